#!/usr/bin/env python3
"""SGLang's facts, read from each release's own source, vendored like the flag dumps.

Two steps, like ``tools/gen_flag_table.py``:

1. ``--from-release VERSION=PATH`` (PATH: the release's wheel, or a folder holding its unpacked
   ``sglang/`` package; ``pip download --no-deps sglang==VERSION``) reads the source and writes
   ``tests/doubles/gpusim/src/gpusim/facts/VERSION.json``: every Prometheus metric (name, type,
   labels, help, multiprocess mode), the code that computes the usage gauges, the startup log
   lines' format strings, the ``/server_info`` ``memory_usage`` keys, the startup constraints of
   ``tools/sglang_facts_spec.yml`` found in the release, the order of the scheduler's start
   (target, draft, pools), and which startup lines the draft's own model runner writes too. Each
   fact carries its provenance: file and line in the release.
   Only this step needs the wheels.
2. Without ``--from-release`` it builds ``plugins/plugin_utils/_releases/sglang_facts.json``, what the
   collection reads (the validator, the advisor, the monitoring), from those vendored files.

``--check`` exits 1 when the committed table (and, in step 1, a vendored file) differs from what
the sources produce, and writes nothing.

Usage::

    tools/gen_sglang_facts.py [--from-release VERSION=PATH ...] [--check]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
SPEC = REPO_ROOT / "tools" / "sglang_facts_spec.yml"
FACTS_DIR = REPO_ROOT / "tests" / "doubles" / "gpusim" / "src" / "gpusim" / "facts"
TABLE = REPO_ROOT / "plugins" / "plugin_utils" / "_releases" / "sglang_facts.json"
VERSION_FILE = re.compile(r"\d+\.\d+\.\d+")
FORMAT = 1

METRIC_FILES = ("sglang/srt/observability/metrics_collector.py", "sglang/srt/metrics/collector.py")
METRIC_CLASSES = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram", "Summary": "summary"}
CONSTRAINT_FILES = re.compile(
    r"sglang/srt/(server_args\.py|arg_groups/[^/]+\.py"
    r"|model_executor/model_runner_kv_cache_mixin\.py|mem_cache/kv_cache_configurator\.py)$"
)
USAGE_FILES = re.compile(
    r"sglang/srt/managers/(scheduler_components/pool_stats_observer|scheduler_metrics_mixin|scheduler)\.py$"
)
LOG_DIRS = re.compile(r"sglang/srt/(managers|model_executor|mem_cache|speculative|entrypoints)/.*\.py$")


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


class Release:
    """The Python files of one release, from its wheel or its unpacked folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._files: dict[str, str] = {}
        if path.is_file():
            with zipfile.ZipFile(path) as wheel:
                for name in wheel.namelist():
                    if name.startswith("sglang/") and name.endswith(".py"):
                        self._files[name] = wheel.read(name).decode("utf-8", errors="replace")
            self.origin = {"wheel": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        else:
            root = path / "sglang"
            if not root.is_dir():
                raise SystemExit(f"{path}: neither a wheel nor a folder holding sglang/")
            for file in sorted(root.rglob("*.py")):
                self._files[file.relative_to(path).as_posix()] = file.read_text(encoding="utf-8", errors="replace")
            self.origin = {"unpacked": path.name}
        self._trees: dict[str, ast.Module | None] = {}

    def files(self, pattern: re.Pattern[str] | None = None) -> Iterator[str]:
        for name in sorted(self._files):
            if pattern is None or pattern.search(name):
                yield name

    def text(self, name: str) -> str | None:
        return self._files.get(name)

    def tree(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            try:
                self._trees[name] = ast.parse(self._files[name])
            except SyntaxError:
                self._trees[name] = None
        return self._trees[name]


def _where(name: str, line: int) -> str:
    return f"{name}:{line}"


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _message(node: ast.AST | None) -> str:
    """An assert's or raise's message as written: strings joined, f-string fields kept as {...}."""
    if node is None:
        return ""
    if isinstance(node, ast.Call) and node.args:
        node = node.args[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(v.value) if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"  # type: ignore[attr-defined]
            for v in node.values
        )
    return ast.unparse(node)


def _statement_text(release: Release, name: str, line: int) -> tuple[int, str]:
    """The whole statement around ``line`` (a call spread over lines), with its first line."""
    tree = release.tree(name)
    text = release.text(name) or ""
    if tree is not None:
        best: ast.stmt | None = None
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt) and not isinstance(
                node,
                (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try),
            ):
                end = node.end_lineno or node.lineno
                if node.lineno <= line <= end and (
                    best is None or end - node.lineno < (best.end_lineno or 0) - best.lineno
                ):
                    best = node
        if best is not None:
            segment = ast.get_source_segment(text, best) or ""
            return best.lineno, segment
    return line, text.splitlines()[line - 1].strip()


def extract_metrics(release: Release) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for name in METRIC_FILES:
        tree = release.tree(name) if release.text(name) is not None else None
        if tree is None:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            kind = METRIC_CLASSES.get(node.func.id)
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            metric = _literal(keywords.get("name"))
            if kind is None or not isinstance(metric, str) or not metric.startswith("sglang:"):
                continue
            record = {
                "type": kind,
                "help": _message(keywords.get("documentation")),
                "labels": ast.unparse(keywords["labelnames"]) if "labelnames" in keywords else None,
                "multiprocess_mode": _literal(keywords.get("multiprocess_mode")),
                "source": _where(name, node.lineno),
            }
            known = metrics.get(metric)
            if known is None:
                metrics[metric] = record
            else:
                known.setdefault("also", []).append(record["source"])
    return dict(sorted(metrics.items()))


def extract_usage_code(release: Release, spec: Mapping[str, list[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gauge, needles in spec.items():
        found = []
        for needle in needles:
            for name in release.files(USAGE_FILES):
                for number, line in enumerate((release.text(name) or "").splitlines(), start=1):
                    if needle in line:
                        found.append({"source": _where(name, number), "code": line.strip()})
            if found:
                break
        out[gauge] = found
    return out


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def token_usage_pools(release: Release, usage: Mapping[str, Any]) -> list[str]:
    """Which pools ``sglang:token_usage`` takes the maximum of, from the code that computes it."""
    pools = []
    for hit in usage.get("token_usage", []):
        name = hit["source"].rsplit(":", 1)[0]
        tree = release.tree(name)
        body = hit["code"]
        if tree is not None and hit["code"].startswith("def "):
            func = _function(tree, hit["code"][4:].split("(")[0])
            if func is not None:
                body = ast.get_source_segment(release.text(name) or "", func) or body
        for pool in ("full_token_usage", "swa_token_usage", "mamba_usage"):
            if pool in body and pool not in pools:
                pools.append(pool)
    return pools


def extract_log_lines(release: Release, spec: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, needle in spec.items():
        hits = []
        for name in release.files(LOG_DIRS):
            text = release.text(name) or ""
            if needle not in text:
                continue
            for number, line in enumerate(text.splitlines(), start=1):
                if needle in line:
                    first, statement = _statement_text(release, name, number)
                    hits.append({"source": _where(name, first), "code": statement})
        out[key] = hits
    return out


def extract_memory_usage(release: Release, key: str) -> dict[str, Any]:
    hits = []
    for name in release.files(re.compile(r"sglang/srt/managers/.*\.py$")):
        tree = release.tree(name)
        if tree is None or key not in (release.text(name) or ""):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if key in keys:
                hits.append({"source": _where(name, node.lineno), "keys": keys})
    return {"dicts": hits}


def extract_constraints(release: Release, specs: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for spec in specs:
        for name in release.files(CONSTRAINT_FILES):
            text = release.text(name) or ""
            if spec["message"] not in text:
                continue
            tree = release.tree(name)
            if tree is None:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Assert):
                    message, condition, error = _message(node.msg), ast.unparse(node.test), "AssertionError"
                elif isinstance(node, ast.Raise):
                    message, condition = _message(node.exc), ""
                    call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                    error = ast.unparse(call) if call is not None else "Exception"
                else:
                    continue
                if spec["message"] in message:
                    found.append(
                        {
                            "id": spec["id"],
                            "error": error,
                            "message": message,
                            "condition": condition,
                            "source": _where(name, node.lineno),
                            "rule": spec["rule"],
                            "fix": " ".join(str(spec["fix"]).split()),
                        }
                    )
    return found


def extract_scheduler_start(release: Release, spec: Mapping[str, str]) -> dict[str, Any]:
    tree = release.tree(spec["file"]) if release.text(spec["file"]) is not None else None
    func = _function(tree, spec["method"]) if tree is not None else None
    if func is None:
        return {"draft_before_target_pools": False, "source": None}
    # In the order they are written (ast.walk goes breadth first).
    found = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    calls = [n.func.attr for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]  # type: ignore[attr-defined]
    draft = calls.index(spec["draft"]) if spec["draft"] in calls else None
    pools = calls.index(spec["pools"]) if spec["pools"] in calls else None
    return {
        "draft_before_target_pools": draft is not None and pools is not None and draft < pools,
        "calls": [c for c in calls if c.startswith(("init_", "maybe_init_"))],
        "source": _where(spec["file"], func.lineno),
    }


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name):
            return node.func.id
        if isinstance(node.func, ast.Attribute):
            return node.func.attr
    return None


def extract_scheduler_port(release: Release, spec: Mapping[str, str]) -> dict[str, Any]:
    """How the release picks each scheduler's ``nccl_port`` when the setting is unset: the function
    it calls (where), and that function's ``low``/``high`` defaults (where it is defined); a range of
    null is the kernel's ephemeral range (a bind to port 0)."""
    tree = release.tree(spec["file"]) if release.text(spec["file"]) is not None else None
    picks = [
        (node.lineno, _call_name(node.value))
        for node in (ast.walk(tree) if tree is not None else ())
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == spec["target"] for t in node.targets)
        and _call_name(node.value)
    ]
    line, name = picks[0] if picks else (0, None)
    if name is None:
        return {"picked_by": None, "source": None, "defined_at": None, "range": None}
    defined_at, bounds = None, None
    for file in release.files(re.compile("^" + re.escape(spec["defined_in"]) + r"(/.*)?\.py$")):
        tree = release.tree(file)
        func = _function(tree, name) if tree is not None else None
        if func is None:
            continue
        defined_at = _where(file, func.lineno)
        args = func.args.args
        with_default = args[len(args) - len(func.args.defaults) :]
        named = dict(zip((a.arg for a in with_default), func.args.defaults, strict=True))
        low, high = _literal(named.get("low")), _literal(named.get("high"))
        bounds = [low, high] if isinstance(low, int) and isinstance(high, int) else None
        break
    return {"picked_by": name, "source": _where(spec["file"], line), "defined_at": defined_at, "range": bounds}


def _draft_guard(release: Release, name: str, line: int, guard: str) -> str | None:
    """The condition around ``line`` that keeps the draft's runner from reaching it: an ``if`` on
    ``guard`` whose branch holding the line is the target's (``if not self.is_draft_worker:`` body,
    or the ``else`` of ``if self.is_draft_worker:``); None when there is none."""
    tree = release.tree(name)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or guard not in ast.unparse(node.test):
            continue
        negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
        branch = node.body if negated else node.orelse
        if any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in branch):
            return f"{_where(name, node.lineno)}: if {ast.unparse(node.test)}"
    return None


def extract_draft_log_lines(release: Release, spec: Mapping[str, Any], log_lines: Mapping[str, Any]) -> dict[str, Any]:
    """Which startup lines the draft's own model runner writes too: where the speculative worker
    builds it, and per line of the spec's list the format strings no draft guard encloses."""
    made = [
        _where(name, number)
        for name in release.files(re.compile(re.escape(spec["made_in"]) + r".*\.py$"))
        for number, text in enumerate((release.text(name) or "").splitlines(), start=1)
        if spec["made_with"] in text
    ]
    lines: dict[str, Any] = {}
    for key in spec["lines"]:
        hits = []
        for hit in log_lines.get(key, []):
            name, _, number = hit["source"].rpartition(":")
            guard = _draft_guard(release, name, int(number), spec["guard"])
            hits.append({"source": hit["source"], "draft_guard": guard})
        if made and any(h["draft_guard"] is None for h in hits):
            lines[key] = hits
    return {"runner_made_at": made, "lines": lines}


def extract(version: str, path: Path, spec: Mapping[str, Any]) -> dict[str, Any]:
    release = Release(path)
    usage = extract_usage_code(release, spec["usage_code"])
    log_lines = extract_log_lines(release, spec["log_lines"])
    return {
        "format": FORMAT,
        "release": version,
        "read_from": release.origin,
        "metrics": extract_metrics(release),
        "usage_code": usage,
        "token_usage_pools": token_usage_pools(release, usage),
        "log_lines": log_lines,
        "memory_usage": extract_memory_usage(release, spec["memory_usage_key"]),
        "constraints": extract_constraints(release, spec["constraints"]),
        "scheduler_start": extract_scheduler_start(release, spec["scheduler_start"]),
        "scheduler_port": extract_scheduler_port(release, spec["scheduler_port"]),
        "draft_log_lines": extract_draft_log_lines(release, spec["draft_runner"], log_lines),
    }


def load_spec(path: Path = SPEC) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_facts(directory: Path = FACTS_DIR) -> dict[str, dict[str, Any]]:
    files = sorted(
        (p for p in directory.glob("*.json") if VERSION_FILE.fullmatch(p.stem)), key=lambda p: version_key(p.stem)
    )
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in files}


def build_table(facts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """What the collection reads, per release, from the vendored facts."""
    releases: dict[str, Any] = {}
    for version, fact in facts.items():
        metrics = fact["metrics"]
        constraints = [
            {k: hit[k] for k in ("id", "error", "message", "source", "rule", "fix")} for hit in fact["constraints"]
        ]
        kv_metric = "sglang:full_token_usage" if "sglang:full_token_usage" in metrics else "sglang:token_usage"
        releases[version] = {
            "kv_usage_metric": kv_metric,
            "token_usage_pools": list(fact["token_usage_pools"]),
            "metrics": {name: m["type"] for name, m in metrics.items()},
            "draft_before_target_pools": bool(fact["scheduler_start"]["draft_before_target_pools"]),
            "draft_log_lines": sorted(fact["draft_log_lines"]["lines"]),
            "memory_usage_keys": sorted({k for d in fact["memory_usage"]["dicts"] for k in d["keys"]}),
            "constraints": constraints,
            "scheduler_port": {k: fact["scheduler_port"][k] for k in ("range", "source", "defined_at")},
            "read_from": fact["read_from"],
        }
    return {
        "format": FORMAT,
        "generated_by": "tools/gen_sglang_facts.py from tests/doubles/gpusim/src/gpusim/facts/",
        "releases": releases,
    }


def stale_rules(facts: Mapping[str, Mapping[str, Any]], spec: Mapping[str, Any]) -> list[str]:
    """Constraints whose rule or fix in a vendored file is not the spec's (the spec was edited
    without regenerating), or that the spec no longer has."""
    rules = {c["id"]: (c["rule"], " ".join(str(c["fix"]).split())) for c in spec["constraints"]}
    return [
        f"{version}: constraint {hit['id']} ({hit['source']})"
        for version, fact in facts.items()
        for hit in fact["constraints"]
        if rules.get(hit["id"]) != (hit["rule"], hit["fix"])
    ]


def dump(data: Any) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def _write_or_check(path: Path, text: str, check: bool) -> bool:
    current = path.read_text(encoding="utf-8") if path.exists() else None
    if current == text:
        return True
    if check:
        print(f"{path} is stale: run tools/gen_sglang_facts.py", file=sys.stderr)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--from-release", action="append", default=[], metavar="VERSION=PATH")
    parser.add_argument("--facts-dir", type=Path, default=FACTS_DIR)
    parser.add_argument("--output", type=Path, default=TABLE)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    spec = load_spec()
    ok = True
    for item in args.from_release:
        version, _, path = item.partition("=")
        if not VERSION_FILE.fullmatch(version) or not path:
            parser.error(f"--from-release expects VERSION=PATH, got {item!r}")
        text = dump(extract(version, Path(path), spec))
        ok = _write_or_check(args.facts_dir / f"{version}.json", text, args.check) and ok
    facts = load_facts(args.facts_dir)
    if not facts:
        print(f"no <version>.json files in {args.facts_dir}", file=sys.stderr)
        return 1
    for stale in stale_rules(facts, spec):
        print(f"{stale}: its rule differs from {SPEC.name}: rerun with --from-release", file=sys.stderr)
        ok = False
    ok = _write_or_check(args.output, dump(build_table(facts)), args.check) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

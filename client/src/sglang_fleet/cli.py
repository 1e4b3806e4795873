"""Command line: ``sglang-fleet generate | verify | sync | control | status``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Any, get_origin

from sglang_fleet import __version__
from sglang_fleet.closedpipe import guarded_stdout
from sglang_fleet.config import (
    S3_CONNECTION_GROUP,
    SETTING,
    SETTINGS,
    ConfigError,
    S3Config,
    Setting,
    build_config,
    load_file,
    normalise_endpoint,
    parse_concurrency,
)
from sglang_fleet.control import CONTROL_POLL_S, EXIT_USAGE
from sglang_fleet.fsutil import atomic_write_json
from sglang_fleet.generate import Generator, load_api_key
from sglang_fleet.ids import ShardSpec
from sglang_fleet.prompts import PromptFileError
from sglang_fleet.s3sync import S3Sync, describe_error, make_client
from sglang_fleet.store import OutputStore, StoreError, running_client_pid
from sglang_fleet.verify import VerifyError, format_report, local_sources, run_verify, s3_sources

log = logging.getLogger("sglang_fleet")


class _TTYAwareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines on a terminal first clear the progress bar they would otherwise run into."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self.stream.isatty():
                self.stream.write("\r\x1b[K")
        except (AttributeError, ValueError):
            pass
        super().emit(record)


def setup_logging(level: str) -> None:
    handler = _TTYAwareHandler(sys.stderr)
    # Under systemd the journal adds its own timestamps.
    fmt = "%(levelname)s %(message)s" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s %(levelname)s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # a bare word is a string


def _kv(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, _json_arg(value)


def _add_setting(container: Any, s: Setting, *, with_default: bool = False, **extra: Any) -> None:
    """The flag of one setting, from the settings table. Without ``with_default`` an absent flag
    reads as None, so that the config file's value (or the default) stands."""
    assert s.flag is not None
    kw: dict[str, Any] = {"dest": s.dest}
    default = s.default if with_default else None
    help_text = s.help
    if not isinstance(s.default, bool | dict | list) and s.default not in (None, MISSING):
        help_text += f" (default: {s.default})"
    if s.value_types == (bool,):
        # A setting that may be None is three-way (None: leave it to the server), so it gets --no-X too.
        kw["action"] = argparse.BooleanOptionalAction if s.optional else "store_const"
        if not s.optional:
            kw["const"] = True
    else:
        (tp, *more) = s.value_types
        if not more and get_origin(tp) is list:
            kw["action"] = "append"
        elif not more and tp in (int, float, Path):
            kw["type"] = tp
        if s.choices:
            kw["choices"] = list(s.choices)
        if s.metavar:
            kw["metavar"] = s.metavar
    kw.update(default=None if default is MISSING else default, help=help_text or None)
    kw.update(extra)
    container.add_argument(s.flag, **kw)


def _add_s3_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(S3_CONNECTION_GROUP)
    for s in SETTINGS:
        if s.group == S3_CONNECTION_GROUP:
            _add_setting(g, s)


def _s3_config(a: argparse.Namespace) -> S3Config:
    """The S3 settings a command's flags give (the others keep their defaults)."""
    given = {s.name: getattr(a, s.dest) for s in SETTINGS if s.section == "s3" and hasattr(a, s.dest)}
    return S3Config(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-fleet", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sglang-fleet {__version__}")
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    parser.add_argument("--log-level", default="INFO", choices=levels)
    # Accepted after the subcommand too, where people tend to put it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, choices=levels)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_parser = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return _add_parser(name, parents=[common], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    g = sub.add_parser("generate", help="send prompts to the endpoints and write completions (resumable)")
    g.add_argument("--config", type=Path, help="YAML or JSON file; flags override it")
    groups: dict[str, Any] = {"": g, "sampling": g.add_argument_group("sampling")}
    # Shortcuts for the commonest keys of the ``sampling`` mapping.
    s = groups["sampling"]
    s.add_argument("--temperature", type=float)
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--max-tokens", type=int)
    s.add_argument("--seed", type=int)
    s.add_argument(
        "--param",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=JSON",
        help="any other request field, e.g. --param 'stop=[\"</answer>\"]' (repeatable)",
    )
    for setting in SETTINGS:
        if setting.flag is not None:
            if setting.group not in groups:
                groups[setting.group] = g.add_argument_group(setting.group)
            _add_setting(groups[setting.group], setting)

    v = sub.add_parser("verify", help="check that every prompt id appears exactly once")
    v.add_argument("--prompts", type=Path, required=True)
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--output", type=Path, action="append", help="output directory (repeatable)")
    _add_setting(src, SETTING["s3.uri"], help="s3://bucket/prefix of the job")
    v.add_argument("--shard", help="check only host shard i/n")
    v.add_argument("--index-only", action="store_true", help="with --s3: read the id indexes, not the shards")
    v.add_argument("--show", type=int, default=20, help="ids to list per problem (default 20)")
    v.add_argument(
        "--in-progress",
        action="store_true",
        help="the job is still running: ids not done yet are not an error (nor an open shard's record being "
        "written), and a shard closed, uploaded or deleted while it is read is read where it went; doubled, "
        "unexpected and damaged records still are",
    )
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_s3_client_args(v)

    y = sub.add_parser("sync", help="upload closed shards now (when no generate is running)")
    y.add_argument("--output", type=Path, required=True)
    _add_setting(y, SETTING["s3.uri"], required=True)
    for name in ("delete_local", "multipart_threshold_mb", "part_size_mb"):
        _add_setting(y, SETTING[f"s3.{name}"], with_default=True)
    _add_s3_client_args(y)

    k = sub.add_parser("control", help="change a running client's concurrency, or pause it")
    k.add_argument("--output", type=Path, help="output directory of the running client")
    k.add_argument("--control-file", type=Path)
    k.add_argument("--concurrency", help="N or auto")
    k.add_argument("--endpoint", help="apply --concurrency to this endpoint only")
    pr = k.add_mutually_exclusive_group()
    pr.add_argument("--pause", action="store_true")
    pr.add_argument("--resume", action="store_true")

    st = sub.add_parser("status", help="print a client's status file")
    st.add_argument("--output", type=Path, required=True)
    st.add_argument("--json", action="store_true")
    return parser


def _generate_overrides(a: argparse.Namespace) -> dict[str, Any]:
    sampling = {
        k: getattr(a, k) for k in ("temperature", "top_p", "top_k", "max_tokens", "seed") if getattr(a, k) is not None
    }
    sampling.update(dict(a.param))
    out: dict[str, Any] = {"sampling": sampling, "reasoning": {}, "s3": {}}
    for s in SETTINGS:
        if s.flag is not None:
            (out[s.section] if s.section else out)[s.name] = getattr(a, s.dest)
    return out


def cmd_generate(a: argparse.Namespace) -> int:
    try:
        file_values = load_file(a.config) if a.config else {}
        cfg = build_config(file_values, _generate_overrides(a))
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_USAGE
    api_key = load_api_key(cfg.api_key_env)
    log.debug("config: %s", json.dumps(cfg.redacted(), default=str))
    return asyncio.run(Generator(cfg, api_key=api_key).run())


def _s3_client(a: argparse.Namespace) -> Any:
    return make_client(_s3_config(a))


def cmd_verify(a: argparse.Namespace) -> int:

    try:
        spec = ShardSpec.parse(a.shard) if a.shard else None
        notes: list[str] = []
        if a.s3_uri:
            try:
                sources = s3_sources(_s3_client(a), a.s3_uri, notes, index_only=a.index_only)
            except Exception as e:
                if isinstance(e, VerifyError | ValueError):
                    raise
                log.error("cannot read %s: %s", a.s3_uri, describe_error(e))
                return 2
        else:
            sources = [s for root in a.output for s in local_sources(root, notes)]
        if spec is not None:
            sources = [s for s in sources if f"-{spec.tag}" in s.name]
        report = run_verify(a.prompts, sources, spec, a.show, in_progress=a.in_progress)
        report.notes.extend(notes)
    except (VerifyError, PromptFileError, ValueError) as e:
        log.error("%s", e)
        return 2
    except OSError as e:
        # Not a file the running job renamed or deleted (those are found where they went): one
        # that cannot be read at all (permissions, the prompts file gone).
        log.error("cannot read: %s", e)
        return 2
    except Exception as e:
        if not a.s3_uri:
            raise
        # S3 closed the connection or stopped answering while a shard was read: no verdict.
        log.error("cannot read %s: %s", a.s3_uri, describe_error(e))
        return 2
    if a.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(format_report(report))
    return 0 if report.exact else 1


def cmd_sync(a: argparse.Namespace) -> int:

    try:
        job = json.loads((a.output / ".state" / "job.json").read_text())
        spec = ShardSpec.parse(job["shard"])
    except (OSError, ValueError, KeyError) as e:
        log.error("%s is not a generate output directory (%s)", a.output, e)
        return 2
    store = OutputStore(a.output, spec)
    try:
        store.open()
    except StoreError as e:
        log.error("%s (a running generate uploads by itself)", e)
        return 5
    try:
        sync = S3Sync(_s3_config(a), store)
        n = sync.sync_once()
    except Exception as e:
        log.error("s3: %s", describe_error(e))
        return 1
    finally:
        store.close()
    print(f"uploaded {n} shard(s); {len(sync.pending())} pending")
    return 0


def cmd_control(a: argparse.Namespace) -> int:

    if a.control_file is None and a.output is None:
        log.error("give --output DIR (or --control-file)")
        return 2
    path = a.control_file or a.output / "control.json"
    try:
        current = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        current = {}
    except OSError as e:
        log.error("cannot read %s: %s", path, e)
        return 2
    if a.concurrency is not None:
        try:
            value = parse_concurrency(a.concurrency)
        except ConfigError as e:
            log.error("%s", e)
            return 2
        if a.endpoint:
            conc = current.get("concurrency")
            conc = dict(conc) if isinstance(conc, dict) else ({"*": conc} if conc is not None else {})
            conc[normalise_endpoint(a.endpoint)] = value
            current["concurrency"] = conc
        else:
            current["concurrency"] = value
    if a.pause:
        current["paused"] = True
    if a.resume:
        current["paused"] = False
    if a.concurrency is not None or a.pause or a.resume:
        atomic_write_json(path, current)
        # Only the process holding the output directory's lock is signalled: a pid left in the
        # lock file by a killed client may now belong to anything.
        pid = running_client_pid(a.output) if a.output else None
        if pid:
            try:
                os.kill(pid, signal.SIGHUP)
                print(f"wrote {path}; signalled pid {pid}")
            except ProcessLookupError:
                print(f"wrote {path}; no client running (it is read at the next start)")
        elif a.output and (a.output / ".state" / "lock").exists():
            print(f"wrote {path}; no client running (it is read at the next start)")
        else:
            print(f"wrote {path}; the client reads it within {CONTROL_POLL_S:g} s")
    print(json.dumps(current, indent=1))
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    path = a.output / "status.json"
    try:
        st = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.error("cannot read %s: %s", path, e)
        return 1
    if a.json:
        print(json.dumps(st, indent=1))
        return 0
    eta = st.get("eta_s")
    print(
        f"{st['state']}: {st['done']}/{st['total']} done, {st['failed_total']} failed, "
        f"{st['requests_per_s']} req/s, {st['completion_tokens_per_s']} tok/s, "
        f"ETA {'?' if eta is None else f'{eta / 3600:.2f} h'}, in flight {st['in_flight']}"
    )
    for url, ep in st.get("endpoints", {}).items():
        print(f"  {url}: {ep['state']}, {ep['in_flight']}/{ep['concurrency']} in flight, errors {ep['errors']}")
        if ep["state"] == "stalled":
            print(f"    STALLED: {ep.get('reason')}")
    if st.get("s3"):
        print(
            f"  s3: {st['s3']['uploaded']} uploaded this run, {st['s3']['pending']} pending, "
            f"last error: {st['s3']['last_error']}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    setup_logging(a.log_level)
    handlers = {
        "generate": cmd_generate,
        "verify": cmd_verify,
        "sync": cmd_sync,
        "control": cmd_control,
        "status": cmd_status,
    }
    with guarded_stdout("sglang-fleet"):
        return handlers[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())

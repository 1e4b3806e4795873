"""Command line: ``sglang-fleet generate | verify | sync | control | status``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from sglang_fleet import __version__
from sglang_fleet.config import (
    ConfigError,
    S3Config,
    build_config,
    load_file,
    normalise_endpoint,
    parse_concurrency,
)
from sglang_fleet.fsutil import atomic_write_json
from sglang_fleet.generate import EXIT_USAGE, Generator, load_api_key
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


def _add_s3_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("S3 connection (credentials: boto3's standard chain)")
    g.add_argument("--s3-endpoint-url", help="S3-compatible store, e.g. http://minio:9000")
    g.add_argument("--s3-region")
    g.add_argument("--s3-profile", help="profile from the shared AWS config")
    g.add_argument("--s3-addressing-style", choices=["path", "virtual", "auto"])


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
    g.add_argument("--prompts", type=Path, help="JSONL: {id?, messages | prompt, params?} per line")
    g.add_argument("--output", type=Path, help="output directory (shards, failures, state)")
    g.add_argument(
        "--endpoint",
        dest="endpoints",
        action="append",
        metavar="URL",
        help="OpenAI-compatible server, e.g. http://127.0.0.1:30000 (repeatable)",
    )
    g.add_argument("--api", choices=["chat", "completions"])
    g.add_argument("--model")
    s = g.add_argument_group("sampling")
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
    s.add_argument(
        "--seed-per-prompt",
        action="store_const",
        const=True,
        help="seed each prompt with seed + a hash of its id (reproducible on any host)",
    )
    r = g.add_argument_group("reasoning")
    r.add_argument("--separate-reasoning", action=argparse.BooleanOptionalAction, default=None)
    r.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    r.add_argument("--reasoning-effort")
    r.add_argument("--split-think-tags", action="store_const", const=True)
    g.add_argument(
        "--include-input", action="store_const", const=True, help="copy each prompt's messages/prompt into its record"
    )
    g.add_argument("--api-key-env", help="environment variable holding the API key (default SGLANG_API_KEY)")
    c = g.add_argument_group("concurrency and retries")
    c.add_argument("--concurrency", help="requests in flight per endpoint: N, or auto (from /server_info)")
    c.add_argument("--concurrency-factor", type=float, help="auto concurrency = server capacity x this")
    c.add_argument("--default-concurrency", type=int, help="auto concurrency when the server does not say")
    c.add_argument("--request-timeout", type=float)
    c.add_argument("--connect-timeout", type=float)
    c.add_argument("--max-attempts", type=int)
    c.add_argument("--backoff-base", type=float)
    c.add_argument("--backoff-max", type=float)
    c.add_argument("--startup-timeout", type=float, help="how long to wait for a first endpoint to be ready")
    c.add_argument("--max-consecutive-failures", type=int)
    o = g.add_argument_group("output")
    o.add_argument("--shard", help="i/n: this host's share of the prompts (numbered from 0)")
    o.add_argument("--shard-records", type=int)
    o.add_argument("--shard-seconds", type=float)
    o.add_argument("--fsync", choices=["always", "interval", "never"])
    o.add_argument("--fsync-interval", type=float)
    o.add_argument("--drain-timeout", type=float, help="on SIGTERM, wait this long for requests in flight")
    o.add_argument("--status-file", type=Path)
    o.add_argument("--status-interval", type=float)
    o.add_argument("--control-file", type=Path)
    o.add_argument("--progress", choices=["auto", "bar", "log", "off"])
    o.add_argument("--progress-interval", type=float)
    o.add_argument(
        "--retry-failed", action="store_const", const=True, help="try the prompts in the failures file again"
    )
    s3 = g.add_argument_group("S3")
    s3.add_argument("--s3", dest="s3_uri", metavar="URI", help="s3://bucket/prefix to upload closed shards to")
    s3.add_argument(
        "--s3-delete-local", action="store_const", const=True, help="delete local shards once S3 holds a verified copy"
    )
    s3.add_argument("--s3-sync-interval", type=float)
    s3.add_argument("--s3-final-sync-timeout", type=float)
    s3.add_argument("--s3-stop-sync-timeout", type=float)
    s3.add_argument("--s3-multipart-threshold-mb", type=int)
    s3.add_argument("--s3-part-size-mb", type=int)
    _add_s3_client_args(g)

    v = sub.add_parser("verify", help="check that every prompt id appears exactly once")
    v.add_argument("--prompts", type=Path, required=True)
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--output", type=Path, action="append", help="output directory (repeatable)")
    src.add_argument("--s3", dest="s3_uri", metavar="URI")
    v.add_argument("--shard", help="check only host shard i/n")
    v.add_argument("--index-only", action="store_true", help="with --s3: read the id indexes, not the shards")
    v.add_argument("--show", type=int, default=20, help="ids to list per problem (default 20)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_s3_client_args(v)

    y = sub.add_parser("sync", help="upload closed shards now (when no generate is running)")
    y.add_argument("--output", type=Path, required=True)
    y.add_argument("--s3", dest="s3_uri", metavar="URI", required=True)
    y.add_argument("--s3-delete-local", action="store_true")
    y.add_argument("--s3-multipart-threshold-mb", type=int, default=64)
    y.add_argument("--s3-part-size-mb", type=int, default=16)
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
    s3: dict[str, Any] = {
        "uri": a.s3_uri,
        "endpoint_url": a.s3_endpoint_url,
        "region": a.s3_region,
        "profile": a.s3_profile,
        "addressing_style": a.s3_addressing_style,
        "delete_local": a.s3_delete_local,
        "sync_interval": a.s3_sync_interval,
        "final_sync_timeout": a.s3_final_sync_timeout,
        "stop_sync_timeout": a.s3_stop_sync_timeout,
        "multipart_threshold_mb": a.s3_multipart_threshold_mb,
        "part_size_mb": a.s3_part_size_mb,
    }
    out: dict[str, Any] = {
        "sampling": sampling,
        "reasoning": {
            "separate": a.separate_reasoning,
            "enable_thinking": a.enable_thinking,
            "effort": a.reasoning_effort,
            "split_think_tags": a.split_think_tags,
        },
        "s3": s3,
    }
    for key in (
        "prompts",
        "output",
        "endpoints",
        "api",
        "model",
        "seed_per_prompt",
        "include_input",
        "api_key_env",
        "concurrency",
        "concurrency_factor",
        "default_concurrency",
        "request_timeout",
        "connect_timeout",
        "max_attempts",
        "backoff_base",
        "backoff_max",
        "startup_timeout",
        "max_consecutive_failures",
        "shard",
        "shard_records",
        "shard_seconds",
        "fsync",
        "fsync_interval",
        "drain_timeout",
        "status_file",
        "status_interval",
        "control_file",
        "progress",
        "progress_interval",
        "retry_failed",
    ):
        out[key] = getattr(a, key)
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
    return make_client(
        S3Config(
            uri=a.s3_uri,
            endpoint_url=a.s3_endpoint_url,
            region=a.s3_region,
            profile=a.s3_profile,
            addressing_style=a.s3_addressing_style,
        )
    )


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
        report = run_verify(a.prompts, sources, spec, a.show)
        report.notes.extend(notes)
    except (VerifyError, PromptFileError, ValueError) as e:
        log.error("%s", e)
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
        cfg = S3Config(
            uri=a.s3_uri,
            endpoint_url=a.s3_endpoint_url,
            region=a.s3_region,
            profile=a.s3_profile,
            addressing_style=a.s3_addressing_style,
            delete_local=a.s3_delete_local,
            multipart_threshold_mb=a.s3_multipart_threshold_mb,
            part_size_mb=a.s3_part_size_mb,
        )
        sync = S3Sync(cfg, store)
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
        current = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        current = {}
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
            print(f"wrote {path}; the client reads it within 2 s")
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
    return handlers[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())

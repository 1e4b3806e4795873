"""Configuration of ``sglang-fleet generate``: defaults, then the config file, then flags.

The config file is YAML (needs PyYAML: ``pip install 'sglang-fleet[yaml]'``) or JSON (any ``.json``
file, or YAML-free hosts). Its keys are the long flag names with ``_`` for ``-``, plus the nested
``sampling``, ``reasoning``, ``extra_body`` and ``s3`` mappings. Unknown keys are errors, so that a
typo never silently falls back to a default.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, get_args, get_type_hints

from sglang_fleet.backoff import Backoff
from sglang_fleet.httpclient import split_base_url
from sglang_fleet.ids import ShardSpec
from sglang_fleet.store import FSYNC_POLICIES


class ConfigError(Exception):
    pass


# The settings are defined once, here: each field's name, type and default, and in its metadata
# (``doc``) the help text and the command-line flag. ``SETTINGS`` (below) lists them as a table; the CLI
# derives its options from it, and a test checks the generation role's variables against it.
_META_HELP = "help"
_META_GROUP = "group"  # argument group of the flag in ``sglang-fleet generate --help``
_META_FLAG = "flag"  # absent: derived from the name; None: config file only
_META_METAVAR = "metavar"
_META_CHOICES = "choices"


def doc(
    help: str,
    *,
    group: str = "",
    flag: str | None = "",
    metavar: str | None = None,
    choices: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A setting's field metadata. ``flag``: "" derives it from the name, None means the setting is
    read from the config file only."""
    meta: dict[str, Any] = {_META_HELP: help, _META_GROUP: group, _META_METAVAR: metavar, _META_CHOICES: choices}
    if flag != "":
        meta[_META_FLAG] = flag
    return meta


_REASONING_GROUP = "reasoning"
_S3_GROUP = "S3"
# The flags that verify and sync take too.
S3_CONNECTION_GROUP = "S3 connection (credentials: boto3's standard chain)"


@dataclass
class ReasoningConfig:
    separate: bool | None = field(
        default=None,
        metadata=doc(
            "SGLang's separate_reasoning: reasoning in reasoning_content (needs the server's --reasoning-parser)",
            group=_REASONING_GROUP,
            flag="--separate-reasoning",
        ),
    )
    enable_thinking: bool | None = field(
        default=None,
        metadata=doc(
            "chat_template_kwargs.enable_thinking (Qwen3, DeepSeek-V3.1 style templates)", group=_REASONING_GROUP
        ),
    )
    effort: str | None = field(
        default=None,
        metadata=doc(
            "reasoning_effort (gpt-oss style): low, medium, high", group=_REASONING_GROUP, flag="--reasoning-effort"
        ),
    )
    split_think_tags: bool = field(
        default=False,
        metadata=doc(
            "split <think>...</think> off the text when the server returns no reasoning_content", group=_REASONING_GROUP
        ),
    )


@dataclass
class S3Config:
    uri: str = field(
        metadata=doc("s3://bucket/prefix to upload closed shards to", group=_S3_GROUP, flag="--s3", metavar="URI")
    )
    endpoint_url: str | None = field(
        default=None,
        metadata=doc("S3-compatible store, e.g. http://minio:9000 (path addressing then)", group=S3_CONNECTION_GROUP),
    )
    region: str | None = field(
        default=None, metadata=doc("S3 region (default: boto3's chain)", group=S3_CONNECTION_GROUP)
    )
    profile: str | None = field(
        default=None, metadata=doc("profile from the shared AWS config", group=S3_CONNECTION_GROUP)
    )
    addressing_style: str | None = field(
        default=None,
        metadata=doc(
            "bucket addressing (default: path with an endpoint URL, else auto)",
            group=S3_CONNECTION_GROUP,
            choices=("path", "virtual", "auto"),
        ),
    )
    delete_local: bool = field(
        default=False, metadata=doc("delete local shards once S3 holds a verified copy", group=_S3_GROUP)
    )
    multipart_threshold_mb: int = field(
        default=64, metadata=doc("shards this big or bigger go up in parts", group=_S3_GROUP)
    )
    part_size_mb: int = field(default=16, metadata=doc("size of a multipart upload's parts", group=_S3_GROUP))
    sync_interval: float = field(
        default=30.0, metadata=doc("seconds between upload passes (a closed shard starts one at once)", group=_S3_GROUP)
    )
    final_sync_timeout: float = field(
        default=0.0,
        metadata=doc(
            "at the end of the job, seconds to keep uploading; 0: until everything is uploaded", group=_S3_GROUP
        ),
    )
    stop_sync_timeout: float = field(
        default=10.0,
        metadata=doc("on SIGTERM, seconds to keep uploading; the rest goes at the next start", group=_S3_GROUP),
    )
    verify_etag: bool = field(
        default=True, metadata=doc("off for SSE-KMS/SSE-C stores, whose ETags are not MD5s", flag=None)
    )
    checksum: str | None = field(
        default=None,
        metadata=doc("botocore request_checksum_calculation", flag=None, choices=("when_supported", "when_required")),
    )
    storage_class: str | None = field(default=None, metadata=doc("storage class of the uploaded objects", flag=None))


_CONCURRENCY_GROUP = "concurrency and retries"
_OUTPUT_GROUP = "output"
_CONTROL_GROUP = "control"


@dataclass
class GenerateConfig:
    prompts: Path = field(metadata=doc("JSONL: {id?, messages | prompt, params?} per line"))
    output: Path = field(metadata=doc("output directory (shards, failures, state)"))
    endpoints: list[str] = field(
        metadata=doc(
            "OpenAI-compatible server, e.g. http://127.0.0.1:30000 (repeatable)", flag="--endpoint", metavar="URL"
        )
    )
    api: str = field(
        default="chat",
        metadata=doc("chat: /v1/chat/completions; completions: /v1/completions", choices=("chat", "completions")),
    )
    model: str = field(default="default", metadata=doc("the model field of each request"))
    sampling: dict[str, Any] = field(
        default_factory=dict, metadata=doc("request fields such as temperature, top_p, max_tokens, seed", flag=None)
    )
    reasoning: ReasoningConfig = field(default_factory=ReasoningConfig, metadata=doc("reasoning options", flag=None))
    extra_body: dict[str, Any] = field(
        default_factory=dict, metadata=doc("any other request fields, merged last", flag=None)
    )
    seed_per_prompt: bool = field(
        default=False,
        metadata=doc("seed each prompt with seed + a hash of its id (reproducible on any host)", group="sampling"),
    )
    include_input: bool = field(default=False, metadata=doc("copy each prompt's messages/prompt into its record"))
    api_key_env: str = field(default="SGLANG_API_KEY", metadata=doc("environment variable holding the API key"))
    concurrency: int | str | dict[str, int | str] = field(
        default="auto",
        metadata=doc("requests in flight per endpoint: N, or auto (from /server_info)", group=_CONCURRENCY_GROUP),
    )
    # Above 1, a few requests wait at each server: a slot freed by a finished request is refilled at
    # the server's next step, not a round trip later, so the server stays at its max running requests.
    concurrency_factor: float = field(
        default=1.25, metadata=doc("auto concurrency = server capacity x this (rounded up)", group=_CONCURRENCY_GROUP)
    )
    default_concurrency: int = field(
        default=32, metadata=doc("auto concurrency when the server does not say", group=_CONCURRENCY_GROUP)
    )
    request_timeout: float = field(
        default=3600.0,
        metadata=doc("seconds one request may take before it counts as a failed attempt", group=_CONCURRENCY_GROUP),
    )
    # A server can accept requests and stop producing, /health still 200 (after a relaunch on the same
    # port, after hours of load): without this, each request sent there waits request_timeout.
    stall_factor: float = field(
        default=4.0,
        metadata=doc(
            "an endpoint that completes nothing for this many times its longest recent request, while the others "
            "complete, is stalled: its requests go elsewhere until a probe completes there; 0: never",
            group=_CONCURRENCY_GROUP,
        ),
    )
    stall_min_s: float = field(
        default=60.0,
        metadata=doc("the shortest silence that counts as a stall, seconds", group=_CONCURRENCY_GROUP),
    )
    connect_timeout: float = field(
        default=10.0, metadata=doc("seconds to open a connection to an endpoint", group=_CONCURRENCY_GROUP)
    )
    max_attempts: int = field(
        default=4,
        metadata=doc("attempts per prompt for timeouts, 5xx and unreadable answers", group=_CONCURRENCY_GROUP),
    )
    backoff_base: float = field(
        default=1.0,
        metadata=doc(
            "first retry delay of a request, seconds; doubles with each failure (with jitter)", group=_CONCURRENCY_GROUP
        ),
    )
    backoff_max: float = field(
        default=60.0,
        metadata=doc("the longest wait of any backoff: retries, health probes, S3", group=_CONCURRENCY_GROUP),
    )
    startup_timeout: float = field(
        default=600.0, metadata=doc("how long to wait for a first endpoint to be ready", group=_CONCURRENCY_GROUP)
    )
    max_consecutive_failures: int = field(
        default=50,
        metadata=doc(
            "stop (exit 4) after this many prompts fail for good in a row; 0: never", group=_CONCURRENCY_GROUP
        ),
    )
    shard: ShardSpec = field(
        default_factory=lambda: ShardSpec(0, 1),
        metadata=doc("i/n: this host's share of the prompts (numbered from 0)", group=_OUTPUT_GROUP),
    )
    shard_records: int = field(
        default=10_000, metadata=doc("close a shard after this many records", group=_OUTPUT_GROUP)
    )
    shard_seconds: float = field(
        default=600.0, metadata=doc("... or this many seconds after its first record", group=_OUTPUT_GROUP)
    )
    fsync: str = field(
        default="interval", metadata=doc("when records are forced to disk", group=_OUTPUT_GROUP, choices=FSYNC_POLICIES)
    )
    fsync_interval: float = field(
        default=1.0, metadata=doc("seconds between fsyncs with --fsync interval", group=_OUTPUT_GROUP)
    )
    drain_timeout: float = field(
        default=60.0, metadata=doc("on SIGTERM, wait this long for requests in flight", group=_OUTPUT_GROUP)
    )
    status_interval: float = field(
        default=5.0, metadata=doc("seconds between rewrites of the status file", group=_OUTPUT_GROUP)
    )
    progress: str = field(
        default="auto",
        metadata=doc(
            "auto: a bar on a terminal, a log line otherwise",
            group=_OUTPUT_GROUP,
            choices=("auto", "bar", "log", "off"),
        ),
    )
    progress_interval: float = field(
        default=30.0, metadata=doc("seconds between progress log lines", group=_OUTPUT_GROUP)
    )
    retry_failed: bool = field(
        default=False, metadata=doc("try the prompts in the failures file again", group=_OUTPUT_GROUP)
    )
    control_file: Path | None = field(default=None, metadata=doc("default: OUTPUT/control.json", group=_OUTPUT_GROUP))
    status_file: Path | None = field(default=None, metadata=doc("default: OUTPUT/status.json", group=_OUTPUT_GROUP))
    control_socket: str = field(
        default="",
        metadata=doc(
            "Unix socket (0600) through which a retune drains and resumes endpoints; empty: none",
            group=_CONTROL_GROUP,
            metavar="PATH",
        ),
    )
    endpoint_log: str = field(
        default="",
        metadata=doc(
            "append one JSON line per endpoint state change (up, down, drained, resumed, capacity); empty: none",
            group=_CONTROL_GROUP,
            metavar="PATH",
        ),
    )
    s3: S3Config | None = field(default=None, metadata=doc("upload closed shards (see the s3.* settings)", flag=None))

    def backoff(self, base: float | None = None) -> Backoff:
        """The retry schedule of one kind of wait. A wait may start from its own base, but its cap is
        always ``backoff_max``."""
        return Backoff(self.backoff_base if base is None else base, self.backoff_max)

    @property
    def control_path(self) -> Path:
        return self.control_file or self.output / "control.json"

    @property
    def status_path(self) -> Path:
        return self.status_file or self.output / "status.json"

    def redacted(self) -> dict[str, Any]:
        """What may be logged: the config has no secrets (the API key lives in the environment),
        but extra_body could hold anything, so only its keys are shown."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "extra_body":
                v = sorted(v)
            elif f.name in ("reasoning", "s3") and v is not None:
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            elif isinstance(v, Path | ShardSpec):
                v = str(v)
            out[f.name] = v
        return out


@dataclass(frozen=True)
class Setting:
    """One row of the settings table: a config-file key, and its flag when it has one."""

    section: str  # "" for a top-level key, else the nested mapping it belongs to ("reasoning", "s3")
    name: str
    type: Any  # the resolved annotation
    default: Any  # dataclasses.MISSING when the setting is required
    help: str
    group: str
    flag: str | None
    metavar: str | None
    choices: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def dest(self) -> str:
        """Attribute name of the flag's value in the parsed arguments."""
        return f"{self.section}_{self.name}" if self.section else self.name

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def _union(self) -> tuple[Any, ...]:
        return get_args(self.type) if isinstance(self.type, UnionType) else (self.type,)

    @property
    def value_types(self) -> tuple[Any, ...]:
        """The annotation's types without ``None`` (which means "not set")."""
        return tuple(t for t in self._union if t is not NoneType)

    @property
    def optional(self) -> bool:
        return NoneType in self._union


def _rows(cls: type, section: str) -> list[Setting]:
    hints = get_type_hints(cls)
    rows = []
    for f in fields(cls):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        m = f.metadata
        # S3 flags are --s3-NAME: verify and sync take some of them next to flags of their own.
        flag = m.get(_META_FLAG, "--" + ("s3-" if section == "s3" else "") + f.name.replace("_", "-"))
        rows.append(
            Setting(
                section,
                f.name,
                hints[f.name],
                default,
                m[_META_HELP],
                m[_META_GROUP],
                flag,
                m[_META_METAVAR],
                tuple(m[_META_CHOICES]),
            )
        )
    return rows


SETTINGS: tuple[Setting, ...] = (
    *_rows(GenerateConfig, ""),
    *_rows(ReasoningConfig, "reasoning"),
    *_rows(S3Config, "s3"),
)
SETTING = {s.key: s for s in SETTINGS}


def load_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
    else:
        try:
            import yaml  # noqa: PLC0415  (optional dependency)
        except ImportError:
            try:
                data = json.loads(text)
            except ValueError:
                raise ConfigError(
                    f"{path}: YAML config needs PyYAML (pip install 'sglang-fleet[yaml]'); or write the config as JSON"
                ) from None
        else:
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    return data


_TOP = {f.name for f in fields(GenerateConfig)} | {"endpoint"}
_REASONING = {f.name for f in fields(ReasoningConfig)}
_S3 = {f.name for f in fields(S3Config)}


# Where the config file and the flags leave them unset, these come from the environment, so that a
# deployment can keep the bucket and the store's address out of world-readable files.
S3_ENV = {
    "uri": "SGLANG_FLEET_S3_URI",
    "endpoint_url": "SGLANG_FLEET_S3_ENDPOINT_URL",
    "region": "SGLANG_FLEET_S3_REGION",
}


def build_config(
    file_values: dict[str, Any], overrides: dict[str, Any], environ: Mapping[str, str] | None = None
) -> GenerateConfig:
    """Merge config-file values with command-line overrides (``None`` = not given), then the S3
    environment variables, and validate."""
    values = dict(file_values)
    unknown = set(values) - _TOP
    if unknown:
        raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
    if "endpoint" in values:
        values.setdefault("endpoints", values.pop("endpoint"))
    for nested in ("sampling", "extra_body"):
        base = dict(values.get(nested) or {})
        base.update(overrides.pop(nested, None) or {})
        values[nested] = base
    reasoning = dict(values.get("reasoning") or {})
    reasoning.update({k: v for k, v in (overrides.pop("reasoning", None) or {}).items() if v is not None})
    s3 = values.get("s3")
    s3 = dict(s3) if isinstance(s3, dict) else ({"uri": s3} if isinstance(s3, str) else {})
    s3.update({k: v for k, v in (overrides.pop("s3", None) or {}).items() if v is not None})
    env = os.environ if environ is None else environ
    for key, var in S3_ENV.items():
        if s3.get(key) is None and env.get(var):
            s3[key] = env[var]
    for k, v in overrides.items():
        if v is not None:
            values[k] = v

    if set(reasoning) - _REASONING:
        raise ConfigError(f"unknown reasoning keys: {', '.join(sorted(set(reasoning) - _REASONING))}")
    if set(s3) - _S3:
        raise ConfigError(f"unknown s3 keys: {', '.join(sorted(set(s3) - _S3))}")
    values["reasoning"] = ReasoningConfig(**reasoning)
    if s3:
        if not s3.get("uri"):
            raise ConfigError("s3 settings need s3.uri (s3://bucket/prefix)")
        values["s3"] = S3Config(**s3)
    else:
        values["s3"] = None

    for key in ("prompts", "output"):
        if not values.get(key):
            raise ConfigError(f"missing {key} (--{key} or '{key}:' in the config)")
        values[key] = Path(values[key]).expanduser()
    for key in ("control_file", "status_file"):
        if values.get(key):
            values[key] = Path(values[key]).expanduser()
    eps = values.get("endpoints") or []
    if isinstance(eps, str):
        eps = [eps]
    if not eps:
        raise ConfigError("no endpoint: give --endpoint URL (repeatable) or 'endpoints:' in the config")
    values["endpoints"] = [normalise_endpoint(str(e)) for e in eps]
    if isinstance(values.get("shard"), str):
        try:
            values["shard"] = ShardSpec.parse(values["shard"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        cfg = GenerateConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    validate(cfg)
    return cfg


def normalise_endpoint(url: str) -> str:
    """``http://h:30000/v1/`` and ``http://h:30000`` name the same server; paths are added here."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    try:
        split_base_url(url)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return url


_SOCKET_PATH_MAX = 107  # sockaddr_un.sun_path less its terminating NUL (Linux)


def _positive(name: str, v: float, *, allow_zero: bool = False) -> None:
    if not isinstance(v, int | float) or isinstance(v, bool) or math.isnan(v) or v < 0 or (v == 0 and not allow_zero):
        raise ConfigError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {v!r}")


def parse_concurrency(v: Any, name: str = "concurrency") -> int | str:
    if v == "auto":
        return "auto"
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return v
    raise ConfigError(f"{name} must be 'auto' or an integer >= 1, got {v!r}")


def validate(cfg: GenerateConfig) -> None:
    for s in SETTINGS:
        if not s.choices:
            continue
        owner = cfg if not s.section else getattr(cfg, s.section)
        if owner is None:
            continue
        value = getattr(owner, s.name)
        if value not in s.choices and not (value is None and s.optional):
            raise ConfigError(f"{s.key} must be one of {', '.join(s.choices)}, got {value!r}")
    if isinstance(cfg.concurrency, dict):
        cfg.concurrency = {
            (k if k == "*" else normalise_endpoint(str(k))): parse_concurrency(v, f"concurrency[{k}]")
            for k, v in cfg.concurrency.items()
        }
    else:
        cfg.concurrency = parse_concurrency(cfg.concurrency)
    for name in (
        "concurrency_factor",
        "request_timeout",
        "connect_timeout",
        "backoff_base",
        "backoff_max",
        "shard_seconds",
        "stall_min_s",
        "fsync_interval",
        "status_interval",
        "progress_interval",
    ):
        _positive(name, getattr(cfg, name))
    for name in ("startup_timeout", "drain_timeout", "stall_factor"):
        _positive(name, getattr(cfg, name), allow_zero=True)
    for name in ("max_attempts", "shard_records", "default_concurrency"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    if not isinstance(cfg.max_consecutive_failures, int) or cfg.max_consecutive_failures < 0:
        raise ConfigError("max_consecutive_failures must be an integer >= 0 (0 = never stop)")
    if not isinstance(cfg.sampling, dict) or not isinstance(cfg.extra_body, dict):
        raise ConfigError("sampling and extra_body must be mappings")
    for name in ("control_socket", "endpoint_log"):
        if not isinstance(getattr(cfg, name), str):
            raise ConfigError(f"{name} must be a path (a string), got {getattr(cfg, name)!r}")
    if len(os.fsencode(os.path.expanduser(cfg.control_socket))) > _SOCKET_PATH_MAX:
        raise ConfigError(f"control_socket is longer than a Unix socket path may be ({_SOCKET_PATH_MAX} bytes)")
    if cfg.reasoning.effort is not None and not isinstance(cfg.reasoning.effort, str):
        raise ConfigError("reasoning.effort must be a string")
    if cfg.s3 is not None:
        if not cfg.s3.uri.startswith("s3://"):
            raise ConfigError(f"s3.uri must look like s3://bucket/prefix, got {cfg.s3.uri!r}")
        if cfg.s3.multipart_threshold_mb < 5 or cfg.s3.part_size_mb < 5:
            raise ConfigError("S3 multipart sizes must be at least 5 MB (S3's smallest part)")

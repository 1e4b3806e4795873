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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sglang_fleet.httpclient import split_base_url
from sglang_fleet.ids import ShardSpec
from sglang_fleet.store import FSYNC_POLICIES


class ConfigError(Exception):
    pass


@dataclass
class ReasoningConfig:
    # SGLang's ``separate_reasoning`` request field: reasoning comes back in ``reasoning_content``
    # (needs the server's --reasoning-parser).
    separate: bool | None = None
    # Passed as ``chat_template_kwargs.enable_thinking`` (Qwen3, DeepSeek-V3.1 style templates).
    enable_thinking: bool | None = None
    # ``reasoning_effort`` (gpt-oss style): low, medium, high.
    effort: str | None = None
    # When the server returns no ``reasoning_content``, split ``<think>...</think>`` off the text.
    split_think_tags: bool = False


@dataclass
class S3Config:
    uri: str
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str | None = None  # path | virtual | auto; path when endpoint_url is set
    delete_local: bool = False
    multipart_threshold_mb: int = 64
    part_size_mb: int = 16
    sync_interval: float = 30.0
    final_sync_timeout: float = 0.0  # at the end of the job: 0 = until everything is uploaded
    stop_sync_timeout: float = 10.0  # on SIGTERM: try this long, the rest goes at the next start
    verify_etag: bool = True  # off for SSE-KMS/SSE-C stores, whose ETags are not MD5s
    checksum: str | None = None  # botocore request_checksum_calculation: when_supported | when_required
    storage_class: str | None = None


@dataclass
class GenerateConfig:
    prompts: Path
    output: Path
    endpoints: list[str]
    api: str = "chat"
    model: str = "default"
    sampling: dict[str, Any] = field(default_factory=dict)
    reasoning: ReasoningConfig = field(default_factory=ReasoningConfig)
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed_per_prompt: bool = False
    include_input: bool = False
    api_key_env: str = "SGLANG_API_KEY"
    concurrency: int | str | dict[str, int | str] = "auto"
    concurrency_factor: float = 1.0
    default_concurrency: int = 32
    request_timeout: float = 3600.0
    connect_timeout: float = 10.0
    max_attempts: int = 4
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    startup_timeout: float = 600.0
    max_consecutive_failures: int = 50
    shard: ShardSpec = field(default_factory=lambda: ShardSpec(0, 1))
    shard_records: int = 10_000
    shard_seconds: float = 600.0
    fsync: str = "interval"
    fsync_interval: float = 1.0
    drain_timeout: float = 60.0
    status_interval: float = 5.0
    progress: str = "auto"
    progress_interval: float = 30.0
    retry_failed: bool = False
    control_file: Path | None = None
    status_file: Path | None = None
    s3: S3Config | None = None

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
    if cfg.api not in ("chat", "completions"):
        raise ConfigError(f"api must be 'chat' or 'completions', got {cfg.api!r}")
    if cfg.fsync not in FSYNC_POLICIES:
        raise ConfigError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}")
    if cfg.progress not in ("auto", "bar", "log", "off"):
        raise ConfigError("progress must be auto, bar, log or off")
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
        "fsync_interval",
        "status_interval",
        "progress_interval",
    ):
        _positive(name, getattr(cfg, name))
    for name in ("startup_timeout", "drain_timeout"):
        _positive(name, getattr(cfg, name), allow_zero=True)
    for name in ("max_attempts", "shard_records", "default_concurrency"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    if not isinstance(cfg.max_consecutive_failures, int) or cfg.max_consecutive_failures < 0:
        raise ConfigError("max_consecutive_failures must be an integer >= 0 (0 = never stop)")
    if not isinstance(cfg.sampling, dict) or not isinstance(cfg.extra_body, dict):
        raise ConfigError("sampling and extra_body must be mappings")
    if cfg.reasoning.effort is not None and not isinstance(cfg.reasoning.effort, str):
        raise ConfigError("reasoning.effort must be a string")
    if cfg.s3 is not None:
        if not cfg.s3.uri.startswith("s3://"):
            raise ConfigError(f"s3.uri must look like s3://bucket/prefix, got {cfg.s3.uri!r}")
        if cfg.s3.multipart_threshold_mb < 5 or cfg.s3.part_size_mb < 5:
            raise ConfigError("S3 multipart sizes must be at least 5 MB (S3's smallest part)")
        if cfg.s3.addressing_style not in (None, "path", "virtual", "auto"):
            raise ConfigError("s3.addressing_style must be path, virtual or auto")
        if cfg.s3.checksum not in (None, "when_supported", "when_required"):
            raise ConfigError("s3.checksum must be when_supported or when_required")

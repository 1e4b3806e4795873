from __future__ import annotations

from pathlib import Path

import pytest

from sglang_fleet.config import ConfigError, build_config, load_file
from sglang_fleet.ids import ShardSpec

BASE = {"prompts": "p.jsonl", "output": "out", "endpoints": ["http://h:1/v1/"]}


def test_flags_override_file_and_nested_values_merge(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "prompts: p.jsonl\noutput: out\nendpoint: http://a:30000\nsampling: {temperature: 0.5, max_tokens: 9}\n"
        "reasoning: {separate: true}\ns3: s3://bucket/prefix\nshard: 1/4\nconcurrency: 16\n"
    )
    cfg = build_config(
        load_file(f),
        {
            "sampling": {"max_tokens": 100},
            "reasoning": {"separate": None},
            "s3": {"delete_local": True},
            "concurrency": None,
            "drain_timeout": 5.0,
        },
    )
    assert cfg.sampling == {"temperature": 0.5, "max_tokens": 100}
    assert cfg.reasoning.separate is True
    assert cfg.s3 is not None and cfg.s3.uri == "s3://bucket/prefix" and cfg.s3.delete_local
    assert cfg.shard == ShardSpec(1, 4)
    assert cfg.concurrency == 16
    assert cfg.drain_timeout == 5.0
    assert cfg.endpoints == ["http://a:30000"]


def test_json_config_and_endpoint_normalisation(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text(
        '{"prompts": "p", "output": "o", "endpoints": ["http://h:1/v1", "http://g:2/"],'
        ' "concurrency": {"http://h:1/v1": 4, "*": "auto"}}'
    )
    cfg = build_config(load_file(f), {})
    assert cfg.endpoints == ["http://h:1", "http://g:2"]
    assert cfg.concurrency == {"http://h:1": 4, "*": "auto"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tempature": 1}, "unknown config keys: tempature"),
        ({"reasoning": {"seperate": True}}, "unknown reasoning keys"),
        ({"s3": {"url": "x"}}, "unknown s3 keys"),
        ({"s3": {"uri": "http://x"}}, "s3.uri must look like"),
        ({"s3": {"uri": "s3://b", "part_size_mb": 1}}, "at least 5 MB"),
        ({"endpoints": []}, "no endpoint"),
        ({"endpoints": ["http://u:p@h:1"]}, "must not carry credentials"),
        ({"api": "responses"}, "api must be"),
        ({"concurrency": 0}, "concurrency must be"),
        ({"concurrency": "lots"}, "concurrency must be"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"request_timeout": -1}, "request_timeout"),
        ({"shard": "4/4"}, "0 <= i < n"),
        ({"fsync": "sometimes"}, "fsync must be"),
    ],
)
def test_bad_values(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config({**BASE, **extra}, {})


def test_missing_required() -> None:
    with pytest.raises(ConfigError, match="missing prompts"):
        build_config({"output": "o", "endpoints": ["http://h:1"]}, {})


def test_bad_files(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_file(tmp_path / "a.json")
    (tmp_path / "b.yaml").write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_file(tmp_path / "b.yaml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_file(tmp_path / "missing.yaml")


def test_redacted_shows_extra_body_keys_only() -> None:
    cfg = build_config({**BASE, "extra_body": {"secret_thing": "value-123"}}, {})
    text = str(cfg.redacted())
    assert "secret_thing" in text and "value-123" not in text


def test_s3_location_from_the_environment_when_not_configured() -> None:
    env = {"SGLANG_FLEET_S3_URI": "s3://env-bucket/p", "SGLANG_FLEET_S3_ENDPOINT_URL": "http://minio:9000"}
    cfg = build_config({**BASE, "s3": {"delete_local": True}}, {}, environ=env)
    assert cfg.s3 is not None
    assert (cfg.s3.uri, cfg.s3.endpoint_url, cfg.s3.delete_local) == ("s3://env-bucket/p", "http://minio:9000", True)
    cfg = build_config({**BASE, "s3": "s3://file-bucket/p"}, {}, environ=env)
    assert cfg.s3 is not None and cfg.s3.uri == "s3://file-bucket/p"  # the file wins
    assert build_config(BASE, {}, environ={}).s3 is None

"""Every filter has documentation of its own where ansible-doc finds it: the DOCUMENTATION of its
file when the file holds that one filter, otherwise a YAML file named after it beside the code."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import yaml

FILTERS = Path(__file__).resolve().parents[4] / "plugins" / "filter"


def filters_by_file() -> dict[str, list[str]]:
    out = {}
    for path in sorted(FILTERS.glob("*.py")):
        module = importlib.import_module(f"ansible_collections.sglang_ops.fleet.plugins.filter.{path.stem}")
        out[path.name] = sorted(module.FilterModule().filters())
    return out


def test_every_filter_is_documented_under_its_own_name() -> None:
    names_seen = []
    for file, names in filters_by_file().items():
        source = (FILTERS / file).read_text(encoding="utf-8")
        embedded = re.search(r'DOCUMENTATION = r"""\n(.*?)"""', source, re.S)
        for name in names:
            sidecar = FILTERS / f"{name}.yml"
            if sidecar.exists():
                doc = yaml.safe_load(sidecar.read_text(encoding="utf-8"))["DOCUMENTATION"]
            else:
                assert embedded and len(names) == 1, f"{name} ({file}) has no documentation of its own"
                doc = yaml.safe_load(embedded.group(1))
            assert doc["name"] == name
            names_seen.append(doc["short_description"])
    assert len(names_seen) == len(set(names_seen)), "two filters share a description"

"""The simulator against the golden startup journals (tests/unit/fixtures/journals, written from
each release's source): for each journal's setting, the lines the simulator's worker writes
(gpusim/startup.py, through simulated_instance) are the journal's, in its order and in its
release's format, and size the same pools. The collection is never tested against the simulator
alone: this keeps the simulator, which the Molecule scenarios and the demo run, on the releases'
facts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from simulated_instance import simulate

REPO_ROOT = Path(__file__).resolve().parents[4]
JOURNALS = REPO_ROOT / "tests" / "unit" / "fixtures" / "journals"
# The scheduler's lines the collection reads (the HTTP server's "fired up" is not the scheduler's).
PARSED = (
    "Load weight begin",
    "Load weight end",
    "Mamba Cache is allocated",
    "KV Cache is allocated",
    "max_total_num_tokens=",
    "max_running_requests is capped",
    "max_running_requests was reduced",
)
_STAMP = re.compile(r"^\[[^\]]+\] ")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def parsed(lines: list[str]) -> list[str]:
    return [_STAMP.sub("", line) for line in lines if any(text in line for text in PARSED)]


def shape(line: str) -> str:
    """A line with its figures masked: what the release's format string fixes."""
    return _NUMBER.sub("N", line)


def golden(name: str) -> dict[str, Any]:
    return yaml.safe_load((JOURNALS / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(p.name for p in JOURNALS.glob("*.yml")))
def test_the_simulator_writes_each_golden_journals_lines_in_its_order_and_format(name: str) -> None:
    journal = golden(name)
    written, _info, plan, _mib = simulate(
        dict(journal["args"]), float(journal["mem_fraction_static"]), release=journal["release"]
    )
    expected = parsed([entry["line"] for entry in journal["lines"]])
    assert [shape(line) for line in parsed(written)] == [shape(line) for line in expected]
    assert plan.kv_tokens == pytest.approx(journal["target_tokens"], rel=0.01)

"""SGLang versions the simulator mimics, and where behaviour changed.

The releases whose argparse dumps ship in ``flags/`` (``<version>.json``) are the captured
ones; each gets its own parser. A version in between uses the flag table of the nearest lower
captured release. Behaviour switches are dated by the release that brought the change
(``at_least``), independently of which flag table applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

_VERSION_TEXT = re.compile(r"\s*v?(\d+)\.(\d+)\.(\d+)(?:\S*)\s*")
_DUMP_NAME = re.compile(r"(\d+)\.(\d+)\.(\d+)\.json")


def _captured_versions() -> tuple[tuple[int, int, int], ...]:
    """Releases with an argparse dump in ``flags/``, oldest first."""
    found = []
    for entry in resources.files("gpusim").joinpath("flags").iterdir():
        m = _DUMP_NAME.fullmatch(entry.name)
        if m:
            found.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
    if not found:
        raise RuntimeError("gpusim/flags holds no <version>.json argparse dump")
    return tuple(sorted(found))


KNOWN_VERSIONS: tuple[tuple[int, int, int], ...] = _captured_versions()


def parse_version(text: str) -> tuple[int, int, int]:
    m = _VERSION_TEXT.fullmatch(str(text))
    if not m:
        raise ValueError(f"unparsable sglang version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def fmt(v: tuple[int, int, int]) -> str:
    return ".".join(str(x) for x in v)


@dataclass(frozen=True)
class Version:
    """Version-dependent switches, all derived from one (major, minor, patch) tuple."""

    v: tuple[int, int, int]

    @classmethod
    def of(cls, text: str) -> Version:
        return cls(parse_version(text))

    def __str__(self) -> str:
        return fmt(self.v)

    def at_least(self, patch: int) -> bool:
        return self.v >= (0, 5, patch)

    @property
    def flags_table(self) -> str:
        """Name of the bundled argparse dump this version uses."""
        chosen = KNOWN_VERSIONS[0]
        for known in KNOWN_VERSIONS:
            if self.v >= known:
                chosen = known
        return fmt(chosen)

    @property
    def family(self) -> int:
        """Patch level of the captured release whose flag table this version uses (see KNOWN_VERSIONS).

        It says which parser applies; a behaviour change is dated with ``at_least`` instead.
        """
        return int(self.flags_table.rsplit(".", 1)[1])

    # --- entrypoint -------------------------------------------------------
    @property
    def prog_is_sglang_serve(self) -> bool:
        return self.at_least(10)

    @property
    def entrypoint_warning(self) -> bool:
        return self.at_least(10)

    # --- lifecycle --------------------------------------------------------
    @property
    def subprocess_watchdog(self) -> bool:
        return self.at_least(10)

    @property
    def shutdown_req(self) -> bool:
        """0.5.14+ send ShutdownReq and wait for schedulers before killing."""
        return self.at_least(14)

    @property
    def exit_zero_after_drain(self) -> bool:
        return self.at_least(19)

    @property
    def kill_tree_wait_timeout(self) -> int | None:
        """kill_process_tree waits this long (s) for its kills to be reaped: 60 from 0.5.19, never before."""
        return 60 if self.at_least(19) else None

    @property
    def straggler_warning(self) -> bool:
        return self.at_least(20)

    @property
    def kill_tree_log(self) -> bool:
        """The ``kill_process_tree called: ...`` line: from 0.5.13 (utils/common.py:1244; 0.5.12 has none)."""
        return self.at_least(13)

    @property
    def ready_endpoint(self) -> bool:
        return self.at_least(20)

    # --- memory heuristics --------------------------------------------------
    @property
    def mem_v14(self) -> bool:
        """Prefill-graph reserve replaces the spec-decoding reserve (v14 formula)."""
        return self.at_least(14)

    @property
    def small_gpu_v20(self) -> bool:
        return self.at_least(20)

    @property
    def decode_bs_capped_by_mrr(self) -> bool:
        return self.at_least(22)

    @property
    def mamba_ratio_default_none(self) -> bool:
        return self.at_least(20)

    @property
    def mamba_family(self) -> int:
        """9: v9 sizing; 14: v14 sizing; 18: +1 padding slot and joint spec solve."""
        if not self.at_least(14):
            return 9
        return 14 if not self.at_least(18) else 18

    @property
    def mamba_cap_warning(self) -> bool:
        return self.at_least(18)

    # --- log layout ---------------------------------------------------------
    @property
    def prefill_layout(self) -> int:
        """9: v9 order; 10: cuda graph before throughput; 11: #pending-token; 21: #replay-token."""
        if self.at_least(21):
            return 21
        if self.at_least(11):
            return 11
        if self.at_least(10):
            return 10
        return 9

    @property
    def accept_rate_v11(self) -> bool:
        return self.at_least(11)

    # --- HTTP surface -------------------------------------------------------
    @property
    def retractions_key(self) -> str:
        return "num_retractions" if self.at_least(12) else "total_retractions"

    @property
    def meta_reasoning_tokens(self) -> bool:
        return self.at_least(14)

    @property
    def model_info_v18(self) -> bool:
        return self.at_least(18)

    @property
    def server_info_startup_time(self) -> bool:
        return self.at_least(18)

    @property
    def memory_usage_v18(self) -> bool:
        return self.at_least(18)

    @property
    def tokenizer_metric_engine_type(self) -> bool:
        return self.at_least(14)

    @property
    def metric_is_streaming(self) -> bool:
        return self.at_least(18)

    @property
    def metrics_startup_constants(self) -> bool:
        return self.at_least(14)

    @property
    def flush_cache_v23(self) -> bool:
        return self.at_least(23)

"""SGLang versions the simulator mimics, and where behaviour changed.

Only four versions were captured in full (their argparse dumps ship in ``flags/``).
A version in between uses the flag table of the nearest lower captured version;
behaviour changes whose release the reference dates precisely switch at that release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KNOWN_VERSIONS: tuple[tuple[int, int, int], ...] = ((0, 5, 9), (0, 5, 14), (0, 5, 18), (0, 5, 23))


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"\s*v?(\d+)\.(\d+)\.(\d+)(?:\S*)\s*", str(text))
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
        """Nearest lower captured patch level: 9, 14, 18 or 23."""
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
    def straggler_warning(self) -> bool:
        return self.at_least(20)

    @property
    def kill_tree_log(self) -> bool:
        return self.family >= 23

    @property
    def ready_endpoint(self) -> bool:
        return self.at_least(20)

    # --- memory heuristics --------------------------------------------------
    @property
    def mem_v14(self) -> bool:
        """Prefill-graph reserve replaces the spec-decoding reserve (v14 formula)."""
        return self.family >= 14

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
        return 9 if self.family < 14 else (14 if self.family < 18 else 18)

    @property
    def mamba_cap_warning(self) -> bool:
        return self.family >= 18

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

    @property
    def kv_line_has_dtype(self) -> bool:
        return self.family >= 14

    @property
    def load_weight_has_dtype(self) -> bool:
        return self.family < 23

    # --- HTTP surface -------------------------------------------------------
    @property
    def retractions_key(self) -> str:
        return "num_retractions" if self.at_least(12) else "total_retractions"

    @property
    def meta_reasoning_tokens(self) -> bool:
        return self.family >= 14

    @property
    def model_info_v18(self) -> bool:
        return self.family >= 18

    @property
    def server_info_startup_time(self) -> bool:
        return self.family >= 18

    @property
    def memory_usage_v18(self) -> bool:
        return self.family >= 18

    @property
    def tokenizer_metric_engine_type(self) -> bool:
        return self.family >= 14

    @property
    def metric_is_streaming(self) -> bool:
        return self.family >= 18

    @property
    def metrics_startup_constants(self) -> bool:
        return self.family >= 14

    @property
    def flush_cache_v23(self) -> bool:
        return self.family >= 23

"""Model facts from evidence: what a running instance says about its model's memory, turned into
:class:`_capacity.inputs.ModelFacts`. Pure functions, no I/O.

The evidence, best first (the reference's log lines and ``/server_info``):

* the startup lines in the unit's journal, written once per start by the rank-0 scheduler:
  ``Load weight end. ... avail mem=A GB, mem usage=W GB.`` (weights, and what was left after them),
  ``Mamba Cache is allocated. max_mamba_cache_size: K, conv_state size: aGB, ssm_state size: bGB``
  (hybrid models: the state of one slot is ``(a + b) / (K + padding)``),
  ``KV Cache is allocated. [dtype: ..., ]#tokens: N, K size: x GB, V size: y GB`` (the KV cell is
  ``(x + y) / N``) and ``max_total_num_tokens=..., max_running_requests=R, context_len=L, ...``;
* ``/server_info``: ``internal_states[0].memory_usage`` (``weight``: the target model's weights;
  ``kvcache``: the target's KV pool only, not the Mamba pool nor the draft's KV (0.5.9
  ``managers/scheduler.py:2655``, 0.5.23 ``mem_cache/memory_pool.py:4359-4362``);
  ``token_capacity``; from 0.5.18 ``startup_available``, the free memory after the pools and the
  CUDA graphs (0.5.23 ``managers/scheduler.py:1262-1276``), which says nothing about the memory
  before the weights), ``max_total_num_tokens``, ``max_req_input_len``,
  ``internal_states[0].max_mamba_cache_size``.

SGLang's "GB" in these lines is GiB (bytes / 2**30), printed with 2 decimals (``memory_usage``: 2
decimals up to 0.5.17, 3 from 0.5.18): a fact is as precise as that, about 0.1% for the pools of a
large GPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._capacity.inputs import GIB, ModelFacts, at_least
from ansible_collections.sglang_ops.fleet.plugins.plugin_utils._releases.facts import nearest_release_facts

_NUM = r"(\d+(?:\.\d+)?)"
LOAD_WEIGHT_BEGIN = re.compile(rf"Load weight begin\. avail mem={_NUM} GB")
LOAD_WEIGHT_END = re.compile(rf"Load weight end\..*?avail mem={_NUM} GB, mem usage={_NUM} GB")
MAMBA_CACHE = re.compile(
    rf"Mamba Cache is allocated\. max_mamba_cache_size: (\d+), conv_state size: {_NUM}\s*GB, "
    rf"ssm_state size: {_NUM}\s*GB"
    rf"(?:\s+intermediate_ssm_state_cache size: {_NUM}\s*GB\s+intermediate_conv_window_cache size: {_NUM}\s*GB)?"
)
KV_CACHE = re.compile(
    rf"KV Cache is allocated\. (?:dtype: (\S+), )?#tokens: (\d+), K size: {_NUM} GB, V size: {_NUM} GB"
)
SCHEDULER_SUMMARY = re.compile(
    r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+), max_prefill_tokens=(\d+), "
    rf"max_running_requests=(\d+), context_len=(\d+), available_gpu_mem={_NUM} GB"
)
MAMBA_CAP_WARNING = re.compile(
    r"max_running_requests is capped to (\d+) by the mamba state cache "
    r"\(max_mamba_cache_size=(\d+), (\d+) state slots per request\)"
)
KV_REDUCED_WARNING = re.compile(r"max_running_requests was reduced from the requested (\d+) to (\d+)")

# What the agent asks journalctl for: every line above (a regular expression journalctl --grep takes).
# The fact the KV lines give (a name ruff's secret check would otherwise take for a token).
_KV_CELL = "kv_bytes_per_token"

JOURNAL_PATTERN = (
    "Load weight begin|Load weight end|Mamba Cache is allocated|KV Cache is allocated|"
    "max_total_num_tokens=|max_running_requests is capped|max_running_requests was reduced"
)


@dataclass(frozen=True)
class LoadWeightEnd:
    avail_gib: float
    weights_gib: float


@dataclass(frozen=True)
class MambaCacheLine:
    max_mamba_cache_size: int
    conv_gib: float
    ssm_gib: float
    intermediate_ssm_gib: float | None = None
    intermediate_conv_gib: float | None = None

    @property
    def pool_gib(self) -> float:
        return self.conv_gib + self.ssm_gib

    @property
    def intermediate_gib(self) -> float:
        return (self.intermediate_ssm_gib or 0.0) + (self.intermediate_conv_gib or 0.0)


@dataclass(frozen=True)
class KVCacheLine:
    tokens: int
    k_gib: float
    v_gib: float
    dtype: str | None = None


@dataclass(frozen=True)
class SchedulerSummary:
    max_total_num_tokens: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    max_running_requests: int
    context_len: int
    available_gpu_mem_gib: float


def parse_load_weight_begin(line: str) -> float | None:
    """``Load weight begin. avail mem=139.21 GB`` -> 139.21 (GiB)."""
    m = LOAD_WEIGHT_BEGIN.search(line)
    return float(m.group(1)) if m else None


def parse_load_weight_end(line: str) -> LoadWeightEnd | None:
    """``Load weight end. elapsed=..., type=..., [dtype=..., ]avail mem=A GB, mem usage=W GB.``"""
    m = LOAD_WEIGHT_END.search(line)
    return LoadWeightEnd(float(m.group(1)), float(m.group(2))) if m else None


def parse_mamba_cache(line: str) -> MambaCacheLine | None:
    """The Mamba pool line (no space before ``GB``; with speculative decoding it continues with
    the intermediate caches)."""
    m = MAMBA_CACHE.search(line)
    if not m:
        return None
    inter_ssm = float(m.group(4)) if m.group(4) is not None else None
    inter_conv = float(m.group(5)) if m.group(5) is not None else None
    return MambaCacheLine(int(m.group(1)), float(m.group(2)), float(m.group(3)), inter_ssm, inter_conv)


def parse_kv_cache(line: str) -> KVCacheLine | None:
    """``KV Cache is allocated. [dtype: torch.bfloat16, ]#tokens: N, K size: x GB, V size: y GB``."""
    m = KV_CACHE.search(line)
    if not m:
        return None
    return KVCacheLine(int(m.group(2)), float(m.group(3)), float(m.group(4)), m.group(1))


def parse_scheduler_summary(line: str) -> SchedulerSummary | None:
    """``max_total_num_tokens=N, chunked_prefill_size=C, max_prefill_tokens=P, max_running_requests=R,
    context_len=L, available_gpu_mem=x GB``."""
    m = SCHEDULER_SUMMARY.search(line)
    if not m:
        return None
    return SchedulerSummary(
        int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), float(m.group(6))
    )


def parse_mamba_cap_warning(line: str) -> tuple[int, int, int] | None:
    """0.5.18+: ``max_running_requests is capped to n by the mamba state cache
    (max_mamba_cache_size=K, S state slots per request)`` -> (n, K, S)."""
    m = MAMBA_CAP_WARNING.search(line)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


@dataclass(frozen=True)
class DraftLines:
    """Where the draft model's own startup lines are, by release: the vendored release facts
    (:mod:`._releases.facts`, read from each release's source). ``lines``: the kinds of line
    (``log_lines`` keys: ``load_weight_begin``, ``load_weight_end``, ``kv_cache``) the draft's own
    model runner writes too, after the target's line of the same kind; ``before_target_pools``:
    whether it is loaded before the target's pools are sized (its weights and its KV layer then
    count in the target's sizing) or after them (its lines are left out)."""

    lines: frozenset[str] = frozenset()
    before_target_pools: bool = False

    @classmethod
    def of(cls, release: str) -> DraftLines:
        """The draft's lines of ``release`` (the nearest release read at or below it); none for a
        release the facts do not know."""
        facts = nearest_release_facts(release)
        if facts is None:
            return cls()
        return cls(frozenset(facts.draft_log_lines), facts.draft_before_target_pools)


@dataclass
class StartupLines:
    """The startup lines of one run of an instance (a unit's journal for one invocation holds one
    start), the target model's first.

    With speculative decoding (MTP/EAGLE) the draft model has its own model runner and writes its
    own lines of the kinds the release's facts name (:class:`DraftLines`; the golden journals in
    tests/unit/fixtures/journals): the second line of such a kind is the draft's. Where the draft
    is loaded before the target's pools are sized (0.5.14+), its weights count in the weights
    before the pools and its one-layer KV pool, logged with the target's ``#tokens``, in each
    token's cell (0.5.23 ``model_executor/pool_configurator.py:258-273``); where it is loaded
    after them (0.5.9), its lines are left out: the target's pools were sized without it. The
    memory before the weights comes from the first ``Load weight`` line (the target's).
    """

    load_weight_begin_gib: float | None = None
    load_weight_end: LoadWeightEnd | None = None
    mamba: MambaCacheLine | None = None
    kv: KVCacheLine | None = None
    summary: SchedulerSummary | None = None
    mamba_cap: tuple[int, int, int] | None = None
    kv_reduced: tuple[int, int] | None = None
    # Weights loaded before the pools were sized (target, and the draft on 0.5.14+), in order.
    weights_before_pools: list[LoadWeightEnd] = field(default_factory=list)
    # The KV lines sized together: the target's, and the draft's of the same #tokens on 0.5.14+.
    kv_sized_together: list[KVCacheLine] = field(default_factory=list)
    # The draft's lines left out of the facts (loaded after the target's pools: 0.5.9).
    later_runner_lines: int = 0
    # Lines of a kind already seen that neither the target nor the draft writes again.
    unexplained_lines: int = 0

    def found(self) -> list[str]:
        names = {
            "load_weight_begin_gib": "Load weight begin",
            "load_weight_end": "Load weight end",
            "mamba": "Mamba Cache is allocated",
            "kv": "KV Cache is allocated",
            "summary": "max_total_num_tokens=",
            "mamba_cap": "max_running_requests is capped",
            "kv_reduced": "max_running_requests was reduced",
        }
        return [text for key, text in names.items() if getattr(self, key) is not None]

    @property
    def weights_gib(self) -> float | None:
        if not self.weights_before_pools:
            return self.load_weight_end.weights_gib if self.load_weight_end is not None else None
        return sum(w.weights_gib for w in self.weights_before_pools)

    @property
    def kv_gib(self) -> float:
        return sum(k.k_gib + k.v_gib for k in self.kv_sized_together)


def _whose(kind: str, seen: dict[str, int], draft: DraftLines) -> str:
    """``target`` (the first line of its kind), ``draft`` (the second, of a kind the draft writes
    too) or ``unexplained``; counts the line."""
    count = seen.get(kind, 0)
    seen[kind] = count + 1
    if count == 0:
        return "target"
    return "draft" if count == 1 and kind in draft.lines else "unexplained"


def parse_startup_lines(lines: Iterable[str], draft: DraftLines | None = None) -> StartupLines:
    """The startup lines of one run; ``draft``: where the draft model's lines are (the release's
    facts, :meth:`DraftLines.of`); without it every line is the target's first line of its kind."""
    draft = draft or DraftLines()
    out = StartupLines()
    seen: dict[str, int] = {}

    def keep(kind: str) -> str | None:
        """Whose line it is, or None when it is left out of the facts (counted)."""
        whose = _whose(kind, seen, draft)
        if whose == "unexplained":
            out.unexplained_lines += 1
            return None
        if whose == "draft" and not draft.before_target_pools:
            out.later_runner_lines += 1
            return None
        return whose

    for line in lines:
        begin = parse_load_weight_begin(line)
        if begin is not None:
            if keep("load_weight_begin") == "target":
                out.load_weight_begin_gib = begin
            continue
        end = parse_load_weight_end(line)
        if end is not None:
            whose = keep("load_weight_end")
            if whose == "target":
                out.load_weight_end = end
            if whose is not None:
                out.weights_before_pools.append(end)
            continue
        mamba = parse_mamba_cache(line)
        if mamba is not None:
            if keep("mamba_cache") == "target":
                out.mamba = mamba
            continue
        kv = parse_kv_cache(line)
        if kv is not None:
            whose = keep("kv_cache")
            if whose == "target":
                out.kv = kv
                out.kv_sized_together.append(kv)
            elif whose == "draft" and out.kv is not None and kv.tokens == out.kv.tokens:
                out.kv_sized_together.append(kv)
            continue
        for attr, parser in (("summary", parse_scheduler_summary), ("mamba_cap", parse_mamba_cap_warning)):
            value = parser(line)
            if value is not None:
                if getattr(out, attr) is None:
                    setattr(out, attr, value)
                break
        else:
            m = KV_REDUCED_WARNING.search(line)
            if m and out.kv_reduced is None:
                out.kv_reduced = (int(m.group(1)), int(m.group(2)))
    return out


# ------------------------------------------------------------------------------------------------
# /server_info
# ------------------------------------------------------------------------------------------------


def internal_state(server_info: Mapping[str, Any] | None) -> dict[str, Any]:
    states = (server_info or {}).get("internal_states") or []
    return dict(states[0]) if states and isinstance(states[0], Mapping) else {}


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class FactsResult:
    """The facts (None when the evidence does not give them), where each came from, the figures
    the instance reported (to check the arithmetic against), and what is missing."""

    facts: ModelFacts | None
    sources: dict[str, str] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        facts = None
        if self.facts is not None:
            facts = {k: getattr(self.facts, k) for k in self.facts.__dataclass_fields__}
        return {
            "facts": facts,
            "sources": dict(self.sources),
            "observed": dict(self.observed),
            "problems": list(self.problems),
        }


def derive_model_facts(
    release: str,
    journal_lines: Iterable[str],
    server_info: Mapping[str, Any] | None,
    gpu_total_mib: float | None,
    context_len_metric: float | None = None,
) -> FactsResult:
    """Model facts of a running instance from its startup lines and its ``/server_info``.

    ``gpu_total_mib`` is its GPU's memory.total (nvidia-smi); ``context_len_metric`` the
    ``sglang:context_len`` gauge if it was read. Without enough evidence for a fact, ``facts`` is
    None and ``problems`` says what is missing.
    """
    d = _Derivation(parse_startup_lines(journal_lines, DraftLines.of(release)), server_info or {}, gpu_total_mib)
    d.observe_reported_figures()
    weights = d.weights()
    overhead = d.overhead()
    hybrid, per_slot = d.mamba_bytes_per_slot(release)
    kv_cell = d.kv_bytes_per_token()
    context = d.context_length(context_len_metric)
    facts = None
    if not d.problems and weights is not None and overhead is not None and context is not None:
        facts = ModelFacts(
            hybrid=hybrid,
            mamba_bytes_per_slot=per_slot,
            kv_bytes_per_token=kv_cell,
            weights_gib=weights,
            context_length=context,
            overhead_gib=overhead,
        )
    return FactsResult(facts=facts, sources=d.sources, observed=d.observed, problems=d.problems)


class _Derivation:
    """The evidence of one instance, and each fact derived from it in a step of its own: where
    each came from (``sources``), what is missing (``problems``) and the reported figures to check
    the arithmetic against (``observed``)."""

    def __init__(self, lines: StartupLines, info: Mapping[str, Any], gpu_total_mib: float | None):
        self.lines = lines
        self.info = info
        self.state = internal_state(info)
        raw_usage = self.state.get("memory_usage")
        self.usage: Mapping[str, Any] = raw_usage if isinstance(raw_usage, Mapping) else {}
        self.total_gib = gpu_total_mib / 1024.0 if gpu_total_mib else None
        self.sources: dict[str, str] = {}
        self.problems: list[str] = []
        self.observed: dict[str, Any] = {"journal_lines": lines.found()}
        self.k_reported: int | None = None
        self.tokens_reported: int | None = None

    def observe_reported_figures(self) -> None:
        lines = self.lines
        self.k_reported = _int(self.state.get("max_mamba_cache_size"))
        if self.k_reported is None and lines.mamba is not None:
            self.k_reported = lines.mamba.max_mamba_cache_size
        self.tokens_reported = _int(self.info.get("max_total_num_tokens"))
        if self.tokens_reported is None and lines.kv is not None:
            self.tokens_reported = lines.kv.tokens
        self.observed.update(
            max_mamba_cache_size=self.k_reported,
            max_total_num_tokens=self.tokens_reported,
            effective_max_running_requests=_int(self.state.get("effective_max_running_requests_per_dp")),
        )
        if lines.summary is not None:
            self.observed["logged_max_running_requests"] = lines.summary.max_running_requests
        if lines.mamba_cap is not None:
            self.observed["logged_mamba_cap"] = {
                "max_running_requests": lines.mamba_cap[0],
                "max_mamba_cache_size": lines.mamba_cap[1],
                "slots_per_request": lines.mamba_cap[2],
            }

    def weights(self) -> float | None:
        lines = self.lines
        if lines.weights_gib is not None:
            count = len(lines.weights_before_pools)
            self.sources["weights_gib"] = "startup log: Load weight end (mem usage)" + (
                f", the {count} model runners loaded before the pools (target and draft)" if count > 1 else ""
            )
            return lines.weights_gib
        weight = _float(self.usage.get("weight"))
        if weight is not None:
            self.sources["weights_gib"] = "/server_info: internal_states[0].memory_usage.weight"
            return weight
        self.problems.append(
            "weights: neither the journal's 'Load weight end' line nor /server_info memory_usage.weight"
        )
        return None

    def overhead(self) -> float | None:
        """What was in use before the weights (CUDA context, other processes)."""
        lines = self.lines
        if self.total_gib is None:
            self.problems.append("the GPU's memory.total (nvidia-smi) is unknown")
            return None
        if lines.load_weight_end is not None:
            self.sources["overhead_gib"] = (
                "nvidia-smi memory.total - startup log: Load weight end (avail mem + mem usage)"
            )
            end = lines.load_weight_end
            return max(self.total_gib - end.avail_gib - end.weights_gib, 0.0)
        if lines.load_weight_begin_gib is not None:
            self.sources["overhead_gib"] = "nvidia-smi memory.total - startup log: Load weight begin (avail mem)"
            return max(self.total_gib - lines.load_weight_begin_gib, 0.0)
        # memory_usage.startup_available is what was free after the pools and CUDA graphs.
        self.problems.append("memory in use before the weights: no 'Load weight' line in the journal")
        return None

    def mamba_bytes_per_slot(self, release: str) -> tuple[bool, float]:
        """Whether the model is hybrid, and the Mamba state of one slot."""
        mamba = self.lines.mamba
        hybrid = mamba is not None or self.k_reported is not None
        if not hybrid:
            return False, 0.0
        if mamba is None:
            self.problems.append(
                "Mamba state per slot: the journal's 'Mamba Cache is allocated' line of the current run is "
                "missing (/server_info does not tell the Mamba pool from the KV cache)"
            )
            return True, 0.0
        pad = 1 if at_least(release, 18) else 0
        slots = mamba.max_mamba_cache_size + pad
        padding = ", one of them padding)" if pad else ")"
        allocated = f"Mamba Cache is allocated ((conv + ssm) / {slots} slots{padding}"
        self.sources["mamba_bytes_per_slot"] = f"startup log: {allocated}"
        self.observed["mamba_pool_gib"] = mamba.pool_gib
        self.observed["mamba_intermediate_gib"] = mamba.intermediate_gib
        return True, mamba.pool_gib * GIB / slots

    def kv_bytes_per_token(self) -> float:
        lines = self.lines
        if lines.kv is not None and lines.kv.tokens > 0 and lines.kv_gib > 0:
            pools = len(lines.kv_sized_together)
            self.sources[_KV_CELL] = "startup log: KV Cache is allocated ((K size + V size) / #tokens" + (
                f", the target's and the draft's {pools} pools of the same #tokens)" if pools > 1 else ")"
            )
            return lines.kv_gib * GIB / lines.kv.tokens
        kv_cell = 0.0
        capacity = _int(self.usage.get("token_capacity"))
        kvcache = _float(self.usage.get("kvcache"))
        spec = bool(self.info.get("speculative_algorithm"))
        if capacity and kvcache is not None and kvcache > 0 and not spec:
            # kvcache is the target's KV pool alone; with a draft model its layer is missing.
            kv_cell = kvcache * GIB / capacity
            self.sources[_KV_CELL] = "/server_info: memory_usage kvcache (the KV pool) / token_capacity"
        if kv_cell <= 0:
            self.problems.append(
                "KV bytes per token: no 'KV Cache is allocated' line in the journal and /server_info "
                "memory_usage does not give it"
            )
        return kv_cell

    def context_length(self, context_len_metric: float | None) -> int | None:
        if self.lines.summary is not None:
            self.sources["context_length"] = "startup log: max_total_num_tokens=... context_len"
            return self.lines.summary.context_len
        if context_len_metric:
            self.sources["context_length"] = "/metrics: sglang:context_len"
            return int(context_len_metric)
        from_info = _int(self.info.get("context_length"))
        if from_info:
            self.sources["context_length"] = "/server_info: context_length"
            return from_info
        # The scheduler's max_req_input_len = min(context_len - 1, KV pool - 1) - 5 (0.5.23
        # managers/tp_worker.py:568-572, 0.5.9 managers/tp_worker.py:287-291): below the pool's
        # bound it is the context length less 6.
        req_len = _int(self.info.get("max_req_input_len"))
        if req_len is not None and self.tokens_reported is not None and req_len + 6 < self.tokens_reported:
            self.sources["context_length"] = "/server_info: max_req_input_len + 6"
            return req_len + 6
        self.problems.append("context length: no 'context_len=' line in the journal, no sglang:context_len gauge")
        return None

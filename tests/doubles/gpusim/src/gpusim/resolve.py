"""ServerArgs resolution (``__post_init__`` in v9-v18, the arg_groups hooks in v19+).

Only the fields the reference documents are resolved; everything else keeps its
argparse value, which is also what ``/server_info`` shows for it.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

from gpusim import nvsmi, release_facts
from gpusim.config import Config
from gpusim.profiles import ModelProfile
from gpusim.versions import Version

SPEC_EAGLE = ("EAGLE", "EAGLE3", "STANDALONE")
SPEC_KNOWN = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "FROZEN_KV_MTP")
SPEC_MTP = ("EAGLE", "NEXTN")


class ResolveError(Exception):
    """Raised where SGLang raises during argument resolution (exit status 1 with a traceback)."""

    def __init__(self, exc_type: str, message: str):
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message


@dataclass
class Resolved:
    args: dict[str, Any]
    messages: list[tuple[str, str]] = field(default_factory=list)
    gpu_capacity_mib: float | None = None
    decode_max_bs: int = 256
    decode_graph: bool = True
    prefill_graph: bool = False
    prefill_bs: list[int] = field(default_factory=list)
    spec: bool = False
    spec_mtp: bool = False
    draft_tokens: int = 0
    spec_steps: int = 0
    mamba_ratio: int = 1
    mamba_strategy: str | None = None
    mamba_full_memory_ratio: float = 0.9
    context_len: int = 4096
    overlap: bool = True

    def warn(self, msg: str) -> None:
        self.messages.append(("warning", msg))

    def info(self, msg: str) -> None:
        self.messages.append(("info", msg))


def decode_bs_list(max_bs: int, spec: bool) -> list[int]:
    if not spec:
        bs = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    else:
        bs = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    bs = [b for b in bs if b <= max_bs]
    if bs and max_bs not in bs:
        bs.append(max_bs)
    return bs


def prefill_bs_list(max_tokens: int) -> list[int]:
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, max_tokens + 1, 512),
    ]
    return [s for s in sizes if s <= max_tokens]


def device_memory_capacity(cfg: Config, version: Version, res: Resolved) -> float:
    """``get_nvgpu_memory_capacity``: nvidia-smi's minimum memory.total, else the CUDA fallback."""
    rc, out, err = nvsmi.run_capture(["--query-gpu=memory.total", "--format=csv,noheader,nounits"], cfg)
    host_broken = cfg.nvsmi["mode"] in ("driver_not_loaded", "library_mismatch")
    if rc != 0:
        if not version.at_least(14):
            raise ResolveError("RuntimeError", f"nvidia-smi error: {err.strip()}")
        reason = f"nvidia-smi failed (exit code {rc}: {err.strip()})."
        return _cuda_fallback(cfg, version, res, reason, host_broken)
    values = [float(x) for x in out.strip().split("\n") if re.match(r"^\d+(\.\d+)?$", x.strip())]
    if not values:
        if not version.at_least(14):
            if host_broken:
                raise ResolveError("ValueError", "No GPU memory values found.")
            res.warn("Failed to get GPU memory capacity from nvidia-smi, falling back to torch.cuda.mem_get_info().")
            return float(min(_visible_totals(cfg)))
        return _cuda_fallback(cfg, version, res, "Failed to get GPU memory capacity from nvidia-smi.", host_broken)
    return min(values)


def _visible_totals(cfg: Config) -> list[int]:
    visible = visible_physical(cfg)
    return [cfg.gpus[i].memory_total_mib for i in visible] or [g.memory_total_mib for g in cfg.gpus]


def _cuda_fallback(cfg: Config, version: Version, res: Resolved, reason: str, host_broken: bool) -> float:
    if host_broken or not cfg.gpus:
        raise ResolveError("RuntimeError", reason)
    totals = _visible_totals(cfg)
    chosen = min(totals)
    res.warn(
        f"{reason} Falling back to torch.cuda.mem_get_info(). "
        f"Reported total GPU memory per device (MiB): {totals}, using min: {chosen} MiB."
    )
    return float(chosen)


def visible_physical(cfg: Config) -> list[int]:
    """Physical GPU indices in CUDA order, honouring CUDA_VISIBLE_DEVICES (indices or UUIDs)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(len(cfg.gpus)))
    out: list[int] = []
    for part in raw.split(","):
        item = part.strip()
        if not item:
            break
        if item.isdigit():
            idx = int(item)
            if idx >= len(cfg.gpus):
                break
            out.append(idx)
        else:
            match = [g.index for g in cfg.gpus if g.uuid == item or g.uuid.startswith(item)]
            if not match:
                break
            out.append(match[0])
    return out


def _gpu_tier(gpu_mem: float, tp: int, version: Version) -> tuple[int, int]:
    if gpu_mem < 20 * 1024:
        return 2048, 8
    if gpu_mem < 35 * 1024:
        if version.small_gpu_v20:
            return 4096, (48 if tp < 4 else 160)
        return 2048, (24 if tp < 4 else 80)
    if gpu_mem < 60 * 1024:
        return 4096, (32 if tp < 4 else 160)
    if gpu_mem < 160 * 1024:
        return 8192, (256 if tp < 4 else 512)
    return 16384, 512


def resolve(raw: dict[str, Any], version: Version, cfg: Config, profile: ModelProfile) -> Resolved:
    """ServerArgs' defaults and adjustments, in the order its ``__post_init__`` applies them."""
    a = dict(raw)
    res = Resolved(args=a)
    _basic_defaults(a)
    alg = _speculative_algorithm(a, res, profile)
    tp = int(a.get("tp_size") or 1)
    pp = int(a.get("pp_size") or 1)
    gpu_mem = device_memory_capacity(cfg, version, res)
    res.gpu_capacity_mib = gpu_mem
    chunk_default, bs_default = _gpu_tier(gpu_mem, tp, version)
    if a.get("chunked_prefill_size") is None:
        a["chunked_prefill_size"] = chunk_default
    if version.at_least(14):
        _cuda_graphs(a, res, version, bs_default)
    else:
        _cuda_graphs_0_5_9(a, res, bs_default)
    if a.get("mem_fraction_static") is None:
        a["mem_fraction_static"] = _mem_fraction_static(a, res, version, gpu_mem, tp * pp, alg)
    if a.get("max_prefill_tokens") is None:
        a["max_prefill_tokens"] = 16384
    if alg is not None:
        _speculative_decoding(a, res, version, profile, alg)
    res.overlap = not a.get("disable_overlap_schedule")
    # --- hybrid Mamba models ----------------------------------------------------------
    if version.mamba_ratio_default_none and a.get("mamba_full_memory_ratio") is None:
        a["mamba_full_memory_ratio"] = 0.9
    res.mamba_full_memory_ratio = float(a.get("mamba_full_memory_ratio") or 0.9)
    if profile.is_hybrid:
        _resolve_mamba(a, res, version, profile)
    res.context_len = int(a.get("context_length") or profile.context_length)
    return res


def _basic_defaults(a: dict[str, Any]) -> None:
    if a.get("served_model_name") is None:
        a["served_model_name"] = a["model_path"]
    if a.get("tokenizer_path") is None:
        a["tokenizer_path"] = a["model_path"]
    if a.get("device") is None:
        a["device"] = "cuda"
    if a.get("random_seed") is None:
        a["random_seed"] = random.randint(0, 1 << 30)
    if a.get("page_size") is None:
        a["page_size"] = 1
    if a.get("dp_size") is None:
        a["dp_size"] = 1


def _speculative_algorithm(a: dict[str, Any], res: Resolved, profile: ModelProfile) -> str | None:
    """The algorithm's canonical name (NEXTN is EAGLE), or None without speculative decoding."""
    alg = a.get("speculative_algorithm")
    if alg is not None:
        if alg.upper() not in SPEC_KNOWN:
            raise ResolveError("ValueError", f"Unknown speculative algorithm name: {alg}")
        alg = alg.upper()
        if alg == "NEXTN":
            alg = "EAGLE"
        a["speculative_algorithm"] = alg
    res.spec = alg is not None
    res.spec_mtp = alg in SPEC_MTP and profile.mtp_capable
    return alg


def _cuda_graphs_0_5_9(a: dict[str, Any], res: Resolved, bs_default: int) -> None:
    """0.5.9-0.5.13: one decode graph list, piecewise prefill graphs only when enabled."""
    if a.get("cuda_graph_bs"):
        a["cuda_graph_max_bs"] = max(a["cuda_graph_bs"])
    if a.get("cuda_graph_max_bs") is None:
        a["cuda_graph_max_bs"] = bs_default
    if not a.get("cuda_graph_bs"):
        a["cuda_graph_bs"] = decode_bs_list(a["cuda_graph_max_bs"], res.spec)
    res.decode_max_bs = a["cuda_graph_max_bs"]
    res.decode_graph = not a.get("disable_cuda_graph")
    if a.get("piecewise_cuda_graph_max_tokens") is None:
        a["piecewise_cuda_graph_max_tokens"] = a["chunked_prefill_size"]
    if a.get("piecewise_cuda_graph_tokens") is None:
        a["piecewise_cuda_graph_tokens"] = prefill_bs_list(a["piecewise_cuda_graph_max_tokens"])
    res.prefill_graph = bool(a.get("enable_piecewise_cuda_graph")) and res.decode_graph
    res.prefill_bs = list(a["piecewise_cuda_graph_tokens"])


def _cuda_graphs(a: dict[str, Any], res: Resolved, version: Version, bs_default: int) -> None:
    """0.5.14 on: decode and prefill graphs each with its backend and batch sizes."""
    all_off = bool(a.get("disable_cuda_graph"))
    dec_backend = a.get("cuda_graph_backend_decode")
    pre_backend = a.get("cuda_graph_backend_prefill")
    res.decode_graph = not (all_off or dec_backend == "disabled" or a.get("disable_decode_cuda_graph"))
    res.prefill_graph = not (all_off or pre_backend == "disabled" or a.get("disable_prefill_cuda_graph"))
    max_bs_default = a.get("cuda_graph_max_bs_decode") is None
    if a.get("cuda_graph_bs_decode"):
        a["cuda_graph_max_bs_decode"] = max(a["cuda_graph_bs_decode"])
        max_bs_default = False
    if a.get("cuda_graph_max_bs_decode") is None:
        a["cuda_graph_max_bs_decode"] = bs_default
    mrr_flag = a.get("max_running_requests")
    if (
        version.decode_bs_capped_by_mrr
        and max_bs_default
        and mrr_flag is not None
        and a["cuda_graph_max_bs_decode"] > mrr_flag
    ):
        a["cuda_graph_max_bs_decode"] = mrr_flag
    if not a.get("cuda_graph_bs_decode"):
        a["cuda_graph_bs_decode"] = decode_bs_list(a["cuda_graph_max_bs_decode"], res.spec)
    if a.get("cuda_graph_max_bs_prefill") is None:
        pmax = a["chunked_prefill_size"]
        if a.get("max_total_tokens") is not None:
            pmax = min(pmax, a["max_total_tokens"])
        a["cuda_graph_max_bs_prefill"] = pmax
    if not a.get("cuda_graph_bs_prefill"):
        a["cuda_graph_bs_prefill"] = prefill_bs_list(a["cuda_graph_max_bs_prefill"])
    if a.get("cuda_graph_backend_decode") is None:
        a["cuda_graph_backend_decode"] = "disabled" if not res.decode_graph else "full"
    if a.get("cuda_graph_backend_prefill") is None:
        a["cuda_graph_backend_prefill"] = "disabled" if not res.prefill_graph else "breakable"
    res.decode_max_bs = a["cuda_graph_max_bs_decode"]
    res.prefill_bs = list(a["cuda_graph_bs_prefill"])


def _mem_fraction_static(
    a: dict[str, Any], res: Resolved, version: Version, gpu_mem: float, parallel: int, alg: str | None
) -> float:
    """SGLang's own choice: the GPU's memory less what it reserves (activations, graphs, drafts)."""
    v9 = not version.at_least(14)
    chunk = a["chunked_prefill_size"]
    act = max(chunk, 2048) if chunk > 0 else max(a.get("max_prefill_tokens") or 16384, 2048)
    reserved = 512 + act * 1.5 + parallel / 8 * 1024
    if v9 or res.decode_graph:
        reserved += res.decode_max_bs * 2
    if res.prefill_graph:
        reserved += len(res.prefill_bs) * 8
    if gpu_mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    if v9 and alg is not None:
        if alg == "STANDALONE":
            reserved += 6 * 1024
        elif alg != "NGRAM":
            reserved += 2 * 1024
    return round((gpu_mem - reserved) / gpu_mem, 3)


def _speculative_decoding(a: dict[str, Any], res: Resolved, version: Version, profile: ModelProfile, alg: str) -> None:
    """The speculative settings SGLang resets or fills in, with its warnings."""
    if a.get("max_running_requests") is None:
        a["max_running_requests"] = 48
        res.warn(
            "Max running requests is reset to 48 for speculative decoding. You can override this by "
            "explicitly setting --max-running-requests."
        )
    if alg in SPEC_EAGLE and not version.at_least(14):
        _overlap_0_5_9(a, res)
    if alg in SPEC_EAGLE:
        _eagle_steps(a, res, profile, alg)
    elif alg == "NGRAM":
        if a.get("speculative_num_draft_tokens") is None:
            a["speculative_num_draft_tokens"] = 12
        if a.get("speculative_num_steps") is None:
            a["speculative_num_steps"] = 1
    else:
        if a.get("speculative_num_steps") is None:
            a["speculative_num_steps"] = 3
        if a.get("speculative_num_draft_tokens") is None:
            a["speculative_num_draft_tokens"] = a["speculative_num_steps"] + 1
    res.draft_tokens = int(a["speculative_num_draft_tokens"])
    res.spec_steps = int(a["speculative_num_steps"])


def _overlap_0_5_9(a: dict[str, Any], res: Resolved) -> None:
    if os.environ.get("SGLANG_ENABLE_SPEC_V2", "").lower() in ("1", "true"):
        a["disable_overlap_schedule"] = False
        res.warn("Spec v2 is enabled for eagle/eagle3 speculative decoding and overlap schedule is turned on.")
    else:
        a["disable_overlap_schedule"] = True
        res.warn(
            "Overlap scheduler is disabled when spec v2 is off or using unsupported speculative "
            "algorithm. You can set env SGLANG_ENABLE_SPEC_V2=True to enable the experimental "
            "overlap scheduler. "
        )


def _eagle_steps(a: dict[str, Any], res: Resolved, profile: ModelProfile, alg: str) -> None:
    if a.get("enable_mixed_chunk"):
        a["enable_mixed_chunk"] = False
        res.warn("Mixed chunked prefill is disabled because of using eagle speculative decoding.")
    if a.get("speculative_num_steps") is None:
        arch = profile.architectures[0]
        steps, topk, draft = (5, 4, 8) if arch in ("LlamaForCausalLM", "Grok1ForCausalLM") else (3, 1, 4)
        if alg == "STANDALONE":
            steps, topk, draft = 3, 1, 4
        a["speculative_num_steps"] = steps
        if a.get("speculative_eagle_topk") is None:
            a["speculative_eagle_topk"] = topk
        if a.get("speculative_num_draft_tokens") is None:
            a["speculative_num_draft_tokens"] = draft
    if a.get("speculative_eagle_topk") is None:
        a["speculative_eagle_topk"] = 1
    if a.get("speculative_num_draft_tokens") is None:
        a["speculative_num_draft_tokens"] = a["speculative_num_steps"] + 1
    if a["speculative_eagle_topk"] == 1 and a["speculative_num_draft_tokens"] != a["speculative_num_steps"] + 1:
        res.warn(
            "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1"
        )
        a["speculative_num_draft_tokens"] = a["speculative_num_steps"] + 1


def _resolve_mamba(a: dict[str, Any], res: Resolved, version: Version, profile: ModelProfile) -> None:
    arch = profile.architectures[0]
    # The parser's dest: 0.5.9's table stores the strategy under its old name.
    key = "mamba_scheduler_strategy" if version.family < 14 else "mamba_radix_cache_strategy"
    strategy = a.get(key) or "auto"
    if not version.at_least(14):
        if strategy == "auto":
            strategy = "no_buffer"
        if strategy == "no_buffer" and not a.get("disable_radix_cache"):
            if not res.spec:
                res.warn(
                    "Disabling overlap schedule since mamba no_buffer is not compatible with overlap schedule, "
                    "try to use --disable-radix-cache if overlap schedule is necessary"
                )
                a["disable_overlap_schedule"] = True
            else:
                res.warn(
                    f"Disabling radix cache since speculative decoding for {arch} is not supported with "
                    "radix cache yet."
                )
                a["disable_radix_cache"] = True
    else:
        overlap = not a.get("disable_overlap_schedule")
        if strategy == "auto":
            strategy = "extra_buffer" if (overlap or (a.get("page_size") or 1) > 1) else "no_buffer"
            # Only auto resolving to no_buffer turns the overlap scheduler off itself (0.5.23
            # arg_groups/overrides.py:477-486); an explicit no_buffer with it on is refused below.
            if strategy == "no_buffer" and not a.get("disable_radix_cache"):
                a["disable_overlap_schedule"] = True
        # The release's own asserts on the strategy (facts/<version>.json, e.g. 0.5.23
        # arg_groups/mamba_hook.py:156-163): SGLang exits with the AssertionError.
        broken = release_facts.refusal(version, {**a, "mamba_radix_cache_strategy": strategy})
        if broken is not None:
            raise ResolveError(broken["error"], broken["message"])
    res.overlap = not a.get("disable_overlap_schedule")
    res.mamba_strategy = strategy
    if a.get("disable_radix_cache"):
        res.mamba_ratio = 1
        return
    base = 3
    if version.at_least(18) and os.environ.get("SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK", "").lower() in ("1", "true"):
        base = 2 if strategy != "no_buffer" else 3
    extra = 0
    if strategy == "extra_buffer":
        extra = 2 if res.overlap else 1
    elif strategy == "extra_buffer_lazy":
        extra = 1
    res.mamba_ratio = base + extra


def mamba_slots_held_per_request(res: Resolved) -> int:
    """What a running request holds in the Mamba pool: its working slot, plus with extra_buffer
    its ping-pong tracking slots (2 with the overlap scheduler, else 1; 0.5.23
    mem_cache/memory_pool.py:1393, 1572-1630). The slots-per-request ratio that sizes the pool
    (res.mamba_ratio) is a reserve and larger."""
    if res.mamba_ratio == 1:
        return 1
    if res.mamba_strategy == "extra_buffer":
        return 1 + (2 if res.overlap else 1)
    if res.mamba_strategy == "extra_buffer_lazy":
        return 2
    return 1


def server_args_repr(args: dict[str, Any], order: list[str], exact: bool = False) -> str:
    """``exact``: the field list is this version's own, so parser-only dests are not fields."""
    seen = set()
    parts = []
    for name in order:
        if name in args and name not in seen:
            parts.append(f"{name}={args[name]!r}")
            seen.add(name)
    for name in sorted(args):
        if name not in seen and not name.startswith("_") and not exact:
            parts.append(f"{name}={args[name]!r}")
    return "ServerArgs(" + ", ".join(parts) + ")"

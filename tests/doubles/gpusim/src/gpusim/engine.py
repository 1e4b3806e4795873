"""The scheduler's batching loop, modelled in time: prefill and decode steps, queueing, logs.

At most the effective max running requests run at once; the rest wait. A decode step
takes ``step_base_s + step_per_req_s * running`` seconds and yields one token per running
request (about ``spec_accept_length`` with speculative decoding), so capacity set by the
launch flags shows up as latency, queue depth, ``/metrics`` and the batch log lines.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpusim.logutil import Logger
from gpusim.metrics import E2E_BUCKETS, TTFT_BUCKETS, Registry
from gpusim.textgen import Completion
from gpusim.versions import Version


@dataclass
class Req:
    prompt_tokens: int
    max_new: int
    completion: Completion
    stream: bool = False
    is_health: bool = False
    hung: bool = False
    log_metrics: bool = True
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.monotonic)
    created_wall: float = field(default_factory=time.time)
    produced: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    finish: dict[str, Any] | None = None
    events: asyncio.Queue | None = None
    done: asyncio.Future | None = None
    verify_ct: int = 0
    accepted_drafts: int = 0
    aborted: bool = False
    eos_id: int = 151645
    ttft_recorded: bool = False

    @property
    def target(self) -> int:
        return min(self.max_new, self.completion.natural_len)

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.produced


@dataclass
class ReplicaConfig:
    dp_rank: int | None
    log_prefix: str
    kv_capacity: int
    max_running: int
    mamba_k: int | None
    mamba_ratio: int
    decode_graph: bool
    prefill_graph: bool
    decode_max_bs: int
    decode_log_interval: int
    max_prefill_tokens: int
    spec: bool
    spec_steps: int
    draft_tokens: int
    accept_length: float
    step_base_s: float
    step_per_req_s: float
    prefill_tps: float
    idle_metrics_s: float
    context_len: int
    page_size: int
    # Mamba slots a running request holds: its working slot, plus with extra_buffer the ping-pong
    # tracking slots (0.5.23 mem_cache/memory_pool.py:1393, 1572-1630). Radix-cached states are
    # evictable and do not count in mamba_usage (pool_stats_observer.py:270-293).
    mamba_held_per_request: int = 1
    # Which pools sglang:token_usage is the fullest of (facts/<version>.json token_usage_pools).
    token_usage_pools: tuple[str, ...] = ("full_token_usage",)


class Replica:
    """One DP rank's scheduler loop."""

    def __init__(
        self,
        cfg: ReplicaConfig,
        version: Version,
        log: Logger,
        metrics: Registry | None,
        labels: dict[str, str],
        pid_label: str,
        on_output,
    ):
        self.cfg = cfg
        self.version = version
        self.log = log
        self.metrics = metrics
        self.labels = labels
        self.pid_label = pid_label
        self.on_output = on_output
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.wake = asyncio.Event()
        self.halted = False
        self.forward_ct_decode = 0
        self.last_decode_log = time.monotonic()
        self.tokens_since_log = 0
        self.last_prefill_time = time.monotonic()
        self.last_gen_throughput = 0.0
        self.spec_acc = 0.0
        self.win_verify = 0
        self.win_accepted = 0
        self.total_verify = 0
        self.total_accepted = 0
        self.task: asyncio.Task | None = None
        self.published_running = 0
        if metrics is not None and version.metrics_startup_constants:
            self._startup_gauges()

    # --- public --------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.loop())

    def submit(self, req: Req) -> None:
        self.waiting.append(req)
        self.wake.set()

    def busy(self) -> bool:
        return bool(self.running) or any(not r.hung for r in self.waiting)

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def avg_accept_length(self) -> float | None:
        if not self.total_verify:
            return None
        return (self.total_accepted + self.total_verify) / self.total_verify

    # --- internals -------------------------------------------------------------
    def _used_tokens(self) -> int:
        return sum(r.kv_tokens for r in self.running)

    def _admit(self) -> list[Req]:
        new: list[Req] = []
        budget = self.cfg.max_prefill_tokens
        used = self._used_tokens()
        keep: deque[Req] = deque()
        while self.waiting:
            r = self.waiting.popleft()
            if r.hung or r.aborted:
                keep.append(r)
                continue
            if len(self.running) + len(new) >= self.cfg.max_running:
                keep.append(r)
                keep.extend(self.waiting)
                self.waiting.clear()
                break
            fits_kv = used + r.prompt_tokens + 1 <= self.cfg.kv_capacity
            fits_batch = not new or budget - r.prompt_tokens >= 0
            if not fits_kv or not fits_batch:
                keep.append(r)
                keep.extend(self.waiting)
                self.waiting.clear()
                break
            budget -= r.prompt_tokens
            used += r.prompt_tokens
            new.append(r)
        self.waiting = keep
        return new

    def _mamba_used(self) -> int:
        """Mamba slots in use (not evictable): what the running requests hold."""
        return min(len(self.running) * self.cfg.mamba_held_per_request, self.cfg.mamba_k or 0)

    def _usage_part(self, prefill: bool) -> str:
        used = self._used_tokens()
        usage = used / max(1, self.cfg.kv_capacity)
        if self.cfg.mamba_k is not None:
            slots = self._mamba_used()
            mu = slots / max(1, self.cfg.mamba_k)
            if prefill:
                return f"full token usage: {usage:.2f}, mamba usage: {mu:.2f}, "
            return f"#full token: {used}, full token usage: {usage:.2f}, mamba num: {slots}, mamba usage: {mu:.2f}, "
        if prefill:
            return f"token usage: {usage:.2f}, "
        return f"#token: {used}, token usage: {usage:.2f}, "

    def _prefill_line(self, new: list[Req], gap: float) -> str:
        tokens = sum(r.prompt_tokens for r in new)
        tput = tokens / gap if gap > 0 else 0.0
        head = f"Prefill batch, #new-seq: {len(new)}, #new-token: {tokens}, #cached-token: 0, "
        head += self._usage_part(prefill=True)
        running = len(self.running) - len(new)
        queue = sum(1 for r in self.waiting if not r.aborted)
        head += f"#running-req: {running}, #queue-req: {queue}, "
        graph = "True" if (self.cfg.prefill_graph and self.version.family >= 14) else "False"
        layout = self.version.prefill_layout
        if layout == 9:
            return head + f"input throughput (token/s): {tput:.2f}, cuda graph: {graph}"
        if layout == 10:
            return head + f"cuda graph: {graph}, input throughput (token/s): {tput:.2f}"
        return head + f"#pending-token: 0, cuda graph: {graph}, input throughput (token/s): {tput:.2f}"

    def _decode_line(self, gen_tput: float) -> str:
        line = f"Decode batch, #running-req: {len(self.running)}, " + self._usage_part(prefill=False)
        if self.cfg.spec:
            steps = max(1, self.cfg.spec_steps)
            verify = max(1, self.win_verify)
            accept_len = (self.win_accepted + verify) / verify
            if self.version.accept_rate_v11:
                rate = (accept_len - 1) / max(1, self.cfg.draft_tokens - 1)
            else:
                rate = accept_len / max(1, steps * self.cfg.draft_tokens) * steps
            line += f"accept len: {accept_len:.2f}, accept rate: {min(rate, 1.0):.2f}, "
        graph = "True" if (self.cfg.decode_graph and len(self.running) <= self.cfg.decode_max_bs) else "False"
        line += f"cuda graph: {graph}, gen throughput (token/s): {gen_tput:.2f}, #queue-req: {len(self.waiting)}"
        return line

    def _startup_gauges(self) -> None:
        assert self.metrics is not None
        self.metrics.set("sglang:max_total_num_tokens", self.labels, self.cfg.kv_capacity)
        self.metrics.set("sglang:context_len", self.labels, self.cfg.context_len)
        self.metrics.set("sglang:page_size", self.labels, self.cfg.page_size)

    def _publish(self, gen_tput: float | None = None) -> None:
        if self.metrics is None:
            return
        m, lab = self.metrics, self.labels
        used = self._used_tokens()
        self.published_running = len(self.running)
        m.set("sglang:num_running_reqs", lab, len(self.running))
        m.set("sglang:num_queue_reqs", lab, len(self.waiting))
        m.set("sglang:num_used_tokens", lab, used)
        usage = {"full_token_usage": used / max(1, self.cfg.kv_capacity)}
        if self.cfg.mamba_k is not None:
            usage["mamba_usage"] = self._mamba_used() / max(1, self.cfg.mamba_k)
        # 0.5.14+: the fullest pool (pool_stats_observer.get_max_pool_usage); 0.5.9: the KV cache.
        fullest = max(v for k, v in usage.items() if k in self.cfg.token_usage_pools)
        m.set("sglang:token_usage", lab, round(fullest, 2))
        m.set("sglang:gen_throughput", lab, gen_tput if gen_tput is not None else self.last_gen_throughput)
        m.set("sglang:cache_hit_rate", lab, 0.0)
        m.set("sglang:max_total_num_tokens", lab, self.cfg.kv_capacity)
        m.set("sglang:num_retracted_reqs", {**lab, "pid": self.pid_label}, 0)
        if self.version.family >= 14:
            m.set("sglang:full_token_usage", lab, usage["full_token_usage"])
        if "mamba_usage" in usage:
            m.set("sglang:mamba_usage", lab, usage["mamba_usage"])
        if self.cfg.spec and self.win_verify:
            al = (self.win_accepted + self.win_verify) / self.win_verify
            m.set("sglang:spec_accept_length", lab, round(al, 2))
            m.set("sglang:spec_accept_rate", lab, round((al - 1) / max(1, self.cfg.draft_tokens - 1), 2))

    def _count_tokens(self, mode: str, tokens: int) -> None:
        """sglang:realtime_tokens_total: tokens processed, by mode, as each batch runs."""
        if self.metrics is not None:
            self.metrics.inc("sglang:realtime_tokens_total", {**self.labels, "mode": mode}, tokens)

    def _emit(self, r: Req, n: int, now: float) -> None:
        r.produced += n
        if r.first_token_at is None:
            r.first_token_at = now
        if r.produced >= r.target:
            r.produced = r.target
            if r.max_new < r.completion.natural_len:
                r.finish = {"type": "length", "length": r.max_new}
            else:
                r.finish = {"type": "stop", "matched": r.eos_id}
            r.finished_at = now
        self.on_output(r)

    async def loop(self) -> None:
        while True:
            if self.halted:
                await asyncio.sleep(0.2)
                continue
            active = self.running or any(not (r.hung or r.aborted) for r in self.waiting)
            if not active:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), self.cfg.idle_metrics_s)
                except TimeoutError:
                    self.last_gen_throughput = 0.0
                    self._publish(0.0)
                continue
            new = self._admit()
            if new:
                self.running.extend(new)
                tokens = sum(r.prompt_tokens for r in new)
                await asyncio.sleep(self.cfg.step_base_s + tokens / max(1.0, self.cfg.prefill_tps))
                if self.halted:
                    continue
                now = time.monotonic()
                gap = now - self.last_prefill_time
                self.last_prefill_time = now
                if any(r.log_metrics or r.is_health for r in new):
                    self.log.info(self._prefill_line(new, gap))
                for r in new:
                    self._emit(r, 1, now)
                self._count_tokens("prefill_compute", tokens)
                self._publish()
            elif self.running:
                n = len(self.running)
                await asyncio.sleep(self.cfg.step_base_s + self.cfg.step_per_req_s * n)
                if self.halted:
                    continue
                now = time.monotonic()
                per = 1
                if self.cfg.spec:
                    before = self.spec_acc
                    self.spec_acc += self.cfg.accept_length
                    per = max(1, min(self.cfg.draft_tokens, int(self.spec_acc) - int(before)))
                    self.win_verify += n
                    self.total_verify += n
                    self.win_accepted += n * (per - 1)
                    self.total_accepted += n * (per - 1)
                for r in list(self.running):
                    r.verify_ct += 1 if self.cfg.spec else 0
                    r.accepted_drafts += (per - 1) if self.cfg.spec else 0
                    before_p = r.produced
                    self._emit(r, per, now)
                    self.tokens_since_log += r.produced - before_p
                # Every decode step: batch size + accepted draft tokens (0.5.9
                # managers/scheduler_metrics_mixin.py:480 log_decode_stats_every_iteration).
                self._count_tokens("decode", n * per)
                self.forward_ct_decode += 1
                if self.forward_ct_decode % max(1, self.cfg.decode_log_interval) == 0:
                    elapsed = max(1e-6, now - self.last_decode_log)
                    tput = self.tokens_since_log / elapsed
                    self.last_gen_throughput = tput
                    self.log.info(self._decode_line(tput))
                    self._publish(tput)
                    self.last_decode_log = now
                    self.tokens_since_log = 0
                    self.win_verify = 0
                    self.win_accepted = 0
            self.running = [r for r in self.running if r.finish is None and not r.aborted]
            if self.version.family >= 23 and self.published_running != len(self.running):
                # v23 republishes when the running-requests gauge disagrees with reality.
                self._publish()


class Tokenizer:
    """Tokenizer-side request metrics (counters and latency histograms)."""

    def __init__(self, version: Version, metrics: Registry | None, model_name: str):
        self.version = version
        self.metrics = metrics
        self.model_name = model_name

    def labels(self, streaming: bool, with_stream_label: bool = True) -> dict[str, str]:
        lab = {"model_name": self.model_name}
        if self.version.tokenizer_metric_engine_type:
            lab["engine_type"] = "unified"
        if with_stream_label and self.version.metric_is_streaming:
            lab["is_streaming"] = "true" if streaming else "false"
        return lab

    def first_token(self, r: Req) -> None:
        if self.metrics is None or not r.log_metrics or r.first_token_at is None:
            return
        self.metrics.observe(
            "sglang:time_to_first_token_seconds", self.labels(r.stream), r.first_token_at - r.created, TTFT_BUCKETS
        )

    def finished(self, r: Req) -> None:
        if self.metrics is None or not r.log_metrics:
            return
        lab = self.labels(r.stream)
        self.metrics.inc("sglang:prompt_tokens_total", lab, r.prompt_tokens)
        self.metrics.inc("sglang:generation_tokens_total", lab, r.produced)
        self.metrics.inc("sglang:num_requests_total", lab, 1)
        cached = {**self.labels(r.stream, with_stream_label=False), "cache_source": "device"}
        self.metrics.inc("sglang:cached_tokens_total", cached, 0)
        end = r.finished_at or time.monotonic()
        self.metrics.observe("sglang:e2e_request_latency_seconds", lab, end - r.created, E2E_BUCKETS)

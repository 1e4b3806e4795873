"""Child processes: schedulers (the only GPU holders), the detokenizer and the DP controller.

Started as ``python -m gpusim.worker ROLE FD --pad=...``; the padding keeps the argv area
long enough for the ``sglang::...`` titles. The spec arrives as the first message on FD.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpusim import driver, memory, proctitle, procutil, registry, startup
from gpusim.channel import Channel
from gpusim.logutil import Logger
from gpusim.profiles import ModelProfile
from gpusim.versions import Version

PAD = "--pad=" + "." * 72


def spawn(role: str, sock_fd: int, extra_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gpusim.worker", role, str(sock_fd), PAD]
    return subprocess.Popen(cmd, pass_fds=(sock_fd, *extra_fds), stdin=subprocess.DEVNULL, close_fds=True)


def _default_signals() -> None:
    # A fault may have set SIGTERM to SIG_IGN in the parent; dispositions survive exec.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _fake_traceback(exc_type: str, message: str) -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "/usr/local/lib/python3.11/dist-packages/sglang/srt/managers/scheduler.py", '
        "line 2987, in run_scheduler_process\n"
        "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)\n"
        '  File "/usr/local/lib/python3.11/dist-packages/sglang/srt/model_executor/model_runner.py", '
        "line 412, in __init__\n"
        "    self.initialize(min_per_gpu_memory)\n"
        f"{exc_type}: {message}\n"
    )


class Scheduler:
    def __init__(self, chan: Channel, spec: dict[str, Any]):
        self.chan = chan
        self.spec = spec
        self.log = Logger(spec["log_stream"], spec["log_prefix"], spec["log_level"])
        self.version = Version.of(spec["version"])
        self.t0 = time.monotonic()
        self.startup_s = float(spec["startup_s"])
        self.heartbeat_s = float(spec["heartbeat_s"])
        self.handle: registry.AllocationHandle | None = None
        self.fds: list[int] = []
        self.crash = spec.get("crash")
        self.detached = bool(spec.get("detached"))

    # --- helpers -----------------------------------------------------------
    def _wait_until(self, frac: float) -> None:
        """Sleep to ``frac`` of the startup delay, heartbeating, failing at the crash point."""
        target = self.t0 + frac * self.startup_s
        if self.crash is not None and float(self.crash.get("at_fraction", 0.5)) <= frac:
            target = self.t0 + float(self.crash.get("at_fraction", 0.5)) * self.startup_s
            self._sleep_to(target)
            raise memory.StartupError(
                str(self.crash.get("exc_type", "RuntimeError")),
                str(self.crash.get("message", "Simulated scheduler failure during startup (gpusim fault).")),
            )
        self._sleep_to(target)

    def _sleep_to(self, target: float) -> None:
        while True:
            now = time.monotonic()
            if now >= target:
                return
            time.sleep(min(self.heartbeat_s, target - now))
            if self.handle:
                self.handle.heartbeat()

    def _set_mib(self, mib: float) -> None:
        if self.handle:
            self.handle.set_mib(round(mib))

    # --- lifecycle -----------------------------------------------------------
    def run(self) -> None:
        try:
            info = self.startup()
        except memory.StartupError as exc:
            self.fail(exc.exc_type, exc.message)
            return
        self.chan.send({"op": "ready", "info": info})
        self.serve()

    def fail(self, exc_type: str, message: str) -> None:
        self.log.error(f"Scheduler hit an exception: {_fake_traceback(exc_type, message)}")
        # SGLang signals its parent process; a scheduler whose parent is gone (reparented) has no
        # one to tell, and the number it was given may since name another process.
        if os.getppid() == int(self.spec["main_pid"]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(self.spec["main_pid"]), signal.SIGQUIT)
        # The parent kills the whole tree; linger like the real process until then.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(self.heartbeat_s)
            if self.handle:
                self.handle.heartbeat()
        os._exit(0)

    def startup(self) -> dict[str, Any]:
        """The scheduler's start as SGLang runs it: torch distributed, the weights, the pools, the
        CUDA graphs, a 0.5.9 draft loaded after them, then the summary; GPU memory taken step by
        step, each step's lines written by gpusim/startup.py."""
        spec = self.spec
        prof = ModelProfile(**spec["profile"])
        others = self._init_torch_distributed(prof)
        inp = memory.MemoryInputs(
            **{
                **spec["memory"],
                "version": self.version,
                "profile": prof,
                "others_mib": others,
                "gpu_index": int(spec["gpu_logical"]),
            }
        )
        plan = self._load_weights(inp, prof)
        rank0 = int(spec["tp_rank"]) == 0
        lines = startup.startup_lines(inp, plan, spec["args_for_log"], rank0=rank0, startup_s=self.startup_s)
        self._say(lines, "weights")
        self._wait_until(0.7)
        self._say(lines, "sizing", "pools")
        self._set_mib(prof.context_mib + plan.weights_mib + plan.pools_mib)
        self._say(lines, "pools_end")
        self._capture_cuda_graphs(inp, plan, lines)
        if plan.late_draft_mib:
            self._say(lines, "late_draft")
            self._set_mib(plan.final_mib)
        self._wait_until(1.0)
        self._say(lines, "warnings", "summary")
        return {
            "status": "ready",
            "max_total_num_tokens": plan.kv_tokens,
            # The scheduler's: min(context_len - 1, KV pool - 1) - 5 (0.5.23
            # managers/tp_worker.py:568-572, 0.5.9 managers/tp_worker.py:287-291).
            "max_req_input_len": min(int(spec["args_for_log"]["context_len"]) - 1, plan.kv_tokens - 1) - 5,
            "max_running_requests": plan.max_running,
            "max_mamba_cache_size": plan.mamba_k,
            "mamba_ratio": plan.mamba_ratio,
            **startup.memory_usage(inp, plan),
            "final_mib": plan.final_mib,
            "pid": os.getpid(),
        }

    def _init_torch_distributed(self, prof: ModelProfile) -> int:
        """Open the GPU's device nodes and take the CUDA context; the MiB others hold on the GPU."""
        spec = self.spec
        phys = int(spec["gpu_physical"])
        devdir = Path(spec["devices_dir"])
        self.log.info("Init torch distributed begin.")
        if phys < 0:
            raise memory.StartupError(
                "torch.AcceleratorError",
                "CUDA error: invalid device ordinal\nCUDA kernel errors might be asynchronously reported at some "
                "other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
                "CUDA_LAUNCH_BLOCKING=1",
            )
        for name in (f"nvidia{phys}", "nvidiactl"):
            try:
                self.fds.append(os.open(devdir / name, os.O_RDWR))
            except OSError as exc:
                raise memory.StartupError(
                    "RuntimeError",
                    f"CUDA error: no CUDA-capable device is detected ({devdir / name}: {exc.strerror})",
                ) from None
        me = os.getpid()
        alloc = registry.Allocation(
            pid=me,
            start_time=procutil.start_time(me) or 0,
            gpu=phys,
            mib=prof.context_mib,
            title=spec["title"],
            port=spec.get("port"),
            never_release=bool(spec.get("never_release")),
        )
        self.handle = registry.AllocationHandle(Path(spec["state_dir"]), alloc)
        others = self._others_mib(phys)
        self._wait_until(0.05)
        self.log.info(
            f"Init torch distributed ends. elapsed={0.05 * self.startup_s:.2f} s, "
            f"mem usage={prof.context_mib / 1024:.2f} GB"
        )
        return others

    def _load_weights(self, inp: memory.MemoryInputs, prof: ModelProfile) -> memory.MemoryPlan:
        """The weights come in step by step; a start that fails (out of memory now, or later at
        the pools) fails after the memory it took."""
        avail0 = inp.total_mib / 1024 - inp.others_mib / 1024 - prof.context_mib / 1024
        self.log.info(startup.load_weight_begin(avail0))
        w = memory.weights_gib(inp)
        try:
            plan = memory.plan(inp)
            failure: memory.StartupError | None = None
        except memory.StartupError as exc:
            failure = exc
        if w > avail0:
            self._wait_until(0.2)
            self._set_mib(prof.context_mib + max(avail0, 0) * 1024)
            assert failure is not None
            raise failure
        steps = 5
        for i in range(1, steps + 1):
            self._wait_until(0.05 + 0.5 * i / steps)
            self._set_mib(prof.context_mib + w * 1024 * i / steps)
        if failure is not None:
            self._wait_until(0.7)
            raise failure
        return plan

    def _capture_cuda_graphs(
        self, inp: memory.MemoryInputs, plan: memory.MemoryPlan, lines: startup.StartupLines
    ) -> None:
        """The graphs' working set must fit outside the static pool, or CUDA runs out."""
        if not inp.cuda_graph_enabled:
            oom = memory.check_headroom(inp, plan)
            if oom:
                raise oom
            return
        self._say(lines, "graph_begin")
        self._wait_until(0.8)
        oom = memory.check_headroom(inp, plan)
        if oom:
            raise oom
        self._wait_until(0.95)
        self._set_mib(plan.final_mib - plan.late_draft_mib)
        self._say(lines, "graph_end")

    def _say(self, lines: startup.StartupLines, *stages: str) -> None:
        for stage in stages:
            for level, text in lines.stages[stage]:
                getattr(self.log, level)(text)

    def _others_mib(self, phys: int) -> int:
        holders = registry.scan(Path(self.spec["state_dir"]), float(self.spec["release_delay_s"]))
        mine = self.handle.alloc.key if self.handle else None
        other = sum(h.alloc.mib for h in holders if h.alloc.gpu == phys and h.alloc.key != mine)
        return other + int(self.spec.get("idle_used_mib", 0))

    def serve(self) -> None:
        obey = not self.detached or bool(self.spec.get("detached_obeys_shutdown"))
        while True:
            msg = None if self.chan.closed else self.chan.recv(timeout=self.heartbeat_s)
            if self.chan.closed:
                time.sleep(self.heartbeat_s)
            if self.handle:
                self.handle.heartbeat()
            if msg and msg.get("op") == "get_internal_state":
                # The tokenizer's GetInternalStateReq: answered from the event loop, so a scheduler
                # that is stopped, stuck or dead never answers (reference 3.2, sglang#4191).
                self.chan.send({"op": "internal_state", "id": msg.get("id"), "pid": os.getpid()})
            if msg and msg.get("op") == "shutdown" and obey:
                # ShutdownReq: leave the event loop, release host resources, exit. The driver
                # frees the GPU memory only after the process is gone.
                time.sleep(float(self.spec.get("shutdown_s", 0.2)))
                os._exit(0)


def _detach() -> None:
    """Double fork into a new session so the scheduler is re-parented away from main."""
    r, w = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.setsid()
    pid2 = os.fork()
    if pid2 > 0:
        os._exit(0)
    proctitle.clear_pdeathsig()
    os.write(w, b"x")
    os.close(w)


def _teardown(spec: dict[str, Any], title: str) -> None:
    """Have the host's driver hold this process in teardown when it is killed (see driver.py)."""
    if spec.get("state_dir"):
        driver.register(Path(spec["state_dir"]), float(spec.get("teardown_s") or 0.0), title)


def run_scheduler(chan: Channel, spec: dict[str, Any]) -> None:
    if spec.get("detached"):
        _detach()
    else:
        proctitle.set_pdeathsig(signal.SIGKILL)
    proctitle.set_title(spec["title"])
    # After the detach: the intermediate processes of the double fork exit normally.
    _teardown(spec, spec["title"])
    Scheduler(chan, spec).run()


def run_idle(title: str, spec: dict[str, Any]) -> None:
    proctitle.set_pdeathsig(signal.SIGKILL)
    proctitle.set_title(title)
    _teardown(spec, title)
    while True:
        signal.pause()


def run_dp_controller(chan: Channel, spec: dict[str, Any]) -> None:
    proctitle.set_pdeathsig(signal.SIGKILL)
    proctitle.set_title("sglang::data_parallel_controller")
    _teardown(spec, "sglang::data_parallel_controller")
    procs = []
    for child in spec["schedulers"]:
        fd = int(child["fd"])
        procs.append(spawn("scheduler", fd))
        os.close(fd)
    while True:
        time.sleep(1.0)
        for p in procs:
            p.poll()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    role, fd = argv[0], int(argv[1])
    _default_signals()
    if role == "scheduler":
        # Set before anything slow: the window until here is the real startup gap.
        proctitle.set_pdeathsig(signal.SIGKILL)
    chan = Channel.from_fd(fd)
    spec = chan.recv(timeout=30)
    if spec is None:
        os._exit(1)
    try:
        if role == "scheduler":
            run_scheduler(chan, spec)
        elif role == "detokenizer":
            run_idle("sglang::detokenizer", spec)
        elif role == "dp_controller":
            run_dp_controller(chan, spec)
        else:
            raise SystemExit(f"unknown worker role {role}")
    except Exception:
        traceback.print_exc()
        os._exit(1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

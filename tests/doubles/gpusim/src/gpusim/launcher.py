"""The main process of ``python -m sglang.launch_server``: launch, serve, signals, shutdown.

Follows reference section 2: schedulers and the detokenizer are spawned first, the port is
bound only after every scheduler reports ready, the warmup thread decides when the server
is Up, and SIGTERM/SIGQUIT/child death follow the version's code paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from gpusim import cli_parser, driver, procutil, release_facts, resolve
from gpusim.channel import Channel
from gpusim.config import Config, ConfigError
from gpusim.engine import Replica, ReplicaConfig, Tokenizer
from gpusim.httpserver import HTTPServer
from gpusim.logutil import Logger, UvicornLogger, bare_stderr
from gpusim.metrics import Registry, new_registry
from gpusim.profiles import ModelProfile
from gpusim.versions import Version
from gpusim.worker import spawn


class SchedulerProc:
    def __init__(self, dp_rank: int | None, tp_rank: int, logical: int, physical: int, title: str, prefix: str):
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank
        self.logical = logical
        self.physical = physical
        self.title = title
        self.prefix = prefix
        self.popen: subprocess.Popen | None = None
        self.chan: Channel | None = None
        self.child_fd: int = -1
        self.detached = False
        self.info: dict[str, Any] | None = None
        self.pid: int | None = None
        self.dead = False


def _frozen(pid: int) -> bool:
    """Stopped: held in teardown by the driver (``t``) or by SIGSTOP (``T``)."""
    return procutil.state(pid) in ("t", "T")


def _title_suffix(dp_rank: int | None, tp_rank: int, tp_size: int) -> str:
    prefix = ""
    if dp_rank is not None:
        prefix += f" DP{dp_rank}"
    if tp_size > 1:
        prefix += f" TP{tp_rank}"
    return prefix


class Launcher:
    def __init__(self, cfg: Config, version: Version, argv: list[str]):
        self.cfg = cfg
        self.version = version
        self.argv = argv
        self.t_start = time.time()
        self.raw: dict[str, Any] = {}
        self.res: resolve.Resolved
        self.args: dict[str, Any] = {}
        self.profile: ModelProfile
        self.log: Logger
        self.uvlog: UvicornLogger
        self.schedulers: list[SchedulerProc] = []
        self.detok: subprocess.Popen | None = None
        self.dp_ctrl: subprocess.Popen | None = None
        self.tracker: subprocess.Popen | None = None
        self.tracker_w: int | None = None
        self.status = "Starting"
        self.gracefully_exit = False
        self.handlers_installed = False
        self.watchdog_stop = threading.Event()
        self.watchdog_thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.exit_code = 0
        self.raise_signal_at_exit: int | None = None
        self.replicas: list[Replica] = []
        self.rr = 0
        self.rid_to_state: dict[str, Any] = {}
        self.last_receive_tstamp = 0.0
        self.user_requests = 0
        self.metrics: Registry | None = None
        self.tokenizer: Tokenizer
        self.ready_time = 0.0
        self.http: HTTPServer | None = None
        self.warmup_thread: threading.Thread | None = None
        self.port = 30000
        self.host = "127.0.0.1"
        self.bg_tasks: set[asyncio.Task] = set()
        self.detok_dead = False
        self.state_req_id = 0
        self.state_waiters: dict[int, asyncio.Future] = {}

    # ------------------------------------------------------------------ helpers
    def fault(self, kind: str):
        return self.cfg.fault(kind, self.port, self.raw)

    def timing(self, key: str) -> float:
        return float(self.cfg.timing[key])

    def kill_tree(self, include_parent: bool = True, wait_timeout: float | None = None) -> None:
        """kill_process_tree(os.getpid()): SIGKILL every descendant, then (optionally) itself."""
        me = os.getpid()
        if self.version.kill_tree_log:
            self.log.info(f"kill_process_tree called: parent_pid={me}, include_parent={include_parent}, pid={me}")
        killed = procutil.kill_children(me)
        if include_parent:
            os.kill(me, signal.SIGKILL)
            time.sleep(5)
        if wait_timeout:
            procutil.wait_gone(killed, wait_timeout)
        for p in self._popens():
            with contextlib.suppress(Exception):
                p.poll()

    def stop_watchdog(self) -> None:
        # The real process exits within milliseconds of its final kill_process_tree, so its 1 s
        # watchdog practically never sees those kills; stopping it first keeps that outcome stable.
        self.watchdog_stop.set()
        if self.watchdog_thread is not None and self.watchdog_thread is not threading.current_thread():
            self.watchdog_thread.join(timeout=2)

    def _popens(self) -> list[subprocess.Popen]:
        out = [s.popen for s in self.schedulers if s.popen is not None]
        out += [p for p in (self.detok, self.dp_ctrl, self.tracker) if p is not None]
        return out

    # ------------------------------------------------------------------ startup
    def prepare(self) -> None:
        raw = cli_parser.parse_args(self.argv, self.version)
        self.raw = raw
        self.port = int(raw.get("port") or 30000)
        self.host = raw.get("host") or "127.0.0.1"
        self.profile = self.cfg.profile_for(raw["model_path"])
        pre_logger_bare = self.version.family < 14
        try:
            res = resolve.resolve(raw, self.version, self.cfg, self.profile)
        except resolve.ResolveError as exc:
            self._emit_pre([], pre_logger_bare)
            raise _Crash(exc.exc_type, exc.message) from None
        self.res = res
        self.args = res.args
        self._emit_pre(res.messages, pre_logger_bare)
        stream = self.cfg.log_stream
        self.log = Logger(stream, "", self.args.get("log_level") or "info")
        level_http = self.args.get("log_level_http") or self.args.get("log_level") or "info"
        self.uvlog = UvicornLogger(
            level_http,
            access_stream="stdout",
            default_stream="stdout" if stream == "stdout" else "stderr",
        )

    def _emit_pre(self, messages: list[tuple[str, str]], bare: bool) -> None:
        pre = Logger("stderr", "", "info")
        for level, msg in messages:
            if bare:
                if level != "info":
                    bare_stderr(msg)
            else:
                pre.log(30 if level == "warning" else 20, msg)

    def launch(self) -> None:
        a = self.args
        exact = self.version.family in (9, 23)
        order = cli_parser.field_order(self.version)
        self.log.info(f"server_args={resolve.server_args_repr(a, order, exact)}")
        signal.signal(signal.SIGQUIT, self._launch_phase_sigquit)
        if self.fault("ignore_sigterm"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        tp = int(a.get("tp_size") or 1)
        dp = int(a.get("dp_size") or 1)
        base = int(a.get("base_gpu_id") or 0)
        step = int(a.get("gpu_id_step") or 1)
        visible = resolve.visible_physical(self.cfg)
        for d in range(dp):
            for t in range(tp):
                logical = base + (d * tp + t) * step
                dp_rank = d if dp > 1 else None
                prefix = _title_suffix(dp_rank, t, tp)
                phys = visible[logical] if logical < len(visible) else -1
                self.schedulers.append(
                    SchedulerProc(dp_rank, t, logical, phys, f"sglang::scheduler{prefix.replace(' ', '_')}", prefix)
                )
        self._spawn_tracker()
        detach = self.fault("detach_scheduler")
        never = self.fault("never_release")
        crash = self.fault("startup_crash")
        detach_ranks = None
        if detach is not None and detach.params.get("ranks") is not None:
            detach_ranks = {int(x) for x in detach.params["ranks"]}
        for i, s in enumerate(self.schedulers):
            mine, theirs = socket.socketpair()
            s.chan = Channel(mine)
            s.child_fd = theirs.detach()
            s.detached = detach is not None and (detach_ranks is None or i in detach_ranks)
            s.chan.send(self._scheduler_spec(s, never is not None, crash, detach))
        if dp > 1:
            ctrl_a, ctrl_b = socket.socketpair()
            fds = tuple(s.child_fd for s in self.schedulers)
            cfd = ctrl_b.detach()
            self.dp_ctrl = spawn("dp_controller", cfd, fds)
            os.close(cfd)
            Channel(ctrl_a).send({"schedulers": [{"fd": s.child_fd} for s in self.schedulers], **self._teardown_spec()})
            self._keep_ctrl = ctrl_a
        else:
            for s in self.schedulers:
                s.popen = spawn("scheduler", s.child_fd)
                s.pid = s.popen.pid
        for s in self.schedulers:
            os.close(s.child_fd)
        det_a, det_b = socket.socketpair()
        dfd = det_b.detach()
        self.detok = spawn("detokenizer", dfd)
        os.close(dfd)
        Channel(det_a).send(self._teardown_spec())
        self._keep_detok = det_a
        self._wait_for_ready()
        if self.version.subprocess_watchdog:
            self.watchdog_thread = threading.Thread(target=self._watchdog, daemon=True, name="subprocess-watchdog")
            self.watchdog_thread.start()

    def _teardown_spec(self) -> dict[str, Any]:
        return {"teardown_s": self.timing("teardown_s"), "state_dir": str(self.cfg.state_dir())}

    def _spawn_tracker(self) -> None:
        r, w = os.pipe()
        try:
            self.tracker = subprocess.Popen(
                [sys.executable, "-c", f"from multiprocessing.resource_tracker import main;main({r})"],
                pass_fds=(r,),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(r)
        self.tracker_w = w

    def _scheduler_spec(self, s: SchedulerProc, never: bool, crash, detach) -> dict[str, Any]:
        a, res, prof = self.args, self.res, self.profile
        gpu = self.cfg.gpus[s.physical] if 0 <= s.physical < len(self.cfg.gpus) else None
        mem = {
            "total_mib": gpu.memory_total_mib if gpu else 0,
            "mem_fraction_static": float(a["mem_fraction_static"]),
            "tp_size": int(a.get("tp_size") or 1),
            "spec": res.spec,
            "spec_mtp": res.spec_mtp,
            "draft_tokens": res.draft_tokens,
            "max_running_requests": a.get("max_running_requests"),
            "max_mamba_cache_size": a.get("max_mamba_cache_size"),
            "mamba_full_memory_ratio": res.mamba_full_memory_ratio,
            "mamba_ssm_dtype": a.get("mamba_ssm_dtype"),
            "mamba_ratio": res.mamba_ratio,
            "disable_radix_cache": bool(a.get("disable_radix_cache")),
            "page_size": int(a.get("page_size") or 1),
            "max_total_tokens": a.get("max_total_tokens"),
            "context_len": res.context_len,
            "cuda_graph_enabled": res.decode_graph,
            "cuda_graph_max_bs": res.decode_max_bs,
        }
        crash_spec = None
        if crash is not None:
            crash_spec = {
                "at_fraction": float(crash.params.get("at_fraction", 0.5)),
                "message": crash.params.get("message", "Simulated scheduler failure during startup (gpusim fault)."),
                "exc_type": crash.params.get("exc_type", "RuntimeError"),
            }
        return {
            "title": s.title,
            "log_prefix": s.prefix,
            "log_stream": self.cfg.log_stream,
            "log_level": a.get("log_level") or "info",
            "version": str(self.version),
            "tp_rank": s.tp_rank,
            "gpu_physical": s.physical,
            "gpu_logical": s.logical,
            "idle_used_mib": gpu.idle_used_mib if gpu else 0,
            "main_pid": os.getpid(),
            "detached": s.detached,
            "detached_obeys_shutdown": bool(detach.params.get("obey_shutdown")) if detach else False,
            "never_release": never,
            "crash": crash_spec,
            "startup_s": self.timing("startup_s"),
            "heartbeat_s": self.timing("heartbeat_s"),
            "shutdown_s": self.timing("scheduler_shutdown_s"),
            "release_delay_s": self.timing("release_delay_s"),
            "teardown_s": self.timing("teardown_s"),
            "state_dir": str(self.cfg.state_dir()),
            "devices_dir": str(self.cfg.devices_dir),
            "port": self.port,
            "profile": prof.to_dict(),
            "memory": mem,
            "args_for_log": {
                "chunked_prefill_size": a["chunked_prefill_size"],
                "max_prefill_tokens": a["max_prefill_tokens"],
                "context_len": res.context_len,
            },
        }

    def _wait_for_ready(self) -> None:
        sel = selectors.DefaultSelector()
        for i, s in enumerate(self.schedulers):
            assert s.chan is not None
            sel.register(s.chan.sock, selectors.EVENT_READ, i)
        pending = set(range(len(self.schedulers)))
        while pending:
            for key, _ in sel.select(timeout=0.5):
                i = key.data
                s = self.schedulers[i]
                assert s.chan is not None
                msg = s.chan.recv(timeout=0)
                if msg is None and s.chan.closed:
                    sel.unregister(s.chan.sock)
                    self._scheduler_died_during_init(i)
                if msg and msg.get("op") == "ready":
                    s.info = msg["info"]
                    s.pid = s.info.get("pid", s.pid)
                    pending.discard(i)
                    sel.unregister(s.chan.sock)
        self.ready_time = time.time()

    def _scheduler_died_during_init(self, rank: int) -> None:
        s = self.schedulers[rank]
        code: int | None = None
        if s.popen is not None:
            try:
                code = s.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
        if self.version.family < 14:
            self.log.error(f"Rank {rank} scheduler is dead. Please check if there are relevant logs.")
            self.log.error(f"Exit code: {code}")
            raise _Crash("EOFError", "")
        raise _Crash(
            "RuntimeError",
            f"Rank {rank} scheduler died during initialization (exit code: {code}). "
            "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer. "
            "Run `dmesg -T | grep -i oom` to check.",
        )

    def _launch_phase_sigquit(self, signum, frame) -> None:
        self.log.error("Received sigquit from a child process. It usually means the child failed.")
        self.kill_tree(include_parent=True)

    def _running_phase_sigquit(self, signum, frame) -> None:
        self.log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        self.watchdog_stop.set()
        self.kill_tree(include_parent=True)

    def _watchdog(self) -> None:
        procs: list[tuple[subprocess.Popen, str]] = []
        if self.dp_ctrl is not None:
            procs.append((self.dp_ctrl, "scheduler_0"))
        else:
            procs += [(s.popen, f"scheduler_{i}") for i, s in enumerate(self.schedulers) if s.popen is not None]
        if self.detok is not None:
            procs.append((self.detok, "detokenizer"))
        interval = self.timing("subprocess_watchdog_s")
        while not self.watchdog_stop.wait(interval):
            for proc, name in procs:
                code = proc.poll()
                if code is None or code == 0:
                    continue
                self.log.error(
                    f"Subprocess {name} (pid={proc.pid}) crashed with exit code {code}. "
                    "Triggering SIGQUIT for cleanup..."
                )
                os.kill(os.getpid(), signal.SIGQUIT)
                return

    # ------------------------------------------------------------------ serving
    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.stop_event = asyncio.Event()
        self._build_engine()
        from gpusim.api import Api  # noqa: PLC0415  (api imports launcher types)

        api = Api(self)
        self.http = HTTPServer(api.handle, self.uvlog)
        uv = self.uvlog
        uv.info(f"Started server process [{os.getpid()}]")
        uv.info("Waiting for application startup.")
        self.warmup_thread = threading.Thread(target=self._warmup, name="warmup", daemon=True)
        self.warmup_thread.start()
        uv.info("Application startup complete.")
        try:
            if self.fault("port_taken"):
                raise OSError(98, os.strerror(98))
            await self.http.bind(self.host, self.port)
        except OSError as exc:
            errno_ = exc.errno or 98
            uv.error(
                f"[Errno {errno_}] error while attempting to bind on address ({self.host!r}, {self.port}): "
                f"[errno {errno_}] {os.strerror(errno_).lower()}"
            )
            uv.info("Waiting for application shutdown.")
            self.warmup_thread.join()
            uv.info("Application shutdown complete.")
            return 1
        shown = f"[{self.host}]" if ":" in self.host else self.host
        uv.info(f"Uvicorn running on http://{shown}:{self.port} (Press CTRL+C to quit)")
        if not self.fault("ignore_sigterm"):
            loop.add_signal_handler(signal.SIGTERM, self._uvicorn_signal, signal.SIGTERM)
        loop.add_signal_handler(signal.SIGINT, self._uvicorn_signal, signal.SIGINT)
        for r in self.replicas:
            r.start()
        self._task(self._monitor_children())
        await self.stop_event.wait()
        return self.exit_code

    def _task(self, coro) -> asyncio.Task:
        assert self.loop is not None
        t = self.loop.create_task(coro)
        self.bg_tasks.add(t)
        t.add_done_callback(self.bg_tasks.discard)
        return t

    def _build_engine(self) -> None:
        a, res = self.args, self.res
        served = a["served_model_name"]
        if a.get("enable_metrics"):
            self.metrics = new_registry()
        self.tokenizer = Tokenizer(self.version, self.metrics, served)
        gen = self.cfg.generation
        dp = int(a.get("dp_size") or 1)
        for d in range(dp):
            rank0 = next(s for s in self.schedulers if (s.dp_rank or 0) == d and s.tp_rank == 0)
            info = rank0.info or {}
            labels = {
                "engine_type": "unified",
                "model_name": served,
                "moe_ep_rank": "0",
                "pp_rank": "0",
                "tp_rank": "0",
            }
            if dp > 1:
                labels["dp_rank"] = str(d)
            rc = ReplicaConfig(
                dp_rank=d if dp > 1 else None,
                log_prefix=rank0.prefix,
                kv_capacity=int(info.get("max_total_num_tokens", 1)),
                max_running=int(info.get("max_running_requests", 1)),
                mamba_k=info.get("max_mamba_cache_size"),
                mamba_ratio=int(info.get("mamba_ratio", 1)),
                mamba_held_per_request=resolve.mamba_slots_held_per_request(res),
                token_usage_pools=tuple(release_facts.token_usage_pools(self.version)),
                decode_graph=res.decode_graph,
                prefill_graph=res.prefill_graph,
                decode_max_bs=res.decode_max_bs,
                decode_log_interval=int(a.get("decode_log_interval") or 40),
                max_prefill_tokens=int(a.get("max_prefill_tokens") or 16384),
                spec=res.spec,
                spec_steps=res.spec_steps,
                draft_tokens=max(1, res.draft_tokens),
                accept_length=float(gen["spec_accept_length"]),
                step_base_s=self.timing("step_base_s"),
                step_per_req_s=self.timing("step_per_req_s"),
                prefill_tps=self.timing("prefill_tokens_per_s"),
                idle_metrics_s=self.timing("idle_metrics_s"),
                context_len=res.context_len,
                page_size=int(a.get("page_size") or 1),
            )
            log = Logger(self.cfg.log_stream, rank0.prefix, a.get("log_level") or "info")
            self.replicas.append(
                Replica(rc, self.version, log, self.metrics, labels, str(rank0.pid or 0), self._on_output)
            )

    def _on_output(self, r) -> None:
        self.last_receive_tstamp = time.time()
        if not r.ttft_recorded and r.first_token_at is not None and not r.is_health:
            r.ttft_recorded = True
            self.tokenizer.first_token(r)
        if r.events is not None:
            r.events.put_nowait(r.produced)
        if r.finish is not None:
            self.rid_to_state.pop(r.rid, None)
            if not r.is_health:
                self.tokenizer.finished(r)
            if r.done is not None and not r.done.done():
                r.done.set_result(r)

    def pick_replica(self) -> Replica:
        r = self.replicas[self.rr % len(self.replicas)]
        self.rr += 1
        return r

    async def _monitor_children(self) -> None:
        """A scheduler or detokenizer that dies after startup stops all output (v9's "zombie
        service"); one that is stopped (held in teardown, or SIGSTOPped) produces nothing while it is."""
        loop = asyncio.get_running_loop()
        for s in self.schedulers:
            if s.chan is not None and not s.chan.closed:
                loop.add_reader(s.chan.fileno(), self._on_channel, s)
        while True:
            await asyncio.sleep(0.2)
            if self.detok is not None and self.detok.poll() is not None:
                self.detok_dead = True
            detok_frozen = self.detok is not None and _frozen(self.detok.pid)
            for r in self.replicas:
                rank = r.cfg.dp_rank or 0
                mine = [s for s in self.schedulers if (s.dp_rank or 0) == rank]
                gone = any(s.dead or (s.pid is not None and _frozen(s.pid)) for s in mine)
                r.halted = self.detok_dead or detok_frozen or gone

    def _on_channel(self, s: SchedulerProc) -> None:
        assert s.chan is not None and self.loop is not None
        msg = s.chan.recv(timeout=0)
        while msg is not None:
            if msg.get("op") == "internal_state":
                fut = self.state_waiters.pop(msg.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            msg = s.chan.recv(timeout=0)
        if s.chan.closed:
            self.loop.remove_reader(s.chan.fileno())
            s.dead = True

    async def ask_schedulers(self) -> None:
        """GetInternalStateReq to every scheduler, awaited without a timeout as SGLang does: a
        scheduler that is dead, stopped or stuck never answers, so the caller hangs (sglang#4191)."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future] = []
        ids: list[int] = []
        for s in self.schedulers:
            fut = loop.create_future()
            futs.append(fut)
            if s.chan is None or s.chan.closed or s.dead:
                continue
            self.state_req_id += 1
            ids.append(self.state_req_id)
            self.state_waiters[self.state_req_id] = fut
            s.chan.send({"op": "get_internal_state", "id": self.state_req_id})
        try:
            await asyncio.gather(*futs)
        finally:
            for i in ids:
                self.state_waiters.pop(i, None)

    # ------------------------------------------------------------------ warmup
    def _http(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        conn = http.client.HTTPConnection(host, self.port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if self.args.get("api_key"):
            headers["Authorization"] = f"Bearer {self.args['api_key']}"
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _warmup(self) -> None:
        if self.args.get("skip_server_warmup"):
            self._set_status("Up")
            self.log.info("The server is fired up and ready to roll!")
            return
        poll = self.timing("warmup_poll_s")
        tries = max(1, round(self.timing("warmup_timeout_s") / max(poll, 1e-3)))
        last_tb = ""
        success = False
        for _ in range(tries):
            time.sleep(poll)
            try:
                status, body = self._http("GET", "/model_info", None, 5)
                if status != 200:
                    raise AssertionError(f"res=<Response [{status}]>, res.text={body.decode(errors='replace')!r}")
                success = True
                break
            except (AssertionError, OSError, http.client.HTTPException):
                last_tb = traceback.format_exc()
        if not success:
            self.log.error(f"Initialization failed. warmup error: {last_tb}")
            self.kill_tree(include_parent=True)
            return
        req = {"sampling_params": {"temperature": 0, "max_new_tokens": 8}, "text": "The capital city of France is"}
        try:
            status, body = self._http("POST", "/generate", req, 600)
            if status != 200:
                raise AssertionError(body.decode(errors="replace"))
        except (AssertionError, OSError, http.client.HTTPException):
            self.log.error(f"Initialization failed. warmup error: {traceback.format_exc()}")
            self.kill_tree(include_parent=True)
            return
        self._set_status("Up")
        self.log.info("The server is fired up and ready to roll!")

    def _set_status(self, status: str) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(setattr, self, "status", status)
        else:
            self.status = status

    # ------------------------------------------------------------------ signals
    def install_handlers(self) -> None:
        """auto_create_handle_loop: SGLang's handlers arrive with the first generate request."""
        if self.handlers_installed:
            return
        self.handlers_installed = True
        assert self.loop is not None
        if not self.fault("ignore_sigterm"):
            self.loop.add_signal_handler(signal.SIGTERM, self._sigterm_handler)
        signal.signal(signal.SIGQUIT, self._running_phase_sigquit)
        self._task(self._sigterm_watchdog())

    def _sigterm_handler(self) -> None:
        self.log.warning("SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
        self.gracefully_exit = True

    def _uvicorn_signal(self, sig: int) -> None:
        if self.handlers_installed and sig == signal.SIGTERM:
            return
        self._task(self._uvicorn_shutdown(sig))

    async def _uvicorn_shutdown(self, sig: int) -> None:
        uv = self.uvlog
        uv.info("Shutting down")
        if self.http is not None:
            await self.http.close()
        uv.info("Waiting for application shutdown.")
        if self.warmup_thread is not None:
            self.warmup_thread.join()
        uv.info("Application shutdown complete.")
        uv.info(f"Finished server process [{os.getpid()}]")
        self.exit_code = 0
        if sig == signal.SIGTERM:
            self.raise_signal_at_exit = signal.SIGTERM
        assert self.stop_event is not None
        self.stop_event.set()

    async def _sigterm_watchdog(self) -> None:
        poll = self.timing("drain_poll_s")
        while not self.gracefully_exit:
            await asyncio.sleep(poll)
        while True:
            remaining = list(self.rid_to_state)
            if self.status == "UnHealthy":
                self.log.error("Signal SIGTERM received while health check failed. Force exiting.")
                break
            if os.environ.get("SGL_FORCE_SHUTDOWN", "").lower() in ("1", "true", "yes"):
                self.log.error("Signal SIGTERM received while force shutdown flag set. Force exiting.")
                break
            self.log.info(
                f"Gracefully exiting... Remaining number of requests {len(remaining)}. "
                f"Remaining requests remaining_rids={remaining!r}."
            )
            if remaining:
                await asyncio.sleep(poll)
            else:
                break
        await self._exit_after_drain()

    def _scheduler_children(self) -> list[int]:
        out = []
        for pid in procutil.children(os.getpid()):
            cl = procutil.cmdline(pid)
            if cl and cl[0].startswith("sglang::scheduler") and procutil.is_alive(pid):
                out.append(pid)
        return out

    async def _exit_after_drain(self) -> None:
        v = self.version
        self.watchdog_stop.set()
        if not v.shutdown_req:
            self.kill_tree(include_parent=True)
        for s in self.schedulers:
            if s.chan is not None and not s.chan.closed:
                s.chan.send({"op": "shutdown"})
        deadline = time.monotonic() + self.timing("scheduler_exit_timeout_s")
        while time.monotonic() < deadline and self._scheduler_children():
            await asyncio.sleep(0.1)
        stragglers = self._scheduler_children()
        if not v.exit_zero_after_drain:
            self.kill_tree(include_parent=True)
        if stragglers and v.straggler_warning:
            self.log.warning(
                f"Schedulers still alive {self.timing('scheduler_exit_timeout_s'):g}s after ShutdownReq, "
                f"killing them before they released: {stragglers}"
            )
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.kill_tree(False, 60))
        uv = self.uvlog
        uv.info("Shutting down")
        if self.http is not None:
            await self.http.close()
        uv.info("Waiting for application shutdown.")
        uv.info("Application shutdown complete.")
        uv.info(f"Finished server process [{os.getpid()}]")
        self.exit_code = 0
        assert self.stop_event is not None
        self.stop_event.set()


class _Crash(Exception):
    """An exception SGLang would let escape: printed as a traceback, exit status 1."""

    def __init__(self, exc_type: str, message: str):
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message


def _print_crash(exc: _Crash) -> None:
    last = f"{exc.exc_type}: {exc.message}" if exc.message else exc.exc_type
    text = (
        "Traceback (most recent call last):\n"
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
        '  File "/usr/local/lib/python3.11/dist-packages/sglang/launch_server.py", line 32, in <module>\n'
        "    run_server(server_args)\n"
        f"{last}\n"
    )
    sys.stderr.write(text)
    sys.stderr.flush()


def _raise_nofile_limit() -> None:
    """Hundreds of keep-alive clients need more descriptors than the usual soft limit of 1024."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 65536
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None, cfg: Config | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if cfg is None:
        try:
            cfg = Config.load()
        except ConfigError as exc:
            sys.stderr.write(f"gpusim: configuration error: {exc}\n")
            return 1
    _raise_nofile_limit()
    # Killed, this process stays in teardown (its port still bound) until the driver lets it go.
    driver.register(cfg.state_dir(), float(cfg.timing["teardown_s"]))
    launcher = Launcher(cfg, cfg.version, argv)
    code = 1
    try:
        launcher.prepare()
    except _Crash as exc:
        _print_crash(exc)
        return 1
    try:
        launcher.launch()
        code = asyncio.run(launcher.serve())
    except _Crash as exc:
        launcher.stop_watchdog()
        launcher.kill_tree(include_parent=False, wait_timeout=cfg.version.kill_tree_wait_timeout)
        _print_crash(exc)
        return 1
    except KeyboardInterrupt:
        code = 130
    if launcher.raise_signal_at_exit is not None:
        # uvicorn re-raises a captured SIGTERM once it has shut down; the default action ends the
        # process before launch_server's finally block, and PDEATHSIG takes the children.
        signal.signal(launcher.raise_signal_at_exit, signal.SIG_DFL)
        signal.raise_signal(launcher.raise_signal_at_exit)
    launcher.stop_watchdog()
    launcher.kill_tree(include_parent=False, wait_timeout=cfg.version.kill_tree_wait_timeout)
    return code

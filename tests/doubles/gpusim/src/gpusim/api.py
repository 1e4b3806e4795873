"""HTTP endpoints of reference section 3, served from the main process."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from gpusim import textgen
from gpusim.engine import Req
from gpusim.httpserver import Request, Response

if TYPE_CHECKING:
    from gpusim.launcher import Launcher

NOT_FOUND = {"detail": "Not Found"}
SSE = "text/event-stream; charset=utf-8"


def _oai_error(message: str, status: int = 400) -> Response:
    return Response.json(
        {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}, status
    )


class Api:
    def __init__(self, launcher: Launcher):
        self.L = launcher
        self.v = launcher.version
        self.routes: dict[str, tuple[tuple[str, ...], Any]] = {
            "/health": (("GET",), self.health),
            "/health_generate": (("GET",), self.health),
            "/model_info": (("GET",), self.model_info),
            "/get_model_info": (("GET",), self.get_model_info),
            "/server_info": (("GET",), self.server_info),
            "/get_server_info": (("GET",), self.get_server_info),
            "/v1/models": (("GET",), self.models),
            "/metrics": (("GET",), self.metrics),
            "/generate": (("POST", "PUT"), self.generate),
            "/v1/completions": (("POST",), self.completions),
            "/v1/chat/completions": (("POST",), self.chat),
            "/flush_cache": (("GET", "POST"), self.flush_cache),
        }
        if self.v.ready_endpoint:
            self.routes["/ready"] = (("GET",), self.ready)

    # ------------------------------------------------------------------ plumbing
    def _authorized(self, req: Request) -> bool:
        key = self.L.args.get("api_key")
        if not key or req.method == "OPTIONS":
            return True
        path = req.path
        if path.startswith("/health") or path.startswith("/metrics"):
            return True
        if self.v.ready_endpoint and path.startswith("/ready"):
            return True
        header = req.headers.get("authorization")
        if not header:
            return False
        parts = header.split(" ", 1)
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return False
        return hmac.compare_digest(parts[1].encode(), str(key).encode())

    async def handle(self, req: Request) -> Response:
        if not self._authorized(req):
            return Response.json({"error": "Unauthorized"}, 401)
        path = req.path
        if path == "/metrics/":
            path = "/metrics"
        route = self.routes.get(path)
        if route is None:
            return Response.json(NOT_FOUND, 404)
        methods, fn = route
        if req.method == "HEAD" and "GET" in methods:
            pass
        elif req.method not in methods:
            return Response.json({"detail": "Method Not Allowed"}, 405)
        return await fn(req)

    # ------------------------------------------------------------------ health
    async def health(self, req: Request) -> Response:
        L = self.L
        if L.gracefully_exit:
            L.log.info("Health check request received during shutdown. Returning 503.")
            return Response.empty(503)
        if L.status == "Starting":
            return Response.empty(503)
        flag = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower()
        if flag in ("0", "false", "no") and req.path == "/health":
            return Response.empty(200)
        L.install_handlers()
        tic = time.time()
        replica = L.pick_replica()
        if not replica.busy() and not replica.halted:
            comp = textgen.Completion(tokens=["."], token_ids=[13], natural_len=1, reasoning_len=0)
            probe = Req(prompt_tokens=1, max_new=1, completion=comp, is_health=True, log_metrics=False)
            probe.rid = f"HEALTH_CHECK_{uuid.uuid4().hex}" if self.v.family >= 23 else f"HEALTH_CHECK_{tic}"
            replica.submit(probe)
        timeout = float(L.cfg.timing["health_timeout_s"])
        step = float(L.cfg.timing["health_probe_s"])
        while time.time() < tic + timeout:
            await asyncio.sleep(step)
            if L.last_receive_tstamp > tic:
                L.status = "Up"
                return Response.empty(200)
        tic_s = time.strftime("%H:%M:%S", time.localtime(tic))
        last_s = time.strftime("%H:%M:%S", time.localtime(L.last_receive_tstamp))
        L.log.error(
            "Health check failed. Server couldn't get a response from detokenizer for last "
            f"{int(timeout) if timeout == int(timeout) else timeout} seconds. tic start time: {tic_s}. "
            f"last_heartbeat time: {last_s}"
        )
        L.status = "UnHealthy"
        return Response.empty(503)

    async def ready(self, req: Request) -> Response:
        L = self.L
        ok = L.status == "Up" and not L.gracefully_exit
        return Response.empty(200 if ok else 503)

    # ------------------------------------------------------------------ info
    def _model_info(self) -> dict[str, Any]:
        a, prof = self.L.args, self.L.profile
        info: dict[str, Any] = {
            "model_path": a["model_path"],
            "tokenizer_path": a.get("tokenizer_path"),
            "is_generation": True,
            "preferred_sampling_params": a.get("preferred_sampling_params"),
            "weight_version": a.get("weight_version") or "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": prof.model_type,
            "architectures": list(prof.architectures),
        }
        if self.v.model_info_v18:
            info.update(
                served_model_name=a["served_model_name"],
                load_format=a.get("load_format") or "auto",
                reasoning_parser=a.get("reasoning_parser"),
                tool_call_parser=a.get("tool_call_parser"),
            )
        if self.v.family >= 23:
            info["disaggregation_mode"] = a.get("disaggregation_mode") or "null"
        return info

    async def model_info(self, req: Request) -> Response:
        return Response.json(self._model_info())

    async def get_model_info(self, req: Request) -> Response:
        self.L.log.warning(
            "Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
            "Please use '/model_info' instead."
        )
        return Response.json(self._model_info())

    def _jsonable(self, value: Any) -> Any:
        try:
            json.dumps(value)
            return value
        except (TypeError, ValueError):
            return str(value)

    def server_info_dict(self) -> dict[str, Any]:
        L = self.L
        a = {k: self._jsonable(v) for k, v in L.args.items() if not k.startswith("_")}
        mismatch = L.fault("settings_mismatch")
        report = dict(mismatch.params.get("report") or {}) if mismatch else {}
        states = []
        for r in L.replicas:
            rank0 = next(s for s in L.schedulers if (s.dp_rank or 0) == (r.cfg.dp_rank or 0) and s.tp_rank == 0)
            info = rank0.info or {}
            st = dict(a)
            if info.get("max_mamba_cache_size") is not None:
                st["max_mamba_cache_size"] = info["max_mamba_cache_size"]
            st["effective_max_running_requests_per_dp"] = r.cfg.max_running
            st["last_gen_throughput"] = r.last_gen_throughput
            if self.v.memory_usage_v18:
                graph = round(info.get("graph_gib", 0.0), 3)
                st["memory_usage"] = {
                    "weight": round(info.get("weight_gib", 0.0), 3),
                    "kvcache": round(info.get("kv_gib", 0.0), 3),
                    "startup_available": round(info.get("avail_end_gib", 0.0), 3),
                    "token_capacity": r.cfg.kv_capacity,
                    "token_capacity_swa": None,
                    "graph": {
                        "prefill": round(graph * 0.2, 3) if L.res.prefill_graph else 0.0,
                        "decode": round(graph * (0.8 if L.res.prefill_graph else 1.0), 3),
                        "target_verify": 0.0,
                        "draft_prefill": 0.0,
                        "draft_decode": 0.0,
                        "draft_extend": 0.0,
                    },
                }
                st["startup_time"] = round(L.ready_time - L.t_start, 3)
            else:
                st["memory_usage"] = {
                    "weight": round(info.get("weight_gib", 0.0), 2),
                    "kvcache": round(info.get("kv_gib", 0.0), 2),
                    "token_capacity": r.cfg.kv_capacity,
                    "graph": round(info.get("graph_gib", 0.0), 2),
                }
            acc = r.avg_accept_length()
            if acc is not None:
                st["avg_spec_accept_length"] = acc
            if self.v.family >= 23:
                st["world_size"] = int(a.get("tp_size") or 1) * int(a.get("pp_size") or 1)
            for k, val in report.items():
                if k in st:
                    st[k] = val
            states.append(st)
        first = L.replicas[0]
        first_info = L.schedulers[0].info or {}
        out: dict[str, Any] = dict(a)
        out.update(
            status="ready",
            max_total_num_tokens=first.cfg.kv_capacity,
            max_req_input_len=first_info.get("max_req_input_len"),
        )
        if self.v.family >= 14:
            out["kv_events"] = None
        out["internal_states"] = states
        out["version"] = str(self.v)
        if self.v.server_info_startup_time:
            out["startup_time"] = round(L.ready_time - L.t_start, 3)
        if self.v.family >= 23:
            out["launch_command"] = " ".join(["python", "-m", "sglang.launch_server", *L.argv])
            out["frontend"] = "python"
        for k, val in report.items():
            if k in out and k != "internal_states":
                out[k] = val
        return out

    async def _server_info(self) -> Response:
        hang = self.L.fault("server_info_hang")
        if hang is not None:
            after = hang.params.get("answer_after_s")
            if after is None:
                await asyncio.Event().wait()  # accepted, never answered
            await asyncio.sleep(float(after))
        await self.L.ask_schedulers()
        return Response.json(self.server_info_dict())

    async def server_info(self, req: Request) -> Response:
        return await self._server_info()

    async def get_server_info(self, req: Request) -> Response:
        self.L.log.warning(
            "Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
            "Please use '/server_info' instead."
        )
        return await self._server_info()

    async def models(self, req: Request) -> Response:
        served = self.L.args["served_model_name"]
        return Response.json(
            {
                "object": "list",
                "data": [
                    {
                        "id": served,
                        "object": "model",
                        "created": int(self.L.t_start),
                        "owned_by": "sglang",
                        "root": served,
                        "parent": None,
                        "max_model_len": self.L.res.context_len,
                    }
                ],
            }
        )

    async def metrics(self, req: Request) -> Response:
        if self.L.metrics is None:
            return Response.json(NOT_FOUND, 404)
        body = self.L.metrics.render()
        return Response.text(body, 200, "text/plain; version=1.0.0; charset=utf-8")

    async def flush_cache(self, req: Request) -> Response:
        busy = any(r.num_requests for r in self.L.replicas)
        text = (
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n"
        )
        if busy:
            return Response.text("Flush cache failed.\n" if self.v.flush_cache_v23 else text, 400)
        self.L.log.info("Cache flushed successfully!")
        return Response.text(text, 200)

    # ------------------------------------------------------------------ generation
    def _new_req(self, prompt_text: str, prompt_tokens: int, max_new: int, seed: Any, stream: bool) -> Req:
        L = self.L
        gen = L.cfg.generation
        comp = textgen.generate(
            prompt_text,
            seed,
            int(gen["output_tokens_min"]),
            int(gen["output_tokens_max"]),
            L.profile.reasoning,
            L.profile.vocab_size,
        )
        r = Req(prompt_tokens=prompt_tokens, max_new=max_new, completion=comp, stream=stream)
        r.eos_id = L.profile.eos_token_id
        r.done = asyncio.get_running_loop().create_future()
        if stream:
            r.events = asyncio.Queue()
        hang = L.fault("generation_hang")
        if hang is not None and L.status == "Up":
            L.user_requests += 1
            if L.user_requests > int(hang.params.get("after_requests", 0)):
                r.hung = True
        return r

    def _check_len(self, n: int) -> str | None:
        ctx = self.L.res.context_len
        if n >= ctx:
            return f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
        return None

    def _submit(self, r: Req) -> None:
        L = self.L
        L.install_handlers()
        L.rid_to_state[r.rid] = r
        L.pick_replica().submit(r)

    def _meta(self, r: Req, final: bool) -> dict[str, Any]:
        m: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish if final else None,
            "prompt_tokens": r.prompt_tokens,
            "weight_version": "default",
            self.v.retractions_key: 0,
        }
        if self.v.meta_reasoning_tokens:
            m["reasoning_tokens"] = min(r.produced, r.completion.reasoning_len + 1) if r.completion.reasoning_len else 0
        m["completion_tokens"] = r.produced
        m["cached_tokens"] = 0
        if final:
            m["e2e_latency"] = round((r.finished_at or time.monotonic()) - r.created, 6)
        if self.L.res.spec and r.verify_ct:
            m["spec_accept_rate"] = round(r.accepted_drafts / max(1, r.verify_ct * (self.L.res.draft_tokens - 1)), 4)
            m["spec_accept_length"] = round(r.produced / r.verify_ct, 4)
            m["spec_accept_token_num"] = r.accepted_drafts
            m["spec_draft_token_num"] = r.verify_ct * max(0, self.L.res.draft_tokens - 1)
            m["spec_verify_ct"] = r.verify_ct
        return m

    async def _wait(self, r: Req) -> Req:
        assert r.done is not None
        return await r.done

    async def generate(self, req: Request) -> Response:
        try:
            body = req.json() or {}
        except ValueError as exc:
            return Response.json({"error": {"message": f"Invalid JSON: {exc}"}}, 400)
        texts = body.get("text")
        ids = body.get("input_ids")
        sp = body.get("sampling_params") or {}
        if isinstance(sp, list):
            sp = sp[0] if sp else {}
        stream = bool(body.get("stream"))
        max_new = int(sp.get("max_new_tokens", 128) if sp.get("max_new_tokens") is not None else 128)
        seed = sp.get("seed", sp.get("sampling_seed"))
        batch = isinstance(texts, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
        items: list[tuple[str, int]] = []
        if texts is not None:
            for t in texts if isinstance(texts, list) else [texts]:
                items.append((str(t), textgen.count_prompt_tokens(str(t))))
        elif ids is not None:
            for seq in ids if batch else [ids]:
                items.append((json.dumps(seq), len(seq)))
        else:
            return Response.json({"error": {"message": "Either text or input_ids should be provided."}}, 400)
        for _, n in items:
            err = self._check_len(n)
            if err:
                return Response.json({"error": {"message": err}}, 400)
        reqs = [self._new_req(t, n, max_new, seed, stream and not batch) for t, n in items]
        for r in reqs:
            self._submit(r)
        if stream and not batch:
            return Response(200, content_type=SSE, stream=self._generate_stream(reqs[0]))
        done = [await self._wait(r) for r in reqs]
        outs = [
            {
                "text": r.completion.text(r.produced),
                "output_ids": r.completion.token_ids[: r.produced],
                "meta_info": self._meta(r, True),
            }
            for r in done
        ]
        return Response.json(outs if batch else outs[0])

    async def _generate_stream(self, r: Req) -> AsyncIterator[bytes]:
        assert r.events is not None
        sent = 0
        try:
            while True:
                await r.events.get()
                if r.produced > sent or r.finish is not None:
                    sent = r.produced
                    final = r.finish is not None
                    event = {
                        "text": r.completion.text(r.produced),
                        "output_ids": r.completion.token_ids[: r.produced],
                        "meta_info": self._meta(r, final),
                    }
                    yield b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
                    if final:
                        break
            yield b"data: [DONE]\n\n"
        finally:
            if r.finish is None:
                r.aborted = True
                self.L.rid_to_state.pop(r.rid, None)

    # ------------------------------------------------------------------ OpenAI
    def _finish_oai(self, r: Req) -> tuple[str, Any]:
        if r.finish is None:
            return "abort", None
        if r.finish.get("type") == "length":
            return "length", None
        return "stop", r.finish.get("matched")

    def _usage(self, r: Req, reasoning_tokens: int = 0) -> dict[str, Any]:
        return {
            "prompt_tokens": r.prompt_tokens,
            "total_tokens": r.prompt_tokens + r.produced,
            "completion_tokens": r.produced,
            "prompt_tokens_details": None,
            "reasoning_tokens": reasoning_tokens,
        }

    async def completions(self, req: Request) -> Response:
        try:
            body = req.json() or {}
        except ValueError as exc:
            return _oai_error(f"Invalid JSON: {exc}")
        prompt = body.get("prompt")
        if prompt is None:
            return _oai_error("prompt is required")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt else ""
        prompt_text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        n = textgen.count_prompt_tokens(prompt_text) if isinstance(prompt, str) else len(prompt)
        err = self._check_len(n)
        if err:
            return _oai_error(err)
        max_tokens = body.get("max_tokens")
        max_new = int(max_tokens) if max_tokens is not None else 16
        model = body.get("model") or "default"
        stream = bool(body.get("stream"))
        r = self._new_req(prompt_text, n, max_new, body.get("seed"), stream)
        self._submit(r)
        created = int(time.time())
        if stream:
            return Response(200, content_type=SSE, stream=self._completions_stream(r, model, created, body))
        await self._wait(r)
        reason, matched = self._finish_oai(r)
        return Response.json(
            {
                "id": r.rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": r.completion.text(r.produced),
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(r),
                "metadata": {"weight_version": "default"},
            }
        )

    async def _completions_stream(self, r: Req, model: str, created: int, body: dict) -> AsyncIterator[bytes]:
        assert r.events is not None
        sent = 0
        try:
            while True:
                await r.events.get()
                final = r.finish is not None
                if r.produced > sent:
                    delta = r.completion.text(r.produced)[len(r.completion.text(sent)) :]
                    sent = r.produced
                    chunk = {
                        "id": r.rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [
                            {"index": 0, "text": delta, "logprobs": None, "finish_reason": None, "matched_stop": None}
                        ],
                    }
                    yield _sse(chunk)
                if final:
                    reason, matched = self._finish_oai(r)
                    chunk = {
                        "id": r.rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [
                            {"index": 0, "text": "", "logprobs": None, "finish_reason": reason, "matched_stop": matched}
                        ],
                    }
                    yield _sse(chunk)
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield _sse(
                            {
                                "id": r.rid,
                                "object": "text_completion",
                                "created": created,
                                "model": model,
                                "choices": [],
                                "usage": self._usage(r),
                            }
                        )
                    break
            yield b"data: [DONE]\n\n"
        finally:
            if r.finish is None:
                r.aborted = True
                self.L.rid_to_state.pop(r.rid, None)

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        parts = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(f"<|im_start|>{m.get('role', 'user')}\n{content or ''}<|im_end|>\n")
        parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def _split(self, text: str) -> tuple[str | None, str]:
        if self.L.args.get("reasoning_parser") and self.L.profile.reasoning:
            reasoning, content = textgen.split_reasoning(text)
            return reasoning, content
        return None, text

    async def chat(self, req: Request) -> Response:
        try:
            body = req.json() or {}
        except ValueError as exc:
            return _oai_error(f"Invalid JSON: {exc}")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _oai_error("messages is required and must be a non-empty list")
        prompt = self._chat_prompt(messages)
        n = textgen.count_prompt_tokens(prompt)
        err = self._check_len(n)
        if err:
            return _oai_error(err)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = int(max_tokens) if max_tokens is not None else max(1, self.L.res.context_len - n)
        model = body.get("model") or "default"
        stream = bool(body.get("stream"))
        r = self._new_req(prompt, n, max_new, body.get("seed"), stream)
        self._submit(r)
        created = int(time.time())
        if stream:
            return Response(200, content_type=SSE, stream=self._chat_stream(r, model, created, body))
        await self._wait(r)
        reason, matched = self._finish_oai(r)
        reasoning, content = self._split(r.completion.text(r.produced))
        rtok = r.completion.reasoning_len if reasoning is not None else 0
        return Response.json(
            {
                "id": r.rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": content,
                            "reasoning_content": reasoning,
                            "tool_calls": None,
                        },
                        "logprobs": None,
                        "finish_reason": reason,
                        "matched_stop": matched,
                    }
                ],
                "usage": self._usage(r, min(rtok, r.produced)),
                "metadata": {"weight_version": "default"},
            }
        )

    async def _chat_stream(self, r: Req, model: str, created: int, body: dict) -> AsyncIterator[bytes]:
        assert r.events is not None
        base = {"id": r.rid, "object": "chat.completion.chunk", "created": created, "model": model}
        yield _sse(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        "matched_stop": None,
                    }
                ],
            }
        )
        sent_r, sent_c = "", ""
        try:
            while True:
                await r.events.get()
                reasoning, content = self._split(r.completion.text(r.produced))
                delta: dict[str, Any] = {}
                if reasoning is not None and len(reasoning) > len(sent_r):
                    delta["reasoning_content"] = reasoning[len(sent_r) :]
                    sent_r = reasoning
                if len(content) > len(sent_c):
                    delta["content"] = content[len(sent_c) :]
                    sent_c = content
                if delta:
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": delta,
                                    "logprobs": None,
                                    "finish_reason": None,
                                    "matched_stop": None,
                                }
                            ],
                        }
                    )
                if r.finish is not None:
                    reason, matched = self._finish_oai(r)
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {},
                                    "logprobs": None,
                                    "finish_reason": reason,
                                    "matched_stop": matched,
                                }
                            ],
                        }
                    )
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield _sse({**base, "choices": [], "usage": self._usage(r)})
                    break
            yield b"data: [DONE]\n\n"
        finally:
            if r.finish is None:
                r.aborted = True
                self.L.rid_to_state.pop(r.rid, None)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

"""Request bodies for OpenAI-compatible servers (SGLang first) and the records made from answers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sglang_fleet.config import GenerateConfig
from sglang_fleet.ids import id_digest
from sglang_fleet.prompts import Prompt

# One encoder for every request and record: json.dumps with options builds a new encoder each call.
COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class Kind(Enum):
    """How a failed attempt is handled."""

    UNAVAILABLE = "unavailable"  # server away (refused, reset, 503): wait for it, attempt not counted
    THROTTLED = "throttled"  # 429: back off, attempt not counted
    RETRY = "retry"  # timeout, 5xx, unreadable answer: retried with backoff, counted
    PERMANENT = "permanent"  # 400/413/422: the prompt itself is refused; recorded as failed at once
    ENDPOINT = "endpoint"  # 401/403/404/405: endpoint misconfigured; it is taken out of service


@dataclass(slots=True)
class AttemptError(Exception):
    kind: Kind
    reason: str
    status: int | None = None

    def __str__(self) -> str:
        return self.reason


def classify_status(status: int) -> Kind:
    if status in (503, 502) or status == 0:
        return Kind.UNAVAILABLE
    if status == 429:
        return Kind.THROTTLED
    if status in (401, 403, 404, 405):
        return Kind.ENDPOINT
    if status in (408, 409, 425) or status >= 500:
        return Kind.RETRY
    return Kind.PERMANENT


class RequestBuilder:
    def __init__(self, cfg: GenerateConfig) -> None:
        self.api = cfg.api
        self.path = CHAT_PATH if cfg.api == "chat" else COMPLETIONS_PATH
        base: dict[str, Any] = {"model": cfg.model}
        base.update(cfg.sampling)
        r = cfg.reasoning
        if r.separate is not None:
            base["separate_reasoning"] = r.separate
        if r.enable_thinking is not None:
            kwargs = dict(base.get("chat_template_kwargs") or {})
            kwargs["enable_thinking"] = r.enable_thinking
            base["chat_template_kwargs"] = kwargs
        if r.effort is not None:
            base["reasoning_effort"] = r.effort
        base.update(cfg.extra_body)
        base["stream"] = False
        self.base = base
        self.seed_per_prompt = cfg.seed_per_prompt
        self.base_seed = int(base.get("seed", 0) or 0)

    def body(self, prompt: Prompt) -> bytes:
        body = dict(self.base)
        if prompt.params:
            body.update(prompt.params)
        if self.seed_per_prompt and "seed" not in prompt.params:
            # Reproducible sampling per prompt, whichever host or attempt serves it.
            body["seed"] = (self.base_seed + id_digest(prompt.id)) % (2**31 - 1)
        if self.api == "chat":
            body["messages"] = prompt.messages or [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        return COMPACT_JSON.encode(body).encode("utf-8", "surrogatepass")

    def probe_body(self) -> bytes:
        """A one-token generation: does a stalled server complete anything again?"""
        body = {k: v for k, v in self.base.items() if k != "seed"}
        body["max_tokens"] = 1
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": "ping"}]
        else:
            body["prompt"] = "ping"
        return COMPACT_JSON.encode(body).encode("utf-8", "surrogatepass")


@dataclass(slots=True)
class Completion:
    output: str | None
    reasoning: str | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    model: str | None
    response_id: str | None


def parse_response(api: str, data: Any, *, split_think_tags: bool = False) -> Completion:
    """Raises ``AttemptError(RETRY)`` for an answer without a usable first choice."""
    try:
        choice = data["choices"][0]
        if api == "chat":
            msg = choice["message"]
            output = msg.get("content")
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")
        else:
            output = choice["text"]
            reasoning = choice.get("reasoning_content")
    except (KeyError, IndexError, TypeError):
        raise AttemptError(Kind.RETRY, "answer has no choices[0] with a message") from None
    if output is not None and not isinstance(output, str):
        raise AttemptError(Kind.RETRY, "answer content is not text")
    if split_think_tags and reasoning is None and output and "</think>" in output:
        head, _unused, tail = output.partition("</think>")
        reasoning = head.replace("<think>", "", 1).strip()
        output = tail.lstrip()
    usage = data.get("usage")
    return Completion(
        output=output,
        reasoning=reasoning,
        finish_reason=choice.get("finish_reason"),
        usage=usage if isinstance(usage, dict) else None,
        model=data.get("model"),
        response_id=data.get("id"),
    )


def error_detail(body: bytes, limit: int = 300) -> str:
    """A short, single-line reason from an error body (OpenAI-style ``{"error": {"message": ...}}``
    or SGLang's ``{"message": ...}``)."""
    text = body[:4096].decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            msg = err.get("message") if isinstance(err, dict) else err
            if msg is None:
                msg = obj.get("detail") or obj.get("message")
            if msg is not None:
                text = str(msg)
    except ValueError:
        pass
    text = " ".join(text.split())
    return text[:limit]

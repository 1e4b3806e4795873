from __future__ import annotations

import json

import pytest

from sglang_fleet.config import build_config
from sglang_fleet.openai_api import (
    AttemptError,
    Kind,
    RequestBuilder,
    classify_status,
    error_detail,
    parse_response,
)
from sglang_fleet.prompts import Prompt


def cfg(**kw: object) -> object:
    base: dict[str, object] = {"prompts": "p.jsonl", "output": "out", "endpoints": ["http://h:1"]}
    base.update(kw)
    return build_config(base, {})


def test_chat_body_has_sampling_reasoning_and_per_prompt_params() -> None:
    c = cfg(
        model="m",
        sampling={"temperature": 0.6, "max_tokens": 100},
        reasoning={"separate": True, "enable_thinking": True, "effort": "high"},
        extra_body={"chat_template_kwargs": {"x": 1}},
    )
    b = RequestBuilder(c)  # type: ignore[arg-type]
    p = Prompt("a", 1, {"messages": [{"role": "user", "content": "hi"}], "params": {"max_tokens": 5}})
    body = json.loads(b.body(p))
    assert body["model"] == "m"
    assert body["temperature"] == 0.6
    assert body["max_tokens"] == 5  # the prompt's own params win
    assert body["separate_reasoning"] is True
    assert body["reasoning_effort"] == "high"
    assert body["chat_template_kwargs"] == {"x": 1}  # extra_body is applied last
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] is False
    assert b.path == "/v1/chat/completions"


def test_plain_prompts_become_a_user_message_in_chat_and_stay_text_in_completions() -> None:
    p = Prompt("a", 1, {"prompt": "hello"})
    chat = json.loads(RequestBuilder(cfg()).body(p))  # type: ignore[arg-type]
    assert chat["messages"] == [{"role": "user", "content": "hello"}]
    b = RequestBuilder(cfg(api="completions"))  # type: ignore[arg-type]
    assert json.loads(b.body(p))["prompt"] == "hello"
    assert b.path == "/v1/completions"


def test_seed_per_prompt_is_stable_and_distinct() -> None:
    b = RequestBuilder(cfg(seed_per_prompt=True, sampling={"seed": 10}))  # type: ignore[arg-type]
    s1 = json.loads(b.body(Prompt("a", 1, {"prompt": "x"})))["seed"]
    s2 = json.loads(b.body(Prompt("b", 2, {"prompt": "x"})))["seed"]
    assert s1 != s2
    assert s1 == json.loads(b.body(Prompt("a", 9, {"prompt": "other"})))["seed"]


def test_parse_chat_with_reasoning() -> None:
    data = {
        "id": "r1",
        "model": "m",
        "choices": [{"message": {"content": "42", "reasoning_content": "think"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }
    c = parse_response("chat", data)
    assert (c.output, c.reasoning, c.finish_reason, c.usage, c.response_id) == (
        "42",
        "think",
        "length",
        {"prompt_tokens": 3, "completion_tokens": 4},
        "r1",
    )


def test_think_tags_split_only_when_asked() -> None:
    data = {"choices": [{"message": {"content": "<think>hmm</think>\n\nanswer"}, "finish_reason": "stop"}]}
    assert parse_response("chat", data).output == "<think>hmm</think>\n\nanswer"
    c = parse_response("chat", data, split_think_tags=True)
    assert (c.reasoning, c.output) == ("hmm", "answer")


def test_parse_completions_and_bad_answers() -> None:
    assert parse_response("completions", {"choices": [{"text": "t", "finish_reason": "stop"}]}).output == "t"
    bad: object
    for bad in ({}, {"choices": []}, {"choices": [{}]}, [], {"choices": [{"message": {"content": 5}}]}):
        with pytest.raises(AttemptError) as e:
            parse_response("chat", bad)
        assert e.value.kind is Kind.RETRY


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (503, Kind.UNAVAILABLE),
        (502, Kind.UNAVAILABLE),
        (429, Kind.THROTTLED),
        (500, Kind.RETRY),
        (504, Kind.RETRY),
        (408, Kind.RETRY),
        (400, Kind.PERMANENT),
        (413, Kind.PERMANENT),
        (422, Kind.PERMANENT),
        (401, Kind.ENDPOINT),
        (403, Kind.ENDPOINT),
        (404, Kind.ENDPOINT),
    ],
)
def test_classify(status: int, kind: Kind) -> None:
    assert classify_status(status) is kind


def test_error_detail() -> None:
    assert error_detail(b'{"error": {"message": "too\\nlong"}}') == "too long"
    assert error_detail(b'{"object": "error", "message": "bad"}') == "bad"
    assert error_detail(b'{"detail": "Not Found"}') == "Not Found"
    assert error_detail(b"<html>oops</html>") == "<html>oops</html>"
    assert len(error_detail(b"x" * 5000)) == 300

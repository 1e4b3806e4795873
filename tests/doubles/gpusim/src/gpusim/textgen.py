"""Deterministic completions: the same prompt and seed always give the same tokens."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

_WORDS = (
    "the",
    "model",
    "answers",
    "with",
    "a",
    "short",
    "and",
    "plain",
    "reply",
    "about",
    "systems",
    "that",
    "serve",
    "language",
    "models",
    "on",
    "many",
    "machines",
    "while",
    "operators",
    "watch",
    "memory",
    "health",
    "and",
    "latency",
    "under",
    "steady",
    "load",
    "so",
    "the",
    "fleet",
    "keeps",
    "running",
    "and",
    "every",
    "request",
    "finds",
    "a",
    "free",
    "slot",
    "in",
    "time",
    "for",
    "its",
    "user",
    "today",
)

_THINK_WORDS = (
    "okay",
    "let",
    "me",
    "think",
    "about",
    "this",
    "question",
    "carefully",
    "first",
    "I",
    "should",
    "consider",
    "what",
    "is",
    "being",
    "asked",
    "and",
    "then",
    "work",
    "through",
    "the",
    "steps",
    "one",
    "at",
    "a",
    "time",
    "before",
    "giving",
    "the",
    "final",
    "answer",
)

END_THINK = "</think>"


def count_prompt_tokens(text: str) -> int:
    """Roughly one token per four bytes, as BPE tokenizers give for English text."""
    return max(1, math.ceil(len(text.encode("utf-8")) / 4))


@dataclass
class Completion:
    tokens: list[str]
    token_ids: list[int]
    natural_len: int
    reasoning_len: int

    def text(self, n: int | None = None) -> str:
        n = len(self.tokens) if n is None else n
        return "".join(self.tokens[:n])


def _stream(key: bytes):
    counter = 0
    while True:
        block = hashlib.sha256(key + counter.to_bytes(8, "big")).digest()
        yield from (int.from_bytes(block[i : i + 4], "big") for i in range(0, 32, 4))
        counter += 1


def generate(prompt: str, seed: object, min_len: int, max_len: int, reasoning: bool, vocab: int) -> Completion:
    key = hashlib.sha256(f"{prompt}\x00{seed}".encode()).digest()
    rnd = _stream(key)
    span = max(0, max_len - min_len)
    natural = min_len + next(rnd) % (span + 1)
    natural = max(1, natural)
    reasoning_len = 0
    tokens: list[str] = []
    if reasoning and natural >= 4:
        reasoning_len = max(1, natural // 3)
        for i in range(reasoning_len):
            w = _THINK_WORDS[next(rnd) % len(_THINK_WORDS)]
            tokens.append(w.capitalize() if i == 0 else " " + w)
        tokens.append(f"\n{END_THINK}\n\n")
    first = True
    while len(tokens) < natural:
        w = _WORDS[next(rnd) % len(_WORDS)]
        tokens.append(w.capitalize() if first else " " + w)
        first = False
    if tokens and not tokens[-1].endswith("."):
        tokens[-1] = tokens[-1] + "."
    ids = [1000 + next(rnd) % max(1, vocab - 2000) for _ in tokens]
    return Completion(tokens=tokens, token_ids=ids, natural_len=len(tokens), reasoning_len=reasoning_len)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """What a reasoning parser returns: (reasoning_content, content)."""
    if END_THINK in text:
        head, tail = text.split(END_THINK, 1)
        return head.strip(), tail.lstrip("\n")
    return text.strip(), ""

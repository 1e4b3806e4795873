"""Prompt ids: normalisation, the stable hash that assigns them to hosts, and a compact done set.

A done set of a million ids as a Python ``set[str]`` costs over 100 MB; this module keeps 64-bit
digests in sorted ``array('Q')`` buckets instead (8 bytes an id). Digests can collide, so the prompt
scan checks that the digests of the job's own ids are all distinct; when they are not (odds about
n²/2⁶⁵), the caller falls back to an exact ``set[str]``.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

_BUCKET_BITS = 12
_SHIFT = 64 - _BUCKET_BITS


def id_digest(prompt_id: str) -> int:
    """Digest used for done-set membership (process-independent, unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(prompt_id.encode("utf-8", "surrogatepass"), digest_size=8).digest())


def shard_of(prompt_id: str, count: int) -> int:
    """The host shard an id belongs to. Part of the on-disk contract: changing it would reassign
    prompts between hosts mid-job, so it is salted separately from ``id_digest``."""
    digest = hashlib.blake2b(prompt_id.encode("utf-8", "surrogatepass"), digest_size=8, person=b"sgf-shard").digest()
    return int.from_bytes(digest) % count


@dataclass(frozen=True)
class ShardSpec:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        try:
            a, b = text.split("/")
            index, count = int(a), int(b)
        except ValueError:
            raise ValueError(f"--shard must look like i/n (for example 0/4), got {text!r}") from None
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"--shard {text}: need 0 <= i < n (shards are numbered from 0)")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def tag(self) -> str:
        """File-name form, sortable and unique per shard: ``00003-of-00016``."""
        return f"{self.index:05d}-of-{self.count:05d}"

    def owns(self, prompt_id: str) -> bool:
        return self.count == 1 or shard_of(prompt_id, self.count) == self.index


class IdContainer(Protocol):
    def __contains__(self, prompt_id: object) -> bool: ...
    def __len__(self) -> int: ...


class DigestSet:
    """Set of id digests in 4096 sorted buckets: 8 bytes an id, and building it never needs more
    than one bucket's worth of temporary Python ints."""

    __slots__ = ("_buckets", "_len")

    def __init__(self, digests: Iterable[int] = ()) -> None:
        buckets = [array("Q") for _unused in range(1 << _BUCKET_BITS)]
        for d in digests:
            buckets[d >> _SHIFT].append(d)
        total = 0
        for i, b in enumerate(buckets):
            if len(b) > 1:
                buckets[i] = array("Q", sorted(set(b)))
            total += len(buckets[i])
        self._buckets = buckets
        self._len = total

    @classmethod
    def from_ids(cls, ids: Iterable[str]) -> DigestSet:
        return cls(id_digest(i) for i in ids)

    def has_digest(self, d: int) -> bool:
        b = self._buckets[d >> _SHIFT]
        i = bisect_left(b, d)
        return i < len(b) and b[i] == d

    def __contains__(self, prompt_id: object) -> bool:
        return isinstance(prompt_id, str) and self.has_digest(id_digest(prompt_id))

    def __len__(self) -> int:
        return self._len

    def digests(self) -> Iterator[int]:
        for b in self._buckets:
            yield from b

    def nbytes(self) -> int:
        return sum(b.itemsize * len(b) for b in self._buckets)


def duplicate_digests(digests: array[int]) -> set[int]:
    """Digests that occur more than once (a duplicate id, or, very rarely, a collision)."""
    buckets: list[array[int]] = [array("Q") for _unused in range(1 << _BUCKET_BITS)]
    for d in digests:
        buckets[d >> _SHIFT].append(d)
    dups: set[int] = set()
    for b in buckets:
        if len(b) > 1:
            s = sorted(b)
            dups.update(s[i] for i in range(1, len(s)) if s[i] == s[i - 1])
    return dups


def normalise_id(value: object) -> str:
    """Ids are strings on disk. Integers are accepted as a convenience and written in decimal, so
    ``7`` and ``"7"`` name the same prompt (and are reported as duplicates if both appear)."""
    if isinstance(value, str):
        if not value:
            raise ValueError("id is an empty string")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"id must be a string or an integer, got {type(value).__name__}")

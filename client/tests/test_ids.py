from __future__ import annotations

from array import array

import pytest

from sglang_fleet.ids import DigestSet, ShardSpec, duplicate_digests, id_digest, normalise_id, shard_of


def test_shard_assignment_is_pinned() -> None:
    # The assignment of ids to hosts is an on-disk contract: a change would move prompts between
    # hosts in the middle of a job. These values must never change.
    assert [shard_of(f"q{i}", 16) for i in range(8)] == [0, 0, 10, 8, 0, 10, 14, 10]
    assert id_digest("q0") == 2195274083305894413


def test_shards_partition_the_ids() -> None:
    ids = [f"id-{i}" for i in range(5000)]
    specs = [ShardSpec(i, 5) for i in range(5)]
    owners = [[s for s in specs if s.owns(i)] for i in ids]
    assert all(len(o) == 1 for o in owners)
    sizes = [sum(1 for o in owners if o[0] == s) for s in specs]
    assert min(sizes) > 800  # a hash spreads them; no shard is starved


@pytest.mark.parametrize("text", ["3", "1/0", "2/2", "-1/3", "a/b", "1/2/3"])
def test_bad_shard_specs(text: str) -> None:
    with pytest.raises(ValueError, match="shard"):
        ShardSpec.parse(text)


def test_shard_spec_forms() -> None:
    s = ShardSpec.parse("3/16")
    assert (s.index, s.count, str(s), s.tag) == (3, 16, "3/16", "00003-of-00016")
    assert ShardSpec.parse("0/1").owns("anything")


def test_digest_set_membership() -> None:
    present = [f"p{i}" for i in range(20000)]
    ds = DigestSet.from_ids(present + present[:10])  # repeats collapse
    assert len(ds) == 20000
    assert all(i in ds for i in present[::7])
    assert not any(f"absent{i}" in ds for i in range(2000))
    assert 5 not in ds
    assert ds.nbytes() == 8 * 20000


def test_duplicate_digests() -> None:
    a = array("Q", [id_digest(x) for x in ["a", "b", "c", "b", "d", "a"]])
    assert duplicate_digests(a) == {id_digest("a"), id_digest("b")}
    assert duplicate_digests(array("Q", [1, 2, 3])) == set()


def test_normalise_id() -> None:
    assert normalise_id("x") == "x"
    assert normalise_id(7) == "7"
    bad: object
    for bad in (True, 1.5, None, [], ""):
        with pytest.raises(ValueError):
            normalise_id(bad)

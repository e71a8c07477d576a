"""The simulated storage pool against a plain reference model of an LRU pool of rank shards.

Any order of writes, reads and queries, by any rank, over overlapping key chains, with a
capacity small enough to evict often: the pool must answer as the reference does, hold the
same keys in the same LRU order with the same ranks, count the same bytes and evictions.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.sim._scenario import StorageSpec
from kvstate.sim._storage import SimStore

SHARD = 1024  # bytes of one rank's shard of a block
KEYS = [f"k{i}" for i in range(24)]


class ReferenceStore:
    """An LRU pool written for clarity: a list in LRU order, a set of ranks per key."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.order, self.ranks = capacity, [], {}
        self.used = self.evicted = self.peak = 0
        self.stats = dict.fromkeys(("puts", "gets", "queries", "bytes_written", "bytes_read", "hits", "misses"), 0)

    def query(self, rank: int, keys: list[str]) -> int:
        self.stats["queries"] += 1
        return self.leading(rank, keys)

    def leading(self, rank: int, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and rank in self.ranks.get(keys[n], ()):
            n += 1
        return n

    def _touch(self, key: str) -> None:
        if key in self.ranks:
            self.order.remove(key)
        self.order.append(key)

    def write(self, rank: int, keys: list[str]) -> int:
        n = self.query(rank, keys)  # what is stored already is not written again
        if n < len(keys):
            self.stats["puts"] += 1
            self.stats["bytes_written"] += (len(keys) - n) * SHARD
        for k in keys[n:]:
            if rank not in self.ranks.get(k, ()):
                self.used += SHARD
            self._touch(k)
            self.ranks.setdefault(k, set()).add(rank)
        while self.used > self.capacity and self.order:
            k = self.order.pop(0)
            self.used -= SHARD * len(self.ranks.pop(k))
            self.evicted += 1
        self.peak = max(self.peak, self.used)  # what the pool held at most, once it fit again
        return len(keys)

    def read(self, rank: int, keys: list[str]) -> int:
        n = self.leading(rank, keys)
        self.stats["gets"] += 1
        self.stats["hits"] += n
        self.stats["misses"] += len(keys) - n
        self.stats["bytes_read"] += n * SHARD
        for k in keys[:n]:
            self._touch(k)
        return n


def chains(draw_keys: list[int]) -> list[str]:
    return [KEYS[i] for i in dict.fromkeys(draw_keys)]  # distinct, as a command's keys are


OPS = st.lists(st.tuples(st.sampled_from(("write", "read", "query")), st.integers(0, 1),
                         st.lists(st.integers(0, len(KEYS) - 1), min_size=0, max_size=10)),
               min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, capacity_blocks=st.integers(1, 30), same_keys_twice=st.booleans())
def test_pool_answers_and_orders_as_the_reference(ops, capacity_blocks, same_keys_twice):
    spec = StorageSpec(capacity_gib=capacity_blocks * SHARD / 2**30)
    store, ref = SimStore(spec, SHARD, tp=2), ReferenceStore(capacity_blocks * SHARD)
    for op, rank, idx in ops:
        keys = chains(idx)
        ranks = (rank, 1 - rank) if same_keys_twice else (rank,)  # every rank after the other, as TP does
        for r in ranks:
            if op == "query":
                assert store.query(r, keys) == ref.query(r, keys)
            else:
                assert store.answer(r, keys, op == "write") == getattr(ref, op)(r, keys)
        assert store.contents() == [(k, tuple(sorted(ref.ranks[k]))) for k in ref.order]
        assert store.used == ref.used and store.evictions == ref.evicted and store.peak == ref.peak
        assert store.stats == {**ref.stats, "evicted_blocks": ref.evicted}
        assert store.used <= store.capacity
        assert len(store) == len(ref.order)


def test_known_leading_keys_skip_the_look_but_not_the_answer():
    store = SimStore(StorageSpec(capacity_gib=1.0), SHARD, tp=1)
    store.write(0, ["a", "b", "c"])
    assert store.leading(0, ["a", "b", "c", "d"]) == 3
    assert store.leading(0, ["a", "b", "c", "d"], known=2) == 3
    assert store.read(0, ["a", "x", "c"]) == 1  # a miss ends a read
    assert store.read(0, ["x", "a"]) == 0  # a read told nothing looks from the first key
    assert store.read(0, ["a"]) == 1 and store.stats["bytes_read"] == 2 * SHARD  # and skips nothing
    assert store.answer(0, ["a", "b", "c"], False, known=3, skipped=100) == 3
    assert store.stats["bytes_read"] == 5 * SHARD - 100  # a whole read's skipped bytes stayed in the pool
    assert store.answer(0, ["a", "x"], False, known=1, skipped=100) == 1
    assert store.stats["bytes_read"] == 6 * SHARD - 100  # a partial read is charged its blocks whole
    assert [k for k, _ in store.contents()] == ["b", "c", "a"]  # the read moved "a" to the LRU end


def test_one_byte_over_capacity_evicts_the_oldest_key():
    store = SimStore(StorageSpec(capacity_gib=1.0), SHARD, tp=1)
    store.capacity = 3 * SHARD - 1  # a capacity that is no whole number of shards
    store.write(0, ["a", "b", "c"])
    assert [k for k, _ in store.contents()] == ["b", "c"]
    assert store.used == 2 * SHARD and store.evictions == 1


# -- states (kvstate._statepages): stored under the key of the last block they follow ------------
def test_a_write_stores_the_states_whose_blocks_it_stored_for_its_own_rank_only():
    store = SimStore(StorageSpec(capacity_gib=1.0), SHARD, tp=2)
    keys = ["a", "b", "c", "d"]
    # states after blocks 2 and 4; only 3 blocks moved: the state after block 2 is stored
    assert store.states_moved(1, keys, [(2, 0), (4, 1)], 3, write=True) == 2
    assert store.states_moved(1, keys, [(2, 0), (4, 1)], 4, write=False) == 2  # rank 1 finds it
    assert store.states_moved(0, keys, [(2, 0), (4, 1)], 4, write=False) == 0  # rank 0 stored none


def test_states_none_of_which_moved_answer_zero():
    store = SimStore(StorageSpec(capacity_gib=1.0), SHARD, tp=1)
    keys = ["a", "b", "c"]
    assert store.states_moved(0, keys, [(2, 0), (3, 1)], 1, write=True) == 0  # no state's blocks all stored
    assert store.states_moved(0, keys, [(2, 0), (3, 1)], 3, write=False) == 0  # and a read finds none


def test_a_read_loads_the_last_state_stored_among_its_candidates():
    store = SimStore(StorageSpec(capacity_gib=1.0), SHARD, tp=1)
    keys = ["a", "b", "c", "d"]
    store.states_moved(0, keys, [(1, 0), (3, 1)], 4, write=True)
    assert store.states_moved(0, keys, [(1, 0), (3, 1), (4, 2)], 4, write=False) == 3  # 4's was never stored
    assert store.states_moved(0, keys, [(1, 0), (3, 1)], 2, write=False) == 1  # 3's blocks did not all arrive


def test_an_evicted_block_takes_its_state_with_it():
    store = SimStore(StorageSpec(capacity_gib=1.0), SHARD, tp=1)
    store.capacity = 3 * SHARD
    store.write(0, ["n"])  # no state
    store.write(0, ["a", "b"])
    store.states_moved(0, ["a", "b"], [(1, 0), (2, 1)], 2, write=True)  # states after "a" and after "b"
    store.write(0, ["x"])  # "n" goes: a key with no state, while others have one
    assert store.evictions == 1
    assert store.states_moved(0, ["a", "b"], [(1, 0), (2, 1)], 2, write=False) == 2
    store.write(0, ["y"])  # "a" goes, and its state with it
    store.write(0, ["a"])  # stored again, without a state; "b" goes
    assert store.evictions == 3 and [k for k, _ in store.contents()] == ["x", "y", "a"]
    assert store.states_moved(0, ["a"], [(1, 0)], 1, write=False) == 0
    store.write(0, ["b"])
    assert store.states_moved(0, ["b"], [(1, 0)], 1, write=False) == 0


def test_the_pools_figures_in_seconds_and_bytes():
    spec = StorageSpec(capacity_gib=2.0, bandwidth_gbps=25.0, latency_ms=2.0, query_latency_ms=0.5)
    store = SimStore(spec, SHARD, tp=1)
    assert store.capacity == 2 * 2**30 and store.bandwidth == 25e9
    assert store.latency == 0.002 and store.query_latency == 0.0005
    assert store.occupy(1.0, 50_000_000) == (1.0, 1.0 + 0.002 + 0.002)  # 2 ms on the link, then the latency
    assert store.occupy(1.0, 25_000_000) == (1.002, 1.003 + 0.002)  # queued behind the first

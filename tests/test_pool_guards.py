"""The block pools' edges that a mutation run of the core showed untested: exact headroom
boundaries, a free block's refcount, and errors naming the call and the rule broken."""
from __future__ import annotations

import re

import numpy as np
import pytest
from rigs import Rig
from test_mutant_guards import first_token_code, no_retry, p_writing

from kvstate import KVStateError
from kvstate._hostpool import HostBlockPool
from kvstate._pool import BlockPool
from kvstate._prefixcache import PrefixCachingPool
from kvstate._timers import FENCE, TRANSFER, WAIT, Timers
from kvstate.events import Completion

POOLS = [BlockPool, PrefixCachingPool]


@pytest.mark.parametrize("cls", POOLS)
def test_headroom_is_an_exact_boundary(cls):
    pool = cls(8)
    pool.allocate(4)
    assert pool.can_allocate(4) and pool.can_allocate(3, headroom=1)
    assert not pool.can_allocate(4, headroom=1) and not pool.can_allocate(5)


@pytest.mark.parametrize("cls", POOLS)
def test_a_free_block_s_refcount_is_zero(cls):
    pool = cls(8)
    [b] = pool.allocate(1)
    pool.free([b])
    assert pool.refcount(b) == 0 and pool.refcount(7) == 0


@pytest.mark.parametrize("cls", POOLS)
@pytest.mark.parametrize("call, needle", [
    (lambda p: p.refcount(99), r"BlockPool\.refcount: block 99 is out of range 0\.\.7$"),
    (lambda p: p.share([8]), r"BlockPool\.share: block 8 is out of range 0\.\.7$"),
    (lambda p: p.free([-1]), r"BlockPool\.free: block -1 is out of range 0\.\.7$"),
    (lambda p: p.free("ab"), r"BlockPool\.free: block ids must be a sequence of ints, got 'ab'"),
    (lambda p: p.share([1.5]), r"BlockPool\.share: block id 1\.5 is not an int"),
    (lambda p: p.share([3]), r"BlockPool\.share: block 3 is free"),
    (lambda p: p.can_allocate(-1), r"BlockPool: n must be"),
    (lambda p: p.can_allocate(1, headroom=-1), r"BlockPool: headroom must be"),
])
def test_errors_name_the_call_and_the_rule(cls, call, needle):
    pool = cls(8)
    with pytest.raises(KVStateError, match=needle):
        call(pool)
    assert pool.num_free == 8


def test_host_lookups_count_every_hit_and_miss():
    host = HostBlockPool(4)
    host.acquire(["a", "b"])
    host.commit(["a", "b"])
    assert host.lookup(["a", "b", "c"]) == 2 and host.lookup(["a", "x"]) == 1
    st = host.stats()
    assert (st.hits, st.misses) == (3, 2)


def test_a_pool_counts_its_allocations_frees_and_peak():
    pool = BlockPool(8)
    st = pool.stats()
    assert (st.peak_used, st.allocations, st.frees) == (0, 0, 0)
    ids = pool.allocate(3)
    pool.free(ids[:2])
    pool.allocate(1)
    st = pool.stats()
    assert (st.peak_used, st.allocations, st.frees, st.used) == (3, 4, 2, 2)
    assert pool.release(pool.allocate(2)) == 2 and pool.stats().frees == 4  # the owner's unchecked path counts too


def test_pool_sizes_and_counts_are_refused_naming_the_value():
    with pytest.raises(KVStateError, match=r"BlockPool: num_blocks .*-1"):
        BlockPool(-1)
    empty = BlockPool(0)
    assert empty.num_free == 0 and empty.allocate(0) == []
    with pytest.raises(KVStateError, match=r"cannot allocate 1 block\(s\) keeping 0 free: 0 of 0 are free"):
        empty.allocate(1)
    pool = BlockPool(4)
    with pytest.raises(KVStateError, match=r"BlockPool: n .*-2"):
        pool.allocate(-2)
    with pytest.raises(KVStateError, match=r"BlockPool: headroom .*-1"):
        pool.allocate(1, headroom=-1)
    assert pool.num_free == 4


def _idle_cache(total: int, cached: int) -> PrefixCachingPool:
    """A prefix cache of ``total`` blocks, ``cached`` of them idle and published (k0, k1, ...)."""
    pool = PrefixCachingPool(total)
    ids = pool.allocate(cached)
    pool.publish([f"k{i}" for i in range(cached)], ids)
    assert pool.release(ids) == cached
    return pool


@pytest.mark.parametrize("n, headroom, name", [
    (1, -1, "headroom"), (1, 1.5, "headroom"), (1, True, "headroom"), (-2, 0, "n"), (1.5, 0, "n"), (True, 0, "n"),
])
def test_a_prefix_cache_refuses_bad_counts_evicting_nothing(n, headroom, name):
    pool = _idle_cache(4, 4)  # every free block is idle: a slipped check would evict one
    bad = headroom if name == "headroom" else n
    with pytest.raises(KVStateError, match=rf"^BlockPool: {name} must be .*{re.escape(repr(bad))}"):
        pool.allocate(n, headroom)
    assert len(pool.cached_blocks()) == 4 and pool.num_free == 4 and pool.prefix_stats().evictions == 0


def test_a_prefix_cache_evicts_only_what_the_free_list_lacks():
    pool = _idle_cache(4, 2)
    assert len(pool.allocate(2)) == 2 and len(pool.cached_blocks()) == 2  # two keyless blocks were free
    pool.allocate(1)
    pool.allocate(1)
    assert pool.prefix_stats().evictions == 2 and not pool.cached_blocks()  # counted across evictions
    with pytest.raises(KVStateError, match=r"^cannot allocate 1 block\(s\) keeping 0 free: 0 of 4 are free$"):
        pool.allocate(1)


def test_a_prefix_cache_counts_like_a_pool():
    pool = _idle_cache(6, 2)
    a = pool.allocate(3)
    pool.share(a[:1])
    assert pool.release(a) == 2 and pool.release(a[:1]) == 1
    st = pool.stats()
    assert (st.total, st.free, st.used, st.shared, st.peak_used) == (6, 6, 0, 0, 3)
    assert (st.allocations, st.frees, st.cached) == (5, 5, 2)
    pool.share(pool.allocate(1))
    assert pool.stats().shared == 1


def test_allocate_after_keeps_no_headroom_by_default():
    pool = _idle_cache(4, 2)
    got = pool.allocate_after(["k0", "k1", "x"], 4)
    assert got is not None and got[1] == 2 and pool.num_free == 0


def test_host_pool_errors_name_the_call_the_key_and_the_count():
    with pytest.raises(KVStateError, match=r"^HostBlockPool: num_slots must be"):
        HostBlockPool(0)
    host = HostBlockPool(2)
    host.acquire(["a"])
    with pytest.raises(KVStateError, match=r"^host tier: 2 new block\(s\) needed, 1 free and 0 evictable of 2$"):
        host.acquire(["a", "b", "c"])
    with pytest.raises(KVStateError, match=r"a key appears twice in \['x', 'x', 'y', 'z'\]\.\.\.$"):
        host.acquire(["x", "x", "y", "z", "w"])
    long = "0123456789abcdefGHIJ"
    for op in ("slots", "retain", "commit", "release"):
        with pytest.raises(KVStateError, match=rf"^HostBlockPool\.{op}: key '0123456789abcdef'\.\.\. holds no slot$"):
            getattr(host, op)([long])
    host.acquire([long])
    host.commit([long])
    host.release([long])  # ready, kept, unreferenced
    with pytest.raises(KVStateError, match=r"^HostBlockPool\.release: key '0123456789abcdef'\.\.\. has no reference"):
        host.release([long])
    assert host.refcount("a") == 1 and host.refcount(long) == 0 and host.stats().entries == 2


def test_host_pool_counts_each_eviction():
    host = HostBlockPool(1)
    for key in ("a", "b", "c"):
        host.acquire([key])
        host.commit([key])
        host.release([key])  # ready and unreferenced: evictable
    st = host.stats()
    assert (st.slots, st.free, st.entries, st.evictions) == (1, 0, 1, 2)


@pytest.mark.parametrize("rank, count, lost, needle", [
    (5, 0, False, r"rank 5 is not one of its ranks \(0, 1\)"),
    (0, 99, False, r"count 99 outside 0\.\.2"),
    (0, 0, "yes", r"a lost answer is lost=True with count 0, got lost='yes', count 0"),
])
def test_a_bad_answer_names_its_command_request_and_rule(rank, count, lost, needle):
    rig = Rig(tp=2, policy=no_retry())
    cmd = p_writing(rig)
    where = rf"^command {cmd.command_id} of request 'r': "
    with pytest.raises(KVStateError, match=where + needle):
        rig.P.complete(Completion(cmd.command_id, rank, count, lost=lost))
    assert rig.P.state_of("r") == "writing"


def test_numpy_ints_are_ranks_and_counts():
    rig = Rig(tp=2, policy=no_retry())
    cmd = p_writing(rig)
    for rank in (0, 1):
        rig.pd.drop(cmd.command_id, rank)
        rig.P.complete(Completion(cmd.command_id, np.int64(rank), np.int32(len(cmd.keys))))
    assert first_token_code(rig) == 200


def test_timers_stay_in_order_when_the_clock_goes_back():
    timers = Timers()
    for when, ident in ((1.0, "a"), (5.0, "b"), (9.0, "c"), (3.0, "d"), (5.0, "e")):
        timers.push(TRANSFER, when, ident)  # d and e were set after the clock went back
    timers.push(WAIT, 5.0, "w")
    timers.push(FENCE, 4.0, "f")
    assert [i for _, i in timers.due(100.0)] == ["a", "d", "f", "b", "e", "w", "c"]  # equal times: first set first

"""The block pools' edges that a mutation run of the core showed untested: exact headroom
boundaries, a free block's refcount, and errors naming the call and the rule broken."""
from __future__ import annotations

import pytest

from kvstate import KVStateError
from kvstate.hostpool import HostBlockPool
from kvstate.pool import BlockPool
from kvstate.prefixcache import PrefixCachingPool

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

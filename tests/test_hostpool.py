"""The host tier's bookkeeping: slots by content key, references, LRU of idle ready entries."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstate._errors import BlockError, HostTierFullError, KVStateError
from kvstate._hostpool import HostBlockPool


def keys(*names: str) -> list[str]:
    return [f"k{n}" for n in names]


def test_acquire_grants_slots_and_names_the_fresh_ones():
    pool = HostBlockPool(4)
    slots, fresh = pool.acquire(keys("a", "b"))
    assert slots == [0, 1] and fresh == [0, 1]
    assert pool.lookup(keys("a")) == 0  # filling: not a hit yet
    pool.commit(keys("a", "b"))
    assert pool.lookup(keys("a", "b", "c")) == 2 and pool.hits == 2 and pool.misses == 2  # one from the look above
    slots2, fresh2 = pool.acquire(keys("a", "c"))  # a is shared, c is new
    assert slots2 == [0, 2] and fresh2 == [1]
    assert pool.refcount("ka") == 2


def test_idle_ready_entries_are_kept_then_evicted_least_recently_used_first():
    pool = HostBlockPool(2)
    pool.acquire(keys("a", "b"))
    pool.commit(keys("a", "b"))
    pool.release(keys("a"))
    pool.release(keys("b"))
    assert pool.ready_prefix(keys("a", "b")) == 2  # kept for later hits
    pool.acquire(keys("a"))  # a is used again: b is now the least recently used
    pool.release(keys("a"))
    slots, fresh = pool.acquire(keys("c"))
    assert fresh == [0] and slots == [pool_slot_of_b := 1] and pool.evictions == 1
    assert pool.ready_prefix(keys("a")) == 1 and pool.ready_prefix(keys("b")) == 0
    assert pool_slot_of_b == 1


def test_a_referenced_entry_is_never_evicted_and_full_changes_nothing():
    pool = HostBlockPool(2)
    pool.acquire(keys("a", "b"))
    before = pool.stats()
    with pytest.raises(HostTierFullError, match="1 new block"):
        pool.acquire(keys("a", "c"))
    assert pool.stats() == before and pool.refcount("ka") == 1
    assert isinstance(HostTierFullError("x"), KVStateError)


def test_a_filling_entry_whose_last_reference_goes_is_dropped():
    pool = HostBlockPool(2)
    pool.acquire(keys("a"))
    pool.retain(keys("a"))  # an in-flight copy
    pool.release(keys("a"))
    assert pool.stats().entries == 1  # the copy still holds it
    pool.release(keys("a"))
    assert pool.stats().entries == 0 and pool.stats().free == 2


def test_taking_back_an_idle_entry_does_not_count_it_as_evictable():
    pool = HostBlockPool(2)
    pool.acquire(keys("a", "b"))
    pool.commit(keys("a", "b"))
    pool.release(keys("a", "b"))
    assert pool.can_acquire(keys("a", "c"))  # evicts b
    assert not pool.can_acquire(keys("a", "b", "c"))
    slots, fresh = pool.acquire(keys("a", "c"))
    assert fresh == [1] and pool.ready_prefix(keys("a")) == 1


@pytest.mark.parametrize("call", [
    lambda p: p.acquire(keys("a", "a")),
    lambda p: p.release(keys("z")),
    lambda p: p.commit(keys("z")),
    lambda p: p.retain(keys("z")),
    lambda p: p.slots(keys("z")),
])
def test_bad_calls_raise_naming_the_key_and_change_nothing(call):
    pool = HostBlockPool(3)
    pool.acquire(keys("x"))
    before = pool.stats()
    with pytest.raises(BlockError):
        call(pool)
    assert pool.stats() == before


def test_a_release_below_zero_raises_before_changing_any_key():
    pool = HostBlockPool(3)
    pool.acquire(keys("a", "b"))
    pool.commit(keys("b"))
    pool.release(keys("b"))  # b stays, idle and ready
    with pytest.raises(BlockError, match="no reference"):
        pool.release(keys("a", "b"))
    assert pool.refcount("ka") == 1


class HostPoolModel(RuleBasedStateMachine):
    """Random acquires, pins, commits and releases against a plain model of references."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HostBlockPool(6)
        self.refs: dict[str, int] = {}
        self.ready: set[str] = set()

    @rule(names=st.lists(st.sampled_from("abcdefghij"), min_size=1, max_size=4, unique=True))
    def acquire(self, names):
        ks = keys(*names)
        ok = self.pool.can_acquire(ks)
        try:
            slots, fresh = self.pool.acquire(ks)
        except HostTierFullError:
            assert not ok
            return
        assert ok and len(set(slots)) == len(slots)
        for i, k in enumerate(ks):
            if i in fresh:
                self.ready.discard(k)  # a new entry (the old one, if any, was evicted)
            self.refs[k] = self.refs.get(k, 0) + 1

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def commit_or_release(self, data):
        k = data.draw(st.sampled_from(sorted(k for k, r in self.refs.items() if r)))
        if data.draw(st.booleans()):
            self.pool.commit([k])
            self.ready.add(k)
        else:
            self.pool.release([k])
            self.refs[k] -= 1
            if not self.refs[k] and k not in self.ready:
                del self.refs[k]

    @invariant()
    def matches_the_model(self):
        st_ = self.pool.stats()
        assert st_.free + st_.entries == 6
        for k, r in self.refs.items():
            assert self.pool.refcount(k) == r
        held = [k for k, r in self.refs.items() if r]
        assert len(set(self.pool.slots(held))) == len(held)  # no slot shared by two keys
        for k in held:
            assert self.pool.ready_prefix([k]) == (1 if k in self.ready else 0)


TestHostPoolModel = HostPoolModel.TestCase
TestHostPoolModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

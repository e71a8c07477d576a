"""Every protocol invariant can fail: each test plants one bug in the library and checks that the
protocol machine reports it under that invariant's name."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from protocol_machine import Protocol
from protocol_support import INVARIANTS

from kvstate import _pool as pool_mod
from kvstate._decode import DecodeLifecycle
from kvstate._pins import Transfers
from kvstate._prefixcache import PrefixCachingPool
from kvstate._registry import Registry
from kvstate._timers import TRANSFER, Timers
from kvstate.backends import ReferenceBackend

# derandomized: each break is found by the same examples every run (a random search missed one
# in 400 examples now and then, failing a suite run at random)
HUNT = settings(max_examples=400, stateful_step_count=40, deadline=None, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck), derandomize=True)


def fires(name: str, examples: int = 400, layouts: tuple[str, ...] = ()) -> None:
    """Run the protocol machine with every invariant but ``name`` turned off: it must fail, and
    say ``name`` (within ``examples``: an invariant of one layout in eight needs more, or only
    its ``layouts`` drawn)."""
    others = {n: (lambda self, *args: None) for n in INVARIANTS if n != name and hasattr(Protocol, n)}
    cls = type(f"Only_{name}", (Protocol,), {**others, "CHECK_DRAINED": name == "drained_all_terminal_and_empty",
                                              "LAYOUTS_ONLY": layouts})
    with pytest.raises(AssertionError) as e:
        run_state_machine_as_test(cls, settings=settings(HUNT, max_examples=examples))
    assert name in str(e.value), str(e.value)[:500]


def test_block_owned_by_one_request_unless_a_cached_prefix(monkeypatch):
    real = pool_mod.BlockPool.allocate

    def hands_out_a_held_block(self, n, headroom=0):
        ids = real(self, n, headroom)
        held = [b for b, r in enumerate(self.refcounts()) if r and b not in ids]
        if ids and held:
            self.release(ids[:1])
            ids[0] = held[0]  # a block another request owns
        return ids
    monkeypatch.setattr(pool_mod.BlockPool, "allocate", hands_out_a_held_block)
    fires("block_owned_by_one_request_unless_a_cached_prefix")


def test_refcount_equals_owners_plus_pins(monkeypatch):
    def pins_without_a_reference(self, req):
        for t in req.inflight:
            t.pinned = True
    monkeypatch.setattr(Transfers, "pin", pins_without_a_reference)
    fires("refcount_equals_owners_plus_pins")


def test_free_list_holds_exactly_the_unheld_blocks(monkeypatch):
    real = pool_mod.BlockPool.release

    def loses_a_freed_block(self, ids):
        freed = real(self, ids)
        if freed and len(ids) > 1 and ids[0] in self._free:  # the planted bug, inside the pool's own method
            self._free.remove(ids[0])
        return freed
    monkeypatch.setattr(pool_mod.BlockPool, "release", loses_a_freed_block)
    fires("free_list_holds_exactly_the_unheld_blocks")


def test_pool_counts_match_its_blocks(monkeypatch):
    real = pool_mod.BlockPool.stats
    monkeypatch.setattr(pool_mod.BlockPool, "stats", lambda self: dataclasses.replace(real(self), peak_used=0))
    fires("pool_counts_match_its_blocks")


def test_every_transfer_has_a_timer_due_by_its_fence(monkeypatch):
    real = Timers.push

    def drops_transfer_deadlines(self, kind, when, ident):
        if kind != TRANSFER:
            real(self, kind, when, ident)
    monkeypatch.setattr(Timers, "push", drops_transfer_deadlines)
    fires("every_transfer_has_a_timer_due_by_its_fence")


def test_live_request_in_legal_state(monkeypatch):
    def keeps_ended_requests_live(self, req):
        self._ended[req.id] = req.state  # noqa: SLF001 - the planted bug: never leaves `live`
    monkeypatch.setattr(Registry, "end", keeps_ended_requests_live)
    fires("live_request_in_legal_state")


def test_transfer_blocks_held_by_their_request_or_pinned(monkeypatch):
    monkeypatch.setattr(Transfers, "pin", lambda self, req: None)
    fires("transfer_blocks_held_by_their_request_or_pinned")


def test_runnable_only_after_full_read_on_every_rank(monkeypatch):
    monkeypatch.setattr(DecodeLifecycle, "_read_complete", lambda self, req, value: True)
    fires("runnable_only_after_full_read_on_every_rank_with_p_bytes")


def test_drained_all_terminal_and_empty(monkeypatch):
    real = Transfers.retire

    def keeps_pins(self, t):
        t.pinned = False  # its blocks stay referenced after it retires: a leak
        return real(self, t)
    monkeypatch.setattr(Transfers, "retire", keeps_pins)
    fires("drained_all_terminal_and_empty")


def test_host_refs_equal_holders_plus_copies(monkeypatch):
    real = Transfers.retire

    def forgets_the_copys_host_reference(self, t):
        t.host_keys = ()  # a retired swap keeps its host entries referenced: slots never come back
        return real(self, t)
    monkeypatch.setattr(Transfers, "retire", forgets_the_copys_host_reference)
    fires("host_refs_equal_holders_plus_copies")


def test_gpu_cached_block_holds_its_keys_bytes(monkeypatch):
    real = PrefixCachingPool.publish

    def publishes_one_block_off(self, keys, blocks):
        real(self, keys[1:], blocks)  # each block under the next block's key
    monkeypatch.setattr(PrefixCachingPool, "publish", publishes_one_block_off)
    fires("gpu_cached_block_holds_its_keys_bytes")


def test_swap_in_of_a_partial_copy_is_caught(monkeypatch):
    """A swap-in that declares a partial copy complete starts decoding on wrong bytes."""
    monkeypatch.setattr(DecodeLifecycle, "_swap_in_complete", lambda self, req, value: True)
    fires("runnable_only_after_full_read_on_every_rank_with_p_bytes")


def test_no_transfer_touches_a_block_freed_behind_the_window(monkeypatch):
    real = DecodeLifecycle._free_behind_window

    def forgets_where_the_window_starts(self, req):
        before = req.window_from
        real(self, req)
        req.window_from = before  # a write-back or reload would start before the window
    monkeypatch.setattr(DecodeLifecycle, "_free_behind_window", forgets_where_the_window_starts)
    fires("no_transfer_touches_a_block_freed_behind_the_window", 1000, ("sliding",))  # every layer a window


def test_state_reused_only_at_its_checkpoint(monkeypatch):
    real = ReferenceBackend._scatter_state

    def lands_reversed(self, rank, page, data):
        real(self, rank, page, data[::-1])  # verified in the buffer, garbled on its way to the page
    monkeypatch.setattr(ReferenceBackend, "_scatter_state", lands_reversed)
    fires("state_reused_only_at_its_checkpoint", 1000, ("state", "window_state"))


def test_runnable_only_with_the_caches_state(monkeypatch):
    monkeypatch.setattr(ReferenceBackend, "_scatter_state", lambda self, rank, page, data: None)  # "read", not landed
    fires("runnable_only_with_the_caches_state", 1000, ("state", "window_state"))

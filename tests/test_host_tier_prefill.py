"""The host tier at P, on real bytes (reference backend): a prompt's prefix looked up in host
memory before the store, and each stored cache copied into the tier without being awaited."""
from __future__ import annotations

import pytest
from lifecycle_helpers import answer_only, d_matches, fill_p, swapping_rig
from rigs import Clock, Rig, small_spec

from kvstate import Policy, PrefillLifecycle
from kvstate import commands as C
from kvstate import events as E
from kvstate._keys import block_keys

# -- P: the prefix looked up by tier, the cache copied to the host tier after the store -------------
LONG = list(range(200, 217))  # 17 tokens: 4 full blocks of 4 and a partial one; a prefix limit of 4


def p_view(rig: Rig) -> Rig:
    """``d_matches`` reads ``rig.db``: a view whose D backend is P's."""
    view = Rig.__new__(Rig)
    view.db, view.spec = rig.pb, rig.spec
    return view


def p_served(rig: Rig, rid: str, toks, copy: bool = True) -> C.StartPrefill:
    """Admit on D and P, look the prefix up, prefill with the true bytes, store the cache (and,
    with ``copy``, let the host copy answer); returns P's StartPrefill."""
    rig.D.reserve(rid, toks)
    rig.P.admit(rid, toks)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_p(rig, rid, toks, sp.block_ids, sp.num_cached_tokens // rig.spec.block_size)
    rig.P.prefill_done(rid, 7)
    answer_only(rig.pd, C.WriteBlocks)
    if copy:
        rig.pd.run_until_idle()
    return sp


def test_p_copies_a_stored_cache_to_its_host_tier_without_waiting_for_it():
    rig = swapping_rig()
    p_served(rig, "a", LONG, copy=False)
    assert "a" not in rig.P.live_requests()  # done at once: the first token went out
    assert rig.notices(rig.pd, C.SendFirstToken)[0].error_code == 200
    assert rig.P.pool.num_used == 5  # the host copy pins its blocks until it answers
    rig.pd.run_until_idle()
    assert rig.P.pool.num_used == 0
    assert rig.P.host.ready_prefix(block_keys(LONG, 4)) == 5 and rig.P.host.stats().referenced == 0


def test_a_prefix_in_the_host_tier_is_copied_in_and_the_store_is_not_asked():
    rig = swapping_rig()
    p_served(rig, "a", LONG)
    rig.store.evict(list(rig.store.keys()))  # the pool lost everything: only host memory has it
    sp = p_served(rig, "b", LONG[:16] + [9, 9])
    assert sp.num_cached_tokens == 16
    assert rig.P.counters["host_prefix_blocks"] == 4 and rig.P.counters["store_prefix_blocks"] == 0
    assert d_matches(p_view(rig), LONG[:16], sp.block_ids[:4])
    p_served(rig, "c", LONG[:16] + [8, 8])
    assert rig.P.counters["host_prefix_blocks"] == 8  # counted for every request


def test_the_store_serves_what_the_host_tier_lacks():
    rig = swapping_rig()
    other = swapping_rig(store=rig.store)
    p_served(other, "x", LONG)  # another P put all 4 blocks in the shared store
    p_served(rig, "a", LONG[:9])  # this P's host tier now holds the first 2 (read from the store)
    host0, store0 = rig.P.counters["host_prefix_blocks"], rig.P.counters["store_prefix_blocks"]
    sp = p_served(rig, "c", LONG[:16] + [1])
    assert sp.num_cached_tokens == 16
    assert rig.P.counters["host_prefix_blocks"] - host0 == 2 and rig.P.counters["store_prefix_blocks"] - store0 == 2
    assert d_matches(p_view(rig), LONG[:16], sp.block_ids[:4])
    p_served(rig, "d", LONG[:16] + [2])
    assert rig.P.counters["host_prefix_blocks"] - host0 == 6  # counted for every request: c's 4 now in host memory
    sp = p_served(rig, "f", LONG[:16])  # a prompt of whole blocks leaves its last block to compute
    assert sp.num_cached_tokens == 12
    longer = LONG[:16] + list(range(60, 68))  # 6 whole blocks: the first 4 in host memory
    p_served(other, "y", longer + [5])  # the store holds all 6
    before = rig.P.counters["host_prefix_blocks"]
    sp = p_served(rig, "g", longer)
    assert sp.num_cached_tokens == 20  # 4 from host memory, 1 from the store: the 6th is computed
    assert rig.P.counters["host_prefix_blocks"] == before + 4


def test_a_partial_host_copy_prefills_from_where_it_stopped_and_abort_leaks_nothing():
    rig = swapping_rig()
    p_served(rig, "a", LONG)
    rig.store.evict(list(rig.store.keys()))
    rig.D.reserve("b", LONG)
    rig.P.admit("b", LONG)
    assert rig.P.state_of("b") == "loading_prefix"
    rig.pd.pump()
    [cid] = {c for c, _ in rig.pd.pending}
    rig.pd.complete(cid, 0, 1)
    rig.pd.complete(cid, 1)
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.num_cached_tokens == 4  # the store was not asked: rank 0 stopped short
    rig.D.reserve("c", LONG)
    rig.P.admit("c", LONG)
    assert rig.P.state_of("c") == "loading_prefix"
    rig.P.abort("c")  # the copy still answers, then its pins and references go
    rig.pd.run_until_idle()
    rig.P.abort("b")
    assert rig.P.pool.num_used == 0 and rig.P.host.stats().referenced == 0


def test_a_full_host_tier_skips_the_copy():
    rig = swapping_rig(host_blocks=3)
    p_served(rig, "a", LONG, copy=False)
    assert rig.P.pool.num_used == 0 and rig.P.host.stats().entries == 0





def host_primed_prefill() -> PrefillLifecycle:
    """A P whose host tier holds the two whole blocks of ``range(8)`` (a stored prompt's copy)."""
    p = PrefillLifecycle(small_spec(1), 16, clock=Clock(), host_blocks=8)
    p.admit("a", list(range(8)) + [99])
    [look] = p.pending_commands()
    p.complete(E.Completion(look.command_id, 0, 0))  # the store has nothing
    p.prefill_done("a", 7)
    [w] = p.pending_commands()
    p.complete(E.Completion(w.command_id, 0, 3))
    [copy] = p.pending_commands()
    p.complete(E.Completion(copy.command_id, 0, 3))
    p.poll_commands()
    return p


@pytest.mark.parametrize("prompt, copied, cached", [
    (list(range(8)) + [5, 6, 7, 8], 2, 8),  # the host tier holds the whole prefix limit (2)
    (list(range(8)) + list(range(50, 58)), 1, 4),  # its copy came short: prefill from there
])
def test_the_store_is_asked_only_for_blocks_past_a_whole_host_copy(prompt, copied, cached):
    p = host_primed_prefill()
    p.admit("b", prompt)
    [swap_in] = p.poll_commands()
    assert isinstance(swap_in, C.SwapIn) and len(swap_in.keys) == 2
    p.complete(E.Completion(swap_in.command_id, 0, copied))
    out = p.poll_commands()
    assert not [c for c in out if isinstance(c, C.ReadBlocks)]
    [start] = [c for c in out if isinstance(c, C.StartPrefill)]
    assert start.num_cached_tokens == cached


def test_p_s_copy_to_host_memory_outlives_its_request_uncancelled():
    p = PrefillLifecycle(small_spec(1), 8, Policy(read_prefix=False), clock=Clock(), host_blocks=8)
    p.admit("r", list(range(12)))
    p.prefill_done("r", 7)
    [w] = p.pending_commands()
    p.poll_commands()
    p.complete(E.Completion(w.command_id, 0, 3))
    out = p.poll_commands()
    [copy] = [c for c in out if isinstance(c, C.SwapOut)]
    assert copy.request_id == "r" and not p.is_live("r")
    assert not [c for c in out if isinstance(c, C.CancelCommand)]
    p.complete(E.Completion(copy.command_id, 0, 3))
    assert p.host.ready_prefix(list(copy.keys)) == 3 and p.pool.num_used == 0

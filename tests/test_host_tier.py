"""The host tier in D's lifecycle, on real bytes (reference backend): swap out, swap in,
fallbacks when the tier is full or a copy fails, aborts in every swap state, deadlines."""
from __future__ import annotations

import pytest
from lifecycle_helpers import SWAP, TOKS, answer_only, d_matches, deliver, handoff, running, swapping_rig
from rigs import Rig

from kvstate import commands as C
from kvstate._errors import ConfigError, ValidationError
from kvstate._keys import block_keys
from kvstate.testing import fill_blocks

TOKS_NOW = TOKS + [7, 1, 2, 3]  # the prompt, the first token, three decoded tokens


def decoding(rig: Rig, rid: str = "r") -> tuple[int, ...]:
    """``rid`` running with 3 decoded tokens whose blocks hold their true bytes."""
    running(rig, rid)
    rig.D.append_tokens(rid, [1, 2, 3])
    blocks = rig.D.blocks_of(rid)
    fill_blocks(rig.db, block_keys(TOKS_NOW[:-1], 4), blocks)
    return blocks


def scribble(rig: Rig, blocks) -> None:
    for b in blocks:
        for r in range(rig.spec.tp_size):
            for kind in rig.spec.kinds:
                rig.db.fill_block(r, kind, b, bytes(rig.spec.block_bytes(kind)))


def host_clean(rig: Rig) -> None:
    """No host entry is referenced once nothing is swapped or in flight."""
    assert rig.D.host is not None and rig.D.host.stats().referenced == 0, rig.D.host.stats()


def test_swap_out_frees_the_gpu_and_swap_in_brings_the_same_bytes_back():
    rig = swapping_rig()
    blocks = decoding(rig)
    rig.D.preempt("r")
    assert rig.D.state_of("r") == "swapping_out" and rig.D.pool.num_used == len(blocks)
    [cmd] = [c for c in rig.D.pending_commands() if isinstance(c, C.SwapOut)]
    assert len(cmd.host_slots) == len(cmd.keys) == 4  # 13 tokens before the newest: 3 full blocks, 1 partial
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "swapped" and rig.D.pool.num_used == 0
    assert rig.D.host.ready_prefix(list(cmd.keys)) == 4
    scribble(rig, blocks)
    new = rig.D.resume("r")
    assert rig.D.state_of("r") == "swapping_in"
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS_NOW[:-1], new)
    assert rig.store.batch_is_exist(["nothing-written-for-the-swap"]) == [0]
    rig.D.finish("r")
    host_clean(rig)
    assert rig.D.host.stats().entries == 4  # kept for later hits, evictable


def test_keys_already_in_the_host_tier_are_shared_not_copied():
    rig = swapping_rig()
    decoding(rig, "a")
    rig.D.preempt("a")
    rig.dd.run_until_idle()
    rig.D.resume("a")
    rig.dd.run_until_idle()  # a's blocks are now idle, ready entries
    rig.D.finish("a")
    decoding(rig, "b")  # the same tokens: the same keys
    rig.D.preempt("b")
    [cmd] = [c for c in rig.D.pending_commands() if isinstance(c, C.SwapOut)]
    assert cmd.keys == () and cmd.block_ids == ()  # nothing to copy
    rig.dd.run_until_idle()
    assert rig.D.state_of("b") == "swapped" and rig.D.host.stats().referenced == 4


@pytest.mark.parametrize("fallback,state", [("write", "preempt_writing"), ("recompute", "preempted")])
def test_a_full_host_tier_falls_back_per_policy(fallback, state):
    rig = swapping_rig(host_blocks=2, swap_fallback=fallback)
    decoding(rig)
    rig.D.preempt("r")
    assert rig.D.state_of("r") == state
    rig.dd.run_until_idle()
    rig.D.resume("r")
    assert rig.D.state_of("r") == ("reloading" if fallback == "write" else "recomputing")
    assert rig.D.host.stats().entries == 0


@pytest.mark.parametrize("fallback,state", [("write", "preempt_writing"), ("recompute", "preempted")])
def test_a_failed_swap_out_drops_its_entries_and_falls_back(fallback, state):
    rig = swapping_rig(swap_fallback=fallback)
    decoding(rig)
    rig.D.preempt("r")
    rig.dd.pump()
    [(cid, _), *rest] = list(rig.dd.pending)
    rig.dd.complete(cid, 0, "fail")
    rig.dd.complete(cid, 1)
    assert rig.D.state_of("r") == state
    assert rig.D.host.stats().entries == 0  # unfilled entries went with their last reference


def test_a_partial_swap_in_recomputes_the_rest():
    rig = swapping_rig()
    decoding(rig)
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    rig.D.resume("r")
    rig.dd.pump()
    [cid] = {c for c, _ in rig.dd.pending}
    rig.dd.complete(cid, 0, 1)
    rig.dd.complete(cid, 1)
    assert rig.D.state_of("r") == "recomputing"
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 4  # one block came back
    host_clean(rig)


@pytest.mark.parametrize("where", ["swapping_out", "swapped", "swapping_in"])
def test_abort_in_every_swap_state_leaks_nothing(where):
    rig = swapping_rig()
    decoding(rig)
    rig.D.preempt("r")
    if where != "swapping_out":
        rig.dd.run_until_idle()
    if where == "swapping_in":
        rig.D.resume("r")
    assert rig.D.state_of("r") == where
    rig.D.abort("r")
    rig.dd.run_until_idle()  # the abandoned copy answers: its pins go
    assert rig.D.live_requests() == [] and rig.D.pool.num_used == 0
    host_clean(rig)


def test_preempting_a_swap_in_returns_to_swapped_and_resumes_again():
    rig = swapping_rig()
    decoding(rig)
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    rig.D.resume("r")
    rig.D.preempt("r")
    assert rig.D.state_of("r") == "swapped"
    rig.dd.run_until_idle()
    assert rig.D.pool.num_used == 0
    new = rig.D.resume("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS_NOW[:-1], new)


def test_a_swapped_request_past_its_deadline_lets_the_host_copy_go():
    rig = swapping_rig(swapped_timeout=50.0)
    decoding(rig)
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    assert rig.D.next_deadline() == rig.clock.now + 50.0
    rig.clock.now += 50.0
    rig.D.tick()
    assert rig.D.state_of("r") == "preempted"
    host_clean(rig)
    rig.D.resume("r")
    assert rig.D.state_of("r") == "recomputing"


def swap_out_past_its_deadline(rig: Rig) -> int:
    """Preempt ``r`` (decoding) and let its swap-out's deadline pass unanswered; its command id."""
    decoding(rig)
    rig.D.preempt("r")
    rig.dd.pump()
    [cid] = {c for c, _ in rig.dd.pending}
    rig.clock.now += 10.0
    rig.D.tick()  # the deadline passes: fallback to the store write
    return cid


def test_a_timed_out_swap_out_keeps_its_slots_until_the_late_answer():
    rig = swapping_rig()
    cid = swap_out_past_its_deadline(rig)
    assert rig.D.state_of("r") == "preempt_writing"
    assert rig.D.host.stats().referenced == 4  # the unanswered copy still holds its slots
    rig.dd.complete(cid, 0)
    rig.dd.complete(cid, 1, 2)  # late, and partial on rank 1: its entries never hold
    assert rig.D.host.stats().entries == 0 and rig.D.host.stats().referenced == 0


def test_a_late_swap_out_that_copied_everything_leaves_ready_entries():
    rig = swapping_rig()
    cid = swap_out_past_its_deadline(rig)
    rig.dd.complete(cid, 0)
    rig.dd.complete(cid, 1)
    stats = rig.D.host.stats()
    assert stats.entries == 4 and stats.referenced == 0  # the bytes arrived whole: later hits


def test_swap_needs_a_host_tier_and_bad_swaps_change_nothing():
    with pytest.raises(ConfigError, match="host tier"):
        Rig(policy=SWAP)
    rig = swapping_rig(host_blocks=4)
    before = rig.db.host_slot_bytes(0, "key", 1)
    for ids, slots in [([0], [4]), ([0, 1], [1, 1]), ([0], [1, 2]), ([99], [1])]:
        with pytest.raises(ValidationError):
            rig.db.swap_out(0, ids, slots)
    assert rig.db.host_slot_bytes(0, "key", 1) == before
    with pytest.raises(ValidationError, match="no host tier"):
        Rig().db.swap_in(0, [0], [0])


def test_d_reads_what_its_host_tier_holds_from_there_and_the_rest_from_the_store():
    rig = swapping_rig()
    decoding(rig, "a")  # a's cache goes to D's host tier through a preemption
    rig.D.preempt("a")
    rig.dd.run_until_idle()
    rig.D.abort("a")  # its entries stay, idle and ready
    deliver(rig, handoff(rig, "b"))  # b's prompt: the same 10 tokens, so a's first two full blocks
    assert rig.D.state_of("b") == "loading"
    rig.dd.run_until_idle()
    assert rig.D.state_of("b") == "running" and rig.D.counters["host_read_blocks"] == 2
    assert d_matches(rig, TOKS, rig.D.blocks_of("b"))
    rig.D.reserve("c", TOKS)  # P's cache is stored: D finds a's blocks in host memory again
    rig.D.deliver_first_token("c", 7)
    rig.dd.run_until_idle()
    assert rig.D.state_of("c") == "running" and rig.D.counters["host_read_blocks"] == 4
    one = TOKS[:4] + [50, 51, 52, 53, 54]  # shares only a's first block
    deliver(rig, handoff(rig, "e", one))
    rig.dd.run_until_idle()
    assert rig.D.state_of("e") == "running" and rig.D.counters["host_read_blocks"] == 5  # a hit of one block
    assert d_matches(rig, one, rig.D.blocks_of("e"))


# -- write-through: the swapped cache also in the store ------------------------------------------------
def test_write_through_stores_the_cache_before_freeing_and_reloads_what_the_host_lost():
    rig = swapping_rig(swap_write="through", swapped_timeout=50.0)
    blocks = decoding(rig)
    rig.D.preempt("r")
    answer_only(rig.dd, C.SwapOut)
    assert rig.D.state_of("r") == "preempt_writing" and rig.D.pool.num_used == len(blocks)
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "swapped" and rig.D.pool.num_used == 0
    keys = block_keys(TOKS_NOW[:-1], 4)
    assert rig.db.query(0, keys) == rig.db.query(1, keys) == 4  # in the store too
    rig.clock.now += 50.0
    rig.D.tick()  # the host copy is let go: the store's serves the resume
    assert rig.D.state_of("r") == "preempted"
    scribble(rig, blocks)
    new = rig.D.resume("r")
    assert rig.D.state_of("r") == "reloading"
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS_NOW[:-1], new)


def test_write_through_partial_swap_in_reloads_from_the_store():
    rig = swapping_rig(swap_write="through")
    decoding(rig)
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    new = rig.D.resume("r")
    rig.dd.pump()
    [cid] = {c for c, _ in rig.dd.pending}
    rig.dd.complete(cid, 0, 1)
    rig.dd.complete(cid, 1)
    assert rig.D.state_of("r") == "reloading"
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS_NOW[:-1], new)
    host_clean(rig)


def failed_write_through() -> Rig:
    """A request swapped out whose write-through to the store failed: only host memory has it."""
    rig = swapping_rig(swap_write="through", write_retries=0)
    decoding(rig)
    rig.D.preempt("r")
    answer_only(rig.dd, C.SwapOut)
    rig.dd.pump()
    for key in list(rig.dd.pending):
        rig.dd.complete(*key, "fail")
    return rig


def test_a_failed_write_through_leaves_the_cache_swapped_in_host_memory():
    rig = failed_write_through()
    assert rig.D.state_of("r") == "swapped" and rig.D.pool.num_used == 0
    new = rig.D.resume("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS_NOW[:-1], new)


def test_write_back_stores_from_host_memory_after_the_gpu_blocks_are_free():
    rig = swapping_rig(swap_write="back", swapped_timeout=50.0)
    blocks = decoding(rig)
    rig.D.preempt("r")
    answer_only(rig.dd, C.SwapOut)
    assert rig.D.state_of("r") == "swapped" and rig.D.pool.num_used == 0  # freed before the store write
    [flush] = [c for c in rig.D.pending_commands() if isinstance(c, C.FlushHost)]
    assert flush.block_ids == () and len(flush.host_slots) == 4
    keys = block_keys(TOKS_NOW[:-1], 4)
    assert rig.db.query(0, keys) < 4
    rig.dd.run_until_idle()
    assert rig.db.query(0, keys) == rig.db.query(1, keys) == 4
    rig.clock.now += 50.0
    rig.D.tick()
    host_clean(rig)
    scribble(rig, blocks)
    new = rig.D.resume("r")
    assert rig.D.state_of("r") == "reloading"  # the store holds it: no recompute
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS_NOW[:-1], new)


@pytest.mark.parametrize("then", ["resume", "abort", "timeout"])
def test_a_write_back_in_flight_never_blocks_or_leaks(then):
    rig = swapping_rig(swap_write="back", swapped_timeout=5.0)  # within the flush's 10 s deadline
    decoding(rig)
    rig.D.preempt("r")
    answer_only(rig.dd, C.SwapOut)
    if then == "resume":
        new = rig.D.resume("r")
        answer_only(rig.dd, C.SwapIn)  # the swap-in does not wait for the store write
        assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS_NOW[:-1], new)
    elif then == "abort":
        rig.D.abort("r")
    else:
        rig.clock.now += 5.0
        rig.D.tick()
        assert rig.D.state_of("r") == "preempted"
    rig.dd.run_until_idle()  # the store write answers last: it changes no state
    if then == "timeout":
        assert rig.D.resume("r") and rig.D.state_of("r") == "reloading"
        rig.dd.run_until_idle()
    if "r" in rig.D.live_requests():
        rig.D.finish("r")
    assert rig.D.pool.num_used == 0
    host_clean(rig)


def test_after_a_failed_write_through_a_partial_swap_in_recomputes_instead_of_reading_the_store():
    rig = failed_write_through()  # the store holds nothing of it
    rig.D.resume("r")
    rig.dd.pump()
    [cid] = {c for c, _ in rig.dd.pending}
    rig.dd.complete(cid, 0, 1)  # one block of four swapped in
    rig.dd.complete(cid, 1)
    rig.dd.pump()
    assert not [c for c in rig.dd.pending.values() if isinstance(c, C.ReadBlocks)]
    assert rig.D.state_of("r") == "recomputing"

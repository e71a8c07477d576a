"""Behaviours a sweep of hand-made mutants of the core changed without any test failing: each
test here fails when its behaviour breaks."""
from __future__ import annotations

import pytest
from lifecycle_helpers import fill_p, serve
from rigs import Rig

from kvstate import Policy
from kvstate import commands as C
from kvstate.events import Completion

TOKS8 = list(range(200, 208))  # exactly two full blocks of 4


def p_writing(rig: Rig, rid: str = "r", toks=TOKS8) -> C.TransferCommand:
    """``rid`` prefilled on P; its write pending on the driver, unanswered."""
    rig.D.reserve(rid, toks)
    rig.P.admit(rid, toks)
    rig.pd.run_until_idle()  # its prefix looked up in the store
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_p(rig, rid, toks, sp.block_ids)
    rig.P.prefill_done(rid, 9)
    rig.pd.pump()
    [(cid, _)] = {(c, 0) for (c, r), cmd in rig.pd.pending.items() if isinstance(cmd, C.WriteBlocks)}
    return rig.pd.pending[(cid, 0)]


def first_token_code(rig: Rig) -> int:
    rig.pd.pump()
    [ft] = rig.notices(rig.pd, C.SendFirstToken)
    return ft.error_code


def no_retry() -> Policy:
    return Policy(write_retries=0, transfer_timeout=10.0, fence_grace=5.0)


def test_an_error_answer_s_count_is_not_trusted():
    rig = Rig(tp=2, policy=no_retry())
    cmd = p_writing(rig)
    rig.pd.complete(cmd.command_id, 1)
    rig.pd.drop(cmd.command_id, 0)
    rig.P.complete(Completion(cmd.command_id, 0, len(cmd.keys), error="the store said no"))
    assert first_token_code(rig) == 503


def test_a_write_one_block_short_is_not_complete():
    rig = Rig(tp=2, policy=no_retry())
    cmd = p_writing(rig)
    rig.pd.complete(cmd.command_id, 0)
    rig.pd.complete(cmd.command_id, 1, len(cmd.keys) - 1)
    assert first_token_code(rig) == 503


def test_blocks_a_transfer_s_answer_releases_wake_prompts_waiting_for_them():
    rig = Rig(tp=1, p_blocks=2)  # room for one two-block prompt at a time
    cmd = p_writing(rig, "a")
    rig.D.reserve("b", [t + 50 for t in TOKS8])
    rig.P.admit("b", [t + 50 for t in TOKS8])
    rig.pd.pump()
    assert rig.P.state_of("b") == "waiting" and not rig.notices(rig.pd, C.StartPrefill)
    rig.pd.complete(cmd.command_id, 0)  # a's write answered: its blocks come free
    assert rig.P.state_of("b") != "waiting"  # no other call needed to wake b
    rig.pd.run_until_idle()
    assert [s.request_id for s in rig.notices(rig.pd, C.StartPrefill)] == ["b"]


def test_p_s_prefix_read_leaves_a_token_to_compute():
    """A prompt whose every block is stored still computes its last token (the first token
    comes from a forward)."""
    rig = Rig(tp=1)
    serve(rig, "first", TOKS8)
    rig.D.reserve("again", TOKS8)
    rig.P.admit("again", TOKS8)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.num_cached_tokens <= len(TOKS8) - 1
    assert sp.num_cached_tokens >= 4  # and it did use the stored prefix


def test_a_stale_swapped_timer_does_not_fire_for_a_later_wait_and_a_second_swap_gets_its_own():
    """Swapped at t0 (deadline t0 + 50), resumed, swapped again at t1 (deadline t1 + 50): at
    t0 + 50 nothing fires; at t1 + 50 the host copy goes."""
    from lifecycle_helpers import swapping_rig
    from test_host_tier import decoding

    rig = swapping_rig(swapped_timeout=50.0)
    decoding(rig)
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    t0 = rig.clock.now
    rig.clock.now += 30.0
    rig.D.resume("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running"
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "swapped"
    t1 = rig.clock.now
    rig.clock.now = t0 + 50.0
    rig.D.tick()
    assert rig.D.state_of("r") == "swapped"  # the first wait's timer is stale
    assert rig.D.next_deadline() == t1 + 50.0  # the second swap has its own
    rig.clock.now = t1 + 50.0
    rig.D.tick()
    assert rig.D.state_of("r") == "preempted"


@pytest.mark.parametrize("preempt", ["write", "swap"])
def test_resume_allocates_the_block_the_newest_token_starts(preempt):
    """12 tokens computed and a 13th, the newest, starting block 4: resumed, the request holds
    the 4 blocks its next step writes into."""
    import dataclasses

    from lifecycle_helpers import SWAP, running

    policy = dataclasses.replace(SWAP, preempt=preempt)
    rig = Rig(policy=policy, host_blocks=16 if preempt == "swap" else 0)
    running(rig)  # 10 prompt tokens and the first: 11
    rig.D.append_tokens("r", [1, 2])  # 13: the newest starts the fourth block
    assert len(rig.D.blocks_of("r")) == 4
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    rig.D.resume("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running"
    assert len(rig.D.blocks_of("r")) == 4


def test_recompute_starts_after_the_blocks_the_gpu_prefix_cache_holds():
    """D finds a prompt's two full blocks in its GPU prefix cache and reads only the partial
    one; that read fails under policy "recompute": recomputing starts at token 8, not 0."""
    import dataclasses

    from lifecycle_helpers import TOKS, deliver, serve
    from test_prefix_cache import handoff_p_only

    policy = dataclasses.replace(Policy(transfer_timeout=10.0, fence_grace=5.0), read_failure="recompute")
    rig = Rig(policy=policy, prefix_cache=True)
    serve(rig, "a")
    rig.D.reserve("b", TOKS)
    deliver(rig, handoff_p_only(rig, "b"))
    rig.dd.pump()
    for cid, rank in list(rig.dd.pending):
        rig.dd.complete(cid, rank, "fail")
    rig.dd.pump()
    [rc] = [n for n in rig.notices(rig.dd, C.Recompute) if n.request_id == "b"]
    assert rc.from_token == 8


def test_p_s_store_read_never_writes_into_blocks_the_gpu_prefix_cache_shares():
    """The store holds a prompt's three full blocks, P's GPU prefix cache its first two: P
    reads only the third, into a block of its own, and the shared two keep their bytes."""
    from lifecycle_helpers import serve
    from test_prefix_cache import caching_rig

    from kvstate._keys import block_keys

    toks = list(range(200, 213))  # 3 full blocks of 4 and a partial one
    rig = caching_rig()
    serve(Rig(store=rig.store), "elsewhere", toks)  # another P stored all of it
    serve(rig, "a", toks[:8])  # this P's GPU holds the first two blocks
    shared = set(rig.P.pool.cached_blocks().values())
    assert len(shared) == 2
    rig.D.reserve("b", toks)
    rig.P.admit("b", toks)
    rig.pd.pump()
    reads = {c.command_id: c for c in rig.pd.pending.values() if isinstance(c, C.ReadBlocks)}
    [read] = reads.values()
    assert read.keys == tuple(block_keys(toks, 4)[2:3]) and not set(read.block_ids) & shared


def test_a_swap_in_copies_only_host_entries_that_are_ready():
    """b shares its cache's host entries with a, whose swap-out is still copying them: b's
    swap-out answers, b resumes, and its swap-in copies no entry a has not finished."""
    from lifecycle_helpers import SWAP, answer_only, deliver, handoff

    rig = Rig(policy=SWAP, host_blocks=16)
    for rid in ("a", "b"):
        deliver(rig, handoff(rig, rid))
        rig.dd.run_until_idle()
        rig.notices(rig.dd)
    rig.D.preempt("a")
    rig.dd.pump()
    a_out = {c.command_id for c in rig.D.pending_commands() if isinstance(c, C.SwapOut)}
    rig.D.preempt("b")
    rig.dd.pump()
    for cid, rank in list(rig.dd.pending):
        if cid not in a_out:
            rig.dd.complete(cid, rank)
    rig.dd.pump()
    assert (rig.D.state_of("a"), rig.D.state_of("b")) == ("swapping_out", "swapped")
    rig.D.resume("b")
    rig.dd.pump()
    swap_ins = [c for c in rig.D.pending_commands() if isinstance(c, C.SwapIn)]
    assert swap_ins and all(not c.keys for c in swap_ins), swap_ins  # a's entries are not ready: none copied
    answer_only(rig.dd, C.SwapIn)
    assert rig.D.state_of("b") == "reloading"  # b takes its cache from the store instead
    rig.dd.run_until_idle()
    assert rig.D.state_of("b") == "running"


def test_a_partial_write_back_from_host_memory_is_not_counted_stored():
    """The flush from host memory stores 3 of 4 blocks; once the host copy times out, a resume
    recomputes: it must not reload a cache the store holds only in part."""
    from lifecycle_helpers import answer_only, swapping_rig
    from test_host_tier import decoding

    rig = swapping_rig(swap_write="back", swapped_timeout=50.0)
    decoding(rig)
    rig.D.preempt("r")
    answer_only(rig.dd, C.SwapOut)
    rig.dd.pump()
    [flush] = [c for c in rig.D.pending_commands() if isinstance(c, C.FlushHost)]
    for rank in range(rig.spec.tp_size):
        rig.dd.complete(flush.command_id, rank, len(flush.keys) - 1)
    rig.dd.pump()
    rig.clock.now += 50.0
    rig.D.tick()
    assert rig.D.state_of("r") == "preempted"
    rig.D.resume("r")
    assert rig.D.state_of("r") != "reloading"

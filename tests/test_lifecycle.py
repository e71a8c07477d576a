"""The lifecycle machines on real bytes: happy paths, TP, D failures, preemption, growth."""
from __future__ import annotations

import pytest
from lifecycle_helpers import TOKS, assert_clean, d_matches, deliver, handoff, running, serve
from rigs import Rig

from kvstate import (
    OutOfBlocksError,
    Policy,
)
from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate.backends import MemoryStore, Store
from kvstate.testing import fill_blocks, mismatched_blocks


# -- happy path --------------------------------------------------------------------------------
def test_handoff_end_to_end_bytes_match(rig):
    notes = handoff(rig, "r1")
    [ft] = [n for n in notes if isinstance(n, C.SendFirstToken)]
    assert (ft.token, ft.error_code) == (7, 200)
    assert [n.state for n in notes if isinstance(n, C.RequestEnded)] == ["done"]
    assert rig.P.pool.num_used == 0  # P recycled once the cache was stored
    deliver(rig, notes)
    assert rig.D.state_of("r1") == "reading"
    rig.dd.run_until_idle()
    [sd] = rig.notices(rig.dd, C.StartDecode)
    assert rig.D.state_of("r1") == "running"
    assert d_matches(rig, TOKS, sd.block_ids)
    rig.D.finish("r1")
    assert_clean(rig)


def test_second_request_skips_stored_prefix_and_full_hit_still_sends(rig):
    serve(rig, "a")
    writes_before = rig.store.puts
    # identical prompt: P reads the stored prefix, then finds every block stored: nothing to write
    notes = handoff(rig, "b")
    assert rig.store.puts == writes_before
    assert any(isinstance(n, C.SendFirstToken) and n.error_code == 200 for n in notes)
    deliver(rig, notes)
    rig.dd.run_until_idle()
    rig.D.finish("b")
    assert_clean(rig)


def test_prefix_read_reports_cached_tokens(rig):
    serve(rig, "a")
    toks = TOKS[:8] + [1, 2, 3, 4, 5]  # shares two full blocks
    rig.D.reserve("b", toks)
    rig.P.admit("b", toks)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.num_cached_tokens == 8
    assert not mismatched_blocks(rig.pb, block_keys(toks, 4), sp.block_ids, upto=2)  # read, not computed


# -- TP: completion needs every rank, effective count is the minimum -----------------------------
def test_tp_write_waits_for_every_rank_and_takes_minimum():
    rig = Rig(tp=2, policy=Policy(write_retries=0, read_prefix=False))
    rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    rig.pd.pump()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    rig.P.prefill_done("r", 1)
    rig.pd.pump()
    w = next(iter(rig.pd.pending.values()))
    assert isinstance(w, C.WriteBlocks) and len(w.keys) == 3
    rig.pd.complete(w.command_id, 0)  # rank 0 wrote all 3
    assert rig.P.state_of("r") == "writing"  # rank 1 has not answered
    rig.pd.complete(w.command_id, 1, 1)  # rank 1 only the first block
    notes = rig.notices(rig.pd)
    assert [n.error_code for n in notes if isinstance(n, C.SendFirstToken)] == [503]
    assert [n.state for n in notes if isinstance(n, C.RequestEnded)] == ["failed"]


def test_write_retry_writes_only_the_rest():
    rig = Rig(policy=Policy(write_retries=1, read_prefix=False))
    rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    rig.pd.pump()
    rig.notices(rig.pd)
    rig.P.prefill_done("r", 1)
    rig.pd.pump()
    w = next(iter(rig.pd.pending.values()))
    rig.pd.complete(w.command_id, 0, 2)
    rig.pd.complete(w.command_id, 1, "fail")
    rig.pd.pump()
    retry = next(iter(rig.pd.pending.values()))
    assert isinstance(retry, C.WriteBlocks) and retry.keys == w.keys  # min over ranks was 0
    rig.pd.run_until_idle()
    assert rig.P.counters["retries"] == 1 and rig.P.counters["done"] == 1


class _CountingStore(MemoryStore):
    """Counts the keys each put carries."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.put_keys: list[str] = []

    def batch_put_from(self, keys, buffers):
        self.put_keys += list(keys)
        return super().batch_put_from(keys, buffers)

    batch_put_hashed = Store.batch_put_hashed  # every put through the counting one


def test_write_skips_the_leading_blocks_already_stored():
    store = _CountingStore(1 << 26)
    rig = Rig(store=store, policy=Policy(transfer_timeout=10.0, fence_grace=5.0, read_prefix=False))
    serve(rig, "a")
    assert len(store.put_keys) == 3 * 2 * 3  # 3 blocks, 2 ranks, K, V and the manifest
    # the same prompt again: every block is stored, so the write moves nothing and answers in full
    store.put_keys.clear()
    serve(rig, "b")
    assert store.put_keys == [] and rig.P.counters["done"] == 2
    # one more token completes the partial block: the two full blocks are skipped, the rest written
    serve(rig, "c", TOKS + [110, 111])
    keys = block_keys(TOKS + [110, 111], 4)
    assert {k.split("_")[0] for k in store.put_keys} == {keys[2]}
    assert_clean(rig)


def test_prefix_read_of_a_missing_prefix_reads_nothing_and_prefills_everything(rig):
    rig.D.reserve("r", TOKS)
    rig.P.admit("r", TOKS)
    assert rig.P.state_of("r") == "reading_prefix"
    rig.pd.pump()
    reads = {id(c): c for c in rig.pd.pending.values()}
    [read] = reads.values()
    assert isinstance(read, C.ReadBlocks) and len(read.keys) == 2  # full blocks only, one token left
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.num_cached_tokens == 0 and rig.P.state_of("r") == "prefilling"


# -- D failures ------------------------------------------------------------------------------
def test_read_miss_fails_with_502_and_recycles(rig):
    notes = handoff(rig, "r")
    rig.store.evict([k for k in rig.store.keys() if "_value_1" in k][:1])  # noqa: SIM118 - Store.keys() is a method
    deliver(rig, notes)
    rig.dd.run_until_idle()
    [end] = rig.notices(rig.dd, C.RequestEnded)
    assert (end.state, end.error_code) == ("failed", 502)
    assert_clean(rig)


def test_read_miss_recomputes_from_prefix_read_on_every_rank():
    rig = Rig(policy=Policy(read_failure="recompute"))
    notes = handoff(rig, "r")
    keys = block_keys(TOKS, 4)
    rig.store.evict([f"{keys[1]}_key_0"])  # rank 0 lost block 1: both ranks keep only block 0
    deliver(rig, notes)
    rig.dd.run_until_idle()
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 4 and rig.D.state_of("r") == "recomputing"
    rig.D.recompute_done("r")
    assert rig.D.state_of("r") == "running"
    rig.D.finish("r")
    assert_clean(rig)


def test_error_first_token_ends_d_request(rig):
    rig.D.reserve("r", TOKS)
    rig.D.deliver_first_token("r", None, 503)
    [end] = rig.notices(rig.dd, C.RequestEnded)
    assert (end.state, end.error_code) == ("failed", 503)
    assert_clean(rig)


def test_first_token_deadline_on_tick_alone():
    rig = Rig(first_token_timeout=3.0)
    rig.D.reserve("r", TOKS)
    rig.clock.advance(2.9)
    rig.D.tick()
    assert rig.D.state_of("r") == "reserved"
    rig.clock.advance(0.2)
    assert rig.D.tick() == 1  # no new work arrived: the tick alone fires the deadline
    [end] = rig.notices(rig.dd, C.RequestEnded)
    assert (end.state, end.error_code) == ("failed", 504)
    assert_clean(rig)


# -- preemption --------------------------------------------------------------------------------
def test_preempt_writes_back_then_frees_then_reloads_same_bytes(rig):
    running(rig)
    rig.D.append_tokens("r", [1, 2, 3])
    toks = TOKS + [7, 1, 2, 3]
    blocks = rig.D.blocks_of("r")
    fill_blocks(rig.db, block_keys(toks[:-1], 4), blocks)
    rig.D.preempt("r")
    assert rig.D.state_of("r") == "preempt_writing"
    assert rig.D.pool.num_used == len(blocks)  # not freed before the write answered
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "preempted" and rig.D.pool.num_used == 0
    for b in blocks:  # scribble over the freed blocks
        for r in range(2):
            for kind in rig.spec.kinds:
                rig.db.fill_block(r, kind, b, bytes(rig.spec.block_bytes(kind)))
    new = rig.D.resume("r")
    assert rig.D.state_of("r") == "reloading"
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running"
    assert d_matches(rig, toks[:-1], new)
    rig.D.finish("r")
    assert_clean(rig)


def test_preempt_recompute_policy_frees_at_once():
    rig = Rig(policy=Policy(preempt="recompute"))
    running(rig)
    rig.D.append_tokens("r", [1])
    rig.D.preempt("r")
    assert rig.D.state_of("r") == "preempted" and rig.D.pool.num_used == 0
    rig.D.resume("r")
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 0
    rig.D.recompute_done("r")
    rig.D.finish("r")
    assert_clean(rig)


def test_failed_write_back_falls_back_to_recompute():
    rig = Rig(policy=Policy(write_retries=0))
    running(rig)
    rig.D.preempt("r")
    rig.dd.pump()
    for (cid, rank) in list(rig.dd.pending):
        rig.dd.complete(cid, rank, "fail")
    assert rig.D.state_of("r") == "preempted"
    rig.D.resume("r")
    assert rig.D.state_of("r") == "recomputing"


def test_preempt_mid_read_then_resume_reloads(rig):
    deliver(rig, handoff(rig, "r"))
    rig.dd.pump()
    rig.D.preempt("r")
    assert rig.D.state_of("r") == "preempted"
    rig.dd.run_until_idle()  # the abandoned read answers: its pins drop
    assert rig.D.pool.num_used == 0
    new = rig.D.resume("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS, new)


# -- growth and reservations -----------------------------------------------------------------------
def test_append_tokens_allocates_on_block_boundaries(rig):
    running(rig)
    n0 = len(rig.D.blocks_of("r"))  # 11 tokens (prompt + first) in 3 blocks
    assert rig.D.append_tokens("r", [1]) == ()
    assert len(rig.D.append_tokens("r", [2])) == 1 and len(rig.D.blocks_of("r")) == n0 + 1


def test_reserve_keeps_headroom_for_running_requests():
    rig = Rig(blocks=10, policy=Policy(decode_headroom_blocks=2))
    running(rig, "a")  # 3 blocks, running -> 2 blocks headroom
    assert rig.D.can_reserve(4 * 5 - 1)  # 5 blocks: 7 free - 5 = 2 >= 2
    assert not rig.D.can_reserve(4 * 6 - 1)
    with pytest.raises(OutOfBlocksError, match="'b'"):
        rig.D.reserve("b", list(range(4 * 6 - 1)))
    assert "b" not in rig.D.live_requests() and rig.D.pool.num_used == 3


def test_prefill_waits_fifo_for_blocks():
    rig = Rig(blocks=4, policy=Policy(read_prefix=False))
    assert rig.P.admit("a", TOKS) == "prefilling"
    assert rig.P.admit("b", TOKS) == "waiting"
    rig.P.abort("a")
    assert rig.P.state_of("b") == "prefilling"

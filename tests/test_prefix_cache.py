"""The GPU prefix cache: the pool's rules, then P and D looking a prompt up on the GPU first."""
from __future__ import annotations

import pytest
from lifecycle_helpers import SWAP, TOKS, assert_clean, d_matches, deliver, fill_p, handoff, running, serve
from rigs import Rig, small_spec

from kvstate import DecodeLifecycle, OutOfBlocksError, Policy, ValidationError
from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate._prefixcache import PrefixCachingPool
from kvstate.testing import fill_blocks, mismatched_blocks

KEYS = ["k0", "k1", "k2"]


def published(n: int = 6) -> tuple[PrefixCachingPool, list[int]]:
    """A pool whose first three blocks were published under KEYS, then released (idle)."""
    pool = PrefixCachingPool(n)
    blocks = pool.allocate(3)
    pool.publish(KEYS, blocks)
    pool.release(blocks)
    return pool, blocks


# -- the pool ------------------------------------------------------------------------------------
def test_released_published_blocks_stay_idle_and_count_as_free():
    pool, blocks = published()
    assert pool.num_free == 6 and pool.num_used == 0
    assert pool.cached_prefix(KEYS + ["k3"]) == (3, 3)
    assert pool.cached_prefix(["x", "k0"]) == (0, 0)  # the lookup stops at the first miss
    st = pool.stats()
    assert (st.free, st.used, st.cached) == (6, 0, 3)
    assert sorted(pool.free_ids()) == list(range(6))


def test_claim_revives_idle_blocks_and_shares_held_ones():
    pool, blocks = published()
    assert pool.claim(KEYS[:2]) == blocks[:2]
    assert pool.num_free == 4 and blocks[0] not in pool.free_ids()
    assert pool.cached_prefix(KEYS) == (3, 1)  # two held now, one still idle
    assert pool.claim(KEYS[:1]) == blocks[:1] and pool.refcount(blocks[0]) == 2
    assert pool.prefix_stats().hit_blocks == 3
    pool.release(blocks[:1])
    assert pool.refcount(blocks[0]) == 1 and pool.num_free == 4


def test_allocation_takes_keyless_blocks_first_then_evicts_the_tail_first():
    pool, blocks = published()
    fresh = pool.allocate(3)
    assert set(fresh).isdisjoint(blocks) and pool.cached_prefix(KEYS) == (3, 3)
    assert pool.allocate(1) == [blocks[2]]  # released last block first: the tail went idle first
    assert pool.cached_prefix(KEYS) == (2, 2)
    assert pool.prefix_stats().evictions == 1 and "k2" not in pool.cached_blocks()


def test_a_held_published_block_is_never_evicted_and_a_short_pool_changes_nothing():
    pool, blocks = published()
    pool.claim(KEYS[:1])
    pool.allocate(3)
    before = (pool.refcounts(), pool.free_ids(), pool.cached_blocks())
    with pytest.raises(OutOfBlocksError):
        pool.allocate(3)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1, headroom=2)
    assert (pool.refcounts(), pool.free_ids(), pool.cached_blocks()) == before
    assert sorted(pool.allocate(2)) == blocks[1:] and pool.cached_blocks() == {"k0": blocks[0]}


def test_a_key_or_block_published_twice_keeps_its_first_entry():
    pool = PrefixCachingPool(4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.publish(["k"], a)
    pool.publish(["k"], b)
    pool.publish(["other"], a)
    assert pool.cached_blocks() == {"k": a[0]}


def test_prefix_cache_must_be_a_bool():
    with pytest.raises(ValidationError, match="prefix_cache"):
        DecodeLifecycle(small_spec(1), 8, prefix_cache=1)


# -- P and D ---------------------------------------------------------------------------------------
def caching_rig(**kw) -> Rig:
    return Rig(prefix_cache=True, **kw)


def test_p_prefills_after_the_prefix_left_on_its_gpu_and_asks_no_tier_for_it():
    rig = caching_rig()
    serve(rig, "a")
    a_blocks = rig.P.pool.cached_blocks()
    rig.P.admit("b", TOKS)
    rig.pd.pump()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.num_cached_tokens == 8 and set(sp.block_ids[:2]) == set(a_blocks.values())
    assert not [c for c in rig.pd.pending.values() if isinstance(c, C.ReadBlocks)]  # the store was not asked
    assert rig.P.stats()["gpu_prefix_blocks"] == 2 and rig.P.stats()["store_prefix_blocks"] == 0
    assert rig.P.stats()["prefix_cache"].hit_blocks == 2 and Rig().P.stats()["prefix_cache"] is None


def test_d_reads_only_what_its_gpu_lacks_and_the_bytes_match():
    rig = caching_rig()
    serve(rig, "a")
    rig.D.reserve("b", TOKS)
    notices = handoff_p_only(rig, "b")
    deliver(rig, notices)
    rig.dd.pump()
    [read] = [c for c in rig.D.pending_commands() if isinstance(c, C.ReadBlocks)]
    assert len(read.keys) == 1 and read.keys[0].endswith(":partial:2")  # the full blocks came from the GPU
    rig.dd.run_until_idle()
    [sd] = [n for n in rig.notices(rig.dd, C.StartDecode) if n.request_id == "b"]
    assert d_matches(rig, TOKS, sd.block_ids[:3]) and rig.D.stats()["gpu_read_blocks"] == 2
    rig.D.finish("b")
    assert_clean(rig)


def handoff_p_only(rig: Rig, rid: str, toks=TOKS):
    """P's side of a handoff whose D already reserved: admit, prefill, store; P's notices."""
    rig.P.admit(rid, toks)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_p(rig, rid, toks, sp.block_ids, sp.num_cached_tokens // rig.spec.block_size)
    rig.P.prefill_done(rid, 7)
    rig.pd.run_until_idle()
    return rig.notices(rig.pd)


def test_a_prompt_held_whole_on_the_gpu_is_runnable_with_its_first_token():
    rig, toks = caching_rig(), TOKS[:8]
    serve(rig, "a", toks)
    rig.D.reserve("b", toks)
    deliver(rig, handoff_p_only(rig, "b", toks))
    assert rig.D.state_of("b") == "running"
    rig.dd.pump()
    assert not rig.dd.pending  # nothing was read
    [sd] = [n for n in rig.notices(rig.dd, C.StartDecode) if n.request_id == "b"]
    assert d_matches(rig, toks, sd.block_ids[:2])


def test_requests_sharing_gpu_blocks_keep_them_until_the_last_one_ends():
    rig = caching_rig()
    deliver(rig, handoff(rig, "a"))
    rig.dd.run_until_idle()
    rig.D.reserve("b", TOKS)
    shared = rig.D.blocks_of("b")[:2]
    assert shared == rig.D.blocks_of("a")[:2] and all(rig.D.pool.refcount(b) == 2 for b in shared)
    rig.D.abort("a")
    rig.dd.run_until_idle()
    assert all(rig.D.pool.refcount(b) == 1 for b in shared)
    assert not mismatched_blocks(rig.db, block_keys(TOKS, 4), shared, upto=2)
    rig.D.abort("b")
    rig.dd.run_until_idle()
    assert rig.D.pool.num_used == 0 and rig.D.pool.prefix_stats().cached == 2


def test_p_looks_up_gpu_then_host_then_store():
    """A prefix whose head is still on P's GPU and whose tail went to the host tier."""
    rig = caching_rig(p_blocks=8, host_blocks=16)
    toks = list(range(200, 213))  # 13 tokens: 3 full blocks and a partial one
    serve(rig, "a", toks)
    rig.pd.run_until_idle()  # the write-through copy to the host tier answers
    serve(rig, "c", list(range(500, 528)))  # 7 blocks: evicts a's two idle tail blocks
    assert rig.P.pool.cached_prefix(block_keys(toks, 4)[:3]) == (1, 1)
    rig.D.reserve("b", toks)
    deliver(rig, handoff_p_only(rig, "b", toks))
    st = rig.P.stats()
    assert (st["gpu_prefix_blocks"], st["host_prefix_blocks"], st["store_prefix_blocks"]) == (1, 2, 0)
    rig.dd.run_until_idle()
    [sd] = [n for n in rig.notices(rig.dd, C.StartDecode) if n.request_id == "b"]
    assert d_matches(rig, toks, sd.block_ids[:4])


def test_reserve_short_of_blocks_changes_nothing_with_the_cache_on():
    rig = caching_rig(blocks=6, policy=Policy(decode_headroom_blocks=0))
    serve(rig, "a")  # leaves TOKS' two full blocks idle on D's GPU
    rig.D.reserve("h", list(range(300, 313)))  # takes the four keyless blocks
    before = (rig.D.pool.refcounts(), rig.D.pool.free_ids(), rig.D.pool.cached_blocks())
    with pytest.raises(OutOfBlocksError, match="'b'"):
        rig.D.reserve("b", TOKS)  # claiming its two idle hits leaves no block for its third
    assert (rig.D.pool.refcounts(), rig.D.pool.free_ids(), rig.D.pool.cached_blocks()) == before
    assert not rig.D.is_live("b") and rig.D.stats()["gpu_read_blocks"] == 0


# -- D's resume: its own blocks, still idle on the GPU ----------------------------------------------
def preempted_rig(preempt: str, grow: int = 0) -> tuple[Rig, tuple[int, ...], list[int]]:
    """Request "r" decoding on D (TOKS, its first token and ``grow`` more), then preempted:
    the rig, its old blocks and its tokens."""
    rig = caching_rig(policy=Policy(preempt=preempt, transfer_timeout=10.0, fence_grace=5.0))
    running(rig)
    toks = TOKS + [7]  # the handoff's first token
    if grow:
        more = list(range(50, 50 + grow))
        rig.D.append_tokens("r", more)  # no longer the stored prompt: a resume cannot reload it
        toks += more
        fill_blocks(rig.db, block_keys(toks[:-1], 4), rig.D.blocks_of("r"))  # the decode steps' KV
    old = rig.D.blocks_of("r")
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    assert rig.D.state_of("r") == "preempted" and rig.D.pool.num_used == 0
    return rig, old, toks


def test_a_resume_recomputes_only_past_its_blocks_still_on_the_gpu():
    rig, old, toks = preempted_rig("recompute", grow=3)  # 13 tokens cached: 3 full blocks
    blocks = rig.D.resume("r")
    assert blocks[:3] == old[:3]  # claimed back
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 12
    fill_blocks(rig.db, block_keys(toks[:-1], 4), blocks, 3)  # the engine recomputes the tail
    rig.D.recompute_done("r")
    assert rig.D.state_of("r") == "running" and d_matches(rig, toks[:-1], blocks[:4])


def test_a_resume_reloads_only_past_its_blocks_still_on_the_gpu():
    rig, old, toks = preempted_rig("write")
    blocks = rig.D.resume("r")
    [read] = rig.D.pending_commands()
    assert isinstance(read, C.ReadBlocks) and len(read.keys) == 1 and blocks[:2] == old[:2]
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS, blocks[:3])


def test_a_resume_after_the_blocks_were_handed_out_moves_them_all():
    rig, old, toks = preempted_rig("recompute", grow=3)
    rig.D.reserve("x", list(range(300, 300 + 4 * 63)))  # takes all 64 blocks, evicting the idle ones
    rig.D.abort("x")
    rig.dd.run_until_idle()
    rig.D.resume("r")
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 0 and rig.D.pool.prefix_stats().evictions >= 3


def test_a_swapped_request_swaps_in_only_past_its_blocks_still_on_the_gpu():
    rig = Rig(policy=SWAP, host_blocks=16, prefix_cache=True)
    running(rig)
    old = rig.D.blocks_of("r")
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "swapped"
    blocks = rig.D.resume("r")
    [swap_in] = rig.D.pending_commands()
    assert isinstance(swap_in, C.SwapIn) and len(swap_in.keys) == 1 and blocks[:2] == old[:2]
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and d_matches(rig, TOKS, blocks[:3])

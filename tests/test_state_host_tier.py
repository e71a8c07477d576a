"""State layer groups with the host tier, on real bytes: a swapped request keeps its state page
and swaps back in whole, or recomputes from token 0; its page goes with its host entries; a
cache read by tier takes its last block and its state from the store; P's prefix lookup takes
host blocks before its last checkpoint only; refusals."""
from __future__ import annotations

import dataclasses

import pytest
from lifecycle_helpers import SWAP, d_matches, deliver
from rigs import Rig
from state_helpers import BS, TOKS, assert_state, fake_state, hybrid, prefill

from kvstate import commands as C
from kvstate._decode import DecodeLifecycle
from kvstate._errors import ConfigError
from kvstate._keys import block_keys
from kvstate._prefill import PrefillLifecycle

KEYS = block_keys(TOKS, BS)


def host_rig(**policy) -> Rig:
    """Hybrid P and D (4 state pages); D alone has a host tier and swaps on preemption."""
    policy = dataclasses.replace(SWAP, read_failure="recompute", **policy)
    return Rig(spec=hybrid(), num_states=4, host_blocks=16, p_host_blocks=0, policy=policy)


def handed_off(rig: Rig, rid: str) -> None:
    """``rid`` handed off through the store and decoding on D."""
    rig.D.reserve(rid, TOKS)
    prefill(rig, rid)
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    assert rig.D.state_of(rid) == "running"


def swapped(rig: Rig, rid: str = "r") -> int:
    """``rid`` handed off, then swapped out; returns its state page."""
    handed_off(rig, rid)
    [page] = rig.D.pages_of(rid)
    rig.D.preempt(rid)
    rig.dd.run_until_idle()
    assert rig.D.state_of(rid) == "swapped" and rig.D.pool.num_used == 0
    assert rig.D.pages_of(rid) == (page,) and rig.D.states.pool.num_used == 1  # the page stays
    return page


def test_a_swapped_request_keeps_its_state_page_and_swaps_back_in_whole():
    rig = host_rig()
    page = swapped(rig)
    blocks = rig.D.resume("r")
    [swap_in] = [c for c in rig.D.pending_commands() if isinstance(c, C.SwapIn)]
    assert len(swap_in.keys) == len(KEYS) and swap_in.states == ()  # blocks only: the state never left
    rig.dd.run_until_idle()
    [sd] = rig.notices(rig.dd, C.StartDecode)
    assert rig.D.state_of("r") == "running" and sd.state_pages == (page,)
    assert_state(rig.db, page, KEYS[-1])
    assert d_matches(rig, TOKS, blocks)
    rig.D.finish("r")
    assert rig.D.states.pool.num_used == 0 and rig.D.host.stats().referenced == 0


def runs_from_the_caches_state(rig: Rig, rid: str = "r") -> None:
    """``rid`` became runnable, its page holding the state of its whole cache."""
    rig.dd.run_until_idle()
    [sd] = rig.notices(rig.dd, C.StartDecode)
    assert rig.D.state_of(rid) == "running"
    assert_state(rig.db, sd.state_pages[0], KEYS[-1])


def held_in_host_memory(rig: Rig) -> None:
    """``a`` swapped out, back in and finished: its blocks stay ready in D's host tier."""
    swapped(rig, "a")
    rig.D.resume("a")
    rig.dd.run_until_idle()
    rig.D.finish("a")


def read_after_host_load(drv) -> C.ReadBlocks:
    """Answer ``drv``'s host load in full; the store read of the rest that follows it."""
    drv.pump()
    for key, cmd in list(drv.pending.items()):
        if isinstance(cmd, C.SwapIn):
            drv.complete(*key)
    drv.pump()
    [read] = list({id(c): c for c in drv.pending.values() if isinstance(c, C.ReadBlocks)}.values())
    return read


def fail(drv, read: C.ReadBlocks) -> None:
    """Every rank of ``read`` fails."""
    for rank in read.ranks:
        drv.complete(read.command_id, rank, "fail")


def swap_in_partly(rig: Rig, n: int) -> None:
    """Resume ``r`` and let its swap-in bring back only ``n`` blocks on every rank."""
    rig.D.resume("r")
    rig.dd.pump()
    [cid] = {c for (c, _r) in rig.dd.pending}
    for rank in range(2):
        rig.dd.complete(cid, rank, n)


def test_a_partial_swap_in_of_a_stored_cache_reloads_it_with_its_state():
    rig = host_rig()
    swapped(rig)
    swap_in_partly(rig, 3)  # 3 of 6 blocks came back: the store still holds the handed-off cache
    runs_from_the_caches_state(rig)


def test_a_partial_swap_in_of_a_grown_cache_recomputes_from_token_0():
    rig = host_rig()
    handed_off(rig, "r")
    rig.D.append_tokens("r", [1])  # one decode step: the store no longer holds the whole cache
    [page] = rig.D.pages_of("r")
    grown = block_keys(TOKS + [7], BS)[-1]
    for r in range(2):
        rig.db.fill_state(r, page, fake_state(grown, r))
    rig.D.preempt("r")
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "swapped"
    swap_in_partly(rig, 3)
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 0 and rc.state_pages == (page,)  # the page holds no state of 3 blocks
    rig.D.recompute_done("r")
    assert rig.D.state_of("r") == "running"


def test_the_page_goes_with_the_host_entries_and_a_resume_reloads_the_state():
    rig = host_rig(swapped_timeout=5.0)
    swapped(rig)
    rig.clock.advance(6.0)
    rig.D.tick()
    assert rig.D.state_of("r") == "preempted" and rig.D.states.pool.num_used == 0
    rig.D.resume("r")  # takes a page again, and reads the stored cache with its state
    runs_from_the_caches_state(rig)


def test_a_cache_read_by_tier_takes_its_last_block_and_state_from_the_store():
    rig = host_rig()
    held_in_host_memory(rig)
    handed_off(rig, "b")
    assert rig.D.counters["host_read_blocks"] == len(KEYS) - 1
    [page] = rig.D.pages_of("b")
    assert_state(rig.db, page, KEYS[-1])


def test_a_failed_read_after_a_host_load_recomputes_from_token_0():
    rig = host_rig()
    held_in_host_memory(rig)
    rig.D.reserve("b", TOKS)
    prefill(rig, "b")
    deliver(rig, rig.notices(rig.pd))
    read = read_after_host_load(rig.dd)
    assert len(read.keys) == 1 and read.states == ((1, rig.D.pages_of("b")[0]),)
    fail(rig.dd, read)
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 0  # no state at the host load's end: blocks 0-4 are computed again


def p_host_rig() -> Rig:
    """Hybrid P and D, both with a host tier; P has served ``a`` and copied it to host memory."""
    rig = Rig(spec=hybrid(), num_states=4, host_blocks=16,
              policy=dataclasses.replace(SWAP, read_failure="recompute"))
    prefill(rig, "a")
    assert rig.P.host.ready_prefix(KEYS) == len(KEYS)
    return rig


def test_ps_host_tier_serves_blocks_before_the_last_checkpoint_and_the_store_its_state():
    rig = p_host_rig()
    sp = prefill(rig, "b")  # asserts pages[0] holds the state after block 3 when it starts
    assert sp.num_cached_tokens == 16  # blocks 0-2 from host memory, block 3 and its state from the store
    assert rig.P.counters["host_prefix_blocks"] == 3 and rig.P.counters["store_prefix_blocks"] == 1


def test_ps_store_read_bringing_no_state_after_a_host_load_prefills_from_0():
    rig = p_host_rig()
    rig.P.admit("b", TOKS)
    read = read_after_host_load(rig.pd)
    assert read.states == ((1, rig.P.pages_of("b")[0]),)  # the checkpoint after block 3
    fail(rig.pd, read)
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.num_cached_tokens == 0  # blocks 0-2 came from host memory, but no state is at their end


def test_state_groups_refuse_a_write_back_from_host_memory():
    back = dataclasses.replace(SWAP, swap_write="back")
    with pytest.raises(ConfigError, match=r"^DecodeLifecycle: state groups with Policy.swap_write='back'"):
        DecodeLifecycle(hybrid(), 8, back, host_blocks=4, num_states=2)
    DecodeLifecycle(hybrid(), 8, dataclasses.replace(SWAP, swap_write="through"), host_blocks=4, num_states=2)
    PrefillLifecycle(hybrid(), 8, host_blocks=4, num_states=2)

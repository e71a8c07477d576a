"""State layer groups with P's GPU prefix cache: P keeps its checkpoint's state page, a later
prompt claims cached blocks only up to a checkpoint whose state was kept and starts from it;
pages are evicted as blocks are, never while claimed; D claims no cached blocks."""
from __future__ import annotations

from lifecycle_helpers import deliver
from state_helpers import BS, TOKS, assert_state, prefill, state_rig

from kvstate import commands as C
from kvstate._keys import block_keys


def cached_rig():
    return state_rig(prefix_cache=True)


def test_a_prompt_starts_from_the_checkpoint_state_the_gpu_cache_kept():
    rig = cached_rig()
    a = prefill(rig, "a")
    assert a.checkpoints == (16,) and a.state_from == -1
    kept = a.state_pages[1]
    pages = rig.P.states.pool
    assert rig.P.live_requests() == [] and pages.num_used == 0
    assert pages.cached_blocks() == {block_keys(TOKS, BS)[3]: kept}  # the checkpoint's page, idle
    b = prefill(rig, "b")  # asserts the page it starts from holds the state after block 3
    assert (b.num_cached_tokens, b.state_from, b.checkpoints) == (16, kept, ())
    assert rig.P.counters["gpu_prefix_blocks"] == 4 and rig.P.counters["store_prefix_blocks"] == 0
    assert pages.num_used == 0 and pages.cached_blocks() == {block_keys(TOKS, BS)[3]: kept}


def test_cached_blocks_past_the_last_kept_state_are_computed_again():
    rig = cached_rig()
    prefill(rig, "a")  # 5 full blocks cached, a state kept after block 3 only
    sp = prefill(rig, "b", TOKS[:12] + [5] * 11)  # shares blocks 0-2: checkpoint 2 has no kept state
    assert (sp.num_cached_tokens, sp.state_from) == (0, -1)
    assert rig.P.counters["gpu_prefix_blocks"] == 0
    sp = prefill(rig, "c", TOKS[:20] + [6] * 3)  # shares blocks 0-4: claims 0-3, then computes block 4
    assert (sp.num_cached_tokens, sp.state_from) == (16, rig.P.states.pool.cached_blocks()[block_keys(TOKS, BS)[3]])


def test_a_claimed_page_is_never_evicted_and_an_idle_one_is_when_pages_run_short():
    rig = cached_rig()  # 4 state pages
    prefill(rig, "a")
    pages = rig.P.states.pool
    rig.P.admit("b", TOKS)  # claims the kept page and takes 2 of its own
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.state_from >= 0 and pages.num_used == 3
    rig.P.admit("x", [1] * 23)  # needs 2 pages, 1 is free: it waits, the claimed page stays
    rig.pd.run_until_idle()
    assert rig.P.state_of("x") == "waiting" and pages.cached_blocks()
    rig.P.abort("b")  # lets go of its pages and the claimed one, which stays cached
    rig.pd.run_until_idle()
    assert rig.P.state_of("x") == "prefilling"
    assert pages.num_used == 2 and pages.cached_blocks()
    rig.P.admit("y", [2] * 23)  # 2 pages: the idle cached one is evicted for it
    rig.pd.run_until_idle()
    assert rig.P.state_of("y") == "prefilling" and pages.cached_blocks() == {}
    assert pages.prefix_stats().evictions == 1


def test_d_claims_no_cached_blocks_with_state_groups_and_decodes_from_the_read_state():
    rig = cached_rig()
    for rid in ("a", "b"):
        rig.D.reserve(rid, TOKS)
        prefill(rig, rid)
        deliver(rig, rig.notices(rig.pd))
        rig.dd.run_until_idle()
        [sd] = rig.notices(rig.dd, C.StartDecode)
        assert_state(rig.db, sd.state_pages[0], block_keys(TOKS, BS)[-1])
        rig.D.finish(rid)
    assert rig.D.counters["gpu_read_blocks"] == 0  # a's blocks were published; b read its own
    assert rig.D.states.pool.num_used == rig.P.states.pool.num_used == 0


def test_the_claimed_page_goes_back_once_the_prefill_is_done_not_when_the_write_is():
    rig = cached_rig()
    prefill(rig, "a")
    pages = rig.P.states.pool
    rig.P.admit("b", TOKS[:20] + [6] * 3)  # blocks 4 and 5 are new: its write has work to do
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.state_from >= 0 and pages.num_used == 3
    rig.P.prefill_done("b", 7)
    assert rig.P.state_of("b") == "writing" and pages.num_used == 2  # its own two, until the write answers
    rig.pd.run_until_idle()
    assert rig.P.live_requests() == [] and rig.P.counters["done"] == 2 and pages.num_used == 0


def test_the_gpu_cache_keeps_every_checkpoint_state_a_prefill_kept():
    from kvstate._policy import Policy

    rig = state_rig(prefix_cache=True, policy=Policy(transfer_timeout=10.0, fence_grace=5.0, state_checkpoints=2))
    a = prefill(rig, "a")
    keys, pages = block_keys(TOKS, BS), rig.P.states.pool
    assert a.checkpoints == (8, 16)
    assert pages.cached_blocks() == {keys[1]: a.state_pages[1], keys[3]: a.state_pages[2]}
    sp = prefill(rig, "b", TOKS[:12] + [5] * 11)  # shares blocks 0-2: starts from the state kept at block 1
    assert (sp.num_cached_tokens, sp.state_from) == (8, a.state_pages[1])
    assert rig.P.counters["gpu_prefix_blocks"] == 2

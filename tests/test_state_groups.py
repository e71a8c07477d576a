"""State layer groups (Mamba, linear attention) through P -> store -> D on real bytes: state pages,
checkpoints, recovery from the last checkpoint every rank loaded, healing, refusals."""
from __future__ import annotations

import numpy as np
import pytest
from lifecycle_helpers import deliver
from rigs import Rig, small_spec
from state_helpers import BS, TOKS, assert_state, fake_state, hybrid, prefill, state_rig

from kvstate import commands as C
from kvstate._decode import DecodeLifecycle
from kvstate._errors import ConfigError, OutOfBlocksError, ValidationError
from kvstate._keys import block_keys, rank_key
from kvstate._policy import Policy
from kvstate._prefill import PrefillLifecycle
from kvstate._spec import check_pair
from kvstate.backends import MemoryStore, ReferenceBackend
from kvstate.backends._stateobjects import STATE_KIND
from kvstate.distributed import ProcessDriver


def test_a_hybrid_handoff_moves_the_prompts_state_and_its_last_checkpoint():
    rig = state_rig()
    rig.D.reserve("a", TOKS)
    sp = prefill(rig, "a")
    keys = block_keys(TOKS, BS)
    assert sp.num_cached_tokens == 0 and len(sp.state_pages) == 2 and sp.checkpoints == (16,)
    for r in range(2):  # stored: the prompt's state and the state after block 4 (token 16), not block 2's
        assert rig.store.batch_is_exist([rank_key(keys[k], STATE_KIND, r) for k in (5, 3, 1)]) == [1, 1, 0]
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    [sd] = rig.notices(rig.dd, C.StartDecode)
    assert rig.D.state_of("a") == "running" and sd.state_pages == rig.D.pages_of("a")
    assert_state(rig.db, sd.state_pages[0], keys[-1])
    rig.D.finish("a")
    assert rig.P.states.pool.num_used == rig.D.states.pool.num_used == 0


def test_a_prompt_sharing_a_prefix_restarts_from_its_last_stored_checkpoint():
    rig = state_rig()
    prefill(rig, "a")
    longer = TOKS[:20] + [9, 9, 9, 9, 9, 9, 9]  # shares blocks 0-4 (20 tokens), then differs
    sp = prefill(rig, "b", longer)
    assert sp.num_cached_tokens == 16  # block 4 is stored, but the state stored there is block 3's: token 16
    assert rig.P.counters["store_prefix_blocks"] == 4


def test_a_prefix_without_a_stored_state_is_computed_again():
    rig = state_rig()
    prefill(rig, "a")
    for r in range(2):
        rig.store.evict([rank_key(block_keys(TOKS, BS)[3], STATE_KIND, r)])
    sp = prefill(rig, "b", TOKS[:20] + [5, 5, 5])
    assert sp.num_cached_tokens == 0  # blocks 0-4 are stored; no state at any checkpoint in them


def test_a_state_corrupt_on_one_rank_recomputes_from_0_and_is_healed():
    rig = state_rig()
    rig.D.reserve("a", TOKS)
    prefill(rig, "a")
    name = rank_key(block_keys(TOKS, BS)[-1], STATE_KIND, 1)
    buf = np.empty(96 + 24, np.uint8)
    assert rig.store.batch_get_into([name], [buf]) == [120]
    buf[5] ^= 1
    rig.store.batch_put_from([name], [buf])
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    [rc] = rig.notices(rig.dd, C.Recompute)
    # rank 0 loaded the prompt's state, rank 1 the checkpoint's: no common position has its state
    assert rc.from_token == 0 and rig.db.broken_states == 1
    assert rig.store.batch_is_exist([name]) == [0]  # evicted: the next write stores it again
    rig.D.recompute_done("a")
    rig.D.finish("a")
    rig.D.reserve("b", TOKS)
    prefill(rig, "b")
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    assert rig.D.state_of("b") == "running"
    assert_state(rig.db, rig.D.pages_of("b")[0], block_keys(TOKS, BS)[-1])


def test_a_missing_prompt_state_on_every_rank_recomputes_from_the_last_checkpoint():
    rig = state_rig()
    rig.D.reserve("a", TOKS)
    prefill(rig, "a")
    keys = block_keys(TOKS, BS)
    rig.store.evict([rank_key(keys[-1], STATE_KIND, r) for r in range(2)])
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 16 and rc.state_pages == rig.D.pages_of("a")
    assert_state(rig.db, rc.state_pages[0], keys[3])


def test_a_write_back_stores_the_running_state_and_resume_reloads_it():
    rig = state_rig(policy=Policy(transfer_timeout=10.0, fence_grace=5.0, preempt="write"))
    rig.D.reserve("a", TOKS)
    prefill(rig, "a")
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    toks = TOKS + [7, 8, 9]  # the cache now holds the prompt, the first token and two decoded ones
    rig.D.append_tokens("a", [8, 9])
    keys = block_keys(toks[:-1], BS)
    page = rig.D.pages_of("a")[0]
    for r in range(2):
        rig.db.fill_state(r, page, fake_state(keys[-1], r))
    rig.D.preempt("a")
    rig.dd.run_until_idle()
    assert rig.D.state_of("a") == "preempted" and rig.D.pages_of("a") == ()
    rig.db.fill_state(0, page, bytes(96))  # the page went back to the pool: another request's now
    rig.D.resume("a")
    rig.dd.run_until_idle()
    assert rig.D.state_of("a") == "running"
    assert_state(rig.db, rig.D.pages_of("a")[0], keys[-1])


def test_pages_wait_like_blocks_and_come_back_when_requests_end():
    rig = Rig(spec=hybrid(), num_states=2)
    rig.P.admit("a", TOKS)  # passes a checkpoint: 2 pages
    rig.P.admit("b", TOKS[:6])  # none: 1 page, but none is free
    assert (rig.P.state_of("a"), rig.P.state_of("b")) == ("reading_prefix", "waiting")
    assert rig.P.pool.num_used == 6  # b took no block while it waits for a page
    rig.P.abort("a")
    rig.pd.run_until_idle()
    assert rig.P.state_of("b") != "waiting" and rig.P.pages_of("b") != ()


def test_an_abandoned_read_pins_its_page_until_it_answers():
    rig = Rig(spec=hybrid(), num_states=1)
    rig.D.reserve("a", TOKS)
    rig.D.deliver_first_token("a", 7)
    rig.dd.pump()
    [page] = rig.D.pages_of("a")
    rig.D.abort("a")
    assert rig.D.states.pool.num_used == 1  # the read may still scatter into it
    with pytest.raises(OutOfBlocksError, match=r"'b': cannot reserve: none of the 1 state pages is free"):
        rig.D.reserve("b", TOKS)
    assert rig.D.live_requests() == []
    rig.dd.run_until_idle()
    assert rig.D.states.pool.num_used == 0 and rig.D.reserve("b", TOKS)


@pytest.mark.parametrize("kwargs, message", [
    ({}, r"^DecodeLifecycle: the spec has state groups: give num_states >= 1"),
])
def test_a_lifecycle_refuses_what_state_groups_cannot_use(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DecodeLifecycle(hybrid(), 8, **kwargs)


def test_refusals_of_state_specs_name_the_rule():
    with pytest.raises(ConfigError, match=r"^PrefillLifecycle: num_states 2, but the spec has no state group$"):
        PrefillLifecycle(small_spec(1), 8, num_states=2)
    with pytest.raises(ConfigError, match=r"one TP degree"):
        check_pair(hybrid(2), hybrid(1))
    with pytest.raises(ConfigError, match=r"^ProcessDriver: num_states 0 with 96 state bytes"):
        ProcessDriver(hybrid(), 8)  # refused before a process starts
    with pytest.raises(ValidationError, match=r"^request 'a': its prompt passes state checkpoints, so it needs 2 "):
        PrefillLifecycle(hybrid(), 8, num_states=1).admit("a", TOKS)
    with pytest.raises(ValidationError, match=r"a spec with state groups needs state pages"):
        ReferenceBackend(hybrid(), 8, MemoryStore(1 << 20))
    with pytest.raises(ValidationError, match=r"state pages of rank 1 must be a writable contiguous uint8 array"):
        ReferenceBackend(hybrid(), 8, MemoryStore(1 << 20), num_states=4, states={0: np.zeros((4, 96), np.uint8)})
    with pytest.raises(ValidationError, match=r"state page 4 outside 0..3"):
        ReferenceBackend(hybrid(), 8, MemoryStore(1 << 20), num_states=4).write_states(0, ["k"], [4])


def test_a_state_of_another_geometry_is_never_loaded():
    store = MemoryStore(1 << 20)
    ReferenceBackend(hybrid(checkpoint=16), 8, store, num_states=2).write_states(0, ["k"], [0])
    b = ReferenceBackend(hybrid(), 8, store, num_states=2)
    assert not b.read_state(0, "k", 1) and b.broken_states == 1


def test_a_prefill_waits_until_a_prefix_read_it_gave_up_on_cannot_land():
    """A late read would put a checkpoint's state into the running page under the prefill."""
    rig = state_rig()
    prefill(rig, "a")
    rig.P.admit("b", TOKS)
    rig.pd.pump()
    [(cid, _)] = [k for k, c in rig.pd.pending.items() if k[1] == 0 and isinstance(c, C.ReadBlocks)]
    rig.pd.complete(cid, 0)
    rig.clock.advance(10.5)  # rank 1 never answered: past the read's deadline, before its fence
    rig.P.tick()
    assert rig.P.state_of("b") == "prefilling" and rig.notices(rig.pd, C.StartPrefill) == []
    rig.pd.complete(cid, 1)  # it lands now, then the prefill goes out
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    assert sp.request_id == "b" and sp.num_cached_tokens == 0


def test_more_checkpoints_kept_let_a_prompt_sharing_only_the_beginning_start_from_a_state():
    """With ``state_checkpoints=2``, P's prefill keeps the states after blocks 1 and 3 (tokens 8
    and 16) in a page each and stores both with the prompt's: a prompt sharing blocks 0-2 only
    starts from token 8 (with one checkpoint kept it starts from 0), from the very bytes."""
    rig = state_rig(policy=Policy(transfer_timeout=10.0, fence_grace=5.0, read_failure="recompute",
                                  state_checkpoints=2))
    sp = prefill(rig, "a")
    keys = block_keys(TOKS, BS)
    assert sp.checkpoints == (8, 16) and len(sp.state_pages) == 3
    for r in range(2):
        assert rig.store.batch_is_exist([rank_key(keys[k], STATE_KIND, r) for k in (1, 3, 5, 0, 2, 4)]) == \
            [1, 1, 1, 0, 0, 0]
    shares = TOKS[:12] + [7] * 9  # blocks 0-2 in common: checkpoint 2 (token 8) is the last inside
    sp = prefill(rig, "b", shares)  # asserts the running page holds the state after block 1
    assert sp.num_cached_tokens == 8 and sp.checkpoints == (16,)  # block 3 on: computed, its checkpoint kept
    assert rig.P.states.pool.num_used == 0
    one = state_rig()  # the default keeps the last checkpoint only
    prefill(one, "a")
    assert prefill(one, "b", shares).num_cached_tokens == 0


def test_a_prompt_keeps_no_more_checkpoints_than_it_passes_nor_than_asked():
    from kvstate._statepages import StatePages

    class Req:
        def __init__(self, n):
            self.tokens = list(range(n))

    pages = StatePages(hybrid(), 8, "P", prefix_cache=False, keep=3)
    assert [pages.snapshots(Req(n)) for n in (8, 9, 17, 25, 41)] == [(), (2,), (2, 4), (2, 4, 6), (6, 8, 10)]
    assert [pages.pages_for(Req(n)) for n in (8, 9, 41)] == [1, 2, 4]
    with pytest.raises(ConfigError, match="state_checkpoints"):
        Policy(state_checkpoints=0)

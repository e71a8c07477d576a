"""A read or swap-in D gave up on (its deadline passed, its fence not yet) may still land in
the request's blocks: the recompute that replaces it goes out only once it answered or its
fence passed, so a late read can never overwrite what the recompute and the decode steps after
it wrote (the protocol suite found that: a decode step's token in the last block, overwritten
by the prompt's stored bytes)."""
from __future__ import annotations

import pytest
from lifecycle_helpers import TOKS, assert_clean, d_matches, deliver, handoff
from rigs import Rig

from kvstate import Policy
from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate.testing import fill_blocks

POLICY = Policy(read_failure="recompute", transfer_timeout=10.0, fence_grace=5.0)


def given_up_read(tp: int):
    """D's read of a handed-off prompt, past its deadline and not answered: D recomputes."""
    rig = Rig(tp=tp, policy=POLICY)
    deliver(rig, handoff(rig, "r", TOKS))
    rig.dd.pump()
    [read] = [c for c in rig.D.pending_commands() if isinstance(c, C.ReadBlocks)]
    rig.clock.advance(10.5)
    rig.D.tick()
    assert rig.D.state_of("r") == "recomputing"
    return rig, read


def recompute_and_decode(rig, rc: C.Recompute) -> None:
    """The engine's recompute, then a decode step that writes the newest token's block."""
    assert rig.D.blocks_of("r") == rc.block_ids
    fill_blocks(rig.db, block_keys(TOKS, 4), rc.block_ids, rc.from_token // 4)
    rig.D.recompute_done("r")
    assert rig.D.state_of("r") == "running"
    rig.D.append_tokens("r", [3])  # the step computed the first token (7): the last block changes
    fill_blocks(rig.db, block_keys(TOKS + [7], 4), rig.D.blocks_of("r"), len(TOKS) // 4)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_recompute_waits_for_a_read_it_gave_up_on_to_land(tp):
    rig, read = given_up_read(tp)
    assert not rig.notices(rig.dd, C.Recompute)  # the read may still land: nothing to compute into yet
    for r in read.ranks:
        rig.dd.complete(read.command_id, r)  # late, before the fence: it moves its bytes
    [rc] = rig.notices(rig.dd, C.Recompute)
    recompute_and_decode(rig, rc)
    assert d_matches(rig, TOKS + [7], rig.D.blocks_of("r"))
    rig.D.finish("r")
    assert_clean(rig)


def test_a_recompute_waits_for_the_fence_of_a_read_that_never_answers():
    rig, read = given_up_read(2)
    rig.clock.advance(4.0)
    rig.D.tick()
    assert not rig.notices(rig.dd, C.Recompute)
    rig.clock.advance(1.0)  # the fence: the backend moves nothing after it
    rig.D.tick()
    [rc] = rig.notices(rig.dd, C.Recompute)
    recompute_and_decode(rig, rc)
    for r in read.ranks:  # a very late answer is refused past its fence and moves nothing
        assert rig.dd.complete(read.command_id, r).error.startswith("FenceError")
    assert d_matches(rig, TOKS + [7], rig.D.blocks_of("r"))
    rig.D.finish("r")
    assert_clean(rig)


def test_an_aborted_request_s_held_back_recompute_never_goes_out():
    rig, read = given_up_read(1)
    rig.D.abort("r")
    rig.dd.complete(read.command_id, 0)
    assert not rig.notices(rig.dd, C.Recompute)
    assert_clean(rig)

"""State groups beside sliding-window groups (a model of full, sliding-window and state layers),
on real bytes: D reads the window layer's blocks from its last window on, and after a partial
read continues from a state's end only where that end's last window was read too."""
from __future__ import annotations

import dataclasses

import pytest
from lifecycle_helpers import deliver
from rigs import Rig, small_spec
from state_helpers import BS, assert_state, prefill

from kvstate import Policy
from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate._layers import LayerGroup


def spec(window: int, checkpoint: int):
    """Layer 0 full attention, layer 1 a sliding window, layer 2 a state (``window`` and
    ``checkpoint`` in blocks)."""
    return small_spec(2, num_layers=3, groups=(LayerGroup("full", (0,)), LayerGroup("window", (1,), window=window * BS),
                                               LayerGroup("state", (2,), state_bytes=96, checkpoint=checkpoint * BS)))


SPEC = spec(2, 2)  #: a window of 2 blocks, a checkpoint every 2
PROMPT = list(range(100, 149))  # 49 tokens: 12 full blocks and one of 1 token


def read_stopping_after(n: int, spec=SPEC, prompt=PROMPT) -> tuple[Rig, C.ReadBlocks, list]:
    """P serves ``prompt``; D's read of it answers ``n`` blocks on every rank; (rig, read, D's notices)."""
    rig = Rig(spec=spec, num_states=4, policy=Policy(transfer_timeout=10.0, fence_grace=5.0,
                                                      read_failure="recompute"))
    rig.D.reserve("r", prompt)
    prefill(rig, "r", prompt)
    deliver(rig, rig.notices(rig.pd))
    rig.dd.pump()
    [read] = list({id(c): c for c in rig.dd.pending.values() if isinstance(c, C.ReadBlocks)}.values())
    for rank in read.ranks:
        rig.dd.complete(read.command_id, rank, n)
    return rig, read, rig.notices(rig.dd)


def test_d_reads_the_window_layer_from_its_last_window_and_states_at_checkpoints():
    rig, read, _ = read_stopping_after(13)
    assert read.window_from == 10  # the last 8 tokens of 50 start in block 10
    assert [e for e, _ in read.states] == [2, 4, 6, 8, 10, 12, 13]
    assert rig.D.state_of("r") == "running"
    assert_state(rig.db, rig.D.pages_of("r")[0], block_keys(PROMPT, BS)[-1])


@pytest.mark.parametrize("stop, resume", [(12, 12), (11, 0), (7, 0)])
def test_a_partial_read_continues_from_a_stored_checkpoint_past_its_read_window(stop, resume):
    """P stored the states after 12 blocks (its last checkpoint) and 13. Stopping after 12
    blocks, the state after block 11 and the window's blocks 10-11 are in: D continues from
    token 48. After 11 or 7 blocks no stored state is in: from token 0."""
    rig, _, notices = read_stopping_after(stop)
    [rc] = [n for n in notices if isinstance(n, C.Recompute)]
    assert rc.from_token == resume * BS
    if resume:
        assert_state(rig.db, rc.state_pages[0], block_keys(PROMPT, BS)[resume - 1])


def test_a_state_before_the_read_window_is_not_continued_from():
    """A window of 1 block, a checkpoint every 4: D's cache of 54 tokens reads the window layer
    from block 12 on; a read stopping after 13 blocks has the state after block 11, but
    continuing from token 48 needs the window layer's block 11, never read: from token 0."""
    prompt = list(range(100, 153))  # 53 tokens: 13 full blocks and one of 1; P stores states at 12 and 14
    rig, read, notices = read_stopping_after(13, spec(1, 4), prompt)
    assert read.window_from == 12
    [rc] = [n for n in notices if isinstance(n, C.Recompute)]
    assert rc.from_token == 0


def test_p_reuses_a_stored_prefix_from_its_stored_checkpoint_only():
    rig = Rig(spec=SPEC, num_states=4, policy=dataclasses.replace(Policy(), transfer_timeout=10.0))
    prefill(rig, "a", PROMPT)  # stores the states after blocks 12 (its last checkpoint) and 13
    assert prefill(rig, "b", PROMPT[:50] + [7] * 3).num_cached_tokens == 12 * BS
    assert prefill(rig, "c", PROMPT[:44] + [7] * 9).num_cached_tokens == 0  # no state stored at 10

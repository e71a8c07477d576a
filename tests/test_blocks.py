"""The block manager (kvstate/_blocks.py): layer kinds as classes, and a lifecycle running on
blocks an engine allocates and owns, as vLLM's scheduler hands a connector its block ids."""
from __future__ import annotations

import pytest
from rigs import Clock, small_spec

from kvstate import DecodeLifecycle, OutOfBlocksError, Policy, PrefillLifecycle
from kvstate import commands as C
from kvstate._blocks import LAYER_KINDS, BlockManager, EngineBlocks, table_kinds
from kvstate._errors import BlockError, ConfigError, ValidationError
from kvstate._layers import GROUP_KINDS, LayerGroup
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver
from kvstate.testing import fill_blocks, mismatched_blocks

POLICY = Policy(transfer_timeout=10.0, fence_grace=5.0, first_token_timeout=100.0)


def test_every_layer_kind_has_a_class_and_only_window_frees_behind_it():
    assert set(LAYER_KINDS) == set(GROUP_KINDS)
    assert [k for k, v in LAYER_KINDS.items() if v.frees_behind_window] == ["window"]
    assert LAYER_KINDS["window"].stores_from(3) == 3 and LAYER_KINDS["full"].stores_from(3) == 0


def test_tables_take_their_kinds_from_the_layer_groups():
    mixed = small_spec(num_layers=4, groups=(LayerGroup("full", (0, 2)), LayerGroup("window", (1, 3), window=8)),
                       group_tables=True)
    assert [k.name for k in table_kinds(mixed)] == ["full", "window"] and BlockManager(mixed, 8).window_tables == (1,)
    one_table = small_spec(num_layers=4, groups=(LayerGroup("full", (0, 2)), LayerGroup("window", (1, 3), window=8)))
    assert [k.name for k in table_kinds(one_table)] == ["full"]  # a block holds a full layer: it stays
    sliding = small_spec(num_layers=2, groups=(LayerGroup("window", (0, 1), window=8),))
    assert BlockManager(sliding, 8).window_tables == (0,)


def engine_pair(num_blocks: int = 32):
    """P and D each on an engine's blocks, with reference backends over one store."""
    spec, clock, store = small_spec(), Clock(), MemoryStore(1 << 22)
    pe, de = EngineBlocks(spec, num_blocks), EngineBlocks(spec, num_blocks)
    P = PrefillLifecycle(spec, num_blocks, POLICY, clock=clock, blocks=pe)
    D = DecodeLifecycle(spec, num_blocks, POLICY, clock=clock, blocks=de)
    pb, db = ReferenceBackend(spec, num_blocks, store), ReferenceBackend(spec, num_blocks, store)
    return spec, clock, (P, pe, StepDriver(P, pb), pb), (D, de, StepDriver(D, db), db)


def test_a_handoff_on_the_engines_blocks_moves_every_byte_and_returns_the_blocks_when_done():
    spec, _, (P, pe, pd, pb), (D, de, dd, db) = engine_pair()
    toks = list(range(1, 11))  # 10 tokens: 3 blocks of 4 (the last partial), D one more for the token
    pe.lend("r", [7, 3, 20])
    assert P.admit("r", toks) == "reading_prefix" and P.blocks_of("r") == (7, 3, 20) and pe.lent("r") == ()
    pd.run_until_idle()  # the store holds no prefix: prefill from token 0
    fill_blocks(pb, P.keys_of("r"), [7, 3, 20])
    P.prefill_done("r", 99)
    pd.run_until_idle()
    assert pe.returned() == [7, 3, 20] and P.stats()["pool"].used == 0  # the engine may free them now
    de.lend("r", [30, 1, 5])
    assert D.reserve("r", toks) == (30, 1, 5)
    D.deliver_first_token("r", 99)
    dd.run_until_idle()
    assert D.state_of("r") == "running"
    assert not mismatched_blocks(db, D.keys_of("r"), [30, 1, 5])  # byte-exact in the engine's blocks
    assert [n for n in dd.notices if isinstance(n, C.StartDecode)][0].block_ids == (30, 1, 5)
    de.lend("r", [9])
    assert D.append_tokens("r", [5, 6, 7]) == (9,)  # the 13th token needs a fourth block: the engine's
    D.finish("r")
    assert sorted(de.returned()) == [1, 5, 9, 30]


def test_without_the_engines_blocks_nothing_is_reserved_and_nothing_changes():
    spec, _, _, (D, de, dd, _) = engine_pair()
    de.lend("r", [4, 5])
    with pytest.raises(OutOfBlocksError, match="the engine lent 2"):
        D.reserve("r", list(range(1, 11)))  # needs 3
    assert not D.is_live("r") and de.lent("r") == (4, 5) and D.stats()["pool"].used == 0


def test_a_block_a_transfer_still_touches_goes_back_only_when_the_transfer_lets_go():
    spec, clock, _, (D, de, dd, db) = engine_pair()
    de.lend("r", [2, 4, 6])
    D.reserve("r", list(range(1, 11)))
    D.deliver_first_token("r", 99)
    dd.pump()  # the read is out, unanswered
    D.abort("r")
    assert de.returned() == []  # ended, but the read may still scatter into them
    for cid, rank in list(dd.pending):
        dd.complete(cid, rank, "fail")
    assert sorted(de.returned()) == [2, 4, 6]


@pytest.mark.parametrize("ids, rule", [
    ([64], "not one of the engine's 0..31"), ([-1], "not one of"), ([1, 1], "already lent"),
    (["1"], "not one of"), ("12", "sequence of block ids"),
])
def test_lending_a_block_that_is_not_the_engines_to_lend_is_refused(ids, rule):
    _, _, _, (D, de, _, _) = engine_pair()
    de.lend("other", [3])
    with pytest.raises(BlockError, match=rule):
        de.lend("r", ids)
    assert de.lent("r") == () and de.lent("other") == (3,)
    with pytest.raises(BlockError, match="already lent"):
        de.lend("r", [3])


def test_a_lifecycle_refuses_a_manager_of_another_pool_or_a_prefix_cache_it_cannot_have():
    spec = small_spec()
    with pytest.raises(ValidationError, match="another spec or pool"):
        DecodeLifecycle(spec, 16, blocks=EngineBlocks(spec, 32))
    with pytest.raises(ValidationError, match="has no prefix cache"):
        DecodeLifecycle(spec, 32, prefix_cache=True, blocks=EngineBlocks(spec, 32))
    with pytest.raises(ValidationError, match="BlockManager"):
        DecodeLifecycle(spec, 32, blocks=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="engine's own prefix cache"):
        EngineBlocks(spec, 32).allocate_cached(None, 1, [])


@pytest.mark.parametrize("call", [
    lambda b: b.lent(7), lambda b: b.lent(""), lambda b: b.take_back(None),
    lambda b: b.can_allocate("2"), lambda b: b.can_allocate(-1), lambda b: b.can_allocate(True),
    lambda b: b.can_allocate(1, -2), lambda b: b.can_allocate(1, 0, 5), lambda b: b.lend("r", None),
])
def test_every_call_of_the_engines_manager_refuses_bad_input_and_changes_nothing(call):
    from kvstate._errors import KVStateError

    b = EngineBlocks(small_spec(), 16)
    b.lend("r", [1, 2])
    with pytest.raises(KVStateError):
        call(b)
    assert b.lent("r") == (1, 2) and b.returned() == [] and b.pool.stats().used == 0


def test_a_block_the_engine_shares_between_two_requests_returns_when_both_let_go():
    spec, clock, _, (D, de, dd, db) = engine_pair()
    de.lend("a", [2, 4])
    D.reserve("a", list(range(1, 6)))
    de.lend("b", [2, 5])  # the engine's prefix cache gave b a's first block
    D.reserve("b", list(range(1, 6)))
    D.abort("a")
    assert de.returned() == [4]  # 2 is still b's
    D.abort("b")
    assert sorted(de.returned()) == [2, 5]


def test_blocks_the_engine_computed_are_read_past_and_must_be_lent():
    spec, clock, _, (D, de, dd, db) = engine_pair()
    with pytest.raises(BlockError, match="computed"):
        de.lend("r", [2, 4], computed=3)
    assert de.lent("r") == ()
    de.lend("r", [2, 4, 6], computed=1)
    D.reserve("r", list(range(1, 11)))
    D.deliver_first_token("r", 99)
    dd.pump()
    (cid, _), *_ = list(dd.pending)
    read = next(c for c in D.pending_commands() if c.command_id == cid)
    assert read.block_ids[0] == 4  # block 2 held the cache already

"""Group tables (kvstate._tables): a block table per layer group, so a decoding request frees
its window groups' blocks behind the window while its full groups keep theirs."""
from __future__ import annotations

import dataclasses

import pytest
from lifecycle_helpers import assert_clean, deliver
from rigs import Rig

from kvstate import CacheSpec, ConfigError, DecodeLifecycle, Policy, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate._blocks import BlockManager
from kvstate._keys import block_keys
from kvstate._layers import LayerGroup
from kvstate._pool import FREED
from kvstate._spec import check_pair
from kvstate._tables import page_layers, per_block, rows, slot_of_layer, table_of_layer
from kvstate.backends import MemoryStore, ReferenceBackend
from kvstate.testing import fill_blocks, mismatched_blocks, mismatched_needed


def window_tables(spec):
    """The tables the block manager frees behind the window."""
    return BlockManager(spec, 0).window_tables


WIN = 8  # tokens: two blocks of 4


def gemma2_like(window: int = WIN, **kw) -> CacheSpec:
    """Window and full layers alternating, the window ones even (Gemma 2's and gpt-oss's pattern)."""
    return CacheSpec(num_layers=4, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=1,
                     groups=(LayerGroup("window", (0, 2), window=window), LayerGroup("full", (1, 3))), **kw)


def split_rig(p_tables: bool = False, **kw):
    """P (group tables if ``p_tables``) and D with group tables, a 40-token prompt handed off
    and running on D."""
    spec = gemma2_like(group_tables=p_tables)
    rig = Rig(tp=1, spec=spec, d_spec=gemma2_like(group_tables=True), **kw)
    toks = list(range(300, 340))
    deliver(rig, handoff_rows(rig, "r", toks))
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    assert rig.D.state_of("r") == "running"
    return rig, toks


def handoff_rows(rig, rid, toks):
    """As ``lifecycle_helpers.handoff``, P computing its blocks table by table."""
    rig.D.reserve(rid, toks)
    rig.P.admit(rid, toks)
    rig.pd.run_until_idle()
    [sp] = rig.notices(rig.pd, C.StartPrefill)
    fill_blocks(rig.pb, block_keys(toks, 4), rows(sp.block_ids, sp.tables))
    rig.P.prefill_done(rid, 7)
    rig.pd.run_until_idle()
    return rig.notices(rig.pd)


def test_the_tables_geometry_follows_the_groups():
    spec = gemma2_like(group_tables=True)
    assert per_block(spec) == 2 and page_layers(spec) == 2 and window_tables(spec) == (0,)
    assert table_of_layer(spec) == (0, 1, 0, 1) and slot_of_layer(spec) == (0, 0, 1, 1)
    one = gemma2_like()
    assert per_block(one) == 1 and page_layers(one) == 4 and window_tables(one) == ()
    state = CacheSpec(num_layers=5, kv_heads=2, block_size=4, head_dim=8, group_tables=True, groups=(
        LayerGroup("full", (0, 3)), LayerGroup("state", (1,), state_bytes=8, checkpoint=8),
        LayerGroup("window", (2, 4), window=8)))
    assert table_of_layer(state) == (0, 1, 0, 1) and window_tables(state) == (1,)  # the paged layers' numbering


def test_group_tables_are_a_bool_for_a_spec_with_a_window_group():
    with pytest.raises(ConfigError, match="True only for a spec with a window group"):
        CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, group_tables=True)
    with pytest.raises(ConfigError, match="is a bool"):
        gemma2_like(group_tables=1)
    check_pair(gemma2_like(), gemma2_like(group_tables=True))  # the GPU's layout, not the store's


def test_group_tables_beside_single_block_entries_are_refused():
    spec = gemma2_like(group_tables=True)
    for make in (lambda: DecodeLifecycle(spec, 16, prefix_cache=True),
                 lambda: PrefillLifecycle(spec, 16, host_blocks=4),
                 lambda: ReferenceBackend(spec, 16, MemoryStore(1 << 20), host_blocks=4)):
        with pytest.raises(ConfigError, match="group_tables with a (GPU prefix cache|host tier)"):
            make()


@pytest.mark.parametrize("p_tables", [False, True])
def test_d_holds_a_table_per_group_and_reads_p_s_bytes_into_them(p_tables):
    rig, toks = split_rig(p_tables)
    blocks, other = zip(*rig.D.rows_of("r"), strict=True)
    assert len(blocks) == len(other) == 11 and not set(blocks) & set(other)
    assert rig.D.pool.num_used == 22
    layers = rig.db.caches[0]["key"]
    assert layers[0] is layers[1] and layers[2] is layers[3]  # a block is two layer slots, shared by the groups
    assert mismatched_needed(rig.db, block_keys(toks, 4), rig.D.rows_of("r"), len(toks)) == []
    rig.D.finish("r")
    assert_clean(rig)


def test_a_long_conversation_holds_its_full_blocks_and_one_window_of_the_window_group():
    rig, toks = split_rig()
    window0 = rig.D.blocks_of("r")
    for i in range(24):  # 40 + 1 + 24 tokens: the next step attends to tokens 57..64
        rig.D.append_tokens("r", [i])
    window, full = zip(*rig.D.rows_of("r"), strict=True)
    assert len(window) == len(full) == 17
    assert window[:14] == (FREED,) * 14 and FREED not in window[14:] and FREED not in full
    assert rig.D.pool.num_used == 17 + 3  # every full block, and the window's three
    assert set(window0[:14]) <= set(rig.D.pool.free_ids()) | set(window[14:]) | set(full)
    got = rig.D.rows_of("r")
    assert mismatched_blocks(rig.db, block_keys(toks, 4), got, upto=10, layers=[1, 3]) == []  # full layers kept
    rig.D.finish("r")
    assert_clean(rig)


def test_a_write_back_stores_the_full_group_whole_and_a_reload_continues_the_cache():
    """After decoding past the window, the write-back stores every block of the full group and
    the window group's from the window on, so the reload reads window-first and D continues
    without recomputing, holding every byte its decode needs."""
    rig, toks = split_rig(policy=Policy(transfer_timeout=10.0, fence_grace=5.0, preempt="write",
                                        read_failure="recompute"))
    cache = toks + [7] + list(range(8))  # the prompt, the first token, 8 decoded
    for i in range(8):
        rig.D.append_tokens("r", [i])
    fill_blocks(rig.db, block_keys(cache[:-1], 4), rig.D.rows_of("r"), 10)  # the engine computed them
    rig.D.preempt("r")
    rig.dd.pump()
    [wb] = [c for c in rig.D.pending_commands() if isinstance(c, C.WriteBlocks)]
    assert len(wb.keys) == 12 and wb.window_from == 10
    assert wb.block_ids[:10] == (FREED,) * 10 and FREED not in wb.block_ids[10:] + wb.tables[0]
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "preempted" and rig.D.pool.num_used == 0
    rig.D.resume("r")
    rig.dd.pump()
    [read] = [c for c in rig.D.pending_commands() if isinstance(c, C.ReadBlocks)]
    assert read.window_from == 10 and len(read.tables[0]) == len(read.keys) == 12
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and not rig.notices(rig.dd, C.Recompute)
    assert mismatched_needed(rig.db, block_keys(cache[:-1], 4), rig.D.rows_of("r"), len(cache) - 1) == []
    rig.D.finish("r")
    assert_clean(rig)


def test_a_transfer_whose_tables_break_the_layout_is_refused_and_moves_nothing():
    spec = gemma2_like(group_tables=True)
    be = ReferenceBackend(spec, 8, MemoryStore(1 << 20))
    keys = block_keys(list(range(8)), 4)
    fill_blocks(be, keys, [(0, 1), (2, 3)])
    before = [a.tobytes() for a in be.caches[0]["key"]]
    for tables, needle in [((), "1 other block tables expected"), ([[2, 5]], "name a block twice"),
                           ([[4]], "2 keys but 1 block ids"), ([[4, 8]], "outside 0..7")]:
        with pytest.raises(ValidationError, match=needle):
            be.read(0, keys, [0, 2], tables=tables)
    assert [a.tobytes() for a in be.caches[0]["key"]] == before
    assert be.write(0, keys, [0, 2], tables=[[1, 3]]) == 2
    assert be.read(0, keys, [4, 6], tables=[[5, 7]]) == 2
    assert mismatched_blocks(be, keys, [(4, 5), (6, 7)]) == []


def test_a_prompt_too_long_for_every_table_is_refused_naming_them():
    d = DecodeLifecycle(gemma2_like(group_tables=True), 16, dataclasses.replace(Policy()))
    with pytest.raises(ValidationError, match="in each of 2 block tables"):
        d.reserve("r", list(range(40)))
    assert d.live_requests() == [] and d.pool.num_used == 0

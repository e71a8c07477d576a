"""The block tables' small functions, each pinned to its exact answers and refusals: a
logical block's rows, a layer's table and slot, what a request pins, the tables a fresh
allocation fills, and the layouts group tables cannot share."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from kvstate import FREED, CacheSpec, ConfigError, LayerGroup, ValidationError, rows, slot_of_layer, table_of_layer
from kvstate._layers import checkpoint_floor
from kvstate._tables import check_layout, give, pinned, table


def gemma2_like(**kw) -> CacheSpec:
    return CacheSpec(num_layers=4, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=1,
                     groups=(LayerGroup("window", (0, 2), window=8), LayerGroup("full", (1, 3))), **kw)


def test_rows_are_the_ids_or_a_tuple_of_every_table_s_block():
    assert rows([1, 2]) == [1, 2]
    assert rows([1, 2], [[3, 4], [5, FREED]]) == [(1, 3, 5), (2, 4, FREED)]
    assert rows([], []) == []


@pytest.mark.parametrize("args,message", [
    (("ab",), "rows: block ids must be a sequence of ints >= 0 (or FREED), got 'ab'"),
    (([1, -2],), "rows: block ids must be a sequence of ints >= 0 (or FREED), got [1, -2]"),
    (([True],), "rows: block ids must be a sequence of ints >= 0 (or FREED), got [True]"),
    ((5,), "rows: block ids must be a sequence of ints >= 0 (or FREED), got 5"),
    (([1], 5), "rows: tables must be a sequence of block tables, got 5"),
    (([1], "ab"), "rows: tables must be a sequence of block tables, got 'ab'"),
    (([1], [["x"]]), "rows: a table's: block ids must be a sequence of ints >= 0 (or FREED), got ['x']"),
    (([1, 2], [[3]]), "rows: every table must hold 2 blocks, got 1"),
])
def test_rows_refuse_what_is_not_a_table_naming_it(args, message):
    with pytest.raises(ValidationError, match=f"^{re.escape(message)}$"):
        rows(*args)


def test_a_layer_s_table_and_slot_follow_the_groups_with_group_tables_only():
    one = gemma2_like()
    assert table_of_layer(one) == (0, 0, 0, 0) and slot_of_layer(one) == (0, 1, 2, 3)
    tables = gemma2_like(group_tables=True)
    assert table_of_layer(tables) == (0, 1, 0, 1) and slot_of_layer(tables) == (0, 0, 1, 1)


@pytest.mark.parametrize("fn", [table_of_layer, slot_of_layer])
def test_a_layer_s_table_and_slot_need_a_cache_spec(fn):
    name = fn.__name__
    with pytest.raises(ValidationError, match=f"^{name}: spec must be a CacheSpec, got 'x'$"):
        fn("x")
    half = SimpleNamespace(paged=lambda: gemma2_like())  # paged, but no group_tables: not a spec
    with pytest.raises(ValidationError, match=f"^{name}: spec must be a CacheSpec"):
        fn(half)


def test_a_request_pins_every_table_s_blocks_but_the_freed():
    assert pinned([1, FREED, 2], [[3, 4, FREED], [5]]) == (1, 2, 3, 4, 5)
    assert list(pinned([1, 2], [])) == [1, 2]  # one table: its ids as they are


def test_table_zero_is_the_request_s_blocks_and_then_its_tables_in_order():
    req = SimpleNamespace(blocks=[1], tables=[[2], [3], [4]])
    assert table(req, 0) is req.blocks
    assert [table(req, t) for t in (1, 2, 3)] == [[2], [3], [4]]


def test_a_fresh_allocation_fills_each_table_with_its_share_in_order():
    req = SimpleNamespace(blocks=[0], tables=[[10], [20]])
    give(req, [1, 2, 11, 12, 21, 22])
    assert req.blocks == [0, 1, 2] and req.tables == [[10, 11, 12], [20, 21, 22]]
    plain = SimpleNamespace(blocks=[0], tables=[])
    give(plain, [1, 2])
    assert plain.blocks == [0, 1, 2]


@pytest.mark.parametrize("prefix_cache,host_blocks,what", [(True, 0, "GPU prefix cache"), (False, 4, "host tier")])
def test_group_tables_refuse_what_moves_single_blocks_naming_it(prefix_cache, host_blocks, what):
    message = (f"P: CacheSpec.group_tables with a {what}: their entries are single blocks, not a block per "
               "layer group (kvstate._tables)")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        check_layout(gemma2_like(group_tables=True), prefix_cache, host_blocks, "P")
    check_layout(gemma2_like(), prefix_cache, host_blocks, "P")  # one table: either is fine


def test_a_state_resumes_from_whole_checkpoints_in_blocks():
    state = LayerGroup("state", (1,), state_bytes=8, checkpoint=8)
    got = checkpoint_floor([LayerGroup("full", (0,)), state], 7, 4)  # checkpoints every 2 blocks of 4 tokens
    assert got == 6 and type(got) is int
    assert checkpoint_floor([LayerGroup("full", (0,))], 7, 4) == 7


def test_a_request_holds_every_block_but_the_freed_with_one_table_too():
    from kvstate._tables import held
    assert held(SimpleNamespace(blocks=[4, 5], tables=[])) == [4, 5]
    assert held(SimpleNamespace(blocks=[FREED, 5], tables=[])) == [5]
    assert held(SimpleNamespace(blocks=[FREED, 5], tables=[[6, FREED]])) == [5, 6]

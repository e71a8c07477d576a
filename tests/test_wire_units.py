"""The wire format's refusals, word for word, and its bounds, exactly at the limit.

A rank worker and its driver trust nothing the other process sends: each item is checked
and a bad one refused with a :class:`ProtocolError` naming the command and the item. These
cases pin each refusal's message (a worker's log and the driver's counters are how an
operator finds a bad peer) and each bound on both sides of its limit.
"""
from __future__ import annotations

import time

import msgpack
import pytest

from kvstate import commands as C
from kvstate._errors import ProtocolError
from kvstate._pool import FREED
from kvstate._spec import CacheSpec
from kvstate.distributed import _wire as wire

NOW = time.monotonic()


def items(**over) -> list:
    """A good CMD message's items for a two-key WriteBlocks, with ``over`` replacing some."""
    c = C.WriteBlocks("r7", 3, (0,), NOW + 10, ("a", "b"), (4, 5), fence=NOW + 20)
    out = wire.unpack(wire.command_message(c, 77))
    names = ["type", "inc", "kind", "cid", "rid", "keys", "blocks", "slots", "deadline", "fence", "window",
             "states", "tables"]
    for name, value in over.items():
        out[names.index(name)] = value
    return out


def refused(msg: list) -> str:
    with pytest.raises(ProtocolError) as e:
        wire.command_of(msg, 0)
    return str(e.value)


@pytest.mark.parametrize("over, message", [
    ({"kind": 10}, "the command kind must be an int in [1, 10), got 10"),
    ({"kind": 0}, "the command kind must be an int in [1, 10), got 0"),
    ({"cid": 0}, f"the command id must be an int in [1, {1 << 63}), got 0"),
    ({"rid": ""}, "the request id must be a non-empty str of at most 4096 chars"),
    ({"keys": "ab"}, "command 3: keys must be a list"),
    ({"keys": ["a", 5]}, "command 3: a key must be a non-empty str of at most 4096 chars"),
    ({"blocks": [4, -1]}, "command 3: block ids must be a list of ints >= 0"),
    ({"blocks": [4, 1 << 63]}, "command 3: block ids must be a list of ints >= 0"),
    ({"slots": [1, 2]}, "command 3: 2 keys, 2 block ids and 2 host slots do not fit a WriteBlocks"),
    ({"slots": "x"}, "command 3: host slots must be a list of ints >= 0"),
    ({"deadline": "soon"}, "command 3: the deadline must be a number of seconds, got 'soon'"),
    ({"fence": None}, "command 3: the fence must be a number of seconds, got None"),
    ({"fence": float("nan")}, "command 3: the fence must be a number of seconds, got nan"),
    ({"window": 3}, "command 3: the window's first key must be an int in [0, 3), got 3"),
    ({"states": [1]}, "command 3: states must be (end, page) pairs with ends increasing in 1..2"),
    ({"states": [2, 0, 1, 0]}, "command 3: states must be (end, page) pairs with ends increasing in 1..2"),
    ({"states": [3, 0]}, "command 3: states must be (end, page) pairs with ends increasing in 1..2"),
    ({"states": "s"}, "command 3: states must be a list of ints >= 0"),
    ({"tables": {}}, "command 3: group tables must be a list of lists"),
    ({"tables": [[1]]}, "command 3: each group table must hold 2 block ids"),
    ({"tables": [[1, "b"]]}, "command 3: a group table must be a list of ints >= 0"),
])
def test_each_bad_item_of_a_command_is_refused_by_name(over, message):
    assert refused(items(**over)) == message


def test_a_command_of_the_wrong_length_names_the_type_and_counts():
    assert refused(items()[:-1]) == "a CMD message has 12 items after its type, got 11"
    with pytest.raises(ProtocolError, match=r"^a DONE message has 5 items after its type, got 4$"):
        wire.from_worker(wire.pack(wire.DONE, 0, 1, 2, 0))


def test_a_swap_has_no_window_and_a_read_or_write_keeps_its_own():
    c = C.SwapOut("r", 4, (0,), NOW + 1, ("a",), (2,), fence=NOW + 2, host_slots=(9,))
    msg = wire.unpack(wire.command_message(c, 1))
    assert wire.command_of(msg, 0).host_slots == (9,)
    msg[10] = 1
    assert refused(msg) == "command 4: a SwapOut has no window to start from"
    for cls in (C.ReadBlocks, C.LoadLayers, C.WriteBlocks, C.SaveLayers):
        c = cls("r", 5, (0,), NOW + 1, ("a", "b"), (2, 3), fence=NOW + 2)
        msg = wire.unpack(wire.command_message(c, 1))
        msg[10] = 1
        back = wire.command_of(msg, 0)
        assert type(back) is cls and back.window_from == 1


def test_freed_entries_cross_only_before_the_window():
    """A write-back of a window group's table (kvstate._tables): its entries before the
    window's first key are FREED, in the block ids and in the other tables alike."""
    c = C.WriteBlocks("r", 6, (0,), NOW + 1, ("a", "b", "c"), (FREED, FREED, 7), fence=NOW + 2,
                      tables=((1, 2, 3), (FREED, 4, 5)), window_from=2)
    back = wire.command_of(wire.unpack(wire.command_message(c, 1)), 0)
    assert (back.block_ids, back.tables, back.window_from) == ((FREED, FREED, 7), ((1, 2, 3), (FREED, 4, 5)), 2)
    msg = wire.unpack(wire.command_message(c, 1))
    msg[10] = 1
    assert refused(msg) == "command 6: block ids must be a list of ints >= 0 (-1, freed, only before the window's " \
                           "first key 1)"
    msg[6] = [FREED, 0, 7]
    assert wire.command_of(msg, 0).block_ids == (FREED, 0, 7)
    msg[6] = [FREED, 1 << 63, 7]
    assert refused(msg).startswith("command 6: block ids must be a list of ints >= 0 (-1, freed")
    msg[6] = [FREED, 8, 7]
    msg[12] = [[1, 2, 3], [4, FREED, 5]]
    assert refused(msg) == "command 6: a group table must be a list of ints >= 0 (-1, freed, only before the " \
                           "window's first key 1)"
    msg[6], msg[12] = [8, 9, 7], [[1, 2, 3], [FREED - 1, 4, 5]]
    assert refused(msg).startswith("command 6: a group table must be a list of ints >= 0 (-1, freed")


def test_bounds_hold_exactly_at_their_limit(monkeypatch):
    monkeypatch.setattr(wire, "_MAX_ITEMS", 3)
    three = items(keys=["a", "b", "c"], blocks=[1, 2, 3], tables=[[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert wire.command_of(three, 0).keys == ("a", "b", "c")  # at the limit: taken
    four = ["a", "b", "c", "d"]
    assert refused(items(keys=four, blocks=[1, 2, 3, 4])) == "command 3: keys must be a list"
    assert refused(items(keys=["a", "b", "c"], blocks=[1, 2, 3, 4])) == \
        "command 3: block ids must be a list of ints >= 0"
    assert refused(items(tables=[[1, 2]] * 4)) == "command 3: group tables must be a list of lists"
    top = (1 << 63) - 1
    assert wire.command_of(items(blocks=[0, top]), 0).block_ids == (0, top)  # the largest id: taken


def test_a_long_bad_value_is_cut_in_the_message():
    long = "x" * 500
    assert len(refused(items(deadline=long))) == 200
    assert len(refused(items(kind=long))) == 200
    assert refused(items(deadline=long)).startswith("command 3: the deadline must be a number of seconds, got 'xxx")


@pytest.mark.parametrize("msg, message", [
    ((wire.HB, 0, 5, 10, [1, 2, 3]), "a heartbeat's counts must be 5: broken, short, failed, armed, fired"),
    ((wire.HB, 0, 0, 10, [1, 2, 3, 4, 5]), f"the incarnation must be an int in [1, {1 << 63}), got 0"),
    ((wire.DONE, 0, 5, 0, 1, None), f"the command id must be an int in [1, {1 << 63}), got 0"),
    ((wire.DONE, 0, 5, 1, 1, 7), "the error must be a str of at most 4096 chars"),
    ((wire.ARRIVED, 0, 5, 1, 0), f"the layers must be an int in [1, {1 << 63}), got 0"),
    ((wire.HELLO, 0, 5, 9, 2, "g", 257, ""), "lanes must be an int in [1, 257), got 257"),
    ((wire.HELLO, 0, 5, 9, 2, "", 1, ""), "the geometry must be a non-empty str of at most 4096 chars"),
    ((wire.BYE, 0, 5, None), "the reason must be a str of at most 4096 chars"),
    ((99, 0), "unknown message type 99 from a worker"),
])
def test_each_bad_worker_message_is_refused_by_name(msg, message):
    with pytest.raises(ProtocolError) as e:
        wire.from_worker(wire.pack(*msg))
    assert str(e.value) == message


def test_good_worker_messages_decode_item_by_item():
    assert wire.from_worker(wire.pack(wire.HB, 1, 5, 10, [1, 2, 3, 4, 5])) == wire.Beat(1, 5, 10, (1, 2, 3, 4, 5))
    assert wire.from_worker(wire.pack(wire.DONE, 1, 5, 9, 2, "")) == wire.Done(1, 5, 9, 2, "")
    assert wire.from_worker(wire.pack(wire.ARRIVED, 1, 5, 9, 3)) == wire.Arrived(1, 5, 9, 3)
    assert wire.from_worker(wire.pack(wire.HELLO, 1, 5, 9, 2, "g", 256, "s")) == wire.Hello(1, 5, 9, 2, "g", 256, "s")
    assert wire.from_worker(wire.pack(wire.BYE, 1, 5, "")) == wire.Bye(1, 5, "")


#: each worker message's good items, and each int item's name and lower bound (text items apart)
GOOD = {
    wire.HB: ([1, 5, 10, [1, 2, 3, 4, 5]], {1: ("the rank", 0), 2: ("the incarnation", 1), 3: ("the bytes", 0)}),
    wire.DONE: ([1, 5, 9, 2, None], {1: ("the rank", 0), 2: ("the incarnation", 1), 3: ("the command id", 1),
                                     4: ("the count", 0)}),
    wire.ARRIVED: ([1, 5, 9, 3], {1: ("the rank", 0), 2: ("the incarnation", 1), 3: ("the command id", 1),
                                  4: ("the layers", 1)}),
    wire.HELLO: ([1, 5, 9, 2, "g", 4, "s"], {1: ("the rank", 0), 2: ("the incarnation", 1), 3: ("the pid", 1),
                                            4: ("the TP size", 1), 6: ("lanes", 1)}),
    wire.BYE: ([1, 5, "bye"], {1: ("the rank", 0), 2: ("the incarnation", 1)}),
}
NAMES = {wire.HB: "HB", wire.DONE: "DONE", wire.ARRIVED: "ARRIVED", wire.HELLO: "HELLO", wire.BYE: "BYE"}


def worker_refusal(kind: int, items: list) -> str:
    with pytest.raises(ProtocolError) as e:
        wire.from_worker(wire.pack(kind, *items))
    return str(e.value)


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_every_int_item_of_every_worker_message_is_refused_by_its_name_below_its_bound(kind):
    items, ints = GOOD[kind]
    wire.from_worker(wire.pack(kind, *items))  # the good message decodes
    for i, (name, low) in ints.items():
        bad = list(items)
        bad[i - 1] = low - 1
        high = 257 if name == "lanes" else 1 << 63
        assert worker_refusal(kind, bad) == f"{name} must be an int in [{low}, {high}), got {low - 1}"
    assert worker_refusal(kind, items[:-1]) == \
        f"a {NAMES[kind]} message has {len(items)} items after its type, got {len(items) - 1}"


def test_a_count_and_texts_are_refused_by_name_and_text_is_bounded_at_4096():
    assert worker_refusal(wire.HB, [1, 5, 10, [1, -1, 3, 0, 0]]) == f"a count must be an int in [0, {1 << 63}), got -1"
    assert worker_refusal(wire.DONE, [1, 5, 9, 2, "e" * 4097]) == "the error must be a str of at most 4096 chars"
    assert wire.from_worker(wire.pack(wire.DONE, 1, 5, 9, 2, "e" * 4096)).error == "e" * 4096
    assert worker_refusal(wire.HELLO, [1, 5, 9, 2, "g", 4, 7]) == "the secret must be a str of at most 4096 chars"
    assert worker_refusal(wire.BYE, [1, 5, 3]) == "the reason must be a str of at most 4096 chars"
    assert wire.from_worker(wire.pack(wire.HELLO, 1, 5, 9, 2, "g" * 4096, 4, "")).geometry == "g" * 4096
    assert worker_refusal(wire.HELLO, [1, 5, 9, 2, "g" * 4097, 4, ""]) == \
        "the geometry must be a non-empty str of at most 4096 chars"


@pytest.mark.parametrize("data, message", [
    ("text", "a message must be bytes of at most 64 MiB"),
    (None, "a message must be bytes of at most 64 MiB"),
    (b"\xc1", "a message did not parse as msgpack (FormatError)"),
    (wire.pack(1) + b"x", "a message did not parse as msgpack (ExtraData)"),
    (msgpack.packb([1, {2: 3}]), "a message did not parse as msgpack (ValueError)"),  # a map keyed by an int
    (msgpack.packb({"a": 1}), "a message must be an array opening with its type"),
    (msgpack.packb([]), "a message must be an array opening with its type"),
    (msgpack.packb(["1", 2]), "a message must be an array opening with its type"),
])
def test_a_message_that_is_no_array_of_items_is_refused_by_what_it_is(data, message):
    with pytest.raises(ProtocolError) as e:
        wire.unpack(data)
    assert str(e.value) == message


def test_the_size_bound_holds_at_its_limit_and_texts_travel_as_text(monkeypatch):
    msg = wire.pack(wire.BYE, 1, 5, "é")
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", len(msg))
    assert wire.unpack(msg) == [wire.BYE, 1, 5, "é"]  # at the limit: taken
    with pytest.raises(ProtocolError, match="^a message must be bytes of at most 64 MiB$"):
        wire.unpack(msg + b"\x00")
    assert msgpack.unpackb(wire.pack("k", b"\x00"), raw=False) == ["k", b"\x00"]  # bytes stay bytes


def test_the_geometry_names_every_field_the_blocks_and_the_states():
    assert wire.geometry(CacheSpec(2, 1, 4, 8), 4) == (
        "num_layers=2|kv_heads=1|block_size=4|head_dim=8|dtype=bfloat16|extra_layers=0|has_value=True|"
        "fp8_scales=False|tp_size=1|layer_groups=1|total_kv_heads=0|store_heads=0|groups=()|"
        "group_tables=False|blocks=4|states=0")
    assert wire.geometry(CacheSpec(2, 1, 4, 8), 4, 3).endswith("|blocks=4|states=3")


def test_incarnations_are_fresh_63_bit_numbers_never_0():
    drawn = {wire.new_incarnation() for _ in range(64)}
    assert len(drawn) == 64 and all(1 <= i < 1 << 63 for i in drawn)
    assert max(drawn) > 1 << 56  # drawn from the whole range, not a small one

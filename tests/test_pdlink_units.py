"""The link between scheduler processes (kvstate.distributed._pdlink), in one process: every
message it takes is checked against its kind's schema, a bad one is counted and dropped, a
send never blocks, and every refusal names what was wrong."""
from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq

from kvstate import ConfigError, ProtocolError
from kvstate.distributed._pdlink import SCHEMAS, Link

LOCAL = "tcp://127.0.0.1:*"


@pytest.fixture
def pair() -> Any:
    a, b = Link(LOCAL), Link(LOCAL)
    a.connect("b", b.address)
    yield a, b
    a.close()
    b.close()


def drain(link: Link, want: int, timeout: float = 3.0) -> list[tuple[str, list[Any]]]:
    out: list[tuple[str, list[Any]]] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        out += link.receive(timeout=0.05)
    return out


def test_messages_of_each_kind_arrive_as_sent_and_are_counted(pair):
    a, b = pair
    assert a.send("b", "first_token", "r1", 5, 200) is True
    assert a.send("b", "first_token", "r2", None, 503) is True
    assert a.send("b", "abort", "r3") is True
    assert drain(b, 3) == [("first_token", ["r1", 5, 200]), ("first_token", ["r2", None, 503]), ("abort", ["r3"])]
    assert a.counters == {"received": 0, "sent": 3, "bad_messages": 0, "dropped": 0}
    assert b.counters == {"received": 3, "sent": 0, "bad_messages": 0, "dropped": 0}


def test_a_callers_kinds_join_the_pd_kinds():
    schemas = {"route": (("request_id", (str,)), ("urgent", (bool,)))}
    with Link(LOCAL, schemas) as a, Link(LOCAL, schemas) as b:
        a.connect("b", b.address)
        assert set(a.schemas) == set(SCHEMAS) | {"route"}
        assert a.send("b", "route", "r", True) and a.send("b", "abort", "r")
        assert drain(b, 2) == [("route", ["r", True]), ("abort", ["r"])]


@pytest.mark.parametrize("args, error, words", [
    (("b", "nope", 1), ProtocolError, "Link.send: 'nope' takes []"),
    (("b", "first_token", "r", 5), ProtocolError,
     "Link.send: 'first_token' takes ['request_id', 'token', 'error_code']"),
    (("b", "abort"), ProtocolError, "Link.send: 'abort' takes ['request_id']"),
    (("x", "abort", "r"), ConfigError, "Link.send: no peer 'x'"),
])
def test_a_send_the_schema_or_the_peers_refuse_sends_nothing(pair, args, error, words):
    a, b = pair
    with pytest.raises(error) as e:
        a.send(*args)
    assert str(e.value) == words
    assert a.counters["sent"] == 0 and a.counters["dropped"] == 0
    assert b.receive(timeout=0.2) == []


def _raw(frames: list[bytes], address: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(address)
    for f in frames:
        s.send(f)
    s.close()
    ctx.term()


BAD = [
    b"\xc1",  # not msgpack
    msgpack.packb({"kind": "abort"}),  # not an array
    msgpack.packb([]),  # empty
    msgpack.packb([7, "r"]),  # the kind not a string
    msgpack.packb(["later", "r"]),  # an unknown kind
    msgpack.packb(["abort"]),  # too few items
    msgpack.packb(["abort", "r", "s"]),  # too many
    msgpack.packb(["abort", b"r"]),  # bytes for a str
    msgpack.packb(["first_token", "r", "5", 200]),  # a str for an int
    msgpack.packb(["first_token", "r", 5, True]),  # a bool for an int
    msgpack.packb(["first_token", "r", 5.0, 200]),  # a float for an int
    msgpack.packb(["first_token", "r", True, 200]),  # a bool for an int or nil
]


def test_every_malformed_message_is_counted_and_dropped_and_a_good_one_after_it_arrives():
    with Link(LOCAL) as b:
        _raw([*BAD, msgpack.packb(["abort", "ok"])], b.address)
        got = drain(b, 1)
        time.sleep(0.1)
        got += b.receive()
        assert got == [("abort", ["ok"])]
        assert b.counters == {"received": 1, "sent": 0, "bad_messages": len(BAD), "dropped": 0}


def test_bytes_and_maps_of_a_callers_kinds_arrive_as_sent_and_maps_with_other_keys_are_refused():
    """Bytes stay bytes (msgpack's bin type, not a string), and a map's keys must be strings
    (msgpack's strict map keys: a peer cannot make the receiver hash arbitrary objects)."""
    schemas = {"blob": (("data", (bytes,)),), "meta": (("m", (dict,)),)}
    with Link(LOCAL, schemas) as a, Link(LOCAL, schemas) as b:
        a.connect("b", b.address)
        assert a.send("b", "blob", b"\x00\xff") and a.send("b", "meta", {"k": 1})
        assert drain(b, 2) == [("blob", [b"\x00\xff"]), ("meta", [{"k": 1}])]
        _raw([msgpack.packb(["meta", {1: 2}]), msgpack.packb(["meta", {"ok": 2}])], b.address)
        assert drain(b, 1) == [("meta", [{"ok": 2}])] and b.counters["bad_messages"] == 1


def test_a_bool_is_taken_only_where_the_schema_names_bool():
    schemas = {"flag": (("on", (bool,)),), "count": (("n", (int,)),)}
    with Link(LOCAL, schemas) as b:
        _raw([msgpack.packb(["flag", True]), msgpack.packb(["count", False]), msgpack.packb(["count", 3])], b.address)
        assert drain(b, 2) == [("flag", [True]), ("count", [3])]
        assert b.counters["bad_messages"] == 1


def test_sends_past_the_queue_of_a_peer_nobody_listens_for_are_dropped_at_once_and_counted():
    with Link(LOCAL, hwm=1) as a:
        a.connect("gone", "tcp://127.0.0.1:9")  # the discard port: nothing accepts
        t = time.monotonic()
        sent = [a.send("gone", "abort", f"r{i}") for i in range(20)]
        assert time.monotonic() - t < 1.0  # never blocked
        assert sent[0] is True and sent[-1] is False  # queued up to hwm, then dropped
        assert a.counters == {"received": 0, "sent": sent.count(True), "bad_messages": 0, "dropped": sent.count(False)}


def test_receive_waits_only_for_the_first_message_and_takes_at_most_limit(pair):
    a, b = pair
    t = time.monotonic()
    assert b.receive(timeout=0.3) == []
    assert 0.25 <= time.monotonic() - t < 2.0
    t = time.monotonic()
    assert b.receive() == [] and time.monotonic() - t < 0.1  # no timeout: no wait
    a.send("b", "abort", "first")
    t = time.monotonic()
    assert b.receive(timeout=10.0) == [("abort", ["first"])] and time.monotonic() - t < 2.0
    for i in range(6):
        a.send("b", "abort", f"s{i}")
    time.sleep(0.3)
    assert [m[1][0] for m in b.receive(limit=2)] == ["s0", "s1"]
    assert [m[1][0] for m in b.receive(limit=10)] == ["s2", "s3", "s4", "s5"]


@pytest.mark.parametrize("kwargs, words", [
    ({"address": "http://127.0.0.1:1"}, "Link: address must be a tcp://, ipc:// or inproc:// address, got "
                                        "'http://127.0.0.1:1'"),
    ({"address": 5}, "Link: address must be a tcp://, ipc:// or inproc:// address, got 5"),
    ({"address": LOCAL, "schemas": [("abort", ())]}, "Link: schemas must map message kinds to their schemas, got "
                                                     "[('abort', ())]"),
    ({"address": LOCAL, "hwm": 0}, "Link: hwm"),
    ({"address": LOCAL, "hwm": (1 << 20) + 1}, "Link: hwm"),
])
def test_a_link_refuses_a_bad_configuration_by_name(kwargs, words):
    with pytest.raises(ConfigError) as e:
        Link(**kwargs)
    assert str(e.value).startswith(words)


def test_ipc_and_inproc_addresses_are_taken(tmp_path):
    with Link(f"ipc://{tmp_path}/mailbox") as a, Link("inproc://mailbox") as b:
        assert a.address == f"ipc://{tmp_path}/mailbox" and b.address == "inproc://mailbox"


def test_the_bounds_of_hwm_are_taken():
    for hwm in (1, 1 << 20):
        Link(LOCAL, hwm=hwm).close()


def test_an_address_in_use_is_refused_and_the_failed_link_holds_nothing():
    with Link(LOCAL) as a:
        with pytest.raises(ConfigError, match=r"Link: cannot listen on 'tcp://127\.0\.0\.1:\d+'"):
            Link(a.address)


def test_a_peer_is_connected_once_and_a_bad_peer_address_is_refused(pair):
    a, b = pair
    with pytest.raises(ConfigError, match="Link: peer 'b' is connected already"):
        a.connect("b", b.address)
    with pytest.raises(ConfigError, match=r"Link: cannot connect to 'c' at 'tcp://no host' \("):
        a.connect("c", "tcp://no host")
    with pytest.raises(ConfigError, match="no peer 'c'"):
        a.send("c", "abort", "r")


def test_close_ends_every_socket_and_the_context():
    a = Link(LOCAL)
    a.connect("x", "tcp://127.0.0.1:9")
    ctx = a._ctx
    a.close()
    assert ctx.closed and not a._peers

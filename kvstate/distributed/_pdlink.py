"""Messages between scheduler processes: P's first token to D, aborts, and what a router says.

Each scheduler (and a router) has a :class:`Link`: one PULL socket it binds (its mailbox) and
one PUSH socket per peer it sends to. A message is a msgpack array: its kind, then the items
its schema names (:data:`SCHEMAS`, extended by the caller for its own kinds). The link

- checks every message it receives against its kind's schema: a message that does not parse,
  names an unknown kind or has items of the wrong type is counted (``bad_messages``) and
  dropped, never applied and never a crash;
- never blocks a sender: a send to a peer whose queue is full (a peer that died, a peer far
  behind) is dropped and counted (``dropped``), so P goes on serving when D is gone;
- closes without lingering: what was not delivered when the process ends is not waited for.

The P/D kinds: ``first_token`` (request id, token or nil, error code: P's first token, 200,
or the error that ends the request at D) and ``abort`` (request id: a side gave the request
up; the other ends its part, late if it already has).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import zmq

from .._errors import ConfigError, KVStateError, ProtocolError
from .._validate import check_int
from . import _wire as wire

__all__ = ["Link", "SCHEMAS", "Schema"]

#: a kind's items: (name, the types it may have) each
Schema = tuple[tuple[str, tuple[type, ...]], ...]

_RID = ("request_id", (str,))
SCHEMAS: dict[str, Schema] = {
    "first_token": (_RID, ("token", (int, type(None))), ("error_code", (int,))),
    "abort": (_RID,),
}


class Link:
    """This process's mailbox (bound at ``address``) and its sends to named peers."""

    def __init__(self, address: str, schemas: Mapping[str, Schema] | None = None, hwm: int = 10_000) -> None:
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"Link: address must be a tcp://, ipc:// or inproc:// address, got {address!r}")
        if schemas is not None and not isinstance(schemas, Mapping):
            raise ConfigError(f"Link: schemas must map message kinds to their schemas, got {schemas!r}")
        check_int(hwm, "Link: hwm", minimum=1, maximum=1 << 20, error=ConfigError)
        self.schemas = dict(SCHEMAS)
        self.schemas.update(schemas or {})
        self.counters = {"received": 0, "sent": 0, "bad_messages": 0, "dropped": 0}
        self._ctx = zmq.Context()
        self._peers: dict[str, zmq.Socket] = {}
        self._hwm = hwm
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, hwm)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        try:
            self._inbox.bind(address)
        except zmq.ZMQError as e:
            self.close()
            raise ConfigError(f"Link: cannot listen on {address!r} ({e})") from None
        self.address = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, peer: str, address: str) -> None:
        """Name a peer's mailbox; sends to ``peer`` go there."""
        if peer in self._peers:
            raise ConfigError(f"Link: peer {peer!r} is connected already")
        s = self._ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self._hwm)
        try:
            s.connect(address)
        except zmq.ZMQError as e:
            s.close()
            raise ConfigError(f"Link: cannot connect to {peer!r} at {address!r} ({e})") from None
        self._peers[peer] = s

    def send(self, peer: str, kind: str, *items: Any) -> bool:
        """Send a ``kind`` message to ``peer`` without blocking; False (counted) when dropped."""
        schema = self.schemas.get(kind)
        if schema is None or len(items) != len(schema):
            raise ProtocolError(f"Link.send: {kind!r} takes {[n for n, _ in schema or ()]}")
        try:
            self._peers[peer].send(msgpack.packb([kind, *items], use_bin_type=True), zmq.NOBLOCK)
        except KeyError:
            raise ConfigError(f"Link.send: no peer {peer!r}") from None
        except zmq.ZMQError:
            self.counters["dropped"] += 1
            return False
        self.counters["sent"] += 1
        return True

    def receive(self, timeout: float = 0.0, limit: int = 1024) -> list[tuple[str, list[Any]]]:
        """Messages waiting now, as (kind, items), waiting up to ``timeout`` s for the first."""
        out: list[tuple[str, list[Any]]] = []
        if timeout > 0 and not self._inbox.poll(int(1000 * timeout)):
            return out
        for _ in range(limit):
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                out.append(self._check(data))
                self.counters["received"] += 1
            except KVStateError:
                self.counters["bad_messages"] += 1
        return out

    def _check(self, data: bytes) -> tuple[str, list[Any]]:
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types on bad input
            raise ProtocolError(f"a message did not parse ({type(e).__name__})") from None
        if not isinstance(msg, list) or not msg or not isinstance(msg[0], str) or msg[0] not in self.schemas:
            raise ProtocolError("a message must be an array opening with a known kind")
        kind, items, schema = msg[0], msg[1:], self.schemas[msg[0]]
        if len(items) != len(schema):
            raise ProtocolError(f"a {kind!r} message has {len(items)} items, not {len(schema)}")
        for (name, types), v in zip(schema, items):
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                raise ProtocolError(f"a {kind!r} message's {name} has type {type(v).__name__}")
        return kind, items

    def close(self) -> None:
        for s in [self._inbox, *self._peers.values()]:
            s.close(linger=0)
        self._peers.clear()
        self._ctx.term()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The wire format between a scheduler's driver and its rank workers: msgpack lists, checked.

Every message is one msgpack array whose first item is its type. A driver sends each rank
its part of a transfer command; a rank worker answers each with one ``DONE``. A command's block
ids and group tables hold ``FREED`` (-1) where a window group's block was freed, and only
before its window's first key (:mod:`kvstate._tables`):

========== =========================================================== ==================
type        items after the type                                        direction
========== =========================================================== ==================
``CMD``     incarnation, kind, command id, request id, keys, block ids, driver -> worker
            host slots, deadline, fence, window's first key,
            states (end, page, end, page, ...), the other
            group tables' block ids (a list each)
``CANCEL``  incarnation, command id                                     driver -> worker
``LAYERS``  incarnation, command id, layers computed                    driver -> worker
``ARM``     incarnation, request id, keys, block ids, deadline          driver -> worker
``DISARM``  incarnation, keys                                           driver -> worker
``WELCOME`` incarnation (the worker's hello was accepted)               driver -> worker
``REJOIN``  incarnation declared dead (say hello again, as a new one)   driver -> worker
``REFUSE``  incarnation, reason (that hello's configuration differs: exit) driver -> worker
``STOP``    (none)                                                      driver -> worker
``HELLO``   rank, incarnation, pid, TP size, geometry, lanes, secret    worker -> driver
``HB``      rank, incarnation, bytes moved, counts so far               worker -> driver
            (:data:`WORKER_COUNTS`)
``DONE``    rank, incarnation, command id, count, error or nil          worker -> driver
``ARRIVED`` rank, incarnation, command id, layers scattered             worker -> driver
``BYE``     rank, incarnation, reason                                   worker -> driver
========== =========================================================== ==================

A worker has lanes (threads, each with its own command socket, named ``r{rank}:{lane}``); a
command goes to one lane, and its ``CANCEL`` and ``LAYERS`` follow it there. ``ARM`` and
``DISARM`` (a read prepared at reservation, :class:`~kvstate.commands.ArmRead`, and its letting
go) go to lane 0: they answer nothing, and a read they miss runs unprepared.

An incarnation is a random 63-bit number a worker draws each time it says hello: a message
naming another than the rank's current one comes from a process declared dead or replaced.
Times (deadline, fence) are absolute ``time.monotonic()`` seconds: one clock per host, which
the scheduler and its rank workers share.

Decoding checks every item's type and range and raises :class:`~kvstate._errors.ProtocolError`
on anything else, so a receiver refuses (and counts) a bad message without applying any of it.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, NamedTuple

import msgpack

from .. import commands as C
from .._errors import ProtocolError
from .._pool import FREED
from .._spec import CacheSpec

__all__ = [
    "CMD", "CANCEL", "LAYERS", "ARM", "DISARM", "WELCOME", "REJOIN", "REFUSE", "STOP",
    "HELLO", "HB", "DONE", "ARRIVED", "BYE",
    "KINDS", "MAX_MESSAGE_BYTES", "new_incarnation", "pack", "unpack", "command_message", "command_of",
    "arm_message", "arm_of", "disarm_message", "disarm_of",
    "Done", "Hello", "Arrived", "Beat", "Bye", "from_worker", "geometry", "STORE_FAULTS", "WORKER_COUNTS",
]

CMD, CANCEL, LAYERS, WELCOME, REJOIN, REFUSE, STOP, ARM, DISARM = 1, 2, 3, 4, 5, 6, 7, 8, 9
HELLO, HB, DONE, ARRIVED, BYE = 11, 12, 13, 14, 15

#: transfer command classes by their wire code
KINDS: dict[int, type[C.TransferCommand]] = {1: C.ReadBlocks, 2: C.LoadLayers, 3: C.WriteBlocks, 4: C.SaveLayers,
                                             5: C.SwapOut, 6: C.SwapIn, 7: C.FlushHost, 8: C.LendBlocks}
_CODES = {cls: code for code, cls in KINDS.items()}
_LEND_STORES = 9  # a LendBlocks whose P writes the store too
_SLOTTED = (C.SwapOut, C.SwapIn, C.FlushHost)
MAX_MESSAGE_BYTES = 64 << 20  #: larger messages are refused by the sockets themselves
_MAX_ITEMS = 1 << 20  # keys or blocks in one command
_MAX_TEXT = 4096  # a request id, a key, an error or a reason
_INT64 = 1 << 63


def new_incarnation() -> int:
    """A fresh incarnation number (never 0, which means "none")."""
    return random.SystemRandom().randrange(1, _INT64)


def pack(*items: Any) -> bytes:
    return msgpack.packb(items, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    """A message's items, or ProtocolError when it is not a msgpack array opening with an int type."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("a message must be bytes of at most 64 MiB")
    try:
        items = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types on bad input
        raise ProtocolError(f"a message did not parse as msgpack ({type(e).__name__})") from None
    if not isinstance(items, list) or not items or not _is_int(items[0]):
        raise ProtocolError("a message must be an array opening with its type")
    return items


def _is_int(x: Any) -> bool:
    return x.__class__ is int


def _int(x: Any, what: str, low: int = 0, high: int = _INT64) -> int:
    if not _is_int(x) or not low <= x < high:
        raise ProtocolError(f"{what} must be an int in [{low}, {high}), got {x!r}"[:200])
    return int(x)


def _text(x: Any, what: str, empty: bool = False) -> str:
    if not isinstance(x, str) or len(x) > _MAX_TEXT or (not x and not empty):
        raise ProtocolError(f"{what} must be a {'' if empty else 'non-empty '}str of at most {_MAX_TEXT} chars")
    return x


def _time(x: Any, what: str) -> float:
    if x.__class__ not in (int, float) or math.isnan(x):
        raise ProtocolError(f"{what} must be a number of seconds, got {x!r}"[:200])
    return float(x)


def _ints(x: Any, what: str, freed_before: int = 0) -> tuple[int, ...]:
    """Ints >= 0; block ids and group tables may hold ``FREED`` (a block freed behind the
    window, :mod:`kvstate._tables`) at their first ``freed_before`` places, which no rank moves."""
    if isinstance(x, list) and len(x) <= _MAX_ITEMS and (
            all(_is_int(i) and 0 <= i < _INT64 for i in x) or (freed_before and all(
                _is_int(i) and (0 <= i < _INT64 or (i == FREED and n < freed_before)) for n, i in enumerate(x)))):
        return tuple(x)
    freed = f" ({FREED}, freed, only before the window's first key {freed_before})" if freed_before else ""
    raise ProtocolError(f"{what} must be a list of ints >= 0{freed}")


def _arity(items: list[Any], n: int, name: str) -> None:
    if len(items) != n:
        raise ProtocolError(f"a {name} message has {n - 1} items after its type, got {len(items) - 1}")


# -- driver -> worker ------------------------------------------------------------------------------
def command_message(cmd: C.TransferCommand, incarnation: int) -> bytes:
    """One rank's part of ``cmd`` (the rank is the worker's own)."""
    slots = list(cmd.host_slots) if isinstance(cmd, _SLOTTED) else []
    window = cmd.window_from if isinstance(cmd, (C.ReadBlocks, C.WriteBlocks)) else 0
    states = [x for pair in cmd.states for x in pair]
    code = _LEND_STORES if cmd.__class__ is C.LendBlocks and cmd.stores else _CODES[cmd.__class__]
    return pack(CMD, incarnation, code, cmd.command_id, cmd.request_id, list(cmd.keys),
                list(cmd.block_ids), slots, cmd.deadline, cmd.fence, window, states, [list(t) for t in cmd.tables])


def command_of(items: list[Any], rank: int) -> C.TransferCommand:
    """The command a ``CMD`` message carries, for ``rank`` alone."""
    _arity(items, 13, "CMD")
    code = _int(items[2], "the command kind", 1, _LEND_STORES + 1)
    cls = KINDS[min(code, 8)]
    cid = _int(items[3], "the command id", 1)
    rid = _text(items[4], "the request id")
    keys = items[5]
    if not isinstance(keys, list) or len(keys) > _MAX_ITEMS:
        raise ProtocolError(f"command {cid}: keys must be a list")
    for k in keys:
        _text(k, f"command {cid}: a key")
    window = _int(items[10], f"command {cid}: the window's first key", 0, len(keys) + 1)
    blocks = _ints(items[6], f"command {cid}: block ids", window)
    slots = _ints(items[7], f"command {cid}: host slots")
    deadline, fence = _time(items[8], f"command {cid}: the deadline"), _time(items[9], f"command {cid}: the fence")
    want_blocks = 0 if cls is C.FlushHost else len(keys)
    if len(blocks) != want_blocks or (cls in _SLOTTED and len(slots) != len(keys)) or \
            (cls not in _SLOTTED and slots):
        raise ProtocolError(f"command {cid}: {len(keys)} keys, {len(blocks)} block ids and {len(slots)} host slots "
                            f"do not fit a {cls.__name__}")
    if cls in _SLOTTED:
        if window:
            raise ProtocolError(f"command {cid}: a {cls.__name__} has no window to start from")
        extra: dict[str, Any] = {"host_slots": slots}
    elif cls is C.LendBlocks:
        if window:
            raise ProtocolError(f"command {cid}: a LendBlocks has no window to start from")
        extra = {"stores": code == _LEND_STORES}
    else:  # every other kind reads or writes (layer-wise ones too): it starts from its window
        extra = {"window_from": window}
    states = _states(items[11], cid, len(keys))
    return cls(rid, cid, (rank,), deadline, tuple(keys), blocks, fence=fence, states=states,
               tables=_tables(items[12], cid, len(blocks), window), **extra)


def arm_message(cmd: C.ArmRead, incarnation: int) -> bytes:
    """One rank's ``ARM`` for the read ``cmd`` announces."""
    return pack(ARM, incarnation, cmd.request_id, list(cmd.keys), list(cmd.block_ids), cmd.deadline)


def arm_of(items: list[Any], rank: int) -> C.ArmRead:
    """The announced read an ``ARM`` message carries, for ``rank`` alone: as many block ids
    (none freed) as keys, at least one."""
    _arity(items, 6, "ARM")
    rid = _text(items[2], "the request id")
    keys = _keys(items[3], f"ARM of request {rid!r}")
    blocks = _ints(items[4], f"ARM of request {rid!r}: block ids")
    if not keys or len(blocks) != len(keys):
        raise ProtocolError(f"ARM of request {rid!r}: {len(keys)} keys and {len(blocks)} block ids do not fit a read")
    return C.ArmRead(rid, (rank,), _time(items[5], f"ARM of request {rid!r}: the deadline"), keys, blocks)


def disarm_message(keys: tuple[str, ...], incarnation: int) -> bytes:
    """One rank's ``DISARM`` of the read armed for ``keys``."""
    return pack(DISARM, incarnation, list(keys))


def disarm_of(items: list[Any]) -> tuple[str, ...]:
    """The keys a ``DISARM`` message lets go of."""
    _arity(items, 3, "DISARM")
    return _keys(items[2], "DISARM")


def _keys(x: Any, what: str) -> tuple[str, ...]:
    if not isinstance(x, list) or len(x) > _MAX_ITEMS:
        raise ProtocolError(f"{what}: keys must be a list")
    return tuple(_text(k, f"{what}: a key") for k in x)


def _tables(x: Any, cid: int, blocks: int, window: int) -> tuple[tuple[int, ...], ...]:
    """A command's other group tables (:mod:`kvstate._tables`): lists of block ids, each as long
    as its block ids."""
    if not isinstance(x, list) or len(x) > _MAX_ITEMS:
        raise ProtocolError(f"command {cid}: group tables must be a list of lists")
    tables = tuple(_ints(t, f"command {cid}: a group table", window) for t in x)
    if any(len(t) != blocks for t in tables):
        raise ProtocolError(f"command {cid}: each group table must hold {blocks} block ids")
    return tables


def _states(x: Any, cid: int, keys: int) -> tuple[tuple[int, int], ...]:
    """A command's states (:mod:`kvstate._statepages`): pairs of the blocks a state follows (1 to
    the command's keys, increasing) and the state page holding it."""
    flat = _ints(x, f"command {cid}: states")
    pairs = tuple(zip(flat[::2], flat[1::2]))
    ends = [end for end, _ in pairs]
    if len(flat) % 2 or any(not 1 <= e <= keys for e in ends) or ends != sorted(set(ends)):
        raise ProtocolError(f"command {cid}: states must be (end, page) pairs with ends increasing in 1..{keys}")
    return pairs


# -- worker -> driver ------------------------------------------------------------------------------
class Hello(NamedTuple):
    rank: int
    incarnation: int
    pid: int
    tp_size: int
    geometry: str
    lanes: int
    secret: str  #: the start's secret (ProcessDriver.secret): a hello without it is not a worker's


#: the store faults a worker counts, in the order its heartbeat carries them: blocks a read found
#: broken (a checksum or size mismatch: evicted), reads that stopped short of their keys (a key
#: missing), and operations that failed outright (an error answer)
STORE_FAULTS = ("broken", "short", "failed")
#: what a heartbeat counts: the store faults, then the reads its backend armed ahead and those
#: fired (:mod:`kvstate.backends._arming`)
WORKER_COUNTS = (*STORE_FAULTS, "armed", "fired")


class Beat(NamedTuple):
    rank: int
    incarnation: int
    bytes_moved: int  #: payload bytes the worker's backend moved to and from the store so far
    counts: tuple[int, ...]  #: its :data:`WORKER_COUNTS` so far


class Done(NamedTuple):
    rank: int
    incarnation: int
    command_id: int
    leading: int  #: the completion's count: leading blocks done
    error: str | None


class Arrived(NamedTuple):
    rank: int
    incarnation: int
    command_id: int
    layers: int


class Bye(NamedTuple):
    rank: int
    incarnation: int
    reason: str


def from_worker(data: bytes) -> Hello | Beat | Done | Arrived | Bye:
    """A worker's message, checked item by item (ranks are checked against the TP size by the
    driver, which knows it)."""
    items = unpack(data)
    kind = items[0]
    if kind == HB:
        _arity(items, 5, "HB")
        counts = items[4]
        if not isinstance(counts, list) or len(counts) != len(WORKER_COUNTS):
            raise ProtocolError(f"a heartbeat's counts must be {len(WORKER_COUNTS)}: {', '.join(WORKER_COUNTS)}")
        return Beat(_int(items[1], "the rank"), _int(items[2], "the incarnation", 1), _int(items[3], "the bytes"),
                    tuple(_int(f, "a count") for f in counts))
    if kind == DONE:
        _arity(items, 6, "DONE")
        error = None if items[5] is None else _text(items[5], "the error", empty=True)
        return Done(_int(items[1], "the rank"), _int(items[2], "the incarnation", 1),
                    _int(items[3], "the command id", 1), _int(items[4], "the count"), error)
    if kind == ARRIVED:
        _arity(items, 5, "ARRIVED")
        return Arrived(_int(items[1], "the rank"), _int(items[2], "the incarnation", 1),
                       _int(items[3], "the command id", 1), _int(items[4], "the layers", 1))
    if kind == HELLO:
        _arity(items, 8, "HELLO")
        return Hello(_int(items[1], "the rank"), _int(items[2], "the incarnation", 1), _int(items[3], "the pid", 1),
                     _int(items[4], "the TP size", 1), _text(items[5], "the geometry"), _int(items[6], "lanes", 1, 257),
                     _text(items[7], "the secret", empty=True))
    if kind == BYE:
        _arity(items, 4, "BYE")
        return Bye(_int(items[1], "the rank"), _int(items[2], "the incarnation", 1),
                   _text(items[3], "the reason", empty=True))
    raise ProtocolError(f"unknown message type {kind!r} from a worker")


def geometry(spec: CacheSpec, num_blocks: int, num_states: int = 0) -> str:
    """What a scheduler and its rank workers must agree on, as one string: every field of the
    cache spec, the blocks per rank and the state pages per rank."""
    fields = "|".join(f"{f.name}={getattr(spec, f.name)}" for f in dataclasses.fields(spec))
    return f"{fields}|blocks={num_blocks}|states={num_states}"

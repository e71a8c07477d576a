"""Direct handoff on one host: P lends its GPU blocks, D pulls them straight into its own.

P's and D's processes share a *lend board*, a directory (on tmpfs by default) where each P
rank posts the blocks a request's cache sits in, and each D rank takes them. An entry is
one file a (lend, rank), and its name says its state, so every step is one atomic
``rename``:

- P **posts** ``NAME.lend``: written under a temporary name first, then renamed, so a reader
  never sees half an entry. It holds P's pid, the geometry, the request's keys, P's block
  ids, one checksum per block (taken on P's side before posting), and what D needs to reach
  P's caches (``peer``: CUDA IPC handles, or a key into this process's backends).
- D **takes** it (``NAME.lend`` → ``NAME.taken``): at most one D rank wins; a loser, or a D
  that finds nothing within its ``wait``, reads the store instead.
- D **releases** it (``NAME.taken`` → ``NAME.done`` if every block arrived and matched its
  checksum, else ``NAME.fail``) once its copy ended.
- P **withdraws** an entry nobody took by the lend's deadline (``NAME.lend`` → removed);
  an entry taken already stays lent until D releases it or P's fence passes, since D's
  copy may be reading the blocks. P then removes every file of the lend.

Entries are named by P's pid, a hash of the request's last key, a sequence number and the
rank; D takes only an entry whose keys end with its own (a D with a prefix of its own reads
the rest). Entries of a P that died are skipped by D and swept by the next board opened on
the directory. Everything read from the board is checked before it is used: a malformed
entry is a :class:`~kvstate._errors.ProtocolError` naming the rule, the entry is marked
failed, and D reads the store. A lend without a fence (a command run without the
lifecycle's clock) waits for a D that took it at most ``UNFENCED_HOLD`` seconds past its
deadline: a D that died holding it never releases it.

How bytes move and are checked is the backend's (:class:`PeerOps`); this module is the
protocol: :func:`lend_blocks` for P's rank, :func:`pull_blocks` for D's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .._errors import ConfigError, KVStateError, ProtocolError
from .._validate import check_int, is_int
from ._hostfiles import pid_alive, remove_orphans

__all__ = ["LendBoard", "Lend", "PeerOps", "lend_blocks", "pull_blocks", "fold_sums", "fold_rows", "local_peer",
           "FORMAT", "VERSION"]

FORMAT, VERSION = "kvstate-lend", 1
_STATES = ("lend", "taken", "done", "fail")
_PREFIX = "lend-"  # an entry is lend-PID-TAG-SEQ.rRANK.STATE: the pid where remove_orphans looks
_MAX_ENTRY = 64 << 20  # bytes of one entry file at most
_POLL = (0.0002, 0.002)  # first and longest sleep between looks at the board, seconds
UNFENCED_HOLD = 30.0  #: seconds an unfenced lend waits past its deadline for a D that took it


_LOCAL: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # backends lending in-process
_LOCAL_IDS = itertools.count(1)


_FOLD_BASIS, _FOLD_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fold_sums(sums: Sequence[int]) -> int:
    """One 64-bit checksum of a block from its objects' checksums, in their order."""
    h = _FOLD_BASIS
    for x in sums:
        h = ((h ^ int(x)) * _FOLD_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def fold_rows(rows: Any) -> list[int]:
    """:func:`fold_sums` of each row of a ``[blocks, objects]`` array of checksums, at once."""
    a = np.asarray(rows, dtype=np.uint64)
    h = np.full(a.shape[0], _FOLD_BASIS, dtype=np.uint64)
    for j in range(a.shape[1] if a.ndim == 2 else 0):
        h = (h ^ a[:, j]) * np.uint64(_FOLD_PRIME)  # uint64 arithmetic wraps modulo 2**64
    return [int(x) for x in h]


def local_peer(backend: Any, token: int | None = None) -> Any:
    """A backend that lends within this process (the reference backend's caches live in its
    memory): registers ``backend`` and answers its token, or, given a ``token``, answers the
    backend registered under it (a :class:`~kvstate._errors.ProtocolError` if none is)."""
    if token is None:
        token = next(_LOCAL_IDS)
        _LOCAL[token] = backend
        return token
    peer = _LOCAL.get(token) if is_int(token) else None
    if peer is None:
        raise ProtocolError(f"no backend of this process lends under token {token!r}")
    return peer


class PeerOps(Protocol):
    """What a backend gives the lend protocol: its geometry, its side of the bytes."""

    def lend_geometry(self) -> str:
        """A string equal on P and D exactly when one's blocks fit the other's."""

    def lend_peer(self, rank: int) -> dict[str, Any]:
        """What another process needs to reach ``rank``'s caches (JSON)."""

    def lend_sums(self, rank: int, block_ids: Sequence[int]) -> list[int]:
        """One checksum per block of ``rank``'s caches, as :meth:`pull_copy` computes them."""

    def pull_copy(self, rank: int, peer: dict[str, Any], src_ids: Sequence[int], dst_ids: Sequence[int],
                  guard: Callable[[], bool] | None) -> list[int]:
        """Copy the peer's blocks ``src_ids`` into ``rank``'s ``dst_ids``; the checksums of
        the copies, once they landed."""


@dataclass(frozen=True)
class Lend:
    """One rank's entry, as D took it (checked)."""

    path: Path
    pid: int
    rank: int
    geometry: str
    keys: tuple[str, ...]
    blocks: tuple[int, ...]
    sums: tuple[int, ...]
    peer: dict[str, Any]
    stores: bool  #: P writes the blocks to the store too


class LendBoard:
    """The lend board in directory ``root`` (created, mode 0700, if missing). ``wait`` is
    how long D looks for an entry before it reads the store instead. P posts once its
    checksums are taken, within a millisecond of its first token on a warm GPU; the first
    lend of a CUDA process compiles the checksum kernel, which takes seconds. A D whose P
    lends without storing (``handoff="direct"``) has nothing else to read: give it a
    ``wait`` that covers P's slowest post."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, wait: float = 0.05) -> None:
        if root is None:
            tmp = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
            root = tmp / f"kvstate-lends-{os.getuid()}"
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"LendBoard: root must be a directory path, got {root!r}")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 3600:
            raise ConfigError(f"LendBoard: wait must be seconds in [0, 3600), got {wait!r}")
        self.root, self.wait = Path(root), float(wait)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"LendBoard: cannot create {self.root}: {e}") from None
        if not self.root.is_dir() or not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"LendBoard: {self.root} is not a directory this process can write")
        self._seq = itertools.count(1)
        self.sweep()

    @staticmethod
    def _tag(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def post(self, rank: int, geometry: str, keys: Sequence[str], blocks: Sequence[int], sums: Sequence[int],
             peer: dict[str, Any], stores: bool = False) -> Path:
        """P: post ``rank``'s entry; its path without the state suffix (the lend's name)."""
        if not keys or len(keys) != len(blocks) or len(sums) != len(blocks):
            raise ProtocolError(f"a lend needs as many keys, blocks and checksums, got {len(keys)}, {len(blocks)}, "
                                f"{len(sums)}")
        name = self.root / f"{_PREFIX}{os.getpid()}-{self._tag(keys[-1])}-{next(self._seq)}.r{rank}"
        body = json.dumps({"format": FORMAT, "version": VERSION, "pid": os.getpid(), "rank": rank,
                           "geometry": geometry, "keys": list(keys), "blocks": list(blocks), "sums": list(sums),
                           "peer": peer, "stores": bool(stores)}).encode()
        tmp = _at(name, "tmp")
        tmp.write_bytes(body)
        os.rename(tmp, _at(name, "lend"))
        return name

    def state(self, name: Path) -> str | None:
        """``lend``, ``taken``, ``done``, ``fail``, or None when no file of it is there."""
        return next((s for s in _STATES if os.path.exists(_at(name, s))), None)

    def withdraw(self, name: Path) -> bool:
        """P: remove an entry nobody took; False when D holds it (or it is gone)."""
        try:
            os.unlink(_at(name, "lend"))
            return True
        except FileNotFoundError:
            return False

    def remove(self, name: Path) -> None:
        """P: every file of the lend, whatever its state."""
        for s in (*_STATES, "tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_at(name, s))

    def take(self, rank: int, keys: Sequence[str], until: Callable[[], bool]) -> Lend | None:
        """D: take a live entry of ``rank`` whose keys end with ``keys``, looking for up to
        ``wait`` seconds (while ``until()``); None when there is none. A malformed entry is
        marked failed and raises :class:`~kvstate._errors.ProtocolError`."""
        end = time.monotonic() + self.wait
        pause = _POLL[0]
        while True:
            tag, tail = f"-{self._tag(keys[-1])}-", f".r{rank}.lend"
            for entry in os.scandir(self.root):
                if entry.name.startswith(_PREFIX) and tag in entry.name and entry.name.endswith(tail):
                    lend = self._try_take(self.root / entry.name[:-5], rank, keys)
                    if lend is not None:
                        return lend
            if time.monotonic() >= end or not until():
                return None
            time.sleep(pause)
            pause = min(2 * pause, _POLL[1])

    def _try_take(self, name: Path, rank: int, keys: Sequence[str]) -> Lend | None:
        """The entry ``name`` if it is live, lends ``keys`` and this call took it first. A
        posted entry never changes, so it is read before it is taken."""
        if not pid_alive(_pid_of(name)):
            return None
        try:
            raw = _at(name, "lend").read_bytes()
        except FileNotFoundError:
            return None  # taken or withdrawn meanwhile
        try:
            lend = _checked(raw, _at(name, "taken"), rank)
        except ProtocolError:
            with contextlib.suppress(FileNotFoundError):
                os.rename(_at(name, "lend"), _at(name, "fail"))
            raise
        n = len(keys)
        if len(lend.keys) < n or lend.keys[len(lend.keys) - n:] != tuple(keys):
            return None  # another prompt whose last block hashes alike
        try:
            os.rename(_at(name, "lend"), _at(name, "taken"))
        except FileNotFoundError:
            return None
        off = len(lend.keys) - n
        return dataclasses.replace(lend, keys=tuple(keys), blocks=lend.blocks[off:], sums=lend.sums[off:])

    def release(self, name: Path, whole: bool) -> None:
        """D: its copy ended (``whole``: every block arrived and matched)."""
        with contextlib.suppress(FileNotFoundError):
            os.rename(_at(name, "taken"), _at(name, "done" if whole else "fail"))

    def sweep(self) -> int:
        """Remove the files of lends whose P process is gone; how many."""
        return remove_orphans(self.root, _PREFIX)


def _at(name: Path, state: str) -> Path:
    return name.with_name(f"{name.name}.{state}")


def _pid_of(name: Path) -> int:
    """The pid in an entry's name (``lend-PID-...``, as :func:`remove_orphans` reads it)."""
    pid = name.name[len(_PREFIX):].split("-", 1)[0] if name.name.startswith(_PREFIX) else ""
    return int(pid) if pid.isdigit() else 0


def _checked(raw: bytes, path: Path, rank: int) -> Lend:
    """An entry read from the board, every field checked against the rules above."""
    def bad(rule: str) -> ProtocolError:
        return ProtocolError(f"lend entry {path.name}: {rule}")
    try:
        d = json.loads(raw) if len(raw) <= _MAX_ENTRY else None
    except ValueError:
        d = None
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
        raise bad(f"not a {FORMAT} version {VERSION} entry")
    lk, blocks, sums, peer = d.get("keys"), d.get("blocks"), d.get("sums"), d.get("peer")
    if not isinstance(lk, list) or not all(k.__class__ is str for k in lk) or \
            not isinstance(blocks, list) or not all(b.__class__ is int for b in blocks) or \
            not isinstance(sums, list) or not all(x.__class__ is int for x in sums) or \
            (blocks and min(blocks) < 0) or (sums and not 0 <= min(sums) <= max(sums) < 1 << 64):
        raise bad("keys must be strings, blocks ints >= 0 and checksums 64-bit ints")
    if not len(lk) == len(blocks) == len(sums) or not lk:
        raise bad(f"{len(lk)} keys, {len(blocks)} blocks and {len(sums)} checksums")
    if d.get("rank") != rank or not is_int(d.get("pid")) or not isinstance(d.get("geometry"), str) or \
            not isinstance(peer, dict) or not isinstance(d.get("stores"), bool):
        raise bad(f"rank must be {rank}, with a pid, a geometry, a peer description and whether P stores")
    return Lend(path, d["pid"], rank, d["geometry"], tuple(lk), tuple(blocks), tuple(sums), peer, d["stores"])


def lend_blocks(board: LendBoard, ops: PeerOps, rank: int, keys: Sequence[str], block_ids: Sequence[int],
                until: Callable[[], bool], guard: Callable[[], bool] | None, stores: bool = False) -> int:
    """P's rank: post its blocks, hold them until D released the entry, or until the lend's
    deadline (``until()`` False) if nobody took it, or past it until the fence (``guard()``
    False) if D still copies; answers how many blocks D pulled whole (all or none)."""
    check_int(rank, "lend: rank", minimum=0)
    name = board.post(rank, ops.lend_geometry(), list(keys), list(block_ids), ops.lend_sums(rank, block_ids),
                      ops.lend_peer(rank), stores)
    if guard is None:  # no fence: bound the wait for a D that took the lend by the clock here
        hold_end: list[float] = []

        def guard() -> bool:
            hold_end[:] = hold_end or [time.monotonic() + UNFENCED_HOLD]
            return time.monotonic() < hold_end[0]
    try:
        state, pause = board.state(name), _POLL[0]
        while state in ("lend", "taken"):
            if not until() and (board.withdraw(name) or not guard()):
                return 0
            time.sleep(pause)
            pause = min(2 * pause, _POLL[1])
            state = board.state(name)
        return len(keys) if state == "done" else 0
    finally:
        board.remove(name)


def pull_blocks(board: LendBoard, ops: PeerOps, rank: int, keys: Sequence[str], block_ids: Sequence[int],
                until: Callable[[], bool], guard: Callable[[], bool] | None) -> int | None:
    """D's rank: pull ``keys`` into ``block_ids`` from a P that lent them; how many leading
    blocks arrived and matched P's checksums (-1 when not all did and P writes them to the
    store too: read them there), or None when no P lends them (read the store)."""
    try:
        lend = board.take(rank, keys, until)
    except ProtocolError:
        return 0
    if lend is None:
        return None
    whole = False
    try:
        if lend.geometry != ops.lend_geometry():
            raise ProtocolError(f"lend entry {lend.path.name}: geometry {lend.geometry!r}, this side's is "
                                f"{ops.lend_geometry()!r}")
        got = ops.pull_copy(rank, lend.peer, lend.blocks, block_ids, guard)
        n = next((i for i, (a, b) in enumerate(zip(got, lend.sums)) if a != b), len(keys))
        whole = n == len(keys)
        return n if whole or not lend.stores else -1
    except (KVStateError, OSError):
        return -1 if lend.stores else 0
    finally:
        board.release(lend.path.with_suffix(""), whole)

"""Direct handoff on one host: P lends its GPU blocks, D pulls them straight into its own.

P's and D's processes share a *lend board*, a directory (on tmpfs by default) where each P
rank posts the blocks a request's cache sits in, and each D rank takes them. An entry is
one file a (lend, rank), and its name says its state, so every step is one atomic
``rename``:

- P **posts** ``NAME.lend``: written under a temporary name first, then renamed, so a reader
  never sees half an entry. It holds P's pid, the geometry, the request's keys, P's block
  ids, one checksum per block (taken on P's side before posting), and what D needs to reach
  P's caches (``peer``: CUDA IPC handles, or a key into this process's backends). It is a
  line of JSON (the scalars, and the lengths of what follows), the keys as UTF-8 joined by
  ``KEY_SEP`` (which a key may not hold; ``keys_bytes`` long), the peer as JSON
  (``peer_bytes`` long), the block ids as little-endian int64 and the checksums as uint64.
  D's parse is on the path of every first token: it compares the keys as bytes with its own
  joined, reads a pull's thousand numbers as two arrays, not as a thousand JSON numbers, and
  parses a peer's bytes once (the same P rank posts the same description every time). A D
  that knows its keys ahead (an armed pull) joins and hashes them once (``prepare``), and an
  entry holding exactly those keys, which D checked, skips the scan of its separators.
- D **takes** it (``NAME.lend`` → ``NAME.taken``): at most one D rank wins; a loser, or a D
  that finds nothing within its ``wait``, reads the store instead. D takes first and reads
  what it took, so a name P lends under again later is never read for another lend; an entry
  whose keys are not D's, or whose P died, goes back (``NAME.taken`` → ``NAME.lend``).
- D **releases** it (``NAME.taken`` → ``NAME.done`` if every block arrived and matched its
  checksum, else ``NAME.fail``) once its copy ended.
- P **withdraws** an entry nobody took by the lend's deadline (``NAME.lend`` → removed);
  an entry taken already stays lent until D releases it or P's fence passes, since D's
  copy may be reading the blocks. P then removes every file of the lend; when its fence
  passed with D holding it, P never lends under that name again (D may still release it).

Entries are named by P's pid, a hash of the request's last key and the rank, with a sequence
number only when that P lends the same last key on that rank twice at once. D takes only an
entry whose keys end with its own (a D with a prefix of its own reads the rest). D remembers
the pids of the Ps it took from (``_LENDERS`` of them), so it opens such a P's entry by its
name, and lists the directory only when none of them lends the keys: on the path of a first
token a listing costs four system calls, an open one. Entries of a P that died are skipped
by D and swept by the next board opened on the directory. Everything read from the board is
checked before it is used: a malformed entry is a :class:`~kvstate._errors.ProtocolError`
naming the rule, the entry is marked failed, and D reads the store. A lend without a fence
(a command run without the lifecycle's clock) waits for a D that took it at most
``UNFENCED_HOLD`` seconds past its deadline: a D that died holding it never releases it.

How bytes move and are checked is the backend's (:class:`PeerOps`); this module is the
protocol: :func:`lend_blocks` for P's rank, :func:`pull_blocks` for D's.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import xxhash

from .._errors import ConfigError, KVStateError, ProtocolError
from .._validate import check_int, is_int
from ._hostfiles import creator_pid, pid_running, remove_orphans

__all__ = ["LendBoard", "Lend", "Prepared", "PeerOps", "lend_blocks", "pull_blocks", "fold_sums", "fold_rows",
           "leading_matches", "local_peer",
           "FORMAT", "VERSION", "KEY_SEP"]

FORMAT, VERSION = "kvstate-lend", 2
KEY_SEP = "\x1f"  #: joins an entry's keys (ASCII's unit separator)
_SEP_BYTES = KEY_SEP.encode()
_STATES = ("lend", "taken", "done", "fail")
_PREFIX = "lend-"  # an entry is lend-PID-TAG[-SEQ].rRANK.STATE: the pid where remove_orphans looks
_MAX_ENTRY = 64 << 20  # bytes of one entry file at most
_FIRST_READ = 96 << 10  # bytes read at once first: an 8k-token request's entry, in heap memory (no mmap)
_PEERS = 64  # peer descriptions a board keeps parsed
_POLL = (0.0002, 0.002)  # first and longest sleep between looks at the board, seconds
_LENDERS = 8  # pids of Ps a D board remembers, to open their entries by name
_HEAD = json.JSONDecoder()  # an entry's first line
UNFENCED_HOLD = 30.0  #: seconds an unfenced lend waits past its deadline for a D that took it


_LOCAL: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # backends lending in-process
_LOCAL_IDS = itertools.count(1)
_NAMED: set[str] = set()  # this process's lends posted under their plain name (without a sequence number)
_NAMED_LOCK = threading.Lock()


_FOLD_BASIS, _FOLD_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fold_sums(sums: Sequence[int]) -> int:
    """One 64-bit checksum of a block from its objects' checksums, in their order."""
    h = _FOLD_BASIS
    for x in sums:
        h = ((h ^ int(x)) * _FOLD_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def leading_matches(got: Sequence[int] | np.ndarray, want: Sequence[int] | np.ndarray) -> int:
    """How many leading checksums of ``got`` equal ``want``'s (at most the shorter's length)."""
    m = min(len(got), len(want))
    differ = np.flatnonzero(np.asarray(got[:m], np.uint64) != np.asarray(want[:m], np.uint64))
    return int(differ[0]) if differ.size else m


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

    def pull_copy(self, rank: int, peer: dict[str, Any], src_ids: Sequence[int] | np.ndarray,
                  dst_ids: Sequence[int] | np.ndarray, sums: Sequence[int] | np.ndarray,
                  guard: Callable[[], bool] | None) -> int:
        """Copy the peer's blocks ``src_ids`` into ``rank``'s ``dst_ids``; how many leading
        blocks, once landed, have the checksums ``sums`` (P's, one a block)."""


class Lend(NamedTuple):
    """One rank's entry, as D took it (checked): a tuple, since it is made on the path of a
    first token."""

    name: str  #: the lend's path without its state suffix (what :meth:`LendBoard.release` takes)
    pid: int
    rank: int
    geometry: str
    keys: tuple[str, ...]
    blocks: np.ndarray  #: P's block ids (int64), one a key
    sums: np.ndarray  #: their checksums (uint64)
    peer: dict[str, Any]
    stores: bool  #: P writes the blocks to the store too


class Prepared(NamedTuple):
    """D's keys as :meth:`LendBoard.take` looks for them (:meth:`LendBoard.prepare`)."""

    rank: int
    keys: tuple[str, ...]
    tag: str  #: the last key's hash, in the entry's name
    mine: bytes  #: the keys joined by ``KEY_SEP``, as an entry holds them
    ok: bool  #: every key non-empty and free of ``KEY_SEP`` (else no P lends them)


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
        self._peers: dict[bytes, Any] = {}  # a peer description's bytes -> its parse (at most _PEERS)
        self._lenders: OrderedDict[int, None] = OrderedDict()  # pids D took from, the latest last
        self._lenders_lock = threading.Lock()  # D's rank threads share the board
        self.sweep()

    @staticmethod
    def _tag(key: str) -> str:
        """A key's part of an entry's name: XXH3-128 (a collision costs D one more entry read;
        the entry's keys decide)."""
        return xxhash.xxh3_128_hexdigest(key.encode())

    def post(self, rank: int, geometry: str, keys: Sequence[str], blocks: Sequence[int], sums: Sequence[int],
             peer: dict[str, Any], stores: bool = False) -> Path:
        """P: post ``rank``'s entry; its path without the state suffix (the lend's name)."""
        if not keys or len(keys) != len(blocks) or len(sums) != len(blocks):
            raise ProtocolError(f"a lend needs as many keys, blocks and checksums, got {len(keys)}, {len(blocks)}, "
                                f"{len(sums)}")
        joined = KEY_SEP.join(keys)
        if joined.count(KEY_SEP) != len(keys) - 1:
            raise ProtocolError(f"a lend's keys may not hold {KEY_SEP!r} (it joins them in the entry)")
        if not all(keys):
            raise ProtocolError("a lend's keys must be non-empty strings (D refuses an entry holding an empty one)")
        described, named = json.dumps(peer).encode(), joined.encode()
        head = json.dumps({"format": FORMAT, "version": VERSION, "pid": os.getpid(), "rank": rank,
                           "geometry": geometry, "n": len(keys), "keys_bytes": len(named),
                           "peer_bytes": len(described), "stores": bool(stores)}).encode()
        name = self._name(keys[-1], rank)
        try:
            tmp = _at(name, "tmp")
            Path(tmp).write_bytes(b"".join((head, b"\n", named, described, np.asarray(blocks, "<i8").tobytes(),
                                            np.asarray(sums, "<u8").tobytes())))
            os.rename(tmp, _at(name, "lend"))
        except BaseException:
            self.remove(name)
            raise
        return name

    def _name(self, key: str, rank: int) -> Path:
        """A new lend's name: plain (what D opens directly) unless this process lends under it
        now, then with a sequence number."""
        plain = self.root / f"{_PREFIX}{os.getpid()}-{self._tag(key)}.r{rank}"
        with _NAMED_LOCK:
            if str(plain) not in _NAMED:
                _NAMED.add(str(plain))
                return plain
        return self.root / f"{_PREFIX}{os.getpid()}-{self._tag(key)}-{next(self._seq)}.r{rank}"

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

    def remove(self, name: Path, reuse: bool = True) -> None:
        """P: every file of the lend, whatever its state (a D's last rename, from ``taken``,
        lands on a file removed after it); its name free again unless ``reuse`` is False: a D
        that held the lend past P's fence may still release it, and must not release a later
        lend posted under the same name."""
        for s in ("taken", "done", "fail", "tmp", "lend"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_at(name, s))
        if reuse:
            with _NAMED_LOCK:
                _NAMED.discard(os.fspath(name))

    def take(self, rank: int, keys: Sequence[str], until: Callable[[], bool],
             prepared: Prepared | None = None) -> Lend | None:
        """D: take a live entry of ``rank`` whose keys end with ``keys``, looking for up to
        ``wait`` seconds (while ``until()``); None when there is none. A malformed entry is
        marked failed and raises :class:`~kvstate._errors.ProtocolError`. ``prepared``:
        :meth:`prepare`'s answer for these keys, made before (an armed pull's)."""
        end = time.monotonic() + self.wait
        pause = _POLL[0]
        p = prepared if prepared is not None and prepared.rank == rank and \
            (prepared.keys is keys or prepared.keys == tuple(keys)) else self.prepare(rank, keys)
        if not p.ok:
            return None  # a key holding the separator could match two of an entry's: no P lends it
        tag, tail, plain, numbered = p.tag, f".r{rank}.lend", f"-{p.tag}.r{rank}.lend", f"-{p.tag}-"
        while True:
            with self._lenders_lock:
                known = tuple(reversed(self._lenders))
            for pid in known:  # the Ps taken from before, by name
                lend = self._try_take(f"{self.root}/{_PREFIX}{pid}-{tag}.r{rank}", rank, p.keys, p.mine)
                if lend is not None:
                    return self._took(lend)
            for entry in os.scandir(self.root):
                n = entry.name
                if n.startswith(_PREFIX) and n.endswith(tail) and (n.endswith(plain) or numbered in n):
                    lend = self._try_take(entry.path[:-5], rank, p.keys, p.mine)
                    if lend is not None:
                        return self._took(lend)
            if time.monotonic() >= end or not until():
                return None
            time.sleep(pause)
            pause = min(2 * pause, _POLL[1])

    def prepare(self, rank: int, keys: Sequence[str]) -> Prepared:
        """What :meth:`take` derives from D's keys (their entry name's tag, their bytes), made
        once: an armed pull makes it when D reserves its blocks, off the first token's path."""
        keys = tuple(keys)
        mine = KEY_SEP.join(keys).encode()
        return Prepared(rank, keys, self._tag(keys[-1]), mine, mine.count(_SEP_BYTES) == len(keys) - 1 and all(keys))

    def _took(self, lend: Lend) -> Lend:
        """``lend``, its P remembered by the pid its name holds (see the module's docstring)."""
        pid = creator_pid(lend.name, _PREFIX)
        with self._lenders_lock:
            self._lenders[pid] = None
            self._lenders.move_to_end(pid)
            while len(self._lenders) > _LENDERS:
                self._lenders.popitem(last=False)
        return lend

    def _try_take(self, name: str, rank: int, keys: Sequence[str], mine: bytes) -> Lend | None:
        """The entry ``name`` (a path without its state) if it is there, its P lives, it lends
        ``keys`` (``mine``: joined) and this call took it first. The take (one ``rename``)
        comes first and the read after, so what D reads is the entry it took, even where P
        lends under this name again; an entry not D's to take goes back as it was. This is a
        first token's path, where each system call counts: one when no entry is there, five
        to take one (the rename, P's liveness, the read's three), paths plain strings."""
        try:
            os.rename(f"{name}.lend", f"{name}.taken")
        except FileNotFoundError:
            return None  # not there, or taken or withdrawn meanwhile
        raw = _read_entry(f"{name}.taken") if pid_running(creator_pid(name, _PREFIX)) else None
        try:
            lend, theirs = (None, b"") if raw is None else _checked(raw, name, rank, self._peers, tuple(keys), mine)
        except ProtocolError:
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{name}.taken", f"{name}.fail")
            raise
        if lend is None or theirs != mine and not theirs.endswith(_SEP_BYTES + mine):
            with contextlib.suppress(FileNotFoundError):  # P gone, or another prompt's whose last key hashes alike
                os.rename(f"{name}.taken", f"{name}.lend")
            return None
        return lend

    def release(self, name: str | os.PathLike[str], whole: bool) -> None:
        """D: its copy ended (``whole``: every block arrived and matched)."""
        with contextlib.suppress(FileNotFoundError):
            os.rename(_at(name, "taken"), _at(name, "done" if whole else "fail"))

    def sweep(self) -> int:
        """Remove the files of lends whose P process is gone; how many."""
        return remove_orphans(self.root, _PREFIX)


def _at(name: str | os.PathLike[str], state: str) -> str:
    """The file of lend ``name`` in ``state``."""
    return f"{os.fspath(name)}.{state}"


def _read_entry(path: str) -> bytes | None:
    """An entry file's bytes (None if it is gone): one read for the usual entry (a short read
    of a regular file is its end), more up to ``_MAX_ENTRY``; a longer file reads as empty,
    which the checks refuse."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    chunks, total, want = [], 0, _FIRST_READ
    try:
        while True:
            chunks.append(os.read(fd, want))
            total += len(chunks[-1])
            if len(chunks[-1]) < want or total > _MAX_ENTRY:
                break
            want = min(1 << 20, _MAX_ENTRY + 1 - total)
    finally:
        os.close(fd)
    return b"".join(chunks) if total <= _MAX_ENTRY else b""


def _checked(raw: bytes, name: str, rank: int, peers: dict[bytes, Any],
             keys: tuple[str, ...], mine: bytes = b"") -> tuple[Lend, bytes]:
    """An entry of lend ``name`` read from the board, every field checked against the rules
    above, as D would take it for ``keys`` (its last block ids and checksums, one a key); with
    the entry's keys still joined, as bytes (D compares them with its own so). ``peers``:
    descriptions parsed before."""
    def bad(rule: str) -> ProtocolError:
        return ProtocolError(f"lend entry {os.path.basename(name)}.taken: {rule}")
    cut = raw.find(b"\n") if len(raw) <= _MAX_ENTRY else -1
    try:  # the line P wrote (UTF-8, nothing around it), decoded with the fewest steps
        d, end = _HEAD.raw_decode(raw[:cut].decode()) if cut > 0 else (None, cut)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        d, end = None, cut
    if end != cut:
        d = None
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
        raise bad(f"not a {FORMAT} version {VERSION} entry")
    n, named, described = d.get("n"), d.get("keys_bytes"), d.get("peer_bytes")
    if not is_int(named) or not is_int(described) or named <= 0 or described < 0 or \
            named + described >= len(raw) - cut:
        raise bad(f"keys_bytes and peer_bytes must count the keys' and the peer description's bytes, got "
                  f"{named!r} and {described!r}")
    at = cut + 1 + named + described  # where the arrays start
    if not is_int(n) or not 0 < n <= _MAX_ENTRY // 16 or len(raw) - at != 16 * n:
        raise bad(f"{n!r} blocks must be followed by as many int64 block ids and uint64 checksums, got "
                  f"{len(raw) - at} bytes")
    named_keys = raw[cut + 1:cut + 1 + named]
    # D's own keys, joined (``mine``: checked by the taker, Prepared.ok, to hold n - 1 separators
    # and no empty key) are well formed: an entry of exactly those keys needs no look at them
    if (named_keys != mine or n != len(keys)) and (
            named_keys.count(_SEP_BYTES) != n - 1 or named_keys.startswith(_SEP_BYTES) or
            named_keys.endswith(_SEP_BYTES) or _SEP_BYTES * 2 in named_keys):
        raise bad(f"keys must be {n} non-empty strings joined by {KEY_SEP!r}")
    blocks = np.frombuffer(raw, "<i8", n, at)
    if np.minimum.reduce(blocks) < 0:  # n > 0 here; the reduction without its Python wrapper
        raise bad("block ids must be ints >= 0")
    peer = _peer(raw[cut + 1 + named:at], peers)
    if d.get("rank") != rank or not is_int(d.get("pid")) or not isinstance(d.get("geometry"), str) or \
            not isinstance(peer, dict) or not isinstance(d.get("stores"), bool):
        raise bad(f"rank must be {rank}, with a pid, a geometry, a peer description and whether P stores")
    off = max(n - len(keys), 0)  # D's keys end the entry's (D holds a prefix of its own)
    sums = np.frombuffer(raw, "<u8", n - off, at + 8 * (n + off))
    return Lend(name, d["pid"], rank, d["geometry"], keys, blocks[off:], sums, peer, d["stores"]), named_keys


def _peer(raw: bytes, peers: dict[bytes, Any]) -> Any:
    """A peer description's parse (None if it is not JSON), from ``peers`` if seen before."""
    if raw not in peers:
        try:
            parsed = json.loads(raw)
        except ValueError:
            return None
        if len(peers) >= _PEERS:
            peers.clear()
        peers[raw] = parsed
    return peers[raw]


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
    held = False  # by a D past the fence: the name is not lent under again
    try:
        state, pause = board.state(name), _POLL[0]
        while state in ("lend", "taken"):
            if not until():
                if board.withdraw(name):
                    return 0
                if not guard():
                    held = True
                    return 0
            time.sleep(pause)
            pause = min(2 * pause, _POLL[1])
            state = board.state(name)
        return len(keys) if state == "done" else 0
    finally:
        board.remove(name, reuse=not held)


def pull_blocks(board: LendBoard, ops: PeerOps, rank: int, keys: Sequence[str],
                block_ids: Sequence[int] | np.ndarray, until: Callable[[], bool],
                guard: Callable[[], bool] | None, prepared: Prepared | None = None) -> int | None:
    """D's rank: pull ``keys`` into ``block_ids`` from a P that lent them; how many leading
    blocks arrived and matched P's checksums (-1 when not all did and P writes them to the
    store too: read them there), or None when no P lends them (read the store). ``prepared``:
    the board's :meth:`~LendBoard.prepare` of ``keys``, made before."""
    try:
        lend = board.take(rank, keys, until, prepared)
    except ProtocolError:
        return 0
    if lend is None:
        return None
    whole = False
    try:
        if lend.geometry != ops.lend_geometry():
            raise ProtocolError(f"lend entry {os.path.basename(lend.name)}.taken: geometry {lend.geometry!r}, this "
                                f"side's is {ops.lend_geometry()!r}")
        n = ops.pull_copy(rank, lend.peer, lend.blocks, block_ids, lend.sums, guard)
        whole = n == len(keys)
        return n if whole or not lend.stores else -1
    except (KVStateError, OSError):
        return -1 if lend.stores else 0
    finally:
        board.release(lend.name, whole)

"""D's direct pulls armed before P lends: the copy's launch taken off the first token's path.

D knows a request's keys and its own blocks from the moment it reserves them, long before P's
prefill ends and P lends the cache (:mod:`kvstate.backends._lends`). An *armed* pull queues,
then, on a stream of its own, everything the pull does on the GPU, behind a wait on a flag
in pinned host memory (``cuStreamWaitValue32``): the upload, from that memory, of the
lender's layer pointers, its block ids and its checksums; the copy that sums what it moves;
the comparison with P's checksums. When P's entry is on the board, D's host takes it,
checks it, writes the lender's side into the pinned memory and raises the flag (*fires*):
the GPU starts at once, with no launch left on the first token's path.

Rules:

- A slot is a stream, its pinned memory and its device scratch. A queued wait holds back all
  that follows it on its stream, so two armed pulls never share one. It can hold back other
  streams too: the GPU runs streams on a few hardware queues, and a queue whose head waits
  stalls every stream placed on it. Measured on an H200 (``.dev/run/armhazard.py``): with
  three or more waits queued in one process, a kernel on a new stream waited for the flag
  (with ``CUDA_DEVICE_MAX_CONNECTIONS`` 8 or 32); with one or two it did not. So a backend
  has at most ``slots`` (default 2) armed at once, over all its ranks (they share its GPU and
  its process: a D in one process at TP 2 queues no more waits than a rank worker), and
  ``arm`` answers False when none is free (the pull then runs as an unarmed one).
- An armed pull is fired by the pull of its keys into its blocks, or *disarmed*: by
  ``disarm``, by a pull of its keys into other blocks, by its deadline (a watchdog thread
  disarms it then), and by ``close``. Disarming raises the flag over a harmless copy: every
  layer pointer the queued work reads or writes is the slot's own scratch row and every id
  0, so it touches no cache.
- A call that waits for the whole device in this process (``cudaFree``, ``cudaFreeHost``,
  ``cudaHostUnregister``, ``cudaDeviceSynchronize``, loading a module: a first use of a CuPy
  operation or a kernel) waits for every armed pull of the process on that GPU to be fired
  or disarmed: at most until the latest deadline. Allocations, streams, events, copies and
  launches of loaded kernels do not wait, and neither does another process or another GPU
  (measured as above). The kernels an armed pull queues, and the checksum kernels of the
  backend's reads and writes, are loaded before its wait is queued. Mapping a lender not met
  before may wait for the device: :meth:`ArmedPulls.quiet` lets every armed pull go first
  and arms none until the mapping is made (a pull already taken waits at most its own wait
  for P's entry).
- D's blocks are written only when the pull is fired, by the read that holds them, after its
  fence check, as an unarmed pull writes them. What P's entry says is checked before the
  flag goes up (its layers, row size and ids in range of P's caches); an entry that fails a
  check disarms the slot, and the pull fails as an unarmed one would.
- A slot is armed again only once the work queued on its stream ran (its event passed), so
  its memory is never rewritten under the copy that reads it.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._errors import BlockError, DriverError, ProtocolError
from ..kernels._cuda_checksum import fold_match, load_fold_match
from ..kernels._cuda_launch import stream_wait_value
from ..kernels._ids import check_ids

__all__ = ["ArmedPulls", "Armed", "SLOTS"]

SLOTS = 2  #: pulls a backend (one GPU of one process) arms at once, by default (more stall other streams)


class Armed:
    """One armed pull: its slot (stream, pinned words, device scratch) and what it waits for."""

    __slots__ = ("stream", "host", "host_dev", "dev", "out", "scratch", "size", "gen", "done", "rank", "keys",
                 "dst", "given", "deadline", "kinds", "layers", "chunk", "sw", "prepared")

    def __init__(self, cp: Any, size: int, kinds: int, layers: int, chunk: int) -> None:
        import cupyx
        self.size, self.kinds, self.layers, self.chunk = size, kinds, layers, chunk
        ptrs = kinds * layers
        self.stream = cp.cuda.Stream(non_blocking=True)
        # the flag and a pad, each kind's source then destination layer pointers, the source
        # ids, destination ids and P's checksums (size each); then the answer
        self.host = cupyx.empty_pinned(2 + 2 * ptrs + 3 * size + 1, np.uint64)
        self.host[:] = 0
        self.host_dev = int(cp.cuda.runtime.pointerGetAttributes(int(self.host.ctypes.data)).devicePointer)
        self.dev = cp.empty(2 * ptrs + 3 * size, cp.uint64)
        self.out = cp.empty(size * kinds, cp.uint64)
        self.scratch = cp.zeros(max(16, chunk), cp.uint8)  # the harmless copy's one row
        self.gen = 0
        self.done: Any = None
        self.rank, self.dst, self.deadline = -1, np.empty(0, np.int64), 0.0
        self.given: Any = None  # the block ids as the caller gave them (compared so, cheaply)
        self.prepared: Any = None  # what the lend board's take derives from the keys, made at arming
        self.keys: tuple[str, ...] = ()
        self.sw: Any = None


class ArmedPulls:
    """The armed pulls of one backend's ranks, ``slots`` at most over all of them."""

    def __init__(self, cp: Any, slots: int = SLOTS) -> None:
        self.cp, self.slots = cp, slots
        self._wait = stream_wait_value()
        self._lock = threading.Lock()
        # the watchdog's (a deadline came nearer, or close) and quiet's (no arming in flight)
        self._cv = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self._quiet = 0  # calls that may wait for the device in progress: nothing is armed meanwhile
        self._arming = 0  # arms between their check and their entry in the table
        self._cache: dict[str, Any] = {}  # fold_match's kernel, loaded before any wait is queued
        self._ptrs: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()  # by mapping
        self._armed: dict[tuple[int, tuple[str, ...]], Armed] = {}
        self._idle: list[Armed] = []  # slots whose queued work may still run (see ``_free``)
        #: pulls armed, fired, and disarmed unfired, since the start
        self.counts = dict.fromkeys(("armed", "fired", "disarmed"), 0)

    def __len__(self) -> int:
        """Pulls armed now."""
        return len(self._armed)

    def arm(self, rank: int, sw: Any, ours: Sequence[Any], keys: tuple[str, ...], dst: np.ndarray,
            deadline: float, given: Any = None, prepared: Any = None) -> bool:
        """Queue the pull of ``keys`` into ``dst`` (checked ids) on a free slot, on ``sw``'s
        device (current): whether it was armed. One armed pull a rank and keys: arming them
        again disarms the earlier one."""
        self.disarm_keys(rank, keys)
        with self._lock:
            if self._closed or self._quiet or len(self._armed) >= self.slots:
                return False
            self._arming += 1
        try:
            return self._arm(rank, sw, ours, keys, dst, deadline, given, prepared)
        finally:
            with self._cv:
                self._arming -= 1
                self._cv.notify_all()

    def _arm(self, rank: int, sw: Any, ours: Sequence[Any], keys: tuple[str, ...], dst: np.ndarray,
             deadline: float, given: Any, prepared: Any) -> bool:
        load_fold_match(self.cp, self._cache)
        n, layers = len(dst), len(ours[0])
        slot = self._free(n, len(ours), layers, int(ours[0].row_bytes))
        slot.rank, slot.keys, slot.dst, slot.deadline, slot.sw = rank, keys, dst, deadline, sw
        slot.given = list(given) if isinstance(given, list) else None
        slot.prepared = prepared
        p = slot.kinds * layers
        h = slot.host
        for j, layer in enumerate(ours):
            h[2 + p + j * layers:2 + p + (j + 1) * layers] = layer.ptrs
        h[2 + 2 * p + n:2 + 2 * p + 2 * n] = dst.view(np.uint64)
        slot.gen = (slot.gen + 1) & 0xFFFFFFFF
        if not self._wait(slot.stream.ptr, slot.host_dev, slot.gen):
            with self._lock:
                self._idle.append(slot)
            return False
        self._queue(slot, n)
        with self._cv:
            self._armed[(rank, keys)] = slot
            self.counts["armed"] += 1
            self._cv.notify_all()
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="kvstate-armed-pulls", daemon=True)
                self._watchdog.start()
        return True

    def _queue(self, slot: Armed, n: int) -> None:
        """Behind the slot's wait: the upload, the copies with their sums, the comparison."""
        cp, rt, s = self.cp, self.cp.cuda.runtime, slot.stream
        p, d = slot.kinds * slot.layers, int(slot.dev.data.ptr)
        rt.memcpyAsync(d, int(slot.host.ctypes.data) + 16, 8 * (2 * p + 3 * n), 1, s.ptr)  # H2D
        rt.memsetAsync(int(slot.out.data.ptr), 0, 8 * slot.kinds * n, s.ptr)
        ids = d + 8 * 2 * p
        for j in range(slot.kinds):
            slot.sw._kernels.launch_copy_sum(s, d + 8 * j * slot.layers, d + 8 * (p + j * slot.layers), ids,
                                             ids + 8 * n, n, slot.layers, slot.chunk,
                                             int(slot.out.data.ptr) + 8 * n * j)
        with s:
            fold_match(cp, slot.out[:slot.kinds * n].reshape(slot.kinds, n), slot.dev[2 * p + 2 * n:2 * p + 3 * n],
                       slot.host_dev + 8 * (2 + 2 * p + 3 * slot.size), self._cache)
            slot.done = cp.cuda.Event(block=False, disable_timing=True)
            slot.done.record(s)

    def _free(self, n: int, kinds: int, layers: int, chunk: int) -> Armed:
        """An idle slot of this geometry, big enough, whose queued work ran; else a new one."""
        with self._lock:
            for i, slot in enumerate(self._idle):
                if slot.size >= n and (slot.kinds, slot.layers, slot.chunk) == (kinds, layers, chunk) and \
                        (slot.done is None or slot.done.done):
                    return self._idle.pop(i)
        return Armed(self.cp, max(n, 1024), kinds, layers, chunk)

    def take(self, rank: int, keys: Sequence[str], dst: Sequence[int] | np.ndarray) -> Armed | None:
        """The pull armed for ``keys`` into ``dst``, taken out to be fired (or disarmed) by the
        caller; None when none is (one armed for other blocks is disarmed)."""
        slot = self._pop(rank, keys)
        if slot is None:
            return None
        if dst == slot.given if dst.__class__ is list and slot.given is not None else \
                len(dst) == len(slot.dst) and np.array_equal(np.asarray(dst), slot.dst):
            return slot
        self.disarm(slot)
        return None

    def fire(self, slot: Armed, theirs: Sequence[Any], src: Sequence[int] | np.ndarray,
             sums: Sequence[int] | np.ndarray) -> Callable[[], int]:
        """Write P's side (its layers ``theirs``, a kind each, bound here; its ids and
        checksums) into the slot and raise the flag; answers the fetch of how many leading
        blocks match. A side that does not fit disarms the slot and raises ProtocolError."""
        n = len(slot.dst)
        try:
            if len(theirs) != slot.kinds or any(len(t) != slot.layers or int(t.row_bytes) != slot.chunk
                                                or not t.aligned for t in theirs):
                raise ProtocolError(f"the lender's caches do not match the armed pull's: {slot.kinds} kinds of "
                                    f"{slot.layers} layers of {slot.chunk}-byte aligned rows expected")
            if len(src) != n or len(sums) != n:
                raise ProtocolError(f"a pull of {n} blocks needs as many lender's blocks and checksums, got "
                                    f"{len(src)} and {len(sums)}")
            top = min(t.shape[0] for t in theirs)
            if isinstance(src, np.ndarray) and src.dtype == np.int64 and src.ndim == 1 and src.size:
                gids = src  # a board's entry: read as int64 (kvstate.backends._lends)
                if int(np.maximum.reduce(gids)) >= top or int(np.minimum.reduce(gids)) < 0:
                    raise ProtocolError(f"the lender's block ids must be in 0..{top - 1}")
            else:
                gids = check_ids(list(src), top, "src", unique=False)
        except (BlockError, ProtocolError) as e:
            self.disarm(slot)
            raise ProtocolError(f"rank {slot.rank}: {e}") from None
        h, p = slot.host, slot.kinds * slot.layers
        for j, layer in enumerate(theirs):
            h[2 + j * slot.layers:2 + (j + 1) * slot.layers] = self._pointers(layer)
        h[2 + 2 * p:2 + 2 * p + n] = np.asarray(gids, np.int64).view(np.uint64)
        h[2 + 2 * p + 2 * n:2 + 2 * p + 3 * n] = np.asarray(sums, np.uint64)
        h[0] = slot.gen  # the flag last: the GPU starts reading the words above
        with self._lock:
            self.counts["fired"] += 1
        answer = h[2 + 2 * p + 3 * slot.size:].view(np.int64)

        def fetch() -> int:
            try:
                slot.sw.wait(slot.done)
                return int(answer[0])
            finally:
                with self._lock:
                    self._idle.append(slot)
        return fetch

    def _pointers(self, layers: Any) -> np.ndarray:
        """A lender's layer pointers as an array, made once for its mapping (a pull copies them
        into the slot's words on a first token's path)."""
        got = self._ptrs.get(layers)
        if got is None:
            got = self._ptrs[layers] = np.asarray(layers.ptrs, np.uint64)
        return got

    @contextlib.contextmanager
    def quiet(self, timeout: float = 5.0) -> Iterator[None]:
        """Around a call that may wait for the whole device (mapping a lender's caches): every
        armed pull let go first, and none armed until it returns. An arm between its check and
        its entry is waited for, at most ``timeout`` seconds (it queues no more than a few
        calls)."""
        with self._cv:
            self._quiet += 1
            self._cv.wait_for(lambda: not self._arming, timeout)
            slots = list(self._armed.values())
            self._armed.clear()
            self._cv.notify_all()
        try:
            for slot in slots:
                self.disarm(slot)
            yield
        finally:
            with self._lock:
                self._quiet -= 1

    def disarm_keys(self, rank: int, keys: Sequence[str]) -> bool:
        """Disarm the pull armed for ``keys`` on ``rank``; whether one was."""
        slot = self._pop(rank, keys)
        if slot is not None:
            self.disarm(slot)
        return slot is not None

    def _pop(self, rank: int, keys: Sequence[str]) -> Armed | None:
        """The pull armed for ``keys`` on ``rank``, out of the table; None when none is (keys
        that are not strings never were)."""
        try:
            key = (rank, tuple(keys))
            with self._lock:
                return self._armed.pop(key, None)
        except TypeError:
            return None

    def _watch(self) -> None:
        """The watchdog: disarm each armed pull at its deadline, until ``close``."""
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                gone = [k for k, s in self._armed.items() if s.deadline <= now]
                slots = [self._armed.pop(k) for k in gone]
                if not slots:
                    nearest = min((s.deadline for s in self._armed.values()), default=now + 60.0)
                    self._cv.wait(min(nearest - now, 60.0))
                    continue
            for slot in slots:
                self.disarm(slot)

    def disarm(self, slot: Armed) -> None:
        """Let an armed pull go unfired (taken out of the table, or never entered): point its
        queued work at the slot's own scratch row and raise the flag, so it runs harmlessly."""
        h, p, n = slot.host, slot.kinds * slot.layers, len(slot.dst)
        h[2:2 + 2 * p] = int(slot.scratch.data.ptr)
        h[2 + 2 * p:2 + 2 * p + 2 * n] = 0
        h[0] = slot.gen
        with self._lock:
            self.counts["disarmed"] += 1
            if slot not in self._idle:
                self._idle.append(slot)

    def close(self) -> None:
        """Disarm every armed pull, stop the watchdog and wait for the slots' work (then
        nothing waits on a flag)."""
        with self._cv:
            self._closed = True
            slots = list(self._armed.values())
            self._armed.clear()
            self._cv.notify_all()
        if self._watchdog is not None:
            self._watchdog.join(5.0)
        for slot in slots:
            self.disarm(slot)
        with self._lock:
            idle, self._idle = self._idle, []
        for slot in idle:
            if slot.done is not None:
                with contextlib.suppress(DriverError):  # a GPU that hung: the backend's close goes on
                    slot.sw.wait(slot.done)

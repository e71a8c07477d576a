"""Running transfer commands, rank by rank, in whatever threads a driver has.

:func:`execute` runs one rank's part of a command on a backend, guarded by its fence.

A :class:`CommandRunner` keeps what a command's life needs across threads, from
:meth:`~CommandRunner.admit` until its last rank ran:

- whether it was cancelled (a rank not started yet then answers 0 at once, moving nothing;
  one already running finishes its store operation, touching blocks only before the fence);
- a layer-wise save's :class:`~kvstate.backends._gate.LayerGate`, advanced by the
  :class:`~kvstate.commands.LayersReady` notices and closed by a cancel;
- a layer-wise load's :class:`~kvstate.backends._gate.LayerArrivals` per rank, kept until the
  driver has delivered that rank's completion (:meth:`~CommandRunner.forget`).

:class:`~kvstate.backends._drivers.ThreadedDriver` runs commands on its worker threads through
one; a rank worker process (:mod:`~kvstate.distributed._rankworker`) runs them on its own.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import commands as C
from .._errors import KVStateError, ValidationError
from .._validate import check_callable
from ..events import Completion
from ._base import TransferBackend, check_backend
from ._gate import LayerArrivals, LayerGate

__all__ = ["CommandRunner", "execute"]


def execute(backend: TransferBackend, cmd: C.TransferCommand, rank: int, limit: int | None = None,
            clock: Callable[[], float] | None = None, layers: Callable[..., Any] | None = None,
            arrived: Callable[[int, Any], None] | None = None,
            cancelled: Callable[[], bool] | None = None) -> Completion:
    """Run one rank's part of ``cmd`` on ``backend`` (only the first ``limit`` keys when given).

    With ``clock`` (the lifecycle's), blocks are touched only while ``clock() < cmd.fence``:
    past the fence the answer is an error (:class:`~kvstate._errors.FenceError`) and no block
    was gathered or scattered. A :class:`~kvstate.commands.SaveLayers` needs ``layers``
    (``layers(n, block=True)``, a :meth:`~kvstate.backends._gate.LayerGate.ready`: False, or
    True or a device event once the first ``n`` layers are computed); a
    :class:`~kvstate.commands.LoadLayers` reports each group it scattered to ``arrived(n, event)``.
    A :class:`~kvstate.commands.LendBlocks`, and a read that waits for a lend, wait while
    ``clock() < cmd.deadline`` (the backend's own clock and ``timeout`` without one) and
    ``cancelled()`` is False."""
    keys = cmd.keys if limit is None else cmd.keys[:limit]
    fence = cmd.fence
    guard = None if clock is None or fence == math.inf else (lambda: clock() < fence)
    until = _until(backend, cmd, clock, cancelled)
    if cmd.__class__ is C.SaveLayers and layers is None:
        raise ValidationError(f"command {cmd.command_id}: a SaveLayers needs a layer gate (layers=)")
    try:
        early = _load_state_first(backend, cmd, rank, keys, guard) if cmd.__class__ is C.LoadLayers else 0
        n = _direct(backend, cmd, rank, keys, guard, until)
        if n is None:
            n = _move_blocks(backend, cmd, rank, keys, guard, layers, arrived)
        if cmd.states:  # a save's states exist once every layer is computed; never past its gate's close
            saved = cmd.__class__ is not C.SaveLayers or _computed(layers, backend.spec.layers)
            n = _move_states(backend, cmd, rank, keys, n, guard, early) if saved else 0
    except (KVStateError, OSError) as e:
        return Completion(cmd.command_id, rank, 0, error=f"{type(e).__name__}: {e}")
    return Completion(cmd.command_id, rank, n)


def _until(backend: TransferBackend, cmd: C.TransferCommand, clock: Callable[[], float] | None,
           cancelled: Callable[[], bool] | None) -> Callable[[], bool]:
    """Whether a wait for a lend may go on: before the command's deadline, not cancelled."""
    if clock is None:
        end, clock = time.monotonic() + getattr(backend, "timeout", 60.0), time.monotonic
    else:
        end = cmd.deadline
    stop = cancelled or (lambda: False)
    return lambda: clock() < end and not stop()


def _direct(backend: TransferBackend, cmd: C.TransferCommand, rank: int, keys: tuple[str, ...], guard: Any,
            until: Callable[[], bool]) -> int | None:
    """The direct handoff's part (:mod:`kvstate.backends._lends`): a lend, or a read a backend
    pulls from a lend first; None for every other command."""
    if cmd.__class__ is C.LendBlocks:
        return backend.lend(rank, keys, cmd.block_ids[:len(keys)], until, guard, cmd.stores)
    if cmd.__class__ is C.ReadBlocks and backend.pulls is not None and keys and not cmd.states and \
            not cmd.tables and not cmd.window_from:
        return _pull_or_read(backend, rank, keys, cmd.block_ids[:len(keys)], until, guard)
    return None


def _move_blocks(backend: TransferBackend, cmd: C.TransferCommand, rank: int, keys: tuple[str, ...], guard: Any,
                 layers: Callable[..., Any] | None, arrived: Callable[[int, Any], None] | None) -> int:
    """The blocks of one rank's part of ``cmd``: how many leading ones moved."""
    if cmd.__class__ is C.SaveLayers:
        n = backend.query(rank, keys)  # a full hit answers at once, computed or not
        if n < len(keys):
            n += _save(backend, rank, keys[n:], cmd.block_ids[n:len(keys)], guard, layers)
    elif isinstance(cmd, C.WriteBlocks):
        # skip the leading keys already stored (same key, same bytes), write the rest
        n = backend.query(rank, keys)
        if n < len(keys):
            n += backend.write(rank, keys[n:], cmd.block_ids[n:len(keys)], guard, **_tables(cmd, n, len(keys)))
    elif cmd.__class__ is C.LoadLayers and backend.spec.layer_groups == 1:  # one object a kind: read whole
        n = backend.read(rank, keys, cmd.block_ids[:len(keys)], guard)
        (arrived or _ignore)(backend.spec.layers, None)
    elif cmd.__class__ is C.LoadLayers:
        n = backend.read(rank, keys, cmd.block_ids[:len(keys)], guard, arrived=arrived or _ignore)
    elif isinstance(cmd, C.ReadBlocks):
        # only when set: a backend reading every block whole may not take window_from
        window: dict[str, Any] = {"window_from": min(cmd.window_from, len(keys))} if cmd.window_from else {}
        n = backend.read(rank, keys, cmd.block_ids[:len(keys)], guard, **window, **_tables(cmd, 0, len(keys)))
    elif isinstance(cmd, C.SwapOut):
        n = backend.swap_out(rank, cmd.block_ids[:len(keys)], cmd.host_slots[:len(keys)], guard)
    elif isinstance(cmd, C.SwapIn):
        n = backend.swap_in(rank, cmd.host_slots[:len(keys)], cmd.block_ids[:len(keys)], guard)
    elif isinstance(cmd, C.FlushHost):
        n = backend.flush_host(rank, keys, cmd.host_slots[:len(keys)])
    else:
        raise ValidationError(f"cannot execute {type(cmd).__name__}")
    return n


def _pull_or_read(backend: TransferBackend, rank: int, keys: tuple[str, ...], block_ids: Sequence[int],
                  until: Callable[[], bool], guard: Any) -> int:
    """A read on a backend with a lend board: pulled from the P that lends the blocks, or,
    when none does or the pull failed, read from the store (waiting for it while ``until()``
    when that P writes the store too)."""
    n = backend.pull(rank, keys, block_ids, until, guard)
    if n is not None and n >= len(keys):
        return n
    if n is not None and n < 0:  # the pull failed and that P writes the store as well: wait for it
        pause = 0.001
        while backend.query(rank, keys) < len(keys) and until():
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
    start = n if n is not None and n > 0 else 0  # the leading blocks pulled whole stay: read the rest
    return start + backend.read(rank, keys[start:], block_ids[start:], guard) if start < len(keys) else start


def _tables(cmd: C.TransferCommand, start: int, end: int) -> dict[str, Any]:
    """The other groups' blocks ``[start, end)`` of a command with group tables, and a write's
    ``window_from`` past ``start``, as keywords (none without group tables: a backend without
    them need not take them)."""
    if not cmd.tables:
        return {}
    window = max(0, cmd.window_from - start) if isinstance(cmd, C.WriteBlocks) else 0
    return {"tables": [t[start:end] for t in cmd.tables], **({"window_from": window} if window else {})}


def _save(backend: TransferBackend, rank: int, keys: Sequence[str], block_ids: Sequence[int], guard: Any,
          layers: Callable[..., Any] | None) -> int:
    """A layer-wise save's blocks not stored yet: group by group as the gate reports their
    layers, or, when they are one object a kind (``layer_groups`` 1, e.g. a hybrid model with
    one paged layer), at once when every layer is computed (nothing if the gate closed)."""
    if backend.spec.layer_groups > 1:
        return backend.write(rank, keys, block_ids, guard, layers=layers)
    if not _computed(layers, backend.spec.layers):
        return 0  # the gate closed (its fence passed) before every layer was reported
    return backend.write(rank, keys, block_ids, guard)


def _load_state_first(backend: TransferBackend, cmd: C.TransferCommand, rank: int, keys: tuple[str, ...],
                      guard: Any) -> int:
    """A layer-wise load's whole-cache state, loaded before its first layer group arrives (the
    engine may run layers as groups arrive): its end, or 0 when it has none or it failed."""
    if not cmd.states or cmd.states[-1][0] != len(keys):
        return 0
    end, page = cmd.states[-1]
    return end if backend.read_state(rank, keys[end - 1], page, guard) else 0


def _computed(layers: Callable[..., Any] | None, paged: int) -> bool:
    """Whether a layer-wise save's layers are all computed: its paged layers all reported
    (:meth:`~kvstate._spec.CacheSpec.paged_layers_done` holds the last back until every layer
    is, states included), and the device past the event reported with them. False when the
    gate closed first (its fence passed, or the layers will never come): nothing computed
    may be stored then, blocks or states."""
    ready = layers(paged) if layers is not None else True
    if not ready:
        return False
    sync = getattr(ready, "synchronize", None)  # a device event (PyTorch or CuPy); a CPU engine gives none
    if sync is not None:
        sync()  # the states may still be computing
    return True


def _move_states(backend: TransferBackend, cmd: C.TransferCommand, rank: int, keys: tuple[str, ...], n: int,
                 guard: Any, early: int = 0) -> int:
    """The states of a transfer whose blocks moved ``n`` leading: a write stores each whose
    blocks were stored, in order; a read loads the last candidate it can (``early``: the end of
    one it loaded first). Answers the end of the last state moved (0: none), as
    :mod:`kvstate._statepages` says."""
    states = [(e, p) for e, p in cmd.states if e <= n]
    if isinstance(cmd, C.WriteBlocks):
        stored = backend.write_states(rank, [keys[e - 1] for e, _ in states], [p for _, p in states], guard)
        return states[stored - 1][0] if stored else 0
    for e, p in reversed(states):
        if e == early or backend.read_state(rank, keys[e - 1], p, guard):
            return e
    return 0


def _ignore(layers: int, event: Any) -> None:
    """Arrivals nobody waits for."""


class _Live:
    """An admitted command: ranks yet to run, its gate (a save), whether it was cancelled,
    whether it is a lend."""

    __slots__ = ("left", "gate", "cancelled", "lend")

    def __init__(self, left: int, gate: LayerGate | None, lend: bool = False) -> None:
        self.left, self.gate, self.cancelled, self.lend = left, gate, False, lend


class CommandRunner:
    """Admitted commands of one backend and their cross-thread state; :meth:`run` is thread-safe.

    ``on_arrived(command_id, rank, layers, event)``, when given, is told of each group a
    layer-wise load scatters (besides its :class:`~kvstate.backends._gate.LayerArrivals`)."""

    def __init__(self, backend: TransferBackend, clock: Callable[[], float] = time.monotonic,
                 on_arrived: Callable[[int, int, int, Any], None] | None = None) -> None:
        check_backend(backend, "CommandRunner")
        check_callable(clock, "CommandRunner: clock")
        check_callable(on_arrived, "CommandRunner: on_arrived", optional=True)
        self.backend, self.clock = backend, clock
        self._on_arrived = on_arrived
        self._lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._arrivals: dict[tuple[int, int], LayerArrivals] = {}  # LoadLayers (command id, rank)

    def admit(self, cmd: C.TransferCommand) -> None:
        """Take ``cmd`` in: each of its ranks runs once, through :meth:`run`."""
        with self._lock:
            gate = LayerGate(cmd.fence, self.clock) if cmd.__class__ is C.SaveLayers else None
            self._live[cmd.command_id] = _Live(len(cmd.ranks), gate, cmd.__class__ is C.LendBlocks)
            if cmd.__class__ is C.LoadLayers:
                for r in cmd.ranks:
                    self._arrivals[(cmd.command_id, r)] = LayerArrivals(self._reporter(cmd.command_id, r))

    def notice(self, cmd: C.CancelCommand | C.LayersReady) -> None:
        """A cancel (ranks not started answer 0; a save's gate closes) or a layer report (a
        save's gate advances). Notices for commands no longer live change nothing."""
        with self._lock:
            live = self._live.get(cmd.command_id)
            if live is None:
                return
            if cmd.__class__ is C.CancelCommand:
                live.cancelled = True
            gate = live.gate
        if gate is not None and isinstance(cmd, C.LayersReady):
            gate.advance(cmd.layers, cmd.event)
        elif gate is not None:
            gate.close()

    def run(self, cmd: C.TransferCommand, rank: int) -> Completion:
        """Run ``rank``'s part of an admitted command in this thread; never raises (a failure
        is an error completion, as a rank must always answer)."""
        with self._lock:
            live = self._live.get(cmd.command_id)
            arrivals = self._arrivals.get((cmd.command_id, rank))
        try:
            if live is None or live.cancelled:
                c = Completion(cmd.command_id, rank, 0, error="cancelled")
            else:
                c = execute(self.backend, cmd, rank, None, self.clock, None if live.gate is None else live.gate.ready,
                            None if arrivals is None else arrivals.arrive, lambda: live.cancelled)
        except Exception as e:  # noqa: BLE001 - a rank must always answer
            c = Completion(cmd.command_id, rank, 0, error=f"{type(e).__name__}: {e}")
        if arrivals is not None:
            arrivals.close()
        with self._lock:
            if live is not None:
                live.left -= 1
                if not live.left:
                    del self._live[cmd.command_id]
        return c

    def cancel_all(self, lends_only: bool = False) -> None:
        """Cancel every live command (its owner is closing): saves stop waiting for layers,
        lends for D (``lends_only``: only those)."""
        with self._lock:
            live = [x for x in self._live.values() if x.lend or not lends_only]
        for x in live:
            x.cancelled = True
            if x.gate is not None:
                x.gate.close()

    def arrivals(self, command_id: int, rank: int) -> LayerArrivals | None:
        with self._lock:
            return self._arrivals.get((command_id, rank))

    def forget(self, command_id: int, rank: int) -> None:
        """The driver delivered this rank's completion: its arrivals are not handed out any more."""
        with self._lock:
            self._arrivals.pop((command_id, rank), None)

    def _reporter(self, command_id: int, rank: int) -> Callable[[int, Any], None] | None:
        hook = self._on_arrived
        return None if hook is None else (lambda layers, event: hook(command_id, rank, layers, event))

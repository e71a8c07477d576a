"""Drivers: execute a lifecycle's transfer commands on a backend and return completions.

Every driver is a :class:`Driver`: it takes the lifecycle's commands (``submit``,
``submit_all``), dispatching on their kind (:data:`kvstate.commands.KINDS`: transfers run,
cancels, layer reports and reads armed ahead are its own, notices go back to the caller), and
``close`` releases what it holds. How answers come back is each driver's own:

- :class:`StepDriver` — for tests and benchmarks: commands wait until the caller picks
  which (command, rank) completes next and how (in full, partially, failed, or never).
- :class:`ThreadedDriver` — for production: worker threads run the commands; completions
  come back through a thread-safe queue the engine polls. ``close()`` joins every thread
  within a deadline.

A driver knows nothing of request states; notices (first token, start prefill, ...) are
handed back to the caller, which owns compute and messaging, except
:class:`~kvstate.commands.LayersReady`, which the driver consumes: it lets a layer-wise save
(:class:`~kvstate.commands.SaveLayers`) store the layers it names (:mod:`~kvstate.backends._gate`).
:class:`ThreadedDriver` arms the pull an :class:`~kvstate.commands.ArmRead` announces on a
backend that can, and lets it go when it cannot fire (:mod:`~kvstate.backends._arming`); it
still hands :class:`~kvstate.commands.RequestEnded` back, having looked at it.
"""
from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast, runtime_checkable

from .. import commands as C
from .._errors import DriverError, ValidationError
from .._timeline import Timeline
from .._validate import check_callable, check_int, check_name, is_int
from ..events import Completion
from ._arming import Armed, ArmedReads
from ._base import TransferBackend, check_backend
from ._gate import LayerArrivals
from ._runner import CommandRunner, execute

__all__ = ["Driver", "StepDriver", "ThreadedDriver", "check_commands", "check_ranks", "check_arm", "check_timeout"]


def check_commands(cmds: Any, who: str) -> list[C.Command]:
    """``cmds`` as a list, every item a command (its kind known), or a ValidationError naming
    the first that is not: a driver takes a list whole or not at all."""
    if isinstance(cmds, (str, bytes)) or not isinstance(cmds, Iterable):
        raise ValidationError(f"{who}: expected an iterable of commands, got {type(cmds).__name__}")
    out = list(cmds)
    for i, c in enumerate(out):
        if not isinstance(c, C.Command):
            raise ValidationError(f"{who}: item {i} is a {type(c).__name__}, not a kvstate command")
    return out


def check_ranks(cmd: C.TransferCommand | C.ArmRead, tp: int, who: str) -> None:
    """``cmd.ranks``: a non-empty tuple of this driver's ranks (``0..tp - 1``), or a
    ValidationError naming the command and its request."""
    ranks = cmd.ranks
    if not isinstance(ranks, tuple) or not ranks or not all(r.__class__ is int and 0 <= r < tp for r in ranks):
        what = f"command {cmd.command_id}" if isinstance(cmd, C.TransferCommand) else type(cmd).__name__
        raise ValidationError(f"{who}: {what} of request {cmd.request_id!r} names ranks {ranks!r}; this driver's "
                              f"are 0..{tp - 1}")


def check_arm(cmd: C.ArmRead, tp: int, who: str) -> None:
    """An :class:`~kvstate.commands.ArmRead` a driver can act on: ranks of its TP group, as many
    blocks as keys; or a ValidationError naming the request."""
    check_ranks(cmd, tp, who)
    if not isinstance(cmd.keys, tuple) or not isinstance(cmd.block_ids, tuple) or \
            len(cmd.keys) != len(cmd.block_ids) or not cmd.keys:
        raise ValidationError(f"{who}: ArmRead of request {cmd.request_id!r} needs as many block ids as keys "
                              f"(at least one), as tuples")


def check_timeout(timeout: Any, who: str) -> float:
    """A finite number of seconds >= 0, or a ValidationError."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
        raise ValidationError(f"{who}: timeout must be a finite number of seconds >= 0, got {timeout!r}")
    return float(timeout)


@runtime_checkable
class Driver(Protocol):
    """What every driver does with a lifecycle's commands (see the module's docstring)."""

    def submit(self, cmd: C.Command) -> bool:
        """Take one command: True for a transfer, a cancel or a layer report it handles, False
        for a notice, which the caller handles."""
        ...

    def submit_all(self, cmds: Iterable[C.Command]) -> list[C.Command]:
        """Take every command; returns the notices, in order."""
        ...

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking commands and release every thread, process or buffer it holds, by
        ``timeout`` seconds; closing twice does nothing."""
        ...


def _reported(ready: int, event: Any, n: int, block: bool = True) -> Any:
    """A step driver's layer gate: what was reported when it answers is all there is (the
    last report's event, if any, follows every layer reported)."""
    return (True if event is None else event) if n <= ready else False


class StepDriver(Driver):
    """Holds a lifecycle's transfer commands until the caller completes them, one rank at a time."""

    def __init__(self, lifecycle: Any, backend: TransferBackend | None = None,
                 on_notice: Callable[[C.Command], None] | None = None) -> None:
        if not all(callable(getattr(lifecycle, m, None)) for m in ("poll_commands", "complete")):
            raise ValidationError(f"StepDriver: lifecycle must be a lifecycle (poll_commands, complete), got "
                                  f"{lifecycle!r}")
        if backend is not None:
            check_backend(backend, "StepDriver")
        check_callable(on_notice, "StepDriver: on_notice", optional=True)
        self.lifecycle = lifecycle
        self.backend = backend
        self.on_notice = on_notice
        #: (command, rank) pairs waiting for an answer, oldest first
        self.pending: dict[tuple[int, int], C.TransferCommand] = {}
        self.notices: list[C.Command] = []
        #: layers reported computed per SaveLayers command (its LayersReady notices)
        self.layers: dict[int, int] = {}
        self._events: dict[int, Any] = {}  # command id -> the device event of its last report (or None)
        self._closed = False

    def pump(self) -> int:
        """Move newly queued commands in; returns how many arrived. Notices go to
        ``on_notice`` if given, else to :attr:`notices` (and so do cancels, whose answers are
        still owed)."""
        cmds = self.lifecycle.poll_commands()
        if not cmds:
            return 0
        for cmd in cmds:  # the lifecycle's own commands: no list check (submit_all's) needed
            if self.submit(cmd):
                continue
            if self.on_notice is not None:
                self.on_notice(cmd)
            else:
                self.notices.append(cmd)
        return len(cmds)

    def submit(self, cmd: C.Command) -> bool:
        """Hold a transfer's (command, rank) answers until the caller completes them, note a
        layer report (True); a cancel goes to :attr:`notices` (True: its answers are still
        owed, so pins release on them); a notice is the caller's (False)."""
        kind = C.kind_of(cmd)
        if self._closed:
            raise DriverError("StepDriver: submit after close")
        if kind in C.TRANSFER_KINDS:
            tc = cast(C.TransferCommand, cmd)
            for r in tc.ranks:
                self.pending[(tc.command_id, r)] = tc
        elif kind == "cancel":
            self.notices.append(cmd)
        elif kind == "layers":
            lr = cast(C.LayersReady, cmd)
            if lr.layers > self.layers.get(lr.command_id, 0):
                self.layers[lr.command_id], self._events[lr.command_id] = lr.layers, lr.event
        elif kind != "arm":  # a read armed ahead is a hint: the step driver runs reads as they come
            return False
        return True

    def submit_all(self, cmds: Iterable[C.Command]) -> list[C.Command]:
        """Submit every command; returns the notices, which the caller handles. A list holding
        anything but commands is refused whole, before any is taken."""
        cmds = check_commands(cmds, "StepDriver.submit_all")
        return [c for c in cmds if not self.submit(c)]

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking commands (it holds no thread; its pending answers stay for inspection)."""
        check_timeout(timeout, "StepDriver.close")
        self._closed = True

    def complete(self, command_id: int, rank: int, outcome: int | str | None = None) -> Completion:
        """Answer one (command, rank).

        ``outcome``: ``None`` runs it in full (on the backend if there is one), an int runs
        only that many leading keys (a partial transfer), ``"fail"`` answers 0 with an
        error and moves nothing. A :class:`~kvstate.commands.LendBlocks` is never run here: its
        answer is what D pulled, which no D does while this thread waits, so the caller's
        outcome is the answer (``None``: pulled whole).
        """
        key = self._pending_key(command_id, rank)
        cmd = self.pending[key]
        if outcome is not None and outcome != "fail" and not (is_int(outcome) and 0 <= outcome <= len(cmd.keys)):
            raise ValidationError(f"outcome {outcome!r} must be None, 'fail' or 0..{len(cmd.keys)}")
        del self.pending[key]
        if outcome == "fail":
            return self._answer(cmd, rank, None, fail=True)
        return self._answer(cmd, rank, None if outcome is None else int(outcome))

    def _answer(self, cmd: C.TransferCommand, rank: int, limit: int | None, fail: bool = False) -> Completion:
        ready, event = self.layers.get(cmd.command_id, 0), self._events.get(cmd.command_id)
        if fail:
            c = Completion(cmd.command_id, rank, 0, error="injected failure")
        elif cmd.__class__ is C.LendBlocks:  # the caller plays D: a lend run here would wait for nobody
            c = Completion(cmd.command_id, rank, len(cmd.keys) if limit is None else limit)
        elif self.backend is not None:  # an answer past the fence moves nothing (FenceError)
            gate = functools.partial(_reported, ready, event)
            c = execute(self.backend, cmd, rank, limit, self.lifecycle.clock, layers=gate)
        elif cmd.__class__ is C.SaveLayers and ready < self.lifecycle.spec.layers:
            c = Completion(cmd.command_id, rank, 0)  # as a backend would: layers not computed, not stored
        elif limit is not None:
            c = Completion(cmd.command_id, rank, limit)
        else:  # without a backend every read and write succeeds in full
            c = Completion(cmd.command_id, rank, len(cmd.keys))
        if cmd.__class__ is C.SaveLayers and not any((cmd.command_id, r) in self.pending for r in cmd.ranks):
            self.layers.pop(cmd.command_id, None)  # its last rank answered: no report is for it now
            self._events.pop(cmd.command_id, None)
        self.lifecycle.complete(c)
        return c

    def drop(self, command_id: int, rank: int) -> None:
        """Forget a pending answer: that rank never answers."""
        self._pending_key(command_id, rank)
        del self.pending[(command_id, rank)]

    def _pending_key(self, command_id: Any, rank: Any) -> tuple[int, int]:
        """``(command_id, rank)`` of a pending answer, or a ValidationError naming it."""
        if not is_int(command_id) or not is_int(rank):  # True would find rank 1's answer
            raise ValidationError(f"command id and rank must be ints, got {command_id!r} and {rank!r}")
        if (command_id, rank) not in self.pending:
            raise ValidationError(f"no pending command {command_id} for rank {rank}")
        return command_id, rank

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Complete every pending answer in order, in full, until nothing is left."""
        check_int(max_steps, "StepDriver.run_until_idle: max_steps", minimum=1, maximum=2**31)
        steps = 0
        pending, answer = self.pending, self._answer
        self.pump()
        while pending or self.pump():  # a notice's handler may have queued new commands
            for key in list(pending):  # oldest first; what they cause comes in after
                cmd = pending.pop(key, None)
                if cmd is not None:
                    answer(cmd, key[1], None)
                    steps += 1
                    if steps >= max_steps:
                        raise DriverError(f"run_until_idle: still busy after {max_steps} steps")
            self.pump()
        return steps


_STOP = object()  #: a worker thread ends when it takes this


#: transfer threads a ThreadedDriver may start (each holds a stack; ranks in flight rarely pass 64)
MAX_WORKERS = 1024


class ThreadedDriver(Driver):
    """Runs transfer commands on ``workers`` threads; the engine polls the completions.

    ``submit`` never blocks on a transfer. A command cancelled before a worker reaches it
    is answered with count 0 (its blocks unpin); one already running finishes its store
    operation, but touches blocks only before the command's fence on ``clock`` (which must
    be the lifecycle's clock). A :class:`~kvstate.commands.SaveLayers` holds a worker per rank
    while its prefill runs, waiting on its :class:`~kvstate.backends._gate.LayerGate` (give it
    more workers than the saves' ranks in flight at once, or other transfers wait behind
    them); a cancel closes the gate. A :class:`~kvstate.commands.LendBlocks` waits for D on a
    thread of its own (a lend lasts until D pulled it: on a worker it would hold back every
    transfer queued behind it), and closing cancels it. A :class:`~kvstate.commands.LoadLayers` reports into a
    :class:`~kvstate.backends._gate.LayerArrivals` per rank (``arrivals``), kept until its
    completion is polled. The commands' state between threads lives in a
    :class:`~kvstate.backends._runner.CommandRunner`.
    """

    def __init__(self, backend: TransferBackend, workers: int = 4, name: str = "kvstate",
                 clock: Callable[[], float] = time.monotonic, timeline: Timeline | None = None) -> None:
        """``timeline``: record each command's part on each rank, from submission to answer, under
        the instance ``name`` (the engine adds its requests' states: ``timeline.states(name, lc)``
        once a loop turn)."""
        check_backend(backend, "ThreadedDriver")
        check_name(name, "ThreadedDriver: name")
        check_int(workers, "ThreadedDriver: workers", minimum=1, maximum=MAX_WORKERS)
        if not callable(clock):
            raise ValidationError("ThreadedDriver: clock must be callable (the lifecycle's clock)")
        if timeline is not None and not isinstance(timeline, Timeline):
            raise ValidationError("ThreadedDriver: timeline must be a kvstate Timeline")
        self.name, self.timeline = name, timeline
        self.backend = backend
        self.clock = clock
        self._runner = CommandRunner(backend, clock)
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._done: queue.Queue[Completion] = queue.Queue()
        self._lock = threading.Lock()
        self._inflight = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-transfer-{i}", daemon=True)
                         for i in range(workers)]
        self._lends: list[threading.Thread] = []  # lends' own threads, joined on close
        self._armed = ArmedReads()  # reads armed at reservation, until read or let go
        for t in self._threads:
            t.start()

    def submit(self, cmd: C.Command) -> bool:
        """Queue a transfer command (True), note a cancel or a layer report (True), arm a read
        announced ahead (True), or ignore a notice (False)."""
        if self._closed:
            raise DriverError("ThreadedDriver: submit after close")
        kind = C.kind_of(cmd)
        if kind == "cancel" or kind == "layers":
            self._runner.notice(cast("C.CancelCommand | C.LayersReady", cmd))
            return True
        if kind == "arm":
            self._arm(cast(C.ArmRead, cmd))
            return True
        if kind not in C.TRANSFER_KINDS:
            if self._armed and cmd.__class__ is C.RequestEnded:
                self._let_go(self._armed.ended(cmd.request_id))
            return False
        cmd = cast(C.TransferCommand, cmd)
        self._runner.admit(cmd)
        if self._armed:
            self._let_go(self._armed.read(cmd))
        if self.timeline is not None:
            self.timeline.submitted(self.name, [cmd])
        with self._lock:
            self._inflight += len(cmd.ranks)
        for r in cmd.ranks:
            if cmd.__class__ is C.LendBlocks:  # it waits for D: on a thread of its own, never a worker's
                t = threading.Thread(target=self._finish, args=(cmd, r), name=f"{self.name}-lend", daemon=True)
                self._lends = [x for x in self._lends if x.is_alive()] + [t]
                t.start()
            else:
                self._jobs.put((cmd, r))
        return True

    def submit_all(self, cmds: Iterable[C.Command]) -> list[C.Command]:
        """Submit every command; returns the notices, which the caller handles. A list holding
        anything but commands is refused whole, before any is taken."""
        return [c for c in check_commands(cmds, "ThreadedDriver.submit_all") if not self.submit(c)]

    def armed_reads(self) -> dict[str, int]:
        """Reads armed at reservation on at least one rank, those whose read came as announced
        (``matched``), and those let go unfired, since the start."""
        return dict(self._armed.counts)

    def _arm(self, cmd: C.ArmRead) -> None:
        """Prepare the read ``cmd`` announces on each of its ranks whose backend can
        (:mod:`kvstate.backends._arming`), until its deadline on the lifecycle's clock."""
        check_arm(cmd, self.backend.spec.tp_size, "ThreadedDriver.submit")
        timeout = cmd.deadline - self.clock()
        if timeout <= 0:
            return  # its first token is already late: nothing to prepare
        self._let_go(self._armed.ended(cmd.request_id))  # armed again: the older one first
        self._armed.note(cmd, tuple(r for r in cmd.ranks if self.backend.arm_pull(r, cmd.keys, cmd.block_ids,
                                                                                    timeout)))

    def _let_go(self, armed: Armed | None) -> None:
        if armed is not None:
            for r in armed.ranks:
                self.backend.disarm_pull(r, armed.keys)

    def poll(self, timeout: float = 0.0) -> list[Completion]:
        """Completions ready now (waiting up to ``timeout`` seconds for the first one)."""
        timeout = check_timeout(timeout, "ThreadedDriver.poll")
        out: list[Completion] = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        for c in out:
            self._runner.forget(c.command_id, c.rank)
        if out and self.timeline is not None:
            self.timeline.completed(self.name, out)
        return out

    def arrivals(self, command_id: int, rank: int = 0) -> LayerArrivals | None:
        """The layer arrivals of a submitted :class:`~kvstate.commands.LoadLayers` on ``rank``
        (None once its completion was polled, or for another command)."""
        return self._runner.arrivals(command_id, rank)

    @property
    def inflight(self) -> int:
        """(command, rank) answers not yet delivered to ``poll``."""
        return self._inflight

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            self._finish(*job)

    def _finish(self, cmd: C.TransferCommand, rank: int) -> None:
        c = self._runner.run(cmd, rank)
        with self._lock:
            self._inflight -= 1
        self._done.put(c)

    def close(self, timeout: float = 30.0) -> None:
        """Stop accepting work, let queued work finish, and join every thread by ``timeout``."""
        check_timeout(timeout, "ThreadedDriver.close")
        if self._closed:
            return
        self._closed = True
        for armed in self._armed.drain():
            self._let_go(armed)
        self._runner.cancel_all(lends_only=True)  # a lend waiting for D answers now
        for _ in self._threads:
            self._jobs.put(_STOP)
        deadline = time.monotonic() + timeout
        for t in [*self._threads, *self._lends]:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in [*self._threads, *self._lends] if t.is_alive()]
        if alive:
            raise DriverError(f"ThreadedDriver.close: threads {alive} still running after {timeout}s")

    def __enter__(self) -> ThreadedDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

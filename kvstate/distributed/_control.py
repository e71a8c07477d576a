"""The control side of a process driver: rank workers' hellos, heartbeats and deaths.

:class:`RankControl` owns the control channel's I/O thread and the worker processes its
driver started. On that thread it

- accepts a hello whose TP size and cache geometry match the scheduler's (a rank is then
  *up*, and :class:`~kvstate.distributed._liveness.RankUp` is noticed), and refuses any other
  (the worker of that incarnation exits; :meth:`RankControl.wait_ready` names the mismatch);
  a hello for a rank whose worker is live is dropped and counted (``foreign_hellos``), never
  answered: the live worker stays;
- records heartbeats, and asks a worker it declared dead but which speaks again (it was only
  stopped) to say hello anew as a new incarnation (``REJOIN``);
- forwards layer arrivals to the driver;
- declares a rank *down* when it is silent past ``dead_after_s``, says goodbye, or its
  process (one this driver started) exits; the driver's ``on_down`` answers what it owed.
  With ``restart`` a started worker is killed first (a stopped process could still touch
  blocks) and started again, as a new incarnation, as :class:`RestartBackoff` allows.

Every message that does not parse or breaks a rule is counted (``bad_messages``) and dropped; a
hello without the driver's per-start secret is counted (``unauthenticated_hellos``) and dropped.
"""
from __future__ import annotations

import dataclasses
import hmac
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .._errors import ConfigError, DriverError, KVStateError, ProtocolError
from .._spec import CacheSpec
from . import _wire as wire
from ._liveness import RankDown, RankTable, RankUp
from ._rankworker import SECRET_ENV, WorkerConfig
from ._supervise import ChildProcess

__all__ = ["RankControl", "RestartBackoff"]

Send = Callable[[int, int, bytes], bool]  #: (rank, lane, message): False when that socket is not connected


class RestartBackoff:
    """When a rank's worker may be started again. A worker that exits before its hello (its
    store unreachable, say) is started again after 0.25 s, then twice as long each time, up
    to 5 s: a worker that cannot come up costs a start every 5 s, not a busy loop. A hello
    ends the back-off: the next death restarts at once."""

    FIRST_S, MAX_S = 0.25, 5.0
    _NEVER = (0.0, 0)  # a rank never started: (last start, starts since its last hello)

    def __init__(self) -> None:
        self._starts: dict[int, tuple[float, int]] = {}  # rank -> (last start, starts since its last hello)

    def started(self, rank: int, now: float) -> None:
        self._starts[rank] = (now, self._starts.get(rank, self._NEVER)[1] + 1)

    def hello(self, rank: int) -> None:
        """``rank``'s worker came up: its next start waits only from its last start."""
        self._starts[rank] = (self._starts.get(rank, self._NEVER)[0], 0)

    def delay(self, rank: int) -> float:
        """Seconds from ``rank``'s last start to its next."""
        starts = self._starts.get(rank, self._NEVER)[1]
        return min(self.MAX_S, self.FIRST_S * 2 ** max(0, starts - 1))

    def may_start(self, rank: int, now: float) -> bool:
        return now - self._starts.get(rank, self._NEVER)[0] >= self.delay(rank)


class RankControl:
    """Liveness and worker processes of one driver's ranks (its I/O thread runs :meth:`serve`).

    ``lock`` is the driver's ledger's: the rank table (``ranks``) and ``counters`` change under it
    only."""

    def __init__(self, spec: CacheSpec, geometry: str, *, heartbeat_s: float, dead_after_s: float, restart: bool,
                 ranks: RankTable, lock: threading.Lock, counters: dict[str, int], send: Send,
                 on_down: Callable[[int, list[int], str, bool], None], on_up: Callable[[int], None],
                 on_arrived: Callable[[int, int, int, int], None], name: str, secret: str = "") -> None:
        self.spec, self.geometry, self.name = spec, geometry, name
        self.secret = secret  #: what every hello must carry: made by the driver for this start
        self.heartbeat_s, self.dead_after_s, self.restart = heartbeat_s, dead_after_s, restart
        self.lock, self.counters, self._send = lock, counters, send
        self._on_down, self._on_up, self._on_arrived = on_down, on_up, on_arrived
        self.ranks = ranks
        self.children: dict[int, ChildProcess] = {}
        self._configs: dict[int, WorkerConfig] = {}
        self._logs: dict[int, str | None] = {}
        self.backoff = RestartBackoff()
        self._notices: list[RankDown | RankUp] = []
        self.running = True
        self.stopping = False

    # -- worker processes -----------------------------------------------------------------------
    def spawn(self, cfg: WorkerConfig, log_path: str | None = None) -> ChildProcess:
        """Start ``cfg``'s worker as a child process (restarted if it dies, with ``restart``,
        appending to the same ``log_path``)."""
        old = self.children.get(cfg.rank)
        if old is not None and old.alive():
            raise ConfigError(f"{self.name}: rank {cfg.rank} already has a worker (pid {old.pid})")
        public = dataclasses.replace(cfg, secret="")  # a command line is readable by every user: not there
        child = ChildProcess("kvstate.distributed", ["rankworker", public.to_json()],
                             f"{self.name} rank {cfg.rank} worker", log_path=log_path,
                             env={**os.environ, SECRET_ENV: cfg.secret})
        self.children[cfg.rank], self._configs[cfg.rank], self._logs[cfg.rank] = child, cfg, log_path
        self.backoff.started(cfg.rank, time.monotonic())
        return child

    def wait_ready(self, timeout: float) -> None:
        """Wait until every rank is up; a refused worker, or a started one that exited before
        its hello, is a ConfigError naming it; a rank still silent at ``timeout`` a DriverError."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                refused, down = self.ranks.refusals(), self.ranks.down()
            if refused:
                raise ConfigError(f"{self.name}: {refused[0]}")
            if not down:
                return
            for r in down:
                c = self.children.get(r)
                if c is not None and not c.alive() and not self.restart:
                    raise ConfigError(f"{self.name}: rank {r}'s worker exited with status {c.returncode} before "
                                      "it said hello (see its stderr)")
            if time.monotonic() >= deadline:
                raise DriverError(f"{self.name}: ranks {down} did not say hello within {timeout} s")
            time.sleep(0.01)

    def restarting(self, rank: int) -> bool:
        """Whether a worker for ``rank`` is on its way: one this driver started (and restarts)."""
        return self.restart and not self.stopping and rank in self._configs

    def lanes(self, rank: int) -> int:
        """The lanes of ``rank``'s worker (that of a started one, else as its last hello said)."""
        cfg = self._configs.get(rank)
        return cfg.lanes if cfg is not None else max(1, self.ranks.lanes(rank))

    def notices(self) -> list[RankDown | RankUp]:
        with self.lock:
            out, self._notices = self._notices, []
        return out

    def stop_children(self, deadline: float) -> None:
        """Let each started worker exit by ``deadline`` (after its STOP), then kill what is left."""
        for child in self.children.values():
            child.wait(max(0.0, deadline - time.monotonic()))
        for child in self.children.values():
            child.stop(max(0.0, min(2.0, deadline - time.monotonic())))

    # -- the I/O thread ---------------------------------------------------------------------------
    def serve(self, sock: zmq.Socket) -> None:
        """Read the control channel and judge liveness until :attr:`running` is False."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        tick = min(0.05, self.heartbeat_s / 2)
        while self.running:
            try:
                if poller.poll(int(1000 * tick)):
                    for _ in range(1024):
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.receive(data)
                self._check()
            except zmq.ZMQError:
                if not self.running:
                    return
                raise

    def receive(self, data: bytes) -> None:
        """Act on one message of the control channel, as the I/O thread reads it: a hello, a
        heartbeat, a layer arrival or a goodbye; anything else is counted and dropped."""
        try:
            msg = wire.from_worker(data)
            if not msg.rank < self.spec.tp_size or isinstance(msg, wire.Done):
                raise ProtocolError(f"the control channel takes no DONE, and ranks below {self.spec.tp_size}")
        except KVStateError:
            with self.lock:
                self.counters["bad_messages"] += 1
            return
        if isinstance(msg, wire.Beat):
            self._beat(msg)
        elif isinstance(msg, wire.Arrived):
            self._on_arrived(msg.rank, msg.incarnation, msg.command_id, msg.layers)
        elif isinstance(msg, wire.Hello):
            self._hello(msg)
        elif isinstance(msg, wire.Bye):
            self.declare_down(msg.rank, f"its worker said goodbye ({msg.reason})", msg.incarnation)

    def _beat(self, msg: wire.Beat) -> None:
        with self.lock:
            current = self.ranks.incarnation(msg.rank)
            if current == msg.incarnation:
                self.ranks.seen(msg.rank, time.monotonic(), msg.bytes_moved, msg.counts)
                return
            self.counters["stale"] += 1
            rejoin = not current and not self.ranks.refusals() and not self.stopping
        if rejoin:  # a worker declared dead that lives on (it was stopped): it says hello anew
            self._send(msg.rank, 0, wire.pack(wire.REJOIN, msg.incarnation))

    def _hello(self, msg: wire.Hello) -> None:
        """Welcome a worker for a rank that has none, or refuse it (its TP or geometry differ).

        A hello for a rank whose worker is live (another incarnation) changes nothing: it is
        dropped and counted (``foreign_hellos``), never answered, since a reply goes down the
        rank's route, which leads to the live worker; that worker is never replaced or told to
        exit by a message it did not ask for. A new worker for the rank is welcome once the
        live one is down (silent past ``dead_after_s``, gone, or said goodbye)."""
        if not hmac.compare_digest(msg.secret.encode(), self.secret.encode()):
            with self.lock:  # not a worker of this start: dropped, counted, never answered
                self.counters["unauthenticated_hellos"] += 1
            return
        previous = self.ranks.incarnation(msg.rank)
        if previous == msg.incarnation:
            return  # a repeated hello the welcome crossed
        if previous:
            with self.lock:
                self.counters["foreign_hellos"] += 1
            return
        problem = None
        if msg.tp_size != self.spec.tp_size:
            problem = f"rank {msg.rank}'s worker has TP {msg.tp_size}, the scheduler {self.spec.tp_size}"
        elif msg.geometry != self.geometry:
            problem = (f"rank {msg.rank}'s worker has another cache geometry: {msg.geometry} against the "
                       f"scheduler's {self.geometry}")
        if problem is not None:  # the refusal names the incarnation it refuses: no other worker obeys it
            with self.lock:
                self.counters["refused"] += 1
                self.ranks.refuse(msg.rank, problem)
            self._send(msg.rank, 0, wire.pack(wire.REFUSE, msg.incarnation, problem))
            return
        welcome = wire.pack(wire.WELCOME, msg.incarnation)
        if not all(self._send(msg.rank, lane, welcome) for lane in reversed(range(msg.lanes))):
            return  # a lane's socket is not connected yet: it says hello again next beat
        with self.lock:
            self.ranks.up(msg.rank, msg.incarnation, msg.pid, time.monotonic(), msg.lanes)
            self._notices.append(RankUp(msg.rank, msg.pid, time.monotonic()))
        self.backoff.hello(msg.rank)  # it started well: no back-off
        self._on_up(msg.rank)

    def _check(self) -> None:
        now = time.monotonic()
        with self.lock:
            live = self.ranks.live()
        for rank, inc, last in live:
            child = self.children.get(rank)
            if child is not None and not child.alive():
                self.declare_down(rank, f"its worker process exited (status {child.returncode})", inc)
            elif now - last > self.dead_after_s:
                self.declare_down(rank, f"no heartbeat for {now - last:.2f} s", inc)
        if self.restart and not self.stopping:
            for rank, child in list(self.children.items()):
                if not child.alive() and not self.ranks.incarnation(rank) and rank in self._configs \
                        and self.backoff.may_start(rank, now):
                    self.spawn(self._configs[rank], self._logs[rank])
                    with self.lock:
                        self.counters["restarts"] += 1

    def declare_down(self, rank: int, reason: str, incarnation: int) -> None:
        """``rank`` (at ``incarnation``; a later one is left alone) is down: what it owed is
        answered. A worker this driver started is killed and reaped first (with ``restart``, or
        when it exited anyway): it can touch no block any more, so its answers are plain
        failures. Any other may only be stopped: its answers are *lost*, and the lifecycle keeps
        their blocks pinned until their fences."""
        with self.lock:
            if self.ranks.incarnation(rank) != incarnation:
                return
            owed = self.ranks.down_now(rank)
            self._notices.append(RankDown(rank, reason, time.monotonic()))
        child = self.children.get(rank)
        dead = False
        if child is not None and (self.restart or not child.alive()):
            child.kill()  # reaped: a stopped worker dies too
            dead = True
        self._on_down(rank, owed, f"rank {rank} lost: {reason}", not dead)

    def info(self) -> dict[str, Any]:
        with self.lock:
            return {"up": [r for r, _, _ in self.ranks.live()], "down": self.ranks.down(),
                    "pids": {r: c.pid for r, c in self.children.items() if c.alive()}}

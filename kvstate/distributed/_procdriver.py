"""The cross-process driver: each transfer command goes to every rank worker's process.

:class:`ProcessDriver` has :class:`~kvstate.backends._drivers.ThreadedDriver`'s interface
(``submit``, ``submit_all``, ``poll``, ``arrivals``, ``inflight``, ``close``), so an engine
loop changes one line; rank workers (:mod:`~kvstate.distributed._rankworker`) run each rank's
part in their own process. Its rules:

- **Transport.** ZeroMQ: commands leave on a ROUTER socket (one DEALER per rank worker, in
  the order submitted). Answers come back on a *reply* PULL socket that ``poll`` reads in
  the engine's own thread, so an answer crosses no Python thread on its way; hellos,
  heartbeats, layer arrivals and goodbyes come on a *control* socket read by the driver's
  I/O thread (:mod:`~kvstate.distributed._control`), so liveness is judged while the engine
  is busy. A send blocks while a rank's bounded queue is full (back-pressure), for at most
  ``submit_timeout``.
- **Liveness.** A rank is *up* from its accepted hello until it is silent past
  ``dead_after_s``, says goodbye, or (a worker this driver started) its process exits. Then it
  is *down*: each command it had not answered completes at once as failed (count 0: the
  lifecycle fails or recomputes per policy), its layer arrivals close, and
  :meth:`ProcessDriver.notices` reports :class:`~kvstate.distributed._liveness.RankDown`. A
  worker this driver started is killed and reaped first (``restart``, the default) and started
  again; when the new incarnation says hello the rank is up again, with no restart of the
  scheduler. A worker that may only be stopped (not started here, or ``restart=False``) could
  still touch blocks: its answers are *lost* (``Completion.lost``), and the lifecycle keeps
  their blocks pinned until the commands' fences. A command submitted while its rank is down
  waits for it when its worker is being restarted (and fails, unsent, if its fence passes
  first); with no restart coming it fails for that rank at once.
- **Stale and bad answers.** An answer from another incarnation than the rank's current one,
  or for a command the rank no longer owes (answered already, or lost), is counted
  (``counters["stale"]``) and dropped; a message that does not parse or breaks a rule is
  counted (``bad_messages``). None of them reach the lifecycle.
- **Reads armed ahead.** An :class:`~kvstate.commands.ArmRead` goes to each of its ranks that
  is up (``ARM``); the driver lets it go (``DISARM``) as
  :mod:`~kvstate.backends._arming` says. A worker whose backend cannot prepare the read
  ignores both; a worker that goes down loses what it prepared with its process.
- **Time.** Deadlines and fences cross as absolute ``time.monotonic()`` seconds: the
  lifecycle must run on that clock (its default), which the host's processes share.
"""
from __future__ import annotations

import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import zmq

from .. import commands as C
from .._errors import ConfigError, DriverError, KVStateError, ProtocolError
from .._spec import CacheSpec
from .._validate import MAX_BLOCKS, check_int, check_name
from ..backends._arming import Armed, ArmedReads
from ..backends._drivers import Driver, check_arm, check_commands, check_ranks, check_timeout
from ..backends._gate import LayerArrivals
from ..events import Completion
from ..kernels._cuda_launch import wait_event
from . import _wire as wire
from ._control import RankControl
from ._ledger import Ledger, Send
from ._liveness import RankDown, RankTable, RankUp
from ._rankworker import WorkerConfig
from ._supervise import ChildProcess, remove_orphans

__all__ = ["ProcessDriver"]


class ProcessDriver(Driver):
    """Runs transfer commands on rank worker processes; the engine polls the completions.

    ``address``: ``"ipc"`` (Unix sockets in a private temporary directory, the default) or
    ``"tcp://HOST"`` (ports chosen by the system). Start workers with :meth:`spawn` (a child
    process each, owned by this driver) or give :meth:`worker_config` to a worker an engine
    hosts in a process of its own; then :meth:`wait_ready`."""

    def __init__(self, spec: CacheSpec, num_blocks: int, *, address: str = "ipc", heartbeat_s: float = 0.2,
                 dead_after_s: float = 2.0, restart: bool = True, submit_timeout: float = 30.0,
                 spin_us: float = 200.0, name: str = "kvstate", num_states: int = 0) -> None:
        if not isinstance(spec, CacheSpec):
            raise ConfigError("ProcessDriver: spec must be a CacheSpec")
        check_int(num_blocks, "ProcessDriver: num_blocks", minimum=1, maximum=MAX_BLOCKS, error=ConfigError)
        check_int(num_states, "ProcessDriver: num_states", minimum=0, maximum=MAX_BLOCKS, error=ConfigError)
        check_name(name, "ProcessDriver: name", error=ConfigError)
        if restart.__class__ is not bool:
            raise ConfigError(f"ProcessDriver: restart must be a bool, got {restart!r}")
        spec.check_num_states("ProcessDriver", num_states)  # the workers' state pages
        self.num_states = num_states  #: state pages a rank (state groups): every worker's must match
        for what, v in (("heartbeat_s", heartbeat_s), ("dead_after_s", dead_after_s),
                        ("submit_timeout", submit_timeout)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 3600:
                raise ConfigError(f"ProcessDriver: {what} must be seconds in (0, 3600), got {v!r}")
        if dead_after_s <= 2 * heartbeat_s:
            raise ConfigError(f"ProcessDriver: dead_after_s ({dead_after_s}) must exceed two heartbeats "
                              f"({2 * heartbeat_s}), or a live rank could be declared dead")
        self.spec, self.num_blocks, self.name = spec, num_blocks, name
        self.heartbeat_s = heartbeat_s
        if not isinstance(spin_us, (int, float)) or isinstance(spin_us, bool) or not 0 <= spin_us <= 1e5:
            raise ConfigError(f"ProcessDriver: spin_us must be microseconds in [0, 100000], got {spin_us!r}")
        self.spin_us = float(spin_us)  #: how long a waiting poll asks the socket before it sleeps
        self.counters = {"stale": 0, "bad_messages": 0, "refused": 0, "foreign_hellos": 0, "unauthenticated_hellos": 0,
                         "lost": 0, "restarts": 0}
        #: made for this start: a worker's hello must carry it (worker_config passes it on)
        self.secret = secrets.token_hex(16)
        ranks = RankTable(spec.tp_size)
        self.ledger = Ledger(ranks, spec.layers, lambda r: self.control.restarting(r), self.counters)
        self._lock = self.ledger.lock  # rank states, what they owe, counters
        self._send_lock = threading.Lock()  # the command socket (used by the engine and the I/O thread)
        self._poll_lock = threading.Lock()  # the reply socket: one poll at a time
        self._wake_lock = threading.Lock()
        self._done: queue.Queue[Completion] = queue.Queue()  # answers made here: lost, or refused at once
        self._closed = False
        self._armed = ArmedReads()  # reads armed at reservation; the workers let them go on close
        self._tmp: str | None = None
        self._ctx = zmq.Context()
        try:
            self._bind(address, submit_timeout)
        except BaseException:
            self._close_sockets()
            raise
        self.control = RankControl(spec, wire.geometry(spec, num_blocks, num_states), heartbeat_s=heartbeat_s,
                                   dead_after_s=dead_after_s, restart=bool(restart), ranks=ranks, lock=self._lock,
                                   counters=self.counters, send=self._send, on_down=self._lose_all,
                                   on_up=self._rank_up, on_arrived=self.ledger.arrived, name=f"ProcessDriver {name}",
                                   secret=self.secret)
        self._io = threading.Thread(target=self.control.serve, args=(self._control,), name=f"{name}-driver-io",
                                    daemon=True)
        self._io.start()
        self._layer_jobs: queue.Queue[Any] = queue.Queue()
        self._watcher: threading.Thread | None = None

    # -- sockets ----------------------------------------------------------------------------------
    def _bind(self, address: str, submit_timeout: float) -> None:
        if address == "ipc":
            remove_orphans(tempfile.gettempdir(), "kvstate-ipc-")
            self._tmp = tempfile.mkdtemp(prefix=f"kvstate-ipc-{os.getpid()}-")
            targets = tuple(f"ipc://{self._tmp}/{n}" for n in ("cmd", "reply", "control"))
        elif isinstance(address, str) and address.startswith("tcp://") and address.count(":") == 1:
            targets = (f"{address}:*",) * 3
        else:
            raise ConfigError(f"ProcessDriver: address must be 'ipc' or 'tcp://HOST' (ports are chosen), got "
                              f"{address!r}")
        self._cmd = self._ctx.socket(zmq.ROUTER)
        self._reply, self._control = self._pull(), self._pull()
        #: over tcp, the sockets' CURVE public key (Z85): a worker must know it to connect, and
        #: everything on the wire is encrypted (the secret in a hello included); "" over ipc,
        #: whose socket directory only this user can open
        self.curve_key = ""
        if targets[0].startswith("tcp://"):
            self.curve_key = self._curve((self._cmd, self._reply, self._control))
        # Commands only leave on it: no worker sends here (a DEALER's identity, at most 255 bytes,
        # is all that comes in), so a peer sending more is disconnected (MAXMSGSIZE 256) and
        # nothing queues (RCVHWM 1): a flood of frames here cannot grow this process's memory.
        for opt, v in ((zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1), (zmq.SNDHWM, 4096), (zmq.LINGER, 0),
                       (zmq.SNDTIMEO, int(1000 * submit_timeout)), (zmq.MAXMSGSIZE, 256), (zmq.RCVHWM, 1)):
            self._cmd.setsockopt(opt, v)
        if self.curve_key:  # a CURVE handshake's INITIATE (a key, a vouch, the metadata) is larger
            self._cmd.setsockopt(zmq.MAXMSGSIZE, 1024)
        # answers made in other threads (lost ranks) wake a waiting poll through this pair
        self._wake_in, self._wake_out = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
        self._wake_in.bind(f"inproc://kvstate-wake-{id(self)}")
        self._wake_out.connect(f"inproc://kvstate-wake-{id(self)}")
        try:
            for sock, target in zip((self._cmd, self._reply, self._control), targets):
                sock.bind(target)
        except zmq.ZMQError as e:
            raise ConfigError(f"ProcessDriver: cannot listen on {address!r} ({e})") from None
        #: (command, reply, control) endpoints: what a worker connects to
        self.addresses = tuple(sock.getsockopt_string(zmq.LAST_ENDPOINT)
                               for sock in (self._cmd, self._reply, self._control))
        self._poller = zmq.Poller()
        self._poller.register(self._reply, zmq.POLLIN)
        self._poller.register(self._wake_in, zmq.POLLIN)

    @staticmethod
    def _curve(socks: tuple[zmq.Socket, ...]) -> str:
        """Make ``socks`` CURVE servers under one keypair made for this start; its public key."""
        if not zmq.has("curve"):
            raise ConfigError("ProcessDriver: tcp needs ZeroMQ's CURVE encryption, which this pyzmq lacks "
                              "(use address 'ipc' on one host)")
        public, secret = zmq.curve_keypair()
        for sock in socks:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        return public.decode()

    def _pull(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def _send(self, rank: int, lane: int, data: bytes) -> bool:
        """Send to a lane of ``rank``'s worker; False when that lane's socket is not connected."""
        with self._send_lock:
            try:
                self._cmd.send_multipart((f"r{rank}:{lane}".encode(), data))
                return True
            except zmq.Again:
                raise DriverError(f"ProcessDriver: rank {rank} took no command for the submit timeout: its queue "
                                  "is full (back-pressure) or it is stuck") from None
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    return False
                raise DriverError(f"ProcessDriver: sending to rank {rank} failed ({e})") from None

    def _wake(self) -> None:
        """Wake a poll waiting for answers (from any thread)."""
        with self._wake_lock:
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # -- workers ---------------------------------------------------------------------------------
    def worker_config(self, rank: int, store: dict[str, Any], **kw: Any) -> WorkerConfig:
        """The configuration of ``rank``'s worker for this driver (``kw``: :class:`WorkerConfig`
        fields, e.g. ``caches``, ``backend``, ``host_blocks``, ``lanes``). The worker watches
        this process as its parent and exits when it is gone, as a worker :meth:`spawn` started
        must; one hosted anywhere else (in this process's threads, or an engine's process)
        takes ``parent_pid=0``: its host stops it."""
        spec = {f: getattr(self.spec, f) for f in self.spec.__dataclass_fields__}
        fields: dict[str, Any] = {"parent_pid": os.getpid(), **kw}
        cfg = WorkerConfig(rank=rank, spec=spec, num_blocks=self.num_blocks, command_address=self.addresses[0],
                           reply_address=self.addresses[1], control_address=self.addresses[2], store=store,
                           heartbeat_s=self.heartbeat_s, num_states=self.num_states, secret=self.secret,
                           curve_key=self.curve_key, **fields)
        cfg.validate()
        return cfg

    def spawn(self, rank: int, store: dict[str, Any], log_path: str | os.PathLike[str] | None = None,
              **kw: Any) -> ChildProcess:
        """Start ``rank``'s worker as a child process this driver owns (restarted if it dies,
        with ``restart``; stopped by :meth:`close`). ``log_path``: a file its output goes to."""
        if self._closed:
            raise DriverError("ProcessDriver: spawn after close")
        return self.control.spawn(self.worker_config(rank, store, **kw), None if log_path is None else str(log_path))

    def child(self, rank: int) -> ChildProcess | None:
        """The worker process this driver started for ``rank`` (tests signal it)."""
        return self.control.children.get(rank)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until every rank is up (see :meth:`RankControl.wait_ready`)."""
        self.control.wait_ready(timeout)

    def notices(self) -> list[RankDown | RankUp]:
        """Ranks that went down or came up since the last call, oldest first."""
        return self.control.notices()

    def bytes_moved(self) -> int:
        """Payload bytes the workers' backends moved to and from the store, as of their last
        heartbeats (one heartbeat behind at most)."""
        with self._lock:
            return self.control.ranks.bytes_moved()

    def store_faults(self) -> dict[str, int]:
        """Store faults its rank workers reported (every incarnation, one heartbeat behind at
        most): ``broken`` blocks a read found corrupt (evicted), ``short`` reads that stopped
        before their last key (one missing), ``failed`` operations (an error answer)."""
        with self._lock:
            return dict(zip(wire.STORE_FAULTS, self.control.ranks.counts()))

    # -- the ThreadedDriver interface -------------------------------------------------------------
    def submit(self, cmd: C.Command) -> bool:
        """Send a transfer command to its ranks (True), forward a cancel or a layer report
        (True), send a read announced ahead to be armed (True), or ignore a notice (False)."""
        if self._closed:
            raise DriverError("ProcessDriver: submit after close")
        kind = C.kind_of(cmd)
        if kind == "cancel" or kind == "layers":
            self._forward(cast("C.CancelCommand | C.LayersReady", cmd))
            return True
        if kind == "arm":
            self._arm(cast(C.ArmRead, cmd))
            return True
        if kind not in C.TRANSFER_KINDS:
            if self._armed and cmd.__class__ is C.RequestEnded:
                self._let_go(self._armed.ended(cmd.request_id))
            return False
        cmd = cast(C.TransferCommand, cmd)
        check_ranks(cmd, self.spec.tp_size, "ProcessDriver.submit")
        if self._armed:
            self._let_go(self._armed.read(cmd))
        sends, down = self.ledger.register(cmd)
        for r in down:
            self._done.put(Completion(cmd.command_id, r, 0, error=f"rank {r} is down"))
        if down:
            self._wake()
        self._send_all(sends, "rank {} lost: its worker is not connected")
        return True

    def armed_reads(self) -> dict[str, int]:
        """Reads announced at reservation and sent to at least one rank to arm, those whose
        read came as announced (``matched``), and those let go unread, since the start; and,
        as the workers' last heartbeats said, the ranks' reads their backends armed
        (``ranks_armed``: a backend that cannot arm arms none) and fired (``ranks_fired``)."""
        with self._lock:
            armed, fired = self.control.ranks.counts()[len(wire.STORE_FAULTS):]
        return {**self._armed.counts, "ranks_armed": armed, "ranks_fired": fired}

    def _arm(self, cmd: C.ArmRead) -> None:
        """Send the read ``cmd`` announces to each of its ranks that is up, to prepare if its
        backend can (:mod:`kvstate.backends._arming`); a rank that is down prepares nothing."""
        check_arm(cmd, self.spec.tp_size, "ProcessDriver.submit")
        if cmd.deadline <= time.monotonic():
            return  # its first token is already late: nothing to prepare
        self._let_go(self._armed.ended(cmd.request_id))  # armed again: the older one first
        sent = []
        for r in cmd.ranks:
            inc = self.control.ranks.incarnation(r)
            if inc and self._send(r, 0, wire.arm_message(cmd, inc)):
                sent.append(r)
        self._armed.note(cmd, tuple(sent))

    def _let_go(self, armed: Armed | None) -> None:
        if armed is not None:
            for r in armed.ranks:
                inc = self.control.ranks.incarnation(r)
                if inc:  # a rank that went down lost what it armed with its process
                    self._send(r, 0, wire.disarm_message(armed.keys, inc))

    def _send_all(self, sends: list[Send], unreachable: str) -> None:
        for r, lane, cid, data in sends:
            if not self._send(r, lane, data):
                self._lose(r, cid, unreachable.format(r), lost=False)

    def _rank_up(self, rank: int) -> None:
        """``rank`` is up again: send it the commands held for it (those whose fence passed
        meanwhile fail, unsent: the lifecycle gave up on them)."""
        sends, expired = self.ledger.release_held(rank)
        for cid in expired:
            self._lose(rank, cid, f"rank {rank} was down until the command's fence", lost=False)
        self._send_all(sends, "rank {} lost again before its held commands went out")

    def submit_all(self, cmds: Iterable[C.Command]) -> list[C.Command]:
        """Submit every command; returns the notices, which the caller handles. A list holding
        anything but commands is refused whole, before any is taken."""
        return [c for c in check_commands(cmds, "ProcessDriver.submit_all") if not self.submit(c)]

    def poll(self, timeout: float = 0.0) -> list[Completion]:
        """Completions ready now (waiting up to ``timeout`` seconds for the first one): the
        workers' answers, read here in the caller's thread, and the lost ones. A wait first
        spins for up to ``spin_us`` (asking the socket without sleeping), then sleeps in the
        socket's poll: waking a sleeping thread costs more than a short answer takes."""
        timeout = check_timeout(timeout, "ProcessDriver.poll")
        with self._poll_lock:
            out = self._drain()
            deadline = time.monotonic() + timeout
            spin_until = time.perf_counter() + min(timeout, self.spin_us / 1e6)
            while not out and self.ledger.inflight and time.perf_counter() < spin_until:
                out = self._drain()
            while not out and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or not self._poller.poll(max(1, int(1000 * left))):
                    break
                out = self._drain()
            return out

    def _drain(self) -> list[Completion]:
        out: list[Completion] = []
        for _ in range(4096):
            try:
                data = self._reply.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            c = self._answer(data)
            if c is not None:
                out.append(c)
        try:
            while True:
                self._wake_in.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass
        try:
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return out

    def _answer(self, data: bytes) -> Completion | None:
        """A worker's answer as a completion, or None (counted) for a bad or stale one."""
        try:
            msg = wire.from_worker(data)
            if not isinstance(msg, wire.Done) or not msg.rank < self.spec.tp_size:
                raise ProtocolError("the reply channel takes DONE messages of known ranks only")
        except KVStateError:
            with self._lock:
                self.counters["bad_messages"] += 1
            return None
        return self.ledger.answered(msg)

    def arrivals(self, command_id: int, rank: int = 0) -> LayerArrivals | None:
        """The layer arrivals of a submitted :class:`~kvstate.commands.LoadLayers` on ``rank``
        (None once it answered, or for another command). Layers arrive already in place:
        the worker waited for its device before reporting them."""
        return self.ledger.arrivals(command_id, rank)

    @property
    def inflight(self) -> int:
        """(command, rank) answers not yet delivered to ``poll``."""
        return self.ledger.inflight

    # -- lost answers, cancels and layer reports ------------------------------------------------------
    def _lose_all(self, rank: int, owed: list[int], reason: str, lost: bool) -> None:
        for cid in owed:
            self._lose(rank, cid, reason, lost)

    def _lose(self, rank: int, command_id: int, reason: str, lost: bool) -> None:
        c = self.ledger.lost(rank, command_id, reason, lost)
        if c is not None:
            self._done.put(c)
            self._wake()

    def _forward(self, cmd: C.CancelCommand | C.LayersReady) -> None:
        if isinstance(cmd, C.LayersReady) and cmd.event is not None:
            self._watch(cmd)
            return
        if isinstance(cmd, C.CancelCommand):
            for r in self.ledger.drop_held(cmd.command_id):  # held for a restart: answered, never sent
                self._lose(r, cmd.command_id, "cancelled while its rank restarted", lost=False)
        for r, inc, lane in self.ledger.owing(cmd.command_id):  # on the lane of the command, after it
            if inc and lane is not None:
                self._send(r, lane, wire.pack(wire.LAYERS, inc, cmd.command_id, cmd.layers)
                           if isinstance(cmd, C.LayersReady) else wire.pack(wire.CANCEL, inc, cmd.command_id))

    def _watch(self, report: C.LayersReady) -> None:
        """A report of launched layers: another process cannot wait on this one's device
        event, so a watcher thread waits for it and forwards the layers as finished."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_events, name=f"{self.name}-layer-events", daemon=True)
            self._watcher.start()
        self._layer_jobs.put(report)

    def _watch_events(self) -> None:
        while True:
            report = self._layer_jobs.get()
            if report is None:
                return
            try:
                wait_event(report.event, what=f"the layers of command {report.command_id}")
            except Exception:  # noqa: BLE001 - a failed or lost event: its layers are never reported, the save stops
                continue
            if not self._closed:
                self._forward(C.LayersReady(report.request_id, report.command_id, report.layers))

    # -- closing --------------------------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Stop every worker and join it (and the driver's threads) within ``timeout``; answers
        still owed are not delivered any more."""
        check_timeout(timeout, "ProcessDriver.close")
        if self._closed:
            return
        self._closed = True
        self.control.stopping = True
        deadline = time.monotonic() + timeout
        for r in range(self.spec.tp_size):
            for lane in range(self.control.lanes(r)):
                try:
                    self._send(r, lane, wire.pack(wire.STOP))
                except DriverError:
                    pass
        self.control.stop_children(deadline)
        self.control.running = False
        self._io.join(max(0.1, deadline - time.monotonic()))
        if self._watcher is not None:
            self._layer_jobs.put(None)
            self._watcher.join(max(0.1, deadline - time.monotonic()))
        if self._io.is_alive():
            raise DriverError(f"ProcessDriver.close: its I/O thread still runs after {timeout} s")
        self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("_cmd", "_reply", "_control", "_wake_in", "_wake_out"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> ProcessDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

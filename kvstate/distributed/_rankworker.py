"""A rank worker: the process that runs one TP rank's part of every transfer command.

As in the seeds' system (a cache-transfer process per TP rank), a rank worker owns its rank's
backend: the caches it attaches to (shared memory another process created, or CUDA memory
shared through IPC), its staging and host-tier buffers, and its store client. It talks to
the scheduler's driver (:mod:`~kvstate.distributed._procdriver`) over ZeroMQ:

- a worker has ``lanes`` threads, each with its own DEALER socket (named ``r{rank}:{lane}``);
  the driver gives each command to the lane with the fewest unanswered, and a lane runs
  what it receives itself, in order, so a command crosses no thread on its way (a thread
  handoff costs tens of microseconds on a busy host). A layer-wise save, which waits for
  its prefill's layer reports, goes to a pool thread instead, so its lane goes on reading:
  the reports (and cancels) come on the lane of their command, after it;
- each answer (``DONE``) goes back on the lane's own PUSH socket to the driver's reply
  channel; heartbeats (``HB``, every ``heartbeat_s``, from the serving thread), hellos, layer
  arrivals and goodbyes go to its control channel;
- a busy lane reads nothing: its bounded socket queues fill and the driver's sends block, so
  a slow rank pushes back instead of growing memory;
- an ``ARM`` prepares the announced read on the backend (``arm_pull``, until its deadline and
  at most ``MAX_ARM_S``), a ``DISARM`` lets it go; a backend that cannot prepare reads
  answers False to both, and the read runs as it comes. An ``ARM`` whose request's read
  already arrived (on another lane) arms nothing.

A worker draws a new incarnation each time it says hello; a command naming another is from
before a restart and is dropped. It exits on ``STOP``, on a ``REFUSE`` of its own incarnation
(its configuration does not match the scheduler's; a refusal of another incarnation is stale),
when its parent process is gone (``parent_pid``; on Linux the kernel also kills it when its
parent dies), or on SIGTERM. A message it cannot parse is counted and dropped. Run one with
:func:`main` (``python -m kvstate.distributed rankworker CONFIG_JSON``) or, inside a process an
engine already runs, ``RankWorker(config).serve()``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq

from .. import commands as C
from .._errors import ConfigError, KVStateError, ProtocolError
from .._spec import CacheSpec
from .._validate import MAX_BLOCKS, check_int, is_real
from ..backends._base import Store, TransferBackend
from ..backends._lends import LendBoard
from ..backends._runner import CommandRunner
from ..kernels._cuda_launch import wait_event
from . import _wire as wire
from ._supervise import die_with_parent, parent_alive

SECRET_ENV = "KVSTATE_WORKER_SECRET"  #: where a started worker finds its driver's secret

__all__ = ["WorkerConfig", "RankWorker", "main", "build_store", "SECRET_ENV"]

_STORES = ("arena", "file", "mooncake")
MAX_ARM_S = 600.0  #: the longest a read stays armed, whatever deadline its message names
MAX_READS_KEPT = 4096  #: requests whose read arrived, remembered so that a late ARM arms nothing
MAX_LENDS = 64  #: lends a rank worker holds at once, each on a thread (mostly asleep) while D pulls
_CACHES = ("own", "shm", "cuda-ipc")
#: the caches each backend can hold: the reference backend's are host memory, CUDA's GPU memory
_HOLDS = {"reference": ("own", "shm"), "cuda": ("own", "cuda-ipc")}


@dataclass
class WorkerConfig:
    """Everything a rank worker needs, as JSON-able data (it crosses a process boundary).

    ``store``: ``{"kind": "file", "root": DIR}`` (and ``"capacity_bytes"`` to bound this
    worker's objects) or ``{"kind": "mooncake", ...}`` (the fields of
    :class:`~kvstate.backends._mooncake.MooncakeConfig`). ``caches``: ``{"kind": "shm", "paths":
    {rank: file}}`` (:class:`~kvstate.backends._shm.SharedCaches`), ``{"kind": "cuda-ipc",
    ...}`` (:mod:`~kvstate.backends._cudaipc`) or ``{"kind": "own"}`` (zeroed caches of its
    own: benchmarks of the transport alone); ``shm`` goes with the ``reference`` backend and
    ``cuda-ipc`` with ``cuda`` (host memory and GPU memory). ``num_states``: state pages, for a
    spec with state groups (in the shared file with ``shm``; beside the caches with ``cuda-ipc``)."""

    rank: int
    spec: dict[str, Any]
    num_blocks: int
    command_address: str
    reply_address: str
    control_address: str
    store: dict[str, Any]
    caches: dict[str, Any] = field(default_factory=lambda: {"kind": "own"})
    backend: str = "reference"
    device: int = 0
    host_blocks: int = 0
    num_states: int = 0
    lanes: int = 4
    heartbeat_s: float = 0.2
    parent_pid: int = 0
    #: the driver's per-start secret its hello must carry (``ProcessDriver.secret``); a worker the
    #: driver starts gets it from ``KVSTATE_WORKER_SECRET`` instead, never on its command line
    secret: str = ""
    #: the driver's CURVE public key (Z85, 40 characters) over tcp, "" over ipc: the worker
    #: connects as a CURVE client with a keypair of its own (``ProcessDriver.curve_key``)
    curve_key: str = ""
    #: the direct handoff (:mod:`kvstate.backends._lends`): the lend board's directory to lend
    #: blocks on (P) and to pull reads from (D), "" for none; how long a pull looks for a lend
    lends: str = ""
    pulls: str = ""
    pull_wait: float = 0.5

    def __post_init__(self) -> None:
        self.validate()  # a config that exists is valid: refused where it is made, not in the worker

    def validate(self) -> CacheSpec:
        """Check every field; returns the cache spec it describes."""
        if not isinstance(self.spec, dict):
            raise ConfigError("WorkerConfig.spec must be a dict of CacheSpec fields")
        try:
            spec = CacheSpec.from_dict(self.spec)
        except ConfigError as e:
            raise ConfigError(f"WorkerConfig.spec: {e}") from None
        check_int(self.rank, "WorkerConfig.rank", minimum=0, error=ConfigError)
        if self.rank >= spec.tp_size:
            raise ConfigError(f"WorkerConfig.rank {self.rank} is outside the spec's {spec.tp_size} TP ranks")
        for name, low, high in (("num_blocks", 1, MAX_BLOCKS), ("host_blocks", 0, MAX_BLOCKS),
                                ("num_states", 0, MAX_BLOCKS), ("lanes", 1, 256), ("device", 0, 1023),
                                ("parent_pid", 0, 2**31 - 1)):
            check_int(getattr(self, name), f"WorkerConfig.{name}", minimum=low, maximum=high, error=ConfigError)
        for name in ("command_address", "reply_address", "control_address"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"WorkerConfig.{name} must be a tcp://, ipc:// or inproc:// address, got {v!r}")
        self._check_keys()
        if not is_real(self.heartbeat_s) or not 0 < self.heartbeat_s <= 60:
            raise ConfigError(f"WorkerConfig.heartbeat_s must be in (0, 60], got {self.heartbeat_s!r}")
        if self.backend not in ("reference", "cuda"):
            raise ConfigError(f"WorkerConfig.backend must be 'reference' or 'cuda', got {self.backend!r}")
        if not isinstance(self.store, dict) or self.store.get("kind") not in _STORES:
            raise ConfigError(f"WorkerConfig.store must be a dict whose kind is one of {list(_STORES)} (a store "
                              f"other processes reach too), got {self.store!r}")
        if not isinstance(self.caches, dict) or self.caches.get("kind") not in _CACHES:
            raise ConfigError(f"WorkerConfig.caches must be a dict whose kind is one of {list(_CACHES)}")
        holds = _HOLDS[self.backend]
        if self.caches["kind"] not in holds:
            raise ConfigError(f"WorkerConfig: the {self.backend!r} backend holds {holds[0]!r} or {holds[1]!r} caches, "
                              f"not {self.caches['kind']!r}")
        self._check_states(spec)
        self._check_boards()
        return spec

    def _check_boards(self) -> None:
        """The direct handoff's boards: absolute directories or none, a finite wait."""
        for name in ("lends", "pulls"):
            v = getattr(self, name)
            if not isinstance(v, str) or (v and not os.path.isabs(v)):
                raise ConfigError(f"WorkerConfig.{name} must be an absolute directory path or \"\", got {v!r}")
        if not is_real(self.pull_wait) or not 0 <= self.pull_wait <= 600:
            raise ConfigError(f"WorkerConfig.pull_wait must be seconds in [0, 600], got {self.pull_wait!r}")

    def _check_keys(self) -> None:
        """The secret a hello carries, and the driver's CURVE key over tcp."""
        if not isinstance(self.curve_key, str) or len(self.curve_key) not in (0, 40):
            raise ConfigError(f"WorkerConfig.curve_key must be the driver's Z85 CURVE key (40 characters) or "
                              f"'', got {self.curve_key!r}")
        if not isinstance(self.secret, str):
            raise ConfigError("WorkerConfig.secret must be a str (the driver's per-start secret)")

    def _check_states(self, spec: CacheSpec) -> None:
        """State pages exactly when the spec has state groups, and only where they can be shared."""
        spec.check_num_states("WorkerConfig", self.num_states)
        if self.num_states and self.caches["kind"] == "cuda-ipc" and not isinstance(self.caches.get("states"), dict):
            raise ConfigError("WorkerConfig: CUDA IPC caches of a spec with state groups must share the state pages "
                              "too (share_caches(..., states=))")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"a rank worker's configuration is not valid JSON of its fields ({e})") from None


def build_store(cfg: dict[str, Any]) -> Store:
    """The store client a configuration names (each worker opens its own)."""
    if cfg.get("kind") == "file":
        from ..backends._filestore import FileStore

        extra = set(cfg) - {"kind", "root", "capacity_bytes"}
        if extra or "root" not in cfg:
            raise ConfigError(f"a file store takes a root and a capacity_bytes only, got {sorted(cfg)}")
        return FileStore(cfg["root"], capacity_bytes=cfg.get("capacity_bytes"))
    if cfg.get("kind") == "arena":
        from ..backends._arena import ArenaStore

        extra = set(cfg) - {"kind", "path", "slot_bytes", "tag"}
        if extra or "path" not in cfg:
            raise ConfigError(f"an arena store takes a path (and the slot_bytes and tag it must have) "
                              f"only, got {sorted(cfg)}")
        return ArenaStore.open(cfg["path"], slot_bytes=cfg.get("slot_bytes"), tag=cfg.get("tag"))
    if cfg.get("kind") == "mooncake":
        from ..backends._mooncake import MooncakeConfig, MooncakeStore

        fields = {k: v for k, v in cfg.items() if k != "kind"}
        known, needed = {f.name for f in dataclasses.fields(MooncakeConfig)}, {"master", "metadata"}
        if set(fields) - known or not needed <= set(fields):
            raise ConfigError(f"a mooncake store takes master and metadata (and {sorted(known - needed)}) only, "
                              f"got {sorted(fields)}")
        return MooncakeStore(MooncakeConfig(**fields))
    raise ConfigError(f"no store of kind {cfg.get('kind')!r} reaches across processes "
                      "(use 'arena', 'file' or 'mooncake')")


class RankWorker:
    """One rank's worker; :meth:`serve` runs it until it is stopped (returns an exit status)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.spec = config.validate()
        self.config = config
        self.rank = config.rank
        self.incarnation = wire.new_incarnation()
        self.counters = {"commands": 0, "stale": 0, "bad_messages": 0, "cancels": 0, "armed": 0, "disarmed": 0}
        self._faults = {"short": 0, "failed": 0}  #: store faults it saw (the backend counts broken blocks)
        self._faults_lock = threading.Lock()
        #: requests whose read arrived, latest last (an ARM coming after it arms nothing)
        self._reads_begun: OrderedDict[str, None] = OrderedDict()
        self._reads_lock = threading.Lock()  # lanes mark reads, lane 0 arms
        self.status = 0
        self.welcomed = False  #: the driver accepted the current incarnation's hello
        self._stop = threading.Event()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._curve: tuple[bytes, bytes] | None = None  # its CURVE keypair over tcp, made once
        self._sockets_lock = threading.Lock()
        self._resources: list[Callable[[], None]] = []  # closed in reverse order

    # -- set-up -----------------------------------------------------------------------------
    def _backend(self) -> TransferBackend:
        cfg, spec = self.config, self.spec
        store = self._store = build_store(cfg.store)
        self._resources.append(store.close)
        caches: Any = None
        states: Any = None
        kind = cfg.caches["kind"]
        if kind == "shm":
            from ..backends._shm import SharedCaches

            paths = {int(r): p for r, p in cfg.caches["paths"].items() if int(r) == self.rank}
            if not paths:
                raise ConfigError(f"rank {self.rank}: the shared caches name no file for this rank")
            shared = SharedCaches.attach(spec, cfg.num_blocks, paths, cfg.num_states)
            self._resources.append(shared.close)
            caches = shared  # its file too: a puller of another process maps it (the direct handoff)
            states = {self.rank: shared.states[self.rank]} if cfg.num_states else None
        elif kind == "cuda-ipc":
            from ..backends._cudaipc import open_caches

            caches, states, closer = open_caches(spec, cfg.num_blocks, self.rank, cfg.caches, cfg.device,
                                                 cfg.num_states)
            self._resources.append(closer)
        lends, pulls = (LendBoard(root, wait=cfg.pull_wait) if root else None for root in (cfg.lends, cfg.pulls))
        if cfg.backend == "cuda":
            from ..backends._cuda import CudaBackend

            backend: TransferBackend = CudaBackend(spec, cfg.num_blocks, store, caches=caches, device=cfg.device,
                                                   host_blocks=cfg.host_blocks, ranks=(self.rank,),
                                                   num_states=cfg.num_states,
                                                   states=states, lends=lends,
                                                   pulls=pulls, shared=cfg.caches if kind == "cuda-ipc" else None)
        else:
            from ..backends._reference import ReferenceBackend

            backend = ReferenceBackend(spec, cfg.num_blocks, store, host_blocks=cfg.host_blocks, ranks=(self.rank,),
                                       caches=caches, num_states=cfg.num_states, states=states, lends=lends,
                                       pulls=pulls)
        self._resources.append(backend.close)
        return backend

    def _socket(self, kind: int, address: str, identity: bytes | None = None) -> zmq.Socket:
        s = self._ctx.socket(kind)
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)  # before connecting: the driver routes to it by name
        s.setsockopt(zmq.LINGER, 1000)
        s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        if self.config.curve_key:  # tcp: an encrypted link to the driver it knows by key
            if self._curve is None:
                self._curve = zmq.curve_keypair()
            s.curve_serverkey = self.config.curve_key.encode()
            s.curve_publickey, s.curve_secretkey = self._curve
        with self._sockets_lock:
            self._sockets.append(s)
        s.connect(address)
        return s

    def _push(self, name: str) -> zmq.Socket:
        """This thread's PUSH socket to the driver's ``reply`` or ``control`` channel (ZeroMQ
        sockets are not shared between threads)."""
        s = getattr(self._local, name, None)
        if s is None:
            address = {"reply": self.config.reply_address, "control": self.config.control_address}[name]
            s = self._socket(zmq.PUSH, address)
            setattr(self._local, name, s)
        return s

    def _arrived(self, command_id: int, rank: int, layers: int, event: Any) -> None:
        if event is not None:  # the scheduler's process cannot wait on this process's device event
            wait_event(event, what=f"rank {rank}'s read of command {command_id}")
        self._push("control").send(wire.pack(wire.ARRIVED, self.rank, self.incarnation, command_id, layers))

    def _moved(self) -> int:
        """Payload bytes its backend moved (for the heartbeat, which runs once ``serve`` built it)."""
        return int(getattr(self._runner.backend, "bytes_moved", 0))

    def store_faults(self) -> list[int]:
        """Its :data:`~kvstate.distributed._wire.STORE_FAULTS` so far: broken blocks and host slots
        (the backend's count), short reads and failed operations (this worker's)."""
        backend = self._runner.backend if hasattr(self, "_runner") else None
        broken = int(getattr(backend, "broken_blocks", 0)) + int(getattr(backend, "broken_slots", 0))
        with self._faults_lock:
            return [broken, self._faults["short"], self._faults["failed"]]

    def _armed_counts(self) -> list[int]:
        """Reads its backend armed ahead and fired (a backend that cannot arm: none)."""
        counts = getattr(self._runner.backend, "armed_counts", None)
        fired = counts()["fired"] if callable(counts) else 0
        return [self.counters["armed"], int(fired)]

    def _hello(self) -> None:
        cfg = self.config
        self._push("control").send(wire.pack(wire.HELLO, self.rank, self.incarnation, os.getpid(), self.spec.tp_size,
                                              wire.geometry(self.spec, cfg.num_blocks, cfg.num_states), cfg.lanes,
                                              cfg.secret or os.environ.get(SECRET_ENV, "")))

    # -- the threads ------------------------------------------------------------------------------
    def serve(self) -> int:
        """Run until ``STOP``, ``REFUSE``, the parent's death or :meth:`stop`; 0 on a clean stop."""
        self._ctx = zmq.Context()
        try:
            self._runner = CommandRunner(self._backend(), time.monotonic, self._arrived)
            self._saves = ThreadPoolExecutor(self.config.lanes, f"kvstate-rank{self.rank}-save")
            self._resources.append(self._saves.shutdown)
            self._lends = ThreadPoolExecutor(MAX_LENDS, f"kvstate-rank{self.rank}-lend")
            self._resources.append(self._lends.shutdown)
            self._resources.append(self._runner.cancel_all)  # first: a save waiting for layers stops
            lanes = [self._socket(zmq.DEALER, self.config.command_address, f"r{self.rank}:{i}".encode())
                     for i in range(self.config.lanes)]
            self._hello()
            threads = [threading.Thread(target=self._lane, args=(i, sock), name=f"kvstate-rank{self.rank}-lane{i}",
                                        daemon=True) for i, sock in enumerate(lanes)]
            threads.append(threading.Thread(target=self._watch_store, name=f"kvstate-rank{self.rank}-store",
                                            daemon=True))
            for t in threads:
                t.start()
            self._beat()
            for t in threads:
                t.join(60.0)
        except KVStateError:
            self.status = 2  # its set-up failed: the goodbye says so
            raise
        finally:
            self._close()
        return self.status

    def _beat(self) -> None:
        """Heartbeats until stopped (the serving thread's own loop); watches the parent. Until
        the driver welcomes this incarnation, each beat is a hello again: the driver accepts a
        hello only once it can reach the worker's command socket, which connects on its own time."""
        cfg = self.config
        while not self._stop.wait(cfg.heartbeat_s):
            if cfg.parent_pid and not parent_alive(cfg.parent_pid):
                self.status = 3
                self._stop.set()
                return
            if self.welcomed:
                self._push("control").send(wire.pack(wire.HB, self.rank, self.incarnation, self._moved(),
                                                     self.store_faults() + self._armed_counts()))
            else:
                self._hello()

    def _watch_store(self) -> None:
        """Probe the store every heartbeat (a thread of its own: re-joining a remote pool can
        take seconds, which must not silence the heartbeats), so a pool that came back is
        re-joined before traffic returns."""
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self._store.check()
            except Exception:  # noqa: BLE001 - the next transfer reports the store's failure
                pass

    def _lane(self, lane: int, sock: zmq.Socket) -> None:
        """Receive on one lane's socket and run what arrives, in this thread."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
            self._handle(data, lane)

    def _handle(self, data: bytes, lane: int) -> None:
        """Apply one message (a command runs here, in the receiving thread)."""
        try:
            items = wire.unpack(data)
            kind = items[0]
            if kind == wire.STOP:
                self._stop.set()
            elif len(items) < 2 or items[1] != self.incarnation:
                self.counters["stale"] += 1  # for an incarnation before a restart or a rejoin
            elif kind == wire.CMD:
                self._run(self._command(items))
            elif kind in (wire.CANCEL, wire.LAYERS):
                self._runner.notice(self._notice(kind, items))
            elif kind == wire.ARM:
                self._arm(wire.arm_of(items, self.rank))
            elif kind == wire.DISARM:
                self.counters["disarmed"] += self._runner.backend.disarm_pull(self.rank, wire.disarm_of(items))
            elif kind == wire.REJOIN:
                self.incarnation = wire.new_incarnation()
                self.welcomed = False
                self._hello()
            elif kind == wire.WELCOME:
                self.welcomed = self.welcomed or lane == 0  # lane 0's comes last: then every lane is reachable
            elif kind == wire.REFUSE:  # this incarnation's hello was refused: its configuration differs
                print(f"kvstate rank worker {self.rank}: refused by the scheduler: {items[2:]}", file=sys.stderr)
                self.status = 2
                self._stop.set()
            else:
                raise ProtocolError(f"unknown message type {kind!r} for a worker")
        except KVStateError:
            self.counters["bad_messages"] += 1

    def _arm(self, cmd: C.ArmRead) -> None:
        """Prepare the announced read on this rank's backend, if it can, until its deadline
        (a read whose first token is already late prepares nothing). ``ARM`` comes on lane 0
        and the read on any lane, so the read may come first: an arm whose read already
        arrived, before or while it armed, is let go at once, or it would hold its slot
        until its deadline."""
        timeout = min(cmd.deadline - time.monotonic(), MAX_ARM_S)
        if timeout <= 0 or self._read_begun(cmd.request_id):
            return
        backend = self._runner.backend
        if backend.arm_pull(self.rank, cmd.keys, cmd.block_ids, timeout):
            self.counters["armed"] += 1
            if self._read_begun(cmd.request_id):
                backend.disarm_pull(self.rank, cmd.keys)  # taken by the read already, or let go here

    def _read_begun(self, request_id: str) -> bool:
        """Whether ``request_id``'s read arrived (among the latest ``MAX_READS_KEPT``)."""
        with self._reads_lock:
            return request_id in self._reads_begun

    def _read_arrives(self, request_id: str) -> None:
        with self._reads_lock:
            self._reads_begun[request_id] = None
            if len(self._reads_begun) > MAX_READS_KEPT:
                self._reads_begun.popitem(last=False)

    def _command(self, items: list[Any]) -> C.TransferCommand:
        """The command a CMD message of this incarnation carries. One it cannot take is
        answered failed at once, under its id where it has one, so the driver need not wait
        out its deadline for it (an id the driver does not owe is dropped there), then counted."""
        try:
            return wire.command_of(items, self.rank)
        except ProtocolError as e:
            cid = items[3] if len(items) > 3 else None
            if cid.__class__ is int and 0 < cid < 1 << 63:
                self._done(cid, 0, f"rank {self.rank} refused the command: {e}")
            raise

    def _run(self, cmd: C.TransferCommand) -> None:
        self.counters["commands"] += 1
        if C.kind_of(cmd) == "read":
            self._read_arrives(cmd.request_id)
        self._runner.admit(cmd)
        if cmd.__class__ is C.SaveLayers:  # it waits for layer reports: never on a receiving thread
            self._saves.submit(self._answer, cmd)
        elif cmd.__class__ is C.LendBlocks:  # it waits for D: never on a lane, which others queue behind
            self._lends.submit(self._answer, cmd)
        else:
            self._answer(cmd)

    def _answer(self, cmd: C.TransferCommand) -> None:
        c = self._runner.run(cmd, self.rank)
        self._runner.forget(c.command_id, c.rank)
        if c.error or (c.count < len(cmd.keys) and C.kind_of(cmd) == "read"):
            with self._faults_lock:  # lanes answer on their own threads
                self._faults["failed" if c.error else "short"] += 1
        self._done(c.command_id, c.count, c.error)

    def _done(self, command_id: int, count: int, error: str | None) -> None:
        """A command's one answer, on this thread's reply socket."""
        self._push("reply").send(wire.pack(wire.DONE, self.rank, self.incarnation, command_id, count, error))

    def _notice(self, kind: int, items: list[Any]) -> C.CancelCommand | C.LayersReady:
        if kind == wire.CANCEL and len(items) == 3 and items[2].__class__ is int:
            self.counters["cancels"] += 1
            return C.CancelCommand("", items[2])
        if kind == wire.LAYERS and len(items) == 4 and items[2].__class__ is int and items[3].__class__ is int:
            return C.LayersReady("", items[2], items[3])
        raise ProtocolError("a CANCEL or LAYERS message with bad items")

    def stop(self) -> None:
        """Ask :meth:`serve` to return (thread-safe; a worker hosted in an engine's process)."""
        self._stop.set()

    def _close(self) -> None:
        self._stop.set()
        for close in reversed(self._resources):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - every resource gets its turn; report, go on
                print(f"kvstate rank worker {self.rank}: while closing: {type(e).__name__}: {e}", file=sys.stderr)
        self._resources.clear()
        try:
            self._push("control").send(wire.pack(wire.BYE, self.rank, self.incarnation, f"exit {self.status}"),
                                       zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        with self._sockets_lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            s.close(linger=200)
        self._ctx.term()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstate.distributed rankworker CONFIG_JSON``: serve one rank until stopped."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvstate.distributed rankworker CONFIG_JSON", file=sys.stderr)
        return 2
    try:
        config = WorkerConfig.from_json(args[0])
        die_with_parent(config.parent_pid)
        worker = RankWorker(config)
    except KVStateError as e:
        print(f"kvstate rank worker: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle: it stops its workers
    try:
        return worker.serve()
    except KVStateError as e:
        print(f"kvstate rank worker {config.rank}: error: {e}", file=sys.stderr)
        return 2


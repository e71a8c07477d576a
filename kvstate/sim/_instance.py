"""What a simulated P or D instance shares: its lifecycle on the simulation clock, its TP
ranks' transfer workers and PCIe links, and the driver loop that turns the lifecycle's
commands into timed work and feeds the outcomes back as the events an engine would send.

A transfer command becomes a task of the instance's per-rank worker pools
(:mod:`kvstate.sim._tp`). A rank's part costs its PCIe time from the calibrated kernel cost
model (:mod:`kvstate.kernels._cost`), pipelined with the storage pool's bandwidth
(:mod:`kvstate.sim._storage`), for the blocks it really moves: a write skips the leading
blocks already stored after one existence query, a read stops at a miss. Its answer comes
from the simulated pool's contents, so evictions make reads partial exactly as in
production. Notices go to the role's :meth:`Instance.notice`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from types import MethodType
from typing import Any

import simpy
from simpy import Event

from .. import commands as C
from .._lifecycle import Lifecycle
from ..commands import KINDS, kind_of
from ..events import Completion
from ._services import Services
from ._tp import RankPools

__all__ = ["Instance", "Transfer", "LayerSave", "Swap"]

#: SimPy's ``Environment.now``: a property, whose getter bound to an environment is the clock the
#: lifecycles read (one call; reading the attribute adds the generic lookup of a property to it)
_NOW: Callable[[simpy.Environment], float] = vars(simpy.Environment)["now"].fget


class Transfer:
    """One transfer command as a task of the rank pools."""

    __slots__ = ("inst", "cmd", "label", "write", "n", "skip", "seen", "left")

    def __init__(self, inst: Instance, cmd: C.TransferCommand, write: bool) -> None:
        self.inst, self.cmd, self.write = inst, cmd, write
        self.label = cmd.command_id
        self.n = len(cmd.keys)
        self.skip: int = getattr(cmd, "window_from", 0)  #: leading blocks moved without their window groups
        self.seen: dict[int, tuple[int, int]] = {}  # rank -> (leading keys stored, evictions) at start
        self.left = len(cmd.ranks)  #: ranks yet to answer: only the last answer can start anything

    def start(self, rank: int) -> float:
        """Seconds of this rank's part: a write first asks which leading keys are stored and
        moves only the rest; a read moves the leading keys found (a miss ends it). A command
        cancelled before a worker took it is skipped, as the threaded driver skips it."""
        inst = self.inst
        if self.label in inst.cancelled:
            return 0.0  # answered "cancelled" at once
        store, side = inst.store, inst.side
        if self.write and not side.writers[rank]:  # a replica: the first rank holding its heads stores them
            self.seen[rank] = (self.n, store.evictions)
            return 0.0
        parts, keys = side.parts[rank], self.cmd.keys
        found = store.leading(parts[0], keys)
        if len(parts) > 1:
            for part in parts[1:]:
                found = min(found, store.leading(part, keys))
        self.seen[rank] = (found, store.evictions)
        if self.write:
            rest = self.n - found
            if not rest:
                return store.query_latency
            if self.cmd.__class__ is C.FlushHost:  # from host memory: the pool's bandwidth only
                now = inst.env.now
                return store.query_latency + store.occupy(now, rest * side.shard_bytes)[1] - now
            return store.query_latency + inst.transfer_time(rank, "d2h", rest)
        if not found:
            return store.latency
        skip = self.skip  # of the blocks found, those read without their window groups
        return inst.transfer_time(rank, "h2d", found, skip if skip < found else found)

    def finish(self, rank: int) -> None:
        self.inst.answer(self, rank)


class LayerSave(Transfer):
    """A layer-wise save (``SaveLayers``), submitted when its prompt's prefill forward starts:
    it moves its bytes as a write does, but cannot end before the forward has, plus the last
    layer's share of the bytes (stored after the forward computed it)."""

    __slots__ = ("forward_left", "submitted")

    def __init__(self, inst: Instance, cmd: C.TransferCommand, forward_left: float) -> None:
        super().__init__(inst, cmd, True)
        self.forward_left = forward_left  #: seconds of the forward still to run at submission
        self.submitted = inst.env.now

    def start(self, rank: int) -> float:
        store = self.inst.sv.store
        moving = super().start(rank)
        if rank not in self.seen or self.seen[rank][0] == self.n:  # cancelled, or every key stored: at once
            return moving
        left = self.forward_left - (self.inst.env.now - self.submitted)
        tail = (moving - store.query_latency) / self.inst.side.cache_spec.layers
        return max(moving, left + tail)


class Swap:
    """One swap command (GPU blocks to or from the host tier) as a task of the rank pools."""

    __slots__ = ("inst", "cmd", "label", "out")

    def __init__(self, inst: Instance, cmd: C.TransferCommand, out: bool) -> None:
        self.inst, self.cmd, self.out, self.label = inst, cmd, out, cmd.command_id

    def start(self, rank: int) -> float:
        n = len(self.cmd.keys)
        if not n or self.cmd.command_id in self.inst.cancelled:  # nothing to copy, or skipped
            return 0.0
        return self.inst.link_time(rank, "d2h" if self.out else "h2d", n)

    def finish(self, rank: int) -> None:
        inst, cmd = self.inst, self.cmd
        count = 0 if cmd.command_id in inst.cancelled else len(cmd.keys)
        c = Completion(cmd.command_id, rank, count, error="cancelled" if not count and cmd.keys else None)
        if inst.sv.timeline is not None:
            inst.sv.timeline.completed(inst.name, [c])
        inst.lc.complete(c)
        inst.pump()
        if not inst.sv.live:
            inst.sv.check_finished()


class Instance(ABC):
    """One P or D instance: its lifecycle, rank pools and links (the role adds compute).

    Instances are slotted, as are their roles: an object with more attributes than CPython
    keeps in its class's shared key table (about thirty) gets a dictionary of its own, and
    every attribute read on the simulator's hot paths then takes the slower lookup."""

    __slots__ = ("sv", "idx", "env", "store", "decoding", "transfer_timeout", "side", "name", "lc", "link_free",
                 "cancelled", "write_pool", "read_pool", "wake", "busy_time", "computing_until", "block_seconds",
                 "_noted_at", "_noted_used", "_link_cost")
    role = ""
    lifecycle_cls: type[Lifecycle] = Lifecycle

    def __init__(self, sv: Services, idx: int) -> None:
        s, env = sv.scenario, sv.env
        self.sv, self.idx, self.env = sv, idx, env
        self.store = sv.store  #: the cluster's storage pool (read on every rank's part of a transfer)
        self.decoding = self.role == "decode"
        self.transfer_timeout = sv.policy.transfer_timeout  #: each transfer's deadline, from when it is sent
        self.side = side = sv.sides[self.role]  #: this role's TP degree, geometry, blocks and compute
        self.name = f"{self.role[0].upper()}{idx}"
        self.lc = self.lifecycle_cls(side.lifecycle_spec, side.gpu_blocks, sv.policy,
                                     clock=MethodType(_NOW, env), namespace=s.model.name, key_cache=sv.key_cache,
                                     num_states=side.num_states, **self.lifecycle_options(s))
        tp = side.tp
        self.link_free = [0.0] * tp
        self.cancelled: set[int] = set()
        kw: dict[str, Any] = dict(tp=tp, workers=s.cluster.transfer_workers, protocol=s.tp.protocol,
                                  semantics=s.tp.barrier, skew_s=[x / 1000.0 for x in s.tp.skew_ms],
                                  barrier_timeout=s.tp.barrier_timeout_s)
        self.write_pool = RankPools(env, f"{self.name}.write_barrier", reset_by="rank0", **kw)
        self.read_pool = RankPools(env, f"{self.name}.read_barrier", reset_by="all", **kw)
        self.wake: simpy.Event | None = None
        self.busy_time = 0.0  #: seconds the instance computed (a forward counts when it starts)
        self.computing_until = 0.0  #: when the forward counted last ends (it may outlast the run)
        self.block_seconds = 0.0  #: integral of blocks used over time
        self._noted_at, self._noted_used = 0.0, 0  # time and blocks used of the last note
        self._link_cost: dict[tuple[str, int], float] = {}

    def lifecycle_options(self, s: Any) -> dict[str, Any]:
        """Keyword arguments of the lifecycle beyond the common ones: the host tier, the GPU
        prefix cache, layer-wise transfers."""
        return {"host_blocks": s.cluster.host_blocks, "prefix_cache": s.cluster.prefix_cache,
                "layerwise": s.cluster.layerwise}

    # -- transfers ---------------------------------------------------------------------------
    def link_time(self, rank: int, direction: str, n: int) -> float:
        """Seconds of one rank's PCIe copy of ``n`` blocks starting now, queued on its link
        (a swap between GPU blocks and the host tier: no storage pool in it)."""
        now = self.env.now
        link = self._link_cost.get((direction, n))
        if link is None:
            link = self._link_cost[(direction, n)] = self.side.link_seconds(direction, n)
        start = max(self.link_free[rank], now)
        self.link_free[rank] = end = start + link
        return end - now

    def transfer_time(self, rank: int, direction: str, n: int, skip: int = 0) -> float:
        """Seconds of one rank's part of a transfer of ``n`` blocks starting now, ``skip`` of
        them without their window groups (a read from a cache's last window)."""
        side, now = self.side, self.env.now
        link = self._link_cost.get((direction, n))
        if link is None:
            link = self._link_cost[(direction, n)] = side.link_seconds(direction, n)
        if skip:  # the link moves that much less, at its rate for these chunks
            link *= 1.0 - skip * side.window_bytes / (n * side.shard_bytes)
        link_free = self.link_free
        start = link_free[rank]
        start = start if start >= now else now  # max and min written out: twelve thousand calls a run
        link_free[rank] = link_end = start + link
        nbytes = n * side.shard_bytes - skip * side.window_bytes + (side.state_bytes if n else 0)  # and states
        sv = self.sv
        s_start, s_end = self.store.occupy(now, nbytes)
        if sv.object_s:  # per object moved, when charged
            s_end += n * len(side.parts[rank]) * side.kinds * sv.object_s
        pieces = -(-nbytes // sv.staging_bytes) if nbytes > sv.staging_bytes else 1
        store_s = s_end - s_start
        tail = (link if link <= store_s else store_s) / pieces  # pipelined in pieces: the faster stage's last one
        end = (link_end if link_end >= s_end else s_end) + tail
        return end - now

    def answer(self, task: Transfer, rank: int) -> None:
        """A rank finished its part: answer from the pool's contents (or an injected fault),
        as :func:`~kvstate.backends._drivers.execute` would from a real pool."""
        cl, cmd, write, cid = self.sv, task.cmd, task.write, task.label
        fail = cl.faults_write if write else cl.faults_read
        if cid in self.cancelled:
            c = Completion(cid, rank, 0, error="cancelled")
        elif fail and cl.rng.random() < fail:
            c = Completion(cid, rank, 0, error="injected failure")
            cl.counters["injected_write_failures" if write else "injected_read_failures"] += 1
        else:
            found, evictions = task.seen[rank]
            store, keys = self.store, cmd.keys
            known = found if evictions == store.evictions else 0  # nothing stored went away since
            parts = self.side.parts[rank]
            if write and not self.side.writers[rank]:  # a replica's write: its first replica stores the keys
                n = len(keys)
            elif len(parts) == 1 and not task.skip:  # one head group, moved whole: the pool answers as is
                n = store.answer(parts[0], keys, write, known)
            else:
                n = self._stored(rank, keys, write, known, task.skip)
            c = Completion(cid, rank, store.states_moved(rank, keys, cmd.states, n, write) if cmd.states else n)
            # D's reads of a stored cache; P's prefix read stopping at a miss is a prefix miss
            if not write and self.decoding and c.count < len(keys):
                cl.counters["partial_reads"] += 1
        if cl.timeline is not None:
            cl.timeline.completed(self.name, [c])
        self.lc.complete(c)
        task.left -= 1
        if not task.left:  # an earlier rank's answer is only recorded: no command can follow it
            self.pump()
        if not cl.live:  # the last answers after the last request ended
            cl.check_finished()

    def _stored(self, rank: int, keys: Sequence[str], write: bool, known: int, window_from: int) -> int:
        """The pool's answer to one rank's write or read of ``keys`` (a rank that stores them):
        over each of its head groups."""
        parts, store = self.side.parts[rank], self.store
        skipped = min(window_from, len(keys)) * self.side.window_bytes // len(parts) if window_from else 0
        count = store.answer(parts[0], keys, write, known, skipped)  # a part's window bytes not read: skipped
        if len(parts) > 1:
            for part in parts[1:]:
                count = min(count, store.answer(part, keys, write, known, skipped))
        return count

    # -- commands out of the lifecycle ------------------------------------------------------------
    def pump(self) -> None:
        """Hand every queued command to its worker or to the role's notice handler."""
        cmds = self.lc.poll_commands()
        tl = self.sv.timeline
        if tl is not None:
            tl.submitted(self.name, cmds)
            tl.states(self.name, self.lc)
        if not cmds:
            return
        timed = False  # a transfer brings a deadline: the next tick may have to come sooner
        for cmd in cmds:
            t = cmd.__class__
            kind = KINDS.get(t) or kind_of(cmd)
            if kind == "read" or (kind == "write" and t is not C.SaveLayers):
                tc: C.TransferCommand = cmd  # type: ignore[assignment]  # its kind says so (no cast call: hot)
                write = kind == "write"
                (self.write_pool if write else self.read_pool).submit(Transfer(self, tc, write), tc.ranks)
                timed = True
            elif kind == "swap":
                self._swap(cmd)  # type: ignore[arg-type]
                timed = True
            elif kind == "write":  # a layer-wise save: the role starts it with its prefill; its deadline runs now
                self.notice(cmd)
                timed = True
            elif kind == "cancel":
                self.cancelled.add(cmd.command_id)  # type: ignore[attr-defined]
            elif t is C.LateEvent:
                name = f"late_{cmd.event}"  # type: ignore[attr-defined]
                counters = self.sv.counters
                counters[name] = counters.get(name, 0) + 1
            else:
                self.notice(cmd)
        now = self.note_blocks()
        if timed:
            self.sv.arm_timer(self, now + self.transfer_timeout)

    def _swap(self, tc: C.TransferCommand) -> None:
        """A swap command to the rank pools (preemption swaps at D counted)."""
        out = tc.__class__ is C.SwapOut
        # preemption swaps (P's are prefix loads and cache copies, D's "loading" a read's prefix)
        rid = tc.request_id
        if self.decoding and (out or (self.lc.is_live(rid) and self.lc.state_of(rid) == "swapping_in")):
            counters = self.sv.counters
            counters["swap_outs" if out else "swap_ins"] += 1
            counters["blocks_swapped_out" if out else "blocks_swapped_in"] += len(tc.keys)
        (self.write_pool if out else self.read_pool).submit(Swap(self, tc, out), tc.ranks)

    @abstractmethod
    def notice(self, cmd: C.Command) -> None:
        """A notice of the lifecycle (first token, start prefill, ...): the role's job."""

    # -- accounting ----------------------------------------------------------------------------
    def note_blocks(self) -> float:
        """Add the blocks held since the last note to the time integral (called whenever the
        lifecycle acted, so the integral is exact at the scheduler's resolution); returns the
        time noted."""
        now = self.env.now
        self.block_seconds += (now - self._noted_at) * self._noted_used
        self._noted_at, self._noted_used = now, self.lc.pool.num_used
        return now

    # -- the compute loop's sleep ---------------------------------------------------------------
    def wake_up(self) -> None:
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def idle(self) -> simpy.Event:
        self.wake = Event(self.env)
        return self.wake

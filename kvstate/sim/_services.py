"""What a simulated instance uses of its run: the clock, the models, the pool, the request table.

A :class:`Services` is built once per run (by :class:`~kvstate.sim._cluster.Cluster`) and
handed to every instance and to the router; none of them holds the cluster. It carries

- the clock (SimPy's environment) and the scenario's figures: cache geometry, policy, blocks
  per instance, staging, network latency, injected fault rates;
- the models: compute (:mod:`~kvstate.sim._compute`), transfers (:mod:`kvstate.kernels._cost`,
  :meth:`Side.link_seconds`) and the storage pool (:mod:`~kvstate.sim._storage`); what differs
  between P and D (TP degree, cache geometry, blocks, compute) is each role's :class:`Side`, and
  the pool holds head groups (:mod:`kvstate._spec`'s layout: a rank's own, unless P and D differ);
- the run's shared records: requests by id, the live ones, the ended ones, counters, the
  preemption round trips, the key cache the instances share;
- deadlines: :meth:`Services.arm_timer` ticks an instance's lifecycle exactly when its next
  timer is due;
- the cluster's hooks, through which an instance hands a request on without knowing the
  others (set by the cluster once the instances exist): ``first_token`` (P's message reaches
  D), ``ended`` (D ended a request), ``blocks_freed`` (blocks came free at D: waiting arrivals
  may fit), ``retry_backlog`` and ``check_finished``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import simpy
from simpy import Timeout

from .. import commands as C
from .._keys import KeyCache
from .._timeline import Timeline
from ..kernels._cost import TransferCostModel
from ._compute import ComputeModel
from ._request import SimRequest
from ._scenario import Scenario
from ._storage import SimStore

__all__ = ["Services", "Side", "COUNTERS", "Ticked"]


class Ticked(Protocol):
    """What :meth:`Services.arm_timer` needs of an instance."""

    name: str
    lc: Any

    def pump(self) -> None: ...

#: the run's counters (``counters``), reported by :mod:`~kvstate.sim._metrics`
COUNTERS = ("preemptions", "partial_reads", "injected_write_failures", "injected_read_failures", "backlogged",
            "rejected_too_long", "swap_outs", "swap_ins", "blocks_swapped_out", "blocks_swapped_in",
            "prompts_dropped")


def _unset(*_: Any) -> None:
    raise AssertionError("a cluster hook was used before the cluster set it")


class Side:
    """What one role's instances are made of: TP degree, cache geometry, blocks, compute, the
    head groups each rank moves, and the PCIe cost of moving them."""

    def __init__(self, scenario: Scenario, cost: TransferCostModel) -> None:
        s = scenario
        self.tp = s.cluster.tp
        #: what the lifecycles hold: every layer group, and a page of states a request with state groups
        self.lifecycle_spec = full = s.cache_spec()
        self.num_states = s.state_pages()
        self.state_bytes = full.state_bytes_per_rank  #: a request's states on one rank (moved with its blocks)
        self.cache_spec = spec = full.paged()  #: the paged layers: what the blocks and the pool hold
        #: a rank's bytes of a block in window groups (left out of blocks before a read's window)
        self.window_bytes = sum(len(g.layers) for g in spec.groups if g.kind == "window") * \
            sum(spec.chunk_bytes(k) for k in spec.kinds)
        self.gpu_blocks = s.gpu_blocks()
        self.compute = ComputeModel(s)
        self.shard_bytes = spec.bytes_per_block_per_rank  #: a rank's bytes of a block
        self.part_bytes = self.shard_bytes // spec.head_groups  #: a head group's bytes of a block
        self.parts = [tuple(spec.parts(r)) for r in range(self.tp)]  #: each rank's head groups
        self.writers = [spec.writes(r) for r in range(self.tp)]  #: ranks that store their heads
        self.chunk_bytes = spec.chunk_bytes()
        self.kinds = len(spec.kinds)
        self.staging_bytes = s.cluster.staging_mib << 20
        self.cost = cost

    def link_seconds(self, direction: str, n: int) -> float:
        """PCIe seconds of one rank moving ``n`` blocks, in staging-sized pieces, one call per
        kind (and head group: each is a call of chunks that many times smaller)."""
        groups = self.cache_spec.head_groups
        chunk = self.chunk_bytes // groups
        per_piece = max(1, self.staging_bytes // self.shard_bytes)
        full, rest = divmod(n, per_piece)
        layers = self.cache_spec.layers
        t = full * self.cost.time_of(direction, per_piece * layers * groups, chunk)
        t += self.cost.time_of(direction, rest * layers * groups, chunk)
        states = self.cost.time_of(direction, 1, self.state_bytes) if n and self.state_bytes else 0.0
        return t * self.kinds + states


class Services:
    """The run's clock, models, pool, records and hooks (see the module's docstring). Slotted, as
    the instances that read it on every transfer and step (:class:`~kvstate.sim._instance.Instance`)."""

    __slots__ = ("scenario", "env", "cost", "sides", "fit_blocks", "cache_spec", "gpu_blocks", "compute",
                 "shard_bytes", "chunk_bytes", "kinds", "block_size", "policy", "staging_bytes", "store", "object_s",
                 "timeline", "key_cache", "net_latency", "rng", "faults_write", "faults_read", "counters",
                 "round_trips", "reqs", "live", "done", "_armed", "first_token", "ended", "blocks_freed",
                 "retry_backlog", "check_finished")

    def __init__(self, scenario: Scenario, cost: TransferCostModel | None = None) -> None:
        s = self.scenario = scenario
        self.env = simpy.Environment()
        self.cost = cost or TransferCostModel.load(s.gpu.calibration)
        p = Side(s, self.cost)
        self.sides = {"prefill": p, "decode": Side(s.decode_view(), self.cost) if s.cluster.d_tp or s.cluster.d_gpu
                      else p}
        #: blocks a request must fit in: the fewer of P's and D's when their TP degrees differ
        self.fit_blocks = min(side.gpu_blocks for side in self.sides.values())
        # P's figures under the names every role used when they were one (and a co-located run's)
        self.cache_spec, self.gpu_blocks, self.compute = p.cache_spec, p.gpu_blocks, p.compute
        self.shard_bytes, self.chunk_bytes, self.kinds = p.shard_bytes, p.chunk_bytes, p.kinds
        self.block_size = s.model.block_size
        self.policy = s.policy
        self.staging_bytes = p.staging_bytes
        self.store = SimStore(s.storage, p.part_bytes, p.cache_spec.heads_total // p.cache_spec.object_heads)
        self.object_s = s.storage.object_us / 1e6  #: pool seconds per object moved
        self.timeline: Timeline | None = None  #: per-request trace events, when asked for (``--timeline``)
        # every instance runs in this one thread: D's reserve and P's admit of a request compute
        # the same keys back to back, so one KeyCache makes the second free (never a different key);
        # 1,024 first blocks kept: the Mooncake trace's prompts start in 2,211 ways, and with 64
        # kept it hashes 2.3x the blocks (790k against 350k; ~90 MiB more at its peak)
        self.key_cache = KeyCache(size=1024)
        self.net_latency = s.network.latency_ms / 1000.0
        self.rng = np.random.default_rng(s.seed + 1)
        self.faults_write, self.faults_read = s.faults.write_fail, s.faults.read_fail
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.round_trips: list[float] = []  #: seconds from each preemption to decoding again
        self.reqs: dict[str, SimRequest] = {}
        self.live: set[str] = set()  #: requests not yet ended
        self.done: list[SimRequest] = []
        self._armed: dict[str, float] = {}  # instance name -> time its next tick is scheduled for
        self.first_token: Callable[[C.SendFirstToken], None] = _unset
        self.ended: Callable[[SimRequest, C.RequestEnded], None] = _unset
        self.blocks_freed: Callable[[], None] = _unset
        self.retry_backlog: Callable[[], None] = _unset
        self.check_finished: Callable[[], None] = _unset

    def link_seconds(self, direction: str, n: int) -> float:
        """P's :meth:`Side.link_seconds` (a co-located instance's)."""
        return self.sides["prefill"].link_seconds(direction, n)

    # -- deadlines: a tick exactly when an instance's lifecycle next has timer work --------------
    def arm_timer(self, inst: Ticked, new_after: float | None = None) -> None:
        """Schedule ``inst``'s next tick at its lifecycle's ``next_deadline()`` (if that is
        earlier than the one already scheduled): deadlines fire at their exact time.
        ``new_after``: every timer set since the last arming is at this time or later."""
        armed = self._armed.get(inst.name, math.inf)
        if new_after is not None and armed <= new_after:
            return  # a tick comes before any new deadline: nothing to look up
        when = inst.lc.next_deadline()
        if when is None or when >= armed:
            return
        self._armed[inst.name] = when
        ev = Timeout(self.env, max(0.0, when - self.env.now))
        ev.callbacks.append(lambda _e: self._on_timer(inst, when))

    def _on_timer(self, inst: Ticked, when: float) -> None:
        if self._armed.get(inst.name) != when:
            return  # superseded by an earlier arming, which ticked already
        del self._armed[inst.name]
        inst.lc.tick()
        inst.pump()
        self.arm_timer(inst)  # the next deadline, which an earlier arming may have superseded
        if not self.live:
            self.check_finished()

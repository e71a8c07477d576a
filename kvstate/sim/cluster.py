"""The simulated cluster: P and D instances running the production lifecycle machines under SimPy.

Each instance holds a :class:`~kvstate.lifecycle.PrefillLifecycle` or
:class:`~kvstate.lifecycle.DecodeLifecycle` on the simulation clock — the very machines an
engine runs — and this module is their driver: it turns every command they emit into
timed SimPy work and feeds the outcome back as the same events an engine would send.

- transfer commands (write, read) become tasks of the instance's per-rank worker
  pools (:mod:`kvstate.sim.tp`); a rank's part costs its PCIe time from the calibrated
  kernel cost model (:mod:`kvstate.kernels.cost`) pipelined with the storage pool's
  bandwidth (:mod:`kvstate.sim.storage`), for the blocks it really moves (a write skips the
  leading blocks already stored after one existence query; a read stops at a miss); its
  answer comes from the simulated pool's contents, so evictions make reads partial exactly
  as in production;
- ``StartPrefill`` queues the prompt on the P instance's compute loop (batched prefill under
  a token budget); ``SendFirstToken`` crosses the network to D;
- ``StartDecode`` / ``Recompute`` join D's continuous batching; a request that needs a block
  when none is free preempts the newest running request (write-back or recompute, per
  policy), and preempted requests resume first-come first-served;
- a router reserves D blocks before P starts (D keeps headroom for its running requests),
  and holds arrivals no D can take yet.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
import simpy

from .. import commands as C
from ..backends.drivers import execute
from ..errors import ConfigError, OutOfBlocksError, UnknownRequestError
from ..events import Completion
from ..kernels.cost import TransferCostModel
from ..lifecycle import DecodeLifecycle, PrefillLifecycle
from ..policy import Policy
from ..spec import CacheSpec
from .compute import ComputeModel
from .scenario import Scenario
from .storage import SimStore
from .tp import RankPools
from .workload import Arrival, arrivals, unique_start, unique_tokens

__all__ = ["Cluster", "SimRequest"]

_FIRST_TOKEN = 1


class SimRequest:
    """The simulator's view of a request (timestamps and decode progress)."""

    __slots__ = ("rid", "index", "arrival", "input_len", "out", "tokens", "d", "p", "first_token",
                 "finish", "state", "error", "generated", "ctx", "synced", "cap", "base", "preemptions",
                 "cached_tokens")

    def __init__(self, a: Arrival) -> None:
        self.rid = f"r{a.index}"
        self.index = a.index
        self.arrival = a.time
        self.input_len = a.input_len
        self.out = a.output_len
        self.tokens = a.tokens
        self.d: Instance | None = None
        self.p: Instance | None = None
        self.first_token: float | None = None
        self.finish: float | None = None
        self.state = "arrived"
        self.error = 200
        self.generated = 0
        self.ctx = 0
        self.synced = 0
        self.cap = 0
        self.base = unique_start(a.index, salt=1)  # where the run of its decoded tokens starts
        self.preemptions = 0
        self.cached_tokens = 0


class _Transfer:
    """One transfer command as a task of the rank pools."""

    __slots__ = ("inst", "cmd", "label", "direction", "n")

    def __init__(self, inst: Instance, cmd: C.TransferCommand, direction: str) -> None:
        self.inst, self.cmd, self.direction = inst, cmd, direction
        self.label = cmd.command_id
        self.n = len(cmd.keys)

    def start(self, rank: int) -> float:
        """Seconds of this rank's part: a write first asks which leading keys are stored and
        moves only the rest; a read moves the leading keys found (a miss ends it)."""
        inst = self.inst
        store = inst.cluster.store
        found = store.leading(rank, self.cmd.keys)
        if self.direction == "d2h":
            rest = self.n - found
            return store.query_latency + (inst.transfer_time(rank, "d2h", rest) if rest else 0.0)
        return inst.transfer_time(rank, "h2d", found) if found else store.latency

    def finish(self, rank: int) -> None:
        self.inst.answer(self.cmd, rank)


class Instance:
    """One P or D instance: its lifecycle, rank pools, links and compute loop."""

    def __init__(self, cluster: Cluster, role: str, idx: int) -> None:
        s, env = cluster.scenario, cluster.env
        self.cluster, self.role, self.idx, self.env = cluster, role, idx, env
        self.name = f"{role[0].upper()}{idx}"
        lc_cls = PrefillLifecycle if role == "prefill" else DecodeLifecycle
        self.lc = lc_cls(cluster.cache_spec, cluster.gpu_blocks, cluster.policy, clock=lambda: env.now,
                         namespace=s.model.name)
        tp = s.cluster.tp
        self.link_free = [0.0] * tp
        self.cancelled: set[int] = set()
        kw = dict(tp=tp, workers=s.cluster.transfer_workers, protocol=s.tp.protocol, semantics=s.tp.barrier,
                  skew_s=[x / 1000.0 for x in s.tp.skew_ms], barrier_timeout=s.tp.barrier_timeout_s)
        self.write_pool = RankPools(env, f"{self.name}.write_barrier", reset_by="rank0", **kw)
        self.read_pool = RankPools(env, f"{self.name}.read_barrier", reset_by="all", **kw)
        self.queue: deque = deque()  # P: (req, new, cached) prompts to prefill; D: (req, from) recomputes
        self.running: dict[str, SimRequest] = {}
        self.preempted: deque[SimRequest] = deque()
        self.finishing: list[SimRequest] = []
        self.wake: simpy.Event | None = None
        self.busy_time = 0.0
        self.assigned = 0
        self._link_cost: dict[tuple[str, int], float] = {}
        env.process(self._prefill_loop() if role == "prefill" else self._decode_loop())

    # -- transfers ---------------------------------------------------------------------------
    def transfer_time(self, rank: int, direction: str, n: int) -> float:
        """Seconds of one rank's part of a transfer of ``n`` blocks starting now."""
        cl = self.cluster
        now = self.env.now
        link = self._link_cost.get((direction, n))
        if link is None:
            link = self._link_cost[(direction, n)] = cl.link_seconds(direction, n)
        start = self.link_free[rank]
        if start < now:
            start = now
        self.link_free[rank] = link_end = start + link
        nbytes = n * cl.shard_bytes
        s_start, s_end = cl.store.occupy(now, nbytes)
        pieces = max(1, math.ceil(nbytes / cl.staging_bytes))
        end = max(link_end, s_end) + min(link, s_end - s_start) / pieces
        return end - now

    def answer(self, cmd: C.TransferCommand, rank: int) -> None:
        cl = self.cluster
        if cmd.command_id in self.cancelled:
            c = Completion(cmd.command_id, rank, 0, error="cancelled")
        elif isinstance(cmd, C.WriteBlocks) and cl.faults_write and cl.rng.random() < cl.faults_write:
            c = Completion(cmd.command_id, rank, 0, error="injected write failure")
            cl.counters["injected_write_failures"] += 1
        elif isinstance(cmd, C.ReadBlocks) and cl.faults_read and cl.rng.random() < cl.faults_read:
            c = Completion(cmd.command_id, rank, 0, error="injected read failure")
            cl.counters["injected_read_failures"] += 1
        else:
            c = execute(cl.store, cmd, rank)
            # D's reads of a stored cache; P's prefix read stopping at a miss is a prefix miss
            if self.role == "decode" and isinstance(cmd, C.ReadBlocks) and c.count < len(cmd.keys):
                cl.counters["partial_reads"] += 1
        self.lc.complete(c)
        self.pump()

    # -- commands out of the lifecycle ------------------------------------------------------------
    def pump(self) -> None:
        cl = self.cluster
        for cmd in self.lc.poll_commands():
            t = type(cmd)
            if t is C.WriteBlocks:
                self.write_pool.submit(_Transfer(self, cmd, "d2h"), cmd.ranks)
            elif t is C.ReadBlocks:
                self.read_pool.submit(_Transfer(self, cmd, "h2d"), cmd.ranks)
            elif t is C.CancelCommand:
                self.cancelled.add(cmd.command_id)
            elif t is C.StartPrefill:
                req = cl.reqs[cmd.request_id]
                req.cached_tokens = cmd.num_cached_tokens
                self.queue.append((req, req.input_len - cmd.num_cached_tokens, cmd.num_cached_tokens))
                self._wake()
            elif t is C.SendFirstToken:
                ev = self.env.timeout(cl.net_latency)
                ev.callbacks.append(lambda _e, c=cmd: cl.first_token(c))
            elif t is C.StartDecode:
                req = cl.reqs[cmd.request_id]
                req.cap = len(cmd.block_ids) * cl.block_size
                if req.generated >= req.out:
                    self.finishing.append(req)  # one-token answers: nothing left to decode
                else:
                    self.running[req.rid] = req
                self._wake()
            elif t is C.Recompute:
                req = cl.reqs[cmd.request_id]
                self.queue.append((req, req.synced - cmd.from_token, cmd.from_token))
                self._wake()
            elif t is C.RequestEnded:
                if self.role == "decode":
                    cl.ended(cl.reqs[cmd.request_id], cmd.state, cmd.error_code)
            # FreeBlocks: the pool already took the blocks back; nothing to time

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def _idle(self):
        self.wake = self.env.event()
        return self.wake

    # -- compute loops -------------------------------------------------------------------------
    def _prefill_loop(self):
        cl, env, q, lc = self.cluster, self.env, self.queue, self.lc
        budget = cl.scenario.cluster.prefill_token_budget
        while True:
            if not q:
                yield self._idle()
                continue
            batch, tokens = [], 0
            while q and (not batch or tokens + q[0][1] <= budget):
                item = q.popleft()
                batch.append(item)
                tokens += item[1]
            t = cl.compute.prefill_time((n, c) for _, n, c in batch)
            self.busy_time += t
            yield env.timeout(t)
            for req, _, _ in batch:
                if lc.state_of(req.rid) == "prefilling":
                    lc.prefill_done(req.rid, _FIRST_TOKEN)
            self.pump()

    def _decode_loop(self):
        cl, env, lc, running = self.cluster, self.env, self.lc, self.running
        max_batch = cl.scenario.cluster.decode_max_batch
        while True:
            while self.finishing:
                req = self.finishing.pop()
                req.finish = env.now
                lc.finish(req.rid)
                self.pump()
            self._resume_preempted()
            recompute = list(self.queue)
            self.queue.clear()
            batch = list(running.values())[:max_batch]
            if not batch and not recompute:
                yield self._idle()
                continue
            t = cl.compute.decode_step_time(len(batch), sum(r.ctx for r in batch))
            if recompute:
                t += cl.compute.prefill_time((n, c) for _, n, c in recompute)
            self.busy_time += t
            yield env.timeout(t)
            now = env.now
            for req, _, _ in recompute:
                if req.rid in cl.live and lc.state_of(req.rid) == "recomputing":
                    lc.recompute_done(req.rid)
            for req in batch:
                if req.rid not in running:
                    continue  # preempted during this step by a neighbour
                if req.generated + 1 >= req.out:
                    del running[req.rid]
                    req.generated += 1
                    req.finish = now
                    lc.finish(req.rid)
                    continue
                if req.ctx + 1 > req.cap and not self._grow(req):
                    continue  # no block: this request waits a step (a victim is writing back)
                req.generated += 1
                req.ctx += 1
            self.pump()
            cl.retry_backlog()

    def _sync(self, req: SimRequest, upto: int) -> tuple[int, ...]:
        added = ()
        if upto > req.synced:
            added = self.lc.append_tokens(req.rid, unique_tokens(req.base, req.synced, upto))
            req.synced = upto
        return added

    def _grow(self, req: SimRequest) -> bool:
        """Give ``req`` the block its next token needs, preempting the newest running request
        (possibly ``req`` itself) when none is free."""
        running = self.running
        while True:
            try:
                added = self._sync(req, req.ctx + 1)
            except OutOfBlocksError:
                if any(self.lc.state_of(p.rid) == "preempt_writing" for p in self.preempted
                       if p.rid in self.cluster.live):
                    return False  # blocks are on their way back: wait rather than preempt more
                victim = next(reversed(running.values()))
                self._preempt(victim)
                if victim is req:
                    return False
                if self.lc.state_of(victim.rid) != "preempted":
                    return False  # its blocks free once its write-back answers
                continue
            req.cap += len(added) * self.cluster.block_size
            return True

    def _preempt(self, req: SimRequest) -> None:
        del self.running[req.rid]
        self._sync(req, req.ctx)
        req.preemptions += 1
        self.cluster.counters["preemptions"] += 1
        self.lc.preempt(req.rid)
        self.preempted.append(req)
        self.pump()

    def _resume_preempted(self) -> None:
        lc, pre = self.lc, self.preempted
        while pre:
            req = pre[0]
            if req.rid not in self.cluster.live or lc.state_of(req.rid) not in ("preempted", "preempt_writing"):
                pre.popleft()
                continue
            if lc.state_of(req.rid) != "preempted":
                return  # FIFO: its write-back is still running
            need = self.cluster.cache_spec.blocks_for(req.synced) + lc.policy.decode_headroom_blocks
            if lc.pool.num_free < need:
                return
            pre.popleft()
            lc.resume(req.rid)
            self.pump()


class Cluster:
    """A whole simulation of one :class:`~kvstate.sim.scenario.Scenario`."""

    def __init__(self, scenario: Scenario, cost: TransferCostModel | None = None) -> None:
        s = self.scenario = scenario
        self.env = simpy.Environment()
        m, tp = s.model, s.cluster.tp
        if m.kv_heads % tp:
            raise ConfigError(f"{s.source}: [model] kv_heads {m.kv_heads} is not divisible by [cluster] tp {tp}")
        self.cache_spec = CacheSpec(num_layers=m.num_layers, kv_heads=m.kv_heads // tp, block_size=m.block_size,
                                    head_dim=m.head_dim, dtype=m.dtype, tp_size=tp)
        self.block_size = m.block_size
        self.gpu_blocks = s.gpu_blocks()
        p = s.policy
        self.policy = Policy(read_prefix=p.read_prefix, write_retries=p.write_retries, read_failure=p.read_failure,
                             preempt=p.preempt, transfer_timeout=p.transfer_timeout_s,
                             fence_grace=p.transfer_timeout_s, decode_headroom_blocks=p.decode_headroom_blocks)
        self.cost = cost or TransferCostModel.load(s.gpu.calibration)
        self.compute = ComputeModel(s)
        self.shard_bytes = s.block_bytes_per_rank
        self.chunk_bytes = self.cache_spec.kv_heads * m.block_size * m.head_dim * self.cache_spec.np_dtype.itemsize
        self.kinds = len(self.cache_spec.kinds)
        self.staging_bytes = s.cluster.staging_mib << 20
        self.store = SimStore(s.storage, self.shard_bytes, tp)
        self.net_latency = s.network.latency_ms / 1000.0
        self.rng = np.random.default_rng(s.seed + 1)
        self.faults_write, self.faults_read = s.faults.write_fail, s.faults.read_fail
        self.counters = dict.fromkeys(("preemptions", "partial_reads", "injected_write_failures",
                                       "injected_read_failures", "backlogged", "rejected_too_long"), 0)
        self.reqs: dict[str, SimRequest] = {}
        self.live: set[str] = set()
        self.done: list[SimRequest] = []
        self.backlog: deque[SimRequest] = deque()
        need = self.cache_spec.blocks_for(s.workload.input_max + 1) if s.workload.arrival != "trace" else 0
        if need > self.gpu_blocks:
            raise ConfigError(f"{s.source}: [workload] input_max {s.workload.input_max} needs {need} blocks, "
                              f"more than an instance's {self.gpu_blocks}")
        self.prefill = [Instance(self, "prefill", i) for i in range(s.cluster.n_prefill)]
        self.decode = [Instance(self, "decode", i) for i in range(s.cluster.n_decode)]
        self.total, self._arrivals = arrivals(s.workload, s.seed)
        self.arrived = 0
        self.finished = self.env.event()
        self.series: list[dict[str, Any]] = []
        self.env.process(self._arrive())
        self.env.process(self._ticker())
        self.env.process(self._sampler())

    # -- costs -------------------------------------------------------------------------------
    def link_seconds(self, direction: str, n: int) -> float:
        """PCIe seconds of one rank moving ``n`` blocks, in staging-sized pieces, one call per kind."""
        per_piece = max(1, self.staging_bytes // self.shard_bytes)
        full, rest = divmod(n, per_piece)
        layers = self.cache_spec.layers
        t = full * self.cost.time_of(direction, per_piece * layers, self.chunk_bytes)
        t += self.cost.time_of(direction, rest * layers, self.chunk_bytes)
        return t * self.kinds

    # -- request flow -------------------------------------------------------------------------
    def _arrive(self):
        env = self.env
        for a in self._arrivals:
            if a.time > env.now:
                yield env.timeout(a.time - env.now)
            req = SimRequest(a)
            self.reqs[req.rid] = req
            self.live.add(req.rid)
            self.arrived += 1
            if self.backlog or not self._route(req):
                self.backlog.append(req)
                self.counters["backlogged"] += 1
        self._check_finished()

    def _route(self, req: SimRequest) -> bool:
        """Reserve D blocks, then admit on the least loaded P. False: no D can take it now."""
        best = None
        for d in self.decode:
            if d.lc.can_reserve(req.input_len) and (best is None or d.lc.pool.num_free > best.lc.pool.num_free):
                best = d
        if best is None:
            if self.cache_spec.blocks_for(req.input_len + 1) > self.gpu_blocks:
                self._reject(req)  # larger than any instance: it can never run
                return True
            return False
        best.lc.reserve(req.rid, req.tokens)
        req.d = best
        p = min(self.prefill, key=lambda i: (sum(n for _, n, _ in i.queue) + i.lc.num_waiting, i.assigned))
        p.assigned += 1
        req.p = p
        req.state = "prefill"
        p.lc.admit(req.rid, req.tokens)
        req.tokens = None  # the lifecycles hold their own copies
        p.pump()
        return True

    def _reject(self, req: SimRequest) -> None:
        self.counters["rejected_too_long"] += 1
        req.state, req.error, req.finish = "rejected", 413, self.env.now
        self.live.discard(req.rid)
        self.done.append(req)

    def retry_backlog(self) -> None:
        while self.backlog and self._route(self.backlog[0]):
            self.backlog.popleft()

    def first_token(self, cmd: C.SendFirstToken) -> None:
        req = self.reqs[cmd.request_id]
        d = req.d
        if cmd.error_code == 200:
            req.first_token = self.env.now
            req.generated = 1
            req.ctx = req.synced = req.input_len + 1
        d.lc.deliver_first_token(req.rid, cmd.token, cmd.error_code)
        d.pump()

    def ended(self, req: SimRequest, state: str, code: int) -> None:
        req.state = state
        req.error = code
        if req.finish is None:
            req.finish = self.env.now
        self.live.discard(req.rid)
        self.done.append(req)
        self.retry_backlog()
        self._check_finished()

    def _check_finished(self) -> None:
        if self.arrived == self.total and not self.live and not self.finished.triggered:
            self.finished.succeed()

    # -- housekeeping processes ---------------------------------------------------------------
    def _ticker(self):
        period = min(1.0, self.policy.transfer_timeout / 10)
        while not self.finished.triggered:
            yield self.env.timeout(period)
            for inst in self.prefill + self.decode:
                if inst.lc.tick():
                    inst.pump()

    def _sampler(self):
        period = self.scenario.sample_ms / 1000.0
        while not self.finished.triggered:
            self.series.append(self.snapshot())
            yield self.env.timeout(period)
        self.series.append(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        return {
            "t": round(self.env.now, 6),
            "prefill_queue": [len(i.queue) + i.lc.num_waiting for i in self.prefill],
            "decode_running": [len(i.running) for i in self.decode],
            "decode_preempted": [len(i.preempted) for i in self.decode],
            "backlog": len(self.backlog),
            "blocks_used": {i.name: i.lc.pool.num_used for i in self.prefill + self.decode},
            "storage_used_bytes": self.store.used,
        }

    # -- run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run to the end (every request terminal) or the time limit; returns raw results."""
        limit = self.scenario.time_limit_s
        stalled = None
        try:
            self.env.run(until=self.env.any_of([self.finished, self.env.timeout(limit)]))
        except RuntimeError as e:  # no scheduled events left: everything waits on something
            stalled = str(e)
        drained = self.finished.triggered
        stuck = [s.describe() for i in self.prefill + self.decode for pool in (i.write_pool, i.read_pool)
                 for s in pool.stuck]
        report = None
        if not drained or stuck:
            report = {
                "reason": ("event queue empty" if stalled else
                           f"time limit {limit}s passed" if not drained else "barrier waits timed out"),
                "stuck_ranks": stuck,
                "live_requests": {rid: {"prefill": _state(self.reqs[rid].p, rid), "decode": _state(self.reqs[rid].d, rid)}
                                  for rid in sorted(self.live, key=lambda r: int(r[1:]))[:50]},
                "live_count": len(self.live),
            }
        return {"drained": drained, "deadlock": report, "end_time": self.env.now}


def _state(inst: Instance | None, rid: str) -> str:
    if inst is None:
        return "-"
    try:
        return inst.lc.state_of(rid)
    except UnknownRequestError:  # ended on that side
        return "ended"

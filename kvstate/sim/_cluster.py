"""The simulated cluster: P and D instances running the production lifecycle machines under SimPy.

Each instance holds a :class:`~kvstate._prefill.PrefillLifecycle` or
:class:`~kvstate._decode.DecodeLifecycle` on the simulation clock — the very machines an
engine runs. This module wires one run together: the cache geometry and policy from the
scenario, the cost models, the shared storage pool, the instances
(:mod:`~kvstate.sim._prefill`, :mod:`~kvstate.sim._decode`), the router
(:mod:`~kvstate.sim._router`), arrivals, the first-token message from P to D, each
lifecycle's deadlines (ticked exactly at ``next_deadline()``), a sampler of queues and
block use, and the end of the run: every request ended and no transfer outstanding.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from simpy import Event, Timeout

from .. import commands as C
from .._errors import ConfigError
from .._spec import CacheSpec
from .._validate import check_callable
from ..kernels._cost import TransferCostModel
from ._decode import DecodeInstance
from ._instance import Instance
from ._metrics import merged_hist, pd_sections, sample_series
from ._prefill import PrefillInstance
from ._request import SimRequest
from ._router import Router
from ._scenario import Scenario, check_scenario
from ._services import Services
from ._workload import arrivals

__all__ = ["Cluster"]


class Cluster:
    """A whole simulation of one :class:`~kvstate.sim._scenario.Scenario`.

    ``on_end(done, total)``, when given, is called as requests end (every 64th, and the
    last): a progress hook for long runs.
    """

    def __init__(self, scenario: Scenario, cost: TransferCostModel | None = None,
                 on_end: Callable[[int, int], None] | None = None) -> None:
        check_scenario(scenario, "Cluster")
        check_callable(on_end, "Cluster: on_end", optional=True, error=ConfigError)
        if cost is not None and not callable(getattr(cost, "time", None)):
            raise ConfigError(f"Cluster: cost must be a transfer cost model or None, got {cost!r}")
        s = self.scenario = scenario
        sv = self.sv = Services(scenario, cost)
        sv.first_token, sv.ended, sv.check_finished = self.first_token, self.ended, self.check_finished
        sv.blocks_freed = self._blocks_freed
        # the run's records and models, shared with the instances (the same objects)
        self.env, self.store, self.counters = sv.env, sv.store, sv.counters
        self.reqs, self.live, self.done, self.round_trips = sv.reqs, sv.live, sv.done, sv.round_trips
        self.cache_spec, self.block_size, self.gpu_blocks = sv.cache_spec, sv.block_size, sv.fit_blocks
        self._check_fits(s, self.cache_spec)
        self.prefill = [PrefillInstance(sv, i) for i in range(s.cluster.n_prefill)]
        self.decode = [DecodeInstance(sv, i) for i in range(s.cluster.n_decode)]
        self.instances: list[Instance] = [*self.prefill, *self.decode]
        self.router = Router(sv, self.prefill, self.decode)
        sv.retry_backlog = self.router.retry_backlog
        self.total, self._arrivals = arrivals(s.workload, s.seed, s.model.context, s.time_limit_s)
        self.arrived = 0
        self.finished = self.env.event()
        self.series: list[dict[str, Any]] = []
        self._on_end = on_end
        self.env.process(self._arrive())
        self.env.process(sample_series(self))

    def _check_fits(self, s: Scenario, spec: CacheSpec) -> None:
        need = spec.blocks_for(s.workload.input_max + 1) if s.workload.arrival != "trace" else 0
        if need > self.gpu_blocks:
            raise ConfigError(f"{s.source}: [workload] input_max {s.workload.input_max} needs {need} blocks, "
                              f"more than an instance's {self.gpu_blocks}")

    def _blocks_freed(self) -> None:
        """Blocks came free at a D: each D's step ends now, where the backlog is retried (and
        its own preempted requests may resume). A D with nothing waiting for blocks, with an
        empty backlog, sleeps on: its step's end would retry nothing, and only blocks coming
        free can make a later arrival routable (a free then finds it in the backlog)."""
        waiting = bool(self.router.backlog)
        for d in self.decode:
            if waiting or d.preempted:
                d.cut_span()

    # -- request flow -------------------------------------------------------------------------
    def _arrive(self) -> Generator[Event, object, None]:
        env = self.env
        for a in self._arrivals:
            if a.time > env.now:
                yield Timeout(env, a.time - env.now)
            req = SimRequest(a)
            self.reqs[req.rid] = req
            self.live.add(req.rid)
            self.arrived += 1
            self.router.arrive(req)
        self.check_finished()

    def first_token(self, cmd: C.SendFirstToken) -> None:
        """P's first token (or its error) reaches D."""
        req = self.reqs[cmd.request_id]
        d = req.d
        assert d is not None
        if cmd.error_code == 200:
            req.first_token = req.last_token = self.env.now
            req.generated = 1
            req.ctx = req.synced = req.input_len + 1
        d.lc.deliver_first_token(req.rid, cmd.token, cmd.error_code)  # False: D gave up already
        d.pump()

    def ended(self, req: SimRequest, end: C.RequestEnded) -> None:
        """D ended the request: it is over. If P still works on it (D's first-token deadline
        passed while the prompt waited at P), the router aborts it there, as an engine's
        router would on D's ``RequestEnded``."""
        req.state, req.error, req.reason = end.state, end.error_code, end.reason
        req.drop_tokens()
        if req.finish is None:
            req.finish = self.env.now
        self.live.discard(req.rid)
        self.done.append(req)
        p = req.p
        if p is not None and p.lc.is_live(req.rid):
            p.lc.abort(req.rid)
            p.pump()
        if self._on_end is not None and (len(self.done) % 64 == 0 or not self.live):
            self._on_end(len(self.done), self.total)
        self.router.retry_backlog()
        self.check_finished()

    def check_finished(self) -> None:
        """The run is over when every request ended and no transfer is outstanding anywhere
        (a timed-out transfer's late answer, or its fence, still unpins blocks)."""
        if self.arrived == self.total and not self.live and not self.finished.triggered \
                and not any(i.lc.pending_commands() for i in self.instances):
            self.finished.succeed()

    # -- the time series -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "t": round(self.env.now, 6),
            "prefill_queue": [len(i.queue) + i.lc.num_waiting for i in self.prefill],
            "decode_running": [i.running for i in self.decode],
            "decode_preempted": [len(i.preempted) for i in self.decode],
            "backlog": len(self.router.backlog),
            "blocks_used": {i.name: i.lc.pool.num_used for i in self.instances},
            "storage_used_bytes": self.store.used,
        }

    # -- what the report reads ------------------------------------------------------------------
    def itl(self) -> dict[float, int]:
        """Every inter-token gap (s) and its tokens, over the D instances."""
        return merged_hist(x.itl for x in self.decode)

    def sections(self, end: float, prompt_tokens: int) -> dict[str, Any]:
        """The report's parts that only a PD run has."""
        return pd_sections(self, end, prompt_tokens)

    # -- run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run to the end (every request ended, nothing outstanding) or the time limit."""
        limit = self.scenario.time_limit_s
        stalled = None
        try:
            self.env.run(until=self.env.any_of([self.finished, self.env.timeout(limit)]))
        except RuntimeError as e:  # no scheduled events left: everything waits on something
            stalled = str(e)
        for inst in self.instances:
            inst.note_blocks()
        drained = self.finished.triggered
        stuck = [s.describe() for i in self.instances for pool in (i.write_pool, i.read_pool) for s in pool.stuck]
        report = None
        if not drained or stuck:
            report = {
                "reason": ("event queue empty" if stalled else
                           f"time limit {limit}s passed" if not drained else "barrier waits timed out"),
                "stuck_ranks": stuck,
                "live_requests": {rid: {"prefill": _state(self.reqs[rid].p, rid),
                                        "decode": _state(self.reqs[rid].d, rid)}
                                  for rid in sorted(self.live, key=lambda r: int(r[1:]))[:50]},
                "live_count": len(self.live),
            }
        return {"drained": drained, "deadlock": report, "end_time": self.env.now}


def _state(inst: Instance | None, rid: str) -> str:
    if inst is None:
        return "-"
    return inst.lc.state_of(rid) if inst.lc.is_live(rid) else "ended"

"""A simulated co-located deployment: ``n_instances`` instances each doing prefill and decode.

The baseline a PD plan is weighed against: the same GPUs, model and workload, served the
way vLLM v1 serves them on one instance (:mod:`kvstate.sim._colocated`), with no cache moving
between instances. An arrival whose prompt and answer could never fit (beyond
``max_model_len``, or beyond the instance's blocks) is refused at once (400), as vLLM refuses
it; the others go, after the front end's ``frontend_ms``, to the instance with the fewest
requests on it (the lowest index on ties).
A run ends when every request has ended.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import simpy

from .._keys import KeyCache
from ._colocated import ColocatedInstance
from ._compute import ComputeModel
from ._metrics import latency_stats, merged_hist, sample_series
from ._request import SimRequest
from ._scenario import Scenario
from ._workload import arrivals

__all__ = ["ColocatedCluster"]


class ColocatedCluster:
    """A whole co-located simulation of one scenario (``on_end(done, total)``: a progress hook)."""

    def __init__(self, scenario: Scenario, on_end: Callable[[int, int], None] | None = None) -> None:
        s = self.scenario = scenario
        self.env = simpy.Environment()
        self.gpu_blocks = s.gpu_blocks()
        self.block_size = s.model.block_size
        self.counters = {"preemptions": 0, "rejected_too_long": 0}
        self.done: list[SimRequest] = []
        self.live = 0
        compute, keys = ComputeModel(s), KeyCache(size=1024)
        self.instances = [ColocatedInstance(self.env, s, compute, i, self.gpu_blocks, self.counters, self._ended)
                          for i in range(s.cluster.n_instances)]
        for inst in self.instances:
            inst.key_cache = keys
        limit = s.scheduler.max_model_len
        self.max_len = min(limit, self.gpu_blocks * self.block_size) if limit else self.gpu_blocks * self.block_size
        self.frontend = s.scheduler.frontend_ms / 1000.0
        self.total, self._arrivals = arrivals(s.workload, s.seed, s.model.context, s.time_limit_s)
        self.arrived = 0
        self.finished = self.env.event()
        self.series: list[dict[str, Any]] = []
        self._on_end = on_end
        self.env.process(self._arrive())
        self.env.process(sample_series(self))

    @property
    def round_trips(self) -> list[float]:
        return [t for i in self.instances for t in i.round_trips]

    def itl(self) -> dict[float, int]:
        """Every inter-token gap (s) and its tokens, over the instances."""
        return merged_hist(x.itl for x in self.instances)

    # -- request flow ---------------------------------------------------------------------------
    def _arrive(self) -> Generator[simpy.Event, object, None]:
        env = self.env
        for a in self._arrivals:
            if a.time > env.now:
                yield env.timeout(a.time - env.now)
            req = SimRequest(a)
            self.arrived += 1
            self.live += 1
            if req.input_len + req.out > self.max_len:
                self.counters["rejected_too_long"] += 1
                req.state, req.error, req.finish, req.reason = "rejected", 400, env.now, "rejected_too_long"
                self._ended(req)
                continue
            if self.frontend:  # the front end hands it over later; its latencies count from its arrival
                env.timeout(self.frontend).callbacks.append(partial(self._handed_over, req))
            else:
                self._route(req)
        self._check_finished()

    def _handed_over(self, req: SimRequest, _event: simpy.Event) -> None:
        """The front end's delay for ``req`` passed: it reaches an instance now."""
        self._route(req)

    def _route(self, req: SimRequest) -> None:
        min(self.instances, key=lambda i: i.load).add(req)

    def _ended(self, req: SimRequest) -> None:
        self.live -= 1
        self.done.append(req)
        if self._on_end is not None and (len(self.done) % 64 == 0 or not self.live):
            self._on_end(len(self.done), self.total)
        self._check_finished()

    def _check_finished(self) -> None:
        if self.arrived == self.total and not self.live and not self.finished.triggered:
            self.finished.succeed()

    # -- the time series -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {"t": round(self.env.now, 6), "waiting": [len(i.waiting) for i in self.instances],
                "running": [len(i.running) for i in self.instances],
                "blocks_used": {i.name: i.pool.num_used for i in self.instances}}

    # -- run ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run to the end (every request ended) or the time limit."""
        limit = self.scenario.time_limit_s
        self.env.run(until=self.env.any_of([self.finished, self.env.timeout(limit)]))
        drained = self.finished.triggered
        report = None if drained else {
            "reason": f"time limit {limit}s passed", "stuck_ranks": [], "live_count": self.live,
            "live_requests": {q.req.rid: {"prefill": "waiting", "decode": "-"}
                              for i in self.instances for q in list(i.waiting)[:10]}}
        return {"drained": drained, "deadlock": report, "end_time": self.env.now}

    def sections(self, end: float, prompt_tokens: int) -> dict[str, Any]:
        """The report's parts that only a co-located run has."""
        share = (lambda n: round(n / prompt_tokens, 4)) if prompt_tokens else (lambda n: 0.0)
        cached = sum(r.cached_tokens for r in self.done)
        pools = [i.pool for i in self.instances]
        prefix = None
        if self.scenario.scheduler.prefix_caching:
            stats = [p.prefix_stats() for p in pools]  # type: ignore[attr-defined]
            prefix = {"prefix_hit_rate_gpu": share(cached), "cached_blocks": sum(x.cached for x in stats),
                      "evictions": sum(x.evictions for x in stats)}
        seats = self.scenario.scheduler.max_num_seqs
        instances = {i.name: {"compute_busy": round(min(i.busy_time, end) / end, 4),
                              "seats_used": round(i.slot_seconds / end / seats, 4),
                              "blocks_used": round(i.block_seconds / end / self.gpu_blocks, 4),
                              "peak_blocks_used": round(i.pool.stats().peak_used / self.gpu_blocks, 4),
                              "steps": i.step} for i in self.instances}
        peaks = {"waiting": [max((x["waiting"][k] for x in self.series), default=0) for k in range(len(pools))],
                 "running": [max((x["running"][k] for x in self.series), default=0) for k in range(len(pools))]}
        return {"gpu_prefix_cache": prefix, "instances": instances, "peaks": peaks,
                "preemption_round_trip_ms": latency_stats(self.round_trips)}

"""The highest arrival rate a configuration holds: a bisection on the rate, each probe a run
judged as ``kvstate simulate`` judges it (:mod:`kvstate.sim._metrics`).

Rules:

- A probe at rate ``r`` re-times the scenario's arrivals to ``r`` (a synthetic workload's
  ``rate``, a trace's ``trace_rate``) and keeps the base run's duration: a synthetic workload
  offers ``r x duration`` requests (at least the scenario's own), so every probe sees the load
  as long as the target's run did. A probe that is too short to judge is run again with twice
  the requests (up to :data:`MAX_GROWTH` times the first), so each verdict is a judged one.
- A rate *holds* when its probe meets the SLOs; one that fails, did not drain or stays too
  short does not.
- The search brackets the answer by doubling (or halving) from the target rate, at most
  :data:`MAX_STEPS` times, then bisects the bracket geometrically until its ends are within
  ``precision`` of each other. The answer is the bracket's low end, the highest rate seen to
  hold; ``precision`` is how far above it the true limit may lie. A configuration that holds no
  rate down to the target / 2**MAX_STEPS answers 0.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError, KVStateError
from ._metrics import verdict_of
from ._run import simulate
from ._scenario import Scenario
from ._scenario_io import with_overrides
from ._workload import offered_rate

__all__ = ["highest_rate", "PRECISION", "MAX_STEPS", "MAX_GROWTH"]

PRECISION = 0.05  #: the bracket's relative width at which the bisection stops
MAX_STEPS = 6  #: doublings (or halvings) from the target rate while bracketing
MAX_GROWTH = 4  #: a too-short probe's requests grow at most to this many times its first


def _at_rate(s: Scenario, rate: float, requests: int) -> Scenario:
    """``s`` re-timed to ``rate``, with ``requests`` synthetic arrivals (a trace keeps its own)."""
    if s.workload.arrival == "trace":
        return with_overrides(s, {"workload.trace_rate": rate})
    return with_overrides(s, {"workload.rate": rate, "workload.num_requests": requests})


def _probe(s: Scenario, rate: float, duration: float) -> tuple[str, dict[str, Any]]:
    """(``meets``/``fails``/``too short``/``infeasible``, the probe's figures) at ``rate``."""
    base, growth = max(s.workload.num_requests, math.ceil(rate * duration)), 1
    while True:
        probe = _at_rate(s, rate, base * growth)
        try:
            r = simulate(probe)  # refuses a workload it cannot carry out (check_workload) before it runs
        except KVStateError as e:
            return "infeasible", {"rate_rps": rate, "verdict": "infeasible", "reason": str(e)}
        verdict = verdict_of(r["slo"]) if r["drained"] and not r["deadlock"] else "infeasible"
        out = {"rate_rps": round(rate, 4), "requests": r["requests"], "verdict": verdict,
               "goodput_rps": r["goodput_rps"]}
        growth *= 2
        if verdict != "too short" or s.workload.arrival == "trace" or growth > MAX_GROWTH:
            return verdict, out


def highest_rate(s: Scenario, precision: float = PRECISION,
                 on_probe: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``max_rate_rps`` (the highest rate found to hold), ``max_rate_precision`` (how far above
    it the limit may lie, as a share) and ``probes`` (each probe's rate, requests and verdict)."""
    if not isinstance(precision, float | int) or isinstance(precision, bool) or not 0 < precision < 1:
        raise ConfigError(f"rate search: precision must be within (0, 1), got {precision!r}")
    target = offered_rate(s.workload)
    if not target > 0:
        raise ConfigError("rate search: the scenario offers no rate to start from (every request at once)")
    duration = s.workload.num_requests / target if s.workload.arrival != "trace" else 0.0
    probes: list[dict[str, Any]] = []

    def holds(rate: float) -> bool:
        verdict, out = _probe(s, rate, duration)
        probes.append(out)
        if on_probe is not None:
            on_probe(out)
        return verdict == "meets"

    lo, hi = _bracket(target, holds)
    while lo > 0 and hi / lo > 1 + precision:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return {"max_rate_rps": round(lo, 4), "max_rate_precision": round(hi / lo - 1, 4) if lo > 0 else None,
            "target_rps": round(target, 4), "probes": probes}


def _bracket(target: float, holds: Callable[[float], bool]) -> tuple[float, float]:
    """(a rate that holds or 0, a rate that does not), around ``target`` (see the rules)."""
    if holds(target):
        lo = target
        for _ in range(MAX_STEPS):
            if not holds(lo * 2):
                return lo, lo * 2
            lo *= 2
        return lo, lo * 2  # holds far past the target: say the bracket reached
    hi = target
    for _ in range(MAX_STEPS):
        if holds(hi / 2):
            return hi / 2, hi
        hi /= 2
    return 0.0, hi

"""Capacity planning: sweep scenario fields, keep the cheapest configuration meeting the SLOs.

Every combination of the swept values (``{"cluster.n_prefill": [1, 2, 3], ...}``) is simulated
at the target rate, in parallel over the machine's cores or as tasks on a Ray cluster
(:mod:`~kvstate.sim._sweep`): the rows are the same either way. Every value is checked against its
field's rules before any simulation runs: a typo is the whole plan's error, never a row. Each
row's verdict (:mod:`kvstate.sim._metrics`) is one of:

- ``meets``: the run drained, TTFT and TPOT attainment reach the target, goodput reaches
  target x offered rate;
- ``fails``: one of those does not hold;
- ``too short``: it would be judged on goodput alone, and the run is too short for its rates
  to resolve the test (the row says how many requests would do);
- ``infeasible``: the combination cannot be built (its model does not fit, its TP does not
  divide the heads), its simulation failed, or it did not drain.

A configuration's cost is what its GPUs cost an hour (``gpu.price_per_hour`` for P or co-located
GPUs, D's own with ``cluster.d_gpu`` or ``cluster.d_price_per_hour``) where every configuration's
GPUs have a price, else its number of GPUs, ``n_prefill * tp + n_decode * d_tp`` (``n_instances *
tp`` co-located); then the storage bandwidth (none co-located). The plan is the cheapest that
meets the SLOs, and the cheapest of each mode swept. A row's ``cost_per_mtok`` is its cost per
million output tokens at the rate it served (``cost_per_mtok_at_max_rate`` at the highest rate
it holds, with ``search_rate``). Sweeping ``cluster.mode=pd,colocated`` weighs disaggregation against the
co-located baseline on the same workload (give ``cluster.n_instances`` so both use as many GPUs).
When a configuration at most as cheap is too short to judge, the plan is undecided and says
which (``undecided``).

The highest arrival rate a configuration holds (:func:`highest_rate`, ``--search-rate``) is a
bisection on the rate, each probe a run judged as ``kvstate simulate`` judges it.
Its rules:

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

import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import ConfigError, KVStateError
from .._validate import check_callable, check_int, is_real
from ._metrics import verdict_of
from ._run import simulate
from ._scenario import Scenario, WorkloadSpec, check_scenario
from ._scenario_io import field_names, with_overrides
from ._sweep import run_all
from ._workload import check_workload, offered_rate

__all__ = ["plan", "parse_sweep", "Row", "highest_rate", "PRECISION", "MAX_STEPS", "MAX_GROWTH"]

Row = dict[str, Any]  #: one configuration's outcome (see :func:`plan`)

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


def _value(text: str) -> Any:
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_sweep(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["cluster.n_decode=1,2,4", ...]`` -> ``{"cluster.n_decode": [1, 2, 4], ...}`` (numbers
    and true/false parsed). A field given twice is an error."""
    out: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not name or not values.strip():
            raise ConfigError(f"--sweep {item!r}: expected FIELD=V1,V2,...")
        if name in out:
            raise ConfigError(f"--sweep {name} is given twice: list all its values once (FIELD=V1,V2)")
        out[name] = [_value(v) for v in values.split(",")]
    return out


def _cost(s: Scenario) -> tuple[int, float]:
    """GPUs, then storage bandwidth (a co-located deployment uses none)."""
    bw = s.storage.bandwidth_gbps if s.cluster.mode == "pd" else 0.0
    return s.cluster.gpus, bw


def _infeasible(config: dict[str, Any], reason: str) -> Row:
    return {"config": config, "gpus": None, "storage_bandwidth_gbps": None, "feasible": False,
            "reason": reason, "meets_slo": False, "unmet": [reason], "verdict": "infeasible", "too_short": None,
            "cost_per_hour": None, "cost_per_mtok": None}


def _per_mtok(cost_per_hour: float | None, tokens_per_s: float) -> float | None:
    """USD per million output tokens of a deployment costing ``cost_per_hour`` that generates
    ``tokens_per_s``; None where either is not known."""
    if cost_per_hour is None or not tokens_per_s:
        return None
    return round(cost_per_hour / (tokens_per_s * 3600 / 1e6), 4)


def _run_one(args: tuple[Scenario | str, dict[str, Any]]) -> Row:
    """Simulate one configuration; any failure makes it an infeasible row, never an exception."""
    s, config = args
    if isinstance(s, str):  # it could not be built: the reason
        return _infeasible(config, s)
    try:
        r = simulate(s)
    except KVStateError as e:
        return _infeasible(config, f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - a sweep outlives a failing configuration, and says why
        return _infeasible(config, f"simulation failed ({type(e).__name__}: {e})")
    gpus, bw = _cost(s)
    drained = r["drained"] and not r["deadlock"]
    slo = r["slo"]
    return {
        "config": config, "gpus": gpus, "storage_bandwidth_gbps": bw, "feasible": drained,
        "reason": None if drained else f"did not drain: {r['deadlock']['reason']}",
        "meets_slo": slo["meets"], "unmet": slo["unmet"], "too_short": slo["too_short"],
        "rate_uncertainty": r["rate_uncertainty"], "requests_needed": slo["requests_needed"],
        "verdict": verdict_of(slo) if drained else "infeasible", "offered_rps": r["offered_rps"],
        "goodput_rps": r["goodput_rps"], "throughput_rps": r["throughput_rps"],
        "ttft_attainment": slo["ttft_attainment"], "tpot_attainment": slo["tpot_attainment"],
        "e2el_attainment": slo["e2el_attainment"],
        "ttft_p99_ms": r["ttft_ms"]["p99"], "tpot_p99_ms": r["tpot_ms"]["p99"],
        "ttft_at_target_ms": slo["ttft_at_target_ms"], "tpot_at_target_ms": slo["tpot_at_target_ms"],
        "preemptions": r["preemptions"], "partial_reads": r.get("partial_reads", 0), "reasons": r["reasons"],
        "failed": r["failed"], "failed_rps": r["failed_rps"], "service_stretch": r["service_stretch"],
        "mode": r["mode"], "cost_per_hour": s.cost_per_hour, "output_tokens_per_s": r["output_tokens_per_s"],
        "cost_per_mtok": _per_mtok(s.cost_per_hour, r["output_tokens_per_s"]),
    }


def _run_with_search(args: tuple[Scenario | str, dict[str, Any]]) -> Row:
    """:func:`_run_one`, then the highest rate the configuration holds
    (:func:`highest_rate`): ``max_rate_rps``, ``max_rate_precision``."""
    row = _run_one(args)
    s = args[0]
    if isinstance(s, str) or not row["feasible"]:
        return {**row, "max_rate_rps": None, "max_rate_precision": None, "rate_probes": 0}
    try:
        found = highest_rate(s)
    except KVStateError as e:
        return {**row, "max_rate_rps": None, "max_rate_precision": None, "rate_probes": 0, "reason": str(e)}
    # at the highest rate held, each request generates what it did at the target rate
    per_request = row["output_tokens_per_s"] / row["throughput_rps"] if row["throughput_rps"] else 0.0
    return {**row, "max_rate_rps": found["max_rate_rps"], "max_rate_precision": found["max_rate_precision"],
            "rate_probes": len(found["probes"]),
            "cost_per_mtok_at_max_rate": _per_mtok(row["cost_per_hour"], found["max_rate_rps"] * per_request)}


def _check_value(base: Scenario, name: str, value: Any) -> None:
    """``value`` obeys field ``name``'s own rules (type, range, choices) and means something for
    the base's arrivals; rules between fields are the combination's (an infeasible row)."""
    sec, _, field = name.rpartition(".")
    if not sec:
        dataclasses.replace(base, **{field: value})
        return
    dataclasses.replace(getattr(base, sec), **{field: value})
    if sec == "workload" and not WorkloadSpec.applies(field, base.workload.arrival):
        raise ConfigError(f"does not apply to {base.workload.arrival!r} arrivals")


def _jobs(base: Scenario, sweep: Mapping[str, Sequence[Any]], fixed: dict[str, Any]) -> list[tuple[Any, dict]]:
    """One job per combination: its scenario, or why it cannot be built. Every value is checked
    first: a bad one is a ConfigError before any job exists."""
    known = set(field_names())
    for name, values in sweep.items():
        if name not in known:
            raise ConfigError(f"--sweep: unknown scenario field {name!r} (fields are SECTION.NAME, "
                              f"e.g. cluster.n_decode; `kvstate scenario` lists them)")
        for v in values:
            try:
                _check_value(base, name, v)
            except ConfigError as e:
                raise ConfigError(f"--sweep {name}={v!r}: {e}") from None
    names = list(sweep)
    jobs: list[tuple[Any, dict]] = []
    for combo in itertools.product(*(sweep[n] for n in names)):
        config = dict(zip(names, combo))
        try:
            s = with_overrides(base, {**fixed, **config})
            s.gpu_blocks()  # the model must fit the GPU
            check_workload(s.workload, s.model.context, s.time_limit_s)  # and its workload be realizable
            jobs.append((s, config))
        except ConfigError as e:
            jobs.append((str(e), config))
    return jobs


def _check_plan(base: Any, sweep: Any, rate: Any, attainment: Any, workers: Any, ray: Any, on_row: Any,
                search_rate: Any) -> None:
    """Every argument of :func:`plan`, before anything runs."""
    check_scenario(base, "plan: base")
    if not isinstance(sweep, Mapping) or not sweep or not all(
            isinstance(k, str) and isinstance(v, Sequence) and not isinstance(v, (str, bytes)) and v
            for k, v in sweep.items()):
        raise ConfigError("plan: sweep must map at least one 'section.field' to a non-empty list of values")
    for name, v, low in (("rate", rate, 0.0), ("attainment", attainment, 0.0)):
        if v is not None and (not is_real(v) or v <= low or (name == "attainment" and v > 1)):
            raise ConfigError(f"plan: {name} must be a finite number > 0{' and <= 1' if name == 'attainment' else ''}"
                              f", got {v!r}")
    if workers is not None:
        check_int(workers, "plan: workers", minimum=1, maximum=1024, error=ConfigError)
    if ray is not None and (not isinstance(ray, str) or not ray):
        raise ConfigError(f"plan: ray must be a Ray address (a non-empty str), got {ray!r}")
    check_callable(on_row, "plan: on_row", optional=True, error=ConfigError)
    if search_rate.__class__ is not bool:
        raise ConfigError(f"plan: search_rate must be a bool, got {search_rate!r}")


def plan(base: Scenario, sweep: Mapping[str, Sequence[Any]], *, rate: float | None = None,
         attainment: float | None = None, workers: int | None = None, ray: str | None = None,
         on_row: Callable[[Row, int, int], None] | None = None, search_rate: bool = False) -> dict[str, Any]:
    """Simulate every combination, on ``workers`` local processes or on the Ray cluster at
    ``ray`` (:mod:`~kvstate.sim._sweep`); returns ``rows`` (sorted by cost, infeasible last,
    ties by the highest rate held with ``search_rate``, else by goodput, then by the sweep's
    order: the same wherever they ran) and ``best`` (or None). ``search_rate``: each row also
    gets the highest rate its configuration holds (``max_rate_rps``, :func:`highest_rate`).
    ``on_row(row, done, total)`` sees each row as it comes."""
    _check_plan(base, sweep, rate, attainment, workers, ray, on_row, search_rate)
    fixed: dict[str, Any] = {}
    if rate is not None:
        fixed["workload.trace_rate" if base.workload.arrival == "trace" else "workload.rate"] = rate
    if attainment is not None:
        fixed["slo.attainment"] = attainment
    base = with_overrides(base, fixed) if fixed else base  # a bad rate is the whole plan's error
    jobs = _jobs(base, sweep, fixed)
    done: list[tuple[int, Row]] = []
    job = _run_with_search if search_rate else _run_one
    for i, row in run_all(job, jobs, workers or os.cpu_count() or 1, ray):
        done.append((i, row))
        if on_row is not None:
            on_row(row, len(done), len(jobs))
    tie = "max_rate_rps" if search_rate else "goodput_rps"  # between equal costs: the most rate held
    priced = all(r["cost_per_hour"] is not None for _, r in done if r["feasible"])
    cost = "cost_per_hour" if priced else "gpus"  # money where every GPU has a price, else GPUs

    def price(r: Row) -> tuple[float, float]:
        return r[cost] or 0, r["storage_bandwidth_gbps"] or 0.0

    done.sort(key=lambda ir: (not ir[1]["feasible"], *price(ir[1]), -(ir[1].get(tie) or 0.0), ir[0]))
    rows = [row for _, row in done]
    best = next((r for r in rows if r["meets_slo"]), None)
    undecided = [r["config"] for r in rows if r["verdict"] == "too short" and (best is None or price(r) <= price(best))]
    modes = {str(r["mode"]) for r in rows if r.get("mode")}
    best_by_mode = {m: next((r for r in rows if r["meets_slo"] and r["mode"] == m), None) for m in sorted(modes)}
    return {"rate": round(offered_rate(base.workload), 4), "attainment": base.slo.attainment,
            "slo": {"ttft_ms": base.slo.ttft_ms, "tpot_ms": base.slo.tpot_ms, "e2el_ms": base.slo.e2el_ms},
            "complete": True,
            "rows": rows, "best": best, "best_by_mode": best_by_mode, "undecided": undecided, "ties_broken_by": tie,
            "cost_by": cost,
            "sweep": {k: list(v) for k, v in sweep.items()},
            "base": base.source}


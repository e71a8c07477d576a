"""Capacity planning: sweep scenario fields, keep the cheapest configuration meeting the SLOs.

Every combination of the swept values (``{"cluster.n_prefill": [1, 2, 3], ...}``) is simulated
at the target rate, in parallel over the machine's cores. A configuration *meets the SLOs*
when the run drained (no deadlock) and at least ``attainment`` of its requests met both the
TTFT and the TPOT SLO. Its cost is the number of GPUs, ``(n_prefill + n_decode) * tp``, then the
storage bandwidth; the cheapest configuration that meets the SLOs is the plan.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from .metrics import simulate
from .scenario import Scenario, with_overrides

__all__ = ["plan", "parse_sweep"]


def parse_sweep(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["cluster.n_decode=1,2,4", ...]`` -> ``{"cluster.n_decode": [1, 2, 4], ...}`` (numbers parsed)."""
    out: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name or not values:
            raise ConfigError(f"--sweep {item!r}: expected FIELD=V1,V2,...")
        vals: list[Any] = []
        for v in values.split(","):
            v = v.strip()
            try:
                vals.append(int(v))
            except ValueError:
                try:
                    vals.append(float(v))
                except ValueError:
                    vals.append(v)
        out[name.strip()] = vals
    return out


def _cost(s: Scenario) -> tuple[float, float]:
    return ((s.cluster.n_prefill + s.cluster.n_decode) * s.cluster.tp, s.storage.bandwidth_gbps)


def _run_one(args: tuple[Scenario, dict[str, Any], float]) -> dict[str, Any]:
    s, config, attainment = args
    r = simulate(s)
    return {
        "config": config, "gpus": _cost(s)[0], "storage_bandwidth_gbps": s.storage.bandwidth_gbps,
        "drained": r["drained"], "slo_attainment": r["slo_attainment"], "goodput_rps": r["goodput_rps"],
        "throughput_rps": r["throughput_rps"], "ttft_p99_ms": r["ttft_ms"]["p99"], "tpot_p99_ms": r["tpot_ms"]["p99"],
        "preemptions": r["preemptions"], "partial_reads": r["partial_reads"],
        "meets_slo": bool(r["drained"] and not r["deadlock"] and r["slo_attainment"] >= attainment),
    }


def plan(base: Scenario, sweep: Mapping[str, Sequence[Any]], *, rate: float | None = None,
         attainment: float = 0.9, workers: int | None = None,
         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Simulate every combination; returns ``rows`` (sorted by cost) and ``best`` (or None)."""
    if not sweep:
        raise ConfigError("plan: give at least one field to sweep")
    if not 0 < attainment <= 1:
        raise ConfigError(f"plan: attainment must be within (0, 1], got {attainment}")
    fixed = {} if rate is None else {"workload.rate": rate}
    names = list(sweep)
    jobs = []
    for combo in itertools.product(*(sweep[n] for n in names)):
        config = dict(zip(names, combo))
        jobs.append((with_overrides(base, {**fixed, **config}), config, attainment))  # validates every one first
    n = len(jobs)
    workers = workers or os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    if workers == 1 or n == 1:
        for job in jobs:
            rows.append(_run_one(job))
            if progress:
                progress(len(rows), n)
    else:
        ctx = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
        with ctx.Pool(min(workers, n)) as pool:
            for row in pool.imap(_run_one, jobs):
                rows.append(row)
                if progress:
                    progress(len(rows), n)
    rows.sort(key=lambda r: (r["gpus"], r["storage_bandwidth_gbps"], -r["goodput_rps"]))
    best = next((r for r in rows if r["meets_slo"]), None)
    return {"rate": rate if rate is not None else base.workload.rate, "attainment": attainment,
            "slo": {"ttft_ms": base.slo.ttft_ms, "tpot_ms": base.slo.tpot_ms}, "rows": rows, "best": best}

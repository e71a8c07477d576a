"""Metrics of a finished simulation, the readable report, and the JSON object.

- TTFT: arrival → first token at D (P's prefill, storage write and message included);
- TPOT: (finish − first token) / (output tokens − 1), for requests of 2+ tokens;
- end-to-end latency: arrival → last token;
- goodput: requests per second that finished and met both the TTFT and TPOT SLOs.
"""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from .cluster import Cluster
from .scenario import Scenario, scenario_to_dict

__all__ = ["simulate", "summarize", "format_report", "to_json"]


def _pcts(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(xs) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3),
            "mean": round(float(a.mean()), 3)}


def summarize(cl: Cluster, raw: dict[str, Any]) -> dict[str, Any]:
    """Every metric of a run as plain data (deterministic for a given scenario and seed)."""
    s = cl.scenario
    reqs = sorted(cl.done, key=lambda r: r.index)
    ok = [r for r in reqs if r.state == "done"]
    ttft = [r.first_token - r.arrival for r in ok]
    tpot = [(r.finish - r.first_token) / (r.out - 1) for r in ok if r.out > 1]
    e2e = [r.finish - r.arrival for r in ok]
    slo_t, slo_p = s.slo.ttft_ms / 1000.0, s.slo.tpot_ms / 1000.0
    good = sum(1 for r in ok if r.first_token - r.arrival <= slo_t
               and (r.out <= 1 or (r.finish - r.first_token) / (r.out - 1) <= slo_p))
    span = max((r.finish for r in reqs), default=0.0) - min((r.arrival for r in reqs), default=0.0)
    states: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in reqs:
        states[r.state] = states.get(r.state, 0) + 1
        if r.state != "done":
            errors[str(r.error)] = errors.get(str(r.error), 0) + 1
    st = cl.store
    hits, misses = st.stats["hits"], st.stats["misses"]
    insts = cl.prefill + cl.decode
    end = max(raw["end_time"], 1e-9)
    cached = sum(r.cached_tokens for r in reqs)
    prompt = sum(r.input_len for r in reqs)
    series = cl.series

    def peak(key: str) -> list[int]:
        return [max((x[key][i] for x in series), default=0) for i in range(len(series[0][key]))] if series else []

    return {
        "scenario": scenario_to_dict(s),
        "requests": len(reqs), "states": dict(sorted(states.items())), "errors": dict(sorted(errors.items())),
        "drained": raw["drained"], "deadlock": raw["deadlock"],
        "simulated_s": round(raw["end_time"], 6),
        "ttft_ms": _pcts(ttft), "tpot_ms": _pcts(tpot), "e2e_ms": _pcts(e2e),
        "throughput_rps": round(len(ok) / span, 4) if span > 0 else 0.0,
        "goodput_rps": round(good / span, 4) if span > 0 else 0.0,
        "slo_attainment": round(good / len(reqs), 4) if reqs else 0.0,
        "output_tokens_per_s": round(sum(r.generated for r in ok) / span, 2) if span > 0 else 0.0,
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "storage": {
            "bytes_written": st.stats["bytes_written"], "bytes_read": st.stats["bytes_read"],
            "write_GBps": round(st.stats["bytes_written"] / end / 1e9, 4),
            "read_GBps": round(st.stats["bytes_read"] / end / 1e9, 4),
            "bandwidth_use": round((st.stats["bytes_written"] + st.stats["bytes_read"]) / end / st.bandwidth, 4),
            "capacity_bytes": st.capacity, "peak_used_bytes": st.peak,
            "peak_use": round(st.peak / st.capacity, 4),
            "evicted_blocks": st.stats["evicted_blocks"], "read_block_hits": hits, "read_block_misses": misses,
        },
        "partial_reads": cl.counters["partial_reads"],
        "preemptions": cl.counters["preemptions"],
        "backlogged_requests": cl.counters["backlogged"],
        "rejected_too_long": cl.counters["rejected_too_long"],
        "injected_failures": {"write": cl.counters["injected_write_failures"],
                              "read": cl.counters["injected_read_failures"]},
        "gpu_blocks_per_instance": cl.gpu_blocks,
        "instances": {i.name: {"busy": round(i.busy_time / end, 4),
                               "peak_blocks_used": i.lc.pool.stats().peak_used,
                               "lifecycle": {k: v for k, v in i.lc.counters.items() if v}}
                      for i in insts},
        "peaks": {"prefill_queue": peak("prefill_queue"), "decode_running": peak("decode_running"),
                  "decode_preempted": peak("decode_preempted"),
                  "backlog": max((x["backlog"] for x in series), default=0)},
        "series": series,
        "_latencies_ms": {"TTFT": [1000 * x for x in ttft], "TPOT": [1000 * x for x in tpot],
                          "E2E": [1000 * x for x in e2e]},
    }


def simulate(s: Scenario) -> dict[str, Any]:
    """Run ``s``; returns :func:`summarize`'s object plus ``wall_s`` (not part of ``--json``'s determinism)."""
    t = time.perf_counter()
    cl = Cluster(s)
    raw = cl.run()
    out = summarize(cl, raw)
    out["wall_s"] = time.perf_counter() - t
    return out


def to_json(result: dict[str, Any]) -> str:
    """The ``--json`` document: every metric, wall time left out so equal seeds give equal bytes."""
    return json.dumps({k: v for k, v in result.items() if k != "wall_s" and not k.startswith("_")}, sort_keys=True)


def format_report(r: dict[str, Any]) -> str:
    s = r["scenario"]
    c, m = s["cluster"], s["model"]

    def row(name: str, d: dict) -> str:
        f = lambda v: "-" if v is None else f"{v:10.1f}"  # noqa: E731
        return f"  {name:<10}{f(d['p50'])}{f(d['p90'])}{f(d['p99'])}"

    st = r["storage"]
    lines = [
        f"kvstate simulate — {m['name']} on {c['n_prefill']} P + {c['n_decode']} D x TP {c['tp']} "
        f"({s['gpu']['name']}), {s['workload']['arrival']} load, seed {s['seed']}",
        f"requests {r['requests']}: {r['states']}" + (f", errors {r['errors']}" if r["errors"] else ""),
        f"simulated {r['simulated_s']:.1f} s" + (f" in {r['wall_s']:.2f} s wall" if "wall_s" in r else ""),
        "latency (ms)      p50       p90       p99",
        row("TTFT", r["ttft_ms"]), row("TPOT", r["tpot_ms"]), row("E2E", r["e2e_ms"]),
        f"throughput {r['throughput_rps']:.2f} req/s, goodput {r['goodput_rps']:.2f} req/s "
        f"(SLO TTFT {s['slo']['ttft_ms']:.0f} ms, TPOT {s['slo']['tpot_ms']:.0f} ms: {100 * r['slo_attainment']:.1f} % met)",
        f"prefix hit rate {100 * r['prefix_hit_rate']:.1f} % of prompt tokens read from storage",
        f"storage: write {st['write_GBps']:.2f} GB/s, read {st['read_GBps']:.2f} GB/s "
        f"({100 * st['bandwidth_use']:.1f} % of bandwidth), peak {st['peak_used_bytes'] / 2**30:.1f} GiB "
        f"({100 * st['peak_use']:.1f} %), evicted {st['evicted_blocks']} blocks, partial reads {r['partial_reads']}",
        f"preemptions {r['preemptions']}, backlogged arrivals {r['backlogged_requests']}, "
        f"GPU blocks per instance {r['gpu_blocks_per_instance']}",
        "instances: " + ", ".join(f"{k} busy {100 * v['busy']:.0f} % peak blocks {v['peak_blocks_used']}"
                                  for k, v in r["instances"].items()),
    ]
    if r["deadlock"]:
        d = r["deadlock"]
        lines.append(f"DEADLOCK / NOT DRAINED: {d['reason']}; {d['live_count']} requests live")
        lines += [f"  {x}" for x in d["stuck_ranks"][:10]]
        lines += [f"  {rid}: {st_}" for rid, st_ in list(d["live_requests"].items())[:10]]
    return "\n".join(lines)

"""A simulation's results as text for people (``kvstate simulate``) and as JSON (``--json``)."""
from __future__ import annotations

import json
from typing import Any

from .._errors import ConfigError
from ._metrics import SLOS, WINDOW_LABELS

__all__ = ["format_report", "to_json"]


def _check_result(r: Any, who: str) -> None:
    if not isinstance(r, dict) or not all(k in r for k in ("deadlock", "requests", "scenario")):
        raise ConfigError(f"{who}: expected what simulate() returns, got {type(r).__name__}")


def to_json(result: dict[str, Any]) -> str:
    """The ``--json`` document: every metric, wall time left out so equal seeds give equal bytes."""
    _check_result(result, "to_json")
    return json.dumps({k: v for k, v in result.items() if k != "wall_s" and not k.startswith("_")}, sort_keys=True)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _ms(v: float | None) -> str:
    return f"{'-':>9}" if v is None else f"{v:9.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _stretch(x: float) -> str:
    """The service stretch in words: whether latency climbed across the window, and so by how
    much the cluster fell behind its arrivals."""
    if x >= 0.9995:
        return "latency level across the window"
    return f"latency climbing across the window: served at {100 * x:.1f} % of the rate offered"


def _replay(w: dict[str, Any]) -> str:
    """How a trace was replayed: which requests, at what pace."""
    which = f"its first {w['trace_requests']:,} requests" if w["trace_requests"] else "every request"
    pace = (f"re-timed to {w['trace_rate']:g} req/s" if w["trace_rate"] else
            f"timestamps x {w['time_scale']:g}" if w["time_scale"] != 1 else "as recorded")
    return f"trace replay of {which}, {pace}"


def _header(r: dict[str, Any]) -> list[str]:
    s = r["scenario"]
    c, w = s["cluster"], s["workload"]
    load = f"{w['arrival']} arrivals at {w['rate']:g} req/s" if w["arrival"] != "trace" else _replay(w)
    wall = f" ({r['wall_s']:.2f} s wall)" if "wall_s" in r else ""
    if r["mode"] == "colocated":
        sch = s["scheduler"]
        where = (f"{c['n_instances']} co-located instance{'s' if c['n_instances'] > 1 else ''} (prefill and "
                 f"decode together: budget {sch['max_num_batched_tokens']:,} tokens, {sch['max_num_seqs']} seats, "
                 f"chunked prefill {'on' if sch['chunked_prefill'] else 'off'}, prefix caching "
                 f"{'on' if sch['prefix_caching'] else 'off'})")
    else:
        where = f"{c['n_prefill']} P + {c['n_decode']} D (disaggregated)"
    gpus = r["gpus"]
    return [
        f"kvstate simulate: {s['model']['name']} on {where}, TP {c['tp']}: {gpus} GPU{'s' if gpus != 1 else ''} "
        f"({s['gpu']['name']}); {load}, seed {s['seed']}",
        f"offered {r['offered_rps']:.2f} req/s: the {r['cohort']:,} arrivals of the {WINDOW_LABELS[r['window']]} "
        f"{r['window_s'][0]:.1f}-{r['window_s'][1]:.1f} s, which every rate below counts; "
        f"run {r['duration_s']:.1f} s simulated{wall}",
        f"requests {r['requests']:,}, ended: {_counts(r['reasons'])}",
    ]


def _latencies(r: dict[str, Any]) -> list[str]:
    lines = [f"{'latency (ms)':<14}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}"]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        d = r[key]
        lines.append(f"  {name:<12}{_ms(d['mean'])}{_ms(d['p50'])}{_ms(d['p90'])}{_ms(d['p99'])}")
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}
    for key, qs in r.get("percentiles", {}).items():  # asked for (--percentile-metrics, --metric-percentiles)
        lines.append(f"  {names[key]:<12}" + ", ".join(f"{q} {_ms(v).strip()}" for q, v in qs.items()))
    return lines


def _slo(r: dict[str, Any]) -> list[str]:
    slo = r["slo"]
    verdict = ("meets the SLOs" if slo["meets"] else slo["too_short"] if slo["too_short"]
               else "does not meet the SLOs: " + "; ".join(slo["unmet"]))
    failed = sum(r["failed"].values())
    return [
        f"throughput {r['throughput_rps']:.2f} req/s, goodput {r['goodput_rps']:.2f} req/s "
        f"({_stretch(r['service_stretch'])}; latency noise alone may read {_pct(r['rate_uncertainty'])} short); "
        f"output {r['output_tokens_per_s']:,.0f} tok/s, total {r['total_tokens_per_s']:,.0f} tok/s",
        f"failed {failed:,}" + (f" ({_counts(r['failed'])}): counted against goodput, not latency" if failed else ""),
        "SLOs: " + ", ".join(f"{label} <= {slo[key]:g} ms met by {_pct(slo[f'{name}_attainment'])}"
                             for name, (key, label) in SLOS.items() if slo[key])
        + f", all by {_pct(slo['attainment'])} (target {_pct(slo['target'])})",
        f"verdict: {verdict}",
    ]


def _colocated(r: dict[str, Any]) -> list[str]:
    lines = [f"prefix hits: {_pct(r['prefix_hit_rate'])} of prompt tokens found cached on the GPU, not computed",
             f"preemptions (recompute) {r['preemptions']:,}, refused as too long {r['rejected_too_long']:,}"]
    if r["preemptions"]:
        rt = r["preemption_round_trip_ms"]
        lines.append(f"preemption round trip (preempted to its next token): p50 {rt['p50']:,.1f} ms, "
                     f"p99 {rt['p99']:,.1f} ms")
    gpu = r["gpu_prefix_cache"]
    if gpu:
        lines.append(f"GPU prefix cache: {gpu['cached_blocks']:,} blocks cached at the end, "
                     f"{gpu['evictions']:,} evictions")
    lines.append(f"instances ({r['gpu_blocks_per_instance']:,} GPU blocks each; compute: share of the run in "
                 "forward steps, not FLOP use):")
    for name, i in r["instances"].items():
        lines.append(f"  {name:<4} compute {_pct(i['compute_busy'])}, seats {_pct(i['seats_used'])}, blocks "
                     f"{_pct(i['blocks_used'])} (peak {_pct(i['peak_blocks_used'])}), {i['steps']:,} steps")
    return lines


def _resources(r: dict[str, Any]) -> list[str]:
    if r["mode"] == "colocated":
        return _colocated(r)
    st = r["storage"]
    late = r["late_events"]
    lines = [
        f"prefix hits: {_pct(r['prefix_hit_rate'])} of prompt tokens found cached, not computed",
        f"storage: write {st['write_GBps']:.2f} GB/s, read {st['read_GBps']:.2f} GB/s "
        f"({_pct(st['bandwidth_use'])} of its bandwidth); peak {st['peak_used_bytes'] / 2**30:.1f} GiB "
        f"({_pct(st['peak_use'])} of capacity), {st['evicted_blocks']:,} blocks evicted, "
        f"{r['partial_reads']:,} partial reads",
        f"preemptions {r['preemptions']:,}, backlogged arrivals {r['backlogged_requests']:,}, "
        f"prompts dropped at P {r['prompts_dropped']:,}, late events {_counts(late) if late else 'none'}",
    ]
    if r["preemptions"]:
        rt = r["preemption_round_trip_ms"]
        lines.append(f"preemption round trip (preempted to decoding again): p50 {rt['p50']:,.1f} ms, "
                     f"p99 {rt['p99']:,.1f} ms")
    tier = r["host_tier"]
    if tier:
        lines.append(f"host tier: {tier['slots_per_instance']:,} slots per instance; prefix hits "
                     f"{_pct(tier['prefix_hit_rate_host'])} of prompt tokens from host memory, "
                     f"{_pct(tier['prefix_hit_rate_store'])} from storage; D: {tier['swap_outs']:,} swap-outs "
                     f"({tier['blocks_swapped_out']:,} blocks copied), {tier['swap_ins']:,} swap-ins "
                     f"({tier['blocks_swapped_in']:,} blocks); {tier['evictions']:,} evictions")
    gpu = r["gpu_prefix_cache"]
    if gpu:
        lines.append(f"GPU prefix cache: prefix hits {_pct(gpu['prefix_hit_rate_gpu'])} of prompt tokens at P, "
                     f"{_pct(gpu['decode_hit_rate_gpu'])} not read at D; {gpu['evictions']:,} evictions")
    lines.append(f"instances ({r['gpu_blocks_per_instance']:,} GPU blocks each; compute: share of the run in "
                 "forward steps, not FLOP use):")
    for name, i in r["instances"].items():
        slots = f", batch slots {_pct(i['batch_slots_used'])}" if "batch_slots_used" in i else ""
        lines.append(f"  {name:<4} compute {_pct(i['compute_busy'])}{slots}, blocks {_pct(i['blocks_used'])} "
                     f"(peak {_pct(i['peak_blocks_used'])})")
    return lines


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report: header, latencies, rates and SLOs, resources, any deadlock."""
    _check_result(r, "format_report")
    lines = _header(r) + _latencies(r) + _slo(r) + _resources(r)
    d = r["deadlock"]
    if d:
        lines.append(f"DEADLOCK / NOT DRAINED: {d['reason']}; {d['live_count']} requests live")
        lines += [f"  {x}" for x in d["stuck_ranks"][:10]]
        lines += [f"  {rid}: prefill {st['prefill']}, decode {st['decode']}"
                  for rid, st in list(d["live_requests"].items())[:10]]
    return "\n".join(lines)

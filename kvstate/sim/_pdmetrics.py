"""The parts of a run's report that only a PD cluster has: storage, host tiers, the GPU prefix
caches of P and D, per-instance use of P and D, and queue peaks (definitions: docs/metrics.md).
"""
from __future__ import annotations

from typing import Any

__all__ = ["pd_sections"]


def pd_sections(cl: Any, end: float, prompt_tokens: int) -> dict[str, Any]:
    """The PD-only parts of :func:`kvstate.sim._metrics.summarize`'s object, for cluster ``cl``."""
    return {
        "storage": _storage(cl, end), "partial_reads": cl.counters["partial_reads"],
        "host_tier": _host_tier(cl, prompt_tokens), "gpu_prefix_cache": _prefix_cache(cl, prompt_tokens),
        "backlogged_requests": cl.counters["backlogged"], "prompts_dropped": cl.counters["prompts_dropped"],
        "late_events": {k[5:]: v for k, v in sorted(cl.counters.items()) if k.startswith("late_")},
        "injected_failures": {"write": cl.counters["injected_write_failures"],
                              "read": cl.counters["injected_read_failures"]},
        "instances": _instances(cl, end), "peaks": _peaks(cl.series),
    }


def _instances(cl: Any, end: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in cl.instances:
        busy = i.busy_time - max(0.0, i.computing_until - end)  # a forward the run's end cut short
        d: dict[str, Any] = {"compute_busy": round(busy / end, 4)}
        if i.role == "decode":
            d["batch_slots_used"] = round(i.slot_seconds / end / i.max_batch, 4)
        blocks = i.side.gpu_blocks
        d["blocks_used"] = round(i.block_seconds / end / blocks, 4)
        d["peak_blocks_used"] = round(i.lc.pool.stats().peak_used / blocks, 4)
        d["lifecycle"] = {k: v for k, v in i.lc.counters.items() if v}
        out[i.name] = d
    return out


def _storage(cl: Any, end: float) -> dict[str, Any]:
    st = cl.store
    w, r = st.stats["bytes_written"], st.stats["bytes_read"]
    return {"bytes_written": w, "bytes_read": r, "write_GBps": round(w / end / 1e9, 4),
            "read_GBps": round(r / end / 1e9, 4), "bandwidth_use": round((w + r) / end / st.bandwidth, 4),
            "capacity_bytes": st.capacity, "peak_used_bytes": st.peak, "peak_use": round(st.peak / st.capacity, 4),
            "evicted_blocks": st.stats["evicted_blocks"], "read_block_hits": st.stats["hits"],
            "read_block_misses": st.stats["misses"]}


def _host_tier(cl: Any, prompt_tokens: int) -> dict[str, Any] | None:
    """The host tiers: prefix blocks found per tier at P, swaps at D, entries and evictions."""
    tiers = [i.lc.host for i in cl.instances if i.lc.host is not None]
    if not tiers:
        return None
    stats = [t.stats() for t in tiers]
    host = sum(p.lc.counters["host_prefix_blocks"] for p in cl.prefill)
    store = sum(p.lc.counters["store_prefix_blocks"] for p in cl.prefill)
    share = (lambda n: round(n * cl.block_size / prompt_tokens, 4)) if prompt_tokens else (lambda n: 0.0)
    return {"slots_per_instance": stats[0].slots, "entries": sum(x.entries for x in stats),
            "prefix_blocks_from_host": host, "prefix_blocks_from_store": store,
            "prefix_hit_rate_host": share(host), "prefix_hit_rate_store": share(store),
            "swap_outs": cl.counters["swap_outs"], "swap_ins": cl.counters["swap_ins"],
            "blocks_swapped_out": cl.counters["blocks_swapped_out"],
            "blocks_swapped_in": cl.counters["blocks_swapped_in"],
            "evictions": sum(x.evictions for x in stats)}


def _prefix_cache(cl: Any, prompt_tokens: int) -> dict[str, Any] | None:
    """The GPU prefix caches: prompt blocks P found on its GPU, blocks D did not read."""
    caches = [i.lc.prefix_cache.prefix_stats() for i in cl.instances if i.lc.prefix_cache is not None]
    if not caches:
        return None
    p_hits = sum(p.lc.counters["gpu_prefix_blocks"] for p in cl.prefill)
    d_hits = sum(d.lc.counters["gpu_read_blocks"] for d in cl.decode)
    share = (lambda n: round(n * cl.block_size / prompt_tokens, 4)) if prompt_tokens else (lambda n: 0.0)
    return {"prefix_blocks_from_gpu": p_hits, "prefix_hit_rate_gpu": share(p_hits),
            "decode_blocks_not_read": d_hits, "decode_hit_rate_gpu": share(d_hits),
            "cached_blocks": sum(c.cached for c in caches), "evictions": sum(c.evictions for c in caches)}


def _peaks(series: list[dict[str, Any]]) -> dict[str, Any]:
    def peak(key: str) -> list[int]:
        return [max(x[key][i] for x in series) for i in range(len(series[0][key]))] if series else []

    return {"prefill_queue": peak("prefill_queue"), "decode_running": peak("decode_running"),
            "decode_preempted": peak("decode_preempted"), "backlog": max((x["backlog"] for x in series), default=0)}

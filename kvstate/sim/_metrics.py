"""Metrics of a finished simulation, as plain data (definitions: docs/metrics.md).

- latencies (ms; mean, p50, p90, p99) of requests that finished: TTFT (arrival → first token
  at D), TPOT ((finish − first token) / (tokens − 1), answers of 2+ tokens), ITL (every gap
  between consecutive tokens of an answer, preemptions and reads included; nearest rank over
  tokens) and E2E (arrival → last token);
- the steady window: from the time 10 % of the requests had ended (warm-up) to the last
  arrival (after it the queues only drain). A run too short for one (it would span under
  10 % of the run) uses the arrivals' span, and says so;
- one cohort for every rate: the requests that arrived in the window. The offered rate is
  its arrivals per second; throughput and goodput are the same requests that finished, and
  that met every SLO, at the rate each arrival stands for, times the *service stretch*
  (:func:`service_stretch`: below 1 when latency climbs across the window, as it does for a
  cluster falling behind). So no rate exceeds the offered one; a cluster that keeps up shows
  its offered rate, one that falls behind the rate it sustains, and a failed request counts
  against goodput;
- SLO attainment over the requests that reached each latency: TTFT over those whose first
  token came, TPOT over those that finished; a request that failed before a latency is
  counted against goodput, not against that latency;
- the verdict: ``meets`` when the run drained, both attainments reach the target and goodput
  reaches target × offered rate beyond the stretch's own uncertainty
  (:func:`rate_uncertainty`); ``fails`` when one of these does not hold beyond it; ``too
  short`` when the goodput test falls within it, or the run had no steady window: the run
  cannot tell a cluster that keeps up from one that does not, and the verdict says about how
  many requests would;
- utilisation over the run: compute busy (the share of the run an instance spent in forward
  passes, not its FLOP efficiency); on D also the batch slots used (time-weighted batch size
  / ``decode_max_batch``); blocks used (time-weighted / blocks per instance);
- what only a PD cluster has (:func:`pd_sections`): storage, host tiers, the GPU prefix caches
  of P and D, per-instance use of P and D, and queue peaks.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Generator, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from ._request import SimRequest
from ._scenario_io import scenario_to_dict

__all__ = ["summarize", "percentiles", "PERCENTILE_METRICS", "SLOS", "steady_window", "cohort", "service_stretch",
           "rate_uncertainty", "verdict_of", "at_target", "latency_stats", "weighted_stats", "merged_hist", "Run",
           "sample_series", "WARMUP_FRACTION", "WINDOW_LABELS", "NEIGHBOURS", "pd_sections"]

class Run(Protocol):
    """What :func:`summarize` reads of a finished run (a PD or a co-located cluster)."""

    scenario: Any
    done: list[SimRequest]
    counters: dict[str, int]
    gpu_blocks: int
    series: list[dict[str, Any]]

    @property
    def round_trips(self) -> list[float]: ...

    def itl(self) -> dict[float, int]: ...

    def sections(self, end: float, prompt_tokens: int) -> dict[str, Any]: ...


WARMUP_FRACTION = 0.1  #: requests that must have ended before the steady window opens


def sample_series(run: Any) -> Generator[Any, Any, None]:
    """A SimPy process appending ``run.snapshot()`` to ``run.series`` every
    ``scenario.sample_ms`` until ``run.finished`` fires, and once more at the end (either
    mode's cluster runs it)."""
    period = run.scenario.sample_ms / 1000.0
    while not run.finished.triggered:
        run.series.append(run.snapshot())
        yield run.env.timeout(period)
    run.series.append(run.snapshot())


def latency_stats(seconds: list[float]) -> dict[str, float | None]:
    """Mean, p50, p90, p99 in ms (linear interpolation; None when there is no sample)."""
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(seconds) * 1000.0
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3)}


#: vllm bench serve's metric names (``--percentile-metrics``) -> the result's latency key
PERCENTILE_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}


def percentiles(result: dict[str, Any], metrics: Sequence[str],
                qs: Sequence[float]) -> dict[str, dict[str, float | None]]:
    """``{metric key: {"p25": ms, ...}}`` of a run's result, as ``vllm bench serve
    --percentile-metrics METRICS --metric-percentiles QS`` reports them: linear interpolation over
    the finished requests (TTFT, TPOT, E2E), nearest rank over every inter-token gap (ITL)."""
    lat, out = result["_latencies_ms"], {}
    for m in metrics:
        key = PERCENTILE_METRICS[m]
        if m == "itl":
            hist = result["_itl_hist"]
            total, values = sum(hist.values()), sorted(hist)
            cum = np.cumsum(list(map(hist.__getitem__, values))) if total else np.zeros(0)
            out[key] = {_qname(q): (round(1000.0 * values[min(int(np.searchsorted(cum, math.ceil(q / 100 * total))),
                                                              len(values) - 1)], 3) if total else None) for q in qs}
            continue
        a = lat[{"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E"}[m]]
        out[key] = {_qname(q): (round(float(np.percentile(a, q)), 3) if a else None) for q in qs}
    return out


def _qname(q: float) -> str:
    """``p99``, ``p99.9``: a percentile's name (vLLM's)."""
    return f"p{q:g}"


def merged_hist(hists: Iterable[dict[float, int]]) -> dict[float, int]:
    """One histogram ``{seconds: count}`` of several (each instance's inter-token gaps), keys in
    the order of first appearance: the order :func:`weighted_stats` sums the mean in. A run's
    gaps are hundreds of thousands of distinct floats, so the first is copied whole, in C."""
    out: dict[float, int] = {}
    for hist in hists:
        if not out:
            out.update(hist)
            continue
        get = out.get
        for gap, n in hist.items():
            out[gap] = get(gap, 0) + n
    return out


def weighted_stats(hist: dict[float, int]) -> dict[str, float | None]:
    """Mean, p50, p90, p99 in ms of a histogram ``{seconds: count}`` (nearest rank; the mean
    summed in the histogram's order)."""
    total = sum(hist.values())
    if not total:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    values = sorted(hist)
    cum = np.cumsum(list(map(hist.__getitem__, values)))
    out: dict[str, float | None] = {"mean": round(1000.0 * sum(map(operator.mul, hist, hist.values())) / total, 3)}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        i = int(np.searchsorted(cum, math.ceil(q * total)))
        out[name] = round(1000.0 * values[min(i, len(values) - 1)], 3)
    return out


def steady_window(reqs: list[SimRequest]) -> tuple[float, float, bool]:
    """(start, end, steady): the steady window; without one, the arrivals' span (the whole run
    when every request arrived at once)."""
    if not reqs:
        return 0.0, 0.0, False
    ends = sorted(r.finish for r in reqs if r.finish is not None)
    first = min(r.arrival for r in reqs)
    last_arrival = max(r.arrival for r in reqs)
    last_end = ends[-1] if ends else last_arrival
    start = ends[max(0, math.ceil(WARMUP_FRACTION * len(reqs)) - 1)] if ends else first
    if last_arrival - start >= WARMUP_FRACTION * (last_end - first) > 0:
        return start, last_arrival, True
    return (first, last_arrival, False) if last_arrival > first else (first, last_end, False)


def cohort(reqs: list[SimRequest], start: float, end: float, steady: bool) -> list[SimRequest]:
    """The requests every rate is counted over: those that arrived in the steady window (every
    request, without one)."""
    return [r for r in reqs if start <= r.arrival <= end] if steady else list(reqs)


def _quarters(arrivals: list[float], latencies: list[float]) -> tuple[np.ndarray, np.ndarray, int, float] | None:
    """The cohort's arrivals and latencies in arrival order, a quarter's size, and the time
    between the median arrivals of its first and last quarter (None: fewer than two requests,
    or no time between them)."""
    if len(arrivals) < 2:
        return None
    order = np.argsort(np.asarray(arrivals), kind="stable")
    t, lat, k = np.asarray(arrivals)[order], np.asarray(latencies)[order], max(1, len(arrivals) // 4)
    span = float(np.median(t[-k:]) - np.median(t[:k]))
    return (t, lat, k, span) if span > 0 else None


def service_stretch(arrivals: list[float], latencies: list[float]) -> float:
    """How fast a cohort was served against how fast it came, at most 1: the time between the
    median arrivals of its first and last quarter, over that time plus how far the median
    end-to-end latency climbed between those quarters.

    A cluster that keeps up serves its last requests as fast as its first: 1. One that falls
    behind queues every arrival a little longer than the one before; at a sustained rate mu
    against an offered lambda the climb is span x (lambda / mu - 1), so this is mu / lambda.
    Medians keep a few slow answers from reading as a climb; the cap at 1 means no rate can
    read above the rate offered (a falling latency is a cluster catching up, not serving faster
    than requests come)."""
    q = _quarters(arrivals, latencies)
    if q is None:
        return 1.0
    _, lat, k, span = q
    climb = float(np.median(lat[-k:]) - np.median(lat[:k]))
    return span / (span + climb) if climb > 0 else 1.0


NEIGHBOURS = 51  #: arrivals a latency is compared with to tell its noise from a trend


def rate_uncertainty(arrivals: list[float], latencies: list[float]) -> float:
    """How far :func:`service_stretch` may fall short of 1 by chance for a cluster that keeps up,
    as a share of the offered rate: the stretch a climb of two standard errors of the difference
    of the two quarters' median latencies would give. A latency's noise is its distance from
    the running median of its :data:`NEIGHBOURS` neighbours in arrival order (the median
    distance scaled to a standard deviation), so a cluster falling behind, whose latencies climb
    across the window, shows its noise here and its shortfall in the stretch."""
    q = _quarters(arrivals, latencies)
    if q is None:
        return math.inf
    _, lat, k, span = q
    n = min(NEIGHBOURS, lat.size)
    n -= 1 - n % 2  # odd: the median of a window centred on each latency
    padded = np.pad(lat, n // 2, mode="edge")
    local = np.median(np.lib.stride_tricks.sliding_window_view(padded, n), axis=1)
    sigma = 1.4826 * float(np.median(np.abs(lat - local)))
    climb = 2 * 1.2533 * sigma * math.sqrt(2 / k)  # two standard errors of a difference of medians
    return climb / (span + climb)


class _Done(NamedTuple):
    """A request that completed: the timestamps every latency is taken from."""

    rid: str
    arrival: float
    first: float  # first token
    finish: float
    out: int
    generated: int
    input_len: int

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (requests of more than one token)."""
        return (self.finish - self.first) / (self.out - 1)

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival


def _completed(reqs: list[SimRequest]) -> list[_Done]:
    return [_Done(r.rid, r.arrival, r.first_token, r.finish, r.out, r.generated, r.input_len)
            for r in reqs if r.state == "done" and r.first_token is not None and r.finish is not None]


def at_target(seconds: list[float], n: int, free: int, target: float) -> float | None:
    """The smallest SLO, in ms, that ``target`` of the ``n`` requests would meet: ``free`` of
    them meet any (a one-token answer has no TPOT), the others need their value at or under it;
    None when too few finished for any SLO to be met by that share."""
    k = math.ceil(target * n - 1e-9) - free
    if k <= 0:
        return 0.0
    if k > len(seconds):
        return None
    return round(1000.0 * float(np.partition(np.asarray(seconds), k - 1)[k - 1]), 3)


def _reached_ttft(r: SimRequest) -> bool:
    """The request's first token came while it was live (a token after D gave up reached no one)."""
    return r.first_token is not None and (r.finish is None or r.first_token <= r.finish)


#: the SLOs a scenario may set (``[slo]``, ``--goodput``): name -> (its key, how the report names it)
SLOS = {"ttft": ("ttft_ms", "TTFT"), "tpot": ("tpot_ms", "TPOT"), "e2el": ("e2el_ms", "E2E")}


def _attainment(s: Any, reqs: list[SimRequest], ok: list[_Done]) -> dict[str, Any]:
    """Each latency SLO's attainment over the requests that reached it: TTFT over those whose
    first token came, TPOT and E2E over those that finished. A request that failed first counts
    against goodput (:func:`_rates`), not against a latency it never had. An SLO of 0 is none:
    its attainment is 1 and it judges nothing. Good requests meet every SLO set."""
    slo, target = s.slo, s.slo.attainment
    slo_t, slo_p, slo_e = slo.ttft_ms / 1000.0, slo.tpot_ms / 1000.0, slo.e2el_ms / 1000.0
    firsts = [r.first_token - r.arrival for r in reqs if r.first_token is not None and _reached_ttft(r)]
    ttft_ok = {r.rid for r in ok if not slo_t or r.ttft <= slo_t}
    tpot_ok = {r.rid for r in ok if not slo_p or r.out <= 1 or r.tpot <= slo_p}
    e2e_ok = {r.rid for r in ok if not slo_e or r.e2e <= slo_e}
    multi = [r.tpot for r in ok if r.out > 1]
    done = max(len(ok), 1)
    good = ttft_ok & tpot_ok & e2e_ok
    return {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms, "target": target,
            "ttft_attainment": round(sum(not slo_t or t <= slo_t for t in firsts) / max(len(firsts), 1), 4),
            "tpot_attainment": round(len(tpot_ok) / done, 4),
            "e2el_attainment": round(len(e2e_ok) / done, 4),
            "attainment": round(len(good) / done, 4),
            "ttft_at_target_ms": at_target(firsts, len(firsts), 0, target),
            "tpot_at_target_ms": at_target(multi, len(ok), len(ok) - len(multi), target),
            "e2el_at_target_ms": at_target([r.e2e for r in ok], len(ok), 0, target),
            "_good": good}


def _offered(reqs: list[SimRequest], start: float, end: float, steady: bool) -> float:
    """Arrivals per second of the window: the steady window's, or (n - 1) over the arrivals'
    span (the gaps between them); the whole run's length when everything arrived at once."""
    if steady:
        return sum(1 for r in reqs if start <= r.arrival <= end) / (end - start)
    first, last = min(r.arrival for r in reqs), max(r.arrival for r in reqs)
    if last > first:
        return (len(reqs) - 1) / (last - first)
    return len(reqs) / (end - start) if end > start else 0.0


WINDOW_NAMES = {True: "steady", False: "arrival span"}
#: how the report names each kind of window
WINDOW_LABELS = {"steady": "steady window", "arrival span": "arrival span", "whole run": "whole run"}


def _rates(reqs: list[SimRequest], ok: list[_Done], good: set[str]) -> dict[str, Any]:
    """Offered rate, throughput and goodput over one cohort: the window's arrivals. Each
    request of it stands for ``offered / len(cohort)`` requests per second; those that finished,
    and those that met every SLO, count at that rate times the service stretch (below 1 only
    when the cohort took longer to serve than to arrive). So throughput <= offered always."""
    start, end, steady = steady_window(reqs)
    group = cohort(reqs, start, end, steady)
    ids = {r.rid for r in group}
    done = [r for r in ok if r.rid in ids]
    arrivals, e2e = [r.arrival for r in done], [r.e2e for r in done]
    stretch = service_stretch(arrivals, e2e)
    offered = _offered(reqs, start, end, steady) if reqs else 0.0
    each = offered / len(group) * stretch if group else 0.0  # req/s one request of the cohort stands for
    at_once = not steady and all(r.arrival == reqs[0].arrival for r in reqs)
    failed = [r for r in group if r.state != "done"]
    return {
        "window_s": [round(start, 6), round(end, 6)],
        "window": "whole run" if at_once else WINDOW_NAMES[steady],
        "cohort": len(group),
        "service_stretch": round(stretch, 4),
        "rate_uncertainty": round(min(rate_uncertainty(arrivals, e2e), 1.0), 4),
        "offered_rps": round(offered, 4),
        "throughput_rps": round(len(done) * each, 4),
        "goodput_rps": round(sum(1 for r in done if r.rid in good) * each, 4),
        "failed_rps": round(len(failed) * offered / len(group), 4) if group else 0.0,
        "output_tokens_per_s": round(sum(r.generated for r in done) * each, 2),
        "total_tokens_per_s": round(sum(r.generated + r.input_len for r in done) * each, 2),
    }


def _too_short(rates: dict[str, Any], target: float, n: int, e2e: list[float]) -> tuple[str | None, int | None]:
    """(why the goodput test cannot be judged on this run, about how many requests would), or
    (None, None) when it can.

    The service stretch is measured to within ``rate_uncertainty`` either way, so goodput short
    of ``target`` x offered by more than that fails however short the run, and goodput passes
    only when it clears the target by more than that. A run without a steady window that did
    not fail never held its load: its arrivals ended before a tenth of its requests had, so it
    shows a burst, not a rate the cluster sustains; it takes arrivals lasting a few latencies
    (about three times the p90 end-to-end latency) to fill the cluster and measure it. The
    uncertainty shrinks as n^-1.5 (the quarters' medians sharpen as the window lengthens), which
    gives the requests that would tell."""
    u, offered = rates["rate_uncertainty"], rates["offered_rps"]
    ratio = rates["goodput_rps"] / offered if offered > 0 else 0.0
    if rates["window"] == "whole run":
        return "too short to judge: every request arrived at once, so no rate was offered to sustain", None
    a, b = rates["window_s"]
    if ratio < target - u:
        return None, None  # short beyond any chance: it fell behind even in a burst
    if rates["window"] == "arrival span":
        p90 = float(np.percentile(e2e, 90)) if e2e else b - a
        fill = _round_up(max(2 * n, offered * 3 * p90))
        return (f"too short to judge: its arrivals ({a:.1f}-{b:.1f} s) ended before a tenth of its requests had, "
                f"so the cluster never held the load; about {fill:,} requests would tell"), fill
    if ratio - u >= target:
        return None, None
    room = max(abs(ratio - target), (1.0 - target) / 4, 1e-3)
    more: int | None = _round_up(1.2 * n * (u / room) ** (2 / 3)) if math.isfinite(u) else None
    hint = f"; about {more:,} requests would tell" if more else ""
    return (f"too short to judge: goodput {rates['goodput_rps']:.2f} req/s against {target} x offered {offered:.2f}, "
            f"but over its {WINDOW_LABELS[rates['window']]} ({b - a:.1f} s, {rates['cohort']:,} arrivals) latency "
            f"noise alone may move it {100 * min(u, 9.99):.1f} %{hint}"), more


def _round_up(x: float) -> int:
    """``x`` rounded up to two significant digits (a request count to suggest)."""
    k = 10 ** max(0, len(str(int(math.ceil(x)))) - 2)
    return int(math.ceil(x / k) * k)


def _verdict(drained: bool, slo: dict[str, Any], rates: dict[str, Any], n: int,
             e2e: list[float]) -> tuple[list[str], str | None, int | None]:
    """(why the run does not meet the SLOs, why it cannot be judged, requests that would do):
    the first two empty when it meets them.
    A run that misses on drain or attainment fails however short; one that would be judged on
    goodput alone is too short when its window cannot resolve the test."""
    why, target = [], slo["target"]
    if not drained:
        why.append("the run did not drain")
    for name, (key, label) in SLOS.items():
        if slo[key] and slo[f"{name}_attainment"] < target:  # name the percentile that broke it
            at = slo[f"{name}_at_target_ms"]
            p = f"p{100 * target:g} {label} {at:,.1f} ms" if at is not None else f"too few reached {label}"
            why.append(f"{label} attainment {slo[f'{name}_attainment']:.3f} < {target}: {p} breaks the "
                       f"{slo[key]:g} ms SLO")
    short, more = _too_short(rates, target, n, e2e)
    if rates["failed_rps"] > (1 - target) * rates["offered_rps"]:
        short, more = None, None  # failures alone sink goodput: no spread of latency explains them
    if short is None and rates["goodput_rps"] < target * rates["offered_rps"]:
        failed = f", {rates['failed_rps']:.2f} req/s of it failed" if rates["failed_rps"] else ""
        why.append(f"goodput {rates['goodput_rps']:.2f} req/s < {target} x offered {rates['offered_rps']:.2f}"
                   f"{failed}")
    return (why, None, None) if why else (why, short, more)


def verdict_of(slo: dict[str, Any]) -> str:
    """``meets``, ``fails`` or ``too short`` (the summary's ``slo`` object)."""
    return "meets" if slo["meets"] else "too short" if slo["too_short"] else "fails"


def _counts(reqs: list[SimRequest]) -> dict[str, dict[str, int]]:
    """Requests by terminal state, by reason, by error code, and those that failed by reason."""
    out: dict[str, dict[str, int]] = {"states": {}, "reasons": {}, "errors": {}, "failed": {}}
    for r in reqs:
        out["states"][r.state] = out["states"].get(r.state, 0) + 1
        out["reasons"][r.reason] = out["reasons"].get(r.reason, 0) + 1
        if r.state != "done":
            out["errors"][str(r.error)] = out["errors"].get(str(r.error), 0) + 1
            out["failed"][r.reason] = out["failed"].get(r.reason, 0) + 1
    return {k: dict(sorted(v.items())) for k, v in out.items()}


def summarize(cl: Run, raw: dict[str, Any]) -> dict[str, Any]:
    """Every metric of a run as plain data (deterministic for a given scenario and seed); the
    parts only one mode has come from the run's own ``sections``."""
    s = cl.scenario
    reqs = sorted(cl.done, key=lambda r: r.index)
    ok = _completed(reqs)
    end = max(raw["end_time"], 1e-9)
    itl = cl.itl()
    slo = _attainment(s, reqs, ok)
    rates = _rates(reqs, ok, slo.pop("_good"))
    why, short, more = _verdict(raw["drained"] and not raw["deadlock"], slo, rates, len(reqs), [r.e2e for r in ok])
    prompt = sum(r.input_len for r in reqs)
    return {
        "scenario": scenario_to_dict(s), "requests": len(reqs), **_counts(reqs),
        "drained": raw["drained"], "deadlock": raw["deadlock"], "duration_s": round(raw["end_time"], 6),
        "configured_rate_rps": (s.workload.rate if s.workload.arrival != "trace"
                                else s.workload.trace_rate or None),
        **rates,
        "ttft_ms": latency_stats([r.ttft for r in ok]),
        "tpot_ms": latency_stats([r.tpot for r in ok if r.out > 1]),
        "itl_ms": weighted_stats(itl),
        "e2e_ms": latency_stats([r.e2e for r in ok]),
        "slo": {**slo, "meets": not why and not short, "unmet": why, "too_short": short,
                "requests_needed": more},
        "prefix_hit_rate": round(sum(r.cached_tokens for r in reqs) / prompt, 4) if prompt else 0.0,
        "mode": s.cluster.mode, "gpus": s.cluster.gpus, "preemptions": cl.counters["preemptions"],
        "rejected_too_long": cl.counters["rejected_too_long"],
        "preemption_round_trip_ms": latency_stats(cl.round_trips),
        "gpu_blocks_per_instance": cl.gpu_blocks, "series": cl.series,
        **cl.sections(end, prompt),
        "_latencies_ms": {"TTFT": [1000 * r.ttft for r in ok],
                          "TPOT": [1000 * r.tpot for r in ok if r.out > 1],
                          "E2E": [1000 * r.e2e for r in ok]},
        "_itl_hist": itl,
    }


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

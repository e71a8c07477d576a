"""Metrics of a finished simulation, as plain data (definitions: docs/metrics.md).

- latencies (ms; mean, p50, p90, p99) of requests that finished: TTFT (arrival → first token
  at D), TPOT ((finish − first token) / (tokens − 1), answers of 2+ tokens), ITL (every gap
  between consecutive tokens of an answer, preemptions and reads included; nearest rank over
  tokens) and E2E (arrival → last token);
- the steady window: from the time 10 % of the requests had ended (warm-up) to the last
  arrival (after it the queues only drain); the offered rate is its arrivals per second.
  Throughput, goodput and tokens/s count the requests that finished in the *finish window*,
  the steady window shifted by the median end-to-end latency of the requests offered in it,
  per second of it: a request is counted when it finishes, so a cluster that keeps up shows
  its offered rate even when the window is only a few latencies long and arrivals come in
  bursts, and one that falls behind shows the rate it sustains. A run too short for a steady
  window (it would span under 10 % of the run) uses the arrivals' span the same way, and
  says so; the offered rate is then (n - 1) over that span;
- SLO attainment: the share of *all* requests that finished meeting the TTFT SLO, the TPOT
  SLO, and both;
- the verdict: ``meets`` when the run drained, both attainments reach the target and goodput
  reaches target × offered rate; ``fails`` when one of these does not hold; ``too short``
  when only goodput falls short, by no more than the counted finishes' own uncertainty
  (:func:`rate_uncertainty`): the run cannot tell a cluster that keeps up from one that does
  not, and the verdict says about how many requests would;
- utilisation over the run: compute busy; on D also the batch slots used (time-weighted
  batch size / ``decode_max_batch``); blocks used (time-weighted / blocks per instance).
"""
from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any, NamedTuple, Protocol

import numpy as np

from .request import SimRequest
from .scenario_io import scenario_to_dict

__all__ = ["summarize", "steady_window", "finish_window", "rate_uncertainty", "verdict_of", "at_target",
           "latency_stats", "weighted_stats", "Run", "sample_series", "WARMUP_FRACTION", "WINDOW_LABELS", "NEIGHBOURS"]

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


def weighted_stats(hist: dict[float, int]) -> dict[str, float | None]:
    """Mean, p50, p90, p99 in ms of a histogram ``{seconds: count}`` (nearest rank)."""
    total = sum(hist.values())
    if not total:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    values = sorted(hist)
    cum = np.cumsum([hist[v] for v in values])
    out: dict[str, float | None] = {"mean": round(1000.0 * sum(v * n for v, n in hist.items()) / total, 3)}
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


def _window_latencies(reqs: list[SimRequest], start: float, end: float) -> list[float]:
    """End-to-end latencies of the window's arrivals that finished ``done``, in arrival order."""
    return [r.finish - r.arrival for r in sorted(reqs, key=lambda r: r.arrival)
            if start <= r.arrival <= end and r.state == "done" and r.finish is not None]


def finish_window(reqs: list[SimRequest], start: float, end: float, steady: bool) -> tuple[float, float]:
    """Where finishes are counted: the window shifted by the median end-to-end latency of its
    arrivals that finished ``done``, its end clipped to the last finish."""
    e2e = _window_latencies(reqs, start, end)
    lag = float(np.median(e2e)) if e2e else 0.0
    last = max((r.finish for r in reqs if r.finish is not None), default=end)
    a, b = start + lag, min(end + lag, last)
    return (a, b) if b > a else (start, end)


NEIGHBOURS = 51  #: arrivals a latency is compared with to tell its noise from a trend


def rate_uncertainty(reqs: list[SimRequest], start: float, end: float) -> float:
    """How far finishes counted in the shifted window may fall short of the arrivals for a
    cluster that keeps up, as a share of them: at the window's end, requests whose latency
    exceeds the median's finish past it, and nothing arrives after the last arrival to make up
    for them; at its start, the warm-up's arrivals make up for the early finishes only in part
    (they met an emptier cluster). Both are bounded by the mean spread of latency about its
    running median over :data:`NEIGHBOURS` neighbours in arrival order, over the window's
    length; so a cluster falling behind, whose latencies climb across the window, shows its
    noise here and its shortfall in the rates."""
    e2e = np.asarray(_window_latencies(reqs, start, end))
    if end <= start or not e2e.size:
        return math.inf
    k = min(NEIGHBOURS, e2e.size)
    k -= 1 - k % 2  # odd: the median of a window centred on each latency
    padded = np.pad(e2e, k // 2, mode="edge")
    local = np.median(np.lib.stride_tricks.sliding_window_view(padded, k), axis=1)
    d = e2e - local
    edge = float(np.abs(d).mean())
    return edge / (end - start)


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


def _attainment(s: Any, reqs: list[SimRequest], ok: list[_Done]) -> dict[str, Any]:
    slo_t, slo_p, target = s.slo.ttft_ms / 1000.0, s.slo.tpot_ms / 1000.0, s.slo.attainment
    n = len(reqs) or 1
    ttft_ok = {r.rid for r in ok if r.ttft <= slo_t}
    tpot_ok = {r.rid for r in ok if r.out <= 1 or r.tpot <= slo_p}
    multi = [r.tpot for r in ok if r.out > 1]
    return {"ttft_ms": s.slo.ttft_ms, "tpot_ms": s.slo.tpot_ms, "target": target,
            "ttft_attainment": round(len(ttft_ok) / n, 4), "tpot_attainment": round(len(tpot_ok) / n, 4),
            "attainment": round(len(ttft_ok & tpot_ok) / n, 4),
            "ttft_at_target_ms": at_target([r.ttft for r in ok], len(reqs), 0, target),
            "tpot_at_target_ms": at_target(multi, len(reqs), len(ok) - len(multi), target),
            "_good": ttft_ok & tpot_ok}


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
    start, end, steady = steady_window(reqs)
    a, b = finish_window(reqs, start, end, steady)
    span = b - a
    inside = [r for r in ok if a <= r.finish <= b]
    per_s = (lambda x: round(x / span, 4)) if span > 0 else (lambda x: 0.0)
    at_once = not steady and all(r.arrival == reqs[0].arrival for r in reqs)
    return {
        "window_s": [round(start, 6), round(end, 6)],
        "window": "whole run" if at_once else WINDOW_NAMES[steady],
        "finish_window_s": [round(a, 6), round(b, 6)],
        "rate_uncertainty": round(min(rate_uncertainty(reqs, start, end), 1e9), 4),
        "offered_rps": round(_offered(reqs, start, end, steady), 4) if reqs else 0.0,
        "throughput_rps": per_s(len(inside)),
        "goodput_rps": per_s(sum(1 for r in inside if r.rid in good)),
        "output_tokens_per_s": round(per_s(sum(r.generated for r in inside)), 2),
        "total_tokens_per_s": round(per_s(sum(r.generated + r.input_len for r in inside)), 2),
    }


def _too_short(rates: dict[str, Any], target: float, n: int) -> tuple[str | None, int | None]:
    """(why the goodput test cannot be judged on this run, about how many requests would), or
    (None, None) when it can. Edge effects only ever make the counted finishes fall short, by
    at most ``rate_uncertainty``: goodput at ``target`` x offered passes whatever the
    uncertainty, goodput short of it by more than the uncertainty fails, and in between the run
    is too short to tell. The uncertainty shrinks as the window grows with the requests."""
    u, offered = rates["rate_uncertainty"], rates["offered_rps"]
    ratio = rates["goodput_rps"] / offered if offered > 0 else 0.0
    if ratio >= target or ratio < target - u:
        return None, None
    if rates["window"] == "whole run":
        return "too short to judge: every request arrived at once, so no rate was offered to sustain", None
    a, b = rates["window_s"]
    allowed = (1.0 - target) / 2
    more = _round_up(n * u / allowed) if allowed > 0 else None
    hint = f"; about {more:,} requests would tell" if more else ""
    return (f"too short to judge: goodput {rates['goodput_rps']:.2f} req/s < {target} x offered {offered:.2f}, "
            f"but over its {WINDOW_LABELS[rates['window']]} ({b - a:.1f} s) latency spread alone may hide "
            f"{100 * min(u, 9.99):.1f} % of the finishes{hint}"), more


def _round_up(x: float) -> int:
    """``x`` rounded up to two significant digits (a request count to suggest)."""
    k = 10 ** max(0, len(str(int(math.ceil(x)))) - 2)
    return int(math.ceil(x / k) * k)


def _verdict(drained: bool, slo: dict[str, Any], rates: dict[str, Any],
             n: int) -> tuple[list[str], str | None, int | None]:
    """(why the run does not meet the SLOs, why it cannot be judged, requests that would do):
    the first two empty when it meets them.
    A run that misses on drain or attainment fails however short; one that would be judged on
    goodput alone is too short when its window cannot resolve the test."""
    why, target = [], slo["target"]
    if not drained:
        why.append("the run did not drain")
    if slo["ttft_attainment"] < target:
        why.append(f"TTFT attainment {slo['ttft_attainment']:.3f} < {target}")
    if slo["tpot_attainment"] < target:
        why.append(f"TPOT attainment {slo['tpot_attainment']:.3f} < {target}")
    short, more = _too_short(rates, target, n)
    if short is None and rates["goodput_rps"] < target * rates["offered_rps"]:
        why.append(f"goodput {rates['goodput_rps']:.2f} req/s < {target} x offered {rates['offered_rps']:.2f}")
    return (why, None, None) if why else (why, short, more)


def verdict_of(slo: dict[str, Any]) -> str:
    """``meets``, ``fails`` or ``too short`` (the summary's ``slo`` object)."""
    return "meets" if slo["meets"] else "too short" if slo["too_short"] else "fails"


def _counts(reqs: list[SimRequest]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {"states": {}, "reasons": {}, "errors": {}}
    for r in reqs:
        out["states"][r.state] = out["states"].get(r.state, 0) + 1
        out["reasons"][r.reason] = out["reasons"].get(r.reason, 0) + 1
        if r.state != "done":
            out["errors"][str(r.error)] = out["errors"].get(str(r.error), 0) + 1
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
    why, short, more = _verdict(raw["drained"] and not raw["deadlock"], slo, rates, len(reqs))
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
        "mode": s.cluster.mode, "preemptions": cl.counters["preemptions"],
        "rejected_too_long": cl.counters["rejected_too_long"],
        "preemption_round_trip_ms": latency_stats(cl.round_trips),
        "gpu_blocks_per_instance": cl.gpu_blocks, "series": cl.series,
        **cl.sections(end, prompt),
        "_latencies_ms": {"TTFT": [1000 * r.ttft for r in ok],
                          "TPOT": [1000 * r.tpot for r in ok if r.out > 1],
                          "E2E": [1000 * r.e2e for r in ok]},
    }



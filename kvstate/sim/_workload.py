"""Workloads: synthetic arrivals with length distributions, and Mooncake-format traces.

Every request becomes an :class:`Arrival` whose token ids are built so that requests
sharing a prefix share its token ids (hence its storage keys, through the one key
function P and D both use): a synthetic request starts with its prefix group's tokens; a
trace request's tokens are derived block by block from its ``hash_ids``.
"""
from __future__ import annotations

import json
import math
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._errors import ConfigError
from .._validate import check_int, is_int
from ._scenario import WorkloadSpec

__all__ = ["Arrival", "TraceRecord", "load_trace", "synthetic", "arrivals", "unique_start", "unique_tokens",
           "trace_selection", "offered_rate", "from_trace", "check_workload", "MAX_RATE"]

# Token ids are uint32 (kvstate._keys). Shared tokens (prefix groups, trace hash blocks) lie in
# [0, 2**31), a request's own tokens in [2**31, 2**32): its run starts at a point of that half
# that no other request's run starts at (i * _MIX mod 2**31 is one-to-one for an odd _MIX), so
# its keys differ from every other request's past their shared prefix.
_HALF = 1 << 31
_MIX = 0x9E3779B1  # odd
#: req/s: arrivals a microsecond apart, the finest step the timeline records; faster, a run's
#: arrivals cannot be told apart, so it offers no rate it can realize
MAX_RATE = 1e6


def unique_start(i: int, salt: int = 0) -> int:
    """Where request ``i``'s own token run starts (offset in the upper half; ``salt`` picks a
    different run for a second use, e.g. decoded tokens)."""
    return (i * _MIX + salt * 0x7F4A7C15) % _HALF


def unique_tokens(start: int, lo: int, hi: int) -> array:
    """Tokens ``lo .. hi-1`` of the own run that starts at ``start``, as a uint32 array: the
    ids ``2**31 + (start + i) mod 2**31`` (a run that may wrap once)."""
    a = (start + lo) % _HALF
    n = hi - lo
    if n <= 16:  # a few tokens: cheaper without numpy (a block's worth is not)
        if a + n <= _HALF:
            return array("I", range(_HALF + a, _HALF + a + n))
        out = array("I", range(_HALF + a, 1 << 32))
        out.extend(range(_HALF, _HALF + n - (_HALF - a)))
        return out
    out = array("I")
    if a + n <= _HALF:
        out.frombytes(np.arange(_HALF + a, _HALF + a + n, dtype=np.uint32).tobytes())
    else:
        out.frombytes(((np.arange(n, dtype=np.uint32) + np.uint32(a)) % np.uint32(_HALF) + np.uint32(_HALF)).tobytes())
    return out


@dataclass(slots=True)
class Arrival:
    """One request of the workload."""

    index: int
    time: float  #: seconds from the start
    input_len: int
    output_len: int  #: tokens generated, the first (from P) included
    tokens: array  #: uint32 token ids of the prompt


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(rec: dict, name: str, where: str, minimum: int) -> int:
    return check_int(rec.get(name), f"{where}: {name}", minimum=minimum, error=ConfigError)


def load_trace(path: str | Path, hash_block_size: int = 512) -> list[TraceRecord]:
    """Read and validate a JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``); errors name the file, the line and the rule. Nothing is returned on any error."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"trace path must be a str or a path, got {type(path).__name__}")
    check_int(hash_block_size, "hash_block_size", minimum=1, error=ConfigError)
    p = Path(path)
    try:
        return _read_trace(p, hash_block_size)
    except FileNotFoundError:
        raise ConfigError(f"{p}: trace file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a text (UTF-8) file ({e.reason})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the trace ({e.strerror or e})") from None


def _read_trace(p: Path, hash_block_size: int) -> list[TraceRecord]:
    known = {"timestamp", "input_length", "output_length", "hash_ids"}
    out: list[TraceRecord] = []
    last = -1.0
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{where}: a record must be a JSON object")
            extra = set(rec) - known
            if extra:
                raise ConfigError(f"{where}: unknown field(s) {sorted(extra)} (known: {sorted(known)})")
            ts = rec.get("timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0:
                raise ConfigError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
            if ts < last:
                raise ConfigError(f"{where}: timestamp {ts} goes back in time (previous {last}): "
                                  "timestamps must be non-decreasing")
            last = float(ts)
            n_in = _int_field(rec, "input_length", where, 1)
            n_out = _int_field(rec, "output_length", where, 1)
            hids = rec.get("hash_ids", [])
            if not isinstance(hids, list) or any(not is_int(h) or h < 0 for h in hids):
                raise ConfigError(f"{where}: hash_ids must be a list of integers >= 0")
            allowed = -(-n_in // hash_block_size)
            if len(hids) > allowed:
                raise ConfigError(f"{where}: {len(hids)} hash_ids but input_length {n_in} allows at most "
                                  f"{allowed} blocks of {hash_block_size} tokens")
            out.append(TraceRecord(float(ts), n_in, n_out, tuple(hids)))
    if not out:
        raise ConfigError(f"{p}: the trace holds no request")
    return out


def _tokens(prefix: np.ndarray | None, n: int, start: int) -> array:
    """``n`` token ids: the shared uint32 ``prefix`` (truncated to ``n``), then the request's own run."""
    a = array("I")
    k = 0
    if prefix is not None and (k := min(len(prefix), n)):
        a.frombytes(prefix[:k].tobytes())  # uint32 already
    a.extend(unique_tokens(start, 0, n - k))
    return a


def _lengths(rng: np.random.Generator, dist: str, mean: float, sigma: float, cap: int, n: int) -> np.ndarray:
    if dist == "fixed":
        x = np.full(n, mean)
    elif dist == "uniform":
        x = rng.uniform(mean * (1 - min(sigma, 1.0)), mean * (1 + min(sigma, 1.0)), n)
    elif dist == "exponential":
        x = rng.exponential(mean, n)
    else:  # lognormal with the given mean
        x = rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, n)
    return np.clip(np.rint(x), 1, cap).astype(np.int64)


def synthetic(w: WorkloadSpec, seed: int) -> Iterator[Arrival]:
    """Poisson or gamma arrivals; prompts share one of ``prefix_groups`` prefixes."""
    rng = np.random.default_rng(seed)
    n = w.num_requests
    if w.arrival == "poisson":
        gaps = rng.exponential(1.0 / w.rate, n)
    else:  # gamma with mean 1/rate and coefficient of variation cv
        shape = 1.0 / (w.cv * w.cv)
        gaps = rng.gamma(shape, 1.0 / (w.rate * shape), n)
    times = np.cumsum(gaps) - gaps[0]
    ins = _lengths(rng, w.input_dist, w.input_mean, w.input_sigma, w.input_max, n)
    outs = _lengths(rng, w.output_dist, w.output_mean, w.output_sigma, w.output_max, n)
    groups = rng.integers(0, w.prefix_groups, n) if w.prefix_groups else None
    prefixes: dict[int, np.ndarray] = {}
    for i in range(n):
        prefix = None
        if groups is not None and w.prefix_tokens:
            g = int(groups[i])
            prefix = prefixes.get(g)
            if prefix is None:
                prefix = prefixes[g] = np.arange(g * w.prefix_tokens, (g + 1) * w.prefix_tokens,
                                                 dtype=np.uint64).astype(np.uint32)
        n_in = int(ins[i])
        yield Arrival(i, float(times[i]), n_in, int(outs[i]), _tokens(prefix, n_in, unique_start(i)))


def trace_selection(records: list[TraceRecord], w: WorkloadSpec) -> tuple[list[TraceRecord], float]:
    """(the records replayed, the factor their timestamps are multiplied by): the first
    ``trace_requests`` (all when 0), re-timed to ``trace_rate`` by scaling every gap alike,
    as ``vllm bench serve --num-prompts`` takes a dataset's first prompts; else ``time_scale``."""
    if w.trace_requests:
        records = records[:w.trace_requests]
    if not w.trace_rate:
        return records, w.time_scale
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    if span_s <= 0:
        raise ConfigError(f"{w.trace}: [workload] trace_rate: the {len(records)} request(s) replayed all arrive at "
                          "once, so there are no gaps to scale to a rate")
    return records, (len(records) - 1) / span_s / w.trace_rate


def offered_rate(w: WorkloadSpec) -> float:
    """The mean arrival rate the workload offers, req/s: the configured rate of synthetic
    arrivals, or (n - 1) over the span of the trace's replayed requests (0 when they all
    arrive at once)."""
    if w.arrival != "trace":
        return w.rate
    records, scale = trace_selection(load_trace(w.trace, w.hash_block_size), w)
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0 * scale
    return (len(records) - 1) / span_s if span_s > 0 else 0.0


def from_trace(records: list[TraceRecord], w: WorkloadSpec) -> Iterator[Arrival]:
    """Replay: equal ``hash_ids`` give equal token ids, block by block (``hash_block_size`` each)."""
    records, scale = trace_selection(records, w)
    hb = w.hash_block_size
    offsets = np.arange(hb, dtype=np.uint32)[None, :]
    t0 = records[0].timestamp_ms
    for i, r in enumerate(records):
        prefix = None
        if r.hash_ids:  # token j of hash block h is h * hb + j (mod 2**31): equal ids, equal tokens
            if (max(r.hash_ids) + 1) * hb <= _HALF:  # no wrap: plain uint32 arithmetic
                prefix = (np.asarray(r.hash_ids, dtype=np.uint32)[:, None] * np.uint32(hb) + offsets).ravel()
            else:
                ids = np.asarray(r.hash_ids, dtype=np.uint64)[:, None]
                prefix = ((ids * np.uint64(hb) + offsets) % np.uint64(_HALF)).astype(np.uint32).ravel()
        yield Arrival(i, (r.timestamp_ms - t0) / 1000.0 * scale, r.input_length, r.output_length,
                      _tokens(prefix, r.input_length, unique_start(i)))


def _replayed(w: WorkloadSpec, records: list[TraceRecord], context: int) -> tuple[int, float]:
    """(requests, seconds from the first arrival to the last) of a trace replay that exists as
    asked: no more requests than the trace holds, no prompt past the model's context."""
    if w.trace_requests > len(records):
        raise ConfigError(f"[workload] trace_requests (--num-prompts with a trace): {w.trace_requests:,} requests, but "
                          f"{w.trace} holds {len(records):,}")
    chosen, scale = trace_selection(records, w)
    i = max(range(len(chosen)), key=lambda j: chosen[j].input_length)
    if context and chosen[i].input_length > context:
        raise ConfigError(f"{w.trace}: request {i + 1} has a {chosen[i].input_length:,}-token prompt, longer than the "
                          f"model's context of {context:,} tokens ([model] context)")
    return len(chosen), (chosen[-1].timestamp_ms - chosen[0].timestamp_ms) / 1000.0 * scale


def check_workload(w: WorkloadSpec, context: int = 0, time_limit_s: float = math.inf,
                   records: list[TraceRecord] | None = None) -> None:
    """Refuse a workload a run cannot carry out as asked, with the limit it breaks: a prompt
    longer than the model's ``context`` (0: not known), more requests than a trace holds, arrivals
    faster than :data:`MAX_RATE`, or so slow that they outlast the run's ``time_limit_s`` (the
    run would end before the rate was offered)."""
    if w.arrival == "trace":
        n, span = _replayed(w, records if records is not None else load_trace(w.trace, w.hash_block_size), context)
    else:
        if context and w.input_max > context:
            raise ConfigError(f"[workload] input_max: prompts of up to {w.input_max:,} tokens, longer than the model's "
                              f"context of {context:,} tokens ([model] context): set input_max <= {context:,}")
        n, span = w.num_requests, (w.num_requests - 1) / w.rate
    if n < 2 or span <= 0:
        return
    rate, field = (n - 1) / span, "rate (--rate)" if w.arrival != "trace" else "trace_rate (--rate with a trace)"
    if rate > MAX_RATE:
        raise ConfigError(f"[workload] {field}: {rate:.3g} req/s puts arrivals less than a microsecond apart; at most "
                          f"{MAX_RATE:.0e} req/s")
    if span >= time_limit_s:
        raise ConfigError(f"[workload] {field}: {n:,} arrivals at {rate:.3g} req/s take {span:,.0f} s, past the run's "
                          f"time limit of {time_limit_s:,.0f} s (time_limit_s): at least {(n - 1) / time_limit_s:.3g} "
                          "req/s, or fewer requests")


def arrivals(w: WorkloadSpec, seed: int, context: int = 0,
             time_limit_s: float = math.inf) -> tuple[int, Iterator[Arrival]]:
    """(number of requests, their arrivals in time order), after :func:`check_workload`. A
    trace is read and validated here, in full, before the first arrival is handed out."""
    if w.arrival == "trace":
        records = load_trace(w.trace, w.hash_block_size)
        check_workload(w, context, time_limit_s, records)
        return len(trace_selection(records, w)[0]), from_trace(records, w)
    check_workload(w, context, time_limit_s)
    return w.num_requests, synthetic(w, seed)

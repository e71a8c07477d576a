"""Scenarios: everything one simulation run needs, as validated, frozen dataclasses.

A scenario is read from TOML (stdlib ``tomllib``) with one table per section below; any
key left out takes the default, so the empty file is the embedded default scenario:
a Llama-3-8B-like cache on H100-class GPUs, 2 P + 2 D instances at TP 2, a Mooncake-like
storage pool, Poisson arrivals. Every rule is checked before anything runs; an error names
the file, the ``[section] field`` and the rule.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..spec import DTYPES

__all__ = ["Scenario", "ModelSpec", "GpuSpec", "ClusterSpec", "StorageSpec", "NetworkSpec",
           "TpSpec", "PolicySpec", "WorkloadSpec", "SloSpec", "FaultSpec", "load_scenario",
           "scenario_from_dict", "scenario_to_dict", "with_overrides"]

DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "exponential")
ARRIVALS = ("poisson", "gamma", "trace")
PROTOCOLS = ("kvstate", "seed")
BARRIERS = ("auto", "manual-reset")


class _Rule:
    """Field checks shared by the sections: each raises ConfigError('field: rule')."""

    @staticmethod
    def positive(sec: Any, *names: str) -> None:
        for n in names:
            v = getattr(sec, n)
            if not v > 0:
                raise ConfigError(f"{n}: must be > 0, got {v!r}")

    @staticmethod
    def non_negative(sec: Any, *names: str) -> None:
        for n in names:
            v = getattr(sec, n)
            if not v >= 0:
                raise ConfigError(f"{n}: must be >= 0, got {v!r}")

    @staticmethod
    def fraction(sec: Any, *names: str) -> None:
        for n in names:
            v = getattr(sec, n)
            if not 0 <= v <= 1:
                raise ConfigError(f"{n}: must be within 0..1, got {v!r}")

    @staticmethod
    def choice(sec: Any, name: str, options: tuple[str, ...]) -> None:
        v = getattr(sec, name)
        if v not in options:
            raise ConfigError(f"{name}: must be one of {list(options)}, got {v!r}")


@dataclass(frozen=True)
class ModelSpec:
    """The served model: its size (for compute) and its KV-cache geometry (for transfers)."""

    name: str = "llama-3-8b"
    params_b: float = 8.03  #: parameters, billions (weights are bf16: 2 bytes each)
    num_layers: int = 32
    hidden: int = 4096
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 64  #: tokens per KV block

    def __post_init__(self) -> None:
        _Rule.positive(self, "params_b", "num_layers", "hidden", "kv_heads", "head_dim", "block_size")
        _Rule.choice(self, "dtype", tuple(DTYPES))


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: roofline figures and the memory left for the KV cache."""

    name: str = "H100-SXM"
    tflops: float = 989.0  #: dense bf16 peak, TFLOP/s
    mfu: float = 0.45  #: fraction of peak FLOP/s a prefill reaches
    hbm_gbps: float = 3350.0  #: HBM bandwidth, GB/s
    mbu: float = 0.65  #: fraction of HBM bandwidth a decode step reaches
    mem_gib: float = 80.0
    mem_util: float = 0.9  #: fraction of memory for weights + KV cache
    step_overhead_ms: float = 1.5  #: fixed cost of one forward (launches, sampling, scheduling)
    calibration: str = "h100"  #: transfer cost calibration: a shipped name or a JSON path

    def __post_init__(self) -> None:
        _Rule.positive(self, "tflops", "mfu", "hbm_gbps", "mbu", "mem_gib", "mem_util")
        _Rule.fraction(self, "mfu", "mbu", "mem_util")
        _Rule.non_negative(self, "step_overhead_ms")


@dataclass(frozen=True)
class ClusterSpec:
    """P and D instances, their TP degree and their schedulers' limits."""

    n_prefill: int = 2
    n_decode: int = 2
    tp: int = 2
    gpu_blocks: int = 0  #: KV blocks per instance; 0 = what the GPU memory leaves after weights
    prefill_token_budget: int = 16384  #: tokens of new prompts batched into one prefill forward
    decode_max_batch: int = 256  #: requests decoded together in one step
    staging_mib: int = 64  #: pinned staging per rank (transfers pipeline in pieces of this size)
    transfer_workers: int = 2  #: per rank and direction (read / write), like the seed's thread pools

    def __post_init__(self) -> None:
        _Rule.positive(self, "n_prefill", "n_decode", "tp", "prefill_token_budget", "decode_max_batch",
                       "staging_mib", "transfer_workers")
        _Rule.non_negative(self, "gpu_blocks")


@dataclass(frozen=True)
class StorageSpec:
    """The storage pool (Mooncake-like): aggregate bandwidth, per-op latency, LRU capacity."""

    bandwidth_gbps: float = 200.0  #: aggregate over the pool, GB/s
    latency_ms: float = 0.3  #: per put/get batch
    query_latency_ms: float = 0.1  #: per existence query
    capacity_gib: float = 256.0  #: beyond it the least recently used blocks are evicted

    def __post_init__(self) -> None:
        _Rule.positive(self, "bandwidth_gbps", "capacity_gib")
        _Rule.non_negative(self, "latency_ms", "query_latency_ms")


@dataclass(frozen=True)
class NetworkSpec:
    latency_ms: float = 0.2  #: P -> D first-token message

    def __post_init__(self) -> None:
        _Rule.non_negative(self, "latency_ms")


@dataclass(frozen=True)
class TpSpec:
    """How the TP ranks of an instance run transfer tasks (see :mod:`kvstate.sim.tp`)."""

    protocol: str = "kvstate"  #: "kvstate": ranks answer independently; "seed": shared barriers
    barrier: str = "auto"  #: "auto" (resets itself) or "manual-reset" (rank 0 resets after passing)
    skew_ms: tuple[float, ...] = ()  #: extra delay of each rank's part of a transfer (missing: 0)
    barrier_timeout_s: float = 30.0  #: a barrier wait longer than this is reported as a deadlock

    def __post_init__(self) -> None:
        _Rule.choice(self, "protocol", PROTOCOLS)
        _Rule.choice(self, "barrier", BARRIERS)
        _Rule.positive(self, "barrier_timeout_s")
        object.__setattr__(self, "skew_ms", tuple(self.skew_ms))
        for s in self.skew_ms:
            if not isinstance(s, (int, float)) or isinstance(s, bool) or s < 0:
                raise ConfigError(f"skew_ms: every entry must be a number >= 0, got {s!r}")


@dataclass(frozen=True)
class PolicySpec:
    """The lifecycle :class:`~kvstate.policy.Policy` the instances run."""

    preempt: str = "write"
    read_failure: str = "recompute"
    write_retries: int = 1
    decode_headroom_blocks: int = 1
    transfer_timeout_s: float = 30.0
    read_prefix: bool = True

    def __post_init__(self) -> None:
        _Rule.choice(self, "preempt", ("write", "recompute"))
        _Rule.choice(self, "read_failure", ("fail", "recompute"))
        _Rule.non_negative(self, "write_retries", "decode_headroom_blocks")
        _Rule.positive(self, "transfer_timeout_s")


@dataclass(frozen=True)
class WorkloadSpec:
    """Arrivals and lengths; or a Mooncake-format JSONL trace to replay."""

    arrival: str = "poisson"  #: "poisson", "gamma" (burstiness ``cv``) or "trace"
    rate: float = 40.0  #: requests per second (poisson, gamma)
    cv: float = 1.0  #: gamma: coefficient of variation of inter-arrival times
    num_requests: int = 2000
    input_dist: str = "lognormal"
    input_mean: float = 2048.0
    input_sigma: float = 0.6  #: lognormal sigma; uniform: half-width as a fraction of the mean
    input_max: int = 16384
    output_dist: str = "lognormal"
    output_mean: float = 256.0
    output_sigma: float = 0.5
    output_max: int = 2048
    prefix_groups: int = 16  #: distinct shared prompt prefixes (0: none)
    prefix_tokens: int = 1024  #: length of each shared prefix (capped below the prompt length)
    trace: str = ""  #: JSONL trace (arrival "trace"); relative paths are relative to the scenario file
    hash_block_size: int = 512  #: tokens per ``hash_ids`` entry of the trace
    time_scale: float = 1.0  #: trace timestamps are multiplied by this (0.5 = twice the rate)

    def __post_init__(self) -> None:
        _Rule.choice(self, "arrival", ARRIVALS)
        _Rule.choice(self, "input_dist", DISTRIBUTIONS)
        _Rule.choice(self, "output_dist", DISTRIBUTIONS)
        _Rule.positive(self, "rate", "cv", "num_requests", "input_mean", "output_mean", "input_max",
                       "output_max", "hash_block_size", "time_scale")
        _Rule.non_negative(self, "input_sigma", "output_sigma", "prefix_groups", "prefix_tokens")
        if self.arrival == "trace" and not self.trace:
            raise ConfigError("trace: arrival 'trace' needs a trace file")


@dataclass(frozen=True)
class SloSpec:
    ttft_ms: float = 1000.0
    tpot_ms: float = 30.0

    def __post_init__(self) -> None:
        _Rule.positive(self, "ttft_ms", "tpot_ms")


@dataclass(frozen=True)
class FaultSpec:
    """Injected transfer faults: probability per (command, rank)."""

    write_fail: float = 0.0
    read_fail: float = 0.0

    def __post_init__(self) -> None:
        _Rule.fraction(self, "write_fail", "read_fail")


_SECTIONS: dict[str, type] = {
    "model": ModelSpec, "gpu": GpuSpec, "cluster": ClusterSpec, "storage": StorageSpec,
    "network": NetworkSpec, "tp": TpSpec, "policy": PolicySpec, "workload": WorkloadSpec,
    "slo": SloSpec, "faults": FaultSpec,
}


@dataclass(frozen=True)
class Scenario:
    """A whole run: top-level ``seed``, ``time_limit_s``, ``sample_ms`` and one field per section."""

    seed: int = 0
    time_limit_s: float = 36000.0  #: simulated time after which a run that has not drained is reported
    sample_ms: float = 500.0  #: period of the queue / block-use time series
    model: ModelSpec = field(default_factory=ModelSpec)
    gpu: GpuSpec = field(default_factory=GpuSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    storage: StorageSpec = field(default_factory=StorageSpec)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    tp: TpSpec = field(default_factory=TpSpec)
    policy: PolicySpec = field(default_factory=PolicySpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    slo: SloSpec = field(default_factory=SloSpec)
    faults: FaultSpec = field(default_factory=FaultSpec)
    source: str = "<embedded default>"  #: where the scenario came from (for messages)

    def __post_init__(self) -> None:
        _Rule.positive(self, "time_limit_s", "sample_ms")
        if len(self.tp.skew_ms) > self.cluster.tp:
            raise ConfigError(f"[tp] skew_ms: {len(self.tp.skew_ms)} entries for {self.cluster.tp} ranks")

    # -- derived figures -----------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Whole-model KV bytes of one token (key and value, every layer, every head)."""
        m = self.model
        return 2 * m.num_layers * m.kv_heads * m.head_dim * DTYPES[m.dtype].itemsize

    @property
    def block_bytes_per_rank(self) -> int:
        return self.kv_bytes_per_token * self.model.block_size // self.cluster.tp

    @property
    def weight_bytes(self) -> float:
        return self.model.params_b * 1e9 * 2

    def gpu_blocks(self) -> int:
        """KV blocks per instance (each block spans every rank)."""
        if self.cluster.gpu_blocks:
            return self.cluster.gpu_blocks
        free = self.gpu.mem_gib * 2**30 * self.gpu.mem_util - self.weight_bytes / self.cluster.tp
        if free <= 0:
            raise ConfigError(f"{self.source}: [gpu] mem_gib: the weights of {self.model.name} "
                              f"({self.weight_bytes / 2**30:.1f} GiB over TP {self.cluster.tp}) do not fit")
        return int(free // self.block_bytes_per_rank)


def _check_types(section: str, cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    names = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, v in values.items():
        if key not in names or key == "source":
            raise ConfigError(f"{where}: [{section}] unknown key {key!r} (known: {sorted(n for n in names if n != 'source')})")
        default = getattr(cls(), key)
        if isinstance(default, bool):
            ok = isinstance(v, bool)
        elif isinstance(default, int):
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif isinstance(default, float):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            v = float(v) if ok else v
        elif isinstance(default, str):
            ok = isinstance(v, str)
        elif isinstance(default, tuple):
            ok = isinstance(v, (list, tuple))
            v = tuple(v) if ok else v
        else:
            ok = True
        if not ok:
            raise ConfigError(f"{where}: [{section}] {key}: expected {type(default).__name__}, got {v!r}")
        out[key] = v
    return out


def scenario_from_dict(data: dict[str, Any], source: str = "<dict>") -> Scenario:
    """Validate a parsed TOML document (or an equivalent dict) into a :class:`Scenario`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a scenario is a table of sections")
    top: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    for key, v in data.items():
        if key in _SECTIONS:
            if not isinstance(v, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            try:
                sections[key] = _SECTIONS[key](**_check_types(key, _SECTIONS[key], v, source))
            except ConfigError as e:
                msg = str(e)
                raise ConfigError(msg if msg.startswith(source) else f"{source}: [{key}] {msg}") from None
        else:
            top[key] = v
    for key in top:
        if key not in ("seed", "time_limit_s", "sample_ms"):
            raise ConfigError(f"{source}: unknown top-level key {key!r} (sections: {sorted(_SECTIONS)}; "
                              f"keys: seed, time_limit_s, sample_ms)")
    for key, kind in (("seed", int), ("time_limit_s", float), ("sample_ms", float)):
        if key in top:
            v = top[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
                raise ConfigError(f"{source}: {key}: expected {kind.__name__}, got {v!r}")
            top[key] = kind(v)
    try:
        return Scenario(**top, **sections, source=source)
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None


def load_scenario(path: str | Path | None) -> Scenario:
    """The scenario in a TOML file, or the embedded default for ``None``."""
    if path is None:
        return Scenario()
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"scenario path must be a str or a path, got {type(path).__name__}")
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: scenario file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the scenario ({e.strerror or e})") from None
    wl = data.get("workload")
    if isinstance(wl, dict) and isinstance(wl.get("trace"), str) and wl["trace"]:
        t = Path(wl["trace"])
        if not t.is_absolute():
            wl["trace"] = str(p.parent / t)
    return scenario_from_dict(data, str(p))


def scenario_to_dict(s: Scenario) -> dict[str, Any]:
    """The scenario as plain data (what ``--json`` prints under ``scenario``)."""
    d = dataclasses.asdict(s)
    d["tp"]["skew_ms"] = list(s.tp.skew_ms)
    return d


def with_overrides(s: Scenario, overrides: dict[str, Any]) -> Scenario:
    """A copy with ``{"section.field": value}`` (or top-level ``"seed"``) replaced, validated again."""
    if not isinstance(overrides, dict):
        raise ConfigError(f"overrides must be a dict of 'section.field' -> value, got {type(overrides).__name__}")
    d = scenario_to_dict(s)
    source = d.pop("source")
    for dotted, v in overrides.items():
        if not isinstance(dotted, str):
            raise ConfigError(f"scenario field {dotted!r} must be a str 'section.field'")
        sec, _, name = dotted.rpartition(".")
        if (sec and sec not in _SECTIONS) or (not sec and name != "seed"):
            raise ConfigError(f"unknown scenario field {dotted!r}")
        target = d[sec] if sec else d
        if name not in target:
            raise ConfigError(f"unknown scenario field {dotted!r}")
        target[name] = v
    return scenario_from_dict(d, source)

"""Scenarios: everything one simulation run needs, as validated, frozen dataclasses.

A scenario has top-level ``seed``, ``time_limit_s`` and ``sample_ms`` and one section per
table below. Every field has a default (the embedded default scenario: a Llama-3-8B-like cache
on H100-class GPUs, 2 P + 2 D instances at TP 2, a Mooncake-like storage pool, Poisson
arrivals) and a one-line description in its metadata, which ``kvstate scenario`` prints.
Each section checks its fields' types (from their defaults) and its rules when built, so a
scenario that exists is valid; an error names the ``[section] field`` and the rule. Reading
and writing TOML lives in :mod:`kvstate.sim.scenario_io`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import DTYPES
from ..errors import ConfigError
from ..policy import PREEMPT_MODES, READ_FAILURE_MODES, SWAP_FALLBACKS, SWAP_WRITES, Policy
from ..spec import CacheSpec
from .tp import PROTOCOLS

__all__ = ["Scenario", "ModelSpec", "GpuSpec", "ClusterSpec", "StorageSpec", "NetworkSpec", "TpSpec",
           "PolicySpec", "WorkloadSpec", "SloSpec", "FaultSpec", "SECTIONS", "TOP_LEVEL", "doc_of"]

DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "exponential")
ARRIVALS = ("poisson", "gamma", "trace")
BARRIERS = ("auto", "manual-reset")


def _f(default: Any, doc: str) -> Any:
    """A field with its default and the line ``kvstate scenario`` prints above it."""
    return field(default=default, metadata={"doc": doc})


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def _type_ok(default: Any, v: Any) -> tuple[bool, Any]:
    """Whether ``v`` has the type of ``default`` (ints pass for floats, lists for tuples)."""
    if isinstance(default, bool):
        return isinstance(v, bool), v
    if isinstance(default, int):
        return isinstance(v, int) and not isinstance(v, bool), v
    if isinstance(default, float):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return ok, float(v) if ok else v
    if isinstance(default, str):
        return isinstance(v, str), v
    if isinstance(default, tuple):
        return isinstance(v, (list, tuple)), tuple(v) if isinstance(v, (list, tuple)) else v
    return True, v


class _Section:
    """What every section does when built: check each field's type, then its own rules."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            ok, v = _type_ok(f.default, v)
            if not ok:
                raise ConfigError(f"{f.name}: expected {type(f.default).__name__}, got {v!r}")
            object.__setattr__(self, f.name, v)
        self.check()

    def check(self) -> None:
        """The section's rules (raise ConfigError('field: rule'))."""

    def positive(self, *names: str) -> None:
        for n in names:
            if not getattr(self, n) > 0:
                raise ConfigError(f"{n}: must be > 0, got {getattr(self, n)!r}")

    def non_negative(self, *names: str) -> None:
        for n in names:
            if not getattr(self, n) >= 0:
                raise ConfigError(f"{n}: must be >= 0, got {getattr(self, n)!r}")

    def fraction(self, *names: str) -> None:
        for n in names:
            if not 0 <= getattr(self, n) <= 1:
                raise ConfigError(f"{n}: must be within 0..1, got {getattr(self, n)!r}")

    def choice(self, name: str, options: tuple[str, ...]) -> None:
        if getattr(self, name) not in options:
            raise ConfigError(f"{name}: must be one of {list(options)}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ModelSpec(_Section):
    """The served model: its size (for compute) and its KV-cache geometry (for transfers)."""

    name: str = _f("llama-3-8b", "a label; also the namespace of its storage keys")
    params_b: float = _f(8.03, "parameters, billions (weights held in bf16: 2 bytes each)")
    num_layers: int = _f(32, "transformer layers (each holds a K and a V cache)")
    hidden: int = _f(4096, "hidden size (attention FLOPs)")
    kv_heads: int = _f(8, "KV heads in all (grouped-query attention); TP ranks split them")
    head_dim: int = _f(128, "dimension of one head")
    dtype: str = _f("bfloat16", f"KV cache dtype: one of {sorted(DTYPES)}")
    block_size: int = _f(64, "tokens per KV block")

    def check(self) -> None:
        self.positive("params_b", "num_layers", "hidden", "kv_heads", "head_dim", "block_size")
        self.choice("dtype", tuple(DTYPES))


@dataclass(frozen=True)
class GpuSpec(_Section):
    """One GPU: roofline figures and the memory left for the KV cache."""

    name: str = _f("H100-SXM", "a label")
    tflops: float = _f(989.0, "dense bf16 peak, TFLOP/s")
    mfu: float = _f(0.45, "fraction of peak FLOP/s a prefill reaches")
    hbm_gbps: float = _f(3350.0, "HBM bandwidth, GB/s")
    mbu: float = _f(0.65, "fraction of HBM bandwidth a decode step reaches")
    mem_gib: float = _f(80.0, "GPU memory, GiB")
    mem_util: float = _f(0.9, "fraction of memory for weights + KV cache")
    step_overhead_ms: float = _f(1.5, "fixed cost of one forward (launches, sampling, scheduling)")
    calibration: str = _f("h100", "transfer cost calibration: a shipped name or a JSON path")

    def check(self) -> None:
        self.positive("tflops", "mfu", "hbm_gbps", "mbu", "mem_gib", "mem_util")
        self.fraction("mfu", "mbu", "mem_util")
        self.non_negative("step_overhead_ms")


@dataclass(frozen=True)
class ClusterSpec(_Section):
    """P and D instances, their TP degree and their schedulers' limits."""

    n_prefill: int = _f(2, "prefill (P) instances")
    n_decode: int = _f(2, "decode (D) instances")
    tp: int = _f(2, "tensor-parallel GPUs per instance")
    gpu_blocks: int = _f(0, "KV blocks per instance; 0: what GPU memory leaves after the weights")
    prefill_token_budget: int = _f(16384, "tokens of new prompts batched into one prefill forward")
    decode_max_batch: int = _f(256, "requests decoded together in one step")
    staging_mib: int = _f(64, "pinned staging per rank (transfers pipeline in pieces of this size)")
    transfer_workers: int = _f(2, "transfer workers per rank and direction (read / write)")
    host_blocks: int = _f(0, "host tier slots per instance (pinned host memory, one block each): P looks "
                             "prefixes up there first, D swaps preempted caches there; 0: none")
    prefix_cache: bool = _f(False, "keep finished prompts' blocks on the GPU, idle, evicted least recently "
                                   "used: P and D look prefixes up there before the host tier and storage")
    layerwise: bool = _f(False, "P stores each layer of the cache as its prefill computes it, so only the last "
                                "layer's share trails the prefill; D reads layer by layer (timed as a read)")

    def check(self) -> None:
        self.positive("n_prefill", "n_decode", "tp", "prefill_token_budget", "decode_max_batch", "staging_mib",
                      "transfer_workers")
        self.non_negative("gpu_blocks", "host_blocks")


@dataclass(frozen=True)
class StorageSpec(_Section):
    """The storage pool (Mooncake-like): aggregate bandwidth, per-op latency, LRU capacity."""

    bandwidth_gbps: float = _f(200.0, "aggregate bandwidth over the pool, GB/s")
    latency_ms: float = _f(0.3, "per put/get batch")
    query_latency_ms: float = _f(0.1, "per existence query")
    capacity_gib: float = _f(256.0, "beyond it the least recently used blocks are evicted")

    def check(self) -> None:
        self.positive("bandwidth_gbps", "capacity_gib")
        self.non_negative("latency_ms", "query_latency_ms")


@dataclass(frozen=True)
class NetworkSpec(_Section):
    """The message path between instances."""

    latency_ms: float = _f(0.2, "P -> D first-token message")

    def check(self) -> None:
        self.non_negative("latency_ms")


@dataclass(frozen=True)
class TpSpec(_Section):
    """How the TP ranks of an instance run transfer tasks (see :mod:`kvstate.sim.tp`)."""

    protocol: str = _f("kvstate", f"one of {list(PROTOCOLS)}: ranks answer on their own, or meet at "
                                  "one shared barrier per kind (FastDeploy's cache transfer manager)")
    barrier: str = _f("auto", "shared barrier: 'auto' (resets itself) or 'manual-reset' (reset after passing)")
    skew_ms: tuple[float, ...] = _f((), "extra delay of each rank's part of a transfer (missing: 0)")
    barrier_timeout_s: float = _f(30.0, "a barrier wait longer than this is reported as a deadlock")

    def check(self) -> None:
        self.choice("protocol", PROTOCOLS)
        self.choice("barrier", BARRIERS)
        self.positive("barrier_timeout_s")
        for s in self.skew_ms:
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not s >= 0:
                raise ConfigError(f"skew_ms: every entry must be a number >= 0, got {s!r}")


@dataclass(frozen=True)
class PolicySpec(_Section):
    """The lifecycle :class:`~kvstate.policy.Policy` the instances run (times in seconds)."""

    preempt: str = _f("write", f"one of {list(PREEMPT_MODES)}: write the cache out, recompute it, or swap it "
                               "to the host tier (needs cluster.host_blocks)")
    swap_fallback: str = _f("write", f"one of {list(SWAP_FALLBACKS)}: when the host tier is full or a swap fails")
    swap_write: str = _f("host", f"one of {list(SWAP_WRITES)}: a swapped cache in host memory only, also "
                                 "written to the store before (through) or after (back) its GPU blocks go")
    read_failure: str = _f("recompute", f"one of {list(READ_FAILURE_MODES)}: end with 502, or recompute")
    write_retries: int = _f(1, "extra attempts after a failed or partial write")
    decode_headroom_blocks: int = _f(1, "blocks D keeps free per running request when it reserves")
    transfer_timeout_s: float = _f(30.0, "deadline of every transfer")
    first_token_timeout_s: float = _f(60.0, "D's wait for P's first token, from its reservation")
    queue_timeout_s: float = _f(30.0, "a prompt's wait for P's blocks")
    fence_grace_s: float = _f(30.0, "how long a timed-out transfer's blocks stay pinned")
    read_prefix: bool = _f(True, "P reads the longest stored prefix of a prompt before prefill")

    def check(self) -> None:
        self.choice("preempt", PREEMPT_MODES)
        self.choice("swap_fallback", SWAP_FALLBACKS)
        self.choice("swap_write", SWAP_WRITES)
        self.choice("read_failure", READ_FAILURE_MODES)
        self.non_negative("write_retries", "decode_headroom_blocks")
        self.positive("transfer_timeout_s", "first_token_timeout_s", "queue_timeout_s", "fence_grace_s")

    def to_policy(self) -> Policy:
        """The lifecycle policy these settings describe (the one place they are mapped)."""
        return Policy(read_prefix=self.read_prefix, write_retries=self.write_retries,
                      read_failure=self.read_failure, preempt=self.preempt, swap_fallback=self.swap_fallback,
                      swap_write=self.swap_write,
                      transfer_timeout=self.transfer_timeout_s, first_token_timeout=self.first_token_timeout_s,
                      queue_timeout=self.queue_timeout_s, fence_grace=self.fence_grace_s,
                      decode_headroom_blocks=self.decode_headroom_blocks)


@dataclass(frozen=True)
class WorkloadSpec(_Section):
    """Arrivals and lengths; or a Mooncake-format JSONL trace to replay."""

    arrival: str = _f("poisson", f"one of {list(ARRIVALS)}")
    rate: float = _f(40.0, "requests per second (poisson, gamma)")
    cv: float = _f(1.0, "gamma: coefficient of variation of inter-arrival times (burstiness)")
    num_requests: int = _f(2000, "requests in the run (poisson, gamma)")
    input_dist: str = _f("lognormal", f"prompt lengths: one of {list(DISTRIBUTIONS)}")
    input_mean: float = _f(2048.0, "mean prompt length, tokens")
    input_sigma: float = _f(0.6, "lognormal sigma; uniform: half-width as a fraction of the mean")
    input_max: int = _f(16384, "longest prompt, tokens")
    output_dist: str = _f("lognormal", f"answer lengths: one of {list(DISTRIBUTIONS)}")
    output_mean: float = _f(256.0, "mean answer length, tokens (the first, from P, included)")
    output_sigma: float = _f(0.5, "as input_sigma, for answers")
    output_max: int = _f(2048, "longest answer, tokens")
    prefix_groups: int = _f(16, "distinct shared prompt prefixes (0: none)")
    prefix_tokens: int = _f(1024, "length of each shared prefix (capped below the prompt length)")
    trace: str = _f("", "JSONL trace (arrival 'trace'); relative to the scenario file")
    hash_block_size: int = _f(512, "tokens per hash_ids entry of the trace")
    time_scale: float = _f(1.0, "trace timestamps are multiplied by this (0.5: twice the rate)")

    def check(self) -> None:
        self.choice("arrival", ARRIVALS)
        self.choice("input_dist", DISTRIBUTIONS)
        self.choice("output_dist", DISTRIBUTIONS)
        self.positive("rate", "cv", "num_requests", "input_mean", "output_mean", "input_max", "output_max",
                      "hash_block_size", "time_scale")
        self.non_negative("input_sigma", "output_sigma", "prefix_groups", "prefix_tokens")
        if self.arrival == "trace" and not self.trace:
            raise ConfigError("trace: arrival 'trace' needs a trace file")


@dataclass(frozen=True)
class SloSpec(_Section):
    """Service-level objectives, and the share of requests that must meet them."""

    ttft_ms: float = _f(1000.0, "time to first token")
    tpot_ms: float = _f(30.0, "time per output token after the first")
    attainment: float = _f(0.9, "share of all requests that must meet each SLO (goodput: this x offered)")

    def check(self) -> None:
        self.positive("ttft_ms", "tpot_ms", "attainment")
        self.fraction("attainment")


@dataclass(frozen=True)
class FaultSpec(_Section):
    """Injected transfer faults: probability per (command, rank)."""

    write_fail: float = _f(0.0, "probability a rank's write fails")
    read_fail: float = _f(0.0, "probability a rank's read fails")

    def check(self) -> None:
        self.fraction("write_fail", "read_fail")


#: The sections by table name, in the order files are written.
SECTIONS: dict[str, type] = {
    "model": ModelSpec, "gpu": GpuSpec, "cluster": ClusterSpec, "storage": StorageSpec,
    "network": NetworkSpec, "tp": TpSpec, "policy": PolicySpec, "workload": WorkloadSpec,
    "slo": SloSpec, "faults": FaultSpec,
}


@dataclass(frozen=True)
class Scenario(_Section):
    """A whole run: top-level ``seed``, ``time_limit_s``, ``sample_ms`` and one field per section."""

    seed: int = _f(0, "random seed of arrivals, lengths and faults (>= 0)")
    time_limit_s: float = _f(36000.0, "simulated seconds after which a run that has not drained is reported")
    sample_ms: float = _f(500.0, "period of the queue and block-use time series")
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
    source: str = _f("<embedded default>", "where the scenario came from (for messages)")

    def check(self) -> None:
        self.positive("time_limit_s", "sample_ms")
        self.non_negative("seed")
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"[{name}] must be a {cls.__name__}")
        if len(self.tp.skew_ms) > self.cluster.tp:
            raise ConfigError(f"[tp] skew_ms: {len(self.tp.skew_ms)} entries for {self.cluster.tp} ranks")
        if self.model.kv_heads % self.cluster.tp:
            raise ConfigError(f"[cluster] tp: the model's {self.model.kv_heads} KV heads do not split "
                              f"over {self.cluster.tp} ranks")
        if self.policy.preempt == "swap" and not self.cluster.host_blocks:
            raise ConfigError("[policy] preempt = \"swap\" needs a host tier: set [cluster] host_blocks > 0")

    # -- derived figures -----------------------------------------------------------------
    def cache_spec(self) -> CacheSpec:
        """One TP rank's cache geometry: every size below comes from it."""
        m, tp = self.model, self.cluster.tp
        return CacheSpec(num_layers=m.num_layers, kv_heads=m.kv_heads // tp, block_size=m.block_size,
                         head_dim=m.head_dim, dtype=m.dtype, tp_size=tp)

    @property
    def kv_bytes_per_token(self) -> int:
        """Whole-model KV bytes of one token (key and value, every layer, every head)."""
        return self.cache_spec().bytes_per_block // self.model.block_size

    @property
    def block_bytes_per_rank(self) -> int:
        return self.cache_spec().bytes_per_block_per_rank

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


TOP_LEVEL = ("seed", "time_limit_s", "sample_ms")  #: the scenario's own fields (not sections)

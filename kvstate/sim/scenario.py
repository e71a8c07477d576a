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

from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..layers import LayerGroup
from ..policy import Policy
from ..spec import CacheSpec, paired
from .fields import Section, doc_of, setting
from .instancespec import MAX_BLOCKS, MAX_INSTANCES, MAX_TOKENS, MAX_TP, MODES, ClusterSpec, SchedulerSpec
from .served import WEIGHT_DTYPES, GpuSpec, ModelSpec, layer_groups
from .tp import PROTOCOLS

__all__ = ["Scenario", "ModelSpec", "GpuSpec", "ClusterSpec", "SchedulerSpec", "StorageSpec", "NetworkSpec",
           "TpSpec", "Policy",
           "WorkloadSpec", "SloSpec", "FaultSpec", "SECTIONS", "MODES", "TOP_LEVEL", "doc_of",
           "MAX_REQUESTS",
           "MAX_INSTANCES", "MAX_TP", "MAX_BLOCKS"]

DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "exponential")
ARRIVALS = ("poisson", "gamma", "trace")
_SYNTHETIC = ("poisson", "gamma")
#: workload fields that mean something for some kinds of arrival only (the rest: for every kind)
_WORKLOAD_FIELD_ARRIVALS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("rate", "num_requests", "input_dist", "input_mean", "input_sigma", "input_max", "output_dist",
                     "output_mean", "output_sigma", "output_max", "prefix_groups", "prefix_tokens"), _SYNTHETIC),
    "cv": ("gamma",),
    **dict.fromkeys(("trace", "hash_block_size", "time_scale", "trace_rate", "trace_requests"), ("trace",)),
}
#: bounds that keep a run within memory: each is stated in the error that enforces it
MAX_REQUESTS = 2_000_000
BARRIERS = ("auto", "manual-reset")


@dataclass(frozen=True)
class StorageSpec(Section):
    """The storage pool (Mooncake-like): aggregate bandwidth, per-op latency, LRU capacity."""

    bandwidth_gbps: float = setting(200.0, "aggregate bandwidth over the pool, GB/s")
    latency_ms: float = setting(0.3, "per put/get batch")
    query_latency_ms: float = setting(0.1, "per existence query")
    capacity_gib: float = setting(256.0, "beyond it the least recently used blocks are evicted")
    object_us: float = setting(0.0, "per object a put or get moves (a block is kinds x head groups objects a "
                               "rank); 0: within latency_ms and bandwidth_gbps")

    def check(self) -> None:
        self.positive("bandwidth_gbps", "capacity_gib")
        self.non_negative("latency_ms", "query_latency_ms", "object_us")


@dataclass(frozen=True)
class NetworkSpec(Section):
    """The message path between instances."""

    latency_ms: float = setting(0.2, "P -> D first-token message")

    def check(self) -> None:
        self.non_negative("latency_ms")


@dataclass(frozen=True)
class TpSpec(Section):
    """How the TP ranks of an instance run transfer tasks (see :mod:`kvstate.sim.tp`)."""

    protocol: str = setting("kvstate", f"one of {list(PROTOCOLS)}: ranks answer on their own, or meet at "
                                  "one shared barrier per kind (FastDeploy's cache transfer manager)")
    barrier: str = setting("auto", "shared barrier: 'auto' (resets itself) or 'manual-reset' (reset after passing)")
    skew_ms: tuple[float, ...] = setting((), "extra delay of each rank's part of a transfer (missing: 0)")
    barrier_timeout_s: float = setting(30.0, "a barrier wait longer than this is reported as a deadlock")

    def check(self) -> None:
        self.choice("protocol", PROTOCOLS)
        self.choice("barrier", BARRIERS)
        self.positive("barrier_timeout_s")
        for s in self.skew_ms:
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not s >= 0:
                raise ConfigError(f"skew_ms: every entry must be a number >= 0, got {s!r}")


@dataclass(frozen=True)
class WorkloadSpec(Section):
    """Arrivals and lengths; or a Mooncake-format JSONL trace to replay."""

    arrival: str = setting("poisson", f"one of {list(ARRIVALS)}")
    rate: float = setting(40.0, "requests per second (poisson, gamma)")
    cv: float = setting(1.0, "gamma: coefficient of variation of inter-arrival times (burstiness)")
    num_requests: int = setting(2000, "requests in the run (poisson, gamma)")
    input_dist: str = setting("lognormal", f"prompt lengths: one of {list(DISTRIBUTIONS)}")
    input_mean: float = setting(2048.0, "mean prompt length, tokens")
    input_sigma: float = setting(0.6, "lognormal sigma; uniform: half-width as a fraction of the mean")
    input_max: int = setting(16384, "longest prompt, tokens")
    output_dist: str = setting("lognormal", f"answer lengths: one of {list(DISTRIBUTIONS)}")
    output_mean: float = setting(256.0, "mean answer length, tokens (the first, from P, included)")
    output_sigma: float = setting(0.5, "as input_sigma, for answers")
    output_max: int = setting(2048, "longest answer, tokens")
    prefix_groups: int = setting(16, "distinct shared prompt prefixes (0: none)")
    prefix_tokens: int = setting(1024, "length of each shared prefix (capped below the prompt length)")
    trace: str = setting("", "JSONL trace (arrival 'trace'); relative to the scenario file")
    hash_block_size: int = setting(512, "tokens per hash_ids entry of the trace")
    time_scale: float = setting(1.0, "trace timestamps are multiplied by this (0.5: twice the rate)")
    trace_rate: float = setting(0.0, "trace: re-time arrivals to this mean rate, req/s, every gap scaled alike "
                                "(order and burst shape kept); 0: as recorded")
    trace_requests: int = setting(0, "trace: replay only its first N requests; 0: all")

    def check(self) -> None:
        self.choice("arrival", ARRIVALS)
        self.choice("input_dist", DISTRIBUTIONS)
        self.choice("output_dist", DISTRIBUTIONS)
        self.positive("rate", "cv", "num_requests", "input_mean", "output_mean", "input_max", "output_max",
                      "hash_block_size", "time_scale")
        self.at_most(input_max=MAX_TOKENS, output_max=MAX_TOKENS, prefix_tokens=MAX_TOKENS,
                     prefix_groups=1 << 20)
        self.non_negative("input_sigma", "output_sigma", "prefix_groups", "prefix_tokens", "trace_rate",
                          "trace_requests")
        if self.arrival == "trace" and not self.trace:
            raise ConfigError("trace: arrival 'trace' needs a trace file")
        if self.trace_rate and self.time_scale != 1.0:
            raise ConfigError("trace_rate: set either trace_rate (a rate to re-time to) or time_scale (a factor), "
                              "not both")
        if self.num_requests > MAX_REQUESTS or self.trace_requests > MAX_REQUESTS:
            raise ConfigError(f"num_requests: at most {MAX_REQUESTS:,} requests a run (each costs the "
                              "simulator ~7 KB of memory), got "
                              f"{max(self.num_requests, self.trace_requests):,}")

    @staticmethod
    def applies(name: str, arrival: str) -> bool:
        """Whether field ``name`` means anything for arrivals of kind ``arrival``."""
        kinds = _WORKLOAD_FIELD_ARRIVALS.get(name)
        return kinds is None or arrival in kinds


@dataclass(frozen=True)
class SloSpec(Section):
    """Service-level objectives, and the share of requests that must meet them."""

    ttft_ms: float = setting(1000.0, "time to first token (0: no TTFT SLO)")
    tpot_ms: float = setting(30.0, "time per output token after the first (0: no TPOT SLO)")
    e2el_ms: float = setting(0.0, "end-to-end latency, arrival to last token (0: no E2E SLO)")
    attainment: float = setting(0.9, "share of all requests that must meet each SLO (goodput: this x offered)")

    def check(self) -> None:
        self.non_negative("ttft_ms", "tpot_ms", "e2el_ms")
        self.positive("attainment")
        self.fraction("attainment")
        if not (self.ttft_ms or self.tpot_ms or self.e2el_ms):
            raise ConfigError("ttft_ms, tpot_ms, e2el_ms: set at least one SLO (0 means none)")


@dataclass(frozen=True)
class FaultSpec(Section):
    """Injected transfer faults: probability per (command, rank)."""

    write_fail: float = setting(0.0, "probability a rank's write fails")
    read_fail: float = setting(0.0, "probability a rank's read fails")

    def check(self) -> None:
        self.fraction("write_fail", "read_fail")


#: The sections by table name, in the order files are written.
SECTIONS: dict[str, type] = {
    "model": ModelSpec, "gpu": GpuSpec, "cluster": ClusterSpec, "scheduler": SchedulerSpec, "storage": StorageSpec,
    "network": NetworkSpec, "tp": TpSpec, "policy": Policy, "workload": WorkloadSpec,
    "slo": SloSpec, "faults": FaultSpec,
}


@dataclass(frozen=True)
class Scenario(Section):
    """A whole run: top-level ``seed``, ``time_limit_s``, ``sample_ms`` and one field per section."""

    seed: int = setting(0, "random seed of arrivals, lengths and faults (>= 0)")
    time_limit_s: float = setting(36000.0, "simulated seconds after which a run that has not drained is reported")
    sample_ms: float = setting(500.0, "period of the queue and block-use time series")
    model: ModelSpec = field(default_factory=ModelSpec)
    gpu: GpuSpec = field(default_factory=GpuSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    storage: StorageSpec = field(default_factory=StorageSpec)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    tp: TpSpec = field(default_factory=TpSpec)
    policy: Policy = field(default_factory=Policy)  #: the library's own: [policy] is the lifecycles' Policy
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    slo: SloSpec = field(default_factory=SloSpec)
    faults: FaultSpec = field(default_factory=FaultSpec)
    source: str = setting("<embedded default>", "where the scenario came from (for messages)")

    def check(self) -> None:
        self.positive("time_limit_s", "sample_ms")
        self.non_negative("seed")
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"[{name}] must be a {cls.__name__}")
        ranks = max(self.cluster.tp, self.cluster.decode_tp)
        if len(self.tp.skew_ms) > ranks:
            raise ConfigError(f"[tp] skew_ms: {len(self.tp.skew_ms)} entries for {ranks} ranks")
        for name, tp in (("tp", self.cluster.tp), ("d_tp", self.cluster.decode_tp)):
            kv = self.model.total_kv_heads
            if kv % tp and tp % kv and not self.model.kv_lora_rank:  # fewer heads than ranks: replicated
                raise ConfigError(f"[cluster] {name}: the model's {kv} KV heads neither split over {tp} ranks nor "
                                  f"replicate evenly on them (TP must divide the heads, or the heads the TP)")
        self._check_experts()
        if self.cluster.decode_tp != self.cluster.tp and self.model.kv_lora_rank:
            raise ConfigError("[cluster] d_tp: a latent (MLA) cache is replicated on every rank; P and D of "
                              "different TP degrees are not modeled for it")
        if self.cluster.decode_tp != self.cluster.tp and self.model.state_layers:
            raise ConfigError("[cluster] d_tp: a state layer's state splits over the ranks; P and D of different TP "
                              "degrees are not modeled for it")
        if self.policy.preempt == "swap" and not self.cluster.host_blocks:
            raise ConfigError("[policy] preempt = \"swap\" needs a host tier: set [cluster] host_blocks > 0")
        if self.cluster.mode == "colocated" and self.policy.state_checkpoints != 1:
            raise ConfigError("[policy] state_checkpoints: a PD setting; a co-located instance keeps the state at "
                              "every checkpoint its prefix cache holds")
        try:
            self.cache_spec()  # the geometry's own rules: a window or a checkpoint in whole blocks
        except ConfigError as e:
            raise ConfigError(f"[model] {e}") from None

    # -- the library's configuration, both ways ----------------------------------------------
    @classmethod
    def from_library(cls, spec: CacheSpec, policy: Policy, host_blocks: int | None = None,
                     base: Scenario | None = None) -> Scenario:
        """``base`` (the embedded default) serving a cache of ``spec``'s geometry (its model's
        heads, ``spec.heads_total``; TP ``spec.tp_size``) under ``policy``, with the lifecycles'
        ``host_blocks`` (None: ``base``'s). The inverse of
        :meth:`cache_spec` and ``policy``; the model's compute shapes stay
        ``base``'s. Geometry a scenario does not model is refused, naming the field."""
        if not isinstance(spec, CacheSpec) or not isinstance(policy, Policy):
            raise ConfigError("Scenario.from_library: needs a CacheSpec and a Policy")
        base = base if base is not None else cls()
        for name, v in (("extra_layers", spec.extra_layers), ("fp8_scales", spec.fp8_scales),
                        ("store_heads", spec.store_heads), ("has_value", not spec.has_value)):
            if v:
                raise ConfigError(f"Scenario.from_library: CacheSpec.{name} = {getattr(spec, name)!r} is not modeled "
                                  "by a scenario (MLA models come from their HF config: kvstate.sim.hfconfig)")
        model = replace(base.model, num_layers=spec.num_layers, total_kv_heads=spec.heads_total,
                        head_dim=spec.head_dim, dtype=spec.dtype, block_size=spec.block_size)
        cluster = replace(base.cluster, tp=spec.tp_size, d_tp=0,
                          host_blocks=base.cluster.host_blocks if host_blocks is None else host_blocks)
        return replace(base, model=model, cluster=cluster, policy=policy)

    def library(self) -> tuple[CacheSpec, Policy]:
        """One P rank's cache geometry and the lifecycle policy: what an engine running this
        scenario passes to its lifecycles."""
        return self.cache_spec(), self.policy

    # -- derived figures -----------------------------------------------------------------
    def cache_spec(self) -> CacheSpec:
        """One TP rank's cache geometry (a P rank's, when D's degree differs): every size below
        comes from it. P and D of different degrees store head groups both split."""
        m, tp = self.model, self.cluster.tp
        if m.kv_lora_rank:  # one latent head with no value cache, replicated: rank 0 stores it once
            return CacheSpec(num_layers=m.num_layers, kv_heads=1, total_kv_heads=1, has_value=False,
                             block_size=m.block_size, head_dim=m.head_dim, dtype=m.dtype, tp_size=tp,
                             groups=(LayerGroup("latent", tuple(range(m.num_layers))),))
        spec = CacheSpec(num_layers=m.num_layers, kv_heads=max(1, m.total_kv_heads // tp), block_size=m.block_size,
                         head_dim=m.head_dim, dtype=m.dtype, tp_size=tp, groups=layer_groups(m, tp),
                         total_kv_heads=m.total_kv_heads)  # fewer heads than ranks: each rank holds a replica
        d_tp = self.cluster.decode_tp
        if d_tp == tp:
            return spec
        d_spec = CacheSpec(num_layers=m.num_layers, kv_heads=max(1, m.total_kv_heads // d_tp),
                           block_size=m.block_size, head_dim=m.head_dim, dtype=m.dtype, tp_size=d_tp,
                           groups=spec.groups, total_kv_heads=m.total_kv_heads)
        return paired(spec, d_spec)[0]

    def _check_experts(self) -> None:
        """Expert parallelism needs experts, as many on every rank of P and of D."""
        if not self.cluster.expert_parallel:
            return
        if not self.model.experts:
            raise ConfigError("[cluster] expert_parallel: the model has no experts (set [model] experts)")
        for name, tp in (("tp", self.cluster.tp), ("d_tp", self.cluster.decode_tp)):
            if self.model.experts % tp:
                raise ConfigError(f"[cluster] expert_parallel: {self.model.experts} experts do not spread "
                                  f"evenly over {name} {tp} ranks")

    def decode_view(self) -> Scenario:
        """This scenario as a D instance sees it: ``cluster.tp`` its own degree and ``gpu`` its
        own GPU (the same scenario when P and D share both)."""
        view = self
        if self.cluster.d_gpu:
            from .gpus import gpu_fields

            view = replace(view, gpu=replace(self.gpu, **gpu_fields(self.cluster.d_gpu, "d_gpu"), profile=""))
        if not self.cluster.d_tp or self.cluster.d_tp == self.cluster.tp:
            return view
        return replace(view, cluster=replace(self.cluster, tp=self.cluster.d_tp, d_tp=self.cluster.tp))

    @property
    def gpu_prices(self) -> tuple[float, float]:
        """USD per GPU-hour of a P (or co-located) GPU and of a D GPU; 0 where not known."""
        if self.cluster.mode == "colocated":
            return self.gpu.price_per_hour, self.gpu.price_per_hour
        d = self.cluster.d_price_per_hour or (self.decode_view().gpu.price_per_hour if self.cluster.d_gpu
                                              else self.gpu.price_per_hour)
        return self.gpu.price_per_hour, d

    @property
    def cost_per_hour(self) -> float | None:
        """USD an hour of every GPU the deployment holds; None where a price is not known."""
        c, (p, d) = self.cluster, self.gpu_prices
        if c.mode == "colocated":
            return c.gpus * p if p else None
        if not (p and d):
            return None
        return c.n_prefill * c.tp * p + c.n_decode * c.decode_tp * d

    @property
    def kv_bytes_per_token(self) -> int:
        """Whole-model KV bytes of one token (key and value, every layer, every head once: a head
        replicated over ranks is stored once)."""
        spec = self.cache_spec()
        return spec.bytes_per_block // spec.replicas // self.model.block_size

    @property
    def block_bytes_per_rank(self) -> int:
        return self.cache_spec().bytes_per_block_per_rank

    @property
    def weight_bytes(self) -> float:
        return self.model.params_b * 1e9 * WEIGHT_DTYPES[self.model.weight_dtype]

    def state_pages(self) -> int:
        """State pages per instance (0 without state layers): ``cluster.state_pages``, or one
        for each request D decodes at once (a co-located instance: one a seat)."""
        if not self.model.state_layers:
            return 0
        c = self.cluster
        return self.scheduler.max_num_seqs if c.mode == "colocated" else c.state_pages or c.decode_max_batch

    def gpu_blocks(self) -> int:
        """KV blocks per instance (each block spans every rank): what the GPU's memory leaves
        after the weights and the state pages."""
        if self.cluster.gpu_blocks:
            return self.cluster.gpu_blocks
        free = self.gpu.mem_gib * 2**30 * self.gpu.mem_util - self.weight_bytes / self.cluster.tp
        if free <= 0:
            raise ConfigError(f"{self.source}: [gpu] mem_gib: the weights of {self.model.name} "
                              f"({self.weight_bytes / 2**30:.1f} GiB over TP {self.cluster.tp}) do not fit")
        n, page = self.state_pages(), self.cache_spec().state_bytes_per_rank
        if n * page >= free:
            raise ConfigError(f"{self.source}: [cluster] state_pages: {n:,} state pages of {page / 2**20:.1f} MiB "
                              f"a rank leave no memory for KV blocks ({free / 2**30:.1f} GiB after the weights): "
                              "set fewer")
        blocks = int((free - n * page) // self.block_bytes_per_rank)
        instances = self.cluster.instances
        if blocks * instances > MAX_BLOCKS:
            raise ConfigError(f"{self.source}: [gpu] mem_gib: {self.gpu.mem_gib:g} GiB leaves {blocks:,} KV blocks "
                              f"on each of {instances} instances; a run holds at most {MAX_BLOCKS:,} (set "
                              "[cluster] gpu_blocks lower)")
        return blocks


TOP_LEVEL = ("seed", "time_limit_s", "sample_ms")  #: the scenario's own fields (not sections)

"""Scenarios: everything one simulation run needs, as validated, frozen dataclasses, every
section in this one module.

A scenario has top-level ``seed``, ``time_limit_s`` and ``sample_ms`` and one section per
table below. Every field has a default (the embedded default scenario: a Llama-3-8B-like cache
on H100-class GPUs, 2 P + 2 D instances at TP 2, a Mooncake-like storage pool, Poisson
arrivals) and a one-line description in its metadata, which ``kvstate scenario`` prints.

A section is a frozen dataclass deriving :class:`Section`; each field is a :func:`setting`.
Building one checks each field's type against its default's (ints pass for floats, lists for
tuples, bools never for numbers), then calls its ``check()``: a section that exists is valid;
an error names the ``[section] field`` and the rule. The bounds that keep a run within memory
(``MAX_*``) are each stated in the error that enforces them.

- ``[model]`` (:class:`ModelSpec`): what the compute model needs of a model (its layers' matrix
  shapes, dense or mixture-of-experts, the weights' dtype), what memory needs (its parameter
  count) and what transfers need (its KV-cache geometry).
- ``[gpu]`` (:class:`GpuSpec`): one GPU's datasheet figures, how near to them kernels come, the
  all-reduce link between the GPUs of an instance, the engine's fixed cost per step, and an
  optional measured profile that replaces the curves (:mod:`~kvstate.sim._profile`).
- ``[cluster]``, ``[scheduler]``: P and D instances (or co-located ones) and their schedulers.
- ``[storage]``, ``[network]``, ``[tp]``, ``[workload]``, ``[slo]``, ``[faults]``; ``[policy]`` is
  the library's :class:`~kvstate._policy.Policy` itself.

Reading and writing TOML lives in :mod:`kvstate.sim._scenario_io`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, cast

from .._dtypes import DTYPES
from .._errors import ConfigError
from .._layers import LayerGroup
from .._policy import Policy
from .._spec import CacheSpec, paired
from ._tp import PROTOCOLS

__all__ = ["Scenario", "Section", "setting", "type_ok", "ModelSpec", "GpuSpec", "ClusterSpec", "SchedulerSpec",
           "StorageSpec", "NetworkSpec", "TpSpec", "Policy", "WorkloadSpec", "SloSpec", "FaultSpec", "SECTIONS",
           "MODES", "TOP_LEVEL", "doc_of", "check_scenario", "WEIGHT_DTYPES", "WEIGHT_KINDS", "layer_groups",
           "MAX_REQUESTS", "MAX_INSTANCES", "MAX_TP", "MAX_BLOCKS", "MAX_BATCH", "MAX_TOKENS"]


# -- sections: typed fields, checked when built ------------------------------------------------

def setting(default: Any, doc: str) -> Any:
    """A field with its default and the line ``kvstate scenario`` prints above it."""
    return field(default=default, metadata={"doc": doc})


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def type_ok(default: Any, v: Any) -> tuple[bool, Any]:
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


@functools.cache
def _made_by(factory: Any) -> type:
    """The class a section field's default factory makes (made once, not at every build)."""
    return type(factory())


class Section:
    """What every section does when built: check each field's type, then its own rules."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                want = _made_by(cast(Any, f.default_factory))  # a class or a lambda: hashable
                ok = isinstance(v, want)  # a section: of its own class
            else:
                want = type(f.default)
                ok, v = type_ok(f.default, v)
            if not ok:
                raise ConfigError(f"{f.name}: expected {want.__name__}, got {v!r}")
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

    def at_most(self, **limits: int) -> None:
        """Bounds that keep a run within memory, each stated when broken."""
        for n, limit in limits.items():
            if getattr(self, n) > limit:
                raise ConfigError(f"{n}: at most {limit:,}, got {getattr(self, n):,}")

    def fraction(self, *names: str) -> None:
        for n in names:
            if not 0 <= getattr(self, n) <= 1:
                raise ConfigError(f"{n}: must be within 0..1, got {getattr(self, n)!r}")

    def choice(self, name: str, options: tuple[str, ...]) -> None:
        if getattr(self, name) not in options:
            raise ConfigError(f"{name}: must be one of {list(options)}, got {getattr(self, name)!r}")


# -- [model] and [gpu]: what is served on what ----------------------------------------------------

#: weight dtypes: bytes a weight, and which tensor-core peak its GEMMs run at
#: how a model's weights are served: bytes a weight, and the tensor cores its GEMMs run on
#: ("16": bf16/fp16; "8": the GPU's 8-bit rate, fp8 or int8). Weight-only quantization (AWQ,
#: GPTQ, compressed-tensors w4a16/w8a16) reads its weights at 4 or 8 bits but computes in 16;
#: W8A8 (int8 or fp8 weights and activations) computes at the 8-bit rate.
WEIGHT_KINDS: dict[str, tuple[float, str]] = {
    "bfloat16": (2, "16"), "float16": (2, "16"), "fp8": (1, "8"), "int8": (1, "8"),
    "int8_weight_only": (1, "16"), "int4_weight_only": (0.5, "16"),
}
WEIGHT_DTYPES = {k: b for k, (b, _) in WEIGHT_KINDS.items()}  #: bytes a weight, by weight dtype


@dataclass(frozen=True)
class ModelSpec(Section):
    """The served model: its shapes (for compute), its size (for memory) and its KV-cache
    geometry (for transfers). A mixture-of-experts model has ``experts`` > 0."""

    name: str = setting("llama-3-8b", "a label; also the namespace of its storage keys")
    params_b: float = setting(8.03, "parameters, billions (what the weights take in GPU memory)")
    num_layers: int = setting(32, "transformer layers (each holds a K and a V cache)")
    hidden: int = setting(4096, "hidden size")
    num_heads: int = setting(32, "attention (query) heads")
    total_kv_heads: int = setting(8, "the model's KV heads (grouped-query attention; CacheSpec.total_kv_heads): "
                                    "TP ranks split them, each holding total_kv_heads / tp, or with fewer heads than "
                                    "ranks each holds one, replicated (as vLLM does)")
    head_dim: int = setting(128, "dimension of one head")
    intermediate: int = setting(14336, "width of a dense layer's MLP (gate, up and down projections)")
    vocab: int = setting(128256, "vocabulary (the LM head's width)")
    experts: int = setting(0, "routed experts of a mixture-of-experts layer (0: a dense model)")
    experts_per_token: int = setting(0, "experts each token is routed to (top-k)")
    shared_experts: int = setting(0, "experts every token goes through besides its top-k")
    moe_intermediate: int = setting(0, "width of one expert's MLP")
    dense_layers: int = setting(0, "layers of a mixture-of-experts model whose MLP is dense (the rest route)")
    q_lora_rank: int = setting(0, "latent attention (MLA): rank of the query's down-projection (0: none)")
    kv_lora_rank: int = setting(0, "latent attention (MLA): rank of the cached latent (0: ordinary attention); "
                                   "the cache's head is kv_lora_rank + its rotary part (head_dim)")
    qk_head_dim: int = setting(0, "latent attention: a query head's width (no-rotary part + rotary part)")
    v_head_dim: int = setting(0, "latent attention: a value head's width")
    window: int = setting(0, "sliding-window attention: the tokens a window layer attends back (0: none)")
    window_layers: int = setting(0, "layers with sliding-window attention (the others attend to every token)")
    state_layers: int = setting(0, "layers keeping a recurrent state (Mamba, linear attention) instead of a KV cache")
    state_bytes: int = setting(0, "one state layer's state for one request, the whole model's (TP ranks split "
                                  "it), bytes")
    state_checkpoint: int = setting(0, "tokens between the states a stored prefix keeps, a multiple of "
                                       "block_size (0: one a block): a prefix is reused from a checkpoint only")
    weight_dtype: str = setting("bfloat16", f"weights: one of {list(WEIGHT_DTYPES)} (fp8, int8: W8A8, a byte a "
                                "weight on 8-bit tensor cores; *_weight_only: read at 8 or 4 bits, computed in 16)")
    dtype: str = setting("bfloat16", f"KV cache dtype: one of {sorted(DTYPES)} (uint8: an fp8 cache)")
    block_size: int = setting(64, "tokens per KV block")
    context: int = setting(0, "the model's context, tokens (config.json's max_position_embeddings): a workload "
                           "whose prompts may be longer is refused; 0: not known, not checked")

    def check(self) -> None:
        self.positive("params_b", "num_layers", "hidden", "num_heads", "total_kv_heads", "head_dim", "intermediate",
                      "vocab", "block_size")
        self.non_negative("experts", "experts_per_token", "shared_experts", "moe_intermediate", "dense_layers",
                          "context")
        self.choice("dtype", tuple(DTYPES))
        self.choice("weight_dtype", tuple(WEIGHT_DTYPES))
        if self.num_heads % self.total_kv_heads:
            raise ConfigError(f"num_heads: {self.num_heads} query heads do not group over "
                              f"{self.total_kv_heads} KV heads")
        if self.experts:
            if not 1 <= self.experts_per_token <= self.experts or not self.moe_intermediate:
                raise ConfigError(f"experts: a mixture-of-experts model needs 1 <= experts_per_token <= experts "
                                  f"({self.experts}) and moe_intermediate > 0, got {self.experts_per_token} and "
                                  f"{self.moe_intermediate}")
            if self.dense_layers > self.num_layers:
                raise ConfigError(f"dense_layers: {self.dense_layers} of only {self.num_layers} layers")
        elif self.experts_per_token or self.shared_experts or self.dense_layers:
            raise ConfigError("experts_per_token, shared_experts and dense_layers describe a mixture-of-experts "
                              "model: set experts > 0, or leave them 0")
        self.non_negative("q_lora_rank", "kv_lora_rank", "qk_head_dim", "v_head_dim")
        self._check_layer_kinds()
        if self.kv_lora_rank and not (self.kv_lora_rank < self.head_dim and self.qk_head_dim and self.v_head_dim):
            raise ConfigError(f"kv_lora_rank: latent attention needs head_dim ({self.head_dim}) > kv_lora_rank "
                              f"({self.kv_lora_rank}) and qk_head_dim, v_head_dim > 0")

    def _check_layer_kinds(self) -> None:
        """Window and state layers: each count with its size, and some layer left to page."""
        self.non_negative("window", "window_layers", "state_layers", "state_bytes", "state_checkpoint")
        self.at_most(window=1 << 20, state_bytes=1 << 30, state_checkpoint=1 << 20)
        for count, size in (("window_layers", "window"), ("state_layers", "state_bytes")):
            if bool(getattr(self, count)) != bool(getattr(self, size)):
                raise ConfigError(f"{count}: {getattr(self, count)} with {size} {getattr(self, size)}: set both, "
                                  "or neither")
        if self.window_layers + self.state_layers > self.num_layers or self.state_layers >= self.num_layers:
            raise ConfigError(f"window_layers + state_layers: {self.window_layers} + {self.state_layers} of "
                              f"{self.num_layers} layers: more than there are, or no attention layer to page")
        if self.kv_lora_rank and (self.window_layers or self.state_layers):
            raise ConfigError("kv_lora_rank: a latent (MLA) model with window or state layers is not modeled")

    @property
    def full_layers(self) -> int:
        """Layers attending to every token."""
        return self.num_layers - self.window_layers - self.state_layers

    @property
    def attention_head_dim(self) -> float:
        """The width one head's attention FLOPs go by: (query-key + value) / 2 under MLA."""
        return (self.qk_head_dim + self.v_head_dim) / 2 if self.kv_lora_rank else self.head_dim

    def attention_matrices(self, tp: int) -> tuple[tuple[str, float, float], ...]:
        """One layer's attention projections on one of ``tp`` ranks: (name, K, N). Latent
        attention (MLA) projects queries through a rank-``q_lora_rank`` bottleneck and keys and
        values from the cached latent (its rotary part kept apart)."""
        q, kv, d, h = self.num_heads, self.total_kv_heads, self.head_dim, self.hidden
        if not self.kv_lora_rank:
            return (("qkv", h, (q + 2 * kv) * d / tp), ("o", q * d / tp, h))
        rope, qk, v, lat = d - self.kv_lora_rank, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank
        query = ((("q_a", h, self.q_lora_rank), ("q_b", self.q_lora_rank, q * qk / tp)) if self.q_lora_rank
                 else (("q", h, q * qk / tp),))
        return (*query, ("kv_a", h, lat + rope), ("kv_b", lat, q * (qk - rope + v) / tp), ("o", q * v / tp, h))

    def mlp_matrices(self, tp: int) -> dict[str, tuple[float, float]]:
        """A layer's MLP matrices on one rank, dense and routed: name -> (K, N)."""
        h, out = self.hidden, {}
        if not self.experts or self.dense_layers:
            out.update({"gate_up": (h, 2 * self.intermediate / tp), "down": (self.intermediate / tp, h)})
        if self.experts:
            w = self.moe_intermediate / tp
            out.update({"expert_gate_up": (h, 2 * w), "expert_down": (w, h), "router": (h, self.experts)})
            if self.shared_experts:
                out.update({"shared_gate_up": (h, 2 * w * self.shared_experts),
                            "shared_down": (w * self.shared_experts, h)})
        return out


@dataclass(frozen=True)
class GpuSpec(Section):
    """One GPU: datasheet figures, how near kernels come to them, the link between an instance's
    GPUs, the engine's cost per step, and the memory left for the KV cache."""

    name: str = setting("H100-SXM", "a label (or a preset's name: `kvstate simulate --gpu`)")
    tflops: float = setting(989.0, "dense bf16 peak, TFLOP/s (datasheet)")
    fp8_tflops: float = setting(1979.0, "dense fp8 peak, TFLOP/s (datasheet): W8A8 weights, fp8 or int8, run there "
                                "(Hopper and Ada run int8 at the fp8 rate; the A100 preset, without fp8, gives "
                                "its 16-bit rate)")
    hbm_gbps: float = setting(3350.0, "HBM bandwidth, GB/s (datasheet)")
    mfu: float = setting(0.79, "fraction of peak a large GEMM reaches (the efficiency curve's top; Hopper's "
                                "GEMMs measured by `kvstate profile`)")
    gemm_half_tokens: float = setting(24.0, "tokens in a step at which a GEMM reaches half of mfu (small "
                                             "GEMMs fill few tiles)")
    attn_mfu: float = setting(0.55, "fraction of peak a long prefill's attention reaches")
    mbu: float = setting(0.85, "fraction of HBM bandwidth a GEMM reading its weights, or an element-wise kernel, "
                               "reaches")
    attn_mbu: float = setting(0.9, "fraction of HBM bandwidth attention reading the KV cache reaches")
    kernel_us: float = setting(4.0, "fixed time of every kernel besides its FLOPs and bytes (launch, ramp-up, "
                                    "tail), µs")
    allreduce_us: float = setting(5.0, "latency of the one-shot (low-latency) all-reduce at TP 2, µs")
    allreduce_ll_gbps: float = setting(200.0, "bus bandwidth the one-shot all-reduce reaches, GB/s")
    allreduce_ring_us: float = setting(35.0, "latency of NCCL's ring all-reduce at TP 2, µs")
    allreduce_gbps: float = setting(360.0, "bus bandwidth of the ring all-reduce on large messages, GB/s (NCCL's "
                                           "busbw: NVLink 4 about 360, PCIe 4.0 about 20)")
    custom_allreduce_mib: float = setting(8.0, "messages up to this size take the engine's one-shot custom "
                                          "all-reduce (vLLM's CustomAllreduce default limit, 8 MiB), larger "
                                          "ones NCCL: a profile's measured NCCL curve applies above it only")
    mem_gib: float = setting(80.0, "GPU memory, GiB")
    mem_util: float = setting(0.9, "fraction of memory for weights + KV cache")
    step_overhead_ms: float = setting(0.3, "the engine's fixed time of a step besides its layers (input copies, "
                                      "sampling, the sampled tokens' copy back; the CPU's scheduling overlaps)")
    profile: str = setting("", "a measured profile (`kvstate profile`) to interpolate instead of the curves: "
                               "a path relative to the scenario file, or a shipped one (h200-llama-2-7b-tp1, ...)")
    calibration: str = setting("h100", "transfer cost calibration: a shipped name or a JSON path")
    price_per_hour: float = setting(3.95, "USD per GPU-hour, for the plan's cost (0: not known); the default is the "
                                          "H100-SXM preset's, and every preset carries a public on-demand list price "
                                          "(kvstate.sim._gpus names whose)")

    def check(self) -> None:
        self.positive("tflops", "fp8_tflops", "hbm_gbps", "mfu", "attn_mfu", "mbu", "attn_mbu", "mem_gib", "mem_util",
                      "allreduce_gbps", "allreduce_ll_gbps", "gemm_half_tokens")
        if not 0 <= self.price_per_hour < float("inf"):
            raise ConfigError(f"price_per_hour: must be a finite number of USD >= 0, got {self.price_per_hour!r}")
        self.fraction("mfu", "attn_mfu", "mbu", "attn_mbu", "mem_util")
        self.non_negative("step_overhead_ms", "allreduce_us", "allreduce_ring_us", "kernel_us", "custom_allreduce_mib")


def layer_groups(m: ModelSpec, tp: int) -> tuple[LayerGroup, ...]:
    """The cache's layer groups on one of ``tp`` ranks: window layers first, then state layers,
    then the full-attention rest (the order is the simulator's: it charges bytes, not places);
    none for a model whose every layer attends to every token."""
    if not (m.window_layers or m.state_layers):
        return ()
    w, st = m.window_layers, m.state_layers
    groups = []
    if w:
        groups.append(LayerGroup("window", tuple(range(w)), window=m.window))
    if st:
        groups.append(LayerGroup("state", tuple(range(w, w + st)), state_bytes=-(-m.state_bytes // tp),
                                 checkpoint=m.state_checkpoint or m.block_size))
    if w + st < m.num_layers:
        groups.append(LayerGroup("full", tuple(range(w + st, m.num_layers))))
    return tuple(groups)


# -- [cluster] and [scheduler]: the instances ------------------------------------------------------

MAX_INSTANCES = 1024  #: P or D instances (each holds a block pool: ~50 bytes a block)
MAX_TP = 64
MAX_BLOCKS = 1 << 26  #: GPU or host blocks over every instance of a run
MAX_BATCH = 1 << 16  #: decode_max_batch
MAX_TOKENS = 1 << 24  #: prefill_token_budget, input_max, output_max
MODES = ("pd", "colocated")  #: ``cluster.mode``


@dataclass(frozen=True)
class ClusterSpec(Section):
    """P and D instances (or co-located ones), their TP degree and their schedulers' limits."""

    mode: str = setting("pd", f"one of {list(MODES)}: prefill and decode on separate instances (P and D, the "
                        "cache moving through the storage pool), or both on each instance ([scheduler])")
    n_instances: int = setting(1, "co-located instances (mode colocated; requests go to the least loaded)")
    n_prefill: int = setting(2, "prefill (P) instances")
    n_decode: int = setting(2, "decode (D) instances")
    tp: int = setting(2, "tensor-parallel GPUs per instance (per P instance when d_tp is set)")
    d_tp: int = setting(0, "tensor-parallel GPUs per D instance; 0: tp (P and D of different degrees store "
                        "head groups both split: kvstate._spec.paired)")
    d_gpu: str = setting("", "D instances' GPU, a preset (H100-SXM, H200, H100-PCIe, A100-SXM-80G, L40S); "
                         "empty: [gpu]'s (P on one kind, D on another)")
    d_price_per_hour: float = setting(0.0, "USD per D GPU-hour; 0: the d_gpu preset's price ([gpu]'s without d_gpu)")
    expert_parallel: bool = setting(False, "a mixture-of-experts model's experts spread whole over an instance's "
                                    "TP ranks (vLLM's --enable-expert-parallel) instead of each expert split over "
                                    "them: each MoE layer sends its tokens to their experts' ranks and back "
                                    "(two all-to-alls) instead of one all-reduce")
    gpu_blocks: int = setting(0, "KV blocks per instance; 0: what GPU memory leaves after the weights")
    prefill_token_budget: int = setting(16384, "tokens of new prompts batched into one prefill forward")
    decode_max_batch: int = setting(256, "requests decoded together in one step")
    staging_mib: int = setting(64, "pinned staging per rank (transfers pipeline in pieces of this size)")
    transfer_workers: int = setting(2, "transfer workers per rank and direction (read / write)")
    host_blocks: int = setting(0, "host tier slots per instance (pinned host memory, one block each): P looks "
                             "prefixes up there first, D swaps preempted caches there; 0: none")
    prefix_cache: bool = setting(False, "keep finished prompts' blocks on the GPU, idle, evicted least recently "
                                   "used: P and D look prefixes up there before the host tier and storage")
    layerwise: bool = setting(False, "P stores each layer of the cache as its prefill computes it, so only the last "
                                "layer's share trails the prefill; D reads layer by layer (timed as a read)")
    state_pages: int = setting(0, "state pages per P or D instance, for a model with state layers (Mamba, linear "
                               "attention): a live request holds one (P two while its prompt passes a "
                               "checkpoint), a request finding none waits (P) or is refused (D), and their "
                               "memory comes out of the blocks'; 0: decode_max_batch (co-located: a seat's page "
                               "each, [scheduler] max_num_seqs)")

    @property
    def instances(self) -> int:
        """Instances of the mode in use: each is ``tp`` GPUs (a D ``d_tp``) with its own blocks."""
        return self.n_instances if self.mode == "colocated" else self.n_prefill + self.n_decode

    @property
    def decode_tp(self) -> int:
        """A D instance's TP degree."""
        return self.d_tp or self.tp

    @property
    def gpus(self) -> int:
        """GPUs of the instances of the mode in use."""
        if self.mode == "colocated":
            return self.n_instances * self.tp
        return self.n_prefill * self.tp + self.n_decode * self.decode_tp

    def check(self) -> None:
        self.choice("mode", MODES)
        self.positive("n_instances", "n_prefill", "n_decode", "tp", "prefill_token_budget", "decode_max_batch",
                      "staging_mib", "transfer_workers")
        self.non_negative("gpu_blocks", "host_blocks", "d_tp", "state_pages")
        if not 0 <= self.d_price_per_hour < float("inf"):
            raise ConfigError(f"d_price_per_hour: must be a finite number of USD >= 0, got {self.d_price_per_hour!r}")
        if self.d_gpu:
            from ._gpus import gpu_fields

            gpu_fields(self.d_gpu, "d_gpu")
        self.at_most(n_instances=MAX_INSTANCES, n_prefill=MAX_INSTANCES, n_decode=MAX_INSTANCES, tp=MAX_TP, d_tp=MAX_TP,
                     decode_max_batch=MAX_BATCH, prefill_token_budget=MAX_TOKENS, transfer_workers=64,
                     staging_mib=1 << 16, state_pages=MAX_BATCH)
        for name in ("gpu_blocks", "host_blocks"):
            total = getattr(self, name) * self.instances
            if total > MAX_BLOCKS:
                raise ConfigError(f"{name}: {getattr(self, name):,} blocks on each of {self.instances} "
                                  f"instances is {total:,}; a run holds at most {MAX_BLOCKS:,} (~50 bytes each)")
        if self.mode == "colocated":
            for name in ("host_blocks", "layerwise", "prefix_cache", "d_tp", "state_pages", "d_gpu",
                         "d_price_per_hour"):
                if getattr(self, name):
                    raise ConfigError(f"{name}: a PD setting; a co-located instance has no host tier, moves no cache, "
                                      "caches prefixes as [scheduler] prefix_caching says and holds a state page "
                                      "a seat")


@dataclass(frozen=True)
class SchedulerSpec(Section):
    """A co-located instance's scheduler, as vLLM v1's (``cluster.mode = "colocated"``)."""

    max_num_batched_tokens: int = setting(8192, "token budget of one step: decode tokens, then prompt chunks")
    max_num_seqs: int = setting(256, "requests running at once (decoding or prefilling)")
    chunked_prefill: bool = setting(True, "split a prompt over steps to fit the budget, beside the decoding "
                                    "requests; off, a prompt runs whole or waits")
    prefix_caching: bool = setting(True, "keep computed prompt blocks on the GPU, idle, evicted least recently "
                                   "used; an admitted prompt takes its cached prefix back")
    max_model_len: int = setting(0, "prompt + answer tokens beyond which a request is refused (400); 0: what "
                                 "the instance's blocks hold")
    async_scheduling: bool = setting(True, "schedule each step while the one before runs (vLLM's default since "
                                     "0.14): an arrival joins the step after the next")
    frontend_ms: float = setting(0.0, "the serving front end's time on each request's path (HTTP, tokenizing, "
                                 "handing over, streaming the first token), added to its TTFT and E2E")

    def check(self) -> None:
        self.positive("max_num_batched_tokens", "max_num_seqs")
        self.non_negative("max_model_len", "frontend_ms")
        self.at_most(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_BATCH, max_model_len=MAX_TOKENS)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens: {self.max_num_batched_tokens} is less than max_num_seqs "
                              f"{self.max_num_seqs}: a step must hold a token of every running request")
        if not self.chunked_prefill and 0 < self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"max_num_batched_tokens: without chunked prefill it must hold the longest prompt "
                              f"(max_model_len {self.max_model_len})")


# -- the other sections and the scenario -----------------------------------------------------------

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
    """How the TP ranks of an instance run transfer tasks (see :mod:`kvstate.sim._tp`)."""

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
        self.at_most(seed=2**63 - 1)
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
                                  "by a scenario (MLA models come from their HF config: kvstate.sim._models)")
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
            from ._gpus import gpu_fields

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


def check_scenario(s: Any, who: str) -> None:
    """``s`` is a :class:`Scenario` (which, existing, is valid), else a ConfigError naming ``who``."""
    if not isinstance(s, Scenario):
        raise ConfigError(f"{who}: expected a Scenario (kvstate.sim.load_scenario, with_overrides), got {s!r}")


TOP_LEVEL = ("seed", "time_limit_s", "sample_ms")  #: the scenario's own fields (not sections)

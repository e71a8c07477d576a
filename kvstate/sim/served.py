"""What is served on what: the model's shapes and the GPU's figures, as scenario sections.

:class:`ModelSpec` holds what the compute model needs of a model (its layers' matrix shapes,
dense or mixture-of-experts, the weights' dtype), what memory needs (its parameter count) and
what transfers need (its KV-cache geometry). :class:`GpuSpec` holds one GPU's datasheet figures
(peak FLOP/s in bf16 and fp8, HBM bandwidth, memory), how near to them kernels come (a GEMM's
efficiency curve over the tokens in a step, memory efficiency), the all-reduce link between the
GPUs of an instance, the engine's fixed cost per step, and an optional measured profile that
replaces the curves (:mod:`~kvstate.sim.profile`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DTYPES
from ..errors import ConfigError
from ..layers import LayerGroup
from .fields import Section, setting

__all__ = ["ModelSpec", "GpuSpec", "WEIGHT_DTYPES", "WEIGHT_KINDS", "layer_groups"]

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
                                          "(kvstate.sim.gpus names whose)")

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

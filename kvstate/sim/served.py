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
from .fields import Section, setting

__all__ = ["ModelSpec", "GpuSpec", "WEIGHT_DTYPES"]

#: weight dtypes: bytes a weight, and which tensor-core peak its GEMMs run at
WEIGHT_DTYPES = {"bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec(Section):
    """The served model: its shapes (for compute), its size (for memory) and its KV-cache
    geometry (for transfers). A mixture-of-experts model has ``experts`` > 0."""

    name: str = setting("llama-3-8b", "a label; also the namespace of its storage keys")
    params_b: float = setting(8.03, "parameters, billions (what the weights take in GPU memory)")
    num_layers: int = setting(32, "transformer layers (each holds a K and a V cache)")
    hidden: int = setting(4096, "hidden size")
    num_heads: int = setting(32, "attention (query) heads")
    kv_heads: int = setting(8, "KV heads in all (grouped-query attention); TP ranks split them")
    head_dim: int = setting(128, "dimension of one head")
    intermediate: int = setting(14336, "width of a dense layer's MLP (gate, up and down projections)")
    vocab: int = setting(128256, "vocabulary (the LM head's width)")
    experts: int = setting(0, "routed experts of a mixture-of-experts layer (0: a dense model)")
    experts_per_token: int = setting(0, "experts each token is routed to (top-k)")
    shared_experts: int = setting(0, "experts every token goes through besides its top-k")
    moe_intermediate: int = setting(0, "width of one expert's MLP")
    dense_layers: int = setting(0, "layers of a mixture-of-experts model whose MLP is dense (the rest route)")
    weight_dtype: str = setting("bfloat16", f"weights: one of {list(WEIGHT_DTYPES)} (fp8: one byte, fp8 tensor cores)")
    dtype: str = setting("bfloat16", f"KV cache dtype: one of {sorted(DTYPES)} (uint8: an fp8 cache)")
    block_size: int = setting(64, "tokens per KV block")

    def check(self) -> None:
        self.positive("params_b", "num_layers", "hidden", "num_heads", "kv_heads", "head_dim", "intermediate",
                      "vocab", "block_size")
        self.non_negative("experts", "experts_per_token", "shared_experts", "moe_intermediate", "dense_layers")
        self.choice("dtype", tuple(DTYPES))
        self.choice("weight_dtype", tuple(WEIGHT_DTYPES))
        if self.num_heads % self.kv_heads:
            raise ConfigError(f"num_heads: {self.num_heads} query heads do not group over {self.kv_heads} KV heads")
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


@dataclass(frozen=True)
class GpuSpec(Section):
    """One GPU: datasheet figures, how near kernels come to them, the link between an instance's
    GPUs, the engine's cost per step, and the memory left for the KV cache."""

    name: str = setting("H100-SXM", "a label (or a preset's name: `kvstate simulate --gpu`)")
    tflops: float = setting(989.0, "dense bf16 peak, TFLOP/s (datasheet)")
    fp8_tflops: float = setting(1979.0, "dense fp8 peak, TFLOP/s (datasheet; fp8 weights run there)")
    hbm_gbps: float = setting(3350.0, "HBM bandwidth, GB/s (datasheet)")
    mfu: float = setting(0.75, "fraction of peak a large GEMM reaches (the efficiency curve's top)")
    gemm_half_tokens: float = setting(192.0, "tokens in a step at which a GEMM reaches half of mfu (small "
                                             "GEMMs fill few tiles)")
    attn_mfu: float = setting(0.55, "fraction of peak a long prefill's attention reaches")
    mbu: float = setting(0.85, "fraction of HBM bandwidth reading weights, KV caches and activations reaches")
    allreduce_gbps: float = setting(360.0, "all-reduce bus bandwidth between an instance's GPUs, GB/s "
                                           "(NCCL's busbw: NVLink about 360, PCIe 4.0 about 20)")
    allreduce_us: float = setting(8.0, "latency of one small all-reduce at TP 2, µs (+50 % each doubling)")
    mem_gib: float = setting(80.0, "GPU memory, GiB")
    mem_util: float = setting(0.9, "fraction of memory for weights + KV cache")
    step_overhead_ms: float = setting(1.5, "the engine's fixed cost of one step (launches, sampling, scheduling)")
    profile: str = setting("", "a measured profile (`kvstate profile`) to interpolate instead of the curves; "
                               "relative to the scenario file")
    calibration: str = setting("h100", "transfer cost calibration: a shipped name or a JSON path")

    def check(self) -> None:
        self.positive("tflops", "fp8_tflops", "hbm_gbps", "mfu", "attn_mfu", "mbu", "mem_gib", "mem_util",
                      "allreduce_gbps", "gemm_half_tokens")
        self.fraction("mfu", "attn_mfu", "mbu", "mem_util")
        self.non_negative("step_overhead_ms", "allreduce_us")

"""Served models for ``--model``: shipped presets by name, or a Hugging Face ``config.json``
(:mod:`~kvstate.sim._hfconfig`: dense decoders and mixture-of-experts families)."""
from __future__ import annotations

from pathlib import Path

from .._errors import ConfigError
from ._hfconfig import model_from_hf_config, params_from_hf_config
from ._scenario import ModelSpec

__all__ = ["MODELS", "resolve_model", "model_from_hf_config", "params_from_hf_config"]


def _m(name: str, params_b: float, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int,
       context: int, experts: int = 0, top_k: int = 0) -> ModelSpec:
    return ModelSpec(name, params_b, layers, hidden, heads, kv, 128, inter, vocab, experts=experts,
                     experts_per_token=top_k, moe_intermediate=inter if experts else 0, context=context)


#: Presets: published architecture figures of common models, each with the context of its
#: config.json (max_position_embeddings). The Llama 3 presets take the 3.1 release's 128k context:
#: the same shapes, and the release served today (Llama 3's first release had 8k).
MODELS: dict[str, ModelSpec] = {
    m.name: m for m in (
        _m("llama-3-8b", 8.03, 32, 4096, 32, 8, 14336, 128256, 131072),
        _m("llama-3-70b", 70.55, 80, 8192, 64, 8, 28672, 128256, 131072),
        _m("llama-3.1-405b", 405.85, 126, 16384, 128, 8, 53248, 128256, 131072),
        _m("llama-2-7b", 6.74, 32, 4096, 32, 32, 11008, 32000, 4096),
        _m("codellama-34b", 33.74, 48, 8192, 64, 8, 22016, 32000, 16384),
        _m("qwen2.5-7b", 7.62, 28, 3584, 28, 4, 18944, 152064, 32768),
        _m("qwen2.5-72b", 72.71, 80, 8192, 64, 8, 29568, 152064, 32768),
        _m("mistral-7b", 7.24, 32, 4096, 32, 8, 14336, 32000, 32768),
        _m("mixtral-8x7b", 46.70, 32, 4096, 32, 8, 14336, 32000, 32768, experts=8, top_k=2),
        # latent attention (MLA: one 512 + 64 latent a token) and 256 routed experts, fp8 weights
        ModelSpec("deepseek-v3", 671.0, 61, 7168, 128, 1, 576, 18432, 129280, experts=256, experts_per_token=8,
                  shared_experts=1, moe_intermediate=2048, dense_layers=3, q_lora_rank=1536, kv_lora_rank=512,
                  qk_head_dim=192, v_head_dim=128, weight_dtype="fp8", context=163840),
        # five sliding-window layers (1,024 tokens) to one full-attention layer
        ModelSpec("gemma-3-27b", 27.4, 62, 5376, 32, 16, 128, 21504, 262208, window=1024, window_layers=52,
                  context=131072),
    )
}


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset by name, else a Hugging Face config file or directory."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    p = Path(name_or_path)
    if p.suffix == ".json" or p.is_dir() or p.exists():
        return model_from_hf_config(p)
    raise ConfigError(f"--model {name_or_path!r}: not a preset ({', '.join(MODELS)}) nor a config.json")

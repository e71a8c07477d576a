"""Served models for ``--model``: shipped presets by name, or a Hugging Face ``config.json``.

From a config the geometry is read as given (``num_hidden_layers``, ``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``torch_dtype``) and the
parameter count is estimated for a dense decoder: per layer the attention projections
(q, k, v, o), a gated MLP (3 x hidden x intermediate) and two norms, plus the embeddings (and
the output head unless tied). Mixture-of-experts and latent-attention (MLA) configs are
refused: the roofline and the cache layout here model neither.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..validate import check_int
from .scenario import ModelSpec

__all__ = ["MODELS", "resolve_model", "model_from_hf_config", "params_from_hf_config"]

#: Presets: published architecture figures of common dense models.
MODELS: dict[str, ModelSpec] = {
    m.name: m for m in (
        ModelSpec("llama-3-8b", 8.03, 32, 4096, 8, 128),
        ModelSpec("llama-3-70b", 70.55, 80, 8192, 8, 128),
        ModelSpec("llama-3.1-405b", 405.85, 126, 16384, 8, 128),
        ModelSpec("qwen2.5-7b", 7.62, 28, 3584, 4, 128),
        ModelSpec("qwen2.5-72b", 72.71, 80, 8192, 8, 128),
        ModelSpec("mistral-7b", 7.24, 32, 4096, 8, 128),
    )
}

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16"}


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    return check_int(cfg.get(key, default), f"{where}: {key}", minimum=1, error=ConfigError)


def params_from_hf_config(cfg: dict[str, Any], where: str = "<config>") -> float:
    """Estimated parameters (billions) of the dense decoder ``cfg`` describes."""
    h, layers = _int(cfg, "hidden_size", where), _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv = _int(cfg, "num_key_value_heads", where, heads)
    hd = _int(cfg, "head_dim", where, h // heads) if cfg.get("head_dim") is not None else h // heads
    inter = _int(cfg, "intermediate_size", where, 4 * h)
    vocab = _int(cfg, "vocab_size", where, 32000)
    attn = 2 * h * heads * hd + 2 * h * kv * hd
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return (layers * per_layer + embed + h) / 1e9


def model_from_hf_config(path: str | os.PathLike[str]) -> ModelSpec:
    """The model a Hugging Face ``config.json`` describes (a directory holding one works too)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: model config not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not a JSON model config ({e})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the model config ({e.strerror or e})") from None
    where = str(p)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: a model config is a JSON object")
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "kv_lora_rank"):
        if cfg.get(key):
            raise ConfigError(f"{where}: {key} = {cfg[key]!r}: mixture-of-experts and latent-attention "
                              "models are not modelled (dense decoders only)")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise ConfigError(f"{where}: torch_dtype {dtype!r}: the KV cache must be bfloat16 or float16")
    heads = _int(cfg, "num_attention_heads", where)
    h = _int(cfg, "hidden_size", where)
    hd = _int(cfg, "head_dim", where) if cfg.get("head_dim") is not None else h // heads
    name = str(cfg.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem) or "model")
    return ModelSpec(name=name.rsplit("/", 1)[-1], params_b=round(params_from_hf_config(cfg, where), 3),
                     num_layers=_int(cfg, "num_hidden_layers", where), hidden=h,
                     kv_heads=_int(cfg, "num_key_value_heads", where, heads), head_dim=hd, dtype=_DTYPES[dtype])


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset by name, else a Hugging Face config file or directory."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    p = Path(name_or_path)
    if p.suffix == ".json" or p.is_dir() or p.exists():
        return model_from_hf_config(p)
    raise ConfigError(f"--model {name_or_path!r}: not a preset ({', '.join(MODELS)}) nor a config.json")

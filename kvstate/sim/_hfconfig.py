"""A model from a Hugging Face ``config.json``: dense decoders and mixture-of-experts families.

Read as given: layers, hidden size, query and KV heads, head dim, the MLP width, the
vocabulary, the dtype. Mixture-of-experts fields by family:

- Mixtral (``num_local_experts``, ``num_experts_per_tok``, experts as wide as
  ``intermediate_size``);
- Qwen-MoE (``num_experts``, ``moe_intermediate_size``, one shared expert of
  ``shared_expert_intermediate_size``, ``mlp_only_layers`` dense);
- DeepSeek V2/V3 (``n_routed_experts``, ``n_shared_experts``, ``moe_intermediate_size``, the
  first ``first_k_dense_replace`` layers dense; latent attention, MLA: one latent "head" of
  ``kv_lora_rank + qk_rope_head_dim`` a token, replicated on every TP rank, and the low-rank
  query and key-value projections);
- Jamba (``expert_layer_period``: every period-th layer routed);
- Llama 4 (a ``text_config``; ``num_local_experts`` with one shared expert, every
  ``interleave_moe_layer_step``-th layer routed, dense layers ``intermediate_size_mlp`` wide).

Sliding-window and recurrent-state layers come from :mod:`~kvstate.sim._hfgroups`.

Quantized weights (``quantization_config``, :func:`weight_dtype_of`): ``fp8`` (block or per
tensor), ``compressed-tensors`` (its weights' bits and type, and whether activations are
quantized: fp8 W8A8, int8 W8A8, int8 or int4 weight-only), ``awq`` and ``gptq`` (weight-only,
``bits`` 4 or 8, their Marlin kernels too). A method or a scheme the model does not know is
refused by name, never read as bf16. The weights' bytes are the parameters at the stored width
(group scales, under 1 %, left out). The parameter count (the
weights' memory) is summed from the same matrices the compute model times
(:meth:`~kvstate.sim._scenario.ModelSpec.attention_matrices`, ``mlp_matrices``: every expert), two
norms a layer, the embeddings and the LM head unless tied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .._validate import check_int
from ._hfgroups import layer_kinds
from ._scenario import ModelSpec

__all__ = ["model_from_hf_config", "params_from_hf_config", "weight_dtype_of", "QUANT_METHODS"]

#: the ``quant_method`` values read (anything else is refused by name)
QUANT_METHODS = ("fp8", "compressed-tensors", "awq", "awq_marlin", "gptq", "gptq_marlin")

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "bfloat16"}


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1) -> int:
    return check_int(cfg.get(key, default), f"{where}: {key}", minimum=minimum, error=ConfigError)


def _moe(cfg: dict[str, Any], where: str, layers: int, inter: int) -> dict[str, int]:
    """The mixture-of-experts fields of ``cfg`` (all zero for a dense model)."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return {"experts": 0, "experts_per_token": 0, "shared_experts": 0, "moe_intermediate": 0, "dense_layers": 0}
    experts = _int(cfg, "num_local_experts" if cfg.get("num_local_experts") else
                   "num_experts" if cfg.get("num_experts") else "n_routed_experts", where)
    top_k = _int(cfg, "num_experts_per_tok", where, 2)
    width = _int(cfg, "moe_intermediate_size", where, inter)
    shared, dense = int(cfg.get("n_shared_experts") or 0), 0
    if cfg.get("shared_expert_intermediate_size"):  # Qwen-MoE: one shared expert of its own width
        shared = max(1, round(int(cfg["shared_expert_intermediate_size"]) / width))
        dense = len(cfg.get("mlp_only_layers") or ())
    if cfg.get("first_k_dense_replace"):  # DeepSeek
        dense = _int(cfg, "first_k_dense_replace", where, 0, minimum=0)
    if cfg.get("expert_layer_period"):  # Jamba: every period-th layer routed
        dense = layers - layers // _int(cfg, "expert_layer_period", where)
    if cfg.get("interleave_moe_layer_step"):  # Llama 4: every k-th layer routed, one shared expert
        step = _int(cfg, "interleave_moe_layer_step", where)
        dense, shared = layers - layers // step, max(shared, 1)
    return {"experts": experts, "experts_per_token": top_k, "shared_experts": shared, "moe_intermediate": width,
            "dense_layers": dense}


def _attention(cfg: dict[str, Any], where: str, h: int) -> dict[str, int]:
    """Heads and the cache's head: MLA keeps one latent head a token (``kv_lora_rank`` + its
    rotary part), and its projections' ranks and head widths."""
    heads = _int(cfg, "num_attention_heads", where)
    if cfg.get("kv_lora_rank"):
        rope = _int(cfg, "qk_rope_head_dim", where, 64)
        lat = _int(cfg, "kv_lora_rank", where)
        return {"num_heads": heads, "total_kv_heads": 1, "head_dim": lat + rope, "kv_lora_rank": lat,
                "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
                "qk_head_dim": _int(cfg, "qk_nope_head_dim", where, 128) + rope,
                "v_head_dim": _int(cfg, "v_head_dim", where, 128)}
    kv = _int(cfg, "num_key_value_heads", where, heads)
    hd = _int(cfg, "head_dim", where) if cfg.get("head_dim") is not None else h // heads
    return {"num_heads": heads, "total_kv_heads": kv, "head_dim": hd}


def _shapes(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelSpec shape fields of a decoder config (its text part)."""
    h, layers = _int(cfg, "hidden_size", where), _int(cfg, "num_hidden_layers", where)
    inter = _int(cfg, "intermediate_size_mlp", where) if cfg.get("intermediate_size_mlp") else \
        _int(cfg, "intermediate_size", where, 4 * h)
    # Llama 4's experts are intermediate_size wide, its dense layers intermediate_size_mlp
    expert_width = _int(cfg, "intermediate_size", where, inter) if cfg.get("intermediate_size_mlp") else inter
    return {"num_layers": layers, "hidden": h, **_attention(cfg, where, h), "intermediate": inter,
            "vocab": _int(cfg, "vocab_size", where, 32000), **_moe(cfg, where, layers, expert_width),
            **layer_kinds(cfg, where, layers, h, itemsize=2)}  # the cache is bf16 or fp16 (_DTYPES)


def _params(m: ModelSpec, tied: bool) -> float:
    """Parameters (billions) of a model with ``m``'s shapes: every expert counted."""
    attn = sum(k * n for _, k, n in m.attention_matrices(1)) + 2 * m.hidden  # and the two norms
    mlp = m.mlp_matrices(1)
    dense = sum(k * n for name, (k, n) in mlp.items() if name in ("gate_up", "down"))
    routed = m.num_layers - m.dense_layers if m.experts else 0
    per_routed = sum(k * n * (m.experts if name.startswith("expert_") else 1)
                     for name, (k, n) in mlp.items() if name not in ("gate_up", "down"))
    embed = m.vocab * m.hidden * (1 if tied else 2)
    return (m.num_layers * attn + (m.num_layers - routed) * dense + routed * per_routed + embed + m.hidden) / 1e9


def weight_dtype_of(quant: Any, where: str, unquantized: str) -> str:
    """The ``ModelSpec.weight_dtype`` a ``quantization_config`` serves its weights as
    (``unquantized`` without one); see the module's docstring."""
    if quant is None:
        return unquantized
    if not isinstance(quant, dict):
        raise ConfigError(f"{where}: quantization_config must be a JSON object")
    method = quant.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"{where}: quantization_config quant_method {method!r} is not modeled (known: "
                          f"{', '.join(QUANT_METHODS)}): its weights' bytes and kernels are unknown, so it is not "
                          "read as bf16")
    if method == "fp8":
        return "fp8"
    if method != "compressed-tensors":  # AWQ and GPTQ: weight-only
        bits = quant.get("bits", quant.get("w_bit"))
        if bits not in (4, 8):
            raise ConfigError(f"{where}: {method} with bits {bits!r}: only 4 and 8 are modeled")
        return f"int{bits}_weight_only"
    return _compressed_tensors(quant, where)


def _compressed_tensors(quant: dict[str, Any], where: str) -> str:
    """The weight dtype of a ``compressed-tensors`` config: every config group's scheme must be
    the same (weights' bits and type; activations quantized or not)."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}: compressed-tensors needs config_groups")
    kinds = set()
    for name, g in groups.items():
        w, a = (g or {}).get("weights") or {}, (g or {}).get("input_activations")
        bits, typ = w.get("num_bits"), w.get("type")
        if typ == "float" and bits == 8:
            kind = "fp8" if a else "int8_weight_only"  # fp8 weights alone run as a W8A16 kernel
        elif typ == "int" and bits == 8:
            kind = "int8" if a else "int8_weight_only"
        elif typ == "int" and bits == 4 and not a:
            kind = "int4_weight_only"
        else:
            raise ConfigError(f"{where}: compressed-tensors group {name!r}: weights of {bits!r} bits, type {typ!r}"
                              f"{', activations quantized' if a else ''} are not modeled (known: fp8 and int8 "
                              "W8A8, int8 and int4 weight-only)")
        kinds.add(kind)
    if len(kinds) > 1:
        raise ConfigError(f"{where}: compressed-tensors groups of different schemes ({sorted(kinds)}) are not modeled")
    return kinds.pop()


def params_from_hf_config(cfg: dict[str, Any], where: str = "<config>") -> float:
    """Estimated parameters (billions) of the decoder ``cfg`` describes, every expert counted."""
    text = cfg.get("text_config", cfg)
    return _params(ModelSpec(**_shapes(text, where)), bool(text.get("tie_word_embeddings", False)))


def model_from_hf_config(path: str | os.PathLike[str]) -> ModelSpec:
    """The model a Hugging Face ``config.json`` describes (a directory holding one works too)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        outer = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: model config not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not a JSON model config ({e})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the model config ({e.strerror or e})") from None
    where = str(p)
    if not isinstance(outer, dict):
        raise ConfigError(f"{where}: a model config is a JSON object")
    cfg = outer.get("text_config", outer)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: text_config must be a JSON object")
    dtype = cfg.get("torch_dtype") or outer.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise ConfigError(f"{where}: torch_dtype {dtype!r}: the KV cache must be bfloat16 or float16")
    weights = weight_dtype_of(outer.get("quantization_config"), where, _DTYPES[dtype])
    name = str(outer.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem) or "model")
    shapes = _shapes(cfg, where)
    params = _params(ModelSpec(**shapes), bool(cfg.get("tie_word_embeddings", False)))
    context = _int(cfg, "max_position_embeddings", where, 0, minimum=0)
    return ModelSpec(name=name.rsplit("/", 1)[-1], params_b=round(params, 3), **shapes,
                     weight_dtype=weights, dtype=_DTYPES[dtype], context=context)

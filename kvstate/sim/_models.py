"""The served model: shipped presets by name, or a Hugging Face ``config.json`` read as served.

:func:`resolve_model` takes a preset's name (:data:`MODELS`, published architecture figures) or a
config file or directory. A config is read as given: layers, hidden size, query and KV heads,
head dim, the MLP width, the vocabulary, the dtype. Mixture-of-experts fields by family:

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

Quantized weights (``quantization_config``, :func:`weight_dtype_of`): ``fp8`` (block or per
tensor), ``compressed-tensors`` (its weights' bits and type, and whether activations are
quantized: fp8 W8A8, int8 W8A8, int8 or int4 weight-only), ``awq`` and ``gptq`` (weight-only,
``bits`` 4 or 8, their Marlin kernels too). A method or a scheme the model does not know is
refused by name, never read as bf16. The weights' bytes are the parameters at the stored width
(group scales, under 1 %, left out). The parameter count (the weights' memory) is summed from
the same matrices the compute model times
(:meth:`~kvstate.sim._scenario.ModelSpec.attention_matrices`, ``mlp_matrices``: every expert), two
norms a layer, the embeddings and the LM head unless tied.

Which layers slide over a window and which keep a recurrent state (:func:`layer_kinds`), read in
this order:

- ``layer_types`` (one entry a layer): ``full_attention``; ``sliding_attention`` (a window of
  ``sliding_window`` tokens: Gemma 2/3, gpt-oss, recent Mistral and Qwen configs);
  ``linear_attention`` (Qwen3-Next's gated delta rule: a state of ``linear_num_value_heads ×
  linear_key_head_dim × linear_value_head_dim`` values and a convolution window of
  ``linear_conv_kernel_dim − 1`` inputs); ``mamba`` (as Jamba's below);
- without it, by family: Gemma 2 alternates window and full layers (even layers slide);
  Gemma 3 makes every ``sliding_window_pattern``-th layer full; Jamba's attention layers are
  those with ``i % attn_layer_period == attn_layer_offset``, the rest Mamba layers with a state
  of ``d_inner × mamba_d_state`` and a convolution of ``(mamba_d_conv − 1) × d_inner`` values
  (``d_inner = mamba_expand × hidden_size``); any other config with a ``sliding_window`` and
  ``use_sliding_window`` not false slides on every layer (Qwen 2's ``max_window_layers`` keeps
  the first layers full).
- A hybrid layout this module does not read (``hybrid_override_pattern``, ``layers_block_type``,
  ``attn_layer_indices``...) is refused, never read as a plain decoder.

States are counted in the cache's dtype (``itemsize`` bytes a value), as vLLM keeps them by default.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .._validate import check_int
from ._scenario import ModelSpec

__all__ = ["MODELS", "resolve_model", "model_from_hf_config", "params_from_hf_config", "weight_dtype_of",
           "layer_kinds", "QUANT_METHODS", "UNREAD_HYBRID_KEYS"]


#: the ``quant_method`` values read (anything else is refused by name)
QUANT_METHODS = ("fp8", "compressed-tensors", "awq", "awq_marlin", "gptq", "gptq_marlin")

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "bfloat16"}


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1) -> int:
    return check_int(cfg.get(key, default), f"{where}: {key}", minimum=minimum, error=ConfigError)


#: keys of hybrid layouts that are not read here: a config holding one is refused
UNREAD_HYBRID_KEYS = ("hybrid_override_pattern", "layers_block_type", "attn_layer_indices", "mamba_d_ssm",
                      "ssm_cfg", "block_types")
_KINDS = {"full_attention": "full", "attention": "full", "sliding_attention": "window", "linear_attention": "state",
          "mamba": "state"}
NONE = {"window": 0, "window_layers": 0, "state_layers": 0, "state_bytes": 0}


def _linear_state(cfg: dict[str, Any], where: str) -> int:
    """Values of one gated-delta-rule layer's state and convolution window (Qwen3-Next)."""
    kh, kd = _int(cfg, "linear_num_key_heads", where), _int(cfg, "linear_key_head_dim", where)
    vh, vd = _int(cfg, "linear_num_value_heads", where), _int(cfg, "linear_value_head_dim", where)
    conv = _int(cfg, "linear_conv_kernel_dim", where, 4) - 1
    return vh * kd * vd + conv * (2 * kh * kd + vh * vd)


def _mamba_state(cfg: dict[str, Any], where: str, hidden: int) -> int:
    """Values of one Mamba layer's state and convolution window (Jamba's fields)."""
    inner = _int(cfg, "mamba_expand", where, 2) * hidden
    return inner * _int(cfg, "mamba_d_state", where, 16) + (_int(cfg, "mamba_d_conv", where, 4) - 1) * inner


def _types_by_family(cfg: dict[str, Any], where: str, layers: int) -> list[str]:
    """Each layer's kind from a family's own fields (no ``layer_types``)."""
    family = str(cfg.get("model_type", ""))
    if family == "jamba":
        period, offset = _int(cfg, "attn_layer_period", where, 8), cfg.get("attn_layer_offset", 4)
        return ["full" if i % period == offset else "state" for i in range(layers)]
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return ["full"] * layers
    if family == "gemma2":
        return ["window" if i % 2 == 0 else "full" for i in range(layers)]
    if family in ("gemma3", "gemma3_text"):
        pattern = _int(cfg, "sliding_window_pattern", where, 6)
        return ["full" if (i + 1) % pattern == 0 else "window" for i in range(layers)]
    first = cfg.get("max_window_layers", 0) if cfg.get("use_sliding_window") else 0
    first = min(layers, first) if isinstance(first, int) and first > 0 else 0
    return ["full"] * first + ["window"] * (layers - first)


def _types(cfg: dict[str, Any], where: str, layers: int) -> list[str]:
    unread = [k for k in UNREAD_HYBRID_KEYS if cfg.get(k)]
    if unread:
        raise ConfigError(f"{where}: {unread[0]}: this hybrid layer layout is not read; set [model] window_layers, "
                          "state_layers and state_bytes by hand")
    given = cfg.get("layer_types")
    if given is None:
        return _types_by_family(cfg, where, layers)
    if not isinstance(given, list) or len(given) != layers:
        raise ConfigError(f"{where}: layer_types must list one type for each of the {layers} layers")
    bad = [t for t in given if t not in _KINDS]
    if bad:
        raise ConfigError(f"{where}: layer_types: {bad[0]!r} is not a layer type kvstate reads ({sorted(_KINDS)})")
    return [_KINDS[t] for t in given]


def layer_kinds(cfg: dict[str, Any], where: str, layers: int, hidden: int, itemsize: int) -> dict[str, int]:
    """``window``, ``window_layers``, ``state_layers`` and ``state_bytes`` (one layer's state of
    one request, the whole model's) of a decoder config (zeros for a plain one)."""
    kinds = _types(cfg, where, layers)
    out = dict(NONE)
    if "window" in kinds:
        out["window"] = _int(cfg, "sliding_window", where)
        out["window_layers"] = kinds.count("window")
    if "state" in kinds:
        values = _linear_state(cfg, where) if cfg.get("linear_num_value_heads") else _mamba_state(cfg, where, hidden)
        out["state_layers"], out["state_bytes"] = kinds.count("state"), values * itemsize
    return out


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

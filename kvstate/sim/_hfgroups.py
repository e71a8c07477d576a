"""Which layers of a Hugging Face ``config.json`` attend over a sliding window, and which keep a
recurrent state instead of a KV cache.

Read, in this order:

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

from typing import Any

from .._errors import ConfigError
from .._validate import check_int

__all__ = ["layer_kinds", "UNREAD_HYBRID_KEYS"]

#: keys of hybrid layouts that are not read here: a config holding one is refused
UNREAD_HYBRID_KEYS = ("hybrid_override_pattern", "layers_block_type", "attn_layer_indices", "mamba_d_ssm",
                      "ssm_cfg", "block_types")
_KINDS = {"full_attention": "full", "attention": "full", "sliding_attention": "window", "linear_attention": "state",
          "mamba": "state"}
NONE = {"window": 0, "window_layers": 0, "state_layers": 0, "state_bytes": 0}


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    return check_int(cfg.get(key, default), f"{where}: {key}", minimum=1, error=ConfigError)


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

"""The numpy reference implementation of the transfer ops (CPU, exact for every shape).

Arrays are numpy arrays or any CPU tensor exporting DLPack (Paddle, PyTorch CPU, ...),
which are viewed zero-copy through ``np.from_dlpack``. A tensor on another device is
rejected before anything moves. Copies follow the plan's coalesced runs: one slice copy
per run of consecutive ids instead of one per block.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from .._dtypes import as_16bit_ints
from .._errors import ValidationError
from ._plan import TransferPlan, plan_all_layers, plan_layout, plan_per_layer

__all__ = ["as_numpy", "swap_cache_layout", "swap_cache_per_layer", "swap_cache_all_layers"]

_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory is CPU-addressable)


def as_numpy(x: Any, name: str = "array") -> np.ndarray:
    """A zero-copy numpy view of a numpy array or a CPU DLPack tensor."""
    if not isinstance(name, str) or not name:
        raise ValidationError(f"as_numpy: name must be a non-empty str (the array's, for errors), got {name!r}")
    if isinstance(x, np.ndarray):
        return x
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        raise ValidationError(f"{name} must be a numpy array or a DLPack tensor, got {type(x).__name__}")
    if int(dev()[0]) not in _DLPACK_CPU:
        raise ValidationError(f"{name} lives on device {dev()}, the numpy ops need CPU memory: "
                              "use the CUDA implementation for GPU tensors")
    try:
        return np.from_dlpack(as_16bit_ints(x))
    except (BufferError, TypeError, RuntimeError) as e:
        raise ValidationError(f"{name} cannot be viewed through DLPack: {e}") from None


def _np_list(arrays: Sequence[Any], name: str) -> list[np.ndarray]:
    if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Sequence):
        raise ValidationError(f"{name} must be a list of per-layer arrays")
    return [as_numpy(a, f"{name}[{i}]") for i, a in enumerate(arrays)]


def _run_copies(plan: TransferPlan, gpu: list[np.ndarray], host: list[np.ndarray] | np.ndarray) -> None:
    layout = plan.op == "swap_cache_layout"
    d2h = plan.direction == "d2h"
    for g0, h0, n in plan.runs:
        gs, hs = slice(g0, g0 + n), slice(h0, h0 + n)
        for layer, cache in enumerate(gpu):
            # the layout op's host is one [M, L, ...] array; the others' a list of [M, ...] layers
            dst = cast(np.ndarray, host)[hs, layer] if layout else cast(list, host)[layer][hs]
            if d2h:
                dst[...] = cache[gs]
            else:
                cache[gs] = dst


def swap_cache_layout(caches: Sequence[Any], host: Any, gpu_block_ids: Any, host_block_ids: Any,
                      direction: str) -> TransferPlan:
    """Layer-major caches ``[N,H,B,D]`` per layer ⇄ block-major host ``[M,L,H,B,D]``."""
    gpu = _np_list(caches, "caches")
    h = as_numpy(host, "host")
    plan = plan_layout(gpu, h, gpu_block_ids, host_block_ids, direction)
    _run_copies(plan, gpu, h)
    return plan


def swap_cache_per_layer(cache: Any, host_layer: Any, gpu_block_ids: Any, host_block_ids: Any,
                         direction: str) -> TransferPlan:
    """One layer: ``[N,H,B,D]`` ⇄ ``[M,H,B,D]``."""
    g = as_numpy(cache, "cache")
    h = as_numpy(host_layer, "host_layer")
    plan = plan_per_layer(g, h, gpu_block_ids, host_block_ids, direction)
    _run_copies(plan, [g], [h])
    return plan


def swap_cache_all_layers(caches: Sequence[Any], host_layers: Sequence[Any], gpu_block_ids: Any,
                          host_block_ids: Any, direction: str) -> TransferPlan:
    """Every layer, the same layout on both sides: ``[N,H,B,D]`` ⇄ ``[M,H,B,D]`` per layer."""
    gpu = _np_list(caches, "caches")
    host = _np_list(host_layers, "host_layers")
    plan = plan_all_layers(gpu, host, gpu_block_ids, host_block_ids, direction)
    _run_copies(plan, gpu, host)
    return plan

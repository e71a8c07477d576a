"""The transfer ops, dispatched by where the caches live.

Numpy arrays and CPU tensors run the numpy reference; GPU tensors (CuPy, PyTorch, Paddle)
run the CUDA implementation. A call on GPU tensors without ``swapper=`` makes a
:class:`~kvstate.kernels._cuda.CudaSwapper` for that call alone and closes it after; an
engine keeps one swapper and passes it (or calls its methods), so buffers and compiled
kernels are reused.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import ValidationError
from . import _reference as reference
from ._plan import TransferPlan

__all__ = ["swap_cache_layout", "swap_cache_per_layer", "swap_cache_all_layers"]

_DL_CUDA = 2


def _gpu_device(x: Any) -> int | None:
    """The CUDA device of the first layer, or None for host memory / anything else."""
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and len(x):
        x = x[0]
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return None
    try:
        kind, idx = dev()
    except Exception:  # noqa: BLE001 - let the op's validation report it
        return None
    return int(idx) if int(kind) == _DL_CUDA else None


def _dispatch(op: str, gpu_side: Any, args: tuple, swapper: Any) -> TransferPlan:
    """Run ``op`` on ``swapper``, on a transient swapper for GPU tensors, or in numpy."""
    if swapper is not None and not callable(getattr(swapper, op, None)):
        raise ValidationError(f"{op}: swapper must be a CudaSwapper (kvstate.kernels._cuda), got {swapper!r}")
    if swapper is not None:
        return getattr(swapper, op)(*args)
    dev = _gpu_device(gpu_side)
    if dev is None:
        return getattr(reference, op)(*args)
    from ._cuda import CudaSwapper

    with CudaSwapper(dev) as sw:
        return getattr(sw, op)(*args)


def swap_cache_layout(caches: Sequence[Any], host: Any, gpu_block_ids: Any, host_block_ids: Any,
                      direction: str, *, swapper: Any = None) -> TransferPlan:
    """Layer-major caches ``[N,H,B,D]`` per layer ⇄ block-major host ``[M,L,H,B,D]``."""
    return _dispatch("swap_cache_layout", caches, (caches, host, gpu_block_ids, host_block_ids, direction),
                     swapper)


def swap_cache_per_layer(cache: Any, host_layer: Any, gpu_block_ids: Any, host_block_ids: Any,
                         direction: str, *, swapper: Any = None) -> TransferPlan:
    """One layer: ``[N,H,B,D]`` ⇄ ``[M,H,B,D]``."""
    return _dispatch("swap_cache_per_layer", cache, (cache, host_layer, gpu_block_ids, host_block_ids, direction),
                     swapper)


def swap_cache_all_layers(caches: Sequence[Any], host_layers: Sequence[Any], gpu_block_ids: Any,
                          host_block_ids: Any, direction: str, *, swapper: Any = None) -> TransferPlan:
    """Every layer, the same layout on both sides: ``[N,H,B,D]`` ⇄ ``[M,H,B,D]`` per layer."""
    return _dispatch("swap_cache_all_layers", caches,
                     (caches, host_layers, gpu_block_ids, host_block_ids, direction), swapper)

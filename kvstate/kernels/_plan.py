"""The transfer ops' shared semantics: validation, layout math and coalesced copy runs.

Every implementation (numpy in :mod:`~kvstate.kernels._reference`, CUDA in
:mod:`~kvstate.kernels._cuda`) validates through
:func:`plan_layout`, :func:`plan_per_layer` or :func:`plan_all_layers` *before* a byte
moves, so bad arguments fail with the same :class:`~kvstate._errors.ValidationError`
everywhere. The resulting :class:`TransferPlan` is also what a cost model reads: bytes
over the link, copy runs, chunks.

Layouts (``N`` GPU blocks, ``M`` host blocks, ``L`` layers, chunk ``[H, B, D]``):

- ``swap_cache_layout``: GPU caches, one array per layer ``[N, H, B, D]`` ⇄ a block-major
  host buffer ``[M, L, H, B, D]``; ``"d2h"`` gathers into host, ``"h2d"`` scatters back.
- ``swap_cache_per_layer``: one layer, ``[N, H, B, D]`` ⇄ ``[M, H, B, D]``.
- ``swap_cache_all_layers``: ``L`` layers, each ``[N, H, B, D]`` ⇄ ``[M, H, B, D]``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from .._dtypes import dtype_name
from .._errors import ValidationError
from ._ids import check_ids, check_pair

__all__ = ["DIRECTIONS", "TransferPlan", "LayerSet", "LayoutShape", "coalesce_runs", "layout_shape", "plan_layout",
           "plan_layout_ids", "plan_per_layer", "plan_all_layers"]

DIRECTIONS = ("d2h", "h2d")


class TransferPlan:
    """A validated transfer: what moves, in which runs, how many bytes. Treated as immutable
    (a plain class: a frozen dataclass costs a microsecond more per call on the hot path)."""

    def __init__(self, op: str, direction: str, layers: int, chunk_bytes: int, gpu_ids: np.ndarray | None,
                 host_ids: np.ndarray | None, host_block_contiguous: bool, packed: bytes | None = None) -> None:
        self.op, self.direction, self.layers, self.chunk_bytes = op, direction, layers, chunk_bytes
        self.host_block_contiguous = host_block_contiguous  #: one host block holds all layers back to back
        #: the GPU then the host ids as native int64, back to back, where they were packed from
        #: lists (the id arrays are then views of it, made on first use: a launcher copying the
        #: ids elsewhere needs no array)
        self.packed = packed
        if gpu_ids is None or host_ids is None:
            assert packed is not None
            self.blocks = len(packed) // 16  #: blocks moved
        else:
            self.gpu_ids, self.host_ids = gpu_ids, host_ids
            self.blocks = gpu_ids.size

    @cached_property
    def gpu_ids(self) -> np.ndarray:
        """The GPU block ids (int64)."""
        return np.frombuffer(self.packed, np.int64, self.blocks)  # type: ignore[arg-type]

    @cached_property
    def host_ids(self) -> np.ndarray:
        """The host block ids (int64), one per GPU id."""
        return np.frombuffer(self.packed, np.int64, self.blocks, self.blocks * 8)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (f"TransferPlan({self.op}, {self.direction}, {self.blocks} blocks x {self.layers} layers "
                f"x {self.chunk_bytes} B)")

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(gpu_start, host_start, length) runs, consecutive on both sides (computed on first use)."""
        return coalesce_runs(self.gpu_ids, self.host_ids)

    @cached_property
    def host_runs(self) -> tuple[tuple[int, int, int], ...]:
        """(position, host_start, length) runs of consecutive host ids, whatever the GPU ids do."""
        h = self.host_ids
        return tuple((s, int(h[s]), e - s) for s, e in _run_bounds(_breaks(h), int(h.size)))

    @cached_property
    def num_runs(self) -> int:
        """``len(runs)``, counted without building the runs."""
        return 0 if self.gpu_ids.size == 0 else 1 + int(_breaks(self.gpu_ids, self.host_ids).size)

    @cached_property
    def num_host_runs(self) -> int:
        """``len(host_runs)``, counted without building the runs."""
        return 0 if self.host_ids.size == 0 else 1 + int(_breaks(self.host_ids).size)

    @property
    def chunks(self) -> int:
        """(layer, block) chunks moved."""
        return self.blocks * self.layers

    @property
    def bytes(self) -> int:
        """Payload bytes over the link."""
        return self.chunks * self.chunk_bytes


def _breaks(ids: np.ndarray, other: np.ndarray | None = None) -> np.ndarray:
    """Positions where ``ids`` (and ``other``, when given) stop advancing by one."""
    step = np.diff(ids) != 1
    if other is not None:
        step |= np.diff(other) != 1
    return np.flatnonzero(step) + 1


def _run_bounds(breaks: np.ndarray, n: int) -> list[tuple[int, int]]:
    """(start, end) of each run of ``n`` positions cut at ``breaks``."""
    if n == 0:
        return []
    edges = [0, *breaks.tolist(), n]
    return list(zip(edges[:-1], edges[1:]))


def coalesce_runs(gpu_ids: np.ndarray, host_ids: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Group positions where both id lists advance by one into (gpu, host, length) runs."""
    for name, ids in (("gpu_ids", gpu_ids), ("host_ids", host_ids)):
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValidationError(f"coalesce_runs: {name} must be a 1-D integer array, got {ids!r}")
    if gpu_ids.size != host_ids.size:
        raise ValidationError(f"coalesce_runs: {gpu_ids.size} gpu ids but {host_ids.size} host ids")
    return tuple((int(gpu_ids[s]), int(host_ids[s]), e - s)
                 for s, e in _run_bounds(_breaks(gpu_ids, host_ids), int(gpu_ids.size)))


#: The compiled packer of block id lists and checker of int64 ids (``kvstate.kernels._idpack``,
#: built by setup.py where a C compiler is found), or None: numpy then does the same, slower.
@dataclass(frozen=True, eq=False)
class LayerSet:
    """Per-layer cache arrays validated once (same shape, same dtype, contiguous).

    Pass one to the ops instead of a list to skip re-checking every layer on each call; the
    CUDA implementation also keeps the layers' device pointers here.
    """

    arrays: tuple[Any, ...]
    shape: tuple[int, ...]  #: one layer's shape ``[N, H, B, D]``
    dtype: str  #: :func:`dtype_name` of the layers
    itemsize: int

    @classmethod
    def of(cls, arrays: Sequence[Any], name: str = "caches") -> LayerSet:
        shape, dtype = _check_layers(arrays, name)
        return cls(tuple(arrays), shape, dtype_name(dtype), _itemsize(dtype))

    def __len__(self) -> int:
        return len(self.arrays)

    @property
    def row_bytes(self) -> int:
        """Bytes of one block of one layer (a row of ``[N, ...]``)."""
        return self.itemsize * math.prod(self.shape[1:])

    def __getitem__(self, i: int) -> Any:
        return self.arrays[i]

    def __iter__(self):
        return iter(self.arrays)


def _meta(a: Any, name: str) -> tuple[tuple[int, ...], Any, bool]:
    """(shape, dtype, contiguous) of an array-like, without importing any framework."""
    if a.__class__ is np.ndarray:
        return a.shape, a.dtype, a.flags.c_contiguous
    shape = getattr(a, "shape", None)
    dtype = getattr(a, "dtype", None)
    if shape is None or dtype is None:
        raise ValidationError(f"{name} must be an array or tensor, got {type(a).__name__}")
    shape = tuple(int(s) for s in shape)
    if isinstance(a, np.ndarray):
        contiguous = a.flags.c_contiguous
    elif hasattr(a, "is_contiguous"):  # torch, paddle
        contiguous = bool(a.is_contiguous())
    elif hasattr(a, "flags"):  # cupy
        contiguous = bool(a.flags.c_contiguous)
    else:
        contiguous = True
    return shape, dtype, contiguous


def _check_direction(direction: Any) -> None:
    if direction not in DIRECTIONS:
        raise ValidationError(f"direction must be 'd2h' or 'h2d', got {direction!r}")


def _check_layers(caches: Any, name: str) -> tuple[tuple[int, ...], Any]:
    if isinstance(caches, LayerSet):
        return caches.shape, caches.dtype
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence) or not caches:
        raise ValidationError(f"{name} must be a non-empty list of per-layer arrays")
    shape0, dtype0, _ = _meta(caches[0], f"{name}[0]")
    for i, c in enumerate(caches):
        shape, dtype, contiguous = _meta(c, f"{name}[{i}]")
        if len(shape) != 4:
            raise ValidationError(f"{name}[{i}] must be [blocks, heads, block_size, head_dim], got shape {shape}")
        if shape != shape0:
            raise ValidationError(f"{name}[{i}] has shape {shape}, layer 0 has {shape0}: all layers must match")
        if dtype_name(dtype) != dtype_name(dtype0):
            raise ValidationError(f"{name}[{i}] has dtype {dtype_name(dtype)}, layer 0 has "
                                  f"{dtype_name(dtype0)}: all layers must match")
        if not contiguous:
            raise ValidationError(f"{name}[{i}] is not contiguous")
    return shape0, dtype0


def _itemsize(dtype: Any) -> int:
    if dtype.__class__ is not str and isinstance(dtype, np.dtype):
        return dtype.itemsize
    size = getattr(dtype, "itemsize", None)
    if size is None:  # torch / paddle dtypes
        size = np.dtype(dtype_name(dtype)).itemsize
    return int(size)


def _finish(op: str, direction: str, layers: int, chunk: tuple[int, ...], dtype: Any,
            gpu_ids: Any, host_ids: Any, num_gpu: int, num_host: int, host_contig: bool) -> TransferPlan:
    h2d = direction == "h2d"
    if gpu_ids.__class__ is list and host_ids.__class__ is list:
        # an engine's usual call: both lists, packed and checked in one pass
        packed = check_pair(gpu_ids, host_ids, num_gpu, num_host, h2d)
        if packed is not None:
            return TransferPlan(op, direction, layers, _chunk_size(chunk, dtype), None, None, host_contig, packed)
    g = check_ids(gpu_ids, num_gpu, "gpu_block_ids", unique=h2d)
    h = check_ids(host_ids, num_host, "host_block_ids", unique=not h2d)
    if g.size != h.size:
        raise ValidationError(f"gpu_block_ids has {g.size} ids, host_block_ids has {h.size}: lengths must match")
    return TransferPlan(op, direction, layers, _chunk_size(chunk, dtype), g, h, host_contig)


def _chunk_size(chunk: tuple[int, ...], dtype: Any) -> int:
    """Bytes of one (layer, block) chunk, cached by (shape, dtype)."""
    key = (chunk, dtype)
    size = _chunk_bytes.get(key)
    if size is None:
        if len(_chunk_bytes) >= 256:
            _chunk_bytes.clear()
        size = _chunk_bytes[key] = math.prod(chunk) * _itemsize(dtype)
    return size


_chunk_bytes: dict[tuple[tuple[int, ...], Any], int] = {}  # (chunk shape, dtype) -> bytes: a cache


class LayoutShape(NamedTuple):
    """What a ``swap_cache_layout`` call's arrays fix, checked once: a caller that passes the
    same caches and host buffer again may keep it and plan with :func:`plan_layout_ids`."""

    layers: int
    chunk: tuple[int, ...]  #: one (layer, block) chunk's shape ``[H, B, D]``
    dtype: Any
    num_gpu: int  #: blocks of each GPU cache
    num_host: int  #: blocks of the host buffer


def layout_shape(caches: Sequence[Any] | LayerSet, host: Any, direction: str) -> LayoutShape:
    """Validate the direction and arrays of a ``swap_cache_layout`` call (not its ids)."""
    _check_direction(direction)
    shape, dtype = _check_layers(caches, "caches")
    hshape, hdtype, hcontig = _meta(host, "host")
    expect = (len(caches),) + shape[1:]
    if len(hshape) != 5 or hshape[1:] != expect:
        raise ValidationError(f"host must be [host_blocks, {', '.join(map(str, expect))}] for these caches, "
                              f"got shape {hshape}")
    if dtype_name(hdtype) != dtype_name(dtype):
        raise ValidationError(f"host dtype {dtype_name(hdtype)} differs from the caches' {dtype_name(dtype)}")
    if not hcontig:
        raise ValidationError("host is not contiguous")
    return LayoutShape(len(caches), shape[1:], dtype, shape[0], hshape[0])


def plan_layout_ids(shape: LayoutShape, gpu_block_ids: Any, host_block_ids: Any, direction: str) -> TransferPlan:
    """Validate the ids and direction of a ``swap_cache_layout`` call over arrays already
    checked by :func:`layout_shape`, and plan it."""
    _check_direction(direction)  # the shape may have been checked for another direction
    return _finish_layout(shape, gpu_block_ids, host_block_ids, direction)


def plan_layout(caches: Sequence[Any] | LayerSet, host: Any, gpu_block_ids: Any, host_block_ids: Any,
                direction: str) -> TransferPlan:
    """Validate a ``swap_cache_layout`` call and plan it."""
    return _finish_layout(layout_shape(caches, host, direction), gpu_block_ids, host_block_ids, direction)


def _finish_layout(shape: LayoutShape, gpu_block_ids: Any, host_block_ids: Any, direction: str) -> TransferPlan:
    return _finish("swap_cache_layout", direction, shape.layers, shape.chunk, shape.dtype, gpu_block_ids,
                   host_block_ids, shape.num_gpu, shape.num_host, True)


def plan_per_layer(cache: Any, host_layer: Any, gpu_block_ids: Any, host_block_ids: Any,
                   direction: str) -> TransferPlan:
    """Validate a ``swap_cache_per_layer`` call and plan it."""
    return plan_all_layers([cache], [host_layer], gpu_block_ids, host_block_ids, direction,
                           op="swap_cache_per_layer")


def plan_all_layers(caches: Sequence[Any] | LayerSet, host_layers: Sequence[Any], gpu_block_ids: Any,
                    host_block_ids: Any, direction: str, op: str = "swap_cache_all_layers") -> TransferPlan:
    """Validate a ``swap_cache_all_layers`` call and plan it."""
    _check_direction(direction)
    shape, dtype = _check_layers(caches, "caches")
    hshape, hdtype = _check_layers(host_layers, "host_layers")
    if len(host_layers) != len(caches):
        raise ValidationError(f"host_layers has {len(host_layers)} layers, caches has {len(caches)}")
    if hshape[1:] != shape[1:]:
        raise ValidationError(f"host block shape {hshape[1:]} differs from the caches' {shape[1:]}")
    if dtype_name(hdtype) != dtype_name(dtype):
        raise ValidationError(f"host dtype {dtype_name(hdtype)} differs from the caches' {dtype_name(dtype)}")
    return _finish(op, direction, len(caches), shape[1:], dtype, gpu_block_ids, host_block_ids,
                   shape[0], hshape[0], False)

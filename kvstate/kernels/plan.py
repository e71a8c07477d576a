"""The transfer ops' shared semantics: validation, layout math and coalesced copy runs.

Every implementation (numpy in :mod:`~kvstate.kernels.reference`, CUDA in
:mod:`~kvstate.kernels.cuda`) validates through
:func:`plan_layout`, :func:`plan_per_layer` or :func:`plan_all_layers` *before* a byte
moves, so bad arguments fail with the same :class:`~kvstate.errors.ValidationError`
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
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..dtypes import dtype_name
from ..errors import BlockError, ValidationError

__all__ = ["DIRECTIONS", "TransferPlan", "LayerSet", "coalesce_runs", "check_ids", "as_ids", "id_packer",
           "id_checker", "identity_key", "plan_layout", "plan_per_layer", "plan_all_layers"]

DIRECTIONS = ("d2h", "h2d")


class TransferPlan:
    """A validated transfer: what moves, in which runs, how many bytes. Treated as immutable
    (a plain class: a frozen dataclass costs a microsecond more per call on the hot path)."""

    def __init__(self, op: str, direction: str, layers: int, chunk_bytes: int, gpu_ids: np.ndarray,
                 host_ids: np.ndarray, host_block_contiguous: bool) -> None:
        self.op, self.direction, self.layers, self.chunk_bytes = op, direction, layers, chunk_bytes
        self.gpu_ids, self.host_ids = gpu_ids, host_ids
        self.host_block_contiguous = host_block_contiguous  #: one host block holds all layers back to back
        self.blocks = gpu_ids.size  #: blocks moved

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
    return tuple((int(gpu_ids[s]), int(host_ids[s]), e - s)
                 for s, e in _run_bounds(_breaks(gpu_ids, host_ids), int(gpu_ids.size)))


#: The compiled packer of block id lists and checker of int64 ids (``kvstate.kernels.idpack``,
#: built by setup.py where a C compiler is found), or None: numpy then does the same, slower.
def _compiled() -> Any:
    try:
        from . import idpack
    except ImportError:  # pragma: no cover - where no C compiler was found at install
        return None
    return idpack


_c = _compiled()
id_packer: Callable[[Sequence[Any]], bytes] | None = _c and _c.pack
id_checker: Callable[[np.ndarray, int, bool], bool | None] | None = _c and _c.valid
_identity: Callable[[Sequence[Any]], bytes] | None = _c and _c.identity
_pack_valid: Callable[[Sequence[Any], int, bool], bytes | None] | None = _c and _c.pack_valid
_pack_pair: Callable[..., bytes | None] | None = _c and _c.pack_pair


def identity_key(objects: list | tuple) -> Any:
    """A hashable key naming exactly these objects (by identity, in order), holding no
    reference to them: valid while they all live."""
    if _identity is not None:
        return _identity(objects)
    return tuple(map(id, objects))

_EMPTY = np.empty(0, np.int64)
_DL_HOST = (1, 3)  # kDLCPU, kDLCUDAHost
_MAX = np.maximum.reduce  # ndarray.max without its Python-level wrapper
_MIN = np.minimum.reduce


def _not_ints(ids: Sequence[Any], name: str) -> BlockError:
    """The error for a list that does not pack as int64: it names the first offending id."""
    for b in ids:
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool):
            return BlockError(f"{name}: block id {b!r} is not an int")
    return BlockError(f"{name}: a block id is out of the int64 range")


def _list_ids(ids: list | tuple, name: str) -> np.ndarray:
    """Python ints (or numpy integers) packed at C speed (the compiled packer when it was built,
    else ``array('q')``); floats, strings, None and bools are refused."""
    if not ids:
        return _EMPTY
    if id_packer is not None:
        try:
            return np.frombuffer(id_packer(ids), np.int64)
        except (TypeError, OverflowError):
            raise _not_ints(ids, name) from None
    return _list_ids_python(ids, name)


def _list_ids_python(ids: list | tuple, name: str) -> np.ndarray:
    """The pure-Python packing: ``array('q')`` refuses floats, strings and None itself; bools,
    which it packs as 0 and 1, are looked for among those values alone."""
    try:
        arr = np.frombuffer(array("q", ids), np.int64)
    except (TypeError, OverflowError):
        raise _not_ints(ids, name) from None
    if int(_MIN(arr)) <= 1:  # only a 0 or a 1 can be a bool: look at those alone
        for i in np.flatnonzero(arr <= 1).tolist():
            if ids[i].__class__ is bool:
                raise _not_ints(ids, name)
    return arr


def _tensor_ids(ids: Any, name: str) -> np.ndarray:
    """A tensor's ids on the host: CPU tensors (PyTorch, Paddle, numpy-like) zero-copy through
    DLPack, GPU ones copied over (CuPy ``get()``, PyTorch/Paddle ``cpu()``)."""
    device = getattr(ids, "__dlpack_device__", None)
    if device is None:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValidationError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
        return _list_ids(list(ids), name)  # range, array.array, other sequences
    try:
        if int(device()[0]) in _DL_HOST:
            return np.from_dlpack(ids)
        if hasattr(ids, "get"):  # CuPy
            return ids.get()
        return np.from_dlpack(ids.cpu())
    except Exception as e:  # noqa: BLE001 - each framework fails its own way
        raise ValidationError(f"{name} cannot be read as block ids ({type(e).__name__}: {e})") from None


def as_ids(ids: Any, name: str = "block ids") -> np.ndarray:
    """Block ids as a one-dimensional int64 numpy array (an int64 array is returned as is).

    Accepted: Python lists and tuples of ints, numpy arrays of any integer dtype, and integer
    tensors (PyTorch, Paddle, CuPy; on the CPU or a GPU). Floats, bools and anything else are
    refused with a :class:`BlockError` naming what was wrong; nothing is checked per element
    in Python."""
    if ids.__class__ is np.ndarray:
        arr = ids
    elif ids.__class__ is list or ids.__class__ is tuple:
        return _list_ids(ids, name)
    else:
        arr = _tensor_ids(ids, name)
    if arr.ndim != 1:
        raise ValidationError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if not arr.size:
            return _EMPTY
        raise BlockError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.itemsize == 8 and arr.size and int(_MAX(arr)) >= 2**63:
        raise BlockError(f"{name}: block {int(_MAX(arr))} is out of the int64 range")
    return arr.astype(np.int64, copy=False)


def check_ids(ids: Any, limit: int, name: str, unique: bool) -> np.ndarray:
    """Validated block ids: integers in ``0..limit-1``, distinct when ``unique``. The cost is
    O(n log n) in the ids, never in ``limit`` (a pool may hold millions of blocks)."""
    if (ids.__class__ is list or ids.__class__ is tuple) and id_packer is not None and _pack_valid is not None:
        try:  # the engine's usual call: a list, packed and checked in one pass
            packed = _pack_valid(ids, limit, unique)
        except (TypeError, OverflowError):
            raise _not_ints(ids, name) from None
        if packed is not None:
            return np.frombuffer(packed, np.int64)
    arr = as_ids(ids, name)
    if id_checker is not None and id_checker(arr, limit, unique):
        return arr  # all good; otherwise numpy finds (and names) the offending id
    if arr.size:
        # one reduction catches both ends: a negative id viewed as uint64 is huge
        if int(_MAX(arr.view(np.uint64))) >= limit:
            lo, hi = int(_MIN(arr)), int(_MAX(arr))
            if lo < 0:
                raise BlockError(f"{name}: block {lo} is negative")
            raise BlockError(f"{name}: block {hi} is out of range 0..{limit - 1}")
        if unique and arr.size > 1:
            s = np.sort(arr)
            same = s[1:] == s[:-1]
            if same.any():
                raise BlockError(f"{name}: block {int(s[1:][same][0])} appears twice "
                                 f"(a destination block may be written once)")
    return arr


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
    if gpu_ids.__class__ is list and host_ids.__class__ is list and id_packer is not None and _pack_pair:
        # an engine's usual call: both lists, packed and checked in one pass
        packed = _pair(gpu_ids, host_ids, num_gpu, num_host, h2d)
        if packed is not None:
            n = len(gpu_ids)
            return TransferPlan(op, direction, layers, _chunk_size(chunk, dtype), packed[:n], packed[n:], host_contig)
    g = check_ids(gpu_ids, num_gpu, "gpu_block_ids", unique=h2d)
    h = check_ids(host_ids, num_host, "host_block_ids", unique=not h2d)
    if g.size != h.size:
        raise ValidationError(f"gpu_block_ids has {g.size} ids, host_block_ids has {h.size}: lengths must match")
    return TransferPlan(op, direction, layers, _chunk_size(chunk, dtype), g, h, host_contig)


def _pair(gpu_ids: list[Any], host_ids: list[Any], num_gpu: int, num_host: int, h2d: bool) -> np.ndarray | None:
    """Both id lists packed and checked by one compiled call (None: let check_ids find and
    name what is wrong)."""
    assert _pack_pair is not None
    try:
        packed = _pack_pair(gpu_ids, host_ids, num_gpu, num_host, h2d, not h2d)
    except (TypeError, OverflowError):
        return None
    return None if packed is None else np.frombuffer(packed, np.int64)


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


def plan_layout(caches: Sequence[Any] | LayerSet, host: Any, gpu_block_ids: Any, host_block_ids: Any,
                direction: str) -> TransferPlan:
    """Validate a ``swap_cache_layout`` call and plan it."""
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
    return _finish("swap_cache_layout", direction, len(caches), shape[1:], dtype, gpu_block_ids,
                   host_block_ids, shape[0], hshape[0], True)


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

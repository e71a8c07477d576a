"""Block ids in every form an engine holds them, checked before a byte moves.

Accepted: Python lists and tuples of ints, numpy arrays of any integer dtype, and integer
tensors (PyTorch, Paddle, CuPy; on the CPU or a GPU). Floats, bools and anything else are
refused with a :class:`~kvstate._errors.BlockError` naming what was wrong. Nothing is checked
per element in Python: lists are packed, and ids checked for range and uniqueness, by the
compiled helpers of :mod:`kvstate.kernels._idpack` where ``pip install`` built them (a C
compiler was found), else by ``array`` and numpy — same results, slower. Uniqueness costs
O(n) or O(n log n) in the ids, never anything in the pool's size.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._errors import BlockError, ValidationError

__all__ = ["as_ids", "check_ids", "checked_ids", "check_pair", "identity_key", "id_packer", "id_checker", "narrow_into"]


def _compiled() -> Any:
    try:
        from . import _idpack as idpack
    except ImportError:  # pragma: no cover - where no C compiler was found at install
        return None
    return idpack


_c = _compiled()
id_packer: Callable[[Sequence[Any]], bytes] | None = _c and _c.pack
id_checker: Callable[[np.ndarray, int, bool], bool | None] | None = _c and _c.valid
_identity: Callable[[Sequence[Any]], bytes] | None = _c and _c.identity
_pack_valid: Callable[[Sequence[Any], int, bool], bytes | None] | None = _c and _c.pack_valid
_pack_pair: Callable[..., bytes | None] | None = _c and _c.pack_pair
_narrow: Callable[[bytes, int, int, np.ndarray], None] | None = _c and _c.narrow


def narrow_into(packed: bytes, start: int, count: int, dst: np.ndarray) -> None:
    """Copy ids ``start..start+count-1`` of packed native int64 ids (:func:`check_pair`) into
    the first ``count`` items of the int32 array ``dst`` (ids checked below 2**31)."""
    if _narrow is not None:
        _narrow(packed, start, count, dst)
    else:
        dst[:count] = np.frombuffer(packed, np.int64, count, start * 8)


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


def checked_ids(ids: list[int], limit: int) -> np.ndarray | None:
    """A list of plain ints packed as int64 when every id is in ``0..limit-1`` and none
    repeats, in one compiled pass; None when one is not, or where nothing was compiled (the
    caller's own checks then find and name it)."""
    if _pack_valid is None:
        return None
    try:
        packed = _pack_valid(ids, limit, True)
    except (TypeError, OverflowError):
        return None
    return None if packed is None else np.frombuffer(packed, np.int64)


def check_pair(gpu_ids: list[Any], host_ids: list[Any], num_gpu: int, num_host: int, h2d: bool) -> bytes | None:
    """A transfer's GPU and host id lists packed as native int64 (one after the other) and
    checked by one compiled call; None where that cannot answer (no compiled helpers, or
    something is wrong: :func:`check_ids` then finds and names it)."""
    if id_packer is None or _pack_pair is None:
        return None
    try:
        packed = _pack_pair(gpu_ids, host_ids, num_gpu, num_host, h2d, not h2d)
    except (TypeError, OverflowError):
        return None
    return packed

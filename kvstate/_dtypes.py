"""Cache dtypes, and how bfloat16 travels where numpy and CuPy have none: the one place for it.

kvstate only moves bytes. A bfloat16 cache is therefore carried as its 16-bit patterns: a
numpy or CuPy view of it is uint16, a host buffer for it is uint16, and a framework's bfloat16
tensor (PyTorch, Paddle) is reinterpreted as 16-bit integers, without a copy, before it is
viewed through DLPack. Names are framework-neutral: ``torch.float16`` and numpy's
``float16`` are both ``float16``, and bfloat16 is named ``uint16``.
"""
from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ._errors import ValidationError

__all__ = ["DTYPES", "BFLOAT16", "dtype_name", "numpy_dtype", "is_bfloat16", "as_16bit_ints"]

BFLOAT16 = "bfloat16"

#: Supported cache dtypes -> the numpy dtype of the same width that holds them.
DTYPES: dict[str, np.dtype] = {
    BFLOAT16: np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "uint8": np.dtype(np.uint8),  # fp8 (e4m3/e5m2) caches, moved as raw bytes
}

_NAMES: dict[Any, str] = {}


def is_bfloat16(dtype: Any) -> bool:
    return str(dtype).rsplit(".", 1)[-1] == BFLOAT16


def dtype_name(dtype: Any) -> str:
    """A framework-neutral name of a numpy, CuPy, PyTorch or Paddle dtype (bfloat16: ``uint16``)."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # first sight, or an unhashable dtype-like
        pass
    name = str(dtype).rsplit(".", 1)[-1]
    name = "uint16" if name == BFLOAT16 else name
    try:
        if len(_NAMES) < 256:
            _NAMES[dtype] = name
    except TypeError:
        pass
    return name


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s values (bfloat16: uint16)."""
    return np.dtype("uint16" if is_bfloat16(dtype) else dtype)


def as_16bit_ints(x: Any) -> Any:
    """A bfloat16 tensor viewed as 16-bit integers of its own framework (no copy); other
    tensors as they are."""
    if not is_bfloat16(getattr(x, "dtype", "")):
        return x
    view = getattr(x, "view", None)
    module = importlib.import_module(type(x).__module__.split(".")[0])
    for name in ("uint16", "int16"):  # PyTorch has uint16 from 2.3; int16 is the same bytes
        try:
            return view(getattr(module, name))  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - try the next spelling
            continue
    raise ValidationError(f"a bfloat16 {type(x).__name__} could not be reinterpreted as 16-bit integers")

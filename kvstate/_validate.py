"""Argument checks shared by every public entry point, so each rule is written once.

Each check raises the error class its caller documents (a :class:`ValidationError` unless
told otherwise) with a message that names the argument and the rule, and returns the checked
value. ``bool`` is never an int here: ``True`` would pass for rank, block or command 1.
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from ._errors import ConfigError, KVStateError, ValidationError

__all__ = ["is_int", "check_int", "check_layerwise", "check_request_id", "pack_tokens", "check_tokens", "check_token",
           "read_clock", "TOKEN_LIMIT", "TOKEN_TYPECODE", "MAX_BLOCKS", "MAX_DIM"]

TOKEN_LIMIT = 2**32  #: token ids are packed as uint32
MAX_BLOCKS = 2**31  #: blocks of a pool, host tier or backend at most (far past any GPU's memory)
MAX_DIM = 2**20  #: a cache's layers, heads, block size, head dim or TP degree at most
TOKEN_TYPECODE = "I"  #: the array typecode of packed token ids: uint32
if array(TOKEN_TYPECODE).itemsize != 4:  # pragma: no cover - no mainstream platform
    raise ImportError("kvstate needs a 4-byte array('I')")


def is_int(x: Any) -> TypeGuard[int]:
    """An int or a numpy integer scalar; never a bool."""
    if isinstance(x, int):
        return not isinstance(x, bool)
    return getattr(getattr(x, "dtype", None), "kind", None) in ("i", "u") and getattr(x, "ndim", None) == 0


def all_ints(values: Any) -> bool:
    """Whether every item of ``values`` is :func:`is_int`: a one-dimensional integer numpy
    array at once, a list of plain ints in C loops (a pull checks hundreds of block ids on the
    path of a first token), anything else item by item."""
    if getattr(values, "ndim", None) == 1 and getattr(getattr(values, "dtype", None), "kind", None) in ("i", "u"):
        return True
    return set(map(type, values)) <= {int} or all(map(is_int, values))


def check_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None,
              error: type[KVStateError] = ValidationError) -> int:
    """``value`` as an int within ``minimum..maximum`` (inclusive), else ``error``."""
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = "" if minimum is None else " > 0" if minimum == 1 else f" >= {minimum}"
        hi = "" if maximum is None else f" <= {maximum}"
        rule = f"an int{lo}{' and' if lo and hi else ''}{hi}"
        raise error(f"{name} must be {rule}, got {value!r}")
    return int(value)


def is_real(x: Any) -> bool:
    """A finite int or float (numpy's too); never a bool."""
    if is_int(x):
        return True  # any int is finite (and 10**400 has no float to test)
    float_scalar = getattr(getattr(x, "dtype", None), "kind", None) == "f" and getattr(x, "ndim", None) == 0
    return (isinstance(x, float) or float_scalar) and math.isfinite(x)


def check_name(value: Any, name: str, error: type[KVStateError] = ValidationError) -> str:
    """A label (a non-empty str of at most 200 characters, no NUL), else ``error``."""
    if not isinstance(value, str) or not value or len(value) > 200 or "\0" in value:
        raise error(f"{name} must be a non-empty str (a label), got {value!r}")
    return value


def check_callable(value: Any, name: str, optional: bool = False,
                   error: type[KVStateError] = ValidationError) -> None:
    """A callable (or None where ``optional``), else ``error``: refused where it is handed over,
    not where it is first called."""
    if not (callable(value) or (optional and value is None)):
        raise error(f"{name} must be callable{' or None' if optional else ''}, got {value!r}")


def read_clock(clock: Callable[[], float]) -> float:
    """The clock's reading, refused unless a finite number: a NaN deadline would never fire."""
    return clock_reading(clock())


def clock_reading(t: Any) -> float:
    """``t``, a clock's reading, refused unless a finite number (see :func:`read_clock`)."""
    if (t.__class__ is float or isinstance(t, (int, float)) and not isinstance(t, bool)) and -math.inf < t < math.inf:
        return t
    raise ValidationError(f"the clock must read a finite number of seconds, read {t!r}")


def check_request_id(request_id: Any) -> str:
    if (request_id.__class__ is not str or not request_id) and (not isinstance(request_id, str) or not request_id):
        raise ValidationError(f"request id must be a non-empty str, got {request_id!r}")
    return request_id


def pack_tokens(token_ids: Sequence[int]) -> array[int]:
    """Token ids as a uint32 array; raises :class:`ValidationError` for anything but ints in 0..2**32-1."""
    if isinstance(token_ids, (str, bytes)):
        raise ValidationError("token ids must be a sequence of ints, not a string")
    try:
        # unsigned 32-bit: negative, too large and non-int ids are rejected by the conversion itself
        if token_ids.__class__ is list:
            packed = array(TOKEN_TYPECODE)
            packed.fromlist(token_ids)  # faster than array("I", list) for the common case
        else:
            packed = array(TOKEN_TYPECODE, token_ids)
    except (TypeError, OverflowError) as e:
        raise ValidationError(f"token ids must be ints in 0..2**32-1 ({e})") from None
    _refuse_bools(token_ids)
    return packed


def _refuse_bools(token_ids: Sequence[int]) -> None:
    """A bool packs as 0 or 1, a real token id: refuse it. Typed arrays (``array``, integer
    numpy arrays) hold no bools; a list costs 0.1 ms per 8k ids, a third of an admit's cost
    and nothing beside a prefill's."""
    if isinstance(token_ids, array) or getattr(getattr(token_ids, "dtype", None), "kind", "") in ("i", "u"):
        return
    if bool in set(map(type, token_ids)):
        i = next(i for i, t in enumerate(token_ids) if t.__class__ is bool)
        raise ValidationError(f"token ids must be ints in 0..2**32-1, not bools (index {i}: {token_ids[i]!r})")


def check_tokens(request_id: str, token_ids: Any) -> array[int]:
    """Validated token ids as our own uint32 array: the caller's list is never mutated."""
    if token_ids.__class__ is array and token_ids.typecode == TOKEN_TYPECODE and token_ids:
        return token_ids[:]  # already uint32 ids: a copy of our own
    if token_ids.__class__ is list and token_ids:  # the hot case: the packing is the check
        packed = array(TOKEN_TYPECODE)
        try:
            packed.fromlist(token_ids)
            if bool not in set(map(type, token_ids)):  # True would pack as 1
                return packed
        except (TypeError, OverflowError):
            pass  # the checks below raise with the rule broken
    if token_ids.__class__ is not list and (isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence)):
        raise ValidationError(f"request {request_id!r}: token_ids must be a sequence of ints")
    if not token_ids:
        raise ValidationError(f"request {request_id!r}: token_ids is empty")
    try:
        return pack_tokens(token_ids)
    except ValidationError as e:
        raise ValidationError(f"request {request_id!r}: {e}") from None


def check_token(request_id: str, token: Any) -> int:
    fast_ok = token.__class__ is int and 0 <= token < TOKEN_LIMIT
    if not fast_ok and (not is_int(token) or not 0 <= token < TOKEN_LIMIT):
        raise ValidationError(f"request {request_id!r}: token {token!r} is not an int in 0..2**32-1")
    return int(token)


def check_layerwise(layerwise: Any, spec: Any) -> None:
    """``layerwise`` a bool, and not for a spec whose window groups are stored group by group
    (layer-wise transfers go by layers ``[0, end)``)."""
    if layerwise.__class__ is not bool:
        raise ValidationError(f"layerwise must be a bool, got {layerwise!r}")
    if layerwise and getattr(spec, "splits_groups", False):
        raise ConfigError("layerwise: a spec with window layer groups is stored group by group; layer-wise "
                          "transfers are not built for it")

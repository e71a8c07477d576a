"""Storage keys: one function that P and D both call, so they can never disagree.

A block's key is a chained sha256 over the previous block's key, the block's token ids
and optional extra keys (e.g. multimodal content hashes). The last, incomplete block's key
carries the ``:partial:N`` suffix, N being its token count. Python's ``hash()`` is never
used: it is salted per process.

Token ids are hashed as little-endian uint32 (every tokenizer's vocabulary is far below
2**32; ids outside 0..2**32-1 are rejected), which halves the bytes hashed per block.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping, Sequence

from .errors import ValidationError
from .validate import TOKEN_TYPECODE, check_int, pack_tokens

__all__ = ["block_keys", "keys_of_packed", "full_blocks", "rank_key", "KeyCache", "KEY_PREFIX_SEP"]

KEY_PREFIX_SEP = "/"
_sha256 = hashlib.sha256
_BIG_ENDIAN = sys.byteorder == "big"


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Mapping[int, Sequence[str]] | None = None,
    namespace: str = "",
) -> list[str]:
    """Keys of every block covering ``token_ids`` (the caller's list is never modified).

    ``extra_keys`` maps a block index to strings mixed into that block's hash (and, through
    the chain, every later one). ``namespace`` (e.g. a model name) prefixes every key so
    two models sharing one pool never collide.
    """
    check_int(block_size, "block_keys: block_size", minimum=1)
    return keys_of_packed(pack_tokens(token_ids), block_size, extra_keys, namespace)


def full_blocks(keys: Sequence[str]) -> int:
    """How many of ``keys`` (one request's, in order) are full blocks': all but a partial last."""
    return len(keys) - 1 if keys and ":partial:" in keys[-1] else len(keys)


class KeyCache:
    """The last prompt's keys, kept whole: asked for the same tokens again at once, the key
    function answers with one comparison instead of a hash per block.

    That is the case when P and D of one request run in one process (the simulator, a
    colocated engine), each computing the request's keys. Keys are content hashes, so a
    kept key is the key the function computes: it changes speed, never a key. (A cache of
    single blocks' keys was measured and cost more than it saved: a hit still hashes the
    block's bytes to find it, and a miss adds its insertion to the sha256.) Not thread-safe:
    share one among lifecycles driven by one thread.
    """

    __slots__ = ("hits", "misses", "_last")

    def __init__(self) -> None:
        self.hits = 0  #: prompts answered whole
        self.misses = 0  #: prompts hashed
        self._last: tuple[bytes, int, str, list[str]] | None = None  # token bytes, block size, namespace, keys


def keys_of_packed(packed: array[int], block_size: int, extra_keys: Mapping[int, Sequence[str]] | None,
                   namespace: str, cache: KeyCache | None = None) -> list[str]:
    """:func:`block_keys` over already validated, packed token ids (``cache``: see :class:`KeyCache`;
    it serves prompts without extra keys)."""
    n = len(packed)
    if extra_keys:
        nblocks = -(-n // block_size)
        for idx in extra_keys:
            if not isinstance(idx, int) or not 0 <= idx < nblocks:
                raise ValidationError(f"block_keys: extra_keys names block {idx!r}, outside 0..{nblocks - 1}")
    step = block_size * 4
    nfull = n // block_size
    end = nfull * step
    if _BIG_ENDIAN:  # pragma: no cover - keys are a storage format: little-endian everywhere
        packed = array(TOKEN_TYPECODE, packed)
        packed.byteswap()
    raw = packed.tobytes()  # one copy; slicing bytes is cheaper than slicing a memoryview
    prefix = namespace + KEY_PREFIX_SEP if namespace else ""
    partial = f":partial:{n - nfull * block_size}"
    if extra_keys:
        keys = _chain_extra(raw, step, end, namespace.encode(), extra_keys, partial)
        return [prefix + k for k in keys] if prefix else keys
    if cache is not None:
        last = cache._last
        if last is not None and last[0] == raw and last[1] == block_size and last[2] == namespace:
            cache.hits += 1
            return list(last[3])
        cache.misses += 1
    keys = []  # the common case: one sha256 call per block
    append = keys.append
    prev = namespace.encode()
    for start in range(0, end, step):
        key = _sha256(prev + raw[start:start + step]).hexdigest()
        append(key)
        prev = key.encode()
    if end < n * 4:  # the last, incomplete block
        append(f"{_sha256(prev + raw[end:]).hexdigest()}{partial}")
    if prefix:
        keys = [prefix + k for k in keys]
    if cache is not None:
        cache._last = (raw, block_size, namespace, keys)
        return list(keys)
    return keys


def _chain_extra(raw: bytes, step: int, end: int, prev: bytes, extra_keys: Mapping[int, Sequence[str]],
                 partial: str) -> list[str]:
    """Keys when some blocks mix in extra keys (never cached: rare, and their bytes differ)."""
    keys: list[str] = []
    for i, start in enumerate(range(0, len(raw), step)):
        h = _sha256(prev)
        h.update(raw[start:start + step])
        for extra in extra_keys.get(i, ()):
            h.update(b"\x00" + str(extra).encode())
        key = h.hexdigest()
        if start >= end:  # the last, incomplete block
            key += partial
        keys.append(key)
        prev = key.encode()
    return keys


def rank_key(key: str, kind: str, rank: int, group: int | None = None) -> str:
    """Name of the stored object holding ``kind`` ("key", "value", ...) of one block on ``rank``;
    ``group``: which layer group, when a block is stored in several (``CacheSpec.layer_groups``)."""
    return f"{key}_{kind}_{rank}" if group is None else f"{key}_{kind}_{rank}_g{group}"

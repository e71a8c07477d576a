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

from ._errors import ValidationError
from ._validate import MAX_DIM, TOKEN_TYPECODE, check_int, is_int, pack_tokens

__all__ = ["block_keys", "keys_of_packed", "full_blocks", "rank_key", "rank_keys", "KeyCache", "KEY_PREFIX_SEP"]

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
    check_int(block_size, "block_keys: block_size", minimum=1, maximum=MAX_DIM)
    return keys_of_packed(pack_tokens(token_ids), block_size, extra_keys, namespace)


def full_blocks(keys: Sequence[str]) -> int:
    """How many of ``keys`` (one request's, in order) are full blocks': all but a partial last."""
    return len(keys) - 1 if keys and ":partial:" in keys[-1] else len(keys)


class KeyCache:
    """Recent prompts' keys. Asked for the last prompt's tokens again at once (P and D of one
    request in one process: the simulator, a colocated engine), the key function answers with
    one comparison; asked for a prompt that starts as a recent one did (a shared system
    prompt, a conversation's earlier turns), it takes the keys of their common full blocks
    and hashes only the rest. A recent prompt is found by its first block's bytes (``size``
    first blocks kept, the latest prompt for each, with its token bytes), the common part by
    comparing bytes.

    Keys are content hashes, so a kept key is the key the function computes: it changes
    speed, never a key. (A cache of single blocks' keys was measured and cost more than it
    saved: a hit still hashes the block's bytes to find it, and a miss adds its insertion to
    the sha256.) Not thread-safe: share one among lifecycles driven by one thread.
    """

    __slots__ = ("hits", "misses", "reused", "size", "_last", "_heads")

    def __init__(self, size: int = 64) -> None:
        check_int(size, "KeyCache: size", minimum=1, maximum=1 << 20)
        self.hits = 0  #: prompts answered whole
        self.misses = 0  #: prompts hashed
        self.reused = 0  #: full blocks whose keys a hashed prompt took from a recent one
        self.size = size
        self._last: tuple[bytes, int, str, list[str]] | None = None  # token bytes, block size, namespace, keys
        # (first block's bytes, block size, namespace) -> (token bytes, its full blocks' chained keys,
        # unprefixed and as returned)
        self._heads: dict[tuple[bytes, int, str], tuple[bytes, list[str], list[str]]] = {}

    def __len__(self) -> int:
        """Prompts kept for their shared blocks (at most ``size``)."""
        return len(self._heads)

    def whole(self, raw: bytes, block_size: int, namespace: str) -> list[str] | None:
        """A copy of the last prompt's keys if ``raw`` is its tokens (a hit), else None."""
        last = self._last
        if last is not None and last[0] == raw and last[1] == block_size and last[2] == namespace:
            self.hits += 1
            return list(last[3])
        self.misses += 1
        return None

    def common(self, raw: bytes, step: int, nfull: int, block_size: int, namespace: str) -> tuple[list[str], list[str]]:
        """Chained keys of the leading full blocks ``raw`` shares with the latest kept prompt
        that starts with the same block: unprefixed (to chain on) and as returned (the same
        string objects as that prompt's, so sets and dicts holding them compare by identity)."""
        kept = self._heads.get((raw[:step], block_size, namespace)) if nfull else None
        if kept is None:
            return [], []
        k = min(nfull, len(kept[1]))
        other = kept[0]  # compared with startswith: one slice copied, not two
        if not other.startswith(raw[:k * step]):  # they part inside: bisect for the first block that differs
            lo, hi = 1, k - 1  # blocks [0, lo) are equal; the answer is at most hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if other.startswith(raw[lo * step:mid * step], lo * step):
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        self.reused += k
        return kept[1][:k], kept[2][:k]

    def remember(self, raw: bytes, block_size: int, namespace: str, keys: list[str]) -> None:
        """The prompt just hashed, for :meth:`whole` (``keys`` as returned: kept, not copied)."""
        self._last = (raw, block_size, namespace, keys)

    def keep(self, raw: bytes, step: int, block_size: int, namespace: str, chain: list[str],
             named: list[str]) -> None:
        """Keep a hashed prompt's chained full-block keys (unprefixed and as returned), under its
        first block."""
        if not chain:
            return
        head = (raw[:step], block_size, namespace)
        heads = self._heads
        if heads.pop(head, None) is None and len(heads) >= self.size:
            del heads[next(iter(heads))]  # the longest unused first block goes
        heads[head] = (raw, chain, named)


def _check_extra(extra_keys: Mapping[int, Sequence[str]], nblocks: int) -> None:
    """Extra keys map block indices in range to sequences of str."""
    if not isinstance(extra_keys, Mapping):
        raise ValidationError(f"block_keys: extra_keys must map block indices to str sequences, got {extra_keys!r}")
    for idx, extra in extra_keys.items():
        if not is_int(idx) or not 0 <= idx < nblocks:
            raise ValidationError(f"block_keys: extra_keys names block {idx!r}, outside 0..{nblocks - 1}")
        if isinstance(extra, (str, bytes)) or not isinstance(extra, Sequence) or \
                not all(isinstance(x, str) for x in extra):
            raise ValidationError(f"block_keys: extra_keys[{idx}] must be a sequence of str, got {extra!r}")


def keys_of_packed(packed: array[int], block_size: int, extra_keys: Mapping[int, Sequence[str]] | None,
                   namespace: str, cache: KeyCache | None = None) -> list[str]:
    """:func:`block_keys` over already validated, packed token ids (``cache``: see :class:`KeyCache`;
    it serves prompts without extra keys)."""
    n = len(packed)
    if not isinstance(namespace, str):
        raise ValidationError(f"block_keys: namespace must be a str, got {namespace!r}")
    if extra_keys:
        _check_extra(extra_keys, -(-n // block_size))
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
    if cache is None:
        keys = _chain(raw, step, end, [], namespace.encode(), partial)
        return [prefix + k for k in keys] if prefix else keys
    kept = cache.whole(raw, block_size, namespace)
    if kept is not None:
        return kept
    chain, named = cache.common(raw, step, nfull, block_size, namespace)
    keys = _chain(raw, step, end, chain, namespace.encode(), partial)
    if prefix:
        named += [prefix + k for k in keys[len(named):]]
    else:
        named = keys
    cache.keep(raw, step, block_size, namespace, keys[:nfull], named[:nfull])
    cache.remember(raw, block_size, namespace, named)
    return list(named)


def _chain(raw: bytes, step: int, end: int, keys: list[str], first: bytes, partial: str) -> list[str]:
    """Extend ``keys`` (the chain of the leading full blocks, known already) to every block of
    ``raw``: one sha256 call per block, over the previous key (``first`` for block 0)."""
    append = keys.append
    prev = keys[-1].encode() if keys else first
    for start in range(len(keys) * step, end, step):
        key = _sha256(prev + raw[start:start + step]).hexdigest()
        append(key)
        prev = key.encode()
    if end < len(raw):  # the last, incomplete block
        append(f"{_sha256(prev + raw[end:]).hexdigest()}{partial}")
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
    """Name of the stored object holding ``kind`` ("key", "value", ...) of one block in head
    group ``rank`` (a rank's own, by default); ``group``: which layer group, when a block is
    stored in several (``CacheSpec.layer_groups``)."""
    if key.__class__ is not str or not key or kind.__class__ is not str or not kind or not is_int(rank) \
            or not 0 <= rank <= MAX_DIM or group is not None and (not is_int(group) or not 0 <= group <= MAX_DIM):
        raise ValidationError(f"rank_key: key and kind must be non-empty str, rank and group ints in "
                              f"0..{MAX_DIM}; got {key!r}, {kind!r}, {rank!r}, {group!r}")
    return f"{key}_{kind}_{rank}" if group is None else f"{key}_{kind}_{rank}_g{group}"


def rank_keys(keys: Sequence[str], kinds: Sequence[str], rank: int, groups: Sequence[int] | None = None) -> list[str]:
    """:func:`rank_key` of every key, kind and group, key by key, then kind, then group (a
    transfer names hundreds of objects at a time; the kinds, rank and groups are checked once,
    the keys by type)."""
    if not all(k.__class__ is str and k for k in keys):
        bad = next(k for k in keys if k.__class__ is not str or not k)
        raise ValidationError(f"rank_keys: keys must be non-empty str, got {bad!r}")
    for kind in kinds:
        rank_key("k", kind, rank)
    if groups is None:
        return [f"{key}_{kind}_{rank}" for key in keys for kind in kinds]
    for g in groups:
        rank_key("k", "k", rank, g)
    return [f"{key}_{kind}_{rank}_g{g}" for key in keys for kind in kinds for g in groups]

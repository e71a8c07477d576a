"""Block tables: which pool block holds which layers of which of a request's tokens.

Rules:

- Without :attr:`~kvstate._spec.CacheSpec.group_tables` a request has one table,
  ``Request.blocks``: its block ``i`` holds every paged layer of tokens ``[i*B, (i+1)*B)``.
- With it (a spec with a window group), each paged layer group (``CacheSpec.stored_groups``,
  in order) has a table of its own: ``Request.blocks`` is group 0's and ``Request.tables`` the
  others', each as long as ``blocks``. Entry ``i`` of every table covers the same tokens, its
  *logical block* ``i``. Every table's blocks come from the one pool, so a block belongs to
  one (request, group) at a time: a backend lays a block out as :func:`page_layers` layer
  slots, group ``g``'s ``j``-th layer in slot ``j`` (the caches of layers sharing a slot may
  be one array), and a block costs that many layers, not every layer.
- A logical block costs :func:`per_block` pool blocks, fewer once some are freed.
- A decoding request frees the blocks wholly behind its window in every window table (the
  block manager decides which: :mod:`kvstate._blocks`; up to one block for all of them, the
  largest window's): the entries become :data:`~kvstate._pool.FREED`, from the front. A full
  group's table keeps every block, so a long conversation holds the full groups' blocks and
  one window of the window groups'.
- Transfer commands carry the other tables' entries for their blocks (``tables``, aligned with
  ``block_ids``), and so do the engine's notices (``StartPrefill``, ``StartDecode``,
  ``Recompute``); ``FreeBlocks`` and ``RequestEnded`` list every block released.
- A write-back stores every block of the full groups and the window groups' from the window on
  (``WriteBlocks.window_from``; their entries before it are ``FREED``), so a reload reads the
  whole cache window-first as the handoff did.
- A GPU prefix cache and a host tier hold single blocks, so beside group tables they are
  refused where they are configured (:func:`check_layout`).
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

from ._errors import ConfigError, ValidationError
from ._pool import FREED
from ._spec import CacheSpec
from ._validate import is_int

__all__ = ["per_block", "page_layers", "table_of_layer", "slot_of_layer", "rows", "cut",
           "held", "give", "check_layout", "pinned", "table"]


def per_block(spec: Any) -> int:
    """Tables a request holds, so pool blocks one logical block costs."""
    return len(spec.stored_groups) if spec.group_tables else 1


def page_layers(spec: Any) -> int:
    """Layer slots one pool block holds: its group's layers, at most the largest group's."""
    return max(len(g.layers) for g in spec.stored_groups) if spec.group_tables else spec.paged_layers


def table_of_layer(spec: Any) -> tuple[int, ...]:
    """For each paged layer (of ``spec.paged()``'s numbering), the table holding its blocks."""
    paged = _paged(spec, "table_of_layer")
    if not paged.group_tables:
        return (0,) * paged.layers
    out = [0] * paged.layers
    for t, g in enumerate(paged.stored_groups):
        for i in g.layers:
            out[i] = t
    return tuple(out)


def slot_of_layer(spec: Any) -> tuple[int, ...]:
    """For each paged layer, its slot in a pool block: its place in its group (with group
    tables), else the layer itself."""
    paged = _paged(spec, "slot_of_layer")
    if not paged.group_tables:
        return tuple(range(paged.layers))
    out = [0] * paged.layers
    for g in paged.stored_groups:
        for j, i in enumerate(g.layers):
            out[i] = j
    return tuple(out)


def _paged(spec: Any, who: str) -> Any:
    """The paged part of a cache spec (anything else refused)."""
    if not isinstance(spec, CacheSpec):
        raise ValidationError(f"{who}: spec must be a CacheSpec, got {spec!r}")
    return spec.paged()


def _ids(ids: Any, who: str) -> None:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or \
            not all(is_int(b) and (b >= 0 or b == FREED) for b in ids):
        raise ValidationError(f"{who}: block ids must be a sequence of ints >= 0 (or FREED), got {ids!r}")


def rows(block_ids: Sequence[int], tables: Sequence[Sequence[int]] = ()) -> list[Any]:
    """Logical blocks as a backend's test helpers take them: the block ids themselves (one
    table), or per logical block the tuple of its blocks, table by table."""
    _ids(block_ids, "rows")
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence):
        raise ValidationError(f"rows: tables must be a sequence of block tables, got {tables!r}")
    for t in tables:
        _ids(t, "rows: a table's")
        if len(t) != len(block_ids):
            raise ValidationError(f"rows: every table must hold {len(block_ids)} blocks, got {len(t)}")
    if not tables:
        return list(block_ids)
    return [tuple(t) for t in zip(block_ids, *tables, strict=True)]


def cut(req: Any, start: int, end: int) -> tuple[tuple[int, ...], ...]:
    """The other tables' entries for logical blocks ``[start, end)`` (for a command's ``tables``)."""
    if not req.tables:
        return ()
    return tuple(tuple(t[start:end]) for t in req.tables)


def pinned(block_ids: tuple[int, ...], tables: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The blocks a transfer of ``block_ids`` and ``tables`` touches (freed entries left out)."""
    if not tables:
        return block_ids
    return tuple(b for b in chain(block_ids, *tables) if b != FREED)


def held(req: Any) -> list[int]:
    """Every block the request holds, table by table (freed entries left out)."""
    if not req.tables and FREED not in req.blocks:  # one table with nothing freed: the common case
        return list(req.blocks)
    return [b for b in chain(req.blocks, *req.tables) if b != FREED]


def table(req: Any, t: int) -> list[int]:
    """The request's table ``t`` (0: ``Request.blocks``)."""
    return req.blocks if t == 0 else req.tables[t - 1]


def give(req: Any, ids: Sequence[int]) -> None:
    """Append freshly allocated ``ids`` (``n`` a table, table after table) to the request's tables."""
    if not req.tables:  # one table: the common case, on every decode step that crosses a block
        req.blocks.extend(ids)
        return
    n = len(ids) // (1 + len(req.tables))
    req.blocks.extend(ids[:n])
    for t, table in enumerate(req.tables):
        table.extend(ids[(t + 1) * n:(t + 2) * n])


def check_layout(spec: Any, prefix_cache: bool, host_blocks: int, who: str) -> None:
    """Refuse group tables beside what still moves single blocks: a GPU prefix cache, a host tier."""
    if spec.group_tables and (prefix_cache or host_blocks):
        raise ConfigError(f"{who}: CacheSpec.group_tables with a {'GPU prefix cache' if prefix_cache else 'host tier'}"
                          ": their entries are single blocks, not a block per layer group (kvstate._tables)")

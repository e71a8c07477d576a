"""The CUDA backend's caches: the engine's own or allocated ones, bound once per rank, and the
views a transfer moves them through.

A rank's caches of a kind are bound whole (what swaps to the host tier and block access use)
and as its head groups see them (:mod:`kvstate._spec`'s layout): the same memory as
``[num_blocks * head_groups, object_heads, block_size, dim]``, in which block ``b``'s group
``g`` is row ``b * head_groups + g``, one contiguous chunk (one head group: the whole binding).
That view is also bound per layer group, which a layer-wise save gathers alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import ValidationError
from .._spec import CacheSpec
from .._tables import page_layers, slot_of_layer
from ..kernels._cuda import CudaSwapper, DeviceLayers

__all__ = ["caches_by_rank", "bind_rank", "Bound"]

#: (the whole caches, the head groups' view, that view's layer groups) of one rank and kind
Bound = tuple[DeviceLayers, DeviceLayers, list[DeviceLayers]]


def caches_by_rank(spec: CacheSpec, ranks: Sequence[int], caches: Any) -> dict[int, Any]:
    """The engine's caches as ``{rank: {kind: layers}}`` for exactly the ranks held: from a list
    with one entry per TP rank, or a dict of the ranks held."""
    if isinstance(caches, Sequence) and not isinstance(caches, (str, bytes)):
        if len(caches) != spec.tp_size:
            raise ValidationError(f"CudaBackend: caches must hold one dict per TP rank ({spec.tp_size})")
        caches = {r: caches[r] for r in ranks}
    if not isinstance(caches, dict) or set(caches) != set(ranks):
        raise ValidationError(f"CudaBackend: caches must be a list per TP rank or a dict of the ranks held "
                              f"({list(ranks)})")
    for r, by_kind in caches.items():
        if not isinstance(by_kind, dict) or set(by_kind) != set(spec.kinds):
            raise ValidationError(f"CudaBackend: caches[{r}] must map exactly the kinds {spec.kinds}")
    return caches


def bind_rank(cp: Any, sw: CudaSwapper, spec: CacheSpec, num_blocks: int, device: int, r: int, kind: str,
              layers: Any) -> Bound:
    """Bind rank ``r``'s caches of ``kind`` (zeroed ones allocated when ``layers`` is None), and
    each head group's and layer group's views of them."""
    if layers is None:  # with group tables, the layers at one slot of a block share an array (kvstate._tables)
        with cp.cuda.Device(device):
            slots = [cp.zeros((num_blocks,) + spec.block_shape(kind), spec.kind_dtype(kind))
                     for _ in range(page_layers(spec))]
        layers = [slots[i] for i in slot_of_layer(spec)]
    name = f"caches[{r}][{kind!r}]"
    bound = sw.bind(list(layers), name)
    want = (num_blocks,) + spec.block_shape(kind)
    if bound.shape != want or len(bound) != spec.layers:
        raise ValidationError(f"CudaBackend: {name} must be {spec.layers} layers "
                              f"of {want}, got {len(bound)} of {bound.shape}")
    if spec.head_groups == 1 and not spec.splits_groups:
        parts = bound
    else:  # by head group, and the layers in the stored order (window groups: group by group)
        parts = sw.bind([bound.views[i].reshape((num_blocks * spec.head_groups,) + spec.object_shape(kind))
                         for i in spec.storage_order], f"{name} by head group, in the stored order")
    spans = [spec.group_span(g) for g in range(spec.object_groups)]
    groups = [sw.bind(parts.views[a:b], f"{name}[{a}:{b}]") for a, b in spans]
    return bound, parts, groups if spec.object_groups > 1 else []

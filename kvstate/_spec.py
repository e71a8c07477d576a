"""Cache geometry: every size derived from a model's KV-cache layout lives here, and the rules
by which a P and a D of different TP degrees share a store.

Rules of the stored layout (rank-neutral):

- A block's KV heads are stored in *head groups* of ``object_heads`` heads each (``store_heads``;
  by default a rank's ``kv_heads``, one object per rank and kind). Group ``j`` holds the model's
  heads ``[j * object_heads, (j + 1) * object_heads)``, whatever the TP degree that wrote it.
- A rank holds ``kv_heads // object_heads`` consecutive groups, starting at its first head's.
  When the model has fewer KV heads than ranks, each head is replicated on ``replicas`` ranks:
  all of them read the head's group, and only the first of them writes it (the others' bytes
  are the same).
- P and D interoperate when their geometries agree on everything a stored object holds (layers,
  layer groups, block size, head dim, dtype, kinds, heads per object, the model's heads): see
  :func:`check_pair`. Block sizes must be equal: a block's key chains over its tokens, so a
  block of 64 tokens has no key in common with four of 16, and a size pair is refused.
- A state group's states (:mod:`kvstate._statepages`) are one object per rank, holding that
  rank's share: P and D of a model with state layers use one TP degree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import gcd
from typing import Any

import numpy as np

from ._dtypes import DTYPES
from ._errors import ConfigError, ValidationError
from ._layers import LayerGroup, check_groups, read_blocks, window_start
from ._validate import MAX_DIM, check_int

__all__ = ["CacheSpec", "CACHE_KINDS", "SCALE_DTYPE", "check_pair", "paired"]

#: Block-wise fp8 scales: one float32 per (head, token) of a block.
SCALE_DTYPE = np.dtype(np.float32)
CACHE_KINDS = ("key", "value", "key_scale", "value_scale")


@dataclass(frozen=True, slots=True)
class CacheSpec:
    r"""Geometry of one TP rank's paged KV cache.

    Per layer and kind the cache is ``[num_blocks, kv_heads, block_size, head_dim]``; fp8
    scales, when present, are ``[num_blocks, kv_heads, block_size, 1]`` float32.

    ``layer_groups`` splits a stored block into that many objects per kind, each holding
    consecutive layers (1: one object of every layer). P and D must agree on it: it is the
    store's format. More groups let a layer-wise save put a group as soon as its layers are
    computed, so only the last group's put trails the prefill.

    ``groups`` describes the layers as :class:`~kvstate._layers.LayerGroup`\ s of kinds (full,
    sliding window, latent, state; :mod:`kvstate._layers` gives the rules); none is one full group.
    ``group_tables`` gives each paged group a block table of its own, so a window group's blocks
    behind its window are freed while a full group keeps its own (:mod:`kvstate._tables`). It is
    the GPU's layout, not the store's: a P and a D may differ on it.

    ``total_kv_heads`` is the model's KV heads (0: ``kv_heads * tp_size``; fewer than
    ``tp_size``: each rank holds one head, replicated). ``store_heads`` is the heads per stored
    object (0: ``kv_heads``); a P and a D of different TP degrees set it to a divisor of both
    sides' ``kv_heads`` (:func:`paired`). The module's docstring gives the layout's rules.
    """

    num_layers: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str = "bfloat16"
    extra_layers: int = 0
    has_value: bool = True
    fp8_scales: bool = False
    tp_size: int = 1
    layer_groups: int = 1
    total_kv_heads: int = 0
    store_heads: int = 0
    groups: tuple[LayerGroup, ...] = ()
    group_tables: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "block_size", "head_dim", "tp_size", "layer_groups"):
            check_int(getattr(self, name), f"CacheSpec.{name}", minimum=1, maximum=MAX_DIM, error=ConfigError)
        check_int(self.extra_layers, "CacheSpec.extra_layers", minimum=0, maximum=MAX_DIM, error=ConfigError)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError(f"CacheSpec.dtype {self.dtype!r} is unknown; use one of {sorted(DTYPES)}")
        if not isinstance(self.fp8_scales, bool) or not isinstance(self.has_value, bool):
            raise ConfigError(f"CacheSpec.fp8_scales and has_value must be bools, got "
                              f"{self.fp8_scales!r} and {self.has_value!r}")
        if self.fp8_scales and self.dtype != "uint8":
            raise ConfigError("CacheSpec.fp8_scales needs dtype 'uint8' (an fp8 cache)")
        self._check_heads()
        check_groups(self.groups, self.layers, self.block_size, latent_layout=self.kv_heads == 1 and
                     self.heads_total == 1 and not self.has_value)
        paged = self.layers - len(self._state_layers())
        if paged % self.layer_groups:  # stored objects split the layers whose blocks are stored
            raise ConfigError(f"CacheSpec.layer_groups {self.layer_groups} must divide the {paged} layers"
                              + (" whose blocks are stored (state layers have none)" if paged != self.layers else ""))
        if self.splits_groups and self.layer_groups != 1:
            raise ConfigError("CacheSpec: window groups are stored group by group: layer_groups must be 1")
        if not isinstance(self.group_tables, bool) or (self.group_tables and not self.splits_groups):
            raise ConfigError(f"CacheSpec.group_tables {self.group_tables!r}: a block table per layer group "
                              "(kvstate._tables) is a bool, True only for a spec with a window group")

    def _check_heads(self) -> None:
        """``total_kv_heads`` split over the ranks (or replicated), ``store_heads`` a divisor."""
        for name in ("total_kv_heads", "store_heads"):
            check_int(getattr(self, name), f"CacheSpec.{name}", minimum=0, maximum=MAX_DIM, error=ConfigError)
        total, tp = self.heads_total, self.tp_size
        if total >= tp and total != self.kv_heads * tp:
            raise ConfigError(f"CacheSpec: {total} KV heads over TP {tp} give {total / tp:g} a rank, "
                              f"not kv_heads {self.kv_heads}")
        if total < tp and (self.kv_heads != 1 or tp % total):
            raise ConfigError(f"CacheSpec: {total} KV heads over TP {tp} replicate one head a rank, so "
                              f"kv_heads must be 1 (got {self.kv_heads}) and TP a multiple of {total}")
        if self.kv_heads % self.object_heads:
            raise ConfigError(f"CacheSpec.store_heads {self.store_heads} must divide the rank's "
                              f"{self.kv_heads} KV heads")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> CacheSpec:
        """The spec of ``dataclasses.asdict(spec)`` come back through JSON (groups as lists of
        dicts, their layers as lists)."""
        if not isinstance(fields, dict):
            raise ConfigError(f"CacheSpec.from_dict: expected a dict of fields, got {type(fields).__name__}")
        groups = fields.get("groups", ())
        try:
            if isinstance(groups, list):
                groups = tuple(g if isinstance(g, LayerGroup) else _group_from_dict(g) for g in groups)
            return cls(**{**fields, "groups": groups})
        except (TypeError, AttributeError) as e:
            raise ConfigError(f"CacheSpec.from_dict: {e}") from None

    # -- derived sizes (the single place they are computed) ------------------------------
    @property
    def layers(self) -> int:
        """Layers whose cache moves: model layers plus extra ones (e.g. MTP)."""
        return self.num_layers + self.extra_layers

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def kinds(self) -> tuple[str, ...]:
        """Cache tensors per layer: key, value (absent for MLA), and their fp8 scales."""
        kinds = ["key"] + (["value"] if self.has_value else [])
        if self.fp8_scales:
            kinds += [k + "_scale" for k in kinds]
        return tuple(kinds)

    def kind_dtype(self, kind: str) -> np.dtype:
        self._check_kind(kind)
        return SCALE_DTYPE if kind.endswith("_scale") else self.np_dtype

    def _check_kind(self, kind: str) -> None:
        if kind not in self.kinds:
            raise ValidationError(f"CacheSpec: kind {kind!r} is not one of this cache's {self.kinds}")

    def block_shape(self, kind: str) -> tuple[int, int, int]:
        """Shape of one (layer, block) chunk of ``kind``: ``(heads, block_size, dim)``."""
        self._check_kind(kind)
        dim = 1 if kind.endswith("_scale") else self.head_dim
        return (self.kv_heads, self.block_size, dim)

    def object_shape(self, kind: str) -> tuple[int, int, int]:
        """Shape of one (layer, block) chunk of ``kind`` in a stored object: ``(object_heads,
        block_size, dim)``."""
        return (self.object_heads,) + self.block_shape(kind)[1:]

    # -- the rank-neutral stored layout (the module's docstring) ------------------------------
    @property
    def heads_total(self) -> int:
        """The model's KV heads."""
        return self.total_kv_heads or self.kv_heads * self.tp_size

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head (1 unless the model has fewer heads than ranks)."""
        return max(1, self.tp_size // self.heads_total)

    @property
    def object_heads(self) -> int:
        """KV heads per stored object."""
        return self.store_heads or self.kv_heads

    @property
    def head_groups(self) -> int:
        """Stored objects per block, kind and layer group on one rank."""
        return self.kv_heads // self.object_heads

    def parts(self, rank: int) -> range:
        """The head groups (object indices) rank ``rank`` holds, in head order."""
        first = rank // self.replicas * self.kv_heads // self.object_heads
        return range(first, first + self.head_groups)

    def writes(self, rank: int) -> bool:
        """Whether rank ``rank`` stores its head groups (the first replica of its heads does)."""
        return rank % self.replicas == 0

    def chunk_bytes(self, kind: str = "key") -> int:
        """Bytes of one (layer, block) chunk of ``kind``."""
        h, b, d = self.block_shape(kind)
        return h * b * d * self.kind_dtype(kind).itemsize

    def block_bytes(self, kind: str = "key") -> int:
        """Bytes of one block of ``kind`` across all paged layers."""
        return self.paged_layers * self.chunk_bytes(kind)

    # -- layer groups (kvstate._layers) ----------------------------------------------------------
    @property
    def paged_layers(self) -> int:
        """Layers whose cache is paged by tokens (all but state layers)."""
        return self.layers - sum(len(g.layers) for g in self.groups if g.kind == "state")

    @property
    def state_bytes_per_rank(self) -> int:
        """One request's recurrent state on one rank, every state layer."""
        return sum(g.state_bytes * len(g.layers) for g in self.groups if g.kind == "state")

    def _state_layers(self) -> frozenset[int]:
        return frozenset(i for g in self.groups if g.kind == "state" for i in g.layers)

    def paged_layers_done(self, layers: int) -> int:
        """The layers of :meth:`paged` (a backend's count) ready once the model's first
        ``layers`` are computed: ``layers`` without state groups; with them, the paged layers
        among those, the last one only once every layer is, since the states stored after the
        last paged group may come from a later layer."""
        state = self._state_layers()
        if not state:
            return layers
        done = layers - sum(1 for i in state if i < layers)
        return done if layers >= self.layers else min(done, self.layers - len(state) - 1)

    def paged(self) -> CacheSpec:
        """This spec without its state layers: the paged cache that lifecycles and backends
        hold (state groups' states are counted apart: :attr:`state_bytes_per_rank`)."""
        state = self._state_layers()
        if not state:
            return self
        index = {old: new for new, old in enumerate(i for i in range(self.layers) if i not in state)}
        kept = tuple(replace(g, layers=tuple(index[i] for i in g.layers)) for g in self.groups if g.kind != "state")
        groups = () if all(g.kind == "full" for g in kept) else kept
        return replace(self, num_layers=self.num_layers - len(state), groups=groups)

    def check_moved(self, who: str) -> None:
        """Refuse state groups where ``who`` (a backend given the whole spec, not its
        :meth:`paged` part) cannot move them: the backends' state pages do
        (:mod:`kvstate.backends._stateobjects`)."""
        if any(g.kind == "state" for g in self.groups):
            raise ConfigError(f"{who}: state layer groups (Mamba, linear attention) are moved by the lifecycles "
                              f"and the reference backend; {who} does not move states")

    def check_num_states(self, who: str, num_states: int, error: type[ConfigError | ValidationError] = ConfigError
                         ) -> None:
        """Refuse ``num_states`` state pages a rank that do not match the spec: some exactly
        when it has state groups (``who`` names the holder; ``error`` is its kind of refusal)."""
        if bool(num_states) != bool(self.state_bytes_per_rank):
            raise error(f"{who}: num_states {num_states} with {self.state_bytes_per_rank} state bytes a rank: "
                        "a spec with state groups needs state pages, one without has none")

    def read_bytes_per_rank(self, num_tokens: int) -> int:
        """Bytes one rank reads to continue a ``num_tokens``-token cache: every paged group's
        blocks it needs (a window group's last window only) and the state groups' states."""
        check_int(num_tokens, "CacheSpec.read_bytes_per_rank: num_tokens", minimum=0, maximum=1 << 40)
        if not self.groups:
            return self.blocks_for(num_tokens) * self.bytes_per_block_per_rank
        per_layer = sum(self.chunk_bytes(k) for k in self.kinds)
        return sum(len(g.layers) * per_layer * read_blocks(g, num_tokens, self.block_size)
                   for g in self.groups) + self.state_bytes_per_rank

    @property
    def group_layers(self) -> int:
        """Layers per stored object (``layers // layer_groups``)."""
        return self.layers // self.layer_groups

    def group_span(self, group: int) -> tuple[int, int]:
        """The positions ``[start, end)`` in :attr:`storage_order` of the layers stored object
        group ``group`` holds (with ``layer_groups``, the layers themselves)."""
        if self.splits_groups:
            sizes = [len(g.layers) for g in self.stored_groups]
            start = sum(sizes[:group])
            return start, start + sizes[group]
        n = self.group_layers
        return group * n, (group + 1) * n

    # -- window groups stored apart (kvstate._layers: a reader takes only their last window) ------
    @property
    def splits_groups(self) -> bool:
        """Whether each layer group is its own stored object (a spec with a window group)."""
        return any(g.kind == "window" for g in self.groups)

    @property
    def object_groups(self) -> int:
        """Stored objects per block, kind and head group: one per layer group when
        :attr:`splits_groups`, else ``layer_groups``."""
        return len(self.stored_groups) if self.splits_groups else self.layer_groups

    @property
    def stored_groups(self) -> tuple[LayerGroup, ...]:
        """The groups whose blocks are stored (all but state groups)."""
        return tuple(g for g in self.groups if g.kind != "state")

    @property
    def storage_order(self) -> tuple[int, ...]:
        """The layers in the order a block's stored objects hold them: group by group when
        :attr:`splits_groups`, else in order."""
        if not self.splits_groups:
            return tuple(range(self.layers))
        return tuple(i for g in self.stored_groups for i in g.layers)

    def window_first_block(self, num_tokens: int) -> int:
        """The first block a cache of ``num_tokens`` tokens needs from its window groups (0:
        every block, or no window group)."""
        if not self.groups:
            return 0
        return min((window_start(g.window, num_tokens, self.block_size) for g in self.groups if g.kind == "window"),
                   default=0)

    @property
    def frees_behind_window(self) -> bool:
        """Whether a decoding request frees blocks behind its window: every paged layer is a
        window layer (Mistral's pattern), or each group has a block table of its own
        (``group_tables``: the window groups' tables free them, :mod:`kvstate._tables`)."""
        return self.group_tables or (bool(self.stored_groups) and all(g.kind == "window" for g in self.stored_groups))

    def resume_blocks(self, whole: int, window_end: int, window_from: int, blocks: int) -> int:
        """Leading blocks a cache can be continued from after a read that took ``whole``
        leading blocks of its full groups and its window groups' blocks ``[window_from,
        window_end)``: every block, or a prefix whose last window was read, or none."""
        end = min(whole, window_end)
        if end >= blocks or not window_from:
            return min(end, blocks)
        windows = max(g.window for g in self.groups if g.kind == "window")
        return end if end >= window_from + -(-windows // self.block_size) else 0

    @property
    def bytes_per_block_per_rank(self) -> int:
        """Bytes of one block, all layers and kinds, on one TP rank."""
        return sum(self.block_bytes(k) for k in self.kinds)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every TP rank."""
        return self.bytes_per_block_per_rank * self.tp_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)


def _group_from_dict(g: dict[str, Any]) -> LayerGroup:
    layers = g.get("layers")
    return LayerGroup(**{**g, "layers": tuple(layers) if isinstance(layers, list) else layers})


#: what a stored object's geometry is made of: P and D must agree on each
_SHARED = ("num_layers", "extra_layers", "layer_groups", "block_size", "head_dim", "dtype", "has_value",
           "fp8_scales", "heads_total", "object_heads", "groups")


def check_pair(p: CacheSpec, d: CacheSpec) -> None:
    """Refuse, naming the rule, a P and a D whose stored objects would not be the same: every
    field of :data:`_SHARED` must agree (block sizes included: see the module's docstring)."""
    if not isinstance(p, CacheSpec) or not isinstance(d, CacheSpec):
        raise ConfigError("check_pair: P's and D's specs must be CacheSpecs")
    if p.state_bytes_per_rank and p.tp_size != d.tp_size:
        raise ConfigError(f"P (TP {p.tp_size}) and D (TP {d.tp_size}): a state group's states are stored per "
                          "rank, so P and D of a model with state layers use one TP degree")
    for name in _SHARED:
        a, b = getattr(p, name), getattr(d, name)
        if a != b:
            hint = (": keys chain over a block's tokens, so P and D use one block size" if name == "block_size"
                    else f": set store_heads to {gcd(p.kv_heads, d.kv_heads)} on both (kvstate._spec.paired)"
                    if name == "object_heads" else "")
            raise ConfigError(f"P (TP {p.tp_size}) and D (TP {d.tp_size}) disagree on {name}: {a} != {b}{hint}")


def paired(p: CacheSpec, d: CacheSpec) -> tuple[CacheSpec, CacheSpec]:
    """P's and D's specs storing the largest head groups both can split into, checked as a pair."""
    if not isinstance(p, CacheSpec) or not isinstance(d, CacheSpec):
        raise ValidationError(f"paired: P's and D's specs must be CacheSpecs, got {p!r} and {d!r}")
    heads = gcd(p.kv_heads, d.kv_heads)
    p2, d2 = replace(p, store_heads=heads), replace(d, store_heads=heads)
    check_pair(p2, d2)
    return p2, d2

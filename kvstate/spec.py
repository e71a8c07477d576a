"""Cache geometry: every size derived from a model's KV-cache layout lives here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import DTYPES
from .errors import ConfigError
from .validate import check_int

__all__ = ["CacheSpec", "CACHE_KINDS", "SCALE_DTYPE"]

#: Block-wise fp8 scales: one float32 per (head, token) of a block.
SCALE_DTYPE = np.dtype(np.float32)
CACHE_KINDS = ("key", "value", "key_scale", "value_scale")


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Geometry of one TP rank's paged KV cache.

    Per layer and kind the cache is ``[num_blocks, kv_heads, block_size, head_dim]``; fp8
    scales, when present, are ``[num_blocks, kv_heads, block_size, 1]`` float32.

    ``layer_groups`` splits a stored block into that many objects per kind, each holding
    consecutive layers (1: one object of every layer). P and D must agree on it: it is the
    store's format. More groups let a layer-wise save put a group as soon as its layers are
    computed, so only the last group's put trails the prefill.
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

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "block_size", "head_dim", "tp_size", "layer_groups"):
            check_int(getattr(self, name), f"CacheSpec.{name}", minimum=1, error=ConfigError)
        if self.layers % self.layer_groups:
            raise ConfigError(f"CacheSpec.layer_groups {self.layer_groups} must divide the {self.layers} layers")
        check_int(self.extra_layers, "CacheSpec.extra_layers", minimum=0, error=ConfigError)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError(f"CacheSpec.dtype {self.dtype!r} is unknown; use one of {sorted(DTYPES)}")
        if not isinstance(self.fp8_scales, bool) or not isinstance(self.has_value, bool):
            raise ConfigError(f"CacheSpec.fp8_scales and has_value must be bools, got "
                              f"{self.fp8_scales!r} and {self.has_value!r}")
        if self.fp8_scales and self.dtype != "uint8":
            raise ConfigError("CacheSpec.fp8_scales needs dtype 'uint8' (an fp8 cache)")

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
        return SCALE_DTYPE if kind.endswith("_scale") else self.np_dtype

    def block_shape(self, kind: str) -> tuple[int, int, int]:
        """Shape of one (layer, block) chunk of ``kind``: ``(heads, block_size, dim)``."""
        dim = 1 if kind.endswith("_scale") else self.head_dim
        return (self.kv_heads, self.block_size, dim)

    def chunk_bytes(self, kind: str = "key") -> int:
        """Bytes of one (layer, block) chunk of ``kind``."""
        h, b, d = self.block_shape(kind)
        return h * b * d * self.kind_dtype(kind).itemsize

    def block_bytes(self, kind: str = "key") -> int:
        """Bytes of one block of ``kind`` across all layers."""
        return self.layers * self.chunk_bytes(kind)

    @property
    def group_layers(self) -> int:
        """Layers per stored object (``layers // layer_groups``)."""
        return self.layers // self.layer_groups

    def group_span(self, group: int) -> tuple[int, int]:
        """The layers ``[start, end)`` that stored object group ``group`` holds."""
        n = self.group_layers
        return group * n, (group + 1) * n

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

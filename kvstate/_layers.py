"""Layer groups: a model's cache as groups of layers, each of one kind.

Rules:

- ``full``: attention over every token; the cache is paged by tokens and every block is kept.
- ``window``: sliding-window attention over the last ``window`` tokens; paged like ``full``,
  but decode needs only the blocks covering the last ``window`` tokens. A window is a whole
  number of blocks (blocks are read and freed whole).
- ``latent``: latent attention (MLA): one "head" of ``kv_lora_rank + rope_dim`` values a token,
  the same on every TP rank. Its spec is one KV head in all (``kv_heads == total_kv_heads ==
  1``, no value cache), so the stored layout replicates it: rank 0 writes each block once and
  every rank reads that object. Latent layers do not share a model with head-split ones.
- ``state``: a recurrent state (Mamba, linear attention) of ``state_bytes`` per layer, request
  and rank, whatever the sequence's length. It is valid only where it was checkpointed: every
  ``checkpoint`` tokens (a whole number of blocks: it is stored with the block ending there) and
  at the prompt's end. A stored prefix is reusable from a checkpoint only.
- The groups partition the cache's layers: every layer in exactly one group. No groups is one
  ``full`` group of every layer, the store format of a spec without groups.

What a transfer moves per group follows (:func:`read_blocks`): a window group's blocks past its
window, a latent group's objects once, a state group's state at its checkpoint.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._errors import ConfigError
from ._validate import MAX_DIM, check_int

__all__ = ["LayerGroup", "GROUP_KINDS", "check_groups", "read_blocks", "window_start", "checkpoint_floor"]

GROUP_KINDS = ("full", "window", "latent", "state")
#: the largest state one layer of one request may hold on one rank (Mamba-2's are a few MiB)
MAX_STATE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers ``layers`` (indices into the cache's layers) of kind ``kind`` (see the module's
    rules); ``window`` (tokens) for a window group, ``state_bytes`` and ``checkpoint`` (tokens)
    for a state group, 0 otherwise."""

    kind: str
    layers: tuple[int, ...]
    window: int = 0
    state_bytes: int = 0
    checkpoint: int = 0

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"LayerGroup: kind {self.kind!r} is not one of {GROUP_KINDS}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ConfigError(f"LayerGroup {self.kind}: layers must be a non-empty tuple of layer indices, "
                              f"got {self.layers!r}")
        for i in self.layers:
            check_int(i, f"LayerGroup {self.kind}: layer index", minimum=0, maximum=MAX_DIM, error=ConfigError)
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"LayerGroup {self.kind}: layer indices repeat: {self.layers}")
        wants = {"window": ("window",), "state": ("state_bytes", "checkpoint")}.get(self.kind, ())
        for name in ("window", "state_bytes", "checkpoint"):
            cap = MAX_STATE_BYTES if name == "state_bytes" else MAX_DIM
            check_int(getattr(self, name), f"LayerGroup {self.kind}: {name}", minimum=1 if name in wants else 0,
                      maximum=cap if name in wants else 0, error=ConfigError)


def check_groups(groups: Sequence[LayerGroup], layers: int, block_size: int, *, latent_layout: bool) -> None:
    """Refuse, naming the rule, groups that do not partition ``layers`` layers or break a
    kind's rule (``latent_layout``: the spec is one replicated head with no value cache)."""
    if not isinstance(groups, tuple) or not all(isinstance(g, LayerGroup) for g in groups):
        raise ConfigError(f"CacheSpec.groups must be a tuple of LayerGroup, got {groups!r}")
    if groups:
        _check_partition(groups, layers)
        _check_kinds(groups, block_size, latent_layout)


def _check_partition(groups: Sequence[LayerGroup], layers: int) -> None:
    """Every layer of ``range(layers)`` in exactly one group."""
    seen: dict[int, str] = {}
    for g in groups:
        for i in g.layers:
            if i in seen:
                raise ConfigError(f"CacheSpec.groups: layer {i} is in a {seen[i]} group and a {g.kind} group")
            seen[i] = g.kind
    missing = sorted(set(range(layers)) - set(seen))
    extra = sorted(set(seen) - set(range(layers)))
    if missing or extra:
        raise ConfigError(f"CacheSpec.groups do not add up to the cache's {layers} layers: "
                          f"{'missing ' + str(missing[:8]) if missing else ''}"
                          f"{' ' if missing and extra else ''}{'beyond it ' + str(extra[:8]) if extra else ''}")


def _check_kinds(groups: Sequence[LayerGroup], block_size: int, latent_layout: bool) -> None:
    """Windows and checkpoints in whole blocks; latent layers alone, in the latent layout."""
    for g in groups:
        if g.kind == "window" and g.window % block_size:
            raise ConfigError(f"CacheSpec.groups: a window of {g.window} tokens is not a multiple of the block "
                              f"size {block_size} (blocks are read and freed whole)")
        if g.kind == "state" and g.checkpoint % block_size:
            raise ConfigError(f"CacheSpec.groups: a state checkpoint every {g.checkpoint} tokens is not a multiple "
                              f"of the block size {block_size} (a state is stored with the block ending there)")
    kinds = {g.kind for g in groups}
    if "latent" in kinds and kinds & {"full", "window"}:
        raise ConfigError("CacheSpec.groups: latent (MLA) layers and head-split attention layers in one model "
                          "are not a layout kvstate stores")
    if "latent" in kinds and not latent_layout:
        raise ConfigError("CacheSpec.groups: a latent group needs the latent layout: kv_heads = total_kv_heads "
                          "= 1 (one head, replicated on every rank) and has_value = False")
    if kinds == {"state"}:
        raise ConfigError("CacheSpec.groups: every layer is a state layer: there is no paged cache to describe")


def read_blocks(group: LayerGroup, num_tokens: int, block_size: int) -> int:
    """Blocks of a ``num_tokens``-token cache that continuing it needs from ``group``: every
    block, or for a window group the blocks covering its last ``window`` tokens (a state
    group has no blocks: its state is one object)."""
    blocks = -(-num_tokens // block_size)
    if group.kind == "state":
        return 0
    if group.kind != "window":
        return blocks
    return blocks - window_start(group.window, num_tokens, block_size)


def window_start(window: int, num_tokens: int, block_size: int) -> int:
    """The block of a ``num_tokens``-token cache its last ``window`` tokens start in."""
    return max(0, num_tokens - window) // block_size


def checkpoint_floor(groups: Sequence[LayerGroup], blocks: int, block_size: int) -> int:
    """The longest prefix of ``blocks`` whole blocks every state group can resume from: down to
    a multiple of each group's checkpoint (no state group: ``blocks``)."""
    for g in groups:
        if g.kind == "state":
            step = g.checkpoint // block_size
            blocks -= blocks % step
    return blocks

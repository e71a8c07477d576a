"""A Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU) whose KV cache is kvstate's pages,
with optional sliding-window layers interleaved with full-attention ones (Gemma 2's pattern),
or DeepSeek-V2's multi-head latent attention (MLA) in place of GQA.

Per TP rank, layer and kind the cache is ``[num_blocks, kv_heads_per_rank, block_size,
head_dim]`` — the layout kvstate moves — and a request's block table lists its blocks in token
order. Attention gathers a request's pages through the table: slow, but exact, and the
arithmetic of a chunk depends only on its tokens, its positions and the cached bytes, never on
which physical blocks hold them. That is what lets a handoff (P computes, D reads the bytes
back into other blocks) reproduce a monolithic run bit for bit.

A window layer (``window`` tokens, on the layers ``window_layers``) lets a token attend to
itself and the ``window - 1`` before it, and gathers only the pages from the block its chunk's
earliest window starts in: pages before it are never touched, so D need not read them.

With ``kv_lora_rank`` (MLA), a token's cache is one latent vector: ``kv_lora_rank`` values
(normalised) and ``rope_dim`` rotated key values, the same on every TP rank. Each rank keeps its
own copy and computes its share of the heads from it, decompressing keys and values through
``w_uk`` and ``w_uv``, as DeepSeek-V2's deployments do; there is no value cache.

A hybrid model's state layers (``state_layers``: linear attention, Mamba) keep no pages: each
request's recurrent state, ``state_bytes`` a layer, lives in a state page (``PagedCache.states``,
split evenly over the TP ranks), and the engine copies it to a page of its own at each checkpoint it keeps.
This file's own model has no state layers; ``hf.py`` serves transformers' Qwen3-Next.

Weights are random from a fixed seed; nothing is downloaded.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstate import CacheSpec, slot_of_layer, table_of_layer

__all__ = ["LlamaConfig", "Model", "PagedCache", "TinyLlama"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 512
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    ffn: int = 512
    rope_theta: float = 10000.0
    eps: float = 1e-5
    window: int = 0  #: tokens a window layer attends to (0: every layer is full attention)
    window_layers: tuple[int, ...] = ()  #: the layers with a sliding window
    kv_lora_rank: int = 0  #: MLA's latent size (0: GQA); its rotated key part has ``rope_dim`` values
    rope_dim: int = 16
    state_layers: tuple[int, ...] = ()  #: layers keeping a recurrent state instead of pages
    state_bytes: int = 0  #: one state layer's state of one request, all TP ranks together
    checkpoint: int = 0  #: tokens between the states stored with a prefix (a state group's checkpoint)

    @property
    def paged_layers(self) -> tuple[int, ...]:
        """The layers whose cache is paged (every layer but the state layers), in order."""
        return tuple(i for i in range(self.layers) if i not in self.state_layers)

    @property
    def latent(self) -> int:
        """Values a token's MLA cache holds (0: GQA)."""
        return self.kv_lora_rank + self.rope_dim if self.kv_lora_rank else 0

    def first_position(self, layer: int, start: int, block_size: int) -> int:
        """The first position layer ``layer`` gathers for a chunk starting at ``start``: 0, or
        for a window layer the start of the block its chunk's earliest window begins in."""
        if layer not in self.window_layers:
            return 0
        return max(0, start - self.window + 1) // block_size * block_size


class PagedCache:
    """Key and value pages of every layer, split by KV head over ``tp`` ranks.

    ``caches[rank]["key" | "value"]`` is the per-layer list kvstate's ``CudaBackend`` binds (the
    paged layers only); ``states[rank]``, ``[num_states, bytes]`` of uint8, its state pages.
    """

    def __init__(self, cfg: LlamaConfig, num_blocks: int, block_size: int, tp: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cuda", num_states: int = 0,
                 spec: CacheSpec | None = None) -> None:
        """``spec``: kvstate's spec of these caches; with group tables (``kvstate._tables``) a
        block is a page of layer slots the groups share, and a request's table has a column
        per group."""
        if not cfg.latent and cfg.kv_heads % tp:
            raise ValueError(f"kv_heads {cfg.kv_heads} do not split over {tp} ranks")
        if cfg.state_bytes % tp:
            raise ValueError(f"a state layer's {cfg.state_bytes} bytes do not split over {tp} ranks")
        self.block_size, self.tp = block_size, tp
        self.slot = {layer: i for i, layer in enumerate(cfg.paged_layers)}  #: a paged layer's index in ``caches``
        share = len(cfg.state_layers) * cfg.state_bytes // tp
        self.states = [torch.zeros((num_states, share), dtype=torch.uint8, device=device)
                       for _ in range(tp)] if share else []
        self.replicated = bool(cfg.latent)  #: MLA: one latent head, the same on every rank
        self.heads_per_rank = 1 if cfg.latent else cfg.kv_heads // tp
        kinds = ("key",) if cfg.latent else ("key", "value")
        shape = (num_blocks, self.heads_per_rank, block_size, cfg.latent or cfg.head_dim)
        tables = spec is not None and spec.group_tables
        slots = slot_of_layer(spec) if tables else tuple(range(len(self.slot)))  # type: ignore[arg-type]
        #: a paged layer's column in a request's table (with group tables: its group's)
        self.column = table_of_layer(spec) if tables else (0,) * len(self.slot)  # type: ignore[arg-type]

        def layers() -> list[torch.Tensor]:
            pages = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(max(slots) + 1)]
            return [pages[s] for s in slots]

        self.caches = [{kind: layers() for kind in kinds} for _ in range(tp)]

    def _table(self, table: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s blocks of a request's table (its group's column, with group tables)."""
        return table if table.dim() == 1 else table[:, self.column[self.slot[layer]]]

    def state(self, page: int) -> torch.Tensor:
        """State page ``page``'s bytes, every rank's share in rank order (a new tensor)."""
        return torch.cat([s[page] for s in self.states])

    def put_state(self, page: int, data: torch.Tensor) -> None:
        """Write a request's whole state (uint8) into page ``page``, an equal share a rank."""
        for r, part in enumerate(data.view(self.tp, -1)):
            self.states[r][page].copy_(part)

    def copy_state(self, src: int, dst: int) -> None:
        """Copy state page ``src`` to ``dst`` on every rank (a checkpoint)."""
        for s in self.states:
            s[dst].copy_(s[src])

    def put(self, layer: int, kind: str, table: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x`` ``[m, kv_heads, head_dim]`` for positions ``pos`` of the request (MLA:
        ``[m, 1, latent]``, on every rank)."""
        blk, off = self._table(table, layer)[pos // self.block_size], pos % self.block_size
        h, slot = self.heads_per_rank, self.slot[layer]
        for r, by_kind in enumerate(self.caches):
            part = x if self.replicated else x[:, r * h:(r + 1) * h]
            by_kind[kind][slot][blk, :, off, :] = part.to(by_kind[kind][slot].dtype)

    def get(self, layer: int, kind: str, table: torch.Tensor, length: int, first: int = 0,
            rank: int | None = None) -> torch.Tensor:
        """The request's positions ``first..length-1`` (``first`` on a block boundary),
        ``[kv_heads, length - first, head_dim]`` in float32: every rank's heads, or ``rank``'s."""
        nblk, lo = -(-length // self.block_size), first // self.block_size
        parts = []
        for by_kind in self.caches if rank is None else self.caches[rank:rank + 1]:
            pages = by_kind[kind][self.slot[layer]][self._table(table, layer)[lo:nblk]]  # [nblk - lo, h, bs, d]
            parts.append(pages.permute(1, 0, 2, 3).reshape(pages.shape[1], -1, pages.shape[3])[:, :length - first])
        return torch.cat(parts, 0).float()


class Model(Protocol):
    """What the engine asks of a model: its cache's shape, and a forward over one chunk of a
    request's tokens that reads and writes the request's pages (``TinyLlama``, and
    transformers' models in ``hf.py``)."""

    cfg: LlamaConfig

    def forward(self, tokens: list[int], start: int, cache: PagedCache, table: list[int],
                on_layer: Callable[[int], None] | None = None, state: int | None = None) -> torch.Tensor:
        """The last token's logits; ``state``: the request's state page (a hybrid model:
        read at ``start > 0``, written with the state after the chunk)."""


class TinyLlama:
    """The model's forward over one chunk of a request's tokens (a prefill chunk, a decode step)."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, device: str = "cuda") -> None:
        self.cfg = cfg
        g = torch.Generator(device="cpu").manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[0])).to(device)

        c = cfg
        self.embed = torch.randn(c.vocab, c.hidden, generator=g).to(device)

        def attention() -> dict[str, torch.Tensor]:
            if not c.latent:
                return dict(wq=w(c.hidden, c.heads * c.head_dim), wk=w(c.hidden, c.kv_heads * c.head_dim),
                            wv=w(c.hidden, c.kv_heads * c.head_dim))
            return dict(wq=w(c.hidden, c.heads * (c.head_dim + c.rope_dim)), wdkv=w(c.hidden, c.latent),
                        kv_norm=1 + 0.1 * torch.randn(c.kv_lora_rank, generator=g).to(device),
                        wuk=w(c.kv_lora_rank, c.heads * c.head_dim), wuv=w(c.kv_lora_rank, c.heads * c.head_dim))

        self.layers = [dict(norm1=1 + 0.1 * torch.randn(c.hidden, generator=g).to(device), **attention(),
                            wo=w(c.heads * c.head_dim, c.hidden),
                            norm2=1 + 0.1 * torch.randn(c.hidden, generator=g).to(device),
                            wg=w(c.hidden, c.ffn), wu=w(c.hidden, c.ffn), wd=w(c.ffn, c.hidden))
                       for _ in range(c.layers)]
        self.norm = torch.ones(c.hidden, device=device)
        self.lm_head = w(c.hidden, c.vocab)
        self.inv_freq = {d: (1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(device)
                         for d in {c.head_dim, c.rope_dim}}

    def on(self, device: str) -> TinyLlama:
        """The same model with its weights on ``device`` (D's GPU, when P and D have one each)."""
        other = copy.copy(self)
        other.embed, other.norm, other.lm_head = (t.to(device) for t in (self.embed, self.norm, self.lm_head))
        other.layers = [{k: v.to(device) for k, v in layer.items()} for layer in self.layers]
        other.inv_freq = {d: v.to(device) for d, v in self.inv_freq.items()}
        return other

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * weight

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.float()[:, None] * self.inv_freq[x.shape[-1]][None, :]  # [m, d/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

    def _visible(self, layer: int, pos: torch.Tensor, first: int, length: int) -> torch.Tensor:
        """``[m, length - first]``: which gathered positions each query may attend to."""
        keys = torch.arange(first, length, device=pos.device)[None, :]
        seen = pos[:, None] >= keys
        if layer in self.cfg.window_layers:
            seen &= pos[:, None] - keys < self.cfg.window
        return seen

    def _gqa(self, i: int, p: dict[str, torch.Tensor], h: torch.Tensor, pos: torch.Tensor, start: int,
             cache: PagedCache, tab: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention of layer ``i`` over a chunk from ``start``: ``[m, heads, head_dim]``."""
        c, m = self.cfg, len(pos)
        length = start + m
        q = self._rope((h @ p["wq"]).view(m, c.heads, c.head_dim), pos)
        cache.put(i, "key", tab, pos, self._rope((h @ p["wk"]).view(m, c.kv_heads, c.head_dim), pos))
        cache.put(i, "value", tab, pos, (h @ p["wv"]).view(m, c.kv_heads, c.head_dim))
        first = c.first_position(i, start, cache.block_size)
        k = cache.get(i, "key", tab, length, first).repeat_interleave(c.heads // c.kv_heads, 0)
        v = cache.get(i, "value", tab, length, first).repeat_interleave(c.heads // c.kv_heads, 0)
        s = torch.einsum("mhd,hld->hml", q, k) / math.sqrt(c.head_dim)
        a = torch.softmax(s.masked_fill(~self._visible(i, pos, first, length), float("-inf")), -1)
        return torch.einsum("hml,hld->mhd", a, v)

    def _mla(self, i: int, p: dict[str, torch.Tensor], h: torch.Tensor, pos: torch.Tensor, start: int,
             cache: PagedCache, tab: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention of layer ``i`` over a chunk from ``start``: each TP
        rank's heads from its own copy of the latent cache; ``[m, heads, head_dim]``. Every
        rank's pass computes all heads and keeps its own, so the arithmetic, and the result
        bit for bit, does not depend on the TP degree."""
        c, m = self.cfg, len(pos)
        length = start + m
        q = (h @ p["wq"]).view(m, c.heads, c.head_dim + c.rope_dim)
        q_nope, q_pe = q[..., :c.head_dim], self._rope(q[..., c.head_dim:], pos)
        lat = h @ p["wdkv"]
        k_pe = self._rope(lat[:, None, c.kv_lora_rank:], pos)[:, 0]
        cache.put(i, "key", tab, pos, torch.cat((self._rms(lat[:, :c.kv_lora_rank], p["kv_norm"]), k_pe), -1)[:, None])
        per_rank, out = c.heads // cache.tp, []
        for r in range(cache.tp):
            cached = cache.get(i, "key", tab, length, 0, rank=r)[0]  # [length, latent]
            ckv, kpe = cached[:, :c.kv_lora_rank], cached[:, c.kv_lora_rank:]
            k = (ckv @ p["wuk"]).view(length, c.heads, c.head_dim)
            v = (ckv @ p["wuv"]).view(length, c.heads, c.head_dim)
            s = (torch.einsum("mhd,lhd->hml", q_nope, k)
                 + torch.einsum("mhd,ld->hml", q_pe, kpe)) / math.sqrt(c.head_dim + c.rope_dim)
            a = torch.softmax(s.masked_fill(~self._visible(i, pos, 0, length), float("-inf")), -1)
            out.append(torch.einsum("hml,lhd->mhd", a, v)[:, r * per_rank:(r + 1) * per_rank])
        return torch.cat(out, 1)

    @torch.no_grad()
    def forward(self, tokens: list[int], start: int, cache: PagedCache, table: list[int],
                on_layer: Callable[[int], None] | None = None, state: int | None = None) -> torch.Tensor:
        """Run ``tokens`` at positions ``start..``, writing their keys and values into the
        request's pages (``table``), attending to every position before them; returns the
        logits of the last token (float32). ``on_layer(i)`` runs once layer ``i`` is launched."""
        c, dev = self.cfg, self.embed.device
        m, length = len(tokens), start + len(tokens)
        pos = torch.arange(start, length, device=dev)
        tab = torch.tensor(table, dtype=torch.long, device=dev)
        x = self.embed[torch.tensor(tokens, device=dev)]
        for i, p in enumerate(self.layers):
            h = self._rms(x, p["norm1"])
            attend = self._mla if c.latent else self._gqa
            x = x + attend(i, p, h, pos, start, cache, tab).reshape(m, -1) @ p["wo"]
            h = self._rms(x, p["norm2"])
            x = x + (torch.nn.functional.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]
            if on_layer is not None:
                on_layer(i)
        return self._rms(x[-1:], self.norm)[0] @ self.lm_head

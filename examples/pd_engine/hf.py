"""transformers' own models served on kvstate's pages: Gemma 2 (sliding-window layers
interleaved with full-attention ones), Mistral (a sliding window on every layer), DeepSeek-V2
(multi-head latent attention, MoE) and Qwen3-Next (gated linear-attention layers, whose state
has a fixed size, beside full-attention ones; MoE).

An HF model keeps its keys and values in a ``Cache`` object for the life of a generation.
Here the request's pages (:class:`model.PagedCache`, the layout kvstate moves) are the only
cache that outlives a forward: each forward gets a fresh HF cache filled from the pages, and
every key and value a layer adds is written back into the pages as the layer runs. P's write,
the store, D's read, a write-back and a recompute therefore move exactly what the model
computes with, and the engine (``engine.py``) serves :class:`HFModel` as it serves its own
``TinyLlama``.

What the pages hold per layer and token:

- Gemma 2 and Mistral: the keys (after rotary) and values of the layer's KV heads, split over TP ranks;
  a sliding layer's pages before its window are never gathered (D need not read them): the
  HF cache gets zeros there, positions its sliding mask hides.
- DeepSeek-V2: what transformers' DeepSeek-V2 caches, the normalised latent
  (``kv_lora_rank`` values) and the rotated key part (``qk_rope_head_dim``), side by side in
  one "head", the same on every TP rank (kvstate's ``latent`` group: stored once).
- Qwen3-Next: its full-attention layers' keys and values as Gemma 2's; its linear-attention
  layers keep no pages. Their state (each layer's causal-convolution window, bf16, and its
  gated-delta-rule matrix, float32, as transformers keeps them) is the request's state page
  (kvstate's ``state`` group): read into the HF cache before a forward at a position past 0,
  written back after it, so it is always the state after the tokens computed so far.

Why a run equals transformers' own run bit for bit (:func:`native`, HF's ``DynamicCache``, the
same chunks): the HF cache a forward sees holds the same bytes, in tensors of the same shapes,
as the one a native run would have grown; a sliding layer keeps its last ``window - 1``
tokens either way, all gathered from the pages.

Weights are random from a seed (``torch.manual_seed``), configs are written here: nothing is
downloaded.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from model import LlamaConfig, PagedCache
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

__all__ = ["HFModel", "PagesCache", "gemma2", "mistral", "deepseek_v2", "qwen3_next", "native"]

Sink = Callable[[int, torch.Tensor, torch.Tensor], None]
#: the dtypes of a Qwen3-Next linear-attention layer's two state tensors, as transformers keeps
#: them: the convolution window (the model's bf16) and the recurrent matrix (float32)
STATE_DTYPES = (torch.bfloat16, torch.float32)


class PagesCache(DynamicCache):
    """An HF ``DynamicCache`` that hands each layer's new keys and values to ``sink(layer,
    keys, values)`` before caching them (``sink`` is set once the cache holds the past)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.sink: Sink | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sink is not None:
            self.sink(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def linear_state_shapes(config: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A Qwen3-Next linear-attention layer's state as transformers keeps it for one request: the
    convolution's window over the mixed q, k, v (bf16) and the recurrent matrix (float32)."""
    k = config.linear_num_key_heads * config.linear_key_head_dim
    v = config.linear_num_value_heads * config.linear_value_head_dim
    return ((1, 2 * k + v, config.linear_conv_kernel_dim),
            (1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim))


def shape_of(config: Any, checkpoint: int = 0) -> LlamaConfig:
    """The cache's shape as the engine's ``PagedCache`` and ``cache_spec`` read it
    (``checkpoint``: tokens between a hybrid model's stored states)."""
    layers, types = config.num_hidden_layers, getattr(config, "layer_types", None)
    if types and "linear_attention" in types:
        return LlamaConfig(vocab=config.vocab_size, hidden=config.hidden_size, layers=layers,
                           heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                           head_dim=config.head_dim, checkpoint=checkpoint,
                           state_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                           state_bytes=sum(math.prod(shape) * dtype.itemsize
                                           for shape, dtype in zip(linear_state_shapes(config), STATE_DTYPES)))
    if not types:  # Mistral: a sliding window on every layer, if any
        types = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * layers
    if getattr(config, "kv_lora_rank", None):
        return LlamaConfig(vocab=config.vocab_size, hidden=config.hidden_size, layers=layers,
                           heads=config.num_attention_heads, kv_heads=1, kv_lora_rank=config.kv_lora_rank,
                           rope_dim=config.qk_rope_head_dim)
    window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return LlamaConfig(vocab=config.vocab_size, hidden=config.hidden_size, layers=layers,
                       heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, window=config.sliding_window if window_layers else 0,
                       window_layers=window_layers)


class HFModel:
    """A transformers causal LM (bf16, eager attention) whose cache is the request's pages."""

    def __init__(self, hf: Any, checkpoint: int = 0) -> None:
        self.hf = hf.eval()
        self.cfg = shape_of(hf.config, checkpoint)
        self.device = next(hf.parameters()).device
        self._on_layer: Callable[[int], None] | None = None
        for i, layer in enumerate(hf.model.layers):  # a layer-wise save hears of each layer once it ran
            layer.register_forward_hook(lambda _m, _a, _o, i=i: self._on_layer(i) if self._on_layer else None)

    @torch.no_grad()
    def forward(self, tokens: list[int], start: int, cache: PagedCache, table: list[int],
                on_layer: Callable[[int], None] | None = None, state: int | None = None) -> torch.Tensor:
        """Run ``tokens`` at positions ``start..`` over the pages of positions before them,
        writing their keys and values into the pages; the last token's logits (float32).
        A hybrid model's state comes from state page ``state`` and goes back to it."""
        if self.cfg.state_layers and state is None:
            raise RuntimeError("a hybrid model's forward needs the request's state page")
        tab = torch.tensor(table, dtype=torch.long, device=self.device)
        past = PagesCache(self.hf.config)
        if start:
            for i in self.cfg.paged_layers:
                past.update(*self._gather(cache, tab, i, start), i)
            if self.cfg.state_layers:
                self._load_state(past, cache.state(state))
        pos = torch.arange(start, start + len(tokens), device=self.device)
        past.sink = lambda i, k, v: self._put(cache, tab, i, pos, k, v)
        self._on_layer = on_layer
        try:
            out = self.hf(input_ids=torch.tensor([tokens], device=self.device), position_ids=pos[None],
                          past_key_values=past, use_cache=True)
        finally:
            self._on_layer = None
        if self.cfg.state_layers:
            cache.put_state(state, self._state_of(past))
        return out.logits[0, -1].float()

    def _load_state(self, past: PagesCache, flat: torch.Tensor) -> None:
        """Put a state page's bytes into the linear-attention layers of ``past``, as if it had
        computed the tokens before (transformers then continues from that state)."""
        off = 0
        for i in self.cfg.state_layers:
            parts = []
            for shape, dtype in zip(linear_state_shapes(self.hf.config), STATE_DTYPES):
                n = math.prod(shape) * dtype.itemsize
                parts.append(flat[off:off + n].clone().view(dtype).view(shape))
                off += n
            layer = past.layers[i]
            layer.lazy_initialization(conv_states=parts[0], recurrent_states=parts[1])
            layer.conv_states[0].copy_(parts[0])
            layer.recurrent_states[0].copy_(parts[1])
            layer.has_previous_state[0] = True

    def _state_of(self, past: PagesCache) -> torch.Tensor:
        """The linear-attention layers' state in ``past`` after a forward, as a page's bytes."""
        parts = []
        for i in self.cfg.state_layers:
            layer = past.layers[i]
            for t, dtype in zip((layer.conv_states[0], layer.recurrent_states[0]), STATE_DTYPES):
                if t is None or t.dtype != dtype:
                    raise RuntimeError(f"layer {i}: this transformers keeps a linear-attention state of "
                                       f"{None if t is None else t.dtype}, not {dtype}")
                parts.append(t.contiguous().view(torch.uint8).flatten())
        flat = torch.cat(parts)
        if flat.numel() != len(self.cfg.state_layers) * self.cfg.state_bytes:
            raise RuntimeError(f"the linear-attention state is {flat.numel()} bytes, the config says "
                               f"{len(self.cfg.state_layers) * self.cfg.state_bytes}")
        return flat

    def _gather(self, cache: PagedCache, tab: torch.Tensor, layer: int, start: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s cache of positions ``0..start-1`` as HF holds it: ``[1, heads,
        start, dim]`` keys and values (MLA: the latent and the rotated key part)."""
        c, dtype = self.cfg, self.hf.dtype
        if c.latent:
            copies = [cache.get(layer, "key", tab, start, 0, rank=r) for r in range(cache.tp)]
            for r, other in enumerate(copies[1:], 1):
                if not torch.equal(copies[0], other):
                    raise RuntimeError(f"layer {layer}: rank {r}'s copy of the latent differs from rank 0's")
            lat = copies[0].to(dtype)[None]  # [1, 1, start, latent]
            return lat[..., :c.kv_lora_rank].contiguous(), lat[..., c.kv_lora_rank:].contiguous()
        first = c.first_position(layer, start, cache.block_size)
        out = []
        for kind in ("key", "value"):
            part = cache.get(layer, kind, tab, start, first).to(dtype)  # [kv_heads, start - first, dim]
            full = torch.zeros((c.kv_heads, start, c.head_dim), dtype=dtype, device=part.device)
            full[:, first:] = part  # before a window: positions the sliding mask hides
            out.append(full[None])
        return tuple(out)

    def _put(self, cache: PagedCache, tab: torch.Tensor, layer: int, pos: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
        if self.cfg.latent:  # [1, 1, m, rank] and [1, 1, m, rope]: one head of both
            if k.shape[1] != 1 or k.shape[-1] != self.cfg.kv_lora_rank:
                raise RuntimeError(f"this transformers' DeepSeek-V2 caches keys of shape {tuple(k.shape)}, not "
                                   "the latent: it needs transformers 5")
            cache.put(layer, "key", tab, pos, torch.cat((k, v), -1)[0].transpose(0, 1))
            return
        cache.put(layer, "key", tab, pos, k[0].transpose(0, 1))  # [m, kv_heads, dim]
        cache.put(layer, "value", tab, pos, v[0].transpose(0, 1))


def _built(model_cls: Any, config: Any, seed: int, device: str, checkpoint: int = 0) -> HFModel:
    torch.manual_seed(seed)
    return HFModel(model_cls(config).to(device=device, dtype=torch.bfloat16), checkpoint)


def gemma2(seed: int = 0, window: int = 64, layers: int = 4, device: str = "cuda") -> HFModel:
    """A small Gemma 2: a ``window``-token sliding window on every other layer (from layer 0),
    full attention on the others, logit soft-capping, GQA of 8 heads over 4 KV heads."""
    config = Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32, query_pre_attn_scalar=32,
                          sliding_window=window, max_position_embeddings=8192, initializer_range=0.1,
                          tie_word_embeddings=False, attn_implementation="eager")
    return _built(Gemma2ForCausalLM, config, seed, device)


def mistral(seed: int = 0, window: int = 64, layers: int = 4, device: str = "cuda") -> HFModel:
    """A small Mistral: a ``window``-token sliding window on every layer, so a decoding request
    frees the blocks wholly behind it (``CacheSpec.frees_behind_window``)."""
    config = MistralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=32, sliding_window=window,
                           max_position_embeddings=8192, initializer_range=0.1, tie_word_embeddings=False,
                           attn_implementation="eager")
    return _built(MistralForCausalLM, config, seed, device)


def deepseek_v2(seed: int = 0, layers: int = 4, device: str = "cuda") -> HFModel:
    """A small DeepSeek-V2-Lite: MLA (a latent of 64 + 16 rotated values a token, no query
    compression), a dense first layer and MoE after it (8 routed experts, top 2, one shared)."""
    config = DeepseekV2Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                              num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                              kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
                              v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=1, max_position_embeddings=8192, initializer_range=0.1,
                              tie_word_embeddings=False, attn_implementation="eager")
    return _built(DeepseekV2ForCausalLM, config, seed, device)


def qwen3_next(seed: int = 0, layers: int = 4, checkpoint: int = 64, device: str = "cuda") -> HFModel:
    """A small Qwen3-Next: three gated linear-attention (gated delta rule) layers, then a gated
    full-attention one, MoE everywhere (8 experts, top 2, a shared one). Its state is stored
    every ``checkpoint`` tokens of a prompt, and at the prompt's end."""
    config = Qwen3NextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
                             linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                             linear_num_value_heads=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                             num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                             max_position_embeddings=8192, initializer_range=0.1, tie_word_embeddings=False,
                             attn_implementation="eager")
    return _built(Qwen3NextForCausalLM, config, seed, device, checkpoint)


@torch.no_grad()
def native(model: HFModel, prompt: list[int], max_new: int, block_size: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own run, with its own ``DynamicCache``: the prompt in chunks ending on
    block boundaries (as the engine computes it), then greedy decode a token at a time."""
    hf, dev = model.hf, model.device
    past = DynamicCache(config=hf.config)

    def run(tokens: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(tokens), device=dev)[None]
        out = hf(input_ids=torch.tensor([tokens], device=dev), position_ids=pos, past_key_values=past, use_cache=True)
        return out.logits[0, -1].float()

    start, logits = 0, []
    while start < len(prompt):
        end = min(len(prompt), (start // block_size + 1) * block_size)
        last = run(prompt[start:end], start)
        start = end
    logits.append(last)
    tokens = [int(torch.argmax(last))]
    while len(tokens) < max_new:
        logits.append(run(tokens[-1:], len(prompt) + len(tokens) - 1))
        tokens.append(int(torch.argmax(logits[-1])))
    return tokens, logits

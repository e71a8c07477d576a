"""A Llama-3-8B-shaped decoder in plain PyTorch, run the way an optimised serving engine runs it.

Fused QKV and gate-up projections, flash attention (SDPA) for a prefill, a static KV cache per
decode batch, and every forward captured once in a CUDA graph and replayed, so host work does
not set the step time. Seeded random weights in bfloat16; nothing is downloaded. Used by
``benchmarks/model_calibration.py`` (``--engine fast``) to time prefills and decode steps; run
alone, it times one prefill and one decode step:

    python3 benchmarks/fast_llama.py [--layers 32] [--prompt 4096] [--batch 32] [--context 2048]
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["FastLlama"]

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256


class FastLlama:
    """``layers`` decoder layers of Llama-3-8B's shape on the current CUDA device."""

    def __init__(self, torch: Any, layers: int = 32, seed: int = 0) -> None:
        self.torch, self.F = torch, torch.nn.functional
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def w(*shape: int) -> Any:
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02

        def ones() -> Any:
            return torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [dict(ln1=ones(), qkv=w(HIDDEN, qkv), o=w(HEADS * HEAD_DIM, HIDDEN), ln2=ones(),
                            gu=w(HIDDEN, 2 * INTER), down=w(INTER, HIDDEN)) for _ in range(layers)]
        self.emb, self.norm, self.head = w(VOCAB, HIDDEN), ones(), w(HIDDEN, VOCAB)
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
        ang = torch.outer(torch.arange(32768, device="cuda").float(), inv)
        self.cos, self.sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)

    def rope(self, x: Any, pos: slice) -> Any:
        cos, sin, half = self.cos[pos], self.sin[pos], HEAD_DIM // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    def mlp(self, x: Any, lw: dict) -> Any:
        g, u = (self.F.rms_norm(x, (HIDDEN,), lw["ln2"], 1e-5) @ lw["gu"]).chunk(2, -1)
        return x + (self.F.silu(g) * u) @ lw["down"]

    def qkv(self, x: Any, lw: dict, pos: slice) -> tuple[Any, Any, Any]:
        b, t = x.shape[:2]
        q, k, v = (self.F.rms_norm(x, (HIDDEN,), lw["ln1"], 1e-5) @ lw["qkv"]).split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q = q.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return self.rope(q, pos), self.rope(k, pos), v.view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)

    def prefill(self, ids: Any, kv: list | None = None, on_layer: Any = None) -> Any:
        """One prompt ``[1, T]``: the last token's logits (flash attention over the prompt); each
        layer's K and V ``[1, KV_HEADS, T, HEAD_DIM]`` are appended to ``kv`` when given, and
        handed to ``on_layer(i, k, v)`` once layer ``i`` is launched (an engine's paged write)."""
        x, t, rep = self.emb[ids], ids.shape[1], HEADS // KV_HEADS
        for i, lw in enumerate(self.layers):
            q, k, v = self.qkv(x, lw, slice(0, t))
            if kv is not None:
                kv.append((k, v))
            a = self.F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                    is_causal=True)
            x = self.mlp(x + a.transpose(1, 2).reshape(1, t, HEADS * HEAD_DIM) @ lw["o"], lw)
            if on_layer is not None:
                on_layer(i, k, v)
        return self.F.rms_norm(x[:, -1:], (HIDDEN,), self.norm, 1e-5) @ self.head

    def decode_caches(self, batch: int, context: int) -> list[tuple[Any, Any]]:
        """Static K and V caches per layer for ``batch`` requests of ``context`` tokens plus one."""
        shape = (batch, KV_HEADS, context + 1, HEAD_DIM)
        return [(self.torch.randn(shape, device="cuda", dtype=self.torch.bfloat16),
                 self.torch.randn(shape, device="cuda", dtype=self.torch.bfloat16)) for _ in self.layers]

    def decode(self, tok: Any, caches: list[tuple[Any, Any]], before_layer: Any = None) -> Any:
        """One step for ``tok`` ``[B, 1]`` at position ``context`` of ``caches``: logits.
        ``before_layer(i)`` runs before layer ``i`` is launched (an engine filling its caches)."""
        x = self.emb[tok]
        for i, (kc, vc) in enumerate(caches):
            if before_layer is not None:
                before_layer(i)
            x = self.decode_layer(i, x, kc, vc)
        return self.F.rms_norm(x, (HIDDEN,), self.norm, 1e-5) @ self.head

    def decode_layer(self, i: int, x: Any, kc: Any, vc: Any) -> Any:
        """Layer ``i`` of a step: ``x`` ``[B, 1, HIDDEN]`` at position ``context`` of its static
        caches ``kc``, ``vc`` (whose last slot takes the new key and value); the layer's output."""
        lw, b, c = self.layers[i], x.shape[0], kc.shape[2] - 1
        q, k, v = self.qkv(x, lw, slice(c, c + 1))
        kc[:, :, c:] = k
        vc[:, :, c:] = v
        # a KV head's query group as that many query rows (no mask): each KV head is read
        # once for its group, as a decode kernel does
        a = self._decode_attention(q.reshape(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), kc, vc)
        return self.mlp(x + a.reshape(b, 1, HEADS * HEAD_DIM) @ lw["o"], lw)

    def _decode_attention(self, q: Any, k: Any, v: Any) -> Any:
        """Flash attention, which splits a long context over the SMs, when the batch's KV heads
        are too few to fill them (a serving engine's split-KV decode); else the default kernel,
        faster for big batches (measured on the H100)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if q.shape[0] * KV_HEADS < self.torch.cuda.get_device_properties(q.device).multi_processor_count:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return self.F.scaled_dot_product_attention(q, k, v)
        return self.F.scaled_dot_product_attention(q, k, v)

    def graphed(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` captured in a CUDA graph (after warm-up on a side stream): its replay."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            fn(*args)
        return graph.replay


def replay_ms(torch: Any, replay: Any, reps: int = 10) -> float:
    """Median milliseconds of one replay, timed between CUDA events."""
    replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check(torch: Any, m: FastLlama, prompt: int = 300) -> float:
    """The decode path against the prefill path: the prompt's last token decoded over the cache
    of the tokens before it gives the prompt's logits; returns the largest difference."""
    ids = torch.randint(0, VOCAB, (1, prompt), device="cuda")
    with torch.no_grad():
        want = m.prefill(ids).float()
        kv: list = []
        m.prefill(ids[:, :-1], kv)
        caches = m.decode_caches(1, prompt - 1)
        for (kc, vc), (k, v) in zip(caches, kv):
            kc[:, :, :-1], vc[:, :, :-1] = k, v
        got = m.decode(ids[:, -1:], caches).float()
    return float((got - want).abs().max() / want.abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    args = ap.parse_args()
    import torch

    m = FastLlama(torch, args.layers)
    print(f"decode against prefill logits: largest difference {check(torch, m):.4f} of the largest logit")
    ids = torch.randint(0, VOCAB, (1, args.prompt), device="cuda")
    print(f"prefill of {args.prompt} tokens: {replay_ms(torch, m.graphed(m.prefill, ids)):.2f} ms")
    tok = torch.randint(0, VOCAB, (args.batch, 1), device="cuda")
    step = m.graphed(m.decode, tok, m.decode_caches(args.batch, args.context))
    print(f"decode step of {args.batch} x {args.context} tokens: {replay_ms(torch, step):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FastLlama as a serving engine runs it, for ``benchmarks/engine_sim.py``: paged caches, and
one CUDA graph per shape bucket, all captured before serving starts.

- **Prefill**: a prompt is padded to a multiple of ``PREFILL_BUCKET`` tokens. The pad tokens
  come last, so the causal mask keeps them out of every real token's attention. Each bucket's
  forward, with its writes into P's pages, is one graph; pages past the prompt's own blocks
  go to a scratch block the lifecycle never hands out.
- **Decode**: a batch is padded to a batch bucket, its context to a multiple of
  ``CONTEXT_BUCKET`` positions (masked). Each (batch, context) bucket's step is one graph.
  Padded rows use free slots, at position 0, which a request's load overwrites.

Eager PyTorch would not do: its launches set a decode step's time (about 21 ms at batch 1,
against 8 ms graphed, measured on the H100), and each new prompt length or context costs
tens of ms the first time it is seen. The graphs share one memory pool and replay one at a
time. Attention is flash or memory-efficient only (cuDNN's builds a plan per shape).

:class:`DryModel` stands in for it on a CPU (it sleeps); :func:`forwards` times a model's
prefills and steps alone, and :func:`fitted` fits the simulator's compute model on them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
from fast_llama import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, FastLlama

__all__ = ["ServedLlama", "DryModel", "forwards", "fitted", "PREFILL_BUCKET", "CONTEXT_BUCKET"]

PREFILL_BUCKET, CONTEXT_BUCKET, BLOCK, SPLIT = 128, 512, 64, 256


def _up(n: int, step: int) -> int:
    return -(-n // step) * step


class ServedLlama:
    """The model, P's pages (plus a scratch block), D's pages, D's slots, and the graphs."""

    def __init__(self, torch: Any, p_blocks: int, d_blocks: int, slots: int, context: int, max_prompt: int,
                 layers: int = 32, split_kv: bool = True) -> None:
        self.torch, self.model, self.p_blocks = torch, FastLlama(torch, layers), p_blocks
        self.split_kv = split_kv
        z = torch.zeros

        def paged(n: int) -> dict[str, list[Any]]:
            return {k: [z((n, KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
                    for k in ("key", "value")}
        self.p_pages, self.d_cache = paged(p_blocks + 1), paged(d_blocks)
        #: what the lifecycle and the backend see of P's pages: all but the scratch block
        self.p_cache = {k: [x[:p_blocks] for x in xs] for k, xs in self.p_pages.items()}
        self.context = _up(context, CONTEXT_BUCKET)
        self.slots = [[z((slots, KV_HEADS, self.context, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
                       for _ in range(2)] for _ in range(layers)]
        self.max_prompt = _up(max_prompt, PREFILL_BUCKET)
        long = dict(dtype=torch.long, device="cuda")
        self.ids, self.tab = z((1, self.max_prompt), **long), z(self.max_prompt // BLOCK, **long)
        self.last, self.tok = z(1, **long), z(1, **long)
        self.dtok, self.dpos, self.dout = z((slots, 1), **long), z(slots, **long), z(slots, **long)
        #: the last step's logits per slot, and the last prefill's (float32), for checks
        self.logits = z((slots, self.model.head.shape[1]), dtype=torch.float32, device="cuda")
        self.prefill_logits = z(self.model.head.shape[1], dtype=torch.float32, device="cuda")
        self.heads = torch.arange(KV_HEADS, device="cuda")[None, :]
        self.rows = torch.arange(slots, device="cuda")[:, None]
        self.positions = torch.arange(self.context, device="cuda")[None, :]
        self.batches = sorted({b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if b < slots} | {slots})
        self.pool, self.done = torch.cuda.graph_pool_handle(), torch.cuda.Event()
        self.prefills = {t: self._capture(self._prefill_body, t)
                         for t in range(PREFILL_BUCKET, self.max_prompt + 1, PREFILL_BUCKET)}
        self.steps = {(b, c): self._capture(self._step_body, b, c) for b in self.batches
                      for c in range(CONTEXT_BUCKET, self.context + 1, CONTEXT_BUCKET)}

    def attention(self) -> Any:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])

    def _capture(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` as a graph in the shared pool (run once first on a side stream)."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad(), self.attention():
            fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad(), self.attention():
            fn(*args)
        return graph

    # -- prefill -------------------------------------------------------------------------------
    def _prefill_body(self, t: int) -> None:
        m, F, nb = self.model, self.torch.nn.functional, t // BLOCK
        tab, rep = self.tab[:nb], HEADS // KV_HEADS
        x = m.emb[self.ids[:, :t]]
        for i, lw in enumerate(m.layers):
            q, k, v = m.qkv(x, lw, slice(0, t))
            for kind, y in (("key", k), ("value", v)):  # [1, H, t, D] -> pages [nb, H, BLOCK, D]
                self.p_pages[kind][i][tab] = y[0].reshape(KV_HEADS, nb, BLOCK, HEAD_DIM).transpose(0, 1)
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               is_causal=True)
            x = m.mlp(x + a.transpose(1, 2).reshape(1, t, HIDDEN) @ lw["o"], lw)
        logits = F.rms_norm(x.index_select(1, self.last), (HIDDEN,), m.norm, 1e-5) @ m.head
        self.prefill_logits.copy_(logits.view(-1))
        self.tok.copy_(logits.view(-1).argmax().view(1))

    def prefill(self, toks: list[int], table: list[int]) -> int:
        """Prefill ``toks`` into P's pages ``table``; the first token."""
        self.launch_prefill(toks, table)
        return self.prefill_result()

    def prefill_ready(self) -> bool:
        """Whether the launched prefill finished (the engine answers transfers meanwhile)."""
        return bool(self.done.query())

    def prefill_result(self) -> int:
        return int(self.tok.item())

    def launch_prefill(self, toks: list[int], table: list[int]) -> None:
        """Start the prefill of ``toks`` into P's pages ``table``."""
        torch, n = self.torch, len(toks)
        t, nb = _up(n, PREFILL_BUCKET), -(-n // BLOCK)
        self.ids[0, :t] = torch.tensor(toks + [0] * (t - n))
        self.tab[:t // BLOCK] = torch.tensor(list(table[:nb]) + [self.p_blocks] * (t // BLOCK - nb))
        self.last.fill_(n - 1)
        self.prefills[t].replay()
        self.done.record()

    # -- decode --------------------------------------------------------------------------------
    def _step_body(self, b: int, c: int) -> None:
        m, F = self.model, self.torch.nn.functional
        p = self.dpos[:b]
        # slot s, head h is row s * KV_HEADS + h of a [slots * heads, context, dim] view
        rows = (self.rows[:b] * KV_HEADS + self.heads).reshape(-1)
        at = p[:, None].expand(b, KV_HEADS).reshape(-1)
        mask = (self.positions[:, :c] <= p[:, None]).view(b, 1, 1, c)
        n, rep = c // SPLIT, HEADS // KV_HEADS
        bias = self.torch.where(mask.view(b, 1, n, 1, SPLIT), 0.0, -1e4).to(self.torch.bfloat16)
        bias = bias.expand(b, KV_HEADS, n, rep, SPLIT).reshape(b * KV_HEADS, n, rep, SPLIT)
        x = m.emb[self.dtok[:b]]
        for lw, (kc, vc) in zip(m.layers, self.slots):
            q, k, v = m.qkv(x, lw, p.view(b, 1, 1))
            kc.view(-1, *kc.shape[2:])[rows, at] = k[:, :, 0].reshape(b * KV_HEADS, HEAD_DIM)
            vc.view(-1, *vc.shape[2:])[rows, at] = v[:, :, 0].reshape(b * KV_HEADS, HEAD_DIM)
            q = q.reshape(b, KV_HEADS, -1, HEAD_DIM)
            if self.split_kv:
                a = self._split_kv(q, kc, vc, bias, b, c)
            else:
                a = F.scaled_dot_product_attention(q, kc[:b, :, :c], vc[:b, :, :c], attn_mask=mask)
            x = m.mlp(x + a.reshape(b, 1, HIDDEN) @ lw["o"], lw)
        logits = F.rms_norm(x, (HIDDEN,), m.norm, 1e-5) @ m.head
        self.logits[:b].copy_(logits[:, 0])
        self.dout[:b].copy_(logits[:, 0].argmax(-1))

    def _split_kv(self, q: Any, kc: Any, vc: Any, bias: Any, b: int, c: int) -> Any:
        """Decode attention split over the context, as flash decoding does: each ``SPLIT``
        positions of a (slot, KV head) is one head of a strided view of the slot caches (no
        copy), attended to by the memory-efficient kernel, which also gives each part's
        log-sum-exp; the parts are then combined. Unsplit, a (slot, head) is one thread block
        reading its whole context alone: a step took 3 ms longer at 3k tokens than at 512,
        whatever the batch (H100)."""
        torch, n, rep = self.torch, c // SPLIT, q.shape[2]
        shape, strides = (b * KV_HEADS, n, SPLIT, HEAD_DIM), (self.context * HEAD_DIM, SPLIT * HEAD_DIM, HEAD_DIM, 1)
        k, v = torch.as_strided(kc, shape, strides), torch.as_strided(vc, shape, strides)
        qq = q.reshape(b * KV_HEADS, 1, rep, HEAD_DIM).expand(b * KV_HEADS, n, rep, HEAD_DIM).contiguous()
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qq, k, v, bias, True)[:2]
        lse = lse[..., :rep]  # [b * heads, parts, rep]; a part past a slot's context weighs ~0
        w = torch.exp(lse - torch.logsumexp(lse, 1, keepdim=True))
        return (o.float() * w[..., None]).sum(1).to(q.dtype).view(b, KV_HEADS, rep, HEAD_DIM)

    def step(self, toks: list[int], pos: list[int]) -> list[int]:
        """One decode step of slots ``0 .. len(toks) - 1``: token ``toks[s]`` at position
        ``pos[s]`` of slot ``s``; the next token of each."""
        n = len(toks)
        b = next(x for x in self.batches if x >= n)
        c = _up(max(pos) + 1, CONTEXT_BUCKET)
        pad = [0] * (b - n)
        self.dtok[:b, 0] = self.torch.tensor(toks + pad)
        self.dpos[:b] = self.torch.tensor(pos + pad)
        self.steps[(b, c)].replay()
        self.done.record()
        self.done.synchronize()  # without the GIL, unlike tolist(): the transfer threads run meanwhile
        return self.dout[:n].tolist()

    def load(self, slot: int, table: list[int], n: int) -> None:
        """A request's pages, once read, into its slot's first ``n`` positions."""
        nb = -(-n // BLOCK)
        tab = self.torch.tensor(table[:nb], device="cuda")
        for i, pair in enumerate(self.slots):
            for j, kind in enumerate(("key", "value")):
                pages = self.d_cache[kind][i][tab].transpose(0, 1).reshape(KV_HEADS, nb * BLOCK, HEAD_DIM)
                pair[j][slot, :, :n] = pages[:, :n]

    def move(self, src: int, dst: int, n: int) -> None:
        """Slot ``src``'s first ``n`` positions into slot ``dst``."""
        for pair in self.slots:
            for c in pair:
                c[dst, :, :n] = c[src, :, :n]


class DryModel:
    """A stand-in that sleeps as a roofline would say (CPU runs of this script)."""

    def __init__(self) -> None:
        self.until, self.n = 0.0, 0

    def prefill(self, toks: list[int], table: list[int]) -> int:
        self.launch_prefill(toks, table)
        while not self.prefill_ready():
            time.sleep(0.0005)
        return self.prefill_result()

    def launch_prefill(self, toks: list[int], table: list[int]) -> None:
        self.until, self.n = time.perf_counter() + 0.003 + 2.5e-5 * len(toks), len(toks)

    def prefill_ready(self) -> bool:
        return time.perf_counter() >= self.until

    def prefill_result(self) -> int:
        return self.n % 1000

    def load(self, slot: int, table: list[int], n: int) -> None:
        pass

    def move(self, src: int, dst: int, n: int) -> None:
        pass

    def step(self, toks: list[int], pos: list[int]) -> list[int]:
        time.sleep(0.008 + 2e-8 * sum(pos))
        return [(t + 1) % 1000 for t in toks]


def forwards(model: Any, max_prompt: int, max_context: int, slots: int) -> list[dict[str, Any]]:
    """The engine's own forwards alone, as the compute model's fit takes them: prefills of one
    prompt, decode steps of ``batch`` requests at ``context`` tokens each (median wall ms)."""
    rows: list[dict[str, Any]] = []

    def timed(fn: Any, reps: int) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    for i, n in enumerate(n for n in (256, 512, 768, 1024, 1536, 2048, 2560, 3072) if n <= max_prompt):
        ms = timed(lambda n=n: model.prefill(list(range(n)), list(range(-(-n // BLOCK)))), 3)
        rows.append({"kind": "prefill", "tokens": n, "context": 0, "batch": 1, "measured_ms": ms,
                     "held_out": i % 2 == 1})
    for i, b in enumerate(b for b in (1, 2, 4, 8, 16) if b <= slots):
        for j, c in enumerate(c for c in (512, 1024, 2048, 3072) if c <= max_context):
            ms = timed(lambda b=b, c=c: model.step([1] * b, [c] * b), 5)
            rows.append({"kind": "decode", "tokens": b, "context": c, "batch": b, "measured_ms": ms,
                         "held_out": (i + j) % 2 == 1})  # a checkerboard: both halves span every size
    return rows


def figures_overrides(mfu: float, mbu: float, overhead_ms: float, half_tokens: float) -> dict[str, Any]:
    """The scenario fields the fitted figures set (attention reads the cache at the weights' ``mbu``)."""
    return {"gpu.mfu": mfu, "gpu.mbu": mbu, "gpu.attn_mbu": mbu, "gpu.step_overhead_ms": overhead_ms,
            "gpu.gemm_half_tokens": half_tokens}


def predict(rows: list[dict[str, Any]], mfu: float, mbu: float, overhead_ms: float,
            half_tokens: float) -> np.ndarray:
    """The simulator's compute model's times (ms) for ``rows`` (one GPU) with these figures."""
    from kvstate.sim import Scenario, with_overrides
    from kvstate.sim._compute import ComputeModel

    figures = figures_overrides(mfu, mbu, overhead_ms, half_tokens)
    cm = ComputeModel(with_overrides(Scenario(), {"cluster.tp": 1, **figures}))
    return np.array([1e3 * (cm.prefill_time([(r["tokens"], 0)]) if r["kind"] == "prefill"
                            else cm.decode_step_time(r["batch"], r["batch"] * r["context"])) for r in rows])


#: the GEMM curves' half-efficiency points the fit tries (the engine's GEMMs, not the defaults')
HALF_TOKENS = (24.0, 64.0, 128.0, 192.0, 256.0)


def fit(rows: list[dict[str, Any]]) -> tuple[tuple[float, float, float, float], float]:
    """(mfu, mbu, overhead ms, gemm_half_tokens) minimising the largest relative error over
    ``rows``: a grid over mfu, mbu and the curve's half point, and for each the best overhead
    (a constant added to every step)."""
    meas = np.array([r["measured_ms"] for r in rows])
    ov = np.concatenate([np.arange(0.0, 5.0, 0.05), np.arange(5.0, 40.0, 0.25)])[:, None]
    best: tuple[float, tuple[float, float, float, float]] = (np.inf, (0.0, 0.0, 0.0, 0.0))
    for half in HALF_TOKENS:
        for mfu in np.arange(0.20, 1.001, 0.05):
            for mbu in np.arange(0.30, 1.001, 0.05):
                base = predict(rows, float(mfu), float(mbu), 0.0, half)
                err = np.abs((base[None, :] + ov) / meas - 1).max(-1)
                k = int(np.argmin(err))
                if err[k] < best[0]:
                    figures = (round(float(mfu), 2), round(float(mbu), 2), round(float(ov[k, 0]), 2), half)
                    best = (float(err[k]), figures)
    return best[1], best[0]


def fitted(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The compute model's figures fitted on half the points; its errors on the held-out half.
    (kvstate's own engine against the simulator's structure: the figures describe this engine,
    not the defaults, which are set from published kernel profiles.)"""
    (mfu, mbu, ov, half), fit_err = fit([r for r in rows if not r["held_out"]])
    held = [r for r in rows if r["held_out"]]
    err = predict(held, mfu, mbu, ov, half) / np.array([r["measured_ms"] for r in held]) - 1
    for r, e in zip(held, err):
        r["model_error"] = float(e)
    return {"mfu": mfu, "mbu": mbu, "overhead_ms": ov, "gemm_half_tokens": half, "fit_max_error": fit_err,
            "held_out_max_error": float(np.abs(err).max()), "points": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description="Time the served model's prefills and decode steps alone, and fit "
                                             "the simulator's compute model on half of them (GPU).")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=3072)
    args = ap.parse_args()
    import torch

    m = ServedLlama(torch, -(-args.max_prompt // BLOCK), 16, args.slots, args.max_prompt + 65, args.max_prompt)
    fit = fitted(forwards(m, args.max_prompt, args.max_prompt + 64, args.slots))
    for r in fit["points"]:
        held = f"  held out, model {r['model_error']:+.1%}" if r["held_out"] else ""
        print(f"{r['kind']:<8}{r['tokens']:>6}{r['context']:>6}{r['measured_ms']:>9.2f} ms{held}")
    print(f"mfu {fit['mfu']}, mbu {fit['mbu']}, overhead {fit['overhead_ms']} ms, GEMM half point "
          f"{fit['gemm_half_tokens']:g} tokens; largest error "
          f"{fit['fit_max_error']:.1%} fitted, {fit['held_out_max_error']:.1%} held out")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The simulator's compute model against a real model on this GPU: prints a table, writes JSON.

    python3 benchmarks/model_calibration.py [--engine fast|transformers] [--out FILE] [--quick]

A Llama-3-8B-shaped decoder (32 layers, hidden 4096, 32 heads, 8 KV heads, bfloat16, seeded
random weights, nothing downloaded) is timed on the GPU, as an optimised engine runs it
(``--engine fast``, the default: :mod:`fast_llama`, every forward a CUDA graph replay) or as
eager ``transformers`` with SDPA attention runs it (``--engine transformers``):

- prefill of one prompt, 256 to 16k tokens (the last token's logits only);
- one decode step of ``b`` requests holding ``c`` tokens each, for batches 1 to 256.

Nothing is fitted: the compute model (:mod:`kvstate.sim._compute`) predicts every point from the
model's shapes and the GPU's datasheet through its roofline defaults, and, with ``--profile``,
through kernels measured on the GPU (``kvstate profile``). ``--rows`` compares the points of an
earlier run's JSON again, on any machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstate.sim import Scenario, with_overrides  # noqa: E402
from kvstate.sim._compute import ComputeModel  # noqa: E402

PREFILL = [256, 512, 1024, 2048, 4096, 8192, 12288, 16384]
DECODE = [(1, 1024), (1, 8192), (4, 4096), (8, 1024), (8, 8192), (16, 2048), (32, 1024), (32, 4096),
          (64, 1024), (64, 2048), (128, 512), (128, 1024), (256, 256), (256, 512)]


def build(torch, quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2 if quick else 32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=32768, rope_theta=500000.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    return model


def timed(torch, fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def measure(torch, model, quick: bool) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n in PREFILL[:3] if quick else PREFILL:
            ids = torch.randint(0, 128256, (1, n), device="cuda", generator=gen)
            t = timed(torch, lambda ids=ids: model.lm_head(model.model(ids, use_cache=False).last_hidden_state[:, -1:]))
            rows.append({"kind": "prefill", "tokens": n, "batch": 1, "context": 0, "measured_ms": t * 1e3})
        for b, c in DECODE[:3] if quick else DECODE:
            ids = torch.randint(0, 128256, (b, c), device="cuda", generator=gen)
            past = model.model(ids, use_cache=True).past_key_values
            step = torch.randint(0, 128256, (b, 1), device="cuda", generator=gen)
            # each timed step appends one token per request to the cache: context grows by <1 %
            t = timed(torch, lambda step=step, past=past: model(step, past_key_values=past, use_cache=True), reps=5)
            rows.append({"kind": "decode", "tokens": b, "batch": b, "context": c, "measured_ms": t * 1e3})
            del past
            torch.cuda.empty_cache()
    return rows


def measure_fast(torch, quick: bool) -> list[dict]:
    """The same points on :class:`fast_llama.FastLlama`, each forward captured once and replayed."""
    from fast_llama import VOCAB, FastLlama, check, replay_ms

    diff = check(torch, FastLlama(torch, 2))  # the decode path computes what the prefill path does
    assert diff < 0.05, f"fast_llama: decode and prefill logits differ by {diff:.3f}"  # (bf16 rounding)
    model, rows = FastLlama(torch, 2 if quick else 32), []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n in PREFILL[:3] if quick else PREFILL:
        ids = torch.randint(0, VOCAB, (1, n), device="cuda", generator=gen)
        rows.append({"kind": "prefill", "tokens": n, "batch": 1, "context": 0,
                     "measured_ms": replay_ms(torch, model.graphed(model.prefill, ids))})
        torch.cuda.empty_cache()
    for b, c in DECODE[:3] if quick else DECODE:
        tok = torch.randint(0, VOCAB, (b, 1), device="cuda", generator=gen)
        step = model.graphed(model.decode, tok, model.decode_caches(b, c))
        rows.append({"kind": "decode", "tokens": b, "batch": b, "context": c,
                     "measured_ms": replay_ms(torch, step, reps=20)})
        del step
        torch.cuda.empty_cache()
    return rows


def sim_times(rows: list[dict], figures: dict) -> np.ndarray:
    """The simulator's times (ms) for ``rows`` with these scenario fields (one GPU)."""
    cm = ComputeModel(with_overrides(Scenario(), {"cluster.tp": 1, "gpu.step_overhead_ms": 0.0, **figures}))
    return np.array([1e3 * (cm.prefill_time([(r["tokens"], 0)]) if r["kind"] == "prefill"
                            else cm.decode_step_time(r["batch"], r["batch"] * r["context"])) for r in rows])


def gpu_fields(name: str) -> dict:
    """The datasheet figures of the GPU the points were measured on (a preset)."""
    from kvstate.sim._gpus import gpu_overrides

    key = "H200" if "H200" in name else "H100-SXM"
    return gpu_overrides(key)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--quick", action="store_true", help="2 layers, 3 points a kind (a smoke run)")
    ap.add_argument("--engine", choices=("fast", "transformers"), default="fast",
                    help="fast: plain PyTorch, CUDA graphs (an optimised engine); transformers: eager")
    ap.add_argument("--rows", help="compare the points of an earlier run's JSON (no GPU needed)")
    ap.add_argument("--profile", help="also predict with this measured profile (kvstate profile)")
    args = ap.parse_args()
    if args.rows:
        with open(args.rows) as f:
            old = json.load(f)
        rows, gpu = old["rows"], old["gpu"]
    else:
        import torch

        rows = measure_fast(torch, args.quick) if args.engine == "fast" else \
            measure(torch, build(torch, args.quick), args.quick)
        gpu = torch.cuda.get_device_name(0)
    rows.sort(key=lambda r: (r["kind"], r["tokens"], r["context"]))
    ways = {"roofline": gpu_fields(gpu)}
    if args.profile:
        path = os.path.abspath(args.profile) if os.path.exists(args.profile) else args.profile  # or a shipped one
        ways["profile"] = {**gpu_fields(gpu), "gpu.profile": path}
    for way, figures in ways.items():
        for r, p in zip(rows, sim_times(rows, figures)):
            r[f"{way}_ms"], r[f"{way}_error"] = float(p), float(p / r["measured_ms"] - 1)
    out = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "quick": args.quick, "engine": args.engine,
           "max_error": {w: max(abs(r[f"{w}_error"]) for r in rows) for w in ways},
           "within_10pct": {w: sum(abs(r[f"{w}_error"]) <= 0.10 for r in rows) for w in ways}, "points": len(rows),
           "rows": rows}
    print(f"{gpu}: the compute model (no fitted figure; engine overhead 0: one graph replay a forward)")
    print(f"{'kind':>8} {'tokens/batch':>12} {'context':>8} {'measured ms':>12}" +
          "".join(f" {w + ' ms':>12} {'error':>7}" for w in ways))
    for r in rows:
        print(f"{r['kind']:>8} {r['tokens']:>12} {r['context']:>8} {r['measured_ms']:>12.2f}" +
              "".join(f" {r[f'{w}_ms']:>12.2f} {r[f'{w}_error']:>+7.1%}" for w in ways))
    for w in ways:
        print(f"{w}: {out['within_10pct'][w]} of {len(rows)} within 10 %, max error {out['max_error'][w]:.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

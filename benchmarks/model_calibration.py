"""The simulator's compute model against a real model on this GPU: prints a table, writes JSON.

    python3 benchmarks/model_calibration.py [--engine fast|transformers] [--out FILE] [--quick]

A Llama-3-8B-shaped decoder (32 layers, hidden 4096, 32 heads, 8 KV heads, bfloat16, seeded
random weights, nothing downloaded) is timed on the GPU, as an optimised engine runs it
(``--engine fast``, the default: :mod:`fast_llama`, every forward a CUDA graph replay) or as
eager ``transformers`` with SDPA attention runs it (``--engine transformers``):

- prefill of one prompt, 256 to 16k tokens (the last token's logits only);
- one decode step of ``b`` requests holding ``c`` tokens each, for batches 1 to 256.

The roofline of :mod:`kvstate.sim.compute` has three free figures (``gpu.mfu``, ``gpu.mbu``,
``gpu.step_overhead_ms``). They are fitted on every other point (sorted by kind and size) by a
grid search minimising the largest relative error, and the fit predicts the held-out half.
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
from kvstate.sim.compute import ComputeModel  # noqa: E402

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
    """The simulator's times (ms) for ``rows`` on one GPU with these ``gpu.*`` figures."""
    cm = ComputeModel(with_overrides(Scenario(), {"cluster.tp": 1, **figures}))
    return np.array([1e3 * (cm.prefill_time([(r["tokens"], 0)]) if r["kind"] == "prefill"
                            else cm.decode_step_time(r["batch"], r["batch"] * r["context"])) for r in rows])


def terms(rows: list[dict]) -> np.ndarray:
    """Per point, the roofline's four parts in ms at ``mfu`` = ``mbu`` = 1 (GEMM FLOPs, weight
    bytes, attention FLOPs, attention bytes), from the simulator's own model: shape (4, points)."""
    cm = ComputeModel(with_overrides(Scenario(), {"cluster.tp": 1}))
    return 1e3 * np.array([cm.parts(r["kind"], r["tokens"], r["context"]) for r in rows]).T


def predict(rows: list[dict], mfu: float, mbu: float, overhead_ms: float) -> np.ndarray:
    """The simulator's times (ms) for ``rows`` with the fitted figures."""
    return sim_times(rows, {"gpu.mfu": mfu, "gpu.mbu": mbu, "gpu.step_overhead_ms": overhead_ms})


def fit(rows: list[dict]) -> tuple[tuple[float, float, float], float]:
    """Grid search (vectorised over the model's form: GEMMs then attention, each the longer
    of its FLOPs and bytes, plus the overhead) for the figures minimising the largest relative
    error; the predictions themselves come from the simulator (:func:`predict`)."""
    meas = np.array([r["measured_ms"] for r in rows])
    gf, wb, af, ab = terms(rows)
    mfu = np.arange(0.20, 1.001, 0.01)[:, None, None, None]
    mbu = np.arange(0.30, 1.001, 0.01)[None, :, None, None]
    ov = np.concatenate([np.arange(0.0, 5.0, 0.05), np.arange(5.0, 40.0, 0.25)])[None, None, :, None]
    t = np.maximum(gf / mfu, wb / mbu) + np.maximum(af / mfu, ab / mbu) + ov
    err = np.abs(t / meas - 1).max(-1)
    i, j, k = np.unravel_index(int(np.argmin(err)), err.shape)
    best = (round(float(mfu[i, 0, 0, 0]), 2), round(float(mbu[0, j, 0, 0]), 2), round(float(ov[0, 0, k, 0]), 2))
    return best, float(err[i, j, k])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--quick", action="store_true", help="2 layers, 3 points a kind (a smoke run)")
    ap.add_argument("--engine", choices=("fast", "transformers"), default="fast",
                    help="fast: plain PyTorch, CUDA graphs (an optimised engine); transformers: eager")
    args = ap.parse_args()
    import torch

    rows = measure_fast(torch, args.quick) if args.engine == "fast" else \
        measure(torch, build(torch, args.quick), args.quick)
    rows.sort(key=lambda r: (r["kind"], r["tokens"], r["context"]))
    for i, r in enumerate(rows):
        r["fitted"] = i % 2 == 0
    (mfu, mbu, ov), fit_err = fit([r for r in rows if r["fitted"]])
    for r, p in zip(rows, predict(rows, mfu, mbu, ov)):
        r["predicted_ms"] = float(p)
        r["error"] = float(p / r["measured_ms"] - 1)
    held = [abs(r["error"]) for r in rows if not r["fitted"]]
    out = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "quick": args.quick,
           "engine": args.engine,
           "fit": {"gpu.mfu": mfu, "gpu.mbu": mbu, "gpu.step_overhead_ms": ov, "max_error_fitted": fit_err},
           "held_out_max_error": max(held), "held_out_within_10pct": sum(e <= 0.10 for e in held),
           "held_out_points": len(held), "rows": rows}
    print(f"{out['gpu']}: fit mfu {mfu}, mbu {mbu}, step overhead {ov} ms (max error on fitted points "
          f"{fit_err:.1%})")
    print(f"{'kind':>8} {'tokens/batch':>12} {'context':>8} {'measured ms':>12} {'model ms':>9} {'error':>7}  set")
    for r in rows:
        print(f"{r['kind']:>8} {r['tokens']:>12} {r['context']:>8} {r['measured_ms']:>12.2f} "
              f"{r['predicted_ms']:>9.2f} {r['error']:>+7.1%}  {'fit' if r['fitted'] else 'held out'}")
    print(f"held out: {out['held_out_within_10pct']} of {len(held)} within 10 %, max error {max(held):.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

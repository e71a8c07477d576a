"""A PD engine on a real model against the simulator, on one workload: TTFT and TPOT medians.

    python3 benchmarks/engine_sim.py [--requests 32] [--rate 4] [--prompt 512:3072] [--output 64] [--out FILE]
    python benchmarks/engine_sim.py --dry      # CPU: a stand-in model that sleeps, the numpy backend

The workload (seeded Poisson arrivals, uniform prompt lengths, fixed answer lengths, no shared
prefixes) is served twice.

**Engine** (``benchmarks/serving_model.py``: the Llama-3-8B-shaped model of
``fast_llama.py``, bf16, seeded random weights, one CUDA graph per prompt-length and
(batch, context) bucket; kvstate's lifecycles, a ``ThreadedDriver`` with 2 workers, ``CudaBackend``
over a ``MemoryStore`` pre-faulted to hold the whole run). One P and one D each get the whole GPU
in turn, as two GPUs would give them:

- P admits each prompt at its arrival time and prefills prompts one at a time in arrival order
  (writing keys and values into its pages); the lifecycle writes the cache out and sends the
  first token, which P's clock records. P answers finished writes while a prefill runs.
- D then replays those times on its own clock: it reserves at the arrival time, takes the first
  token when P sent it, reads the cache into its pages, copies them once into a contiguous slot,
  and decodes every running request in one batched step until its answer is complete.

**Simulator**: the same arrivals and lengths as a trace; 1 P + 1 D at TP 1, one prompt per
prefill forward, the storage bandwidth from the handoff's stages measured first (a write and a
read of one median prompt, alone), and the compute model's figures either fitted on this
engine's own forwards measured alone (half the points, in a checkerboard; the rest held out)
or given (``--mfu --mbu --overhead-ms``: ``benchmarks/model_calibration.py``'s fit on the
static-cache engine).

TTFT is arrival to first token, TPOT (finish - first token) / (answer tokens - 1), as
``docs/metrics.md`` defines them for the simulator.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving_model import DryModel, figures_overrides, fitted, forwards  # noqa: E402

from kvstate import (  # noqa: E402
    CacheSpec,
    DecodeLifecycle,
    Policy,
    PrefillLifecycle,
    block_keys,  # noqa: E402
)
from kvstate import commands as C  # noqa: E402
from kvstate.backends import MemoryStore, ReferenceBackend, ThreadedDriver  # noqa: E402
from kvstate.sim import Scenario, simulate, with_overrides  # noqa: E402

BLOCK, KV_HEADS, HEAD_DIM = 64, 8, 128
POLICY = Policy(read_prefix=False, transfer_timeout=120.0, first_token_timeout=600.0, queue_timeout=600.0)


@dataclass
class Req:
    rid: str
    arrival: float  #: seconds from the start
    tokens: list[int]
    output: int  #: answer tokens, P's first included
    first: float = 0.0  #: first token sent (P's clock)
    token: int = 0
    finish: float = 0.0  #: last token (D's clock, which replays P's)
    delivered: float = 0.0  #: D took the first token
    started: float = 0.0  #: D's read done: the request runs
    answer: list[int] = field(default_factory=list)


def workload(n: int, rate: float, lo: int, hi: int, output: int, seed: int) -> list[Req]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    times = np.cumsum(gaps) - gaps[0]
    lens = rng.integers(lo, hi + 1, n)
    return [Req(f"r{i}", float(times[i]), rng.integers(0, 128000, int(lens[i])).tolist(), output)
            for i in range(n)]


def make_backend(model: Any, spec: CacheSpec, blocks: int, store: Any, side: str) -> Any:
    """P's or D's backend over ``model``'s pages (the numpy backend for the stand-in)."""
    if isinstance(model, DryModel):
        return ReferenceBackend(spec, blocks, store)
    from kvstate.backends import CudaBackend
    return CudaBackend(spec, blocks, store, caches=[model.p_cache if side == "P" else model.d_cache])


def _complete(lc: Any, drv: ThreadedDriver, wait: float) -> None:
    """Hand the lifecycle every finished transfer, waiting up to ``wait`` (at most 5 ms) for one."""
    for c in drv.poll(max(0.0, min(wait, 0.005))):
        lc.complete(c)


def serve_p(model: Any, lc: PrefillLifecycle, drv: ThreadedDriver, reqs: list[Req]) -> list[float]:
    """P: admit at arrival, prefill in arrival order, record when each first token left.
    Returns each prefill's seconds."""
    by_id, spent = {r.rid: r for r in reqs}, []
    arrivals, queue, sent = deque(reqs), deque(), 0
    t0 = time.perf_counter()

    def pump() -> None:
        nonlocal sent
        for c in drv.submit_all(lc.poll_commands()):
            if isinstance(c, C.StartPrefill):
                queue.append(c)
            elif isinstance(c, C.SendFirstToken):
                r = by_id[c.request_id]
                assert c.error_code == 200, f"{r.rid}: P's first token carried {c.error_code}"
                r.first, r.token, sent = time.perf_counter() - t0, int(c.token or 0), sent + 1

    while sent < len(reqs):
        now = time.perf_counter() - t0
        while arrivals and arrivals[0].arrival <= now:
            r = arrivals.popleft()
            lc.admit(r.rid, r.tokens)
        pump()
        _complete(lc, drv, 0.0)
        pump()
        if queue:
            cmd = queue.popleft()
            r = by_id[cmd.request_id]
            t = time.perf_counter()
            model.launch_prefill(r.tokens, list(cmd.block_ids))
            while not model.prefill_ready():  # first tokens leave as their writes end
                _complete(lc, drv, 5e-4)
                pump()
            tok = model.prefill_result()
            spent.append(time.perf_counter() - t)
            lc.prefill_done(r.rid, tok)
            pump()
        else:
            _complete(lc, drv, max(5e-4, arrivals[0].arrival - now) if arrivals else 0.005)
        lc.tick()
    return spent


class DecodeBatch:
    """D's running requests, packed in slots ``0 .. len - 1`` (a finished one's slot takes the
    last); runnable requests beyond ``slots`` wait for one, as the simulator's do."""

    def __init__(self, model: Any, slots: int) -> None:
        self.model, self.slots = model, slots
        self.rows: list[Req] = []
        self.pos: list[int] = []
        self.waiting: deque[tuple[Req, list[int]]] = deque()
        self.steps: list[tuple[int, float]] = []  #: (batch, seconds) of each step
        self.gaps: list[float] = []  #: seconds between two steps back to back
        self.last_end = 0.0

    def add(self, r: Req, table: list[int]) -> None:
        if len(self.rows) >= self.slots:
            self.waiting.append((r, table))
            return
        n = len(r.tokens)
        self.model.load(len(self.rows), table, n)
        self.rows.append(r)
        self.pos.append(n)  # the first token goes in at position n
        r.answer = [r.token]

    def step(self, lc: DecodeLifecycle, t0: float) -> int:
        """One step of every running request; returns how many finished."""
        t = time.perf_counter()
        if self.last_end:
            self.gaps.append(t - self.last_end)
        out = self.model.step([r.answer[-1] for r in self.rows], self.pos)
        now = self.last_end = time.perf_counter()
        self.steps.append((len(self.rows), now - t))
        ended = 0
        for s in range(len(self.rows) - 1, -1, -1):
            r = self.rows[s]
            r.answer.append(out[s])
            self.pos[s] += 1
            if len(r.answer) < r.output:
                lc.append_tokens(r.rid, [out[s]])
                continue
            r.finish, ended = now - t0, ended + 1
            lc.finish(r.rid)
            last = len(self.rows) - 1
            if s != last:
                self.model.move(last, s, self.pos[last])
            self.rows[s], self.pos[s] = self.rows[last], self.pos[last]
            self.rows.pop()
            self.pos.pop()
        while self.waiting and len(self.rows) < self.slots:
            self.add(*self.waiting.popleft())
        return ended


def serve_d(model: Any, lc: DecodeLifecycle, drv: ThreadedDriver, reqs: list[Req], slots: int) -> DecodeBatch:
    """D: replay P's first tokens on P's clock; decode every running request each step."""
    by_id = {r.rid: r for r in reqs}
    events = deque(sorted([(r.arrival, 0, r.rid) for r in reqs] + [(r.first, 1, r.rid) for r in reqs]))
    batch, done = DecodeBatch(model, slots), 0
    t0 = time.perf_counter()

    def pump() -> None:
        for c in drv.submit_all(lc.poll_commands()):
            if isinstance(c, C.StartDecode):
                by_id[c.request_id].started = time.perf_counter() - t0
                batch.add(by_id[c.request_id], list(c.block_ids))
            elif isinstance(c, C.RequestEnded):
                assert c.state == "done", f"{c.request_id} ended {c.state}: {c.reason}"

    while done < len(reqs):
        now = time.perf_counter() - t0
        while events and events[0][0] <= now:
            _, kind, rid = events.popleft()
            r = by_id[rid]
            if kind:
                r.delivered = now
                lc.deliver_first_token(rid, r.token)
            else:
                lc.reserve(rid, r.tokens)
        pump()
        _complete(lc, drv, 0.0)
        pump()
        if batch.rows:
            done += batch.step(lc, t0)
            if not batch.rows:
                batch.last_end = 0.0
        else:
            _complete(lc, drv, max(5e-4, events[0][0] - now) if events else 0.005)
        lc.tick()
    return batch


def prefault(store: MemoryStore, spec: CacheSpec, nbytes: int) -> None:
    """Fill the store with objects of the stored size and drop them: the run's puts reuse their
    memory instead of page-faulting fresh memory (a serving pool in steady state)."""
    size = spec.bytes_per_block_per_rank // len(spec.kinds)
    keys = [f"prefault/{i}" for i in range(nbytes // size)]
    buf = np.zeros(size, dtype=np.uint8)
    for i in range(0, len(keys), 64):
        store.batch_put_from(keys[i:i + 64], [buf] * len(keys[i:i + 64]))
    store.evict(keys)


def stages(backend: Any, spec: CacheSpec, tokens: int, reps: int = 3) -> dict[str, float]:
    """The handoff's stages alone: one ``tokens`` prompt's write (GPU -> store) and read back."""
    n = spec.blocks_for(tokens)
    w, r = [], []
    for k in range(reps):
        keys = block_keys(list(range(k * 7, k * 7 + tokens)), BLOCK, namespace="stages")
        t = time.perf_counter()
        assert backend.write(0, keys, list(range(n))) == n
        w.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert backend.read(0, keys, list(range(n))) == n
        r.append(time.perf_counter() - t)
    nbytes = n * spec.bytes_per_block_per_rank
    return {"blocks": n, "bytes": nbytes, "write_s": statistics.median(w), "read_s": statistics.median(r)}


def simulated(reqs: list[Req], args: argparse.Namespace, bandwidth_gbps: float, blocks: int,
              figures: tuple[float, float, float, float]) -> dict[str, Any]:
    """The simulator on the same arrivals and lengths (a trace with no shared blocks)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "workload.jsonl")
        with open(path, "w") as f:
            for r in reqs:
                f.write(json.dumps({"timestamp": r.arrival * 1000.0, "input_length": len(r.tokens),
                                    "output_length": r.output, "hash_ids": []}) + "\n")
        s = with_overrides(Scenario(), {
            **figures_overrides(*figures),
            "cluster.n_prefill": 1, "cluster.n_decode": 1, "cluster.tp": 1, "cluster.gpu_blocks": blocks,
            "cluster.prefill_token_budget": 1, "cluster.decode_max_batch": args.slots,
            "cluster.transfer_workers": 2, "cluster.staging_mib": 64,
            "storage.bandwidth_gbps": bandwidth_gbps, "storage.latency_ms": 0.0, "network.latency_ms": 0.0,
            "policy.read_prefix": False, "policy.read_failure": "fail", "policy.transfer_timeout": 120.0,
            "policy.first_token_timeout": 600.0, "policy.queue_timeout": 600.0,
            "workload.arrival": "trace", "workload.trace": path})
        return simulate(s)


def engine(model: Any, reqs: list[Req], spec: CacheSpec, args: argparse.Namespace,
           p_blocks: int, d_blocks: int) -> dict[str, Any]:
    """Serve ``reqs``: the handoff's stages alone first, then P's run, then D's replay."""
    need = sum(spec.blocks_for(len(r.tokens)) for r in reqs) + 4 * spec.blocks_for(args.hi)
    store = MemoryStore(int(need * spec.bytes_per_block_per_rank * 1.1) + (64 << 20))
    backends: list[Any] = []
    try:
        prefault(store, spec, store.capacity_bytes)
        backends = [make_backend(model, spec, p_blocks, store, "P"), make_backend(model, spec, d_blocks, store, "D")]
        median_len = int(statistics.median(len(r.tokens) for r in reqs))
        st = stages(backends[0], spec, median_len)
        rows = forwards(model, args.hi, args.hi + args.output, args.slots)  # also the warm-up
        p_lc = PrefillLifecycle(spec, p_blocks, POLICY)
        d_lc = DecodeLifecycle(spec, d_blocks, POLICY)
        drv = ThreadedDriver(backends[0], workers=2)
        try:
            spent = serve_p(model, p_lc, drv, reqs)
        finally:
            drv.close()
        drv = ThreadedDriver(backends[1], workers=2)
        try:
            batch = serve_d(model, d_lc, drv, reqs, args.slots)
        finally:
            drv.close()
        leaks = {"P": p_lc.pool.num_used, "D": d_lc.pool.num_used}
    finally:
        for b in backends:
            b.close()
        store.close()
    by_batch: dict[int, list[float]] = {}
    for b, sec in batch.steps:
        by_batch.setdefault(b, []).append(sec * 1e3)
    steps = {b: round(statistics.median(v), 2) for b, v in sorted(by_batch.items())}
    parts = {"first_token_to_delivery": [r.delivered - r.first for r in reqs],
             "delivery_to_running": [r.started - r.delivered for r in reqs],
             "running_to_finish_per_token": [(r.finish - r.started) / (r.output - 1) for r in reqs],
             "step": [sec for _, sec in batch.steps], "between_steps": batch.gaps or [0.0]}
    return {"stages": st, "forwards": rows, "largest_batch": max(steps), "step_ms_by_batch": steps,
            "d_median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in parts.items()},
            "leaked_blocks": leaks, "prefill_ms": [round(x * 1e3, 1) for x in spent]}


def medians(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    return {"ttft_ms_p50": statistics.median(ttft) * 1e3, "tpot_ms_p50": statistics.median(tpot) * 1e3}


def report(res: dict[str, Any]) -> None:
    st, fit, e = res["engine"]["stages"], res["compute_fit"], res["engine"]
    print(f"handoff stages alone, {st['blocks']} blocks ({st['bytes'] / 2**20:.0f} MiB): write "
          f"{st['write_s'] * 1e3:.1f} ms, read {st['read_s'] * 1e3:.1f} ms -> storage {res['storage_gbps']:.2f} GB/s")
    print(f"compute model fitted on the engine's forwards: mfu {fit['mfu']}, mbu {fit['mbu']}, overhead "
          f"{fit['overhead_ms']} ms, GEMM half point {fit['gemm_half_tokens']:g} tokens; largest error "
          f"{fit['fit_max_error']:.1%} fitted, "
          f"{fit['held_out_max_error']:.1%} held out")
    for r in fit["points"]:
        print(f"  {r['kind']:<8}{r['tokens']:>6}{r['context']:>6}{r['measured_ms']:>9.2f} ms"
              + (f"  held out, model {r['model_error']:+.1%}" if "model_error" in r else ""))
    print(f"{'median':<8}{'engine ms':>11}" + "".join(f"{'sim (' + k + ')':>34}" for k in res["simulator"]))
    for k, name in (("ttft_ms_p50", "TTFT"), ("tpot_ms_p50", "TPOT")):
        print(f"{name:<8}{e[k]:>11.1f}" + "".join(f"{v[k]:>24.1f} ({v['sim_over_engine'][k]:.3f} x)"
                                                  for v in res["simulator"].values()))
    print(f"D medians, ms: {e['d_median_ms']}")
    print(f"D step ms by batch: {e['step_ms_by_batch']}; largest D batch {e['largest_batch']}, "
          f"leaked blocks {e['leaked_blocks']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    ap.add_argument("--prompt", default="512:3072", help="prompt lengths LO:HI, uniform")
    ap.add_argument("--output", type=int, default=64, help="answer tokens, P's first included")
    ap.add_argument("--slots", type=int, default=24, help="D's largest batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mfu", type=float, default=0.61)
    ap.add_argument("--mbu", type=float, default=0.95)
    ap.add_argument("--overhead-ms", type=float, default=3.0)
    ap.add_argument("--half-tokens", type=float, default=192.0, help="the GEMM curve's half point the given "
                    "figures were fitted with")
    ap.add_argument("--dry", action="store_true", help="CPU: stand-in model and the numpy backend")
    ap.add_argument("--layers", type=int, default=32, help="fewer for a quick smoke run (the simulator and "
                                                            "the fit keep Llama-3-8B's 32: figures then mean nothing)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.lo, args.hi = (int(x) for x in args.prompt.split(":"))
    reqs = workload(args.requests, args.rate, args.lo, args.hi, args.output, args.seed)
    spec = CacheSpec(num_layers=args.layers, kv_heads=KV_HEADS, block_size=BLOCK, head_dim=HEAD_DIM, dtype="bfloat16")
    p_blocks = 8 * spec.blocks_for(args.hi)
    d_blocks = len(reqs) * (spec.blocks_for(args.hi + args.output) + 1)
    if args.dry:
        model: Any = DryModel()
    else:
        import torch
        from serving_model import ServedLlama  # noqa: I001 - needs torch, so imported here
        model = ServedLlama(torch, p_blocks, d_blocks, args.slots, args.hi + args.output + 1, args.hi, args.layers)
    eng = engine(model, reqs, spec, args, p_blocks, d_blocks)
    st, fit = eng["stages"], fitted(eng.pop("forwards"))
    bandwidth = st["bytes"] / ((st["write_s"] + st["read_s"]) / 2) / 1e9
    e = medians([r.first - r.arrival for r in reqs], [(r.finish - r.first) / (r.output - 1) for r in reqs])
    sims = {}
    for name, figures in (("fitted on this engine", (fit["mfu"], fit["mbu"], fit["overhead_ms"],
                                                      fit["gemm_half_tokens"])),
                          ("given", (args.mfu, args.mbu, args.overhead_ms, args.half_tokens))):
        r = simulated(reqs, args, bandwidth, d_blocks, figures)
        sims[name] = {"figures": figures, "ttft_ms_p50": r["ttft_ms"]["p50"], "tpot_ms_p50": r["tpot_ms"]["p50"],
                      "reasons": r["reasons"]}
        sims[name]["sim_over_engine"] = {k: sims[name][k] / e[k] for k in e}
    res = {"device": "dry run (CPU stand-in)" if args.dry else model.torch.cuda.get_device_name(0),
           "args": vars(args), "engine": {**e, **eng}, "storage_gbps": bandwidth, "compute_fit": fit,
           "simulator": sims}
    report(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    ok = all(x["reasons"] == {"done": len(reqs)} for x in sims.values()) and not any(eng["leaked_blocks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Lifecycle overhead: the full P-side plus D-side life of one request, no data moved.

Each request: D reserves blocks, P admits it and reads a stored prefix (a StepDriver
without a backend answers every transfer in full, so the 7 full blocks "hit"), prefills
the rest, writes the cache (a write skips stored blocks inside the backend, so it is one
command), sends the first token; D reads the cache and decodes; both recycle. 7 triggers,
3 transfer commands of 2 TP ranks each, no bytes moved.

Side by side in one run (alternating, median of the repeats), the same lifecycles with:
- ``kvstate``: the machines as shipped (compiled from their transitions definition),
- ``stock``: every trigger through a stock ``transitions.Machine``,
- ``baseline``: a hand-written dict table (what the bookkeeping costs with no machine library).

Memory: Python heap per idle (reserved) request for the lifecycle's own bookkeeping,
beyond the request's block ids, keys and tokens (tracemalloc).

    python benchmarks/lifecycle.py [--requests N] [--repeats R] [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import tracemalloc
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstate import CacheSpec, DecodeLifecycle, PrefillLifecycle, block_keys  # noqa: E402
from kvstate import commands as C  # noqa: E402
from kvstate._machine import CompiledMachine, StockMachine  # noqa: E402
from kvstate.backends import StepDriver  # noqa: E402

SPEC = CacheSpec(num_layers=32, kv_heads=4, block_size=64, head_dim=128, tp_size=2)
PROMPT_TOKENS = 500  # 8 blocks of 64, the last one partial


class HandTable:
    """A hand-written (trigger, state) -> rows dict: what a lifecycle costs with no machine library."""

    def __init__(self, defn, owner) -> None:
        self.table: dict[tuple[str, str], list] = {}
        for t in defn.transitions:
            srcs = [t["source"]] if isinstance(t["source"], str) else t["source"]
            conds = t.get("conditions", [])
            conds = [conds] if isinstance(conds, str) else conds
            after = t.get("after", [])
            after = [after] if isinstance(after, str) else after
            for s in srcs:
                self.table.setdefault((t["trigger"], s), []).append(
                    ([getattr(owner, c) for c in conds], t["dest"], [getattr(owner, a) for a in after]))

    def fire(self, req, trigger, value=None):
        for conds, dest, after in self.table[(trigger, req.state)]:
            if all(c(req, value) for c in conds):
                req.state = dest
                for a in after:
                    a(req, value)
                return True
        return False


MACHINES = {"kvstate": CompiledMachine, "stock": StockMachine, "baseline": HandTable}


def make_rig(kind: str, n: int):
    cls = MACHINES[kind]
    return PrefillLifecycle(SPEC, 16 * n + 64, machine_cls=cls), DecodeLifecycle(SPEC, 16 * n + 64, machine_cls=cls)


def run_requests(kind: str, n: int, prompts: list[list[int]]) -> float:
    """Seconds per request for the whole P+D life of ``n`` requests, one at a time."""
    P, D = make_rig(kind, n)

    def on_p(cmd):
        t = type(cmd)
        if t is C.StartPrefill:
            P.prefill_done(cmd.request_id, 1)
        elif t is C.SendFirstToken:
            D.deliver_first_token(cmd.request_id, cmd.token, cmd.error_code)

    def on_d(cmd):
        if type(cmd) is C.StartDecode:
            D.finish(cmd.request_id)

    pd, dd = StepDriver(P, on_notice=on_p), StepDriver(D, on_notice=on_d)
    ids = [f"req-{i}" for i in range(n)]
    prompts = prompts[:n]
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    for rid, toks in zip(ids, prompts):
        D.reserve(rid, toks)
        P.admit(rid, toks)
        pd.run_until_idle()
        dd.run_until_idle()
    dt = time.perf_counter() - t0
    gc.enable()
    assert P.counters["done"] == n and D.counters["done"] == n, (P.counters, D.counters)
    assert P.pool.num_used == 0 and D.pool.num_used == 0
    return dt / n


def bytes_per_idle_request(n: int, prompts: list[list[int]]) -> float:
    D = DecodeLifecycle(SPEC, 16 * n + 64)
    ids = [f"idle-{i}" for i in range(n)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    for rid, toks in zip(ids, prompts):
        D.reserve(rid, toks)
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    total = sum(s.size_diff for s in snap.compare_to(base, "filename"))
    # the request's own data, rebuilt alike: its block ids, keys and token ids
    own = 0
    for rid, toks in zip(ids, prompts):
        keys = block_keys(toks, SPEC.block_size)
        own += sys.getsizeof(list(D.blocks_of(rid))) + sys.getsizeof(keys) + sum(sys.getsizeof(k) for k in keys)
        packed = array("I")
        packed.fromlist(toks)  # as the lifecycle packs them (fromlist over-allocates)
        own += sys.getsizeof(packed)
    return (total - own) / n


def bare_trigger_us(n: int = 50_000) -> float:
    """Cost of one trigger of a stock transitions Machine here (for comparing machines)."""
    from transitions import Machine

    class R:
        __slots__ = ("state",)

        def __init__(self):
            self.state = "a"

    m = Machine(model=None, states=["a", "b"], initial="a", auto_transitions=False,
                transitions=[dict(trigger="go", source="a", dest="b"), dict(trigger="back", source="b", dest="a")])
    go, back, r = m.events["go"].trigger, m.events["back"].trigger, R()
    t0 = time.perf_counter()
    for _ in range(n):
        go(r)
        back(r)
    return (time.perf_counter() - t0) / (2 * n) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = args.requests
    prompts = [[(i * 31 + j) % 32000 for j in range(PROMPT_TOKENS)] for i in range(n)]
    kinds = ("kvstate", "stock", "baseline")
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    run_requests("kvstate", min(200, n), prompts)  # warm-up
    for _ in range(args.repeats):
        for k in kinds:
            runs[k].append(run_requests(k, n, prompts))
    med = {k: statistics.median(v) * 1e6 for k, v in runs.items()}
    bpr = bytes_per_idle_request(n, prompts)
    trig = bare_trigger_us()
    out = {
        "requests_per_s": round(1e6 / med["kvstate"], 1),
        "us_per_request": round(med["kvstate"], 2),
        "baseline_us_per_request": round(med["baseline"], 2),
        "stock_transitions_us_per_request": round(med["stock"], 2),
        "ratio_vs_baseline": round(med["kvstate"] / med["baseline"], 3),
        "ratio_stock_vs_kvstate": round(med["stock"] / med["kvstate"], 3),
        "bytes_per_request": round(bpr, 1),
        "requests": n, "repeats": args.repeats, "prompt_tokens": PROMPT_TOKENS,
        "blocks_per_request": SPEC.blocks_for(PROMPT_TOKENS), "tp": SPEC.tp_size,
        "triggers_per_request": 7,
        "stock_transitions_us_per_trigger": round(trig, 2),
        "python": platform.python_version(), "machine": platform.machine(),
    }
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"lifecycle of one request (P+D, {PROMPT_TOKENS} tokens, {out['blocks_per_request']} blocks, "
              f"TP {SPEC.tp_size}), median of {args.repeats} x {n} requests")
        print(f"{'variant':<36}{'us/request':>12}{'requests/s':>14}")
        for label, k in (("kvstate (compiled from transitions)", "kvstate"),
                         ("kvstate on stock transitions", "stock"),
                         ("hand-written dict table", "baseline")):
            print(f"{label:<36}{med[k]:>12.1f}{1e6 / med[k]:>14.0f}")
        print(f"ratio kvstate / dict table: {out['ratio_vs_baseline']:.2f}x")
        print(f"bookkeeping per idle request: {bpr:.0f} bytes")
        print(f"this machine: one stock transitions trigger costs {trig:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

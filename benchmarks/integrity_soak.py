"""A fault-injection soak: corrupt, short and missing objects on random ranks, never wrong bytes.

    python benchmarks/integrity_soak.py [--requests 10000] [--fault 0.02] [--prompts 2000] [--json PATH]
    python benchmarks/integrity_soak.py --hash   # XXH3 GB/s per core beside a memory copy

P and D lifecycles (TP 2, the numpy reference backend, step drivers) serve ``--requests``
requests, their prompts drawn from ``--prompts`` prompts (2,000) so later requests find
earlier ones' blocks stored. The store under them spoils each object it is given with probability ``--fault``: a
flipped byte at full length, half the bytes kept, or nothing kept at all (each reported as a
success). D recomputes what it cannot read (``read_failure = "recompute"``); every request
that starts decoding has each of its blocks compared byte for byte with what P computed.
The report: faults injected by kind, blocks D found broken (and evicted), requests that
recomputed, wrong bytes in requests that decoded (the bar: 0), and a final audit that reads
every prompt's blocks one by one: spoiled objects still stored are found broken, and no block
that verifies differs from what P computed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from kvstate import (  # noqa: E402
    CacheSpec,
    DecodeLifecycle,
    Policy,
    PrefillLifecycle,
    block_keys,  # noqa: E402
)
from kvstate import commands as C  # noqa: E402
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver, Store  # noqa: E402
from kvstate.testing import fill_blocks, mismatched_blocks  # noqa: E402

FAULTS = ("corrupt", "short", "missing")


class SpoilingStore(MemoryStore):
    """A pool that spoils objects as it takes them, saying each put succeeded."""

    def __init__(self, rate: float, rng: random.Random) -> None:
        super().__init__(1 << 28, copy_threads=1)
        self.rate, self.rng = rate, rng
        self.injected = dict.fromkeys(FAULTS, 0)

    batch_put_hashed = Store.batch_put_hashed  # hashes what it is given (as a sender does), then spoils it

    def batch_put_from(self, keys: Any, buffers: Any) -> list[int]:
        keep_keys, keep = [], []
        for k, b in zip(keys, buffers):
            data = memoryview(b).cast("B")
            if self.rng.random() < self.rate:
                fault = self.rng.choice(FAULTS)
                self.injected[fault] += 1
                if fault == "missing":
                    continue
                if fault == "short":
                    data = data[:max(1, data.nbytes // 2)]
                else:
                    spoiled = bytearray(data)
                    spoiled[self.rng.randrange(len(spoiled))] ^= 1 << self.rng.randrange(8)
                    data = memoryview(spoiled)
            keep_keys.append(k)
            keep.append(data)
        status = super().batch_put_from(keep_keys, keep) if keep_keys else []
        assert all(s == 0 for s in status)
        return [0] * len(keys)


def serve(p: PrefillLifecycle, d: DecodeLifecycle, pd: StepDriver, dd: StepDriver, rid: str,
          toks: list[int]) -> tuple[str, int]:
    """One request through P -> store -> D, recomputing what D could not read; (how it went,
    wrong blocks once it decoded)."""
    spec, keys = p.spec, block_keys(toks, p.spec.block_size)
    d.reserve(rid, toks)
    p.admit(rid, toks)
    pd.run_until_idle()
    [sp] = [n for n in pd.notices if isinstance(n, C.StartPrefill)]
    fill_blocks(pd.backend, keys, sp.block_ids, sp.num_cached_tokens // spec.block_size)
    p.prefill_done(rid, 1)
    pd.run_until_idle()
    for n in pd.notices:
        if isinstance(n, C.SendFirstToken):
            d.deliver_first_token(n.request_id, n.token, n.error_code)
    pd.notices.clear()
    dd.run_until_idle()
    how = "read"
    for n in list(dd.notices):
        if isinstance(n, C.Recompute):
            how = "recomputed"
            fill_blocks(dd.backend, keys, n.block_ids, n.from_token // spec.block_size)
            d.recompute_done(rid)
            dd.run_until_idle()
    start = [n for n in dd.notices if isinstance(n, C.StartDecode)]
    dd.notices.clear()
    if not start:
        return "failed", 0
    wrong = len(mismatched_blocks(dd.backend, keys, start[0].block_ids))
    d.finish(rid)
    dd.run_until_idle()
    dd.notices.clear()
    return how, wrong


def soak(requests: int, rate: float, seed: int, distinct: int = 2000) -> dict[str, Any]:
    rng = random.Random(seed)
    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2)
    store = SpoilingStore(rate, rng)
    policy = Policy(read_failure="recompute", write_retries=0, transfer_timeout=30.0, fence_grace=5.0)
    p, d = PrefillLifecycle(spec, 256, policy), DecodeLifecycle(spec, 256, policy)
    pb, db = ReferenceBackend(spec, 256, store), ReferenceBackend(spec, 256, store)
    pd, dd = StepDriver(p, pb), StepDriver(d, db)
    prompts = [[rng.randrange(1 << 20) for _ in range(rng.randrange(9, 40))] for _ in range(distinct)]
    outcomes: dict[str, int] = {}
    wrong = 0
    t = time.perf_counter()
    for i in range(requests):
        how, bad = serve(p, d, pd, dd, f"r{i}", prompts[rng.randrange(len(prompts))])
        outcomes[how] = outcomes.get(how, 0) + 1
        wrong += bad
    leaks = p.pool.num_used + d.pool.num_used + len(p.live_requests()) + len(d.live_requests())
    served = db.broken_blocks + pb.broken_blocks
    audit = audit_store(db, prompts)
    return {"requests": requests, "fault_rate": rate, "seed": seed, "faults_injected": store.injected,
            "broken_blocks_found_serving": served, "broken_blocks_found_by_the_final_audit": audit["broken"],
            "outcomes": outcomes, "wrong_blocks_in_decoding_requests": wrong,
            "wrong_blocks_passing_verification_at_the_audit": audit["wrong"], "leaked_blocks_or_requests": leaks,
            "objects_stored": len(store), "wall_s": round(time.perf_counter() - t, 2)}


def audit_store(db: ReferenceBackend, prompts: list[list[int]]) -> dict[str, int]:
    """Read every prompt's stored blocks on every rank: the spoiled ones still there are found
    broken (and evicted), and every block that verifies holds exactly what P computed."""
    spec, before, wrong = db.spec, db.broken_blocks, 0
    scratch = [db.num_blocks - 1]
    for key in sorted({k for toks in prompts for k in block_keys(toks, spec.block_size)}):
        for rank in range(spec.tp_size):  # block by block: a broken one does not hide those after it
            if db.read(rank, [key], scratch):
                wrong += sum(1 for _, r, _ in mismatched_blocks(db, [key], scratch) if r == rank)
    return {"broken": db.broken_blocks - before, "wrong": wrong}


def hash_speed() -> dict[str, float]:
    """XXH3-64 GB/s on one core over 256 MiB, beside a numpy copy of the same bytes."""
    a = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)  # touch the pages first
    out = {}
    for name, fn in (("xxh3_64", lambda: xxhash.xxh3_64_intdigest(memoryview(a))), ("memcpy", lambda: np.copyto(b, a))):
        best = min(_timed(fn) for _ in range(5))
        out[f"{name}_GBps"] = round(a.nbytes / best / 1e9, 2)
    return out


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--fault", type=float, default=0.02, help="probability an object is spoiled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=2000, help="distinct prompts the requests draw from")
    ap.add_argument("--hash", action="store_true", help="only the host hash's speed")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args()
    r = hash_speed() if a.hash else soak(a.requests, a.fault, a.seed, a.prompts)
    for k, v in r.items():
        print(f"{k:<50}{v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    clean = not (r.get("wrong_blocks_in_decoding_requests") or r.get("leaked_blocks_or_requests")
                 or r.get("wrong_blocks_passing_verification_at_the_audit"))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())

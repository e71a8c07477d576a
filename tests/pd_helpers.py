"""The PD engine example's test harness (examples/pd_engine/): workloads, serving, and exactness.

Shared by the tests of the example's own models and of transformers' models on kvstate's pages.
Importing it puts the example's folder on ``sys.path`` (its modules import one another by name).
"""
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pd_engine"))

__all__ = ["BS", "LENGTHS", "workload", "serve", "assert_exact", "assert_equal_runs", "window_read_bytes"]

BS = 32
LENGTHS = [1, 2, 31, 32, 33, 64, 95, 257, 500, 1000, 1024, 1500, 2048, 3000, 4000, 4096]


def workload(n: int = 16, max_new: int = 6, per_request: dict | None = None, seed: int = 1,
             lengths: Sequence[int] = LENGTHS):
    """Prompts of every length in ``lengths`` (partial last blocks among them); some share a
    prefix with an earlier prompt, so P reads it from the store."""
    from engine import Request

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        prompt = [rng.randrange(512) for _ in range(length)]
        if out and i % 3 == 0:
            donor = max(out, key=lambda r: len(r.prompt)).prompt
            k = min(len(donor), length - 1) // BS * BS
            prompt[:k] = donor[:k]
        out.append(Request(f"r{i:02d}", prompt, max_new, **(per_request or {}).get(i, {})))
    return out


def serve(model, reqs, store=None, **kw):
    """Serve ``reqs`` on a fresh engine; the engine (closed) and the blocks it leaked."""
    from engine import PDEngine

    from kvstate.backends import MemoryStore

    store = store if store is not None else MemoryStore(1 << 30)  # an empty store is falsy
    eng = PDEngine(model, store, block_size=BS, num_blocks=kw.pop("num_blocks", 1024), **kw)
    try:
        eng.run(reqs)
        return eng, eng.leaks()
    finally:
        eng.close()


def assert_equal_runs(reqs, ref: dict, skip=()) -> None:
    """Every request not in ``skip`` ended ``done`` with ``ref``'s tokens and logits, bit for bit."""
    for rid, (tokens, logits) in ref.items():
        if rid in skip:
            continue
        r = next(x for x in reqs if x.rid == rid)
        assert r.ended is not None and r.ended[0] == "done", (rid, r.ended)
        assert r.tokens == tokens, rid
        assert len(r.logits) == len(logits)
        for i, (a, b) in enumerate(zip(r.logits, logits)):
            assert (a.to(b.device) == b).all().item(), f"{rid}: logits of token {i} differ"


def assert_exact(model, reqs, skip=(), reference: Callable | None = None) -> None:
    """D's tokens and logits equal a monolithic run's (the engine's own by default)."""
    from engine import monolithic

    kept = [r for r in reqs if r.rid not in skip]
    ref = reference(kept) if reference else monolithic(model, kept, BS)
    assert_equal_runs(reqs, ref, skip)


def window_read_bytes(spec, reqs) -> int:
    """What D reads of every prompt: each full layer's blocks, each window layer's from the
    block its last window starts in."""
    full = sum(len(g.layers) for g in spec.groups if g.kind == "full")
    window = spec.layers - full
    per_layer = sum(spec.chunk_bytes(k) for k in spec.kinds) * spec.tp_size
    blocks = [(-(-len(r.prompt) // BS), spec.window_first_block(len(r.prompt))) for r in reqs]
    return sum((full * n + window * (n - w)) * per_layer for n, w in blocks)

"""Rank workers on the GPU: caches shared through CUDA IPC, and the PD engine split into processes.

Marked ``gpu``: skipped with a reason where CuPy, PyTorch or a CUDA device is missing.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest
from needs import gpu as needs_gpu

from kvstate import CacheSpec
from kvstate import commands as C

pytestmark = [pytest.mark.gpu, needs_gpu("torch")]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pd_engine"))


def answers(drv, n: int, timeout: float = 60.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += drv.poll(1.0)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_workers_move_blocks_of_caches_shared_through_cuda_ipc(tp, tmp_path):
    """P's caches (PyTorch, bf16, filled at random) are written by P's rank worker processes,
    D's (zeros) read back by D's: the blocks D read equal P's, bit for bit, and no other block
    of D changed."""
    import torch

    from kvstate.backends._cudaipc import share_caches
    from kvstate.distributed import ProcessDriver

    spec = CacheSpec(num_layers=3, kv_heads=4 // tp, block_size=16, head_dim=64, dtype="bfloat16", tp_size=tp)
    nb = 32
    shape = (nb, spec.kv_heads, spec.block_size, spec.head_dim)
    p_caches = {r: {k: [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3)]
                    for k in spec.kinds} for r in range(tp)}
    d_caches = {r: {k: [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                    for k in spec.kinds} for r in range(tp)}
    store = {"kind": "file", "root": str(tmp_path)}
    with ProcessDriver(spec, nb, name="P") as p, ProcessDriver(spec, nb, name="D") as d:
        for drv, caches in ((p, p_caches), (d, d_caches)):
            for r in range(tp):
                drv.spawn(r, store, caches=share_caches(caches), backend="cuda")
            drv.wait_ready(120)
        keys, src, dst = tuple(f"blk{i}" for i in range(5)), (3, 9, 10, 11, 30), (0, 1, 2, 17, 31)
        now = time.monotonic()
        p.submit(C.WriteBlocks("r", 1, tuple(range(tp)), now + 60, keys, src, fence=now + 90))
        assert [(a.count, a.error) for a in answers(p, tp)] == [(5, None)] * tp
        d.submit(C.ReadBlocks("r", 2, tuple(range(tp)), now + 60, keys, dst, fence=now + 90))
        assert [(a.count, a.error) for a in answers(d, tp)] == [(5, None)] * tp
    torch.cuda.synchronize()
    for r in range(tp):
        for k in spec.kinds:
            for pl, dl in zip(p_caches[r][k], d_caches[r][k]):
                assert torch.equal(dl[list(dst)], pl[list(src)])
                rest = [b for b in range(nb) if b not in dst]
                assert not dl[rest].any()


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_workers_move_state_pages_shared_through_cuda_ipc(tp, tmp_path):
    """A hybrid spec (one full layer, two state layers): P's caches and state pages (PyTorch,
    random) shared through CUDA IPC, written by P's rank workers with the state after their
    blocks, read back by D's into zeros: D's blocks and the page it named equal P's, bit for
    bit, and D's other pages stay zero."""
    import torch

    from kvstate._layers import LayerGroup
    from kvstate.backends._cudaipc import share_caches
    from kvstate.distributed import ProcessDriver

    spec = CacheSpec(num_layers=3, kv_heads=4 // tp, block_size=16, head_dim=64, dtype="bfloat16", tp_size=tp,
                     groups=(LayerGroup("full", (0,)), LayerGroup("state", (1, 2), state_bytes=2048, checkpoint=32)))
    nb, ns, size = 32, 4, spec.state_bytes_per_rank
    shape = (nb, spec.kv_heads, spec.block_size, spec.head_dim)
    p_caches = {r: {k: [torch.randn(shape, device="cuda").to(torch.bfloat16)] for k in spec.kinds} for r in range(tp)}
    d_caches = {r: {k: [torch.zeros(shape, device="cuda", dtype=torch.bfloat16)] for k in spec.kinds}
                for r in range(tp)}
    p_pages = {r: torch.randint(0, 256, (ns, size), dtype=torch.uint8, device="cuda") for r in range(tp)}
    d_pages = {r: torch.zeros((ns, size), dtype=torch.uint8, device="cuda") for r in range(tp)}
    store = {"kind": "file", "root": str(tmp_path)}
    with ProcessDriver(spec, nb, name="P", num_states=ns) as p, ProcessDriver(spec, nb, name="D", num_states=ns) as d:
        for drv, caches, pages in ((p, p_caches, p_pages), (d, d_caches, d_pages)):
            for r in range(tp):
                drv.spawn(r, store, caches=share_caches(caches, states=pages), backend="cuda")
            drv.wait_ready(120)
        keys, src, dst = tuple(f"blk{i}" for i in range(4)), (3, 9, 10, 11), (0, 1, 2, 17)
        now = time.monotonic()
        p.submit(C.WriteBlocks("r", 1, tuple(range(tp)), now + 60, keys, src, fence=now + 90, states=((4, 1),)))
        assert [(a.count, a.error) for a in answers(p, tp)] == [(4, None)] * tp
        d.submit(C.ReadBlocks("r", 2, tuple(range(tp)), now + 60, keys, dst, fence=now + 90, states=((4, 2),)))
        assert [(a.count, a.error) for a in answers(d, tp)] == [(4, None)] * tp
    torch.cuda.synchronize()
    for r in range(tp):
        assert torch.equal(d_pages[r][2], p_pages[r][1]) and not d_pages[r][[0, 1, 3]].any()
        for k in spec.kinds:
            assert torch.equal(d_caches[r][k][0][list(dst)], p_caches[r][k][0][list(src)])


@pytest.mark.parametrize("tp", [1, 2])
def test_the_pd_engine_split_into_processes_is_token_and_logit_exact(tp):
    """P and D as processes (each a scheduler plus rank workers on CUDA IPC), a FileStore on
    tmpfs between them: every token and every logit equals the monolithic run's."""
    import numpy as np
    from engine import Request, monolithic
    from model import LlamaConfig, TinyLlama
    from split import run_split

    rng = random.Random(3)
    lengths = [1, 31, 32, 33, 257, 1000, 2048, 4000]
    reqs = [Request(f"r{i}", [rng.randrange(512) for _ in range(n)], 5) for i, n in enumerate(lengths)]
    got = run_split(reqs, tp=tp)
    assert got["ended"] == {r.rid: ("done", 200) for r in reqs}
    for role, figures in got["reports"].items():
        assert (figures["leaked"], figures["pending"], figures["live"]) == (0, 0, 0), (role, figures)
    ref = monolithic(TinyLlama(LlamaConfig(), seed=0), reqs, 32)
    for r in reqs:
        tokens, logits = ref[r.rid]
        assert got["tokens"][r.rid] == tokens, r.rid
        for i, want in enumerate(logits):
            have = np.frombuffer(got["logits"][r.rid][i][1], np.float32)
            assert np.array_equal(have, want.float().cpu().numpy().ravel()), f"{r.rid}: logits of token {i} differ"

"""The direct handoff on GPUs: D's CudaBackend pulls P's blocks with a kernel reading P's GPU.

In one process (the same GPU, or P on GPU 0 and D on GPU 1 joined by NVLink) through the
lifecycles and ThreadedDrivers; across processes through CUDA IPC, with P killed while it
lends. Every test skips, with its reason, without CuPy and the GPUs it needs.
"""
import functools
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
from needs import gpu
from test_direct_handoff import PROMPTS, _Pair

from kvstate import CacheSpec
from kvstate.backends import MemoryStore
from kvstate.backends._lends import LendBoard

pytestmark = [pytest.mark.gpu, gpu()]

SPEC = CacheSpec(num_layers=4, kv_heads=4, block_size=4, head_dim=32, dtype="bfloat16", tp_size=2)


def _devices() -> int:
    import cupy as cp

    return cp.cuda.runtime.getDeviceCount()


def _cuda(device):
    from kvstate.backends import CudaBackend

    return functools.partial(CudaBackend, device=device)


@pytest.mark.parametrize("handoff", ["direct", "both"])
@pytest.mark.parametrize("d_device", [0, 1])
def test_d_pulls_from_p_in_one_process_byte_exact(tmp_path, handoff, d_device):
    if d_device >= _devices():
        pytest.skip("needs two GPUs")
    # D waits long enough for P's first checksums, whose kernel compiles on first use (seconds)
    pair = _Pair(tmp_path, handoff, p_backend=_cuda(0), d_backend=_cuda(d_device), spec=SPEC, wait=4.0)
    try:
        outcome, bad, _ = pair.serve(PROMPTS)
        assert outcome == {rid: "done" for rid in PROMPTS} and bad == []
        assert pair.db.lend_counts["pulls"] == 2 * len(PROMPTS) and pair.db.lend_counts["pull_failed"] == 0
        assert pair.P.pool.num_used == pair.D.pool.num_used == 0
    finally:
        pair.close()


def _lender(root, device, keys, blocks, ready, hold):
    """A P process: CudaBackend on ``device``, blocks filled with a pattern, lent until ``hold``."""
    import cupy as cp

    from kvstate.backends import CudaBackend

    be = CudaBackend(SPEC, 64, MemoryStore(1 << 20), device=device, lends=LendBoard(root, wait=0))
    with cp.cuda.Device(device):
        for kind in SPEC.kinds:
            for layer, arr in enumerate(be.caches(0, kind).views):
                for b in blocks:
                    arr[b] = (b * 31 + layer * 7 + len(kind)) % 251
    ready.set()
    be.lend(0, keys, blocks, lambda: time.monotonic() < hold)
    be.close()


@pytest.mark.parametrize("kill", [False, True])
def test_d_pulls_from_another_process_and_survives_its_death(tmp_path, kill):
    import cupy as cp

    from kvstate.backends import CudaBackend

    d_dev = 1 if _devices() > 1 else 0
    keys = [f"k{i}" for i in range(6)]
    p_blocks, d_blocks = [9, 3, 40, 41, 7, 12], [1, 2, 3, 4, 5, 6]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_lender, args=(str(tmp_path), 0, keys, p_blocks, ready, time.monotonic() + 30),
                       daemon=True)
    proc.start()
    db = CudaBackend(SPEC, 64, MemoryStore(1 << 20), device=d_dev, pulls=LendBoard(tmp_path, wait=20))
    try:
        assert ready.wait(60)
        while not list(tmp_path.glob("*.lend")):
            time.sleep(0.01)
        if kill:  # P died after it posted: its entry is skipped, so D reads the store
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            assert db.pull(0, keys, d_blocks, lambda: True) is None
            return
        n = db.pull(0, keys, d_blocks, lambda: True)
        assert n == len(keys)
        for kind in SPEC.kinds:
            for layer, arr in enumerate(db.caches(0, kind).views):
                got = arr[cp.asarray(d_blocks)].get()
                want = np.stack([np.full(arr.shape[1:], (b * 31 + layer * 7 + len(kind)) % 251, arr.dtype)
                                 for b in p_blocks])
                assert (got == want).all(), (kind, layer)
        proc.join(10)
        assert proc.exitcode == 0 and list(tmp_path.iterdir()) == []
    finally:
        db.close()
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def test_a_gpu_that_cannot_reach_p_is_refused_by_rule():
    from kvstate import ProtocolError
    from kvstate.backends import CudaBackend
    from kvstate.backends._cuda_peers import CudaPeers

    be = CudaBackend(SPEC, 8, MemoryStore(1 << 20))
    try:
        peers = CudaPeers(be.cp, be.spec, 0, be)
        with pytest.raises(ProtocolError, match="cannot read GPU 1000"):
            peers.open({"kind": "cuda-ipc", "pid": 1, "device": 1000, "num_blocks": 8}, 0, be._swappers[0].bind)
        with pytest.raises(ProtocolError, match="must describe CUDA caches"):
            peers.open({"kind": "local"}, 0, be._swappers[0].bind)
    finally:
        be.close()

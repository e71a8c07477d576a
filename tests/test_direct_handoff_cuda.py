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


@pytest.mark.parametrize("summed", [True, False], ids=["sums-in-copy", "sums-after"])
@pytest.mark.parametrize("handoff", ["direct", "both"])
@pytest.mark.parametrize("d_device", [0, 1])
def test_d_pulls_from_p_in_one_process_byte_exact(tmp_path, handoff, d_device, summed, monkeypatch):
    from kvstate.kernels._cuda import CudaSwapper, SumCopier

    if d_device >= _devices():
        pytest.skip("needs two GPUs")
    calls = []  # how each pull's copies ran: with their sums, or without
    real, launch = CudaSwapper.copy_blocks, SumCopier.launch
    monkeypatch.setattr(CudaSwapper, "copy_blocks",
                        lambda self, *a, **k: calls.append("sums" in k) or real(self, *a, **k))
    monkeypatch.setattr(SumCopier, "launch", lambda self, *a: calls.append(True) or launch(self, *a))
    if not summed:  # the other path: copies first, then the sums kernel behind each piece
        monkeypatch.setattr(CudaSwapper, "copies_with_sums", lambda self, s, d: False)
    # D waits long enough for P's first checksums, whose kernel compiles on first use (seconds)
    pair = _Pair(tmp_path, handoff, p_backend=_cuda(0), d_backend=_cuda(d_device), spec=SPEC, wait=4.0)
    try:
        outcome, bad, _ = pair.serve(PROMPTS)
        assert outcome == {rid: "done" for rid in PROMPTS} and bad == []
        assert pair.db.lend_counts["pulls"] == 2 * len(PROMPTS) and pair.db.lend_counts["pull_failed"] == 0
        assert pair.P.pool.num_used == pair.D.pool.num_used == 0
        assert calls and all(c == summed for c in calls)
    finally:
        pair.close()


def test_reads_armed_at_reservation_fire_on_the_gpu_byte_exact(tmp_path):
    """D's lifecycle announces each read at reservation, the driver arms it on D's GPU (the
    backend arms ``SLOTS`` rank pulls at once: one read of both ranks), and the pull after the
    first token fires it. D is on its own
    GPU: P's prefill (here, filling its blocks with CuPy) loads kernels, which on D's GPU in
    this process would wait behind the armed reads (kvstate.backends._cuda_armed)."""
    if _devices() < 2:
        pytest.skip("needs two GPUs: an in-process D arms only on a GPU this process computes nothing on")
    from kvstate.backends._cuda_armed import SLOTS

    pair = _Pair(tmp_path, "direct", p_backend=_cuda(0), d_backend=_cuda(1), spec=SPEC, wait=4.0, arm=True)
    again = {f"again-{rid}": tokens for rid, tokens in PROMPTS.items()}
    try:
        for prompts in (PROMPTS, again):  # the first pulls map P's caches: they run unarmed
            outcome, bad, _ = pair.serve(prompts)
            assert outcome == {rid: "done" for rid in prompts} and bad == []
        reads = SLOTS // SPEC.tp_size  # the first reserved: each arms a slot a rank
        assert pair.armed == {"armed": reads, "matched": reads, "let_go": 0}
        counts = pair.db.armed_counts()
        assert counts["fired"] >= SLOTS and counts["armed"] == counts["fired"] + counts["disarmed"]
        assert counts["now"] == 0
        assert pair.db.lend_counts["pulls"] == 4 * len(PROMPTS) and pair.db.lend_counts["pull_failed"] == 0
    finally:
        pair.close()


def _filled(cp, device, blocks, seed):
    """Eight layers of ``blocks`` blocks of 16 tokens x 2 heads x 64 bf16 (as int16), random."""
    with cp.cuda.Device(device):
        rs = cp.random.RandomState(seed)
        return [rs.randint(-2**15, 2**15, (blocks, 16, 2, 64), dtype=cp.int16) for _ in range(8)]


@pytest.mark.parametrize("n", [3, 480, 700], ids=["inline", "inline-max", "uploaded"])
def test_copy_blocks_sums_what_it_moved_as_the_sums_kernel_does(n):
    import cupy as cp

    from kvstate.kernels._cuda import CudaSwapper
    from kvstate.kernels._cuda_checksum import block_sums

    src, dst = _filled(cp, 0, 1024, 1), _filled(cp, 0, 1024, 2)
    rng = np.random.default_rng(n)
    gids, fids = rng.permutation(1024)[:n], rng.permutation(1024)[:n]
    with CudaSwapper(0) as sw:
        sums = cp.zeros((2, n), dtype=cp.uint64)  # two kinds: the first four layers, the last four
        sw.wait(sw.copy_blocks([(src[:4], dst[:4]), (src[4:], dst[4:])], gids, fids, sums=sums))
        for a, b in zip(src, dst):
            assert (a[cp.asarray(gids)].get() == b[cp.asarray(fids)].get()).all()
        for j, layers in enumerate((slice(0, 4), slice(4, 8))):
            want = block_sums(cp, dst[layers], fids.tolist(), {})
            assert (sums[j].get() == want).all() and len(set(want.tolist())) == n  # every block its own sum
            assert (block_sums(cp, src[layers], gids.tolist(), {}) == want).all()  # the source's, weighed alike


def test_a_sum_copier_moves_and_sums_as_copy_blocks_does_from_ids_its_caller_uploaded():
    import cupy as cp

    from kvstate import ValidationError
    from kvstate.kernels._cuda import CudaSwapper

    src, dst, again = _filled(cp, 0, 1024, 1), _filled(cp, 0, 1024, 2), _filled(cp, 0, 1024, 2)
    rng = np.random.default_rng(5)
    gids, fids = rng.permutation(1024)[:600], rng.permutation(1024)[:600]
    with CudaSwapper(0) as sw:
        want = cp.zeros((2, 600), dtype=cp.uint64)
        sw.wait(sw.copy_blocks([(src[:4], dst[:4]), (src[4:], dst[4:])], gids, fids, sums=want))
        copier = sw.sum_copier([(src[:4], again[:4]), (src[4:], again[4:])])
        with pytest.raises(ValidationError, match="check the ids first"):
            copier.launch(0, 0)
        with pytest.raises(ValidationError, match="distinct"):
            copier.check([1, 2], [3, 3])
        with pytest.raises(ValidationError, match="check the ids first"):
            copier.launch(0, 0)  # a check that failed leaves nothing to launch
        g, f = copier.check(gids.tolist(), fids.tolist())
        with sw.stream:  # the caller's upload, on the swapper's stream
            ids, got = cp.asarray(np.concatenate([g, f])), cp.zeros((2, 600), dtype=cp.uint64)
        copier.launch(int(ids.data.ptr), int(got.data.ptr))
        sw.wait(sw.stream)
        assert (got.get() == want.get()).all()
        assert all((a == b).all() for a, b in zip(dst, again))
        with pytest.raises(ValidationError, match="whole aligned 16-byte vectors"):
            odd = [cp.zeros((16, 3, 1, 2), cp.int16) for _ in range(2)]
            sw.sum_copier([(odd, [o.copy() for o in odd])])


def test_copy_blocks_refuses_bad_sums_and_moves_nothing():
    import cupy as cp

    from kvstate import ValidationError
    from kvstate.kernels._cuda import CudaSwapper

    src, dst = _filled(cp, 0, 16, 1), _filled(cp, 0, 16, 2)
    before = [d.copy() for d in dst]
    odd = [cp.zeros((16, 3, 1, 2), cp.int16) for _ in range(2)]  # rows of 12 bytes: no whole vectors
    with CudaSwapper(0) as sw:
        for bad in (cp.zeros((1, 2), cp.uint64), cp.zeros((1, 3), cp.int64), np.zeros((1, 3), np.uint64),
                    cp.zeros(3, cp.uint64), cp.zeros((2, 3), cp.uint64)[:, :1]):
            with pytest.raises(ValidationError, match="sums must be a contiguous uint64"):
                sw.copy_blocks([(src, dst)], [1, 2, 3], [4, 5, 6], sums=bad)
        with pytest.raises(ValidationError, match="whole aligned 16-byte vectors"):
            sw.copy_blocks([(odd, [o.copy() for o in odd])], [1], [2], sums=cp.zeros((1, 1), cp.uint64))
        for g, f in (([1, 2], [4, 4]), ([1], [16]), ([-1], [2]), ([1, 2], [3])):
            with pytest.raises(ValidationError, match="distinct"):
                sw.copy_blocks([(src, dst)], g, f, sums=cp.zeros((1, len(g)), cp.uint64))
        with pytest.raises(ValidationError, match="no .src, dst. pair"):
            sw.copy_blocks([], [1], [2])
        cp.cuda.runtime.deviceSynchronize()
    assert all((a == b).all() for a, b in zip(before, dst))


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


def test_a_pull_with_too_few_checksums_is_refused_before_anything_moves():
    from kvstate import ProtocolError
    from kvstate.backends import CudaBackend

    be = CudaBackend(SPEC, 8, MemoryStore(1 << 20))
    try:
        with pytest.raises(ProtocolError, match="as many lender's blocks, own blocks and checksums"):
            be.pull_copy(0, {"kind": "cuda-ipc"}, [1, 2], [3, 4], [5], None)
    finally:
        be.close()


def test_a_pull_reads_its_own_answer_after_the_rank_s_next_pull_ran():
    """A rank's pulls run on several lanes: one waiting for its answer while the next one
    queues. The next may not reuse the scratch the first's answer lands in before the first
    read it, though the first's GPU work has run (it used to: the first pull was then handed
    the second's count, here 8 blocks of a 2-block pull)."""
    from kvstate.backends import CudaBackend

    pb, db = CudaBackend(SPEC, 16, MemoryStore(1 << 20)), CudaBackend(SPEC, 16, MemoryStore(1 << 20))
    try:
        src = list(range(8))
        sums = pb.lend_sums(0, src)
        sw = db._swappers[0]
        with db._on(0):
            theirs = db._open_peer(0, pb.lend_peer(0))
            pairs = [(theirs[k], db._layers[0][k]) for k in SPEC.kinds]
            wrong = [s ^ 1 for s in sums[:2]]  # no block matches: the first pull's answer is 0
            first = db._peers.pull(0, sw, pairs, src[:2], [8, 9], wrong, db._keep_until)
            sw.wait(sw.stream)  # its GPU work ran; its answer is not read yet
            second = db._peers.pull(0, sw, pairs, src, list(range(8, 16)), sums, db._keep_until)
        assert second() == 8
        assert first() == 0
    finally:
        db.close()
        pb.close()


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


def test_a_lender_builds_its_sums_kernel_and_describes_its_caches_before_its_first_lend(tmp_path):
    """A backend that lends does its first lend's one-time work when it is built: its SUM64
    kernel and each rank's CUDA IPC description (a pull waits only ``pull_wait`` for a post)."""
    from kvstate.backends import CudaBackend

    board = LendBoard(str(tmp_path / "lends"), wait=0)
    lender = CudaBackend(SPEC, 8, MemoryStore(1 << 20), lends=board)
    plain = CudaBackend(SPEC, 8, MemoryStore(1 << 20))
    try:
        assert sorted(lender._peers._described) == [0, 1]
        assert lender._sum_cache and not plain._sum_cache and not plain._peers._described
        t = time.perf_counter()
        assert len(lender.lend_sums(0, [1, 2, 3])) == 3
        assert time.perf_counter() - t < 0.1  # nothing left to build
    finally:
        lender.close()
        plain.close()

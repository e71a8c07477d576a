"""`kvstate profile`'s all-reduce harness: processes spawned, a collective timed per size, the
medians gathered. Its NCCL form needs as many GPUs as ranks; the same harness over gloo on CPU
tensors runs wherever PyTorch is (the GPU machine here has one GPU)."""
from __future__ import annotations

import pytest
from needs import has_module

pytestmark = pytest.mark.skipif(not has_module("torch"), reason="needs PyTorch")


def test_the_allreduce_harness_times_every_size_over_two_processes():
    from kvstate.app._gpuprofile import allreduce_curve

    sizes = [4096, 1 << 20, 16 << 20]
    curve = allreduce_curve(sizes, 2, backend="gloo")
    assert [n for n, _ in curve] == sizes
    times = [t for _, t in curve]
    assert all(0 < t < 5.0 for t in times)
    assert times[2] > times[0]  # 4,096 times the bytes cannot take less time

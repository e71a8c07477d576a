"""Block ids handed to the CUDA ops as tensors, as an engine may hold its block table.

Every integer form (CuPy arrays on the GPU, PyTorch tensors on the CPU or the GPU, numpy
arrays of narrow dtypes) moves the same bytes as the same ids in a Python list, both
directions; tensors of floats or bools, and tensors of the wrong rank, are refused with the
rule broken, and nothing moves.

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing; the PyTorch
forms also need PyTorch.
"""
import numpy as np
import pytest
from needs import gpu as needs_gpu

from kvstate import BlockError, ValidationError
from kvstate.kernels import _reference as reference

gpu = needs_gpu()
pytestmark = pytest.mark.gpu

LAYERS, N_GPU, N_HOST, CHUNK = 4, 64, 16, (1, 16, 8)  # 256-byte chunks of uint16

FORMS = ["cupy int32", "cupy int64", "cupy uint8", "numpy uint16", "torch cpu int64", "torch cpu int32",
         "torch cuda int64", "torch cuda int16"]


def _as_form(ids: list[int], form: str):
    """``ids`` in the named form."""
    lib, *where, dtype = form.split()
    if lib == "numpy":
        return np.asarray(ids, dtype=dtype)
    if lib == "cupy":
        import cupy as cp
        return cp.asarray(ids, dtype=dtype)
    torch = pytest.importorskip("torch", reason="needs PyTorch")
    return torch.tensor(ids, dtype=getattr(torch, dtype), device=where[0])


@pytest.fixture(scope="module")
def sw():
    from kvstate.kernels._cuda import CudaSwapper

    with CudaSwapper() as s:
        yield s


def _rig(sw, seed):
    """Random GPU caches and a pinned host buffer, with their numpy copies."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    want_c = [rng.integers(0, 2**16, (N_GPU,) + CHUNK, dtype=np.uint16) for _ in range(LAYERS)]
    caches = [cp.asarray(w) for w in want_c]
    host = sw.pinned((N_HOST, LAYERS) + CHUNK, np.uint16)
    host[...] = rng.integers(0, 2**16, host.shape, dtype=np.uint16)
    return rng, caches, host, want_c, host.copy()


@gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("form", FORMS)
def test_tensor_ids_move_the_same_bytes_as_a_list(sw, form, direction):
    import cupy as cp

    rng, caches, host, want_c, want_h = _rig(sw, FORMS.index(form))
    gids = rng.choice(N_GPU, 12, replace=False).tolist()
    hids = rng.choice(N_HOST, 12, replace=False).tolist()
    reference.swap_cache_layout(want_c, want_h, gids, hids, direction)
    sw.swap_cache_layout(caches, host, _as_form(gids, form), _as_form(hids, form), direction)
    assert np.array_equal(host, want_h)
    assert all(np.array_equal(cp.asnumpy(c), w) for c, w in zip(caches, want_c))


@gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("bad, err, msg", [
    ("cupy float32", BlockError, "must hold integers, got dtype float32"),
    ("cupy bool", BlockError, "must hold integers, got dtype bool"),
    ("torch cpu float64", BlockError, "must hold integers, got dtype float64"),
    ("torch cuda bool", BlockError, "must hold integers, got dtype bool"),
    ("torch cuda 2-d", ValidationError, "must be one-dimensional"),
])
def test_tensors_not_of_ints_are_refused_and_nothing_moves(sw, bad, err, msg, direction):
    import cupy as cp

    _, caches, host, want_c, want_h = _rig(sw, 99)
    ids = [3, 1, 2]
    if bad.endswith("2-d"):
        torch = pytest.importorskip("torch", reason="needs PyTorch")
        value = torch.tensor([ids], device="cuda")
    else:
        value = _as_form([1, 0, 1] if bad.endswith("bool") else ids, bad)
    with pytest.raises(err, match=msg):
        sw.swap_cache_layout(caches, host, value, [0, 1, 2], direction)
    assert np.array_equal(host, want_h)
    assert all(np.array_equal(cp.asnumpy(c), w) for c, w in zip(caches, want_c))

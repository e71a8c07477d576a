"""State pages on the GPU (kvstate.backends._cuda_states): the CUDA backend moves a hybrid model's
states through P -> store -> D as the reference backend does, and never loads a broken one.

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing.
"""
import numpy as np
import pytest
from lifecycle_helpers import deliver
from needs import gpu as needs_gpu
from state_helpers import BS, TOKS, assert_state, fake_state, hybrid, prefill, state_rig

from kvstate import commands as C
from kvstate._keys import block_keys, rank_key

pytestmark = [pytest.mark.gpu, needs_gpu()]


def cuda_backend(spec, blocks, store):
    from kvstate.backends._cuda import CudaBackend

    return CudaBackend(spec, blocks, store, num_states=4, staging_bytes=1 << 20)


def test_a_hybrid_handoff_through_cuda_backends_lands_the_prompts_state():
    rig = state_rig(cuda_backend)
    rig.D.reserve("a", TOKS)
    prefill(rig, "a")
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    [sd] = rig.notices(rig.dd, C.StartDecode)
    assert_state(rig.db, sd.state_pages[0], block_keys(TOKS, BS)[-1])
    longer = TOKS[:20] + [9, 9, 9]
    assert prefill(rig, "b", longer).num_cached_tokens == 16  # the checkpoint's state, read into P's page
    for b in (rig.pb, rig.db):
        b.close()


def test_a_corrupt_state_is_not_loaded_on_the_gpu_and_is_evicted():
    rig = state_rig(cuda_backend)
    rig.D.reserve("a", TOKS)
    prefill(rig, "a")
    name = rank_key(block_keys(TOKS, BS)[-1], "state", 0)
    buf = np.empty(96 + 24, np.uint8)
    rig.store.batch_get_into([name], [buf])
    buf[0] ^= 0x80
    rig.store.batch_put_from([name], [buf])
    page = rig.D.pages_of("a")[0]
    deliver(rig, rig.notices(rig.pd))
    rig.dd.run_until_idle()
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 0 and rig.db.broken_states == 1 and rig.store.batch_is_exist([name]) == [0]
    # rank 0 fell back to the last checkpoint's state; rank 1 loaded the prompt's: no common start
    assert rig.db.state_bytes(0, page) == fake_state(block_keys(TOKS, BS)[3], 0)
    assert rig.db.state_bytes(1, page) == fake_state(block_keys(TOKS, BS)[-1], 1)
    for b in (rig.pb, rig.db):
        b.close()


def test_the_engines_own_state_tensor_is_used_in_place():
    import cupy as cp

    from kvstate._errors import ValidationError
    from kvstate.backends import MemoryStore
    from kvstate.backends._cuda import CudaBackend

    mine = {r: cp.zeros((4, 96), cp.uint8) for r in range(2)}
    b = CudaBackend(hybrid(), 8, MemoryStore(1 << 22), num_states=4, states=mine, staging_bytes=1 << 20)
    b.fill_state(1, 2, bytes(range(96)))
    assert mine[1][2].get().tobytes() == bytes(range(96))  # the engine's memory, not a copy
    b.close()
    with pytest.raises(ValidationError, match=r"state pages of rank 0 must be a contiguous uint8 device array"):
        CudaBackend(hybrid(), 8, MemoryStore(1 << 22), num_states=4, states={0: cp.zeros((4, 95), cp.uint8)})

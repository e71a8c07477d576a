"""D's pulls armed at reservation (kvstate.backends._cuda_armed), on GPUs: an armed pull lands
byte for byte and is counted fired; one that no lend fires, or that a pull into other blocks,
a deadline, ``disarm_pull`` or ``close`` lets go, writes no block of any cache; arming checks
its input before it queues anything. P lends from this process on GPU 0, D pulls on GPU 1
where there is one. Every test skips, with its reason, without CuPy and a GPU.
"""
import threading
import time

import numpy as np
import pytest
from needs import gpu

from kvstate import CacheSpec, ValidationError
from kvstate.backends import MemoryStore
from kvstate.backends._cuda_armed import SLOTS
from kvstate.backends._lends import LendBoard

pytestmark = [pytest.mark.gpu, gpu()]

SPEC = CacheSpec(num_layers=4, kv_heads=4, block_size=4, head_dim=32, dtype="bfloat16", tp_size=2)
KEYS = [f"armed-{i}" for i in range(6)]
P_BLOCKS, D_BLOCKS = [9, 3, 40, 41, 7, 12], [1, 2, 3, 4, 5, 6]


def _value(block: int, layer: int, kind: str) -> int:
    return (block * 31 + layer * 7 + len(kind)) % 251


@pytest.fixture
def pd(tmp_path):
    """P (lends, GPU 0) with its blocks filled, and D (pulls, GPU 1 if there is one) with its
    blocks set to 1, both on one lend board."""
    import cupy as cp

    from kvstate.backends import CudaBackend

    d_dev = 1 if cp.cuda.runtime.getDeviceCount() > 1 else 0
    p = CudaBackend(SPEC, 64, MemoryStore(1 << 20), device=0, lends=LendBoard(tmp_path, wait=0))
    d = CudaBackend(SPEC, 64, MemoryStore(1 << 20), device=d_dev, pulls=LendBoard(tmp_path, wait=2))
    for be, fill in ((p, _value), (d, lambda b, layer, kind: 1)):
        with cp.cuda.Device(be.device):
            for kind in SPEC.kinds:
                for layer, arr in enumerate(be.caches(0, kind).views):
                    for b in range(64):
                        arr[b] = fill(b, layer, kind)
            cp.cuda.runtime.deviceSynchronize()
    try:
        yield p, d
    finally:
        d.close()
        p.close()


def _lend(p, keys=KEYS, seconds: float = 10.0) -> threading.Thread:
    """P lends ``keys`` from its blocks on another thread, until pulled or ``seconds`` pass."""
    end = time.monotonic() + seconds
    t = threading.Thread(target=p.lend, args=(0, keys, P_BLOCKS, lambda: time.monotonic() < end), daemon=True)
    t.start()
    return t


def _meet(p, d) -> None:
    """D pulls once, unarmed, from P: P's caches are mapped on D's GPU from then on."""
    keys = [f"meet-{k}" for k in KEYS]
    t = _lend(p, keys)
    assert d.pull(0, keys, [30, 31, 32, 33, 34, 35], lambda: True) == len(keys)
    t.join(10)


def _d_bytes(d, blocks=None) -> dict:
    import cupy as cp

    ids = cp.asarray(list(range(64)) if blocks is None else blocks)
    with cp.cuda.Device(d.device):
        return {(kind, layer): arr[ids].get() for kind in SPEC.kinds
                for layer, arr in enumerate(d.caches(0, kind).views)}


def _landed(d) -> bool:
    got = _d_bytes(d, D_BLOCKS)
    return all((got[kind, layer] == np.stack([np.full(v.shape[1:], _value(b, layer, kind), v.dtype)
                                               for b in P_BLOCKS])).all()
               for (kind, layer), v in got.items())


def test_an_armed_pull_lands_byte_for_byte_and_its_slot_serves_the_next(pd):
    p, d = pd
    _meet(p, d)
    for rep in range(3):  # a slot's memory is armed again once its work ran
        keys = [f"{k}-{rep}" for k in KEYS]
        assert d.arm_pull(0, keys, D_BLOCKS) is True
        assert d.armed_counts()["now"] == 1
        t = _lend(p, keys)
        assert d.pull(0, keys, D_BLOCKS, lambda: True) == len(keys)
        t.join(10)
        assert _landed(d)
    assert d.armed_counts() == {"armed": 3, "fired": 3, "disarmed": 0, "now": 0}
    assert d.lend_counts["pulls"] == 4 and p.lend_counts["pulled"] == 4


def test_a_pull_from_a_lender_never_met_lets_every_armed_pull_go_and_runs_unarmed(pd):
    """Mapping a lender's caches may wait for the whole device, every queued wait with it: the
    first pull from P is unarmed, and lets the other armed pull go first; arming works again
    once P is mapped."""
    p, d = pd
    other = [f"{k}-other" for k in KEYS]
    assert d.arm_pull(0, KEYS, D_BLOCKS) and d.arm_pull(0, other, [20, 21, 22, 23, 24, 25])
    t = _lend(p)
    assert d.pull(0, KEYS, D_BLOCKS, lambda: True) == len(KEYS)
    t.join(10)
    assert _landed(d)
    assert d.armed_counts() == {"armed": 2, "fired": 0, "disarmed": 2, "now": 0}
    assert d.arm_pull(0, other, D_BLOCKS)
    t = _lend(p, other)
    assert d.pull(0, other, D_BLOCKS, lambda: True) == len(KEYS)
    t.join(10)
    assert d.armed_counts() == {"armed": 3, "fired": 1, "disarmed": 2, "now": 0}


def test_an_armed_pull_no_lend_fires_writes_no_block(pd):
    import cupy as cp

    p, d = pd
    before = _d_bytes(d)
    assert d.arm_pull(0, KEYS, D_BLOCKS)
    d.pulls.wait = 0.05
    assert d.pull(0, KEYS, D_BLOCKS, lambda: True) is None  # nobody lends them: D reads the store
    assert d.armed_counts() == {"armed": 1, "fired": 0, "disarmed": 1, "now": 0}
    with cp.cuda.Device(d.device):
        cp.cuda.runtime.deviceSynchronize()  # the released work ran (on the slot's scratch row)
    after = _d_bytes(d)
    assert all((before[k] == after[k]).all() for k in before)


def test_released_armed_pulls_touch_no_cache(pd):
    """Disarmed by ``disarm_pull``, by a pull into other blocks, by the deadline: the work each
    queued runs on the slot's scratch row, and D's caches (all 64 blocks) keep their bytes."""
    p, d = pd
    before = _d_bytes(d)
    assert d.arm_pull(0, KEYS, D_BLOCKS)
    assert d.disarm_pull(0, KEYS) is True and d.disarm_pull(0, KEYS) is False
    assert d.arm_pull(0, KEYS, D_BLOCKS, timeout=0.01)
    time.sleep(0.05)
    other = [k + "-b" for k in KEYS]
    assert d.arm_pull(0, other, D_BLOCKS)  # the watchdog let the expired one go
    assert d.armed_counts()["disarmed"] == 2 and d.armed_counts()["now"] == 1
    d.pulls.wait = 0.05
    assert d.pull(0, other, [20, 21, 22, 23, 24, 25], lambda: True) is None  # other blocks: released, unarmed
    import cupy as cp

    with cp.cuda.Device(d.device):
        cp.cuda.runtime.deviceSynchronize()
    assert d.armed_counts() == {"armed": 3, "fired": 0, "disarmed": 3, "now": 0}
    after = _d_bytes(d)
    assert all((before[k] == after[k]).all() for k in before)


def test_a_pull_into_the_armed_blocks_after_a_release_runs_unarmed_and_lands(pd):
    p, d = pd
    assert d.arm_pull(0, KEYS, [20, 21, 22, 23, 24, 25])
    t = _lend(p)
    assert d.pull(0, KEYS, D_BLOCKS, lambda: True) == len(KEYS)  # armed for other blocks: unarmed pull
    t.join(10)
    assert _landed(d)
    assert d.armed_counts() == {"armed": 1, "fired": 0, "disarmed": 1, "now": 0}


def test_close_lets_every_armed_pull_go_and_returns(pd):
    p, d = pd
    for i in range(SLOTS):
        assert d.arm_pull(0, [f"{k}-{i}" for k in KEYS], D_BLOCKS)
    t0 = time.monotonic()
    d.close()
    assert time.monotonic() - t0 < 5 and d.armed_counts()["now"] == 0


def test_a_backend_arms_at_most_its_slots_over_all_its_ranks(pd):
    """The slots are the GPU's in this process, not a rank's: a D holding both TP ranks on one
    GPU queues no more waits than one rank would (more stall other streams)."""
    p, d = pd
    armed = [d.arm_pull(i % 2, [f"{k}-{i}" for k in KEYS], D_BLOCKS) for i in range(10)]
    assert armed == [True] * SLOTS + [False] * (10 - SLOTS)
    assert d.disarm_pull(0, [f"{k}-0" for k in KEYS])  # a slot let go is the other rank's to take
    assert d.arm_pull(1, [f"{k}-9" for k in KEYS], D_BLOCKS)


@pytest.mark.parametrize("keys,blocks,timeout,match", [
    (KEYS, [1, 2, 3, 4, 5, 5], 60.0, "twice|distinct|duplicate"),
    (KEYS, [1, 2, 3, 4, 5, 64], 60.0, "range|64"),
    (KEYS, [1, 2, 3], 60.0, "6 keys but 3 block ids"),
    (KEYS, D_BLOCKS, 0.0, "timeout must be seconds > 0"),
    (KEYS, D_BLOCKS, float("nan"), "timeout must be seconds > 0"),
    ([1, 2, 3, 4, 5, 6], D_BLOCKS, 60.0, "key"),
])
def test_arming_checks_its_input_and_queues_nothing(pd, keys, blocks, timeout, match):
    p, d = pd
    with pytest.raises(ValidationError, match=match):
        d.arm_pull(0, keys, blocks, timeout=timeout)
    assert d.armed_counts()["now"] == 0


def test_a_backend_without_a_lend_board_arms_nothing():
    from kvstate.backends import CudaBackend

    be = CudaBackend(SPEC, 8, MemoryStore(1 << 20))
    try:
        assert be.arm_pull(0, KEYS[:2], [1, 2]) is False and be.armed_counts()["now"] == 0
    finally:
        be.close()


def test_an_entry_with_ids_out_of_p_s_range_fails_the_armed_pull_and_writes_nothing(pd):
    """P's entry is checked before the flag goes up: a block id past P's caches fails the
    pull (0: that P does not write the store), the slot is let go, D's blocks keep their bytes."""
    p, d = pd
    _meet(p, d)
    before = _d_bytes(d)
    assert d.arm_pull(0, KEYS, D_BLOCKS)
    bad = [*P_BLOCKS[:-1], 64]
    p.lends.post(0, p.lend_geometry(), KEYS, bad, [0] * len(KEYS), p.lend_peer(0))
    assert d.pull(0, KEYS, D_BLOCKS, lambda: True) == 0
    import cupy as cp

    with cp.cuda.Device(d.device):
        cp.cuda.runtime.deviceSynchronize()
    assert d.armed_counts() == {"armed": 1, "fired": 0, "disarmed": 1, "now": 0}
    after = _d_bytes(d)
    assert all((before[k] == after[k]).all() for k in before)


def test_a_driver_that_refuses_the_stream_wait_arms_nothing_and_the_pull_runs_unarmed(pd, monkeypatch):
    """Where the driver offers no stream memory operations, ``arm_pull`` answers False with
    nothing queued, and the pull lands as an unarmed one."""
    from kvstate.backends import _cuda_armed

    monkeypatch.setattr(_cuda_armed, "stream_wait_value", lambda: lambda stream, addr, value: False)
    p, d = pd
    assert d.arm_pull(0, KEYS, D_BLOCKS) is False
    assert d.armed_counts() == {"armed": 0, "fired": 0, "disarmed": 0, "now": 0}
    t = _lend(p)
    assert d.pull(0, KEYS, D_BLOCKS, lambda: True) == len(KEYS)
    t.join(10)
    assert _landed(d)

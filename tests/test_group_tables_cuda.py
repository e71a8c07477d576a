"""Group tables (kvstate._tables) on the GPU: D's CUDA backend lays a block out as layer slots
shared by the groups, and a long conversation's handoff, decode past the window, write-back
and reload keep every byte its decode needs.

Marked ``gpu``: skipped with a reason where CuPy or a CUDA device is missing, run for real on
the GPU machine.
"""
import pytest
from lifecycle_helpers import assert_clean, deliver
from needs import gpu as needs_gpu
from test_group_tables import gemma2_like, handoff_rows

pytestmark = [pytest.mark.gpu, needs_gpu()]


class CudaRig:
    """P on the reference backend with one table, D on the CUDA backend with group tables."""

    def __init__(self, policy) -> None:
        from kvstate import DecodeLifecycle, PrefillLifecycle
        from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver
        from kvstate.backends._cuda import CudaBackend

        store = MemoryStore(1 << 26)
        self.spec, d_spec = gemma2_like(), gemma2_like(group_tables=True)
        self.P, self.D = PrefillLifecycle(self.spec, 64, policy), DecodeLifecycle(d_spec, 64, policy)
        self.pb, self.db = ReferenceBackend(self.spec, 64, store), CudaBackend(d_spec, 64, store)
        self.pd, self.dd = StepDriver(self.P, self.pb), StepDriver(self.D, self.db)

    def notices(self, drv, cls=None):
        drv.pump()
        out = [n for n in drv.notices if cls is None or isinstance(n, cls)]
        drv.notices = [n for n in drv.notices if n not in out]
        return out


def test_layers_at_one_slot_share_the_gpu_memory_of_a_block():
    from kvstate import Policy

    rig = CudaRig(Policy())
    try:
        views = rig.db.caches(0, "key").views
        assert [v.data.ptr for v in views][0:2] == [views[0].data.ptr] * 2  # layer 0 (window), 1 (full): slot 0
        assert views[2].data.ptr == views[3].data.ptr != views[0].data.ptr
    finally:
        rig.db.close()


def test_a_long_conversation_decodes_past_the_window_writes_back_and_reloads_exact():
    from kvstate import Policy
    from kvstate import commands as C
    from kvstate._keys import block_keys
    from kvstate._pool import FREED
    from kvstate.testing import fill_blocks, mismatched_needed

    rig = CudaRig(Policy(transfer_timeout=10.0, fence_grace=5.0, preempt="write", read_failure="recompute"))
    try:
        toks = list(range(300, 340))
        deliver(rig, handoff_rows(rig, "r", toks))
        rig.dd.run_until_idle()
        rig.notices(rig.dd)
        assert rig.D.state_of("r") == "running"
        assert mismatched_needed(rig.db, block_keys(toks, 4), rig.D.rows_of("r"), len(toks)) == []
        cache = toks + [7] + list(range(24))
        for i in range(24):
            rig.D.append_tokens("r", [i])
        assert rig.D.blocks_of("r")[:14] == (FREED,) * 14 and rig.D.pool.num_used == 17 + 3
        fill_blocks(rig.db, block_keys(cache[:-1], 4), rig.D.rows_of("r"), 10)
        rig.D.preempt("r")
        rig.dd.run_until_idle()
        assert rig.D.state_of("r") == "preempted" and rig.D.pool.num_used == 0
        rig.D.resume("r")
        rig.dd.run_until_idle()
        assert rig.D.state_of("r") == "running" and not rig.notices(rig.dd, C.Recompute)
        assert mismatched_needed(rig.db, block_keys(cache[:-1], 4), rig.D.rows_of("r"), len(cache) - 1) == []
        rig.D.finish("r")
        assert_clean(rig)
    finally:
        rig.db.close()

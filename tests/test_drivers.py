"""StepDriver outcomes, and a FastDeploy-like engine loop on the ThreadedDriver."""
import threading
import time

import pytest
from rigs import small_spec

from kvstate import DecodeLifecycle, DriverError, Policy, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate._keys import block_keys
from kvstate.backends import MemoryStore, ReferenceBackend, ThreadedDriver
from kvstate.events import Completion
from kvstate.testing import fill_blocks, mismatched_blocks


def test_step_driver_partial_and_fail_outcomes(rig):
    rig.D.reserve("r", list(range(10)))
    rig.D.deliver_first_token("r", 1)
    rig.dd.pump()
    [(cid, r0), (_, r1)] = list(rig.dd.pending)
    with pytest.raises(ValidationError):
        rig.dd.complete(cid, r0, 99)
    assert rig.dd.complete(cid, r0, 0).count == 0  # nothing stored yet: reads nothing
    c = rig.dd.complete(cid, r1, "fail")
    assert c.error == "injected failure" and rig.D.counters["failed"] == 1
    with pytest.raises(ValidationError):
        rig.dd.complete(cid, r1)


def test_step_driver_answer_after_the_fence_moves_no_bytes(rig):
    """A rank answering after its command's fence (deadline + grace) must not scatter into
    blocks the lifecycle has recycled to another request, nor store blocks P recycled."""
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    rig.P.admit("a", toks)
    rig.pd.pump()
    while rig.pd.pending or rig.notices(rig.pd, C.StartPrefill):
        for key in list(rig.pd.pending):
            rig.pd.complete(*key)
        for n in rig.notices(rig.pd, C.StartPrefill):
            fill_blocks(rig.pb, block_keys(toks, 4), n.block_ids)
            rig.P.prefill_done("a", 1)
        rig.pd.pump()
    assert rig.P.counters["done"] == 1
    # D reads it, but no rank answers before the fence; the blocks go to request b
    blocks_a = rig.D.reserve("a", toks)
    rig.D.deliver_first_token("a", 1)
    rig.dd.pump()
    late = sorted(rig.dd.pending)
    rig.clock.advance(rig.policy.transfer_timeout + rig.policy.fence_grace)
    rig.D.tick()
    assert rig.D.counters["forced_releases"] == 1 and rig.D.pool.num_used == 0
    blocks_b = rig.D.reserve("b", [0] * 9)
    assert set(blocks_b) == set(blocks_a)
    before = [rig.db.block_bytes(r, k, b) for r in range(2) for k in rig.spec.kinds for b in blocks_b]
    for key in late:
        c = rig.dd.complete(*key)
        assert c.count == 0 and c.error.startswith("FenceError")
    assert [rig.db.block_bytes(r, k, b) for r in range(2) for k in rig.spec.kinds for b in blocks_b] == before
    assert rig.D.counters["stale_completions"] == 2  # nobody waits for them any more
    # a write past its fence stores nothing
    rig.P.admit("w", [3] * 9)
    rig.pd.pump()
    while not any(isinstance(c, C.WriteBlocks) for c in rig.pd.pending.values()):
        for key in sorted(rig.pd.pending):  # prefix query and query: nothing stored yet
            rig.pd.complete(*key)
        if rig.notices(rig.pd, C.StartPrefill):
            rig.P.prefill_done("w", 1)
        rig.pd.pump()
    writes = sorted(rig.pd.pending)
    assert all(isinstance(rig.pd.pending[k], C.WriteBlocks) for k in writes)
    stored = len(rig.store)
    rig.clock.advance(rig.policy.transfer_timeout + rig.policy.fence_grace)
    rig.P.tick()
    for key in writes:
        assert rig.pd.complete(*key).error.startswith("FenceError")
    assert len(rig.store) == stored


def test_threaded_driver_fences_on_the_lifecycle_clock():
    spec = small_spec(tp=1)
    store = MemoryStore(1 << 20)
    be = ReferenceBackend(spec, 4, store)
    keys = block_keys([1, 2, 3, 4], 4)
    assert be.write(0, keys, [0]) == 1
    now = [0.0]
    with ThreadedDriver(be, workers=1, clock=lambda: now[0]) as d:
        d.submit(C.ReadBlocks("a", 1, (0,), 1.0, keys, (2,), fence=2.0))
        now[0] = 5.0  # whichever the worker runs it, it is past the fence only after this
        d.submit(C.ReadBlocks("a", 2, (0,), 1.0, keys, (3,), fence=2.0))
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            got += d.poll(timeout=0.1)
    [c2] = [c for c in got if c.command_id == 2]
    assert c2.count == 0 and c2.error.startswith("FenceError")
    assert not any(layer[3].any() for kind in spec.kinds for layer in be.caches[0][kind])
    with pytest.raises(ValidationError):
        ThreadedDriver(be, clock=5.0)
    assert isinstance(c2, Completion)


def test_threaded_driver_close_joins_threads_and_rejects_late_submit():
    before = threading.active_count()
    for _ in range(20):
        d = ThreadedDriver(ReferenceBackend(small_spec(), 4, MemoryStore(1 << 20)), workers=3)
        d.close()
    assert threading.active_count() == before
    with pytest.raises(DriverError):
        d.submit(C.ReadBlocks("r", 1, (0,), 1.0, ("k",), (0,)))
    with pytest.raises(ValidationError):
        ThreadedDriver(None, workers=0)


def test_threaded_driver_answers_cancelled_commands_with_zero():
    class Slow(ReferenceBackend):
        def read(self, rank, keys, block_ids, guard=None):
            time.sleep(0.2)
            return super().read(rank, keys, block_ids, guard)

    with ThreadedDriver(Slow(small_spec(tp=1), 4, MemoryStore(1 << 20)), workers=1) as d:
        d.submit(C.ReadBlocks("a", 1, (0,), 9.0, ("k",), (0,)))
        d.submit(C.ReadBlocks("b", 2, (0,), 9.0, ("k",), (1,)))
        d.submit(C.CancelCommand("b", 2))
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            got += d.poll(timeout=0.1)
        assert {(c.command_id, c.error) for c in got} == {(1, None), (2, "cancelled")}


def _on_notice(n, lc, be, P, D, prompts, spec, decoded, outcome):
    """The scheduler's answer to one notice: compute a prefill, pass a token on, decode."""
    if isinstance(n, C.StartPrefill):
        fill_blocks(be, block_keys(prompts[n.request_id], spec.block_size), n.block_ids)
        P.prefill_done(n.request_id, 11)
    elif isinstance(n, C.SendFirstToken):
        D.deliver_first_token(n.request_id, n.token, n.error_code)
    elif isinstance(n, C.StartDecode):
        decoded[n.request_id] = n.block_ids
        D.finish(n.request_id)
    elif isinstance(n, C.RequestEnded) and lc is D:
        outcome[n.request_id] = n.state


def _engine_loop(P, D, pdrv, ddrv, pb, db, prompts, stop, errors, outcome, spec):
    """A scheduler thread: route commands to transfer workers, run 'compute', poll completions."""
    try:
        pending_reserve = list(prompts.items())
        decoded = {}
        while not stop.is_set():
            while pending_reserve:
                rid, toks = pending_reserve.pop()
                D.reserve(rid, toks)
                P.admit(rid, toks)
            for lc, drv, be in ((P, pdrv, pb), (D, ddrv, db)):
                for n in drv.submit_all(lc.poll_commands()):
                    _on_notice(n, lc, be, P, D, prompts, spec, decoded, outcome)
                for c in drv.poll():
                    lc.complete(c)
                lc.tick()
            if len(outcome) == len(prompts):
                # check what D read against what P computed, block by block
                for rid, blocks in decoded.items():
                    errors += [(rid, *bad) for bad in mismatched_blocks(db, block_keys(prompts[rid], spec.block_size),
                                                                         blocks)]
                return
            time.sleep(0.0005)
    except Exception as e:  # surfaced by the test
        errors.append(e)


def test_engine_loop_with_threaded_driver():
    spec = small_spec(tp=2)
    store = MemoryStore(1 << 24)
    P = PrefillLifecycle(spec, 128, Policy(transfer_timeout=30.0))
    D = DecodeLifecycle(spec, 128, Policy(transfer_timeout=30.0))
    pb, db = ReferenceBackend(spec, 128, store), ReferenceBackend(spec, 128, store)
    prompts = {f"r{i}": [(i * 7 + j) % 13 for j in range(5 + 3 * i)] for i in range(12)}
    stop, errors, outcome = threading.Event(), [], {}
    with ThreadedDriver(pb, workers=3, name="p") as pdrv, ThreadedDriver(db, workers=3, name="d") as ddrv:
        t = threading.Thread(target=_engine_loop, args=(P, D, pdrv, ddrv, pb, db, prompts, stop, errors, outcome, spec))
        t.start()
        t.join(timeout=30)
        stop.set()
        t.join(timeout=5)
        assert not t.is_alive()
    assert errors == []
    assert outcome == {rid: "done" for rid in prompts}
    assert P.pool.num_used == D.pool.num_used == 0

"""StepDriver outcomes, and a FastDeploy-like engine loop on the ThreadedDriver."""
import threading
import time

import pytest
from conftest import small_spec

from kvstate import DecodeLifecycle, DriverError, Policy, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate.backends import MemoryStore, ReferenceBackend, ThreadedDriver
from kvstate.demo import fake_block
from kvstate.keys import block_keys


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


def test_threaded_driver_close_joins_threads_and_rejects_late_submit():
    before = threading.active_count()
    for _ in range(20):
        d = ThreadedDriver(ReferenceBackend(small_spec(), 4, MemoryStore(1 << 20)), workers=3)
        d.close()
    assert threading.active_count() == before
    with pytest.raises(DriverError):
        d.submit(C.QueryBlocks("r", 1, (0,), 1.0, ("k",)))
    with pytest.raises(ValidationError):
        ThreadedDriver(None, workers=0)


def test_threaded_driver_answers_cancelled_commands_with_zero():
    class Slow(ReferenceBackend):
        def query(self, rank, keys):
            time.sleep(0.2)
            return super().query(rank, keys)

    with ThreadedDriver(Slow(small_spec(tp=1), 4, MemoryStore(1 << 20)), workers=1) as d:
        d.submit(C.QueryBlocks("a", 1, (0,), 9.0, ("k",)))
        d.submit(C.QueryBlocks("b", 2, (0,), 9.0, ("k",)))
        d.submit(C.CancelCommand("b", 2))
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            got += d.poll(timeout=0.1)
        assert {(c.command_id, c.error) for c in got} == {(1, None), (2, "cancelled")}


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
                    if isinstance(n, C.StartPrefill):
                        keys = block_keys(prompts[n.request_id], spec.block_size)
                        for i, k in enumerate(keys):
                            for r in range(spec.tp_size):
                                for kind in spec.kinds:
                                    be.fill_block(r, kind, n.block_ids[i], fake_block(k, r, kind, spec.block_bytes(kind)))
                        P.prefill_done(n.request_id, 11)
                    elif isinstance(n, C.SendFirstToken):
                        D.deliver_first_token(n.request_id, n.token, n.error_code)
                    elif isinstance(n, C.StartDecode):
                        decoded[n.request_id] = n.block_ids
                        D.finish(n.request_id)
                    elif isinstance(n, C.RequestEnded) and lc is D:
                        outcome[n.request_id] = n.state
                for c in drv.poll():
                    lc.complete(c)
                lc.tick()
            if len(outcome) == len(prompts):
                # check what D read against what P computed, block by block
                for rid, blocks in decoded.items():
                    keys = block_keys(prompts[rid], spec.block_size)
                    for i, k in enumerate(keys):
                        for r in range(spec.tp_size):
                            for kind in spec.kinds:
                                if db.block_bytes(r, kind, blocks[i]) != fake_block(k, r, kind, spec.block_bytes(kind)):
                                    errors.append((rid, i, r, kind))
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

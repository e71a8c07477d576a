"""Layer-wise save on P: the save goes out with the prefill, stores a layer group only once the
engine reported its layers, and stays cancel-safe (abort, deadline) with nothing leaked."""
from __future__ import annotations

import time

import pytest
from rigs import Clock, small_spec

from kvstate import KVStateError, Policy, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver, ThreadedDriver
from kvstate.backends._gate import LayerGate
from kvstate.testing import fill_layers, mismatched_blocks

SPEC = small_spec(tp=2, num_layers=4, layer_groups=2)
PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks of 4 and a partial one


def compute_layers(backend, keys, block_ids, a: int, b: int) -> None:
    """"Compute" layers [a, b) of every block: write those layers of its stand-in bytes."""
    fill_layers(backend, keys, block_ids, (a, b))


def stored(store: MemoryStore, suffix: str) -> int:
    """Objects in ``store`` whose name ends with ``suffix``."""
    return sum(name.endswith(suffix) for name in store)


def completions(drv: ThreadedDriver, n: int, timeout: float = 10.0) -> list:
    """The next ``n`` completions the threaded driver delivers (fewer if ``timeout`` passes)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += drv.poll(0.05)
    return got


def assert_read_back_whole(store: MemoryStore, keys) -> None:
    """Every rank reads ``keys`` back from ``store`` whole, with the bytes P computed."""
    d = ReferenceBackend(SPEC, 16, store)
    blocks = list(range(len(keys)))
    for r in range(SPEC.tp_size):
        assert d.read(r, keys, blocks) == len(keys)
    assert mismatched_blocks(d, keys, blocks) == []


def rig(policy: Policy | None = None, store: MemoryStore | None = None, **kw):
    clock = Clock()
    store = MemoryStore(1 << 24) if store is None else store
    lc = PrefillLifecycle(SPEC, 16, policy or Policy(read_prefix=False, transfer_timeout=10.0, fence_grace=5.0),
                          clock=clock, layerwise=True, **kw)
    return clock, store, lc, ReferenceBackend(SPEC, 16, store)


def start(lc, rid="r", drv: StepDriver | None = None):
    """Admit ``rid``; its StartPrefill and SaveLayers go out together (into ``drv`` if given)."""
    lc.admit(rid, PROMPT)
    if drv is None:
        cmds = lc.poll_commands()
    else:
        n = len(drv.notices)
        drv.pump()
        cmds = drv.notices[n:] + list({c.command_id: c for c in drv.pending.values()}.values())
    assert [type(c) for c in cmds] == [C.StartPrefill, C.SaveLayers]  # the save goes out with the prefill
    return cmds[1]


def test_the_save_stores_a_group_only_once_its_layers_are_reported():
    clock, store, lc, be = rig()
    drv = StepDriver(lc, be)
    save = start(lc, drv=drv)
    keys, ids = lc.keys_of("r"), lc.blocks_of("r")
    compute_layers(be, keys, ids, 0, 2)
    assert lc.layers_done("r", 2)
    drv.pump()
    assert drv.layers[save.command_id] == 2
    drv.complete(save.command_id, 0)  # layers 2..4 not reported: group 1 is not stored, no block whole
    assert stored(store, "_0_g0") and not stored(store, "_g1")
    drv.complete(save.command_id, 1)
    assert save.command_id not in drv.layers  # every rank answered: its reports are let go
    assert lc.state_of("r") == "saved"  # answered 0 while the prefill still runs
    compute_layers(be, keys, ids, 2, 4)
    lc.prefill_done("r", 7)  # judged now: a retry writes it all
    assert lc.state_of("r") == "writing" and lc.stats()["retries"] == 1
    drv.run_until_idle()
    assert lc.stats()["done"] == 1
    first = [n for n in drv.notices if isinstance(n, C.SendFirstToken)]
    assert first == [C.SendFirstToken("r", 7, 200)]
    assert_read_back_whole(store, keys)


def test_a_save_finishing_after_prefill_done_sends_the_first_token():
    clock, store, lc, be = rig()
    drv = StepDriver(lc, be)
    save = start(lc, drv=drv)
    keys, ids = lc.keys_of("r"), lc.blocks_of("r")
    for n in (1, 2, 3):
        compute_layers(be, keys, ids, n - 1, n)
        lc.layers_done("r", n)
    compute_layers(be, keys, ids, 3, 4)
    lc.prefill_done("r", 5)  # reports the last layer itself
    assert [c.layers for c in lc.poll_commands() if isinstance(c, C.LayersReady)] == [1, 2, 3, 4]
    drv.layers[save.command_id] = 4
    drv.complete(save.command_id, 0)
    drv.complete(save.command_id, 1)
    assert lc.stats()["done"] == 1 and lc.stats()["retries"] == 0
    assert store.puts == 2 * len(keys) * (len(SPEC.kinds) + 1) * 2  # ranks x blocks x (kinds + manifest) x groups


def test_a_full_store_hit_answers_before_any_layer():
    clock, store, lc, be = rig()
    drv = StepDriver(lc, be)
    start(lc, "a", drv)
    compute_layers(be, lc.keys_of("a"), lc.blocks_of("a"), 0, 4)
    lc.prefill_done("a", 1)
    drv.run_until_idle()
    save = start(lc, "b", drv)  # the same prompt: every key is stored already
    drv.pump()
    for r in (0, 1):
        assert drv.complete(save.command_id, r).count == len(lc.keys_of("b"))
    assert lc.state_of("b") == "saved"
    lc.prefill_done("b", 1)
    assert lc.stats()["done"] == 2


def test_abort_mid_prefill_closes_the_gate_and_leaks_nothing():
    clock, store, lc, be = rig()
    with ThreadedDriver(be, workers=2, clock=clock) as drv:
        save = start(lc)
        drv.submit(save)
        compute_layers(be, lc.keys_of("r"), lc.blocks_of("r"), 0, 2)
        lc.layers_done("r", 2)
        lc.abort("r")
        notices = drv.submit_all(lc.poll_commands())
        assert any(isinstance(c, C.RequestEnded) for c in notices)
        got = completions(drv, 2)
        assert len(got) == 2 and all(c.count == 0 for c in got)
        for c in got:
            lc.complete(c)
    assert lc.pinned_blocks() == {} and lc.pool.num_free == 16
    assert not stored(store, "_g1")  # group 1 was never computed


def test_threaded_save_overlaps_the_prefill_and_is_exact():
    clock, store, lc, be = rig()
    with ThreadedDriver(be, workers=2, clock=clock) as drv:
        save = start(lc)
        drv.submit(save)
        keys, ids = lc.keys_of("r"), lc.blocks_of("r")
        compute_layers(be, keys, ids, 0, 2)
        lc.layers_done("r", 2)
        drv.submit_all(lc.poll_commands())
        deadline = time.monotonic() + 10  # group 0 is stored while layers 2..4 are still to come
        while stored(store, "_g0") < 2 * len(keys) * 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not stored(store, "_g1")
        compute_layers(be, keys, ids, 2, 4)
        lc.prefill_done("r", 3)
        drv.submit_all(lc.poll_commands())
        for c in completions(drv, 2):
            lc.complete(c)
    assert lc.stats()["done"] == 1
    assert_read_back_whole(store, keys)


class GateSpy(ReferenceBackend):
    """A backend recording what its layer gate answers for every group of a save."""

    def write(self, rank, keys, block_ids, guard=None, layers=None):
        if layers is not None:
            self.answers = [layers(e) for e in (2, 4)]
        return super().write(rank, keys, block_ids, guard, layers)


def test_layers_reported_with_a_device_event_hand_it_to_the_save():
    event = object()  # stands in for a CUDA event: the core passes it on untouched
    clock, store, lc, _ = rig()
    be = GateSpy(SPEC, 16, store)
    with ThreadedDriver(be, workers=2, clock=clock) as drv:
        drv.submit(start(lc))
        keys, ids = lc.keys_of("r"), lc.blocks_of("r")
        compute_layers(be, keys, ids, 0, 4)
        assert lc.layers_done("r", 2, event=event)
        (ready,) = lc.poll_commands()
        assert isinstance(ready, C.LayersReady) and ready.event is event
        drv.submit(ready)
        lc.prefill_done("r", 3)  # the last layers are finished: no event
        drv.submit_all(lc.poll_commands())
        for c in completions(drv, 2):
            lc.complete(c)
    assert be.answers[0] is event and be.answers[1] is True
    assert lc.stats()["done"] == 1
    assert_read_back_whole(store, keys)


def test_a_gate_answers_each_group_with_the_event_of_the_report_covering_it():
    first, second = object(), object()
    gate = LayerGate()
    gate.advance(1, first)
    assert gate.ready(1) is first and gate.ready(2, block=False) is False
    gate.advance(3, second)
    gate.advance(4)  # finished, no event
    assert [gate.ready(n) for n in (1, 2, 3, 4)] == [first, second, second, True]


def test_a_save_past_its_deadline_is_retried_after_the_prefill():
    clock, store, lc, be = rig()
    drv = StepDriver(lc, be)
    save = start(lc, drv=drv)
    clock.advance(11)  # the prefill outlived the save's deadline
    lc.tick()
    assert lc.state_of("r") == "saved"
    assert any(isinstance(c, C.CancelCommand) for c in lc.poll_commands())
    lc.layers_done("r", 2)  # no save waits any more: nothing to send
    assert not [c for c in lc.poll_commands() if isinstance(c, C.LayersReady)]
    compute_layers(be, lc.keys_of("r"), lc.blocks_of("r"), 0, 4)
    lc.prefill_done("r", 9)
    drv.run_until_idle()  # the expired save answers late (nothing stored); the retry stores it
    assert lc.stats()["done"] == 1 and lc.stats()["expired"] == 1
    assert lc.pinned_blocks() == {} and lc.pool.num_free == 16
    assert drv.pending == {} and save.command_id not in {c for c, _ in drv.pending}


def test_a_failed_save_with_no_retries_left_fails_with_503():
    clock, store, lc, be = rig(Policy(read_prefix=False, write_retries=0))
    drv = StepDriver(lc, be)
    save = start(lc, drv=drv)
    drv.pump()
    drv.complete(save.command_id, 0, "fail")
    drv.complete(save.command_id, 1)
    lc.prefill_done("r", 4)
    assert not lc.is_live("r") and lc.stats()["failed"] == 1
    drv.pump()
    assert C.SendFirstToken("r", None, 503) in drv.notices


@pytest.mark.parametrize("call, match", [
    (lambda lc: lc.layers_done("r", 0), "layers_done"),
    (lambda lc: lc.layers_done("r", 5), "4 layers"),
    (lambda lc: lc.layers_done("r", True), "layers_done"),
    (lambda lc: lc.layers_done("nobody", 1), "nobody"),
    (lambda lc: lc.layers_done("r", 3, event=True), "device event"),
])
def test_bad_layer_reports_raise_and_change_nothing(call, match):
    clock, store, lc, be = rig()
    start(lc)
    lc.layers_done("r", 2)
    lc.poll_commands()
    with pytest.raises(KVStateError, match=match):
        call(lc)
    with pytest.raises(ValidationError, match="in order"):
        lc.layers_done("r", 2)
    assert lc.poll_commands() == [] and lc.state_of("r") == "prefilling"


def test_layer_reports_need_a_layerwise_prefill_and_a_live_one():
    plain = PrefillLifecycle(SPEC, 16)
    plain.admit("r", PROMPT)
    with pytest.raises(ValidationError, match="layerwise=True"):
        plain.layers_done("r", 1)
    with pytest.raises(ValidationError, match="must be a bool"):
        PrefillLifecycle(SPEC, 16, layerwise=1)
    clock, store, lc, be = rig()
    lc.admit("big", list(range(60)))  # 15 blocks: waits behind nothing, takes the pool
    lc.admit("w", PROMPT)  # waits for blocks: not prefilling
    with pytest.raises(ValidationError, match="only while it prefills"):
        lc.layers_done("w", 1)
    lc.abort("w")
    lc.poll_commands()
    assert lc.layers_done("w", 1) is False  # it ended: a late report is dropped
    assert isinstance(lc.poll_commands()[-1], C.LateEvent)


def test_a_save_needs_a_gate_and_a_gate_wait_always_ends():
    clock, store, lc, be = rig()
    save = start(lc)
    from kvstate.backends._runner import execute
    with pytest.raises(ValidationError, match="layer gate"):
        execute(be, save, 0)
    gate = LayerGate(fence=1.0, clock=clock)
    assert gate.ready(2, block=False) is False
    gate.advance(3)
    gate.advance(1)  # smaller: ignored
    assert gate.ready(3) and gate.layers == 3
    clock.advance(2)  # past the fence: a wait for more gives up at once
    assert gate.ready(4) is False
    gate = LayerGate()
    gate.close()
    assert gate.ready(1) is False


def _stored_by_p(store: MemoryStore, groups_missing: tuple[str, ...] = ()):
    """P's cache of PROMPT stored (every layer computed), some objects then evicted."""
    clock, _, lc, be = rig(store=store)
    drv = StepDriver(lc, be)
    start(lc, "p", drv)
    keys, ids = lc.keys_of("p"), lc.blocks_of("p")
    compute_layers(be, keys, ids, 0, 4)
    lc.prefill_done("p", 1)
    drv.run_until_idle()
    store.evict(list(groups_missing))
    return keys


def _load(store: MemoryStore, policy: Policy):
    from kvstate import DecodeLifecycle
    d = DecodeLifecycle(SPEC, 16, policy, layerwise=True)
    be = ReferenceBackend(SPEC, 16, store)
    d.reserve("r", PROMPT)
    d.deliver_first_token("r", 1)
    (load,) = d.poll_commands()
    assert isinstance(load, C.LoadLayers)
    with ThreadedDriver(be, workers=2) as drv:
        drv.submit(load)
        arrivals = [drv.arrivals(load.command_id, r) for r in load.ranks]
        waited = [a.wait(n, timeout=10)[0] for a in arrivals for n in (2, 4)]  # a decode step's waits
        got = completions(drv, len(load.ranks))
        assert drv.arrivals(load.command_id) is None  # let go once its completion was polled
    for c in got:
        d.complete(c)
    return d, be, waited


def test_a_layerwise_load_reports_each_group_and_the_request_runs_once_whole():
    store = MemoryStore(1 << 24)
    keys = _stored_by_p(store)
    d, be, waited = _load(store, Policy())
    assert waited == [True, True, True, True]
    assert d.state_of("r") == "running"
    assert mismatched_blocks(be, keys, d.blocks_of("r")) == []


def test_a_load_missing_a_group_stops_there_and_recomputes():
    store = MemoryStore(1 << 24)
    keys = _stored_by_p(store)
    store.evict([f"{keys[1]}_key_1_g1"])  # rank 1 lacks layers 2..4 of block 1
    d, be, waited = _load(store, Policy(read_failure="recompute"))
    assert waited == [True, True, True, False]  # rank 1: group 0 arrived, group 1 never did
    assert d.state_of("r") == "recomputing"
    rec = [c for c in d.poll_commands() if isinstance(c, C.Recompute)]
    assert rec and rec[0].from_token == 4  # block 0 arrived whole on every rank: recompute after it


def test_a_layerwise_decode_lifecycle_needs_a_bool():
    from kvstate import DecodeLifecycle
    with pytest.raises(ValidationError, match="must be a bool"):
        DecodeLifecycle(SPEC, 16, layerwise="yes")


def test_a_short_first_group_still_reads_every_group_of_the_blocks_it_counts():
    """Group 0 of block 1 is missing: the load counts block 0 only, so block 0 must hold every
    group's layers (not group 0 alone), and no group is reported as arrived."""
    store = MemoryStore(1 << 24)
    keys = _stored_by_p(store)
    store.evict([f"{keys[1]}_key_0_g0"])
    d = ReferenceBackend(SPEC, 16, store)
    reported = []
    assert d.read(0, keys, [4, 5, 6, 7], arrived=lambda n, ev: reported.append(n)) == 1
    assert reported == []
    assert [b for b in mismatched_blocks(d, keys[:1], [4]) if b[1] == 0] == []

"""Behaviours the mutation run of the lifecycle modules found untested (docs/benchmarks.md,
"Mutation testing"): each test here failed against one or more of its surviving mutants."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from lifecycle_helpers import answer_only
from rigs import Clock, small_spec

from kvstate import MACHINES, InvalidTransitionError, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate._decode import DECODE, DecodeLifecycle
from kvstate._machine import CompiledMachine, MachineDef, StockMachine, mermaid, stock_machine
from kvstate.backends import MemoryStore, ReferenceBackend, StepDriver


@pytest.mark.parametrize("trigger", ["finish", "no_such_event"])
def test_the_stock_machine_refuses_an_event_naming_request_state_event_and_machine(trigger):
    machine = StockMachine(DECODE, DecodeLifecycle(small_spec(1), 8))
    with pytest.raises(InvalidTransitionError) as e:
        machine.fire(SimpleNamespace(id="r", state="reserved"), trigger)
    assert (e.value.request_id, e.value.state, e.value.event, e.value.machine) == ("r", "reserved", trigger, "decode")


@pytest.mark.parametrize("name", list(MACHINES))
def test_the_diagram_has_its_title_initial_state_and_conditions_and_no_extra_events(name):
    defn, text = MACHINES[name], mermaid(MACHINES[name])
    assert text.startswith(f"---\nkvstate {name} lifecycle\n---\n")
    assert f"[*] --> {defn.initial}" in text
    for tr in defn.transitions:
        for cond in [tr["conditions"]] if isinstance(tr.get("conditions"), str) else tr.get("conditions", []):
            assert f"[{cond}]" in text, cond
    assert ": to_" not in text  # transitions' automatic to_<state> events are not the machine's


def layerwise_prefill():
    spec = small_spec(tp=1, num_layers=4, layer_groups=2)
    lc = PrefillLifecycle(spec, 16, clock=Clock(), layerwise=True)
    drv = StepDriver(lc, ReferenceBackend(spec, 16, MemoryStore(1 << 22)))
    lc.admit("r", list(range(10)))
    answer_only(drv, C.ReadBlocks)  # the prefix lookup; the save waits for layers
    drv.pump()
    assert lc.state_of("r") == "prefilling" and any(isinstance(c, C.SaveLayers) for c in drv.pending.values())
    return lc


def test_layer_reports_count_from_one_and_name_their_request():
    lc = layerwise_prefill()
    with pytest.raises(ValidationError, match=r"layers_done must be an int > 0, got 0"):
        lc.layers_done("r", 0)
    assert lc.layers_done("r", 1)
    [ready] = [c for c in lc.poll_commands() if isinstance(c, C.LayersReady)]
    assert ready.request_id == "r" and ready.layers == 1
    lc.abort("r")
    lc.poll_commands()
    assert lc.layers_done("r", 2) is False
    [late] = [c for c in lc.poll_commands() if isinstance(c, C.LateEvent)]
    assert late.request_id == "r" and late.event == "layers_done"


def test_typed_events_reach_their_method_and_a_foreign_one_is_refused_by_name():
    from kvstate import events as E

    d = DecodeLifecycle(small_spec(1), 8, clock=Clock())
    assert d.handle(E.Reserve("r", [1, 2, 3])) == d.blocks_of("r") == (0,)
    assert d.handle(E.Tick()) == 0
    assert d.handle(E.Abort("r")) is True and d.live_requests() == []
    with pytest.raises(ValidationError, match="^DecodeLifecycle does not take Admit events$"):
        d.handle(E.Admit("q", [1]))
    assert d.live_requests() == []


def test_stats_name_live_requests_pending_commands_and_the_pool():
    d = DecodeLifecycle(small_spec(1), 8, clock=Clock())
    d.reserve("r", list(range(9)))  # 3 blocks: 9 tokens and the first
    st = d.stats()
    assert st["live"] == 1 and st["pending_commands"] == 0
    assert st["pool"].used == 3 and st["pool"].free == 5


TOY = MachineDef(name="toy", states=("a", "b", "done"), initial="a", terminal=("done",), transitions=(
    {"trigger": "go", "source": "a", "dest": "b", "conditions": "ok", "after": "note"},
    {"trigger": "end", "source": "b", "dest": "done"},
))
#: the toy with the callback kinds only transitions runs (the compiled machine refuses them)
TOY_STOCK = dataclasses.replace(TOY, transitions=(
    {**TOY.transitions[0], "unless": "blocked", "before": "note"}, TOY.transitions[1]))


class ToyOwner:
    """The toy machine's callbacks: ``ok`` says whether ``go`` may fire."""

    def __init__(self, ok: bool) -> None:
        self.allowed, self.notes = ok, []

    def ok(self, req, value):
        return self.allowed

    def blocked(self, req, value):
        return False

    def note(self, req, value):
        self.notes.append(req.state)


@pytest.mark.parametrize("machine_cls", [CompiledMachine, StockMachine])
def test_a_trigger_whose_conditions_fail_leaves_the_state_and_says_so(machine_cls):
    req = SimpleNamespace(id="r", state="a")
    machine = machine_cls(TOY, ToyOwner(ok=False))
    assert machine.fire(req, "go") is False and req.state == "a"
    with pytest.raises(InvalidTransitionError) as e:
        machine.fire(req, "end")
    assert (e.value.request_id, e.value.state, e.value.event, e.value.machine) == ("r", "a", "end", "toy")


def test_the_stock_machine_binds_every_callback_kind_to_the_owner_and_adds_no_events():
    owner, req = ToyOwner(ok=True), SimpleNamespace(id="r", state="a")
    assert StockMachine(TOY_STOCK, owner).fire(req, "go") is True and req.state == "b"
    assert owner.notes == ["a", "b"]  # before the state changed, and after
    stock = stock_machine(TOY_STOCK)
    assert set(stock.events) == {"go", "end"} and stock.initial == "a"
    assert stock_machine(TOY, queued=True).has_queue  # transitions' own options pass through


def test_the_first_token_releases_every_layer_to_the_save_once():
    lc = layerwise_prefill()
    [save] = [c for c in lc.pending_commands() if isinstance(c, C.SaveLayers)]
    lc.layers_done("r", 1)
    lc.poll_commands()
    lc.prefill_done("r", 7)  # the cache is whole: the save may store every layer
    [ready] = [c for c in lc.poll_commands() if isinstance(c, C.LayersReady)]
    assert (ready.request_id, ready.command_id, ready.layers) == ("r", save.command_id, 4)
    other = layerwise_prefill()
    other.layers_done("r", 4)
    other.poll_commands()
    other.prefill_done("r", 7)  # every layer was reported already: nothing more to release
    assert not [c for c in other.poll_commands() if isinstance(c, C.LayersReady)]
    plain = PrefillLifecycle(small_spec(1), 8, clock=Clock())
    plain.admit("p", list(range(8)))
    answer_only(StepDriver(plain, ReferenceBackend(small_spec(1), 8, MemoryStore(1 << 20))), C.ReadBlocks)
    plain.prefill_done("p", 7)
    assert not [c for c in plain.poll_commands() if isinstance(c, C.LayersReady)]


# -- a clock that cannot tell the time refuses the call whole ---------------------------------------
def _nan_rig():
    """P with "a" prefilling, D with "a" reading (its read pending) and "b" reserved, "c" running:
    every call below has a request to act on; then the clock reads NaN."""
    from protocol_support import snapshot
    from rigs import Rig

    rig = Rig()
    for rid in ("a", "b", "c"):
        rig.D.reserve(rid, list(range(9)))
    for rid in ("a", "c"):
        rig.P.admit(rid, list(range(9)))
    rig.pd.run_until_idle()
    rig.P.prefill_done("c", 3)
    rig.pd.run_until_idle()
    rig.D.deliver_first_token("c", 3)
    rig.dd.run_until_idle()
    rig.D.deliver_first_token("a", 3)
    rig.dd.pump()
    assert rig.D.state_of("c") == "running" and rig.D.state_of("a") == "reading" and rig.dd.pending
    rig.clock.now = float("nan")
    return rig, lambda: (snapshot(rig.P), snapshot(rig.D))


@pytest.mark.parametrize("call", [
    lambda r: r.D.reserve("new", list(range(9))), lambda r: r.P.admit("new", list(range(9))),
    lambda r: r.P.prefill_done("a", 3), lambda r: r.D.deliver_first_token("b", 3),
    lambda r: r.D.preempt("c"), lambda r: r.D.finish("c"), lambda r: r.D.abort("b"), lambda r: r.P.abort("a"),
    lambda r: r.dd.complete(*next(iter(r.dd.pending))), lambda r: r.D.tick(),
])
def test_a_clock_reading_nan_refuses_the_call_and_changes_nothing(call):
    """A refused clock used to leave a reserved request registered, holding blocks, with no
    deadline (so no tick would ever end it): now the clock is read before anything changes."""
    rig, state = _nan_rig()
    before = state()
    with pytest.raises(ValidationError, match="clock must read a finite number"):
        call(rig)
    assert state() == before
    assert not rig.D.is_live("new") and not rig.P.is_live("new")

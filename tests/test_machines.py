"""The machine definitions, the compiled machine's equivalence with stock transitions, diagrams."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rigs import Rig
from transitions import Machine, MachineError

from kvstate import MACHINES, InvalidTransitionError, Policy
from kvstate import commands as C
from kvstate._machine import CompiledMachine, MachineDef, StockMachine, mermaid, stock_machine


def _sources(tr):
    return [tr["source"]] if isinstance(tr["source"], str) else list(tr["source"])


@pytest.mark.parametrize("name", list(MACHINES))
def test_definitions_are_data_and_consistent(name):
    d = MACHINES[name]
    states = set(d.states)
    assert d.initial in states and set(d.terminal) <= states
    for tr in d.transitions:
        assert set(_sources(tr)) <= states and tr["dest"] in states
        assert not set(_sources(tr)) & set(d.terminal), "nothing leaves a terminal state"
        if tr["dest"] in ("failed", "done", "aborted"):  # every row that ends a request recycles it
            after = [tr["after"]] if isinstance(tr["after"], str) else tr["after"]
            assert after[-1] == "_recycle", tr
    reachable, changed = {d.initial}, True
    while changed:
        changed = False
        for tr in d.transitions:
            if set(_sources(tr)) & reachable and tr["dest"] not in reachable:
                reachable.add(tr["dest"])
                changed = True
    assert reachable == states
    aborts = [tr for tr in d.transitions if tr["trigger"] == "abort"]
    assert set(aborts[0]["source"]) == states - set(d.terminal) == set(d.live)


class _Req:
    __slots__ = ("id", "state")

    def __init__(self, state):
        self.id, self.state = "r", state


class _Owner:
    """Every callback the table names: logs its call; a condition answers from ``answers``."""

    def __init__(self, answers, log):
        self.answers, self.log = answers, log

    def __getattr__(self, name):
        if not name.startswith("_"):
            raise AttributeError(name)

        def callback(req, value):
            self.log.append((name, req.state, value))
            return self.answers.get((name, req.state), True)
        return callback


def _run(defn: MachineDef, compiled: bool, triggers, answers):
    log, owner, req = [], None, _Req(defn.initial)
    owner = _Owner(answers, log)
    if compiled:
        m = CompiledMachine(defn, owner)

        def fire(trigger, value):
            try:
                return m.fire(req, trigger, value)
            except InvalidTransitionError:
                return "invalid"
    else:
        events = stock_machine(defn, owner).events

        def fire(trigger, value):
            try:
                return events[trigger].trigger(req, req, value)
            except MachineError:
                return "invalid"
    for i, trigger in enumerate(triggers):
        log.append((trigger, fire(trigger, i), req.state))
    return log


@settings(max_examples=300, deadline=None)
@given(data=st.data(), name=st.sampled_from(list(MACHINES)))
def test_the_compiled_machine_does_what_stock_transitions_does(data, name):
    """Random trigger sequences, and random answers of every condition per state: the same
    outcomes, states and callback calls (with their arguments), in the same order."""
    defn = MACHINES[name]
    triggers = data.draw(st.lists(st.sampled_from(sorted({t["trigger"] for t in defn.transitions})), max_size=30))
    conds = sorted({(c, s) for t in defn.transitions for c in ([t.get("conditions")] if isinstance(
        t.get("conditions"), str) else t.get("conditions") or []) for s in _sources(t)})
    answers = {k: data.draw(st.booleans()) for k in conds}
    compiled = _run(defn, True, triggers, answers)
    assert compiled == _run(defn, False, triggers, answers)


def test_only_what_it_can_run_is_compiled():
    d = MachineDef("x", ("a", "b"), "a", ("b",), (dict(trigger="go", source="a", dest="b", before="_cb"),))
    with pytest.raises(ValueError, match="only conditions and after"):
        CompiledMachine(d, _Owner({}, []))


def _engine_acts(rig, lc, n, rng) -> None:
    """What the engine does on a notice: compute, pass the token on, decode or preempt."""
    if isinstance(n, C.StartPrefill):
        lc.prefill_done(n.request_id, 1)
    elif isinstance(n, C.SendFirstToken) and n.request_id in rig.D.live_requests():
        rig.D.deliver_first_token(n.request_id, n.token, n.error_code)
    elif isinstance(n, C.Recompute):
        rig.D.recompute_done(n.request_id)
    elif isinstance(n, C.StartDecode):
        (rig.D.preempt if rng.random() < 0.5 else rig.D.finish)(n.request_id)


def _trace(machine_cls, seed: int):
    """Drive a random P+D workload and record every state each request passes through."""
    rng = random.Random(seed)
    rig = Rig(policy=Policy(read_failure="recompute", transfer_timeout=8.0, fence_grace=1.0), machine_cls=machine_cls)
    trace = []
    for i in range(12):
        toks = [rng.randrange(5) for _ in range(rng.randint(2, 14))]
        rig.D.reserve(f"r{i}", toks)
        rig.P.admit(f"r{i}", toks)
    for _ in range(400):
        for drv, lc in ((rig.pd, rig.P), (rig.dd, rig.D)):
            drv.pump()
            for n in list(drv.notices):
                drv.notices.remove(n)
                _engine_acts(rig, lc, n, rng)
            for _ in range(rng.randint(0, 6)):
                if drv.pending:
                    key = rng.choice(sorted(drv.pending))
                    drv.complete(*key, outcome=rng.choice([None, None, None, "fail", 0]))
        for rid in list(rig.D.live_requests()):
            if rig.D.state_of(rid) == "preempted":
                rig.D.resume(rid)
        rig.clock.advance(0.5)
        rig.P.tick()
        rig.D.tick()
        trace.append(tuple(sorted((r, lc.state_of(r)) for lc in (rig.P, rig.D) for r in lc.live_requests())))
    states = {s for step in trace for _, s in step}
    assert {"reading", "running", "preempt_writing", "reloading", "writing"} <= states, states  # it got somewhere
    return trace


@pytest.mark.parametrize("seed", range(3))
def test_whole_lifecycles_run_the_same_on_compiled_and_stock_machines(seed):
    assert _trace(CompiledMachine, seed) == _trace(StockMachine, seed)


def test_the_stock_machine_is_plain_transitions():
    m = stock_machine(MACHINES["decode"])
    assert type(m) is Machine and m.models == []


@pytest.mark.parametrize("name", list(MACHINES))
def test_mermaid_diagram_drawn_from_the_definition(name):
    text = mermaid(MACHINES[name])
    assert "stateDiagram-v2" in text
    for s in MACHINES[name].states:
        assert f'state "{s}"' in text
    for tr in MACHINES[name].transitions:
        assert tr["trigger"] in text

"""The machine tables, the lean machine's equivalence with stock transitions, diagrams."""
import random

import pytest
from conftest import Rig
from transitions import Machine

from kvstate import Policy
from kvstate import commands as C
from kvstate.machines import MACHINES, LeanMachine, mermaid


@pytest.mark.parametrize("name", list(MACHINES))
def test_tables_are_data_and_consistent(name):
    t = MACHINES[name]
    states = set(t.STATES)
    assert t.INITIAL in states and set(t.TERMINAL) <= states
    for tr in t.TRANSITIONS:
        srcs = [tr["source"]] if isinstance(tr["source"], str) else tr["source"]
        assert set(srcs) <= states and tr["dest"] in states
        assert not set(srcs) & set(t.TERMINAL), "nothing leaves a terminal state"
    reachable = {t.INITIAL}
    changed = True
    while changed:
        changed = False
        for tr in t.TRANSITIONS:
            srcs = [tr["source"]] if isinstance(tr["source"], str) else tr["source"]
            if set(srcs) & reachable and tr["dest"] not in reachable:
                reachable.add(tr["dest"])
                changed = True
    assert reachable == states
    # abort leaves every live state
    aborts = [tr for tr in t.TRANSITIONS if tr["trigger"] == "abort"]
    assert set(aborts[0]["source"]) == states - set(t.TERMINAL)


def test_lifecycles_use_one_machine_each_with_no_models():
    rig = Rig()
    assert isinstance(rig.P.machine, LeanMachine) and isinstance(rig.D.machine, LeanMachine)
    rig.P.admit("a", list(range(9)))
    rig.P.admit("b", list(range(9)))
    assert rig.P.machine.models == []


def _trace(lean: bool, seed: int):
    """Drive a random P+D workload and record every state each request passes through."""
    rng = random.Random(seed)
    rig = Rig(policy=Policy(read_failure="recompute", transfer_timeout=8.0, fence_grace=1.0))
    for lc in (rig.P, rig.D):
        lc.__init__(lc.spec, 64, lc.policy, clock=rig.clock, lean_machine=lean)
    rig.pd.lifecycle, rig.dd.lifecycle = rig.P, rig.D
    trace = []
    for i in range(12):
        toks = [rng.randrange(5) for _ in range(rng.randint(2, 14))]
        rid = f"r{i}"
        rig.D.reserve(rid, toks)
        rig.P.admit(rid, toks)
    for _ in range(400):
        for drv, lc in ((rig.pd, rig.P), (rig.dd, rig.D)):
            drv.pump()
            for n in list(drv.notices):
                drv.notices.remove(n)
                if isinstance(n, C.StartPrefill):
                    lc.prefill_done(n.request_id, 1)
                elif isinstance(n, C.SendFirstToken) and n.request_id in rig.D.live_requests():
                    rig.D.deliver_first_token(n.request_id, n.token, n.error_code)
                elif isinstance(n, C.Recompute):
                    rig.D.recompute_done(n.request_id)
                elif isinstance(n, C.StartDecode) and rng.random() < 0.5:
                    rig.D.preempt(n.request_id)
                elif isinstance(n, C.StartDecode):
                    rig.D.finish(n.request_id)
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
    assert {"reading", "running", "preempt_writing", "reloading", "writing"} <= states, states  # the walk got somewhere
    return trace


@pytest.mark.parametrize("seed", range(3))
def test_lean_machine_behaves_exactly_like_stock_transitions(seed):
    assert _trace(True, seed) == _trace(False, seed)


def test_stock_machine_is_plain_transitions():
    rig = Rig()
    rig.P.__init__(rig.spec, 8, lean_machine=False)
    assert type(rig.P.machine) is Machine


@pytest.mark.parametrize("name", list(MACHINES))
def test_mermaid_diagram_drawn_from_the_table(name):
    text = mermaid(MACHINES[name])
    assert "stateDiagram-v2" in text
    for s in MACHINES[name].STATES:
        assert f'state "{s}"' in text
    for tr in MACHINES[name].TRANSITIONS:
        assert tr["trigger"] in text

"""The machine tables, the lean machine's equivalence with stock transitions, diagrams."""
import random

import pytest
from conftest import Rig
from transitions import Machine, MachineError

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


class _Model:
    """Logs every callback; the state attribute is set by the machine."""

    def __init__(self, log):
        self.state, self.log, self.flag = "a", log, True

    def __getattr__(self, name):  # callbacks named in the table: log and answer self.flag
        if name.startswith("cb_"):
            def cb(*args, **kwargs):
                self.log.append((name, self.state, tuple(a if isinstance(a, int) else type(a).__name__ for a in args)))
                return self.flag
            return cb
        raise AttributeError(name)


_MACHINE_CALLBACKS = {
    "none": {},
    "state_change": dict(before_state_change="cb_bsc", after_state_change="cb_asc"),
    "event": dict(prepare_event="cb_pe", finalize_event="cb_fe", on_final="cb_final"),
    "send_event": dict(send_event=True),
}


def _every_callback_kind(cls, seed: int, machine_callbacks: str):
    """Random triggers on a machine using each kind of callback transitions offers."""
    rng = random.Random(seed)
    log: list = []
    extra = _MACHINE_CALLBACKS[machine_callbacks]
    states = ["a", dict(name="b", on_enter="cb_enter_b", on_exit="cb_exit_b"), "c", dict(name="z", final=True)]
    m = cls(model=None, states=states, initial="a", auto_transitions=False, **extra, transitions=[
        dict(trigger="go", source="a", dest="b", conditions="cb_cond", after="cb_after"),
        dict(trigger="go", source="a", dest="c", unless="cb_unless", after=["cb_after2", "cb_after3"]),
        dict(trigger="go", source="b", dest="c", prepare="cb_prep", before="cb_before"),
        dict(trigger="go", source="c", dest="a"),
        dict(trigger="stay", source=["a", "b", "c"], dest=None, after="cb_internal"),
        dict(trigger="end", source="c", dest="z", after="cb_end"),
        dict(trigger="back", source="z", dest="a"),
    ])
    model = _Model(log)
    for _ in range(60):
        model.flag = rng.random() < 0.5
        trigger = rng.choice(["go", "go", "stay", "end", "back"])
        try:
            ok = m.events[trigger].trigger(model, rng.randrange(3))
        except MachineError as e:
            ok = f"error: {e}"
        log.append((trigger, ok, model.state))
    return log


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("machine_callbacks", list(_MACHINE_CALLBACKS))
def test_lean_machine_runs_every_callback_kind_like_stock(seed, machine_callbacks):
    lean = _every_callback_kind(LeanMachine, seed, machine_callbacks)
    assert lean == _every_callback_kind(Machine, seed, machine_callbacks)
    assert {e[0] for e in lean} >= {"cb_cond", "cb_after", "cb_enter_b", "cb_exit_b", "cb_prep", "cb_internal"}

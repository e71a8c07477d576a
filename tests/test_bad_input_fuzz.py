"""Bad-input fuzzing: hypothesis generates invalid arguments for each public entry point; every
one raises a KVStateError and leaves the lifecycle exactly as it was (snapshot before == after)."""
from __future__ import annotations

from conftest import Rig
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_machine import snapshot

from kvstate import KVStateError
from kvstate.events import Completion

junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                 st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                 st.integers(max_value=-1), st.binary(max_size=3))
bad_tokens = st.one_of(st.just([]), st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                       st.lists(st.text(max_size=2), min_size=1, max_size=2), st.text(max_size=3), st.none(),
                       st.just([2**64]), st.lists(st.floats(), min_size=1, max_size=2))
bad_ids = st.one_of(st.just(""), st.integers(), st.none(), st.lists(st.integers(), max_size=2))


def live_rig() -> Rig:
    """P and D with one request each in a non-initial state and one command pending."""
    rig = Rig(tp=2, blocks=16)
    rig.D.reserve("a", list(range(9)))
    rig.P.admit("a", list(range(9)))
    rig.pd.pump()
    rig.D.deliver_first_token("a", 3)
    rig.dd.pump()
    return rig


CALLS = {
    "P.admit(id)": lambda r, x: r.P.admit(x, [1, 2, 3]),
    "P.admit(tokens)": lambda r, x: r.P.admit("new", x),
    "P.admit(extra_keys)": lambda r, x: r.P.admit("new", [1, 2, 3], x if x is not None and x != {} else 5),
    "P.prefill_done(token)": lambda r, x: r.P.prefill_done("a", x),
    "P.prefill_done(id)": lambda r, x: r.P.prefill_done(x, 1),
    "D.reserve(tokens)": lambda r, x: r.D.reserve("new", x),
    "D.reserve(id)": lambda r, x: r.D.reserve(x, [1]),
    "D.deliver_first_token(token)": lambda r, x: r.D.deliver_first_token("a", x),
    "D.append_tokens(tokens)": lambda r, x: r.D.append_tokens("a", x),
    "D.finish(id)": lambda r, x: r.D.finish(x),
    "D.preempt(id)": lambda r, x: r.D.preempt(x),
    "D.resume(id)": lambda r, x: r.D.resume(x),
    "D.abort(id)": lambda r, x: r.D.abort(x),
    "D.can_reserve(n)": lambda r, x: r.D.can_reserve(x),
    "D.complete(event)": lambda r, x: r.D.complete(x),
    "D.complete(rank)": lambda r, x: r.D.complete(Completion(r.D.pending_commands()[0].command_id, x, 0)),
    "D.complete(count)": lambda r, x: r.D.complete(Completion(r.D.pending_commands()[0].command_id, 0, x)),
    "D.handle(event)": lambda r, x: r.D.handle(x),
}


@settings(max_examples=300, deadline=None)
@given(call=st.sampled_from(sorted(CALLS)), data=st.data())
def test_invalid_arguments_raise_and_change_nothing(call, data):
    rig = live_rig()
    strat = {"tokens": bad_tokens, "id": bad_ids}.get(call[call.index("(") + 1:-1], junk)
    arg = data.draw(strat)
    if call.endswith("(count)") and isinstance(arg, int) and not isinstance(arg, bool) and arg >= 0:
        arg = 10**6  # beyond the command's blocks
    if call.endswith("(rank)") and arg in (0, 1) and not isinstance(arg, bool):
        arg = 7
    before = (snapshot(rig.P), snapshot(rig.D), rig.D.pending_commands()[0].command_id)
    try:
        CALLS[call](rig, arg)
    except KVStateError:
        pass
    else:
        raise AssertionError(f"{call} accepted {arg!r}")
    assert (snapshot(rig.P), snapshot(rig.D), rig.D.pending_commands()[0].command_id) == before


# -- regression corpus: every failure the fuzzing found, kept as an explicit case ------------------
def test_regression_unhashable_request_id_is_a_kvstate_error():
    """Found by the fuzzing above: ``abort([0])`` raised TypeError (dict lookup of a list)."""
    rig = live_rig()
    before = snapshot(rig.D)
    for call in ("D.abort(id)", "D.finish(id)", "D.preempt(id)", "D.resume(id)", "P.prefill_done(id)"):
        try:
            CALLS[call](rig, [0])
        except KVStateError as e:
            assert "request id must be a str" in str(e)
        else:
            raise AssertionError(call)
    assert snapshot(rig.D) == before


def test_regression_bool_is_not_a_token_count():
    """Found by the fuzzing above: ``can_reserve(True)`` was taken as 1 token."""
    rig = live_rig()
    for v in (True, False):
        try:
            rig.D.can_reserve(v)
        except KVStateError as e:
            assert "num_tokens must be an int > 0" in str(e)
        else:
            raise AssertionError(v)
    # and ``complete`` took rank False for rank 0
    cid = rig.D.pending_commands()[0].command_id
    before = snapshot(rig.D)
    try:
        rig.D.complete(Completion(cid, False, 0))
    except KVStateError:
        pass
    else:
        raise AssertionError("rank False accepted")
    assert snapshot(rig.D) == before

"""Bad arguments for every public method of the lifecycles and the step driver, generated from
their signatures: for each parameter, hypothesis draws a value its annotation rules out (or a
value of the right type that breaks a rule), the other arguments stay valid, and the call must
raise a KVStateError and leave P, D and the driver exactly as they were.

The methods are found by introspection, not listed: a new public method, or a parameter whose
annotation has no bad values below, fails :func:`test_every_public_parameter_has_bad_values`.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_support import snapshot
from rigs import Rig

from kvstate import DecodeLifecycle, KVStateError, PrefillLifecycle
from kvstate import commands as C
from kvstate.backends import StepDriver
from kvstate.events import Completion

not_str = st.one_of(st.none(), st.integers(), st.booleans(), st.binary(max_size=2), st.just(["a"]), st.just(""))
not_count = st.one_of(st.none(), st.booleans(), st.integers(max_value=0), st.integers(min_value=2**63),
                      st.floats(allow_nan=True), st.text(max_size=2))
not_token = st.one_of(st.booleans(), st.integers(max_value=-1), st.integers(min_value=2**32), st.floats(),
                      st.text(max_size=2), st.just([1]))
not_tokens = st.one_of(st.just([]), st.none(), st.text(max_size=3), st.integers(),
                       st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
                       st.lists(st.booleans(), min_size=1, max_size=2), st.just([2**32]), st.just([1.5]))
not_extra_keys = st.one_of(st.integers(), st.text(max_size=2), st.just({0: 5}), st.just({-1: ["x"]}),
                           st.just({"0": ["x"]}), st.just({True: ["x"]}), st.just({0: [5]}))
not_event = st.one_of(st.none(), st.integers(), st.text(max_size=2), st.just(("Completion", 1, 0, 0)),
                      st.just(Completion("1", 0, 0)))  # an answer to no pending command is stale, not bad
not_status = st.one_of(st.booleans(), st.integers(max_value=99), st.integers(min_value=600), st.floats(),
                       st.none(), st.text(max_size=2))
not_rank = st.one_of(st.booleans(), st.integers(max_value=-1), st.integers(min_value=2), st.none(), st.floats())
not_outcome = st.one_of(st.booleans(), st.integers(max_value=-1), st.text(max_size=3).filter(lambda s: s != "fail"),
                        st.floats(), st.just([1]))

not_command = st.one_of(st.none(), st.integers(), st.text(max_size=2), st.just(Completion(1, 0, 0)), st.just(object()))
#: a list whose last item is no command: the ones before it must not be taken either
not_commands = st.one_of(st.none(), st.integers(), not_command.map(lambda c: [C.FreeBlocks("a", ()), c]))
not_timeout = st.one_of(st.none(), st.booleans(), st.floats(max_value=-1e-9), st.just(float("nan")),
                        st.just(float("inf")), st.text(max_size=2))

#: (class, parameter name or annotation) -> what may not pass; a parameter name wins over its annotation
BAD: dict[str, st.SearchStrategy[Any]] = {
    "request_id": not_str, "str": not_str, "int": not_count, "token_ids": not_tokens,
    "Sequence[int]": not_tokens, "Mapping[int, Sequence[str]] | None": not_extra_keys,
    "first_token": not_token, "token": not_token, "error_code": not_status,
    "E.Completion": not_event, "E.Event": not_event, "command_id": not_count,
    "rank": not_rank, "outcome": not_outcome, "max_steps": not_count,
    "cmd": not_command, "cmds": not_commands, "timeout": not_timeout,
    # a count of any size is a fair question ("can 2**63 tokens be reserved?" No): only its type is bad
    "num_tokens": st.one_of(st.none(), st.booleans(), st.integers(max_value=0), st.floats(), st.text(max_size=2)),
}
#: parameters whose every value is the engine's own (an opaque event handed back, never read)
OPAQUE = {"event: Any"}


def live() -> Rig:
    """P with request "a" prefilling and D with "a" reading and "b" reserved: one command pending
    on each driver, so every method has a live request and a pending answer to act on."""
    rig = Rig(tp=2, blocks=16)
    for rid in ("a", "b"):
        rig.D.reserve(rid, list(range(9)))
    rig.P.admit("a", list(range(9)))
    rig.pd.pump()
    rig.D.deliver_first_token("a", 3)
    rig.dd.pump()
    return rig


def valid(rig: Rig, name: str) -> Any:
    """A value of parameter ``name`` that the call would accept."""
    cid = next(iter(rig.dd.pending))[0] if rig.dd.pending else 1
    return {"request_id": "a", "token_ids": [1, 2, 3], "extra_keys": None, "layers": 1, "first_token": 3,
            "token": 3, "error_code": 200, "num_tokens": 4, "command_id": cid, "rank": 0, "outcome": None}[name]


TARGETS: dict[str, tuple[type, Callable[[Rig], Any]]] = {
    "P": (PrefillLifecycle, lambda r: r.P), "D": (DecodeLifecycle, lambda r: r.D),
    "StepDriver": (StepDriver, lambda r: r.dd),
}


def public_parameters() -> list[tuple[str, str, inspect.Parameter]]:
    out = []
    for target, (cls, _) in TARGETS.items():
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_") or "ǁ" in name:  # private, or mutmut's copy of a method
                continue
            for p in list(inspect.signature(fn).parameters.values())[1:]:
                if f"{p.name}: {p.annotation}" not in OPAQUE:
                    out.append((target, name, p))
    return out


PARAMS = public_parameters()


def bad_values(p: inspect.Parameter) -> st.SearchStrategy[Any] | None:
    by_name = BAD.get(p.name)
    return by_name if by_name is not None else BAD.get(str(p.annotation))


def test_every_public_parameter_has_bad_values():
    missing = [f"{t}.{m}({p.name}: {p.annotation})" for t, m, p in PARAMS if bad_values(p) is None]
    assert not missing, f"no bad values for: {missing}"
    assert len(PARAMS) >= 30  # the lifecycles' and the driver's methods were found


def snap(rig: Rig) -> tuple[Any, ...]:
    return snapshot(rig.P), snapshot(rig.D), sorted(rig.dd.pending), sorted(rig.pd.pending)


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(PARAMS), data=st.data())
def test_a_bad_argument_to_any_public_method_is_refused_and_changes_nothing(case, data):
    target, method, param = case
    rig = live()
    obj = TARGETS[target][1](rig)
    fn = getattr(obj, method)
    bad = data.draw(bad_values(param), label=f"{target}.{method}({param.name})")
    args = {p.name: valid(rig, p.name) for _, m, p in PARAMS if m == method and p.name != param.name
            and p.name in inspect.signature(fn).parameters and p.default is inspect.Parameter.empty}
    if method in ("admit", "reserve") and param.name != "request_id":
        args["request_id"] = "new"
    if method == "deliver_first_token" and param.name != "request_id":
        args["request_id"] = "b"  # reserved, waiting for its first token
    before = snap(rig)
    try:
        fn(**args, **{param.name: bad})
    except KVStateError as e:
        assert str(e)  # it names what was wrong
    else:
        raise AssertionError(f"{target}.{method}({param.name}={bad!r}) was accepted")
    assert snap(rig) == before

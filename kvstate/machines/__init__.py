"""The lifecycle machines, one module each, built on the ``transitions`` package.

Each module holds its machine as data: ``NAME``, ``STATES``, ``INITIAL``, ``TERMINAL`` and
``TRANSITIONS`` (dicts of trigger, source, dest, conditions, after). Callback names in a
table are methods of the lifecycle object that owns the machine (:mod:`kvstate.lifecycle`);
every callback is called as ``callback(request, value)``.

One ``transitions.Machine`` is built per lifecycle object, with no model attached:
requests are plain records carrying a ``state`` attribute, and an event is fired with
``machine.events[trigger].trigger(request, request, value)``. A request therefore costs
neither a ``Machine`` (~0.9 ms) nor an ``add_model`` (~0.2 ms, ~7 KB) — only its record.

:class:`LeanMachine` uses transitions' documented extension points (``event_cls`` and
``transition_cls``) to run the same steps — source check, prepare, conditions, before,
exit, state change, enter, after, finalize, on_exception — without the debug and info
log calls that cost about half of a stock trigger. ``lean=False`` builds a stock
``transitions.Machine`` instead; the tests run both and compare their traces.
"""
from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

from transitions import Machine
from transitions.core import Event, EventData, Transition

from . import decode, prefill

__all__ = ["MACHINES", "LeanMachine", "build_machine", "allowed_sources", "mermaid"]

#: Every lifecycle machine by name.
MACHINES: dict[str, ModuleType] = {prefill.NAME: prefill, decode.NAME: decode}


class _LeanTransition(Transition):
    def execute(self, event_data: EventData) -> bool:
        machine = event_data.machine
        if self.prepare:
            machine.callbacks(self.prepare, event_data)
        if machine.send_event:
            for cond in self.conditions:
                if not cond.check(event_data):
                    return False
        else:  # Condition.check without its per-call resolve: callables are called directly
            args, kwargs = event_data.args, event_data.kwargs
            for cond in self.conditions:
                func = cond.func
                if isinstance(func, str):
                    func = machine.resolve_callable(func, event_data)
                if func(*args, **kwargs) != cond.target:
                    return False
        if machine.before_state_change or self.before:
            machine.callbacks(itertools.chain(machine.before_state_change, self.before), event_data)
        if self.dest:
            self._change_state(event_data)
        if machine.send_event or machine.after_state_change:
            for func in itertools.chain(self.after, machine.after_state_change):
                machine.callback(func, event_data)
        else:
            args, kwargs = event_data.args, event_data.kwargs
            for func in self.after:
                if isinstance(func, str):
                    func = machine.resolve_callable(func, event_data)
                func(*args, **kwargs)
        return True

    def _change_state(self, event_data: EventData) -> None:
        machine = event_data.machine
        states = machine.states
        source = states[self.source]
        if source.on_exit:
            source.exit(event_data)
        dest = states[self.dest]
        setattr(event_data.model, machine.model_attribute, dest.value)
        event_data.state = dest
        if dest.on_enter:
            dest.enter(event_data)
        if dest.final:
            machine.callbacks(machine.on_final, event_data)


class _LeanEvent(Event):
    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        machine = self.machine
        # The machine's callback lists are read through their private attributes: the public
        # properties cost a call each (transitions is pinned below 0.10; a test checks them).
        if machine._queued or machine._transition_queue:
            return super().trigger(model, *args, **kwargs)
        if machine._prepare_event or machine._finalize_event or machine._on_exception:
            return self._trigger(EventData(None, self, machine, model, args=args, kwargs=kwargs))
        # no event-level callbacks: source check, then the first transition whose conditions
        # hold (string states: the model's state value is the state's name)
        value = getattr(model, machine.model_attribute)
        candidates = self.transitions.get(value) if value.__class__ is str else None
        if candidates is None:
            return self._trigger(EventData(None, self, machine, model, args=args, kwargs=kwargs))
        states = machine.states
        if machine.send_event or machine._before_state_change or machine._after_state_change or kwargs:
            event_data = EventData(states[value], self, machine, model, args, kwargs)
            for trans in candidates:
                event_data.transition = trans
                if trans.execute(event_data):
                    return True
            return False
        # The common case, steps in the same order without an EventData: conditions, state
        # change, after. A transition with prepare/before callbacks, or leaving or entering a
        # state with callbacks (or a final one), takes the full path; so does resolving a
        # callback given by name (it needs an EventData, built once when first needed).
        event_data = None
        exits = states[value].on_exit
        for trans in candidates:
            dest = trans.dest
            if dest is not None:
                dest_state = states[dest]
                full = dest_state.on_enter or dest_state.final
            else:
                full = False
            if full or exits or trans.prepare or trans.before:
                event_data = event_data or EventData(states[value], self, machine, model, args, kwargs)
                event_data.transition = trans
                if trans.execute(event_data):
                    return True
                continue
            for cond in trans.conditions:
                func = cond.func
                if func.__class__ is str:
                    event_data = event_data or EventData(states[value], self, machine, model, args, kwargs)
                    func = machine.resolve_callable(func, event_data)
                if func(*args) != cond.target:
                    break
            else:
                if dest is not None:
                    setattr(model, machine.model_attribute, dest)  # string state: value is the name
                for func in trans.after:
                    if func.__class__ is str:
                        event_data = event_data or EventData(states[value], self, machine, model, args, kwargs)
                        func = machine.resolve_callable(func, event_data)
                    func(*args)
                return True
        return False

    def _trigger(self, event_data: EventData) -> bool:
        machine = self.machine
        event_data.state = machine.states[getattr(event_data.model, machine.model_attribute)]
        try:
            if self._is_valid_source(event_data.state):
                self._process(event_data)
        except BaseException as err:
            event_data.error = err
            if machine.on_exception:
                machine.callbacks(machine.on_exception, event_data)
            else:
                raise
        finally:
            if machine.finalize_event:
                machine.callbacks(machine.finalize_event, event_data)
        return event_data.result

    def _process(self, event_data: EventData) -> None:
        machine = self.machine
        if machine.prepare_event:
            machine.callbacks(machine.prepare_event, event_data)
        for trans in self.transitions[event_data.state.name]:
            event_data.transition = trans
            if trans.execute(event_data):
                event_data.result = True
                break


class LeanMachine(Machine):
    """A ``transitions.Machine`` whose events and transitions skip per-step logging."""

    event_cls = _LeanEvent
    transition_cls = _LeanTransition


def _resolve(names: Any, owner: object) -> list:
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    return [getattr(owner, n) for n in names]


def build_machine(table: ModuleType, owner: object, lean: bool = True) -> Machine:
    """A model-less machine for ``table`` whose callbacks are ``owner``'s methods."""
    transitions = []
    for t in table.TRANSITIONS:
        t = dict(t)
        for key in ("conditions", "unless", "after", "before"):
            if key in t:
                t[key] = _resolve(t[key], owner)
        transitions.append(t)
    cls = LeanMachine if lean else Machine
    return cls(model=None, states=list(table.STATES), transitions=transitions,
                   initial=table.INITIAL, auto_transitions=False, send_event=False,
                   name=table.NAME)


def allowed_sources(table: ModuleType) -> dict[str, frozenset[str]]:
    """For each trigger, the states it may fire from (used to reject events up front)."""
    out: dict[str, set[str]] = {}
    for t in table.TRANSITIONS:
        src = t["source"]
        out.setdefault(t["trigger"], set()).update([src] if isinstance(src, str) else src)
    return {k: frozenset(v) for k, v in out.items()}


def mermaid(table: ModuleType) -> str:
    """The machine's diagram as mermaid text, drawn by transitions from the table itself."""
    from transitions.extensions import GraphMachine

    class _Model:
        pass

    m = GraphMachine(model=None, states=list(table.STATES), transitions=[dict(t) for t in table.TRANSITIONS],
                     initial=table.INITIAL, auto_transitions=False, graph_engine="mermaid",
                     show_conditions=True, title=f"kvstate {table.NAME} lifecycle")
    model = _Model()
    m.add_model(model)
    return model.get_graph().draw(None)

"""Lifecycle machines: defined once as data, checked and drawn by ``transitions``, run compiled.

A :class:`MachineDef` lists states and transitions (``trigger``, ``source``, ``dest``,
``conditions``, ``after``) as a role module writes them at its top. ``transitions`` builds a
stock ``Machine`` from it, which checks the definition (unknown states, bad rows) and draws
the mermaid diagrams. :class:`CompiledMachine` then reads that machine's public structure
(``machine.events[trigger].transitions[source]``: each :class:`transitions.core.Transition`'s
``conditions``, ``dest`` and ``after``) into one dict, ``(trigger, source) -> rows``, with the
owner's methods bound in, and fires a trigger as transitions does with no machine-level or
state callbacks: the first row whose conditions all hold changes the state, then its
``after`` callbacks run, each called as ``callback(request, value)``. A request is a plain
record with a ``state`` attribute; it costs no ``Machine`` (~0.9 ms) and no ``add_model``.

Why compiled: a stock trigger costs about as much as a request's whole bookkeeping, most of
it in debug logging and per-call lookups. ``tests/test_machines.py`` drives the compiled and
the stock machine through the same random event sequences and requires identical states and
callback calls.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from transitions import Machine

from ._errors import ConfigError, InvalidTransitionError

__all__ = ["MachineDef", "CompiledMachine", "StockMachine", "stock_machine", "mermaid"]

Row = tuple[tuple[tuple[Callable[..., Any], bool], ...], str, tuple[Callable[..., Any], ...]]


@dataclass(frozen=True)
class MachineDef:
    """A machine as data. Callback names in ``transitions`` are methods of the owner."""

    name: str
    states: tuple[str, ...]
    initial: str
    terminal: tuple[str, ...]
    transitions: tuple[Mapping[str, Any], ...]

    def __post_init__(self) -> None:
        """A table that names its states and whose rows go between them: what ``transitions``
        would otherwise find only when the first request fires a bad row."""
        who = f"MachineDef {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"MachineDef: name must be a non-empty str, got {self.name!r}")
        for field_name in ("states", "terminal", "transitions"):
            if not isinstance(getattr(self, field_name), tuple):
                raise ConfigError(f"{who}: {field_name} must be a tuple")
        if not self.states or not all(isinstance(x, str) and x for x in self.states) or \
                len(set(self.states)) != len(self.states):
            raise ConfigError(f"{who}: states must be distinct non-empty strs, got {self.states!r}")
        known = set(self.states)
        ends = (self.initial, *self.terminal)
        if not all(isinstance(x, str) and x in known for x in ends):
            raise ConfigError(f"{who}: initial {self.initial!r} and terminal {self.terminal!r} must be its states")
        self._check_rows(who, known)

    def _check_rows(self, who: str, known: set[str]) -> None:
        for row in self.transitions:
            if not isinstance(row, Mapping) or not isinstance(row.get("trigger"), str) or \
                    not isinstance(row.get("dest"), str) or row["dest"] not in known:
                raise ConfigError(f"{who}: a transition must map trigger to a str and dest to a state, got {row!r}")
            src = row.get("source")
            sources = [src] if isinstance(src, str) else src if isinstance(src, (list, tuple)) else [None]
            if not all(isinstance(x, str) and x in known for x in sources):
                raise ConfigError(f"{who}: transition {row.get('trigger')!r} starts from unknown states {src!r}")

    @property
    def live(self) -> tuple[str, ...]:
        """The states a request is still in its life in."""
        return tuple(s for s in self.states if s not in self.terminal)

    def sources(self) -> dict[str, frozenset[str]]:
        """For each trigger, the states it may fire from."""
        out: dict[str, set[str]] = {}
        for t in self.transitions:
            src = t["source"]
            out.setdefault(t["trigger"], set()).update([src] if isinstance(src, str) else src)
        return {k: frozenset(v) for k, v in out.items()}


def stock_machine(defn: MachineDef, owner: object | None = None, **kwargs: Any) -> Machine:
    """A stock, model-less ``transitions.Machine`` of ``defn``; callbacks resolved on ``owner``
    (kept as names without one)."""
    rows = []
    for t in defn.transitions:
        row = dict(t)
        if owner is not None:
            for key in ("conditions", "unless", "after", "before"):
                names = row.get(key)
                if names is not None:
                    names = [names] if isinstance(names, str) else list(names)
                    row[key] = [getattr(owner, n) for n in names]
        rows.append(row)
    return Machine(model=None, states=list(defn.states), transitions=rows, initial=defn.initial,
                   auto_transitions=False, send_event=False, name=defn.name, **kwargs)


class CompiledMachine:
    """``fire(request, trigger, value)``: ``defn`` run as one dict lookup and its rows."""

    __slots__ = ("name", "_rows")

    def __init__(self, defn: MachineDef, owner: object) -> None:
        machine = stock_machine(defn)  # transitions checks the definition here
        self.name = defn.name
        self._rows: dict[tuple[str, str], tuple[Row, ...]] = {}
        for trigger, event in machine.events.items():
            for source, trans in event.transitions.items():
                self._rows[(trigger, source)] = tuple(self._compile(t, owner) for t in trans)

    @staticmethod
    def _compile(t: Any, owner: object) -> Row:
        if t.before or t.prepare:
            raise ValueError(f"transition {t.source} -> {t.dest}: only conditions and after callbacks are compiled")
        conds = tuple((_bind(c.func, owner), bool(c.target)) for c in t.conditions)
        return conds, t.dest, tuple(_bind(a, owner) for a in t.after)

    def fire(self, req: Any, trigger: str, value: Any = None) -> bool:
        """Fire ``trigger`` on ``req``; False when no row's conditions held (state unchanged)."""
        rows = self._rows.get((trigger, req.state))
        if rows is None:
            raise InvalidTransitionError(req.id, req.state, trigger, self.name)
        for conds, dest, after in rows:
            for cond, target in conds:
                if cond(req, value) != target:  # as transitions' Condition.check compares
                    break
            else:
                req.state = dest
                for callback in after:
                    callback(req, value)
                return True
        return False


class StockMachine:
    """The same ``fire`` run by a stock ``transitions.Machine``: every trigger goes through
    transitions' own ``Event.trigger`` (about twice as slow; for comparisons and tests)."""

    __slots__ = ("name", "_events", "_sources")

    def __init__(self, defn: MachineDef, owner: object) -> None:
        self.name = defn.name
        self._events = stock_machine(defn, owner).events
        self._sources = defn.sources()

    def fire(self, req: Any, trigger: str, value: Any = None) -> bool:
        if req.state not in self._sources.get(trigger, ()):
            raise InvalidTransitionError(req.id, req.state, trigger, self.name)
        return bool(self._events[trigger].trigger(req, req, value))


def _bind(func: Any, owner: object) -> Callable[..., Any]:
    bound: Callable[..., Any] = getattr(owner, func) if isinstance(func, str) else func
    return bound


def mermaid(defn: MachineDef) -> str:
    """The machine's diagram as mermaid text, drawn by transitions from the definition itself."""
    from transitions.extensions import GraphMachine

    class _Model:
        get_graph: Callable[[], Any]  # added by GraphMachine.add_model

    rows = [dict(t) for t in defn.transitions]
    m = GraphMachine(model=None, states=list(defn.states), transitions=rows, initial=defn.initial,
                     auto_transitions=False, graph_engine="mermaid", show_conditions=True,
                     title=f"kvstate {defn.name} lifecycle")
    model = _Model()
    m.add_model(model)
    return str(model.get_graph().draw(None))

"""Per-request timelines in the Chrome trace-event format (Perfetto and chrome://tracing open it).

One schema for a real run and a simulated one, so the two open side by side:

- a process per instance (``pid``: its name, e.g. ``P0``, ``D1``);
- a thread per request (``tid``: ``req <id>``) holding its states as consecutive complete
  (``"X"``) events named by the state, from when the state was first seen to when the next one
  was, and an instant (``"i"``) event when the request ended;
- a thread per TP rank (``rank <r>``) holding each transfer command's part on that rank, from
  its submission to the rank's answer, named by the command's kind, its answer in ``args``.
  Parts that overlap on one rank (a read beside a write) go to the rank's next free lane,
  ``rank <r> #<lane>``: Perfetto drops a complete event that overlaps another on its thread
  without nesting in it;
- a ``steps`` thread holding compute steps (the simulator's forwards; an engine may add its own);
- a ``store faults`` counter track per instance (``"C"`` events): its rank workers' broken,
  short and failed store operations so far (:meth:`Timeline.store_faults`, from
  ``ProcessDriver.store_faults()``), recorded when they change.

Times are whole microseconds (``ts``, ``dur``) from the first event recorded, and a span's end
is rounded once, so consecutive spans meet exactly instead of overlapping by a rounding error.
States are read by polling (:meth:`Timeline.states`, once per loop turn): the lifecycles emit
no event per state change, and a turn is the finest time an engine acts at anyway. A
:class:`Timeline` keeps every event in memory until written: it is a debugging and planning
aid for runs of thousands of requests, not an always-on log.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import commands as C
from ._errors import ValidationError
from .events import Completion

__all__ = ["Timeline"]


class Timeline:
    """Trace events of one run (see the module's docstring); ``clock`` in seconds (the
    lifecycles' own, so simulated runs record simulated time)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        if not callable(clock):
            raise ValidationError("Timeline: clock must be callable")
        self.clock = clock
        self.events: list[dict[str, Any]] = []
        self._t0: float | None = None
        self._state: dict[tuple[str, str], tuple[str, float]] = {}  # (instance, request) -> state, since
        #: (instance, command id, rank) -> kind, request, since, lane
        self._open: dict[tuple[str, int, int], tuple[str, str, float, int]] = {}
        self._lanes: dict[tuple[str, int], set[int]] = {}  # (inst, rank) -> lanes an open part holds
        self._faults: dict[str, dict[str, int]] = {}  # instance -> the store faults last recorded

    def _now(self) -> float:
        """The clock now; the first reading is the trace's zero."""
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        return now

    def _us(self, t: float) -> int:
        return round((t - (self._t0 if self._t0 is not None else t)) * 1e6)

    def _complete(self, pid: str, tid: str, name: str, start: float, end: float, **args: Any) -> dict[str, Any]:
        """A complete ("X") event from ``start`` to ``end`` (clock seconds), its end rounded once."""
        ts = self._us(start)
        return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(0, self._us(end) - ts),
                "args": args}

    def _span(self, pid: str, tid: str, name: str, start: float, end: float, **args: Any) -> None:
        self.events.append(self._complete(pid, tid, name, start, end, **args))

    def states(self, instance: str, lifecycle: Any) -> None:
        """Note the state of every live request of ``lifecycle`` now; a request no longer live
        ends its last state here and gets an instant event."""
        now = self._now()
        live = set()
        for rid in lifecycle.live_requests():
            live.add(rid)
            state = lifecycle.state_of(rid)
            seen = self._state.get((instance, rid))
            if seen is None or seen[0] != state:
                if seen is not None:
                    self._span(instance, f"req {rid}", seen[0], seen[1], now)
                self._state[(instance, rid)] = (state, now)
        for (inst, rid), (state, since) in list(self._state.items()):
            if inst == instance and rid not in live:
                self._span(instance, f"req {rid}", state, since, now)
                self.events.append({"name": "ended", "ph": "i", "s": "t", "pid": instance, "tid": f"req {rid}",
                                    "ts": self._us(now), "args": {}})
                del self._state[(inst, rid)]

    def submitted(self, instance: str, cmds: Iterable[C.Command]) -> None:
        """Open each transfer command's part on each of its ranks."""
        now = self._now()
        for cmd in cmds:
            if isinstance(cmd, C.TransferCommand):
                for r in cmd.ranks:
                    held = self._lanes.setdefault((instance, r), set())
                    lane = min(set(range(len(held) + 1)) - held)
                    held.add(lane)
                    self._open[(instance, cmd.command_id, r)] = (type(cmd).__name__, cmd.request_id, now, lane)

    def completed(self, instance: str, completions: Iterable[Completion]) -> None:
        """Close each answered part (an answer to a command not seen submitted is skipped)."""
        now = self._now()
        for c in completions:
            opened = self._open.pop((instance, c.command_id, c.rank), None)
            if opened is not None:
                kind, rid, since, lane = opened
                self._lanes[(instance, c.rank)].discard(lane)
                track = f"rank {c.rank}" + (f" #{lane + 1}" if lane else "")
                self._span(instance, track, kind, since, now, request=rid, count=c.count,
                           error=c.error, lost=c.lost)

    def store_faults(self, instance: str, faults: dict[str, int]) -> None:
        """The instance's store faults so far (``ProcessDriver.store_faults()``: broken, short,
        failed), as a counter track; recorded only when they changed since the last call."""
        if not isinstance(faults, dict) or not all(isinstance(k, str) and isinstance(v, int) and v >= 0
                                                   for k, v in faults.items()):
            raise ValidationError(f"Timeline.store_faults: expected {{name: count >= 0}}, got {faults!r:.80}")
        if self._faults.get(instance) == faults:
            return
        self._faults[instance] = dict(faults)
        now = self._now()
        self.events.append({"name": "store faults", "ph": "C", "pid": instance, "ts": self._us(now),
                            "args": dict(faults)})

    def step(self, instance: str, start: float, end: float, name: str = "step", **args: Any) -> None:
        """A compute step of ``instance`` from ``start`` to ``end`` (clock seconds)."""
        self._now()
        self._span(instance, "steps", name, start, end, **args)

    def to_json(self) -> dict[str, Any]:
        """The trace: its events, open states and transfers closed at the clock's time now."""
        now = self._now()
        tail = [self._complete(inst, f"req {rid}", state, since, now, open=True)
                for (inst, rid), (state, since) in self._state.items()]
        return {"traceEvents": self.events + tail, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        """Write the trace as JSON to ``path`` (a file Perfetto and chrome://tracing open)."""
        Path(path).write_text(json.dumps(self.to_json()))

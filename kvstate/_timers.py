"""Deadlines: when each transfer times out, when its pins are reclaimed, when a wait gives up.

Three kinds, each in its own FIFO of ``(when, seq, ident)``: a transfer's deadline
(``TRANSFER``, ident = command id), its fence (``FENCE``: deadline plus grace, set when the
deadline passes), and a request's wait (``WAIT``: D's first token, P's blocks; ident =
``(request id, wait seq)``). Each kind's times are "now" plus a constant, so appending keeps a
queue sorted: O(1) a timer, where a heap paid O(log n) for the many timers of transfers that
answered in time. :meth:`Timers.due` merges the three heads in (when, seq) order; a clock that
steps back inserts in place. Timers are never cancelled: their owner ignores those whose work
went away (it decides which, through ``live``) when they come due or reach the head.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Timers", "TRANSFER", "FENCE", "WAIT"]

TRANSFER, FENCE, WAIT = 0, 1, 2


class Timers:
    """The three deadline queues of one lifecycle."""

    __slots__ = ("_queues", "_seq")

    def __init__(self) -> None:
        self._queues: tuple[deque[tuple[float, int, Any]], ...] = (deque(), deque(), deque())
        self._seq = itertools.count(1)

    def push(self, kind: int, when: float, ident: Any) -> None:
        q = self._queues[kind]
        entry = (when, next(self._seq), ident)
        if q and when < q[-1][0]:  # the clock went back: insert where the queue stays sorted
            i = len(q)
            while i and q[i - 1][0] > when:
                i -= 1
            q.insert(i, entry)
        else:
            q.append(entry)

    def due(self, now: float) -> Iterator[tuple[int, Any]]:
        """Pop every timer at or before ``now``, earliest first: ``(kind, ident)``."""
        queues = self._queues
        while True:
            kind, head = -1, None
            for k, q in enumerate(queues):
                if q and q[0][0] <= now and (head is None or q[0][:2] < head[:2]):
                    kind, head = k, q[0]
            if head is None:
                return
            queues[kind].popleft()
            yield kind, head[2]

    def next(self, live: Callable[[int, Any], bool]) -> float | None:
        """The earliest time a timer whose work is still ``live`` comes due (None: none is
        set); timers whose work went away are dropped on the way."""
        best = None
        for kind, q in enumerate(self._queues):
            while q and not live(kind, q[0][2]):
                q.popleft()
            if q and (best is None or q[0][0] < best):
                best = q[0][0]
        return best

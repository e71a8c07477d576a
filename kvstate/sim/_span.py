"""A run of decode steps slept through as one wait: the D loop's fast path.

Between two events of a D batch (a join, a finish, a token that needs a block) every step
is alike: the same members each make a token, and the step time only grows with the
context. Waking the SimPy process for each of them costs more than the step's own
bookkeeping, so the loop sleeps through such a run in one timeout and accounts for the
steps when it wakes.

Exactness is the point. Each step's end is summed exactly as the simulation clock would
sum it step by step, and the wait lands on that very float, so a run's report does not
change by one bit. Anything that must see the batch between steps (a request joining,
blocks coming free while a request waits for them, a preempted request becoming
resumable) first *cuts* the span: the steps already over are accounted for, and the span
now ends with the step in progress, where the loop wakes as it would have.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate

__all__ = ["StepSpan", "delay_to"]


class StepSpan:
    """``count`` decode steps of a fixed batch of ``batch`` requests from time ``now``.

    ``step_times(batch, context, count)`` gives the steps' seconds; the context grows by
    ``batch`` a step. ``done`` steps are accounted for; ``last`` is the index of the step the span
    ends with (it shrinks when the span is cut).
    """

    __slots__ = ("batch", "lens", "ends", "done", "last")

    def __init__(self, now: float, batch: int, context: int, count: int,
                 step_times: Callable[[int, int, int], list[float]]) -> None:
        lens = step_times(batch, context, count)
        ends = list(accumulate(lens, initial=now))[1:]  # the sums the clock makes, step after step
        self.batch, self.lens, self.ends = batch, lens, ends
        self.done = 0
        self.last = count - 1

    def over_at(self, now: float) -> int:
        """Steps over at ``now`` (a step ending exactly now counts as over), never the last:
        the loop itself ends that one."""
        return bisect_right(self.ends, now, self.done, self.last)

    def cut(self, now: float) -> bool:
        """End the span with the step in progress at ``now``; True if it got shorter."""
        j = self.over_at(now)
        if j == self.last:
            return False
        self.last = j
        return True


def delay_to(now: float, when: float) -> float:
    """The delay ``d`` with ``now + d == when`` exactly (SimPy schedules at ``now + d``), where
    one exists; else the one whose sum lands just before ``when``. None exists for some
    ``when`` past twice ``now``: the sums from ``now`` step over floats there (``now`` has
    bits finer than the spacing of floats near ``when``, so a sum can round past one). From
    where it lands, ``when`` is exactly one more delay away (within a factor of two the
    difference is exact), so the D loop's span wait (:mod:`kvstate.sim._decode`) waits again
    when it wakes early."""
    d = when - now
    while now + d < when:
        d = math.nextafter(d, math.inf)
    while now + d > when:
        d = math.nextafter(d, -math.inf)
    return d

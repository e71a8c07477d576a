"""TP ranks running transfer tasks, with the barrier protocols to compare, and a deadlock search.

Each rank of an instance has a pool of ``workers`` per task kind (read, write), like the
per-rank thread pools of FastDeploy's cache transfer manager. A task is handed to every rank; each rank
does its part (its own duration plus its configured skew) and answers.

Protocols:

- ``kvstate`` — each rank answers its own part; the lifecycle takes the minimum over the
  ranks and a deadline covers a rank that never answers. No barrier is shared, so none can
  be reset at the wrong moment.
- ``shared-barrier`` — as FastDeploy's cache transfer manager: after its part every rank waits on one
  barrier shared by all tasks of that kind, then answers. Barrier semantics:
  ``auto`` (generation barrier, like ``threading.Barrier``: it resets itself when the last
  party arrives) or ``manual-reset`` (it trips when ``parties`` arrivals are counted and stays
  open until someone calls ``reset()``, which zeroes the count; rank 0 resets after passing
  on writes, every rank on reads — that manager's two call sites).

A barrier wait has a timeout: a waiter still blocked after ``barrier_timeout`` is
reported as stuck with the barrier's arrivals (who is there, who is missing), and the
worker is lost, as a thread blocked forever would be.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import simpy
from simpy import Timeout

__all__ = ["SimBarrier", "RankPools", "Stuck", "TaskSchedule", "run_schedule", "search_deadlocks",
           "PROTOCOLS", "INDEPENDENT", "SHARED_BARRIER"]

INDEPENDENT = "kvstate"  #: each rank answers on its own; the lifecycle takes the minimum
SHARED_BARRIER = "shared-barrier"  #: every rank waits on one barrier per task kind, then answers
PROTOCOLS = (INDEPENDENT, SHARED_BARRIER)


@dataclass
class Stuck:
    """A worker that waited on a barrier past the timeout."""

    barrier: str
    rank: int
    task: Any
    since: float
    arrived: list[tuple[int, Any]]  #: (rank, task) of the arrivals the barrier still counts
    missing_ranks: list[int]

    def describe(self) -> str:
        return (f"rank {self.rank} (task {self.task}) waits on barrier {self.barrier!r} since "
                f"t={self.since:.6f}s; counted arrivals {self.arrived}, ranks missing {self.missing_ranks}")


class SimBarrier:
    """A TP barrier of ``parties`` with ``auto`` or ``manual-reset`` semantics (module docstring)."""

    def __init__(self, env: simpy.Environment, name: str, parties: int, semantics: str,
                 log: list | None = None) -> None:
        self.env, self.name, self.parties, self.semantics = env, name, parties, semantics
        self.count = 0
        self.open = False
        self.waiting: list[tuple[int, Any, simpy.Event]] = []
        self.unsynchronized = 0  #: passes that did not meet one arrival from every rank
        self.log = log

    def _note(self, what: str, rank: int, task: Any) -> None:
        if self.log is not None:
            self.log.append((round(self.env.now, 9), self.name, what, rank, task))

    def wait(self, rank: int, task: Any) -> simpy.Event:
        ev = self.env.event()
        self._note("arrive", rank, task)
        self.count += 1
        if self.open:  # manual-reset barrier left open: passes without meeting anyone
            self.unsynchronized += 1
            self._note("pass-open", rank, task)
            return ev.succeed()
        self.waiting.append((rank, task, ev))
        if self.count >= self.parties:
            released = self.waiting
            if len({r for r, _, _ in released}) < self.parties:
                self.unsynchronized += 1
            self.waiting = []
            if self.semantics == "auto":
                self.count = 0
            else:
                self.open = True
            for r, t, e in released:
                self._note("release", r, t)
                e.succeed()
        return ev

    def reset(self, rank: int, task: Any) -> None:
        self._note("reset", rank, task)
        self.count = 0
        self.open = False
        # arrivals still waiting are forgotten by the count: they need ``parties`` new ones

    def stuck_report(self, rank: int, task: Any, since: float) -> Stuck:
        present = {r for r, _, _ in self.waiting}
        return Stuck(self.name, rank, task, since, [(r, t) for r, t, _ in self.waiting],
                     [r for r in range(self.parties) if r not in present])


class RankPools:
    """Worker pools of every rank of one instance, for one task kind.

    Workers are counts, not processes: a task starts when one of its rank's ``workers`` is
    free (FIFO otherwise), its part is one timeout, and its barrier wait (``shared-barrier``)
    a callback on the barrier's event. A task therefore costs one SimPy event per rank.
    """

    def __init__(self, env: simpy.Environment, name: str, tp: int, workers: int, protocol: str,
                 semantics: str, skew_s: Iterable[float] = (), barrier_timeout: float = 30.0,
                 reset_by: str = "rank0", log: list | None = None) -> None:
        self.env, self.name, self.tp, self.protocol = env, name, tp, protocol
        skew = list(skew_s)
        self.skew = skew + [0.0] * (tp - len(skew))
        self._skewed = any(self.skew)
        self.barrier_timeout = barrier_timeout
        self.reset_by = reset_by
        self.manual = semantics == "manual-reset"
        self.barrier = SimBarrier(env, name, tp, semantics, log) if protocol == SHARED_BARRIER else None
        self.queues: list[deque[Any]] = [deque() for _ in range(tp)]
        self.idle = [workers] * tp  #: free workers per rank
        self.stuck: list[Stuck] = []
        self._then = self._worked if self.barrier is not None else self._done  # no barrier: done when worked

    def submit(self, task: Any, ranks: Iterable[int]) -> None:
        """Hand ``task`` to each rank: ``task.start(rank) -> seconds`` is called when a worker
        takes it, ``task.finish(rank)`` when that rank's part is done (after the barrier)."""
        for r in ranks:
            if self.idle[r]:
                self.idle[r] -= 1
                self._start(r, task)
            else:
                self.queues[r].append(task)

    def _start(self, r: int, task: Any) -> None:
        dt = task.start(r)
        if self._skewed:
            dt += self.skew[r]
        then = self._then
        Timeout(self.env, dt if dt > 0.0 else 0.0).callbacks.append(lambda _e: then(r, task))

    def _worked(self, r: int, task: Any) -> None:
        barrier = self.barrier
        if barrier is None:
            self._done(r, task)
            return
        since = self.env.now
        ev = barrier.wait(r, task.label)
        if ev.triggered:
            self._passed(r, task)
            return
        either = ev | self.env.timeout(self.barrier_timeout)

        def after(_e: Any) -> None:
            if ev.triggered:
                self._passed(r, task)
            else:  # the worker is lost, like a thread blocked forever
                self.stuck.append(barrier.stuck_report(r, task.label, since))
        either.callbacks.append(after)

    def _passed(self, r: int, task: Any) -> None:
        if self.manual and (self.reset_by == "all" or r == 0):
            self.barrier.reset(r, task.label)  # type: ignore[union-attr]
        self._done(r, task)

    def _done(self, r: int, task: Any) -> None:
        task.finish(r)
        q = self.queues[r]
        if q:
            self._start(r, q.popleft())
        else:
            self.idle[r] += 1


# -- the deadlock search --------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSchedule:
    """A small explored case: ``tasks`` tasks of one kind arriving ``spacing`` apart, each
    taking ``work`` seconds on every rank plus that rank's ``skew``."""

    protocol: str
    semantics: str
    reset_by: str
    tp: int
    workers: int
    tasks: int
    spacing: float
    work: float
    skew: tuple[float, ...]


@dataclass
class _MicroTask:
    label: int
    work: float
    answered: set = field(default_factory=set)

    def start(self, rank: int) -> float:
        return self.work

    def finish(self, rank: int) -> None:
        self.answered.add(rank)


def run_schedule(case: TaskSchedule, barrier_timeout: float = 1.0) -> dict[str, Any]:
    """Run one case; returns ``deadlock`` (some rank's part never answered), ``stuck``,
    ``unsynchronized`` passes and the barrier ``trace``."""
    env = simpy.Environment()
    log: list = []
    pools = RankPools(env, "swap_barrier", case.tp, case.workers, case.protocol, case.semantics,
                      case.skew, barrier_timeout, case.reset_by, log)
    tasks = [_MicroTask(i, case.work) for i in range(case.tasks)]

    def arrive():
        for t in tasks:
            pools.submit(t, range(case.tp))
            yield env.timeout(case.spacing)
    env.process(arrive())
    env.run(until=case.tasks * case.spacing + 100 * (case.work + max(case.skew, default=0)) + 2 * barrier_timeout)
    missing = {t.label: sorted(set(range(case.tp)) - t.answered) for t in tasks if len(t.answered) < case.tp}
    return {"deadlock": bool(missing), "unanswered": missing,
            "stuck": [s.describe() for s in pools.stuck],
            "unsynchronized": pools.barrier.unsynchronized if pools.barrier else 0, "trace": log}


def search_deadlocks(protocols: Iterable[str] = (SHARED_BARRIER, INDEPENDENT),
                     semantics: Iterable[str] = ("auto", "manual-reset"),
                     tps: Iterable[int] = (2, 4), workers: Iterable[int] = (1, 2),
                     tasks: Iterable[int] = (1, 2, 3, 4), spacings: Iterable[float] = (0.0, 0.0005, 0.002),
                     skews: Iterable[float] = (0.0, 0.0005, 0.001, 0.003), work: float = 0.001,
                     progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Explore every combination (the slow rank is the last one, or rank 0); per protocol and
    semantics count the cases, deadlocks and unsynchronized passes, and keep the smallest
    deadlocking case (fewest tasks, then workers, ranks, skew) with its barrier trace."""
    results: dict[str, Any] = {}
    n = 0
    for proto, sem in itertools.product(protocols, semantics):
        reset_bys = ("rank0", "all") if proto == SHARED_BARRIER else ("rank0",)
        summary: dict[str, Any] = {"cases": 0, "deadlocks": 0, "unsynchronized_cases": 0, "minimal": None}
        best_key = None
        for reset_by, tp, w, k, sp, sk, slow in itertools.product(
                reset_bys, tps, workers, tasks, spacings, skews, ("last", "rank0")):
            skew = [0.0] * tp
            skew[0 if slow == "rank0" else tp - 1] = sk
            case = TaskSchedule(proto, sem, reset_by, tp, w, k, sp, work, tuple(skew))
            out = run_schedule(case)
            n += 1
            if progress is not None:
                progress(n)
            summary["cases"] += 1
            summary["unsynchronized_cases"] += out["unsynchronized"] > 0
            if out["deadlock"]:
                summary["deadlocks"] += 1
                key = (k, w, tp, sk, sp)
                if best_key is None or key < best_key:
                    best_key = key
                    summary["minimal"] = {"case": case.__dict__ | {"skew": list(case.skew)},
                                          "unanswered": out["unanswered"], "stuck": out["stuck"],
                                          "trace": out["trace"]}
        results[f"{proto}/{sem}"] = summary
    return results

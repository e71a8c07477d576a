"""Which rank workers are up: their incarnations, when each was last heard, what each owes.

A rank is *up* from an accepted hello until it is declared *down*; an up rank has the
incarnation its worker drew, the time it was last heard from, its lanes (each a thread and a
command socket of the worker), and the commands it owes an answer, each on the lane it was
given. A new command goes to the lane owing the fewest. Declaring a rank down forgets the
incarnation and hands back what it owed, which the driver then answers as lost. The table
holds no lock: its owner (the driver) holds one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["RankTable", "RankDown", "RankUp"]

_COUNTS = 5  # a heartbeat's counts (kvstate.distributed._wire.WORKER_COUNTS)


class RankDown(NamedTuple):
    """A rank went down at ``at`` (``time.monotonic()``): the commands it owed were answered."""

    rank: int
    reason: str
    at: float


class RankUp(NamedTuple):
    """A rank's worker (process ``pid``) said hello and was accepted at ``at``."""

    rank: int
    pid: int
    at: float


@dataclass
class _Rank:
    incarnation: int = 0  #: 0: down
    pid: int = 0
    last_seen: float = 0.0
    owed: dict[int, int] = field(default_factory=dict)  #: command id -> its lane
    load: list[int] = field(default_factory=list)  #: answers owed per lane
    refused: str | None = None
    moved: int = 0  #: bytes the current incarnation's backend moved, as its last beat said
    moved_before: int = 0  #: bytes earlier incarnations moved
    counts: tuple[int, ...] = (0,) * _COUNTS  #: the current incarnation's counts, as its last beat said
    counts_before: tuple[int, ...] = (0,) * _COUNTS  #: earlier incarnations' counts


class RankTable:
    """Per TP rank: up or down, its incarnation, last heard, commands owed."""

    def __init__(self, tp_size: int) -> None:
        self._ranks = [_Rank() for _ in range(tp_size)]

    def incarnation(self, rank: int) -> int:
        """The current incarnation of an up rank; 0 when it is down."""
        return self._ranks[rank].incarnation

    def pid(self, rank: int) -> int:
        return self._ranks[rank].pid

    def up(self, rank: int, incarnation: int, pid: int, now: float, lanes: int) -> None:
        r = self._ranks[rank]
        r.incarnation, r.pid, r.last_seen, r.refused = incarnation, pid, now, None
        r.owed, r.load = {}, [0] * lanes

    def seen(self, rank: int, now: float, moved: int | None = None, counts: tuple[int, ...] | None = None) -> None:
        r = self._ranks[rank]
        r.last_seen = now
        if moved is not None:
            r.moved = moved
        if counts is not None:
            r.counts = counts

    def counts(self) -> tuple[int, ...]:
        """What every incarnation of every rank counted, as their last beats said (in the
        order of :data:`~kvstate.distributed._wire.WORKER_COUNTS`)."""
        return tuple(sum(r.counts[i] + r.counts_before[i] for r in self._ranks) for i in range(_COUNTS))

    def bytes_moved(self) -> int:
        """Bytes every incarnation of every rank moved, as their last beats said."""
        return sum(r.moved + r.moved_before for r in self._ranks)

    def owe(self, rank: int, command_id: int) -> int:
        """``rank`` owes ``command_id``: it goes to the lane owing the fewest (returned)."""
        r = self._ranks[rank]
        lane = min(range(len(r.load)), key=r.load.__getitem__)
        r.owed[command_id] = lane
        r.load[lane] += 1
        return lane

    def lanes(self, rank: int) -> int:
        return len(self._ranks[rank].load)

    def lane_of(self, rank: int, command_id: int) -> int | None:
        return self._ranks[rank].owed.get(command_id)

    def paid(self, rank: int, command_id: int) -> None:
        r = self._ranks[rank]
        lane = r.owed.pop(command_id, None)
        if lane is not None:
            r.load[lane] -= 1

    def owed(self, rank: int) -> list[int]:
        return sorted(self._ranks[rank].owed)

    def down_now(self, rank: int) -> list[int]:
        """Declare ``rank`` down; returns the commands it owed, oldest first."""
        r = self._ranks[rank]
        owed = sorted(r.owed)
        r.incarnation, r.owed, r.load = 0, {}, []
        r.moved_before, r.moved = r.moved_before + r.moved, 0
        r.counts_before, r.counts = tuple(a + b for a, b in zip(r.counts_before, r.counts)), (0,) * _COUNTS
        return owed

    def refuse(self, rank: int, reason: str) -> None:
        self._ranks[rank].refused = reason

    def refusals(self) -> list[str]:
        return [r.refused for r in self._ranks if r.refused]

    def live(self) -> list[tuple[int, int, float]]:
        """(rank, incarnation, last heard) of every up rank."""
        return [(i, r.incarnation, r.last_seen) for i, r in enumerate(self._ranks) if r.incarnation]

    def down(self) -> list[int]:
        return [i for i, r in enumerate(self._ranks) if not r.incarnation]

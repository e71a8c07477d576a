"""What a process driver owes its lifecycle: answers outstanding, layer arrivals, held commands.

The :class:`Ledger` is the driver's bookkeeping, apart from its sockets. For each command
submitted it keeps the ranks that still owe an answer; an answer settles one, once — a second
answer, or one from another incarnation than the rank's current one, is *stale* and counted,
never delivered. An answer of more leading blocks than the command has keys is counted as a
bad message and settles its rank as failed: that worker sends no other answer, so waiting for
one would hold the command until its deadline and its blocks until its fence. It keeps each
layer-wise load's arrivals per rank until that rank answered, and the commands held for a
rank whose worker is being restarted, in order, until it is up again or their fences pass.
Every method takes the ledger's lock; the driver's control side shares it, so a rank's
liveness and what it owes always change together.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import commands as C
from .._errors import ValidationError
from ..backends._gate import LayerArrivals
from ..events import Completion
from . import _wire as wire
from ._liveness import RankTable

__all__ = ["Ledger", "Send"]

Send = tuple[int, int, int, bytes]  #: (rank, lane, command id, message)


@dataclass
class _Pending:
    cmd: C.TransferCommand
    left: set[int] = field(default_factory=set)  #: ranks that still owe an answer


class Ledger:
    """The answers a driver's ranks owe, and what waits on them (thread-safe)."""

    def __init__(self, ranks: RankTable, layers: int, restarting: Callable[[int], bool],
                 counters: dict[str, int]) -> None:
        self.lock = threading.Lock()
        self.ranks, self.layers, self.restarting, self.counters = ranks, layers, restarting, counters
        self.inflight = 0  #: (command, rank) answers owed
        self._pending: dict[int, _Pending] = {}
        self._arrivals: dict[tuple[int, int], LayerArrivals] = {}
        self._held: dict[int, list[C.TransferCommand]] = {}  # rank -> commands waiting for its restart

    def register(self, cmd: C.TransferCommand) -> tuple[list[Send], list[int]]:
        """Owe ``cmd``'s answers: (what to send to each up rank, the ranks down). A rank whose
        worker is being restarted holds the command (behind any held before it) until it is up."""
        sends, down = [], []
        with self.lock:
            if cmd.command_id in self._pending:
                raise ValidationError(f"ProcessDriver: command {cmd.command_id} was submitted already")
            p = _Pending(cmd)
            for r in cmd.ranks:
                inc = self.ranks.incarnation(r)
                if not inc and not self.restarting(r):
                    down.append(r)
                    continue
                p.left.add(r)
                self.inflight += 1
                if cmd.__class__ is C.LoadLayers:
                    self._arrivals[(cmd.command_id, r)] = LayerArrivals()
                if not inc or self._held.get(r):
                    self._held.setdefault(r, []).append(cmd)
                    continue
                sends.append((r, self.ranks.owe(r, cmd.command_id), cmd.command_id, wire.command_message(cmd, inc)))
            if p.left:
                self._pending[cmd.command_id] = p
        return sends, down

    def release_held(self, rank: int) -> tuple[list[Send], list[int]]:
        """``rank`` is up again: (its held commands to send now, those whose fence passed)."""
        now, sends, expired = time.monotonic(), [], []
        with self.lock:
            held, inc = self._held.pop(rank, []), self.ranks.incarnation(rank)
            for cmd in held:
                p = self._pending.get(cmd.command_id)
                if p is None or rank not in p.left:
                    continue
                if cmd.fence <= now or not inc:
                    expired.append(cmd.command_id)
                else:
                    lane = self.ranks.owe(rank, cmd.command_id)
                    sends.append((rank, lane, cmd.command_id, wire.command_message(cmd, inc)))
        return sends, expired

    def drop_held(self, command_id: int) -> list[int]:
        """A cancel: the ranks that held ``command_id`` unsent (each now owes nothing to send)."""
        with self.lock:
            ranks = [r for r, cmds in self._held.items() if any(c.command_id == command_id for c in cmds)]
            for r in ranks:
                self._held[r] = [c for c in self._held[r] if c.command_id != command_id]
        return ranks

    def answered(self, msg: wire.Done) -> Completion | None:
        """A worker's answer as the lifecycle's completion, or None (counted) when stale."""
        with self.lock:
            p = self._pending.get(msg.command_id)
            if self.ranks.incarnation(msg.rank) != msg.incarnation or p is None or msg.rank not in p.left:
                self.counters["stale"] += 1
                return None
            bad = msg.leading > len(p.cmd.keys)
            if bad:
                self.counters["bad_messages"] += 1
            self._settle(p, msg.rank)
            arrivals = self._arrivals.pop((msg.command_id, msg.rank), None)
            self.ranks.seen(msg.rank, time.monotonic())
        if arrivals is not None:
            if msg.leading == len(p.cmd.keys):  # read whole: every group arrived (their reports may trail)
                arrivals.arrive(self.layers, None)
            arrivals.close()
        if bad:
            return Completion(msg.command_id, msg.rank, 0, error=f"rank {msg.rank} answered {msg.leading} leading "
                              f"blocks of command {msg.command_id}, which has {len(p.cmd.keys)} keys")
        return Completion(msg.command_id, msg.rank, msg.leading, error=msg.error)

    def lost(self, rank: int, command_id: int, reason: str, lost: bool) -> Completion | None:
        """``rank`` will never answer ``command_id``: its failed completion (None when it owes
        nothing any more); *lost* keeps the blocks pinned to the fence."""
        with self.lock:
            p = self._pending.get(command_id)
            if p is None or rank not in p.left:
                return None
            self._settle(p, rank)
            self.counters["lost"] += 1
            arrivals = self._arrivals.pop((command_id, rank), None)
        if arrivals is not None:
            arrivals.close()
        return Completion(command_id, rank, 0, error=reason, lost=lost)

    def _settle(self, p: _Pending, rank: int) -> None:
        p.left.discard(rank)
        self.ranks.paid(rank, p.cmd.command_id)
        self.inflight -= 1
        if not p.left:
            del self._pending[p.cmd.command_id]

    def owing(self, command_id: int) -> list[tuple[int, int, int | None]]:
        """(rank, incarnation, lane) of each rank that still owes ``command_id``."""
        with self.lock:
            p = self._pending.get(command_id)
            return [(r, self.ranks.incarnation(r), self.ranks.lane_of(r, command_id)) for r in (p.left if p else ())]

    def arrivals(self, command_id: int, rank: int) -> LayerArrivals | None:
        with self.lock:
            return self._arrivals.get((command_id, rank))

    def arrived(self, rank: int, incarnation: int, command_id: int, layers: int) -> None:
        """A layer-wise load's groups arrived on ``rank`` (from its current incarnation only)."""
        with self.lock:
            arrivals = self._arrivals.get((command_id, rank))
            current = self.ranks.incarnation(rank) == incarnation
        if arrivals is not None and current:
            arrivals.arrive(layers, None)

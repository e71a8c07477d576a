"""Which reads a driver armed at reservation, and when each must be let go.

D's lifecycle sends an :class:`~kvstate.commands.ArmRead` when it reserves a request's blocks
(``DecodeLifecycle(arm_reads=True)``); a driver whose backend can prepare the pull
(``TransferBackend.arm_pull``) arms it on each rank and notes it here. A prepared pull holds a
slot of its rank, and on a GPU a wait queued on the device, until it is fired or let go, so
every one is let go as soon as it cannot fire.

Where to arm: a queued wait holds back what waits for the whole device in its process on its
GPU (loading a kernel, freeing memory: :mod:`kvstate.backends._cuda_armed`), so arm where the
process moves bytes and computes nothing on D's GPU: a rank worker, or a D with a GPU of its
own. ``docs/engine.md`` gives the measurements, and why kvstate's own demo does not arm.

Rules:

- A read of the request (``read`` kind) with exactly the armed keys and blocks fires it: the
  backend's pull takes it, and the note is dropped. A read of other keys or blocks (a host
  tier served the leading blocks, or the prefix changed) lets it go first, then reads.
- A swap-in of the request (its read's host-tier part, sent before the rest) changes nothing:
  the read of the rest follows and decides.
- The request's end (:class:`~kvstate.commands.RequestEnded`) before any read lets it go.
- Letting go is the backend's ``disarm_pull`` on each rank that armed; a pull the deadline
  already let go answers False there, which is fine. The backend's own deadline bounds what a
  lost note could cost.
- The driver's thread calls this (one engine loop submits a lifecycle's commands): no lock.
"""
from __future__ import annotations

from typing import NamedTuple

from .. import commands as C

__all__ = ["ArmedReads", "Armed"]


class Armed(NamedTuple):
    """One request's armed read: the ranks that armed it, its keys and its blocks."""

    ranks: tuple[int, ...]
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]


class ArmedReads:
    """A driver's armed reads by request id (see the module's rules)."""

    __slots__ = ("_by_request", "counts")

    def __init__(self) -> None:
        self._by_request: dict[str, Armed] = {}
        #: reads armed, fired (their read matched) and let go unfired, since the start
        self.counts = {"armed": 0, "matched": 0, "let_go": 0}

    def __len__(self) -> int:
        return len(self._by_request)

    def note(self, cmd: C.ArmRead, ranks: tuple[int, ...]) -> None:
        """``ranks`` armed ``cmd``'s read (an earlier note for its request is replaced: the
        caller let that one go)."""
        if ranks:
            self._by_request[cmd.request_id] = Armed(ranks, cmd.keys, cmd.block_ids)
            self.counts["armed"] += 1

    def read(self, cmd: C.TransferCommand) -> Armed | None:
        """A transfer of a request that may have an armed read: what to let go before it runs
        (a read of other keys or blocks), else None."""
        armed = self._by_request.get(cmd.request_id)
        if armed is None or C.kind_of(cmd) != "read":
            return None
        del self._by_request[cmd.request_id]
        if cmd.keys == armed.keys and cmd.block_ids == armed.block_ids:
            self.counts["matched"] += 1
            return None
        self.counts["let_go"] += 1
        return armed

    def ended(self, request_id: str) -> Armed | None:
        """The request ended: its read, armed and never sent, to let go; else None."""
        armed = self._by_request.pop(request_id, None)
        if armed is not None:
            self.counts["let_go"] += 1
        return armed

    def drain(self) -> list[Armed]:
        """Every armed read still noted (the driver closes): each to let go."""
        out = list(self._by_request.values())
        self.counts["let_go"] += len(out)
        self._by_request.clear()
        return out


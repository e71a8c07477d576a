"""Outstanding transfers and the pins that keep their blocks from being freed under them.

A transfer (a read or write command) touches blocks of its own request only, and stays listed
on that request (``Request.inflight``) until its last rank answers or its fence passes. While
the request holds its blocks, that hold covers the transfer too. When the request lets go of
them (it ends, fails, or is preempted) with transfers still unanswered, each such transfer
*pins* its blocks: one more reference each, dropped when it retires. So a block returns to
the free list only when neither an owner nor an in-flight transfer holds it, and the common
life (every transfer answered before its request lets go) pays no pin at all.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .pool import BlockPool

if TYPE_CHECKING:  # pragma: no cover
    from .commands import TransferCommand
    from .registry import Request

__all__ = ["Transfer", "Transfers"]


class Transfer:
    """One outstanding transfer command: its per-rank answers and the blocks it touches."""

    __slots__ = ("cmd", "req", "trigger", "blocks", "counts", "left", "limit", "resolved", "pinned",
                 "held", "inflight")

    def __init__(self, cmd: TransferCommand, req: Request, trigger: str, blocks: Sequence[int]) -> None:
        self.cmd = cmd
        self.req: Request | None = req  #: None once the request stopped waiting for it
        self.trigger = trigger  #: fired on the request with the answered count
        self.blocks = blocks
        self.counts: dict[int, int] = {}  #: rank -> leading count it answered
        self.left = len(cmd.ranks)  #: ranks still to answer
        self.limit = len(blocks)  #: the largest count a rank may answer
        self.resolved = False  #: its request moved on (all answered, or the deadline passed)
        self.pinned = False  #: it holds a reference to each of its blocks (its request let go)
        self.held = req.blocks  #: the request's block list it was cut from (replaced on release)
        self.inflight = req.inflight
        req.inflight.append(self)


class Transfers:
    """The outstanding transfers of one lifecycle, by command id."""

    __slots__ = ("pending", "_pool")

    def __init__(self, pool: BlockPool) -> None:
        self.pending: dict[int, Transfer] = {}  #: read directly on hot paths
        self._pool = pool

    def open(self, cmd: TransferCommand, req: Request, trigger: str, blocks: Sequence[int]) -> Transfer:
        t = self.pending[cmd.command_id] = Transfer(cmd, req, trigger, blocks)
        return t

    def pin(self, req: Request) -> None:
        """``req`` lets go of its blocks: each of its unanswered transfers pins the blocks it touches."""
        for t in req.inflight:
            if not t.pinned:
                t.pinned = True
                if t.blocks:
                    self._pool.retain(t.blocks)

    def retire(self, t: Transfer) -> int:
        """Forget ``t`` (answered, or its fence passed); returns how many blocks its unpinning freed."""
        del self.pending[t.cmd.command_id]
        t.inflight.remove(t)
        return self._pool.release(t.blocks) if t.pinned else 0

    def pinned_blocks(self) -> dict[int, int]:
        """Block id -> number of transfers pinning it."""
        out: dict[int, int] = {}
        for t in self.pending.values():
            if t.pinned:
                for b in t.blocks:
                    out[b] = out.get(b, 0) + 1
        return out

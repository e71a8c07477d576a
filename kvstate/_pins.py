"""Outstanding transfers and the pins that keep their blocks from being freed under them.

A transfer (a read or write command) touches blocks of its own request only, and stays listed
on that request (``Request.inflight``) until its last rank answers or its fence passes. While
the request holds its blocks, that hold covers the transfer too. When the request lets go of
them (it ends, fails, or is preempted) with transfers still unanswered, each such transfer
*pins* its blocks: one more reference each, dropped when it retires. So a block returns to
the free list only when neither an owner nor an in-flight transfer holds it, and the common
life (every transfer answered before its request lets go) pays no pin at all. A transfer's
state pages (:mod:`kvstate._statepages`) are pinned the same way, in their own pool.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._errors import ValidationError
from ._hostpool import HostBlockPool
from ._pool import BlockPool
from ._statepages import StatePages
from ._validate import is_int
from .commands import SwapOut

if TYPE_CHECKING:  # pragma: no cover
    from ._registry import Request
    from .commands import TransferCommand

__all__ = ["Transfer", "Transfers"]


class Transfer:
    """One outstanding transfer command: its per-rank answers and the blocks it touches."""

    __slots__ = ("cmd", "req", "trigger", "blocks", "counts", "left", "limit", "resolved", "pinned",
                 "held", "inflight", "host_keys", "lost", "pages")

    def __init__(self, cmd: TransferCommand, req: Request, trigger: str, blocks: Sequence[int],
                 host_keys: Sequence[str] = ()) -> None:
        self.cmd = cmd
        self.req: Request | None = req  #: None once the request stopped waiting for it
        self.trigger = trigger  #: fired on the request with the answered count
        self.blocks = blocks
        self.counts: dict[int, int] = {}  #: rank -> leading count it answered
        self.left = len(cmd.ranks)  #: ranks still to answer
        self.limit = len(cmd.keys)  #: the largest count a rank may answer (a flush from host memory has no blocks)
        self.resolved = False  #: its request moved on (all answered, or the deadline passed)
        self.pinned = False  #: it holds a reference to each of its blocks (its request let go)
        self.held = req.blocks  #: the request's block list it was cut from (replaced on release)
        self.inflight = req.inflight
        self.host_keys = host_keys  #: host tier entries it references until it retires
        self.lost = False  #: a rank was declared lost: retire at the fence, not at the last answer
        self.pages = StatePages.page_ids(cmd.states) if cmd.states else ()  #: the state pages it touches
        req.inflight.append(self)

    def check_answer(self, rank: object, count: object, lost: object, error: object = None) -> None:
        """One rank's answer is one of its ranks' first, with a count in range (0 when lost)
        and an error that is None or its message."""
        if rank.__class__ is int and count.__class__ is int and lost is False and error is None and \
                0 <= count <= self.limit and rank in self.cmd.ranks and rank not in self.counts:
            return  # the common answer, checked without building a message
        cmd = self.cmd
        where = f"command {cmd.command_id} of request {cmd.request_id!r}"
        if (rank.__class__ is not int and not is_int(rank)) or rank not in cmd.ranks:
            raise ValidationError(f"{where}: rank {rank!r} is not one of its ranks {cmd.ranks}")
        if rank in self.counts:
            raise ValidationError(f"{where}: rank {rank} already answered")
        if (count.__class__ is not int and not is_int(count)) or not 0 <= count <= self.limit:
            raise ValidationError(f"{where}: count {count!r} outside 0..{self.limit}")
        if lost is not False and (lost is not True or count):
            raise ValidationError(f"{where}: a lost answer is lost=True with count 0, got lost={lost!r}, "
                                  f"count {count!r}")
        if error is not None and error.__class__ is not str:
            raise ValidationError(f"{where}: an error answer's error is its message (a str), got {error!r}")


class Transfers:
    """The outstanding transfers of one lifecycle, by command id."""

    __slots__ = ("pending", "_pool", "host", "_pages")

    def __init__(self, pool: BlockPool, host: HostBlockPool | None = None, pages: BlockPool | None = None) -> None:
        self.pending: dict[int, Transfer] = {}  #: read directly on hot paths
        self._pool = pool
        self.host = host  #: the host tier, whose entries swap transfers reference
        self._pages = pages  #: the state page pool, whose pages state transfers pin

    def open(self, cmd: TransferCommand, req: Request, trigger: str, blocks: Sequence[int],
             host_keys: Sequence[str] = ()) -> Transfer:
        """List a new transfer; one touching host tier entries references them until it retires
        (so no slot is reused under a copy that may still run, even past its deadline)."""
        if host_keys:
            assert self.host is not None
            self.host.retain(host_keys)
        t = self.pending[cmd.command_id] = Transfer(cmd, req, trigger, blocks, host_keys)
        return t

    def pin(self, req: Request) -> None:
        """``req`` lets go of its blocks: each of its unanswered transfers pins the blocks it touches.
        One every rank has answered (none lost) touches no block again and retires next: a
        request that ends on a transfer's last answer frees its blocks then, unpinned."""
        for t in req.inflight:
            if not t.pinned and (t.left or t.lost):
                t.pinned = True
                if t.blocks:
                    self._pool.retain(t.blocks)
                if t.pages:
                    assert self._pages is not None
                    self._pages.retain(t.pages)

    def retire(self, t: Transfer) -> int:
        """Forget ``t`` (answered, or its fence passed); returns how many blocks and pages its
        unpinning freed."""
        del self.pending[t.cmd.command_id]
        t.inflight.remove(t)
        if t.host_keys:
            assert self.host is not None
            counts = t.counts
            if t.cmd.__class__ is SwapOut and len(counts) == len(t.cmd.ranks) and min(counts.values()) >= t.limit:
                self.host.commit(t.host_keys)  # every rank copied every block whole: the entries hold
            self.host.release(t.host_keys)
        if not t.pinned:
            return 0
        pages = self._pages.release(t.pages) if t.pages and self._pages is not None else 0
        return self._pool.release(t.blocks) + pages

    def pinned_blocks(self) -> dict[int, int]:
        """Block id -> number of transfers pinning it."""
        out: dict[int, int] = {}
        for t in self.pending.values():
            if t.pinned:
                for b in t.blocks:
                    out[b] = out.get(b, 0) + 1
        return out

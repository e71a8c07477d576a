"""The simulated router: where an arrival goes, and what waits for room.

An arrival first reserves blocks on the D instance with the most free blocks among those that
can take it (D keeps headroom for its running requests), then is admitted on the least loaded
P instance. When no D can take it now, it waits in a FIFO backlog, retried whenever a request
ends or a decode step frees blocks. A request whose prompt and answer together outgrow an
instance could never finish: it is refused at once (413, ``rejected_too_long``), as an engine
refuses a request beyond its maximum model length.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ._decode import DecodeInstance
from ._prefill import PrefillInstance
from ._request import SimRequest
from ._services import Services

__all__ = ["Router", "REJECTED"]

REJECTED = "rejected_too_long"  #: the reason of a request refused at arrival


class Router:
    """Routes arrivals to a (D, P) pair, or holds them until a D can take them."""

    def __init__(self, sv: Services, prefill: Sequence[PrefillInstance], decode: Sequence[DecodeInstance]) -> None:
        self.sv, self.prefill, self.decode = sv, prefill, decode
        self.backlog: deque[SimRequest] = deque()

    def arrive(self, req: SimRequest) -> None:
        cl = self.sv
        if cl.cache_spec.blocks_for(req.input_len + req.out) > cl.fit_blocks:
            self._reject(req)
        elif self.backlog or not self._route(req):
            self.backlog.append(req)
            cl.counters["backlogged"] += 1

    def retry_backlog(self) -> None:
        backlog = self.backlog
        while backlog and self._route(backlog[0]):
            backlog.popleft()

    def _route(self, req: SimRequest) -> bool:
        """Reserve D blocks, then admit on the least loaded P. False: no D can take it now."""
        cl = self.sv
        best = None
        for d in self.decode:
            if d.lc.can_reserve(req.input_len) and (best is None or d.lc.pool.num_free > best.lc.pool.num_free):
                best = d
        if best is None:
            return False
        tokens = req.tokens
        assert tokens is not None, "a request is routed once"
        best.lc.reserve(req.rid, tokens)
        best.note_blocks()
        cl.arm_timer(best)  # its first-token deadline
        req.d = best
        p = min(self.prefill, key=lambda i: i.load)
        p.assigned += 1
        req.p = p
        req.state = "prefill"
        p.lc.admit(req.rid, tokens)
        req.tokens = None  # the lifecycles hold their own copies
        p.pump()
        cl.arm_timer(p)  # a prompt waiting for P's blocks has a deadline too
        return True

    def _reject(self, req: SimRequest) -> None:
        cl = self.sv
        cl.counters["rejected_too_long"] += 1
        req.state, req.error, req.finish, req.reason = "rejected", 413, cl.env.now, REJECTED
        cl.live.discard(req.rid)
        cl.done.append(req)

"""What a lifecycle shows of itself: read-only views of its requests, transfers and pool,
for engines, drivers, metrics and the protocol suite. None of them changes anything."""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any

from . import commands as C
from .tables import rows
from .validate import check_request_id

if TYPE_CHECKING:  # pragma: no cover
    from .pins import Transfer
    from .pool import BlockPool
    from .prefixcache import PrefixCachingPool
    from .registry import Registry, Request
    from .statepages import StatePages
    from .timers import Timers

__all__ = ["Inspection", "TransferView"]

TransferView = tuple[C.TransferCommand, tuple[int, ...], bool, bool]  #: command, blocks, pinned, held


class Inspection:
    """The views (mixed into :class:`~kvstate.lifecycle.Lifecycle`, which holds what they read)."""

    pool: BlockPool
    prefix_cache: PrefixCachingPool | None
    states: StatePages
    counters: dict[str, int]
    _requests: Registry
    _reqs: dict[str, Request]
    _pending: dict[int, Transfer]
    _transfers: Any
    _timers: Timers
    _out: list[C.Command]

    def _live_timer(self, kind: int, ident: Any) -> bool:
        raise NotImplementedError

    def state_of(self, request_id: str) -> str:
        return self._requests.get(request_id).state

    def blocks_of(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (with group tables, group 0's: :meth:`rows_of`)."""
        return tuple(self._requests.get(request_id).blocks)

    def rows_of(self, request_id: str) -> list[Any]:
        """The request's logical blocks as backends' test helpers take them
        (:func:`kvstate.tables.rows`): block ids, or with group tables a tuple per logical
        block of its blocks, table by table (``FREED`` where freed)."""
        req = self._requests.get(request_id)
        return rows(req.blocks, req.tables)

    def pages_of(self, request_id: str) -> tuple[int, ...]:
        """The request's state pages (:mod:`kvstate.statepages`): its running state's first."""
        return tuple(self._requests.get(request_id).pages)

    def keys_of(self, request_id: str) -> tuple[str, ...]:
        """The content keys of the cache the request's leading blocks hold (or will)."""
        return tuple(self._requests.get(request_id).keys)

    def waiting_for(self, request_id: str) -> int:
        """The command whose answer the request waits for (0: none)."""
        return self._requests.get(request_id).cmd

    def live_requests(self) -> list[str]:
        return list(self._reqs)

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` (a str, else refused) is live here (admitted or reserved)."""
        return check_request_id(request_id) in self._reqs

    def next_deadline(self) -> float | None:
        """The clock time at which :meth:`tick` next has work, or None when no timer is set.

        An engine may sleep until then (or until an event arrives): calling ``tick()`` any
        earlier fires nothing."""
        return self._timers.next(self._live_timer)

    def pending_commands(self) -> list[C.TransferCommand]:
        """Transfer commands still awaiting at least one rank's answer."""
        return [t.cmd for t in self._pending.values()]

    def transfers(self) -> list[TransferView]:
        """Each outstanding transfer: its command, blocks, whether it pins them, and whether its
        request still holds the very block list it was cut from."""
        return [(t.cmd, tuple(t.blocks), t.pinned, t.req is not None and t.req.blocks is t.held)
                for t in self._pending.values()]

    def pinned_blocks(self) -> dict[int, int]:
        """Block id -> number of in-flight transfers pinning it."""
        return self._transfers.pinned_blocks()

    def owned_blocks(self) -> dict[str, tuple[int, ...]]:
        # by position, table after table: FREED where freed
        return {rid: tuple(chain(r.blocks, *r.tables)) for rid, r in self._reqs.items()}

    def queued_commands(self) -> int:
        """Commands queued since the last :meth:`poll_commands`."""
        return len(self._out)

    def stats(self) -> dict[str, Any]:
        cache = self.prefix_cache.prefix_stats() if self.prefix_cache is not None else None
        pages = self.states.pool.stats() if self.states.pool is not None else None
        return {"live": len(self._reqs), "pending_commands": len(self._pending),
                "pool": self.pool.stats(), "prefix_cache": cache, "state_pages": pages, **self.counters}

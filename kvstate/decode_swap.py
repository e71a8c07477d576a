"""D's host tier: preemption swapped to host memory and back, and reads by tier.

Rules (the rest of D's are in :mod:`kvstate.decode`; these rows come first in its table):

- With a host tier, D reads a handed-off cache by tier: the leading blocks ready in host
  memory are copied in first (``loading``, a ``SwapIn``), the store serves the rest.
- With a host tier (``host_blocks``) and ``Policy.preempt == "swap"``, preemption from
  ``running`` copies the cache into host slots (keys already there are shared, not copied)
  and frees the GPU blocks once every rank answered; ``resume`` copies the ready prefix back
  and recomputes the rest. A host tier too full to take the cache, or a failed swap-out,
  falls back per ``Policy.swap_fallback`` (write to the store, or recompute). A swapped
  request keeps its host entries referenced until it swaps in, ends, or waits past
  ``Policy.swapped_timeout`` (then it lets them go and recomputes on resume). Preempting a
  request that is swapping in returns it to ``swapped``. With ``Policy.swap_write ==
  "through"`` the cache is also written to the store (from the GPU blocks, still held) before
  they are freed; a swapped cache the host tier then loses (timeout, partial swap-in) is
  reloaded from the store instead of recomputed, and a failed store write leaves it swapped.
  With ``"back"`` the store write runs from host memory after the GPU blocks are freed
  (``FlushHost``, while the request waits swapped); a resume does not wait for it.
- With state groups, a swapped request keeps its state page and host memory serves no cache's
  last block (:mod:`kvstate.statepages` gives the rules).
"""
from __future__ import annotations

from typing import Any

from . import commands as C
from .keys import keys_of_packed
from .lifecycle import Lifecycle
from .registry import Request

__all__ = ["SWAP_STATES", "SWAP_ROWS", "SwapActions"]

SWAP_STATES = ("loading", "swapping_out", "swapped", "swapping_in")

SWAP_ROWS: tuple[dict[str, Any], ...] = (
    dict(trigger="first_token", source="reserved", dest="loading", conditions="_token_ok_host_hit",
         after="_send_host_load"),
    dict(trigger="host_loaded", source="loading", dest="running", conditions="_read_complete", after="_start_decode"),
    dict(trigger="host_loaded", source="loading", dest="reading", after="_send_rest_read"),
    dict(trigger="preempt", source="loading", dest="preempted", after="_release_blocks"),
    # preemption into the host tier: the GPU blocks go once the copy (and any store write) answered
    dict(trigger="preempt", source="running", dest="swapping_out", conditions="_swaps_out", after="_send_swap_out"),
    dict(trigger="swapped_out", source="swapping_out", dest="preempt_writing", conditions="_swapped_through",
         after=["_keep_swap", "_send_write_back"]),
    dict(trigger="swapped_out", source="swapping_out", dest="swapped", conditions="_swapped_back",
         after=["_keep_swap", "_release_swapped", "_park", "_send_flush"]),
    dict(trigger="swapped_out", source="swapping_out", dest="swapped", conditions="_swap_complete",
         after=["_keep_swap", "_release_swapped", "_park"]),
    dict(trigger="swapped_out", source="swapping_out", dest="preempt_writing", conditions="_falls_back_to_write",
         after=["_drop_swap", "_send_write_back"]),
    dict(trigger="swapped_out", source="swapping_out", dest="preempted", after=["_drop_swap", "_drop_write_back"]),
    dict(trigger="written", source="preempt_writing", dest="swapped", conditions="_stored_with_host",
         after=["_keep_write_back", "_release_swapped", "_park"]),
    dict(trigger="written", source="preempt_writing", dest="swapped", conditions="_host_only_now",
         after=["_forget_store", "_release_swapped", "_park"]),
    # the write-back from host memory answered (while swapped, or preempted once that timed out)
    dict(trigger="flushed", source="swapped", dest="swapped", conditions="_flush_complete", after="_keep_write_back"),
    dict(trigger="flushed", source="swapped", dest="swapped"),
    dict(trigger="flushed", source="preempted", dest="preempted", conditions="_flush_complete",
         after="_keep_write_back"),
    dict(trigger="flushed", source="preempted", dest="preempted"),
    dict(trigger="timed_out", source="swapped", dest="preempted", after=["_drop_host", "_release_pages"]),
    dict(trigger="resume", source="swapped", dest="swapping_in", after="_send_swap_in"),
    dict(trigger="preempt", source="swapping_in", dest="swapped", after=["_release_swapped", "_park"]),
    dict(trigger="swapped_in", source="swapping_in", dest="running", conditions="_swap_in_complete",
         after=["_drop_swap", "_start_decode"]),
    dict(trigger="swapped_in", source="swapping_in", dest="reloading", conditions="_has_stored",
         after=["_drop_host", "_send_reload"]),
    dict(trigger="swapped_in", source="swapping_in", dest="recomputing",
         after=["_drop_swap", "_recompute_after_swap_in"]),
)


class SwapActions(Lifecycle):
    """The actions :data:`SWAP_ROWS` name (D's lifecycle inherits them)."""

    _running: set[str]

    def _read(self, req: Request, start: int = 0) -> None:  # D's store read (kvstate.decode)
        raise NotImplementedError

    def _start_recompute(self, req: Request, value: int | None) -> None:  # (kvstate.decode)
        raise NotImplementedError

    def host_holdings(self) -> dict[str, tuple[str, ...]]:
        """Request id -> the host tier keys it references (swapping out, swapped, swapping in)."""
        return {rid: tuple(r.host_keys) for rid, r in self._reqs.items() if r.host_keys is not None}

    def _host_servable(self, req: Request) -> list[str]:
        """The keys of a handed-off cache that host memory may serve, past the GPU prefix
        cache's hits: with state groups not the last, which the store serves with the state."""
        assert req.stored_keys is not None
        keys = req.stored_keys[req.hits:]
        return keys[:-1] if self.states else keys

    def _token_ok_host_hit(self, req: Request, value: tuple[int | None, int]) -> bool:
        return value[1] == 200 and self.host is not None and req.stored_keys is not None \
            and self.host.ready_prefix(self._host_servable(req)) > 0

    def _send_host_load(self, req: Request, value: tuple[int, int]) -> None:
        assert self.host is not None and req.stored_keys is not None
        req.tokens.append(value[0])
        start = req.base = req.hits  # past the blocks the GPU prefix cache gave
        keys = req.stored_keys[start:start + self.host.lookup(self._host_servable(req))]
        self._transfer(req, C.SwapIn, "host_loaded", keys, req.blocks[start:start + len(keys)],
                       self.host.slots(keys))

    def _send_rest_read(self, req: Request, value: int) -> None:
        self.counters["host_read_blocks"] += value
        self._read(req, req.base + value)

    def _cache_keys(self, req: Request) -> list[str]:
        """The keys of a running request's cache: the newest token's is computed by the next
        decode step, so every token before it (what a write-back or swap-out copies)."""
        return keys_of_packed(req.tokens[:-1], self.spec.block_size, req.extra_keys, self.namespace,
                              self.key_cache)

    def _swaps_out(self, req: Request, value: Any) -> bool:
        """Into the host tier, whose entries other requests share: only a cache whole in every
        block (``window_from`` 0); one read without early window layers falls back."""
        return self.policy.preempt == "swap" and self.host is not None and not req.window_from and \
            self.host.can_acquire(self._cache_keys(req))

    def _send_swap_out(self, req: Request, value: Any) -> None:
        assert self.host is not None
        self._running.discard(req.id)
        keys = req.keys = self._cache_keys(req)
        slots, fresh = self.host.acquire(keys)
        req.host_keys, req.host_fresh = keys, [keys[i] for i in fresh]
        self._transfer(req, C.SwapOut, "swapped_out", req.host_fresh, [req.blocks[i] for i in fresh],
                       [slots[i] for i in fresh])

    def _swap_complete(self, req: Request, value: int) -> bool:
        return value >= len(req.host_fresh)

    def _swapped_back(self, req: Request, value: int) -> bool:
        return self.policy.swap_write == "back" and self._swap_complete(req, value)

    def _send_flush(self, req: Request, value: Any) -> None:
        """Write the cache back to the store from the host slots (awaited while it waits swapped:
        a resume first sends its swap-in, and the flush's answer then changes nothing)."""
        assert self.host is not None and req.host_keys is not None
        keys = req.host_keys
        req.base = 0
        self._transfer(req, C.FlushHost, "flushed", keys, [], self.host.slots(keys))

    def _flush_complete(self, req: Request, value: int) -> bool:
        return value >= len(req.keys)  # the keys its swap-out copied

    def _swapped_through(self, req: Request, value: int) -> bool:
        return self.policy.swap_write == "through" and self._swap_complete(req, value)

    def _stored_with_host(self, req: Request, value: int) -> bool:
        return req.host_keys is not None and self._write_complete(req, value)

    def _host_only_now(self, req: Request, value: int) -> bool:
        return req.host_keys is not None and not self._can_retry(req, value)

    def _forget_store(self, req: Request, value: Any) -> None:
        req.stored_keys = None  # the write-through failed: only the host tier holds the cache

    def _keep_swap(self, req: Request, value: int) -> None:
        assert self.host is not None
        self.host.commit(req.host_fresh)
        req.host_fresh = ()

    def _release_swapped(self, req: Request, value: Any = None) -> None:
        """Swapped: the GPU blocks go, the state page stays (host memory holds no state)."""
        self._running.discard(req.id)
        self._release(req, pages=False)

    def _release_pages(self, req: Request, value: Any = None) -> None:
        """Its host entries went: so does the state page it kept (a resume reads or recomputes)."""
        if self.states.release(req):
            self._freed = True

    def _park(self, req: Request, value: Any) -> None:
        self._wait(req, self.policy.swapped_timeout)  # its host entries are held until resume or then

    def _falls_back_to_write(self, req: Request, value: int) -> bool:
        return self.policy.swap_fallback == "write"

    def _drop_swap(self, req: Request, value: Any = None) -> None:
        """Let go of the request's host entries and of any stored copy's keys."""
        self._drop_host(req)
        req.stored_keys = None

    def _drop_host(self, req: Request, value: Any = None) -> None:
        """Let go of the request's host entries (uncommitted ones go once no copy holds them);
        a copy written through to the store stays known (``stored_keys``)."""
        if req.host_keys is not None:
            assert self.host is not None
            self.host.release(req.host_keys)
            req.host_keys, req.host_fresh = None, ()

    def _send_swap_in(self, req: Request, value: Any) -> None:
        """Copy back the ready entries past the blocks the GPU prefix cache still held."""
        assert self.host is not None and req.host_keys is not None
        start = req.base = req.hits
        keys = req.host_keys[start:max(start, self.host.ready_prefix(req.host_keys))]  # unready: recomputed
        self._transfer(req, C.SwapIn, "swapped_in", keys, req.blocks[start:start + len(keys)], self.host.slots(keys))

    def _swap_in_complete(self, req: Request, value: int) -> bool:
        return req.host_keys is not None and req.base + value >= len(req.host_keys)

    def _recompute_after_swap_in(self, req: Request, value: int) -> None:
        """A partial swap-in: continue past what came in, or, with state groups, from token 0
        (the page holds the whole cache's state, no shorter prefix's)."""
        self._start_recompute(req, 0 if self.states else req.base + value)


"""State pages: where a request's recurrent states live on the GPU (the state layer groups of
:mod:`kvstate._layers`: Mamba, linear attention), and which stored states a transfer moves.

Rules:

- A spec with state groups gives every live request *state pages* from a pool of
  ``num_states`` (one page holds a request's states of every state layer, on each rank:
  ``CacheSpec.state_bytes_per_rank``), as vLLM's hybrid allocator gives a state group its own
  table. ``pages[0]`` holds the running state. P takes a page more for each checkpoint its
  prompt passes, up to the last ``Policy.state_checkpoints`` of them: its prefill copies the
  state there into it (``StartPrefill.checkpoints``), so the write can store it. A request
  without free pages waits (P) or is refused (D), as for blocks.
- A stored state belongs to the prefix it follows: the state after a cache's leading ``n``
  blocks is stored with block ``n - 1``'s key. States are stored at checkpoints (every
  ``checkpoint`` tokens) and where a cache is written whole (P's prompt, D's write-back), so
  a prefix is reusable from a checkpoint only (or whole).
- A transfer lists its states as ``(end, page)`` pairs (``TransferCommand.states``; ``end``
  counts the command's blocks). A write stores each state whose blocks it stored, in order;
  a read loads into its page the last candidate whose blocks it read. Either answers the end
  of the last state it moved (0: none): blocks past it cannot be continued from.
- The lifecycle trusts no count beyond that: it floors each rank's to a state's end. A read
  whose ranks stop at different ends counts 0, since each rank's page holds the state of its
  own end and no position has its state on every rank. A write counts the minimum: each rank
  stored every state up to its count.
- Pages are released with the request's blocks (a swapped request's excepted: below); a
  transfer still running when its request lets go pins its pages as it pins its blocks
  (:mod:`kvstate._pins`).
- With a GPU prefix cache, the pages are a :class:`~kvstate._prefixcache.PrefixCachingPool`
  too: once P's prefill is done, its checkpoint pages are *published* under the key of the block
  each checkpoint follows, and kept, idle, when P lets go of them (evicted as blocks are). A later
  prompt claims cached blocks only up to the last checkpoint whose state is cached
  (:meth:`StatePages.claim_start`), claims that page too (shared: ``Request.from_page``), and
  its prefill copies it into its own running page first (``StartPrefill.state_from``); P lets
  go of the page once its prefill is done. D claims no cached blocks: it keeps no checkpoint
  states (its reads bring the cache's own state), so a block it holds has no state to start
  from.
- The host tier moves blocks, not states. On D, a request swapped out keeps its state page, which
  holds its whole cache's state until it swaps back in (a partial swap-in recomputes from
  token 0; its state belongs to no shorter prefix). The page goes when its host entries do
  (``Policy.swapped_timeout``). A cache read by tier takes at most its blocks before the last
  from host memory: the store serves the rest and the state stored with it. P's prefix lookup
  takes from host memory the blocks before the prefix's last checkpoint only; the store serves
  the rest with that checkpoint's state (a read that brings none prefills from the GPU prefix
  cache's hits, or 0). A write-back from host memory (``swap_write="back"``) would have no
  state to store, so it is refused.
- Layer-wise, a save stores its states once every layer is computed (the last paged layer
  group is held back until then: :meth:`~kvstate._spec.CacheSpec.paged_layers_done`), and a load
  reads the whole cache's state before its first layer group.
- With window groups as well (a model of sliding-window, full and state layers), a read or
  recompute continues from a state's end only where the blocks of its last window were read
  too (:meth:`~kvstate._spec.CacheSpec.resume_blocks`), and from token 0 otherwise.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence

from ._errors import ConfigError, OutOfBlocksError, ValidationError
from ._pool import BlockPool
from ._prefixcache import PrefixCachingPool
from ._registry import PrefillRequest, Request
from ._spec import CacheSpec
from .commands import TransferCommand

__all__ = ["StatePages", "usable_count"]


def usable_count(cmd: TransferCommand, counts: Mapping[int, int], reads: bool) -> int:
    """The count a state-moving transfer resolves to, from its ranks' answers (every rank
    answered): each floored to a state's end, then their minimum for a write, or their one
    common value for a read (0 if the ranks differ; 0 for a transfer moving no state)."""
    ends = [e for e, _ in cmd.states]
    floors = {ends[i - 1] if (i := bisect_right(ends, c)) else 0 for c in counts.values()} or {0}
    if reads and len(floors) > 1:
        return 0
    return min(floors)


class StatePages:
    """The state page pool of one lifecycle and what its requests' transfers move."""

    __slots__ = ("pool", "block_size", "step", "keep")
    pool: BlockPool | None  #: the state pages (None: no state group)

    def __init__(self, spec: CacheSpec, num_states: int, who: str, *, prefix_cache: bool, keep: int = 1) -> None:
        """``keep``: checkpoints P stores a state at, the last its prompt passes (a page each)."""
        self.keep = keep
        steps = [g.checkpoint // spec.block_size for g in spec.groups if g.kind == "state"]
        if not steps:
            if num_states:
                raise ConfigError(f"{who}: num_states {num_states}, but the spec has no state group")
            self.pool, self.block_size, self.step = None, spec.block_size, 0
            return
        if num_states < 1:
            raise ConfigError(f"{who}: the spec has state groups: give num_states >= 1 (state pages)")
        self.pool = PrefixCachingPool(num_states) if prefix_cache else BlockPool(num_states)
        self.block_size = spec.block_size
        self.step = max(steps)  # checkpoints are whole blocks; every state group checkpoints at their multiples
        for s in steps:
            if self.step % s:
                raise ConfigError(f"{who}: state groups checkpoint every {s} and {self.step} blocks: "
                                  "one must divide the other")

    def __bool__(self) -> bool:
        return self.pool is not None

    # -- pages ----------------------------------------------------------------------------------
    def pages_for(self, req: Request) -> int:
        """Pages ``req`` needs: one, and on P (whose write stores the checkpoints it passes) one
        more for each checkpoint it keeps."""
        return 1 + len(self.snapshots(req))

    def snapshots(self, req: Request) -> tuple[int, ...]:
        """The checkpoints (in blocks) P keeps for ``req``'s prompt: the last ``keep`` inside its
        full blocks, in order (none: a prompt shorter than a checkpoint)."""
        full = (len(req.tokens) - 1) // self.block_size
        last = full - full % self.step
        return tuple(range(max(self.step, last - (self.keep - 1) * self.step), last + 1, self.step)) if last else ()

    def take(self, req: Request, n: int) -> bool:
        """Give ``req`` ``n`` pages (none without state groups); False, changing nothing, when
        fewer are free."""
        if not self.can_take(n):
            return False
        if self.pool is not None:
            req.pages = self.pool.allocate(n)
        return True

    def can_take(self, n: int = 1) -> bool:
        """Whether ``n`` pages are free (always, without state groups)."""
        return self.pool is None or self.pool.num_free >= n

    def check_fits(self, req: Request) -> None:
        """Refuse a P request needing more pages than the pool has (it would wait forever)."""
        if self.pool is not None and self.pages_for(req) > self.pool.num_blocks:
            raise ValidationError(f"request {req.id!r}: its prompt passes state checkpoints, so it needs "
                                  f"{self.pages_for(req)} state pages (one a checkpoint it keeps), more than the "
                                  f"pool's {self.pool.num_blocks}")

    def check_free(self, request_id: str, op: str) -> None:
        """Refuse ``op`` (before it allocates anything) when no state page is free."""
        if self.pool is not None and not self.pool.num_free:
            raise OutOfBlocksError(f"request {request_id!r}: cannot {op}: none of the {self.pool.num_blocks} "
                                   "state pages is free")

    def release(self, req: Request) -> int:
        """``req`` lets go of its pages and of a cached page it claimed (a transfer still
        running pinned them first); returns how many came free."""
        freed = self.let_go_of_start(req)
        if req.pages:
            assert self.pool is not None
            freed += self.pool.release(req.pages)
            req.pages = []
        return freed

    # -- the GPU prefix cache's states (P) ----------------------------------------------------------
    def claim_start(self, req: PrefillRequest, lookup: Sequence[str], blocks: PrefixCachingPool) -> int:
        """How many leading ``lookup`` keys P may claim from the GPU prefix cache ``blocks``:
        up to the last checkpoint whose blocks and state are both cached (0: none). Its state
        page is claimed into ``req.from_page``."""
        pages = self.pool
        if not isinstance(pages, PrefixCachingPool):
            return 0
        hits = blocks.cached_prefix(lookup)[0]
        for end in range(hits - hits % self.step, 0, -self.step):
            key = lookup[end - 1]
            if pages.cached_prefix((key,))[0]:
                req.from_page = pages.claim((key,))[0]
                return end
        return 0

    def publish(self, req: Request) -> None:
        """P's prefill is done: its checkpoint pages hold the states after ``req.snaps``
        blocks, which later prompts may start from; the page it started from is let go."""
        if isinstance(self.pool, PrefixCachingPool) and req.snaps:
            self.pool.publish(tuple(req.keys[s - 1] for s in req.snaps), tuple(req.pages[1:1 + len(req.snaps)]))
        self.let_go_of_start(req)

    def let_go_of_start(self, req: Request) -> int:
        """``req`` lets go of the cached page it claimed, if any; returns how many came free."""
        if req.from_page < 0:  # a D record's is always -1
            return 0
        assert self.pool is not None and isinstance(req, PrefillRequest)
        page, req.from_page = req.from_page, -1
        return self.pool.release((page,))

    # -- what transfers move ----------------------------------------------------------------------
    def candidates(self, req: Request, start: int, end: int, whole: bool) -> tuple[tuple[int, int], ...]:
        """A read of blocks ``[start, end)``: every checkpoint past ``start`` (and ``end``
        itself when ``whole``: a cache stored whole), relative to ``start``, into pages[0]."""
        if self.pool is None:
            return ()
        page = req.pages[0]
        first = (start // self.step + 1) * self.step
        out = [(e - start, page) for e in range(first, end + 1, self.step)]
        if whole and (not out or out[-1][0] != end - start) and end > start:
            out.append((end - start, page))
        return tuple(out)

    def written(self, req: Request, base: int, end: int) -> tuple[tuple[int, int], ...]:
        """A write of blocks ``[base, end)``: the checkpoints P's prefill copied (``req.snaps``
        blocks, into pages[1:], those past ``base``), then the running state at ``end``."""
        if self.pool is None:
            return ()
        out = [(s - base, page) for s, page in zip(req.snaps, req.pages[1:]) if base < s < end]
        if end > base:
            out.append((end - base, req.pages[0]))
        return tuple(out)

    def continued(self, base: int, value: int, fallback: int) -> int:
        """Blocks a cache continues from after a read of ``value`` blocks past ``base``: all of
        them, or with state groups ``fallback`` (where the request has a state: the GPU prefix
        cache's hits, or 0) when the read moved no state, since none is at ``base``."""
        return base + value if value or self.pool is None else fallback

    @staticmethod
    def page_ids(states: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """The distinct pages a transfer's states touch (what it pins)."""
        return tuple(dict.fromkeys(p for _, p in states))

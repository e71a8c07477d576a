"""The block manager: every block decision a lifecycle makes, in one place.

A lifecycle never touches its pool: it asks its :class:`BlockManager` to check a request fits,
allocate its blocks (every table's), claim a cached prefix, publish a computed prefix, free
the blocks behind a window, and release what a request holds. Pins (blocks a transfer still
touches, :mod:`kvstate._pins`) are references in the same pool, so a released block returns only
when its last transfer lets go.

Rules:

- A request holds one block table per :func:`~kvstate._tables.per_block` (one without group
  tables), each entry a block of the one pool; a logical block costs that many pool blocks.
- Layer kinds are classes picked by ``LayerGroup.kind`` (:data:`LAYER_KINDS`). Each answers
  whether a table of its layers frees the blocks wholly behind a decoding request's window
  (``window``: yes; ``full``, ``latent``: no, every token attends to them; ``state``: its
  layers keep pages, not blocks) and from which logical block a write stores its blocks (a
  window table from the window on: the blocks before hold no window layers). A table frees
  behind the window when every layer kind in it does (:func:`table_kinds`).
- Who owns the blocks is the manager's business, not the lifecycle's:

  - :class:`BlockManager` owns a pool of ``num_blocks`` (a :class:`~kvstate._pool.BlockPool`,
    or a :class:`~kvstate._prefixcache.PrefixCachingPool` with the GPU prefix cache): it
    allocates from its free list and frees into it.
  - :class:`EngineBlocks` borrows the blocks an engine allocated and owns (vLLM's scheduler
    hands a connector the block ids it allocated for a request). The engine lends a request's
    ids (:meth:`EngineBlocks.lend`) before the lifecycle admits or reserves it, and the
    lifecycle's allocations for that request take them in order; a block the lifecycle lets
    go of, once no transfer pins it, is handed back (:meth:`EngineBlocks.returned`), never
    reused by kvstate. So the engine frees a block only when no transfer can touch it. An
    engine's prefix cache shares blocks between requests: a block lent for a second request
    while kvstate holds it for a first gains a reference, and returns when the last goes.

- Every public call validates first and changes nothing when it refuses.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._errors import BlockError, ConfigError, OutOfBlocksError, ValidationError
from ._pool import FREED, BlockPool, PoolStats
from ._prefixcache import PrefixCachingPool
from ._spec import CacheSpec
from ._tables import check_layout, give, held, per_block, table
from ._validate import MAX_BLOCKS, check_int, check_name, check_request_id, is_int

__all__ = ["BlockManager", "EngineBlocks", "EnginePool", "LayerKind", "LAYER_KINDS", "table_kinds", "check_manager"]


class LayerKind:
    """What a kind of layer asks of the blocks that hold it (the base: every token's blocks
    are kept and stored, as full attention needs)."""

    name = "full"
    #: a decoding request frees the blocks wholly behind its window
    frees_behind_window = False

    def stores_from(self, window_from: int) -> int:
        """The first logical block a write stores of a table of these layers."""
        return 0


class WindowKind(LayerKind):
    """Sliding-window attention: only the last window's blocks are ever read again."""

    name = "window"
    frees_behind_window = True

    def stores_from(self, window_from: int) -> int:
        return window_from  # the blocks before hold no window layers


class LatentKind(LayerKind):
    """Latent attention (MLA): one latent a token, every token attended to: kept as full."""

    name = "latent"


class StateKind(LayerKind):
    """A recurrent state (Mamba, linear attention): it lives in state pages
    (:mod:`kvstate._statepages`), so its layers hold no blocks to free."""

    name = "state"


#: ``LayerGroup.kind`` -> what it asks of blocks
LAYER_KINDS: dict[str, LayerKind] = {k.name: k for k in (LayerKind(), WindowKind(), LatentKind(), StateKind())}


def table_kinds(spec: Any) -> tuple[LayerKind, ...]:
    """The layer kind of each block table: with group tables each paged group's own; with one
    table, ``window`` only when every paged layer is a window layer (a block holds every layer
    of its tokens, so one full layer keeps it), else ``full``."""
    if spec.group_tables:
        return tuple(LAYER_KINDS[g.kind] for g in spec.stored_groups)
    return (LAYER_KINDS["window"] if spec.frees_behind_window else LAYER_KINDS["full"],)


class BlockManager:
    """A lifecycle's block decisions over a pool of ``num_blocks`` it owns (see the rules)."""

    def __init__(self, spec: Any, num_blocks: int, *, prefix_cache: bool = False,
                 who: str = "BlockManager", pool: BlockPool | None = None) -> None:
        """``prefix_cache``: a GPU prefix cache over the pool (:mod:`kvstate._prefixcache`);
        ``pool``: a pool of ``num_blocks`` to manage instead of a new one (a subclass's)."""
        check_name(who, "BlockManager: who")
        check_int(num_blocks, f"{who}: num_blocks", minimum=0, maximum=MAX_BLOCKS)
        if not isinstance(spec, CacheSpec):
            raise ValidationError(f"{who}: spec must be a CacheSpec, got {spec!r}")
        if pool is not None and (not isinstance(pool, BlockPool) or pool.num_blocks != num_blocks):
            raise ValidationError(f"{who}: pool must be a BlockPool of num_blocks ({num_blocks}) blocks, got {pool!r}")
        if prefix_cache.__class__ is not bool:
            raise ValidationError(f"prefix_cache must be a bool, got {prefix_cache!r}")
        check_layout(spec, prefix_cache, 0, who)  # the prefix cache's rule; the host tier's is its lifecycle's
        self.spec = spec
        self.per_block = per_block(spec)  #: pool blocks one logical block costs (its tables)
        self.kinds = table_kinds(spec)  #: each table's layer kind
        #: the tables a decoding request frees behind its window
        self.window_tables = tuple(t for t, k in enumerate(self.kinds) if k.frees_behind_window)
        self.prefix_cache = PrefixCachingPool(num_blocks) if prefix_cache else None  #: the pool, when it caches
        self.pool: BlockPool = pool if pool is not None else self.prefix_cache or BlockPool(num_blocks)

    # -- questions ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def new_tables(self) -> list[list[int]]:
        """A new request's tables besides ``Request.blocks``: empty, one per other table."""
        return [[] for _ in range(self.per_block - 1)] if self.per_block > 1 else []

    def check_fits(self, req: Any, nblocks: int) -> None:
        """Refuse a request whose ``nblocks`` logical blocks exceed the whole pool."""
        if nblocks * self.per_block > self.pool.num_blocks:
            tables = f" in each of {self.per_block} block tables" if self.per_block > 1 else ""
            raise ValidationError(f"request {req.id!r}: {len(req.tokens)} tokens need {nblocks} blocks of "
                                  f"{self.spec.block_size}{tables}, more than the pool's {self.pool.num_blocks}")

    def can_allocate(self, n: int, headroom: int = 0, request_id: str | None = None) -> bool:
        """Whether ``n`` logical blocks can be given now, keeping ``headroom`` pool blocks free."""
        return self.pool.can_allocate(n * self.per_block, headroom)

    # -- decisions ---------------------------------------------------------------------------
    def allocate(self, req: Any, n: int, headroom: int = 0) -> list[int]:
        """Give ``req`` ``n`` more logical blocks, in every table (keeping ``headroom`` free);
        returns the pool blocks. Raises :class:`~kvstate._errors.OutOfBlocksError`, changing
        nothing."""
        if self.per_block == 1:  # one table: the common case, on every decode step that crosses a block
            ids = self.pool.allocate(n, headroom)
            req.blocks.extend(ids)
            return ids
        ids = self.pool.allocate(n * self.per_block, headroom)
        give(req, ids)
        return ids

    def allocate_cached(self, req: Any, n: int, lookup: Sequence[str], headroom: int = 0) -> bool:
        """With the GPU prefix cache: give ``req`` ``n`` blocks, the leading ones claimed where
        ``lookup`` hits (``req.hits``), keeping ``headroom`` free; False, changing nothing, if
        short."""
        assert self.prefix_cache is not None
        got = self.prefix_cache.allocate_after(lookup, n, headroom)
        if got is None:
            return False
        req.blocks, req.hits = got
        return True

    def publish(self, keys: Sequence[str], blocks: Sequence[int]) -> None:
        """Blocks that hold ``keys``' bytes may be claimed by later requests (the GPU prefix
        cache; nothing without one)."""
        if self.prefix_cache is not None:
            self.prefix_cache.publish(keys, blocks)

    def free_behind_window(self, req: Any, first: int) -> int:
        """Free the window tables' logical blocks ``[0, first)`` (their entries become
        :data:`~kvstate._pool.FREED`); returns how many pool blocks came free. The caller pins
        them first where a transfer may still touch them."""
        out: list[int] = []
        for t in self.window_tables:
            entries = table(req, t)
            out += [b for b in entries[:first] if b != FREED]
            entries[:first] = [FREED] * first
        return self.pool.release(out)

    def release(self, req: Any) -> tuple[list[int], int]:
        """Take every block ``req`` holds from it (its tables left empty); returns the blocks
        and how many came free (the rest a transfer still pins)."""
        if req.tables or FREED in req.blocks:
            blocks = held(req)
            req.tables = [[] for _ in req.tables]
        else:  # one table, nothing freed behind a window: the list itself is handed over
            blocks = req.blocks
        req.blocks = []
        return blocks, (self.pool.release(blocks) if blocks else 0)


def check_manager(blocks: Any, spec: Any, num_blocks: int, prefix_cache: bool, who: str) -> None:
    """A block manager a lifecycle is given must decide for its ``spec`` over ``num_blocks``,
    with the prefix cache the lifecycle was told of."""
    if not isinstance(blocks, BlockManager):
        raise ValidationError(f"{who}: blocks must be a kvstate._blocks.BlockManager, got {type(blocks).__name__}")
    if blocks.spec != spec or blocks.num_blocks != num_blocks:
        raise ValidationError(f"{who}: its block manager decides for another spec or pool ({blocks.num_blocks} "
                              f"blocks, not {num_blocks})")
    if (blocks.prefix_cache is not None) != prefix_cache:
        raise ValidationError(f"{who}: prefix_cache={prefix_cache}, but its block manager "
                              f"{'has' if blocks.prefix_cache is not None else 'has no'} prefix cache")


class EnginePool(BlockPool):
    """The references kvstate holds on blocks an engine owns: the engine's ids
    ``0 .. num_blocks-1``, each free (with the engine) or held by a request or a transfer pin.
    It never hands out a block of its own choosing; a block whose last reference goes joins
    :meth:`take_returned`'s list for the engine to free."""

    __slots__ = ("_returned", "_used")

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._free = []  # the engine's free blocks are the engine's to list
        self._returned: list[int] = []
        self._used = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._used

    @property
    def num_used(self) -> int:
        return self._used

    def can_allocate(self, n: int, headroom: int = 0) -> bool:
        self._check_count(n, "n")
        self._check_count(headroom, "headroom")
        return self.num_free - n >= headroom

    def free_ids(self) -> list[int]:
        return [b for b, r in enumerate(self._refs) if not r]

    def stats(self) -> PoolStats:
        refs = self._refs
        shared = len(refs) - refs.count(0) - refs.count(1)  # in C: refcounts are never negative
        return PoolStats(self.num_blocks, self.num_free, self._used, shared, self._peak, self._allocs, self._frees)

    def allocate(self, n: int, headroom: int = 0) -> list[int]:
        if n == 0:
            return []
        raise BlockError("EnginePool: the engine chooses its blocks; take() the ids it lent")

    def take(self, block_ids: Sequence[int]) -> None:
        """A reference to each of the engine's ``block_ids`` (one held already gains one: the
        engine shares it between requests)."""
        refs = self._refs
        for b in block_ids:
            if not refs[b]:
                self._used += 1
            refs[b] += 1
        self._allocs += len(block_ids)
        self._peak = max(self._peak, self._used)

    def release(self, block_ids: Sequence[int]) -> int:
        refs, back = self._refs, self._returned
        before = len(back)
        for b in block_ids:
            r = refs[b] - 1
            refs[b] = r
            if not r:
                back.append(b)
        freed = len(back) - before
        self._used -= freed
        self._frees += freed
        return freed

    def take_returned(self) -> list[int]:
        """The blocks whose last reference went since the last call: the engine may free them."""
        out, self._returned = self._returned, []
        return out


class EngineBlocks(BlockManager):
    """A lifecycle's block decisions over blocks an engine allocates and owns (see the rules):
    ``lend`` a request's ids before the lifecycle admits or reserves it (and more before
    ``append_tokens`` grows it); ``returned`` says which the engine may free."""

    def __init__(self, spec: Any, num_blocks: int, who: str = "EngineBlocks") -> None:
        check_name(who, "EngineBlocks: who")
        check_int(num_blocks, f"{who}: num_blocks", minimum=0, maximum=MAX_BLOCKS)
        super().__init__(spec, num_blocks, who=who, pool=EnginePool(num_blocks))
        self._lent: dict[str, list[int]] = {}
        self._lent_ids: set[int] = set()
        self._computed: dict[str, int] = {}  # request -> leading lent blocks the engine computed

    def lend(self, request_id: str, block_ids: Sequence[int], computed: int = 0) -> None:
        """The engine allocated ``block_ids`` for the request (table by table with group
        tables: ``n`` of each); the lifecycle's next allocations for it take them in order.
        Each id must be the engine's (in range), named once, and not lent for another request
        still untaken; one kvstate holds already is shared (see the rules). ``computed``: how
        many leading blocks already hold the request's cache (the engine's own prefix cache
        found them): the lifecycle reads and computes only past them (``req.hits``)."""
        check_request_id(request_id)
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
            raise BlockError(f"request {request_id!r}: lend takes a sequence of block ids, got {block_ids!r}")
        seen: set[int] = set()
        for b in block_ids:
            if not is_int(b) or not 0 <= b < self.pool.num_blocks:
                raise BlockError(f"request {request_id!r}: block {b!r} is not one of the engine's "
                                 f"0..{self.pool.num_blocks - 1}")
            if b in seen or b in self._lent_ids:
                raise BlockError(f"request {request_id!r}: block {b} is already lent")
            seen.add(b)
        check_int(computed, f"request {request_id!r}: computed", minimum=0, maximum=len(block_ids),
                  error=BlockError)
        self._lent.setdefault(request_id, []).extend(int(b) for b in block_ids)
        self._lent_ids |= seen
        if computed:
            self._computed[request_id] = computed

    def lent(self, request_id: str) -> tuple[int, ...]:
        """The ids lent for the request and not taken yet."""
        return tuple(self._lent.get(check_request_id(request_id), ()))

    def take_back(self, request_id: str) -> list[int]:
        """Drop the ids lent for the request and not taken (it ended, or never started): the
        engine keeps them as it had them."""
        ids = self._lent.pop(check_request_id(request_id), [])
        self._lent_ids.difference_update(ids)
        self._computed.pop(request_id, None)
        return ids

    def returned(self) -> list[int]:
        """Blocks the lifecycle let go of, no transfer pinning them, since the last call."""
        return self.pool.take_returned()  # type: ignore[attr-defined]

    def can_allocate(self, n: int, headroom: int = 0, request_id: str | None = None) -> bool:
        """For a request, whether its engine lent ``n`` logical blocks' ids; without one, True:
        the engine, which allocates, has decided already."""
        check_int(n, "EngineBlocks.can_allocate: n", minimum=0)
        check_int(headroom, "EngineBlocks.can_allocate: headroom", minimum=0)
        if request_id is None:
            return True
        return len(self._lent.get(check_request_id(request_id), ())) >= n * self.per_block

    def allocate(self, req: Any, n: int, headroom: int = 0) -> list[int]:
        """Take the next ``n`` logical blocks' ids the engine lent for ``req`` (``headroom`` is
        the engine's business); :class:`~kvstate._errors.OutOfBlocksError` when it lent fewer."""
        k = n * self.per_block
        lent = self._lent.get(req.id, [])
        if len(lent) < k:
            raise OutOfBlocksError(f"request {req.id!r}: needs {k} block(s), the engine lent {len(lent)}")
        if not k:
            return []
        ids, lent[:k] = lent[:k], []
        if not lent:
            del self._lent[req.id]
        self._lent_ids.difference_update(ids)
        self.pool.take(ids)  # type: ignore[attr-defined]
        first = not held(req)
        give(req, ids)
        if first:
            req.hits = min(self._computed.pop(req.id, 0), n)
        return ids

    def allocate_cached(self, req: Any, n: int, lookup: Sequence[str], headroom: int = 0) -> bool:
        raise ConfigError("EngineBlocks: the engine's own prefix cache decides which blocks a prompt shares")

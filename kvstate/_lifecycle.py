"""What the P and D lifecycles share: the sans-I/O loop of events in, commands out.

A lifecycle owns a block pool (:mod:`~kvstate._pool`) and, with state groups, a state page
pool (:mod:`~kvstate._statepages`), its live requests
(:mod:`~kvstate._registry`), their outstanding transfers and pins (:mod:`~kvstate._pins`) and
deadlines (:mod:`~kvstate._timers`), and one compiled machine (:mod:`~kvstate._machine`) built
from its role's table (:mod:`~kvstate._prefill`, :mod:`~kvstate._decode`). It consumes events
(method calls, or :mod:`~kvstate.events` objects given to :meth:`Lifecycle.handle`) and queues
:mod:`~kvstate.commands`, which :meth:`Lifecycle.poll_commands` hands out. It never sleeps,
spawns a thread or touches a device; time comes from an injected clock, and deadlines fire
on :meth:`Lifecycle.tick` (:meth:`Lifecycle.next_deadline` says when that is due). Its
read-only views (states, blocks, keys, transfers, pins, stats) change nothing.

Rules every role keeps:

- Every public call validates its arguments first; a bad one raises a
  :class:`~kvstate._errors.KVStateError` naming the request and rule, and changes nothing.
- A transfer completes when every TP rank answered; it counts the minimum over ranks. Past its
  deadline it resolves as if the silent ranks answered 0, and its blocks stay pinned until the
  late answers arrive or its fence (deadline + ``Policy.fence_grace``) passes.
- Work one request's transition makes possible for another (blocks freed: a waiting request
  can start) runs after the transition that caused it has finished, never inside it.
- A late event for a request that already ended is dropped and counted, not an error
  (:meth:`Lifecycle.abort`, and the results of work the lifecycle asked for).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any, Generic

from . import commands as C
from . import events as E
from ._blocks import BlockManager, check_manager
from ._errors import ValidationError
from ._hostpool import HostBlockPool
from ._keys import KeyCache, keys_of_packed
from ._machine import CompiledMachine, MachineDef
from ._pins import Transfer, Transfers
from ._policy import ERROR_ABORTED, Policy
from ._pool import BlockPool
from ._registry import R, Registry, Request
from ._spec import CacheSpec
from ._statepages import StatePages, usable_count
from ._tables import check_layout, cut, pinned, rows
from ._timers import FENCE, TRANSFER, WAIT, Timers
from ._validate import MAX_BLOCKS, check_int, check_request_id, check_tokens, clock_reading, is_int, read_clock

__all__ = ["Lifecycle", "TransferView", "LANDING"]

TransferView = tuple[C.TransferCommand, tuple[int, ...], bool, bool]  #: command, blocks, pinned, held
#: transfers that scatter into GPU blocks or state pages: one given up on may still land until its fence
LANDING = (C.ReadBlocks, C.LoadLayers, C.SwapIn)
#: the host tier's transfers: they move blocks only (a state stays in its page), so their counts are blocks
HOST_COPIES = (C.SwapOut, C.SwapIn, C.FlushHost)


class Lifecycle(Generic[R]):
    """The pool, requests, transfers and deadlines one role's machine drives, and read-only
    views of them (for engines, drivers, metrics and the protocol suite: none changes anything).
    Slotted, as its roles' classes: every event reads a dozen of its fields, and slots keep them
    one indexed load away however many a role adds."""

    __slots__ = ("states", "_now", "spec", "policy", "blocks", "_per_block", "prefix_cache", "pool", "clock",
                 "namespace", "key_cache", "_requests", "_reqs", "host", "_transfers", "_pending", "_timers",
                 "_out", "_ids", "_ranks", "_depth", "_freed", "counters", "_machine")
    DEFINITION: MachineDef
    RECORD: type[R]  #: the side's request record
    #: states besides the initial one whose wait has a deadline (``_wait``; fires ``timed_out``)
    TIMED_WAITS: tuple[str, ...] = ()
    #: the state in which a command held back by :meth:`_send_settled` is still wanted
    SETTLES_IN = ""

    def __init__(self, spec: CacheSpec, num_blocks: int, policy: Policy | None = None, *,
                 clock: Callable[[], float] = time.monotonic, namespace: str = "",
                 key_cache: KeyCache | None = None, machine_cls: type = CompiledMachine,
                 host_blocks: int = 0, prefix_cache: bool = False, num_states: int = 0,
                 blocks: BlockManager | None = None) -> None:
        """``host_blocks``: host tier slots (0: none); ``prefix_cache``: see :mod:`kvstate._prefixcache`;
        ``num_states``: state pages, for a spec with state groups (:mod:`kvstate._statepages`);
        ``blocks``: the block manager to decide with (:mod:`kvstate._blocks`: an
        :class:`~kvstate._blocks.EngineBlocks` over an engine's own blocks), of ``spec`` and
        ``num_blocks``; by default one owning a pool of ``num_blocks``."""
        if not hasattr(self, "DEFINITION"):
            raise ValidationError("Lifecycle is the base of PrefillLifecycle and DecodeLifecycle: build one of those")
        check_int(host_blocks, "host_blocks", minimum=0, maximum=MAX_BLOCKS)
        check_int(num_states, "num_states", minimum=0, maximum=MAX_BLOCKS)
        if not (isinstance(machine_cls, type) and callable(getattr(machine_cls, "fire", None))):
            raise ValidationError(f"machine_cls must be a machine class (CompiledMachine, StockMachine), got "
                                  f"{machine_cls!r}")
        if prefix_cache.__class__ is not bool:
            raise ValidationError(f"prefix_cache must be a bool, got {prefix_cache!r}")
        if not isinstance(spec, CacheSpec):
            raise ValidationError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if policy is not None and not isinstance(policy, Policy):
            raise ValidationError(f"policy must be a Policy, got {type(policy).__name__}")
        #: state pages, with state groups
        self.states = StatePages(spec, num_states, type(self).__name__, prefix_cache=prefix_cache,
                                 keep=(policy or Policy()).state_checkpoints)
        if not callable(clock):
            raise ValidationError("clock must be callable")
        self._now = read_clock(clock)  # a clock that cannot tell a finite time is refused now
        if not isinstance(namespace, str):
            raise ValidationError(f"namespace must be a str, got {type(namespace).__name__}")
        if key_cache is not None and not isinstance(key_cache, KeyCache):
            raise ValidationError(f"key_cache must be a KeyCache, got {type(key_cache).__name__}")
        check_layout(spec, False, host_blocks, type(self).__name__)  # the prefix cache's: its block manager
        if blocks is not None:
            check_manager(blocks, spec, num_blocks, prefix_cache, type(self).__name__)
        self.spec, self.policy = spec, policy or Policy()
        #: every block decision (:mod:`kvstate._blocks`)
        self.blocks = blocks or BlockManager(spec, num_blocks, prefix_cache=prefix_cache, who=type(self).__name__)
        self._per_block = self.blocks.per_block  # pool blocks a logical block costs (its tables)
        self.prefix_cache = self.blocks.prefix_cache  #: the pool, when it caches
        self.pool: BlockPool = self.blocks.pool
        self.clock, self.namespace, self.key_cache = clock, namespace, key_cache
        self._requests: Registry[R] = Registry(self.DEFINITION.name)
        self._reqs = self._requests.live  # the live requests by id (hot paths read it directly)
        self.host = HostBlockPool(host_blocks) if host_blocks else None  #: the host tier's slots
        self._transfers = Transfers(self.pool, self.host, self.states.pool)
        self._pending = self._transfers.pending
        self._timers = Timers()
        self._out: list[C.Command] = []  # swapped out whole by poll_commands
        self._ids = itertools.count(1)
        self._ranks = tuple(range(spec.tp_size))
        self._depth = 0  # triggers running: deferred work waits for the outermost to finish
        self._freed = False  # blocks came free during a trigger: waiting work may start after it
        self.counters: dict[str, int] = dict.fromkeys(
            ("done", "failed", "aborted", "expired", "timed_out", "stale_completions", "late_completions",
             "late_events", "forced_releases", "retries", "lost_answers"), 0)
        # any class of CompiledMachine's shape: StockMachine runs the same table on stock transitions
        self._machine = machine_cls(self.DEFINITION, self)

    # -- commands out, completions and time in -------------------------------------------------
    def poll_commands(self) -> list[C.Command]:
        """Every command queued since the last poll, oldest first."""
        out = self._out
        if not out:
            return []
        self._out = []
        return out

    def complete(self, completion: E.Completion) -> bool:
        """Record one rank's answer. Returns False for an answer nobody waits for any more
        (its command expired and was reclaimed, or it never existed): such answers are
        counted in ``counters['stale_completions']`` and change nothing."""
        if completion.__class__ is not E.Completion and not isinstance(completion, E.Completion):
            raise ValidationError(f"complete() takes a Completion, got {type(completion).__name__}")
        cid, rank, count = completion.command_id, completion.rank, completion.count
        if cid.__class__ is not int and not is_int(cid):
            raise ValidationError(f"completion: command id {cid!r} is not an int")
        t = self._pending.get(cid)
        if t is None:
            self.counters["stale_completions"] += 1
            return False
        t.check_answer(rank, count, completion.lost, completion.error)
        self._clock_in()
        lost = completion.lost
        t.counts[rank] = 0 if completion.error or lost else count
        t.left -= 1
        if lost:
            self.counters["lost_answers"] += 1
            t.lost = True
        if t.resolved:
            self.counters["late_completions"] += 1
        elif t.left == 0:
            self._resolve(t)
        if t.left == 0:
            if t.lost and self._now < t.cmd.fence:  # a stopped rank may still touch the blocks
                self._timers.push(FENCE, t.cmd.fence, cid)
            else:
                self._retire(t)
        return True

    def tick(self) -> int:
        """Enforce deadlines at the clock's current time; returns how many timers fired."""
        fired = 0
        for kind, ident in self._timers.due(self._clock_in()):
            if not self._live_timer(kind, ident):
                continue
            fired += 1
            if kind == WAIT:
                self.counters["timed_out"] += 1  # a wait's deadline ("expired": a transfer's)
                self._fire(self._reqs[ident[0]], "timed_out")
                continue
            t = self._pending[ident]
            if kind == TRANSFER:  # resolve as if the silent ranks answered 0; pins wait for the fence
                self.counters["expired"] += 1
                self._timers.push(FENCE, t.cmd.fence, ident)
                self._out.append(C.CancelCommand(t.cmd.request_id, ident))
                self._resolve(t)
            else:
                self.counters["forced_releases"] += 1
                self._retire(t)
        return fired

    def abort(self, request_id: str) -> bool:
        """Cancel a live request from any state; its blocks are freed once no transfer pins them.

        Returns False, changing nothing, when the request already ended (a client's abort
        racing the request's own end is normal): see :meth:`_late`."""
        self._clock_in()
        req = self._late(request_id, "abort")
        if req is None:
            return False
        self._fire(req, "abort")
        return True

    def handle(self, event: E.Event) -> Any:
        """Feed one typed event (see :mod:`kvstate.events`) to the matching method."""
        method = self._HANDLERS.get(type(event))
        if method is None:
            raise ValidationError(f"{type(self).__name__} does not take {type(event).__name__} events")
        return method(self, event)

    _HANDLERS: dict[type, Callable[..., Any]] = {
        E.Completion: lambda s, e: s.complete(e),
        E.Tick: lambda s, e: s.tick(),
        E.Abort: lambda s, e: s.abort(e.request_id),
    }

    # -- views: what a lifecycle shows of itself, changing nothing -------------------------------
    def state_of(self, request_id: str) -> str:
        return self._requests.get(request_id).state

    def blocks_of(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (with group tables, group 0's: :meth:`rows_of`)."""
        return tuple(self._requests.get(request_id).blocks)

    def rows_of(self, request_id: str) -> list[Any]:
        """The request's logical blocks as backends' test helpers take them
        (:func:`kvstate._tables.rows`): block ids, or with group tables a tuple per logical
        block of its blocks, table by table (``FREED`` where freed)."""
        req = self._requests.get(request_id)
        return rows(req.blocks, req.tables)

    def pages_of(self, request_id: str) -> tuple[int, ...]:
        """The request's state pages (:mod:`kvstate._statepages`): its running state's first."""
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
        if request_id.__class__ is str and request_id:
            return request_id in self._reqs
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

    # -- firing, and the work it makes possible -------------------------------------------------
    def _fire(self, req: Request, trigger: str, value: Any = None) -> None:
        self._depth += 1
        try:
            self._machine.fire(req, trigger, value)
        finally:
            self._depth -= 1
        if self._freed and not self._depth:
            self._settle()

    def _settle(self) -> None:
        """Run the work blocks freed during a transition made possible, now it has finished."""
        while self._freed:
            self._freed = False
            self._blocks_freed()

    def _blocks_freed(self) -> None:
        """Hook: blocks returned to the free list (after the transition that freed them)."""

    def _late(self, request_id: str, event: str) -> R | None:
        """The live request, or None for one that already ended: an event that answers work
        the lifecycle asked for (a prefill, a recompute, P's first token) or an abort can
        arrive after the request ended by a deadline or an abort. Such a late event is
        dropped, counted in ``counters['late_events']`` and reported as a
        :class:`~kvstate.commands.LateEvent` notice. An id never seen still raises."""
        req = self._reqs.get(request_id) if request_id.__class__ is str else None
        if req is not None:
            return req
        ended = self._requests.ended(request_id)
        if ended is None:
            self._requests.get(request_id)  # raises: not a str, or never admitted here
            raise AssertionError("unreachable: get() raised")
        self.counters["late_events"] += 1
        self._out.append(C.LateEvent(request_id, event, ended))
        return None

    def _clock_in(self) -> float:
        """Read the clock once, at the start of a public call that may change anything, before
        it does: a clock that cannot tell the time (NaN) refuses the call whole, and every
        deadline the call sets counts from this one reading (``_wait``, ``_transfer``)."""
        t = self.clock()
        if t.__class__ is not float or t - t != 0.0:  # a finite float (the common reading): t - t is 0
            t = clock_reading(t)
        self._now = t
        return t

    def _live_timer(self, kind: int, ident: Any) -> bool:
        """Whether a timer still has work: its transfer unanswered (or, for a fence, not yet
        retired), or its request still waiting in the initial state it was set in."""
        if kind == WAIT:
            req = self._reqs.get(ident[0])
            return req is not None and req.wait_seq == ident[1] and \
                (req.state == self.DEFINITION.initial or req.state in self.TIMED_WAITS)
        t = self._pending.get(ident)
        return t is not None and (kind == FENCE or not t.resolved)

    def _wait(self, req: Request, timeout: float) -> None:
        """Give ``req`` a deadline for the wait it starts now (fires ``timed_out``)."""
        req.wait_seq = next(self._ids)
        self._timers.push(WAIT, self._now + timeout, (req.id, req.wait_seq))

    # -- transfers -------------------------------------------------------------------------------
    def _transfer(self, req: Request, cls: type, trigger: str, keys: Sequence[str], blocks: list[int],
                  host_slots: Sequence[int] | None = None, awaited: bool = True, timeout: float | None = None,
                  states: tuple[tuple[int, int], ...] = (), tables: tuple[tuple[int, ...], ...] = (),
                  window_from: int = 0, stores: bool = False) -> None:
        """Send a transfer of ``keys`` into / from ``blocks`` (and, for a swap, host tier
        ``host_slots``, whose entries it references until it retires); ``trigger`` takes its
        answer, unless the request does not wait for it (``awaited=False``: a copy that only
        pins its blocks once the request lets go of them). Its deadline is ``timeout`` from
        now (``Policy.transfer_timeout`` by default). ``states``, ``tables``, ``window_from``
        and ``stores`` are the command's fields of those names, passed only where set (a
        command's keywords cost on every transfer)."""
        cid = next(self._ids)
        deadline = self._now + (self.policy.transfer_timeout if timeout is None else timeout)
        ids = tuple(blocks)
        fence = deadline + self.policy.fence_grace
        if host_slots is None:
            if states or tables or window_from:  # a read or write (a lend has none of them)
                cmd = cls(req.id, cid, self._ranks, deadline, tuple(keys), ids, fence=fence, states=states,
                          tables=tables, window_from=window_from)
            elif stores:
                cmd = cls(req.id, cid, self._ranks, deadline, tuple(keys), ids, fence=fence, stores=True)
            else:
                cmd = cls(req.id, cid, self._ranks, deadline, tuple(keys), ids, fence=fence)
            self._transfers.open(cmd, req, trigger, pinned(ids, tables))
        else:
            cmd = cls(req.id, cid, self._ranks, deadline, tuple(keys), ids, fence=fence, host_slots=tuple(host_slots))
            self._transfers.open(cmd, req, trigger, ids, cmd.keys)
        self._timers.push(TRANSFER, deadline, cid)
        if awaited:
            req.cmd = cid
        self._out.append(cmd)

    def _resolve(self, t: Transfer) -> None:
        t.resolved = True
        req = t.req
        if req is None or req.cmd != t.cmd.command_id:
            return
        req.cmd = 0
        counts = t.counts
        # TP: the minimum over every rank; a rank that never answered counts 0
        value = min(counts.values()) if len(counts) == len(t.cmd.ranks) else 0
        if value and self.states.pool is not None and t.cmd.__class__ not in HOST_COPIES:
            # floored to a state's end; a read's ranks must agree
            value = usable_count(t.cmd, counts, t.trigger != "written")
        self._fire(req, t.trigger, value)

    def _retire(self, t: Transfer) -> None:
        """Forget ``t``; a command held back for it goes out once nothing can land any more."""
        req = t.req
        if self._transfers.retire(t):
            self._freed = True
            if not self._depth:
                self._settle()
        if req is not None and req.deferred is not None and req.state == self.SETTLES_IN and not self._landing(req):
            cmd, req.deferred = req.deferred, None
            self._out.append(cmd)

    def _send_settled(self, req: Request, cmd: C.Command) -> None:
        """Send ``cmd`` (a recompute, a prefill) once no read or swap-in the request gave up on
        (its deadline passed, its fence not yet) may still land in its blocks or pages."""
        req.deferred = cmd if self._landing(req) else None
        if req.deferred is None:
            self._out.append(cmd)

    @staticmethod
    def _landing(req: Request) -> bool:
        return any(t.cmd.__class__ in LANDING for t in req.inflight)

    def _release(self, req: Request, ended: C.RequestEnded | None = None, pages: bool = True) -> None:
        """Drop the request's blocks (and its state pages, unless ``pages`` is False); the notice
        (``ended``, else a FreeBlocks) goes out first, before blocks freed here can start a
        waiting request."""
        if req.cmd:  # it no longer waits for its transfer: cancel it (its answers still unpin)
            t = self._pending.get(req.cmd)
            if t is not None:
                t.req = None
                self._out.append(C.CancelCommand(req.id, req.cmd))
            req.cmd = 0
        self._transfers.pin(req)
        blocks, freed = self.blocks.release(req)
        if ended is not None:
            ended.block_ids = tuple(blocks)
            self._out.append(ended)
        elif blocks:
            self._out.append(C.FreeBlocks(req.id, tuple(blocks)))
        if pages and self.states.pool is not None:
            freed += self.states.release(req)  # its pages, as its blocks
        if freed:
            self._freed = True

    # -- requests in ------------------------------------------------------------------------------
    def _new_request(self, request_id: str, token_ids: Any, extra_keys: Any) -> R:
        check_request_id(request_id)
        self._requests.check_new(request_id)
        tokens = check_tokens(request_id, token_ids)
        if extra_keys is not None and not isinstance(extra_keys, Mapping):
            raise ValidationError(f"request {request_id!r}: extra_keys must map block index -> strings")
        try:
            keys = keys_of_packed(tokens, self.spec.block_size, extra_keys, self.namespace, self.key_cache)
        except ValidationError as e:
            raise ValidationError(f"request {request_id!r}: {e}") from None
        req = self.RECORD(request_id, self.DEFINITION.initial, tokens, keys, extra_keys)
        req.tables = self.blocks.new_tables()
        return req

    # -- actions both tables name (called as action(request, value)) -------------------------------
    def _recycle(self, req: R, value: Any = None) -> None:
        """The request ended: count it, remember it, release its blocks with its RequestEnded."""
        if req.state == "aborted" and req.error_code == 200:
            req.error_code = ERROR_ABORTED
        self._requests.end(req)
        self.counters[req.state] += 1
        self._release(req, C.RequestEnded(req.id, req.state, req.error_code, (), req.reason or req.state))

    def _write_complete(self, req: Request, value: int) -> bool:
        return req.base + value >= len(req.keys)

    def _can_retry(self, req: Request, value: int) -> bool:
        return req.retries < self.policy.write_retries

    def _retry_write(self, req: Request, value: int) -> None:
        req.retries += 1
        self.counters["retries"] += 1
        self._write(req, req.base + value)

    def _write(self, req: Request, base: int, cls: type = C.WriteBlocks) -> None:
        req.base = base
        keys = req.keys
        # group tables: the window groups' blocks freed behind the window are not stored (kvstate._tables)
        self._transfer(req, cls, "written", keys[base:], req.blocks[base:len(keys)],
                       states=self.states.written(req, base, len(keys)), tables=cut(req, base, len(keys)),
                       window_from=max(0, req.window_from - base) if req.tables else 0)

"""The sans-I/O core: per-request KV-cache life driven by the machines in :mod:`kvstate.machines`.

A lifecycle object owns a block pool, the live requests, the outstanding commands and
their deadlines. It consumes events (method calls or :mod:`kvstate.events` objects given to
:meth:`Lifecycle.handle`) and queues :mod:`kvstate.commands` that :meth:`Lifecycle.poll_commands`
hands out. It never sleeps, spawns a thread or touches a device; time comes from an injected
clock and deadlines are enforced by :meth:`Lifecycle.tick`.

Block safety comes from reference counts: a request holds one reference to each of its
blocks. A transfer touches blocks of its own request only; when that request lets go of
its blocks (finish, abort, preemption, failure) while transfers that touch them are still
unanswered, each such transfer pins its blocks with one more reference, dropped when its
last rank answers (or its deadline plus ``Policy.fence_grace`` passes). So a block returns
to the free list only when neither an owner nor an in-flight transfer holds it, and the
common life (every transfer answered before its request lets go) pays no pin at all.
"""
from __future__ import annotations

from array import array
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from . import commands as C
from . import events as E
from .errors import (DuplicateRequestError, InvalidTransitionError, OutOfBlocksError,
                     UnknownRequestError, ValidationError)
from .keys import TOKEN_TYPECODE, KeyCache, keys_of_packed, pack_tokens
from .machines import allowed_sources, build_machine, decode, prefill
from .policy import (ERROR_ABORTED, ERROR_READ_FAILED, ERROR_TIMEOUT, ERROR_WRITE_FAILED, Policy,
                     prefill_reason)
from .pool import BlockPool
from .spec import CacheSpec

__all__ = ["Lifecycle", "PrefillLifecycle", "DecodeLifecycle", "Request", "ERROR_NO_FIRST_TOKEN"]

ERROR_NO_FIRST_TOKEN = ERROR_TIMEOUT  #: D's wait for P's first token passed its deadline

_CMD, _FENCE, _WAIT = 0, 1, 2  # timer kinds
_ENDED_MEMORY = 4096  # recently ended request ids: late events for them are dropped, not errors


class Request:
    """A live request's record: cheap (slots), no per-request machine."""

    __slots__ = ("id", "state", "tokens", "keys", "extra_keys", "blocks", "cmd", "base",
                 "retries", "error_code", "reason", "token", "stored_keys", "wait_seq", "inflight")

    def __init__(self, request_id: str, state: str, tokens: array, keys: list[str],
                 extra_keys: Mapping[int, Sequence[str]] | None) -> None:
        self.id = request_id
        self.state = state
        self.tokens = tokens
        self.keys = keys
        self.extra_keys = extra_keys
        self.blocks: list[int] = []
        self.cmd = 0  # the command whose answer the request waits for (0: none)
        self.base = 0
        self.retries = 0
        self.error_code = 200
        self.reason = ""  # why it ended, set by the action that fails it (else its end state)
        self.token: int | None = None
        self.stored_keys: list[str] | None = None
        self.wait_seq = 0
        self.inflight: list[_Pending] = []  # its transfers not yet retired


class _Pending:
    """An outstanding transfer command: per-rank answers and the blocks it pins."""

    __slots__ = ("cmd", "req", "trigger", "blocks", "counts", "left", "limit", "resolved", "pinned",
                 "held", "inflight")

    def __init__(self, cmd: C.TransferCommand, req: Request, trigger: str, blocks: Sequence[int],
                 limit: int) -> None:
        self.cmd = cmd
        self.req: Request | None = req
        self.trigger = trigger
        self.blocks = blocks
        self.counts: dict[int, int] = {}
        self.left = len(cmd.ranks)
        self.limit = limit
        self.resolved = False
        self.pinned = False  # holds a reference to each of its blocks (its request let go)
        self.held = req.blocks  # the request's block list it was cut from (replaced on release)
        self.inflight = req.inflight
        req.inflight.append(self)


def _is_int(x: Any) -> bool:
    """An int, bool excluded (True would pass for rank or command 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_request_id(request_id: Any) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValidationError(f"request id must be a non-empty str, got {request_id!r}")


def _check_tokens(request_id: str, token_ids: Any) -> array:
    """Validated token ids as our own uint32 array: the caller's list is never mutated."""
    if token_ids.__class__ is list and token_ids:  # the hot case: the packing is the check
        packed = array(TOKEN_TYPECODE)
        try:
            packed.fromlist(token_ids)
            return packed
        except (TypeError, OverflowError):
            pass  # the checks below raise with the rule broken
    if token_ids.__class__ is not list and (isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence)):
        raise ValidationError(f"request {request_id!r}: token_ids must be a sequence of ints")
    if not token_ids:
        raise ValidationError(f"request {request_id!r}: token_ids is empty")
    try:
        return pack_tokens(token_ids)
    except ValidationError as e:
        raise ValidationError(f"request {request_id!r}: {e}") from None


def _check_token(request_id: str, token: Any) -> None:
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**32:
        raise ValidationError(f"request {request_id!r}: token {token!r} is not an int in 0..2**32-1")


class Lifecycle:
    """What the P and D sides share: pool, requests, commands, deadlines, completions."""

    TABLE: ModuleType

    def __init__(self, spec: CacheSpec, num_blocks: int, policy: Policy | None = None, *,
                 clock: Callable[[], float] = time.monotonic, namespace: str = "",
                 lean_machine: bool = True, key_cache: KeyCache | None = None) -> None:
        if not isinstance(spec, CacheSpec):
            raise ValidationError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if policy is not None and not isinstance(policy, Policy):
            raise ValidationError(f"policy must be a Policy, got {type(policy).__name__}")
        if not callable(clock):
            raise ValidationError("clock must be callable")
        if key_cache is not None and not isinstance(key_cache, KeyCache):
            raise ValidationError(f"key_cache must be a KeyCache, got {type(key_cache).__name__}")
        self.key_cache = key_cache
        self.spec = spec
        self.policy = policy or Policy()
        self.pool = BlockPool(num_blocks)
        self.clock = clock
        self.namespace = namespace
        self._reqs: dict[str, Request] = {}
        self._pending: dict[int, _Pending] = {}
        # Timers: one FIFO per kind (_CMD, _FENCE, _WAIT) of (when, seq, ident). Each kind's
        # times are "now" plus a constant, so appending keeps every queue sorted (O(1) per
        # timer, where a heap paid O(log n) for the many timers of answered commands);
        # tick() merges the three heads in (when, seq) order.
        self._timers: tuple[deque[tuple[float, int, Any]], ...] = (deque(), deque(), deque())
        self._out: list[C.Command] = []  # swapped out whole by poll_commands
        self._ids = itertools.count(1)
        self._ranks = tuple(range(spec.tp_size))
        self._ended: dict[str, str] = {}  # insertion-ordered: the oldest goes first
        self.counters: dict[str, int] = dict.fromkeys(
            ("done", "failed", "aborted", "expired", "stale_completions", "late_completions",
             "late_events", "forced_releases", "retries"), 0)
        self.machine = build_machine(self.TABLE, self, lean_machine)
        self._fire_ev = {name: ev.trigger for name, ev in self.machine.events.items()}
        self._sources = allowed_sources(self.TABLE)

    # -- inspection --------------------------------------------------------------------------
    def state_of(self, request_id: str) -> str:
        return self._get(request_id).state

    def blocks_of(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._get(request_id).blocks)

    def live_requests(self) -> list[str]:
        return list(self._reqs)

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` is live here (admitted or reserved, not yet ended)."""
        return request_id in self._reqs

    def next_deadline(self) -> float | None:
        """The clock time at which :meth:`tick` next has work, or None when no timer is set.

        An engine may sleep until then (or until an event arrives); calling ``tick()`` any
        earlier fires nothing. Timers whose work went away (an answered command, a request
        that got its first token) are dropped here as they reach the head of their queue."""
        best = None
        for kind, q in enumerate(self._timers):
            while q and not self._live_timer(kind, q[0][2]):
                q.popleft()
            if q and (best is None or q[0][0] < best):
                best = q[0][0]
        return best

    def pending_commands(self) -> list[C.TransferCommand]:
        """Transfer commands still awaiting at least one rank's answer."""
        return [p.cmd for p in self._pending.values()]

    def pinned_blocks(self) -> dict[int, int]:
        """Block id -> number of in-flight commands pinning it (a transfer pins its blocks
        once its request has let go of them)."""
        out: dict[int, int] = {}
        for p in self._pending.values():
            if not p.pinned:
                continue
            for b in p.blocks:
                out[b] = out.get(b, 0) + 1
        return out

    def owned_blocks(self) -> dict[str, tuple[int, ...]]:
        return {rid: tuple(r.blocks) for rid, r in self._reqs.items()}

    def stats(self) -> dict[str, Any]:
        return {"live": len(self._reqs), "pending_commands": len(self._pending),
                "pool": self.pool.stats(), **self.counters}

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
        if cid.__class__ is not int and not _is_int(cid):
            raise ValidationError(f"completion: command id {cid!r} is not an int")
        p = self._pending.get(cid)
        if p is None:
            self.counters["stale_completions"] += 1
            return False
        cmd = p.cmd
        if (rank.__class__ is not int and not _is_int(rank)) or rank not in cmd.ranks:
            raise ValidationError(f"command {cid} of request {cmd.request_id!r}: "
                                  f"rank {rank!r} is not one of its ranks {cmd.ranks}")
        if rank in p.counts:
            raise ValidationError(f"command {cid} of request {cmd.request_id!r}: "
                                  f"rank {rank} already answered")
        if (count.__class__ is not int and not _is_int(count)) or not 0 <= count <= p.limit:
            raise ValidationError(f"command {cid} of request {cmd.request_id!r}: "
                                  f"count {count!r} outside 0..{p.limit}")
        p.counts[rank] = 0 if completion.error else count
        p.left -= 1
        if p.resolved:
            self.counters["late_completions"] += 1
        elif p.left == 0:
            self._resolve(p)
        if p.left == 0:
            self._retire(p)
        return True

    def tick(self) -> int:
        """Enforce deadlines at the clock's current time; returns how many timers fired.

        An expired command resolves as if its silent ranks answered 0, so the request moves
        on (retry, error, recompute) at once; its blocks stay pinned until the late answers
        arrive or ``Policy.fence_grace`` passes.
        """
        now, queues, fired = self.clock(), self._timers, 0
        while True:
            kind, head = -1, None
            for k, q in enumerate(queues):
                if q and q[0][0] <= now and (head is None or q[0][:2] < head[:2]):
                    kind, head = k, q[0]
            if head is None:
                break
            ident = queues[kind].popleft()[2]
            if kind == _WAIT:
                if self._live_timer(_WAIT, ident):
                    fired += 1
                    self._fire(self._reqs[ident[0]], "timed_out")
                continue
            p = self._pending.get(ident)
            if p is None:
                continue
            fired += 1
            if kind == _CMD and not p.resolved:
                self.counters["expired"] += 1
                self._push_timer(p.cmd.fence, _FENCE, ident)
                self._out.append(C.CancelCommand(p.cmd.request_id, ident))
                self._resolve(p)
            elif kind == _FENCE:
                self.counters["forced_releases"] += 1
                self._retire(p)
        return fired

    def abort(self, request_id: str) -> bool:
        """Cancel a live request from any state; its blocks are freed once no transfer pins them.

        Returns False, changing nothing, when the request already ended (a client's abort
        racing the request's own end is normal): see :meth:`_late`."""
        req = self._late(request_id, "abort")
        if req is None:
            return False
        self._fire(req, "abort")
        return True

    def handle(self, event: E.Event) -> Any:
        """Feed one typed event (see :mod:`kvstate.events`) to the matching method."""
        try:
            method = self._HANDLERS[type(event)]
        except KeyError:
            raise ValidationError(f"{type(self).__name__} does not take {type(event).__name__} events") from None
        return method(self, event)

    _HANDLERS: dict[type, Callable[..., Any]] = {
        E.Completion: lambda s, e: s.complete(e),
        E.Tick: lambda s, e: s.tick(),
        E.Abort: lambda s, e: s.abort(e.request_id),
    }

    # -- internals -------------------------------------------------------------------------
    def _get(self, request_id: str) -> Request:
        if not isinstance(request_id, str):
            raise ValidationError(f"request id must be a str, got {type(request_id).__name__} {request_id!r}")
        req = self._reqs.get(request_id)
        if req is None:
            ended = self._ended.get(request_id)
            if ended:
                raise UnknownRequestError(
                    f"request {request_id!r} already ended ({ended}) and was recycled on the "
                    f"{self.TABLE.NAME} side: no further events are accepted for it")
            raise UnknownRequestError(f"request {request_id!r} is unknown on the {self.TABLE.NAME} side")
        return req

    def _late(self, request_id: str, event: str) -> Request | None:
        """The live request, or None for one that already ended: an event that answers work
        the lifecycle asked for (a prefill, a recompute, P's first token) or an abort can
        arrive after the request ended by a deadline or an abort. Such a late event is
        dropped, counted in ``counters['late_events']`` and reported as a
        :class:`~kvstate.commands.LateEvent` notice. An id never seen still raises."""
        req = self._reqs.get(request_id) if request_id.__class__ is str else None
        if req is not None:
            return req
        ended = self._ended.get(request_id) if request_id.__class__ is str else None
        if ended is None:
            self._get(request_id)  # raises: not a str, or never admitted here
        self.counters["late_events"] += 1
        self._out.append(C.LateEvent(request_id, event, ended))
        return None

    def _live_timer(self, kind: int, ident: Any) -> bool:
        """Whether a timer still has work: its command unanswered (or, for a fence, not yet
        retired), or its request still waiting in the initial state it was set in."""
        if kind == _WAIT:
            req = self._reqs.get(ident[0])
            return req is not None and req.wait_seq == ident[1] and req.state == self.TABLE.INITIAL
        p = self._pending.get(ident)
        return p is not None and (kind == _FENCE or not p.resolved)

    def _fire(self, req: Request, trigger: str, value: Any = None) -> None:
        if req.state not in self._sources[trigger]:
            raise InvalidTransitionError(req.id, req.state, trigger, self.TABLE.NAME)
        self._fire_ev[trigger](req, req, value)

    def _push_timer(self, when: float, kind: int, ident: Any, seq: int | None = None) -> None:
        q = self._timers[kind]
        entry = (when, next(self._ids) if seq is None else seq, ident)
        if q and when < q[-1][0]:  # the clock went back: insert where the queue stays sorted
            i = len(q)
            while i and q[i - 1][0] > when:
                i -= 1
            q.insert(i, entry)
        else:
            q.append(entry)

    def _transfer(self, req: Request, cls: type, trigger: str, keys: Sequence[str], blocks: list[int]) -> None:
        """Send a read or write of ``keys`` into / from ``blocks`` (pinned until it answers)."""
        cid = next(self._ids)
        deadline = self.clock() + self.policy.transfer_timeout
        ids = tuple(blocks)
        cmd = cls(req.id, cid, self._ranks, deadline, tuple(keys), ids,
                  fence=deadline + self.policy.fence_grace)
        self._pending[cid] = _Pending(cmd, req, trigger, ids, len(ids))
        self._push_timer(deadline, _CMD, cid, cid)
        req.cmd = cid
        self._out.append(cmd)

    def _resolve(self, p: _Pending) -> None:
        p.resolved = True
        req = p.req
        if req is None or req.cmd != p.cmd.command_id:
            return
        req.cmd = 0
        counts = p.counts
        # TP: the minimum over every rank; a rank that never answered counts 0
        eff = min(counts.values()) if len(counts) == len(p.cmd.ranks) else 0
        self._fire(req, p.trigger, eff)

    def _retire(self, p: _Pending) -> None:
        del self._pending[p.cmd.command_id]
        p.inflight.remove(p)
        if p.pinned and self.pool._decref(p.blocks):
            self._blocks_freed()

    def _detach(self, req: Request) -> None:
        if req.cmd:
            p = self._pending.get(req.cmd)
            if p is not None:
                p.req = None
                self._out.append(C.CancelCommand(req.id, req.cmd))
            req.cmd = 0

    def _release(self, req: Request, ended: C.RequestEnded | None = None) -> None:
        """Drop the request's blocks; the notice (``ended``, else a FreeBlocks) goes out first,
        before blocks freed here can start a waiting request."""
        self._detach(req)
        for p in req.inflight:  # unanswered transfers keep the blocks they touch
            if not p.pinned:
                p.pinned = True
                if p.blocks:
                    self.pool._incref(p.blocks)
        blocks, req.blocks = req.blocks, []
        if ended is not None:
            ended.block_ids = tuple(blocks)
            self._out.append(ended)
        elif blocks:
            self._out.append(C.FreeBlocks(req.id, tuple(blocks)))
        if blocks and self.pool._decref(blocks):
            self._blocks_freed()

    def _blocks_freed(self) -> None:
        """Hook: blocks returned to the free list."""

    # -- actions shared by both tables (called by transitions as callback(req, value)) --------
    def recycle(self, req: Request, value: Any = None) -> None:
        if req.state == "aborted" and req.error_code == 200:
            req.error_code = ERROR_ABORTED
        del self._reqs[req.id]
        ended = self._ended
        ended[req.id] = req.state
        if len(ended) > _ENDED_MEMORY:
            del ended[next(iter(ended))]
        self.counters[req.state] += 1
        self._release(req, C.RequestEnded(req.id, req.state, req.error_code, (), req.reason or req.state))

    def write_complete(self, req: Request, value: int) -> bool:
        return req.base + value >= len(req.keys)

    def can_retry(self, req: Request, value: int) -> bool:
        return req.retries < self.policy.write_retries

    def retry_write(self, req: Request, value: int) -> None:
        req.retries += 1
        self.counters["retries"] += 1
        self._write(req, req.base + value)

    def _write(self, req: Request, base: int) -> None:
        req.base = base
        keys = req.keys
        blocks = req.blocks[base:len(keys)]
        self._transfer(req, C.WriteBlocks, "written", keys[base:], blocks)

    def _new_request(self, request_id: str, token_ids: Any, extra_keys: Any) -> Request:
        if request_id.__class__ is not str or not request_id:
            _check_request_id(request_id)  # raises
        if request_id in self._reqs:
            raise DuplicateRequestError(
                f"request {request_id!r} is already live on the {self.TABLE.NAME} side "
                f"(state {self._reqs[request_id].state!r})")
        tokens = _check_tokens(request_id, token_ids)
        if extra_keys is not None and not isinstance(extra_keys, Mapping):
            raise ValidationError(f"request {request_id!r}: extra_keys must map block index -> strings")
        try:
            keys = keys_of_packed(tokens, self.spec.block_size, extra_keys, self.namespace, self.key_cache)
        except ValidationError as e:
            raise ValidationError(f"request {request_id!r}: {e}") from None
        return Request(request_id, self.TABLE.INITIAL, tokens, keys, extra_keys)

    def _check_fits(self, req: Request, nblocks: int) -> None:
        if nblocks > self.pool.num_blocks:
            raise ValidationError(
                f"request {req.id!r}: {len(req.tokens)} tokens need {nblocks} blocks of "
                f"{self.spec.block_size}, more than the pool's {self.pool.num_blocks}")


class PrefillLifecycle(Lifecycle):
    """The P instance's side: see :mod:`kvstate.machines.prefill`."""

    TABLE = prefill

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting: deque[Request] = deque()

    # -- engine API --------------------------------------------------------------------------
    def admit(self, request_id: str, token_ids: Sequence[int],
              extra_keys: Mapping[int, Sequence[str]] | None = None) -> str:
        """Admit a prompt; blocks are allocated now or, FIFO, as soon as enough are free.

        Returns the request's state (``"waiting"`` when it queues for blocks)."""
        req = self._new_request(request_id, token_ids, extra_keys)
        self._check_fits(req, len(req.keys))
        self._reqs[request_id] = req
        self._waiting.append(req)
        self._start_waiting()
        if req.state == prefill.INITIAL:  # queued for blocks: until Policy.queue_timeout at most
            req.wait_seq = next(self._ids)
            self._push_timer(self.clock() + self.policy.queue_timeout, _WAIT, (request_id, req.wait_seq))
        return req.state

    @property
    def num_waiting(self) -> int:
        """Admitted requests still queued for blocks."""
        return len(self._waiting)

    def prefill_done(self, request_id: str, first_token: int) -> bool:
        """The prompt's cache is computed and ``first_token`` sampled: store it, then send.

        Returns False for a request that already ended (aborted while it computed): the
        late result is dropped (see :meth:`Lifecycle._late`)."""
        _check_token(request_id, first_token)
        req = self._late(request_id, "prefill_done")
        if req is None:
            return False
        self._fire(req, "prefill_done", first_token)
        return True

    _HANDLERS = {**Lifecycle._HANDLERS,
                 E.Admit: lambda s, e: s.admit(e.request_id, e.token_ids, e.extra_keys),
                 E.PrefillDone: lambda s, e: s.prefill_done(e.request_id, e.first_token)}

    # -- internals ---------------------------------------------------------------------------
    def _start_waiting(self) -> None:
        waiting, pool = self._waiting, self.pool
        while waiting:
            req = waiting[0]
            if req.state != prefill.INITIAL:  # aborted while it waited
                waiting.popleft()
                continue
            n = len(req.keys)
            if pool.num_free < n:
                return
            waiting.popleft()
            req.blocks = pool.allocate(n)
            self._fire(req, "start")

    def _blocks_freed(self) -> None:
        if self._waiting:
            self._start_waiting()

    def _prefix_limit(self, req: Request) -> int:
        # Reuse full blocks only, and leave at least one token to compute the first token from.
        return (len(req.tokens) - 1) // self.spec.block_size

    # -- actions (see the table in kvstate.machines.prefill) ----------------------------------
    def wants_prefix(self, req: Request, value: Any) -> bool:
        return self.policy.read_prefix and self._prefix_limit(req) > 0

    def send_prefix_read(self, req: Request, value: Any) -> None:
        n = self._prefix_limit(req)
        blocks = req.blocks[:n]
        self._transfer(req, C.ReadBlocks, "prefix_read", req.keys[:n], blocks)

    def start_prefill(self, req: Request, value: int | None) -> None:
        self._out.append(C.StartPrefill(req.id, tuple(req.blocks), (value or 0) * self.spec.block_size))

    def send_write(self, req: Request, value: int) -> None:
        req.token = value
        self._write(req, 0)

    def send_first_token(self, req: Request, value: Any) -> None:
        self._out.append(C.SendFirstToken(req.id, req.token, 200))

    def send_write_error(self, req: Request, value: Any) -> None:
        req.error_code, req.reason = ERROR_WRITE_FAILED, "write_failed"
        self._out.append(C.SendFirstToken(req.id, None, ERROR_WRITE_FAILED))

    def send_queue_timeout(self, req: Request, value: Any) -> None:
        req.error_code, req.reason = ERROR_TIMEOUT, "queue_timeout"
        self._out.append(C.SendFirstToken(req.id, None, ERROR_TIMEOUT))


class DecodeLifecycle(Lifecycle):
    """The D instance's side, preemption included: see :mod:`kvstate.machines.decode`."""

    TABLE = decode

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._running: set[str] = set()

    # -- engine API --------------------------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` fits while keeping running requests' headroom."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens <= 0:
            raise ValidationError(f"num_tokens must be an int > 0, got {num_tokens!r}")
        return self.pool.can_allocate(self.spec.blocks_for(num_tokens + 1), self._headroom())

    def reserve(self, request_id: str, token_ids: Sequence[int],
                extra_keys: Mapping[int, Sequence[str]] | None = None) -> tuple[int, ...]:
        """P asks for blocks: reserve room for the prompt plus the first token.

        Keeps ``Policy.decode_headroom_blocks`` free per running request; raises
        :class:`OutOfBlocksError` (reserving nothing) when that is not possible."""
        req = self._new_request(request_id, token_ids, extra_keys)
        n = -(-(len(req.tokens) + 1) // self.spec.block_size)  # spec.blocks_for, inline (hot path)
        if n > self.pool.num_blocks:
            self._check_fits(req, n)  # raises
        try:
            req.blocks = self.pool.allocate(n, self._headroom())
        except OutOfBlocksError as e:
            raise OutOfBlocksError(f"request {request_id!r}: cannot reserve {n} blocks ({e})") from None
        req.stored_keys = req.keys
        self._reqs[request_id] = req
        req.wait_seq = next(self._ids)
        self._push_timer(self.clock() + self.policy.first_token_timeout, _WAIT, (request_id, req.wait_seq))
        return tuple(req.blocks)

    def deliver_first_token(self, request_id: str, token: int | None, error_code: int = 200) -> bool:
        """P's first token arrived (``error_code`` 200), or P reports it has no cache (!= 200).

        Returns False for a request that already ended (D's first-token deadline passed, or
        it was aborted): the late token is dropped (see :meth:`Lifecycle._late`)."""
        if not isinstance(error_code, int) or isinstance(error_code, bool):
            raise ValidationError(f"request {request_id!r}: error_code {error_code!r} is not an int")
        if error_code == 200:
            _check_token(request_id, token)
        req = self._late(request_id, "first_token")
        if req is None:
            return False
        self._fire(req, "first_token", (token, error_code))
        return True

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Decoded tokens: grow the request, allocating blocks as it crosses block boundaries.

        Returns the blocks newly allocated. Raises :class:`OutOfBlocksError` (appending
        nothing) when the pool is short: preempt a request and try again."""
        req = self._get(request_id)
        if req.state != "running":
            raise InvalidTransitionError(request_id, req.state, "append_tokens", decode.NAME)
        new = _check_tokens(request_id, token_ids)
        need = self.spec.blocks_for(len(req.tokens) + len(new)) - len(req.blocks)
        try:
            added = self.pool.allocate(max(need, 0))
        except OutOfBlocksError as e:
            raise OutOfBlocksError(f"request {request_id!r}: cannot grow by {need} blocks ({e})") from None
        req.blocks.extend(added)
        req.tokens.extend(new)
        req.stored_keys = None  # the store no longer holds the whole cache
        return tuple(added)

    def preempt(self, request_id: str) -> None:
        """Take the request's blocks back: write its cache out first if the policy says so."""
        self._fire(self._get(request_id), "preempt")

    def resume(self, request_id: str) -> tuple[int, ...]:
        """Give a preempted request blocks again, then reload its cache or recompute it."""
        req = self._get(request_id)
        if req.state not in self._sources["resume"]:
            raise InvalidTransitionError(request_id, req.state, "resume", decode.NAME)
        n = self.spec.blocks_for(len(req.tokens))
        try:
            req.blocks = self.pool.allocate(n)
        except OutOfBlocksError as e:
            raise OutOfBlocksError(f"request {request_id!r}: cannot resume with {n} blocks ({e})") from None
        self._fire(req, "resume")
        return tuple(req.blocks)

    def recompute_done(self, request_id: str) -> bool:
        """The engine recomputed the cache a :class:`~kvstate.commands.Recompute` asked for.

        Returns False for a request that already ended (the late result is dropped)."""
        req = self._late(request_id, "recompute_done")
        if req is None:
            return False
        self._fire(req, "recompute_done")
        return True

    def finish(self, request_id: str) -> None:
        self._fire(self._get(request_id), "finish")

    _HANDLERS = {**Lifecycle._HANDLERS,
                 E.Reserve: lambda s, e: s.reserve(e.request_id, e.token_ids, e.extra_keys),
                 E.FirstToken: lambda s, e: s.deliver_first_token(e.request_id, e.token, e.error_code),
                 E.AppendTokens: lambda s, e: s.append_tokens(e.request_id, e.token_ids),
                 E.Preempt: lambda s, e: s.preempt(e.request_id),
                 E.Resume: lambda s, e: s.resume(e.request_id),
                 E.RecomputeDone: lambda s, e: s.recompute_done(e.request_id),
                 E.Finish: lambda s, e: s.finish(e.request_id)}

    def _headroom(self) -> int:
        return self.policy.decode_headroom_blocks * len(self._running)

    # -- actions (see the table in kvstate.machines.decode) -----------------------------------
    def token_ok(self, req: Request, value: tuple[int | None, int]) -> bool:
        return value[1] == 200

    def send_read(self, req: Request, value: tuple[int, int]) -> None:
        req.tokens.append(value[0])
        self._read(req)

    def send_reload(self, req: Request, value: Any) -> None:
        self._read(req)

    def _read(self, req: Request) -> None:
        keys = req.stored_keys
        assert keys is not None
        blocks = req.blocks[:len(keys)]
        self._transfer(req, C.ReadBlocks, "read_done", keys, blocks)

    def fail_from_prefill(self, req: Request, value: tuple[int | None, int]) -> None:
        req.error_code, req.reason = value[1], prefill_reason(value[1])
        self.recycle(req)

    def fail_no_token(self, req: Request, value: Any) -> None:
        req.error_code, req.reason = ERROR_NO_FIRST_TOKEN, "first_token_timeout"
        self.recycle(req)

    def read_complete(self, req: Request, value: int) -> bool:
        return value >= len(req.stored_keys or ())

    def recompute_on_miss(self, req: Request, value: int) -> bool:
        return self.policy.read_failure == "recompute"

    def fail_read(self, req: Request, value: int) -> None:
        req.error_code, req.reason = ERROR_READ_FAILED, "read_failed"
        self.recycle(req)

    def start_recompute(self, req: Request, value: int | None) -> None:
        req.stored_keys = None
        self._out.append(C.Recompute(req.id, tuple(req.blocks), (value or 0) * self.spec.block_size))

    def start_decode(self, req: Request, value: Any) -> None:
        self._running.add(req.id)
        self._out.append(C.StartDecode(req.id, tuple(req.blocks)))

    def writes_back(self, req: Request, value: Any) -> bool:
        return self.policy.preempt == "write"

    def send_write_back(self, req: Request, value: Any) -> None:
        self._running.discard(req.id)
        # The newest token's cache is computed by the next decode step: store all before it.
        req.keys = keys_of_packed(req.tokens[:-1], self.spec.block_size, req.extra_keys, self.namespace,
                                  self.key_cache)
        req.retries = 0
        self._write(req, 0)

    def keep_write_back(self, req: Request, value: int) -> None:
        req.stored_keys = req.keys  # the write-back answered in full on every rank

    def release_blocks(self, req: Request, value: Any) -> None:
        self._running.discard(req.id)
        self._release(req)

    def drop_write_back(self, req: Request, value: Any) -> None:
        req.stored_keys = None
        self._running.discard(req.id)
        self._release(req)

    def has_stored(self, req: Request, value: Any) -> bool:
        return req.stored_keys is not None

    def recycle(self, req: Request, value: Any = None) -> None:
        self._running.discard(req.id)
        super().recycle(req, value)

"""The decode (D) side of a request's KV-cache life, preemption included: its machine, then its actions.

Rules:

- When P asks, D reserves blocks for the prompt and the first token, keeping
  ``Policy.decode_headroom_blocks`` free per running request; it then waits for P's first
  token at most ``Policy.first_token_timeout`` (504, reason ``first_token_timeout``). A first
  token that comes with an error ends the request with P's code (reason ``prefill_...``).
- With a GPU prefix cache (``prefix_cache``), ``reserve`` claims, shared, the prompt's leading
  full blocks the cache holds (``counters['gpu_read_blocks']``); the reads below start after
  them, and a prompt held whole is runnable with its first token. A request's full blocks are
  published when it becomes runnable and when it is preempted from ``running``; ``resume``
  claims back those still on the GPU, and the reload, swap-in or recompute starts after them.
  ``can_reserve`` does not count hits. With state groups D claims none (no state to start from).
- With ``arm_reads``, ``reserve`` announces the read the first token will send (an
  :class:`~kvstate.commands.ArmRead`: its keys and blocks past the prefix-cache hits, until
  that token's deadline) for a driver to prepare (:mod:`kvstate.backends._arming` says where
  that is safe); none layer-wise, with state groups or group tables (those reads carry more
  than keys and blocks), or with the whole prompt cached. Nothing waits on it.
- With the token, D reads the cache into the reserved blocks; with a host tier, the leading
  blocks ready there are copied in first (``loading``, a ``SwapIn``) and the store serves only
  the rest (counted in ``counters['host_read_blocks']``). A request is runnable only when
  every block was read on every TP rank; a partial or failed read ends with 502 (policy
  ``fail``, reason ``read_failed``) or recomputes from the longest prefix every rank read
  (policy ``recompute``).
- With window layer groups (:mod:`kvstate._layers`), a read takes their blocks only from the
  one the cache's last window starts in (``window_from``). The blocks before hold no window
  layers, so the request never shares them: no prefix-cache publish, no swap into the host
  tier (it falls back per ``Policy.swap_fallback``), a write-back only from that block on;
  a recompute from token 0 makes them whole again. A short read recomputes from its count
  only where the count's last window was read (``CacheSpec.resume_blocks``), else from token
  0: a count that a window-first read cannot give is not trusted.
- Layer-wise (``layerwise=True``): D's store reads are ``LoadLayers``: a rank reads and scatters
  one layer group at a time and signals each group's arrival to the engine, which may start
  the request's next decode step as soon as the load goes out, waiting per layer before its
  attention. The request is runnable, and that step's token counts, only once ``StartDecode``
  follows; a load that stops short recomputes or fails as a read does, and the engine drops
  the step.
- When every layer is a window layer, or each layer group has a block table of its own
  (``CacheSpec.frees_behind_window``; :mod:`kvstate._tables`), ``append_tokens`` frees the
  window tables' blocks wholly behind the next step's window; those tables read
  ``kvstate._pool.FREED`` there. With one table and any full layer, every block stays (a block
  holds every layer of its tokens). With group tables a write-back stores the full groups'
  every block and the window groups' from ``window_from`` on.
- Decoded tokens grow the request block by block. Preemption from ``running`` writes the cache
  out first when the policy says ``write`` and frees the blocks only once that write answered
  (a failed write-back falls back to recomputing); from reading, reloading or recomputing it
  frees at once (an unanswered read keeps its pins). ``resume`` reloads a stored cache, or
  recomputes.
- A recompute goes out only once no read or swap-in the request gave up on (its deadline
  passed, its fence not yet) can still land in its blocks: until then it is held back, and
  it leaves when that transfer answers or its fence passes. A late read brings a cache's
  bytes as they were stored; after the recompute, decode steps change the last block, and a
  read landing then would overwrite them.
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
  last block (:mod:`kvstate._statepages` gives the rules).
- With state groups (:mod:`kvstate._statepages`), a request holds a state page while it holds
  blocks. A read loads the state stored with the cache (or, short, with the last checkpoint
  its blocks reach): a recompute starts from the count only where every rank loaded that
  state, else from token 0. A write-back stores the state with the cache.
- Every failure row recycles in the same step; ``abort`` leaves every live state. A late first
  token, recompute result or abort for a request that already ended is dropped and counted.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import commands as C
from . import events as E
from ._blocks import BlockManager
from ._errors import ConfigError, InvalidTransitionError, OutOfBlocksError, ValidationError
from ._keys import KeyCache, full_blocks, keys_of_packed
from ._lifecycle import Lifecycle
from ._machine import CompiledMachine, MachineDef
from ._policy import ERROR_READ_FAILED, ERROR_TIMEOUT, Policy, prefill_reason
from ._pool import FREED
from ._registry import DecodeRequest
from ._spec import CacheSpec
from ._tables import cut, held, table
from ._validate import check_int, check_layerwise, check_token, check_tokens, is_int

__all__ = ["DECODE", "DecodeLifecycle", "ERROR_NO_FIRST_TOKEN"]

ERROR_NO_FIRST_TOKEN = ERROR_TIMEOUT  #: D's wait for P's first token passed its deadline

#: the host tier's states: reads by tier, and preemption swapped to host memory and back
SWAP_STATES = ("loading", "swapping_out", "swapped", "swapping_in")
_LIVE = ("reserved", "reading", "recomputing", "running", "preempt_writing", "preempted", "reloading",
         *SWAP_STATES)

DECODE = MachineDef(
    name="decode", initial="reserved",
    states=(*_LIVE, "done", "failed", "aborted"),
    terminal=("done", "failed", "aborted"),
    transitions=(
        # the GPU prefix cache held every block of the prompt: nothing to read
        dict(trigger="first_token", source="reserved", dest="running", conditions="_token_ok_all_cached",
             after=["_take_token", "_start_decode"]),
        # the host tier (these rows come before the store's: a hit there is taken first)
        dict(trigger="first_token", source="reserved", dest="loading", conditions="_token_ok_host_hit",
             after="_send_host_load"),
        dict(trigger="host_loaded", source="loading", dest="running", conditions="_read_complete",
             after="_start_decode"),
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
        dict(trigger="flushed", source="swapped", dest="swapped", conditions="_flush_complete",
             after="_keep_write_back"),
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
        # the store
        dict(trigger="first_token", source="reserved", dest="reading", conditions="_token_ok", after="_send_read"),
        dict(trigger="first_token", source="reserved", dest="failed", after=["_note_prefill_error", "_recycle"]),
        dict(trigger="timed_out", source="reserved", dest="failed", after=["_note_no_token", "_recycle"]),
        # runnable only when every block was read on every rank
        dict(trigger="read_done", source=["reading", "reloading"], dest="running", conditions="_read_complete",
             after="_start_decode"),
        dict(trigger="read_done", source=["reading", "reloading"], dest="recomputing",
             conditions="_recompute_on_miss", after="_recompute_after_read"),
        dict(trigger="read_done", source=["reading", "reloading"], dest="failed",
             after=["_note_read_failed", "_recycle"]),
        dict(trigger="recompute_done", source="recomputing", dest="running", after="_start_decode"),
        # preemption: write back, free only after the write answered
        dict(trigger="preempt", source="running", dest="preempt_writing", conditions="_writes_back",
             after="_send_write_back"),
        dict(trigger="preempt", source=["running", "recomputing", "reading", "reloading"], dest="preempted",
             after="_release_blocks"),
        dict(trigger="written", source="preempt_writing", dest="preempted", conditions="_write_complete",
             after=["_keep_write_back", "_release_blocks"]),
        dict(trigger="written", source="preempt_writing", dest="preempt_writing", conditions="_can_retry",
             after="_retry_write"),
        dict(trigger="written", source="preempt_writing", dest="preempted", after="_drop_write_back"),
        dict(trigger="resume", source="preempted", dest="reloading", conditions="_has_stored", after="_send_reload"),
        dict(trigger="resume", source="preempted", dest="recomputing", after="_start_recompute"),
        dict(trigger="finish", source="running", dest="done", after="_recycle"),
        dict(trigger="abort", source=list(_LIVE), dest="aborted", after="_recycle"),
    ),
)


class DecodeLifecycle(Lifecycle[DecodeRequest]):
    """The D instance's side (see the module's rules)."""

    __slots__ = ("layerwise", "arm_reads", "_running", "_frees_behind_window", "_window_tables")
    DEFINITION = DECODE
    RECORD = DecodeRequest
    TIMED_WAITS = ("swapped",)
    SETTLES_IN = "recomputing"

    def __init__(self, spec: CacheSpec, num_blocks: int, policy: Policy | None = None, *,
                 clock: Callable[[], float] = time.monotonic, namespace: str = "",
                 key_cache: KeyCache | None = None, machine_cls: type = CompiledMachine,
                 host_blocks: int = 0, prefix_cache: bool = False, layerwise: bool = False,
                 num_states: int = 0, blocks: BlockManager | None = None, arm_reads: bool = False) -> None:
        """``layerwise``: read the cache layer group by group; ``arm_reads``: announce each
        read at reservation (see the rules); the others as
        :class:`~kvstate._lifecycle.Lifecycle`'s (written out, so ``help()`` shows them)."""
        check_layerwise(layerwise, spec)
        if arm_reads.__class__ is not bool:
            raise ConfigError(f"DecodeLifecycle: arm_reads must be True or False, got {arm_reads!r}")
        super().__init__(spec, num_blocks, policy, clock=clock, namespace=namespace, key_cache=key_cache,
                         machine_cls=machine_cls, host_blocks=host_blocks, prefix_cache=prefix_cache,
                         num_states=num_states, blocks=blocks)
        self.layerwise = layerwise
        self.arm_reads = arm_reads and not layerwise and not num_states
        if self.policy.preempt == "swap" and self.host is None:
            raise ConfigError("Policy.preempt='swap' needs a host tier: give DecodeLifecycle host_blocks > 0")
        if self.states and self.host is not None and self.policy.swap_write == "back":
            raise ConfigError("DecodeLifecycle: state groups with Policy.swap_write='back': a write-back from host "
                              "memory has no state to store (kvstate._statepages); use 'host' or 'through'")
        self.counters["host_read_blocks"] = 0  # blocks of P's caches found in the host tier
        self.counters["gpu_read_blocks"] = 0  # ... and found on the GPU (prefix cache): not read
        self._running: set[str] = set()
        self._frees_behind_window = spec.frees_behind_window  # read on every append_tokens
        self._window_tables = self.blocks.window_tables  # the tables it frees from

    # -- engine API --------------------------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` fits while keeping running requests' headroom."""
        if num_tokens.__class__ is not int or num_tokens < 1:
            check_int(num_tokens, "num_tokens", minimum=1)
        if self.states.pool is not None and not self.states.can_take():
            return False  # no state page
        return self.blocks.can_allocate(self.spec.blocks_for(num_tokens + 1), self._headroom())

    def reserve(self, request_id: str, token_ids: Sequence[int],
                extra_keys: Mapping[int, Sequence[str]] | None = None) -> tuple[int, ...]:
        """P asks for blocks: reserve room for the prompt plus the first token. Returns the
        blocks reserved (with group tables, every table's, table by table).

        Raises :class:`OutOfBlocksError` (reserving nothing) when the headroom cannot be kept."""
        self._clock_in()
        req = self._new_request(request_id, token_ids, extra_keys)
        n = -(-(len(req.tokens) + 1) // self.spec.block_size)  # spec.blocks_for, inline (hot path)
        if n * self._per_block > self.pool.num_blocks:
            self.blocks.check_fits(req, n)  # raises
        self.states.check_free(req.id, "reserve")
        if self.prefix_cache is None:
            try:
                self.blocks.allocate(req, n, self._headroom())
            except OutOfBlocksError as e:
                raise OutOfBlocksError(f"request {request_id!r}: cannot reserve {n} blocks ({e})") from None
        elif self.blocks.allocate_cached(req, n, self._cached_lookup(req), self._headroom()):
            self.counters["gpu_read_blocks"] += req.hits
        else:
            raise OutOfBlocksError(f"request {request_id!r}: cannot reserve {n} blocks keeping "
                                   f"{self._headroom()} free: {self.pool.num_free} are free")
        req.stored_keys = req.keys
        self.states.take(req, 1)
        self._reqs[request_id] = req
        self._wait(req, self.policy.first_token_timeout)
        if self.arm_reads and req.hits < len(req.keys) and not req.tables:
            self._out.append(C.ArmRead(request_id, self._ranks, self._now + self.policy.first_token_timeout,
                                       tuple(req.keys[req.hits:]), tuple(req.blocks[req.hits:len(req.keys)])))
        return tuple(held(req))

    def deliver_first_token(self, request_id: str, token: int | None, error_code: int = 200) -> bool:
        """P's first token arrived (``error_code`` 200), or P reports it has no cache (!= 200).

        Returns False for a request that already ended (D's first-token deadline passed, or
        it was aborted): the late token is dropped."""
        if not is_int(error_code) or not 100 <= error_code <= 599:
            raise ValidationError(f"request {request_id!r}: error_code {error_code!r} is not an HTTP status (100..599)")
        if error_code == 200:
            check_token(request_id, token)
        self._clock_in()
        req = self._late(request_id, "first_token")
        if req is None:
            return False
        self._fire(req, "first_token", (token, error_code))
        return True

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Decoded tokens: grow the request, allocating blocks as it crosses block boundaries.

        Returns the blocks newly allocated. Raises :class:`OutOfBlocksError` (appending
        nothing) when the pool is short: preempt a request and try again."""
        req = self._requests.get(request_id)
        if req.state != "running":
            raise InvalidTransitionError(request_id, req.state, "append_tokens", DECODE.name)
        new = check_tokens(request_id, token_ids)
        need = -(-(len(req.tokens) + len(new)) // self.spec.block_size) - len(req.blocks)  # spec.blocks_for, inline
        try:
            added = self.blocks.allocate(req, need if need > 0 else 0)
        except OutOfBlocksError as e:
            raise OutOfBlocksError(f"request {request_id!r}: cannot grow by {need} blocks ({e})") from None
        req.tokens.extend(new)
        req.stored_keys = None  # the store no longer holds the whole cache
        if self._frees_behind_window:
            self._free_behind_window(req)
        return tuple(added)

    def _free_behind_window(self, req: DecodeRequest) -> None:
        """Free the blocks of the window tables (:mod:`kvstate._tables`) wholly behind the window
        of the request's next step: their entries become :data:`~kvstate._pool.FREED`, and the
        request is one whose early blocks hold no window layers (``window_from``)."""
        first = self.spec.window_first_block(len(req.tokens) - 1)
        if not first or table(req, self._window_tables[0])[first - 1] == FREED:
            return  # freed entries lead the tables: nothing new behind
        self._transfers.pin(req)  # a transfer it abandoned may still touch them: pinned until answered
        req.window_from = max(req.window_from, first)
        self.blocks.free_behind_window(req, first)  # D queues no work on free blocks: nothing to wake

    def preempt(self, request_id: str) -> None:
        """Take the request's blocks back: write its cache out first if the policy says so.

        With the GPU prefix cache, a running request's full blocks are published first, so
        its resume finds those still idle on the GPU instead of moving them again."""
        req = self._requests.get(request_id)
        self._clock_in()
        if self.prefix_cache is not None and req.state == "running" and not req.window_from:
            req.keys = self._cache_keys(req)
            self.blocks.publish(req.keys, req.blocks)
        self._fire(req, "preempt")

    def resume(self, request_id: str) -> tuple[int, ...]:
        """Give a preempted request blocks again, then reload its cache or recompute it."""
        req = self._requests.get(request_id)
        if req.state != "preempted" and req.state != "swapped":
            raise InvalidTransitionError(request_id, req.state, "resume", DECODE.name)
        self._clock_in()
        n = self.spec.blocks_for(len(req.tokens))
        if not req.pages:  # a swapped request still holds its page
            self.states.check_free(req.id, "resume")
        if self.prefix_cache is None:
            try:
                self.blocks.allocate(req, n)
            except OutOfBlocksError as e:
                raise OutOfBlocksError(f"request {request_id!r}: cannot resume with {n} blocks ({e})") from None
        elif not self.blocks.allocate_cached(req, n, self._cached_lookup(req)):
            raise OutOfBlocksError(f"request {request_id!r}: cannot resume with {n} blocks: "
                                   f"{self.pool.num_free} are free")
        if not req.pages:
            self.states.take(req, 1)
        self._fire(req, "resume")
        return tuple(held(req))

    def recompute_done(self, request_id: str) -> bool:
        """The engine recomputed the cache a :class:`~kvstate.commands.Recompute` asked for.

        Returns False for a request that already ended (the late result is dropped)."""
        self._clock_in()
        req = self._late(request_id, "recompute_done")
        if req is None:
            return False
        self._fire(req, "recompute_done")
        return True

    def finish(self, request_id: str) -> None:
        """The answer is complete: recycle the request."""
        req = self._requests.get(request_id)
        self._clock_in()
        self._fire(req, "finish")

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

    def _cached_lookup(self, req: DecodeRequest) -> list[str]:
        """The keys D claims from the GPU prefix cache: the full blocks', and none with state
        groups (D keeps no checkpoint state to start from: :mod:`kvstate._statepages`)."""
        return [] if self.states else req.keys[:full_blocks(req.keys)]

    def _read(self, req: DecodeRequest, start: int = 0) -> None:
        """Read the stored cache past ``start`` blocks (already in place); a window group's
        blocks only from its last window on (those before then hold none: ``window_from``)."""
        keys = req.stored_keys
        assert keys is not None
        req.base = start  # blocks already in place (from the host tier)
        cls = C.LoadLayers if self.layerwise else C.ReadBlocks
        first = self.spec.window_first_block(len(req.tokens) - 1)  # the cache: every token but the newest
        req.window_from = first if first > start and first > req.window_from else req.window_from
        end, ahead = len(keys), first - start if first > start else 0  # max(0, first - start), not a call
        self._transfer(req, cls, "read_done", keys[start:], req.blocks[start:end], window_from=ahead,
                       states=self.states.candidates(req, start, end, True), tables=cut(req, start, end))

    # -- actions (named in DECODE) ----------------------------------------------------------------
    def _token_ok(self, req: DecodeRequest, value: tuple[int | None, int]) -> bool:
        return value[1] == 200

    def _send_read(self, req: DecodeRequest, value: tuple[int, int]) -> None:
        req.tokens.append(value[0])
        self._read(req, req.hits)

    def _token_ok_all_cached(self, req: DecodeRequest, value: tuple[int | None, int]) -> bool:
        return value[1] == 200 and req.hits >= len(req.stored_keys or ())

    def _take_token(self, req: DecodeRequest, value: tuple[int, int]) -> None:
        req.tokens.append(value[0])

    def _send_reload(self, req: DecodeRequest, value: Any) -> None:
        self._read(req, req.hits)

    def _note_prefill_error(self, req: DecodeRequest, value: tuple[int | None, int]) -> None:
        req.error_code, req.reason = value[1], prefill_reason(value[1])

    def _note_no_token(self, req: DecodeRequest, value: Any) -> None:
        req.error_code, req.reason = ERROR_NO_FIRST_TOKEN, "first_token_timeout"

    def _read_complete(self, req: DecodeRequest, value: int) -> bool:
        return req.base + value >= len(req.stored_keys or ())

    def _recompute_after_read(self, req: DecodeRequest, value: int) -> None:
        start = self.states.continued(req.base, value, 0)
        if req.window_from:  # blocks before window_from hold no window layers: continue only past a whole window
            start = self.spec.resume_blocks(start, start, req.window_from, len(req.stored_keys or ()))
        self._start_recompute(req, start)

    def _recompute_on_miss(self, req: DecodeRequest, value: int) -> bool:
        return self.policy.read_failure == "recompute"

    def _note_read_failed(self, req: DecodeRequest, value: int) -> None:
        req.error_code, req.reason = ERROR_READ_FAILED, "read_failed"

    def _start_recompute(self, req: DecodeRequest, value: int | None) -> None:
        """Recompute past ``value`` blocks in place (None: past the GPU prefix cache's hits)."""
        req.cmd = 0  # a write-back from host memory still running no longer answers to it
        req.stored_keys = None
        start = req.hits if value is None else value
        if not start:
            req.window_from = 0  # every block is computed again, window layers included
        self._send_settled(req, C.Recompute(req.id, tuple(req.blocks), start * self.spec.block_size,
                                            state_pages=tuple(req.pages), tables=cut(req, 0, len(req.blocks))))

    def _start_decode(self, req: DecodeRequest, value: Any) -> None:
        if self.prefix_cache is not None and not req.window_from:  # its blocks hold its whole cache now
            self.blocks.publish(req.keys, req.blocks)
        self._running.add(req.id)
        self._out.append(C.StartDecode(req.id, tuple(req.blocks), state_pages=tuple(req.pages),
                                       tables=cut(req, 0, len(req.blocks))))

    def _writes_back(self, req: DecodeRequest, value: Any) -> bool:
        p = self.policy
        return p.preempt == "write" or (p.preempt == "swap" and p.swap_fallback == "write")

    def _send_write_back(self, req: DecodeRequest, value: Any) -> None:
        self._running.discard(req.id)
        req.keys = self._cache_keys(req)
        req.retries = 0
        # blocks without their window layers: stored only in their own groups' tables, or not at all
        self._write(req, 0 if self._per_block > 1 else req.window_from)

    def _keep_write_back(self, req: DecodeRequest, value: int) -> None:
        req.stored_keys = req.keys  # the write-back answered in full on every rank

    def _release_blocks(self, req: DecodeRequest, value: Any) -> None:
        self._running.discard(req.id)
        self._release(req)

    def _drop_write_back(self, req: DecodeRequest, value: Any) -> None:
        req.stored_keys = None
        self._running.discard(req.id)
        self._release(req)

    def _has_stored(self, req: DecodeRequest, value: Any) -> bool:
        return req.stored_keys is not None

    def _recycle(self, req: DecodeRequest, value: Any = None) -> None:
        self._running.discard(req.id)
        self._drop_swap(req)
        super()._recycle(req, value)

    # -- the host tier: reads by tier, preemption swapped to host memory and back -----------------
    def host_holdings(self) -> dict[str, tuple[str, ...]]:
        """Request id -> the host tier keys it references (swapping out, swapped, swapping in)."""
        return {rid: tuple(r.host_keys) for rid, r in self._reqs.items() if r.host_keys is not None}

    def _host_servable(self, req: DecodeRequest) -> list[str]:
        """The keys of a handed-off cache that host memory may serve, past the GPU prefix
        cache's hits: with state groups not the last, which the store serves with the state."""
        assert req.stored_keys is not None
        keys = req.stored_keys[req.hits:]
        return keys[:-1] if self.states else keys

    def _token_ok_host_hit(self, req: DecodeRequest, value: tuple[int | None, int]) -> bool:
        return value[1] == 200 and self.host is not None and req.stored_keys is not None \
            and self.host.ready_prefix(self._host_servable(req)) > 0

    def _send_host_load(self, req: DecodeRequest, value: tuple[int, int]) -> None:
        assert self.host is not None and req.stored_keys is not None
        req.tokens.append(value[0])
        start = req.base = req.hits  # past the blocks the GPU prefix cache gave
        keys = req.stored_keys[start:start + self.host.lookup(self._host_servable(req))]
        self._transfer(req, C.SwapIn, "host_loaded", keys, req.blocks[start:start + len(keys)],
                       self.host.slots(keys))

    def _send_rest_read(self, req: DecodeRequest, value: int) -> None:
        self.counters["host_read_blocks"] += value
        self._read(req, req.base + value)

    def _cache_keys(self, req: DecodeRequest) -> list[str]:
        """The keys of a running request's cache: the newest token's is computed by the next
        decode step, so every token before it (what a write-back or swap-out copies)."""
        return keys_of_packed(req.tokens[:-1], self.spec.block_size, req.extra_keys, self.namespace,
                              self.key_cache)

    def _swaps_out(self, req: DecodeRequest, value: Any) -> bool:
        """Into the host tier, whose entries other requests share: only a cache whole in every
        block (``window_from`` 0); one read without early window layers falls back."""
        return self.policy.preempt == "swap" and self.host is not None and not req.window_from and \
            self.host.can_acquire(self._cache_keys(req))

    def _send_swap_out(self, req: DecodeRequest, value: Any) -> None:
        assert self.host is not None
        self._running.discard(req.id)
        keys = req.keys = self._cache_keys(req)
        slots, fresh = self.host.acquire(keys)
        req.host_keys, req.host_fresh = keys, [keys[i] for i in fresh]
        self._transfer(req, C.SwapOut, "swapped_out", req.host_fresh, [req.blocks[i] for i in fresh],
                       [slots[i] for i in fresh])

    def _swap_complete(self, req: DecodeRequest, value: int) -> bool:
        return value >= len(req.host_fresh)

    def _swapped_back(self, req: DecodeRequest, value: int) -> bool:
        return self.policy.swap_write == "back" and self._swap_complete(req, value)

    def _send_flush(self, req: DecodeRequest, value: Any) -> None:
        """Write the cache back to the store from the host slots (awaited while it waits swapped:
        a resume first sends its swap-in, and the flush's answer then changes nothing)."""
        assert self.host is not None and req.host_keys is not None
        keys = req.host_keys
        req.base = 0
        self._transfer(req, C.FlushHost, "flushed", keys, [], self.host.slots(keys))

    def _flush_complete(self, req: DecodeRequest, value: int) -> bool:
        return value >= len(req.keys)  # the keys its swap-out copied

    def _swapped_through(self, req: DecodeRequest, value: int) -> bool:
        return self.policy.swap_write == "through" and self._swap_complete(req, value)

    def _stored_with_host(self, req: DecodeRequest, value: int) -> bool:
        return req.host_keys is not None and self._write_complete(req, value)

    def _host_only_now(self, req: DecodeRequest, value: int) -> bool:
        return req.host_keys is not None and not self._can_retry(req, value)

    def _forget_store(self, req: DecodeRequest, value: Any) -> None:
        req.stored_keys = None  # the write-through failed: only the host tier holds the cache

    def _keep_swap(self, req: DecodeRequest, value: int) -> None:
        assert self.host is not None
        self.host.commit(req.host_fresh)
        req.host_fresh = ()

    def _release_swapped(self, req: DecodeRequest, value: Any = None) -> None:
        """Swapped: the GPU blocks go, the state page stays (host memory holds no state)."""
        self._running.discard(req.id)
        self._release(req, pages=False)

    def _release_pages(self, req: DecodeRequest, value: Any = None) -> None:
        """Its host entries went: so does the state page it kept (a resume reads or recomputes)."""
        if self.states.release(req):
            self._freed = True

    def _park(self, req: DecodeRequest, value: Any) -> None:
        self._wait(req, self.policy.swapped_timeout)  # its host entries are held until resume or then

    def _falls_back_to_write(self, req: DecodeRequest, value: int) -> bool:
        return self.policy.swap_fallback == "write"

    def _drop_swap(self, req: DecodeRequest, value: Any = None) -> None:
        """Let go of the request's host entries and of any stored copy's keys."""
        self._drop_host(req)
        req.stored_keys = None

    def _drop_host(self, req: DecodeRequest, value: Any = None) -> None:
        """Let go of the request's host entries (uncommitted ones go once no copy holds them);
        a copy written through to the store stays known (``stored_keys``)."""
        if req.host_keys is not None:
            assert self.host is not None
            self.host.release(req.host_keys)
            req.host_keys, req.host_fresh = None, ()

    def _send_swap_in(self, req: DecodeRequest, value: Any) -> None:
        """Copy back the ready entries past the blocks the GPU prefix cache still held."""
        assert self.host is not None and req.host_keys is not None
        start = req.base = req.hits
        keys = req.host_keys[start:max(start, self.host.ready_prefix(req.host_keys))]  # unready: recomputed
        self._transfer(req, C.SwapIn, "swapped_in", keys, req.blocks[start:start + len(keys)], self.host.slots(keys))

    def _swap_in_complete(self, req: DecodeRequest, value: int) -> bool:
        return req.host_keys is not None and req.base + value >= len(req.host_keys)

    def _recompute_after_swap_in(self, req: DecodeRequest, value: int) -> None:
        """A partial swap-in: continue past what came in, or, with state groups, from token 0
        (the page holds the whole cache's state, no shorter prefix's)."""
        self._start_recompute(req, 0 if self.states else req.base + value)


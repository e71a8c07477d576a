"""The prefill (P) side of a request's KV-cache life: its machine, then its actions.

Rules:

- A prompt is admitted, then waits (FIFO) for blocks for its whole cache; it waits at most
  ``Policy.queue_timeout``, then fails (504, reason ``queue_timeout``) and its first token
  carries the error, so D ends it at once instead of at its own deadline.
- With blocks, P reads the longest stored prefix of full blocks (leaving at least one token to
  compute), when the policy says so; the read answers how many leading blocks it found, so a
  lookup costs no round trip of its own. Then P prefills from there.
- With a GPU prefix cache (``prefix_cache``), the leading blocks an earlier prompt left on the
  GPU are claimed, shared, when blocks are allocated (``counters['gpu_prefix_blocks']``); the
  lookups below start after them, and their blocks are published once the prefill is done.
- With a host tier (``host_blocks``), the prefix is looked up by tier: the leading blocks ready
  in host memory are copied in first (``loading_prefix``, a ``SwapIn``), and only the rest is
  read from the store; a partial copy prefills from where it stopped. With state groups host
  memory serves blocks before the prefix's last checkpoint only, and the store the rest with
  that checkpoint's state. Blocks found per tier are counted
  (``counters['host_prefix_blocks']``, ``counters['store_prefix_blocks']``).
- Once the cache is stored and the first token sent, P also copies it into its host tier
  (write-through: the store always holds it, for D), keys already there being shared. The
  copy is not awaited: the request ends ``done`` at once, the copy pins its blocks until it
  answers, and its entries become hits only if every rank copied them whole. A full tier
  skips the copy.
- P writes the cache, skipping the leading blocks already stored (a write first asks the store
  which leading keys it holds: keys are content hashes, so a stored key holds these bytes). A
  failed or partial write is retried ``Policy.write_retries`` times from where it stopped.
- Layer-wise (``layerwise=True``): the write (a ``SaveLayers``) goes out as the prefill starts,
  and the engine reports the layers computed (``layers_done``, in order: finished on the
  GPU, or launched, with the device event after them); each report becomes a
  ``LayersReady`` for the save, whose ranks store a layer group once its layers are
  reported (and, given an event, once the device reached it), so only the last group's
  store trails the prefill. ``prefill_done`` reports every
  layer. A save answering before the prefill is done (a full store hit, a failure, its
  deadline, which counts from the prefill's start) waits in ``saved`` for ``prefill_done``;
  it is then judged as a write answering then. Reports after the save answered or the
  request ended change nothing.
- Only a cache stored whole sends the first token (200); P's blocks are then recycled. A write
  that keeps failing sends the first token with 503 and recycles (reason ``write_failed``).
- Direct handoff (``handoff`` ``"direct"`` or ``"both"``, for a D on the same host): once the
  prefill is done P *lends* its blocks (a ``LendBlocks``, ``lending``) and sends the first
  token at once; D's ranks pull the blocks straight from P's GPU
  (:mod:`kvstate.backends._lends`). The lend answers once D pulled them, or at its deadline
  (``lend_timeout``) when nobody took them; either way the request is then ``done``
  (``counters['lends_pulled']`` / ``['lends_unpulled']``) and its blocks recycle (a D still
  copying past the deadline holds them until the fence). With ``"both"`` P also writes the
  cache to the store beside the lend, for later prompts and for a D whose pull failed; that
  write is not awaited (it pins its blocks once the request ends, and a failure costs only
  that reuse). With ``"direct"`` nothing is stored: a D that cannot pull fails or recomputes
  by its own policy. The direct handoff lends whole caches of paged blocks: it is refused
  with a layer-wise save, state pages or per-group block tables.
- With state groups (:mod:`kvstate._statepages`), a prompt waits for state pages with its
  blocks; the GPU prefix cache gives blocks only up to a checkpoint whose state it kept, and
  the prefill starts from that state (``StartPrefill.state_from``); the prefix read takes
  the longest stored prefix ending at a checkpoint whose state every rank read, and the write
  stores the prompt's state and that of the last checkpoint the prefill passed. A prefill
  goes out only once no prefix read the request gave up on can still land in its state page
  (as D's recompute waits: :mod:`kvstate._decode`).
- ``abort`` leaves every live state; blocks a transfer still touches stay pinned until it
  answers or its fence passes. A result that comes after the request ended is dropped.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import commands as C
from . import events as E
from ._blocks import BlockManager
from ._errors import ConfigError, ValidationError
from ._keys import KeyCache
from ._lifecycle import Lifecycle
from ._machine import CompiledMachine, MachineDef
from ._policy import ERROR_TIMEOUT, ERROR_WRITE_FAILED, Policy
from ._registry import PrefillRequest
from ._spec import CacheSpec
from ._tables import cut, per_block
from ._validate import check_int, check_layerwise, check_token

__all__ = ["PREFILL", "PrefillLifecycle", "HANDOFFS"]

_LIVE = ("waiting", "loading_prefix", "reading_prefix", "prefilling", "saved", "writing", "lending")
HANDOFFS = ("store", "direct", "both")  #: ``PrefillLifecycle(handoff=)``

PREFILL = MachineDef(
    name="prefill",
    states=(*_LIVE, "done", "failed", "aborted"),
    initial="waiting",
    terminal=("done", "failed", "aborted"),
    # Conditions are tried in table order; the first transition whose conditions hold fires.
    transitions=(
        # blocks allocated: the longest prefix by tier (host, then store), or straight to prefill
        dict(trigger="start", source="waiting", dest="loading_prefix", conditions="_host_has_prefix",
             after="_send_host_prefix"),
        dict(trigger="start", source="waiting", dest="reading_prefix", conditions="_wants_prefix",
             after="_send_prefix_read"),
        dict(trigger="start", source="waiting", dest="prefilling", after="_start_prefill"),
        dict(trigger="timed_out", source="waiting", dest="failed", after=["_send_queue_timeout", "_recycle"]),
        dict(trigger="host_prefix", source="loading_prefix", dest="reading_prefix", conditions="_store_may_have_more",
             after="_send_rest_read"),
        dict(trigger="host_prefix", source="loading_prefix", dest="prefilling", after="_start_prefill_from_host"),
        dict(trigger="prefix_read", source="reading_prefix", dest="prefilling", after="_start_prefill"),
        # prefill computed: lend the blocks to D on this host (first token at once), or write what is
        # not stored yet (a full hit writes nothing and answers in full)
        dict(trigger="prefill_done", source="prefilling", dest="lending", conditions="_lends", after="_send_lend"),
        dict(trigger="prefill_done", source="prefilling", dest="writing", conditions="_saving", after="_keep_token"),
        dict(trigger="prefill_done", source="prefilling", dest="writing", after="_send_write"),
        # layer-wise: the save answered while the prefill still ran; judged once it is done
        dict(trigger="written", source="prefilling", dest="saved", after="_note_saved"),
        dict(trigger="prefill_done", source="saved", dest="done", conditions="_saved_whole",
             after=["_keep_token", "_send_first_token", "_copy_to_host", "_recycle"]),
        dict(trigger="prefill_done", source="saved", dest="writing", conditions="_can_retry",
             after=["_keep_token", "_retry_saved"]),
        dict(trigger="prefill_done", source="saved", dest="failed",
             after=["_keep_token", "_send_write_error", "_recycle"]),
        dict(trigger="written", source="writing", dest="done", conditions="_write_complete",
             after=["_send_first_token", "_copy_to_host", "_recycle"]),
        dict(trigger="written", source="writing", dest="writing", conditions="_can_retry", after="_retry_write"),
        dict(trigger="written", source="writing", dest="failed", after=["_send_write_error", "_recycle"]),
        dict(trigger="written", source="lending", dest="done", after=["_note_lend", "_copy_to_host", "_recycle"]),
        dict(trigger="abort", source=list(_LIVE), dest="aborted", after="_recycle"),
    ),
)


class PrefillLifecycle(Lifecycle[PrefillRequest]):
    """The P instance's side (see the module's rules)."""

    __slots__ = ("layerwise", "handoff", "lend_timeout", "_waiting")
    DEFINITION = PREFILL
    RECORD = PrefillRequest
    SETTLES_IN = "prefilling"

    def __init__(self, spec: CacheSpec, num_blocks: int, policy: Policy | None = None, *,
                 clock: Callable[[], float] = time.monotonic, namespace: str = "",
                 key_cache: KeyCache | None = None, machine_cls: type = CompiledMachine,
                 host_blocks: int = 0, prefix_cache: bool = False, layerwise: bool = False,
                 num_states: int = 0, blocks: BlockManager | None = None, handoff: str = "store",
                 lend_timeout: float = 5.0) -> None:
        """``layerwise``: save the cache layer by layer while the prefill runs; ``handoff``
        (one of :data:`HANDOFFS`) and ``lend_timeout`` (seconds a lend waits for D to pull):
        how the cache reaches D (see the rules); the others as
        :class:`~kvstate._lifecycle.Lifecycle`'s (written out, so ``help()`` shows them)."""
        check_layerwise(layerwise, spec)
        _check_handoff(handoff, lend_timeout, layerwise, spec, num_states)
        super().__init__(spec, num_blocks, policy, clock=clock, namespace=namespace, key_cache=key_cache,
                         machine_cls=machine_cls, host_blocks=host_blocks, prefix_cache=prefix_cache,
                         num_states=num_states, blocks=blocks)
        self.layerwise = layerwise
        self.handoff, self.lend_timeout = handoff, float(lend_timeout)
        self.counters.update(gpu_prefix_blocks=0, host_prefix_blocks=0, store_prefix_blocks=0, lends_pulled=0,
                             lends_unpulled=0)
        self._waiting: deque[PrefillRequest] = deque()

    # -- engine API --------------------------------------------------------------------------
    def admit(self, request_id: str, token_ids: Sequence[int],
              extra_keys: Mapping[int, Sequence[str]] | None = None) -> str:
        """Admit a prompt; blocks are allocated now or, FIFO, as soon as enough are free.

        Returns the request's state (``"waiting"`` when it queues for blocks)."""
        self._clock_in()
        req = self._new_request(request_id, token_ids, extra_keys)
        self.blocks.check_fits(req, len(req.keys))
        self.states.check_fits(req)
        self._reqs[request_id] = req
        self._waiting.append(req)
        self._start_waiting()
        if req.state == PREFILL.initial:  # queued for blocks: until Policy.queue_timeout at most
            self._wait(req, self.policy.queue_timeout)
        return req.state

    @property
    def num_waiting(self) -> int:
        """Admitted requests still queued for blocks."""
        return len(self._waiting)

    def layers_done(self, request_id: str, layers: int, event: Any = None) -> bool:
        """The first ``layers`` layers of the request's prefill are computed: a layer-wise save
        may store them. Report layers in order, each once: either after the GPU finished
        them (``event`` None), or as soon as they are launched, with ``event``, a device
        event (PyTorch or CuPy) recorded after them on the stream computing them. The save's
        copies then wait for it on the device, so the engine never waits for its GPU. With
        state groups, report the last layer only once the state pages hold the request's
        states (the save stores them then; ``prefill_done`` reports it too).
        Returns False for a request that already ended (the report is dropped)."""
        check_int(layers, f"request {request_id!r}: layers_done", minimum=1)
        if isinstance(event, (bool, int, float, str, bytes)):
            raise ValidationError(f"request {request_id!r}: layers_done's event must be a device event "
                                  f"(PyTorch or CuPy) or None, got {event!r}")
        if layers > self.spec.layers:
            raise ValidationError(f"request {request_id!r}: layers_done({layers}), but the cache has "
                                  f"{self.spec.layers} layers")
        if not self.layerwise:
            raise ValidationError(f"request {request_id!r}: layers_done needs PrefillLifecycle(layerwise=True)")
        req = self._late(request_id, "layers_done")
        if req is None:
            return False
        if req.state not in ("prefilling", "saved"):
            raise ValidationError(f"request {request_id!r} is {req.state}: layers are reported only while it prefills")
        if layers <= req.layers:
            raise ValidationError(f"request {request_id!r}: layers_done({layers}) after {req.layers}: "
                                  f"report layers in order, each once")
        req.layers = layers
        if req.cmd:  # the save still runs: its ranks may store these layers
            self._out.append(C.LayersReady(req.id, req.cmd, self.spec.paged_layers_done(layers), event))
        return True

    def prefill_done(self, request_id: str, first_token: int) -> bool:
        """The prompt's cache is computed and ``first_token`` sampled: store it, then send.

        Returns False for a request that already ended (aborted while it computed): the
        late result is dropped."""
        check_token(request_id, first_token)
        self._clock_in()
        req = self._late(request_id, "prefill_done")
        if req is None:
            return False
        self._fire(req, "prefill_done", first_token)
        return True

    _HANDLERS = {**Lifecycle._HANDLERS,
                 E.Admit: lambda s, e: s.admit(e.request_id, e.token_ids, e.extra_keys),
                 E.LayersDone: lambda s, e: s.layers_done(e.request_id, e.layers, e.event),
                 E.PrefillDone: lambda s, e: s.prefill_done(e.request_id, e.first_token)}

    # -- waiting for blocks ----------------------------------------------------------------------
    def _start_waiting(self) -> None:
        waiting = self._waiting
        while waiting:
            req = waiting[0]
            if req.state != PREFILL.initial:  # it ended while it waited
                waiting.popleft()
                continue
            if not self._allocate(req):
                return
            waiting.popleft()
            self._fire(req, "start")

    def _allocate(self, req: PrefillRequest) -> bool:
        """Give ``req`` its state pages and blocks, the leading ones claimed from the GPU prefix
        cache (with state groups, up to a checkpoint whose state it cached); False, holding
        nothing, when too few are free."""
        n, lookup = len(req.keys), req.keys[:self._prefix_limit(req)]
        if self.states.pool is not None and self.prefix_cache is not None:
            lookup = lookup[:self.states.claim_start(req, lookup, self.prefix_cache)]
        if self.states.pool is not None and not self.states.take(req, self.states.pages_for(req)):
            got = False
        elif self.prefix_cache is None:
            got = self.blocks.can_allocate(n, 0, req.id)
            if got:
                self.blocks.allocate(req, n)
        else:
            got = self.blocks.allocate_cached(req, n, lookup)
            self.counters["gpu_prefix_blocks"] += req.hits if got else 0
        if not got:
            self.states.release(req)  # its pages, and the cached page it claimed
        return got

    def _blocks_freed(self) -> None:
        if self._waiting:
            self._start_waiting()

    def _prefix_limit(self, req: PrefillRequest) -> int:
        # Reuse full blocks only, and leave at least one token to compute the first token from.
        return (len(req.tokens) - 1) // self.spec.block_size

    # -- actions (named in PREFILL) ---------------------------------------------------------------
    def _wants_prefix(self, req: PrefillRequest, value: Any) -> bool:  # with state groups, only past a checkpoint
        return self.policy.read_prefix and self._prefix_limit(req) > req.hits and \
            (self.states.pool is None or self._prefix_limit(req) >= self.states.step)

    def _send_prefix_read(self, req: PrefillRequest, value: Any) -> None:
        n = self._prefix_limit(req)
        start = req.base = req.hits  # past the blocks the GPU prefix cache gave
        self._transfer(req, C.ReadBlocks, "prefix_read", req.keys[start:n], req.blocks[start:n],
                       states=self.states.candidates(req, start, n, whole=False), tables=cut(req, start, n))

    def _start_prefill(self, req: PrefillRequest, value: int | None) -> None:
        """Prefill after a store read of ``value`` blocks past ``req.base`` (``None``: no
        lookup, past the GPU prefix cache's hits only)."""
        if value:
            self.counters["store_prefix_blocks"] += value
        self._prefill_from(req, req.hits if value is None else self.states.continued(req.base, value, req.hits))

    def _prefill_from(self, req: PrefillRequest, blocks: int) -> None:
        bs = self.spec.block_size
        if len(req.pages) > 1:  # state groups: the prefill keeps the states of checkpoints it passes
            req.snaps = tuple(s for s in self.states.snapshots(req) if s > blocks)
        start = req.from_page if blocks and blocks == req.hits else -1  # the cached state it claimed
        cmd = C.StartPrefill(req.id, tuple(req.blocks), blocks * bs, state_pages=tuple(req.pages),
                             checkpoints=tuple(s * bs for s in req.snaps) if req.snaps else (), state_from=start,
                             tables=cut(req, 0, len(req.blocks)))
        if req.pages:  # a read it gave up on would overwrite the running state: wait until none can land
            self._send_settled(req, cmd)
        else:  # blocks are keyed by content: a late read brings the bytes the prefill computes
            self._out.append(cmd)
        if self.layerwise:  # the save goes out now; its ranks wait for LayersReady
            self._write(req, 0, C.SaveLayers)

    # -- the host tier: prefix lookup before the store, write-through after it ----------------
    def _host_limit(self, req: PrefillRequest) -> int:
        """Where the host lookup stops: the prefix's limit, or with state groups the block
        before its last checkpoint (host memory holds no state: the store serves the rest
        with the checkpoint's)."""
        n = self._prefix_limit(req)
        return max(req.hits, n - n % self.states.step - 1) if self.states else n

    def _host_has_prefix(self, req: PrefillRequest, value: Any) -> bool:
        return self.host is not None and self._wants_prefix(req, value) and \
            self.host.ready_prefix(req.keys[req.hits:self._host_limit(req)]) > 0

    def _send_host_prefix(self, req: PrefillRequest, value: Any) -> None:
        assert self.host is not None
        start = req.hits  # past the blocks the GPU prefix cache gave
        n = self.host.lookup(req.keys[start:self._host_limit(req)])
        keys = req.keys[start:start + n]
        req.base = start + n  # where the store's part starts once every host hit came in
        self._transfer(req, C.SwapIn, "host_prefix", keys, req.blocks[start:start + n], self.host.slots(keys))

    def _store_may_have_more(self, req: PrefillRequest, value: int) -> bool:
        return req.hits + value >= req.base and req.base < self._prefix_limit(req)  # every host hit came in

    def _send_rest_read(self, req: PrefillRequest, value: int) -> None:
        self.counters["host_prefix_blocks"] += value
        n = self._prefix_limit(req)
        start = req.base = req.hits + value
        self._transfer(req, C.ReadBlocks, "prefix_read", req.keys[start:n], req.blocks[start:n],
                       states=self.states.candidates(req, start, n, whole=False), tables=cut(req, start, n))

    def _start_prefill_from_host(self, req: PrefillRequest, value: int) -> None:
        """Some host hits did not come in: prefill past those that did (with state groups, past
        the GPU prefix cache's hits: no state is at the host copy's end)."""
        self.counters["host_prefix_blocks"] += value
        self._prefill_from(req, req.hits if self.states else req.hits + value)

    def _copy_to_host(self, req: PrefillRequest, value: Any) -> None:
        host = self.host
        if host is None or not host.can_acquire(req.keys):
            return  # no tier, or a full one: the store holds the cache anyway
        slots, fresh = host.acquire(req.keys)
        keys = [req.keys[i] for i in fresh]
        if keys:  # not awaited (req.cmd stays): the copy pins its blocks once the request ends
            self._transfer(req, C.SwapOut, "", keys, [req.blocks[i] for i in fresh], [slots[i] for i in fresh],
                           awaited=False)  # its entries are committed when every rank copied them whole
        host.release(req.keys)  # the copy holds its own references until it retires

    # -- the direct handoff -----------------------------------------------------------------------
    def _lends(self, req: PrefillRequest, value: Any) -> bool:
        return self.handoff != "store"

    def _send_lend(self, req: PrefillRequest, value: int) -> None:
        """Lend every block to D (and, ``both``, write them beside the lend, not awaited: the
        write pins its blocks once the request lets go), then send the first token."""
        self._keep_token(req, value)
        keys, blocks = req.keys, req.blocks[:len(req.keys)]
        both = self.handoff == "both"
        if both:
            self._transfer(req, C.WriteBlocks, "", keys, blocks, awaited=False)
        self._transfer(req, C.LendBlocks, "written", keys, blocks, timeout=self.lend_timeout, stores=both)
        self._send_first_token(req, value)

    def _note_lend(self, req: PrefillRequest, value: int) -> None:
        self.counters["lends_pulled" if value >= len(req.keys) else "lends_unpulled"] += 1

    def _send_write(self, req: PrefillRequest, value: int) -> None:
        self._keep_token(req, value)
        self._write(req, 0)

    def _keep_token(self, req: PrefillRequest, value: int) -> None:
        """The prefill is done: keep its first token; the blocks hold the prompt's cache."""
        req.token = value
        if self.prefix_cache is not None:
            self.blocks.publish(req.keys, req.blocks)
            self.states.publish(req)
        if req.cmd and req.layers < self.spec.layers:  # the layer-wise save may store every layer
            req.layers = self.spec.layers
            self._out.append(C.LayersReady(req.id, req.cmd, self.spec.paged_layers_done(req.layers)))

    # -- layer-wise save -------------------------------------------------------------------------
    def _saving(self, req: PrefillRequest, value: Any) -> bool:
        return req.cmd != 0  # in prefilling, only a layer-wise save is awaited

    def _note_saved(self, req: PrefillRequest, value: int) -> None:
        req.saved = value

    def _saved_whole(self, req: PrefillRequest, value: Any) -> bool:
        return self._write_complete(req, req.saved)

    def _retry_saved(self, req: PrefillRequest, value: Any) -> None:
        self._retry_write(req, req.saved)

    def _send_first_token(self, req: PrefillRequest, value: Any) -> None:
        self._out.append(C.SendFirstToken(req.id, req.token, 200))

    def _send_write_error(self, req: PrefillRequest, value: Any) -> None:
        req.error_code, req.reason = ERROR_WRITE_FAILED, "write_failed"
        self._out.append(C.SendFirstToken(req.id, None, ERROR_WRITE_FAILED))

    def _send_queue_timeout(self, req: PrefillRequest, value: Any) -> None:
        req.error_code, req.reason = ERROR_TIMEOUT, "queue_timeout"
        self._out.append(C.SendFirstToken(req.id, None, ERROR_TIMEOUT))


def _check_handoff(handoff: Any, lend_timeout: Any, layerwise: bool, spec: CacheSpec, num_states: int) -> None:
    """The direct handoff's settings: a mode, a finite timeout; it lends whole caches of
    paged blocks, so not with a layer-wise save, state layers or per-group block tables."""
    if handoff not in HANDOFFS:
        raise ConfigError(f"PrefillLifecycle: handoff must be one of {HANDOFFS}, got {handoff!r}")
    if isinstance(lend_timeout, bool) or not isinstance(lend_timeout, (int, float)) or \
            not 0 < lend_timeout < math.inf:
        raise ConfigError(f"PrefillLifecycle: lend_timeout must be a finite number of seconds > 0, "
                          f"got {lend_timeout!r}")
    if handoff != "store" and (layerwise or num_states or per_block(spec) != 1):
        raise ConfigError(f"PrefillLifecycle: handoff={handoff!r} lends a whole cache of paged blocks: not with "
                          "layerwise=True, state pages or per-group block tables")

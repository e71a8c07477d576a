"""The scheduler's side of an engine connector: kvstate's P and D lifecycles over the blocks
the engine allocated, advanced one engine step at a time. No engine is imported here.

An engine that owns its blocks (vLLM) tells :class:`Handoff` what its scheduler decided:
a prompt whose cache a consumer may load (:meth:`Handoff.lookup`, then :meth:`Handoff.load`
with the blocks it allocated), a request a producer finished (:meth:`Handoff.save`), a
request that ended (:meth:`Handoff.finished`). Once a step, :meth:`Handoff.step` gives the
:class:`Orders` every rank's worker carries out, and :meth:`Handoff.completed` takes their
answers back.

Rules:

- A request's *cache* is its prompt but the last token: a consumer recomputes that token to
  sample its first one (vLLM does so after a full load), so both sides key the same blocks
  (:func:`~kvstate._keys.block_keys` under the model's ``namespace``).
- Save (producer): once the engine finished a request's prompt it lends its blocks; the P
  lifecycle writes every block not yet stored (a full hit writes nothing), retries per the
  policy, and ends at the write's deadline. The engine keeps the blocks until
  ``Orders.sent`` names the request: the save ended and no transfer can touch them (a
  transfer given up on pins its blocks until its fence passes).
- Load (consumer): a prompt loads only when every block of its cache is stored on every
  rank (:meth:`Handoff.lookup`, against the verified manifests). The D lifecycle reads the
  blocks into those the engine allocated, by the read's deadline. ``Orders.received`` names
  the request once the read was judged and no transfer touches its blocks; with it,
  ``Orders.invalid`` lists the blocks from the first one some rank could not read whole
  (checksum, eviction, failure, deadline): the engine recomputes from there, or fails the
  request, by its own policy. Nothing is computed from a block that was not verified.
- Layer-wise (``layerwise``): a prompt the engine computes whole in its next forward may start
  its save before it (:meth:`Handoff.start_save`): the save goes out with that step's orders
  and each rank stores a layer group once its forward reports the group's layers; ``save``
  then gives the first token. Nothing is stored before the forward reported its layers.
- Layer-wise loads (``layerwise_loads``): the engine runs a loading request's first forward
  as the load goes out, waiting before each layer for its group (a
  :class:`~kvstate.commands.LoadLayers`), and its workers report the blocks that did not
  arrive whole themselves, after that forward and once no load touches them, so the engine
  drops that step's tokens and recomputes from the first of them. ``Orders.received`` and
  ``Orders.invalid`` then never name a request the engine still runs: only one it ended
  while the load was in flight, whose blocks it keeps until then.
- Every request the engine ends is ended here (:meth:`Handoff.finished`): aborted in any
  state, its blocks held by the engine until the orders release them.
- Every request is named once in ``sent`` or ``received``, and only if the engine holds its
  blocks for this connector.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import commands as C
from .._blocks import EngineBlocks
from .._decode import DecodeLifecycle
from .._errors import ConfigError, ValidationError
from .._keys import block_keys
from .._policy import Policy
from .._prefill import PrefillLifecycle
from .._spec import CacheSpec, paired
from .._validate import check_request_id, check_token, check_tokens, is_int
from ..backends._base import Store
from ..events import Completion

__all__ = ["Handoff", "Orders", "StoredEvent", "ROLES", "SIDES", "peer_spec"]

ROLES = ("producer", "consumer", "both")
SIDES = ("save", "load")  #: the P lifecycle's transfers, the D lifecycle's


def _prompt(request_id: str, prompt: Any) -> list[int]:
    """The prompt's token ids, checked (a list of ints in 0..2**32-1)."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise ValidationError(f"request {request_id!r}: the prompt must be a sequence of token ids, got {prompt!r:.80}")
    return list(check_tokens(request_id, list(prompt))) if prompt else []


def _block_ids(request_id: str, block_ids: Any) -> list[int]:
    """The engine's block ids, checked as ints (their range and uniqueness are the blocks')."""
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence) or \
            not all(is_int(b) for b in block_ids):
        raise ValidationError(f"request {request_id!r}: block ids must be a sequence of ints, got {block_ids!r:.80}")
    return [int(b) for b in block_ids]


def peer_spec(spec: CacheSpec, role: str, peer_tp: int) -> CacheSpec:
    """This engine's rank spec when the other role runs at TP ``peer_tp`` (0: this engine's):
    objects of the largest head group both degrees split into (:func:`~kvstate._spec.paired`),
    so P's ranks store and D's ranks read the same objects. A ``both`` engine is P and D at
    once: its peer is itself."""
    if isinstance(peer_tp, bool) or not isinstance(peer_tp, int) or not 0 <= peer_tp <= 1024:
        raise ConfigError(f"peer_tp must be an int in 0..1024 (0: this engine's TP degree), got {peer_tp!r}")
    if not peer_tp or peer_tp == spec.tp_size:
        return spec
    if role not in ("producer", "consumer"):
        raise ConfigError(f"peer_tp {peer_tp}: a {role!r} engine saves and loads its own caches, at its own TP "
                          f"degree {spec.tp_size}")
    heads = spec.heads_total
    peer = dataclasses.replace(spec, tp_size=peer_tp, kv_heads=max(1, heads // peer_tp), store_heads=0)
    try:
        p, d = paired(spec, peer) if role == "producer" else paired(peer, spec)
    except ValidationError as e:
        raise ConfigError(f"peer_tp {peer_tp}: this engine's TP {spec.tp_size} and its peer's cannot share "
                          f"objects: {e}") from None
    return p if role == "producer" else d


@dataclass
class Orders:
    """What every rank's worker carries out in one engine step."""

    #: transfers by side (``save``: the P lifecycle's, ``load``: the D lifecycle's; each numbers
    #: its commands on its own): each rank runs its share
    commands: dict[str, list[C.Command]] = field(default_factory=lambda: {"save": [], "load": []})
    sent: set[str] = field(default_factory=set)  #: saves ended: the engine may free their blocks
    received: set[str] = field(default_factory=set)  #: loads judged: the engine may schedule them
    invalid: set[int] = field(default_factory=set)  #: engine blocks a load left unverified


@dataclass(frozen=True)
class StoredEvent:
    """The pool gained (``stored``) or lost (not) a request's blocks: their keys, in order."""

    request_id: str
    keys: tuple[str, ...]
    token_ids: tuple[int, ...]
    stored: bool


@dataclass
class _Tracked:
    side: str  # "save" or "load"
    block_ids: list[int]  # the engine's blocks the lifecycle holds, in order
    tokens: tuple[int, ...]
    held: bool = True  # the engine holds the blocks until the orders name the request
    invalid_from: int | None = None  # a load: the first block not read whole on every rank
    computing: bool = False  # a layer-wise save started before its forward: save() gives its first token
    engine_ended: bool = False  # the engine ended the request and keeps its blocks until the orders name it


class Handoff:
    """kvstate's P and D lifecycles over an engine's blocks (see the module's rules).

    ``lookup_store`` is a client of the pool the scheduler asks which caches are stored
    (closed by :meth:`close`); ``num_blocks`` the engine's blocks; ``policy`` the deadlines
    and retries (a load that stops short always reports the blocks it verified);
    ``layerwise`` saves and ``layerwise_loads`` loads go layer group by layer group."""

    def __init__(self, spec: CacheSpec, num_blocks: int, role: str, lookup_store: Store, *,
                 policy: Policy | None = None, namespace: str = "", clock: Callable[[], float] = time.monotonic,
                 layerwise: bool = False, layerwise_loads: bool = False) -> None:
        if role not in ROLES:
            raise ValidationError(f"Handoff: role must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(lookup_store, Store):
            raise ValidationError("Handoff: lookup_store must be a kvstate Store")
        policy = policy or Policy()
        self.spec, self.role, self.namespace = spec, role, namespace
        self.store = lookup_store
        self.prefill = PrefillLifecycle(spec, num_blocks, dataclasses.replace(policy, read_prefix=False),
                                        clock=clock, namespace=namespace, blocks=EngineBlocks(spec, num_blocks),
                                        layerwise=layerwise)
        self.decode = DecodeLifecycle(spec, num_blocks, dataclasses.replace(policy, read_failure="recompute"),
                                      clock=clock, namespace=namespace, blocks=EngineBlocks(spec, num_blocks),
                                      layerwise=layerwise_loads)
        from ..backends._reference import ReferenceBackend  # a cacheless view: it only asks the store

        self._view = ReferenceBackend(spec, 1, lookup_store)
        self._tracked: dict[str, _Tracked] = {}
        self._ending: set[str] = set()  # ended here; released once no transfer pins their blocks
        self._orders = Orders()
        self._events: list[StoredEvent] = []
        self.counters = dict.fromkeys(("lookups", "hits", "saves", "layerwise_saves", "loads", "saved",
                                       "save_failed", "loaded", "load_partial", "load_failed", "aborted"), 0)

    # -- what the engine's scheduler decided ---------------------------------------------------
    def cache_keys(self, prompt: Sequence[int]) -> list[str]:
        """The keys of a prompt's cache (every token but the last)."""
        return block_keys(list(prompt[:-1]), self.spec.block_size, namespace=self.namespace)

    def lookup(self, request_id: str, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens a load brings: all of them when every block of its
        cache is stored on every rank, else 0 (the engine computes them)."""
        check_request_id(request_id)
        prompt = _prompt(request_id, prompt)
        if self.role == "producer" or len(prompt) < 2:
            return 0
        keys = self.cache_keys(prompt)
        self.counters["lookups"] += 1
        if min(self._view.query(r, keys) for r in range(self.spec.tp_size)) < len(keys):
            return 0
        self.counters["hits"] += 1
        return len(prompt)

    def load(self, request_id: str, prompt: Sequence[int], block_ids: Sequence[int], computed: int = 0) -> None:
        """Load the prompt's cache (a :meth:`lookup` hit) into the engine's ``block_ids``;
        its first ``computed`` tokens (whole blocks: the engine's own prefix cache had them)
        are in place already, and only the blocks past them are read."""
        self._check_new(request_id, "load")
        prompt = _prompt(request_id, prompt)
        n = self.spec.blocks_for(len(prompt))
        block_ids = _block_ids(request_id, block_ids)
        if len(block_ids) < n:
            raise ValidationError(f"request {request_id!r}: a load of {len(prompt)} tokens needs {n} blocks, "
                                  f"the engine allocated {len(block_ids)}")
        bs = self.spec.block_size
        if isinstance(computed, bool) or not isinstance(computed, int) or computed < 0 or computed % bs \
                or computed >= len(prompt) - 1:
            raise ValidationError(f"request {request_id!r}: computed {computed!r} is not whole blocks of "
                                  f"{bs} tokens short of the prompt's cache")
        ids = [int(b) for b in block_ids[:n]]
        self.decode.blocks.lend(request_id, ids, computed // bs)  # type: ignore[attr-defined]
        try:
            self.decode.reserve(request_id, list(prompt[:-1]))
        except Exception:
            self.decode.blocks.take_back(request_id)  # type: ignore[attr-defined]
            raise
        self._tracked[request_id] = _Tracked("load", ids, tuple(prompt))
        self.counters["loads"] += 1
        self.decode.deliver_first_token(request_id, int(prompt[-1]))

    def start_save(self, request_id: str, prompt: Sequence[int], block_ids: Sequence[int]) -> bool:
        """Layer-wise (``layerwise``): the engine computes the whole prompt in its next forward,
        into ``block_ids``. Its save goes out with this step's orders and stores each layer
        group once the forward reports it (a ``LayersReady`` each rank gives its save driver),
        so only the last group trails the prefill; :meth:`save` then gives the first token.
        True: the engine keeps the blocks until ``Orders.sent`` names it."""
        if not self.prefill.layerwise:
            raise ValidationError("Handoff.start_save needs Handoff(layerwise=True)")
        started = self._admit(request_id, prompt, block_ids, None)
        self.counters["layerwise_saves"] += started
        return started

    def save(self, request_id: str, prompt: Sequence[int], block_ids: Sequence[int], first_token: int) -> bool:
        """The engine computed the prompt and sampled ``first_token``: store its cache from
        ``block_ids`` (or, a save :meth:`start_save` began, let it finish). True: the engine
        keeps the blocks until ``Orders.sent`` names it."""
        check_token(str(request_id), first_token)
        return self._admit(request_id, prompt, block_ids, first_token)

    def _admit(self, request_id: str, prompt: Sequence[int], block_ids: Sequence[int], first_token: int | None) -> bool:
        """P takes the prompt's cache over ``block_ids``: from its start (``first_token``
        None: layer-wise, before the forward), or computed already (the first token given)."""
        check_request_id(request_id)
        prompt = _prompt(request_id, prompt)
        if first_token is not None:
            check_token(request_id, first_token)  # before anything changes: prefill_done takes it last
        t = self._tracked.get(request_id)
        if t is not None and t.computing and first_token is not None:  # the layer-wise save's forward ended
            if tuple(prompt) != t.tokens:
                raise ValidationError(f"request {request_id!r}: save() names another prompt than start_save()")
            t.computing = False
            if self.prefill.is_live(request_id):
                self.prefill.prefill_done(request_id, first_token)
            return t.held
        if self.role == "consumer" or len(prompt) < 2:
            return False
        self._check_new(request_id, "save")
        n = self.spec.blocks_for(len(prompt) - 1)
        block_ids = _block_ids(request_id, block_ids)
        if len(block_ids) < n:
            raise ValidationError(f"request {request_id!r}: a save of {len(prompt) - 1} tokens needs {n} blocks, "
                                  f"the engine holds {len(block_ids)}")
        ids = [int(b) for b in block_ids[:n]]
        self.prefill.blocks.lend(request_id, ids)  # type: ignore[attr-defined]
        try:
            self.prefill.admit(request_id, list(prompt[:-1]))
        except Exception:
            self.prefill.blocks.take_back(request_id)  # type: ignore[attr-defined]
            raise
        self._tracked[request_id] = _Tracked("save", ids, tuple(prompt), computing=first_token is None)
        self.counters["saves"] += 1
        self._notices(self.prefill.poll_commands(), "save")  # StartPrefill (and a layer-wise save's SaveLayers)
        if first_token is not None:
            self.prefill.prefill_done(request_id, first_token)
        return True

    def finished(self, request_id: str) -> bool:
        """The engine ended the request. True: it must keep the blocks until the orders
        release them (a save or a load still in flight)."""
        check_request_id(request_id)
        t = self._tracked.get(request_id)
        if t is None:
            return False
        lc = self.prefill if t.side == "save" else self.decode
        if lc.is_live(request_id):
            if t.side == "load" and lc.state_of(request_id) == "running":
                self.decode.finish(request_id)
                t.held = False
            else:
                lc.abort(request_id)
                self.counters["aborted"] += 1
        if request_id not in self._ending and t.held:
            self._ending.add(request_id)
            t.engine_ended = True
        elif not t.held:
            del self._tracked[request_id]
        return t.held

    def _check_new(self, request_id: str, what: str) -> None:
        check_request_id(request_id)
        if request_id in self._tracked:
            raise ValidationError(f"request {request_id!r}: already tracked; cannot {what} it again")

    # -- one engine step ------------------------------------------------------------------------
    def completed(self, side: str, completions: Iterable[Completion]) -> None:
        """The workers' answers to one side's commands (each checked by its lifecycle; one
        nobody waits for is dropped and counted there)."""
        lc = self._side(side)
        if isinstance(completions, (str, bytes)) or not isinstance(completions, Iterable):
            raise ValidationError(f"Handoff.completed: expected Completions, got {completions!r:.80}")
        answers = list(completions)
        for c in answers:  # every one checked before any is applied
            if not isinstance(c, Completion):
                raise ValidationError(f"Handoff.completed: expected Completions, got {type(c).__name__}")
        for c in answers:
            lc.complete(c)
        self._notices(lc.poll_commands(), side)  # what the answers decided, for the next orders

    def _side(self, side: str) -> Any:
        if side not in SIDES:
            raise ValidationError(f"Handoff: side must be one of {list(SIDES)}, got {side!r}")
        return self.prefill if side == "save" else self.decode

    def step(self) -> Orders:
        """Advance time, then collect this step's orders."""
        for side in SIDES:
            lc = self._side(side)
            lc.tick()
            self._notices(lc.poll_commands(), side)
        self._release_unpinned()
        out, self._orders = self._orders, Orders()
        return out

    def _notices(self, cmds: list[C.Command], side: str) -> None:
        for cmd in cmds:
            kind = C.kind_of(cmd)
            if kind in C.TRANSFER_KINDS or kind in ("cancel", "layers"):
                self._orders.commands[side].append(cmd)
            elif isinstance(cmd, C.SendFirstToken):
                self._saved(cmd)
            elif isinstance(cmd, C.StartDecode):
                self._loaded(cmd.request_id, None)
            elif isinstance(cmd, C.Recompute):
                self._loaded(cmd.request_id, cmd.from_token // self.spec.block_size)
                self.decode.recompute_done(cmd.request_id)  # the engine recomputes from there
            elif isinstance(cmd, C.RequestEnded):
                self._ended(cmd)

    def _saved(self, cmd: C.SendFirstToken) -> None:
        t = self._tracked.get(cmd.request_id)
        if t is None:
            return
        if cmd.error_code == 200:
            self.counters["saved"] += 1
            keys = self.cache_keys(t.tokens)
            self._events.append(StoredEvent(cmd.request_id, tuple(keys), t.tokens[:-1], True))
        else:
            self.counters["save_failed"] += 1

    def _loaded(self, request_id: str, invalid_from: int | None) -> None:
        """A load was judged: whole (``invalid_from`` None) or valid up to a block."""
        t = self._tracked.get(request_id)
        if t is None or t.side != "load" or not t.held:
            return  # judged already (a recompute's StartDecode follows its Recompute)
        layerwise = self.decode.layerwise  # then the engine runs the request: its workers judged the load
        if not layerwise:
            self._orders.received.add(request_id)
        t.held = False  # the engine owns the outcome from here
        if invalid_from is None:
            self.counters["loaded"] += 1
            return
        self.counters["load_partial"] += 1
        t.invalid_from = invalid_from
        if not layerwise:
            self._orders.invalid.update(t.block_ids[invalid_from:])
        keys = self.cache_keys(t.tokens)[invalid_from:]
        self._events.append(StoredEvent(request_id, tuple(keys), (), False))

    def _ended(self, cmd: C.RequestEnded) -> None:
        t = self._tracked.get(cmd.request_id)
        if t is None:
            return
        if t.side == "load" and t.held and cmd.state == "failed":
            self.counters["load_failed"] += 1
            t.invalid_from = 0
        if t.held and (t.side == "save" or not self.decode.layerwise or t.engine_ended):
            self._ending.add(cmd.request_id)
        else:  # a layer-wise load the engine still runs: its workers reported its blocks
            self._tracked.pop(cmd.request_id, None)

    def _release_unpinned(self) -> None:
        """Name in the orders every ended request no transfer pins any more."""
        if not self._ending:
            return
        pinned = {cmd.request_id for lc in (self.prefill, self.decode)
                  for cmd, _, pins, _ in lc.transfers() if pins}
        for rid in [r for r in self._ending if r not in pinned
                    and not self.prefill.is_live(r) and not self.decode.is_live(r)]:
            self._ending.discard(rid)
            t = self._tracked.pop(rid)
            if t.side == "save":
                self._orders.sent.add(rid)
            else:
                self._orders.received.add(rid)
                if not self.decode.layerwise:
                    self._orders.invalid.update(t.block_ids[t.invalid_from or 0:])

    def take_events(self) -> list[StoredEvent]:
        """The pool's changes seen since the last call."""
        out, self._events = self._events, []
        return out

    def tracks(self, request_id: str) -> bool:
        """Whether a save or load of the request is still this side's."""
        return request_id in self._tracked

    def computing(self, request_id: str) -> bool:
        """Whether the request's layer-wise save waits for its first token (:meth:`start_save`)."""
        t = self._tracked.get(request_id)
        return t is not None and t.computing

    def live(self) -> int:
        """Requests this side still tracks."""
        return len(self._tracked)

    def close(self) -> None:
        self._view.close()
        self.store.close()

"""A minimal PD serving loop on PyTorch through kvstate's public API.

P admits a prompt, reads any stored prefix, prefills the rest in block-sized chunks and writes
the cache through ``CudaBackend`` to a store, then sends the first token; D reserves blocks,
reads the cache back and decodes greedily, one request per step. Preemption writes D's cache
back and reloads it; a failed read recomputes (policy ``recompute``) or ends the request
(policy ``fail``); an abort ends both sides.

Why chunks of one block and decode steps of one request: a chunk's arithmetic then depends only
on its tokens, positions and cached bytes, so a handoff, a prefix read from the store, a reload
or a recompute reproduces a monolithic run (:func:`monolithic`) bit for bit.

The transfers run in this thread through a ``StepDriver`` (answered in order, or with an
injected fault); an engine with a transfer thread uses ``ThreadedDriver`` the same way.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from model import LlamaConfig, Model, PagedCache

from kvstate import CacheSpec, DecodeLifecycle, LayerGroup, Policy, PrefillLifecycle, paired, rows
from kvstate import commands as C
from kvstate.backends import CudaBackend, StepDriver, Store

__all__ = ["Request", "PDEngine", "cache_spec", "layer_groups", "monolithic"]


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_new: int
    preempt_after: int | None = None  #: preempt once this many tokens were generated
    abort_in: str | None = None  #: abort once P or D reaches this state
    read_fault: int | str | None = None  #: the answer to D's first read: a count or "fail"
    tokens: list[int] = field(default_factory=list)  #: generated tokens, the first from P
    logits: list[torch.Tensor] = field(default_factory=list)  #: one per generated token
    cached_tokens: int = 0  #: prompt tokens P read from the store instead of computing
    ended: tuple[str, int, str] | None = None  #: D's (state, error code, reason)
    running: bool = False


def prefill_chunks(model: Model, cache: PagedCache, table: list[int], tokens: list[int],
                   start: int, stop: int, on_layer: Callable[[int], None] | None = None,
                   pages: tuple[int, ...] = (), checkpoints: tuple[int, ...] = ()) -> torch.Tensor | None:
    """Compute positions ``start..stop-1`` in chunks that end on block boundaries (so every
    run cuts a prompt the same way); the last chunk's logits. ``on_layer(i)`` runs as the
    last chunk launches layer ``i``: a layer is complete only once every chunk computed it.
    A hybrid model's state runs in ``pages[0]``; the state after ``checkpoints[i]`` tokens is
    copied to ``pages[1 + i]``."""
    bs, out = cache.block_size, None
    while start < stop:
        end = min(stop, (start // bs + 1) * bs)
        out = model.forward(tokens[start:end], start, cache, table, on_layer if end == stop else None,
                            state=pages[0] if pages else None)
        if end in checkpoints:
            cache.copy_state(pages[0], pages[1 + checkpoints.index(end)])
        start = end
    return out


def monolithic(model: Model, requests: list[Request], block_size: int) -> dict[str, tuple[list[int], list]]:
    """The reference: each request prefilled and decoded in place, no handoff."""
    out = {}
    for r in requests:
        need = -(-(len(r.prompt) + r.max_new) // block_size)
        cache = PagedCache(model.cfg, need, block_size)
        table = list(range(need))
        logits = [prefill_chunks(model, cache, table, r.prompt, 0, len(r.prompt))]
        tokens = [int(torch.argmax(logits[0]))]
        while len(tokens) < r.max_new:
            logits.append(model.forward(tokens[-1:], len(r.prompt) + len(tokens) - 1, cache, table))
            tokens.append(int(torch.argmax(logits[-1])))
        out[r.rid] = (tokens, logits)
    return out


def layer_groups(cfg: LlamaConfig, tp: int = 1) -> tuple[LayerGroup, ...]:
    """The cache's groups: one latent group for an MLA model (stored once, read by every
    rank); a hybrid model's full layers and its state layers (each rank's share of a state);
    none for a model of full-attention layers only; else its window layers (stored apart, D
    reading them from their last window on) and its full ones, if any."""
    if cfg.latent:
        return (LayerGroup("latent", tuple(range(cfg.layers))),)
    if cfg.state_layers:
        return (LayerGroup("full", cfg.paged_layers),
                LayerGroup("state", cfg.state_layers, state_bytes=cfg.state_bytes // tp, checkpoint=cfg.checkpoint))
    if not cfg.window_layers:
        return ()
    full = tuple(i for i in range(cfg.layers) if i not in cfg.window_layers)
    window = LayerGroup("window", cfg.window_layers, window=cfg.window)
    return (window, LayerGroup("full", full)) if full else (window,)


def cache_spec(cfg: LlamaConfig, tp: int, block_size: int, layerwise: bool = False) -> CacheSpec:
    """The cache of ``cfg`` at TP ``tp`` as kvstate describes it (MLA: one replicated latent
    head, no value cache)."""
    heads = dict(kv_heads=1, total_kv_heads=1, head_dim=cfg.latent, has_value=False) if cfg.latent else \
        dict(kv_heads=cfg.kv_heads // tp, head_dim=cfg.head_dim)
    stored = len(cfg.paged_layers) if cfg.state_layers else cfg.layers  # layer-wise: an object a stored layer
    return CacheSpec(num_layers=cfg.layers, block_size=block_size, dtype="bfloat16", tp_size=tp,
                     layer_groups=stored if layerwise else 1, groups=layer_groups(cfg, tp), **heads)


class PDEngine:
    """One P instance of ``tp`` ranks and one D instance of ``d_tp`` (default ``tp``) on one
    GPU, sharing ``store``: of different TP degrees, they store head groups both can split
    (``kvstate._spec.paired``)."""

    def __init__(self, model: Model, store: Store, *, block_size: int = 16, num_blocks: int = 512,
                 tp: int = 1, policy: Policy | None = None, staging_bytes: int = 4 << 20,
                 p_blocks: int | None = None, prefix_cache: bool = False, layerwise: bool = False,
                 d_tp: int | None = None, num_states: int = 64, host_blocks: int = 0,
                 group_tables: bool = False, d_device: int | None = None) -> None:
        """``layerwise``: P saves each layer as it is computed, in one stored object per layer,
        and D loads layer by layer (here in this thread, so a step starts after the load).
        ``num_states``: state pages on each side, for a hybrid model (P takes one a prompt, and
        one more a checkpoint it keeps: ``Policy.state_checkpoints``; D one a request).
        ``host_blocks``: D's host tier, in blocks (``Policy(preempt="swap")`` swaps preempted
        requests into it). ``group_tables``: D gives each layer group a block table of its own
        (``kvstate._tables``), freeing a window group's blocks behind the window as it decodes.
        ``d_device``: D's GPU, when it is not P's (the current device): D's caches, backend and
        a copy of the model's weights live there, and the handoff goes through the store."""
        cfg = model.cfg
        self.model, self.store, self.now = model, store, 0.0
        p_device = torch.cuda.current_device()
        self.d_device = p_device if d_device is None else d_device
        d_where = f"cuda:{self.d_device}"
        #: D's model: P's, or the same weights on D's GPU
        self.d_model = model if self.d_device == p_device else model.on(d_where)  # type: ignore[attr-defined]
        d_tp = d_tp or tp
        p_spec, d_spec = (cache_spec(cfg, n, block_size, layerwise) for n in (tp, d_tp))
        self.spec, self.d_spec = (p_spec, d_spec) if tp == d_tp else paired(p_spec, d_spec)
        self.d_spec = replace(self.d_spec, group_tables=group_tables)
        policy = policy or Policy()
        num_states = num_states if cfg.state_layers else 0
        clock: Callable[[], float] = lambda: self.now  # noqa: E731
        p_blocks = p_blocks or num_blocks  # P's pool (smaller: prompts wait at P for blocks)
        self.P = PrefillLifecycle(self.spec, p_blocks, policy, clock=clock, prefix_cache=prefix_cache,
                                  layerwise=layerwise, num_states=num_states)
        self.D = DecodeLifecycle(self.d_spec, num_blocks, policy, clock=clock, prefix_cache=prefix_cache,
                                 layerwise=layerwise, num_states=num_states, host_blocks=host_blocks)
        self.p_cache = PagedCache(cfg, p_blocks, block_size, tp, num_states=num_states, spec=self.spec)
        self.d_cache = PagedCache(cfg, num_blocks, block_size, d_tp, num_states=num_states, spec=self.d_spec,
                                  device=d_where)
        sides = ((self.spec, p_blocks, self.p_cache, 0, p_device),
                 (self.d_spec, num_blocks, self.d_cache, host_blocks, self.d_device))
        self.backends = [CudaBackend(spec, n, store, caches=c.caches, staging_bytes=staging_bytes, host_blocks=h,
                                     num_states=num_states, states=dict(enumerate(c.states)) if num_states else None,
                                     device=dev)
                         for spec, n, c, h, dev in sides]
        self.p_drv = StepDriver(self.P, self.backends[0], on_notice=self._on_prefill)
        self.d_drv = StepDriver(self.D, self.backends[1], on_notice=self._on_decode)
        self.reqs: dict[str, Request] = {}
        self.queue: list[Request] = []  #: not admitted yet (D had no room)
        self.work: list[tuple[Callable[[Request, Any], None], Request, Any]] = []
        self.p_ended: dict[str, str] = {}
        self.recomputed: list[str] = []  #: requests D recomputed, once per recompute

    def close(self) -> None:
        for b in self.backends:
            b.close()

    # -- notices ---------------------------------------------------------------------------
    def _on_prefill(self, cmd: C.Command) -> None:
        r = self.reqs[cmd.request_id]
        if isinstance(cmd, C.StartPrefill):
            self.work.append((self._prefill, r, cmd))  # computed in the loop, as an engine's step
        elif isinstance(cmd, C.SendFirstToken):
            if self.D.deliver_first_token(r.rid, cmd.token, cmd.error_code) and cmd.error_code == 200:
                r.tokens.append(int(cmd.token))  # type: ignore[arg-type]
        elif isinstance(cmd, C.RequestEnded):
            self.p_ended[r.rid] = cmd.state

    def _on_decode(self, cmd: C.Command) -> None:
        r = self.reqs[cmd.request_id]
        if isinstance(cmd, C.StartDecode):
            r.running = True
        elif isinstance(cmd, C.Recompute):
            self.work.append((self._recompute, r, cmd))
        elif isinstance(cmd, C.RequestEnded):
            r.running = False
            r.ended = (cmd.state, cmd.error_code, cmd.reason)

    # -- compute ---------------------------------------------------------------------------
    def _prefill(self, r: Request, cmd: C.StartPrefill) -> None:
        if not (self.P.is_live(r.rid) and self.P.state_of(r.rid) in ("prefilling", "saved")):
            return  # aborted meanwhile
        def done(i: int) -> None:  # a layer-wise P reports each layer as it is launched, with
            if i + 1 == self.model.cfg.layers and self.model.cfg.state_layers:
                return  # the states reach their pages after the forward: prefill_done reports the last layer
            ev = torch.cuda.Event()  # the event after it: the save's copies wait for it on the GPU
            ev.record()
            self.P.layers_done(r.rid, i + 1, ev)

        if cmd.state_from >= 0:  # a state P's GPU prefix cache kept (shared): the prompt's own page starts as it
            self.p_cache.copy_state(cmd.state_from, cmd.state_pages[0])
        table = rows(cmd.block_ids, cmd.tables)
        logits = prefill_chunks(self.model, self.p_cache, table, r.prompt, cmd.num_cached_tokens,
                                len(r.prompt), done if self.P.layerwise else None, cmd.state_pages, cmd.checkpoints)
        assert logits is not None  # the lifecycle leaves at least one token to compute
        torch.cuda.synchronize()  # the cache is complete before the write reads it
        r.logits.append(logits)
        r.cached_tokens = cmd.num_cached_tokens
        self.P.prefill_done(r.rid, int(torch.argmax(logits)))

    def _recompute(self, r: Request, cmd: C.Recompute) -> None:
        if not (self.D.is_live(r.rid) and self.D.state_of(r.rid) == "recomputing"):
            return
        # the prompt in P's chunks, generated tokens one at a time: as they were computed
        table, n, known = rows(cmd.block_ids, cmd.tables), len(r.prompt), r.prompt + r.tokens[:-1]
        state = cmd.state_pages[0] if cmd.state_pages else None
        prefill_chunks(self.d_model, self.d_cache, table, known, cmd.from_token, n, pages=cmd.state_pages[:1])
        for pos in range(max(n, cmd.from_token), len(known)):
            self.d_model.forward(known[pos:pos + 1], pos, self.d_cache, table, state=state)
        torch.cuda.synchronize(self.d_device)
        self.recomputed.append(r.rid)
        self.D.recompute_done(r.rid)

    # -- the loop ----------------------------------------------------------------------------
    def _abort_due(self) -> None:
        for r in self.reqs.values():
            if r.abort_in is None:
                continue
            states = {lc.state_of(r.rid) for lc in (self.P, self.D) if lc.is_live(r.rid)}
            if r.abort_in in states:
                r.abort_in = None
                for lc in (self.P, self.D):  # as a router does: both sides
                    lc.abort(r.rid)

    def _answer_transfers(self) -> None:
        for drv in (self.p_drv, self.d_drv):
            drv.pump()
            self._abort_due()
            while ready := [k for k, c in drv.pending.items() if self._answerable(drv, c)]:
                (cid, rank), cmd = ready[0], drv.pending[ready[0]]
                r = self.reqs.get(cmd.request_id)
                outcome = None
                if drv is self.d_drv and isinstance(cmd, C.ReadBlocks) and r and r.read_fault is not None:
                    outcome = r.read_fault
                    if rank == cmd.ranks[-1]:
                        r.read_fault = None
                drv.complete(cid, rank, outcome)
                drv.pump()
                self._abort_due()

    def _answerable(self, drv: StepDriver, cmd: C.TransferCommand) -> bool:
        """Every pending answer, but a layer-wise save's only once its layers are all reported
        (a threaded driver's worker would wait for them) or its request ended."""
        every = self.spec.paged_layers_done(self.spec.layers)  # reports count the layers whose blocks are stored
        if cmd.__class__ is not C.SaveLayers or drv.layers.get(cmd.command_id, 0) == every:
            return True
        return not self.P.is_live(cmd.request_id) or self.P.waiting_for(cmd.request_id) != cmd.command_id

    def _decode_step(self, r: Request) -> None:
        table, pos = self.D.rows_of(r.rid), len(r.prompt) + len(r.tokens) - 1
        pages = self.D.pages_of(r.rid)
        logits = self.d_model.forward(r.tokens[-1:], pos, self.d_cache, table, state=pages[0] if pages else None)
        r.logits.append(logits)
        tok = int(torch.argmax(logits))
        r.tokens.append(tok)
        if len(r.tokens) >= r.max_new:
            r.running = False
            self.D.finish(r.rid)
            return
        self.D.append_tokens(r.rid, [tok])
        if r.preempt_after is not None and len(r.tokens) >= r.preempt_after:
            r.preempt_after, r.running = None, False
            torch.cuda.synchronize(self.d_device)  # the cache is complete before the write-back reads it
            self.D.preempt(r.rid)

    def _admit(self) -> None:
        while self.queue and self.D.can_reserve(len(self.queue[0].prompt)):
            r = self.queue.pop(0)
            self.D.reserve(r.rid, r.prompt)
            self.P.admit(r.rid, r.prompt)

    def step(self) -> None:
        """One loop: admit, answer transfers, compute queued prefills and recomputes, one
        decode step per running request, resume the preempted, tick."""
        self._admit()
        self._answer_transfers()
        work, self.work = self.work, []
        for fn, r, cmd in work:
            fn(r, cmd)
        self._answer_transfers()
        for r in list(self.reqs.values()):
            if r.running and self.D.is_live(r.rid):
                self._decode_step(r)
            elif self.D.is_live(r.rid) and self.D.state_of(r.rid) in ("preempted", "swapped"):
                self.D.resume(r.rid)
        self._abort_due()
        self.now += 0.001
        self.P.tick()
        self.D.tick()

    def run(self, requests: list[Request], max_loops: int = 100_000) -> dict[str, Request]:
        """Serve ``requests`` to the end; returns them by id."""
        for r in requests:
            self.reqs[r.rid] = r
        self.queue.extend(requests)
        for _ in range(max_loops):
            self.step()
            if not (self.queue or self.work or self.P.live_requests() or self.D.live_requests()
                    or self.p_drv.pending or self.d_drv.pending):
                self._answer_transfers()  # the last notices
                return self.reqs
        raise RuntimeError(f"the engine did not finish within {max_loops} loops")

    def leaks(self) -> dict[str, Any]:
        """Blocks still held after a run (all zero when nothing leaked)."""
        return {"P": self.P.pool.num_used, "D": self.D.pool.num_used,
                "pinned": len(self.P.pinned_blocks()) + len(self.D.pinned_blocks())}

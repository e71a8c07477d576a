"""How the CUDA ops move a planned transfer: the ``auto`` choice and the three ways.

- ``zero_copy``: one kernel reads the GPU blocks and writes the pinned host buffer directly
  (or the reverse), 16 bytes per access on the host side;
- ``staged``: the same kernel gathers into device staging and DMA engines move it, in pieces
  on a second stream, so gathering piece *k+1* overlaps the DMA of piece *k*;
- ``dma``: strided DMA, one ``cudaMemcpy2DAsync`` per layer and run of consecutive ids.

:data:`AUTO` holds the thresholds :func:`choose_strategy` uses, measured on an H100 (figures in
docs/benchmarks.md). A :class:`Mover` runs a plan one way, on resources its swapper owns.

Ordering. A call runs after everything queued before it on its stream. Staged calls also use
the copy stream C and the staging slots:

- a slot is reused only after the event of its last use (kept across calls and streams);
- on a caller's stream S, C first waits for S, and a d2h's S waits for its last DMA;
- on the swapper's own stream, which holds only its calls, those two waits are made only when
  needed, so back-to-back staged calls keep the DMA engine busy across call boundaries:
  C waits for S only when S holds work that touched host memory or waited for a foreign event
  since C last waited; S waits for C (a staged d2h's DMAs) only before work that is not
  staged. A staged d2h there ends on C: its end event is recorded on C.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._errors import ValidationError
from ._cuda_launch import D2H, H2D, Buffer, DeviceLayers, Kernels, ParamRing
from ._plan import TransferPlan

__all__ = ["STRATEGIES", "AUTO", "choose_strategy", "Mover"]

STRATEGIES = ("auto", "zero_copy", "staged", "dma")

#: How ``auto`` picks: strided DMA when few calls move big chunks (53-54 GB/s at 128 KiB,
#: contiguous ids) and each call moves enough to hide its host cost (a CudaBackend piece of 4
#: blocks would issue 64 DMAs for 32 MiB); staging + pipelined DMA for large transfers whose
#: host side is in few runs (53 GB/s at 128 KiB random, 48 at 16 KiB); the zero-copy kernel
#: below that (it wins at 1 KiB and at odd sizes, where a call is short).
AUTO = {
    "dma_min_chunk": 64 * 1024,     # chunk bytes at or above which strided DMA is considered
    "dma_max_calls": 64,            # at most this many DMA calls (runs x layers) ...
    "dma_min_call_bytes": 4 << 20,  # ... each moving at least this much: issuing one costs ~10 us
                                    # of host time, which a small call (a backend's piece) can't hide
    "staged_min_bytes": 32 << 20,   # transfers at least this big go through staging (its pieces'
                                    # events cost ~0.1 ms of host per call) ...
    "staged_max_runs": 16,          # ... when the host side is in at most this many runs
}

_STAGING_SLOTS = 4


def choose_strategy(plan: TransferPlan) -> str:
    """The ``auto`` choice for ``plan`` (see :data:`AUTO`)."""
    if plan.chunk_bytes >= AUTO["dma_min_chunk"]:
        calls = plan.num_runs * plan.layers
        if calls <= AUTO["dma_max_calls"] and plan.bytes >= calls * AUTO["dma_min_call_bytes"]:
            return "dma"
    if plan.bytes >= AUTO["staged_min_bytes"] and plan.num_host_runs <= AUTO["staged_max_runs"]:
        return "staged"
    return "zero_copy"


def _geometry(plan: TransferPlan) -> tuple[int, int, int]:
    """(groups, span, layers per span) of the flat (host-side) layout."""
    if plan.host_block_contiguous:
        return 1, plan.layers * plan.chunk_bytes, plan.layers
    return plan.layers, plan.chunk_bytes, 1


class _Piece(NamedTuple):
    """Entries ``[e0, e1)`` of a staged transfer, through the staging slot at ``slot_ptr``
    (``stride`` bytes per group); ``ids``: the kernel's (gpu ids, flat ids) for them."""

    e0: int
    e1: int
    slot_ptr: int
    stride: int
    ids: tuple[Any, Any]


class Mover:
    """Moves plans on one device with its swapper's kernels, parameter ring, copy stream and
    staging (allocated through ``alloc`` on first staged use)."""

    def __init__(self, cp: Any, kernels: Kernels, params: ParamRing, copy_stream: Any, staging_bytes: int,
                 alloc: Callable[[int, bool], Buffer], own_stream: Any) -> None:
        self.cp, self.kernels, self.params, self.copy = cp, kernels, params, copy_stream
        self.staging_bytes, self.alloc = staging_bytes, alloc
        self.staging: Buffer | None = None
        self.own = own_stream  #: the swapper's own stream: only its calls go there
        self.slot_free: list[Any] = [None] * _STAGING_SLOTS  # event after each slot's last use
        self.next_slot = 0
        self.c_behind = True  # own stream holds work C has not waited for (host memory, foreign events)
        self.s_behind: Any = None  # event of a staged d2h's last DMA the own stream has not waited for

    def run(self, strategy: str, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...],
            stream: Any, inline: bool) -> Any:
        """Enqueue ``plan`` on ``stream`` the way ``strategy`` names (not ``auto``); returns
        the stream the call ends on (``stream``, or the copy stream: see the module's rules)."""
        if strategy == "staged" and plan.blocks:
            return self.staged(plan, layers, host_ptrs, stream, inline)
        if stream is self.own:
            self.own_foreign()  # it may touch host memory: a later staged call's C must wait
            if self.s_behind is not None:
                stream.wait_event(self.s_behind)
                self.s_behind = None
        if not plan.blocks:
            return stream
        if strategy == "dma":
            self.dma(plan, layers, host_ptrs, stream)
        else:
            self.zero_copy(plan, layers, host_ptrs, stream, inline)
        return stream

    def own_foreign(self) -> None:
        """The own stream got work the copy stream must wait for before its next staged call."""
        self.c_behind = True

    def zero_copy(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], stream: Any,
                  inline: bool) -> None:
        geometry = _geometry(plan)
        aligned = geometry[1] % 16 == 0 and (host_ptrs[0] % 16 == 0 if len(host_ptrs) == 1
                                              else all(p % 16 == 0 for p in host_ptrs))
        vectors = aligned and layers.aligned and plan.chunk_bytes % 16 == 0
        d2h = plan.direction == "d2h"
        if inline and len(host_ptrs) == 1:  # one launch, ids inline (from the packed lists as they are)
            g, f = (plan.gpu_ids, plan.host_ids) if plan.packed is None else (plan.packed, None)
            self.kernels.launch(stream, layers.ptr_array.data.ptr, 0, host_ptrs[0], 0, g, f,
                                plan.blocks, geometry, plan.chunk_bytes, d2h, vectors)
            return
        gptr, fptr, hptr = self.params.upload([plan.gpu_ids, plan.host_ids, np.asarray(host_ptrs, np.int64)], stream)
        self.kernels.launch(stream, layers.ptr_array.data.ptr, hptr, 0, 0, gptr, fptr, plan.blocks, geometry,
                            plan.chunk_bytes, d2h, vectors)

    def dma(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], stream: Any) -> None:
        rt = self.cp.cuda.runtime
        c, L = plan.chunk_bytes, plan.layers
        d2h = plan.direction == "d2h"
        for g0, h0, n in plan.runs:
            for layer in range(L):
                gp = layers.ptrs[layer] + g0 * c
                if plan.host_block_contiguous:
                    hp = host_ptrs[0] + h0 * L * c + layer * c
                    if d2h:
                        rt.memcpy2DAsync(hp, L * c, gp, c, c, n, D2H, stream.ptr)
                    else:
                        rt.memcpy2DAsync(gp, c, hp, L * c, c, n, H2D, stream.ptr)
                else:
                    hp = host_ptrs[layer] + h0 * c
                    if d2h:
                        rt.memcpyAsync(hp, gp, n * c, D2H, stream.ptr)
                    else:
                        rt.memcpyAsync(gp, hp, n * c, H2D, stream.ptr)

    def _pieces(self, plan: TransferPlan, per_block: int) -> tuple[int, int]:
        """(blocks per piece, bytes per staging slot) for a staged transfer."""
        if self.staging is None:
            self.staging = self.alloc(self.staging_bytes, False)
        slot_bytes = (self.staging_bytes // _STAGING_SLOTS) & ~255
        per_piece = max(1, slot_bytes // per_block)
        if per_piece * per_block > slot_bytes:
            raise ValidationError(f"staging_bytes {self.staging_bytes} cannot hold one block ({per_block} bytes "
                                  f"per block in {_STAGING_SLOTS} slots): raise staging_bytes")
        n = plan.blocks
        if n * per_block >= (8 << 20):  # few, large pieces for big transfers, at least 4 to overlap
            per_piece = min(per_piece, max(1, -(-n // 4)))
        return per_piece, slot_bytes

    def _event(self, stream: Any) -> Any:
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        return ev

    def staged(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], stream: Any,
               inline: bool) -> Any:
        """Kernel ⇄ device staging, DMA ⇄ host, in pieces over a ring of staging slots;
        returns the stream the call ends on."""
        groups, span, _ = _geometry(plan)
        per_piece, slot_bytes = self._pieces(plan, span * groups)
        gptr = 0 if inline else self.params.upload([plan.gpu_ids], stream)[0]
        d2h = plan.direction == "d2h"
        own = stream is self.own
        if not own or self.c_behind:
            self.copy.wait_event(self._event(stream))
            self.c_behind = False
        assert self.staging is not None
        for e0 in range(0, plan.blocks, per_piece):
            e1 = min(plan.blocks, e0 + per_piece)
            slot = self.next_slot
            self.next_slot = (slot + 1) % _STAGING_SLOTS
            sp = self.staging.ptr + slot * slot_bytes
            ids: tuple[Any, Any] = (plan.gpu_ids[e0:e1], None) if inline else (gptr + e0 * 8, 0)
            piece = _Piece(e0, e1, sp, (e1 - e0) * span, ids)
            if d2h:
                self.slot_free[slot] = self._gather_piece(stream, self.slot_free[slot], plan, layers, host_ptrs, piece)
            else:
                self.slot_free[slot] = self._scatter_piece(stream, self.slot_free[slot], plan, layers, host_ptrs,
                                                           piece)
        if not d2h:
            if own:
                self.s_behind = None  # its kernels ran after every DMA queued before
            return stream
        if own:  # the own stream goes on without its DMAs; work there that is not staged waits first
            self.s_behind = self.slot_free[(self.next_slot - 1) % _STAGING_SLOTS]
            return self.copy
        stream.wait_event(self._event(self.copy))  # the caller's stream continues after the last DMA
        return stream

    def _launch(self, stream: Any, plan: TransferPlan, layers: DeviceLayers, p: _Piece) -> None:
        """The kernel between the piece's staging slot and the GPU blocks."""
        vectors = layers.aligned and plan.chunk_bytes % 16 == 0
        self.kernels.launch(stream, layers.ptr_array.data.ptr, 0, p.slot_ptr, p.stride, p.ids[0], p.ids[1],
                            p.e1 - p.e0, _geometry(plan), plan.chunk_bytes, plan.direction == "d2h", vectors)

    def _gather_piece(self, stream: Any, free: Any, plan: TransferPlan, layers: DeviceLayers,
                      host_ptrs: tuple[int, ...], p: _Piece) -> Any:
        """One d2h piece: the kernel gathers into the slot, then the copy stream DMAs it out."""
        if free is not None:
            stream.wait_event(free)
        self._launch(stream, plan, layers, p)
        self.copy.wait_event(self._event(stream))
        self._dma_runs(plan, host_ptrs, p)
        return self._event(self.copy)

    def _scatter_piece(self, stream: Any, free: Any, plan: TransferPlan, layers: DeviceLayers,
                       host_ptrs: tuple[int, ...], p: _Piece) -> Any:
        """One h2d piece: the copy stream DMAs into the slot, then the kernel scatters it."""
        if free is not None:
            self.copy.wait_event(free)
        self._dma_runs(plan, host_ptrs, p)
        stream.wait_event(self._event(self.copy))
        self._launch(stream, plan, layers, p)
        return self._event(stream)

    def _dma_runs(self, plan: TransferPlan, host_ptrs: tuple[int, ...], p: _Piece) -> None:
        """DMA the host runs that fall in the piece's entries between its staging slot and host."""
        rt, copy = self.cp.cuda.runtime, self.copy
        groups, span, _ = _geometry(plan)
        d2h = plan.direction == "d2h"
        for pos, h0, length in plan.host_runs:
            a, b = max(pos, p.e0), min(pos + length, p.e1)
            if a >= b:
                continue
            for g in range(groups):
                hp = host_ptrs[g] + (h0 + a - pos) * span
                dp = p.slot_ptr + g * p.stride + (a - p.e0) * span
                if d2h:
                    rt.memcpyAsync(hp, dp, (b - a) * span, D2H, copy.ptr)
                else:
                    rt.memcpyAsync(dp, hp, (b - a) * span, H2D, copy.ptr)

"""An engine's paged KV tensors as kvstate caches, and one TP rank's transfers over them.

An engine (vLLM) allocates one tensor per attention layer and hands the connector a dict of
them. This module sees them as kvstate's per-layer, per-kind caches ``[num_blocks, heads,
block_size, head_dim]`` *without a copy*, builds the backend that moves their blocks to and
from a :class:`~kvstate.backends._base.Store` (the numpy backend for CPU tensors, the CUDA
backend for GPU ones: both checksum every block and verify every read against its manifest),
and runs a rank's share of the scheduler's commands on a
:class:`~kvstate.backends._drivers.ThreadedDriver`, so the engine's thread never waits on the
store. It imports PyTorch only when handed tensors, and no engine at all.

Rules:

- Layouts served, per layer (``H`` heads, ``B`` tokens a block, ``D`` head size): K and V
  apart, ``[2, num_blocks, H, B, D]`` stored so (vLLM's GPU backends under the ``HND``
  layout), or the same seen as ``[2, num_blocks, B, H, D]`` with ``HND`` strides; one kind,
  ``[num_blocks, H, B, D']`` (vLLM's CPU attention packs each head's K and V rows in a block:
  ``D' = 2 D``) or a latent ``[num_blocks, B, D]`` (MLA: one head). The spec says which: a
  one-kind spec's ``head_dim`` is ``D'``.
  Whatever the logical shape, the bytes of one block of one kind must be one contiguous run
  of ``H * B * D`` elements (or ``B * D``), since the kernels move whole blocks. Anything
  else (``NHD`` memory order, K and V interleaved per block) is refused by name, before any
  transfer: convert on the engine's side (``VLLM_KV_CACHE_LAYOUT=HND``).
- Dtypes: bfloat16, float16 and fp8 (moved as bytes, ``uint8``); fp8 scales are not
  carried (an fp8 cache with per-block scales is refused).
- Every layer has the geometry the scheduler's :class:`~kvstate._spec.CacheSpec` says; the
  first that does not is named in the error.
- A command reaches a rank as that rank's share (``ranks=(rank,)``); completions go back
  to the scheduler as :class:`~kvstate.events.Completion` s, which it checks.
- Layer-wise loads (:class:`~kvstate.commands.LoadLayers`) run beside the engine's forward:
  before a layer's attention the engine waits for it (:meth:`RankTransfers.wait_layers`,
  within the load's deadline; a device event is waited for on the engine's stream), and after
  the forward it learns which blocks did not arrive whole (:meth:`RankTransfers.load_errors`),
  once no load touches them any more: each load answered, or its fence passed.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from .. import commands as C
from .._dtypes import as_16bit_ints, dtype_name
from .._errors import ConfigError, ValidationError
from .._spec import CacheSpec
from .._validate import check_int, is_int
from ..backends._base import Store, TransferBackend
from ..backends._drivers import ThreadedDriver, check_commands
from ..events import Completion

__all__ = ["kind_views", "check_layers", "RankTransfers"]

#: a tensor's dtype name (kvstate._dtypes) -> the CacheSpec dtype that carries it
SPEC_DTYPES = {"uint16": "bfloat16", "float16": "float16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8",
               "uint8": "uint8"}


def spec_dtype(dtype: Any) -> str:
    """The :class:`CacheSpec` dtype that carries a tensor dtype, or a ConfigError naming it."""
    name = dtype_name(dtype)
    if name not in SPEC_DTYPES:
        raise ConfigError(f"KV cache dtype {dtype} is not served (bfloat16, float16 or fp8)")
    return SPEC_DTYPES[name]


def _blocks_contiguous(t: Any) -> bool:
    """Whether ``t`` ``[num_blocks, ...]`` holds each block's elements as one dense run."""
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def kind_views(name: str, t: Any, spec: CacheSpec) -> list[Any]:
    """The layer tensor ``t`` as one view ``[num_blocks, heads, block_size, head_dim]`` per kind
    of ``spec`` (see the rules), or a ConfigError naming the layer and what it holds."""
    shape, heads, bs, dim = tuple(t.shape), spec.kv_heads, spec.block_size, spec.head_dim
    if len(spec.kinds) == 1 and shape[1:] == (heads, bs, dim):
        views = [t]  # one kind: K and V packed in a block (CPU attention), or a latent
    elif len(spec.kinds) == 1 and heads == 1 and shape[1:] == (bs, dim):
        views = [t.unsqueeze(1)]  # MLA's latent: one head
    elif len(spec.kinds) == 2 and len(shape) == 5 and shape[0] == 2 and shape[2:] == (heads, bs, dim):
        views = [t[0], t[1]]
    elif len(spec.kinds) == 2 and len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, heads, dim):
        views = [t[0].transpose(1, 2), t[1].transpose(1, 2)]
    else:
        want = f"[blocks, {heads}, {bs}, {dim}]" if len(spec.kinds) == 1 else f"[2, blocks, {heads}, {bs}, {dim}]"
        raise ConfigError(f"KV cache layer {name!r}: shape {list(shape)} is not the layout kvstate expects here "
                          f"({want}, or its HND view)")
    for v in views:
        if not _blocks_contiguous(v):
            raise ConfigError(f"KV cache layer {name!r}: a block's {heads}x{bs}x{dim} elements are not "
                              f"one dense run (strides {list(t.stride())}): an NHD memory order; run the engine "
                              "with the HND layout (VLLM_KV_CACHE_LAYOUT=HND)")
    return views


def check_layers(spec: CacheSpec, layers: Mapping[str, Any]) -> dict[str, list[Any]]:
    """The engine's layer tensors, in its order, as ``{kind: [per-layer views]}`` for ``spec``
    (one rank's), or a ConfigError naming the first layer that does not fit."""
    if not isinstance(layers, Mapping) or len(layers) != spec.layers:
        raise ConfigError(f"the engine registered {len(layers) if isinstance(layers, Mapping) else '?'} KV cache "
                          f"layers; the model has {spec.layers}")
    out: dict[str, list[Any]] = {k: [] for k in spec.kinds}
    blocks = None
    for name, t in layers.items():
        if spec_dtype(t.dtype) != spec.dtype:
            raise ConfigError(f"KV cache layer {name!r}: dtype {t.dtype}, the model's cache is {spec.dtype}")
        views = kind_views(name, t, spec)
        if len(views) != len(spec.kinds):
            raise ConfigError(f"KV cache layer {name!r}: {len(views)} kind(s), the model's cache has {spec.kinds}")
        if blocks is None:
            blocks = views[0].shape[0]
        if views[0].shape[0] != blocks:
            raise ConfigError(f"KV cache layer {name!r}: {views[0].shape[0]} blocks, the first layer has {blocks}")
        for kind, v in zip(spec.kinds, views):
            out[kind].append(_as_carried(v))
    return out


def _as_carried(v: Any) -> Any:
    """A view of the dtype kvstate carries: one-byte floats (fp8) as uint8, which CuPy reads
    through DLPack (it has no fp8 type); others as they are."""
    import torch

    return v.view(torch.uint8) if v.element_size() == 1 and v.dtype != torch.uint8 else v


def _numpy(v: Any) -> Any:
    """A CPU tensor's view as a writable numpy array of the dtype kvstate carries (no copy):
    bfloat16 as uint16, fp8 as uint8."""
    if SPEC_DTYPES[dtype_name(v.dtype)] == "uint8" and v.element_size() == 1:
        import torch

        v = v.view(torch.uint8)
    return as_16bit_ints(v).numpy()


class RankTransfers:
    """One TP rank's transfers between an engine's paged KV tensors and a store (the rules).

    ``layers`` is the engine's ``{layer name: tensor}``; ``store`` this process's client of
    the pool (closed by :meth:`close`); ``workers`` the transfer threads."""

    def __init__(self, spec: CacheSpec, rank: int, layers: Mapping[str, Any], store: Store, *,
                 workers: int = 2, staging_bytes: int = 64 << 20) -> None:
        if not isinstance(spec, CacheSpec):
            raise ValidationError("RankTransfers: spec must be a CacheSpec")
        if not isinstance(rank, int) or not 0 <= rank < spec.tp_size:
            raise ValidationError(f"RankTransfers: rank {rank!r} outside 0..{spec.tp_size - 1}")
        views = check_layers(spec, layers)
        first = views[spec.kinds[0]][0]
        self.spec, self.rank, self.store = spec, rank, store
        self.device: str = first.device.type  #: "cpu" or "cuda": where the caches are
        self.num_blocks = int(first.shape[0])
        self.backend = self._backend(views, first, staging_bytes)
        #: one driver per side (kvstate.integrations._handoff.SIDES): each side numbers its
        #: commands on its own, and loads never queue behind saves
        self.drivers = {side: ThreadedDriver(self.backend, workers=workers, name=f"rank{rank}-{side}")
                        for side in ("save", "load")}
        self._kept: dict[str, list[Completion]] = {side: [] for side in self.drivers}  # answers polled early

    def _backend(self, views: dict[str, list[Any]], first: Any, staging_bytes: int) -> TransferBackend:
        if first.device.type == "cuda":
            from ..backends._cuda import CudaBackend

            per_block = self.spec.bytes_per_block_per_rank
            return CudaBackend(self.spec, self.num_blocks, self.store, caches={self.rank: views},
                               device=first.device.index or 0, ranks=[self.rank],
                               staging_bytes=max(staging_bytes, 2 * per_block))
        if first.device.type != "cpu":
            raise ConfigError(f"KV caches on {first.device.type} are not served (CPU or CUDA)")
        from ..backends._reference import ReferenceBackend

        caches = {self.rank: {k: [_numpy(v) for v in vs] for k, vs in views.items()}}
        return ReferenceBackend(self.spec, self.num_blocks, self.store, ranks=[self.rank], caches=caches)

    def submit(self, side: str, commands: Iterable[C.Command]) -> int:
        """Start this rank's share of one side's transfer commands (others' ranks and notices
        are not a rank's); returns how many started."""
        driver = self._driver(side)
        started = 0
        for cmd in check_commands(commands, "RankTransfers.submit"):
            kind = C.kind_of(cmd)
            if kind in C.TRANSFER_KINDS:
                transfer = cast(C.TransferCommand, cmd)
                if self.rank in transfer.ranks:
                    driver.submit(dataclasses.replace(transfer, ranks=(self.rank,)))
                    started += 1
            elif kind in ("cancel", "layers"):  # a layer-wise save's gate is every rank's
                driver.submit(cmd)
        return started

    def layers_computed(self, commands: Iterable[tuple[str, int]], layers: int, event: Any = None) -> None:
        """The engine's forward computed the first ``layers`` layers (``event``: a device event
        after them, None when they are complete): the layer-wise saves ``(request id, command
        id)`` may store their groups."""
        check_int(layers, "RankTransfers.layers_computed: layers", minimum=1, maximum=self.spec.layers)
        if isinstance(commands, (str, bytes)) or not isinstance(commands, Iterable):
            raise ValidationError(f"RankTransfers.layers_computed: commands must be (request id, command id) "
                                  f"pairs, got {commands!r:.80}")
        pairs = list(commands)
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and is_int(p[1]) for p in pairs):
            raise ValidationError(f"RankTransfers.layers_computed: commands must be (request id, command id) "
                                  f"pairs, got {pairs!r:.80}")
        done = self.spec.paged_layers_done(layers)
        self.submit("save", [C.LayersReady(rid, cid, done, event) for rid, cid in pairs])

    def wait_layers(self, loads: Sequence[C.LoadLayers], layers: int, stream: Any = None) -> set[int]:
        """Wait until each of ``loads`` (layer-wise loads submitted here) scattered its first
        ``layers`` layers on this rank, each within its deadline; returns the command ids that
        will not bring them (ended short, or past the deadline). A device event after a scatter
        is waited for on ``stream`` (a CUDA stream's handle), or on the host when None."""
        check_int(layers, "RankTransfers.wait_layers: layers", minimum=1, maximum=self.spec.layers)
        short: set[int] = set()
        for cmd in _loads(loads, "RankTransfers.wait_layers"):
            arrivals = self.drivers["load"].arrivals(cmd.command_id, self.rank)
            if arrivals is None:  # answered and polled already: its outcome is in load_errors
                continue
            ok, event = arrivals.wait(self.spec.paged_layers_done(layers), max(0.0, cmd.deadline - time.monotonic()))
            if not ok:
                short.add(cmd.command_id)
            elif event is not None:
                _device_wait(event, stream)
        return short

    def load_errors(self, loads: Sequence[C.LoadLayers]) -> set[int]:
        """The engine blocks ``loads`` did not bring whole on this rank: each load's blocks from
        the first one it did not read, scatter and verify. Returns once no load touches its
        blocks: each answered (its answer kept for :meth:`poll`), or its fence passed (then
        every block it was to bring counts)."""
        pending = {cmd.command_id: cmd for cmd in _loads(loads, "RankTransfers.load_errors")}
        counts: dict[int, int] = {c.command_id: c.count for c in self._kept["load"] if c.command_id in pending}
        while len(counts) < len(pending):
            left = min(cmd.fence for cid, cmd in pending.items() if cid not in counts) - time.monotonic()
            if left <= 0:
                break
            got = self._driver("load").poll(min(left, 1.0))
            self._kept["load"] += got
            counts.update((c.command_id, c.count) for c in got if c.command_id in pending)
        return {b for cid, cmd in pending.items() for b in cmd.block_ids[counts.get(cid, 0):len(cmd.keys)]}

    def _driver(self, side: str) -> ThreadedDriver:
        try:
            return self.drivers[side]
        except (KeyError, TypeError):
            raise ValidationError(f"RankTransfers: side must be one of {list(self.drivers)}, got {side!r}") from None

    def poll(self, side: str, timeout: float = 0.0) -> list[Completion]:
        """This rank's answers to one side's commands, ready now (those :meth:`load_errors`
        waited for first)."""
        driver = self._driver(side)
        kept, self._kept[side] = self._kept[side], []
        return kept + driver.poll(0.0 if kept else timeout)

    def inflight(self) -> int:
        """Transfers submitted and not answered yet, both sides."""
        return sum(d.inflight for d in self.drivers.values())

    def close(self, timeout: float = 30.0) -> None:
        """Stop the transfer threads (within ``timeout``), then the backend and the store client."""
        try:
            for d in self.drivers.values():
                d.close(timeout)
        finally:
            try:
                self.backend.close()
            finally:
                self.store.close()


def _loads(loads: Any, who: str) -> list[C.LoadLayers]:
    if isinstance(loads, (str, bytes)) or not isinstance(loads, Iterable):
        raise ValidationError(f"{who}: loads must be LoadLayers commands, got {loads!r:.80}")
    out = list(loads)
    for cmd in out:
        if not isinstance(cmd, C.LoadLayers):
            raise ValidationError(f"{who}: loads must be LoadLayers commands, got a {type(cmd).__name__}")
    return out


def _device_wait(event: Any, stream: Any) -> None:
    """Make ``stream`` (a CUDA stream's handle) wait for ``event``, or the host if None."""
    if stream is None:
        event.synchronize()
        return
    import cupy as cp

    cp.cuda.runtime.streamWaitEvent(int(stream), event.ptr, 0)

"""The CUDA implementation of the transfer ops, over CuPy, PyTorch and Paddle GPU tensors.

A :class:`CudaSwapper` owns everything a transfer needs on one device (its streams, the
compiled kernels, a ring of parameter slots for block ids, an optional device staging area)
and releases all of it on :meth:`CudaSwapper.close` (or on leaving a ``with`` block); nothing
lives at module level. Arguments are validated by :mod:`kvstate.kernels._plan` exactly as in
the numpy reference, then by the GPU-specific rules (the caches on this device, the host
buffer page-locked), before a byte moves. How the bytes move is
:mod:`~kvstate.kernels._cuda_strategy`'s (zero-copy kernel, staged, strided DMA, ``auto``);
how kernels are launched, :mod:`~kvstate.kernels._cuda_launch`'s.

GPU tensors come in through DLPack (``cupy.from_dlpack``); bfloat16 tensors are viewed as
16-bit integers first (:mod:`kvstate._dtypes`). Host buffers are numpy arrays or CPU tensors in
page-locked memory (:meth:`CudaSwapper.pinned`, or PyTorch's ``pin_memory()``).

Per-layer cache lists are bound once (validated, their pointers uploaded): :meth:`bind` returns
a :class:`DeviceLayers` the caller may keep and pass. A list passed directly is bound on first
use and remembered by its tensors' identities through weak references, with pointers only, so
the swapper never keeps alive a cache the engine dropped; tensors that cannot be weakly
referenced are bound on every call instead.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._dtypes import as_16bit_ints, numpy_dtype
from .._errors import BlockError, ValidationError
from .._validate import check_int
from ._cuda_launch import (
    Buffer,
    DeviceLayers,
    Kernels,
    ParamRing,
    cuda_available,
    event_ptr,
    external_stream,
    load_cupy,
    stream_ptr,
    transfer_stream,
    wait_event,
)
from ._cuda_src import INLINE_IDS
from ._cuda_strategy import AUTO, STRATEGIES, Mover, choose_strategy
from ._ids import check_ids, identity_key
from ._plan import LayerSet, LayoutShape, TransferPlan, layout_shape, plan_all_layers, plan_layout_ids, plan_per_layer
from ._reference import as_numpy

__all__ = ["CudaSwapper", "SumCopier", "DeviceLayers", "STRATEGIES", "AUTO", "choose_strategy", "cuda_available",
           "load_cupy"]

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


class CudaSwapper:
    """Runs the transfer ops on one CUDA device; owns its streams and buffers.

    ``staging_bytes`` bounds the device staging area (allocated on first staged use);
    ``timeout`` bounds every host-side wait, in seconds; ``max_bound`` the cache lists
    remembered (weakly) and the host buffers known to be page-locked.
    """

    def __init__(self, device: int = 0, staging_bytes: int = 64 << 20, strategy: str = "auto",
                 timeout: float = 60.0, max_bound: int = 64, inline_ids: int = INLINE_IDS) -> None:
        cp = load_cupy()
        check_int(device, "CudaSwapper: device", minimum=0, maximum=cp.cuda.runtime.getDeviceCount() - 1)
        check_int(staging_bytes, "CudaSwapper: staging_bytes", minimum=1 << 20)
        if strategy not in STRATEGIES:
            raise ValidationError(f"CudaSwapper: strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValidationError(f"CudaSwapper: timeout must be > 0, got {timeout!r}")
        check_int(inline_ids, "CudaSwapper: inline_ids", minimum=0, maximum=INLINE_IDS)
        check_int(max_bound, "CudaSwapper: max_bound", minimum=1)
        self.cp, self.device, self.strategy, self.timeout = cp, device, strategy, float(timeout)
        self.staging_bytes, self.max_bound, self.inline_ids = staging_bytes, max_bound, inline_ids
        self._closed, self._buffers = False, list[Buffer]()  # every raw allocation this swapper made
        with cp.cuda.Device(device):
            self.stream = transfer_stream(cp)
            self._copy_stream = transfer_stream(cp)
            self._kernels = Kernels(cp)
        self._params = ParamRing(cp, self._event, self._alloc, self._release, self.wait)
        self._mover = Mover(cp, self._kernels, self._params, self._copy_stream, staging_bytes, self._alloc,
                            self.stream)
        # lists bound on use: ids -> (weak references to the tensors, pointer-only layers)
        self._bound: OrderedDict[Any, tuple[tuple[Any, ...], DeviceLayers]] = OrderedDict()
        # page-locked host arrays seen (their memory cannot change): id -> (weak ref, device ptr)
        self._pinned_seen: dict[int, tuple[Any, int]] = {}
        # (id(layers), id(host), host shape) -> weak references to both, their LayoutShape
        self._shapes: dict[tuple[int, int, Any], tuple[Any, Any, LayoutShape]] = {}
        self.calls = {s: 0 for s in STRATEGIES if s != "auto"}  #: transfers run per strategy
        self._threads = threading.local()  # .bound: this thread has the device's context current

    def bind_thread(self) -> None:
        """Bind this swapper's device's context to the calling thread once; call it first in
        any thread other than the creator's (a driver's worker). Until then a fresh thread has
        no CUDA context bound, and the runtime cannot even tell pinned host memory apart. The
        thread's current device is left as it was: an engine's thread calling a backend on
        another GPU (a step driver's) keeps computing on its own."""
        if not getattr(self._threads, "bound", False):
            runtime = self.cp.cuda.runtime
            before = runtime.getDevice()
            runtime.setDevice(self.device)
            runtime.free(0)  # binds the device's primary context to this thread
            if before != self.device:
                runtime.setDevice(before)
            self._threads.bound = True

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for queued work (within ``timeout``), then free every buffer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self.cp.cuda.Device(self.device):  # its streams and buffers are that device's, whatever the caller's
            try:
                self._wait_stream(self.stream)
                self._wait_stream(self._copy_stream)
            finally:
                for b in self._buffers:
                    b.free()
                self._buffers.clear()
                self._bound.clear()
                self._pinned_seen.clear()
                self._shapes.clear()
                self._kernels = self._params = self._mover = None  # type: ignore[assignment]
                self.stream = self._copy_stream = None

    def __enter__(self) -> CudaSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _event(self) -> Any:
        with self.cp.cuda.Device(self.device):
            return self.cp.cuda.Event(block=False, disable_timing=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ValidationError("CudaSwapper is closed")

    def _alloc(self, nbytes: int, pinned: bool) -> Buffer:
        with self.cp.cuda.Device(self.device):
            b = Buffer(self.cp, nbytes, pinned)
        self._buffers.append(b)
        return b

    def _release(self, b: Buffer | None) -> None:
        if b is not None:
            b.free()
            self._buffers.remove(b)

    @property
    def id_uploads(self) -> int:
        """Uploads of block ids to the device so far (calls with their ids inline make none)."""
        return self._params.uploads

    def pinned(self, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """A page-locked host array owned by this swapper (freed on :meth:`close`)."""
        self._check_open()
        dt = numpy_dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValidationError(f"pinned: negative dimension in {shape}")
        count = int(np.prod(shape))
        b = self._alloc(max(1, count * dt.itemsize), pinned=True)
        return b.host_array(dt, count).reshape(shape)

    # -- binding -------------------------------------------------------------------------------
    def bind(self, caches: Sequence[Any] | DeviceLayers, name: str = "caches") -> DeviceLayers:
        """Validate per-layer GPU caches once and keep their pointers on the device.

        Ops accept the result in place of the list, and the caller keeps it (it holds the
        caches). A list passed to an op directly is bound there and remembered weakly."""
        self._check_open()
        if isinstance(caches, DeviceLayers):
            if caches.device != self.device:
                raise ValidationError(f"{name} are bound to device {caches.device}, this swapper runs on {self.device}")
            return caches
        if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence) or not caches:
            raise ValidationError(f"{name} must be a non-empty list of per-layer arrays")
        views = tuple(self._gpu_view(c, f"{name}[{i}]") for i, c in enumerate(caches))
        base = LayerSet.of(list(caches), name)
        ptrs = tuple(int(v.data.ptr) for v in views)
        with self.cp.cuda.Device(self.device):
            arr = self.cp.asarray(np.asarray(ptrs, dtype=np.uint64))
        return DeviceLayers(base.arrays, base.shape, base.dtype, base.itemsize, self.device, ptrs, arr, views,
                            all(p % 16 == 0 for p in ptrs))

    def _bound_layers(self, caches: Any, name: str) -> DeviceLayers:
        """``caches`` bound: a remembered binding if these very tensors were bound before.

        An entry is keyed by its tensors' ids and dropped by a weak-reference callback the
        moment any of them is freed (before its id can be reused), so a hit needs no check."""
        if caches.__class__ is not list and caches.__class__ is not tuple or not caches:
            return self.bind(caches, name)
        key = identity_key(caches)
        hit = self._bound.get(key)
        if hit is not None:
            self._bound.move_to_end(key)
            return hit[1]
        full = self.bind(caches, name)
        table = weakref.ref(self._bound)

        def forget(_: Any, key: Any = key) -> None:
            live = table()
            if live is not None:
                live.pop(key, None)
        try:
            refs = tuple(weakref.ref(c, forget) for c in caches)
        except TypeError:
            return full  # cannot be referenced weakly: bound again on each call
        self._bound[key] = (refs, dataclasses.replace(full, arrays=(), views=()))
        while len(self._bound) > self.max_bound:
            self._bound.popitem(last=False)
        return full

    def _gpu_view(self, x: Any, name: str) -> Any:
        cp = self.cp
        if not isinstance(x, cp.ndarray):
            dev = getattr(x, "__dlpack_device__", None)
            if dev is None:
                raise ValidationError(f"{name} must be a GPU tensor (CuPy, PyTorch or Paddle), got {type(x).__name__}")
            kind, _ = dev()
            if int(kind) != _DL_CUDA:
                raise ValidationError(f"{name} is in host memory (DLPack device {int(kind)}): "
                                      "the CUDA op needs a GPU tensor here")
            try:
                x = cp.from_dlpack(as_16bit_ints(x))
            except Exception as e:  # noqa: BLE001 - framework-specific export errors
                raise ValidationError(f"{name} cannot be viewed through DLPack: {e}") from None
        if x.device.id != self.device:
            raise ValidationError(f"{name} is on GPU {x.device.id}, this swapper runs on GPU {self.device}")
        return x

    def host_pointer(self, x: Any, name: str = "host") -> tuple[np.ndarray, int]:
        """(numpy view, device-visible pointer) of a page-locked host buffer, or a
        ValidationError saying how to pin it."""
        given = x
        seen = self._pinned_seen.get(id(x))
        if seen is not None and seen[0]() is x:
            return x, seen[1]
        if not isinstance(x, np.ndarray):
            dev = getattr(x, "__dlpack_device__", None)
            if dev is not None and int(dev()[0]) not in (_DL_CPU, _DL_CUDA_HOST):
                raise ValidationError(f"{name} is GPU memory: the host side must be a pinned host buffer")
            x = as_numpy(x, name)
        ptr = x.__array_interface__["data"][0]
        if x.nbytes == 0:
            return x, ptr
        try:
            attrs = self.cp.cuda.runtime.pointerGetAttributes(ptr)
            kind, dptr = attrs.type, attrs.devicePointer
        except Exception:  # noqa: BLE001 - older runtimes raise for unregistered memory
            kind, dptr = 0, 0
        if kind != 1 or not dptr:
            raise ValidationError(f"{name} is not page-locked (pinned) host memory: allocate it with "
                                  "CudaSwapper.pinned() or pin_memory()")
        if given.__class__ is np.ndarray:
            if len(self._pinned_seen) >= self.max_bound:
                del self._pinned_seen[next(iter(self._pinned_seen))]
            self._pinned_seen[id(x)] = (weakref.ref(x), int(dptr))
        return x, int(dptr)

    # -- the ops -------------------------------------------------------------------------------
    def swap_cache_layout(self, caches: Sequence[Any] | DeviceLayers, host: Any, gpu_block_ids: Any,
                          host_block_ids: Any, direction: str, *, strategy: str | None = None) -> TransferPlan:
        """Layer-major GPU caches ⇄ block-major pinned host buffer; returns when done."""
        return self._layout(caches, host, gpu_block_ids, host_block_ids, direction, strategy, None)[0]

    def swap_cache_layout_async(self, caches: Sequence[Any] | DeviceLayers, host: Any, gpu_block_ids: Any,
                                host_block_ids: Any, direction: str, *, stream: Any = None,
                                strategy: str | None = None) -> Any:
        """Enqueue :meth:`swap_cache_layout` on ``stream`` (default: the swapper's) and return
        a CUDA event recorded after it."""
        return self._layout(caches, host, gpu_block_ids, host_block_ids, direction, strategy, stream_ptr(stream))[1]

    def swap_cache_per_layer(self, cache: Any, host_layer: Any, gpu_block_ids: Any, host_block_ids: Any,
                             direction: str, *, strategy: str | None = None) -> TransferPlan:
        """One layer, ``[N,H,B,D]`` ⇄ pinned ``[M,H,B,D]``; returns when done."""
        return self._layers([cache], [host_layer], gpu_block_ids, host_block_ids, direction, strategy,
                            None, "swap_cache_per_layer")[0]

    def swap_cache_per_layer_async(self, cache: Any, host_layer: Any, gpu_block_ids: Any, host_block_ids: Any,
                                   direction: str, *, stream: Any = None, strategy: str | None = None) -> Any:
        """Enqueue :meth:`swap_cache_per_layer` on ``stream``; returns a CUDA event after it."""
        return self._layers([cache], [host_layer], gpu_block_ids, host_block_ids, direction, strategy,
                            stream_ptr(stream), "swap_cache_per_layer")[1]

    def swap_cache_all_layers(self, caches: Sequence[Any] | DeviceLayers, host_layers: Sequence[Any],
                              gpu_block_ids: Any, host_block_ids: Any, direction: str, *,
                              strategy: str | None = None) -> TransferPlan:
        """Every layer, the same layout on both sides; returns when done."""
        return self._layers(caches, host_layers, gpu_block_ids, host_block_ids, direction, strategy,
                            None, "swap_cache_all_layers")[0]

    # -- planning and execution ------------------------------------------------------------------
    def _strategy(self, strategy: str | None) -> str:
        s = self.strategy if strategy is None else strategy
        if s not in STRATEGIES:
            raise ValidationError(f"strategy must be one of {STRATEGIES}, got {s!r}")
        return s

    def _layout(self, caches: Any, host: Any, gids: Any, hids: Any, direction: str,
                strategy: str | None, sptr: int | None) -> tuple[TransferPlan, Any]:
        if self._closed or strategy is not None:
            self._check_open()
            strategy = self._strategy(strategy)
        else:  # the hot call: open, the swapper's own (validated) strategy
            strategy = self.strategy
        layers = self._bound_layers(caches, "caches")
        host_np, hptr = self.host_pointer(host, "host")
        plan = plan_layout_ids(self._layout_shape(layers, host_np, host, direction), gids, hids, direction)
        return plan, self._run(plan, layers, (hptr,), strategy, sptr, host_np.shape[0])

    def _layout_shape(self, layers: DeviceLayers, host_np: np.ndarray, given: Any, direction: str) -> LayoutShape:
        """The arrays' checks, remembered weakly per binding and host numpy array seen together."""
        key = (id(layers), id(host_np), host_np.shape)  # a numpy array's shape can be set
        seen = self._shapes.get(key)
        if seen is not None and seen[0]() is layers and seen[1]() is host_np:
            return seen[2]
        shape = layout_shape(layers, host_np, direction)
        if given.__class__ is np.ndarray:
            if len(self._shapes) >= self.max_bound:
                del self._shapes[next(iter(self._shapes))]
            self._shapes[key] = (weakref.ref(layers), weakref.ref(host_np), shape)
        return shape

    def _layers(self, caches: Any, host_layers: Any, gids: Any, hids: Any, direction: str,
                strategy: str | None, sptr: int | None, op: str) -> tuple[TransferPlan, Any]:
        self._check_open()
        strategy = self._strategy(strategy)
        one = op == "swap_cache_per_layer"
        layers = self._bound_layers(caches, "cache" if one else "caches")
        hname = "host_layer" if one else "host_layers"
        if isinstance(host_layers, (str, bytes)) or not isinstance(host_layers, Sequence) or not host_layers:
            raise ValidationError(f"{hname} must be a non-empty list of per-layer arrays")
        pairs = [self.host_pointer(h, hname if one else f"{hname}[{i}]") for i, h in enumerate(host_layers)]
        hosts = [p[0] for p in pairs]
        if one:
            plan = plan_per_layer(layers, hosts[0], gids, hids, direction)
        else:
            plan = plan_all_layers(layers, hosts, gids, hids, direction)
        return plan, self._run(plan, layers, tuple(p[1] for p in pairs), strategy, sptr, hosts[0].shape[0])

    def _run(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], strategy: str,
             sptr: int | None, host_blocks: int) -> Any:
        """Enqueue ``plan``; ``sptr`` None means a synchronous call (waited on here)."""
        # ids go inline (as int32) for calls of up to inline_ids blocks on both sides' ranges
        inline = plan.blocks <= self.inline_ids and layers.shape[0] < 2**31 and host_blocks < 2**31
        cp = self.cp
        stream = self.stream if not sptr else external_stream(cp, sptr, self.device)
        if strategy == "auto":
            strategy = choose_strategy(plan)
        self.calls[strategy] += 1
        prev = cp.cuda.runtime.getDevice()
        if prev != self.device:
            cp.cuda.runtime.setDevice(self.device)
        ev, uploads = None, self._params.uploads
        try:
            end = self._mover.run(strategy, plan, layers, host_ptrs, stream, inline)
            if self._params.uploads != uploads:  # its ids stay until it has run, whatever the stream
                self._params.held_until(end)
            if sptr is not None:
                ev = cp.cuda.Event(block=False, disable_timing=True)
                ev.record(end)
        finally:
            if prev != self.device:
                cp.cuda.runtime.setDevice(prev)
        if sptr is None:  # the swapper's streams hold only its calls: their end is this one's
            self.wait(end)
        return ev

    def copy_blocks(self, pairs: Sequence[tuple[Sequence[Any] | DeviceLayers, Sequence[Any] | DeviceLayers]],
                    src_ids: Any, dst_ids: Any, sums: Any = None) -> Any:
        """For each ``(src, dst)`` of ``pairs`` (caches of one shape and dtype: a kind's), copy
        block ``src_ids[i]`` of every layer of ``src`` into block ``dst_ids[i]`` of ``dst`` on
        this swapper's stream, the ids checked and uploaded once for all pairs; returns the
        event after the last. ``src`` may be another process's caches mapped here through CUDA
        IPC, on another GPU: the kernel then reads them over the link between the GPUs (a
        pull). ``sums``: a zeroed CuPy uint64 array ``[pairs, ids]``, into which the same
        kernels add each copied block's SUM64 (its rows of every layer of a pair one object,
        as :func:`~kvstate.kernels._cuda_checksum.block_sums` weighs them) from the words they
        moved; rows must then be whole aligned 16-byte vectors (:meth:`copies_with_sums`)."""
        self._check_open()
        bound = [(self.bind(src, "src"), self.bind(dst, "dst")) for src, dst in pairs]
        if not bound:
            raise ValidationError("copy_blocks: no (src, dst) pair of caches to copy between")
        for s, d in bound:
            if len(s) != len(d) or s.shape != d.shape or s.itemsize != d.itemsize or s.dtype != d.dtype:
                raise ValidationError(f"copy_blocks: src ({len(s)} layers of {s.shape} {s.dtype}) and dst "
                                      f"({len(d)} layers of {d.shape} {d.dtype}) differ")
        gids, fids = self._copy_ids(bound, src_ids, dst_ids)
        self._check_sums(sums, bound, gids.size)
        with self.cp.cuda.Device(self.device):
            ev = self.cp.cuda.Event(block=False, disable_timing=True)
            # up to inline_ids ids ride in the kernels' parameters: no upload, nothing for the host to wait on
            inline = gids.size <= self.inline_ids and max(max(s.shape[0], d.shape[0]) for s, d in bound) < 2**31
            g, f = (gids, fids) if inline else self._params.upload([gids, fids], self.stream)
            for j, (s, d) in enumerate(bound):
                chunk = s.row_bytes
                if sums is not None:
                    self._kernels.launch_copy_sum(self.stream, s.ptr_array.data.ptr, d.ptr_array.data.ptr, g, f,
                                                  int(gids.size), len(s), chunk, int(sums[j].data.ptr))
                else:
                    self._kernels.launch(self.stream, s.ptr_array.data.ptr, d.ptr_array.data.ptr, 0, 0, g, f,
                                         int(gids.size), (len(s), chunk, 1), chunk, gather=True,
                                         vectors=chunk % 16 == 0 and s.aligned and d.aligned)
            if not inline and gids.size:
                self._params.held_until(self.stream)
            ev.record(self.stream)
        return ev

    def sum_copier(self, pairs: Sequence[tuple[Any, Any]]) -> SumCopier:
        """:meth:`copy_blocks` with sums between these caches, bound and checked once here (a
        pull repeats them between the same caches); see :class:`SumCopier`."""
        self._check_open()
        bound = [(self.bind(src, "src"), self.bind(dst, "dst")) for src, dst in pairs]
        if not bound or any(len(s) != len(d) or s.shape != d.shape or s.dtype != d.dtype or
                            not self.copies_with_sums(s, d) for s, d in bound):
            raise ValidationError("sum_copier: pairs of caches of one shape and dtype, rows of whole aligned 16-byte "
                                  "vectors, expected")
        return SumCopier(self, bound)

    @staticmethod
    def _copy_ids(bound: list[tuple[DeviceLayers, DeviceLayers]], src_ids: Any,
                  dst_ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """The ids as int64 arrays, checked: as many on both sides, in range of every pair,
        the destination's distinct."""
        gids, fids = (np.asarray(x, np.int64) if isinstance(x, (Sequence, np.ndarray)) else None
                      for x in (src_ids, dst_ids))
        top_s, top_d = min(s.shape[0] for s, _ in bound), min(d.shape[0] for _, d in bound)
        bad = gids is None or fids is None or gids.ndim != 1 or gids.shape != fids.shape
        if not bad and gids is not None and fids is not None and gids.size:
            try:  # one compiled pass each where it was built (a pull's ids are on a first token's path)
                check_ids(gids, top_s, "src", unique=False)
                check_ids(fids, top_d, "dst", unique=True)
            except BlockError:
                bad = True
        if bad or gids is None or fids is None:
            raise ValidationError(f"copy_blocks: block ids must be two equally long lists of ids in range, the "
                                  f"destination's distinct; got {src_ids!r:.80} and {dst_ids!r:.80}")
        return gids, fids

    def copies_with_sums(self, src: DeviceLayers, dst: DeviceLayers) -> bool:
        """Whether :meth:`copy_blocks` can take sums between these caches: rows of whole
        aligned 16-byte vectors on both sides."""
        return src.row_bytes % 16 == 0 and src.aligned and dst.aligned

    def _check_sums(self, sums: Any, bound: list[tuple[DeviceLayers, DeviceLayers]], n: int) -> None:
        if sums is None:
            return
        for s, d in bound:
            if not self.copies_with_sums(s, d):
                raise ValidationError(f"copy_blocks: sums need rows of whole aligned 16-byte vectors, got rows of "
                                      f"{s.row_bytes} bytes (aligned: src {s.aligned}, "
                                      f"dst {d.aligned})")
        want = (len(bound), n)
        if not isinstance(sums, self.cp.ndarray) or sums.dtype != np.uint64 or sums.shape != want or \
                not sums.flags.c_contiguous or sums.device.id != self.device:
            raise ValidationError(f"copy_blocks: sums must be a contiguous uint64 CuPy array of {want} on device "
                                  f"{self.device}, got {type(sums).__name__} {getattr(sums, 'shape', '')}")

    # -- waiting -------------------------------------------------------------------------------
    def wait(self, ev: Any) -> None:
        """Wait for the CUDA event (or stream) ``ev`` within ``timeout`` (:func:`wait_event`)."""
        wait_event(ev, self.timeout, "a CUDA transfer")

    def wait_on_device(self, event: Any) -> None:
        """Make work queued on this swapper's own stream from now on wait, on the device, for
        ``event`` (a CuPy or PyTorch CUDA event of this device); the host does not wait."""
        self._check_open()
        self.cp.cuda.runtime.streamWaitEvent(self.stream.ptr, event_ptr(event), 0)
        self._mover.own_foreign()

    def _wait_stream(self, stream: Any) -> None:
        if stream is None:
            return  # closed already
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        self.wait(ev)


class SumCopier:
    """:meth:`CudaSwapper.copy_blocks` with sums between pairs of bound caches
    (:meth:`CudaSwapper.sum_copier`), for a caller that uploads the ids itself, beside data of
    its own, in one copy: :meth:`check` the ids, upload the arrays it answers on the
    swapper's stream, then :meth:`launch`. One caller at a time (a rank's pulls hold its lock)."""

    def __init__(self, swapper: CudaSwapper, bound: list[tuple[DeviceLayers, DeviceLayers]]) -> None:
        self.swapper, self.bound = swapper, bound
        self._kernels = [(s.ptr_array.data.ptr, d.ptr_array.data.ptr, len(s), s.row_bytes) for s, d in bound]
        self._checked: np.ndarray | None = None

    def check(self, src_ids: Any, dst_ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """The ids as int64 arrays, checked as :meth:`CudaSwapper.copy_blocks` checks them."""
        self._checked = None  # a check that fails leaves nothing to launch
        gids, fids = self.swapper._copy_ids(self.bound, src_ids, dst_ids)
        self._checked = gids
        return gids, fids

    def launch(self, ids_at: int, sums_at: int) -> None:
        """Queue the copies of the ids :meth:`check` answered last, the caller having queued
        their upload (source ids, then destination ids) to device address ``ids_at`` on the
        swapper's stream; each block's SUM64 goes into ``[pairs, n]`` zeroed uint64 at
        ``sums_at``."""
        sw, gids = self.swapper, self._checked
        if gids is None:
            raise ValidationError("SumCopier.launch: check the ids first")
        sw._check_open()
        self._checked, n = None, int(gids.size)
        for j, (sp, dp, layers, chunk) in enumerate(self._kernels):
            sw._kernels.launch_copy_sum(sw.stream, sp, dp, ids_at, ids_at + 8 * n, n, layers, chunk,
                                        sums_at + 8 * n * j)

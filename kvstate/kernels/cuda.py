"""The CUDA implementation of the transfer ops, over CuPy, PyTorch and Paddle GPU tensors.

A :class:`CudaSwapper` owns everything a transfer needs on one device — its streams, the
compiled kernel, a small ring of pinned/device parameter slots for block ids, an optional
device staging area — and releases all of it on :meth:`CudaSwapper.close` (or on leaving a
``with`` block). Nothing lives at module level.

Arguments are validated by :mod:`kvstate.kernels.plan` exactly as in the numpy reference,
then by the GPU-specific rules (the caches on this device, the host buffer page-locked),
before a byte moves. Three ways to move the bytes, picked per shape by :data:`AUTO`
(figures in docs/benchmarks.md) or forced with ``strategy=``:

- ``zero_copy`` — one kernel reads the GPU blocks and writes the pinned host buffer directly
  (or the reverse), 16 bytes per access on the host side;
- ``staged`` — the same kernel gathers into device staging, DMA engines move it (pipelined
  in pieces on a second stream, so gathering piece *k+1* overlaps the DMA of piece *k*);
- ``dma`` — strided DMA, one ``cudaMemcpy2DAsync`` per layer and run of consecutive ids.

Kernels are launched through the driver API (``cuLaunchKernel``) from a parameter block each
kernel keeps and refills, and a call of at most ``inline_ids`` blocks passes its block ids in
the kernel's parameters: such a call is one launch, with no id upload before it.

GPU tensors come in through DLPack (``cupy.from_dlpack``); bfloat16 tensors are viewed as
16-bit integers first (CuPy has no bfloat16). Host buffers are numpy arrays or CPU tensors
in page-locked memory (:meth:`CudaSwapper.pinned`, or PyTorch's ``pin_memory()``).
"""
from __future__ import annotations

import ctypes
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, DriverError, ValidationError
from ..validate import check_int
from .cuda_src import INLINE_IDS, KERNEL_SOURCE, SPAN_PIECE
from .plan import LayerSet, TransferPlan, plan_all_layers, plan_layout, plan_per_layer
from ..dtypes import as_16bit_ints, numpy_dtype
from .reference import as_numpy

__all__ = ["STRATEGIES", "AUTO", "CudaSwapper", "DeviceLayers", "cuda_available", "load_cupy",
           "choose_strategy"]

STRATEGIES = ("auto", "zero_copy", "staged", "dma")

#: How ``auto`` picks, from the H100 measurements in docs/benchmarks.md: strided DMA when few
#: calls move big chunks (53-54 GB/s at 128 KiB, contiguous ids) and each call moves enough to
#: hide its host cost (a CudaBackend piece of 4 blocks would issue 64 DMAs for 32 MiB); staging + pipelined DMA for
#: large transfers whose host side is in few runs (53 GB/s at 128 KiB random, 48 at 16 KiB);
#: the zero-copy kernel below that (it wins at 1 KiB and at odd sizes, where a call is short).
AUTO = {
    "dma_min_chunk": 64 * 1024,    # chunk bytes at or above which strided DMA is considered
    "dma_max_calls": 64,           # at most this many DMA calls (runs x layers) ...
    "dma_min_call_bytes": 4 << 20,  # ... each moving at least this much: issuing one costs ~10 us
                                    # of host time, which a small call (a backend's piece) can't hide
    "staged_min_bytes": 32 << 20,  # transfers at least this big go through staging (its pieces'
                                   # events cost ~0.1 ms of host per call) ...
    "staged_max_runs": 16,         # ... when the host side is in at most this many runs
}

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3
_H2D, _D2H = 1, 2  # cudaMemcpyKind
_THREADS = 256
_PARAM_SLOTS = 4


def load_cupy() -> Any:
    """Import CuPy and check that a CUDA device is present, or raise :class:`ConfigError`."""
    try:
        import cupy
    except ImportError:
        raise ConfigError("the CUDA ops need CuPy: pip install cupy-cuda13x (or cupy-cuda12x)") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError, driver missing
        raise ConfigError(f"no usable CUDA device: {e}") from None
    if count == 0:
        raise ConfigError("no CUDA device is present")
    return cupy


def cuda_available() -> bool:
    """Whether CuPy imports and sees a CUDA device."""
    try:
        load_cupy()
    except ConfigError:
        return False
    return True


def choose_strategy(plan: TransferPlan) -> str:
    """The ``auto`` choice for ``plan`` (see :data:`AUTO`)."""
    if plan.chunk_bytes >= AUTO["dma_min_chunk"]:
        calls = plan.num_runs * plan.layers
        if calls <= AUTO["dma_max_calls"] and plan.bytes >= calls * AUTO["dma_min_call_bytes"]:
            return "dma"
    if plan.bytes >= AUTO["staged_min_bytes"]:
        if plan.num_host_runs <= AUTO["staged_max_runs"]:
            return "staged"
    return "zero_copy"


@dataclass(frozen=True, eq=False)
class DeviceLayers(LayerSet):
    """A :class:`LayerSet` on one GPU, with its layers' pointers in device memory."""

    device: int = 0
    ptrs: tuple[int, ...] = ()  #: host copy of the layer pointers
    ptr_array: Any = None  #: the same pointers as a CuPy uint64 array
    views: tuple[Any, ...] = ()  #: CuPy views keeping the tensors' memory referenced
    aligned: bool = False  #: every layer starts on a 16-byte boundary


def _stream_ptr(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):  # CuPy, PyTorch
        p = getattr(stream, attr, None)
        if isinstance(p, int):
            return p
    raise ValidationError(f"stream must be a CuPy or PyTorch stream or a raw pointer, got {type(stream).__name__}")


def _async(stream: Any) -> int:
    """The stream pointer of an async call: 0 means the swapper's own stream."""
    return _stream_ptr(stream)


class _ExtStream:
    """A raw stream pointer in the CUDA stream protocol, for ``Stream.from_external``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _external(cp: Any, ptr: int, device: int) -> Any:
    """A CuPy view of a foreign stream (CuPy 14 spells it ``Stream.from_external``)."""
    fe = getattr(cp.cuda.Stream, "from_external", None)
    if fe is not None:
        try:
            return fe(_ExtStream(ptr))
        except (TypeError, ValueError, AttributeError):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cp.cuda.ExternalStream(ptr, device)


class _Buffer:
    """One raw allocation (device or pinned host), freed exactly once."""

    def __init__(self, cp: Any, nbytes: int, pinned: bool) -> None:
        self.cp, self.nbytes, self.pinned = cp, nbytes, pinned
        rt = cp.cuda.runtime
        self.ptr = rt.hostAlloc(nbytes, 0) if pinned else rt.malloc(nbytes)

    def host_array(self, dtype: Any, count: int | None = None) -> np.ndarray:
        raw = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dtype, count=-1 if count is None else count)

    def free(self) -> None:
        if self.ptr:
            rt = self.cp.cuda.runtime
            (rt.freeHost if self.pinned else rt.free)(self.ptr)
            self.ptr = 0


class _IdList(ctypes.Structure):
    """The kernels' ``IdList`` parameter (see :mod:`kvstate.kernels.cuda_src`)."""

    _fields_ = [("n", ctypes.c_int32), ("has_f", ctypes.c_int32),
                ("g", ctypes.c_int32 * INLINE_IDS), ("f", ctypes.c_int32 * INLINE_IDS)]


def _driver_launch(cp: Any) -> Any:
    """``cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)``: CuPy's
    binding, else libcuda's through ctypes."""
    fn = getattr(getattr(cp.cuda, "driver", None), "launchKernel", None)
    if fn is not None:
        return fn
    lib = ctypes.CDLL("libcuda.so.1")
    c_launch = lib.cuLaunchKernel
    u = ctypes.c_uint
    c_launch.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    c_launch.restype = ctypes.c_int

    def launch(*args: Any) -> None:
        rc = c_launch(*args)
        if rc:
            raise DriverError(f"cuLaunchKernel failed with CUDA error {rc}")
    return launch


class _Kernel:
    """One kernel and the parameter block it is launched from.

    ``cuLaunchKernel`` copies the parameters when called, so the block is refilled for the
    next launch at once: a launch is a few stores and one call, with no per-argument work.
    """

    def __init__(self, func: Any, scalars: int, inline: bool, launch: Any) -> None:
        handle = getattr(func, "ptr", None)
        if handle is None:  # a RawKernel: its compiled Function holds the CUfunction
            handle = func.kernel.ptr
        self.func, self.fptr, self.launch = func, int(handle), launch
        self.vals = (ctypes.c_uint64 * scalars)()
        addrs = [ctypes.addressof(self.vals) + 8 * i for i in range(scalars)]
        self.ids: _IdList | None = None
        if inline:
            self.ids = _IdList()
            addrs.append(ctypes.addressof(self.ids))
            self.g = np.frombuffer(self.ids.g, dtype=np.int32)
            self.f = np.frombuffer(self.ids.f, dtype=np.int32)
        self.params = (ctypes.c_void_p * len(addrs))(*addrs)
        self.pptr = ctypes.addressof(self.params)

    def __call__(self, grid: tuple[int, int, int], threads: int, shared: int, stream_ptr: int,
                 values: Sequence[int], gids: np.ndarray | None = None, fids: np.ndarray | None = None) -> None:
        self.vals[:len(values)] = values
        if gids is not None:
            ids, n = self.ids, len(gids)
            ids.n = n
            self.g[:n] = gids
            if fids is None:
                ids.has_f = 0
            else:
                ids.has_f = 1
                self.f[:n] = fids
        self.launch(self.fptr, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream_ptr, self.pptr, 0)


class CudaSwapper:
    """Runs the transfer ops on one CUDA device; owns its streams and buffers.

    ``staging_bytes`` bounds the device staging area (allocated on first staged use);
    ``timeout`` bounds every host-side wait, in seconds.
    """

    def __init__(self, device: int = 0, staging_bytes: int = 64 << 20, strategy: str = "auto",
                 timeout: float = 60.0, max_bound: int = 64, inline_ids: int = INLINE_IDS) -> None:
        cp = load_cupy()
        if not isinstance(device, int) or not 0 <= device < cp.cuda.runtime.getDeviceCount():
            raise ValidationError(f"CudaSwapper: device {device!r} does not exist")
        if not isinstance(staging_bytes, int) or staging_bytes < 1 << 20:
            raise ValidationError(f"CudaSwapper: staging_bytes must be an int >= 1 MiB, got {staging_bytes!r}")
        if strategy not in STRATEGIES:
            raise ValidationError(f"CudaSwapper: strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not timeout > 0:
            raise ValidationError(f"CudaSwapper: timeout must be > 0, got {timeout!r}")
        check_int(inline_ids, "CudaSwapper: inline_ids", minimum=0, maximum=INLINE_IDS)
        self.inline_ids = inline_ids
        self.cp, self.device, self.strategy, self.timeout = cp, device, strategy, float(timeout)
        self.staging_bytes, self.max_bound = staging_bytes, max_bound
        self._closed = False
        self._buffers: list[_Buffer] = []  # every raw allocation this swapper made
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._copy_stream = cp.cuda.Stream(non_blocking=True)
            self._module = cp.RawModule(code=KERNEL_SOURCE, options=("-std=c++17",))
            launch = _driver_launch(cp)
            get = self._module.get_function
            self._kchunks = _Kernel(get("kv_chunks"), 10, False, launch)
            self._kchunks_i = _Kernel(get("kv_chunks_i"), 8, True, launch)
            self._kspan = _Kernel(get("kv_span"), 11, False, launch)
            self._kspan_i = _Kernel(get("kv_span_i"), 9, True, launch)
            self._sms = cp.cuda.Device(device).attributes["MultiProcessorCount"]
        self._bound: OrderedDict[tuple[int, ...], DeviceLayers] = OrderedDict()
        # host arrays already found page-locked: id -> (weak reference, device pointer); an
        # array's memory cannot change under it, so a live array seen before is not re-asked
        self._pinned_seen: dict[int, tuple[Any, int]] = {}
        self._staging: _Buffer | None = None
        self._param_host: _Buffer | None = None
        self._param_view: np.ndarray | None = None  # the pinned parameter slots as int64
        self._param_dev: _Buffer | None = None
        self._param_slot_bytes = 0
        self._param_events = [self._event() for _ in range(_PARAM_SLOTS)]
        self._param_used = [False] * _PARAM_SLOTS
        self._param_next = 0
        self._done = self._event()  # recorded after each synchronous op
        self.calls = {s: 0 for s in STRATEGIES if s != "auto"}  #: transfers run per strategy

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for queued work (within ``timeout``), then free every buffer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wait_stream(self.stream)
            self._wait_stream(self._copy_stream)
        finally:
            for b in self._buffers:
                b.free()
            self._buffers.clear()
            self._bound.clear()
            self._pinned_seen.clear()
            self._staging = self._param_host = self._param_dev = self._param_view = None
            self._module = self._kchunks = self._kspan = self._kchunks_i = self._kspan_i = None
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

    def _alloc(self, nbytes: int, pinned: bool) -> _Buffer:
        with self.cp.cuda.Device(self.device):
            b = _Buffer(self.cp, nbytes, pinned)
        self._buffers.append(b)
        return b

    def _release(self, b: _Buffer | None) -> None:
        if b is not None:
            b.free()
            self._buffers.remove(b)

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

        Ops accept the result in place of the list; a list passed directly is bound on first
        use and remembered (up to ``max_bound`` lists).
        """
        self._check_open()
        if isinstance(caches, DeviceLayers):
            if caches.device != self.device:
                raise ValidationError(f"{name} are bound to device {caches.device}, this swapper runs on {self.device}")
            return caches
        if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence) or not caches:
            raise ValidationError(f"{name} must be a non-empty list of per-layer arrays")
        key = tuple(map(id, caches))
        hit = self._bound.get(key)
        if hit is not None:
            self._bound.move_to_end(key)
            return hit
        views = tuple(self._gpu_view(c, f"{name}[{i}]") for i, c in enumerate(caches))
        base = LayerSet.of(list(caches), name)
        ptrs = tuple(int(v.data.ptr) for v in views)
        with self.cp.cuda.Device(self.device):
            arr = self.cp.asarray(np.asarray(ptrs, dtype=np.uint64))
        bound = DeviceLayers(base.arrays, base.shape, base.dtype, base.itemsize, self.device, ptrs, arr, views,
                             all(p % 16 == 0 for p in ptrs))
        self._bound[key] = bound
        while len(self._bound) > self.max_bound:
            self._bound.popitem(last=False)
        return bound

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

    def _host_ptr(self, x: Any, name: str) -> tuple[np.ndarray, int]:
        """(numpy view, device-visible pointer) of a pinned host buffer."""
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
        return self._layout(caches, host, gpu_block_ids, host_block_ids, direction, strategy, _async(stream))[1]

    def swap_cache_per_layer(self, cache: Any, host_layer: Any, gpu_block_ids: Any, host_block_ids: Any,
                             direction: str, *, strategy: str | None = None) -> TransferPlan:
        """One layer, ``[N,H,B,D]`` ⇄ pinned ``[M,H,B,D]``; returns when done."""
        return self._layers([cache], [host_layer], gpu_block_ids, host_block_ids, direction, strategy,
                            None, "swap_cache_per_layer")[0]

    def swap_cache_per_layer_async(self, cache: Any, host_layer: Any, gpu_block_ids: Any, host_block_ids: Any,
                                   direction: str, *, stream: Any = None, strategy: str | None = None) -> Any:
        """Enqueue :meth:`swap_cache_per_layer` on ``stream``; returns a CUDA event after it."""
        return self._layers([cache], [host_layer], gpu_block_ids, host_block_ids, direction, strategy,
                            _async(stream), "swap_cache_per_layer")[1]

    def swap_cache_all_layers(self, caches: Sequence[Any] | DeviceLayers, host_layers: Sequence[Any],
                              gpu_block_ids: Any, host_block_ids: Any, direction: str, *,
                              strategy: str | None = None) -> TransferPlan:
        """Every layer, the same layout on both sides; returns when done."""
        return self._layers(caches, host_layers, gpu_block_ids, host_block_ids, direction, strategy,
                            None, "swap_cache_all_layers")[0]

    # -- planning ------------------------------------------------------------------------------
    def _strategy(self, strategy: str | None) -> str:
        s = self.strategy if strategy is None else strategy
        if s not in STRATEGIES:
            raise ValidationError(f"strategy must be one of {STRATEGIES}, got {s!r}")
        return s

    def _layout(self, caches: Any, host: Any, gids: Any, hids: Any, direction: str,
                strategy: str | None, stream: Any) -> tuple[TransferPlan, Any]:
        self._check_open()
        strategy = self._strategy(strategy)
        sptr = stream
        layers = self.bind(caches)
        host_np, hptr = self._host_ptr(host, "host")
        plan = plan_layout(layers, host_np, gids, hids, direction)
        return plan, self._run(plan, layers, (hptr,), strategy, sptr, host_np.shape[0])

    def _layers(self, caches: Any, host_layers: Any, gids: Any, hids: Any, direction: str,
                strategy: str | None, stream: Any, op: str) -> tuple[TransferPlan, Any]:
        self._check_open()
        strategy = self._strategy(strategy)
        sptr = stream
        layers = self.bind(caches, "cache" if op == "swap_cache_per_layer" else "caches")
        hname = "host_layer" if op == "swap_cache_per_layer" else "host_layers"
        if isinstance(host_layers, (str, bytes)) or not isinstance(host_layers, Sequence) or not host_layers:
            raise ValidationError(f"{hname} must be a non-empty list of per-layer arrays")
        pairs = [self._host_ptr(h, hname if op == "swap_cache_per_layer" else f"{hname}[{i}]")
                 for i, h in enumerate(host_layers)]
        hosts = [p[0] for p in pairs]
        if op == "swap_cache_per_layer":
            plan = plan_per_layer(layers, hosts[0], gids, hids, direction)
        else:
            plan = plan_all_layers(layers, hosts, gids, hids, direction)
        return plan, self._run(plan, layers, tuple(p[1] for p in pairs), strategy, sptr, hosts[0].shape[0])

    # -- execution -----------------------------------------------------------------------------
    def _run(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], strategy: str,
             sptr: int | None, host_blocks: int) -> Any:
        """Enqueue ``plan``; ``sptr`` None means a synchronous call (waited on here)."""
        # ids go inline (as int32) for calls of up to inline_ids blocks on both sides' ranges
        inline = plan.blocks <= self.inline_ids and layers.shape[0] < 2**31 and host_blocks < 2**31
        cp = self.cp
        stream = self.stream if not sptr else _external(cp, sptr, self.device)
        if strategy == "auto":
            strategy = choose_strategy(plan)
        self.calls[strategy] += 1
        switch = cp.cuda.runtime.getDevice() != self.device
        if switch:
            prev = cp.cuda.runtime.getDevice()
            cp.cuda.runtime.setDevice(self.device)
        try:
            if plan.blocks:
                if strategy == "dma":
                    self._dma(plan, layers, host_ptrs, stream)
                elif strategy == "staged":
                    self._staged(plan, layers, host_ptrs, stream, inline)
                else:
                    self._zero_copy(plan, layers, host_ptrs, stream, inline)
            ev = self._done if sptr is None else cp.cuda.Event(block=False, disable_timing=True)
            ev.record(stream)
        finally:
            if switch:
                cp.cuda.runtime.setDevice(prev)
        if sptr is None:
            self.wait(ev)
        return ev

    def _geometry(self, plan: TransferPlan) -> tuple[int, int, int]:
        """(groups, span, layers_per_span) of the flat (host-side) layout."""
        if plan.host_block_contiguous:
            return 1, plan.layers * plan.chunk_bytes, plan.layers
        return plan.layers, plan.chunk_bytes, 1

    def _params(self, arrays: Sequence[np.ndarray], stream: Any) -> list[int]:
        """Copy small int64 arrays to the device on ``stream``; returns their device pointers."""
        need = sum(a.size for a in arrays) * 8
        if need > self._param_slot_bytes:
            for used, ev in zip(self._param_used, self._param_events):
                if used:
                    self.wait(ev)
            self._release(self._param_host)
            self._release(self._param_dev)
            slot = max(64 << 10, 1 << (need - 1).bit_length())
            self._param_host = self._alloc(slot * _PARAM_SLOTS, pinned=True)
            self._param_view = self._param_host.host_array(np.int64)
            self._param_dev = self._alloc(slot * _PARAM_SLOTS, pinned=False)
            self._param_slot_bytes = slot
            self._param_used = [False] * _PARAM_SLOTS
        s = self._param_next
        self._param_next = (s + 1) % _PARAM_SLOTS
        ev = self._param_events[s]
        if self._param_used[s]:
            self.wait(ev)  # the slot's previous upload must have left the pinned buffer
        base = s * self._param_slot_bytes
        host = self._param_view[base // 8: (base + self._param_slot_bytes) // 8]
        ptrs, off = [], 0
        for a in arrays:
            host[off: off + a.size] = a
            ptrs.append(self._param_dev.ptr + base + off * 8)
            off += a.size
        self.cp.cuda.runtime.memcpyAsync(self._param_dev.ptr + base, self._param_host.ptr + base, off * 8,
                                         _H2D, stream.ptr)
        ev.record(stream)
        self._param_used[s] = True
        return ptrs

    def _launch(self, stream: Any, layer_ptrs: int, flat_ptrs: int, flat_base: int, group_stride: int,
                gids: int | np.ndarray, fids: int | np.ndarray | None, n: int, groups: int, span: int,
                chunk: int, lps: int, gather: bool, vectors: bool = False) -> None:
        """Launch the copy; ``vectors`` when every chunk is whole aligned 16-byte vectors.

        ``gids``/``fids`` are device pointers (``fids`` 0: entry i goes to flat position i), or
        numpy arrays of at most ``INLINE_IDS`` ids (``fids`` None: position i), passed inline."""
        if n == 0:
            return
        inline = isinstance(gids, np.ndarray)
        if vectors and groups * lps <= 65535:
            units = chunk // 16
            threads = min(_THREADS, max(32, -(-units // 32) * 32))
            grid, shared = (n, groups * lps, 1), 0
            if inline:  # every parameter of the kernels is 64-bit: plain ints are passed as such
                self._kchunks_i(grid, threads, 0, stream.ptr, (layer_ptrs, flat_ptrs, flat_base, group_stride,
                                                             span, chunk, lps, int(gather)), gids, fids)
            else:
                self._kchunks(grid, threads, 0, stream.ptr, (layer_ptrs, flat_ptrs, flat_base, group_stride,
                                                           gids, fids, span, chunk, lps, int(gather)))
            return
        # any chunk size: pieces of a span through shared memory
        pieces = -(-span // SPAN_PIECE)
        if span >= 2**31 or groups > 65535 or pieces > 65535:
            raise ValidationError(f"a block's span of {span} bytes in {groups} groups is beyond the "
                                  "kernels' grid (spans under 1 GiB, at most 65,535 layers)")
        grid, shared = (n, groups, pieces), SPAN_PIECE + 16
        if inline:
            self._kspan_i(grid, _THREADS, shared, stream.ptr, (layer_ptrs, flat_ptrs, flat_base, group_stride,
                                                               span, chunk, lps, SPAN_PIECE, int(gather)), gids, fids)
        else:
            self._kspan(grid, _THREADS, shared, stream.ptr, (layer_ptrs, flat_ptrs, flat_base, group_stride, gids,
                                                             fids, span, chunk, lps, SPAN_PIECE, int(gather)))

    def _zero_copy(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], stream: Any,
                   inline: bool) -> None:
        groups, span, lps = self._geometry(plan)
        aligned = span % 16 == 0 and (host_ptrs[0] % 16 == 0 if len(host_ptrs) == 1
                                      else all(p % 16 == 0 for p in host_ptrs))
        vectors = aligned and layers.aligned and plan.chunk_bytes % 16 == 0
        d2h = plan.direction == "d2h"
        if inline and len(host_ptrs) == 1:  # one launch, ids inline
            self._launch(stream, layers.ptr_array.data.ptr, 0, host_ptrs[0], 0, plan.gpu_ids, plan.host_ids,
                         plan.blocks, groups, span, plan.chunk_bytes, lps, d2h, vectors)
            return
        gptr, fptr, hptr = self._params([plan.gpu_ids, plan.host_ids, np.asarray(host_ptrs, np.int64)], stream)
        self._launch(stream, layers.ptr_array.data.ptr, hptr, 0, 0, gptr, fptr, plan.blocks, groups, span,
                     plan.chunk_bytes, lps, d2h, vectors)

    def _dma(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], stream: Any) -> None:
        rt = self.cp.cuda.runtime
        c, L = plan.chunk_bytes, plan.layers
        d2h = plan.direction == "d2h"
        for g0, h0, n in plan.runs:
            for layer in range(L):
                gp = layers.ptrs[layer] + g0 * c
                if plan.host_block_contiguous:
                    hp = host_ptrs[0] + h0 * L * c + layer * c
                    if d2h:
                        rt.memcpy2DAsync(hp, L * c, gp, c, c, n, _D2H, stream.ptr)
                    else:
                        rt.memcpy2DAsync(gp, c, hp, L * c, c, n, _H2D, stream.ptr)
                else:
                    hp = host_ptrs[layer] + h0 * c
                    if d2h:
                        rt.memcpyAsync(hp, gp, n * c, _D2H, stream.ptr)
                    else:
                        rt.memcpyAsync(gp, hp, n * c, _H2D, stream.ptr)

    def _staged(self, plan: TransferPlan, layers: DeviceLayers, host_ptrs: tuple[int, ...], stream: Any,
                inline: bool) -> None:
        """Kernel ⇄ device staging, DMA ⇄ host, in pieces over a ring of staging slots."""
        cp, rt = self.cp, self.cp.cuda.runtime
        groups, span, lps = self._geometry(plan)
        if self._staging is None:
            self._staging = self._alloc(self.staging_bytes, pinned=False)
        nslots = 4
        slot_bytes = (self.staging_bytes // nslots) & ~255
        per_piece = max(1, slot_bytes // (span * groups))
        if per_piece * span * groups > slot_bytes:
            raise ValidationError(f"staging_bytes {self.staging_bytes} cannot hold one block "
                                  f"({span * groups} bytes per block in {nslots} slots): raise staging_bytes")
        n = plan.blocks
        # few, large pieces for big transfers, at least 4 when there is enough to overlap
        per_piece = min(per_piece, max(1, -(-n // 4))) if n * span * groups >= (8 << 20) else per_piece
        gptr = 0 if inline else self._params([plan.gpu_ids], stream)[0]
        d2h = plan.direction == "d2h"
        vectors = layers.aligned and plan.chunk_bytes % 16 == 0
        copy = self._copy_stream
        start = cp.cuda.Event(block=False, disable_timing=True)
        start.record(stream)
        copy.wait_event(start)
        slot_free: list[Any] = [None] * nslots
        host_runs = plan.host_runs
        for k, e0 in enumerate(range(0, n, per_piece)):
            e1 = min(n, e0 + per_piece)
            m = e1 - e0
            slot = k % nslots
            sp = self._staging.ptr + slot * slot_bytes
            stride = m * span  # bytes between groups in the slot
            if d2h:
                if slot_free[slot] is not None:
                    stream.wait_event(slot_free[slot])
                self._launch(stream, layers.ptr_array.data.ptr, 0, sp, stride,
                             plan.gpu_ids[e0:e1] if inline else gptr + e0 * 8, None if inline else 0, m, groups,
                             span, plan.chunk_bytes, lps, True, vectors)
                ready = cp.cuda.Event(block=False, disable_timing=True)
                ready.record(stream)
                copy.wait_event(ready)
                self._dma_runs(rt, host_runs, e0, e1, sp, stride, span, host_ptrs, groups, _D2H, copy)
                freed = cp.cuda.Event(block=False, disable_timing=True)
                freed.record(copy)
                slot_free[slot] = freed
            else:
                if slot_free[slot] is not None:
                    copy.wait_event(slot_free[slot])
                self._dma_runs(rt, host_runs, e0, e1, sp, stride, span, host_ptrs, groups, _H2D, copy)
                ready = cp.cuda.Event(block=False, disable_timing=True)
                ready.record(copy)
                stream.wait_event(ready)
                self._launch(stream, layers.ptr_array.data.ptr, 0, sp, stride,
                             plan.gpu_ids[e0:e1] if inline else gptr + e0 * 8, None if inline else 0, m, groups,
                             span, plan.chunk_bytes, lps, False, vectors)
                freed = cp.cuda.Event(block=False, disable_timing=True)
                freed.record(stream)
                slot_free[slot] = freed
        if d2h:  # the caller's stream continues after the last DMA
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(copy)
            stream.wait_event(done)

    @staticmethod
    def _dma_runs(rt: Any, host_runs: tuple[tuple[int, int, int], ...], e0: int, e1: int, sp: int, stride: int,
                  span: int, host_ptrs: tuple[int, ...], groups: int, kind: int, copy: Any) -> None:
        """DMA the host runs that fall in entries ``[e0, e1)`` between a staging slot and host."""
        for pos, h0, length in host_runs:
            a, b = max(pos, e0), min(pos + length, e1)
            if a >= b:
                continue
            for g in range(groups):
                hp = host_ptrs[g] + (h0 + a - pos) * span
                dp = sp + g * stride + (a - e0) * span
                if kind == _D2H:
                    rt.memcpyAsync(hp, dp, (b - a) * span, _D2H, copy.ptr)
                else:
                    rt.memcpyAsync(dp, hp, (b - a) * span, _H2D, copy.ptr)

    # -- waiting -------------------------------------------------------------------------------
    def wait(self, ev: Any) -> None:
        """Wait for the CUDA event ``ev`` (spin briefly, then back off) within ``timeout``;
        a :class:`~kvstate.errors.DriverError` past it."""
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not ev.done:
            spins += 1
            if spins > 2000:
                if time.monotonic() > deadline:
                    raise DriverError(f"a CUDA transfer did not finish within {self.timeout} s")
                time.sleep(min(1e-3, 1e-6 * spins / 100))

    def _wait_stream(self, stream: Any) -> None:
        if stream is None:
            return
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        self.wait(ev)

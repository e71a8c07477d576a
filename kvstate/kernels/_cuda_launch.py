"""Launch plumbing of the CUDA transfer kernels: CuPy, raw buffers, streams, parameter blocks.

- :func:`load_cupy` imports CuPy and checks a device is there, with errors that say what to do.
- :class:`Buffer` is one raw allocation (device, or page-locked host), freed exactly once by
  whoever made it (a :class:`~kvstate.kernels._cuda.CudaSwapper` frees all of its own on close).
- :class:`Kernels` compiles the kernels of :mod:`~kvstate.kernels._cuda_src` for one device and
  launches them through the driver API (``cuLaunchKernel``) from a parameter block each kernel
  keeps and refills: a launch is a few stores and one call, with no per-argument work. A call of
  at most ``INLINE_IDS`` blocks passes its ids inside the parameters (a ``__grid_constant__``
  ``IdList``), so it needs no upload before the kernel.
- :class:`ParamRing` uploads the ids of larger calls through a small ring of pinned and device
  slots, each reused only after the call that last uploaded into it has run (on whatever
  stream: a staged call's last kernels read their ids long after the upload).
- :func:`transfer_stream` makes the streams transfers and checksums run on: non-blocking, at
  the device's highest priority, so their short kernels go ahead of an engine's queued GEMM
  blocks instead of waiting behind a forward (a layer-wise save runs beside one).
- :func:`register_host` pins host memory made elsewhere (an arena store's shared slots) once
  per process, counting its users; :func:`unregister_host` lets it go with the last.
"""
from __future__ import annotations

import ctypes
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import ConfigError, DriverError, ValidationError
from ._cuda_src import INLINE_IDS, KERNEL_SOURCE, SPAN_PIECE
from ._ids import narrow_into
from ._plan import LayerSet

__all__ = ["load_cupy", "cuda_available", "stream_ptr", "event_ptr", "wait_event", "EVENT_TIMEOUT_S",
           "external_stream", "Buffer", "Kernels", "DeviceLayers", "ParamRing", "H2D", "D2H", "register_host",
           "unregister_host", "transfer_stream", "stream_wait_value"]

H2D, D2H = 1, 2  # cudaMemcpyKind
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


def stream_ptr(stream: Any) -> int:
    """The raw pointer of a CuPy or PyTorch stream (or of a raw pointer: itself); 0 for None."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):  # CuPy, PyTorch
        p = getattr(stream, attr, None)
        if isinstance(p, int):
            return p
    raise ValidationError(f"stream must be a CuPy or PyTorch stream or a raw pointer, got {type(stream).__name__}")


def event_ptr(event: Any) -> int:
    """The raw handle of a CuPy or PyTorch CUDA event (PyTorch creates it when first recorded)."""
    for attr in ("ptr", "cuda_event"):  # CuPy, PyTorch
        p = getattr(event, attr, None)
        if isinstance(p, int) and p:
            return p
    raise ValidationError(f"expected a recorded CuPy or PyTorch CUDA event, got {type(event).__name__}")


#: the default limit of :func:`wait_event` (the CUDA backend's transfer timeout's default): a
#: transfer or a few layers' compute that has not finished by then is taken as a hung GPU
EVENT_TIMEOUT_S = 60.0


#: seconds a wait looks at its event without sleeping (yielding between looks): a transfer's end
#: is usually that close, and a sleep, rounded up by the kernel's timer slack (50 µs), would
#: add its rounding to every short transfer, a first token's pull among them
SPIN_S = 0.005


def wait_event(event: Any, timeout: float = EVENT_TIMEOUT_S, what: str = "a CUDA event") -> None:
    """Wait on the host for a CuPy event or stream (``done``) or a PyTorch one (``query()``)
    within ``timeout`` seconds: for ``SPIN_S`` look again at once, yielding the GIL and the
    core between looks (``sleep(0)``), then back off to sleeps of up to 1 ms. A GPU that never
    gets there raises :class:`~kvstate._errors.DriverError` instead of hanging the waiting
    thread."""
    done: Callable[[], bool] = (lambda: bool(event.done)) if hasattr(event, "done") else event.query
    if done():
        return
    now = time.monotonic()
    deadline, spin_end, pause = now + timeout, now + SPIN_S, 5e-5
    while not done():
        now = time.monotonic()
        if now < spin_end:
            time.sleep(0)
            continue
        if now > deadline:
            raise DriverError(f"{what} did not finish within {timeout} s")
        time.sleep(pause)
        pause = min(1e-3, 2 * pause)


class _ExtStream:
    """A raw stream pointer in the CUDA stream protocol, for ``Stream.from_external``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def transfer_stream(cp: Any) -> Any:
    """A non-blocking stream of the current device at its highest priority (see the rules;
    at the default priority where this CuPy makes no prioritized stream)."""
    try:
        return cp.cuda.Stream(non_blocking=True, priority=_greatest_priority(cp))
    except TypeError:  # pragma: no cover - a CuPy before stream priorities
        return cp.cuda.Stream(non_blocking=True)


def _greatest_priority(cp: Any) -> int:
    """The current context's highest stream priority (CUDA counts down: -5 on recent GPUs),
    from CuPy where it has the call, else libcuda's ``cuCtxGetStreamPriorityRange``."""
    fn = getattr(cp.cuda.runtime, "deviceGetStreamPriorityRange", None)
    if fn is not None:
        return int(fn()[1])
    cp.cuda.runtime.free(0)  # the device's context made current, as CuPy makes it lazily
    least, greatest = ctypes.c_int(), ctypes.c_int()
    rc = ctypes.CDLL("libcuda.so.1").cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))
    if rc:
        raise DriverError(f"cuCtxGetStreamPriorityRange failed with CUDA error {rc}")
    return greatest.value


def external_stream(cp: Any, ptr: int, device: int) -> Any:
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


class Buffer:
    """One raw allocation (device or pinned host), freed exactly once."""

    def __init__(self, cp: Any, nbytes: int, pinned: bool) -> None:
        self.cp, self.nbytes, self.pinned = cp, nbytes, pinned
        rt = cp.cuda.runtime
        self.ptr = rt.hostAlloc(nbytes, 0) if pinned else rt.malloc(nbytes)

    def host_array(self, dtype: Any, count: int | None = None) -> np.ndarray:
        raw = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr)
        return np.frombuffer(memoryview(raw), dtype=dtype, count=-1 if count is None else count)

    def free(self) -> None:
        if self.ptr:
            rt = self.cp.cuda.runtime
            (rt.freeHost if self.pinned else rt.free)(self.ptr)
            self.ptr = 0


class _IdList(ctypes.Structure):
    """The kernels' ``IdList`` parameter (see :mod:`kvstate.kernels._cuda_src`)."""

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


def stream_wait_value() -> Callable[[int, int, int], bool]:
    """``wait(stream, addr, value)``: queue on ``stream`` a wait until the 32-bit word at
    device-visible address ``addr`` is at least ``value`` (``cuStreamWaitValue32``, a stream
    memory operation of libcuda's, through ctypes); False where the driver refuses it (no
    stream memory operations on this device), with nothing queued."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def wait(stream: int, addr: int, value: int) -> bool:
        return fn(stream, addr, value, 0) == 0  # 0: CU_STREAM_WAIT_VALUE_GEQ
    return wait


class _Kernel:
    """One kernel and the parameter block it is launched from (``cuLaunchKernel`` copies the
    parameters when called, so the block is refilled for the next launch at once)."""

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
        self.last: list[Any] = []  # the values in the block now: a call repeating them stores none

    def __call__(self, grid: tuple[int, int, int], threads: int, shared: int, stream_ptr: int,
                 values: list[Any], gids: np.ndarray | bytes | None = None, fids: np.ndarray | None = None,
                 n: int = 0) -> None:
        """``gids``: the ids inline, an array (and ``fids``, or None), or both sides' ``n``
        ids packed back to back (:attr:`TransferPlan.packed`)."""
        if values != self.last:
            self.vals[:len(values)] = values
            self.last = values
        if gids is not None:
            ids = self.ids
            assert ids is not None
            if gids.__class__ is bytes:
                narrow_into(gids, 0, n, self.g)
                narrow_into(gids, n, n, self.f)
                ids.n, ids.has_f = n, 1
            else:
                ids.n = n = len(gids)
                self.g[:n] = gids
                if fids is None:
                    ids.has_f = 0
                else:
                    ids.has_f = 1
                    self.f[:n] = fids
        self.launch(self.fptr, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream_ptr, self.pptr, 0)


class Kernels:
    """The transfer kernels compiled for the current device, and their launch."""

    def __init__(self, cp: Any) -> None:
        self.module = cp.RawModule(code=KERNEL_SOURCE, options=("-std=c++17",))
        launch = _driver_launch(cp)
        get = self.module.get_function
        self.chunks = _Kernel(get("kv_chunks"), 10, False, launch)
        self.chunks_i = _Kernel(get("kv_chunks_i"), 8, True, launch)
        self.span = _Kernel(get("kv_span"), 11, False, launch)
        self.span_i = _Kernel(get("kv_span_i"), 9, True, launch)
        self.copy_sum = _Kernel(get("kv_copy_sum"), 6, False, launch)
        self.copy_sum_i = _Kernel(get("kv_copy_sum_i"), 4, True, launch)

    def launch_copy_sum(self, stream: Any, src_ptrs: int, dst_ptrs: int, gids: int | np.ndarray, fids: int | np.ndarray,
                        n: int, layers: int, chunk: int, sums: int) -> None:
        """Launch the copy of ``n`` blocks of every layer between two layered caches (their
        rows whole aligned 16-byte vectors), adding each block's SUM64 into ``sums[i]``
        (device pointer to ``n`` zeroed uint64). ``gids``/``fids``: device pointers, or numpy
        arrays of at most ``INLINE_IDS`` ids passed inline."""
        if n == 0:
            return
        threads = min(_THREADS, max(32, -(-(chunk // 16) // 32) * 32))
        if isinstance(gids, np.ndarray):
            self.copy_sum_i((n, layers, 1), threads, 0, stream.ptr, [src_ptrs, dst_ptrs, chunk, sums], gids,
                            fids, n)  # type: ignore[arg-type]
        else:
            self.copy_sum((n, layers, 1), threads, 0, stream.ptr, [src_ptrs, dst_ptrs, gids, fids, chunk, sums])

    def launch(self, stream: Any, layer_ptrs: int, flat_ptrs: int, flat_base: int, group_stride: int,
               gids: int | np.ndarray | bytes, fids: int | np.ndarray | None, n: int, geometry: tuple[int, int, int],
               chunk: int, gather: bool, vectors: bool = False) -> None:
        """Launch the copy of ``n`` entries; ``geometry`` is (groups, span, layers per span);
        ``vectors`` when every chunk is whole aligned 16-byte vectors.

        ``gids``/``fids`` are device pointers (``fids`` 0: entry i goes to flat position i), or
        numpy arrays of at most ``INLINE_IDS`` ids (``fids`` None: position i) or both sides'
        ids packed (:attr:`TransferPlan.packed`, ``fids`` None), passed inline."""
        if n == 0:
            return
        groups, span, lps = geometry
        inline = isinstance(gids, (np.ndarray, bytes))  # else device pointers (ints)
        g: np.ndarray = gids  # type: ignore[assignment]  # one of the two, by ``inline``
        f: np.ndarray | None = fids  # type: ignore[assignment]
        gp: int = gids  # type: ignore[assignment]
        fp: int = fids  # type: ignore[assignment]
        if vectors and groups * lps <= 65535:
            units = chunk // 16
            threads = min(_THREADS, max(32, -(-units // 32) * 32))
            grid = (n, groups * lps, 1)
            if inline:  # every parameter of the kernels is 64-bit: plain ints are passed as such
                self.chunks_i(grid, threads, 0, stream.ptr, [layer_ptrs, flat_ptrs, flat_base, group_stride,
                                                           span, chunk, lps, int(gather)], g, f, n)
            else:
                self.chunks(grid, threads, 0, stream.ptr, [layer_ptrs, flat_ptrs, flat_base, group_stride,
                                                         gp, fp, span, chunk, lps, int(gather)])
            return
        # any chunk size: pieces of a span through shared memory
        pieces = -(-span // SPAN_PIECE)
        if span >= 2**31 or groups > 65535 or pieces > 65535:
            raise ValidationError(f"a block's span of {span} bytes in {groups} groups is beyond the "
                                  "kernels' grid (spans under 1 GiB, at most 65,535 layers)")
        grid, shared = (n, groups, pieces), SPAN_PIECE + 16
        if inline:
            self.span_i(grid, _THREADS, shared, stream.ptr, [layer_ptrs, flat_ptrs, flat_base, group_stride,
                                                             span, chunk, lps, SPAN_PIECE, int(gather)], g, f, n)
        else:
            self.span(grid, _THREADS, shared, stream.ptr, [layer_ptrs, flat_ptrs, flat_base, group_stride, gp,
                                                           fp, span, chunk, lps, SPAN_PIECE, int(gather)])


class ParamRing:
    """Uploads small int64 arrays (block ids) to the device on a stream, through
    ``_PARAM_SLOTS`` pinned/device slots grown on demand; a slot is reused only once the event
    of its previous use passed: its upload, and after :meth:`held_until` the call reading it
    (calls on different streams share the slots, and a staged call's last kernels read its ids
    long after they landed). Allocations come from ``alloc`` and go back to ``release`` (the
    owner's), waits go through ``wait`` (the owner's, with its timeout)."""

    def __init__(self, cp: Any, new_event: Callable[[], Any], alloc: Callable[[int, bool], Buffer],
                 release: Callable[[Buffer | None], None], wait: Callable[[Any], None]) -> None:
        self.cp, self.alloc, self.release, self.wait = cp, alloc, release, wait
        self.host: Buffer | None = None
        self.view: np.ndarray | None = None  # the pinned slots as int64
        self.dev: Buffer | None = None
        self.slot_bytes = 0
        self.events = [new_event() for _ in range(_PARAM_SLOTS)]
        self.used = [False] * _PARAM_SLOTS
        self.next = 0
        self.last = -1  # the slot of the latest upload
        self.uploads = 0  #: uploads made (a call with its ids inline makes none)

    def _grow(self, need: int) -> None:
        for used, ev in zip(self.used, self.events):
            if used:
                self.wait(ev)
        self.release(self.host)
        self.release(self.dev)
        slot = max(64 << 10, 1 << (need - 1).bit_length())
        self.host = self.alloc(slot * _PARAM_SLOTS, True)
        self.view = self.host.host_array(np.int64)
        self.dev = self.alloc(slot * _PARAM_SLOTS, False)
        self.slot_bytes = slot
        self.used = [False] * _PARAM_SLOTS

    def upload(self, arrays: Sequence[np.ndarray], stream: Any) -> list[int]:
        """Copy ``arrays`` to the device on ``stream``; returns their device pointers."""
        need = sum(a.size for a in arrays) * 8
        if need > self.slot_bytes:
            self._grow(need)
        assert self.host is not None and self.dev is not None and self.view is not None
        s = self.next
        self.next = (s + 1) % _PARAM_SLOTS
        ev = self.events[s]
        if self.used[s]:
            self.wait(ev)  # the slot's previous upload must have left the pinned buffer
        base = s * self.slot_bytes
        host = self.view[base // 8: (base + self.slot_bytes) // 8]
        ptrs, off = [], 0
        for a in arrays:
            host[off: off + a.size] = a
            ptrs.append(self.dev.ptr + base + off * 8)
            off += a.size
        self.cp.cuda.runtime.memcpyAsync(self.dev.ptr + base, self.host.ptr + base, off * 8, H2D, stream.ptr)
        ev.record(stream)
        self.used[s] = True
        self.last = s
        self.uploads += 1
        return ptrs

    def held_until(self, stream: Any) -> None:
        """Keep the latest upload's slot until the work queued on ``stream`` so far has run (the
        call that uploaded it has been enqueued and ends there)."""
        self.events[self.last].record(stream)


@dataclass(frozen=True, eq=False)
class DeviceLayers(LayerSet):
    """A :class:`LayerSet` on one GPU, with its layers' pointers in device memory."""

    device: int = 0
    ptrs: tuple[int, ...] = ()  #: host copy of the layer pointers
    ptr_array: Any = None  #: the same pointers as a CuPy uint64 array
    views: tuple[Any, ...] = ()  #: CuPy views keeping the tensors' memory referenced (empty when remembered)
    aligned: bool = False  #: every layer starts on a 16-byte boundary

    def __len__(self) -> int:
        return len(self.ptrs)


_REGISTERED: dict[int, int] = {}  # address registered as pinned -> its users in this process
_REGISTERED_LOCK = threading.Lock()


def register_host(cp: Any, ptr: int, nbytes: int) -> None:
    """Register host memory as pinned (portable and mapped: every device sees it) once per
    process, however many users ask (an arena's slots serve every backend of the process)."""
    with _REGISTERED_LOCK:
        if not _REGISTERED.get(ptr):
            cp.cuda.runtime.hostRegister(ptr, nbytes, 3)  # cudaHostRegisterPortable | Mapped
        _REGISTERED[ptr] = _REGISTERED.get(ptr, 0) + 1


def unregister_host(cp: Any, ptr: int) -> None:
    """One user of :func:`register_host`'s memory is done; the last unregisters it."""
    with _REGISTERED_LOCK:
        _REGISTERED[ptr] -= 1
        if not _REGISTERED[ptr]:
            del _REGISTERED[ptr]
            cp.cuda.runtime.hostUnregister(ptr)

"""GPU KV caches shared with rank workers through CUDA IPC: the engine keeps them, workers map them.

In the seeds' system the model runner creates the KV caches and each TP rank's
cache-transfer process attaches to them through CUDA IPC handles. :func:`share_caches` runs in
the engine's process: for each cache tensor (PyTorch, Paddle or CuPy, through DLPack) it finds
the device allocation holding it (``cuMemGetAddressRange``: a framework's caching allocator
hands out pieces of larger allocations) and returns that allocation's IPC handle with the
tensor's offset and size, as JSON-able data for :class:`~kvstate.distributed.WorkerConfig`.
:func:`open_caches` runs in the worker: it opens each allocation once and views the tensors
in it as CuPy arrays, the shapes and dtypes following from the spec and the block count.

A spec with state groups shares each rank's state pages the same way (``states``): one
``[num_states, state bytes]`` uint8 tensor a rank, mapped by the worker beside its caches.

The engine must keep its tensors alive while workers use them (as it keeps its caches anyway);
a worker's mapping ends when it closes (or exits).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._dtypes import as_16bit_ints, is_bfloat16
from .._errors import ConfigError
from .._spec import CacheSpec
from .._validate import check_int, is_int
from ..kernels._cuda_launch import load_cupy

__all__ = ["share_caches", "open_caches"]

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def _address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding ``ptr`` (the driver API, through ctypes)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise ConfigError(f"CUDA IPC needs the CUDA driver library (libcuda.so.1): {e}") from None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise ConfigError(f"cuMemGetAddressRange failed for device pointer {ptr:#x} (CUresult {rc})")
    return base.value, size.value


def _export(cp: Any, t: Any, handles: dict[int, str], what: str) -> list[Any]:
    """``[IPC handle of the allocation holding t, t's offset in it, its bytes]`` (``handles``
    caches one handle an allocation)."""
    a = cp.from_dlpack(as_16bit_ints(t) if is_bfloat16(getattr(t, "dtype", "")) else t)
    if not a.flags.c_contiguous:
        raise ConfigError(f"{what}: not contiguous")
    base, _ = _address_range(a.data.ptr)
    if base not in handles:
        handles[base] = bytes(cp.cuda.runtime.ipcGetMemHandle(base)).hex()
    return [handles[base], a.data.ptr - base, a.nbytes]


def share_caches(caches: Mapping[int, Mapping[str, Sequence[Any]]], device: int = 0,
                 states: Mapping[int, Any] | None = None) -> dict[str, Any]:
    """The IPC description of ``caches[rank][kind]`` = per-layer GPU tensors (and, for a spec
    with state groups, ``states[rank]`` = the rank's ``[num_states, state bytes]`` uint8 pages):
    what a rank worker's ``caches`` configuration is (``{"kind": "cuda-ipc", ...}``)."""
    if not isinstance(caches, Mapping) or not all(
            is_int(r) and isinstance(by_kind, Mapping) and all(isinstance(k, str) and isinstance(layers, Sequence)
                                                              for k, layers in by_kind.items())
            for r, by_kind in caches.items()):
        raise ConfigError("share_caches: caches must map each rank (an int) to {kind: [per-layer tensors]}")
    check_int(device, "share_caches: device", minimum=0, maximum=1023, error=ConfigError)
    if states is not None and (not isinstance(states, Mapping) or not all(is_int(r) for r in states)):
        raise ConfigError("share_caches: states must map each rank (an int) to its state pages, or be None")
    cp = load_cupy()
    handles: dict[int, str] = {}  # allocation base -> its IPC handle (hex), one per allocation
    out: dict[str, dict[str, list[list[Any]]]] = {}
    with cp.cuda.Device(device):
        for rank, by_kind in caches.items():
            out[str(rank)] = {kind: [_export(cp, t, handles, f"caches[{rank}][{kind!r}]: a layer") for t in layers]
                              for kind, layers in by_kind.items()}
        pages = {str(r): _export(cp, t, handles, f"states[{r}]") for r, t in (states or {}).items()}
    return {"kind": "cuda-ipc", "device": device, "tensors": out, **({"states": pages} if states else {})}


def _check_shared(spec: CacheSpec, num_blocks: int, rank: int, cfg: Mapping[str, Any], num_states: int) -> Any:
    """``rank``'s tensors in a :func:`share_caches` description, checked against the paged
    spec and the state pages' size; returns them."""
    tensors, paged = cfg.get("tensors", {}).get(str(rank)), spec.paged()
    if not isinstance(tensors, dict) or set(tensors) != set(paged.kinds):
        raise ConfigError(f"rank {rank}: the shared caches must name the kinds {paged.kinds}")
    want = {k: num_blocks * paged.chunk_bytes(k) for k in paged.kinds}
    for kind, rows in tensors.items():
        if len(rows) != paged.layers or any(int(r[2]) != want[kind] for r in rows):
            raise ConfigError(f"rank {rank}: caches of {kind!r} must be {paged.layers} layers of {want[kind]} bytes "
                              "(another geometry?)")
    row = cfg.get("states", {}).get(str(rank))
    size = num_states * spec.state_bytes_per_rank
    if num_states and (not isinstance(row, list) or int(row[2]) != size):
        raise ConfigError(f"rank {rank}: the shared caches must give its state pages, {size} bytes")
    return tensors


Opened = tuple[dict[int, dict[str, list[Any]]], dict[int, Any] | None, Callable[[], None]]


def open_caches(spec: CacheSpec, num_blocks: int, rank: int, cfg: Mapping[str, Any], device: int,
                num_states: int = 0) -> Opened:
    """Map ``rank``'s caches (and its ``num_states`` state pages) from a :func:`share_caches`
    description: ``({rank: {kind: [CuPy arrays]}}, {rank: pages} or None, close)``. Sizes are
    checked against the spec before anything is mapped."""
    tensors, paged = _check_shared(spec, num_blocks, rank, cfg, num_states), spec.paged()
    cp = load_cupy()
    opened: dict[str, int] = {}

    def view(row: Sequence[Any], shape: tuple[int, ...], dtype: Any) -> Any:
        handle, offset, nbytes = row
        if handle not in opened:
            opened[handle] = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(handle), _LAZY_PEER_ACCESS)
        mem = cp.cuda.UnownedMemory(opened[handle] + int(offset), int(nbytes), None, device)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))

    out: dict[str, list[Any]] = {}
    states: dict[int, Any] | None = None
    try:
        with cp.cuda.Device(device):
            for kind, rows in tensors.items():
                shape = (num_blocks,) + paged.block_shape(kind)
                out[kind] = [view(r, shape, paged.kind_dtype(kind)) for r in rows]
            if num_states:
                states = {rank: view(cfg["states"][str(rank)], (num_states, spec.state_bytes_per_rank), cp.uint8)}
    except BaseException:
        _close(cp, opened, device)
        raise

    def close() -> None:
        out.clear()
        _close(cp, opened, device)
    return {rank: out}, states, close


def _close(cp: Any, opened: dict[str, int], device: int) -> None:
    with cp.cuda.Device(device):
        for ptr in opened.values():
            try:
                cp.cuda.runtime.ipcCloseMemHandle(ptr)
            except Exception:  # noqa: BLE001 - a mapping the process loses anyway at exit
                pass
    opened.clear()

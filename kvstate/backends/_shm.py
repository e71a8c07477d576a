"""Host KV caches in shared memory: the engine (model runner) creates them, rank workers attach.

In the seeds' system the model-runner process creates the KV caches and each TP rank's
cache-transfer process attaches to them (CUDA IPC on the GPU). On the CPU the same shape is a
file per rank in a RAM-backed directory (``/dev/shm``), mapped by both: the creator's numpy
views and the worker's see the same bytes, and neither copies. A rank's file holds, in
``spec.kinds`` order, each paged layer's ``[num_blocks, heads, block_size, dim]`` array, then
(a spec with state groups) its ``[num_states, state bytes]`` state pages, every array starting
on a 64-byte boundary: both sides compute the layout from the spec, the block count and the
state pages alone, so a handle is just the file's path.

The creator owns the files: :meth:`SharedCaches.close` unmaps and unlinks them (a worker's
mapping stays valid until it unmaps). Files left by a creator that died are removed by the
next :meth:`SharedCaches.create` on the host (their names carry the creator's pid).
"""
from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .._errors import ConfigError, ValidationError
from .._spec import CacheSpec
from .._validate import MAX_BLOCKS, check_int, is_int
from ._hostfiles import remove_orphans, shm_directory

__all__ = ["SharedCaches", "cache_layout", "shm_directory"]

_ALIGN = 64


def cache_layout(spec: CacheSpec, num_blocks: int, num_states: int = 0) -> tuple[list[tuple[str, int, int]], int]:
    """([(kind, layer, byte offset)], total bytes) of one rank's file; its state pages, if
    any, are the last ``num_states * spec.state_bytes_per_rank`` bytes."""
    out, at, paged = [], 0, spec.paged()
    for kind in paged.kinds:
        size = num_blocks * paged.chunk_bytes(kind)
        for layer in range(paged.layers):
            out.append((kind, layer, at))
            at += -(-size // _ALIGN) * _ALIGN
    return out, at + num_states * spec.state_bytes_per_rank


class SharedCaches:
    """One file per rank of layer-major caches, mapped: ``caches[rank][kind][layer]`` arrays.

    With state groups, ``states[rank]`` is the rank's ``[num_states, state bytes]`` uint8 pages.
    Build with :meth:`create` (the owner) or :meth:`attach` (a worker, from ``paths``)."""

    def __init__(self, spec: CacheSpec, num_blocks: int, paths: Mapping[int, str], owner: bool,
                 num_states: int = 0) -> None:
        if not isinstance(spec, CacheSpec):
            raise ValidationError("SharedCaches: spec must be a CacheSpec")
        check_int(num_blocks, "SharedCaches: num_blocks", minimum=1, maximum=MAX_BLOCKS)
        check_int(num_states, "SharedCaches: num_states", minimum=0)
        spec.check_num_states("SharedCaches", num_states, ValidationError)
        if not isinstance(paths, Mapping) or not all(is_int(r) and isinstance(p, str) and p for r, p in paths.items()):
            raise ValidationError(f"SharedCaches: paths must map each rank (an int) to its file, got {paths!r}")
        if owner.__class__ is not bool:
            raise ValidationError(f"SharedCaches: owner must be a bool, got {owner!r}")
        self.spec, self.num_blocks, self.num_states, self.owner = spec, num_blocks, num_states, owner
        self.paths: dict[int, str] = dict(paths)  #: rank -> file: the handle a worker attaches with
        self._maps: list[mmap.mmap] = []
        self.caches: dict[int, dict[str, list[np.ndarray]]] = {}
        self.states: dict[int, np.ndarray] = {}
        layout, size = cache_layout(spec, num_blocks, num_states)
        try:
            for rank, path in self.paths.items():
                self.caches[rank] = self._map(rank, path, layout, size)
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, spec: CacheSpec, num_blocks: int, ranks: Sequence[int] | None = None,
               directory: str | os.PathLike[str] | None = None, num_states: int = 0) -> SharedCaches:
        """Zeroed caches for ``ranks`` (default: every TP rank), in new files under ``directory``
        (``num_states``: state pages a rank, for a spec with state groups)."""
        if not isinstance(spec, CacheSpec):
            raise ValidationError("SharedCaches: spec must be a CacheSpec")
        check_int(num_blocks, "SharedCaches: num_blocks", minimum=1, maximum=MAX_BLOCKS)
        check_int(num_states, "SharedCaches: num_states", minimum=0)
        spec.check_num_states("SharedCaches", num_states, ValidationError)  # refused before any file is made
        ranks = list(range(spec.tp_size)) if ranks is None else list(ranks)
        d = Path(directory) if directory is not None else shm_directory()
        if not d.is_dir():
            raise ConfigError(f"SharedCaches: {str(d)!r} is not a directory")
        remove_orphans(d, "kvstate-")
        token = secrets.token_hex(8)
        _, size = cache_layout(spec, num_blocks, num_states)
        paths: dict[int, str] = {}
        try:
            for r in ranks:
                p = d / f"kvstate-{os.getpid()}-{token}-r{r}"
                with open(p, "xb") as f:
                    f.truncate(size)
                paths[r] = str(p)
        except OSError as e:
            for made in paths.values():
                Path(made).unlink(missing_ok=True)
            raise ConfigError(f"SharedCaches: cannot create {size:,} bytes per rank in {str(d)!r} ({e})") from None
        try:
            return cls(spec, num_blocks, paths, owner=True, num_states=num_states)
        except BaseException:
            for made in paths.values():
                Path(made).unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, spec: CacheSpec, num_blocks: int, paths: Mapping[int, str], num_states: int = 0) -> SharedCaches:
        """Map caches another process created (``paths``: rank -> file, its :attr:`paths`)."""
        return cls(spec, num_blocks, paths, owner=False, num_states=num_states)

    def _map(self, rank: int, path: str, layout: list[tuple[str, int, int]], size: int) -> dict[str, list[np.ndarray]]:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ConfigError(f"SharedCaches: cannot open {path!r} ({e.strerror})") from None
        try:
            if os.fstat(fd).st_size != size:
                raise ConfigError(f"SharedCaches: {path!r} holds {os.fstat(fd).st_size:,} bytes, but this spec, "
                                  f"{self.num_blocks} blocks and {self.num_states} state pages need {size:,}: the "
                                  "geometries differ")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps.append(mm)
        spec = self.spec.paged()
        out: dict[str, list[np.ndarray]] = {k: [] for k in spec.kinds}
        for kind, _layer, offset in layout:
            shape = (self.num_blocks,) + spec.block_shape(kind)
            dtype = spec.kind_dtype(kind)
            out[kind].append(np.frombuffer(mm, dtype, int(np.prod(shape)), offset).reshape(shape))
        if self.num_states:
            page = self.spec.state_bytes_per_rank
            at = size - self.num_states * page
            self.states[rank] = np.frombuffer(mm, np.uint8, self.num_states * page, at).reshape(self.num_states, page)
        return out

    def close(self) -> None:
        """Drop this process's views and mappings; the owner also removes the files (idempotent)."""
        self.caches, self.states = {}, {}
        maps, self._maps = self._maps, []
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a view someone still holds: the mapping goes with it
                pass
        if self.owner:
            for p in self.paths.values():
                Path(p).unlink(missing_ok=True)

    def __enter__(self) -> SharedCaches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

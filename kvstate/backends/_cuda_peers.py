"""The CUDA backend's side of the direct handoff: its caches described for a puller, a
lender's caches mapped here, and the pull that copies, sums and compares on the device.

A lender (P) describes each rank's caches once: CUDA IPC handles of the allocations holding
them (:func:`~kvstate.backends._cudaipc.share_caches`; a rank worker, whose caches are another
process's, passes on the handles it opened them with), its device, its block count, its pid,
and a token by which a backend of the same process finds them (CUDA IPC cannot open a handle
in the process that made it). A puller (D) maps a lender's caches on its own device the first
time it meets them (known by the description's random ``id``, so a pull does not read the
handles again) and keeps the mapping (at most ``keep`` lenders, the least recently used
closed first): a kernel on D's GPU then reads P's blocks over the link between the GPUs.

A pull whose blocks are one object a kind of rows of whole 16-byte vectors runs on the rank's
stream as one small upload (the block ids and the lender's checksums together) and two
kernels: the copy adds each block's SUM64 from the words it moves (a
:class:`~kvstate.kernels._cuda.SumCopier`, made once for a lender's caches and the rank's, so
a pull checks only its ids), then one CTA folds them and compares with the lender's checksums
(:func:`~kvstate.kernels._cuda_checksum.fold_match`), storing in pinned memory how many
leading blocks match: the host reads one number. Its scratch (the sums, the ids and the
lender's checksums on both sides, the answer) is kept from pull to pull, each rank its own,
since a pull's allocations are on the path of a first token; a pull that timed out leaves its
scratch to the kernels that may still use it, and the next one takes new.

Rules: the lender's GPU must be reachable from the puller's (peer access: NVLink, or PCIe
P2P), else the pull is refused naming that rule, and D reads the store. A description from
another process is checked before anything is mapped (its kind, ints in range, sizes that fit
the spec); an IPC handle the driver refuses (its process died before the handle was opened)
is a :class:`~kvstate._errors.ProtocolError` too. A mapping opened keeps P's memory alive
while it lasts, even past P's death: the copy reads the bytes P left, and the checksums P
took before it lent them decide whether they count.
"""
from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import KVStateError, ProtocolError
from .._spec import CacheSpec
from .._validate import MAX_BLOCKS, is_int
from ..kernels._cuda_checksum import fold_match
from ._cudaipc import open_caches, share_caches
from ._lends import local_peer

__all__ = ["CudaPeers"]


class CudaPeers:
    """One backend's descriptions of its own caches and mappings of lenders' caches."""

    def __init__(self, cp: Any, spec: CacheSpec, device: int, owner: Any, keep: int = 8,
                 shared: Mapping[str, Any] | None = None) -> None:
        self.cp, self.spec, self.device, self.keep = cp, spec, device, keep
        #: the CUDA IPC description the owner's caches came from (a rank worker's): passed on as
        #: it is, since memory a process imported cannot be exported again
        self.shared = shared
        self._token = local_peer(owner)
        self._described: dict[int, dict[str, Any]] = {}
        self._open: OrderedDict[tuple[Any, ...], tuple[dict[str, Any], Callable[[], None]]] = OrderedDict()
        self._peer_access: set[int] = set()
        self._scratch: dict[int, dict[str, Any]] = {}  # a rank's pull scratch (see the rules)
        self._copiers: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}  # a rank's, by the caches' identity
        self._kernels: dict[str, Any] = {}  # fold_match's compiled kernel

    def describe(self, rank: int, layers: Mapping[str, Any], num_blocks: int) -> dict[str, Any]:
        """``rank``'s caches (``layers[kind]``: their bound layers) for a puller (JSON)."""
        if rank not in self._described:
            if self.shared is not None:
                shared = {"kind": "cuda-ipc", "device": self.shared["device"],
                          "tensors": {str(rank): self.shared["tensors"][str(rank)]}}
            else:
                shared = share_caches({rank: {k: list(v.views) for k, v in layers.items()}}, self.device)
            self._described[rank] = {**shared, "num_blocks": num_blocks, "pid": os.getpid(), "token": self._token,
                                     "id": uuid.uuid4().hex}
        return self._described[rank]

    def _key(self, peer: Mapping[str, Any], rank: int) -> tuple[Any, ...]:
        """A description's mapping key, the description checked first."""
        pid, dev, blocks = peer.get("pid"), peer.get("device"), peer.get("num_blocks")
        if peer.get("kind") != "cuda-ipc" or not (is_int(pid) and is_int(dev) and is_int(blocks)) or \
                not 0 <= dev < 1024 or not 0 < blocks <= MAX_BLOCKS:
            raise ProtocolError(f"a lend's peer must describe CUDA caches (kind, pid, device, num_blocks), got "
                                f"{dict(peer)!r:.160}")
        tag = peer.get("id")  # one description's: its handles are not read again on every pull
        return pid, dev, blocks, tag if isinstance(tag, str) else repr(peer.get("tensors", {}).get(str(rank)))

    def mapped(self, peer: Mapping[str, Any], rank: int) -> dict[str, Any] | None:
        """The lender's caches of ``rank`` if mapped here already (no device call), else None."""
        key = self._key(peer, rank)
        hit = self._open.get(key)
        if hit is None:
            return None
        self._open.move_to_end(key)
        return hit[0]

    def open(self, peer: Mapping[str, Any], rank: int, bind: Callable[[Any, str], Any]) -> dict[str, Any]:
        """The lender's caches of ``rank``, bound on this device (``bind``: the rank's swapper's)."""
        key = self._key(peer, rank)
        pid, dev, blocks = key[0], key[1], key[2]
        hit = self._open.get(key)
        if hit is not None:
            self._open.move_to_end(key)
            return hit[0]
        self._reach(dev)
        if pid == os.getpid():
            owner = local_peer(None, peer.get("token"))
            opened, close = self._same_process(owner, rank, bind), _nothing
        else:
            opened, close = self._other_process(peer, rank, blocks, bind)
        self._open[key] = (opened, close)
        while len(self._open) > self.keep:
            self._copiers.clear()  # they hold the caches of the mapping about to close
            self._open.popitem(last=False)[1][1]()
        return opened

    def _reach(self, dev: int) -> None:
        """Whether this GPU reads ``dev``'s memory; enabled once for this process's context."""
        if dev == self.device or dev in self._peer_access:
            return
        rt = self.cp.cuda.runtime
        if dev >= rt.getDeviceCount() or not rt.deviceCanAccessPeer(self.device, dev):
            raise ProtocolError(f"GPU {self.device} cannot read GPU {dev}'s memory (no peer access over NVLink or "
                                "PCIe): the direct handoff needs P's and D's GPUs joined")
        with self.cp.cuda.Device(self.device):
            try:
                rt.deviceEnablePeerAccess(dev)
            except self.cp.cuda.runtime.CUDARuntimeError as e:
                if "PeerAccessAlreadyEnabled" not in str(e):
                    raise ProtocolError(f"GPU {self.device}: peer access to GPU {dev} failed: {e}") from None
        self._peer_access.add(dev)

    def _same_process(self, owner: Any, rank: int, bind: Callable[[Any, str], Any]) -> dict[str, Any]:
        """Another backend of this process: its arrays, viewed as memory of this device."""
        cp = self.cp
        out = {}
        for kind in self.spec.kinds:
            views = []
            for v in owner.caches(rank, kind).views:
                mem = cp.cuda.UnownedMemory(int(v.data.ptr), int(v.nbytes), v, self.device)
                views.append(cp.ndarray(v.shape, v.dtype, cp.cuda.MemoryPointer(mem, 0)))
            out[kind] = bind(views, f"lender's {kind} caches")
        return out

    def _other_process(self, peer: Mapping[str, Any], rank: int, blocks: int,
                       bind: Callable[[Any, str], Any]) -> tuple[dict[str, Any], Callable[[], None]]:
        try:
            caches, _, close = open_caches(self.spec, blocks, rank, peer, self.device)
        except KVStateError:
            raise
        except Exception as e:  # noqa: BLE001 - the driver's refusal of a handle (its process is gone)
            raise ProtocolError(f"the lender's caches could not be mapped on GPU {self.device}: {e}") from None
        try:
            return {kind: bind(layers, f"lender's {kind} caches") for kind, layers in caches[rank].items()}, close
        except BaseException:
            close()
            raise

    def pull(self, rank: int, sw: Any, pairs: list[tuple[Any, Any]], src_ids: Sequence[int] | np.ndarray,
             dst_ids: Sequence[int] | np.ndarray, sums: Sequence[int] | np.ndarray,
             keep: Callable[[int, Any, Any], None]) -> Callable[[], int]:
        """Queue the copy of ``pairs`` (a kind's lender's and own caches, bound on ``sw``, the
        rank's swapper, with its device current), its sums and their comparison with the
        lender's ``sums``; answers the fetch of how many leading blocks match (it waits once).
        ``keep(rank, event, scratch)`` holds the scratch until the event passed."""
        cp, rt = self.cp, self.cp.cuda.runtime
        copier = self._copier(rank, sw, pairs)
        gids, fids = copier.check(src_ids, dst_ids)
        n = gids.size
        buf = self._buffers(rank, len(pairs), n)
        host = buf["host"]  # the ids, then the lender's sums: one upload
        host[:n], host[n:2 * n] = gids, fids
        buf["sums_host"][:n] = sums
        rt.memsetAsync(buf["out_ptr"], 0, 8 * len(pairs) * n, sw.stream.ptr)
        rt.memcpyAsync(buf["dev_ptr"], buf["host_ptr"], 24 * n, 1, sw.stream.ptr)  # H2D
        copier.launch(buf["dev_ptr"], buf["out_ptr"])
        with sw.stream:
            fold_match(cp, buf["out"], buf["expect"], buf["answer_ptr"], self._kernels)
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(sw.stream)
        held = buf["held"]
        held["done"], held["busy"] = done, True  # the answer is read by fetch, after the GPU's work
        keep(rank, done, held)

        def fetch() -> int:
            try:
                sw.wait(done)
                return int(buf["answer"][0])
            finally:
                held["busy"] = False
        return fetch

    def _copier(self, rank: int, sw: Any, pairs: list[tuple[Any, Any]]) -> Any:
        """The rank's :class:`~kvstate.kernels._cuda.SumCopier` between these caches, made
        once (it holds them: a mapping's caches are kept while it is open, and its copiers
        dropped when it closes)."""
        key = (rank, *(id(x) for pair in pairs for x in pair))  # ids of caches the entry keeps alive
        hit = self._copiers.get(key)
        if hit is None:
            hit = self._copiers[key] = (tuple(pairs), sw.sum_copier(pairs))
        return hit[1]

    def _buffers(self, rank: int, kinds: int, n: int) -> dict[str, Any]:
        """The rank's pull scratch for ``kinds`` x ``n`` sums: the sums on the device (``out``
        at ``out_ptr``); the ids and the lender's sums in pinned memory (``host``, int64, and
        ``sums_host``, at ``host_ptr``) and their copy on the device (at ``dev_ptr``; the
        lender's sums ``expect``); the answer in pinned memory (``answer``, ``answer_ptr``
        the device's address of it). Views made once a shape. A scratch is used again only
        once its pull's GPU work ran *and* its fetch read the answer: the rank's pulls on other
        lanes queue while one waits, and one reusing the scratch in between would hand the
        waiting pull its own count (more blocks than it asked for, or fewer)."""
        cp, need = self.cp, kinds * n
        held = self._scratch.get(rank)
        if held is None or held["size"] < max(need, n) or held["busy"] or \
                (held["done"] is not None and not held["done"].done):
            import cupyx
            size = max(need, n, 1024)
            host = cupyx.empty_pinned(3 * size + 1, np.uint64)  # ids and the lender's sums, then the answer
            held = self._scratch[rank] = {
                "size": size, "done": None, "busy": False, "out": cp.empty(size, cp.uint64),
                "dev": cp.empty(3 * size, cp.uint64), "host": host, "views": {},
                "answer_ptr": int(cp.cuda.runtime.pointerGetAttributes(int(host.ctypes.data)).devicePointer)
                + 8 * 3 * size}
        views = held["views"].get((kinds, n))
        if views is None:
            host = held["host"]
            views = held["views"][(kinds, n)] = {
                "out": held["out"][:need].reshape(kinds, n), "out_ptr": int(held["out"].data.ptr),
                "expect": held["dev"][2 * n:3 * n], "dev_ptr": int(held["dev"].data.ptr), "held": held,
                "host": host[:2 * n].view(np.int64), "sums_host": host[2 * n:3 * n],
                "host_ptr": int(host.ctypes.data), "answer": host[3 * held["size"]:].view(np.int64),
                "answer_ptr": held["answer_ptr"]}
        return views

    def close(self) -> None:
        """Unmap every lender's caches (the backend closes)."""
        self._copiers.clear()
        while self._open:
            self._open.popitem()[1][1]()
        self._scratch.clear()


def _nothing() -> None:
    """A same-process lender's arrays: nothing to unmap."""

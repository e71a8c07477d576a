"""Putting and getting a block's objects with their manifest: :class:`BlockObjects`, the part
every :class:`~kvstate.backends._objects.StoreBackend` holds over its store (the rules are
:mod:`~kvstate.backends._integrity`'s).

A put takes each object's checksum as the store copies it (:data:`~kvstate.backends._integrity.XXH3`),
or is handed them (:data:`~kvstate.backends._integrity.SUM64`, taken on the GPU by the CUDA
backend), then puts one manifest per block and layer group. A get reads the manifests first,
then the objects, and checks each block in order: its manifest is of this format and geometry,
each object arrived at its recorded length and with its recorded checksum. Host checksums are
taken as the store copies (XXH3) or over the buffers (SUM64); a backend whose data lands on a
device passes ``check``, which scatters the blocks that arrived whole and answers their SUM64
from the device. The first block that fails ends the count; a broken one is evicted.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from .._keys import rank_keys
from ._base import TOO_LARGE, Store, leading
from ._integrity import SUM64, XXH3, ManifestError, geometry_id, manifest_size, pack_manifest, sum64, unpack_manifest

__all__ = ["BlockObjects", "MANIFEST_KIND", "Scatter", "Deferred", "Manifests", "manifest_slice"]

MANIFEST_KIND = "sum"  #: the kind name of a block's manifest object (``rank_key(key, "sum", part[, group])``)

#: ``scatter(n)``: put the leading ``n`` blocks of a get in place (a device backend's scatter)
Scatter = Callable[[int], None]
#: what a deferred get leaves to verify: (key, each of its objects' expected SUM64), block by block
Deferred = list[tuple[str, list[int]]]
#: manifests read: (bytes read per manifest, the leading ones parsed as (algorithm, entries))
Manifests = tuple[list[int], list[tuple[int, list[tuple[int, int]]]]]


def manifest_slice(manifests: Manifests, a: int, b: int, per_block: int) -> Manifests:
    """The manifests of blocks ``a..b`` of those read (``per_block`` manifests a block)."""
    read, vouched = manifests
    return read[a * per_block:b * per_block], vouched[a * per_block:b * per_block]


def _stored(status: Sequence[int], per: int, n: int) -> int:
    """Leading blocks of ``n`` whose ``per`` put statuses each (in order) are all successes."""
    return leading(all(st == 0 for st in status[i * per:(i + 1) * per]) for i in range(n))


class BlockObjects:
    """A backend's blocks as objects in its store, with their manifests: the names, the puts
    and the verified gets every store backend makes (a part it holds, not a class it is)."""

    def __init__(self, spec: Any, store: Store) -> None:
        self.spec, self.store = spec, store
        #: manifests written and reads verified (the store's setting: a trusted pool turns it off)
        self.verify = bool(getattr(store, "verify", True))
        self.geometry = {g: geometry_id(spec, g) for g in (None, *range(spec.object_groups))}
        self.broken_blocks = 0  #: blocks a read found broken (and evicted from the store)

    def names(self, part: int, keys: Sequence[str], groups: Sequence[int] | None = None) -> list[str]:
        """Object names of ``keys``' blocks in head group ``part``, block by block, then kind,
        then layer group (all groups, or only ``groups``)."""
        spec = self.spec
        if spec.object_groups == 1 and groups is None:
            return rank_keys(keys, spec.kinds, part)
        return rank_keys(keys, spec.kinds, part, range(spec.object_groups) if groups is None else groups)

    def groups_of(self, groups: Sequence[int] | None) -> list[int | None]:
        """The layer groups each block's objects are named for, in :meth:`names`' order."""
        if self.spec.object_groups == 1 and groups is None:
            return [None]
        return list(range(self.spec.object_groups)) if groups is None else list(groups)

    def manifest_names(self, part: int, keys: Sequence[str], groups: Sequence[int] | None) -> list[str]:
        """One manifest per block and layer group of head group ``part``, block by block."""
        gs = self.groups_of(groups)
        if gs == [None]:
            return rank_keys(keys, (MANIFEST_KIND,), part)
        return rank_keys(keys, (MANIFEST_KIND,), part, cast("list[int]", gs))

    def objects_of(self, i: int, gi: int, ng: int) -> range:
        """Indices (in :meth:`names`' order) of block ``i``'s objects of its ``gi``-th group."""
        nk = len(self.spec.kinds)
        return range(i * nk * ng + gi, (i + 1) * nk * ng, ng)

    def leading_blocks(self, keys: Sequence[str], groups: Sequence[int] | None, ok: Sequence[bool]) -> int:
        """Leading blocks whose objects and manifests are all ``ok`` (objects first, then one
        flag per manifest, as put)."""
        ng = len(self.groups_of(groups))
        per, first = len(self.spec.kinds) * ng, len(keys) * len(self.spec.kinds) * ng
        return leading(all(ok[i * per:(i + 1) * per]) and all(ok[first + i * ng:first + (i + 1) * ng])
                       for i in range(len(keys)))

    def put(self, part: int, keys: Sequence[str], groups: Sequence[int] | None,
                     views: Sequence[memoryview], sums: Sequence[int] | None = None) -> int:
        """Put the objects of ``keys``' blocks, then their manifests; leading blocks stored whole.
        ``sums``: the objects' SUM64, taken on the device; without, XXH3 as they are copied.
        A trusted store (``verify`` off) gets the objects alone."""
        if not self.verify:
            return self.put_bare(part, keys, groups, views)
        if sums is None:
            status, sums = self.store.batch_put_hashed(self.names(part, keys, groups), list(views))
            per, algorithm = self.per(groups), XXH3
            count = _stored(status, per, len(keys))
        else:
            count, algorithm = self.put_bare(part, keys, groups, views), SUM64
        return self.put_manifests(part, keys[:count], groups, [v.nbytes for v in views], sums, algorithm) \
            if count else 0

    def put_bare(self, part: int, keys: Sequence[str], groups: Sequence[int] | None,
                  views: Sequence[memoryview]) -> int:
        """Put the objects of ``keys``' blocks alone (a backend putting the manifests later, once,
        for a whole transfer, as :meth:`put_manifests`); leading blocks whose objects all stored."""
        status, per = self.store.batch_put_from(self.names(part, keys, groups), list(views)), self.per(groups)
        return _stored(status, per, len(keys))

    def put_piece(self, part: int, keys: Sequence[str], groups: Sequence[int] | None,
                   views: Sequence[memoryview], sizes: list[int] | None) -> int:
        """One piece of a write: its objects and manifests; or, given ``sizes`` (a write whose
        SUM64 manifests are put once, after every object), its objects alone, their sizes
        appended to ``sizes``. Leading blocks stored."""
        if sizes is None:
            return self.put(part, keys, groups, views)
        sizes += [v.nbytes for v in views]
        return self.put_bare(part, keys, groups, views)

    def put_manifests(self, part: int, keys: Sequence[str], groups: Sequence[int] | None, sizes: Sequence[int],
                       sums: Sequence[int], algorithm: int) -> int:
        """Put the manifests of ``keys``' blocks, whose objects are stored (``sizes`` and ``sums``
        per object, in :meth:`names`' order), in one batch; leading blocks whose manifests stored."""
        names, manifests = self.manifests(part, keys, groups, sizes, sums, algorithm)
        status = self.store.batch_put_from(names, manifests)
        return _stored(status, len(self.groups_of(groups)), len(keys))

    def manifests(self, part: int, keys: Sequence[str], groups: Sequence[int] | None, sizes: Sequence[int],
                   sums: Sequence[int], algorithm: int) -> tuple[list[str], list[bytes]]:
        """The names and bytes of the manifests of ``keys``' blocks (as :meth:`put_manifests`)."""
        gs = self.groups_of(groups)
        manifests = [pack_manifest(self.geometry[g], [(sizes[j], sums[j])
                                                       for j in self.objects_of(i, gi, len(gs))], algorithm)
                     for i in range(len(keys)) for gi, g in enumerate(gs)]
        return self.manifest_names(part, keys, groups), manifests

    def per(self, groups: Sequence[int] | None) -> int:
        """Objects a block has in :meth:`names`' order (every kind, every group named)."""
        return len(self.spec.kinds) * len(self.groups_of(groups))

    def get(self, part: int, keys: Sequence[str], groups: Sequence[int] | None,
                     views: Sequence[memoryview], scatter: Scatter | None = None,
                     deferred: Deferred | None = None, manifests: Manifests | None = None) -> int:
        """Get the objects of ``keys``' blocks into ``views``; leading blocks that arrived whole
        and verified (see the module's docstring). With ``scatter``, every block counted has
        been put in place by it. With ``deferred`` too, blocks whose manifests hold SUM64 are
        scattered and counted once they arrived whole, and left to verify where they landed:
        their keys and expected checksums are appended to ``deferred``
        (:meth:`verify_deferred`). ``manifests``: these blocks' manifests, read already (a
        backend reading a transfer piece by piece reads them all at once, by
        :meth:`read_manifests`, and hands each piece its slice, :func:`manifest_slice`)."""
        names, per = self.names(part, keys, groups), self.per(groups)
        if not self.verify:
            got = self.store.batch_get_into(names, list(views))
            n = leading(all(got[j] == views[j].nbytes for j in range(i * per, (i + 1) * per)) for i in range(len(keys)))
            if scatter is not None and n:
                scatter(n)
            return n
        gs = self.groups_of(groups)
        read, vouched = self.read_manifests(part, keys, groups) if manifests is None else manifests
        hashed = any(algorithm == XXH3 for algorithm, _ in vouched)  # hash as the store copies
        got, host = (self.store.batch_get_hashed(names, list(views)) if hashed
                     else (self.store.batch_get_into(names, list(views)), None))
        whole = self.arrived(keys, gs, got, vouched)
        if deferred is not None and scatter is not None and whole and \
                all(a == SUM64 for a, _ in vouched[:whole * len(gs)]):
            scatter(whole)  # checked where they land, after the whole read
            deferred.extend((keys[i], self.expected(i, gs, vouched)) for i in range(whole))
            self.evict_if_broken(part, keys, groups, got, read, whole)
            return whole
        sums = [host[j] if host is not None and vouched[(j // per) * len(gs) + j % len(gs)][0] == XXH3
                else sum64(views[j][:max(got[j], 0)]) for j in range(whole * per)]
        count = self._verified(part, keys, groups, whole, got, read, vouched, sums)
        if scatter is not None and count:
            scatter(count)
        return count

    def read_manifests(self, part: int, keys: Sequence[str], groups: Sequence[int] | None) -> Manifests:
        """Read the manifests of ``keys``' blocks in one batch: (bytes read per manifest, the
        leading ones that parse as (algorithm, entries)); reading stops vouching at the first
        that does not."""
        gs, nk = self.groups_of(groups), len(self.spec.kinds)
        heads = [bytearray(manifest_size(nk)) for _ in range(len(keys) * len(gs))]
        read = self.store.batch_get_into(self.manifest_names(part, keys, groups), heads)
        vouched = []  # per manifest, in order, while each parses: (algorithm, entries)
        for m, (head, n) in enumerate(zip(heads, read)):
            try:
                vouched.append(unpack_manifest(head, n, self.geometry[gs[m % len(gs)]], nk))
            except ManifestError:
                break
        return read, vouched

    def expected(self, i: int, gs: list[int | None], vouched: list[tuple[int, list[tuple[int, int]]]]) -> list[int]:
        """Block ``i``'s objects' recorded checksums, in object order (kind, then group)."""
        nk, ng = len(self.spec.kinds), len(gs)
        return [vouched[i * ng + gi][1][k][1] for k in range(nk) for gi in range(ng)]

    def verify_deferred(self, part: int, deferred: Deferred, sums: Sequence[Sequence[int]]) -> int:
        """Leading blocks of a deferred get whose objects' checksums, taken where they landed
        (``sums[i]``, in object order), are the recorded ones; the first that is not is evicted.
        Without a sum for every block (none could be taken), none counts."""
        if len(sums) != len(deferred):
            return 0
        for i, ((key, want), have) in enumerate(zip(deferred, sums)):
            if list(have) != want:
                self.evict_block(part, key)
                return i
        return len(deferred)

    def arrived(self, keys: Sequence[str], gs: list[int | None], got: list[int],
                 vouched: list[tuple[int, list[tuple[int, int]]]]) -> int:
        """Leading blocks whose manifests parsed and whose objects arrived at their recorded lengths."""
        ng = len(gs)
        for i in range(len(keys)):
            for gi in range(ng):
                m = i * ng + gi
                if m >= len(vouched) or any(got[j] != length for j, (length, _) in
                                            zip(self.objects_of(i, gi, ng), vouched[m][1])):
                    return i
        return len(keys)

    def _verified(self, part: int, keys: Sequence[str], groups: Sequence[int] | None, whole: int, got: list[int],
                  read: list[int], vouched: list[tuple[int, list[tuple[int, int]]]], sums: Sequence[int]) -> int:
        """Leading blocks whose checksums match; the first that does not, or that arrived short
        or unvouched though stored, is evicted."""
        ng = len(self.groups_of(groups))
        for i in range(whole):
            for gi in range(ng):
                entries = vouched[i * ng + gi][1]
                if any(sums[j] != checksum for j, (_, checksum) in zip(self.objects_of(i, gi, ng), entries)):
                    self.evict_block(part, keys[i])
                    return i
        self.evict_if_broken(part, keys, groups, got, read, whole)
        return whole

    def evict_if_broken(self, part: int, keys: Sequence[str], groups: Sequence[int] | None, got: list[int],
                         read: list[int], i: int) -> None:
        """Evict block ``i``, the first that did not arrive whole, if it is broken rather than
        missing or unreachable: every object and manifest came (short, corrupt or foreign) or
        was stored too large. A get that failed says nothing of the object (a missing one, a
        transport error, an object another writer is storing this instant): evicting on it
        would destroy a block other requests are reading, so it is a failed read only."""
        if i >= len(keys):
            return
        ng = len(self.groups_of(groups))
        mine = [got[j] for gi in range(ng) for j in self.objects_of(i, gi, ng)] + list(read[i * ng:(i + 1) * ng])
        if all(n >= 0 or n == TOO_LARGE for n in mine):
            self.evict_block(part, keys[i])

    def evict_block(self, part: int, key: str) -> None:
        """A read found this block broken in this head group: its objects and manifests leave the
        store (every group: a layer-wise write stores them one by one), so the next write of
        the prompt stores it again."""
        self.broken_blocks += 1
        self.store.evict(self.names(part, [key]) + self.manifest_names(part, [key], None))

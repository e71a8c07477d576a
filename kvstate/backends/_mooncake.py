"""The Mooncake store client: kvstate's :class:`~kvstate.backends._base.Store` over ``MooncakeDistributedStore``.

A local master for tests and the demo: :mod:`kvstate.backends._mooncake_master`.

Version: ``mooncake-transfer-engine`` 0.3.12 and newer need the NVIDIA driver library
(``libcuda``) just to import, so they cannot run on a CPU-only host; kvstate pins
0.3.10.post2, which needs only ``libcudart.so.12``. That library comes from the pip package
``nvidia-cuda-runtime-cu12`` and is loaded here before the import, so no LD_LIBRARY_PATH is
needed. The transfer engine also links ``libibverbs`` (Debian: ``libibverbs1
ibverbs-providers``), even over tcp.

Data path: a batch whose buffers all lie in memory its caller registered (:meth:`MooncakeStore.register_memory`:
a backend's staging slots, registered with the transfer engine once) moves straight from and
into them, no copy in Python. Any other batch goes through one staging buffer registered at
start-up (``register_buffer``): puts copy the caller's buffers into it and call
``batch_put_from``, gets call ``batch_get_into`` and copy out. Per-key results keep Mooncake's
meaning: bytes read (a short read is a miss to the backend), negative on error.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import itertools
import os
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import ConfigError, StoreError, ValidationError
from .._validate import is_int, is_real
from ._base import MISSING, Store, check_batch, check_keys, check_verify

__all__ = ["MooncakeConfig", "MooncakeStore", "load_mooncake", "probe", "host_port", "INSTALL_HINT"]

INSTALL_HINT = ("pip install 'kvstate[mooncake]' (mooncake-transfer-engine==0.3.10.post2 and "
                "nvidia-cuda-runtime-cu12) and apt-get install libibverbs1 ibverbs-providers")
MAX_MOONCAKE_KEY = 256


#: where Mooncake's own logging goes unless asked for (``MC_LOG_DIR`` or ``MC_LOG_LEVEL`` set)
LOG_DIR = os.path.join(tempfile.gettempdir(), f"kvstate-mooncake-logs-{os.getuid()}")


def mooncake_log_dir() -> str | None:
    """The directory Mooncake logs into: the user's ``MC_LOG_DIR``, or none when they set
    ``MC_LOG_LEVEL`` (their choice of what reaches stderr), else :data:`LOG_DIR`, set here for
    this process and its children. A healthy client writes a hundred lines, one of them an
    error (its first metadata lookup misses), which do not belong on the engine's stderr."""
    if os.environ.get("MC_LOG_DIR"):
        return os.environ["MC_LOG_DIR"]
    if os.environ.get("MC_LOG_LEVEL"):
        return None
    os.makedirs(LOG_DIR, mode=0o700, exist_ok=True)
    os.environ["MC_LOG_DIR"] = LOG_DIR
    return LOG_DIR


@contextlib.contextmanager
def _stderr_to(log_dir: str | None) -> Iterator[None]:
    """Send file descriptor 2 to ``log_dir/client-stderr.log`` for the block (nothing without a
    directory): glog writes errors to stderr besides its files, a client's setup among them."""
    if log_dir is None:
        yield
        return
    saved = os.dup(2)
    try:
        fd = os.open(os.path.join(log_dir, "client-stderr.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def load_mooncake() -> Any:
    """Import ``mooncake.store`` after loading libcudart from the pip package; clear errors.
    Mooncake's logging goes to :func:`mooncake_log_dir` unless asked for."""
    mooncake_log_dir()
    try:
        import nvidia.cuda_runtime as cr
        libs = sorted(glob.glob(os.path.join(list(cr.__path__)[0], "lib", "libcudart.so*")))
        if not libs:
            raise ImportError("libcudart.so.12 not found in nvidia-cuda-runtime-cu12")
        ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
    except ImportError as e:
        raise StoreError(f"the Mooncake store needs libcudart.so.12 ({e}): {INSTALL_HINT}") from None
    try:
        from mooncake import store
    except ImportError as e:
        hint = "apt-get install libibverbs1 ibverbs-providers" if "ibverbs" in str(e) else INSTALL_HINT
        raise StoreError(f"cannot import mooncake.store ({e}): {hint}") from None
    return store


RDMA_SYSFS = "/sys/class/infiniband"  #: where the kernel lists RDMA devices


def rdma_devices() -> list[str]:
    """The host's RDMA devices (none: ``rdma`` cannot run here)."""
    try:
        return sorted(os.listdir(RDMA_SYSFS))
    except OSError:
        return []


def host_port(value: str, setting: str) -> tuple[str, int]:
    """``HOST:PORT`` split and checked, or a ConfigError naming ``setting``."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{setting} must be HOST:PORT, got {value!r}")
    return host, int(port)


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the pool is and how this client joins it.

    ``master`` is the master's RPC ``HOST:PORT``; ``metadata`` the metadata server URL (the
    master's built-in one is ``http://HOST:PORT/metadata``); ``global_segment_size`` the bytes
    this client contributes to the pool; ``local_buffer_size`` its transfer buffer;
    ``staging_bytes`` the registered staging buffer every batch goes through.
    """

    master: str
    metadata: str
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    device_name: str = ""
    global_segment_size: int = 256 << 20
    local_buffer_size: int = 64 << 20
    staging_bytes: int = 64 << 20
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        self.validate()  # a config that exists is valid

    def validate(self) -> None:
        for name in ("master", "metadata", "protocol", "local_hostname", "device_name"):
            v = getattr(self, name)
            if not isinstance(v, str) or "\0" in v or (not v and name != "device_name"):
                raise ConfigError(f"MooncakeConfig.{name} must be a{'' if name == 'device_name' else ' non-empty'} "
                                  f"str, got {v!r}")
        host_port(self.master, "master")
        if not self.metadata.startswith(("http://", "etcd://", "P2PHANDSHAKE")):
            raise ConfigError(f"metadata must be an http:// URL (e.g. http://127.0.0.1:8080/metadata), "
                              f"got {self.metadata!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.protocol == "rdma" and not rdma_devices():
            raise ConfigError(f"protocol 'rdma': this host has no RDMA device (nothing in {RDMA_SYSFS}); "
                              "use protocol 'tcp', which Mooncake would otherwise not fall back to cleanly")
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        for name in ("global_segment_size", "local_buffer_size", "staging_bytes"):
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ConfigError(f"{name} must be an int > 0, got {v!r}")
            if v > total:
                raise ConfigError(f"{name} = {v} bytes is larger than this machine's memory ({total} bytes): "
                                  "choose a smaller segment")
        if not is_real(self.connect_timeout) or not 0 < self.connect_timeout <= 3600:
            raise ConfigError(f"connect_timeout must be seconds in (0, 3600], got {self.connect_timeout!r}")


def probe(cfg: MooncakeConfig) -> None:
    """Check the master's RPC port and the metadata server answer, or raise StoreError saying how to fix it."""
    host, port = host_port(cfg.master, "master")
    try:
        with socket.create_connection((host, port), timeout=cfg.connect_timeout):
            pass
    except OSError as e:
        raise StoreError(f"Mooncake master {cfg.master} is unreachable ({e}): start mooncake_master there "
                         "or pass the right --master HOST:PORT (kvstate demo --start-master starts one)") from None
    if cfg.metadata.startswith("http://"):
        try:
            urllib.request.urlopen(cfg.metadata + "?key=kvstate-probe", timeout=cfg.connect_timeout)
        except urllib.error.HTTPError:
            pass  # the server answered (404 for an unknown key): it is there
        except (urllib.error.URLError, OSError) as e:
            raise StoreError(f"metadata server {cfg.metadata} does not answer ({e}): start the master with "
                             "--enable_http_metadata_server=true or fix --metadata") from None


class MooncakeStore(Store):
    """A client of a Mooncake pool, behind kvstate's batch store interface."""

    def __init__(self, config: MooncakeConfig, *, verify: bool = True) -> None:
        """``verify``: blocks stored carry checksummed manifests (every client of the pool alike)."""
        self.verify = check_verify(verify, "MooncakeStore")
        config.validate()
        probe(config)
        self._mc = load_mooncake()
        self.config = config
        self._lock = threading.Lock()
        self._closed = False
        self._staging = np.empty(config.staging_bytes, np.uint8)
        self._base = self._staging.ctypes.data
        self._regions: dict[int, int] = {}  # memory callers registered: address -> bytes
        self.direct_batches = 0  #: batches moved straight from or into registered memory
        self._up, self._checked = False, time.monotonic()
        self.reconnects = 0
        self._sentinel = f"kvstate-sentinel-{uuid.uuid4().hex}"
        self._join()

    def _join(self) -> None:
        """Create a client, join the pool, register the staging buffer."""
        config = self.config
        self._store = self._mc.MooncakeDistributedStore()
        with _stderr_to(mooncake_log_dir()):
            rc = self._store.setup(config.local_hostname, config.metadata, config.global_segment_size,
                                   config.local_buffer_size, config.protocol, config.device_name, config.master)
        if rc != 0:
            raise StoreError(f"Mooncake setup failed with code {rc} (master {config.master}, metadata "
                             f"{config.metadata}, protocol {config.protocol}, global_segment_size "
                             f"{config.global_segment_size}): code -600 means invalid parameters, e.g. a "
                             "segment under 16 MiB")
        rc = self._store.register_buffer(self._base, self._staging.nbytes)
        if rc != 0:
            self._store.close()
            raise StoreError(f"Mooncake could not register the {config.staging_bytes}-byte staging buffer "
                             f"(code {rc})")
        for base, nbytes in list(self._regions.items()):  # a re-joined client registers them again
            if self._store.register_buffer(base, nbytes) != 0:
                del self._regions[base]  # its batches go through staging from now on
        self._up = self._put_sentinel()

    def _put_sentinel(self) -> bool:
        """Store this client's sentinel in its own segment (a put placed on another client's
        segment fails while that client re-joins after a restart); its absence later reveals a
        restarted master. False when it could not be stored: the next probe joins again."""
        own = self._mc.ReplicateConfig()
        own.replica_num, own.preferred_segment = 1, self._store.get_hostname()
        return list(self._store.batch_put_from([self._sentinel], [self._base], [8], own)) == [0]

    # -- liveness: fail fast while the master is down, re-join when it is back ------------------
    LIVENESS_INTERVAL = 0.5  #: seconds between master probes
    #: Mooncake's TRANSFER_FAIL and RPC_FAIL: this client's links to the pool broke (a master that
    #: restarted between two probes forgot the other clients' segments); it joins again
    BROKEN_CODES = frozenset((-800, -900))

    def _note(self, codes: Sequence[int]) -> None:
        """After a batch: codes saying the client is broken make the next call re-join."""
        if any(c in self.BROKEN_CODES for c in codes):
            self._up, self._checked = False, 0.0

    def _ensure_master(self) -> None:
        """Called under the lock before each batch. A dead master would make Mooncake calls
        block for seconds in RPC retries; instead every call fails at once with StoreError,
        and the client re-joins the pool (a new segment, a re-registered buffer) once the
        master answers again. A master that restarted between two probes answers too, but has
        forgotten every client: each client keeps a small sentinel object in the pool, and one
        whose sentinel is gone re-joins (so does one a batch found broken, :attr:`BROKEN_CODES`;
        a sentinel evicted from a full pool costs one needless re-join). Objects stored before
        a restart are gone: reads miss."""
        now = time.monotonic()
        if self._up and now - self._checked < self.LIVENESS_INTERVAL:
            return
        host, port = host_port(self.config.master, "master")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                alive = True
        except OSError:
            alive = False
        self._checked = now
        if not alive:
            self._up = False
            raise StoreError(f"Mooncake master {self.config.master} is unreachable: failing fast until it is back")
        if self._up and self._store.batch_is_exist([self._sentinel]) != [1]:
            self._up = False  # the master answers but lost this client's sentinel: it restarted
        if not self._up:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001 - the old client may already be broken
                pass
            self._join()  # up once its sentinel is stored
            self.reconnects += 1

    # -- memory callers register: batches without a copy --------------------------------------
    def register_memory(self, buffer: Any) -> bool:
        """Register writable, contiguous host memory with the transfer engine; a batch whose
        buffers all lie in registered memory moves without the staging copy. False (nothing
        registered) when the engine refuses it."""
        v = check_batch(["buffer"], "MooncakeStore.register_memory", [buffer])[0]
        if v.readonly or not v.nbytes:
            raise ValidationError("MooncakeStore.register_memory: the memory must be writable and not empty")
        base = _address(v)
        with self._lock:
            if self._closed:
                raise StoreError("MooncakeStore.register_memory: the store is closed")
            if base in self._regions:
                return True
            if self._store.register_buffer(base, v.nbytes) != 0:
                return False
            self._regions[base] = v.nbytes
        return True

    def unregister_memory(self, buffer: Any) -> None:
        """Forget registered memory (before its owner frees it); unknown memory is ignored."""
        base = _address(check_batch(["buffer"], "MooncakeStore.unregister_memory", [buffer])[0])
        with self._lock:
            if self._regions.pop(base, None) is not None and not self._closed:
                self._store.unregister_buffer(base)

    def _registered(self, views: list[memoryview], writing: bool) -> list[int] | None:
        """Each view's address when every one lies in registered memory (and, for a get, is
        writable); None otherwise."""
        if not self._regions:
            return None
        out = []
        for v in views:
            if writing and v.readonly:
                return None
            a = _address(v)
            if not any(base <= a and a + v.nbytes <= base + n for base, n in self._regions.items()):
                return None
            out.append(a)
        return out

    # -- batching through the registered staging buffer --------------------------------------
    def _groups(self, views: list[memoryview]) -> list[tuple[int, int]]:
        """Split a batch into [start, end) groups that fit the staging buffer."""
        groups, start, used = [], 0, 0
        cap = self._staging.nbytes
        for i, v in enumerate(views):
            if v.nbytes > cap:
                raise ValidationError(f"an object of {v.nbytes} bytes exceeds the {cap}-byte staging buffer "
                                      "(raise MooncakeConfig.staging_bytes)")
            if used + v.nbytes > cap:
                groups.append((start, i))
                start, used = i, 0
            used += v.nbytes
        groups.append((start, len(views)))
        return groups

    def _check_keys(self, keys: Sequence[str], op: str) -> None:
        if self._closed:
            raise StoreError(f"MooncakeStore.{op}: the store is closed")
        check_keys(keys, f"MooncakeStore.{op}")
        for k in keys:
            if len(k) > MAX_MOONCAKE_KEY:
                raise ValidationError(f"MooncakeStore.{op}: key {k[:40]!r}... is {len(k)} chars, "
                                      f"over Mooncake's {MAX_MOONCAKE_KEY}")

    def _check_batch(self, keys: Sequence[str], buffers: Sequence[Any], op: str) -> list[memoryview]:
        self._check_keys(keys, op)
        return check_batch(keys, f"MooncakeStore.{op}", buffers)

    def _in_groups(self, keys: Sequence[str], views: list[memoryview],
                   move: Callable[[list[str], list[memoryview], list[int]], list[int]],
                   direct: Callable[[list[str], list[int], list[int]], list[int]], writing: bool) -> list[int]:
        """Under the lock, with the master up: ``direct(keys, addresses, sizes)`` when every
        buffer lies in registered memory; else ``move(keys, views, offsets)`` for each run of
        objects that fits the staging buffer together (placed back to back at ``offsets``).
        The per-key results in order."""
        out: list[int] = []
        with self._lock:
            self._ensure_master()
            addresses = self._registered(views, writing)
            if addresses is not None:
                self.direct_batches += 1
                return direct(list(keys), addresses, [v.nbytes for v in views])
            for a, b in self._groups(views):
                group = views[a:b]
                offs = list(itertools.accumulate((v.nbytes for v in group), initial=0))[:-1]
                out.extend(move(list(keys[a:b]), group, offs))
        return out

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        def put(ks: list[str], group: list[memoryview], offs: list[int]) -> list[int]:
            for v, o in zip(group, offs):
                self._staging[o:o + v.nbytes] = np.frombuffer(v, np.uint8)
            return store(ks, [self._base + o for o in offs], [v.nbytes for v in group])

        def store(ks: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
            rcs = self._store.batch_put_from(ks, addresses, sizes)
            self._note(rcs)
            return [0 if rc == 0 else (rc if rc < 0 else MISSING) for rc in rcs]

        return self._in_groups(keys, self._check_batch(keys, buffers, "batch_put_from"), put, store, False)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        def get(ks: list[str], group: list[memoryview], offs: list[int]) -> list[int]:
            got = self._store.batch_get_into(ks, [self._base + o for o in offs], [v.nbytes for v in group])
            self._note(got)
            for v, o, n in zip(group, offs, got):
                if n > 0:
                    v[:n] = self._staging.data[o:o + n]
            return list(got)

        def load(ks: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
            got = self._store.batch_get_into(ks, addresses, sizes)
            self._note(got)
            return list(got)

        return self._in_groups(keys, self._check_batch(keys, buffers, "batch_get_into"), get, load, True)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self._check_keys(keys, "batch_is_exist")
        with self._lock:
            self._ensure_master()
            return [1 if r == 1 else 0 for r in self._store.batch_is_exist(list(keys))]

    def check(self) -> bool:
        """Probe the pool now, re-joining it if the master came back (a rank worker calls this
        every heartbeat, so an idle client is ready before traffic returns). False while the
        master is down; a batch in progress (which probes anyway) makes this a no-op."""
        if self._closed or not self._lock.acquire(blocking=False):
            return not self._closed
        try:
            self._checked = 0.0
            self._ensure_master()
            return True
        except StoreError:
            return False
        finally:
            self._lock.release()

    def evict(self, keys: Sequence[str]) -> int:
        """Remove keys now (tests: a pool that evicted them)."""
        self._check_keys(keys, "evict")
        with self._lock:
            self._ensure_master()
            return sum(1 for rc in self._store.batch_remove(list(keys), True) if rc == 0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            try:
                for base in [self._base, *self._regions]:
                    self._store.unregister_buffer(base)
                self._regions.clear()
            finally:
                self._store.close()


def _address(v: memoryview) -> int:
    """Where a byte view's memory starts (read-only views too)."""
    return int(np.frombuffer(v, np.uint8).ctypes.data) if v.nbytes else 0

"""A local ``mooncake_master`` process, owned and ended by whoever starts it.

The master runs with its HTTP metadata server on free loopback ports; ``start()`` waits until
both answer, ``stop()`` ends it by its process group (TERM, then KILL), and on Linux the
kernel kills it if its owner dies, even by a crash. A missing ``libibverbs1`` makes the binary
exit at once with 127: the error says which Debian packages to install.
"""
from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._errors import StoreError
from ._mooncake import INSTALL_HINT, MooncakeConfig, probe

__all__ = ["MooncakeMaster"]


def _free_port() -> int:
    """A port below the ephemeral range that binds on every interface (the master's HTTP
    servers bind 0.0.0.0, and Mooncake's tcp transport leaves many ephemeral ports in
    TIME_WAIT, where a port the kernel just handed out can still collide)."""
    lo, hi = 20000, 32000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo_eph = int(f.read().split()[0])
        hi = min(hi, lo_eph)
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise StoreError("no free port found for mooncake_master")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the kernel sends SIGKILL to the master if its owner dies, even by a crash."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _master_binary() -> str:
    """The real ``mooncake_master`` binary shipped in the package (the console script of the
    same name is a Python wrapper that spawns it, so its PID is not the server's)."""
    try:
        import mooncake
        cand = Path(mooncake.__file__).parent / "mooncake_master"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise StoreError(f"mooncake_master was not found in the mooncake package or on PATH: {INSTALL_HINT}")


class MooncakeMaster:
    """A local ``mooncake_master`` with its HTTP metadata server, on free loopback ports.

    ``start()`` waits until both ports answer; ``stop()`` ends the process by its PID (TERM,
    then KILL). Use it as a context manager so the server never outlives its owner.
    """

    def __init__(self, host: str = "127.0.0.1", rpc_port: int | None = None, http_port: int | None = None,
                 log_path: str | os.PathLike[str] | None = None, extra_args: Sequence[str] = ()) -> None:
        self.host = host
        self._fixed_ports = bool(rpc_port or http_port)
        self.rpc_port = rpc_port or _free_port()
        self.http_port = http_port or _free_port()
        self.metrics_port = _free_port()
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def config(self, **overrides: Any) -> MooncakeConfig:
        return MooncakeConfig(master=self.address, metadata=self.metadata_url, local_hostname=self.host, **overrides)

    def start(self, timeout: float = 30.0, attempts: int = 3) -> MooncakeMaster:
        """Start the server and wait until it answers; on a port clash retry on fresh ports
        (only for ports this object chose itself)."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except StoreError:
                if attempt == attempts - 1 or self._fixed_ports:
                    raise
                self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> MooncakeMaster:
        cmd = [_master_binary(), f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
               "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
               f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}",
               *self.extra_args]
        with open(self.log_path or os.devnull, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        deadline = time.monotonic() + timeout
        cfg = MooncakeConfig(master=self.address, metadata=self.metadata_url, connect_timeout=0.5)
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                hint = (": it could not load its libraries (libibverbs.so.1): apt-get install libibverbs1 "
                        "ibverbs-providers" if code == 127 else "")
                raise StoreError(f"mooncake_master exited with code {code} at start "
                                 f"(ports {self.rpc_port}/{self.http_port}){hint}")
            try:
                probe(cfg)
                return self
            except StoreError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise StoreError(f"mooncake_master did not answer within {timeout}s") from None
                time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGTERM)  # its own session: the server and anything it spawned
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout)

    def kill(self) -> None:
        """Kill -9 (a crash), for failure tests."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> MooncakeMaster:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

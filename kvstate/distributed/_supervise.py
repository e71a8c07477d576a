"""Process supervision: start a worker process, watch it, and make sure it never outlives anyone.

Three rules keep the suite and an engine free of orphans:

- a child watches its parent: on Linux the kernel sends it SIGKILL when the parent dies
  (``PR_SET_PDEATHSIG``, set by :func:`die_with_parent` first thing in the child), and its
  loop also checks :func:`parent_alive` every heartbeat, for the case the kernel rule misses
  (the parent's thread that forked it ended, not the process);
- :meth:`ChildProcess.stop` asks nicely (SIGTERM), waits until its deadline, then kills
  (SIGKILL) and reaps, so a stop always ends within the deadline given;
- whoever starts a child owns it: a :class:`ChildProcess` is stopped by its owner's
  ``close()``, and by the interpreter's exit if the owner forgot (``atexit``).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from .._errors import ConfigError, DriverError
from .._validate import check_int, check_name
from ..backends._hostfiles import pid_alive, remove_orphans

__all__ = ["ChildProcess", "die_with_parent", "parent_alive", "pid_alive", "remove_orphans"]

_PR_SET_PDEATHSIG = 1
_LIVE: weakref.WeakSet[ChildProcess] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def die_with_parent(parent_pid: int) -> None:
    """In a child: have the kernel kill this process when its parent dies (Linux), and exit at
    once if the parent ``parent_pid`` is already gone (it may have died before this ran)."""
    if not parent_pid:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the heartbeat's parent check still ends the child
    if not parent_alive(parent_pid):
        os._exit(3)


def parent_alive(parent_pid: int) -> bool:
    """Whether this process's parent is still ``parent_pid`` (a dead parent's children are
    re-parented, so the pid changes)."""
    check_int(parent_pid, "parent_alive: parent_pid", minimum=0, maximum=2**31 - 1)
    return os.getppid() == parent_pid


class ChildProcess:
    """One child process running ``python -m MODULE ARGS...``, owned by whoever made it."""

    def __init__(self, module: str, args: Sequence[str], name: str, env: dict[str, str] | None = None,
                 quiet: bool = False, log_path: str | os.PathLike[str] | None = None) -> None:
        """``log_path``: a file the child's stdout and stderr are appended to (its libraries'
        logs too: Mooncake's clients log every retry); else they are this process's, or with
        ``quiet`` only stderr is. Everything is checked before the child starts."""
        check_name(name, "ChildProcess: name", error=ConfigError)
        if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
            raise ConfigError(f"{name}: module must be a dotted module name, got {module!r}")
        if isinstance(args, (str, bytes)) or not isinstance(args, Sequence) or \
                not all(isinstance(a, str) and "\0" not in a for a in args):
            raise ConfigError(f"{name}: args must be a sequence of str, got {args!r}")
        if env is not None and (not isinstance(env, dict) or
                                not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ConfigError(f"{name}: env must be a dict of str to str, or None")
        if quiet.__class__ is not bool:
            raise ConfigError(f"{name}: quiet must be a bool, got {quiet!r}")
        if log_path is not None and not isinstance(log_path, (str, os.PathLike)):
            raise ConfigError(f"{name}: log_path must be a path or None, got {log_path!r}")
        self.name = name
        with contextlib.ExitStack() as files:
            out: Any = subprocess.DEVNULL if quiet else None
            err: Any = None
            if log_path is not None:
                try:
                    out = err = files.enter_context(open(log_path, "ab"))  # the child keeps its own descriptor
                except (OSError, TypeError) as e:
                    raise ConfigError(f"{name}: cannot open its log file {log_path!r}: {e}") from None
            self.popen = subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=err, start_new_session=False)
        self.pid = self.popen.pid
        with _LIVE_LOCK:
            _LIVE.add(self)

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` (tests stop, continue and kill workers this way)."""
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait until ``timeout``, then SIGKILL; always reaped. Returns the exit status."""
        if self.alive():
            try:
                self.popen.terminate()
                self.popen.wait(max(0.0, timeout))
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL (a stopped process dies too) and reap; returns the exit status."""
        if self.alive():
            self.popen.kill()
        try:
            status = self.popen.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process the kernel cannot kill
            raise DriverError(f"{self.name} (pid {self.pid}) did not die after SIGKILL") from None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return status

    def wait(self, timeout: float) -> int | None:
        """The exit status once it exits within ``timeout`` seconds, else None."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.returncode


@atexit.register
def _stop_forgotten_children() -> None:
    """The interpreter is exiting: no child a forgetful owner left may survive it."""
    with _LIVE_LOCK:
        children = list(_LIVE)
    for c in children:
        try:
            c.kill()
        except DriverError:  # pragma: no cover
            pass

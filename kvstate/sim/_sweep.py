"""Where a sweep's simulations run: in this process, in local worker processes, or on Ray.

:func:`run_all` runs one function over a list of jobs and yields ``(index, result)`` as each
finishes, in whatever order they finish; the caller orders them (a plan's rows are sorted
by a total key), so the outcome is the same everywhere. Each job is independent and
deterministic (a scenario and its seed), so where it runs changes nothing in its result.

- one worker: in this process, in order;
- ``workers`` > 1: a pool of local processes (``fork``; ``spawn`` on macOS), Ctrl-C left to
  this process, which ends the pool; a worker takes SIGTERM's default back from this process
  (which may have a handler of its own), so ending the pool ends every worker, even one
  waiting on the pool's queue, and even one still starting: workers are born with SIGTERM
  and SIGINT blocked, and unblock them only once they have set their own dispositions;
- ``ray``: a Ray cluster's address (``auto`` finds the one this machine runs, or starts a local
  one for the sweep when none does and says so, ``HOST:PORT``
  its GCS, ``ray://HOST:PORT`` a Ray client). Each job is a task of one CPU, and kvstate's own
  package travels with the tasks (a ``py_modules`` runtime environment), so the cluster runs
  this very code; its other dependencies must be installed there. Nothing is left behind:
  unfinished tasks are cancelled and the connection closed, however the sweep ends (a cluster
  this process did not start keeps running), and the signal handlers Ray's connection set are
  put back as they were.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .._errors import ConfigError

__all__ = ["run_all", "WAIT_S", "CONNECT_S"]

WAIT_S = 1.0  #: how long one wait for a Ray task lasts before the loop looks again (Ctrl-C, progress)
CONNECT_S = 10.0  #: how long a cluster's address may take to answer


def run_all(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int = 1,
            ray: str | None = None) -> Iterator[tuple[int, Any]]:
    """``(index, fn(jobs[index]))`` for every job, as each finishes (see the module's docstring)."""
    if ray is not None:
        yield from _on_ray(fn, jobs, ray)
    elif workers <= 1 or len(jobs) <= 1:
        yield from enumerate(map(fn, jobs))
    else:
        yield from _on_pool(fn, jobs, min(workers, len(jobs)))


def _indexed(args: tuple[Callable[[Any], Any], int, Any]) -> tuple[int, Any]:
    fn, i, job = args
    return i, fn(job)


def _on_pool(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int) -> Iterator[tuple[int, Any]]:
    ctx = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
    pool = None
    try:
        # workers are born with them blocked (see _ignore_interrupts); a Ctrl-C meanwhile
        # arrives here once the pool is held, which the finally then ends
        with _blocked(_WORKER_SIGNALS):
            pool = ctx.Pool(workers, initializer=_ignore_interrupts)
        yield from pool.imap_unordered(_indexed, [(fn, i, job) for i, job in enumerate(jobs)])
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


#: the signals a pool worker must not see before its initializer has set them
_WORKER_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def _blocked(signals: Sequence[int]) -> Iterator[None]:
    """``signals`` blocked in this thread for the block, and so in every process it forks then
    (a fork inherits its thread's mask; so do the threads it starts)."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - no POSIX signals: nothing to inherit
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _ignore_interrupts() -> None:
    """A pool worker leaves Ctrl-C to the parent, which ends the pool: no traceback per worker.
    It dies of SIGTERM, whatever handler it inherited: ``Pool.terminate`` ends it with one and
    then joins it without a timeout, and a handler that returns would leave it (and the join)
    waiting forever on the pool's queue. The worker was born with both signals blocked, so one
    sent before this ran (a worker still starting when a short sweep ended) waits here and is
    taken with the worker's own dispositions when they are unblocked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _WORKER_SIGNALS)


@contextmanager
def _connected(address: str) -> Iterator[Any]:
    """Ray, connected to ``address``, with kvstate's package shipped to its workers."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'kvstate[ray]'") from None
    import kvstate

    _probe(address)
    env: dict[str, Any] = {"runtime_env": {"py_modules": [kvstate]}, "log_to_driver": False,
                           "logging_level": logging.ERROR}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # Ray's init sets its own
    try:
        ray.init(address=address, **env)
    except (ConnectionError, ValueError, RuntimeError) as e:
        if address != "auto":
            raise ConfigError(f"--ray {address}: cannot connect to a Ray cluster ({e})") from None
        # none runs here: a local instance for this sweep, shut down with it
        print("kvstate plan: no Ray cluster runs on this machine: started a local one for this sweep "
              "(`ray start --head` starts one that outlives it)", file=sys.stderr)
        try:
            ray.init(include_dashboard=False, **env)
        except (ConnectionError, ValueError, RuntimeError) as e2:
            raise ConfigError(f"--ray auto: no Ray cluster runs here and a local one did not start ({e2}); "
                              "start one with `ray start --head`") from None
    try:
        yield ray
    finally:
        ray.shutdown()
        if threading.current_thread() is threading.main_thread():  # the only thread that may set them
            for sig, handler in handlers.items():  # the calling program's handlers, as they were
                if handler is not None:
                    signal.signal(sig, handler)


def _probe(address: str, timeout: float = CONNECT_S) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) must take a TCP connection within ``timeout``:
    Ray itself retries an absent cluster for minutes."""
    if address == "auto":
        return  # Ray looks the local cluster up and fails at once when there is none
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--ray {address}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConfigError(f"--ray {address}: cannot connect to a Ray cluster ({e.strerror or e})") from None


def _on_ray(fn: Callable[[Any], Any], jobs: Sequence[Any], address: str) -> Iterator[tuple[int, Any]]:
    with _connected(address) as ray:
        task = ray.remote(num_cpus=1, max_retries=2)(fn)
        index = {}
        for i, job in enumerate(jobs):
            index[task.remote(job)] = i
        pending = list(index)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=WAIT_S)
                for ref in done:
                    yield index[ref], ray.get(ref)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)

"""kvstate across processes: rank workers, the driver that feeds them, and P-to-D messages.

- :mod:`~kvstate.distributed._wire`: the messages and their checks (msgpack);
- :mod:`~kvstate.distributed._rankworker`: the process that runs one TP rank's transfers;
- :mod:`~kvstate.distributed._procdriver`: :class:`ProcessDriver`, the scheduler's side, with
  :class:`~kvstate.backends._drivers.ThreadedDriver`'s interface;
- :mod:`~kvstate.distributed._liveness`: which ranks are up, and what each owes;
- :mod:`~kvstate.distributed._supervise`: child processes that never outlive their parent;
- :mod:`~kvstate.backends._shm`: host caches in shared memory, created by the engine and
  attached by rank workers (:mod:`~kvstate.backends._cudaipc`: the same on the GPU);
- :mod:`~kvstate.distributed._pdlink`: messages between P's and D's scheduler processes.

The core knows none of this: it only sees commands out and completions in. ZeroMQ (``pyzmq``)
and ``msgpack`` are this package's own dependencies.
"""
from ..backends._cudaipc import share_caches
from ..backends._shm import SharedCaches
from ._liveness import RankDown, RankUp
from ._pdlink import Link
from ._procdriver import ProcessDriver
from ._rankworker import RankWorker, WorkerConfig
from ._supervise import ChildProcess, die_with_parent, parent_alive

__all__ = ["ProcessDriver", "RankWorker", "WorkerConfig", "SharedCaches", "share_caches", "RankDown", "RankUp",
           "Link", "ChildProcess", "die_with_parent", "parent_alive"]

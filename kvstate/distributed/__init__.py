"""kvstate across processes: rank workers, the driver that feeds them, and P-to-D messages.

- :mod:`~kvstate.distributed.wire`: the messages and their checks (msgpack);
- :mod:`~kvstate.distributed.rankworker`: the process that runs one TP rank's transfers;
- :mod:`~kvstate.distributed.procdriver`: :class:`ProcessDriver`, the scheduler's side, with
  :class:`~kvstate.backends.drivers.ThreadedDriver`'s interface;
- :mod:`~kvstate.distributed.liveness`: which ranks are up, and what each owes;
- :mod:`~kvstate.distributed.supervise`: child processes that never outlive their parent;
- :mod:`~kvstate.distributed.shm`: host caches in shared memory, created by the engine and
  attached by rank workers (:mod:`~kvstate.distributed.cudaipc`: the same on the GPU);
- :mod:`~kvstate.distributed.pdlink`: messages between P's and D's scheduler processes.

The core knows none of this: it only sees commands out and completions in. ZeroMQ (``pyzmq``)
and ``msgpack`` are this package's own dependencies.
"""
from .liveness import RankDown, RankUp
from .procdriver import ProcessDriver
from .rankworker import RankWorker, WorkerConfig
from .shm import SharedCaches

__all__ = ["ProcessDriver", "RankWorker", "WorkerConfig", "SharedCaches", "RankDown", "RankUp"]

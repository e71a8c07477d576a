"""Backends at the edge of the sans-I/O core: interfaces, stores, the reference backend, drivers.

:mod:`~kvstate.backends.cuda` (GPU caches), :mod:`~kvstate.backends.mooncake` (the Mooncake
store client) and :mod:`~kvstate.backends.mooncake_master` (a local master) are imported on
demand: their packages are optional.
"""
from .base import MISSING, Guard, Store, TransferBackend, check_fence, leading
from .drivers import Driver, StepDriver, ThreadedDriver
from .filestore import FileStore
from .objects import StoreBackend
from .reference import ReferenceBackend
from .runner import CommandRunner, execute
from .stores import MemoryStore

__all__ = ["Store", "MemoryStore", "FileStore", "MISSING", "TransferBackend", "StoreBackend", "ReferenceBackend",
           "Guard", "check_fence", "leading", "Driver", "StepDriver", "ThreadedDriver", "CommandRunner", "execute"]

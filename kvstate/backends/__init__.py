"""Backends at the edge of the sans-I/O core: interfaces, stores, the reference and CUDA
backends, drivers. This package's face is its contract; its ``_x`` modules are not.

``CudaBackend`` (GPU caches), ``MooncakeStore`` and ``MooncakeConfig`` (the Mooncake store
client) and ``MooncakeMaster`` (a local master) are imported on first use: the packages they
drive (CuPy, Mooncake) are optional, and importing this face costs none of them.
"""
from typing import Any

from ._arena import ArenaStore
from ._base import MISSING, Guard, Store, TransferBackend, check_fence
from ._drivers import Driver, StepDriver, ThreadedDriver
from ._filestore import FileStore
from ._objects import StoreBackend
from ._reference import ReferenceBackend
from ._stores import MemoryStore

__all__ = ["Store", "MemoryStore", "FileStore", "ArenaStore", "MISSING", "TransferBackend", "StoreBackend",
           "ReferenceBackend", "CudaBackend", "MooncakeStore", "MooncakeConfig", "MooncakeMaster", "Guard",
           "check_fence", "Driver", "StepDriver", "ThreadedDriver"]

#: names imported on first use, and the module that holds each
_ON_DEMAND = {"CudaBackend": "._cuda", "MooncakeStore": "._mooncake", "MooncakeConfig": "._mooncake",
              "MooncakeMaster": "._mooncake_master"}


def __getattr__(name: str) -> Any:
    """``CudaBackend`` and the Mooncake names, imported when first asked for (PEP 562)."""
    if name not in _ON_DEMAND:
        raise AttributeError(f"module 'kvstate.backends' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_ON_DEMAND[name], __name__), name)
    globals()[name] = value
    return value

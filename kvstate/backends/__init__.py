"""Backends at the edge of the sans-I/O core: stores, the reference backend, drivers."""
from .drivers import StepDriver, ThreadedDriver, execute
from .reference import ReferenceBackend, TransferBackend, leading
from .stores import MISSING, FileStore, MemoryStore, Store

__all__ = ["Store", "MemoryStore", "FileStore", "MISSING", "TransferBackend", "ReferenceBackend",
           "leading", "StepDriver", "ThreadedDriver", "execute"]

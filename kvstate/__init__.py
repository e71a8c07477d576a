"""kvstate: the KV-cache life of PD-disaggregated LLM serving as explicit state machines.

The core (this package) is sans-I/O: lifecycle objects consume events and emit commands.
Subpackages: :mod:`kvstate.kernels` (transfer ops), :mod:`kvstate.backends` (reference and
CUDA backends, stores, drivers), :mod:`kvstate.sim` (the SimPy simulator) and
:mod:`kvstate.app` (the command line and the demo); :mod:`kvstate.testing` holds helpers for
tests and integrators.
"""
from __future__ import annotations

from . import commands, events
from ._blocks import BlockManager, EngineBlocks
from ._decode import DECODE, DecodeLifecycle
from ._errors import (
    BlockError,
    ConfigError,
    DriverError,
    DuplicateRequestError,
    FenceError,
    InvalidTransitionError,
    KVStateError,
    OutOfBlocksError,
    ProtocolError,
    StoreError,
    UnknownRequestError,
    ValidationError,
)
from ._keys import KeyCache, block_keys, rank_key
from ._layers import LayerGroup
from ._lifecycle import Lifecycle
from ._machine import MachineDef
from ._policy import Policy
from ._pool import FREED, BlockPool, PoolStats
from ._prefill import PREFILL, PrefillLifecycle
from ._spec import CacheSpec, paired
from ._tables import rows, slot_of_layer, table_of_layer
from ._timeline import Timeline

__version__ = "0.2.0"

#: Every lifecycle machine by name.
MACHINES: dict[str, MachineDef] = {PREFILL.name: PREFILL, DECODE.name: DECODE}

__all__ = [
    "CacheSpec", "BlockPool", "PoolStats", "BlockManager", "EngineBlocks", "Policy", "block_keys", "rank_key",
    "KeyCache", "LayerGroup", "paired", "FREED", "rows", "slot_of_layer", "table_of_layer", "Timeline",
    "Lifecycle", "PrefillLifecycle", "DecodeLifecycle", "MachineDef", "MACHINES", "PREFILL", "DECODE",
    "commands", "events",
    "KVStateError", "ValidationError", "BlockError", "OutOfBlocksError", "UnknownRequestError",
    "DuplicateRequestError", "InvalidTransitionError", "StoreError", "ConfigError", "DriverError",
    "FenceError", "ProtocolError", "__version__",
]

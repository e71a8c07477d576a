"""The public faces are the contract: each package's ``__all__`` pinned here, so a name is
added to (or taken from) a face on purpose, in the same change as this list."""
from __future__ import annotations

import importlib

import pytest

FACES = {
    "kvstate": [
        "BlockError", "BlockManager", "BlockPool", "CacheSpec", "ConfigError", "DECODE", "DecodeLifecycle",
        "DriverError", "DuplicateRequestError", "EngineBlocks", "FenceError", "InvalidTransitionError",
        "KVStateError", "KeyCache", "Lifecycle", "MACHINES", "MachineDef", "OutOfBlocksError", "PREFILL", "Policy",
        "PoolStats", "PrefillLifecycle", "ProtocolError", "StoreError", "UnknownRequestError", "ValidationError",
        "__version__", "block_keys", "commands", "events", "rank_key"],
    "kvstate.backends": [
        "CommandRunner", "Driver", "FileStore", "Guard", "MISSING", "MemoryStore", "ReferenceBackend",
        "StepDriver", "Store", "StoreBackend", "ThreadedDriver", "TransferBackend", "check_fence", "execute",
        "leading"],
    "kvstate.distributed": ["ProcessDriver", "RankDown", "RankUp", "RankWorker", "SharedCaches", "WorkerConfig"],
    "kvstate.sim": [
        "Cluster", "Scenario", "format_report", "load_scenario", "load_trace", "plan", "scenario_from_dict",
        "search_deadlocks", "simulate", "to_json", "to_toml", "with_overrides"],
    "kvstate.kernels": [
        "DIRECTIONS", "LayerSet", "TransferPlan", "as_numpy", "coalesce_runs", "swap_cache_all_layers",
        "swap_cache_layout", "swap_cache_per_layer"],
}


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_exports_exactly_its_pinned_names_and_each_resolves(face):
    mod = importlib.import_module(face)
    assert sorted(mod.__all__) == sorted(FACES[face])
    assert len(set(mod.__all__)) == len(mod.__all__)  # no name twice
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, missing


def test_every_class_a_face_exports_says_what_it_is():
    undocumented = []
    for face, names in FACES.items():
        mod = importlib.import_module(face)
        for n in names:
            obj = getattr(mod, n)
            if isinstance(obj, type) and not (obj.__doc__ or "").strip():
                undocumented.append(f"{face}.{n}")
    assert not undocumented, undocumented

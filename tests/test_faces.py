"""The public faces are the contract: each package's ``__all__`` pinned here, so a name is
added to (or taken from) a face on purpose, in the same change as this list."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

FACES = {
    "kvstate": [
        "BlockError", "BlockManager", "BlockPool", "CacheSpec", "ConfigError", "DECODE", "DecodeLifecycle",
        "DriverError", "DuplicateRequestError", "EngineBlocks", "FREED", "FenceError", "InvalidTransitionError",
        "KVStateError", "KeyCache", "LayerGroup", "Lifecycle", "MACHINES", "MachineDef", "OutOfBlocksError",
        "PREFILL", "Policy", "PoolStats", "PrefillLifecycle", "ProtocolError", "StoreError", "Timeline",
        "UnknownRequestError", "ValidationError", "__version__", "block_keys", "commands", "events", "paired",
        "rank_key", "rows", "slot_of_layer", "table_of_layer"],
    "kvstate.backends": [
        "ArenaStore", "CudaBackend", "Driver", "FileStore", "Guard", "MISSING", "MemoryStore",
        "MooncakeConfig", "MooncakeMaster", "MooncakeStore", "ReferenceBackend", "StepDriver", "Store",
        "StoreBackend", "ThreadedDriver", "TransferBackend", "check_fence"],
    "kvstate.distributed": ["ChildProcess", "Link", "ProcessDriver", "RankDown", "RankUp", "RankWorker",
                            "SharedCaches", "WorkerConfig", "die_with_parent", "parent_alive", "share_caches"],
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


#: modules outside the faces that users import by name: the command and event vocabularies
#: (also on the kvstate face), test helpers for integrators, the Prometheus exporter, and the
#: vLLM connector (vLLM loads it by its module path)
PUBLIC_MODULES = {"kvstate/commands.py", "kvstate/events.py", "kvstate/testing.py", "kvstate/prometheus.py",
                  "kvstate/integrations/vllm.py"}


def test_every_other_module_is_private():
    """What a user may import is the faces and PUBLIC_MODULES; every other module is ``_x``,
    so its names can change without a deprecation."""
    root = Path(__file__).resolve().parents[1]
    public = sorted(p.relative_to(root).as_posix() for p in (root / "kvstate").rglob("*.py")
                    if not p.name.startswith("_") and p.relative_to(root).as_posix() not in PUBLIC_MODULES)
    assert public == [], f"modules neither private nor a face: {public}"

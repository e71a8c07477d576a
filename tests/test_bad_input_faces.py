"""Every callable the faces export, swept from its signature: each parameter in turn gets
values its annotation rules out (or values of its type that break an obvious rule), the other
parameters stay valid, and the call must raise a KVStateError (not a TypeError, not silence)
and leave no file behind.

The callables are found by introspection (each face's ``__all__``); a new one without valid
arguments in :data:`VALID`, or a parameter whose annotation has no bad values in
:func:`bad_values`, fails :func:`test_every_face_callable_is_swept`. :data:`SKIPPED` names the
few left out and why. The sweep's figure (clean refusals over all calls) is the issue's bar:
at least 99 %; every call that is not a clean refusal is listed when the bar is missed.
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rigs import small_spec

from kvstate import KVStateError, PrefillLifecycle
from kvstate.backends import ArenaStore, MemoryStore, ReferenceBackend
from kvstate.distributed import SharedCaches
from kvstate.sim import simulate

FACES = ("kvstate", "kvstate.backends", "kvstate.distributed", "kvstate.sim", "kvstate.kernels")
#: face names not swept, and why
SKIPPED = {
    "kvstate.backends.CudaBackend": "needs a GPU: its refusals are tests/test_cuda_backend.py's",
    "kvstate.backends.MooncakeStore": "needs a Mooncake master: tests/test_mooncake.py refuses its bad input",
    "kvstate.backends.MooncakeMaster": "starts a server process: tests/test_mooncake.py",
    "kvstate.distributed.RankWorker": "a worker's config is WorkerConfig, swept here; the worker binds sockets",
    "kvstate.distributed.die_with_parent": "changes this process (a parent-death signal) when given a valid pid",
    "kvstate.sim.search_deadlocks": "a search of minutes; its arguments are iterables of the grid",
    "kvstate.kernels.TransferPlan": "a plan the kernels make (plan_layout); never built by hand",
    "kvstate.kernels.LayerSet": "the kernels' view of caches they checked; never built by hand",
    "kvstate.PoolStats": "a read-only record a pool returns",
    "kvstate.Lifecycle": "the base of both lifecycles, refused when built itself; swept as each of them",
    "kvstate.distributed.RankDown": "an event the driver emits",
    "kvstate.distributed.RankUp": "an event the driver emits",
}

_ARENA: list[Any] = []
_SHARED: list[Any] = []
_TMP = ""  #: the sweep's folder, made and removed around it (``swept_in_a_folder``)


@contextmanager
def swept_in_a_folder() -> Iterator[None]:
    """A private folder for the files valid arguments name, removed afterwards."""
    global _TMP
    _TMP = tempfile.mkdtemp(prefix="kvstate-faces-")
    try:
        yield
    finally:
        for made in (*_ARENA, *_SHARED):
            made.close()
        _ARENA.clear()
        _SHARED.clear()
        shutil.rmtree(_TMP, ignore_errors=True)
        _TMP = ""


@pytest.fixture(autouse=True, scope="module")
def _folder() -> Iterator[None]:
    with swept_in_a_folder():
        yield


def _scenario() -> Any:
    from kvstate.sim import Scenario, with_overrides
    return with_overrides(Scenario(), {"workload.num_requests": 4, "workload.rate": 50.0})


def _arena() -> str:
    """An arena made once (in the sweep's folder, closed with it): what a valid open opens."""
    if not _ARENA:
        _ARENA.append(ArenaStore.create(4096, 4, directory=_TMP))
    return str(_ARENA[0].path)


def _shared() -> dict[int, str]:
    """Caches in shared memory made once (closed with the sweep's folder): what a valid attach attaches."""
    if not _SHARED:
        _SHARED.append(SharedCaches.create(small_spec(1), 4, directory=_TMP))
    return dict(_SHARED[0].paths)


def _trace() -> str:
    path = os.path.join(_TMP, "trace.jsonl")
    Path(path).write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    return path


def _worker() -> dict[str, Any]:
    return dict(rank=0, spec={"num_layers": 2, "kv_heads": 2, "block_size": 4, "head_dim": 8}, num_blocks=4,
                command_address="ipc:///tmp/x-c", reply_address="ipc:///tmp/x-r", control_address="ipc:///tmp/x-k",
                store={"kind": "file", "root": _TMP})


def _arrays() -> dict[str, Any]:
    caches = [np.zeros((4, 2, 2, 3), np.float32) for _ in range(2)]
    return dict(caches=caches, host=np.zeros((3, 2, 2, 2, 3), np.float32), gpu_block_ids=[0, 1],
                host_block_ids=[2, 0], direction="d2h")


#: face name -> a factory of valid keyword arguments (the required ones, and what the bad
#: values of one parameter need beside it)
VALID: dict[str, Callable[[], dict[str, Any]]] = {
    "kvstate.CacheSpec": lambda: dict(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16"),
    "kvstate.BlockPool": lambda: dict(num_blocks=8),
    "kvstate.BlockManager": lambda: dict(spec=small_spec(1), num_blocks=8),
    "kvstate.EngineBlocks": lambda: dict(spec=small_spec(1), num_blocks=8),
    "kvstate.Policy": dict,
    "kvstate.block_keys": lambda: dict(token_ids=[1, 2, 3, 4], block_size=2),
    "kvstate.rank_key": lambda: dict(key="k", kind="key", rank=0),
    "kvstate.KeyCache": dict,
    "kvstate.LayerGroup": lambda: dict(kind="full", layers=(0, 1)),
    "kvstate.paired": lambda: dict(p=small_spec(2), d=small_spec(1, kv_heads=4)),
    "kvstate.rows": lambda: dict(block_ids=[1, 2]),
    "kvstate.slot_of_layer": lambda: dict(spec=small_spec(1)),
    "kvstate.table_of_layer": lambda: dict(spec=small_spec(1)),
    "kvstate.Timeline": dict,
    "kvstate.PrefillLifecycle": lambda: dict(spec=small_spec(1), num_blocks=8),
    "kvstate.DecodeLifecycle": lambda: dict(spec=small_spec(1), num_blocks=8),
    "kvstate.MachineDef": lambda: dict(name="m", states=("a", "b"), initial="a", terminal=("b",),
                                       transitions=({"trigger": "go", "source": "a", "dest": "b"},)),
    "kvstate.backends.MemoryStore": lambda: dict(capacity_bytes=1 << 20),
    "kvstate.backends.FileStore": lambda: dict(directory=os.path.join(_TMP, "files")),
    "kvstate.backends.ArenaStore": lambda: dict(path=_arena()),
    "kvstate.backends.ReferenceBackend": lambda: dict(spec=small_spec(2), num_blocks=4, store=MemoryStore(1 << 20)),
    "kvstate.backends.MooncakeConfig": lambda: dict(master="127.0.0.1:50051", metadata="http://127.0.0.1:8080/metadata"),
    "kvstate.backends.StepDriver": lambda: dict(lifecycle=PrefillLifecycle(small_spec(1), 8)),
    "kvstate.backends.ThreadedDriver": lambda: dict(backend=ReferenceBackend(
        small_spec(1), 4, MemoryStore(1 << 20))),
    "kvstate.backends.check_fence": lambda: dict(guard=None, rank=0, what="gather", block_ids=[1]),
    "kvstate.distributed.ProcessDriver": lambda: dict(spec=small_spec(1), num_blocks=4),
    "kvstate.distributed.WorkerConfig": _worker,
    "kvstate.distributed.SharedCaches": lambda: dict(spec=small_spec(1), num_blocks=4, paths=_shared(), owner=False),
    "kvstate.distributed.share_caches": lambda: dict(caches={}),
    "kvstate.distributed.Link": lambda: dict(address="ipc://" + os.path.join(_TMP, "link")),
    "kvstate.distributed.ChildProcess": lambda: dict(module="kvstate.distributed", args=[], name="child"),
    "kvstate.distributed.parent_alive": lambda: dict(parent_pid=os.getpid()),
    "kvstate.sim.Cluster": lambda: dict(scenario=_scenario()),
    "kvstate.sim.Scenario": dict,
    "kvstate.sim.load_scenario": lambda: dict(path=None),
    "kvstate.sim.scenario_from_dict": lambda: dict(data={}),
    "kvstate.sim.with_overrides": lambda: dict(s=_scenario(), overrides={}),
    "kvstate.sim.to_toml": lambda: dict(s=_scenario()),
    "kvstate.sim.simulate": lambda: dict(s=_scenario()),
    "kvstate.sim.format_report": lambda: dict(r=simulate(_scenario())),
    "kvstate.sim.to_json": lambda: dict(result=simulate(_scenario())),
    "kvstate.sim.plan": lambda: dict(base=_scenario(), sweep={"cluster.n_decode": [1]}),
    "kvstate.sim.load_trace": lambda: dict(path=_trace()),
    "kvstate.kernels.coalesce_runs": lambda: dict(gpu_ids=np.array([0, 1]), host_ids=np.array([2, 3])),
    "kvstate.kernels.as_numpy": lambda: dict(x=np.zeros(3)),
    "kvstate.kernels.swap_cache_layout": _arrays,
    "kvstate.kernels.swap_cache_per_layer": lambda: dict(cache=np.zeros((4, 2, 2, 3), np.float32),
                                                         host_layer=np.zeros((3, 2, 2, 3), np.float32),
                                                         gpu_block_ids=[0, 1], host_block_ids=[2, 0], direction="d2h"),
    "kvstate.kernels.swap_cache_all_layers": lambda: dict(caches=[np.zeros((4, 2, 2, 3), np.float32)] * 2,
                                                          host_layers=[np.zeros((3, 2, 2, 3), np.float32)] * 2,
                                                          gpu_block_ids=[0, 1], host_block_ids=[2, 0], direction="d2h"),
}


class Junk:
    """An object of no type any parameter takes."""


NUMBERS = (None, "1", Junk(), [1])
INTS = (*NUMBERS, True, 1.5, math.nan, -1, 2**70)
FLOATS = (*NUMBERS, True, math.nan, math.inf, -1.0)
STRS = (None, 5, b"x", ["a"], Junk())
SEQS = (None, 5, Junk(), [None], [-1], [True], [math.nan])
OBJECTS = (None, 5, "x", Junk())


def bad_values(p: inspect.Parameter) -> tuple[Any, ...] | None:
    """Values parameter ``p``'s annotation rules out (by the annotation's text)."""
    a = str(p.annotation).replace(" | None", "")
    allow_none = "None" in str(p.annotation) or p.default is None
    table: list[tuple[Callable[[str], bool], tuple[Any, ...]]] = [
        (lambda t: t == "int", INTS), (lambda t: t == "float", FLOATS), (lambda t: t == "bool", (None, 2, "yes", 1.0)),
        (lambda t: t == "str", STRS), (lambda t: "PathLike" in t or t == "str | Path", (5, b"\0", Junk(), ["a"])),
        (lambda t: t.startswith(("Sequence", "tuple", "Iterable", "list")), SEQS),
        (lambda t: t.startswith(("Mapping", "dict")), (5, "x", [1], Junk())),
        (lambda t: t.startswith("Callable"), (5, "x", Junk())),
        (lambda t: t in ("np.ndarray", "Any", "Store", "CacheSpec", "Policy", "Scenario", "BlockPool", "KeyCache",
                         "BlockManager", "Timeline", "TransferCostModel", "Guard", "WorkerConfig", "type",
                         "TransferBackend", "Lifecycle", "Command", "MooncakeConfig", "LendBoard")
         or t.endswith("Spec"),
         OBJECTS),
    ]
    for match, values in table:
        if match(a):
            return tuple(v for v in values if not (v is None and allow_none) and not _same(v, p.default))
    return None


def _same(v: Any, default: Any) -> bool:
    try:
        return bool(v == default) and type(v) is type(default)
    except Exception:  # noqa: BLE001 - arrays and the like: not the default
        return False


def face_callables() -> dict[str, Any]:
    out = {}
    for face in FACES:
        mod = importlib.import_module(face)
        for name in mod.__all__:
            obj = getattr(mod, name)
            qual = f"{face}.{name}"
            if qual in SKIPPED or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # modules, constants, type aliases (Guard)
            if inspect.isclass(obj) and (issubclass(obj, BaseException) or inspect.isabstract(obj)):
                continue
            if inspect.isclass(obj) and getattr(obj, "_is_protocol", False):
                continue
            out[qual] = obj
    return out


def cases() -> list[tuple[str, str, Any]]:
    out = []
    for qual, obj in face_callables().items():
        for p in inspect.signature(obj).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            for v in bad_values(p) or ():
                out.append((qual, p.name, v))
    return out


def _files() -> set[str]:
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return shm | {str(p) for p in Path(_TMP).rglob("*")}


def sweep() -> tuple[int, list[str], list[str]]:
    """(calls, calls not refused with a KVStateError, files a refused call left behind)."""
    calls, unclean, left = 0, [], []
    for qual, param, bad in cases():
        obj = face_callables()[qual]
        kwargs = VALID[qual]()
        kwargs[param] = bad
        before = _files()
        calls += 1
        try:
            obj(**kwargs)
        except KVStateError as e:
            if not str(e):
                unclean.append(f"{qual}({param}={bad!r}): an error without a message")
        except Exception as e:  # noqa: BLE001 - what the sweep counts
            unclean.append(f"{qual}({param}={bad!r}): {type(e).__name__}: {e}"[:200])
        else:
            unclean.append(f"{qual}({param}={bad!r}): accepted")
        new = _files() - before
        if new:
            left.append(f"{qual}({param}={bad!r}) left {sorted(new)[:3]}")
    return calls, unclean, left


def test_every_face_callable_is_swept():
    found = face_callables()
    missing = sorted(set(found) - set(VALID))
    assert not missing, f"face callables with no valid arguments here (add them to VALID or SKIPPED): {missing}"
    unswept = [f"{q}({p.name}: {p.annotation})" for q, obj in found.items()
               for p in inspect.signature(obj).parameters.values()
               if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and bad_values(p) is None]
    assert not unswept, f"parameters with no bad values: {unswept}"
    for qual in found:  # the valid arguments are valid: each call succeeds
        if qual.endswith(("simulate", "plan", "Cluster", "ChildProcess", "ProcessDriver", "Link", "share_caches")):
            continue  # costly, owning a resource, or needing a GPU: run by their own tests
        obj = found[qual](**VALID[qual]())
        if hasattr(obj, "close"):
            obj.close()


def test_bad_input_at_every_face_is_refused_cleanly():
    calls, unclean, left = sweep()
    clean = 1 - len(unclean) / calls
    print(f"\n{calls} calls, {calls - len(unclean)} clean refusals ({clean:.1%})")
    assert calls >= 500
    assert not left, left
    assert clean >= 0.99, "\n".join(unclean)


if __name__ == "__main__":
    with swept_in_a_folder():
        n, bad, files = sweep()
    print(f"{n} calls, {n - len(bad)} clean ({1 - len(bad) / n:.2%}); files left: {len(files)}")
    print("\n".join(bad))

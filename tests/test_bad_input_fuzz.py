"""Bad-input fuzzing: hypothesis generates invalid arguments for each public entry point; every
one raises a KVStateError and leaves the lifecycle exactly as it was (snapshot before == after)."""
from __future__ import annotations

import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_support import snapshot
from rigs import Rig

from kvstate import KVStateError
from kvstate.backends import MemoryStore
from kvstate.events import Completion

junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                 st.lists(st.integers(-5, 5), max_size=3),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                 st.integers(max_value=-1), st.binary(max_size=3))
bad_tokens = st.one_of(st.just([]), st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                       st.lists(st.text(max_size=2), min_size=1, max_size=2), st.text(max_size=3), st.none(),
                       st.just([2**64]), st.just([2**32]), st.lists(st.floats(), min_size=1, max_size=2))
bad_ids = st.one_of(st.just(""), st.integers(), st.none(), st.lists(st.integers(), max_size=2))


def live_rig() -> Rig:
    """P and D with one request each in a non-initial state and one command pending."""
    rig = Rig(tp=2, blocks=16)
    rig.D.reserve("a", list(range(9)))
    rig.P.admit("a", list(range(9)))
    rig.pd.pump()
    rig.D.deliver_first_token("a", 3)
    rig.dd.pump()
    return rig


CALLS = {
    "P.admit(id)": lambda r, x: r.P.admit(x, [1, 2, 3]),
    "P.admit(tokens)": lambda r, x: r.P.admit("new", x),
    "P.admit(extra_keys)": lambda r, x: r.P.admit("new", [1, 2, 3], x if x is not None and x != {} else 5),
    "P.prefill_done(token)": lambda r, x: r.P.prefill_done("a", x),
    "P.prefill_done(id)": lambda r, x: r.P.prefill_done(x, 1),
    "D.reserve(tokens)": lambda r, x: r.D.reserve("new", x),
    "D.reserve(id)": lambda r, x: r.D.reserve(x, [1]),
    "D.deliver_first_token(token)": lambda r, x: r.D.deliver_first_token("a", x),
    "D.append_tokens(tokens)": lambda r, x: r.D.append_tokens("a", x),
    "D.finish(id)": lambda r, x: r.D.finish(x),
    "D.preempt(id)": lambda r, x: r.D.preempt(x),
    "D.resume(id)": lambda r, x: r.D.resume(x),
    "D.abort(id)": lambda r, x: r.D.abort(x),
    "D.can_reserve(n)": lambda r, x: r.D.can_reserve(x),
    "D.complete(event)": lambda r, x: r.D.complete(x),
    "D.complete(rank)": lambda r, x: r.D.complete(Completion(r.D.pending_commands()[0].command_id, x, 0)),
    "D.complete(count)": lambda r, x: r.D.complete(Completion(r.D.pending_commands()[0].command_id, 0, x)),
    "D.complete(command_id)": lambda r, x: r.D.complete(Completion(x, 0, 0)),
    "D.handle(event)": lambda r, x: r.D.handle(x),
}


@settings(max_examples=300, deadline=None)
@given(call=st.sampled_from(sorted(CALLS)), data=st.data())
def test_invalid_arguments_raise_and_change_nothing(call, data):
    rig = live_rig()
    strat = {"tokens": bad_tokens, "id": bad_ids,
             "token": st.one_of(junk, st.integers(min_value=2**32))}.get(call[call.index("(") + 1:-1], junk)
    arg = data.draw(strat)
    if call.endswith("(count)") and type(arg) is int and arg >= 0:
        arg = 10**6  # beyond the command's blocks
    if call.endswith("(rank)") and type(arg) is int and arg in (0, 1):
        arg = 7
    if call.endswith("(command_id)") and type(arg) is int:
        arg = str(arg)  # an unknown int id is a stale answer (returns False), not bad input
    before = (snapshot(rig.P), snapshot(rig.D), rig.D.pending_commands()[0].command_id)
    try:
        CALLS[call](rig, arg)
    except KVStateError:
        pass
    else:
        raise AssertionError(f"{call} accepted {arg!r}")
    assert (snapshot(rig.P), snapshot(rig.D), rig.D.pending_commands()[0].command_id) == before


# -- regression corpus: every failure the fuzzing found, kept as an explicit case ------------------
def test_regression_unhashable_request_id_is_a_kvstate_error():
    """Found by the fuzzing above: ``abort([0])`` raised TypeError (dict lookup of a list)."""
    rig = live_rig()
    before = snapshot(rig.D)
    for call in ("D.abort(id)", "D.finish(id)", "D.preempt(id)", "D.resume(id)", "P.prefill_done(id)"):
        try:
            CALLS[call](rig, [0])
        except KVStateError as e:
            assert "request id must be a str" in str(e)
        else:
            raise AssertionError(call)
    assert snapshot(rig.D) == before


def test_regression_bool_is_not_a_token_count():
    """Found by the fuzzing above: ``can_reserve(True)`` was taken as 1 token."""
    rig = live_rig()
    for v in (True, False):
        try:
            rig.D.can_reserve(v)
        except KVStateError as e:
            assert "num_tokens must be an int > 0" in str(e)
        else:
            raise AssertionError(v)
    # and ``complete`` took rank False for rank 0, rank 1.0 for rank 1, command True for
    # command 1, and raised TypeError for an unhashable command id
    cid = rig.D.pending_commands()[0].command_id
    before = snapshot(rig.D)
    for bad in (Completion(cid, False, 0), Completion(cid, 1.0, 0), Completion(cid, 0, 1.0),
                Completion(True, 0, 0), Completion([cid], 0, 0)):
        try:
            rig.D.complete(bad)
        except KVStateError:
            pass
        else:
            raise AssertionError(f"{bad} accepted")
    assert snapshot(rig.D) == before


# -- every other public entry point: pool, keys, spec, policy, stores, backend, kernels, drivers,
# -- scenarios. Each case builds its object in a known state, calls with a bad argument, and
# -- compares a snapshot of everything observable before and after.
def _pool():
    from kvstate import BlockPool
    p = BlockPool(8)
    held = p.allocate(3)
    p.share(held[:1])
    return p


def _pool_snap(p):
    return (tuple(p.refcounts()), tuple(p.free_ids()), p.stats())


_TMP = tempfile.TemporaryDirectory(prefix="kvstate-fuzz-")  # removed when the session ends
_TRACE = __import__("os").path.join(_TMP.name, "trace.jsonl")
with open(_TRACE, "w") as _f:
    _f.write('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')


def _store(kind):
    from kvstate.backends import FileStore, MemoryStore
    s = MemoryStore(1 << 16) if kind == "memory" else FileStore(tempfile.mkdtemp(dir=_TMP.name))
    s.batch_put_from(["a", "b"], [b"xyz", b"12345"])
    return s


def _store_snap(s):
    from kvstate.backends import MemoryStore
    probe = ["a", "b", "c", "q", "k0", "k1"]
    bufs = [bytearray(4096) for _ in probe]
    got = s.batch_get_into(probe, bufs)
    count = len(s) if isinstance(s, MemoryStore) else sum(1 for p in s.root.rglob("*") if p.is_file())
    return count, tuple(bytes(b[:n]) if n >= 0 else None for b, n in zip(bufs, got))


def _backend():
    from rigs import small_spec

    from kvstate.backends import MemoryStore, ReferenceBackend
    be = ReferenceBackend(small_spec(tp=2), 4, MemoryStore(1 << 20))
    for r in range(2):
        for kind in be.spec.kinds:
            for i, layer in enumerate(be.caches[r][kind]):
                layer[:] = i + r + 1
    be.write(0, ["k0"], [1])
    return be


def _backend_snap(be):
    caches = tuple(layer.tobytes() for r in be.caches.values() for k in sorted(r) for layer in r[k])
    return caches, _store_snap(be.store), be.bytes_moved


def _arrays():
    import numpy as np
    caches = [np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3) + 100 * i for i in range(2)]
    host = np.zeros((3, 2, 2, 3), np.float32)
    return caches, host


def _arrays_snap(obj):
    caches, host = obj
    return tuple(c.tobytes() for c in caches), host.tobytes()


def _swap(obj, **bad):
    from kvstate.kernels._reference import swap_cache_layout
    caches, host = obj
    args = dict(caches=caches, host=host, gpu_block_ids=[0, 1], host_block_ids=[2, 0], direction="d2h")
    args.update(bad)
    swap_cache_layout(args["caches"], args["host"], args["gpu_block_ids"], args["host_block_ids"], args["direction"])


def _nothing(obj=None):
    return None


def _spec(**bad):
    from kvstate import CacheSpec
    args = dict(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2)
    args.update(bad)
    CacheSpec(**args)


def _policy(**bad):
    from kvstate import Policy
    Policy(**bad)


def _scenario(overrides):
    from kvstate.sim._scenario_io import load_scenario, with_overrides
    with_overrides(load_scenario(None), overrides)


# (for the pool, blocks 0..2 are held and 5 is free; for the backend 5 is out of range)
bad_scalars = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=3), st.integers(),
                        st.binary(max_size=3),
                        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
bad_block_lists = st.one_of(bad_scalars, st.lists(st.integers(8, 20), min_size=1, max_size=2),
                            st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
                            st.just([0, 0]), st.just([5]), st.lists(st.booleans(), min_size=1, max_size=2),
                            st.lists(st.one_of(st.none(), st.text(max_size=1), st.floats()), min_size=1, max_size=2))
bad_gpu_ids = st.one_of(bad_scalars, st.just([5, 0]), st.just([-1, 0]), st.just([0]), st.just([True, False]),
                        st.just(["a", "b"]), st.just([0.0, 1.0]))
bad_counts = st.one_of(st.integers(max_value=-1), st.integers(9, 100), st.booleans(), st.none(), st.floats(),
                       st.text(max_size=2))
bad_key_lists = st.one_of(st.none(), st.integers(), st.text(max_size=3),
                          st.lists(st.integers(), min_size=1, max_size=2),
                          st.lists(st.none(), min_size=1, max_size=2), st.binary(max_size=2))
bad_ranks = st.one_of(st.integers(max_value=-1), st.integers(2, 50), st.none(), st.booleans(), st.text(max_size=2),
                      st.floats())

def _step_snap(rig):
    return snapshot(rig.P), snapshot(rig.D), tuple(sorted(rig.dd.pending)), tuple(sorted(rig.pd.pending))


def _threaded(workers):
    from rigs import small_spec

    from kvstate.backends import MemoryStore, ReferenceBackend, ThreadedDriver
    ThreadedDriver(ReferenceBackend(small_spec(), 4, MemoryStore(1 << 20)), workers=workers).close()


def _scenario_dict(data):
    from kvstate.sim._scenario_io import scenario_from_dict
    scenario_from_dict(data)


# name -> (make, snapshot, call(obj, arg), strategy of bad arguments)
COMPONENTS = {
    "BlockPool.allocate(n)": (_pool, _pool_snap, lambda p, x: p.allocate(x), bad_counts),
    "BlockPool.allocate(headroom)": (_pool, _pool_snap, lambda p, x: p.allocate(1, x),
                                     st.one_of(st.integers(max_value=-1), st.integers(5, 99), st.none(), st.floats())),
    "BlockPool.can_allocate(n)": (_pool, _pool_snap, lambda p, x: p.can_allocate(x),
                                  st.one_of(st.integers(max_value=-1), st.none(), st.booleans(), st.floats())),
    "BlockPool.free(ids)": (_pool, _pool_snap, lambda p, x: p.free(x), bad_block_lists),
    "BlockPool.share(ids)": (_pool, _pool_snap, lambda p, x: p.share(x), bad_block_lists),
    "BlockPool.refcount(id)": (_pool, _pool_snap, lambda p, x: p.refcount(x),
                               st.one_of(st.integers(max_value=-1), st.integers(8, 99), st.none(), st.floats())),
    "MemoryStore.batch_put_from(keys)": (lambda: _store("memory"), _store_snap,
                                         lambda s, x: s.batch_put_from(x, [b"q"]), bad_key_lists),
    "MemoryStore.batch_put_from(buffers)": (lambda: _store("memory"), _store_snap,
                                            lambda s, x: s.batch_put_from(["a", "c"], x), junk),
    "MemoryStore.batch_get_into(buffers)": (lambda: _store("memory"), _store_snap,
                                            lambda s, x: s.batch_get_into(["a", "b"], x), junk),
    "MemoryStore.batch_is_exist(keys)": (lambda: _store("memory"), _store_snap,
                                         lambda s, x: s.batch_is_exist(x), bad_key_lists),
    "MemoryStore.evict(keys)": (lambda: _store("memory"), _store_snap, lambda s, x: s.evict(x), bad_key_lists),
    "FileStore.batch_put_from(keys)": (lambda: _store("file"), _store_snap,
                                       lambda s, x: s.batch_put_from(x, [b"q"]), bad_key_lists),
    "FileStore.batch_get_into(buffers)": (lambda: _store("file"), _store_snap,
                                          lambda s, x: s.batch_get_into(["a", "b"], x), junk),
    "FileStore.evict(keys)": (lambda: _store("file"), _store_snap, lambda s, x: s.evict(x), bad_key_lists),
    "ReferenceBackend.write(rank)": (_backend, _backend_snap, lambda b, x: b.write(x, ["k1"], [2]), bad_ranks),
    "ReferenceBackend.write(block_ids)": (_backend, _backend_snap, lambda b, x: b.write(0, ["k1"], x), bad_block_lists),
    "ReferenceBackend.read(block_ids)": (_backend, _backend_snap, lambda b, x: b.read(0, ["k0"], x), bad_block_lists),
    "ReferenceBackend.read(keys)": (_backend, _backend_snap, lambda b, x: b.read(0, x, [2]), bad_key_lists),
    "ReferenceBackend.query(rank)": (_backend, _backend_snap, lambda b, x: b.query(x, ["k0"]), bad_ranks),
    "ReferenceBackend.fill_block(data)": (_backend, _backend_snap, lambda b, x: b.fill_block(0, "key", 1, x), junk),
    "ReferenceBackend.fill_block(block)": (_backend, _backend_snap,
                                           lambda b, x: b.fill_block(0, "key", x, bytes(b.spec.block_bytes("key"))),
                                           st.one_of(st.integers(max_value=-1), st.integers(4, 50), st.none())),
    "swap_cache_layout(gpu_block_ids)": (_arrays, _arrays_snap, lambda o, x: _swap(o, gpu_block_ids=x), bad_gpu_ids),
    "swap_cache_layout(host_block_ids)": (_arrays, _arrays_snap,
                                          lambda o, x: _swap(o, host_block_ids=x, direction="h2d"),
                                          st.one_of(bad_scalars, st.just([3, 0]), st.just([1, 1]), st.just([0]))),
    "swap_cache_layout(direction)": (_arrays, _arrays_snap, lambda o, x: _swap(o, direction=x), junk),
    "swap_cache_layout(host)": (_arrays, _arrays_snap, lambda o, x: _swap(o, host=x), junk),
    "block_keys(tokens)": (_nothing, _nothing, lambda o, x: __import__("kvstate").block_keys(x, 4),
                           bad_tokens.filter(lambda v: v != [])),  # no tokens: no keys, rightly
    "block_keys(block_size)": (_nothing, _nothing, lambda o, x: __import__("kvstate").block_keys([1, 2], x),
                               st.one_of(st.integers(max_value=0), st.none(), st.floats(), st.booleans())),
    "CacheSpec(num_layers)": (_nothing, _nothing, lambda o, x: _spec(num_layers=x),
                              st.one_of(st.integers(max_value=0), st.none(), st.booleans(), st.floats(),
                                        st.text(max_size=2))),
    "CacheSpec(dtype)": (_nothing, _nothing, lambda o, x: _spec(dtype=x), junk),
    "CacheSpec(tp_size)": (_nothing, _nothing, lambda o, x: _spec(tp_size=x),
                           st.one_of(st.integers(max_value=0), st.none(), st.floats(), st.text(max_size=2))),
    "Policy(read_failure)": (_nothing, _nothing, lambda o, x: _policy(read_failure=x), junk),
    "Policy(transfer_timeout)": (_nothing, _nothing, lambda o, x: _policy(transfer_timeout=x),
                                 st.one_of(st.floats(max_value=0), st.none(), st.text(max_size=2),
                                           st.just(float("nan")))),
    "with_overrides(field)": (_nothing, _nothing, lambda o, x: _scenario(x),
                              st.one_of(st.dictionaries(st.text(max_size=6), st.integers(), min_size=1, max_size=2),
                                        st.just({"cluster.num_prefill": -1}), st.just({"slo.ttft_ms": "x"}),
                                        st.just({"workload.rate": float("nan")}))),
    "StepDriver.complete(outcome)": (live_rig, _step_snap, lambda r, x: r.dd.complete(*sorted(r.dd.pending)[0], x),
                                     st.one_of(st.integers(max_value=-1), st.integers(100, 10**6), st.booleans(),
                                               st.text(min_size=1,
                                               max_size=3).filter(lambda t: t != "fail"), st.floats(),
                                               st.lists(st.integers(), max_size=2))),
    "StepDriver.complete(command)": (live_rig, _step_snap, lambda r, x: r.dd.complete(x, 0),
                                     st.one_of(st.integers(10**6, 10**7), st.none(), st.text(max_size=2))),
    "ThreadedDriver(workers)": (_nothing, _nothing, lambda o, x: _threaded(x),
                                st.one_of(st.integers(max_value=0), st.none(), st.floats(), st.text(max_size=2))),
    "MemoryStore(capacity)": (_nothing, _nothing, lambda o, x: MemoryStore(x),
                              st.one_of(st.integers(max_value=0), st.none(), st.floats(), st.text(max_size=2))),
    "Policy(preempt)": (_nothing, _nothing, lambda o, x: _policy(preempt=x), junk),
    "Policy(write_retries)": (_nothing, _nothing, lambda o, x: _policy(write_retries=x),
                              st.one_of(st.integers(max_value=-1), st.none(), st.floats(), st.text(max_size=2))),
    "scenario_from_dict(data)": (_nothing, _nothing, lambda o, x: _scenario_dict(x),
                                 st.one_of(st.none(), st.integers(), st.text(max_size=3),
                                           st.dictionaries(st.text(max_size=5), junk, min_size=1, max_size=2))),
    "load_trace(path)": (_nothing, _nothing, lambda o, x: __import__("kvstate.sim", fromlist=["x"]).load_trace(x),
                         st.one_of(st.just("/nonexistent/trace.jsonl"), st.just("/"), st.just("/bin/sh"),
                                   st.none(), st.integers())),
    "load_trace(hash_block_size)": (_nothing, _nothing,
                                    lambda o, x: __import__("kvstate.sim", fromlist=["x"]).load_trace(_TRACE, x),
                                    st.one_of(st.integers(max_value=0), st.none(), st.floats(), st.booleans())),
    "load_scenario(path)": (_nothing, _nothing, lambda o, x: __import__("kvstate.sim", fromlist=["x"]).load_scenario(x),
                            st.one_of(st.just("/nonexistent.toml"), st.just("/"), st.just("/bin/sh"), st.integers(),
                                      st.lists(st.integers(), max_size=1))),
}


@settings(max_examples=400, deadline=None)
@given(case=st.sampled_from(sorted(COMPONENTS)), data=st.data())
def test_component_entry_points_reject_bad_arguments_and_change_nothing(case, data):
    make, snap, call, strat = COMPONENTS[case]
    obj = make()
    arg = data.draw(strat)
    before = snap(obj)
    try:
        call(obj, arg)
    except KVStateError:
        pass
    else:
        raise AssertionError(f"{case} accepted {arg!r}")
    assert snap(obj) == before, case


def test_regression_component_fuzz_finds():
    """Found by the component fuzzing above; each raised TypeError/IndexError/KeyError (or
    IsADirectoryError, UnicodeDecodeError for a trace or scenario path), or (get with buffers
    None) was accepted."""
    import pytest

    cases = [
        ("ReferenceBackend.write(block_ids)", None), ("ReferenceBackend.read(block_ids)", None),
        ("ReferenceBackend.read(keys)", None), ("ReferenceBackend.fill_block(block)", -5),
        ("ReferenceBackend.fill_block(data)", None), ("MemoryStore.batch_get_into(buffers)", None),
        ("FileStore.batch_get_into(buffers)", None), ("BlockPool.free(ids)", None),
        ("CacheSpec(dtype)", ["float16"]), ("with_overrides(field)", {"0": 1}),
        ("load_trace(path)", None), ("load_trace(path)", "/"), ("load_scenario(path)", "/"),
        ("load_scenario(path)", "/bin/sh"),
    ]
    for case, arg in cases:
        make, snap, call, _ = COMPONENTS[case]
        obj = make()
        before = snap(obj)
        with pytest.raises(KVStateError):
            call(obj, arg)
        assert snap(obj) == before, case

"""Classes of bad input found by a sweep of the public API: each is refused with a
KVStateError naming the rule, before anything changes."""
from __future__ import annotations

import math

import pytest
from protocol_support import snapshot
from rigs import Rig, small_spec

from kvstate import KVStateError, Policy
from kvstate._keys import block_keys, rank_key, rank_keys
from kvstate._prefill import PrefillLifecycle
from kvstate._spec import CacheSpec
from kvstate.backends import FileStore, MemoryStore, ReferenceBackend
from kvstate.events import Completion


def test_a_driver_never_takes_true_for_rank_one():
    """``complete(cid, rank=True)`` must not find rank 1's pending answer (True hashes like 1)."""
    rig = Rig(tp=2, blocks=16)
    rig.D.reserve("a", list(range(9)))
    rig.P.admit("a", list(range(9)))
    drv = rig.pd
    drv.pump()
    pending = dict(drv.pending)
    assert pending
    cid = next(c for c, r in pending if r == 1)
    with pytest.raises(KVStateError, match="must be ints"):
        drv.complete(cid, True)
    assert drv.pending == pending  # rank 1's answer is still owed
    drv.complete(cid, 1)
    assert (cid, 1) not in drv.pending


@pytest.mark.parametrize("reading", [math.nan, math.inf, -math.inf, None, "0", True])
def test_a_clock_that_cannot_tell_a_finite_time_is_refused(reading):
    with pytest.raises(KVStateError, match="finite number"):
        PrefillLifecycle(small_spec(1), 8, Policy(), clock=lambda: reading)


def test_a_clock_that_turns_nan_mid_run_is_refused_not_a_deadline_that_never_fires():
    now = [0.0]
    p = PrefillLifecycle(small_spec(1), 8, Policy(), clock=lambda: now[0])
    p.admit("a", list(range(9)))
    now[0] = math.nan
    with pytest.raises(KVStateError, match="finite number"):
        p.tick()


@pytest.mark.parametrize("kw,rule", [
    ({"read_prefix": "yes"}, "read_prefix"),
    ({"write_retries": True}, "write_retries"),
    ({"write_retries": 10**9}, "write_retries"),
    ({"decode_headroom_blocks": 2**40}, "decode_headroom_blocks"),
    ({"transfer_timeout": True}, "transfer_timeout"),
    ({"transfer_timeout": math.inf}, "finite"),
    ({"fence_grace": math.nan}, "fence_grace"),
])
def test_policy_knobs_are_checked(kw, rule):
    with pytest.raises(KVStateError, match=rule):
        Policy(**kw)


@pytest.mark.parametrize("kw,rule", [
    ({"num_layers": 2**70}, "num_layers"),
    ({"extra_layers": None}, "extra_layers"),
    ({"extra_layers": -1}, "extra_layers"),
    ({"block_size": True}, "block_size"),
])
def test_cache_specs_are_bounded_and_checked_before_use(kw, rule):
    args = {"num_layers": 2, "kv_heads": 2, "block_size": 4, "head_dim": 8, **kw}
    with pytest.raises(KVStateError, match=rule):
        CacheSpec(**args)


def test_sizes_of_unknown_kinds_are_refused():
    spec = small_spec(1)
    for size in (spec.block_bytes, spec.chunk_bytes, spec.block_shape, spec.kind_dtype):
        with pytest.raises(KVStateError, match="kind 'nope'"):
            size("nope")
    with pytest.raises(KVStateError, match="kind 'key_scale'"):
        spec.block_shape("key_scale")  # a kind of fp8 caches, not of this one


def test_pools_are_bounded():
    with pytest.raises(KVStateError, match="num_blocks"):
        PrefillLifecycle(small_spec(1), 2**70, Policy())


@pytest.mark.parametrize("extra,rule", [({0: 5}, "sequence of str"), ({0: [1]}, "sequence of str"),
                                        ({True: ["x"]}, "names block"), (["x"], "must map"),
                                        ({9: ["x"]}, "names block")])
def test_extra_keys_are_checked_on_both_sides_before_anything_changes(extra, rule):
    rig = Rig(tp=1, blocks=16)
    before = snapshot(rig.P), snapshot(rig.D)
    with pytest.raises(KVStateError, match=rule):
        rig.P.admit("a", list(range(9)), extra_keys=extra)
    with pytest.raises(KVStateError, match=rule):
        rig.D.reserve("a", list(range(9)), extra_keys=extra)
    assert (snapshot(rig.P), snapshot(rig.D)) == before


@pytest.mark.parametrize("args", [(None, "key", 0), ("", "key", 0), ("k", None, 0), ("k", "key", -1),
                                  ("k", "key", True), ("k", "key", 0, -1), ("k", "key", 0, 1.5)])
def test_object_names_are_checked(args):
    with pytest.raises(KVStateError, match="rank_key"):
        rank_key(*args)


def test_names_in_a_batch_are_each_rank_key_and_checked_as_it_checks():
    keys, kinds = ["a", "bb"], ("key", "value")
    assert rank_keys(keys, kinds, 3) == [rank_key(k, kind, 3) for k in keys for kind in kinds]
    assert rank_keys(keys, kinds, 0, [0, 2]) == [rank_key(k, kind, 0, g) for k in keys for kind in kinds
                                                 for g in (0, 2)]
    for args in [(["a", ""], kinds, 0), (["a", None], kinds, 0), (keys, ("key", ""), 0), (keys, kinds, -1),
                 (keys, kinds, True), (keys, kinds, 0, [1, -1]), (keys, kinds, 0, [1.5])]:
        with pytest.raises(KVStateError, match="rank_key"):
            rank_keys(*args)


def test_key_namespaces_are_str():
    with pytest.raises(KVStateError, match="namespace"):
        block_keys([1, 2, 3], 4, namespace=None)


def test_backend_and_store_entry_points_refuse_bad_arguments():
    b = ReferenceBackend(small_spec(2), 8, MemoryStore(1 << 20), host_blocks=2)
    with pytest.raises(KVStateError, match="kind 'nope'"):
        b.block_bytes(0, "nope", 0)
    with pytest.raises(KVStateError, match="block ids"):
        b.swap_out(0, None, None)
    with pytest.raises(KVStateError, match="directory"):
        FileStore(None)


@pytest.mark.parametrize("error_code", [-1, 0, 99, 600, True, 200.0])
def test_first_token_error_codes_are_http_statuses(error_code):
    rig = Rig(tp=1, blocks=16)
    rig.D.reserve("a", list(range(9)))
    before = snapshot(rig.D)
    with pytest.raises(KVStateError, match="error_code"):
        rig.D.deliver_first_token("a", 3, error_code=error_code)
    assert snapshot(rig.D) == before


@pytest.mark.parametrize("error", [5, b"x", ["x"]])
def test_an_error_answer_carries_its_message(error):
    rig = Rig(tp=1, blocks=16)
    rig.P.admit("a", list(range(9)))
    cmd = rig.P.poll_commands()[-1]
    before = snapshot(rig.P)
    with pytest.raises(KVStateError, match="error answer"):
        rig.P.complete(Completion(cmd.command_id, 0, 0, error=error))
    assert snapshot(rig.P) == before


def test_public_constructors_show_their_parameters():
    """``help()`` of every public class names its parameters (no bare ``*args, **kwargs``)."""
    import inspect

    import kvstate
    import kvstate._decode
    import kvstate._prefill
    import kvstate.backends

    hidden = []
    for mod in (kvstate, kvstate.backends, kvstate._prefill, kvstate._decode):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not inspect.isclass(obj) or getattr(obj, "_is_protocol", False):
                continue  # a Protocol (kvstate.backends.Driver) is an interface, never constructed
            try:
                params = inspect.signature(obj).parameters.values()
            except (TypeError, ValueError):
                continue
            if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
                hidden.append(f"{mod.__name__}.{name}")
    assert not hidden
    assert "host_blocks" in inspect.signature(PrefillLifecycle).parameters


def test_rdma_without_an_rdma_device_is_an_error_not_a_fallback():
    from kvstate.backends._mooncake import MooncakeConfig, rdma_devices

    if rdma_devices():
        pytest.skip("this host has RDMA devices")
    with pytest.raises(KVStateError, match="no RDMA device"):  # refused where it is made
        MooncakeConfig(master="127.0.0.1:50051", metadata="http://127.0.0.1:8080/metadata", protocol="rdma")
    MooncakeConfig(master="127.0.0.1:50051", metadata="http://127.0.0.1:8080/metadata").validate()  # tcp is fine


def test_the_demo_says_which_transport_ran():
    from kvstate.app._demo import DemoConfig, format_summary, run_demo

    s = run_demo(DemoConfig(requests=6))
    assert s["transport"] == "" and " over " not in format_summary(s)
    assert "over tcp" in format_summary({**s, "store": "MooncakeStore", "transport": "tcp"})


@pytest.mark.parametrize("tokens", [[5, True, 7], (5, 6, False), [False]])
def test_bools_are_not_token_ids(tokens):
    """A bool would pack as token 0 or 1: admit, reserve, append_tokens and block_keys refuse
    it, naming where it is, and nothing changes."""
    from lifecycle_helpers import running

    rig = Rig(tp=1, blocks=16)
    running(rig, "a")
    before = (snapshot(rig.P), snapshot(rig.D))
    for call in (lambda: rig.P.admit("b", tokens), lambda: rig.D.reserve("b", tokens),
                 lambda: rig.D.append_tokens("a", tokens), lambda: block_keys(tokens, 4)):
        with pytest.raises(KVStateError, match=r"not bools \(index \d"):
            call()
    assert (snapshot(rig.P), snapshot(rig.D)) == before

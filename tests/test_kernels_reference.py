"""The numpy transfer ops against a trivially correct loop, and every validation rule."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from needs import has_module

from kvstate import BlockError, ValidationError
from kvstate.kernels import coalesce_runs, swap_cache_all_layers, swap_cache_layout, swap_cache_per_layer
from kvstate.kernels._plan import plan_layout

DTYPES = [np.uint16, np.float16, np.uint8, np.float32]


@st.composite
def case(draw):
    layers = draw(st.integers(1, 4))
    n_gpu, n_host = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    heads, bs, dim = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 7))  # odd chunk sizes
    dtype = draw(st.sampled_from(DTYPES))
    k = draw(st.integers(0, min(n_gpu, n_host)))
    gpu = draw(st.permutations(range(n_gpu)))[:k]
    host = draw(st.permutations(range(n_host)))[:k]
    if draw(st.booleans()) and k:  # runs of consecutive ids on both sides
        g0, h0 = draw(st.integers(0, n_gpu - k)), draw(st.integers(0, n_host - k))
        gpu, host = list(range(g0, g0 + k)), list(range(h0, h0 + k))
    seed = draw(st.integers(0, 2**31))
    return layers, n_gpu, n_host, (heads, bs, dim), np.dtype(dtype), list(gpu), list(host), seed


def rand(shape, dtype, rng):
    return rng.integers(0, 255, size=shape).astype(dtype)


@settings(max_examples=150, deadline=None)
@given(case(), st.sampled_from(["d2h", "h2d"]))
def test_layout_matches_loop(c, direction):
    layers, n_gpu, n_host, chunk, dtype, gpu, host, seed = c
    rng = np.random.default_rng(seed)
    caches = [rand((n_gpu,) + chunk, dtype, rng) for _ in range(layers)]
    hbuf = rand((n_host, layers) + chunk, dtype, rng)
    want_c, want_h = [x.copy() for x in caches], hbuf.copy()
    for g, h in zip(gpu, host):  # the trivially correct loop
        for layer in range(layers):
            if direction == "d2h":
                want_h[h, layer] = want_c[layer][g]
            else:
                want_c[layer][g] = want_h[h, layer]
    plan = swap_cache_layout(caches, hbuf, gpu, host, direction)
    assert all((a == b).all() for a, b in zip(caches, want_c)) and (hbuf == want_h).all()
    assert plan.bytes == len(gpu) * layers * int(np.prod(chunk)) * dtype.itemsize
    assert sum(n for _, _, n in plan.runs) == len(gpu)


@settings(max_examples=100, deadline=None)
@given(case(), st.sampled_from(["d2h", "h2d"]), st.booleans())
def test_per_layer_and_all_layers_match_loop(c, direction, one):
    layers, n_gpu, n_host, chunk, dtype, gpu, host, seed = c
    layers = 1 if one else layers
    rng = np.random.default_rng(seed)
    caches = [rand((n_gpu,) + chunk, dtype, rng) for _ in range(layers)]
    hosts = [rand((n_host,) + chunk, dtype, rng) for _ in range(layers)]
    want_c, want_h = [x.copy() for x in caches], [x.copy() for x in hosts]
    for g, h in zip(gpu, host):
        for layer in range(layers):
            if direction == "d2h":
                want_h[layer][h] = want_c[layer][g]
            else:
                want_c[layer][g] = want_h[layer][h]
    if one:
        swap_cache_per_layer(caches[0], hosts[0], gpu, host, direction)
    else:
        swap_cache_all_layers(caches, hosts, gpu, host, direction)
    assert all((a == b).all() for a, b in zip(caches + hosts, want_c + want_h))


def test_coalesce_runs():
    assert coalesce_runs(np.array([3, 4, 5, 9, 10]), np.array([0, 1, 2, 3, 7])) == ((3, 0, 3), (9, 3, 1), (10, 7, 1))
    assert coalesce_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == ()


def _arrays():
    caches = [np.zeros((4, 2, 3, 5), np.float16) for _ in range(2)]
    host = np.ones((3, 2, 2, 3, 5), np.float16)
    return caches, host


@pytest.mark.parametrize("gpu,host,direction,err,msg", [
    ([0, 1], [0], "d2h", ValidationError, "lengths must match"),
    ([4], [0], "d2h", BlockError, "out of range"),
    ([-1], [0], "d2h", BlockError, "negative"),
    ([0], [3], "d2h", BlockError, "out of range"),
    ([0, 1], [1, 1], "d2h", BlockError, "appears twice"),
    ([1, 1], [0, 1], "h2d", BlockError, "appears twice"),
    ([0.5], [0], "d2h", BlockError, "not an int"),
    ([0], [0], "up", ValidationError, "direction"),
])
def test_validation_rules_move_nothing(gpu, host, direction, err, msg):
    caches, hbuf = _arrays()
    before = [c.copy() for c in caches], hbuf.copy()
    with pytest.raises(err, match=msg):
        swap_cache_layout(caches, hbuf, gpu, host, direction)
    assert all((a == b).all() for a, b in zip(caches, before[0])) and (hbuf == before[1]).all()


def test_duplicate_source_is_allowed():
    caches, hbuf = _arrays()
    caches[0][1] = 7
    swap_cache_layout(caches, hbuf, [1, 1], [0, 2], "d2h")
    assert (hbuf[0, 0] == 7).all() and (hbuf[2, 0] == 7).all()


@pytest.mark.parametrize("mutate,msg", [
    (lambda c, h: (c + [np.zeros((4, 2, 3, 6), np.float16)], h), "shape"),
    (lambda c, h: ([c[0], c[1].astype(np.float32)], h), "dtype"),
    (lambda c, h: (c, h[:, :1]), "host must be"),
    (lambda c, h: (c, h.astype(np.uint8)), "host dtype"),
    (lambda c, h: ([c[0][:, :, :, ::2].copy(), c[1][:, :, :, ::2]], h), "contiguous|shape"),
    (lambda c, h: ([], h), "non-empty"),
    (lambda c, h: (c, "not an array"), "DLPack|array"),
])
def test_shape_dtype_contiguity_rules(mutate, msg):
    caches, hbuf = mutate(*_arrays())
    with pytest.raises(ValidationError, match=msg):
        swap_cache_layout(caches, hbuf, [0], [0], "d2h")


@pytest.mark.paddle
@pytest.mark.skipif(not has_module("paddle"), reason="paddlepaddle is not installed (pip install '.[paddle]')")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "uint8"])
def test_paddle_cpu_tensors_zero_copy(dtype):
    import paddle

    rng = np.random.default_rng(0)
    src = [rng.integers(0, 100, (6, 2, 4, 3)).astype(np.float32) for _ in range(3)]
    caches = [paddle.to_tensor(s).astype(dtype) for s in src]
    host = paddle.zeros([4, 3, 2, 4, 3], dtype=dtype)
    ptr = host.data_ptr()
    swap_cache_layout(caches, host, [5, 0, 2], [0, 1, 3], "d2h")
    assert host.data_ptr() == ptr  # written in place, through DLPack
    got = host.astype("float32").numpy()
    for g, h in zip([5, 0, 2], [0, 1, 3]):
        for layer in range(3):
            np.testing.assert_array_equal(got[h, layer], caches[layer].astype("float32").numpy()[g])
    back = [paddle.zeros([6, 2, 4, 3], dtype=dtype) for _ in range(3)]
    swap_cache_layout(back, host, [1, 2, 3], [0, 1, 3], "h2d")
    np.testing.assert_array_equal(back[1].astype("float32").numpy()[1], caches[1].astype("float32").numpy()[5])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=12, unique=True), st.data())
def test_run_counts_match_the_runs(gids, data):
    """``num_runs``/``num_host_runs`` count what ``runs``/``host_runs`` build."""
    hids = data.draw(st.permutations(range(len(gids))))
    caches = [np.zeros((31, 1, 1, 2), np.uint8)]
    plan = plan_layout(caches, np.zeros((max(1, len(gids)), 1, 1, 1, 2), np.uint8), gids, hids, "d2h")
    assert plan.num_runs == len(plan.runs) and plan.num_host_runs == len(plan.host_runs)


# -- block ids in every form an engine holds them -------------------------------------------------
@pytest.fixture(params=["compiled", "python"], autouse=False)
def packer(request, monkeypatch):
    """Block ids packed and checked by the compiled helpers, and by the pure-Python fallback."""
    from kvstate.kernels import _ids as id_mod
    if request.param == "compiled" and id_mod.id_packer is None:
        pytest.skip("the compiled id packer was not built here (no C compiler at install)")
    if request.param == "python":
        monkeypatch.setattr(id_mod, "id_packer", None)
        monkeypatch.setattr(id_mod, "id_checker", None)
    return request.param


def _forms(ids):
    from array import array
    yield "list", list(ids)
    yield "tuple", tuple(ids)
    yield "numpy ints in a list", [np.int32(i) for i in ids]
    yield "range", range(ids[0], ids[0] + len(ids)) if ids == list(range(ids[0], ids[0] + len(ids))) else list(ids)
    yield "array.array", array("i", ids)
    for dt in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"):
        if max(ids) < np.iinfo(dt).max:
            yield dt, np.asarray(ids, dtype=dt)


@pytest.mark.parametrize("ids", [[5, 1, 9, 3], [0, 1, 2], [7]])
def test_ids_in_any_integer_form_move_the_same_bytes(ids, packer):
    from kvstate.kernels._ids import as_ids
    caches = [np.arange(16 * 2 * 3, dtype=np.float16).reshape(16, 1, 2, 3) + layer for layer in range(2)]
    want = np.zeros((len(ids), 2, 1, 2, 3), np.float16)
    swap_cache_layout(caches, want, list(ids), list(range(len(ids))), "d2h")
    for form, value in _forms(ids):
        assert as_ids(value).tolist() == list(ids), form
        host = np.zeros_like(want)
        swap_cache_layout(caches, host, value, list(range(len(ids))), "d2h")
        assert np.array_equal(host, want), form


@pytest.mark.parametrize("bad, msg", [
    ([2, True, 5], "block id True is not an int"),  # a bool hides as 1 among ints: still refused
    ([0, False], "block id False is not an int"),
    ([1, 2.0], "block id 2.0 is not an int"),
    ([1, "2"], "block id '2' is not an int"),
    ([1, None], "block id None is not an int"),
    ([1, 2**70], "out of the int64 range"),
    (np.array([True, False]), "must hold integers, got dtype bool"),
    (np.array([1.0, 2.0]), "must hold integers, got dtype float64"),
    (np.array([2**64 - 1], dtype=np.uint64), "out of the int64 range"),
    (np.array([[1, 2]]), "must be one-dimensional"),
    ("12", "must be a sequence of ints"),
    (7, "must be a sequence of ints"),
])
def test_ids_that_are_not_integers_are_refused_before_anything_moves(bad, msg, packer):
    caches = [np.zeros((4, 1, 2, 2), np.float16)]
    host = np.ones((2, 1, 1, 2, 2), np.float16)
    with pytest.raises(ValidationError, match=msg):
        swap_cache_layout(caches, host, bad, [0, 1][:len(bad) if hasattr(bad, "__len__") else 1], "h2d")
    assert not caches[0].any()


def test_duplicates_are_found_at_any_pool_size(packer):
    """Uniqueness costs O(n log n) or O(n) in the ids, nothing in the pool's size."""
    from kvstate.kernels._ids import check_ids
    for limit in (1 << 10, 1 << 20, 1 << 40):
        ids = [limit - 1, 3, 77, limit - 1]
        with pytest.raises(BlockError, match=f"block {limit - 1} appears twice"):
            check_ids(ids, limit, "ids", unique=True)
        assert check_ids(ids, limit, "ids", unique=False).tolist() == ids


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-3, 40) | st.integers(-2**64, 2**64) | st.booleans() | st.floats(0, 40), max_size=12),
       limit=st.sampled_from([8, 40, 1 << 30]), unique=st.booleans())
def test_list_and_array_ids_are_judged_alike(ids, limit, unique):
    from kvstate.kernels import _ids as id_mod
    for packer in (id_mod.id_packer, None):  # the compiled packer (if built) and the fallback
        _judged_alike(ids, limit, unique, packer)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-3, 40) | st.integers(-2**64, 2**64) | st.booleans(), max_size=12),
       limit=st.sampled_from([8, 40, 1 << 30]))
def test_checked_ids_packs_exactly_the_ids_check_ids_accepts_as_distinct(ids, limit):
    from kvstate.kernels import _ids as id_mod
    got = id_mod.checked_ids(ids, limit)
    try:
        want = id_mod.check_ids(ids, limit, "ids", unique=True).tolist()
    except BlockError:
        want = None
    if id_mod.id_packer is None:
        assert got is None  # nothing compiled: the caller's checks decide
    else:
        assert (got.tolist() if got is not None else None) == want and (got is None or got.dtype == np.int64)


def _judged_alike(ids, limit, unique, packer):
    """A list is accepted exactly when its ints are, as an int64 array, with the same ids."""
    from unittest import mock

    from kvstate.kernels import _ids as id_mod
    ints = all(type(i) is int and -2**63 <= i < 2**63 for i in ids)
    try:
        with mock.patch.object(id_mod, "id_packer", packer):
            got = id_mod.check_ids(ids, limit, "ids", unique).tolist()
    except BlockError:
        got = None
    if not ints:
        assert got is None
        return
    try:
        want = id_mod.check_ids(np.asarray(ids, dtype=np.int64), limit, "ids", unique).tolist()
    except BlockError:
        want = None
    assert got == want


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(-2**63, 2**63 - 1) | st.integers(-3, 3000), max_size=3000),
       limit=st.sampled_from([1, 8, 3000, 1 << 40, 2**63 - 1]), unique=st.booleans(), step=st.sampled_from([1, 2]))
def test_compiled_checker_agrees_with_numpy(ids, limit, unique, step):
    """The compiled check accepts exactly what numpy's does (and passes strided arrays to it)."""
    from unittest import mock

    from kvstate.kernels import _ids as id_mod
    if id_mod.id_checker is None:
        pytest.skip("the compiled id checker was not built here (no C compiler at install)")
    arr = np.asarray(ids, dtype=np.int64)[::step]
    verdicts = []
    for checker in (id_mod.id_checker, None):
        try:
            with mock.patch.object(id_mod, "id_checker", checker):
                verdicts.append(id_mod.check_ids(arr, limit, "ids", unique).tolist())
        except BlockError as e:
            verdicts.append(str(e))
    assert verdicts[0] == verdicts[1]
    fits = all(0 <= i < limit for i in arr.tolist()) and not (unique and len(set(arr.tolist())) < arr.size)
    assert id_mod.id_checker(np.ascontiguousarray(arr), limit, unique) is fits


@settings(max_examples=300, deadline=None)
@given(a=st.lists(st.integers(-2, 60), max_size=40), b=st.lists(st.integers(-2, 60), max_size=40),
       sort=st.sampled_from(["", "a", "b", "ab"]), limits=st.sampled_from([(50, 50), (61, 8), (1 << 40, 61)]),
       h2d=st.booleans())
def test_a_compiled_pair_check_agrees_with_checking_each_list(a, b, sort, limits, h2d):
    """GPU and host ids packed and checked in one call (increasing lists take a shortcut past
    the uniqueness table): accepted exactly when each list passes alone, with the same ids."""
    from kvstate.kernels import _ids as id_mod
    if id_mod.id_packer is None:
        pytest.skip("the compiled id packer was not built here (no C compiler at install)")
    a, b = (sorted(a) if "a" in sort else a), (sorted(set(b)) if "b" in sort else b)
    b = (b * 2)[:len(a)] if len(b) >= 1 else b  # equal lengths mostly; an empty b stays unequal
    from unittest import mock
    try:  # the reference: numpy alone, no compiled helper
        with mock.patch.object(id_mod, "id_packer", None), mock.patch.object(id_mod, "id_checker", None):
            want = id_mod.check_ids(a, limits[0], "a", unique=h2d).tolist() + \
                id_mod.check_ids(b, limits[1], "b", unique=not h2d).tolist()
        want = want if len(a) == len(b) else None
    except BlockError:
        want = None
    got = id_mod.check_pair(a, b, limits[0], limits[1], h2d)
    assert (None if got is None else np.frombuffer(got, np.int64).tolist()) == want


@pytest.mark.skipif(not has_module("paddle"), reason="needs paddlepaddle")
def test_paddle_int_tensors_as_ids():
    import paddle

    from kvstate.kernels._ids import as_ids
    assert as_ids(paddle.to_tensor([4, 0, 2], dtype="int32")).tolist() == [4, 0, 2]
    with pytest.raises(BlockError, match="got dtype bool"):
        as_ids(paddle.to_tensor([True, False]))


@pytest.mark.parametrize("compiled", [True, False])
def test_identity_key_names_exactly_these_objects(compiled, monkeypatch):
    """The key a swapper remembers a cache list by: equal for the same objects in the same
    order, different for any other object or order, and holding no reference to them."""
    import gc
    import weakref

    from kvstate.kernels import _ids as id_mod
    if compiled and id_mod.id_packer is None:
        pytest.skip("the compiled helpers were not built here (no C compiler at install)")
    if not compiled:
        monkeypatch.setattr(id_mod, "_identity", None)
    a, b, c = (np.zeros(2) for _ in range(3))
    key = id_mod.identity_key([a, b])
    assert key == id_mod.identity_key((a, b)) and hash(key) == hash(id_mod.identity_key([a, b]))
    assert key != id_mod.identity_key([b, a]) and key != id_mod.identity_key([a, c]) and key != id_mod.identity_key([a])
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None, "the key kept its object alive"


@settings(max_examples=300, deadline=None)
@given(g=st.lists(st.integers(-2, 9), max_size=6), h=st.lists(st.integers(-2, 9), max_size=6),
       direction=st.sampled_from(["d2h", "h2d"]))
def test_a_call_with_list_ids_is_judged_as_with_arrays(g, h, direction):
    """Both ids as lists (packed and checked together in one compiled pass) against both as
    int64 arrays: the same ids, or the same error."""
    from kvstate.kernels._plan import plan_layout
    caches = [np.zeros((8, 1, 1, 2), np.uint8)]
    host = np.zeros((8, 1, 1, 1, 2), np.uint8)
    outcomes = []
    for gi, hi in ((g, h), (np.asarray(g, np.int64), np.asarray(h, np.int64))):
        try:
            p = plan_layout(caches, host, gi, hi, direction)
            outcomes.append((p.gpu_ids.tolist(), p.host_ids.tolist()))
        except ValidationError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("compiled", [True, False])
@given(ids=st.lists(st.integers(0, 2**31 - 1), max_size=40), start=st.integers(0, 10))
def test_packed_ids_narrow_into_int32_as_numpy_would(compiled, ids, start):
    """How the CUDA launch copies a plan's packed ids into its parameter block: the same int32
    values from the compiled helper and from numpy; a too-short buffer is refused (compiled)."""
    from unittest import mock

    from kvstate.kernels import _ids as id_mod
    if compiled and id_mod.id_packer is None:
        pytest.skip("the compiled id packer was not built here (no C compiler at install)")
    packed = np.asarray(ids, np.int64).tobytes()
    start = min(start, len(ids))
    dst = np.full(48, -1, np.int32)
    with mock.patch.object(id_mod, "_narrow", id_mod._narrow if compiled else None):
        id_mod.narrow_into(packed, start, len(ids) - start, dst)
    assert dst[:len(ids) - start].tolist() == ids[start:] and (dst[len(ids) - start:] == -1).all()
    if compiled:
        with pytest.raises(ValueError, match="too short"):
            id_mod.narrow_into(packed, start, len(ids) - start + 1, dst)


def test_a_plan_from_id_lists_keeps_them_packed_and_views_them():
    caches = [np.zeros((10, 1, 1, 2), np.uint8)] * 3
    host = np.zeros((6, 3, 1, 1, 2), np.uint8)
    p = plan_layout(caches, host, [9, 2, 4], [0, 5, 1], "h2d")
    assert p.blocks == 3 and p.gpu_ids.tolist() == [9, 2, 4] and p.host_ids.tolist() == [0, 5, 1]
    assert p.packed is None or np.frombuffer(p.packed, np.int64).tolist() == [9, 2, 4, 0, 5, 1]
    assert plan_layout(caches, host, np.array([9]), np.array([0]), "h2d").packed is None

"""An engine's paged KV tensors seen as kvstate caches, and a rank's transfers over them
(kvstate.integrations._pagedkv): every layout served round-trips byte-exact; others are refused
by name. PyTorch CPU tensors here; the same on CUDA tensors runs on the GPU machine."""
from __future__ import annotations

import time
from typing import Any

import pytest
from needs import has_module

from kvstate import CacheSpec, ConfigError, ValidationError
from kvstate._keys import block_keys
from kvstate.backends._arena import ArenaStore
from kvstate.backends._stores import MemoryStore
from kvstate.commands import ReadBlocks, WriteBlocks

pytestmark = pytest.mark.skipif(not has_module("torch"), reason="needs PyTorch (pip install '.[vllm]')")

NB, H, B, D = 9, 2, 16, 8


def spec(kinds: int = 2, dtype: str = "bfloat16", heads: int = H, dim: int = D) -> CacheSpec:
    return CacheSpec(num_layers=3, kv_heads=heads, block_size=B, head_dim=dim, dtype=dtype, has_value=kinds == 2)


def layers(shape, dtype=None, perm=None, device="cpu"):
    import torch

    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(len(shape))
    out = {}
    for i in range(3):
        t = torch.randn(*shape, generator=g).to(dtype).to(device)
        out[f"layer{i}"] = t.permute(*perm) if perm else t
    return out


def cuda_missing() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None if has_module("cupy") else "needs CuPy (pip install '.[cuda]')"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_store(kind: str, s: CacheSpec):
    """A MemoryStore, or an arena whose slots are one object of ``s`` (the zero-copy path on CUDA)."""
    if kind == "memory":
        return MemoryStore(1 << 26)
    slot = s.num_layers * s.chunk_bytes(s.kinds[0])
    return ArenaStore.create(slot, 64, small_bytes=min(1024, slot // 2))


def roundtrip(s: CacheSpec, src: dict, dst: dict, ids_src: list[int], ids_dst: list[int],
              store_kind: str = "memory") -> None:
    from kvstate.integrations._pagedkv import RankTransfers

    store = make_store(store_kind, s)  # closing it twice is harmless
    keys = block_keys(list(range(1, len(ids_src) * B + 1)), B, namespace="t")
    p, d = RankTransfers(s, 0, src, store), RankTransfers(s, 0, dst, store)
    try:
        p.submit("save", [WriteBlocks("r", 1, (0,), time.monotonic() + 30, tuple(keys), tuple(ids_src))])
        assert [c.count for c in p.poll("save", 10)] == [len(ids_src)]
        d.submit("load", [ReadBlocks("r", 1, (0,), time.monotonic() + 30, tuple(keys), tuple(ids_dst))])
        assert [c.count for c in d.poll("load", 10)] == [len(ids_src)]
    finally:
        for t in (p, d):
            t.close(5)


@pytest.mark.parametrize("store_kind", ["memory", "arena"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["kv-first HND", "HND strides, NHD shape", "CPU packed", "MLA latent"])
def test_every_layout_served_round_trips_byte_exact_odd_block_counts(layout, device, store_kind):
    import torch

    if device == "cuda" and cuda_missing():
        pytest.skip(cuda_missing())
    if layout == "kv-first HND":
        s, shape, perm = spec(), (2, NB, H, B, D), None
    elif layout == "HND strides, NHD shape":
        s, shape, perm = spec(), (2, NB, H, B, D), (0, 1, 3, 2, 4)  # seen as [2, NB, B, H, D]
    elif layout == "CPU packed":
        s, shape, perm = spec(kinds=1, dim=2 * D), (NB, H, B, 2 * D), None
    else:
        s, shape, perm = spec(kinds=1, heads=1), (NB, B, D), None
    src = layers(shape, perm=perm, device=device)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    ids_src, ids_dst = [4, 1, 7], [2, 8, 5]
    roundtrip(s, src, dst, ids_src, ids_dst, store_kind)
    for name in src:
        a, b = src[name], dst[name]
        for i, j in zip(ids_src, ids_dst):
            if len(shape) == 5:
                assert torch.equal(a[:, i], b[:, j])
            else:
                assert torch.equal(a[i], b[j])
        untouched = [j for j in range(NB) if j not in ids_dst]
        assert not b[..., untouched, :, :, :].any() if len(shape) == 5 else not b[untouched].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn", "float8_e5m2"])
def test_float16_and_fp8_caches_round_trip_as_bytes(dtype, device):
    import torch

    if device == "cuda" and cuda_missing():
        pytest.skip(cuda_missing())
    tdtype = getattr(torch, dtype)
    s = spec(dtype="float16" if dtype == "float16" else "uint8")
    src = layers((2, NB, H, B, D), dtype=tdtype, device=device)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    roundtrip(s, src, dst, [0, 8], [3, 4])
    for name in src:
        a, b = src[name].view(torch.uint8), dst[name].view(torch.uint8)
        assert torch.equal(a[:, [0, 8]], b[:, [3, 4]])


@pytest.mark.parametrize("make, rule", [
    (lambda: (spec(), layers((2, NB, B, H, D))), "not one dense run|HND"),  # NHD in memory
    (lambda: (spec(), layers((NB, 2, H, B, D))), "not the layout kvstate expects"),
    (lambda: (spec(), layers((2, NB, H, B, D + 1))), "not the layout"),
    (lambda: (spec(dtype="float16"), layers((2, NB, H, B, D))), "dtype"),
    (lambda: (spec(), {"only": layers((2, NB, H, B, D))["layer0"]}), "registered 1 KV cache layers"),
])
def test_a_layout_kvstate_cannot_serve_is_refused_by_name_before_any_transfer(make, rule):
    from kvstate.integrations._pagedkv import RankTransfers

    s, ls = make()
    with pytest.raises(ConfigError, match=rule):
        RankTransfers(s, 0, ls, MemoryStore(1 << 20))


def cuda_arena_pair(namespace: str) -> tuple[dict, dict, ArenaStore, tuple[str, ...], Any, Any]:
    """P's and D's rank transfers over CUDA tensors and one arena: the tensors (P's random, D's
    zeroed), the arena, four blocks' keys, and the two RankTransfers (skips without CUDA)."""
    import torch

    from kvstate.integrations._pagedkv import RankTransfers

    if cuda_missing():
        pytest.skip(cuda_missing())
    s = spec()
    src = layers((2, NB, H, B, D), device="cuda")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    store = make_store("arena", s)
    keys = tuple(block_keys(list(range(1, 4 * B + 1)), B, namespace=namespace))
    return src, dst, store, keys, RankTransfers(s, 0, src, store), RankTransfers(s, 0, dst, store)


@pytest.mark.gpu
def test_an_arena_store_is_read_and_written_in_place_and_a_flipped_byte_is_caught_on_the_gpu():
    """On CUDA an arena's slots are the host buffer: blocks are gathered straight into them
    and scattered straight out; the SUM64 taken where they land still catch a flipped byte,
    which is evicted, and the blocks before it count."""
    import torch

    src, dst, store, keys, p, d = cuda_arena_pair("z")
    try:
        p.submit("save", [WriteBlocks("r", 1, (0,), time.monotonic() + 30, keys, (1, 3, 5, 7))])
        assert [c.count for c in p.poll("save", 10)] == [4]
        assert p.backend._arena_views, "the zero-copy path was not taken"
        assert store.batch_is_exist([f"{keys[0]}"]) == [0]  # objects are named per kind and rank
        place = store.locate([p.backend.objects.names(0, keys[2:3])[0]])[0]
        store.slots()[place.slot][5] ^= 0xFF  # flip a byte of block 2's first object
        d.submit("load", [ReadBlocks("r", 1, (0,), time.monotonic() + 30, keys, (0, 2, 4, 6))])
        assert [c.count for c in d.poll("load", 10)] == [2]
        for name in src:
            assert torch.equal(src[name][:, [1, 3]], dst[name][:, [0, 2]])
        assert d.backend.broken_blocks == 1
        assert store.batch_is_exist(p.backend.objects.names(0, keys[2:3])) == [0, 0]  # evicted
    finally:
        for t in (p, d):
            t.close(5)


@pytest.mark.gpu
def test_a_block_another_put_replaced_mid_read_is_read_again_on_the_gpu():
    """P puts the same blocks again while D scatters them out of the arena (two prompts sharing
    a prefix, written at once): the slots D read are taken back, its first pass counts none, and
    it reads them again from the new slots, whole, instead of failing the request."""
    import torch

    src, dst, store, keys, p, d = cuda_arena_pair("again")
    calls: list[int] = []
    real = store.unchanged

    def unchanged(places):
        calls.append(len(places))
        if len(calls) == 1:
            assert p.backend.write(0, list(keys), [1, 3, 5, 7]) == 4
        return real(places)
    try:
        p.submit("save", [WriteBlocks("r", 1, (0,), time.monotonic() + 30, keys, (1, 3, 5, 7))])
        assert [c.count for c in p.poll("save", 10)] == [4]
        store.unchanged = unchanged
        d.submit("load", [ReadBlocks("r", 1, (0,), time.monotonic() + 30, keys, (0, 2, 4, 6))])
        assert [c.count for c in d.poll("load", 10)] == [4]
        assert len(calls) >= 2  # the first pass lost the race; a later one counted
        for name in src:
            assert torch.equal(src[name][:, [1, 3, 5, 7]], dst[name][:, [0, 2, 4, 6]])
    finally:
        for t in (p, d):
            t.close(5)


@pytest.mark.gpu
def test_arena_transfers_count_up_to_a_broken_block_and_read_a_cpu_writers_blocks():
    """Of 34 blocks, a flipped byte in block 20 stops the count there, every block before it
    landed byte-exact, and a cache a CPU writer stored in place is read back on the GPU."""
    import torch

    from kvstate.integrations._pagedkv import RankTransfers

    if cuda_missing():
        pytest.skip(cuda_missing())
    s, nb, n = spec(), 80, 34
    src = layers((2, nb, H, B, D), device="cuda")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    cpu = {k: v.cpu() for k, v in src.items()}
    store = ArenaStore.create(s.num_layers * s.chunk_bytes("key"), 4 * n + 8, small_bytes=512)
    keys = tuple(block_keys(list(range(1, n * B + 1)), B, namespace="p"))
    cpu_keys = tuple(block_keys(list(range(1, n * B + 1)), B, namespace="c"))
    p, d, c = (RankTransfers(s, 0, src, store), RankTransfers(s, 0, dst, store), RankTransfers(s, 0, cpu, store))
    try:
        p.submit("save", [WriteBlocks("r", 1, (0,), time.monotonic() + 30, keys, tuple(range(n)))])
        assert [x.count for x in p.poll("save", 10)] == [n]
        place = store.locate([p.backend.objects.names(0, keys[20:21])[1]])[0]
        store.slots()[place.slot][-1] ^= 0x01  # block 20's value object, its last byte
        d.submit("load", [ReadBlocks("r", 1, (0,), time.monotonic() + 30, keys, tuple(range(40, 40 + n)))])
        assert [x.count for x in d.poll("load", 10)] == [20]
        for name in src:
            assert torch.equal(src[name][:, :20], dst[name][:, 40:60])
        assert d.backend.broken_blocks == 1
        c.submit("save", [WriteBlocks("r", 2, (0,), time.monotonic() + 30, cpu_keys, tuple(range(n)))])
        assert [x.count for x in c.poll("save", 10)] == [n]
        for v in dst.values():
            v.zero_()
        d.submit("load", [ReadBlocks("r", 2, (0,), time.monotonic() + 30, cpu_keys, tuple(range(40, 40 + n)))])
        assert [x.count for x in d.poll("load", 10)] == [n]
        for name in src:
            assert torch.equal(src[name][:, :n], dst[name][:, 40:40 + n])
    finally:
        for t in (p, d, c):
            t.close(5)


@pytest.mark.gpu
def test_a_zero_copy_save_whose_fence_passes_between_its_runs_stores_nothing_and_claims_nothing():
    """A save gathers its runs as it claims them, and publishes none before all are under way:
    a fence that passes after the first run was gathered fails the save with no object
    visible and every slot it claimed free again; the same save before its fence stores all."""
    import torch

    from kvstate import FenceError
    from kvstate.integrations._pagedkv import RankTransfers

    if cuda_missing():
        pytest.skip(cuda_missing())
    s, nb, n = spec(), 40, 34
    src = layers((2, nb, H, B, D), device="cuda")
    store = ArenaStore.create(s.num_layers * s.chunk_bytes("key"), 4 * n + 8, small_bytes=512)
    keys = tuple(block_keys(list(range(1, n * B + 1)), B, namespace="f"))
    p = RankTransfers(s, 0, src, store)
    try:
        calls: list[int] = []
        with pytest.raises(FenceError):
            p.backend.write(0, keys, list(range(n)), guard=lambda: calls.append(1) or len(calls) < 2)
        assert len(calls) == 2, "the second run's gather is where the fence was found passed"
        assert len(store) == 0 and int((store.big.state != 0).sum()) == 0 and int((store.small.state != 0).sum()) == 0
        assert p.backend.write(0, keys, list(range(n)), guard=lambda: True) == n
        assert len(store) == 3 * n  # two kinds and a manifest a block
        torch.cuda.synchronize()
    finally:
        p.close(5)


@pytest.mark.gpu
def test_an_arena_of_layer_group_objects_takes_whole_and_layer_wise_transfers_in_place():
    """With layer groups, an arena whose slot is one group's object is moved into and out of
    in place, whole and layer by layer: byte-exact both ways, each layer there when its wait
    returns; a flipped byte in one block's last group lets the earlier groups arrive, then
    stops the load's count at that block."""
    import torch

    from kvstate import rank_key
    from kvstate.commands import LoadLayers, SaveLayers
    from kvstate.integrations._pagedkv import RankTransfers

    if cuda_missing():
        pytest.skip(cuda_missing())
    s = CacheSpec(num_layers=3, kv_heads=H, block_size=B, head_dim=64, layer_groups=3)
    src = layers((2, NB, H, B, 64), device="cuda")
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    store = ArenaStore.create(s.chunk_bytes("key"), 64, small_bytes=1024)
    whole, lw = (tuple(block_keys(list(range(1, n * B + 1)), B, namespace=ns)) for n, ns in ((4, "w"), (3, "l")))
    p, d = RankTransfers(s, 0, src, store), RankTransfers(s, 0, dst, store)
    stream = torch.cuda.current_stream().cuda_stream
    try:
        p.submit("save", [WriteBlocks("r", 1, (0,), time.monotonic() + 30, whole, (1, 3, 5, 7))])
        assert [c.count for c in p.poll("save", 10)] == [4]
        assert p.backend._arena_views, "the zero-copy path was not taken"
        d.submit("load", [ReadBlocks("r", 1, (0,), time.monotonic() + 30, whole, (0, 2, 4, 6))])
        assert [c.count for c in d.poll("load", 10)] == [4]
        assert all(torch.equal(src[k][:, [1, 3, 5, 7]], dst[k][:, [0, 2, 4, 6]]) for k in src)
        now = time.monotonic()
        p.submit("save", [SaveLayers("r", 2, (0,), now + 30, lw, (2, 5, 7), fence=now + 60)])
        for i, name in enumerate(src):  # each layer written behind a long kernel, reported at once
            torch.cuda._sleep(50_000_000)
            src[name][:, [2, 5, 7]] = float(i + 2)
            event = torch.cuda.Event()
            event.record()
            p.layers_computed([("r", 2)], i + 1, event)
        assert [c.count for c in p.poll("save", 10)] == [3]
        load = LoadLayers("r", 2, (0,), time.monotonic() + 30, lw, (1, 3, 8))
        d.submit("load", [load])
        for i, name in enumerate(src):
            assert d.wait_layers([load], i + 1, stream) == set()
            assert torch.equal(dst[name][:, [1, 3, 8]].clone(), src[name][:, [2, 5, 7]]), name
        assert d.load_errors([load]) == set() and [c.count for c in d.poll("load")] == [3]
        place = store.locate([rank_key(lw[1], "value", 0, 2)])[0]
        store.slots()[place.slot][7] ^= 0xFF
        load = LoadLayers("r", 3, (0,), time.monotonic() + 30, lw, (0, 4, 6))
        d.submit("load", [load])
        assert d.wait_layers([load], 2, stream) == set() and d.wait_layers([load], 3, stream) == {3}
        assert d.load_errors([load]) == {4, 6} and [c.count for c in d.poll("load")] == [1]
        assert d.backend.broken_blocks == 1
    finally:
        for t in (p, d):
            t.close(5)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_p_and_d_at_different_tp_degrees_hand_off_byte_exact_through_the_connectors_core(p_tp, d_tp):
    """The connector's whole path without vLLM, P and D at different TP degrees: each side's
    Handoff and each rank's RankTransfers on the spec ``peer_spec`` gives it; D's heads are P's
    ranks' heads side by side, byte for byte, and the lookup sees the cache stored."""
    import torch

    from kvstate.integrations._handoff import Handoff, peer_spec
    from kvstate.integrations._pagedkv import RankTransfers

    heads, prompt = 4, list(range(7, 7 + 3 * B + 2))  # a cache of 3 full blocks and one partial

    def side(tp: int, role: str, peer: int) -> tuple:
        s = peer_spec(CacheSpec(num_layers=3, kv_heads=heads // tp, block_size=B, head_dim=D, tp_size=tp,
                                total_kv_heads=heads), role, peer)
        return s, [layers((2, NB, heads // tp, B, D)) for _ in range(tp)]

    store = MemoryStore(1 << 26)
    (ps, p_caches), (ds, d_caches) = side(p_tp, "producer", d_tp), side(d_tp, "consumer", p_tp)
    for c in d_caches:
        for v in c.values():
            v.zero_()
    hp, hd = Handoff(ps, NB, "producer", store, namespace="m"), Handoff(ds, NB, "consumer", store, namespace="m")
    pt = [RankTransfers(ps, r, p_caches[r], store) for r in range(p_tp)]
    dt = [RankTransfers(ds, r, d_caches[r], store) for r in range(d_tp)]

    def run(h: Handoff, transfers: list, side_name: str) -> Any:
        orders = h.step()
        for t in transfers:
            t.submit(side_name, orders.commands[side_name])
        for t in transfers:
            h.completed(side_name, t.poll(side_name, 10))
        return h.step()

    try:
        assert hp.save("a", prompt, [1, 3, 5, 7], first_token=9)
        assert run(hp, pt, "save").sent == {"a"}
        assert hd.lookup("a", prompt) == len(prompt)
        hd.load("a", prompt, [2, 4, 6, 8])
        orders = run(hd, dt, "load")
        assert orders.received == {"a"} and not orders.invalid
        whole = {name: torch.cat([c[name] for c in p_caches], dim=2) for name in p_caches[0]}  # every head
        for name in whole:
            got = torch.cat([c[name] for c in d_caches], dim=2)
            assert torch.equal(whole[name][:, [1, 3, 5, 7]], got[:, [2, 4, 6, 8]]), name
    finally:
        for t in pt + dt:
            t.close(5)
        store.close()


def test_peer_degrees_that_cannot_share_objects_or_a_both_engine_with_a_peer_are_refused():
    from kvstate.integrations._handoff import peer_spec

    s = CacheSpec(num_layers=2, kv_heads=2, block_size=B, head_dim=D, tp_size=2, total_kv_heads=4)
    assert peer_spec(s, "producer", 0) is s and peer_spec(s, "consumer", 2) is s
    assert peer_spec(s, "producer", 1).store_heads == 2 and peer_spec(s, "producer", 4).store_heads == 1
    with pytest.raises(ConfigError, match="saves and loads its own caches"):
        peer_spec(s, "both", 1)
    for bad in (-1, True, 2.0, "1", 5000):
        with pytest.raises(ConfigError, match="peer_tp must be an int"):
            peer_spec(s, "producer", bad)


def test_a_layer_wise_save_stores_each_layer_group_only_once_the_forward_reported_it():
    """What the connector's ``save_kv_layer`` drives: a SaveLayers waits, storing nothing,
    until the forward reports layers; then exactly the groups reported; then answers whole."""
    from kvstate import rank_key
    from kvstate.commands import SaveLayers
    from kvstate.integrations._pagedkv import RankTransfers

    s = CacheSpec(num_layers=3, kv_heads=H, block_size=B, head_dim=D, layer_groups=3)
    src = layers((2, NB, H, B, D))
    store = MemoryStore(1 << 26)
    keys = tuple(block_keys(list(range(1, 2 * B + 1)), B, namespace="lw"))
    t = RankTransfers(s, 0, src, store)

    def stored(group: int) -> bool:
        return store.batch_is_exist([rank_key(k, kind, 0, group) for k in keys for kind in s.kinds]) == [1] * 4

    try:
        now = time.monotonic()
        t.submit("save", [SaveLayers("r", 1, (0,), now + 30, keys, (2, 5), fence=now + 60)])
        time.sleep(0.3)
        assert t.poll("save") == [] and len(store) == 0  # no layer reported: nothing stored
        t.layers_computed([("r", 1)], 1)
        deadline = time.monotonic() + 10
        while not stored(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert stored(0) and not stored(1) and not stored(2) and t.poll("save") == []
        t.layers_computed([("r", 1)], 3)
        assert [c.count for c in t.poll("save", 10)] == [2]
        assert stored(1) and stored(2)
        with pytest.raises(ValidationError, match="layers"):
            t.layers_computed([("r", 1)], 4)  # more layers than the model has
    finally:
        t.close(5)


def layerwise_pair(device: str, namespace: str) -> tuple[Any, dict, dict, tuple[str, ...], Any, Any]:
    """P's and D's transfers over one MemoryStore, three layers in three groups on ``device``:
    (store, P's caches, D's caches (zeros), keys of three blocks, P, D)."""
    from kvstate.integrations._pagedkv import RankTransfers

    if device == "cuda" and cuda_missing():
        pytest.skip(cuda_missing())
    import torch

    s = CacheSpec(num_layers=3, kv_heads=H, block_size=B, head_dim=D, layer_groups=3)
    caches = layers((2, NB, H, B, D), device=device)
    dst = {k: torch.zeros_like(v) for k, v in caches.items()}
    store = MemoryStore(1 << 26)
    keys = tuple(block_keys(list(range(1, 3 * B + 1)), B, namespace=namespace))
    return store, caches, dst, keys, RankTransfers(s, 0, caches, store), RankTransfers(s, 0, dst, store)


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_wise_save_waits_for_each_layers_event_and_stores_what_the_forward_wrote(device):
    """As the connector's ``save_kv_layer`` drives it on a GPU: the forward writes a layer's
    blocks, records an event after it without waiting (a long kernel first keeps the write
    back), and reports the layer; the save's gathers wait for the event on the device. What
    is read back into other blocks is what the forward wrote, every layer, byte for byte."""
    import torch

    from kvstate.commands import SaveLayers

    store, caches, dst, keys, p, d = layerwise_pair(device, "ev")
    written = {}
    try:
        now = time.monotonic()
        p.submit("save", [SaveLayers("r", 1, (0,), now + 30, keys, (2, 5, 7), fence=now + 60)])
        for i, name in enumerate(caches):
            event = None
            if device == "cuda":
                torch.cuda._sleep(50_000_000)  # tens of ms of GPU time before the layer is written
            caches[name][:, [2, 5, 7]] = torch.full_like(caches[name][:, [2, 5, 7]], float(i + 1))
            written[name] = caches[name][:, [2, 5, 7]].clone()
            if device == "cuda":
                event = torch.cuda.Event()
                event.record()
            p.layers_computed([("r", 1)], i + 1, event)
        assert [c.count for c in p.poll("save", 10)] == [3]
        d.submit("load", [ReadBlocks("r", 2, (0,), time.monotonic() + 30, keys, (0, 1, 3))])
        assert [c.count for c in d.poll("load", 10)] == [3]
        for name in caches:
            assert torch.equal(dst[name][:, [0, 1, 3]], written[name]), name
    finally:
        for t in (p, d):
            t.close(5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_wise_load_brings_each_layer_before_its_wait_returns_and_names_the_blocks_it_did_not(device):
    """As the connector's ``wait_for_layer_load`` drives it: after each wait (on the engine's
    CUDA stream for GPU caches), that layer of every block is the saved one, byte for byte,
    and after the forward no block is reported. With one block's last group corrupted in the
    store, the first two layers still arrive, the last wait gives up, and the blocks from the
    bad one on are reported once the load answered."""
    import torch

    from kvstate import rank_key
    from kvstate.commands import LoadLayers

    store, caches, dst, keys, p, d = layerwise_pair(device, "ll")
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else None
    try:
        p.submit("save", [WriteBlocks("r", 1, (0,), time.monotonic() + 30, keys, (2, 5, 7))])
        assert [c.count for c in p.poll("save", 10)] == [3]
        load = LoadLayers("r", 1, (0,), time.monotonic() + 30, keys, (0, 1, 3))
        d.submit("load", [load])
        for i, name in enumerate(caches):
            assert d.wait_layers([load], i + 1, stream) == set()
            assert torch.equal(dst[name][:, [0, 1, 3]].clone(), caches[name][:, [2, 5, 7]]), name
        assert d.load_errors([load]) == set()
        assert [c.count for c in d.poll("load")] == [3]  # kept for the scheduler, handed out once
        name = rank_key(keys[1], "key", 0, 2)
        import numpy as np

        buf = np.zeros(1 << 16, np.uint8)
        size = store.batch_get_into([name], [buf])[0]
        buf[size // 2] ^= 0xFF
        store.batch_put_from([name], [buf[:size]])  # the last group of the middle block, one byte flipped
        load = LoadLayers("r", 2, (0,), time.monotonic() + 30, keys, (4, 6, 8))
        d.submit("load", [load])
        assert d.wait_layers([load], 2, stream) == set()
        assert d.wait_layers([load], 3, stream) == {2}
        assert d.load_errors([load]) == {6, 8}
        assert [c.count for c in d.poll("load")] == [1]
    finally:
        for t in (p, d):
            t.close(5)


@pytest.mark.parametrize("call, args", [
    ("wait_layers", ([1], 1)), ("wait_layers", ([], 0)), ("wait_layers", ("x", 1)), ("load_errors", ([None],)),
    ("submit", ("save", None)), ("submit", ("nope", [])), ("submit", ("save", [1])),
    ("poll", ("save", "x")), ("poll", ("save", -1)), ("poll", (None,)),
    ("layers_computed", ([("r", 1)], 0)), ("layers_computed", ("x", 1)), ("layers_computed", ([1, 2], 1)),
    ("layers_computed", ([("r", "c")], 1)), ("layers_computed", ([("r", 1)], 99)),
])
def test_a_ranks_transfers_refuse_bad_arguments_by_name(call, args):
    from kvstate import KVStateError
    from kvstate.integrations._pagedkv import RankTransfers

    t = RankTransfers(spec(), 0, layers((2, NB, H, B, D)), MemoryStore(1 << 20))
    try:
        with pytest.raises(KVStateError):
            getattr(t, call)(*args)
        assert t.inflight() == 0 and t.poll("save") == [] and t.poll("load") == []
    finally:
        t.close(5)

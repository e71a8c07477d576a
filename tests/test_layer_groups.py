"""Layer groups (kvstate._layers): the spec's rules, what each group needs read, where each
kind is moved today, and the latent layout stored once."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from lifecycle_helpers import SWAP, TOKS, assert_clean, d_matches, deliver, handoff
from rigs import Rig

from kvstate import CacheSpec, ConfigError, DecodeLifecycle, KVStateError, Policy, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate._keys import block_keys, rank_key
from kvstate._layers import LayerGroup, checkpoint_floor, read_blocks
from kvstate._pool import FREED
from kvstate._spec import check_pair
from kvstate.backends import MemoryStore, ReferenceBackend
from kvstate.testing import mismatched_blocks


def G(kind: str, layers, **kw) -> LayerGroup:  # noqa: N802 - reads as the spec's own word
    return LayerGroup(kind, tuple(layers), **kw)


def gemma_like(num_layers: int = 6, window: int = 16, **kw) -> CacheSpec:
    """Five sliding-window layers to one full layer, interleaved (Gemma 3's pattern)."""
    full = tuple(range(5, num_layers, 6))
    local = tuple(i for i in range(num_layers) if i not in full)
    return CacheSpec(num_layers=num_layers, kv_heads=2, block_size=4, head_dim=8, dtype="float16",
                     groups=(G("window", local, window=window), G("full", full)), **kw)


@pytest.mark.parametrize("groups, needle", [
    ((G("full", range(5)),), r"do not add up to the cache's 6 layers: missing \[5\]"),
    ((G("full", range(6)), G("window", (5, 6), window=8)), "layer 5 is in a full group and a window group"),
    ((G("full", range(7)),), r"beyond it \[6\]"),
    ((G("window", range(5), window=6), G("full", (5,))), "window of 6 tokens is not a multiple of the block size 4"),
    ((G("state", range(5), state_bytes=64, checkpoint=6), G("full", (5,))), "checkpoint every 6 tokens"),
    ((G("state", range(6), state_bytes=64, checkpoint=8),), "every layer is a state layer"),
    ((G("latent", range(3)), G("full", range(3, 6))), "latent .* and head-split attention layers"),
    ((G("latent", range(6)),), "a latent group needs the latent layout"),
    ([G("full", range(6))], "must be a tuple of LayerGroup"),
])
def test_groups_that_break_a_rule_are_refused_naming_it(groups, needle):
    with pytest.raises(ConfigError, match=needle):
        CacheSpec(num_layers=6, kv_heads=2, block_size=4, head_dim=8, groups=groups)


@pytest.mark.parametrize("kw, needle", [
    ({"kind": "sliding"}, "kind 'sliding'"), ({"kind": "full", "window": 8}, "window"),
    ({"kind": "window"}, "window"), ({"kind": "state", "checkpoint": 8}, "state_bytes"),
    ({"kind": "state", "state_bytes": 8}, "checkpoint"), ({"kind": "full", "layers": (1, 1)}, "repeat"),
    ({"kind": "full", "layers": [0]}, "non-empty tuple"), ({"kind": "full", "layers": (True,)}, "layer index"),
    ({"kind": "state", "state_bytes": 2**31, "checkpoint": 8}, "state_bytes"),
])
def test_a_group_that_breaks_its_kind_is_refused(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        LayerGroup(**{"layers": (0,), **kw})


def test_a_window_group_needs_only_the_blocks_of_its_last_window():
    """32k tokens, W = 4,096, blocks of 64: a window layer needs 64 blocks (65 when the window
    does not start on a block), a full layer all 512."""
    w = G("window", (0,), window=4096)
    assert read_blocks(w, 32768, 64) == 64 and read_blocks(w, 32768 + 10, 64) == 65
    assert read_blocks(G("full", (0,)), 32768, 64) == 512 and read_blocks(w, 1000, 64) == 16
    spec = CacheSpec(
        num_layers=12, kv_heads=2, block_size=64, head_dim=8,
        groups=(G("window", [i for i in range(12) if i % 6 != 5], window=4096), G("full", (5, 11))))
    per_layer_block = 2 * 2 * 64 * 8 * 2  # key and value, 2 heads, 64 tokens, dim 8, bf16
    assert spec.read_bytes_per_rank(32768) == per_layer_block * (10 * 64 + 2 * 512)
    plain = dataclasses.replace(spec, groups=())
    assert plain.read_bytes_per_rank(32768) == plain.blocks_for(32768) * plain.bytes_per_block_per_rank


def test_state_groups_count_their_state_and_resume_from_checkpoints_only():
    spec = CacheSpec(num_layers=4, kv_heads=2, block_size=4, head_dim=8,
                     groups=(G("state", (0, 1, 2), state_bytes=1000, checkpoint=16), G("full", (3,))))
    assert spec.paged_layers == 1 and spec.state_bytes_per_rank == 3000
    assert spec.block_bytes("key") == spec.chunk_bytes("key")  # one paged layer
    assert spec.read_bytes_per_rank(40) == 10 * spec.bytes_per_block_per_rank + 3000
    assert checkpoint_floor(spec.groups, 11, 4) == 8 and checkpoint_floor((), 11, 4) == 11


def test_state_groups_without_state_pages_are_refused_where_bytes_move():
    spec = CacheSpec(num_layers=4, kv_heads=2, block_size=4, head_dim=8,
                     groups=(G("state", (0, 1, 2), state_bytes=1000, checkpoint=16), G("full", (3,))))
    for make, message in ((lambda: PrefillLifecycle(spec, 8), "give num_states >= 1"),
                          (lambda: DecodeLifecycle(spec, 8), "give num_states >= 1"),
                          (lambda: ReferenceBackend(spec, 8, MemoryStore(1 << 20)), "needs state pages")):
        with pytest.raises((ConfigError, ValidationError), match=message):
            make()
    assert ReferenceBackend(spec, 8, MemoryStore(1 << 20), num_states=2).spec == spec.paged()


def test_a_short_cache_is_read_whole_and_the_bytes_arrive():
    """A cache shorter than the window: every block of every group is read."""
    rig = Rig(tp=1, spec=gemma_like(tp_size=1))
    deliver(rig, handoff(rig, "r"))
    rig.dd.run_until_idle()
    [sd] = rig.notices(rig.dd, C.StartDecode)
    assert d_matches(rig, TOKS, sd.block_ids[:3])
    rig.D.finish("r")
    assert_clean(rig)


def test_p_and_d_must_agree_on_the_groups():
    with pytest.raises(ConfigError, match="disagree on groups"):
        check_pair(gemma_like(), gemma_like(window=8))


def test_a_spec_with_groups_survives_json_to_a_rank_worker():
    spec = gemma_like(tp_size=2)
    back = CacheSpec.from_dict(json.loads(json.dumps(dataclasses.asdict(spec))))
    assert back == spec
    with pytest.raises(ConfigError, match="layers must be a non-empty tuple"):
        CacheSpec.from_dict({**dataclasses.asdict(spec), "groups": [{"kind": "full"}]})


@pytest.mark.parametrize("tp", [2, 8])
def test_a_latent_cache_is_written_once_and_read_by_every_rank(tp):
    """MLA at TP ``tp``: one latent head (512 + 64 values), replicated. Rank 0 stores each
    block; every rank reads that one object. The store holds 1/tp of a per-rank layout's bytes."""
    mla = CacheSpec(num_layers=4, kv_heads=1, total_kv_heads=1, block_size=4, head_dim=576, has_value=False,
                    tp_size=tp, groups=(G("latent", range(4)),))
    per_rank = dataclasses.replace(mla, total_kv_heads=tp, groups=())  # each rank its own copy
    held = {}
    for name, spec in (("latent", mla), ("per_rank", per_rank)):
        rig = Rig(tp=tp, spec=spec)
        deliver(rig, handoff(rig, "r"))
        rig.dd.run_until_idle()
        [sd] = rig.notices(rig.dd, C.StartDecode)
        assert d_matches(rig, TOKS, sd.block_ids[:3])  # every D rank got the bytes
        held[name] = rig.store.used_bytes
    assert held["latent"] * tp == held["per_rank"]


# -- window groups read from their last window on ---------------------------------------------------
WIN = 8  # tokens: two blocks of 4


def windowed(**kw) -> CacheSpec:
    return gemma_like(window=WIN, **kw)


def stored(spec: CacheSpec, n_tokens: int):
    """P's backend with a cache of ``n_tokens`` tokens stored (random bytes), its keys."""
    store = MemoryStore(1 << 24)
    p = ReferenceBackend(spec, 16, store)
    rng = np.random.default_rng(1)
    for r in range(spec.tp_size):
        for kind in spec.kinds:
            for arr in p.caches[r][kind]:
                arr[...] = rng.standard_normal(arr.shape).astype(arr.dtype)
    keys = block_keys(list(range(n_tokens)), spec.block_size)
    for r in range(spec.tp_size):
        assert p.write(r, keys, list(range(len(keys)))) == len(keys)
    return p, store, keys


def same_layers(a, b, blocks, layers, rank=0) -> bool:
    return all(np.array_equal(a.caches[rank][k][i][blocks], b.caches[rank][k][i][blocks])
               for k in a.spec.kinds for i in layers)


def test_a_window_group_is_read_from_its_last_window_on():
    """40 tokens, W = 8: the full layer reads all 10 blocks, the five window layers only blocks
    8 and 9; D holds P's bytes there, and the window layers' early blocks were not touched."""
    spec = windowed()
    p, store, keys = stored(spec, 40)
    d = ReferenceBackend(spec, 16, store)
    first = spec.window_first_block(40)
    assert first == 8
    assert d.read(0, keys, list(range(10)), window_from=first) == 10
    full, local = spec.groups[1].layers, spec.groups[0].layers
    assert same_layers(p, d, slice(0, 10), full) and same_layers(p, d, slice(8, 10), local)
    assert not same_layers(p, d, slice(0, 8), local)  # never read
    per_layer_block = sum(spec.chunk_bytes(k) for k in spec.kinds)
    assert d.bytes_moved == per_layer_block * (1 * 10 + 5 * 2)
    whole = ReferenceBackend(spec, 16, store)
    assert whole.read(0, keys, list(range(10))) == 10 and whole.bytes_moved == per_layer_block * 6 * 10


@pytest.mark.parametrize("evict, want", [
    ("full:9", 0),  # the last block's full layer is missing: no window was read before it
    ("window:9", 0),  # the window is short of its last block
    ("full:2", 0),  # an early full block: the prefix before it has no window read
    ("window:3", 10),  # a window block it never needed
])
def test_a_short_window_read_can_be_continued_only_where_its_last_window_came(evict, want):
    spec = windowed()
    p, store, keys = stored(spec, 40)
    group, block = evict.split(":")
    g = 1 if group == "full" else 0
    for kind in spec.kinds:
        store.evict([rank_key(keys[int(block)], kind, 0, g)])
    d = ReferenceBackend(spec, 16, store)
    assert d.read(0, keys, list(range(10)), window_from=spec.window_first_block(40)) == want


def long_prompt_rig(**kw):
    """A D whose handed-off prompt (40 tokens) is longer than the window."""
    rig = Rig(tp=1, spec=windowed(tp_size=1), **kw)
    toks = list(range(300, 340))
    return rig, toks


def test_d_reads_a_long_handoff_from_its_window_and_never_shares_the_early_blocks():
    rig, toks = long_prompt_rig(prefix_cache=True)
    deliver(rig, handoff(rig, "r", toks))
    rig.dd.pump()
    [read] = [c for c in rig.D.pending_commands() if isinstance(c, C.ReadBlocks)]
    assert read.window_from == 8 and len(read.keys) == 10
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running"
    assert rig.D.pool.prefix_stats().cached == 0  # blocks 0-7 lack window layers: not published
    assert {i for i, _, _ in mismatched_blocks(rig.db, block_keys(toks, 4), rig.D.blocks_of("r"))} <= set(range(8))
    rig.D.finish("r")
    assert_clean(rig)


def test_a_preempted_long_cache_writes_back_only_whole_blocks_and_reloads():
    rig, toks = long_prompt_rig(policy=dataclasses.replace(SWAP, swap_fallback="write"), host_blocks=16)
    deliver(rig, handoff(rig, "r", toks))
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    rig.D.preempt("r")  # swap would share blocks without window layers: it writes instead
    rig.dd.pump()
    [wb] = [c for c in rig.D.pending_commands() if isinstance(c, C.WriteBlocks)]
    assert len(wb.keys) == 2 and not [c for c in rig.D.pending_commands() if isinstance(c, C.SwapOut)]
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "preempted"
    rig.D.resume("r")
    assert rig.D.state_of("r") == "reloading"
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running"
    rig.D.finish("r")
    assert_clean(rig)


def test_a_failed_window_read_recomputes_from_the_start():
    rig, toks = long_prompt_rig(policy=dataclasses.replace(Policy(transfer_timeout=10.0, fence_grace=5.0),
                                                   read_failure="recompute"))
    notices = handoff(rig, "r", toks)
    rig.store.evict([rank_key(block_keys(toks, 4)[9], k, 0, 0) for k in rig.spec.kinds])  # a window block
    deliver(rig, notices)
    rig.dd.run_until_idle()
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == 0
    rig.D.recompute_done("r")  # every block recomputed, window layers included
    rig.D.preempt("r")
    [wb] = [c for c in rig.D.poll_commands() if isinstance(c, C.WriteBlocks)]
    assert wb.keys[0] == block_keys(toks, 4)[0]  # so the write-back starts at block 0


@pytest.mark.parametrize("n_tokens, count, want", [(40, 1, 0), (40, 9, 0), (42, 9, 0), (42, 10, 40)])
def test_a_short_window_read_s_count_is_trusted_only_past_its_last_window(n_tokens, count, want):
    """D's read takes the window groups from block 8 (W = 2 blocks of 4 tokens). A short
    answer is continued from only if its blocks hold a whole window before the next token
    (42 tokens: blocks 8 and 9 cover tokens 34-39; 40 tokens: only all 10 blocks would);
    otherwise D recomputes from token 0, never past a block whose window layers were not read."""
    rig, _ = long_prompt_rig(policy=dataclasses.replace(Policy(transfer_timeout=10.0, fence_grace=5.0),
                                                        read_failure="recompute"))
    deliver(rig, handoff(rig, "r", list(range(300, 300 + n_tokens))))
    rig.dd.pump()
    [read] = [c for c in rig.D.pending_commands() if isinstance(c, C.ReadBlocks)]
    assert read.window_from == 8
    rig.dd.complete(read.command_id, 0, count)
    rig.dd.run_until_idle()
    [rc] = rig.notices(rig.dd, C.Recompute)
    assert rc.from_token == want


def sliding_rig(**kw):
    """A D whose every layer has a window of two blocks (Mistral's pattern), its 40-token prompt
    handed off and running."""
    spec = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=1,
                     groups=(G("window", (0, 1), window=WIN),))
    assert spec.frees_behind_window and not windowed().frees_behind_window
    rig, toks = Rig(tp=1, spec=spec, **kw), list(range(300, 340))
    deliver(rig, handoff(rig, "r", toks))
    rig.dd.run_until_idle()
    rig.notices(rig.dd)
    assert rig.D.state_of("r") == "running"
    return rig, toks


def test_a_request_frees_the_blocks_behind_the_window_as_it_decodes():
    rig, _ = sliding_rig()
    used, table = rig.D.pool.num_used, rig.D.blocks_of("r")
    assert len(table) == 11 and FREED not in table  # 40 tokens and the first: 11 blocks
    for i in range(8):  # the cache grows to 48 tokens: the next step attends to tokens 41..48
        rig.D.append_tokens("r", [i])
    now = rig.D.blocks_of("r")
    assert now[:10] == (FREED,) * 10 and FREED not in now[10:] and now[10] == table[10]
    assert rig.D.pool.num_used == used - 10 + 2  # ten behind the window freed, two new ones
    assert set(table[:10]) <= set(rig.D.pool.free_ids()) | set(now[11:])  # free, or taken again as it grew
    rig.D.finish("r")
    assert_clean(rig)


def test_a_request_with_freed_blocks_writes_back_its_window_and_reloads_it():
    rig, toks = sliding_rig(policy=dataclasses.replace(Policy(transfer_timeout=10.0, fence_grace=5.0),
                                                       preempt="write"))
    for i in range(8):
        rig.D.append_tokens("r", [i])
    rig.D.preempt("r")
    rig.dd.pump()
    [wb] = [c for c in rig.D.pending_commands() if isinstance(c, C.WriteBlocks)]
    assert FREED not in wb.block_ids and len(wb.keys) == 2  # the window's whole blocks only
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "preempted"
    rig.D.resume("r")
    rig.dd.pump()
    [read] = [c for c in rig.D.pending_commands() if isinstance(c, C.ReadBlocks)]
    assert read.window_from == 10
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running"
    rig.D.finish("r")
    assert_clean(rig)


def test_window_groups_are_refused_layer_wise():
    for make in (lambda: PrefillLifecycle(windowed(), 8, layerwise=True),
                 lambda: DecodeLifecycle(windowed(), 8, layerwise=True)):
        with pytest.raises(ConfigError, match="layer-wise transfers are not built for it"):
            make()
    with pytest.raises(KVStateError, match="moves no layer-wise transfer"):
        ReferenceBackend(windowed(), 16, MemoryStore(1 << 20)).read(0, ["k"], [0], arrived=lambda n, e: None)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_write_back_from_host_memory_stores_each_group_s_own_layers(tp):
    """Interleaved groups (Gemma 3's twelve layers: full at 5 and 11) are stored group by group;
    the host tier holds a block's layers in their own order, so a write-back from it must
    reorder them as a write from the GPU does."""
    spec = gemma_like(num_layers=12, window=WIN, tp_size=tp, total_kv_heads=2 * tp)
    assert spec.storage_order != tuple(range(12))
    store = MemoryStore(1 << 24)
    p, d = ReferenceBackend(spec, 8, store, host_blocks=4), ReferenceBackend(spec, 8, store)
    rng = np.random.default_rng(7)
    for r in range(tp):
        for kind in spec.kinds:
            for arr in p.caches[r][kind]:
                arr[...] = rng.standard_normal(arr.shape).astype(arr.dtype)
        assert p.swap_out(r, [3], [1]) == 1
        assert p.flush_host(r, ["from-host"], [1]) == 1
        assert d.read(r, ["from-host"], [6]) == 1
        assert all(d.block_bytes(r, k, 6) == p.block_bytes(r, k, 3) for k in spec.kinds)


def test_each_decode_step_frees_exactly_the_blocks_its_next_step_no_longer_attends():
    rig, toks = sliding_rig()
    n = len(toks) + 1  # the prompt and the first token
    for i in range(12):
        rig.D.append_tokens("r", [i])
        n += 1
        behind = max(0, n - 1 - WIN) // 4  # the next step attends to the last WIN tokens before it
        table = rig.D.blocks_of("r")
        assert table[:behind] == (FREED,) * behind and FREED not in table[behind:], (n, table)


def test_blocks_the_gpu_prefix_cache_gave_whole_are_written_back_whole():
    rig, _ = long_prompt_rig(prefix_cache=True)
    short = list(range(300, 308))  # 2 whole blocks, inside the window: read whole, then cached
    deliver(rig, handoff(rig, "s", short))
    rig.dd.run_until_idle()
    rig.D.finish("s")
    longer = short + list(range(400, 408))  # its window starts at block 2: where the cache's hits end
    deliver(rig, handoff(rig, "r", longer))
    rig.dd.run_until_idle()
    assert rig.D.state_of("r") == "running" and rig.D.counters["gpu_read_blocks"] == 2
    rig.D.preempt("r")
    [wb] = [c for c in rig.D.poll_commands() if isinstance(c, C.WriteBlocks)]
    assert list(wb.keys) == block_keys(longer, 4)  # blocks 0 and 1 hold every layer: written too


def test_a_read_is_continued_from_every_block_or_a_prefix_whose_last_window_came():
    spec = windowed(tp_size=1)  # a window of 2 blocks
    assert spec.resume_blocks(3, 3, 2, 3) == 3  # every block read: continue after them all
    assert spec.resume_blocks(1, 1, 0, 5) == 1  # no block lacks its window layers: the prefix read
    assert spec.resume_blocks(4, 4, 2, 9) == 4 and spec.resume_blocks(3, 3, 2, 9) == 0  # its last window came, or not

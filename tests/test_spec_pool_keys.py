import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import BlockError, BlockPool, CacheSpec, ConfigError, OutOfBlocksError, ValidationError
from kvstate._keys import block_keys, rank_key


# -- CacheSpec ---------------------------------------------------------------------------------
def test_spec_sizes_bf16_with_v():
    s = CacheSpec(num_layers=32, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16", extra_layers=1)
    assert s.layers == 33
    assert s.kinds == ("key", "value")
    assert s.chunk_bytes() == 8 * 64 * 128 * 2 == 128 * 1024
    assert s.block_bytes("key") == 33 * 128 * 1024
    assert s.bytes_per_block_per_rank == 2 * 33 * 128 * 1024
    assert s.blocks_for(65) == 2 and s.blocks_for(64) == 1


def test_spec_mla_and_fp8_scales():
    s = CacheSpec(num_layers=2, kv_heads=1, block_size=16, head_dim=576, dtype="uint8", has_value=False,
                  fp8_scales=True, tp_size=4)
    assert s.kinds == ("key", "key_scale")
    assert s.chunk_bytes("key") == 16 * 576
    assert s.chunk_bytes("key_scale") == 16 * 4  # one float32 per (head, token)
    assert s.bytes_per_block == 4 * s.bytes_per_block_per_rank


@pytest.mark.parametrize("kw", [dict(dtype="float32"), dict(num_layers=0), dict(block_size=-1),
                                dict(tp_size=0), dict(extra_layers=-1), dict(fp8_scales=True),
                                dict(head_dim=1.5)])
def test_spec_rejects(kw):
    args = dict(num_layers=2, kv_heads=1, block_size=4, head_dim=8)
    args.update(kw)
    with pytest.raises(ConfigError):
        CacheSpec(**args)


# -- BlockPool ---------------------------------------------------------------------------------
def test_pool_allocate_zero_gives_nothing():
    p = BlockPool(4)
    assert p.allocate(0) == [] and p.num_free == 4


def test_pool_allocate_free_roundtrip_and_stats():
    p = BlockPool(8)
    a = p.allocate(3)
    assert sorted(a) == [0, 1, 2] and p.num_free == 5
    b = p.allocate(5)
    assert set(a).isdisjoint(b)
    with pytest.raises(OutOfBlocksError):
        p.allocate(1)
    assert p.free(a) == 3
    st = p.stats()
    assert (st.total, st.free, st.used, st.peak_used) == (8, 3, 5, 8)


def test_pool_double_free_names_block_and_changes_nothing():
    p = BlockPool(4)
    a = p.allocate(2)
    p.free([a[0]])
    before = p.stats()
    with pytest.raises(BlockError, match=f"block {a[0]} is free"):
        p.free([a[1], a[0]])  # the valid id a[1] must not be freed either
    assert p.stats() == before and p.refcount(a[1]) == 1


@pytest.mark.parametrize("ids,msg", [([9], "out of range"), ([-1], "out of range"), ([0, 0], "twice"),
                                     (["x"], "not an int"), ([True], "not an int")])
def test_pool_rejects_bad_ids(ids, msg):
    p = BlockPool(4)
    p.allocate(4)
    with pytest.raises(BlockError, match=msg):
        p.free(ids)
    assert p.num_free == 0


def test_pool_sharing_refcounts():
    p = BlockPool(4)
    a = p.allocate(2)
    p.share(a)
    assert p.stats().shared == 2
    assert p.free(a) == 0 and p.num_free == 2  # still held once
    assert p.free(a) == 2 and p.num_free == 4
    with pytest.raises(BlockError):
        p.share(a)  # free blocks cannot be shared


def test_pool_headroom():
    p = BlockPool(10)
    assert p.can_allocate(6, headroom=4) and not p.can_allocate(7, headroom=4)
    with pytest.raises(OutOfBlocksError):
        p.allocate(7, headroom=4)
    assert p.num_free == 10
    with pytest.raises(ValidationError):
        p.can_allocate(-1)


# -- storage keys --------------------------------------------------------------------------------
def test_keys_chain_and_partial_suffix():
    toks = list(range(10))
    keys = block_keys(toks, 4)
    assert len(keys) == 3
    assert keys[2].endswith(":partial:2") and ":partial:" not in keys[0]
    assert block_keys(toks[:8], 4) == keys[:2]  # full blocks do not depend on what follows
    changed = block_keys([99] + toks[1:], 4)
    assert all(a != b for a, b in zip(keys, changed))  # an early change propagates down the chain


def test_keys_never_mutate_and_extra_keys_change_hash():
    toks = [1, 2, 3, 4, 5]
    copy = list(toks)
    k1 = block_keys(toks, 4)
    k2 = block_keys(toks, 4, extra_keys={0: ["image-abc"]})
    assert toks == copy
    assert k1[0] != k2[0] and k1[1] != k2[1]
    assert block_keys(toks, 4, namespace="llama3").__getitem__(0).startswith("llama3/")
    with pytest.raises(ValidationError):
        block_keys(toks, 4, extra_keys={5: ["x"]})


def _chain(toks, bs, seed):
    """The documented derivation, written independently of kvstate._keys."""
    import hashlib
    import struct
    prev, out = seed, []
    for i in range(0, len(toks), bs):
        block = toks[i:i + bs]
        key = hashlib.sha256(prev + struct.pack(f"<{len(block)}I", *block)).hexdigest()
        key = key if len(block) == bs else f"{key}:partial:{len(block)}"
        out.append(key)
        prev = key.encode()
    return out


def test_keys_follow_the_documented_derivation():
    """The key format is a storage format (pools outlive processes): sha256 over the previous
    key's hex (the namespace for the first block) and the block's token ids as little-endian
    uint32, in hex; the partial block carries its token count."""
    toks = [5, 2**32 - 1, 0, 31999, 1, 2, 3]
    assert block_keys(toks, 4) == _chain(toks, 4, b"")
    assert block_keys(tuple(toks), 4) == _chain(toks, 4, b"")  # any sequence, same keys
    assert block_keys(toks, 4, namespace="m") == [f"m/{k}" for k in _chain(toks, 4, b"m")]


def test_keys_stable_across_processes():
    code = "from kvstate._keys import block_keys; print(block_keys(list(range(37)), 16)[-1])"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1 and block_keys(list(range(37)), 16)[-1] + "\n" in outs


@pytest.mark.parametrize("toks", [[1.5], ["a"], [-3], "abc", [2**32], [2**64]])
def test_keys_reject_bad_tokens(toks):
    with pytest.raises(ValidationError):
        block_keys(toks, 4)


@settings(max_examples=150, deadline=None)
@given(base=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       asks=st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(0, 3), max_size=9)), min_size=1, max_size=8),
       block=st.sampled_from([1, 3, 4]), namespace=st.sampled_from(["", "m"]), size=st.sampled_from([1, 2, 64]))
def test_a_key_cache_reuses_shared_prefixes_exactly(base, asks, block, namespace, size):
    """Prompts cut from one base at any point, then going their own way: every key equals the
    computed one, whatever the cache kept, and it keeps at most ``size`` prompts."""
    from array import array

    from kvstate._keys import KeyCache, keys_of_packed
    cache = KeyCache(size)
    for cut, tail in asks:
        toks = base[:cut] + tail or [7]
        assert keys_of_packed(array("I", toks), block, None, namespace, cache) == \
            block_keys(toks, block, namespace=namespace)
        assert len(cache) <= size


def test_a_key_cache_hashes_only_what_a_recent_prompt_did_not_share():
    from array import array

    from kvstate._keys import KeyCache, keys_of_packed
    cache, base = KeyCache(), list(range(32))  # 8 blocks of 4
    keys_of_packed(array("I", base), 4, None, "m", cache)
    other = base[:26] + [99, 98]  # blocks 0..5 shared; block 6 differs inside
    assert keys_of_packed(array("I", other), 4, None, "m", cache) == block_keys(other, 4, namespace="m")
    assert cache.reused == 6 and cache.misses == 2 and cache.hits == 0
    assert keys_of_packed(array("I", [5] + base[1:]), 4, None, "m", cache) == \
        block_keys([5] + base[1:], 4, namespace="m")  # another first block: nothing to take
    assert cache.reused == 6


def test_rank_key():
    assert rank_key("abc", "value", 3) == "abc_value_3"


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=40), min_size=1, max_size=8),
       block=st.sampled_from([1, 3, 4]), namespace=st.sampled_from(["", "m"]))
def test_a_key_cache_changes_no_key(prompts, block, namespace):
    """Kept keys equal computed ones; a prompt asked for twice in a row is not hashed again."""
    from array import array

    from kvstate._keys import KeyCache, keys_of_packed
    cache = KeyCache()
    for toks in prompts:
        packed = array("I", toks)
        want = block_keys(toks, block, namespace=namespace)
        for _ in range(2):  # asked twice in a row (P and D of one request)
            got = keys_of_packed(packed, block, None, namespace, cache)
            assert got == want
            got.append("x")  # the caller owns its list: the kept copy is untouched
        assert keys_of_packed(packed, block + 1, None, namespace, cache) == block_keys(toks, block + 1,
                                                                                        namespace=namespace)
    assert cache.hits >= len(prompts)  # at least every second ask of a prompt
    assert cache.hits + cache.misses == 3 * len(prompts)

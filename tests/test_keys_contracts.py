"""Contracts of keys, ids and tokens that the mutation run found unchecked (docs/benchmarks.md,
"Mutation testing"): the key format with extra keys, a key cache's exact reuse, the bounds of
token ids, the memory of ended requests, and the refusals' wording."""
from __future__ import annotations

import re
from array import array

import numpy as np
import pytest
from rigs import Clock, small_spec

from kvstate import ConfigError, DecodeLifecycle, KVStateError, Policy, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate._keys import KeyCache, block_keys, keys_of_packed, rank_key
from kvstate._registry import ENDED_MEMORY
from kvstate._validate import check_int, is_int


def test_keys_with_extra_keys_keep_their_stored_format():
    """Stored objects outlive processes and releases: these keys must never change."""
    keys = block_keys(list(range(10)), 4, extra_keys={0: ["img"], 2: ["a", "b"]}, namespace="ns")
    assert keys == ["ns/ff4886ebb4183e793c7bc00d2a022d6e90b4b721e53adf6ca89d3b2185b8935c",
                    "ns/671854df23628de134f8b9618c920c78777a2d83099d048671e9b8abfd488318",
                    "ns/752fa33ecc43fef0f1b222addd946caf8472bfff3b14bb81bb6ff1b554b443ef:partial:2"]


def test_a_key_cache_reuses_exactly_the_blocks_a_kept_prompt_shares():
    base = list(range(32))  # 8 blocks of 4
    for j in range(1, 8):  # a prompt that parts from the base inside block j
        cache = KeyCache(4)
        keys_of_packed(array("I", base), 4, None, "", cache)
        other = base[:4 * j + 1] + [999] + base[4 * j + 2:]
        assert keys_of_packed(array("I", other), 4, None, "", cache) == block_keys(other, 4)
        assert cache.reused == j
        keys_of_packed(array("I", base + [5]), 4, None, "", cache)
        assert cache.reused == 2 * j  # the latest kept prompt of that first block: the other's j again


def test_a_key_cache_hands_out_the_kept_prompts_own_key_objects_for_the_shared_blocks():
    """Shared blocks' keys are the very strings of the prompt that was kept, namespace and all:
    a store's sets and dicts then find them by identity, with their hashes already cached."""
    cache = KeyCache(4)
    base = list(range(32))
    first = keys_of_packed(array("I", base + [1]), 4, None, "ns", cache)
    other = keys_of_packed(array("I", base[:20] + [999] * 12), 4, None, "ns", cache)
    assert other == block_keys(base[:20] + [999] * 12, 4, namespace="ns")
    assert all(a is b for a, b in zip(first[:5], other[:5]))  # the 5 shared blocks
    assert not any(a is b for a, b in zip(first[5:], other[5:]))


def test_a_key_cache_keeps_a_prompt_hashed_again_without_evicting_another():
    cache = KeyCache(2)
    a, b = list(range(8)), list(range(100, 108))
    for toks in (a, b, b[:4] + [1, 2, 3, 4]):  # the third shares b's first block: b's entry is replaced
        keys_of_packed(array("I", toks), 4, None, "", cache)
    keys_of_packed(array("I", a + [9, 9, 9, 9]), 4, None, "", cache)
    assert cache.reused == 1 + 2  # b's first block, then a's two: a was kept


@pytest.mark.parametrize("call, message", [
    (lambda: block_keys([1, 2], 0), r"^block_keys: block_size must be an int > 0 and <= 1048576, got 0$"),
    (lambda: KeyCache(0), r"^KeyCache: size must be an int > 0 and <= 1048576, got 0$"),
    (lambda: block_keys([1, 2], 4, extra_keys=["x"]), r"^block_keys: extra_keys must map block indices"),
    (lambda: block_keys(list(range(8)), 4, extra_keys={2: ["x"]}), r"block 2, outside 0\.\.1$"),
    (lambda: rank_key("k", "", 0), r"^rank_key: key and kind must be non-empty str"),
])
def test_bad_key_arguments_are_refused_naming_the_rule(call, message):
    with pytest.raises(ValidationError, match=message):
        call()


def test_token_ids_are_any_int_in_0_to_2_32_minus_1():
    p = PrefillLifecycle(small_spec(1), 64, clock=Clock())
    for i, token in enumerate((0, np.int64(0), np.uint32(5), 2**32 - 1)):
        p.admit(f"s{i}", [1, 2])  # no whole block: nothing to look up, prefilling at once
        assert p.prefill_done(f"s{i}", token) is True
    p.admit("t", [1, 2])
    for bad in (2**32, -1):
        with pytest.raises(ValidationError, match=rf"^request 't': token {bad} is not an int in 0\.\.2\*\*32-1$"):
            p.prefill_done("t", bad)


def test_ended_requests_are_remembered_up_to_the_memory_and_no_further():
    d = DecodeLifecycle(small_spec(1), 8, clock=Clock())
    for i in range(ENDED_MEMORY + 1):
        d.reserve(f"r{i}", [1])
        d.abort(f"r{i}")
    d.poll_commands()
    assert d.abort("r1") is False  # remembered: a late abort is dropped
    with pytest.raises(KVStateError, match=r"^request 'r0' is unknown on the decode side$"):
        d.abort("r0")  # the oldest was forgotten
    with pytest.raises(ValidationError, match=r"^request id must be a str, got int 5$"):
        d.state_of(5)


def test_an_unknown_prefill_error_ends_the_request_as_prefill_failed():
    d = DecodeLifecycle(small_spec(1), 8, clock=Clock())
    d.reserve("r", [1, 2, 3])
    d.deliver_first_token("r", None, 500)
    [ended] = [c for c in d.poll_commands() if isinstance(c, C.RequestEnded)]
    assert (ended.error_code, ended.reason) == (500, "prefill_failed")


@pytest.mark.parametrize("fields, message", [
    ({"read_failure": "x"}, "Policy.read_failure must be 'fail' or 'recompute', got 'x'"),
    ({"preempt": "x"}, "Policy.preempt must be one of ('write', 'recompute', 'swap'), got 'x'"),
    ({"swap_write": "x"}, "Policy.swap_write must be one of ('host', 'through', 'back'), got 'x'"),
    ({"swap_fallback": "x"}, "Policy.swap_fallback must be one of ('write', 'recompute'), got 'x'"),
    ({"write_retries": -1}, "Policy.write_retries must be an int >= 0 and <= 1000, got -1"),
    ({"decode_headroom_blocks": -1}, "Policy.decode_headroom_blocks must be an int >= 0 and <= 2147483648, got -1"),
])
def test_a_bad_policy_is_refused_word_for_word(fields, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Policy(**fields)


def test_token_lists_ids_and_numbers_are_checked_by_what_they_hold():
    class Rid(str):
        """An engine's own id type."""

    p = PrefillLifecycle(small_spec(1), 64, clock=Clock())
    for i, toks in enumerate(([1, 2], (1, 2), array("I", [1, 2]))):
        p.admit(f"r{i}", toks)
    p.admit(Rid("mine"), [1, 2])
    bools = r"^request 'b': token ids must be ints in 0\.\.2\*\*32-1, not bools \(index 1: True\)$"
    for bad, message in (([1, True], bools),
                         ({1: 2}, r"^request 'b': token_ids must be a sequence of ints$"),
                         ([], r"^request 'b': token_ids is empty$"),
                         ("ab", r"^request 'b': token_ids must be a sequence of ints$")):
        with pytest.raises(ValidationError, match=message):
            p.admit("b", bad)
    with pytest.raises(ValidationError, match=r"^request id must be a non-empty str, got ''$"):
        p.admit("", [1])
    with pytest.raises(ValidationError, match="^token ids must be a sequence of ints, not a string$"):
        block_keys("abc", 4)
    assert not is_int(np.float64(3)) and is_int(np.int64(3))
    with pytest.raises(ValidationError, match=r"^n must be an int <= 5, got 'x'$"):
        check_int("x", "n", maximum=5)

"""Every refusal of a cache spec, a layer group and a P/D pair, word for word (the mutation run
found their wording, bounds and hints unchecked): an error must name the field, the value and
the rule, so an operator can fix a configuration from the message alone."""
from __future__ import annotations

import re

import pytest

from kvstate import CacheSpec, ConfigError, ValidationError
from kvstate._spec import LayerGroup as G
from kvstate._spec import check_pair

BASE = {"num_layers": 4, "kv_heads": 2, "block_size": 4, "head_dim": 8, "dtype": "float16", "tp_size": 1}


@pytest.mark.parametrize("fields, message", [
    ({"extra_layers": -1}, "CacheSpec.extra_layers must be an int >= 0 and <= 1048576, got -1"),
    ({"extra_layers": 1 << 21}, "CacheSpec.extra_layers must be an int >= 0 and <= 1048576, got 2097152"),
    ({"num_layers": 0}, "CacheSpec.num_layers must be an int > 0 and <= 1048576, got 0"),
    ({"store_heads": -1}, "CacheSpec.store_heads must be an int >= 0 and <= 1048576, got -1"),
    ({"total_kv_heads": 1 << 21}, "CacheSpec.total_kv_heads must be an int >= 0 and <= 1048576, got 2097152"),
    ({"layer_groups": 3}, "CacheSpec.layer_groups 3 must divide the 4 layers"),
    ({"dtype": "int4"}, "CacheSpec.dtype 'int4' is unknown; use one of ['bfloat16', 'float16', 'uint8']"),
    ({"fp8_scales": 1}, "CacheSpec.fp8_scales and has_value must be bools, got 1 and True"),
    ({"has_value": 1}, "CacheSpec.fp8_scales and has_value must be bools, got False and 1"),
    ({"fp8_scales": True}, "CacheSpec.fp8_scales needs dtype 'uint8' (an fp8 cache)"),
    ({"layer_groups": 2, "groups": (G("window", (0, 1), window=8), G("full", (2, 3)))},
     "CacheSpec: window groups are stored group by group: layer_groups must be 1"),
    ({"total_kv_heads": 3, "tp_size": 2}, "CacheSpec: 3 KV heads over TP 2 give 1.5 a rank, not kv_heads 2"),
    ({"total_kv_heads": 2, "tp_size": 4},
     "CacheSpec: 2 KV heads over TP 4 replicate one head a rank, so kv_heads must be 1 (got 2) and TP a multiple of 2"),
    ({"total_kv_heads": 2, "tp_size": 3, "kv_heads": 1},
     "CacheSpec: 2 KV heads over TP 3 replicate one head a rank, so kv_heads must be 1 (got 1) and TP a multiple of 2"),
    ({"store_heads": 3}, "CacheSpec.store_heads 3 must divide the rank's 2 KV heads"),
    ({"groups": [G("full", (0, 1, 2, 3))]}, "CacheSpec.groups must be a tuple of LayerGroup, got [LayerGroup(kind="
     "'full', layers=(0, 1, 2, 3), window=0, state_bytes=0, checkpoint=0)]"),
    ({"groups": (G("full", (0, 1, 2)), G("window", (2, 3), window=8))},
     "CacheSpec.groups: layer 2 is in a full group and a window group"),
    ({"groups": (G("full", (0, 1)),)}, "CacheSpec.groups do not add up to the cache's 4 layers: missing [2, 3]"),
    ({"groups": (G("full", (0, 1, 2, 3, 4, 5)),)},
     "CacheSpec.groups do not add up to the cache's 4 layers: beyond it [4, 5]"),
    ({"groups": (G("full", tuple(range(1, 14))),)},
     "CacheSpec.groups do not add up to the cache's 4 layers: missing [0] beyond it [4, 5, 6, 7, 8, 9, 10, 11]"),
    ({"groups": (G("full", (0, 1)), G("window", (2, 3), window=6))}, "CacheSpec.groups: a window of 6 tokens is not a "
     "multiple of the block size 4 (blocks are read and freed whole)"),
    ({"groups": (G("full", (0, 1)), G("state", (2, 3), state_bytes=8, checkpoint=6))}, "CacheSpec.groups: a state "
     "checkpoint every 6 tokens is not a multiple of the block size 4 (a state is stored with the block ending there)"),
    ({"kv_heads": 1, "total_kv_heads": 1, "has_value": False, "groups": (G("latent", (0, 1)), G("full", (2, 3)))},
     "CacheSpec.groups: latent (MLA) layers and head-split attention layers in one model are not a layout kvstate "
     "stores"),
    ({"groups": (G("latent", (0, 1, 2, 3)),)}, "CacheSpec.groups: a latent group needs the latent layout: kv_heads = "
     "total_kv_heads = 1 (one head, replicated on every rank) and has_value = False"),
    ({"num_layers": 12, "groups": (G("full", (0,)),)},
     "CacheSpec.groups do not add up to the cache's 12 layers: missing [1, 2, 3, 4, 5, 6, 7, 8]"),
    ({"kv_heads": 1, "total_kv_heads": 1, "has_value": False, "groups": (G("latent", (0, 1)), G("window", (2, 3),
     window=8))}, "CacheSpec.groups: latent (MLA) layers and head-split attention layers in one model are not a "
     "layout kvstate stores"),
    ({"kv_heads": 1, "total_kv_heads": 1, "groups": (G("latent", (0, 1, 2, 3)),)}, "CacheSpec.groups: a latent "
     "group needs the latent layout: kv_heads = total_kv_heads = 1 (one head, replicated on every rank) and "
     "has_value = False"),
    ({"total_kv_heads": 2, "tp_size": 2}, "CacheSpec: 2 KV heads over TP 2 give 1 a rank, not kv_heads 2"),
    ({"groups": (G("state", (0, 1, 2, 3), state_bytes=8, checkpoint=4),)},
     "CacheSpec.groups: every layer is a state layer: there is no paged cache to describe"),
])
def test_a_bad_spec_is_refused_word_for_word(fields, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        CacheSpec(**{**BASE, **fields})


@pytest.mark.parametrize("fields, message", [
    ({"kind": "x", "layers": (0,)}, "LayerGroup: kind 'x' is not one of ('full', 'window', 'latent', 'state')"),
    ({"kind": "full", "layers": ()}, "LayerGroup full: layers must be a non-empty tuple of layer indices, got ()"),
    ({"kind": "full", "layers": (-1,)}, "LayerGroup full: layer index must be an int >= 0 and <= 1048576, got -1"),
    ({"kind": "full", "layers": (1 << 21,)},
     "LayerGroup full: layer index must be an int >= 0 and <= 1048576, got 2097152"),
    ({"kind": "full", "layers": (1, 1)}, "LayerGroup full: layer indices repeat: (1, 1)"),
    ({"kind": "window", "layers": (0,)}, "LayerGroup window: window must be an int > 0 and <= 1048576, got 0"),
    ({"kind": "full", "layers": (0,), "window": 4}, "LayerGroup full: window must be an int >= 0 and <= 0, got 4"),
    ({"kind": "state", "layers": (0,), "state_bytes": 1 << 31, "checkpoint": 4},
     "LayerGroup state: state_bytes must be an int > 0 and <= 1073741824, got 2147483648"),
    ({"kind": "state", "layers": (0,), "state_bytes": 8, "checkpoint": 1 << 21},
     "LayerGroup state: checkpoint must be an int > 0 and <= 1048576, got 2097152"),
])
def test_a_bad_layer_group_is_refused_word_for_word(fields, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        G(**fields)


@pytest.mark.parametrize("p, d, message", [
    (BASE, {**BASE, "block_size": 8}, "P (TP 1) and D (TP 1) disagree on block_size: 4 != 8: keys chain over a "
     "block's tokens, so P and D use one block size"),
    (BASE, {**BASE, "tp_size": 2, "kv_heads": 1, "total_kv_heads": 2}, "P (TP 1) and D (TP 2) disagree on "
     "object_heads: 2 != 1: set store_heads to 1 on both (kvstate._spec.paired)"),
    (BASE, {**BASE, "head_dim": 16}, "P (TP 1) and D (TP 1) disagree on head_dim: 8 != 16"),
])
def test_a_p_and_d_that_would_store_different_objects_are_refused_naming_the_field(p, d, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        check_pair(CacheSpec(**p), CacheSpec(**d))
    with pytest.raises(ConfigError, match="^check_pair: P's and D's specs must be CacheSpecs$"):
        check_pair(CacheSpec(**p), p)


def test_a_spec_s_own_checks_and_conversions_name_their_rule():
    spec = CacheSpec(**BASE, groups=(G("full", (0, 1)), G("state", (2, 3), state_bytes=8, checkpoint=4)))
    paged = spec.paged()
    assert paged.groups == () and paged.num_layers == 2  # full layers only: the single-kind spec
    assert spec.block_bytes() == spec.block_bytes("key") > 0
    moved = ("X: state layer groups (Mamba, linear attention) are moved by the lifecycles and the reference "
             "backend; X does not move states")
    with pytest.raises(ConfigError, match=f"^{re.escape(moved)}$"):
        spec.check_moved("X")
    spec.check_num_states("X", 4)  # state pages for a spec with state groups
    with pytest.raises(ConfigError, match=r"^X: num_states 0 with 16 state bytes a rank: a spec with state groups"):
        spec.check_num_states("X", 0)
    with pytest.raises(ValidationError, match=r"^Y: num_states 2 with 0 state bytes a rank"):
        spec.paged().check_num_states("Y", 2, ValidationError)
    assert spec.read_bytes_per_rank(0) == 16 and spec.read_bytes_per_rank(1 << 40) > 0  # the states alone, then
    for bad in (-1, (1 << 40) + 1):
        with pytest.raises(ValidationError, match=rf"^CacheSpec\.read_bytes_per_rank: num_tokens must be an int >= 0 "
                                                  rf"and <= 1099511627776, got {bad}$"):
            spec.read_bytes_per_rank(bad)
    with pytest.raises(ConfigError, match="^CacheSpec.from_dict: expected a dict of fields, got str$"):
        CacheSpec.from_dict("x")
    with pytest.raises(ConfigError, match="^CacheSpec.from_dict: .*unexpected keyword argument 'bogus'$"):
        CacheSpec.from_dict({"bogus": 1})
    assert CacheSpec.from_dict({**BASE, "groups": spec.groups}) == spec  # groups given as LayerGroups
    assert CacheSpec.from_dict(dict(BASE)) == CacheSpec(**BASE)  # no groups: the single-kind spec


def test_a_window_starts_at_block_0_while_the_cache_is_shorter_than_it():
    from kvstate._layers import window_start

    assert window_start(8, 5, 1) == 0 and window_start(8, 12, 1) == 4 and window_start(8, 12, 4) == 1

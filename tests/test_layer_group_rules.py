"""A layer group's own rules and the partition and kind rules of a spec's groups
(``kvstate/_layers.py``), each refusal matched word for word, each bound at its edge."""
from __future__ import annotations

import pytest

from kvstate import ConfigError, LayerGroup
from kvstate._layers import MAX_STATE_BYTES, check_groups, window_start
from kvstate._validate import MAX_DIM


def refusal(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        LayerGroup(**kw)
    return str(e.value)


def test_layer_indices_are_ints_from_zero_to_the_dimension_cap():
    assert LayerGroup("full", (0, MAX_DIM)).layers == (0, MAX_DIM)
    bound = f"must be an int >= 0 and <= {MAX_DIM}"
    assert refusal(kind="full", layers=(-1,)) == f"LayerGroup full: layer index {bound}, got -1"
    assert refusal(kind="full", layers=(MAX_DIM + 1,)) == f"LayerGroup full: layer index {bound}, got {MAX_DIM + 1}"


def test_a_kind_sets_its_own_fields_from_one_and_leaves_the_others_zero():
    assert LayerGroup("window", (0,), window=1).window == 1
    assert LayerGroup("state", (0,), state_bytes=1, checkpoint=1).checkpoint == 1
    assert refusal(kind="window", layers=(0,), window=0) == \
        f"LayerGroup window: window must be an int > 0 and <= {MAX_DIM}, got 0"
    assert refusal(kind="full", layers=(0,), window=1) == "LayerGroup full: window must be an int >= 0 and <= 0, got 1"
    assert refusal(kind="window", layers=(0,), window=16, checkpoint=1) == \
        "LayerGroup window: checkpoint must be an int >= 0 and <= 0, got 1"


def test_a_state_may_be_larger_than_a_dimension_but_a_window_may_not():
    big = MAX_DIM + 1
    assert big < MAX_STATE_BYTES
    assert LayerGroup("state", (0,), state_bytes=MAX_STATE_BYTES, checkpoint=16).state_bytes == MAX_STATE_BYTES
    assert refusal(kind="state", layers=(0,), state_bytes=MAX_STATE_BYTES + 1, checkpoint=16) == \
        f"LayerGroup state: state_bytes must be an int > 0 and <= {MAX_STATE_BYTES}, got {MAX_STATE_BYTES + 1}"
    assert refusal(kind="window", layers=(0,), window=big) == \
        f"LayerGroup window: window must be an int > 0 and <= {MAX_DIM}, got {big}"
    assert refusal(kind="state", layers=(0,), state_bytes=1, checkpoint=big) == \
        f"LayerGroup state: checkpoint must be an int > 0 and <= {MAX_DIM}, got {big}"


def partition(groups, layers=4) -> str:
    with pytest.raises(ConfigError) as e:
        check_groups(groups, layers, 16, latent_layout=False)
    return str(e.value)


def test_groups_that_do_not_add_up_name_what_is_missing_and_what_is_beyond():
    head = "CacheSpec.groups do not add up to the cache's 4 layers: "
    assert partition((LayerGroup("full", (0, 1)),)) == head + "missing [2, 3]"
    assert partition((LayerGroup("full", (0, 1, 2, 3, 4)),)) == head + "beyond it [4]"
    assert partition((LayerGroup("full", (0, 1, 2, 4)),)) == head + "missing [3] beyond it [4]"
    many = partition((LayerGroup("full", (0,)),), layers=12)
    assert many == "CacheSpec.groups do not add up to the cache's 12 layers: missing [1, 2, 3, 4, 5, 6, 7, 8]"
    beyond = partition((LayerGroup("full", tuple(range(14))),))
    assert beyond.endswith("beyond it [4, 5, 6, 7, 8, 9, 10, 11]")


def kinds(groups, latent_layout=False) -> str:
    with pytest.raises(ConfigError) as e:
        check_groups(groups, 2, 16, latent_layout=latent_layout)
    return str(e.value)


@pytest.mark.parametrize("other", [LayerGroup("full", (1,)), LayerGroup("window", (1,), window=16)])
def test_latent_layers_stand_alone_in_the_latent_layout(other):
    assert kinds((LayerGroup("latent", (0,)), other), latent_layout=True) == (
        "CacheSpec.groups: latent (MLA) layers and head-split attention layers in one model are not a "
        "layout kvstate stores")
    assert kinds((LayerGroup("latent", (0, 1)),)) == (
        "CacheSpec.groups: a latent group needs the latent layout: kv_heads = total_kv_heads = 1 (one head, "
        "replicated on every rank) and has_value = False")
    check_groups((LayerGroup("latent", (0, 1)),), 2, 16, latent_layout=True)  # alone, in its layout


def test_a_cache_of_state_layers_only_has_nothing_paged():
    assert kinds((LayerGroup("state", (0, 1), state_bytes=8, checkpoint=16),)) == (
        "CacheSpec.groups: every layer is a state layer: there is no paged cache to describe")


def test_a_window_starts_in_the_block_of_its_first_token_and_never_before_block_zero():
    assert window_start(8, 5, 1) == 0  # fewer tokens than the window: from the start
    assert window_start(8, 8, 1) == 0
    assert window_start(8, 11, 1) == 3
    assert window_start(32, 100, 16) == 4  # token 68 is in block 4

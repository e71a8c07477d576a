"""One meaning per name across the library and the simulator, converted in one place."""
from __future__ import annotations

import dataclasses

import pytest

from kvstate import CacheSpec, ConfigError, Policy
from kvstate._spec import check_pair
from kvstate.sim._scenario import Scenario
from kvstate.sim._scenario_io import scenario_from_dict


def test_the_scenario_s_policy_is_the_library_s_policy():
    """One declaration: [policy] is the lifecycles' Policy, every knob documented once."""
    assert Scenario().policy == Policy() and Scenario().library()[1] == Policy()
    assert all(f.metadata.get("doc") for f in dataclasses.fields(Policy))
    sc = scenario_from_dict({"policy": {"transfer_timeout": 5.0, "preempt": "recompute"}})
    assert sc.policy == Policy(transfer_timeout=5.0, preempt="recompute")
    with pytest.raises(ConfigError, match=r"\[policy\].*it is now transfer_timeout"):
        scenario_from_dict({"policy": {"transfer_timeout" + "_s": 5.0}})  # the name before it was the library's
    with pytest.raises(ConfigError, match=r"\[policy\] Policy.transfer_timeout must be a finite number > 0"):
        scenario_from_dict({"policy": {"transfer_timeout": -1.0}})


@pytest.mark.parametrize("policy", [Policy(), Policy(read_failure="recompute", preempt="swap", swap_write="back",
                                                      fence_grace=7.5, swapped_timeout=3.0, write_retries=0,
                                                      read_prefix=False, decode_headroom_blocks=4)])
@pytest.mark.parametrize("spec", [
    CacheSpec(num_layers=32, kv_heads=8, block_size=64, head_dim=128),
    CacheSpec(num_layers=80, kv_heads=1, block_size=16, head_dim=128, tp_size=8, dtype="uint8"),
    CacheSpec(num_layers=40, kv_heads=4, block_size=32, head_dim=64, tp_size=2, total_kv_heads=8),
])
def test_a_library_configuration_becomes_a_scenario_and_back(spec, policy):
    sc = Scenario.from_library(spec, policy, host_blocks=64)
    back, back_policy = sc.library()
    check_pair(spec, back)  # the same stored objects
    assert (back.kv_heads, back.tp_size, back_policy, sc.cluster.host_blocks) == (spec.kv_heads, spec.tp_size,
                                                                                    policy, 64)
    assert sc.model.total_kv_heads == spec.heads_total and sc.cluster.tp == spec.tp_size


@pytest.mark.parametrize("change, needle", [
    ({"fp8_scales": True, "dtype": "uint8"}, "fp8_scales"), ({"extra_layers": 1}, "extra_layers"),
    ({"has_value": False}, "has_value"), ({"store_heads": 2}, "store_heads"),
])
def test_geometry_a_scenario_does_not_model_is_refused(change, needle):
    spec = CacheSpec(**{"num_layers": 4, "kv_heads": 4, "block_size": 16, "head_dim": 64, **change})
    with pytest.raises(ConfigError, match=needle):
        Scenario.from_library(spec, Policy())


def test_replicated_heads_become_a_scenario_and_back():
    """Fewer KV heads than ranks (each replicated, as vLLM serves them) are a scenario too."""
    spec = CacheSpec(num_layers=4, kv_heads=1, block_size=16, head_dim=64, tp_size=8, total_kv_heads=2)
    back = Scenario.from_library(spec, Policy()).cache_spec()
    assert (back.kv_heads, back.heads_total, back.replicas, back.tp_size) == (1, 2, 4, 8)


def test_the_model_s_heads_are_named_as_the_library_names_them():
    """``[model] kv_heads`` (which meant the model's heads, and ``CacheSpec.kv_heads`` a rank's)
    is refused, naming its new name."""
    with pytest.raises(ConfigError, match="it is now total_kv_heads"):
        scenario_from_dict({"model": {"kv_heads": 8}})
    sc = scenario_from_dict({"model": {"total_kv_heads": 8}, "cluster": {"tp": 2}})
    assert sc.cache_spec().kv_heads == 4 and sc.cache_spec().heads_total == 8


def test_from_library_refuses_what_is_not_a_spec_and_a_policy():
    with pytest.raises(ConfigError, match="CacheSpec and a Policy"):
        Scenario.from_library({"num_layers": 2}, Policy())
    with pytest.raises(ConfigError, match="CacheSpec and a Policy"):
        Scenario.from_library(Scenario().cache_spec(), "fail")  # type: ignore[arg-type]


def test_every_command_has_one_kind_and_every_driver_declares_the_driver_protocol():
    from kvstate import commands as C
    from kvstate._errors import ValidationError
    from kvstate.backends import Driver, StepDriver, ThreadedDriver
    from kvstate.distributed import ProcessDriver

    classes = [getattr(C, n) for n in C.__all__ if isinstance(getattr(C, n), type)]
    concrete = [c for c in classes if c not in (C.Command, C.TransferCommand)]
    assert set(C.KINDS) == set(concrete)  # one table names every command, no other
    assert {c for c in concrete if C.KINDS[c] in C.TRANSFER_KINDS} == \
        {c for c in concrete if issubclass(c, C.TransferCommand)}
    assert set(C.KINDS.values()) == {"read", "write", "swap", "lend", "arm", "layers", "cancel", "notice"}

    class Late(C.LateEvent):  # a subclass keeps its parent's kind
        pass
    assert C.kind_of(Late("r", "abort", "done")) == "notice"
    with pytest.raises(ValidationError, match="not a kvstate command"):
        C.kind_of(object())  # type: ignore[arg-type]
    for cls in (StepDriver, ThreadedDriver, ProcessDriver):
        assert Driver in cls.__mro__, cls

"""A rank worker's configuration, field by field: every refusal word for word, each bound
taken at its edge, and the JSON it crosses a process boundary as."""
from __future__ import annotations

import pytest
from workerfields import worker_fields

from kvstate import ConfigError
from kvstate._layers import LayerGroup
from kvstate._spec import CacheSpec
from kvstate.distributed._rankworker import WorkerConfig

STATES = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="float16", tp_size=2,
                   groups=(LayerGroup("full", (0,)), LayerGroup("state", (1,), state_bytes=64, checkpoint=4)))
STORES = "['arena', 'file', 'mooncake'] (a store other processes reach too)"


@pytest.mark.parametrize("kw, message", [
    (dict(spec="x"), "WorkerConfig.spec must be a dict of CacheSpec fields"),
    (dict(rank=-1), "WorkerConfig.rank must be an int >= 0, got -1"),
    (dict(rank=2), "WorkerConfig.rank 2 is outside the spec's 2 TP ranks"),
    (dict(rank=True), "WorkerConfig.rank must be an int >= 0, got True"),
    (dict(num_blocks=0), "WorkerConfig.num_blocks must be an int > 0 and <= 2147483648, got 0"),
    (dict(num_blocks=2**31 + 1), "WorkerConfig.num_blocks must be an int > 0 and <= 2147483648, got 2147483649"),
    (dict(host_blocks=-1), "WorkerConfig.host_blocks must be an int >= 0 and <= 2147483648, got -1"),
    (dict(lanes=0), "WorkerConfig.lanes must be an int > 0 and <= 256, got 0"),
    (dict(lanes=257), "WorkerConfig.lanes must be an int > 0 and <= 256, got 257"),
    (dict(device=-1), "WorkerConfig.device must be an int >= 0 and <= 1023, got -1"),
    (dict(device=1024), "WorkerConfig.device must be an int >= 0 and <= 1023, got 1024"),
    (dict(parent_pid=2**31), "WorkerConfig.parent_pid must be an int >= 0 and <= 2147483647, got 2147483648"),
    (dict(num_states=1), "WorkerConfig: num_states 1 with 0 state bytes a rank: a spec with state groups needs "
                         "state pages, one without has none"),
    (dict(command_address="http://x"), "WorkerConfig.command_address must be a tcp://, ipc:// or inproc:// address, "
                                       "got 'http://x'"),
    (dict(reply_address=5), "WorkerConfig.reply_address must be a tcp://, ipc:// or inproc:// address, got 5"),
    (dict(control_address="TCP://a:1"), "WorkerConfig.control_address must be a tcp://, ipc:// or inproc:// "
                                        "address, got 'TCP://a:1'"),
    (dict(heartbeat_s=0), "WorkerConfig.heartbeat_s must be in (0, 60], got 0"),
    (dict(heartbeat_s=60.5), "WorkerConfig.heartbeat_s must be in (0, 60], got 60.5"),
    (dict(heartbeat_s="1"), "WorkerConfig.heartbeat_s must be in (0, 60], got '1'"),
    (dict(backend="cpu"), "WorkerConfig.backend must be 'reference' or 'cuda', got 'cpu'"),
    (dict(store={"kind": "memory"}), f"WorkerConfig.store must be a dict whose kind is one of {STORES}, "
                                     "got {'kind': 'memory'}"),
    (dict(store="x"), f"WorkerConfig.store must be a dict whose kind is one of {STORES}, got 'x'"),
    (dict(caches={"kind": "gpu"}), "WorkerConfig.caches must be a dict whose kind is one of ['own', 'shm', "
                                   "'cuda-ipc']"),
    (dict(caches=[]), "WorkerConfig.caches must be a dict whose kind is one of ['own', 'shm', 'cuda-ipc']"),
    (dict(caches={"kind": "cuda-ipc"}), "WorkerConfig: the 'reference' backend holds 'own' or 'shm' caches, "
                                        "not 'cuda-ipc'"),
    (dict(caches={"kind": "shm", "paths": {}}, backend="cuda"), "WorkerConfig: the 'cuda' backend holds 'own' or "
                                                                "'cuda-ipc' caches, not 'shm'"),
    (dict(curve_key="a" * 41), "WorkerConfig.curve_key must be the driver's Z85 CURVE key (40 characters) or '', "
                               f"got '{'a' * 41}'"),
    (dict(curve_key=5), "WorkerConfig.curve_key must be the driver's Z85 CURVE key (40 characters) or '', got 5"),
    (dict(secret=5), "WorkerConfig.secret must be a str (the driver's per-start secret)"),
    (dict(lends="relative"), "WorkerConfig.lends must be an absolute directory path or \"\", got 'relative'"),
    (dict(pulls=3), "WorkerConfig.pulls must be an absolute directory path or \"\", got 3"),
    (dict(pull_wait=-0.1), "WorkerConfig.pull_wait must be seconds in [0, 600], got -0.1"),
    (dict(pull_wait=600.5), "WorkerConfig.pull_wait must be seconds in [0, 600], got 600.5"),
    (dict(pull_wait=None), "WorkerConfig.pull_wait must be seconds in [0, 600], got None"),
])
def test_every_field_is_refused_word_for_word(kw, message):
    with pytest.raises(ConfigError) as e:
        WorkerConfig(**worker_fields(**kw))
    assert str(e.value) == message


def test_a_spec_that_is_no_spec_is_refused_with_the_spec_s_own_reason():
    with pytest.raises(ConfigError) as e:
        WorkerConfig(**worker_fields(spec={"num_layers": 0}))
    assert str(e.value).startswith("WorkerConfig.spec: CacheSpec.from_dict: ") and e.value.__cause__ is None


@pytest.mark.parametrize("kw", [
    dict(rank=0), dict(num_blocks=1), dict(num_blocks=2**31), dict(host_blocks=2**31), dict(lanes=1), dict(lanes=256),
    dict(device=1023), dict(parent_pid=0), dict(parent_pid=2**31 - 1), dict(heartbeat_s=60), dict(heartbeat_s=1e-3),
    dict(pull_wait=0), dict(pull_wait=600), dict(backend="cuda"), dict(curve_key="a" * 40), dict(secret=""),
    dict(command_address="tcp://127.0.0.1:1", reply_address="inproc://r", control_address="ipc:///x"),
    dict(store={"kind": "arena", "path": "/dev/shm/a"}), dict(store={"kind": "mooncake"}),
    dict(caches={"kind": "shm", "paths": {}}), dict(caches={"kind": "cuda-ipc"}, backend="cuda"),
    dict(caches={"kind": "own"}, backend="cuda"), dict(lends="/a", pulls="/b"),
])
def test_each_bound_is_taken_at_its_edge(kw):
    cfg = WorkerConfig(**worker_fields(**kw))
    assert all(getattr(cfg, k) == v for k, v in kw.items())
    assert WorkerConfig.from_json(cfg.to_json()).to_json() == cfg.to_json()  # across processes unchanged


def test_state_pages_go_with_a_state_spec_and_cuda_ipc_must_share_them():
    assert WorkerConfig(**worker_fields(STATES, num_states=2)).num_states == 2
    with pytest.raises(ConfigError) as e:
        WorkerConfig(**worker_fields(STATES, num_states=0))
    assert str(e.value) == ("WorkerConfig: num_states 0 with 64 state bytes a rank: a spec with state groups needs "
                            "state pages, one without has none")
    with pytest.raises(ConfigError) as e:
        WorkerConfig(**worker_fields(STATES, num_states=2, caches={"kind": "cuda-ipc"}, backend="cuda"))
    assert str(e.value) == ("WorkerConfig: CUDA IPC caches of a spec with state groups must share the state pages "
                            "too (share_caches(..., states=))")
    assert WorkerConfig(**worker_fields(STATES, num_states=2, caches={"kind": "cuda-ipc", "states": {}},
                                       backend="cuda")).num_states == 2
    assert WorkerConfig(**worker_fields(num_states=0, caches={"kind": "cuda-ipc"}, backend="cuda")).num_states == 0


def test_json_that_is_not_a_config_is_refused_as_such():
    for text in ("[1, 2]", '{"rank": 0}', "nope"):
        with pytest.raises(ConfigError, match="^a rank worker's configuration is not valid JSON of its fields"):
            WorkerConfig.from_json(text)

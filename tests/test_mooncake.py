"""The Mooncake store for real: a mooncake_master on loopback, real KV bytes, failures."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from needs import mooncake_missing
from rigs import Rig, small_spec
from test_lifecycle import TOKS, assert_clean, d_matches, deliver, handoff

from kvstate import ConfigError, Policy, StoreError, ValidationError, block_keys
from kvstate import commands as C

_MISSING = mooncake_missing()
pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    from kvstate.backends._mooncake_master import MooncakeMaster

    with MooncakeMaster(log_path=tmp_path_factory.mktemp("mc") / "master.log") as m:
        pid = m.proc.pid
        yield m
    assert m.proc is None  # stopped by its PID
    import os
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server process is gone, not just its launcher


def mstore(master, **kw):
    from kvstate.backends._mooncake import MooncakeStore

    kw.setdefault("global_segment_size", 64 << 20)
    kw.setdefault("staging_bytes", 8 << 20)
    return MooncakeStore(master.config(**kw))


def test_demo_roundtrip_two_ranks(master):
    from kvstate.app._demo import DemoConfig, run_demo

    s = run_demo(DemoConfig(requests=24, tp=2, store="custom", store_factory=lambda spec: mstore(master)))
    assert s["store"] == "MooncakeStore" and s["integrity_ok"] and s["leaked_blocks"] == 0
    assert s["bytes_moved"] > 0 and s["finished"] > 0


def test_exists_and_skip_already_stored(master):
    store = mstore(master)
    puts: list[int] = []
    orig = store.batch_put_from
    store.batch_put_from = lambda keys, bufs: (puts.append(len(keys)), orig(keys, bufs))[1]
    rig = Rig(tp=2, store=store)
    try:
        deliver(rig, handoff(rig, "a"))
        rig.dd.run_until_idle()
        [sd] = rig.notices(rig.dd, C.StartDecode)
        assert d_matches(rig, TOKS, sd.block_ids)
        rig.D.finish("a")
        written = sum(puts)
        assert written == 3 * 3 * 2  # 3 blocks x (key, value, manifest) on each of 2 ranks
        assert rig.pb.query(0, block_keys(TOKS, 4)) == 3  # every block found by an existence query
        deliver(rig, handoff(rig, "b"))  # same prompt: every block found, nothing written
        assert sum(puts) == written
        rig.dd.run_until_idle()
        rig.D.finish("b")
        assert_clean(rig)
    finally:
        store.close()


@pytest.fixture
def evicting_master(tmp_path):
    """A master of its own that evicts early and much (its default 95 % watermark mostly
    rejects puts for lack of space instead of evicting)."""
    from kvstate.backends._mooncake_master import MooncakeMaster

    with MooncakeMaster(log_path=tmp_path / "master.log",
                        extra_args=["--eviction_high_watermark_ratio=0.6", "--eviction_ratio=0.3"]) as m:
        yield m


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.slow
def test_full_pool_evicts_and_partial_read_runs_policy(evicting_master, policy):
    # A small pool (16 MiB, the smallest segment Mooncake accepts here): ~256 objects of 64 KiB.
    spec = small_spec(tp=1, num_layers=4, kv_heads=4, block_size=16, head_dim=128)
    store = mstore(evicting_master, global_segment_size=16 << 20)
    rig = Rig(tp=1, spec=spec, blocks=64, store=store,
              policy=Policy(read_failure=policy, write_retries=0, read_prefix=False))
    try:
        first = list(range(16 * 3))
        deliver(rig, handoff(rig, "first", first))
        assert rig.D.state_of("first") == "reading"
        rig.dd.pump()
        held = list(rig.dd.pending)  # hold the read back until the pool evicted its blocks
        from kvstate._keys import rank_key

        # Push other requests' cache through the 16 MiB pool in rounds of ~50 MiB until the
        # pool evicted an object of the held read (Mooncake evicts asynchronously, and an
        # existence probe refreshes what it asks about, so each round asks about one object
        # only, taking the read's six in turn: none is kept alive by the probes).
        objects = [rank_key(k, kind, 0) for k in block_keys(first, 16) for kind in ("key", "value")]
        n = 0
        for r in range(20):  # usually 2-4 rounds; on a loaded machine the eviction thread lags
            probe = [objects[r % len(objects)]]
            for _ in range(100):
                toks = [1000 + n] + list(range(16 * 4 - 1))
                rig.P.admit(f"fill{n}", toks)
                n += 1
                rig.pd.run_until_idle()
                for note in rig.notices(rig.pd, C.StartPrefill):
                    rig.P.prefill_done(note.request_id, 1)
                rig.pd.run_until_idle()
                rig.notices(rig.pd)
            time.sleep(0.5)
            if store.batch_is_exist(probe) == [0]:
                break
        assert store.batch_is_exist(probe) == [0], "the pool never evicted an object of the held read"
        counts = [rig.dd.complete(*key).count for key in held]  # the read runs now, comes back short
        assert min(counts) < 3
        notes = rig.notices(rig.dd)
        if policy == "fail":
            assert [(n.state, n.error_code) for n in notes if isinstance(n, C.RequestEnded)] == [("failed", 502)]
        else:  # recompute from the longest prefix that was read
            assert [n.from_token for n in notes if isinstance(n, C.Recompute)] == [16 * min(counts)]
            rig.D.recompute_done("first")
            rig.D.finish("first")
        rig.clock.advance(20)
        rig.D.tick()
        assert rig.D.live_requests() == [] and rig.D.pool.num_used == 0
    finally:
        store.close()


def _drive_to_end(rig, deadline_s=60.0):
    t0 = time.monotonic()
    while rig.P.live_requests() or rig.D.live_requests() or rig.pd.pending or rig.dd.pending:
        assert time.monotonic() - t0 < deadline_s, "hung"
        for drv in (rig.pd, rig.dd):
            drv.pump()
            for key in list(drv.pending):
                drv.complete(*key)
        for n in rig.notices(rig.pd):
            if isinstance(n, C.StartPrefill):
                rig.P.prefill_done(n.request_id, 1)
            elif isinstance(n, C.SendFirstToken) and n.request_id in rig.D.live_requests():
                rig.D.deliver_first_token(n.request_id, n.token, n.error_code)
        for n in rig.notices(rig.dd):
            if isinstance(n, C.StartDecode):
                rig.D.finish(n.request_id)
            elif isinstance(n, C.Recompute):
                rig.D.recompute_done(n.request_id)
        rig.clock.advance(1.0)
        rig.P.tick()
        rig.D.tick()


@pytest.mark.slow
def test_master_killed_mid_run_then_restarted(tmp_path):
    from kvstate.backends._mooncake_master import MooncakeMaster

    m = MooncakeMaster(log_path=tmp_path / "m.log").start()
    store = mstore(m)
    rig = Rig(tp=2, store=store, policy=Policy(read_failure="recompute", transfer_timeout=5.0))
    try:
        for i in range(6):
            rig.D.reserve(f"r{i}", [i] + TOKS)
            rig.P.admit(f"r{i}", [i] + TOKS)
        rig.pd.pump()
        m.kill()  # the master dies (SIGKILL) with every request in flight
        t0 = time.monotonic()
        _drive_to_end(rig)
        assert time.monotonic() - t0 < 30  # failed fast, nobody waited on a dead pool
        assert rig.P.live_requests() == [] and rig.D.live_requests() == []
        assert rig.P.pool.num_used == 0 and rig.D.pool.num_used == 0
        assert rig.D.counters["done"] + rig.D.counters["failed"] == 6
        assert rig.P.counters["failed"] == 6  # no write could land: first tokens carried 503
        # the master comes back on the same address: the same store re-joins, new requests succeed
        m2 = MooncakeMaster(rpc_port=m.rpc_port, http_port=m.http_port, log_path=tmp_path / "m2.log").start()
        try:
            time.sleep(store.LIVENESS_INTERVAL)
            deliver(rig, handoff(rig, "new"))
            rig.dd.run_until_idle()
            [sd] = rig.notices(rig.dd, C.StartDecode)
            assert d_matches(rig, TOKS, sd.block_ids) and store.reconnects == 1
        finally:
            store.close()
            m2.stop()
    finally:
        store.close()
        m.stop()


@pytest.mark.slow
def test_master_dies_with_a_crashed_owner():
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    code = (f"import os, sys; sys.path.insert(0, {root!r})\n"
            "from kvstate.backends._mooncake_master import MooncakeMaster\n"
            "m = MooncakeMaster().start(); print(m.proc.pid, flush=True); os._exit(1)  # a crash")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    import os
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    raise AssertionError("mooncake_master outlived its crashed owner")


# -- bad input: clear errors naming the setting ---------------------------------------------------
def test_unreachable_master_and_wrong_metadata(master):
    from kvstate.backends._mooncake import MooncakeConfig, MooncakeStore

    with pytest.raises(StoreError, match="master 127.0.0.1:1 is unreachable"):
        MooncakeStore(MooncakeConfig(master="127.0.0.1:1", metadata=master.metadata_url))
    with pytest.raises(StoreError, match="metadata server .* does not answer"):
        MooncakeStore(MooncakeConfig(master=master.address, metadata="http://127.0.0.1:1/metadata",
                                     connect_timeout=1.0))


@pytest.mark.parametrize("kw,msg", [
    (dict(master="nohost"), "HOST:PORT"),
    (dict(metadata="ftp://x"), "http://"),
    (dict(protocol="udp"), "protocol"),
    (dict(global_segment_size=1 << 50), "larger than this machine's memory"),
    (dict(staging_bytes=0), "staging_bytes"),
])
def test_config_rules(kw, msg):
    from kvstate.backends._mooncake import MooncakeConfig

    args = dict(master="127.0.0.1:50051", metadata="http://127.0.0.1:8080/metadata")
    args.update(kw)
    with pytest.raises(ConfigError, match=msg):
        MooncakeConfig(**args).validate()


def test_bad_keys_and_buffers(master):
    store = mstore(master, staging_bytes=1 << 20)
    try:
        with pytest.raises(ValidationError, match="over Mooncake's"):
            store.batch_put_from(["k" * 300], [b"x"])
        with pytest.raises(ValidationError, match="staging buffer"):
            store.batch_put_from(["big"], [np.zeros(2 << 20, np.uint8)])
        assert store.batch_is_exist(["big"]) == [0]
    finally:
        store.close()
    with pytest.raises(StoreError, match="closed"):
        store.batch_is_exist(["k"])


def test_a_batch_bigger_than_staging_moves_in_groups_byte_for_byte(master):
    """Five objects of 300-400 KiB through a 1 MiB staging buffer: several put and get groups,
    each placed back to back; a key never written reads as a miss in its group."""
    store = mstore(master, staging_bytes=1 << 20)
    rng = np.random.default_rng(11)
    objs = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(300 << 10, 400 << 10, 5)]
    keys = [f"grouped-{i}" for i in range(5)]
    try:
        assert store.batch_put_from(keys, objs) == [0] * 5
        outs = [np.zeros_like(o) for o in objs]
        got = store.batch_get_into(keys[:2] + ["grouped-never"] + keys[2:4], outs[:2] + [np.zeros(1000, np.uint8)]
                                   + outs[2:4])
        assert got[:2] == [o.nbytes for o in objs[:2]] and got[2] <= 0 and got[3:] == [o.nbytes for o in objs[2:4]]
        assert all(np.array_equal(a, b) for a, b in zip(outs[:4], objs[:4]))
    finally:
        store.close()


@pytest.mark.slow
def test_cli_start_master_demo(capsys):
    from kvstate.app._cli import main

    assert main(["demo", "--store", "mooncake", "--start-master", "--requests", "8", "--json"]) == 0
    import json

    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["integrity_ok"] and s["store"] == "MooncakeStore"
    assert main(["demo", "--store", "mooncake"]) == 2
    assert main(["demo", "--master", "127.0.0.1:1"]) == 2


@pytest.mark.slow
def test_a_healthy_mooncake_demo_keeps_the_librarys_logging_off_stderr(tmp_path):
    """A healthy run used to write ~100 lines of Mooncake's logging to stderr, an error line
    among them; now it goes to a log directory and the demo says where, in one line."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MC_LOG_DIR", "MC_LOG_LEVEL")}
    env["MC_LOG_DIR"] = str(tmp_path)  # asked for: the demo names this directory
    r = subprocess.run([sys.executable, "-m", "kvstate", "demo", "--store", "mooncake", "--start-master",
                        "--processes", "--requests", "12"], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    said = f"kvstate demo: Mooncake's own logging is in {tmp_path} (set MC_LOG_LEVEL to see it here)"
    assert r.stderr.strip() == said
    assert any(p.name.startswith("mooncake") for p in tmp_path.iterdir())  # the library's files are there


def test_registered_memory_moves_without_the_staging_copy(master):
    """Objects in memory the caller registered go straight to and from the pool (a batch of
    four 3 MiB objects through a 1 MiB staging buffer could not go through staging at all); a
    batch with one buffer outside it, or after it is unregistered, goes through staging."""
    store = mstore(master, staging_bytes=1 << 20)
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 12 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = [f"direct-{i}" for i in range(4)]
    parts = [src[i * (3 << 20):(i + 1) * (3 << 20)] for i in range(4)]
    try:
        assert store.register_memory(src) and store.register_memory(dst)
        assert store.batch_put_from(keys, parts) == [0] * 4 and store.direct_batches == 1
        got = store.batch_get_into(keys, [dst[i * (3 << 20):(i + 1) * (3 << 20)] for i in range(4)])
        assert got == [3 << 20] * 4 and store.direct_batches == 2 and np.array_equal(dst, src)
        assert store.batch_put_from(["small"], [src[:1000]]) == [0] and store.direct_batches == 3
        outside = np.zeros(1000, np.uint8)  # outside registered memory: the whole batch is staged
        assert store.batch_get_into(["small", "small"], [dst[:1000], outside]) == [1000, 1000]
        assert store.direct_batches == 3 and np.array_equal(outside, src[:1000])
        store.unregister_memory(dst)
        store.unregister_memory(outside)  # never registered: ignored
        dst[:1000] = 0
        assert store.batch_get_into(["small"], [dst[:1000]]) == [1000] and store.direct_batches == 3
        assert np.array_equal(dst[:1000], src[:1000])
        with pytest.raises(ValidationError, match="writable"):
            store.register_memory(bytes(10))
    finally:
        store.close()
    with pytest.raises(StoreError, match="closed"):
        store.register_memory(np.zeros(10, np.uint8))


@pytest.mark.slow
def test_a_restarted_master_gets_the_registered_memory_again(tmp_path):
    """The client re-joins a restarted master with its registered memory: batches from it are
    still direct, and byte-exact."""
    from kvstate.backends._mooncake_master import MooncakeMaster

    m = MooncakeMaster(log_path=tmp_path / "m.log").start()
    store = mstore(m)
    buf = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[:4 << 20].copy()
    try:
        assert store.register_memory(buf)
        m.kill()
        m = MooncakeMaster(rpc_port=m.rpc_port, http_port=m.http_port, log_path=tmp_path / "m2.log").start()
        time.sleep(store.LIVENESS_INTERVAL)
        assert store.batch_put_from(["again"], [buf[:1 << 20]]) == [0] and store.reconnects == 1
        out = buf[1 << 20:2 << 20]
        want = buf[:1 << 20].copy()
        assert store.batch_get_into(["again"], [out]) == [1 << 20] and store.direct_batches == 2
        assert np.array_equal(out, want)
    finally:
        store.close()
        m.stop()

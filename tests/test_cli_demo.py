"""``kvstate demo`` and ``kvstate diagram`` as a user runs them."""
import json
import subprocess
import sys

import pytest
from needs import gpu, gpu_missing

from kvstate import ConfigError
from kvstate.app._cli import main
from kvstate.app._demo import DemoConfig, run_demo


def test_demo_json_integrity_with_tp2_preemptions_and_aborts(capsys):
    assert main(["demo", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    for key in ("requests", "finished", "failed", "aborted", "leaked_blocks", "bytes_moved", "integrity_ok"):
        assert key in s
    assert s["integrity_ok"] is True and s["leaked_blocks"] == 0 and s["pending_commands"] == 0
    assert s["requests"] == 64 and s["tp"] == 2
    assert s["finished"] + s["failed"] + s["aborted"] == 64
    assert s["preemptions"] > 0 and s["aborted"] > 0 and s["prefix_blocks_read"] > 0
    # every request that did not finish, by its RequestEnded reason: here the planned aborts
    assert s["ended_by"] == {"aborted": s["aborted"]} and s["failed"] == 0
    assert s["bytes_moved"] > 0 and s["blocks_checked"] > 100


@pytest.mark.parametrize("seed,tp", [(1, 1), (2, 4)])
def test_demo_other_seeds_and_tp(seed, tp):
    s = run_demo(DemoConfig(requests=40, seed=seed, tp=tp))
    assert s["integrity_ok"] and s["leaked_blocks"] == 0


def test_demo_file_store(tmp_path):
    s = run_demo(DemoConfig(requests=16, store="file", store_dir=str(tmp_path)))
    assert s["integrity_ok"] and s["leaked_blocks"] == 0 and s["store"] == "FileStore"


def test_demo_detects_corruption(monkeypatch):
    from kvstate.backends import _reference as reference

    orig = reference.ReferenceBackend.read

    def corrupt(self, rank, keys, block_ids, guard=None):
        n = orig(self, rank, keys, block_ids, guard)
        if n:
            self.caches[rank]["key"][0][block_ids[0]].flat[0] += 1
        return n

    monkeypatch.setattr(reference.ReferenceBackend, "read", corrupt)
    s = run_demo(DemoConfig(requests=8))
    assert s["integrity_ok"] is False and s["blocks_mismatched"] > 0


def test_demo_human_summary(capsys):
    assert main(["demo", "--requests", "8"]) == 0
    out = capsys.readouterr().out
    assert "integrity: OK" in out and "leaked blocks 0" in out
    assert "aborted 2 (aborted 2)" in out  # a request that did not finish is named by its reason


@pytest.mark.parametrize("args", [["demo", "--requests", "0"], ["demo", "--tp", "x"], ["demo", "--store", "s3"],
                                  ["nope"], ["diagram", "--machine", "x"]])
def test_cli_rejects_bad_options(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2


def test_cli_file_store_needs_dir(capsys):
    assert main(["demo", "--store", "file"]) == 2
    assert "--store-dir" in capsys.readouterr().err


def test_diagram_from_machines(capsys):
    assert main(["diagram"]) == 0
    out = capsys.readouterr().out
    assert out.count("stateDiagram-v2") == 2 and "preempt_writing" in out and "reading_prefix" in out


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "kvstate", "demo", "--requests", "4", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["integrity_ok"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/dev/shm, PR_SET_PDEATHSIG)")
def test_demo_as_processes(capsys):
    """P and D as scheduler processes, each with a rank worker per TP rank, over a store in
    shared memory (an arena): every byte checked, nothing leaked, seven processes at TP 2."""
    assert main(["demo", "--processes", "--requests", "24", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["integrity_ok"] and s["leaked_blocks"] == 0 and s["pending_commands"] == 0
    assert s["processes"] == 7 and s["unfinished"] == 0 and s["finished"] + s["aborted"] + s["failed"] == 24
    assert s["schedulers_reported"] == ["decode", "prefill"] and s["store"] == "arena"
    assert sum(s["ended_by"].values()) == s["aborted"] + s["failed"]  # reasons cross from D's process
    # a healthy run: no store operation failed or found a block broken, no transfer expired
    assert s["store_broken"] == s["store_failed"] == s["expired_transfers"] == 0 and s["store_short"] >= 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/dev/shm, PR_SET_PDEATHSIG)")
@pytest.mark.parametrize("handoff, arm", [("direct", False), ("both", False),
                                          pytest.param("direct", True, marks=pytest.mark.slow)])
def test_demo_as_processes_with_the_direct_handoff(capsys, handoff, arm):
    """D's rank workers pull each cache from P's rank workers' shared caches (another
    process's memory), every byte checked; P's lends all end pulled. ``direct`` stores
    nothing, so P never finds a stored prefix; ``both`` stores the caches beside the lends.
    With ``--arm-reads`` D announces each read to its workers at reservation; the reference
    backend arms none (only the CUDA one can), and the reads run as before."""
    arms = ["--arm-reads"] if arm else []
    assert main(["demo", "--processes", "--handoff", handoff, *arms, "--requests", "24", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["integrity_ok"] and s["leaked_blocks"] == 0 and s["pending_commands"] == 0 and s["unfinished"] == 0
    assert s["failed"] == 0 and s["lends_unpulled"] == 0 and s["lends_pulled"] >= s["finished"] > 0
    assert (s["prefix_blocks_read"] > 0) == (handoff == "both")
    assert (s["reads_announced"] > 0) == arm and s["ranks_armed"] == s["ranks_fired"] == 0


@pytest.mark.parametrize("args, needle", [
    (["--processes", "--store", "memory"], "needs a store other processes reach"),
    (["--devices", "0,1"], "--devices goes with --processes --backend cuda"),
    (["--handoff", "direct"], "needs --processes"),
    (["--processes", "--arm-reads"], "--arm-reads arms direct pulls: it goes with --handoff direct or both"),
])
def test_demo_processes_bad_options(args, needle, capsys):
    assert main(["demo", *args]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "0,1,2", "0,x", "0+,1", "0+-1,1", "0,1024"])
def test_devices_must_be_two_gpu_indices(capsys, text):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--processes", "--backend", "cuda", "--devices", text])
    assert e.value.code == 2 and "expected two GPU indices P,D" in capsys.readouterr().err


@pytest.mark.parametrize("text, want", [("0,1", (0, 1)), ("0+1,1+0", ((0, 1), (1, 0))), ("1,0+1", (1, (0, 1))),
                                        ("3+3,2", ((3, 3), 2))])
def test_devices_name_a_gpu_a_role_or_one_a_rank(text, want):
    from kvstate.app._cli import _device_pair

    assert _device_pair(text) == want


@pytest.mark.parametrize("arm, handoff, ok", [(True, "direct", True), (True, "both", True), (False, "store", True),
                                              (True, "store", False), ("yes", "direct", False), (1, "direct", False)])
def test_a_demo_config_arms_reads_only_for_the_direct_handoff(arm, handoff, ok):
    from kvstate.app._demo import DemoConfig

    cfg = DemoConfig(arm_reads=arm, handoff=handoff)
    if ok:
        cfg.validate()
    else:
        with pytest.raises(ConfigError, match="--arm-reads arms direct pulls"):
            cfg.validate()


@pytest.mark.parametrize("argv, want", [([], False), (["--backend", "cuda"], False),
                                        (["--processes", "--handoff", "direct"], False),
                                        (["--processes", "--handoff", "direct", "--backend", "cuda"], True),
                                        (["--processes", "--handoff", "both", "--backend", "cuda", "--no-arm-reads"],
                                         False),
                                        (["--processes", "--handoff", "both", "--arm-reads"], True)])
def test_reads_are_armed_by_default_only_where_the_rank_workers_move_bytes_on_gpus(argv, want, monkeypatch):
    """The CUDA backend's rank workers compute nothing on their GPUs, where arming is safe:
    ``--arm-reads`` is their default with the direct handoff, and ``--no-arm-reads`` turns it off."""
    from kvstate.app import _cli
    from kvstate.kernels import _cuda_launch

    monkeypatch.setattr(_cuda_launch, "cuda_available", lambda: True)  # the choice, not the GPU, is tested
    args = _cli._parser().parse_args(["demo", *argv])
    _cli._check_demo(args)
    assert _cli._arms_reads(args) is want


@pytest.mark.parametrize("devices, ok", [((0, 1), True), (((0, 1), (1, 0)), True), (((0, 1), 1), True),
                                         (((0, 1, 0), 1), False), (((0,), 1), False), ((0, -1), False),
                                         ((True, 1), False), (((0, 1.0), 1), False), ([0, 1], False)])
def test_a_demo_config_takes_one_gpu_a_role_or_one_a_rank(devices, ok):
    from kvstate.app._demo import DemoConfig

    cfg = DemoConfig(tp=2, backend="cuda", devices=devices)
    if ok:
        cfg.validate()
    else:
        with pytest.raises(ConfigError, match="each a GPU index, or one a TP rank .2."):
            cfg.validate()


@pytest.mark.skipif(gpu_missing() is None, reason="checks the refusal where CuPy or a GPU is missing")
def test_the_gpu_demo_is_refused_without_a_gpu(capsys):
    assert main(["demo", "--processes", "--backend", "cuda"]) == 2
    assert "--backend cuda needs CuPy and a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@gpu()
@pytest.mark.parametrize("handoff", ["store", "direct"])
def test_demo_as_processes_on_gpus(capsys, handoff):
    """Each scheduler's caches on its GPU (P on 0, D on 1 where there is one), its rank workers
    attached through CUDA IPC; with the direct handoff D's workers pull from P's GPU."""
    assert main(["demo", "--processes", "--backend", "cuda", "--handoff", handoff, "--requests", "24",
                 "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["integrity_ok"] and s["leaked_blocks"] == 0 and s["pending_commands"] == 0 and s["unfinished"] == 0
    assert s["processes"] == 7 and s["finished"] > 0
    assert (s["lends_pulled"] >= s["finished"]) == (handoff == "direct")
    # a healthy run fails nothing: the only requests that do not finish are the planned aborts
    assert s["failed"] == 0 and s["ended_by"] == {"aborted": s["aborted"]}
    assert s["store_broken"] == s["store_failed"] == s["expired_transfers"] == 0


@pytest.mark.gpu
@gpu()
def test_demo_as_processes_with_a_rank_a_gpu(capsys):
    """TP 2 with each rank on its own GPU, P's and D's crossed (P's rank 0 and D's rank 1 on
    GPU 0): every rank worker attaches to its rank's caches on its GPU, and D's pull each rank
    from the other GPU."""
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    assert main(["demo", "--processes", "--backend", "cuda", "--tp", "2", "--devices", "0+1,1+0", "--handoff",
                 "direct", "--requests", "24", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["integrity_ok"] and s["leaked_blocks"] == 0 and s["pending_commands"] == 0 and s["unfinished"] == 0
    assert s["processes"] == 7 and s["lends_pulled"] >= s["finished"] > 0
    assert s["failed"] == 0 and s["ended_by"] == {"aborted": s["aborted"]}  # a cold start fails nothing


@pytest.mark.slow
def test_ctrl_c_on_the_process_demo_is_one_line_and_leaves_no_process():
    """Ctrl-C reaches every process of the terminal's group: the router says one line and stops
    its children; the schedulers and rank workers print nothing (they used to print a
    traceback each) and none outlives the demo."""
    import os
    import signal
    import time

    def as_in_a_terminal() -> None:  # a run started in the background (CI's) inherits SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    p = subprocess.Popen([sys.executable, "-m", "kvstate", "demo", "--processes", "--requests", "4000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=as_in_a_terminal)
    try:
        time.sleep(6)  # the schedulers and their rank workers are up and serving
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and err.strip() == "kvstate demo: interrupted", (err[-2000:], out[-1500:])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)  # any process of the group left?
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError("a process of the demo outlived it")


def test_demo_in_one_process_over_an_arena_and_the_file_store_as_processes(capsys, tmp_path):
    assert main(["demo", "--store", "arena", "--requests", "16", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["integrity_ok"] and s["leaked_blocks"] == 0
    assert main(["demo", "--processes", "--store", "file", "--store-dir", str(tmp_path), "--requests", "8",
                 "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["integrity_ok"] and s["store"] == "file" and s["unfinished"] == 0

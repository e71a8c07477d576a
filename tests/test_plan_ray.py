"""`kvstate plan --ray`: a sweep's configurations as tasks on a Ray cluster, the same rows as
local processes give. The test starts its own local Ray instance and stops it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvstate.app._cli import main

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'kvstate[ray]')")

PLAN = ["plan", "--quiet", "--num-prompts", "80", "--sweep", "cluster.n_decode=1,2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray instance owned by this test process: its GCS address."""
    import signal

    tmp = tmp_path_factory.mktemp("ray")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(tmp),
             configure_logging=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():  # Ray's driver handlers would outlive it in this process
            signal.signal(sig, handler)


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([sys.executable, "-m", "kvstate", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.slow
def test_ray_auto_without_a_cluster_starts_a_local_one_and_says_so(tmp_path):
    """No Ray runs on this machine: ``--ray auto`` starts one for the sweep (it ends with it)
    and says so in one line, instead of failing. It runs first: before this module's own
    cluster starts."""
    r = cli(*PLAN, "--ray", "auto", "--out", str(tmp_path / "p.json"))
    assert r.returncode in (0, 1, 4), r.stderr[-2000:]
    said = [line for line in r.stderr.splitlines() if line.startswith("kvstate plan:")]
    assert said == ["kvstate plan: no Ray cluster runs on this machine: started a local one for this sweep "
                    "(`ray start --head` starts one that outlives it)"], r.stderr[-2000:]
    assert len(json.loads((tmp_path / "p.json").read_text())["rows"]) == 2


@pytest.mark.slow
def test_a_sweep_on_ray_gives_the_rows_local_processes_give(cluster, tmp_path):
    on_ray, local = tmp_path / "ray.json", tmp_path / "local.json"
    r = cli(*PLAN, "--ray", cluster, "--out", str(on_ray))
    assert r.returncode in (0, 1, 4), r.stderr[-2000:]
    assert main([*PLAN, "--workers", "2", "--out", str(local)]) == r.returncode
    a, b = json.loads(on_ray.read_text()), json.loads(local.read_text())
    assert a == b and len(a["rows"]) == 2 and a["complete"] is True


@pytest.mark.parametrize("address,message", [("127.0.0.1:1", "cannot connect"), ("nowhere", "expected auto")])
def test_a_cluster_that_is_not_there_is_a_clear_error(tmp_path, address, message):
    r = cli(*PLAN, "--ray", address, "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and f"--ray {address}: {message}" in r.stderr, r.stderr[-1000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "p.json").exists()


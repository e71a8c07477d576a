"""The benchmark scripts run and report the keys the docs quote (no timing asserted here)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lifecycle_benchmark_json_keys():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lifecycle.py"), "--requests", "50",
                        "--repeats", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("requests_per_s", "us_per_request", "baseline_us_per_request", "bytes_per_request"):
        assert out[key] > 0


def test_every_benchmark_script_starts():
    """Each script's imports resolve and it answers --help (the GPU and Mooncake ones too,
    which need their hardware or server only once they run)."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert scripts
    for script in scripts:
        r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout, (script.name, r.stderr[-500:])

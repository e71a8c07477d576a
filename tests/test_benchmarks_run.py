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

"""Fuzzing ``kvstate.app._cli.main``: random argv over random files; only SystemExit may escape,
and every return is a documented exit status.

Simulations are cut to a few requests (a real, shortened run) and the demo to its argument
checks, so an example takes milliseconds; a Mooncake master is never started.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.app._cli import EXIT_CODES, main

FLAGS = ["--trace", "--model", "--rate", "--num-prompts", "--tp", "--n-prefill", "--n-decode", "--seed", "--set",
         "--quiet", "--json", "--sweep", "--attainment", "--workers", "--out", "--requests", "--store",
         "--store-dir", "--master", "--metadata", "--protocol", "--backend", "--concurrency", "--machine", "--list",
         "--help", "--version", "--bogus"]
COMMANDS = ["simulate", "plan", "scenario", "demo", "diagram", "nope"]
WORDS = ["1", "0", "-1", "2.5", "nan", "inf", "x", "", "cluster.tp=2", "cluster.n_decode=1,2", "slo.ttft_ms=5",
         "workload.rate=abc", "tp.skew_ms=[1,2]", "model.dtype=float99", "seed=3", "=", "llama-3-70b", "default",
         "file", "memory", "mooncake", "cuda", "decode", "127.0.0.1:1", "http://127.0.0.1:1/metadata"]

FILES = {
    "toml_ok": "[workload]\nnum_requests = 3\ninput_mean = 200.0\noutput_mean = 4.0\n",
    "toml_bad_value": "[cluster]\ntp = 'two'\n",
    "toml_unknown": "[nope]\nx = 1\n",
    "toml_broken": "[model\n",
    "empty": "",
    "json_config": json.dumps({"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
                               "num_key_value_heads": 2}),
    "json_garbage": "{not json",
    "trace_ok": "\n".join(json.dumps({"timestamp": 10 * i, "input_length": 100, "output_length": 2,
                                      "hash_ids": []}) for i in range(3)) + "\n",
    "trace_bad": '{"timestamp": -1}\n',
}


@pytest.fixture
def quick(monkeypatch):
    """Simulations of at most 3 requests; the demo stops after its own checks."""
    import kvstate.app._demo as demo
    import kvstate.sim._capacity as capacity
    import kvstate.sim._run as run
    from kvstate.sim._scenario_io import with_overrides

    real = run.simulate

    def small(s, progress=None, timeline=None):
        if s.workload.arrival != "trace":
            s = with_overrides(s, {"workload.num_requests": min(3, s.workload.num_requests)})
        return real(dataclasses.replace(s, time_limit_s=min(s.time_limit_s, 600.0)), progress, timeline)

    def demo_checks(cfg):
        cfg.validate()
        return {"integrity_ok": True, "leaked_blocks": 0, "requests": cfg.requests}
    monkeypatch.setattr(run, "simulate", small)
    monkeypatch.setattr(capacity, "simulate", small)
    monkeypatch.setattr(demo, "run_demo", demo_checks)
    monkeypatch.setattr(demo, "format_summary", lambda s: "demo ok")


@st.composite
def argvs(draw, paths):
    argv = [draw(st.sampled_from(COMMANDS))]
    if draw(st.booleans()):
        argv.append(draw(st.sampled_from(paths)))
    for _ in range(draw(st.integers(0, 5))):
        flag = draw(st.sampled_from(FLAGS))
        argv.append(flag)
        if draw(st.integers(0, 3)):
            argv.append(draw(st.sampled_from(WORDS + paths)))
    return argv


@settings(max_examples=int(os.environ.get("KVSTATE_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_argv_over_random_files_never_escapes(quick, tmp_path_factory, data, capsys):
    d = tmp_path_factory.mktemp("fuzz")
    paths = [str(d / "missing.toml"), str(d), str(d / "missing" / "out.json")]
    for name, text in FILES.items():
        f = d / f"{name}.{'jsonl' if name.startswith('trace') else 'json' if 'json' in name else 'toml'}"
        f.write_text(text)
        paths.append(str(f))
    raw = d / "random.bin"
    raw.write_bytes(data.draw(st.binary(max_size=64)))
    paths.append(str(raw))
    argv = data.draw(argvs(paths))
    if "--out" not in argv and argv[0] == "plan":
        argv += ["--out", str(d / "plan.json")]
    try:
        with contextlib.chdir(d):  # a relative --out lands in the example's own folder
            rc = main(argv)
    except SystemExit as e:  # argparse: usage errors (2), --help and --version (0)
        rc = e.code
    assert rc in EXIT_CODES, (argv, rc)
    out = capsys.readouterr()
    assert "Traceback" not in out.err, (argv, out.err)

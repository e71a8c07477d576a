"""``kvstate simulate``, ``plan`` and ``scenario`` as a serving engineer runs them."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvstate import __version__
from kvstate.app import _simcmds as simcmds
from kvstate.app._cli import EXIT_CODES, main
from kvstate.app._simcmds import Progress
from kvstate.sim import Scenario, load_scenario, with_overrides
from kvstate.sim._models import MODELS, model_from_hf_config
from kvstate.sim._presets import PRESETS, preset
from kvstate.sim._scenario_io import scenario_to_dict

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--num-prompts", "30", "--set", "workload.input_mean=300", "--set", "workload.output_mean=8",
         "--set", "workload.prefix_tokens=64"]


def one_line_error(capsys, needle: str) -> None:
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err


def no_simulation(monkeypatch) -> None:
    """Any simulation from here on fails the test: bad input must be caught before one runs."""
    def boom(*a, **k):
        raise AssertionError("a simulation ran before the bad input was reported")
    monkeypatch.setattr("kvstate.sim._run.simulate", boom)
    monkeypatch.setattr("kvstate.sim._capacity.simulate", boom)


# -- exit codes and bad input -----------------------------------------------------------------
def test_version_and_exit_codes_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code, meaning in EXIT_CODES.items():
        assert f"{code}  {meaning}" in out


@pytest.mark.parametrize("argv, needle", [
    (["simulate", "--seed", "-3"], "argument --seed: '-3' is not an integer >= 0"),
    (["simulate", "--rate", "0"], "argument --rate: '0' is not a number > 0"),
    (["simulate", "--rate", "nan"], "argument --rate: 'nan' is not a number > 0"),
    (["plan", "--sweep", "cluster.n_decode=1", "--sweep", "cluster.n_decode=2"], "cluster.n_decode is given twice"),
    (["plan", "--sweep", "cluster.nope=1,2"], "unknown scenario field 'cluster.nope'"),
    (["simulate", "--set", "cluster.tp"], "expected FIELD=VALUE"),
    (["simulate", "--set", "cluster.tp=3"], "KV heads neither split over 3 ranks"),
    (["simulate", "--model", "no-such-model"], "not a preset"),
    (["scenario", "no-such-preset"], "no scenario preset 'no-such-preset'"),
    (["demo", "--store-dir", "x"], "--store-dir goes with --store file"),
    (["simulate", "--rate", "1e-9"], "take 1,999,000,000,000 s, past the run's time limit of 36,000 s"),
    (["simulate", "--rate", "1e12"], "1e+12 req/s puts arrivals less than a microsecond apart"),
    (["simulate", "--mode", "colocated", "--n-prefill", "2"], "--n-prefill: a pd setting; this run's mode is co"),
    (["simulate", "--n-instances", "3"], "--n-instances: a colocated setting; this run's mode is pd"),
    (["plan", "--mode", "colocated", "--n-decode", "2", "--sweep", "cluster.tp=1,2"], "--n-decode: a pd setting"),
    (["plan", "--n-instances", "2", "--sweep", "cluster.tp=1,2"], "--n-instances: a colocated setting"),
    (["simulate", "--model", "llama-2-7b", "--set", "workload.input_max=8192"],
     "prompts of up to 8,192 tokens, longer than the model's context of 4,096 tokens"),
    (["simulate", "--trace", str(ROOT / "data" / "mooncake_synthetic_trace.jsonl"), "--num-prompts", "5000"],
     "5,000 requests, but " + str(ROOT / "data" / "mooncake_synthetic_trace.jsonl") + " holds 3,993"),
    (["simulate", "--trace", str(ROOT / "data" / "mooncake_synthetic_trace.jsonl"), "--model", "llama-2-7b"],
     "-token prompt, longer than the model's context of 4,096 tokens"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(argv, needle, capsys, monkeypatch):
    no_simulation(monkeypatch)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    assert rc == 2
    one_line_error(capsys, needle)


def test_output_paths_are_checked_before_any_simulation(tmp_path, capsys, monkeypatch):
    no_simulation(monkeypatch)
    missing = tmp_path / "missing" / "plan.json"
    assert main(["plan", "--sweep", "cluster.n_decode=1,2", "--out", str(missing)]) == 2
    one_line_error(capsys, "does not exist")
    assert main(["plan", "--sweep", "cluster.n_decode=1,2", "--out", str(tmp_path)]) == 2
    one_line_error(capsys, "is a directory")
    afile = tmp_path / "a.png"
    afile.write_text("")
    for cmd in (["simulate"], ["plan", "--sweep", "cluster.n_decode=1,2", "--out", str(tmp_path / "p.json")]):
        assert main([*cmd, "--plot", str(tmp_path / "missing" / "dir")]) == 2
        one_line_error(capsys, "does not exist")
        assert main([*cmd, "--plot", str(afile)]) == 2
        one_line_error(capsys, "is a file, not a directory")
    assert not (tmp_path / "missing").exists() and not (tmp_path / "p.json").exists()


def test_an_empty_scenario_file_is_an_error(tmp_path, capsys):
    f = tmp_path / "empty.toml"
    f.write_text("")
    assert main(["simulate", str(f)]) == 2
    one_line_error(capsys, "the scenario file is empty")


def test_demo_store_dir_must_exist_and_is_not_created(tmp_path, capsys):
    d = tmp_path / "store"
    assert main(["demo", "--store", "file", "--store-dir", str(d)]) == 2
    one_line_error(capsys, "no such directory")
    assert not d.exists()


def test_a_closed_pipe_ends_quietly():
    """``kvstate diagram | head -1``: the reader goes away after a line; no traceback."""
    r = subprocess.run(f"{sys.executable} -m kvstate diagram | head -1", shell=True, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.startswith("---") or r.stdout.strip(), r.stdout
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr


def test_a_broken_pipe_while_printing_exits_141(monkeypatch):
    class Gone(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return sys.__stdout__.fileno()
    monkeypatch.setattr(sys, "stdout", Gone())
    monkeypatch.setattr("os.dup2", lambda *a: None)  # keep the test runner's own stdout
    assert main(["diagram"]) == 141


# -- overrides ------------------------------------------------------------------------------------
def test_overrides_without_a_toml(capsys):
    assert main(["simulate", "--json", "--rate", "12.5", "--num-prompts", "20", "--tp", "4", "--n-prefill", "1",
                 "--n-decode", "3", "--model", "llama-3-70b", "--set", "slo.ttft_ms=250",
                 "--set", "tp.skew_ms=[0, 1, 0, 0]", "--set", "model.name=mine", "--seed", "5"]) == 0
    sc = json.loads(capsys.readouterr().out)["scenario"]
    assert sc["workload"]["rate"] == 12.5 and sc["workload"]["num_requests"] == 20
    assert (sc["cluster"]["tp"], sc["cluster"]["n_prefill"], sc["cluster"]["n_decode"]) == (4, 1, 3)
    assert sc["model"]["num_layers"] == 80 and sc["model"]["name"] == "mine"  # --set after --model
    assert sc["slo"]["ttft_ms"] == 250.0 and sc["tp"]["skew_ms"] == [0, 1, 0, 0] and sc["seed"] == 5


def test_model_from_a_hugging_face_config(tmp_path):
    cfg = {"_name_or_path": "meta-llama/Meta-Llama-3-8B", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_from_hf_config(tmp_path)
    assert (m.name, m.num_layers, m.total_kv_heads, m.head_dim, m.dtype) == ("Meta-Llama-3-8B", 32, 8, 128, "bfloat16")
    assert m.params_b == pytest.approx(MODELS["llama-3-8b"].params_b, rel=0.01)  # the published 8.03B
    (tmp_path / "moe.json").write_text(json.dumps({**cfg, "num_local_experts": 8, "num_experts_per_tok": 2}))
    moe = model_from_hf_config(tmp_path / "moe.json")  # Mixtral-style: experts as wide as the MLP
    assert (moe.experts, moe.experts_per_token, moe.moe_intermediate) == (8, 2, 14336)


def test_a_state_size_that_contradicts_the_model_s_config_is_refused(tmp_path, capsys, monkeypatch):
    """Qwen3-Next-like: 3 linear-attention layers to 1 full; its state's size is the config's."""
    cfg = {"model_type": "qwen3_next", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 4096, "vocab_size": 32000,
           "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2, "linear_num_key_heads": 4,
           "linear_key_head_dim": 64, "linear_num_value_heads": 8, "linear_value_head_dim": 64,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    no_simulation(monkeypatch)
    assert main(["simulate", "--model", str(tmp_path), "--set", "model.state_bytes=1000"]) == 2
    one_line_error(capsys, "--set model.state_bytes=1000: --model")
    assert main(["simulate", "--model", str(tmp_path), "--set", "model.state_layers=2"]) == 2
    one_line_error(capsys, "gives 6")


# -- kvstate scenario and the shipped examples ----------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_scenario_prints_commented_toml_that_loads_back(name, tmp_path, capsys):
    assert main(["scenario", name]) == 0
    text = capsys.readouterr().out
    assert text.count("\n# ") > 60  # every field under a comment
    f = tmp_path / "s.toml"
    f.write_text(text)
    back = scenario_to_dict(load_scenario(f))
    want = scenario_to_dict(preset(name))
    back.pop("source"), want.pop("source")
    assert back == want
    assert tomllib.loads(text)  # plain TOML


def test_examples_are_the_presets_as_printed(capsys):
    """examples/NAME.toml is `kvstate scenario NAME` verbatim: they cannot drift apart."""
    for name in PRESETS:
        assert main(["scenario", name]) == 0
        assert (ROOT / "examples" / f"{name}.toml").read_text() == capsys.readouterr().out, name


def test_the_trace_example_loads():
    s = load_scenario(ROOT / "examples" / "mooncake-trace.toml")
    assert s.workload.arrival == "trace" and Path(s.workload.trace).is_file()


# -- plan -------------------------------------------------------------------------------------------
def test_plan_marks_infeasible_configurations_with_a_reason_and_goes_on(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", *SMALL, "--sweep", "cluster.tp=1,3", "--sweep", "model.params_b=8.0,900.0",
               "--workers", "1", "--out", str(out), "--quiet"])
    res = json.loads(out.read_text())
    rows = {(r["config"]["cluster.tp"], r["config"]["model.params_b"]): r for r in res["rows"]}
    assert len(rows) == 4 and res["complete"] is True
    assert "neither split over 3 ranks" in rows[(3, 8.0)]["reason"]
    assert "do not fit" in rows[(1, 900.0)]["reason"]
    assert rows[(1, 8.0)]["feasible"] and rows[(1, 8.0)]["gpus"] == 4
    assert rc == {"meets": 0, "too short": 4}.get(rows[(1, 8.0)]["verdict"], 1)
    assert "infeasible" in capsys.readouterr().out


def test_plan_writes_each_row_as_it_comes(tmp_path):
    from kvstate.sim._capacity import plan
    seen = []

    def on_row(row, done, total):
        seen.append((done, total, row["config"]["cluster.n_decode"]))

    base = with_overrides(Scenario(), {"workload.num_requests": 20, "workload.input_mean": 300.0,
                                       "workload.output_mean": 8.0, "workload.prefix_tokens": 64})
    res = plan(base, {"cluster.n_decode": [1, 2, 3]}, workers=1, on_row=on_row)
    assert [s[:2] for s in seen] == [(1, 3), (2, 3), (3, 3)] and len(res["rows"]) == 3


def test_meeting_the_slos_needs_goodput_at_target_times_offered(tmp_path, capsys):
    """One P and one D at four times their capacity: attainment may be high among the few that
    finish early, but goodput falls far below the offered rate, so the SLOs are not met."""
    assert main(["simulate", "--json", "--rate", "200", "--num-prompts", "400", "--n-prefill", "1",
                 "--n-decode", "1", "--set", "slo.ttft_ms=100000", "--set", "slo.tpot_ms=1000"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["slo"]["ttft_attainment"] >= 0.9 and r["goodput_rps"] < 0.9 * r["offered_rps"]
    assert r["slo"]["meets"] is False and any("goodput" in u for u in r["slo"]["unmet"])


# -- the report -----------------------------------------------------------------------------------
def test_the_report_shows_what_the_json_holds_without_reprs(capsys):
    assert main(["simulate", *SMALL, "--quiet"]) == 0
    text = capsys.readouterr().out
    for word in ("TTFT", "TPOT", "ITL", "E2E", "mean", "p50", "p90", "p99", "tok/s", "offered", "steady",
                 "ended:", "compute", "batch slots", "blocks", "verdict"):
        assert word in text, word
    assert "{" not in text and "'" not in text and "[" not in text


def test_progress_shows_on_a_terminal_after_two_seconds_only():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty = Tty()
    p = Progress("simulate", stream=tty, after=0.0)
    p.update(5, 10)
    p.close()
    assert "simulate: 5/10 (50 %)" in tty.getvalue() and tty.getvalue().endswith("\n")
    for stream, quiet, after in ((io.StringIO(), False, 0.0), (Tty(), True, 0.0), (Tty(), False, 60.0)):
        p = Progress("simulate", quiet=quiet, stream=stream, after=after)
        p.update(5, 10)
        p.close()
        assert stream.getvalue() == ""


def test_build_scenario_applies_presets_and_files(tmp_path):
    import argparse
    args = argparse.Namespace(scenario="llama-3-70b-h200", trace=None, model=None, gpu=None, mode=None, rate=None,
                              num_prompts=None, tp=None, n_prefill=None, n_decode=None, n_instances=None, seed=None,
                              set=[])
    assert simcmds.build_scenario(args).cluster.tp == 4

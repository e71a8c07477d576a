"""Per-request timelines in the Chrome trace-event format: from the simulator (``simulate
--timeline``) and from a real run (a driver option), one schema, checked against the format."""
from __future__ import annotations

import json
import re
import time

import pytest
from rigs import small_spec

from kvstate import DecodeLifecycle, Policy, PrefillLifecycle
from kvstate import commands as C
from kvstate._errors import KVStateError
from kvstate._keys import block_keys
from kvstate._timeline import Timeline
from kvstate.app._cli import main
from kvstate.backends import MemoryStore, ReferenceBackend, ThreadedDriver
from kvstate.events import Completion
from kvstate.testing import fill_blocks

TIDS = re.compile(r"^(req \S+|rank \d+( #\d+)?|steps)$")


def check_nesting(events: list[dict]) -> None:
    """Complete events on one thread nest or follow each other: Perfetto drops one that starts
    inside another and ends after it (``slice_drop_overlapping_complete_event``)."""
    threads: dict[tuple[str, str], list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    for thread, spans in threads.items():
        open_ends: list[float] = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1], (thread, e)
            open_ends.append(end)


def check_trace(trace: dict) -> list[dict]:
    """The trace-event format (JSON object form) as Perfetto and chrome://tracing read it."""
    assert set(trace) == {"traceEvents", "displayTimeUnit"} and trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    assert events
    for e in events:
        assert isinstance(e["name"], str) and e["name"]
        assert e["ph"] in ("X", "i", "C")
        if e["ph"] == "C":  # a counter track: the process's, no thread
            assert isinstance(e["pid"], str) and isinstance(e["ts"], int) and e["ts"] >= 0
            assert all(isinstance(v, int) for v in e["args"].values())
            continue
        assert isinstance(e["pid"], str) and TIDS.match(e["tid"]), e
        assert isinstance(e["ts"], int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0
        else:
            assert e["s"] == "t"
        assert isinstance(e["args"], dict)
    check_nesting(events)
    json.dumps(trace)  # plain JSON
    return events


def ended(events: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in events:
        if e["ph"] == "i":
            out.setdefault(e["pid"][0], set()).add(e["tid"].split()[1])
    return out


def test_a_simulated_run_writes_every_request_s_life(tmp_path, capsys):
    path = tmp_path / "t.json"
    rc = main(["simulate", "--quiet", "--set", "workload.num_requests=40", "--timeline", str(path)])
    assert rc == 0
    events = check_trace(json.loads(path.read_text()))
    done = ended(events)
    assert len(done["P"]) == len(done["D"]) == 40  # every request ended on both sides
    names = {(e["pid"][0], e["name"]) for e in events if e["tid"].startswith("req")}
    assert ("P", "prefilling") in names and ("D", "running") in names
    assert {e["name"] for e in events if e["tid"].startswith("rank")} >= {"WriteBlocks", "ReadBlocks"}
    assert {e["name"] for e in events if e["tid"] == "steps"} >= {"prefill", "decode"}


def test_the_timeline_option_is_checked_before_the_run(tmp_path, capsys):
    assert main(["simulate", "--quiet", "--timeline", str(tmp_path / "no" / "t.json")]) == 2
    assert "--timeline" in capsys.readouterr().err
    assert main(["simulate", "--quiet", "--set", "cluster.mode=colocated", "--set", "workload.num_requests=10",
                 "--timeline", str(tmp_path / "t.json")]) == 2


def serve(P, D, pdrv, ddrv, pb, spec, prompts, tl) -> dict[str, str]:
    """A loop as an engine runs one: both sides' commands to their drivers, states noted."""
    outcome: dict[str, str] = {}
    for rid, toks in prompts.items():
        D.reserve(rid, toks)
        P.admit(rid, toks)
    deadline = time.monotonic() + 20
    while len(outcome) < len(prompts) and time.monotonic() < deadline:
        for name, lc, drv in (("P0", P, pdrv), ("D0", D, ddrv)):
            for n in drv.submit_all(lc.poll_commands()):
                if isinstance(n, C.StartPrefill):
                    keys = block_keys(prompts[n.request_id], spec.block_size)
                    fill_blocks(pb, keys, list(n.block_ids), n.num_cached_tokens // spec.block_size)
                    P.prefill_done(n.request_id, 5)
                elif isinstance(n, C.SendFirstToken):
                    D.deliver_first_token(n.request_id, n.token, n.error_code)
                elif isinstance(n, C.StartDecode):
                    D.finish(n.request_id)
                elif isinstance(n, C.RequestEnded) and lc is D:
                    outcome[n.request_id] = n.state
            for c in drv.poll():
                lc.complete(c)
            tl.states(name, lc)
        time.sleep(0.001)
    return outcome


def test_a_real_run_records_the_same_schema():
    spec = small_spec(tp=2)
    store = MemoryStore(1 << 24)
    P, D = PrefillLifecycle(spec, 64, Policy()), DecodeLifecycle(spec, 64, Policy())
    pb, db = ReferenceBackend(spec, 64, store), ReferenceBackend(spec, 64, store)
    tl = Timeline()
    prompts = {f"r{i}": [(3 * i + j) % 11 for j in range(6 + 2 * i)] for i in range(6)}
    with ThreadedDriver(pb, 2, name="P0", timeline=tl) as pdrv, ThreadedDriver(db, 2, name="D0", timeline=tl) as ddrv:
        outcome = serve(P, D, pdrv, ddrv, pb, spec, prompts, tl)
    assert outcome == dict.fromkeys(prompts, "done")
    events = check_trace(tl.to_json())
    done = ended(events)
    assert done["P"] == done["D"] == set(prompts)
    ranks = [e for e in events if e["tid"].startswith("rank")]
    assert {e["name"] for e in ranks} >= {"WriteBlocks", "ReadBlocks"}
    assert all(e["args"]["request"] in prompts and e["args"]["error"] is None for e in ranks)


def test_a_driver_takes_only_a_timeline():
    with pytest.raises(KVStateError, match="Timeline"):
        ThreadedDriver(ReferenceBackend(small_spec(1), 4, MemoryStore(1 << 20)), 1, timeline=object())


def part(cls: type, cid: int, rid: str) -> C.TransferCommand:
    return cls(command_id=cid, request_id=rid, ranks=(0,), block_ids=(cid,), keys=(rid,), deadline=99.0)


def test_parts_overlapping_on_a_rank_take_separate_lanes_and_spans_meet_exactly():
    now = [10.0]
    tl = Timeline(clock=lambda: now[0])
    tl.submitted("P0", [part(C.ReadBlocks, 1, "a")])
    now[0] += 0.1
    tl.submitted("P0", [part(C.WriteBlocks, 2, "b")])
    now[0] += 0.1
    tl.completed("P0", [Completion(1, 0, 1)])  # the read ends while the write runs
    tl.submitted("P0", [part(C.ReadBlocks, 3, "c")])
    now[0] += 0.1
    tl.completed("P0", [Completion(2, 0, 1), Completion(3, 0, 1)])
    spans = {e["args"]["request"]: e for e in check_trace(tl.to_json())}
    assert spans["a"]["tid"] == spans["c"]["tid"] == "rank 0"  # a freed lane is reused
    assert spans["b"]["tid"] == "rank 0 #2"
    assert spans["a"]["ts"] + spans["a"]["dur"] == spans["c"]["ts"] == 200_000


def test_store_faults_are_a_counter_track_recorded_when_they_change():
    now = [5.0]
    tl = Timeline(clock=lambda: now[0])
    tl.step("D0", 5.0, 5.1)
    for t, faults in ((5.2, {"broken": 0, "short": 0, "failed": 0}), (5.3, {"broken": 0, "short": 0, "failed": 0}),
                      (5.4, {"broken": 1, "short": 2, "failed": 0})):
        now[0] = t
        tl.store_faults("D0", faults)
    counters = [e for e in check_trace(tl.to_json()) if e["ph"] == "C"]
    assert [(e["ts"], e["args"]["broken"], e["args"]["short"]) for e in counters] == [(200_000, 0, 0), (400_000, 1, 2)]
    assert {e["name"] for e in counters} == {"store faults"} and {e["pid"] for e in counters} == {"D0"}
    with pytest.raises(KVStateError, match="store_faults"):
        tl.store_faults("D0", {"broken": -1})

"""Layer-wise transfers in the simulator: P's save runs under its prefill, so the first token
leaves earlier; a save that answers before its prefill ends still ends its request."""
from __future__ import annotations

from test_sim import assert_clean, run, small, write_trace

from kvstate.sim import Scenario, simulate, to_json, with_overrides


def test_a_layerwise_save_shortens_ttft_and_drains():
    """With layer-wise transfers P's write runs under its prefill: TTFT falls by about the write
    time, every request ends done, nothing leaks, and the run stays deterministic."""
    base = small(**{"storage.bandwidth_gbps": 5.0})  # a write that takes a while next to the prefill
    lw = with_overrides(base, {"cluster.layerwise": True})
    cl0, r0 = run(base)
    cl1, r1 = run(lw)
    assert r0["states"] == r1["states"] == {"done": 120}
    assert_clean(cl1)
    write_ms = r0["storage"]["bytes_written"] / 120 / 5e9 * 1e3  # a request's write, at the pool's bandwidth
    assert r1["ttft_ms"]["mean"] < r0["ttft_ms"]["mean"] - 0.5 * write_ms, (r0["ttft_ms"], r1["ttft_ms"], write_ms)
    assert r1["storage"]["bytes_written"] == r0["storage"]["bytes_written"]  # the same bytes, earlier
    assert to_json(simulate(lw)) == to_json(simulate(lw))


def test_a_layerwise_save_of_a_stored_prompt_answers_early_and_the_request_still_ends(tmp_path):
    """A prompt stored whole already: its layer-wise save answers before the prefill is done
    (P waits in 'saved'), and the prefill's end still sends the first token."""
    same = [{"timestamp": 500 * i, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]} for i in range(4)]
    f = write_trace(tmp_path / "same.jsonl", same)
    cl, r = run(with_overrides(Scenario(), {"workload.arrival": "trace", "workload.trace": str(f),
                                            "workload.hash_block_size": 512, "cluster.layerwise": True}))
    assert r["states"] == {"done": 4} and r["reasons"] == {"done": 4}
    assert_clean(cl)
    assert r["ttft_ms"]["p99"] < 1000



"""Layer-wise save and load on the GPU: P's prefill plus cache write against the prefill alone,
and D's first decode step after the handoff against the slower of its read and its step.

    python3 benchmarks/layerwise.py [--tokens 8192] [--reps 5] [--lag 2] [--groups 32] [--copy-threads 4] [--out FILE]

A Llama-3-8B-shaped model (``benchmarks/fast_llama.py``: 32 layers, hidden 4096, 8 KV heads,
bf16, seeded random weights) prefills one ``--tokens`` prompt and writes each layer's keys and
values into a paged cache (blocks of 64 tokens) as it goes. Through the public API only
(``PrefillLifecycle``, ``ThreadedDriver``, ``CudaBackend`` over a ``MemoryStore``, or with
``--store arena`` an ``ArenaStore`` the GPU gathers into and scatters out of in place, ``--groups``
stored objects per block and kind), each repetition runs a fresh prompt, from ``admit`` to P's first token:

- ``prefill``: the prefill with its paged writes, nothing stored (the bar's baseline);
- ``serial``: the prefill, then ``prefill_done`` sends the write (``layerwise=False``);
- ``layerwise``: the save goes out with the prefill; after launching layer ``i`` the engine
  waits for layer ``i - lag`` to finish on the GPU and reports it (``layers_done``), so the
  transfer thread stores it while later layers compute;
- ``at_launch``: as ``layerwise``, but the engine never waits: it reports layer ``i`` as soon
  as it is launched, with the CUDA event recorded after it, and the save's gathers wait for
  that event on the device (the bytes read back are this path's).

Then D, over the same store, for the last prompt P saved (a decode step of batch 1, each layer
a CUDA graph that gathers its pages into contiguous caches, then runs the layer):

- ``read`` alone (first token to runnable), ``step`` alone (cache in place);
- ``serial``: the read, then the step;
- ``layerwise``: a ``LoadLayers``; the step starts at once and waits, before each layer, for
  the group holding it to arrive (``ThreadedDriver.arrivals``);
- ``load``: the ``LoadLayers`` alone, no step meanwhile (what the load costs by itself).

Medians over ``--reps`` after a warm-up, all in one run (the ratios are side by side). The
store holds two requests, so from the first measured repetition on it is full and recycles
evicted objects' memory (a steady-state pool). The bytes stored by the last layer-wise save
are read back through a second backend and compared with P's cache.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fast_llama import HEAD_DIM, KV_HEADS, FastLlama  # noqa: E402

from kvstate import CacheSpec, DecodeLifecycle, Policy, PrefillLifecycle  # noqa: E402
from kvstate import commands as C  # noqa: E402
from kvstate.backends import (  # noqa: E402
    ArenaStore,
    CudaBackend,  # noqa: E402
    MemoryStore,
    ThreadedDriver,
)

BLOCK = 64


class Rig:
    """The model, P's paged cache, and P's lifecycle, backend and driver."""

    def __init__(self, torch: Any, tokens: int, groups: int = 32, copy_threads: int = 4, layers: int = 32,
                 store: str = "memory") -> None:
        self.torch, self.tokens = torch, tokens
        self.model = FastLlama(torch, layers)
        self.spec = CacheSpec(num_layers=layers, kv_heads=KV_HEADS, block_size=BLOCK, head_dim=HEAD_DIM,
                              dtype="bfloat16", layer_groups=groups)
        self.nblocks = self.spec.blocks_for(tokens) + 8
        shape = (self.nblocks, KV_HEADS, BLOCK, HEAD_DIM)
        self.cache = {k: [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
                      for k in ("key", "value")}
        per_request = self.spec.blocks_for(tokens) * self.spec.bytes_per_block_per_rank
        # room for two requests: after the warm-up the pool is full, as a serving pool is, and
        # each put reuses an evicted object's memory instead of page-faulting fresh memory
        if store == "arena":  # slots of one layer group's object: the GPU moves them in place
            obj = layers // groups * KV_HEADS * BLOCK * HEAD_DIM * 2
            self.store: Any = ArenaStore.create(obj, 2 * per_request // obj + 64, small_bytes=1024)
        else:
            self.store = MemoryStore(2 * per_request + (64 << 20), copy_threads=copy_threads)
        self.backend = CudaBackend(self.spec, self.nblocks, self.store, caches=[self.cache])
        self.driver = ThreadedDriver(self.backend, workers=2)
        self.n = 0
        self.last: tuple[list[int], list[int]] = ([], [])  #: the last served prompt and its blocks
        self.prefill_s: list[float] = []  #: admit to the forward's end, per serve

    def close(self) -> None:
        self.driver.close()
        self.backend.close()
        self.store.close()

    def prompt(self) -> list[int]:
        self.n += 1  # a fresh prompt: nothing of it is stored yet
        return [(self.n * 7919 + i * 31) % 128000 for i in range(self.tokens)]

    def prefill(self, toks: list[int], table: list[int], report: Any = None, lag: int = 2) -> int:
        """The prefill with its paged writes; ``report(n, event)``: with ``lag`` > 0 once the
        GPU finished ``n`` layers (event None), with ``lag`` 0 as soon as layer ``n`` is
        launched, with the event recorded after it."""
        torch = self.torch
        tab = torch.tensor(table[:self.spec.blocks_for(len(toks))], device="cuda")
        nb, events = len(tab), []

        def on_layer(i: int, k: Any, v: Any) -> None:
            for kind, x in (("key", k), ("value", v)):  # [1, H, T, D] -> [blocks, H, BLOCK, D]
                self.cache[kind][i][tab] = x[0].view(KV_HEADS, nb, BLOCK, HEAD_DIM).transpose(0, 1)
            if report is not None:
                events.append(torch.cuda.Event())
                events[-1].record()
                if not lag:
                    report(i + 1, events[-1])
                elif i >= lag:
                    events[i - lag].synchronize()
                    report(i - lag + 1, None)

        with torch.no_grad():
            logits = self.model.prefill(torch.tensor([toks], device="cuda"), on_layer=on_layer)
        return int(torch.argmax(logits))  # waits for the whole prefill

    def serve(self, layerwise: bool, lag: int) -> float:
        """Seconds from admit to the first token, one fresh prompt."""
        lc = PrefillLifecycle(self.spec, self.nblocks, Policy(read_prefix=False, transfer_timeout=120.0),
                              layerwise=layerwise)
        drv, toks, sent = self.driver, self.prompt(), []
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()

        def pump() -> None:
            sent.extend(c for c in drv.submit_all(lc.poll_commands()) if isinstance(c, C.SendFirstToken))

        lc.admit("r", toks)
        table = list(lc.blocks_of("r"))
        pump()
        report = (lambda n, ev: (lc.layers_done("r", n, ev), pump())) if layerwise else None
        tok = self.prefill(toks, table, report, lag)
        self.prefill_s.append(time.perf_counter() - t0)  # the forward's own time, saving or not
        lc.prefill_done("r", tok)
        pump()
        errors = []
        while not sent:
            for c in drv.poll(0.01):
                errors += [c.error] if c.error else []
                lc.complete(c)
            pump()
        t1 = time.perf_counter()
        assert sent[0].error_code == 200 and lc.stats()["retries"] == 0, (sent, errors)
        self.last = (toks, table)
        return t1 - t0

    def alone(self) -> float:
        toks = self.prompt()
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.prefill(toks, list(range(self.nblocks)))
        return time.perf_counter() - t0


def bytes_ok(rig: Rig, keys: list[str], table: list[int]) -> bool:
    """Read the stored cache back into a second backend and compare it with P's blocks."""
    torch = rig.torch
    n = len(keys)
    other = {k: [torch.zeros_like(x) for x in xs] for k, xs in rig.cache.items()}
    d = CudaBackend(rig.spec, rig.nblocks, rig.store, caches=[other])
    try:
        got = d.read(0, keys, list(range(n)))
    finally:
        d.close()
    src = torch.tensor(table[:n], device="cuda")
    return got == n and all(bool((other[k][i][:n] == rig.cache[k][i][src]).all())
                            for k in other for i in range(rig.spec.layers))


class DRig:
    """D over the same store: its paged cache, lifecycle, backend, driver and decode caches."""

    def __init__(self, p: Rig) -> None:
        torch, self.p, self.torch = p.torch, p, p.torch
        self.nblocks = p.spec.blocks_for(p.tokens + 1) + 8
        shape = (self.nblocks, KV_HEADS, BLOCK, HEAD_DIM)
        self.cache = {k: [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(p.spec.layers)]
                      for k in ("key", "value")}
        self.backend = CudaBackend(p.spec, self.nblocks, p.store, caches=[self.cache])
        self.driver = ThreadedDriver(self.backend, workers=2)
        self.static = p.model.decode_caches(1, p.tokens)  # the step's contiguous K and V per layer
        import cupy
        self.cp = cupy
        self.replays = self._graphs()

    def close(self) -> None:
        self.driver.close()
        self.backend.close()

    def _graphs(self) -> list[Any]:
        """Each layer of a step captured in a CUDA graph, as a serving engine runs decode: the
        layer's pages gathered (through the static table ``self.tab``) into the step's caches,
        then the layer, in place on the static hidden state ``self.x``."""
        torch, model, n = self.torch, self.p.model, self.p.spec.blocks_for(self.p.tokens)
        self.tab = torch.arange(n, device="cuda")
        self.x = model.emb[torch.tensor([[1]], device="cuda")].clone()

        def layer(i: int) -> None:
            for j, kind in enumerate(("key", "value")):
                pages = self.cache[kind][i][self.tab].transpose(0, 1).reshape(1, KV_HEADS, n * BLOCK, HEAD_DIM)
                self.static[i][j][:, :, :n * BLOCK] = pages
            self.x.copy_(model.decode_layer(i, self.x, *self.static[i]))

        return [model.graphed(layer, i) for i in range(self.p.spec.layers)]

    def step(self, table: list[int], wait: Any = None) -> None:
        """One decode step, layer graph by layer graph; before layer ``i``, ``wait(i)`` (the
        load's arrival)."""
        torch, n = self.torch, self.p.spec.blocks_for(self.p.tokens)
        self.tab.copy_(torch.tensor(table[:n]))
        for i, replay in enumerate(self.replays):
            if wait is not None:
                wait(i)
            replay()
        torch.cuda.synchronize()

    def serve(self, toks: list[int], layerwise: bool) -> float:
        """Seconds from P's first token to the end of D's first decode step (and the request
        running), ``toks`` already stored."""
        lc = DecodeLifecycle(self.p.spec, self.nblocks, Policy(transfer_timeout=120.0), layerwise=layerwise)
        drv, started = self.driver, []
        lc.reserve("r", toks)
        table = list(lc.blocks_of("r"))
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()

        def pump(block: float = 0.0) -> None:
            for c in drv.poll(block):
                lc.complete(c)
            started.extend(c for c in drv.submit_all(lc.poll_commands()) if isinstance(c, C.StartDecode))

        lc.deliver_first_token("r", 1)
        cmds = lc.poll_commands()
        drv.submit_all(cmds)
        if layerwise:  # the step starts now, each layer waiting for its group to arrive
            arrivals = drv.arrivals(cmds[0].command_id)
            assert arrivals is not None

            def wait(i: int) -> None:  # the host waits for the group's report, the GPU for its scatter
                ok, event = arrivals.wait(i + 1, timeout=60.0)
                assert ok, f"layer {i} never arrived"
                if event is not None:
                    self.cp.cuda.runtime.streamWaitEvent(self.torch.cuda.current_stream().cuda_stream, event.ptr, 0)

            self.step(table, wait)
        while not started:
            pump(0.01)
        if not layerwise:
            self.step(table)
        t1 = time.perf_counter()
        lc.finish("r")
        return t1 - t0

    def read_alone(self, toks: list[int], layerwise: bool = False) -> float:
        lc = DecodeLifecycle(self.p.spec, self.nblocks, Policy(transfer_timeout=120.0), layerwise=layerwise)
        lc.reserve("r", toks)
        t0 = time.perf_counter()
        lc.deliver_first_token("r", 1)
        self.driver.submit_all(lc.poll_commands())
        while lc.state_of("r") != "running":
            for c in self.driver.poll(0.01):
                lc.complete(c)
        t1 = time.perf_counter()
        lc.finish("r")
        return t1 - t0

    def step_alone(self) -> float:
        t0 = time.perf_counter()
        self.step(list(range(self.nblocks)))
        return time.perf_counter() - t0


def decode_side(rig: Rig, reps: int) -> dict[str, Any]:
    """D's first step after the handoff: serial read then step, against the layer-wise load."""
    toks = rig.last[0]  # stored by P's last layer-wise save
    d = DRig(rig)
    times: dict[str, list[float]] = {"read": [], "step": [], "serial": [], "layerwise": [], "load": []}
    try:
        for rep in range(reps + 1):
            t = {"read": d.read_alone(toks), "step": d.step_alone(), "serial": d.serve(toks, False),
                 "layerwise": d.serve(toks, True), "load": d.read_alone(toks, True)}
            if rep:
                for k, v in t.items():
                    times[k].append(v)
    finally:
        d.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    slower = max(med["read"], med["step"])
    return {"median_s": med, "min_s": {k: min(v) for k, v in times.items()},
            "serial_vs_slower": med["serial"] / slower, "layerwise_vs_slower": med["layerwise"] / slower}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lag", type=int, default=2, help="layers the GPU runs ahead of the reports")
    ap.add_argument("--groups", type=int, default=32, help="stored objects per block and kind (layer groups)")
    ap.add_argument("--copy-threads", type=int, default=4, help="MemoryStore's copy threads")
    ap.add_argument("--store", choices=["memory", "arena"], default="memory",
                    help="memory: a MemoryStore; arena: an ArenaStore whose slot is one layer group's object")
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="Python's GIL switch interval for the run (0: the default, 5 ms)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.switch_ms > 0:
        sys.setswitchinterval(args.switch_ms / 1000)
    import torch

    from kvstate import block_keys
    rig = Rig(torch, args.tokens, args.groups, args.copy_threads, store=args.store)
    times: dict[str, list[float]] = {"prefill": [], "serial": [], "layerwise": [], "at_launch": []}
    try:
        for rep in range(args.reps + 1):  # the first is a warm-up; the paths interleave
            t = {"prefill": rig.alone(), "serial": rig.serve(False, args.lag),
                 "layerwise": rig.serve(True, args.lag)}
            t["fwd_saving"] = rig.prefill_s[-1]  # the layer-wise forward alone
            t["at_launch"] = rig.serve(True, 0)  # layers reported at launch, with their events
            t["fwd_at_launch"] = rig.prefill_s[-1]
            if rep:
                for k, v in t.items():
                    times.setdefault(k, []).append(v)
        toks, table = rig.last  # the last layer-wise save's
        ok = bytes_ok(rig, block_keys(toks, BLOCK), table)
        dside = decode_side(rig, args.reps)
    finally:
        rig.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"gpu": torch.cuda.get_device_name(0), "tokens": args.tokens, "lag": args.lag, "layer_groups": args.groups,
           "store": args.store,
           "median_s": med, "min_s": {k: min(v) for k, v in times.items()},
           "serial_vs_prefill": med["serial"] / med["prefill"],
           "layerwise_vs_prefill": med["layerwise"] / med["prefill"],
           "at_launch_vs_prefill": med["at_launch"] / med["prefill"], "bytes_ok": ok, "decode": dside}
    print(f"{'path':<11}{'median ms':>11}{'min ms':>9}{'x prefill':>11}")
    for k in times:
        print(f"{k:<11}{med[k] * 1e3:>11.1f}{min(times[k]) * 1e3:>9.1f}{med[k] / med['prefill']:>11.3f}")
    print(f"layer-wise save, layers reported at launch with events: {res['at_launch_vs_prefill']:.3f} x the "
          f"prefill alone (bar 1.10); reported {args.lag} layers behind: {res['layerwise_vs_prefill']:.3f} x; "
          f"serial: {res['serial_vs_prefill']:.3f} x; bytes read back equal: {ok}")
    print(f"\n{'D path':<11}{'median ms':>11}{'min ms':>9}")
    for k, v in dside["median_s"].items():
        print(f"{k:<11}{v * 1e3:>11.1f}{dside['min_s'][k] * 1e3:>9.1f}")
    print(f"D: first token to the end of the first step, layer-wise load: {dside['layerwise_vs_slower']:.3f} x "
          f"the slower of (read, step) (bar 1.10); serial: {dside['serial_vs_slower']:.3f} x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Layer-wise saves and loads beside the forward they overlap (GPU).

    python3 benchmarks/layerwise_prefill.py [--reps 9] [--groups 4] [--store arena|memory] [--out F.json]

A Llama-3-8B-shaped prefill of one 8,192-token prompt at TP 1: 32 layers, each the layer's
GEMMs at their shapes (QKV 4096 -> 6144, O 4096 -> 4096, gate, up 4096 -> 14336, down 14336 ->
4096; bf16) and then its KV written into vLLM's paged cache (``[2, blocks, 8, 64, 128]``
under ``HND``, 128 blocks, 1 GiB in all). Four runs, alternating, medians of ``--reps``:

- ``prefill``: the forward alone;
- ``prefill + copy_``: the forward with each layer's blocks copied to pinned host memory by
  ``copy_`` on a side stream as soon as computed: what the link itself costs beside it;
- ``prefill + save``: the forward with the connector's layer-wise save (``RankTransfers``, a
  ``SaveLayers`` submitted before the forward, each layer reported with a CUDA event after it,
  as ``save_kv_layer`` does), timed until the save answered: when P can send the first token;
  and that forward's own time on the GPU's clock (``forward_beside_save``);
- ``layer-wise load``: D's side, a ``LoadLayers`` of the prompt's cache into other blocks and
  the forward of the prompt's last token (vLLM's first step with ``load`` ``"layerwise"``),
  each layer waiting for its group before its GEMMs (as ``wait_for_layer_load`` does, on the
  forward's stream), timed until the forward ends; checked byte-exact.

``--groups``: layer groups a block's objects hold (``layer_groups``). The store is an
``ArenaStore`` on ``/dev/shm`` (``--store arena``) or a ``MemoryStore``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

LAYERS, HEADS, BS, DIM, N, TOKENS, HIDDEN, INTER = 32, 8, 64, 128, 128, 8192, 4096, 14336


def forward(torch, w, x, caches, names, before=None, after=None, tokens=TOKENS):
    """One forward of ``tokens`` tokens: per layer, ``before(i)``, the GEMMs, the layer's KV
    (a whole prompt's fills the cache's first blocks; one token's, its slot), ``after(i)``."""
    for i, name in enumerate(names):
        if before is not None:
            before(i)
        q = x @ w["qkv"]
        h = q[:, :HIDDEN] @ w["o"]
        g = torch.nn.functional.silu(h @ w["gate"]) * (h @ w["up"])
        x = torch.nn.functional.layer_norm(g @ w["down"], (HIDDEN,))  # bounded: no overflow in 32 layers
        if tokens == TOKENS:
            caches[name][:, :N].copy_(q[:, HIDDEN:].reshape(2, N, BS, HEADS, DIM).transpose(2, 3))
        else:
            caches[name][:, N, :, 0].copy_(q[0, HIDDEN:HIDDEN + 2 * HEADS * DIM].reshape(2, HEADS, DIM))
        if after is not None:
            after(i)
    return x


class Rig:
    """P's and D's connector cores over one store, the weights and the caches."""

    def __init__(self, torch, groups: int, store_kind: str, reps: int) -> None:
        from kvstate import CacheSpec
        from kvstate.backends import ArenaStore, MemoryStore
        from kvstate.integrations._pagedkv import RankTransfers

        self.torch = torch
        self.forward_ms: list[float] = []  #: each save's forward, on the GPU's clock
        self.spec = CacheSpec(num_layers=LAYERS, kv_heads=HEADS, block_size=BS, head_dim=DIM, layer_groups=groups)
        obj = LAYERS // groups * HEADS * BS * DIM * 2
        self.store = (ArenaStore.create(obj, 2 * N * groups * (reps + 1) + 64, small_bytes=1024)
                      if store_kind == "arena" else MemoryStore(16 << 30))
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.p_caches = {n: torch.zeros(2, N + 8, HEADS, BS, DIM, dtype=torch.bfloat16, device="cuda")
                         for n in self.names}
        self.d_caches = {n: torch.zeros_like(t) for n, t in self.p_caches.items()}
        self.scratch = {n: torch.zeros_like(t) for n, t in self.p_caches.items()}  # D's own token's KV
        try:
            self.p = RankTransfers(self.spec, 0, self.p_caches, self.store, workers=2)
            self.d = RankTransfers(self.spec, 0, self.d_caches, self.store, workers=2)
        except BaseException:
            self.store.close()  # an arena's file goes with it
            raise
        gen = torch.Generator(device="cuda").manual_seed(0)
        shapes = {"qkv": (HIDDEN, HIDDEN + 2 * HEADS * DIM), "o": (HIDDEN, HIDDEN), "gate": (HIDDEN, INTER),
                  "up": (HIDDEN, INTER), "down": (INTER, HIDDEN)}
        self.w = {k: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
                  for k, s in shapes.items()}
        self.x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)

    def prefill(self) -> float:
        torch = self.torch
        torch.cuda.synchronize()
        t = time.perf_counter()
        forward(torch, self.w, self.x, self.p_caches, self.names)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def prefill_save(self, cid: int, keys: tuple[str, ...]) -> float:
        """The forward with the layer-wise save, until the save answered."""
        from kvstate.commands import SaveLayers

        torch = self.torch
        for c in self.p_caches.values():  # what the save stores must be this forward's writes
            c.zero_()
        torch.cuda.synchronize()
        t, now = time.perf_counter(), time.monotonic()
        self.p.submit("save", [SaveLayers("r", cid, (0,), now + 60, keys, tuple(range(N)), fence=now + 120)])

        def reported(i: int) -> None:
            ev = torch.cuda.Event()
            ev.record()
            self.p.layers_computed([("r", cid)], i + 1, ev)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        forward(torch, self.w, self.x, self.p_caches, self.names, after=reported)
        end.record()
        assert [c.count for c in self.p.poll("save", 60)] == [N]
        took = time.perf_counter() - t
        end.synchronize()
        self.forward_ms.append(begin.elapsed_time(end))  # the forward's own time beside the save
        return took

    def prefill_copy(self) -> float:
        """The forward with each layer's blocks copied to pinned host memory by ``copy_`` on a
        side stream once computed: the link's own cost beside the forward, no store at all."""
        torch = self.torch
        if not hasattr(self, "host"):
            self.host = torch.empty(LAYERS, 2, N, HEADS, BS, DIM, dtype=torch.bfloat16, pin_memory=True)
            self.side = torch.cuda.Stream()
        torch.cuda.synchronize()
        t = time.perf_counter()

        def copied(i: int) -> None:
            ev = torch.cuda.Event()
            ev.record()
            with torch.cuda.stream(self.side):
                self.side.wait_event(ev)
                self.host[i].copy_(self.p_caches[self.names[i]][:, :N], non_blocking=True)
        forward(torch, self.w, self.x, self.p_caches, self.names, after=copied)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def layerwise_load(self, cid: int, keys: tuple[str, ...]) -> float:
        """D's first forward (the last prompt token) with the layer-wise load, checked."""
        from kvstate.commands import LoadLayers

        torch = self.torch
        torch.cuda.synchronize()
        t, now = time.perf_counter(), time.monotonic()
        load = LoadLayers("r", cid, (0,), now + 60, keys, tuple(range(N)), fence=now + 120)
        self.d.submit("load", [load])
        stream = torch.cuda.current_stream().cuda_stream

        def wait(i: int) -> None:
            assert self.d.wait_layers([load], i + 1, stream) == set()
        forward(torch, self.w, self.x[:1], self.scratch, self.names, before=wait, tokens=1)
        torch.cuda.synchronize()
        took = time.perf_counter() - t
        assert self.d.load_errors([load]) == set() and [c.count for c in self.d.poll("load", 10)] == [N]
        for n in self.names:
            assert torch.equal(self.d_caches[n][:, :N].view(torch.int16), self.p_caches[n][:, :N].view(torch.int16)), n
        return took

    def close(self) -> None:
        self.p.close(10)
        self.d.close(10)
        self.store.close()


def main() -> None:
    import torch

    from kvstate import block_keys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--store", choices=["arena", "memory"], default="arena")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rig = Rig(torch, a.groups, a.store, a.reps)
    rows: dict[str, list[float]] = {"prefill": [], "prefill_copy": [], "prefill_save": [], "layerwise_load": []}
    try:
        for rep in range(a.reps + 1):  # the first is warm-up
            keys = tuple(block_keys(list(range(rep * 10**6, rep * 10**6 + N * BS)), BS, namespace="lw"))
            got = {"prefill": rig.prefill(), "prefill_copy": rig.prefill_copy(),
                   "prefill_save": rig.prefill_save(rep + 1, keys),
                   "layerwise_load": rig.layerwise_load(rep + 1, keys)}
            for k, v in got.items():
                if rep:
                    rows[k].append(v)
    finally:
        rig.close()
    rows["forward_beside_save"] = [x / 1e3 for x in rig.forward_ms[1:]]
    report(torch, a, rig.spec, rows)


def report(torch, a: argparse.Namespace, spec, rows: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    nbytes = N * spec.bytes_per_block_per_rank
    out = {"gpu": torch.cuda.get_device_name(), "groups": a.groups, "store": a.store, "reps": a.reps,
           "bytes": nbytes, "median_ms": med, "save_over_prefill": med["prefill_save"] / med["prefill"],
           "save_over_copy": med["prefill_save"] / med["prefill_copy"],
           "load_gbps": nbytes / med["layerwise_load"] / 1e6,
           "runs_ms": {k: [x * 1e3 for x in v] for k, v in rows.items()}}
    print(f"{nbytes / 2**30:.2f} GiB, {a.groups} layer groups, {a.store} store; medians of {a.reps}")
    print(f"{'run':<16}{'median ms':>10}{'/ prefill':>11}")
    for k in rows:
        print(f"{k:<16}{med[k]:>10.1f}{med[k] / med['prefill']:>11.3f}")
    print(f"the layer-wise load moved {out['load_gbps']:.1f} GB/s")
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

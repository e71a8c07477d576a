"""Layer groups: the bytes each kind of layer moves through the store.

    python benchmarks/layer_groups.py [--tokens 4096] [--json PATH]

- **MLA at TP 8** (measured, reference backend): a DeepSeek-V3-shaped latent cache (one head of
  512 + 64 values a token, no value cache, blocks of 64 tokens; 8 layers of its 61, which
  scales every figure alike) handed from 8 P ranks to 8 D ranks through a ``MemoryStore``, as
  a ``latent`` layer group (one replicated head: rank 0 writes, every rank reads that object)
  and as a per-rank layout (each rank stores its own copy). Reported: bytes stored and objects
  per request, bytes the D ranks read, and whether every D rank holds exactly P's bytes.
- **Sliding window**: a 32k-token conversation, W = 4,096, five window layers to one full. The
  spec's accounting (:meth:`CacheSpec.read_bytes_per_rank`) on the Gemma-3 shape (62 layers of
  16 KV heads of 128), and measured on the reference backend (12 layers of 2 heads of 64, the
  same mix): D's read from the window on (``window_from``, as its lifecycle asks) against a
  whole read, and whether every byte it needs arrived.
- **Held on D**: the GPU bytes D's lifecycle holds for that conversation after 64 decode steps,
  with one block table (a block holds every layer: nothing behind the window is freed while a
  full layer needs it) and with a table per layer group (:mod:`kvstate._tables`: the window
  groups' blocks behind the window freed), on the Gemma-2 (alternating, 46 layers) and Gemma-3
  (five to one, 62 layers; its window layers cut into groups as large as the full group) shapes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from kvstate import CacheSpec, LayerGroup, block_keys  # noqa: E402
from kvstate.backends import MemoryStore, ReferenceBackend  # noqa: E402

TP, LAYERS, BLOCK, LATENT = 8, 8, 64, 576


def mla_specs() -> dict[str, CacheSpec]:
    latent = CacheSpec(num_layers=LAYERS, kv_heads=1, total_kv_heads=1, block_size=BLOCK, head_dim=LATENT,
                       has_value=False, tp_size=TP, groups=(LayerGroup("latent", tuple(range(LAYERS))),))
    return {"latent group": latent, "per-rank layout": dataclasses.replace(latent, total_kv_heads=TP, groups=())}


def handoff(spec: CacheSpec, tokens: int) -> dict[str, Any]:
    """One request's cache from P's ranks to D's through one store: what it stored and read."""
    n = spec.blocks_for(tokens)
    store = MemoryStore(4 << 30)
    p, d = ReferenceBackend(spec, n, store), ReferenceBackend(spec, n, store)
    rng = np.random.default_rng(0)
    for r in range(TP):  # ranks holding the same heads (replicas) hold the same bytes
        first = r - r % spec.replicas
        for i, arr in enumerate(p.caches[r]["key"]):
            arr[...] = p.caches[first]["key"][i] if r != first else \
                rng.integers(0, 1 << 14, arr.shape, dtype=np.uint16).view(arr.dtype)
    keys, ids = block_keys(list(range(tokens)), BLOCK), list(range(n))
    written = [p.write(r, keys, ids) for r in range(TP)]
    read = [d.read(r, keys, ids) for r in range(TP)]
    same = all(np.array_equal(a, b) for r in range(TP) for a, b in zip(p.caches[r]["key"], d.caches[r]["key"]))
    return {"blocks": n, "written_blocks": written, "read_blocks": read, "stored_bytes": store.used_bytes,
            "objects": len(store), "d_read_bytes": d.bytes_moved, "d_matches_p": same}


def window_read(tokens: int = 32768) -> dict[str, Any]:
    """Measured on the reference backend: D reads the conversation window-first, as its
    lifecycle asks (``window_from``), against a whole read; 12 layers (10 window, 2 full) of
    2 heads of 64, which keeps the ratio and fits in memory."""
    layers, full = 12, (5, 11)
    local = tuple(i for i in range(layers) if i not in full)
    spec = CacheSpec(num_layers=layers, kv_heads=2, block_size=BLOCK, head_dim=64,
                     groups=(LayerGroup("window", local, window=4096), LayerGroup("full", full)))
    n = spec.blocks_for(tokens)
    store = MemoryStore(4 << 30)
    p = ReferenceBackend(spec, n, store)
    rng = np.random.default_rng(0)
    for kind in spec.kinds:
        for arr in p.caches[0][kind]:
            arr[...] = rng.integers(0, 1 << 14, arr.shape, dtype=np.uint16).view(arr.dtype)
    keys, ids = block_keys(list(range(tokens)), BLOCK), list(range(n))
    p.write(0, keys, ids)
    first = spec.window_first_block(tokens)
    out: dict[str, Any] = {"tokens": tokens, "blocks": n, "window_from": first}
    for name, wf in (("window", first), ("whole", 0)):
        d = ReferenceBackend(spec, n, store)
        got = d.read(0, keys, ids, window_from=wf)
        right = all(np.array_equal(p.caches[0][k][i][first:], d.caches[0][k][i][first:])
                    for k in spec.kinds for i in range(layers)) and \
            all(np.array_equal(p.caches[0][k][i], d.caches[0][k][i]) for k in spec.kinds for i in full)
        out[name] = {"blocks_answered": got, "bytes_read": d.bytes_moved, "bytes_right": right}
    out["ratio"] = out["window"]["bytes_read"] / out["whole"]["bytes_read"]
    return out


def window_case(tokens: int = 32768) -> dict[str, Any]:
    layers, full = 62, tuple(range(5, 62, 6))
    local = tuple(i for i in range(layers) if i not in full)
    spec = CacheSpec(num_layers=layers, kv_heads=16, block_size=BLOCK, head_dim=128,
                     groups=(LayerGroup("window", local, window=4096), LayerGroup("full", full)))
    needed, whole = spec.read_bytes_per_rank(tokens), spec.blocks_for(tokens) * spec.bytes_per_block_per_rank
    window_blocks = -(-4096 // BLOCK)
    by_hand = (len(full) * spec.blocks_for(tokens) + len(local) * window_blocks) * 2 * spec.chunk_bytes()
    return {"tokens": tokens, "window": 4096, "window_layers": len(local), "full_layers": len(full),
            "needed_bytes": needed, "all_blocks_bytes": whole, "ratio": needed / whole,
            "matches_hand_count": needed == by_hand}


def gemma_groups(layers: int, every: int, window: int, split: bool) -> tuple[LayerGroup, ...]:
    """Every ``every``-th layer full, the rest windows of ``window`` tokens; ``split``: the window
    layers cut into groups as large as the full group (a block table each, blocks of one size)."""
    full = tuple(range(every - 1, layers, every))
    local = [i for i in range(layers) if i not in full]
    size = len(full) if split else len(local)
    return (LayerGroup("full", full),) + tuple(LayerGroup("window", tuple(local[i:i + size]), window=window)
                                                for i in range(0, len(local), size))


def window_held(tokens: int = 32768, steps: int = 64) -> dict[str, Any]:
    """GPU bytes D's lifecycle holds per rank for one conversation of ``tokens`` tokens after
    ``steps`` decode steps (W = 4,096, blocks of 64, 16 KV heads of 128 in bf16), one block
    table against a table per group (:mod:`kvstate._tables`): the pool's blocks held times the
    bytes of a block (every layer, or a page of the largest group's layers)."""
    from kvstate import DecodeLifecycle
    from kvstate._tables import page_layers
    from kvstate.events import Completion

    out: dict[str, Any] = {}
    for shape, layers, every in (("gemma2", 46, 2), ("gemma3", 62, 6)):
        for tables in (False, True):
            spec = CacheSpec(num_layers=layers, kv_heads=16, block_size=BLOCK, head_dim=128, group_tables=tables,
                             groups=gemma_groups(layers, every, 4096, split=tables))
            d = DecodeLifecycle(spec, 4 * spec.blocks_for(tokens + steps) * len(spec.groups))
            d.reserve("r", list(range(tokens)))
            d.deliver_first_token("r", 1)
            [read] = d.poll_commands()
            d.complete(Completion(read.command_id, 0, len(read.keys)))
            for i in range(steps):
                d.append_tokens("r", [i % 7])
            page = page_layers(spec) * 2 * spec.chunk_bytes()
            out[f"{shape}/{'group tables' if tables else 'one table'}"] = {
                "blocks_held": d.pool.num_used, "block_bytes": page, "held_bytes": d.pool.num_used * page,
                "read_blocks": len(read.keys) * (1 + len(read.tables))}
            d.finish("r")
    for shape in ("gemma2", "gemma3"):
        out[f"{shape}/ratio"] = out[f"{shape}/group tables"]["held_bytes"] / out[f"{shape}/one table"]["held_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mla = {name: handoff(spec, args.tokens) for name, spec in mla_specs().items()}
    ratio = mla["latent group"]["stored_bytes"] / mla["per-rank layout"]["stored_bytes"]
    print(f"MLA at TP {TP}, {args.tokens} tokens ({LAYERS} layers of one {LATENT}-value latent, blocks of {BLOCK}):")
    print(f"{'layout':<18}{'stored MiB':>12}{'objects':>9}{'D read MiB':>12}  D == P")
    for name, r in mla.items():
        print(f"{name:<18}{r['stored_bytes'] / 2**20:>12.2f}{r['objects']:>9}{r['d_read_bytes'] / 2**20:>12.2f}"
              f"  {r['d_matches_p']}")
    print(f"stored: latent / per-rank = {ratio:.4f} (1/{TP} = {1 / TP:.4f})")
    win = window_case()
    print(f"\nsliding window: {win['tokens']} tokens, W = {win['window']}, Gemma-3-shaped ({win['window_layers']} "
          f"window + {win['full_layers']} full layers): needed {win['needed_bytes'] / 2**30:.2f} GiB of "
          f"{win['all_blocks_bytes'] / 2**30:.2f} GiB ({win['ratio']:.3f})")
    read = window_read()
    print(f"measured, reference backend (10 window + 2 full layers): D's read from block {read['window_from']} of "
          f"{read['blocks']}: {read['window']['bytes_read'] / 2**20:.1f} MiB against "
          f"{read['whole']['bytes_read'] / 2**20:.1f} MiB whole ({read['ratio']:.3f}); bytes right: "
          f"{read['window']['bytes_right']}")
    held = window_held()
    print("\nheld on D after 64 decode steps of a 32768-token conversation (W = 4096), per rank:")
    print(f"{'shape / layout':<28}{'blocks':>8}{'block MiB':>11}{'held GiB':>10}")
    for name, r in held.items():
        if not name.endswith("ratio"):
            mib, gib = r["block_bytes"] / 2**20, r["held_bytes"] / 2**30
            print(f"{name:<28}{r['blocks_held']:>8}{mib:>11.2f}{gib:>10.2f}")
    print(f"group tables / one table: Gemma-2 shape {held['gemma2/ratio']:.3f}, "
          f"Gemma-3 shape {held['gemma3/ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mla": mla, "mla_stored_ratio": ratio, "window": win, "window_read": read, "held": held}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

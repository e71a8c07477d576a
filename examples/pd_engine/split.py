"""The PD engine as separate processes: a P process and a D process, each with rank workers.

    python3 split.py [--tp 2] [--requests 8] [--store file|mooncake]

Each instance is a scheduler process that runs the model (its "model runner") and owns its
paged KV cache on the GPU, plus one rank-worker process per TP rank that maps the cache through
CUDA IPC and moves its blocks with ``CudaSwapper`` (kvstate's ``ProcessDriver``). P and D meet
through a store other processes reach (a FileStore on tmpfs, or a Mooncake master) and through
messages (kvstate's ``Link``): the router hands each request to D, D reserves blocks and asks P
to admit it, P prefills, writes and sends the first token, D reads and decodes. Each side sends
its logits to the router, which compares every token and every logit with a monolithic run,
bit for bit. The model's weights are seeded, so every process builds the same model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from engine import Request, cache_spec, monolithic, prefill_chunks
from model import LlamaConfig, PagedCache, TinyLlama

from kvstate import DecodeLifecycle, Policy, PrefillLifecycle
from kvstate import commands as C
from kvstate.distributed import ChildProcess, Link, ProcessDriver, die_with_parent, parent_alive, share_caches

__all__ = ["run_split", "SCHEMAS"]

HERE = Path(__file__).resolve().parent
_S, _I, _L, _B = (str,), (int,), (list,), (bytes,)
SCHEMAS = {"submit": (("request_id", _S), ("prompt", _L), ("max_new", _I)),
           "admit": (("request_id", _S), ("prompt", _L)),
           "logits": (("request_id", _S), ("index", _I), ("token", _I), ("data", _B)),
           "ended": (("request_id", _S), ("state", _S), ("error_code", _I)),
           "ready": (("role", _S), ("pid", _I)), "stop": (), "report": (("role", _S), ("figures", (dict,)))}


class Side:
    """One instance's scheduler: its model, cache, lifecycle, rank workers and link."""

    def __init__(self, role: str, cfg: dict[str, Any]) -> None:
        self.role, self.cfg = role, cfg
        self.model = TinyLlama(LlamaConfig(), seed=0)
        mc, tp, bs, nb = self.model.cfg, cfg["tp"], cfg["block_size"], cfg["blocks"]
        self.spec = cache_spec(mc, tp, bs)
        self.cache = PagedCache(mc, nb, bs, tp)
        cls = PrefillLifecycle if role == "prefill" else DecodeLifecycle
        self.lc = cls(self.spec, nb, Policy(transfer_timeout=30.0, fence_grace=10.0))
        self.driver = ProcessDriver(self.spec, nb, dead_after_s=10.0, name=role)
        shared = share_caches({r: self.cache.caches[r] for r in range(tp)})
        for r in range(tp):
            self.driver.spawn(r, cfg["store"], caches=shared, backend="cuda", lanes=2)
        self.driver.wait_ready(120)
        self.link = Link(cfg["addresses"][role], SCHEMAS)
        for peer in ("router", "prefill", "decode"):
            if peer != role:
                self.link.connect(peer, cfg["addresses"][peer])
        self.reqs: dict[str, Request] = {}
        self.queue: deque[Request] = deque()

    def send_logits(self, r: Request, logits: torch.Tensor) -> None:
        tok = int(torch.argmax(logits))
        self.link.send("router", "logits", r.rid, len(r.tokens), tok, logits.float().cpu().numpy().tobytes())
        r.tokens.append(tok)

    # -- P --------------------------------------------------------------------------------
    def prefill_notice(self, cmd: C.Command) -> None:
        r = self.reqs[cmd.request_id]
        if isinstance(cmd, C.StartPrefill):
            logits = prefill_chunks(self.model, self.cache, list(cmd.block_ids), r.prompt, cmd.num_cached_tokens,
                                    len(r.prompt))
            torch.cuda.synchronize()  # the cache is complete before the rank workers read it
            self.send_logits(r, logits)
            self.lc.prefill_done(r.rid, r.tokens[0])
        elif isinstance(cmd, C.SendFirstToken):
            self.link.send("decode", "first_token", r.rid, cmd.token, cmd.error_code)

    # -- D --------------------------------------------------------------------------------
    def decode_notice(self, cmd: C.Command) -> None:
        r = self.reqs[cmd.request_id]
        if isinstance(cmd, C.StartDecode):
            r.running = True
        elif isinstance(cmd, C.RequestEnded):
            r.running = False
            self.link.send("router", "ended", r.rid, cmd.state, cmd.error_code)

    def decode_steps(self) -> None:
        for r in list(self.reqs.values()):
            if not (r.running and self.lc.is_live(r.rid)):
                continue
            table, pos = list(self.lc.blocks_of(r.rid)), len(r.prompt) + len(r.tokens) - 1
            self.send_logits(r, self.model.forward(r.tokens[-1:], pos, self.cache, table))
            if len(r.tokens) >= r.max_new:
                r.running = False
                self.lc.finish(r.rid)
            else:
                self.lc.append_tokens(r.rid, r.tokens[-1:])

    def dispatch(self, kind: str, items: list[Any]) -> None:
        if kind == "submit":
            self.queue.append(Request(items[0], items[1], items[2]))
        elif kind == "admit":
            self.reqs[items[0]] = Request(items[0], items[1], 0)
            self.lc.admit(items[0], items[1])
        elif kind == "first_token" and self.lc.is_live(items[0]) \
                and self.lc.deliver_first_token(items[0], items[1], items[2]) and items[2] == 200:
            self.reqs[items[0]].tokens.append(items[1])

    def turn(self) -> None:
        while self.queue and self.lc.can_reserve(len(self.queue[0].prompt)):
            r = self.queue.popleft()
            self.reqs[r.rid] = r
            self.lc.reserve(r.rid, r.prompt)
            self.link.send("prefill", "admit", r.rid, r.prompt)
        on_notice = self.prefill_notice if self.role == "prefill" else self.decode_notice
        for cmd in self.lc.poll_commands():
            if not self.driver.submit(cmd):
                on_notice(cmd)
        for c in self.driver.poll(0.0005):
            self.lc.complete(c)
        if self.role == "decode":
            self.decode_steps()
        self.lc.tick()

    def serve(self) -> None:
        self.link.send("router", "ready", self.role, os.getpid())
        while parent_alive(self.cfg["parent_pid"]):
            for kind, items in self.link.receive(0.0005):
                if kind == "stop":
                    figures = {"leaked": self.lc.pool.num_used, "pending": len(self.lc.pending_commands()),
                               "live": len(self.lc.live_requests()), "driver": self.driver.counters}
                    self.link.send("router", "report", self.role, figures)
                    return
                self.dispatch(kind, items)
            self.turn()

    def close(self) -> None:
        self.driver.close()
        self.link.close()


def run_split(requests: list[Request], tp: int = 1, block_size: int = 32, blocks: int = 1024,
              store: dict[str, Any] | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """Serve ``requests`` with P and D as processes; returns the tokens and logits each
    request got, how each ended, and what each side reports."""
    tmp = tempfile.mkdtemp(prefix=f"kvstate-split-{os.getpid()}-")
    if store is None:
        os.mkdir(f"{tmp}/store")
        store = {"kind": "file", "root": f"{tmp}/store"}
    addresses = {n: f"ipc://{tmp}/{n}" for n in ("router", "prefill", "decode")}
    cfg = {"tp": tp, "block_size": block_size, "blocks": blocks, "store": store, "addresses": addresses,
           "parent_pid": os.getpid()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out: dict[str, Any] = {"logits": {}, "tokens": {}, "ended": {}, "reports": {}}
    link = Link(addresses["router"], SCHEMAS)
    children = {}
    try:
        for role in ("prefill", "decode"):
            link.connect(role, addresses[role])
            children[role] = ChildProcess("split", [role, json.dumps(cfg)], f"split {role}", env=env)
        _wait_ready(link, children)
        for r in requests:
            link.send("decode", "submit", r.rid, r.prompt, r.max_new)
        _collect(link, out, len(requests), time.monotonic() + timeout)
        for role in children:
            link.send(role, "stop")
        deadline = time.monotonic() + 60
        while len(out["reports"]) < 2 and time.monotonic() < deadline:
            out["reports"].update({items[0]: items[1] for kind, items in link.receive(0.05) if kind == "report"})
        for rid, by_index in out["logits"].items():
            out["tokens"][rid] = [by_index[i][0] for i in sorted(by_index)]
        return out
    finally:
        for c in children.values():
            c.stop(30)
        link.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_ready(link: Link, children: dict[str, ChildProcess]) -> None:
    ready: set[str] = set()
    deadline = time.monotonic() + 240
    while len(ready) < 2 and time.monotonic() < deadline and all(c.alive() for c in children.values()):
        ready |= {items[0] for kind, items in link.receive(0.05) if kind == "ready"}
    if len(ready) < 2:
        raise RuntimeError("the P or D process did not start (see its stderr)")


def _collect(link: Link, out: dict[str, Any], n: int, deadline: float) -> None:
    """Logits and ends until ``n`` requests ended (or ``deadline``)."""
    while len(out["ended"]) < n and time.monotonic() < deadline:
        for kind, items in link.receive(0.05):
            if kind == "logits":
                out["logits"].setdefault(items[0], {})[items[1]] = (items[2], items[3])
            elif kind == "ended":
                out["ended"][items[0]] = (items[1], items[2])


def _serve(role: str, cfg: dict[str, Any]) -> int:
    die_with_parent(cfg["parent_pid"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    side = Side(role, cfg)
    try:
        side.serve()
    finally:
        side.close()
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    import random
    rng = random.Random(1)
    reqs = [Request(f"r{i}", [rng.randrange(512) for _ in range(rng.randint(1, 3000))], 6)
            for i in range(args.requests)]
    got = run_split(reqs, tp=args.tp)
    ref = monolithic(TinyLlama(LlamaConfig(), seed=0), reqs, 32)
    exact = all(got["tokens"].get(r.rid) == ref[r.rid][0] for r in reqs)
    print(json.dumps({"exact_tokens": exact, "ended": got["ended"], "reports": got["reports"]}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("prefill", "decode"):
        sys.exit(_serve(sys.argv[1], json.loads(sys.argv[2])))
    main()

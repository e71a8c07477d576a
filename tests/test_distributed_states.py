"""State groups across processes: a hybrid model's state pages live in the shared caches, and
rank worker processes move them with the blocks (kvstate.distributed, kvstate._statepages).

P and D each have two rank workers over one FileStore; the engine side fills P's blocks and
state pages in shared memory and checks what D's workers brought back into D's.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from state_helpers import BS, TOKS, fake_state, hybrid

from kvstate import ConfigError, DecodeLifecycle, Policy, PrefillLifecycle, ValidationError
from kvstate import commands as C
from kvstate._keys import block_keys, rank_key
from kvstate.backends import FileStore, MemoryStore, ReferenceBackend
from kvstate.distributed import ProcessDriver, SharedCaches, WorkerConfig
from kvstate.testing import fill_blocks, mismatched_blocks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/dev/shm, /proc)")

BLOCKS, STATES = 64, 4
POLICY = Policy(transfer_timeout=10.0, fence_grace=5.0, read_failure="recompute", first_token_timeout=30.0)


class Side:
    """One side's lifecycle, shared caches, driver and two rank worker processes; ``view`` is
    the engine's own window on the shared caches and state pages."""

    def __init__(self, cls, store_dir: str) -> None:
        spec = hybrid()
        self.caches = SharedCaches.create(spec, BLOCKS, num_states=STATES)
        self.drv = ProcessDriver(spec, BLOCKS, heartbeat_s=0.1, dead_after_s=2.0, name=cls.__name__[0],
                                 num_states=STATES)
        for r in range(spec.tp_size):
            self.drv.spawn(r, {"kind": "file", "root": store_dir}, caches={"kind": "shm", "paths": self.caches.paths})
        self.lc = cls(spec, BLOCKS, POLICY, num_states=STATES)
        self.view = ReferenceBackend(spec, BLOCKS, MemoryStore(1 << 20), caches=self.caches.caches,
                                     num_states=STATES, states=self.caches.states)
        self.notices: list[C.Command] = []

    def turn(self) -> None:
        for cmd in self.lc.poll_commands():
            if not self.drv.submit(cmd):
                self.notices.append(cmd)
        for c in self.drv.poll(0.001):
            self.lc.complete(c)
        self.lc.tick()

    def taken(self, cls, rid: str):
        """The first notice of ``cls`` for ``rid``, removed; None while there is none."""
        for n in self.notices:
            if isinstance(n, cls) and n.request_id == rid:
                self.notices.remove(n)
                return n
        return None

    def close(self) -> None:
        self.drv.close()
        self.caches.close()


@pytest.fixture
def sides(tmp_path):
    made = []
    try:
        for cls in (PrefillLifecycle, DecodeLifecycle):
            made.append(Side(cls, str(tmp_path)))
        for s in made:
            s.drv.wait_ready(60)
        yield made
    finally:
        for s in made:
            s.close()


def wait_for(sides, cls, rid, side, timeout=30.0):
    end = time.monotonic() + timeout
    while (n := side.taken(cls, rid)) is None:
        assert time.monotonic() < end, f"no {cls.__name__} for {rid}"
        for s in sides:
            s.turn()
    return n


def prefill(sides, rid, toks):
    """D reserves, P admits and computes (blocks and states into shared memory) and sends the
    first token; (the StartPrefill, the SendFirstToken, each rank's running state as P's
    workers left it before the computation)."""
    P, D = sides
    D.lc.reserve(rid, toks)
    P.lc.admit(rid, toks)
    sp = wait_for(sides, C.StartPrefill, rid, P)
    keys = block_keys(toks, BS)
    loaded = [P.view.state_bytes(r, sp.state_pages[0]) for r in range(2)]
    fill_blocks(P.view, keys, sp.block_ids, sp.num_cached_tokens // BS)
    for r in range(2):
        for page, checkpoint in zip(sp.state_pages[1:], sp.checkpoints):
            P.view.fill_state(r, page, fake_state(keys[checkpoint // BS - 1], r))
        P.view.fill_state(r, sp.state_pages[0], fake_state(keys[-1], r))
    P.lc.prefill_done(rid, 7)
    first = wait_for(sides, C.SendFirstToken, rid, P)
    return sp, first, loaded


def drain(sides, timeout=30.0):
    end = time.monotonic() + timeout
    while any(s.lc.live_requests() or s.lc.pending_commands() for s in sides):
        assert time.monotonic() < end, "requests still live"
        for s in sides:
            s.turn()
    assert [s.lc.pool.num_used for s in sides] == [0, 0]


def test_states_cross_to_rank_workers_and_back_into_shared_pages(sides, tmp_path):
    P, D = sides
    keys = block_keys(TOKS, BS)
    _, first, _ = prefill(sides, "a", TOKS)
    D.lc.deliver_first_token("a", first.token, first.error_code)
    sd = wait_for(sides, C.StartDecode, "a", D)
    assert mismatched_blocks(D.view, keys, D.lc.blocks_of("a")) == []
    for r in range(2):  # D's workers loaded each rank's share of the prompt's state into shared memory
        assert D.view.state_bytes(r, sd.state_pages[0]) == fake_state(keys[-1], r)
    D.lc.finish("a")
    # a prompt sharing 20 tokens: P's workers read the checkpoint's blocks and state (16 tokens)
    longer = TOKS[:20] + [9, 9, 9]
    sp, _, loaded = prefill(sides, "b", longer)
    assert sp.num_cached_tokens == 16 and loaded == [fake_state(keys[3], r) for r in range(2)]
    D.lc.abort("b")
    drain(sides)
    assert FileStore(tmp_path).batch_is_exist([rank_key(keys[3], "state", r) for r in range(2)]) == [1, 1]


def test_a_state_corrupt_on_one_rank_is_evicted_by_the_worker_and_recomputed(sides, tmp_path):
    P, D = sides
    keys = block_keys(TOKS, BS)
    _, first, _ = prefill(sides, "a", TOKS)
    store, name = FileStore(tmp_path), rank_key(keys[-1], "state", 1)
    buf = np.empty(1 << 12, np.uint8)
    [n] = store.batch_get_into([name], [buf])
    buf[0] ^= 0x80
    assert store.batch_put_from([name], [buf[:n]]) == [0]
    D.lc.deliver_first_token("a", first.token, first.error_code)
    rc = wait_for(sides, C.Recompute, "a", D)
    assert rc.from_token == 0  # rank 0 read the prompt's state, rank 1 only the checkpoint's
    assert store.batch_is_exist([name]) == [0]
    D.lc.recompute_done("a")
    D.lc.finish("a")
    drain(sides)


def test_state_pages_across_processes_are_refused_where_they_cannot_go(tmp_path):
    import os

    from kvstate.backends._shm import shm_directory

    spec = hybrid()
    with pytest.raises(ValidationError, match="needs state pages"):
        SharedCaches.create(spec, 8)
    assert not list(shm_directory().glob(f"kvstate-{os.getpid()}-*"))  # refused before a file was made
    base = dict(rank=0, spec={f: getattr(spec, f) for f in spec.__dataclass_fields__}, num_blocks=8,
                command_address="ipc://a", reply_address="ipc://b", control_address="ipc://c",
                store={"kind": "file", "root": str(tmp_path)})
    with pytest.raises(ConfigError, match="needs state pages"):
        WorkerConfig(**base).validate()
    with pytest.raises(ConfigError, match="must share the state pages too"):
        WorkerConfig(**base, num_states=4, caches={"kind": "cuda-ipc"}, backend="cuda").validate()
    with SharedCaches.create(spec, 8, num_states=4) as mine, pytest.raises(ConfigError, match="geometries differ"):
        SharedCaches.attach(spec, 8, mine.paths, num_states=2)
    assert not list(shm_directory().glob(f"kvstate-{os.getpid()}-*"))

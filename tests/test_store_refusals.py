"""Bad input at every store's public calls: a KVStateError naming the rule, and the pool as it
was (every object's bytes, every claim), for the three embedded stores alike."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import KVStateError
from kvstate.backends import FileStore, MemoryStore
from kvstate.backends._arena import ArenaStore

not_keys = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.binary(max_size=3), st.just([""]),
                     st.just([1]), st.just(["a", None]), st.just(["x" * 600]), st.just({"a": 1}))
not_buffers = st.one_of(st.none(), st.integers(), st.just("ab"), st.just([b"a", b"b"]), st.just([object()]),
                        st.just([np.zeros((4, 4), np.uint8)[:, 1]]))  # one key: too many, not bytes, strided


def stores(tmp_path):
    return {"memory": MemoryStore(1 << 20), "file": FileStore(str(tmp_path / "files")),
            "arena": ArenaStore.create(4096, 8, small_bytes=64, directory=tmp_path)}


def snapshot(store) -> tuple:
    keys = ["kept-0", "kept-1", "kept-2"]
    bufs = [bytearray(4096) for _ in keys]
    got = store.batch_get_into(keys, bufs)
    claimed = int((store.big.state == 1).sum()) if isinstance(store, ArenaStore) else 0
    return tuple(got), tuple(bytes(b) for b in bufs), claimed


CALLS = {
    "batch_put_from": lambda s, k, b: s.batch_put_from(k, b),
    "batch_get_into": lambda s, k, b: s.batch_get_into(k, b),
    "batch_is_exist": lambda s, k, b: s.batch_is_exist(k),
    "evict": lambda s, k, b: s.evict(k),
    "batch_put_hashed": lambda s, k, b: s.batch_put_hashed(k, b),
}
ARENA_CALLS = {
    "claim": lambda s, k, b: s.claim(k), "release": lambda s, k, b: s.release(k),
    "locate": lambda s, k, b: s.locate(k), "stage": lambda s, k, b: s.stage(k, b),
    "publish": lambda s, k, b: s.publish(k), "unchanged": lambda s, k, b: s.unchanged(k),
}


@pytest.mark.parametrize("kind", ["memory", "file", "arena"])
def test_bad_keys_or_buffers_are_refused_and_change_nothing(kind, tmp_path_factory):
    store = stores(tmp_path_factory.mktemp(kind))[kind]
    store.batch_put_from(["kept-0", "kept-1", "kept-2"], [bytes([i]) * 4096 for i in range(3)])
    calls = {**CALLS, **(ARENA_CALLS if kind == "arena" else {})}
    before = snapshot(store)

    @settings(max_examples=60, deadline=None, database=None)
    @given(name=st.sampled_from(sorted(calls)), keys=not_keys, buffers=not_buffers, good_keys=st.booleans())
    def check(name, keys, buffers, good_keys):
        if good_keys and name in ("batch_put_from", "batch_get_into", "batch_put_hashed", "stage"):
            keys = ["kept-0"]  # good keys, bad buffers
        elif good_keys:
            return
        with pytest.raises(KVStateError):
            calls[name](store, keys, buffers)
        assert snapshot(store) == before, name

    try:
        check()
    finally:
        store.close()

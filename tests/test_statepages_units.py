"""State pages' bookkeeping, each rule pinned to exact values: which checkpoints P keeps,
what a read and a write of a range move, the count a transfer's ranks resolve to, what a
release frees, and where a cached prefix may start."""
from __future__ import annotations

import re
from array import array

import pytest

from kvstate import BlockPool, CacheSpec, ConfigError, LayerGroup
from kvstate import commands as C
from kvstate._prefixcache import PrefixCachingPool
from kvstate._registry import PrefillRequest
from kvstate._statepages import StatePages, usable_count


def hybrid(*checkpoints: int, block_size: int = 4) -> CacheSpec:
    """A full layer and one state layer per checkpoint (in tokens)."""
    states = tuple(LayerGroup("state", (i + 1,), state_bytes=8, checkpoint=c) for i, c in enumerate(checkpoints))
    return CacheSpec(num_layers=1 + len(checkpoints), kv_heads=2, block_size=block_size, head_dim=8,
                     groups=(LayerGroup("full", (0,)), *states))


def request(tokens: int, keys: int = 0) -> PrefillRequest:
    return PrefillRequest("r", "new", array("I", range(tokens)), [f"k{i}" for i in range(keys)], None)


def test_a_spec_without_state_groups_has_no_pool_and_refuses_pages():
    plain = CacheSpec(num_layers=2, kv_heads=2, block_size=4, head_dim=8)
    sp = StatePages(plain, 0, "P", prefix_cache=False)
    assert sp.pool is None and not sp and sp.candidates(request(9), 0, 2, True) == ()
    with pytest.raises(ConfigError, match="^P: num_states 3, but the spec has no state group$"):
        StatePages(plain, 3, "P", prefix_cache=False)


def test_the_pool_caches_pages_only_with_the_prefix_cache():
    assert type(StatePages(hybrid(8), 4, "P", prefix_cache=False).pool) is BlockPool
    assert type(StatePages(hybrid(8), 4, "P", prefix_cache=True).pool) is PrefixCachingPool
    with pytest.raises(ConfigError, match=r"^P: the spec has state groups: give num_states >= 1 \(state pages\)$"):
        StatePages(hybrid(8), 0, "P", prefix_cache=False)


def test_checkpoints_of_groups_must_divide_each_other():
    message = "D: state groups checkpoint every 2 and 3 blocks: one must divide the other"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        StatePages(hybrid(8, 12), 4, "D", prefix_cache=False)
    assert StatePages(hybrid(8, 16), 4, "D", prefix_cache=False).step == 4  # every 4 blocks suits both


@pytest.mark.parametrize("tokens,checkpoint,keep,want", [
    (9, 4, 2, (1, 2)),  # 2 full blocks (the 9th token's block is its own), a checkpoint every block
    (9, 4, 1, (2,)),
    (17, 8, 2, (2, 4)),
    (16, 8, 3, (2,)),  # 15 tokens in full blocks: 3, down to the checkpoint at 2
    (5, 8, 2, ()),  # shorter than a checkpoint
])
def test_p_keeps_the_last_checkpoints_its_prompt_passes(tokens, checkpoint, keep, want):
    sp = StatePages(hybrid(checkpoint), 8, "P", prefix_cache=False, keep=keep)
    req = request(tokens)
    assert sp.snapshots(req) == want and sp.pages_for(req) == 1 + len(want)


def test_a_read_moves_every_checkpoint_past_its_start_and_a_whole_cache_s_end():
    sp = StatePages(hybrid(8), 8, "D", prefix_cache=False)
    req = request(30)
    req.pages = [5]
    assert sp.candidates(req, 0, 5, False) == ((2, 5), (4, 5))
    assert sp.candidates(req, 0, 5, True) == ((2, 5), (4, 5), (5, 5))
    assert sp.candidates(req, 1, 4, True) == ((1, 5), (3, 5))  # its end is a checkpoint: once
    assert sp.candidates(req, 1, 5, True) == ((1, 5), (3, 5), (4, 5))  # relative to the start
    assert sp.candidates(req, 3, 3, True) == ()  # nothing read, nothing moved


def test_a_write_stores_the_checkpoints_past_its_base_then_the_running_state():
    sp = StatePages(hybrid(8), 8, "P", prefix_cache=False, keep=3)
    req = request(30)
    req.snaps, req.pages = (2, 4, 6), [7, 8, 9, 10]
    assert sp.written(req, 0, 7) == ((2, 8), (4, 9), (6, 10), (7, 7))
    assert sp.written(req, 2, 6) == ((2, 9), (4, 7))  # relative to the base; 2 is not past it, 6 is the end
    assert sp.written(req, 6, 6) == ()


def test_a_transfer_s_ranks_resolve_to_a_state_s_end():
    cmd = C.WriteBlocks("r", 1, (0, 1), 1e9, ("a", "b", "c", "d", "e"), (0, 1, 2, 3, 4), states=((2, 0), (4, 0)))
    assert usable_count(cmd, {0: 3, 1: 5}, reads=False) == 2  # floored to 2 and 4: the least
    assert usable_count(cmd, {0: 3, 1: 5}, reads=True) == 0  # a read whose ranks differ moved nothing usable
    assert usable_count(cmd, {0: 4, 1: 5}, reads=True) == 4
    assert usable_count(cmd, {0: 1}, reads=False) == 0
    assert usable_count(cmd, {}, reads=False) == 0


def test_a_release_frees_the_request_s_pages_and_the_page_it_started_from():
    sp = StatePages(hybrid(4), 4, "P", prefix_cache=True)
    pool = sp.pool
    assert isinstance(pool, PrefixCachingPool)
    (cached,) = pool.allocate(1)
    pool.publish(("k0",), (cached,))
    pool.release((cached,))  # published and idle: a later prompt may start from it
    blocks = PrefixCachingPool(8)
    held = blocks.allocate(2)
    blocks.publish(("k0", "k1"), held)
    req = request(12, keys=3)
    assert sp.claim_start(req, ["k0", "k1", "k2"], blocks) == 1 and req.from_page == cached
    assert sp.take(req, 2)
    assert sp.release(req) == 3 and req.pages == [] and req.from_page == -1
    assert sp.let_go_of_start(req) == 0  # nothing claimed any more


def test_a_cached_prefix_starts_at_the_last_checkpoint_whose_state_is_cached():
    sp = StatePages(hybrid(8), 4, "P", prefix_cache=True)
    pool = sp.pool
    assert isinstance(pool, PrefixCachingPool)
    blocks = PrefixCachingPool(16)
    keys = [f"k{i}" for i in range(6)]
    blocks.publish(keys[:5], blocks.allocate(5))  # five blocks cached
    page = pool.allocate(1)
    pool.publish(("k1",), page)  # the state after 2 blocks, not after 4
    pool.release(page)
    req = request(30, keys=6)
    assert sp.claim_start(req, keys, blocks) == 2 and req.from_page == page[0]
    again = request(30, keys=6)  # the page is held (by req) now, not idle: still a start
    assert sp.claim_start(again, keys, blocks) == 2 and again.from_page == page[0]
    none = request(30, keys=6)
    assert sp.claim_start(none, ["x"] + keys[1:], blocks) == 0 and none.from_page == -1
    assert StatePages(hybrid(8), 4, "P", prefix_cache=False).claim_start(request(30), keys, blocks) == 0


def test_publishing_records_each_checkpoint_s_page_under_its_block_s_key():
    sp = StatePages(hybrid(4), 8, "P", prefix_cache=True, keep=2)
    pool = sp.pool
    assert isinstance(pool, PrefixCachingPool)
    req = request(13, keys=4)
    req.snaps = sp.snapshots(req)
    assert req.snaps == (2, 3) and sp.take(req, 3)
    sp.publish(req)
    assert pool.cached_blocks() == {"k1": req.pages[1], "k2": req.pages[2]}
    plain = StatePages(hybrid(4), 8, "P", prefix_cache=False)
    other = request(13, keys=4)
    other.snaps = (2,)
    assert plain.take(other, 2)
    plain.publish(other)  # no prefix cache: nothing published, nothing raised
    assert other.pages and other.from_page == -1

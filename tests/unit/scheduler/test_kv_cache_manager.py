"""KVCacheManager: block tables, prefix hits, sharing and eviction."""

from services.common.proto.meshserve.v1 import sampling_pb2
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, sampling_pb2.SamplingParams(), [], max_tokens=8)


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    """Prefix lookup + allocation for the whole prompt, as the scheduler does it."""
    hits, num_hit = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
    assert ids is not None
    r.num_computed_tokens = r.num_tokens
    return ids


def test_allocation_covers_tokens_and_fails_when_short() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True, max_model_len=64)
    r = req("a", list(range(9)))
    assert kv.allocate_slots(r, 9) == [0, 1, 2]
    r.num_computed_tokens = 9
    # One more token still fits in block 2; four more need a new block.
    assert kv.allocate_slots(r, 1) == []
    assert kv.allocate_slots(r, 4) == [3]
    assert kv.allocate_slots(r, 8) is None
    assert kv.block_ids(r) == [0, 1, 2, 3]


def test_freed_prefix_is_reused_by_a_later_request() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, max_model_len=64)
    a = req("a", list(range(10)))
    a_ids = admit(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 8
    b = req("b", [*range(8), 99, 98, 97])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert [h.block_id for h in hits] == a_ids[:2]
    new_ids = kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert new_ids is not None
    assert new_ids[:2] == a_ids[:2]
    assert len(new_ids) == 3
    kv.record_prefix_lookup(b.num_tokens, num_hit)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (11, 8)


def test_hit_is_capped_below_num_tokens() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, max_model_len=64)
    a = req("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    # The whole prompt is cached, but the last token must be computed: only the first block hits.
    _, num_hit = kv.get_computed_blocks(req("b", list(range(8))))
    assert num_hit == 4
    _, num_hit = kv.get_computed_blocks(req("c", list(range(9))))
    assert num_hit == 8


def test_no_hits_when_caching_disabled() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False, max_model_len=64)
    a = req("a", list(range(10)))
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", list(range(10)))) == ([], 0)


def test_two_requests_share_prefix_blocks_with_ref_counts() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, max_model_len=64)
    a = req("a", list(range(10)))
    b = req("b", list(range(10)))
    admit(kv, a)
    admit(kv, b)
    shared = kv.block_ids(a)[:2]
    assert kv.block_ids(b)[:2] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert kv.pool.num_free_blocks == 8 - 4
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    assert kv.pool.num_cached_free_blocks == 2


def test_output_tokens_are_hashed_for_continuations() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, max_model_len=64)
    a = req("a", list(range(6)))
    admit(kv, a)
    # Two decodes: token 6 and 7 fill the second block.
    for t in (50, 51):
        a.output_token_ids.append(t)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    kv.free(a)
    follow_up = req("b", [*range(6), 50, 51, 7, 7])
    _, num_hit = kv.get_computed_blocks(follow_up)
    assert num_hit == 8


def test_lru_evicts_tail_of_a_freed_sequence_first() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True, max_model_len=64)
    a = req("a", list(range(12)))
    admit(kv, a)
    kv.free(a)
    # One fresh block is needed: the freed sequence's last block goes, its prefix stays.
    other = req("x", [7] * 3)
    assert kv.allocate_slots(other, 3) == [2]
    _, num_hit = kv.get_computed_blocks(req("b", list(range(12))))
    assert num_hit == 8


def test_hit_on_free_blocks_counts_against_free_space() -> None:
    kv = KVCacheManager(3, BS, enable_prefix_caching=True, max_model_len=64)
    a = req("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    # b hits block 0 (free); it then needs 3 more blocks but only 2 others are free.
    b = req("b", [*range(4), 9, 9, 9, 9, 9, 9, 9, 9, 9])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert kv.pool.num_free_blocks == 3
    assert hits[0].ref_cnt == 0


def test_can_ever_fit() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True, max_model_len=64)
    assert kv.can_ever_fit(16)
    assert not kv.can_ever_fit(17)

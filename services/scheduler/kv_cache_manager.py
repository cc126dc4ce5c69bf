"""Per-request block tables of one worker on top of its BlockPool, with prefix caching."""

from __future__ import annotations

from services.scheduler.block_pool import Block, BlockPool
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees the KV blocks of requests running on one worker."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, max_model_len: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[Block]] = {}
        # Leading blocks of each request whose hashes were already registered.
        self._num_cached: dict[str, int] = {}
        # Blocks indexed since take_newly_cached(); their KV is written by the step in flight.
        self._newly_cached: list[Block] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks, leaving at least the last token to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = request.get_block_hashes(self.block_size)
        max_hit_blocks = request.max_reusable_blocks(self.block_size)
        hits: list[Block] = []
        for h in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (called once per admission, not per attempt)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[Block] | None = None,
        index: bool = True,
    ) -> list[int] | None:
        """Grow the request's table to hold num_new_tokens more; new block ids, or None if short.

        index=False: the new blocks are to be loaded from the kvstore, so their hashes are registered only
        once the load says which arrived (cache_loaded); until then no other request may hit them."""
        computed = new_computed_blocks or []
        table = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {request.request_id}: {total} tokens exceed max_model_len {self.max_model_len}")
        num_needed = max(0, cdiv(total, self.block_size) - len(table) - len(computed))
        # Hit blocks sitting on the free list stop being allocatable once touched.
        num_evictable = self.pool.num_free_blocks - sum(1 for b in computed if b.ref_cnt == 0)
        if num_needed > num_evictable:
            return None
        self.pool.touch(computed)
        new_blocks = computed + self.pool.allocate(num_needed)
        table.extend(new_blocks)
        self._blocks[request.request_id] = table
        if index:
            self._cache_blocks(request, min(total, request.num_tokens))
        else:
            self._num_cached.setdefault(request.request_id, len(computed))
        return [b.block_id for b in new_blocks]

    def cache_loaded(self, request: Request, num_full_blocks: int) -> None:
        """Register the hashes of the request's first num_full_blocks blocks, whose KV a load just wrote.

        Not added to take_newly_cached(): those blocks came from the store and need no saving."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        before = self._num_cached.get(rid, 0)
        if num_full_blocks > before:
            hashes = request.get_block_hashes(self.block_size)
            for block in self.pool.cache_full_blocks(self._blocks[rid], hashes, before, num_full_blocks):
                block.saved = True
            self._num_cached[rid] = num_full_blocks

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        before = self._num_cached.get(rid, 0)
        if num_full <= before:
            return
        hashes = request.get_block_hashes(self.block_size)
        self._newly_cached += self.pool.cache_full_blocks(self._blocks[rid], hashes, before, num_full)
        self._num_cached[rid] = num_full

    def take_newly_cached(self) -> list[Block]:
        """Blocks indexed since the last call (the scheduler un-indexes them if the step fails)."""
        out, self._newly_cached = self._newly_cached, []
        return out

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so a prefix outlives its suffix in the cache."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self._blocks.get(request.request_id, [])]

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens fits in the whole pool."""
        return num_tokens <= self.max_model_len and cdiv(num_tokens, self.block_size) <= self.num_blocks

    def reset(self) -> None:
        """Forget every request and cached prefix (the worker is gone)."""
        self.pool.reset()
        self._blocks.clear()
        self._num_cached.clear()
        self._newly_cached.clear()

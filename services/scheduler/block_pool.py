"""KV block pool of one worker: ref counts, an LRU free list and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """One KV block on the worker; block_hash is set only while the hash map points at it."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # A save of this content to the kvstore was sent (or it came from the store): nothing to save on reuse.
    saved: bool = False


class BlockPool:
    """Hands out blocks; freed hashed blocks stay findable by hash until evicted in LRU order."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.reset()

    def reset(self) -> None:
        """Every block free and uncached (at start, and when the worker is gone)."""
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Insertion order is eviction order: head = least recently freed.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self._num_cached_free = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_cached_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks (in use or free) findable by hash."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache (pulling free ones off the free list)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """n fresh blocks from the LRU head, evicting whatever prefix they held."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out: list[Block] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._num_cached_free -= 1
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching zero join the free-list tail in the given order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def cache_full_blocks(
        self,
        request_blocks: Sequence[Block],
        block_hashes: Sequence[bytes],
        num_cached_before: int,
        num_full: int,
    ) -> list[Block]:
        """Register hashes of request_blocks[num_cached_before:num_full]; returns blocks newly indexed."""
        if not self.enable_caching:
            return []
        newly: list[Block] = []
        for i in range(num_cached_before, num_full):
            block = request_blocks[i]
            if block.block_hash is not None:
                continue  # a prefix hit: already indexed
            h = block_hashes[i]
            if h in self._cached:
                continue  # another block holds the same content; keep the first one
            block.block_hash = h
            self._cached[h] = block
            newly.append(block)
        return newly

    def uncache(self, blocks: Iterable[Block]) -> None:
        """Forget the hashes of blocks whose KV turned out not to be written (a failed step)."""
        for block in blocks:
            if block.block_hash is None:
                continue
            if block.ref_cnt == 0:
                self._num_cached_free -= 1
            self._evict(block)

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.saved = False

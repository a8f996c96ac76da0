"""Paged KV cache bookkeeping: which blocks are free, which sequences hold which blocks, and the prefix
cache (automatic prefix caching, on by default as in vLLM).

The design is vLLM V1's (vllm-project/vllm: vllm/v1/core/kv_cache_manager.py at commit
ace980e6de0540f49b0c63248437a1a7807590c1, vllm/v1/core/block_pool.py at c59cb7941357443da7c5eef75cfa8697d683d228,
vllm/v1/core/kv_cache_utils.py at 001cabc1be16a59a70d720ed61a13b678c060a18):

- A block full of computed tokens whose ids the host knows (a pending token's is not known yet) is
  registered under its chained hash (block_hash.py): prompt blocks and generated ones alike.
- Blocks are reference-counted. Sequences whose prompts share a cached prefix share its blocks; a block
  is free once its last holder lets go.
- A free cached block keeps its hash and contents until it is handed out again. The free queue is the
  eviction order: least recently freed first; a sequence's blocks go in last block first, so that a
  prefix is evicted from its end; blocks without a hash go to the front (nothing is lost with them).
  Finding a free cached block takes it off the queue.
- At admission a sequence takes the longest cached prefix of its tokens in whole blocks, never all of
  them: the last token is always computed, for its logits. Sequences that ask for prompt logprobs do not
  read the cache (those need every prompt token's logits), though their blocks are cached.

Unlike vLLM, a block is registered only once its tokens have been computed (here: at the next schedule,
or when it is freed), never while the step that computes them is being scheduled, and a block whose hash
another block holds already stays unregistered (vLLM keeps both).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .block_hash import hash_block, root
from .sequence import Sequence


@dataclass
class PrefixCacheStats:
    """Cumulative tokens of new requests queried in the prefix cache and found there (vLLM's
    PrefixCacheStats, vllm/v1/metrics/stats.py: a preempted sequence's second look is not counted, nor is
    a request that does not read the cache)."""

    queries: int = 0
    hits: int = 0

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.queries += num_tokens
        self.hits += num_hits


def reads_prefix_cache(seq: Sequence) -> bool:
    """Whether `seq` may start from cached blocks: not where it wants prompt logprobs, which need the
    logits of every prompt token (vLLM's skip_reading_prefix_cache)."""
    return seq.params.prompt_logprobs is None


class BlockManager:
    """`num_blocks` blocks of `block_size` token slots each; a sequence holds ceil(tokens / block_size)
    blocks, listed in order in its `block_table`. enable_caching: the prefix cache (module docstring);
    without it, blocks are never shared and a freed block forgets its contents."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks, block_size: expected >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()
        self._refs = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> the block that holds it
        # The free blocks in eviction order, first out first; an OrderedDict takes a block out of the
        # middle (a cache hit) in O(1), as vLLM's linked FreeKVCacheBlockQueue does.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # ------------------------------------------------------------------ state
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are evicted when needed)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks that sequences hold, 0..1 (vllm:kv_cache_usage_perc; cached free blocks
        count as free, as in vLLM)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._refs[block]

    def free_queue(self) -> list[int]:
        """The free blocks in eviction order (the next one handed out first)."""
        return list(self._free)

    # ------------------------------------------------------------------ growing
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `seq` can hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` the blocks it needs to hold `num_tokens` tokens (evicting cached free blocks first
        in the queue)."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV cache: {need} blocks needed, {len(self._free)} free")
        seq.block_table.extend(self._take_free() for _ in range(need))

    # ------------------------------------------------------------------ the prefix cache
    def lookup(self, seq: Sequence) -> list[int] | None:
        """The cached blocks of the longest prefix of `seq`'s tokens, in whole blocks and short of its
        last token (its logits are needed), taking nothing yet; None where the cache is not read (off, or
        the sequence wants prompt logprobs). `seq` holds no blocks (it is waiting)."""
        if not self.enable_caching or not reads_prefix_cache(seq):
            return None
        limit = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._block_hashes(seq, limit):
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Whether `seq` can take the cached blocks `hits` (lookup) and grow to hold `num_tokens` tokens:
        hits on free blocks come off the free queue, so they count against it too."""
        revived = sum(self._refs[b] == 0 for b in hits)
        return -(-num_tokens // self.block_size) - len(hits) + revived <= len(self._free)

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Start `seq` (holding no blocks) on the cached blocks `hits`, whose tokens it then need not
        compute, and grow it to hold `num_tokens` tokens."""
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id!r}: admitted while holding blocks {seq.block_table}")
        for block in hits:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        seq.block_table = list(hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.grow(seq, num_tokens)

    def cache_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that have become full of computed, known tokens since the last call."""
        if not self.enable_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending) // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            block, block_hash = seq.block_table[i], hashes[i]
            if self._hashes[block] is None and block_hash not in self._cached:
                self._hashes[block] = block_hash
                self._cached[block_hash] = block
        seq.num_cached_blocks = full

    def reset(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache: after new weights, or between benchmark
        runs); only when no sequence holds a block, else False and nothing changes."""
        if any(self._refs):
            return False
        self._cached.clear()
        self._hashes = [None] * self.num_blocks
        return True

    # ------------------------------------------------------------------ freeing
    def free(self, seq: Sequence) -> None:
        """Let go of all of `seq`'s blocks (a finished, aborted or preempted sequence), caching its full
        computed blocks first; blocks nobody else holds join the free queue. A sequence already let go of
        (a request that failed after its release) holds nothing: nothing happens."""
        if not seq.block_table:
            return
        self.cache_blocks(seq)
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._hashes[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0

    # ------------------------------------------------------------------ helpers
    def _take_free(self) -> int:
        """The first block of the free queue, evicted from the cache if it was there, held once."""
        block, _ = self._free.popitem(last=False)
        block_hash = self._hashes[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block] = None
        self._refs[block] = 1
        return block

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """`seq`'s chained block hashes, at most `num_blocks` and only over known tokens (computed once,
        kept on the sequence)."""
        hashes, bs = seq.block_hashes, self.block_size
        known = min(num_blocks, (seq.num_tokens - seq.num_pending) // bs)
        while len(hashes) < known:
            i = len(hashes)
            parent = hashes[-1] if hashes else root(seq.params.cache_salt)
            hashes.append(hash_block(parent, seq.token_ids(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]

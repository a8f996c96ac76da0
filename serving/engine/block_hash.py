"""Chained hashes of full KV blocks: the keys of the prefix cache (block_manager.py).

A block's hash covers its token ids and, through its parent's hash, every token before it, so equal
hashes mean equal prefixes up to the block's end, and a change in an earlier block changes every later
hash. This is vLLM V1's scheme (vllm/v1/core/kv_cache_utils.py, `hash_block_tokens`, at commit
001cabc1be16a59a70d720ed61a13b678c060a18); the encoding and the seed are ours.

The hash is SHA-256 of a canonical encoding: the parent's 32-byte digest, then the block's token ids as
little-endian uint32. The cache hands out KV for a hash without comparing tokens, so a collision would
serve one prompt's KV to another; SHA-256 makes that infeasible even for prompts crafted to collide,
which Python's `hash()` (64 bits, not collision-resistant, seeded per process) does not. Fixed-width
fields and a fixed block size make the encoding unambiguous. The first block's parent is a fixed seed
(ROOT), not a random one as vLLM draws: hashes never leave a rank, and fixed ones make runs reproducible.
Hashing a 16-token block takes about a microsecond on the host.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = hashlib.sha256(b"ep-layer prefix cache: the parent of a sequence's first block").digest()


def root(cache_salt: str | None) -> bytes:
    """The parent of a sequence's first block: ROOT, or for a salted request ROOT hashed with its salt (vLLM's
    cache_salt, which it mixes into the first block's hash), so that only requests of one salt share blocks."""
    if cache_salt is None:
        return ROOT
    return hashlib.sha256(ROOT + b"cache_salt" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block of `token_ids` whose preceding blocks hash to `parent` (ROOT for the first)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()

"""Attention over the paged latent KV cache (MLA in its absorbed form: one shared 576-wide key per
token for V3, whose first kv_lora_rank values are also the value).

Cache layout: one tensor [num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; a
token's entry is [c_kv (the kv_a_layernorm'd latent) | k_pe (its RoPE'd shared key, de-interleaved
as serving.models.rotary lays it out)]; slot s is block s // block_size, offset s % block_size.

Two layouts of a step's metadata, both plain PyTorch and correct on CPU and GPU:
- `TokenMetadata` (any batch whose ForwardBatch.token_seqs is given): each new token reads its own
  sequence's keys up to its position, located on the device from the token's block table row and
  position. Nothing is read on the host, so any step (prefill chunks and decodes mixed, padding tokens
  included) can be captured in a CUDA graph. On a GPU with Triton, serving.models.mla_decode_triton
  reads each token's own keys (flash-decoding over its block table): one kernel for prefill and decode
  alike. Elsewhere every token reads its sequence's whole block table with the keys past its position
  masked (max_blocks_per_seq * block_size keys, whatever its position). In an eager step (the engine's host
  layout given too), `TokenMetadata.prompts` names its long prompt chunks, which MLAttention attends as blocks.
- `AttentionMetadata` (a batch without token_seqs), which reads and checks the batch layout on the host
  (the engine's copy of it, else the device's, which waits for the device). A sequence with several new
  tokens attends on its own, as matrix products over chunks of its rows (PROMPT_SCORE_ELEMENTS scores at
  most); those with one new token attend together, as a
  TokenMetadata batch, so that a step mixing a new prompt into many decodes costs about what its prompt
  does, not a sequence's kernels for each decode.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..forward_batch import ForwardBatch, HostLayout, to_device
from . import mla_decode_triton

# The longest block table (in keys) the padded PyTorch token layout reads for each token: beyond it,
# without the Triton kernel, tokens attend one sequence at a time over their own keys only.
PADDED_DECODE_MAX_KEYS = 4096
# The most scores (query rows x heads x keys) a sequence's attention holds at once: its new tokens attend in chunks
# of rows, so that a step of a long prompt (a large --max-num-batched-tokens) needs a bounded few hundred MB for its
# scores and their softmax instead of tens of GB (an 8k-token prompt's whole [8k, 128, 8k]).
PROMPT_SCORE_ELEMENTS = 1 << 26
# In an eager step with the per-token layout (a GPU's), a sequence with at least this many new tokens attends as a
# block, in MLA's expanded form (serving.models.mla.prompt_attention): its keys expanded once per head serve all of
# its new tokens, where the per-token kernel reads every key once per token.
PROMPT_BLOCK_MIN_TOKENS = 64
# The most expanded key and value elements such a block holds at once: its heads go in groups, so that a chunk deep
# into a long context (DeepSeek-V3's 128 heads of 192 + 192 values over 64k keys: 6 GB at once) takes a bounded
# 256 MB in bf16.
PROMPT_BLOCK_KV_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class SequenceSlots:
    """One sequence of the step: its new tokens [start, end) of the flat batch; `slots` int64 [L] are
    the cache slots of its positions 0..L-1; `visible` bool [end - start, L]: key j <= query position."""

    start: int
    end: int
    slots: torch.Tensor
    visible: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens read and write the cache; built once per step, shared by every layer.
    `decode`: the sequences with one new token, as a TokenMetadata batch whose tokens are rows `decode_rows` of
    the flat batch (None if there are none, or where a decode batch would read every sequence's whole block
    table: no Triton kernel and more than PADDED_DECODE_MAX_KEYS); `sequences`: the others, one at a time."""

    slot_mapping: torch.Tensor
    sequences: tuple[SequenceSlots, ...]
    decode: TokenMetadata | None = None
    decode_rows: torch.Tensor | None = None

    @classmethod
    def from_batch(cls, batch: ForwardBatch, block_size: int, num_blocks: int) -> AttentionMetadata:
        layout = batch.host_layout
        if layout is None:  # copies back from the device (which waits for it)
            layout = HostLayout(batch.query_start.tolist(), batch.seq_lens.tolist(), batch.block_tables.tolist())
        starts, lens, tables = layout.query_start, layout.seq_lens, layout.block_tables
        device = batch.positions.device
        if starts[0] != 0 or starts[-1] != batch.num_tokens:
            raise ValueError(f"batch.query_start: expected to run from 0 to num_tokens={batch.num_tokens}, "
                             f"got {starts[0]} ... {starts[-1]}")
        # Where a decode batch is cheap: the Triton kernel reads each sequence's own keys, the padded layout
        # the whole block table.
        batch_decodes = ((device.type == "cuda" and mla_decode_triton.available())
                         or batch.block_tables.shape[1] * block_size <= PADDED_DECODE_MAX_KEYS)
        sequences = []
        single: list[int] = []  # sequences with one new token, attending as a decode batch
        for i, seq_len in enumerate(lens):
            start, end = starts[i], starts[i + 1]
            if not 0 <= start <= end or end - start > seq_len:
                raise ValueError(f"batch: sequence {i} has tokens [{start}, {end}) of the flat batch but "
                                 f"seq_lens[{i}]={seq_len}; expected 0 <= start <= end and end - start <= seq_len")
            needed = -(-seq_len // block_size)
            if needed > batch.block_tables.shape[1]:
                raise ValueError(f"batch: sequence {i} has {seq_len} tokens, {needed} blocks of {block_size}, "
                                 f"but block_tables has {batch.block_tables.shape[1]} columns")
            if not all(0 <= b < num_blocks for b in tables[i][:needed]):
                raise ValueError(f"batch: block_tables[{i}][:{needed}] = {tables[i][:needed]}; expected block ids "
                                 f"in [0, {num_blocks}) for the {seq_len} tokens of sequence {i}")
            if end - start == 1 and batch_decodes:
                single.append(i)
                continue
            blocks = batch.block_tables[i, :needed].long()
            pos = torch.arange(seq_len, device=device)
            slots = blocks[pos // block_size] * block_size + pos % block_size
            visible = pos[None, :] <= batch.positions[start:end, None]
            sequences.append(SequenceSlots(start, end, slots, visible))
        if not single:
            return cls(batch.slot_mapping, tuple(sequences))
        # A single new token is its sequence's last (position seq_len - 1): what a decode batch holds.
        index = to_device(single + [starts[i] for i in single], torch.int64, device).view(2, -1)
        seqs, rows = index[0], index[1]
        decode = TokenMetadata(batch.slot_mapping[rows], batch.block_tables[seqs], batch.seq_lens[seqs], block_size)
        return cls(batch.slot_mapping, tuple(sequences), decode, rows)


@dataclass(frozen=True)
class PromptChunk:
    """A sequence's new tokens [start, end) of the flat batch, the last of its keys: `slots` int64 [L] are the cache
    slots of its positions 0..L-1 (L - (end - start) keys before the chunk, then the chunk's own)."""

    start: int
    end: int
    slots: torch.Tensor


@dataclass(frozen=True)
class PromptBlocks:
    """An eager step's long prompt chunks (PROMPT_BLOCK_MIN_TOKENS new tokens or more), each attending as a block;
    the step's other rows (`rows`, int64; None if there are none) attend per token with `others`."""

    chunks: tuple[PromptChunk, ...]
    rows: torch.Tensor | None
    others: TokenMetadata | None


@dataclass(frozen=True)
class TokenMetadata:
    """Row t (a new token) attends to keys [0, key_counts[t]) of its own block table, read on the device
    only: block_tables int32 [T, max_blocks] (-1 past the sequence's blocks), key_counts int32 [T].
    `prompts`: in an eager step (the engine's host layout given), its long prompt chunks, which attend as blocks
    instead (MLAttention), and the per-token metadata of the other rows."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    key_counts: torch.Tensor
    block_size: int
    prompts: PromptBlocks | None = None

    @classmethod
    def from_batch(cls, batch: ForwardBatch, block_size: int) -> TokenMetadata:
        """Each token's block table (its sequence's row, gathered on the device) and its key count (its
        position + 1: the keys before it and its own, written to the cache first); with the host layout, the
        long prompt chunks as blocks."""
        if batch.token_seqs is None:
            raise ValueError("batch.token_seqs: TokenMetadata needs each token's sequence (got None)")
        meta = cls(batch.slot_mapping, batch.block_tables.index_select(0, batch.token_seqs),
                   (batch.positions + 1).to(torch.int32), block_size)
        layout = batch.host_layout
        if layout is None:
            return meta
        starts, lens = layout.query_start, layout.seq_lens
        if not any(starts[i + 1] - starts[i] >= PROMPT_BLOCK_MIN_TOKENS for i in range(len(lens))):
            return meta
        device = batch.positions.device
        chunks, others = [], []
        for i, seq_len in enumerate(lens):
            start, end = starts[i], starts[i + 1]
            if end - start < PROMPT_BLOCK_MIN_TOKENS:
                others.extend(range(start, end))
                continue
            pos = torch.arange(seq_len, device=device)
            blocks = batch.block_tables[i, :-(-seq_len // block_size)].long()
            chunks.append(PromptChunk(start, end, blocks[pos // block_size] * block_size + pos % block_size))
        if not others:
            return dataclasses.replace(meta, prompts=PromptBlocks(tuple(chunks), None, None))
        rows = to_device(others, torch.int64, device)
        rest = cls(meta.slot_mapping[rows], meta.block_tables[rows], meta.key_counts[rows], block_size)
        return dataclasses.replace(meta, prompts=PromptBlocks(tuple(chunks), rows, rest))

    def padded_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots int64 [T, L], visible bool [T, L]): the cache slot of every position the block tables
        cover (L = max_blocks * block_size; -1 entries read block 0) and whether it is < the key count."""
        offsets = torch.arange(self.block_size, device=self.block_tables.device)
        slots = (self.block_tables.clamp(min=0).long()[:, :, None] * self.block_size + offsets).flatten(1)
        visible = torch.arange(slots.shape[1], device=slots.device)[None, :] < self.key_counts[:, None]
        return slots, visible


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
    """Store each new token's cache entry [T, D] at its slot of one layer's cache [num_blocks, block_size, D]."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, entries.to(cache.dtype))


def paged_mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata | TokenMetadata, scale: float) -> torch.Tensor:
    """Latent attention output [T, H, kv_lora_rank] for queries [q_latent | q_pe] (q_latent [T, H, kv_lora_rank]:
    q_nope absorbed into W_UK, q_pe [T, H, rope]) against one layer's cache [num_blocks, block_size, kv_lora_rank +
    rope]: softmax(q . key * scale) . c_kv. The Triton decode kernel reads the two parts where they are."""
    kv_lora_rank = q_latent.shape[-1]
    flat = cache.view(-1, cache.shape[-1])
    if isinstance(meta, AttentionMetadata):
        out = q_latent.new_empty(q_latent.shape[0], q_latent.shape[1], kv_lora_rank)
        if meta.decode is not None:
            rows = meta.decode_rows
            out[rows] = paged_mla_attention(q_latent[rows], q_pe[rows], cache, meta.decode, scale)
        if meta.sequences:
            q = torch.cat([q_latent, q_pe], dim=-1)
        for seq in meta.sequences:
            if seq.end == seq.start:
                continue
            keys = flat[seq.slots].to(q.dtype)  # [L, D]
            rows = max(1, PROMPT_SCORE_ELEMENTS // (q.shape[1] * keys.shape[0]))
            for start in range(seq.start, seq.end, rows):
                end = min(start + rows, seq.end)
                scores = torch.matmul(q[start:end], keys.t()) * scale  # [rows, H, L]
                scores = scores.masked_fill(~seq.visible[start - seq.start:end - seq.start, None, :], float("-inf"))
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                out[start:end] = torch.matmul(probs, keys[:, :kv_lora_rank])
        return out
    if q_latent.is_cuda and mla_decode_triton.available() and mla_decode_triton.supports(kv_lora_rank, q_pe.shape[-1]):
        return mla_decode_triton.mla_decode(q_latent, q_pe, cache, meta.block_tables, meta.key_counts, scale)
    q = torch.cat([q_latent, q_pe], dim=-1)
    slots, visible = meta.padded_slots()
    keys = flat[slots].to(q.dtype)  # [B, L, D]
    scores = torch.einsum("bhd,bld->bhl", q, keys) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhl,blc->bhc", probs, keys[..., :kv_lora_rank])

"""Paged MLA attention of a step that mixes prompts and decodes (serving.models.paged_attention): the
sequences with one new token attend together as a decode batch, the others one at a time; every
output row against float64 attention computed from the cache directly, on CPU and on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from serving.forward_batch import ForwardBatch, HostLayout
from serving.models import mla_decode_triton, paged_attention
from serving.models.paged_attention import PADDED_DECODE_MAX_KEYS, AttentionMetadata, paged_mla_attention

BLOCK_SIZE, NUM_BLOCKS = 4, 64
# (tokens in the cache after the step, new tokens): decodes at several lengths (one is the sequence's
# first token), a whole prompt and a prompt's later chunk.
SEQUENCES = [(9, 1), (1, 1), (6, 6), (17, 1), (13, 5), (4, 1)]


WIDTHS = [(4, 64, 32), (3, 32, 8)]  # (heads, kv_lora_rank, rope): the tiny model's; narrower than the kernel takes


def mixed_batch(device: str, gen: torch.Generator) -> ForwardBatch:
    """SEQUENCES on random, scattered blocks (block tables padded with -1)."""
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-length // BLOCK_SIZE) for length, _ in SEQUENCES) + 1
    positions, slots, starts, tables = [], [], [0], []
    for length, new in SEQUENCES:
        table = [blocks.pop() for _ in range(-(-length // BLOCK_SIZE))]
        tables.append(table + [-1] * (width - len(table)))
        for p in range(length - new, length):
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        starts.append(starts[-1] + new)
    i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
    return ForwardBatch(torch.zeros(len(positions), **i64), torch.tensor(positions, **i64),
                        torch.tensor(starts, **i32), torch.tensor([n for n, _ in SEQUENCES], **i32),
                        torch.tensor(tables, **i32), torch.tensor(slots, **i64), torch.tensor(starts[1:], **i64) - 1)


def float64_attention(q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, scale: float,
                      lora: int) -> torch.Tensor:
    """Each new token against its sequence's cache entries at positions up to its own, in float64."""
    flat, tables = cache.double().view(-1, cache.shape[-1]), batch.block_tables.tolist()
    out, row = [], 0
    for i, (length, new) in enumerate(SEQUENCES):
        keys = torch.stack([flat[tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] for p in range(length)])
        for p in range(length - new, length):
            scores = torch.einsum("hd,ld->hl", q[row].double(), keys[:p + 1]) * scale
            out.append(torch.softmax(scores, dim=-1) @ keys[:p + 1, :lora])
            row += 1
    return torch.stack(out)


def check_mixed_step(device: str, dtype: torch.dtype, atol: float, heads: int, lora: int, rope: int) -> None:
    gen = torch.Generator().manual_seed(7)
    batch = mixed_batch(device, gen)
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, lora + rope, generator=gen).to(device, dtype)
    q = torch.randn(batch.num_tokens, heads, lora + rope, generator=gen).to(device, dtype)
    meta = AttentionMetadata.from_batch(batch, BLOCK_SIZE, NUM_BLOCKS)
    singles = [i for i, (_, new) in enumerate(SEQUENCES) if new == 1]
    assert meta.decode is not None and len(meta.sequences) == len(SEQUENCES) - len(singles)
    assert meta.decode_rows.tolist() == batch.query_start[singles].tolist()
    scale = (lora + rope) ** -0.5
    got = paged_mla_attention(q[..., :lora], q[..., lora:], cache, meta, scale)
    torch.testing.assert_close(got.double().cpu(), float64_attention(q.cpu(), cache.cpu(), batch, scale, lora),
                               rtol=0, atol=atol)


@pytest.mark.parametrize("widths", WIDTHS)
def test_mixed_step_matches_float64_on_cpu(widths: tuple[int, int, int]) -> None:
    check_mixed_step("cpu", torch.float32, 1e-5, *widths)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_long_prompt_attends_in_chunks_of_rows(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """With room for the scores of `rows` query rows against the longest sequence, each prompt attends in chunks
    (unevenly where rows = 2; more rows at once for shorter sequences), no chunk's scores exceed that room, and
    every output row still matches float64."""
    heads, lora, rope = WIDTHS[0]
    limit = rows * heads * max(length for length, _ in SEQUENCES)
    monkeypatch.setattr(paged_attention, "PROMPT_SCORE_ELEMENTS", limit)
    products: list[torch.Tensor] = []  # a chunk's scores, then its output (the prompts' only matmuls)
    matmul = torch.matmul

    def recorded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        products.append(matmul(a, b))
        return products[-1]

    monkeypatch.setattr(torch, "matmul", recorded)
    check_mixed_step("cpu", torch.float32, 1e-5, heads, lora, rope)
    chunks = sum(-(-new // max(1, limit // (heads * length))) for length, new in SEQUENCES if new > 1)
    assert len(products) == 2 * chunks > 2 * len([new for _, new in SEQUENCES if new > 1])
    assert max(scores.numel() for scores in products[::2]) <= limit


def test_a_step_without_decodes_attends_sequence_by_sequence() -> None:
    batch = mixed_batch("cpu", torch.Generator().manual_seed(1))
    keep = [i for i, (_, new) in enumerate(SEQUENCES) if new > 1]
    starts = batch.query_start.tolist()
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep])
    lengths = [starts[i + 1] - starts[i] for i in keep]
    only = ForwardBatch(batch.input_ids[rows], batch.positions[rows],
                        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
                        batch.seq_lens[keep], batch.block_tables[keep], batch.slot_mapping[rows],
                        torch.tensor(lengths).cumsum(0) - 1)
    meta = AttentionMetadata.from_batch(only, BLOCK_SIZE, NUM_BLOCKS)
    assert meta.decode is None and meta.decode_rows is None and len(meta.sequences) == len(keep)


def test_long_block_tables_keep_decodes_apart_without_the_kernel() -> None:
    """On CPU (no Triton kernel) a decode batch would read every sequence's whole block table: past
    PADDED_DECODE_MAX_KEYS the single tokens attend one sequence at a time, still against float64."""
    gen = torch.Generator().manual_seed(3)
    batch = mixed_batch("cpu", gen)
    wide = PADDED_DECODE_MAX_KEYS // BLOCK_SIZE + 1
    padding = torch.full((batch.num_seqs, wide - batch.block_tables.shape[1]), -1, dtype=torch.int32)
    batch = dataclasses.replace(batch, block_tables=torch.cat([batch.block_tables, padding], dim=1))
    meta = AttentionMetadata.from_batch(batch, BLOCK_SIZE, NUM_BLOCKS)
    assert meta.decode is None and len(meta.sequences) == len(SEQUENCES)
    heads, lora, rope = WIDTHS[0]
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, lora + rope, generator=gen)
    q = torch.randn(batch.num_tokens, heads, lora + rope, generator=gen)
    scale = (lora + rope) ** -0.5
    got = paged_mla_attention(q[..., :lora], q[..., lora:], cache, meta, scale)
    torch.testing.assert_close(got.double(), float64_attention(q, cache, batch, scale, lora), rtol=0, atol=1e-5)


def test_the_layout_is_read_from_the_engines_host_copy() -> None:
    """With the engine's host lists the metadata is the same, and built from them (no copy back from the
    device, which would wait for it): a bad block id in the host copy alone is what the check reports."""
    batch = mixed_batch("cpu", torch.Generator().manual_seed(2))
    layout = HostLayout(batch.query_start.tolist(), batch.seq_lens.tolist(), batch.block_tables.tolist())
    want = AttentionMetadata.from_batch(batch, BLOCK_SIZE, NUM_BLOCKS)
    got = AttentionMetadata.from_batch(dataclasses.replace(batch, host_layout=layout), BLOCK_SIZE, NUM_BLOCKS)
    assert [(s.start, s.end) for s in got.sequences] == [(s.start, s.end) for s in want.sequences]
    for a, b in zip(got.sequences, want.sequences):
        assert torch.equal(a.slots, b.slots) and torch.equal(a.visible, b.visible)
    assert torch.equal(got.decode_rows, want.decode_rows)
    for name in ("slot_mapping", "block_tables", "key_counts"):
        assert torch.equal(getattr(got.decode, name), getattr(want.decode, name)), name
    bad = HostLayout(layout.query_start, layout.seq_lens, [[NUM_BLOCKS] * len(t) for t in layout.block_tables])
    with pytest.raises(ValueError, match="block_tables"):
        AttentionMetadata.from_batch(dataclasses.replace(batch, host_layout=bad), BLOCK_SIZE, NUM_BLOCKS)


def test_the_decode_kernel_names_the_widths_it_cannot_take() -> None:
    assert mla_decode_triton.supports(512, 64) and mla_decode_triton.supports(64, 32)
    assert not mla_decode_triton.supports(32, 8) and not mla_decode_triton.supports(96, 32)
    q = torch.zeros(1, 2, 40)
    with pytest.raises(ValueError, match="kv_lora_rank 32 and rope 8"):
        mla_decode_triton.mla_decode(q[..., :32], q[..., 32:], torch.zeros(1, 4, 40),
                                     torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("widths", WIDTHS)
def test_mixed_step_matches_float64_on_gpu(widths: tuple[int, int, int]) -> None:
    """The decode rows through the Triton kernel (the tiny model's widths) or, where it cannot take the
    widths, through the PyTorch layout."""
    check_mixed_step("cuda", torch.bfloat16, 3e-2, *widths)

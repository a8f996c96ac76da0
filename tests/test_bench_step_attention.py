"""benchmarks/bench_step_attention.py's steps, on CPU: each step shape's batch is what it says (new tokens,
their positions and slots in the paged cache), and both ways of attending that the benchmark times give a
float64 oracle's output (attention of each token over its own sequence's keys up to its position)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)  # the script imports its neighbour bench_ll by name

import bench_step_attention as bench  # noqa: E402

from serving.models.paged_attention import paged_mla_attention  # noqa: E402

HEADS, LORA, ROPE, SCALE = 4, 32, 16, 0.1


def oracle(step: bench.Step) -> torch.Tensor:
    """float64 [T, H, LORA]: each token's softmax(q . key * SCALE) . c_kv over its sequence's keys 0..position."""
    b, flat = step.batch, step.cache.double().flatten(0, 1)
    q = torch.cat([step.q_latent, step.q_pe], dim=-1).double()
    out = torch.empty(q.shape[0], HEADS, LORA, dtype=torch.float64)
    for t, (seq, pos) in enumerate(zip(b.token_seqs.tolist(), b.positions.tolist())):
        table = b.block_tables[seq].tolist()
        slots = [table[p // bench.BLOCK_SIZE] * bench.BLOCK_SIZE + p % bench.BLOCK_SIZE for p in range(pos + 1)]
        keys = flat[slots]
        probs = torch.softmax(q[t] @ keys.T * SCALE, dim=-1)
        out[t] = probs @ keys[:, :LORA]
    return out


@pytest.mark.parametrize("shape", (*bench.STEPS[:3], bench.StepShape(40, 23, 5, 70)), ids=str)
def test_steps_are_what_they_say_and_both_ways_attend_as_the_oracle(shape):
    step = bench.build_step(shape, HEADS, LORA, ROPE, torch.device("cpu"), seed=3)
    b = step.batch
    assert b.num_tokens == shape.prompt + shape.decodes
    expected_positions = list(range(shape.prompt_context, shape.prompt_context + shape.prompt))
    expected_positions += [shape.decode_context - 1] * shape.decodes
    assert b.positions.tolist() == expected_positions
    tables = b.block_tables.tolist()
    used = [block for row in tables for block in row if block >= 0]
    assert len(used) == len(set(used)), "two sequences share a block"
    for slot, seq, pos in zip(b.slot_mapping.tolist(), b.token_seqs.tolist(), b.positions.tolist()):
        assert slot == tables[seq][pos // bench.BLOCK_SIZE] * bench.BLOCK_SIZE + pos % bench.BLOCK_SIZE
    want = oracle(step)
    for meta in (bench.one_kernel_metadata(step), bench.host_layout_metadata(step)):
        got = paged_mla_attention(step.q_latent, step.q_pe, step.cache, meta, SCALE).double()
        assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (type(meta).__name__, (got - want).abs().max())
    assert bench.compare(step, SCALE) < 2e-2

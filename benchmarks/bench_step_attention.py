"""Attention of one engine step at DeepSeek-V3's shapes (128 heads, latent 512 + rope 64, the paged latent
cache of 16-token blocks), held by a step CUDA graph in either of the two ways serving could:

- one kernel (what the engine does): every token of the step, prompt chunk or decode, through
  serving.models.mla_decode_triton (paged_attention.TokenMetadata: each token reads its own keys), inside
  the step's graph. Its cost is the kernel's GPU time per layer.
- graph pieces around an eager attention (vLLM's piecewise graphs): the layers between attentions replay
  as graph pieces, and attention runs eagerly between them with the host layout (AttentionMetadata: a
  prompt chunk attends as one matrix product per sequence, the decodes through the same kernel). Its cost
  per layer is the larger of its GPU time and the host's time to launch it plus the next piece, since the
  host must keep ahead of the GPU; plus the host layout, once per step.

For each step shape: the two ways' outputs are compared (bf16 tolerance: the reductions run in a different
order), then timed as benchmarks/METHOD.md asks (GPU time by CUDA-graph replay, host time as the median
of eager launches), and the per-step estimate for --layers layers is printed beside.

    python benchmarks/bench_step_attention.py                 # the default step shapes, 61 layers (V3)
    python benchmarks/bench_step_attention.py --layers 4      # the V3-shaped 4-layer model of bench_serving
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from bench_ll import host_time, print_table, time_graph

from serving.forward_batch import ForwardBatch, HostLayout
from serving.models.paged_attention import AttentionMetadata, TokenMetadata, paged_mla_attention

BLOCK_SIZE = 16  # the engine's default (EngineConfig.block_size)


@dataclass(frozen=True)
class StepShape:
    """One step: a prompt chunk of `prompt` tokens whose sequence already has `prompt_context` tokens
    cached (none: no prompt), beside `decodes` decode tokens that each read `decode_context` keys."""

    prompt: int
    prompt_context: int
    decodes: int
    decode_context: int

    def __str__(self) -> str:
        parts = [f"{self.prompt} prompt @{self.prompt_context}"] if self.prompt else []
        parts += [f"{self.decodes} dec @{self.decode_context}"] if self.decodes else []
        return " + ".join(parts)


# A decode step; a short prompt alone (TTFT) and beside decodes; a whole budget of prompt (256: the default
# step budget), fresh and as a later chunk of a long prompt; a chunk beside decodes filling the budget.
STEPS = (StepShape(0, 0, 64, 1024), StepShape(32, 0, 0, 0), StepShape(32, 0, 32, 1024), StepShape(256, 0, 0, 0),
         StepShape(256, 1024, 0, 0), StepShape(224, 1024, 32, 1024))


@dataclass
class Step:
    """A step's attention inputs: queries, one layer's cache, and the batch (token_seqs and host_layout both
    given, so that either metadata can be built from it)."""

    q_latent: torch.Tensor  # [T, H, lora]
    q_pe: torch.Tensor  # [T, H, rope]
    cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, lora + rope]
    batch: ForwardBatch


def build_step(shape: StepShape, heads: int, lora: int, rope: int, device: torch.device, seed: int = 0) -> Step:
    """Random queries and cache for `shape`; every sequence's blocks scattered over the cache at random."""
    gen = torch.Generator().manual_seed(seed)
    seqs = ([(shape.prompt_context + shape.prompt, shape.prompt)] if shape.prompt else [])
    seqs += [(shape.decode_context, 1)] * shape.decodes  # (tokens after the step, new tokens)
    blocks_of = [-(-length // BLOCK_SIZE) for length, _ in seqs]
    num_blocks = sum(blocks_of) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, positions, slots, starts = [], [], [], [0]
    for (length, new), count in zip(seqs, blocks_of):
        table, order = order[:count], order[count:]
        tables.append(table + [-1] * (max(blocks_of) - count))
        for pos in range(length - new, length):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + new)
    tokens = starts[-1]
    token_seqs = [i for i, (_, new) in enumerate(seqs) for _ in range(new)]
    i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, **i64), positions=torch.tensor(positions, **i64),
        query_start=torch.tensor(starts, **i32), seq_lens=torch.tensor([length for length, _ in seqs], **i32),
        block_tables=torch.tensor(tables, **i32), slot_mapping=torch.tensor(slots, **i64),
        logits_indices=torch.tensor([end - 1 for end in starts[1:]], **i64),
        token_seqs=torch.tensor(token_seqs, **i64),
        host_layout=HostLayout(starts, [length for length, _ in seqs], tables))

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(device=device, dtype=torch.bfloat16)

    return Step(randn(tokens, heads, lora), randn(tokens, heads, rope), randn(num_blocks, BLOCK_SIZE, lora + rope),
                batch)


def one_kernel_metadata(step: Step) -> TokenMetadata:
    return TokenMetadata.from_batch(step.batch, BLOCK_SIZE)


def host_layout_metadata(step: Step) -> AttentionMetadata:
    """What an eager attention builds once per step from the host layout (the engine's batch without token_seqs)."""
    b = step.batch
    host_batch = ForwardBatch(b.input_ids, b.positions, b.query_start, b.seq_lens, b.block_tables, b.slot_mapping,
                              b.logits_indices, host_layout=b.host_layout)
    return AttentionMetadata.from_batch(host_batch, BLOCK_SIZE, step.cache.shape[0])


def compare(step: Step, scale: float) -> float:
    """The largest difference between the two ways' outputs, relative to the largest output."""
    one = paged_mla_attention(step.q_latent, step.q_pe, step.cache, one_kernel_metadata(step), scale).float()
    eager = paged_mla_attention(step.q_latent, step.q_pe, step.cache, host_layout_metadata(step), scale).float()
    return float((one - eager).abs().max() / one.abs().max())


def piece_launch_us() -> float:
    """Host microseconds to launch one graph piece (a graph of one small kernel)."""
    x = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return host_time(graph.replay, calls=200)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=61, help="layers per step, for the per-step estimate")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_attention.py needs a CUDA GPU")
    device = torch.device("cuda")
    scale = (128 + args.rope) ** -0.5  # V3's qk_head_dim (without YaRN's mscale)
    launch = piece_launch_us()
    print(f"{torch.cuda.get_device_name()}; one graph piece's launch: {launch:.1f} us of host time; "
          f"per step: {args.layers} layers")
    rows = []
    for shape in STEPS:
        step = build_step(shape, args.heads, args.kv_lora_rank, args.rope, device)
        error = compare(step, scale)
        token_meta, layout_meta = one_kernel_metadata(step), host_layout_metadata(step)

        def one_kernel(meta: TokenMetadata = token_meta, s: Step = step) -> None:
            paged_mla_attention(s.q_latent, s.q_pe, s.cache, meta, scale)

        def eager(meta: AttentionMetadata = layout_meta, s: Step = step) -> None:
            paged_mla_attention(s.q_latent, s.q_pe, s.cache, meta, scale)

        one_gpu, eager_gpu = time_graph(one_kernel), time_graph(eager)
        eager_host = host_time(eager, calls=100)
        layout_host = host_time(lambda s=step: host_layout_metadata(s), calls=50)
        one_step = args.layers * one_gpu
        pieces_step = args.layers * max(eager_gpu, eager_host + launch) + layout_host
        rows.append((str(shape), one_gpu, eager_gpu, eager_host, layout_host, one_step / 1e3, pieces_step / 1e3,
                     pieces_step / one_step, f"{error:.1e}"))
    print_table(("step", "one_kernel_us", "eager_gpu_us", "eager_host_us", "layout_host_us", "one_step_ms",
                 "pieces_step_ms", "pieces/one", "rel_diff"), rows)


if __name__ == "__main__":
    main()

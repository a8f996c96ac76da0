"""Runs the model for a scheduled batch: builds the `ForwardBatch`, owns the KV cache size, and is the
one place where CUDA graphs for decode batch sizes go (eager everywhere for now; see `graph_size`)."""

from __future__ import annotations

import torch

from ..forward_batch import ForwardBatch
from .scheduler import ScheduledBatch


class ModelRunner:
    """model: obeys serving.forward_batch's contract (forward(batch) -> float32 logits [num_seqs, vocab],
    allocate_kv_cache, config)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int,
                 max_model_len: int, max_tokens_per_rank: int) -> None:
        self.model, self.device = model, device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_tokens_per_rank = max_tokens_per_rank
        model.allocate_kv_cache(num_blocks, block_size)

    def graph_size(self, num_tokens: int) -> int | None:
        """The decode batch size to pad to when every rank only decodes and the largest batch has
        `num_tokens` tokens, or None to run eagerly. The CUDA-graph seam: a graph runner (GPU, not
        --enforce-eager) would capture vLLM's ladder of decode sizes (1, 2, 4, 8, 16, 32, ... up to
        max_tokens_per_rank) here, return the smallest one >= num_tokens, and `execute` would replay
        it, idle ranks too (on padding tokens), so every rank dispatches with the same T. Not
        captured yet: always eager."""
        return None

    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        """The flat ForwardBatch for `batch` (built on the host, copied to the device once)."""
        if not batch:
            return ForwardBatch.empty(self.device, self.max_blocks_per_seq)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids(start, end)
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(table + [-1] * (self.max_blocks_per_seq - len(table)))
        i64 = dict(dtype=torch.int64)
        i32 = dict(dtype=torch.int32)
        host = ForwardBatch(
            input_ids=torch.tensor(ids, **i64), positions=torch.tensor(positions, **i64),
            query_start=torch.tensor(query_start, **i32), seq_lens=torch.tensor(seq_lens, **i32),
            block_tables=torch.tensor(tables, **i32), slot_mapping=torch.tensor(slots, **i64),
            logits_indices=torch.tensor(query_start[1:], **i64) - 1)
        if self.device.type == "cpu":
            return host
        return ForwardBatch(*(t.pin_memory().to(self.device, non_blocking=True) for t in (
            host.input_ids, host.positions, host.query_start, host.seq_lens, host.block_tables,
            host.slot_mapping, host.logits_indices)))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, graph_size: int | None = None) -> torch.Tensor:
        """Logits float32 [len(batch.seqs), vocab]; an empty batch still runs the model (its MoE layers
        take part in the other ranks' dispatch and combine) and gives [0, vocab]."""
        del graph_size  # eager: nothing is padded
        return self.model(self.prepare(batch))

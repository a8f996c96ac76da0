"""Runs the model for a scheduled batch: builds the `ForwardBatch`, owns the KV cache size, and replays
CUDA graphs for decode steps.

Decode graphs (vLLM's scheme): at start-up one graph per size of a ladder (1, 2, 4, 8, 16, 24, 32, ...
up to max_num_seqs) is captured over static input tensors. A decode-only step of n sequences copies
its inputs into the first n rows of a captured size >= n (the caller picks it with `graph_size`:
expert-parallel ranks agree on the largest rank's n, serving.engine.step_sync); the other rows are
padding tokens that write their KV to a block of their own (one past the engine's blocks) and whose
logits are dropped. An idle expert-parallel rank replays the agreed size on padding alone, so its MoE
layers still take part in the peers' dispatch and combine. Prefill steps run eagerly.

Graphs need a GPU, MoE layers whose Buffer backend is `cuda` (the reference backend synchronises
with the host inside dispatch), and, without Triton's MLA decode kernel, max_model_len <=
GRAPH_MAX_MODEL_LEN: the graph-safe PyTorch decode attention (serving.models.paged_attention) reads
max_model_len keys per sequence. Otherwise, or with enforce_eager, every step runs eagerly.

Pending tokens (async scheduling, serving.engine.engine): a sequence's last token may still be on the
device, sampled by the previous step; the inputs are built with 0 in its place and the device copies the
token in before the model runs, so the host never waits for it.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..forward_batch import ForwardBatch, HostLayout, to_device
from ..models import mla_decode_triton
from ..models.paged_attention import PADDED_DECODE_MAX_KEYS
from .scheduler import ScheduledBatch

LADDER_STEP = 8  # graph sizes: 1, 2, 4, then every multiple of 8, as vLLM's capture sizes
GRAPH_MAX_MODEL_LEN = PADDED_DECODE_MAX_KEYS  # longer contexts decode eagerly (see the module docstring)
_TENSORS = ("input_ids", "positions", "query_start", "seq_lens", "block_tables", "slot_mapping", "logits_indices")


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at `position`."""
    return block_table[position // block_size] * block_size + position % block_size


def pending_inputs(batch: ScheduledBatch) -> tuple[list[int], list[int]]:
    """(rows of the batch's input_ids that are pending tokens, each one's row among the previous step's
    sampled tokens). A pending token is its sequence's last, and at most one is pending when a step is built."""
    rows: list[int] = []
    sources: list[int] = []
    offset = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if seq.num_pending > 1:
            raise RuntimeError(f"request {seq.request_id!r}: {seq.num_pending} pending tokens when a step is built")
        if seq.num_pending and seq.num_computed_tokens + n == seq.num_tokens:
            rows.append(offset + n - 1)
            sources.append(seq.pending_row)
        offset += n
    return rows, sources


def logits_rows(batch: ScheduledBatch) -> list[int]:
    """How many logits rows each sequence of the batch gets, in order: all of its new tokens where it
    computes prompt logprobs this step, else its last one (the row that gives its next token). A
    decode-only batch always gets one row per sequence, so decode graphs never change for them."""
    return [n if seq.prompt_logprob_positions(n) else 1 for seq, n in zip(batch.seqs, batch.num_new_tokens)]


def graph_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += range(LADDER_STEP, max_num_seqs, LADDER_STEP)
    return sorted(set(sizes) | {max_num_seqs})


class ModelRunner:
    """model: obeys serving.forward_batch's contract (forward(batch) -> float32 logits [num_logits, vocab],
    allocate_kv_cache, config, and `ep_buffer` where it has MoE layers)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int,
                 max_model_len: int, max_tokens_per_rank: int, max_num_seqs: int | None = None,
                 use_cuda_graphs: bool = False) -> None:
        self.model, self.device = model, device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.pad_block = num_blocks  # the block padding tokens write to, outside the engine's blocks
        model.allocate_kv_cache(num_blocks + 1, block_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._static: ForwardBatch | None = None
        self.capture_seconds = 0.0
        buffer = getattr(model, "ep_buffer", None)
        self.eager_reason = why_eager(device, buffer.backend_name if buffer is not None else None, max_model_len)
        if use_cuda_graphs and self.eager_reason is None:
            self.capture(graph_sizes(min(max_num_seqs or max_tokens_per_rank, max_tokens_per_rank)))

    # ------------------------------------------------------------------ inputs
    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        """The flat ForwardBatch for `batch` (built on the host, copied to the device once)."""
        if not batch:
            return ForwardBatch.empty(self.device, self.max_blocks_per_seq)
        host = self._host_batch(batch)
        if self.device.type == "cpu":
            return host
        return ForwardBatch(*(getattr(host, name).pin_memory().to(self.device, non_blocking=True)
                              for name in _TENSORS), host_layout=host.host_layout)

    def _host_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits: list[int] = []
        bs = self.block_size
        for seq, n, rows in zip(batch.seqs, batch.num_new_tokens, logits_rows(batch)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids(start, end)
            positions += range(start, end)
            table = seq.block_table
            slots += [slot_of(table, p, bs) for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            logits += range(query_start[-1] - rows, query_start[-1])
            seq_lens.append(end)
            tables.append(table + [-1] * (self.max_blocks_per_seq - len(table)))
        i64 = dict(dtype=torch.int64)
        i32 = dict(dtype=torch.int32)
        return ForwardBatch(
            input_ids=torch.tensor(ids, **i64), positions=torch.tensor(positions, **i64),
            query_start=torch.tensor(query_start, **i32), seq_lens=torch.tensor(seq_lens, **i32),
            block_tables=torch.tensor(tables, **i32), slot_mapping=torch.tensor(slots, **i64),
            logits_indices=torch.tensor(logits, **i64),
            host_layout=HostLayout(query_start, seq_lens, tables))

    def padded_decode_batch(self, batch: ScheduledBatch, size: int) -> ForwardBatch:
        """`batch` (decode-only or empty, at most `size` sequences) as a decode ForwardBatch of exactly
        `size` rows on the host: padding rows hold token 0 at position 0 of a one-token sequence in
        the padding block."""
        n = len(batch.seqs)
        if not n <= size:
            raise ValueError(f"batch: {n} sequences do not fit a decode graph of {size}")
        # Filled in numpy, one sequence at a time: this runs every decode step on the host.
        bs = self.block_size
        ids = np.zeros(size, np.int64)
        positions = np.zeros(size, np.int64)
        seq_lens = np.ones(size, np.int32)
        slots = np.full(size, self.pad_block * bs, np.int64)
        tables = np.full((size, self.max_blocks_per_seq), -1, np.int32)
        tables[n:, 0] = self.pad_block
        for i, seq in enumerate(batch.seqs):
            p = seq.num_computed_tokens
            table = seq.block_table
            ids[i] = seq.token_ids(p, p + 1)[0]
            positions[i], seq_lens[i] = p, p + 1
            tables[i, :len(table)] = table
            slots[i] = slot_of(table, p, bs)
        rows = torch.arange(size + 1)
        return ForwardBatch(
            input_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions),
            query_start=rows.to(torch.int32), seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
            logits_indices=rows[:size], decode=True)

    # ------------------------------------------------------------------ CUDA graphs
    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def graph_size(self, num_seqs: int) -> int | None:
        """The smallest captured size >= num_seqs (1 for none), or None (no graphs, or more sequences
        than the largest graph): the decode step then runs eagerly."""
        return next((s for s in self.captured_sizes if s >= max(1, num_seqs)), None)

    def capture(self, sizes: list[int]) -> None:
        """Capture a decode graph for each size (largest first, all sharing one memory pool). Every
        expert-parallel rank must capture the same sizes at the same time: the warm-up run before each
        capture executes the MoE layers' dispatch and combine with the peers."""
        padding = self.padded_decode_batch(ScheduledBatch(), max(sizes))
        self._static = ForwardBatch(*(getattr(padding, name).to(self.device) for name in _TENSORS), decode=True)
        pool = None
        side = torch.cuda.Stream(self.device)
        start = time.perf_counter()
        for size in sorted(sizes, reverse=True):
            static = self._static_view(size)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.inference_mode():
                self.model(static)  # warm-up: lazy initialisation and Triton compilation happen outside capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                logits = self.model(static)
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def _static_view(self, size: int) -> ForwardBatch:
        """The first `size` rows of the static inputs (views: the graphs read them in place)."""
        s = self._static
        assert s is not None
        rows = {name: getattr(s, name)[:size + 1 if name == "query_start" else size] for name in _TENSORS}
        return ForwardBatch(**rows, decode=True)

    def _replay(self, batch: ScheduledBatch, size: int, pending_tokens: torch.Tensor | None) -> torch.Tensor:
        if batch and not batch.is_decode_only:
            raise ValueError("graph_size: only a decode-only or empty batch replays a decode graph")
        if size not in self._graphs:
            raise ValueError(f"graph_size: expected one of the captured sizes {self.captured_sizes}, got {size}")
        host = self.padded_decode_batch(batch, size)
        static = self._static_view(size)
        for name in ("input_ids", "positions", "seq_lens", "block_tables", "slot_mapping"):
            getattr(static, name).copy_(getattr(host, name).pin_memory(), non_blocking=True)
        self._fill_pending(static.input_ids, batch, pending_tokens)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:len(batch.seqs)]

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, graph_size: int | None = None,
                pending_tokens: torch.Tensor | None = None, moe_mode: str = "low_latency") -> torch.Tensor:
        """Logits float32 [sum(logits_rows(batch)), vocab] (one row per sequence unless one computes
        prompt logprobs); an empty batch still runs the model (its MoE layers take part in the other
        ranks' dispatch and combine) and gives [0, vocab]. graph_size: replay that captured decode
        graph (see `graph_size`), None: run eagerly. pending_tokens: the previous step's sampled tokens
        on the device, where the batch's pending tokens are (see pending_inputs). moe_mode: the MoE
        layers' dispatch mode (ForwardBatch.moe_mode; the decode graphs are low-latency ones)."""
        if graph_size is not None:
            if moe_mode != "low_latency":
                raise ValueError(f"graph_size: the decode graphs dispatch in low-latency mode, not {moe_mode!r}")
            return self._replay(batch, graph_size, pending_tokens)
        inputs = self.prepare(batch)
        inputs.moe_mode = moe_mode
        self._fill_pending(inputs.input_ids, batch, pending_tokens)
        return self.model(inputs)

    def _fill_pending(self, input_ids: torch.Tensor, batch: ScheduledBatch,
                      pending_tokens: torch.Tensor | None) -> None:
        """Copy the batch's pending tokens from `pending_tokens` into `input_ids`, on the device."""
        rows, sources = pending_inputs(batch)
        if not rows:
            return
        if pending_tokens is None:
            raise RuntimeError("pending_tokens: the batch has pending tokens but none were given")
        if rows == sources == list(range(len(rows))):  # the same sequences as the last step, in order
            input_ids[:len(rows)].copy_(pending_tokens[:len(rows)])
            return
        index = to_device(rows + sources, torch.int64, input_ids.device).view(2, -1)
        input_ids.index_copy_(0, index[0], pending_tokens.index_select(0, index[1]))


def why_eager(device: torch.device, ep_backend: str | None, max_model_len: int) -> str | None:
    """Why decode steps cannot replay CUDA graphs here, or None if they can. ep_backend: the MoE
    layers' Buffer backend (None without MoE layers)."""
    if device.type != "cuda":
        return "no GPU"
    if ep_backend not in (None, "cuda"):
        return f"the {ep_backend} backend's dispatch waits on the host"
    if max_model_len > GRAPH_MAX_MODEL_LEN and not mla_decode_triton.available():
        return (f"max_model_len {max_model_len} > {GRAPH_MAX_MODEL_LEN}: the graph-safe decode attention reads "
                "max_model_len keys per sequence (set --max-model-len to capture graphs)")
    return None

"""Runs the model for a scheduled batch: builds the `ForwardBatch`, owns the KV cache size, and replays
CUDA graphs for every step that fits one.

Step graphs (vLLM's full CUDA graphs, bucketed by token count): at start-up one graph per size of a
ladder (engine_config.capture_sizes: 1, 2, 4, 8, 16, 24, ... up to the tokens of a low-latency step) is
captured over static input tensors. A graph of T tokens holds any step of at most T new tokens, decode
tokens and prefill chunks mixed, from at most S = min(T, max_num_seqs) sequences: its tokens fill the
first rows, each pointing (ForwardBatch.token_seqs) to its sequence's row of the block tables, so that
attention reads everything it needs on the device (serving.models.paged_attention.TokenMetadata). The
other rows are padding tokens of a sequence of their own (block table row S) that write their KV to a
block of their own (one past the engine's blocks). The graph ends at the final norm (the model's
`hidden_states`); the lm_head runs after the replay on the rows the step needs (`compute_logits` on
logits_indices, as vLLM computes logits outside its graphs), so padding rows cost no logits and a step
with prompt logprobs replays too. Expert-parallel ranks agree on the size (the largest rank's token
count, serving.engine.step_sync), and an idle rank replays it on padding alone, so its MoE layers still
take part in the peers' dispatch and combine.

Eager steps: steps with more tokens than the largest graph (normal-mode MoE steps among them), and every
step where graphs cannot be used (`why_eager`, --enforce-eager). On a GPU with Triton they use the same
per-token attention as the graphs; elsewhere the host-layout attention (paged_attention.AttentionMetadata).

Graphs need a GPU, MoE layers whose Buffer backend is `cuda` (the reference backend synchronises with
the host inside dispatch), and, without Triton's MLA kernel, max_model_len <= GRAPH_MAX_MODEL_LEN: the
PyTorch per-token attention reads max_model_len keys per token.

Pending tokens (async scheduling, serving.engine.engine): a sequence's last token may still be on the
device, sampled by the previous step; the inputs are built with 0 in its place and the device copies the
token in before the model runs, so the host never waits for it.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ep_layer.kernels.launch import COMPILES_AHEAD, SPECIALIZED_MULTIPLE, cdiv, compile_ahead

from ..forward_batch import ForwardBatch, HostLayout, to_device
from ..models import mla_decode_triton
from ..models.paged_attention import PADDED_DECODE_MAX_KEYS
from .graph_upload import upload
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)
GRAPH_MAX_MODEL_LEN = PADDED_DECODE_MAX_KEYS  # longer contexts run eagerly without Triton (module docstring)
_TOKEN_ROWS = ("input_ids", "positions", "slot_mapping", "token_seqs")  # a graph's inputs, one row per token
_SEQ_ROWS = ("block_tables", "seq_lens", "query_start")  # ... per sequence row (see _rows)
_LAYOUT = ("input_ids", "positions", "query_start", "seq_lens", "block_tables", "slot_mapping", "logits_indices")


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
    computes prompt logprobs this step, else its last one (the row that gives its next token)."""
    return [n if seq.prompt_logprob_positions(n) else 1 for seq, n in zip(batch.seqs, batch.num_new_tokens)]


class ModelRunner:
    """model: obeys serving.forward_batch's contract (forward(batch) -> float32 logits [num_logits, vocab],
    allocate_kv_cache, config, and `ep_buffer` where it has MoE layers; for graphs also hidden_states and
    compute_logits, forward's two halves). graph_sizes: the step graphs to capture (token counts, each at
    most max_tokens_per_rank; empty: every step runs eagerly)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int,
                 max_model_len: int, max_tokens_per_rank: int, max_num_seqs: int,
                 graph_sizes: list[int] | tuple[int, ...] = ()) -> None:
        self.model, self.device = model, device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_tokens_per_rank, self.max_num_seqs = max_tokens_per_rank, max_num_seqs
        self.pad_block = num_blocks  # the block padding tokens write to, outside the engine's blocks
        model.allocate_kv_cache(num_blocks + 1, block_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._static: ForwardBatch | None = None
        self.capture_seconds = 0.0
        self.compiled_ahead = (0, 0.0)  # Triton variants compiled ahead on threads (_compile_ahead), and seconds
        buffer = getattr(model, "ep_buffer", None)
        self.ep_backend = buffer.backend_name if buffer is not None else None  # None: no MoE layers
        self.eager_reason = why_eager(device, self.ep_backend, max_model_len)
        cfg = model.config
        # Per-token attention on the device in eager steps too, where its kernel runs: no host layout to
        # build or check, and one attention kernel for every step.
        self.token_attention = (device.type == "cuda" and mla_decode_triton.available()
                                and mla_decode_triton.supports(cfg.kv_lora_rank, cfg.qk_rope_head_dim))
        too_large = [s for s in graph_sizes if not 1 <= s <= max_tokens_per_rank]
        if too_large:
            raise ValueError(f"cudagraph_capture_sizes: {too_large} outside [1, max_tokens_per_rank="
                             f"{max_tokens_per_rank}] (a graph's MoE layers dispatch in low-latency mode)")
        if graph_sizes and self.eager_reason is None:
            self.capture(sorted(set(graph_sizes)))

    # ------------------------------------------------------------------ inputs
    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        """The flat ForwardBatch for `batch` (built on the host, copied to the device once)."""
        if not batch:
            empty = ForwardBatch.empty(self.device)
            if self.token_attention:
                empty.token_seqs = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty
        host = self._host_batch(batch)
        if self.device.type == "cpu":
            return host
        names = _LAYOUT + (("token_seqs",) if host.token_seqs is not None else ())
        moved = {name: getattr(host, name).pin_memory().to(self.device, non_blocking=True) for name in names}
        return ForwardBatch(**moved, host_layout=host.host_layout)

    def _host_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        """The eager step's inputs on the host: `_layout` without padding, with the host lists the
        host-layout attention reads, and token_seqs where the per-token attention runs."""
        host = self._layout(batch, batch.num_tokens, len(batch.seqs), padded=False)
        host.host_layout = HostLayout(host.query_start.tolist(), host.seq_lens.tolist(), host.block_tables.tolist())
        if not self.token_attention:
            host.token_seqs = None
        return host

    def _rows(self, size: int) -> tuple[int, int]:
        """(token rows, sequence rows) of the step graph of `size` tokens: at most min(size, max_num_seqs)
        sequences, and the padding tokens' sequence after them."""
        return size, min(size, self.max_num_seqs)

    def fits_graph(self, batch: ScheduledBatch, size: int) -> bool:
        """Whether `batch` can run as the step graph of `size` tokens (module docstring)."""
        tokens, seqs = self._rows(size)
        return batch.num_tokens <= tokens and len(batch.seqs) <= seqs

    def graph_inputs(self, batch: ScheduledBatch, size: int) -> ForwardBatch:
        """`batch` as the host inputs of the step graph of `size` tokens: its tokens first, then padding
        tokens (token 0 at position 0 of the padding sequence, row S of the block tables, whose one block
        is the padding block); logits_indices: the batch's own (logits_rows), never a padding token. The
        block tables have the columns the step reads (at least 1): a replay writes those columns of the
        graph's tables, whose later columns no token reads (each reads its key count's blocks only)."""
        if not self.fits_graph(batch, size):
            raise ValueError(f"batch: {batch.num_tokens} tokens of {len(batch.seqs)} sequences do not fit the "
                             f"step graph of {size} tokens (at most {self._rows(size)[1]} sequences)")
        tokens, seqs = self._rows(size)
        return self._layout(batch, tokens, seqs, padded=True)

    def _layout(self, batch: ScheduledBatch, tokens: int, seqs: int, padded: bool) -> ForwardBatch:
        """`batch`'s tokens in the first of `tokens` rows and its sequences in the first of `seqs` rows
        (padded: then the padding sequence, whose tokens fill the rest; graph_inputs), on the host."""
        bs = self.block_size
        ids = np.zeros(tokens, np.int64)
        positions = np.zeros(tokens, np.int64)
        slots = np.full(tokens, self.pad_block * bs, np.int64)
        token_seqs = np.full(tokens, seqs, np.int64)
        width = max([1] + [len(seq.block_table) for seq in batch.seqs])  # the block table columns it reads
        if not padded:  # one class of width for Triton's attention kernel, which warm-up compiled (graphs: one width)
            width = cdiv(width, SPECIALIZED_MULTIPLE) * SPECIALIZED_MULTIPLE
        rows = seqs + 1 if padded else seqs
        tables = np.full((rows, width), -1, np.int32)
        seq_lens = np.zeros(rows, np.int32)
        if padded:
            tables[seqs, 0] = self.pad_block
            seq_lens[seqs] = 1
        query_start = np.full(rows + 1, batch.num_tokens, np.int32)
        query_start[-1] = tokens
        logits: list[int] = []
        offset = 0
        # Filled in numpy, one sequence at a time (a decode token without numpy): this runs every step.
        for i, (seq, n, logit_rows) in enumerate(zip(batch.seqs, batch.num_new_tokens, logits_rows(batch))):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            tables[i, :len(table)] = table
            query_start[i] = offset
            seq_lens[i] = end
            token_seqs[offset:offset + n] = i
            if n == 1:
                ids[offset] = seq.token_ids(start, end)[0]
                positions[offset] = start
                slots[offset] = slot_of(table, start, bs)
            else:
                pos = np.arange(start, end)
                ids[offset:offset + n] = seq.token_ids(start, end)
                positions[offset:offset + n] = pos
                slots[offset:offset + n] = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
            offset += n
            logits += range(offset - logit_rows, offset)
        return ForwardBatch(
            input_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions),
            query_start=torch.from_numpy(query_start), seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
            logits_indices=torch.tensor(logits, dtype=torch.int64), token_seqs=torch.from_numpy(token_seqs))

    # ------------------------------------------------------------------ CUDA graphs
    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def graph_size(self, num_tokens: int) -> int | None:
        """The smallest captured size >= num_tokens (1 for none), or None (no graphs, or more tokens than
        the largest graph): the step then runs eagerly."""
        return next((s for s in self.captured_sizes if s >= max(1, num_tokens)), None)

    def capture(self, sizes: list[int]) -> None:
        """Capture a step graph for each size (largest first, all sharing one memory pool), then upload them
        all (graph_upload). Every expert-parallel rank must capture the same sizes at the same time: the
        warm-up run before each capture executes the MoE layers' dispatch and combine with the peers. The
        Triton kernels every size's run launches are compiled before any of them, in parallel (_compile_ahead)."""
        padding = self.graph_inputs(ScheduledBatch(), max(sizes))
        tables = torch.full((padding.block_tables.shape[0], self.max_blocks_per_seq), -1, dtype=torch.int32)
        tables[:, :padding.block_tables.shape[1]] = padding.block_tables
        padding.block_tables = tables  # every column a sequence may come to read (graph_inputs writes the used ones)
        self._static = ForwardBatch(**{name: getattr(padding, name).to(self.device)
                                       for name in _TOKEN_ROWS + _SEQ_ROWS},
                                    logits_indices=padding.logits_indices.to(self.device))
        pool = None
        side = torch.cuda.Stream(self.device)
        start = time.perf_counter()
        largest_first = sorted(sizes, reverse=True)
        if COMPILES_AHEAD:
            self.compiled_ahead = self._compile_ahead(largest_first)
        for size in largest_first:
            static = self._static_view(size)
            self._write_inputs(self.graph_inputs(ScheduledBatch(), size), static)  # this size's padding
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.inference_mode():
                self.model.hidden_states(static)  # warm-up: lazy initialisation and Triton compilation
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                hidden = self.model.hidden_states(static)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        stream = torch.cuda.current_stream(self.device)
        for graph, _ in self._graphs.values():
            upload(graph, stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def _compile_ahead(self, sizes: list[int]) -> tuple[int, float]:
        """Compile every Triton variant the step graphs of `sizes` launch, on a pool of threads, before their
        warm-up runs would compile them one at a time: each size's forward is captured into a graph that is never
        replayed, its kernels' first launches handed to the compile threads (ep_layer.kernels.launch.compile_ahead).
        Nothing runs on the GPU, so the skipped kernels' outputs are never read. The captures come before any
        warm-up run, so the lazy initialisations happen inside them (cuBLAS's handle: a capture in the default
        "global" mode failed there on an H100): "relaxed" captures allow them, and a throwaway graph may hold
        whatever they did. Returns (variants, seconds). Where such a capture fails, the warm-up runs compile
        what is left, as without it."""
        start = time.perf_counter()
        try:
            with compile_ahead() as compiled:
                for size in sizes:
                    with (torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="relaxed"),
                          torch.inference_mode()):
                        self.model.hidden_states(self._static_view(size))
        except RuntimeError as e:  # CUDA's capture errors (a compile's error is not one: it raises)
            log.warning("compiling the step graphs' kernels ahead failed; the warm-up runs compile them: %s", e)
            torch.cuda.synchronize(self.device)
        return compiled["variants"], time.perf_counter() - start

    def _static_view(self, size: int) -> ForwardBatch:
        """The static inputs of the step graph of `size` tokens (views: the graphs read them in place)."""
        s = self._static
        assert s is not None
        tokens, seqs = self._rows(size)
        lengths = {"block_tables": seqs + 1, "seq_lens": seqs + 1, "query_start": seqs + 2}
        rows = {name: getattr(s, name)[:tokens] for name in _TOKEN_ROWS}
        rows.update({name: getattr(s, name)[:n] for name, n in lengths.items()})
        return ForwardBatch(**rows, logits_indices=s.logits_indices)

    @staticmethod
    def _write_inputs(host: ForwardBatch, static: ForwardBatch) -> None:
        """Copy a step graph's host inputs (graph_inputs) into its static ones, the block tables' used columns."""
        for name in _TOKEN_ROWS + _SEQ_ROWS:
            source = getattr(host, name)
            target = getattr(static, name)
            if name == "block_tables":
                target = target[:, :source.shape[1]]
            target.copy_(source.pin_memory(), non_blocking=True)

    def _replay(self, batch: ScheduledBatch, size: int, pending_tokens: torch.Tensor | None) -> torch.Tensor:
        if size not in self._graphs:
            raise ValueError(f"graph_size: expected one of the captured sizes {self.captured_sizes}, got {size}")
        host = self.graph_inputs(batch, size)
        static = self._static_view(size)
        self._write_inputs(host, static)
        self._fill_pending(static.input_ids, batch, pending_tokens)
        graph, hidden = self._graphs[size]
        graph.replay()
        rows = host.logits_indices.pin_memory().to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows))

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, graph_size: int | None = None,
                pending_tokens: torch.Tensor | None = None, moe_mode: str = "low_latency") -> torch.Tensor:
        """Logits float32 [sum(logits_rows(batch)), vocab] (one row per sequence unless one computes
        prompt logprobs); an empty batch still runs the model (its MoE layers take part in the other
        ranks' dispatch and combine) and gives [0, vocab]. graph_size: replay that captured step graph
        (`graph_size`; the batch must fit it: fits_graph), None: run eagerly. pending_tokens: the previous
        step's sampled tokens on the device, where the batch's pending tokens are (see pending_inputs).
        moe_mode: the MoE layers' dispatch mode (ForwardBatch.moe_mode; the graphs are low-latency ones)."""
        if graph_size is not None:
            if moe_mode != "low_latency":
                raise ValueError(f"graph_size: the step graphs dispatch in low-latency mode, not {moe_mode!r}")
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
    """Why steps cannot replay CUDA graphs here, or None if they can. ep_backend: the MoE
    layers' Buffer backend (None without MoE layers)."""
    if device.type != "cuda":
        return "no GPU"
    if ep_backend not in (None, "cuda"):
        return f"the {ep_backend} backend's dispatch waits on the host"
    if max_model_len > GRAPH_MAX_MODEL_LEN and not mla_decode_triton.available():
        return (f"max_model_len {max_model_len} > {GRAPH_MAX_MODEL_LEN}: without Triton the graph-safe attention "
                "reads max_model_len keys per token (set --max-model-len to capture graphs)")
    return None

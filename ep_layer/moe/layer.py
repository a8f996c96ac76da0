"""`FusedMoE`: DeepSeek-V3's MoE layer (router, routed experts over expert parallelism, shared experts)
on top of `ep_layer.Buffer`'s low-latency dispatch and combine (docs/design.md section 4), or, for
batches larger than the low-latency buffer's T, its normal mode (normal_forward.py).

One micro-batch's forward is written once, as steps (`FusedMoE.steps`): route; send the dispatch;
then the shared expert's gate_up projection while the tokens travel, the dispatch hook, the expert GEMMs
and the combine send; then the shared expert's down projection while the rows travel back, and the
combine hook. Running the steps to the end is the plain forward; interleaving two micro-batches' steps is
the overlapped one, with bit-identical results on CPU. There the first micro-batch runs its whole shared
expert under its dispatch and the second under its combine, the exchanges that nothing else overlaps. On
a GPU both forwards queue the communication on side streams (CommStreams): the plain forward's
exchanges run beside the shared expert, the overlapped one's under the other half's compute. Single-batch
overlap (`steps(..., sbo=True)`) is the plain forward with the combine's send running beside the down GEMM,
sending each row once the GEMM signals it written. `FusedMoE(overlap=...)` picks the schedule
(ep_layer.moe.overlap).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..backends import resolve_backend
from ..backends.base import SendSignals
from ..backends.exchange import group_rank_and_size
from ..buffer import Buffer
from ..checks import MAX_TOKENS_PER_RANK
from ..config import Config, normal_mode_bytes
from ..quant import FP8_GROUP
from ..streams import current_stream, record
from .experts import EXPERT_KERNELS, DenseActivation, ExpertKernels, RecvX, make_expert_kernels
from .loading import LoadTargets, load_moe_weights
from .normal_forward import normal_forward
from .overlap import SBO_SEND_SMS, GpuRates, LayerCost, Prediction, check_overlap, predict
from .routing import RoutingConfig
from .schedule import (
    COMBINE_HOOKED,
    COMBINE_SENT,
    DISPATCH_HOOKED,
    DISPATCH_SENT,
    ROUTED,
    SHARED_QUEUED,
    CommStreams,
    Steps,
    run_hook,
    run_to_end,
    run_two_microbatches,
    send_on,
)
from .weights import ExpertWeights

QUANT_MODES = ("bf16", "fp8-block")
DISPATCH_MODES = ("low_latency", "normal")  # the Buffer calls a forward runs on
SHARED_UNDER = ("both", "dispatch", "combine")
# Where each micro-batch of the overlapped forward runs its shared expert (`steps`' shared_under): the
# second one's dispatch already runs under the first one's experts, and its combine has nothing else to run under.
# A first micro-batch whose second is empty (one token) runs it under both, as the plain forward does: then
# nothing else overlaps its combine either (benchmarks/RESULTS.md, bench_moe.py).
MICROBATCH_SHARED_UNDER = ("dispatch", "combine")


@dataclass(frozen=True)
class MoEStats:
    """A FusedMoE's counters, summed over its forwards on its device (live tensors, not copies: reading
    one waits for the device). The dispatch / combine latency histograms are its Buffer's
    (`FusedMoE.buffer.latency_stats()`), which layers may share."""

    expert_load: torch.Tensor  # int32 [num_local_experts]: rows each local expert received
    dispatch_wait_ns: torch.Tensor  # int64 [num_ranks]: nanoseconds dispatch waited for each source rank
    combine_wait_ns: torch.Tensor  # int64 [num_ranks]: the same for combine


class FusedMoE(nn.Module):
    """DeepSeek-V3 MoE over expert parallelism: rank r of the `group` (or of `buffer`) owns experts
    [r * E_l, (r + 1) * E_l), E_l = num_experts / ranks; every rank holds the router and the shared
    experts and runs forward on its own tokens, in step with the other ranks.

    quant: "bf16" (bf16 weights, bf16 dispatch) or "fp8-block" (e4m3 weights with 128x128 block scales,
    FP8 dispatch, per-token-per-128 activation scales). buffer: an existing low-latency Buffer, else one
    is made for `group`. expert_kernels: "auto" (Triton on GPU, PyTorch on CPU), "torch" or "triton".
    overlap: the low-latency forward's schedule (ep_layer.moe.overlap): "none", "sbo" (the combine sends
    each expert's rows as the down GEMM finishes them), "dbo" (two micro-batches) or "auto" (per call, "sbo"
    where the cost model says it saves time, else "none"). Every rank of a layer must pass the same.
    Move the layer with `.to(device)` only: a dtype cast would convert its FP8 weights too.
    """

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 group: dist.ProcessGroup | None, *, n_group: int, topk_group: int,
                 routed_scaling_factor: float, quant: str = "bf16", n_shared_experts: int = 1,
                 buffer: Buffer | None = None, max_tokens_per_rank: int = 128, norm_topk_prob: bool = True,
                 expert_kernels: str = "auto", device: torch.device | str | None = None,
                 overlap: str = "none") -> None:
        super().__init__()
        _check_sizes(hidden, intermediate, n_shared_experts, max_tokens_per_rank, quant)
        self._overlap = check_overlap(overlap)
        if expert_kernels not in EXPERT_KERNELS:
            raise ValueError(f"expert_kernels: expected one of {EXPERT_KERNELS}, got {expert_kernels!r}")
        self.routing = RoutingConfig(num_experts, top_k, n_group, topk_group, float(routed_scaling_factor),
                                     norm_topk_prob)
        self.num_experts, self.top_k, self.hidden, self.intermediate = num_experts, top_k, hidden, intermediate
        self.quant, self.fp8 = quant, quant == "fp8-block"
        self.max_tokens_per_rank = max_tokens_per_rank
        self.buffer = buffer if buffer is not None else make_buffer(group, max_tokens_per_rank, hidden,
                                                                    num_experts, device=device)
        if group is not None and buffer is not None and dist.get_world_size(group) != self.buffer.group_size:
            raise ValueError(f"group: has {dist.get_world_size(group)} ranks but buffer has "
                             f"{self.buffer.group_size}; pass the buffer's own group")
        self.rank, self.num_ranks = self.buffer.rank, self.buffer.group_size
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts: expected a multiple of the EP size {self.num_ranks}, got {num_experts}")
        self.num_local_experts = num_experts // self.num_ranks
        self.register_buffer("gate_weight", torch.zeros(num_experts, hidden, device=device))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device))
        self.experts = ExpertWeights(self.num_local_experts, hidden, intermediate, self.fp8, device)
        self.shared_experts = (ExpertWeights(1, hidden, intermediate * n_shared_experts, self.fp8, device)
                               if n_shared_experts else None)
        # Rows each local expert received, summed over forwards, on device (expert-load metrics).
        self.register_buffer("expert_load", torch.zeros(self.num_local_experts, dtype=torch.int32, device=device))
        # Nanoseconds dispatch / combine waited for each source rank, summed over forwards (per-rank wait
        # metrics; the Buffer adds to them on device). Not part of the weights.
        for name in ("dispatch_wait_recv_cost_stats", "combine_wait_recv_cost_stats"):
            self.register_buffer(name, torch.zeros(self.num_ranks, dtype=torch.int64, device=device), persistent=False)
        self.expert_kernels = expert_kernels
        self._kernels: dict[torch.device, ExpertKernels] = {}
        self._comm_streams: dict[torch.device, CommStreams] = {}
        # Where the backend and the expert kernels allow it, the GEMMs read the dispatched rows where they
        # arrived (Buffer.low_latency_dispatch(rows_in_place=True)): no packed copy of them. False: a copy.
        self.read_rows_in_place = True
        self._auto_schedules: dict[tuple[int, torch.device], str] = {}  # overlap="auto"'s choice per batch size

    # ------------------------------------------------------------------ metrics
    def stats(self) -> MoEStats:
        """This layer's expert-load and wait-cost counters (the Buffer adds to them on device)."""
        return MoEStats(self.expert_load, self.dispatch_wait_recv_cost_stats, self.combine_wait_recv_cost_stats)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF DeepSeek-V3 tensors named as under a layer's `mlp.` prefix (`gate.weight`,
        `experts.{i}.gate_proj.weight`, ...); this rank keeps its own experts and skips the others."""
        load_moe_weights(weights, LoadTargets(
            self.gate_weight, self.e_score_correction_bias, self.experts,
            self.rank * self.num_local_experts, self.num_experts, self.shared_experts))

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, mode: str = "low_latency") -> torch.Tensor:
        """bf16 [N, H] -> bf16 [N, H] (N may be 0; all ranks call together, in the same mode).

        mode "low_latency": N <= max_tokens_per_rank. On a GPU the dispatch and combine run on the layer's
        side streams (CommStreams), so the shared expert computes while they run (its gate_up projection
        under the dispatch, its down projection under the combine); on one stream it would wait for the
        send kernel, which moves the rows itself (CUDA IPC, and ranks sharing a GPU). The layer's `overlap`
        (`schedule`) says whether the combine also runs under the down GEMM, or the batch in two halves.
        mode "normal": any N, through the Buffer's normal mode (a Buffer made with num_nvl_bytes > 0:
        make_buffer(..., normal_mode=True)); the host waits for the dispatch's counts."""
        if mode == "normal":
            return normal_forward(self, self._check_input(hidden_states, normal=True))
        if mode != "low_latency":
            raise ValueError(f"mode: expected one of {DISPATCH_MODES}, got {mode!r}")
        x = self._check_input(hidden_states)
        schedule = self.schedule(x.shape[0], x.device)
        if schedule == "dbo":
            return forward_two_microbatches([self], [x], self.comm_streams(x.device))[0]
        return run_to_end(self.steps(x, self.comm_streams(x.device), sbo=schedule == "sbo"))

    @property
    def overlap(self) -> str:
        """The low-latency forward's schedule, as FusedMoE(overlap=...) takes it; may be set between calls."""
        return self._overlap

    @overlap.setter
    def overlap(self, overlap: str) -> None:
        self._overlap = check_overlap(overlap)

    def schedule(self, tokens: int, device: torch.device) -> str:
        """The schedule a low-latency forward of `tokens` tokens on `device` runs: "none", "sbo" or "dbo"."""
        return self.auto_schedule(tokens, device) if self.overlap == "auto" else self.overlap

    def auto_schedule(self, tokens: int, device: torch.device) -> str:
        """What overlap="auto" runs: the cost model's choice between "none" and "sbo" (a choice each rank makes
        alone: both run the same exchanges); "none" where the send cannot wait for signals on the device.
        It never picks "dbo": ranks with different batch sizes would disagree on the number of exchanges
        (where the model says it would pay, pass overlap="dbo")."""
        choice = self._auto_schedules.get((tokens, device))
        if choice is None:
            choice = "none"
            if device.type == "cuda" and self.buffer.signals_waited_on_device:
                choice = self.predict(tokens, device).best(("sbo",))
            self._auto_schedules[(tokens, device)] = choice
        return choice

    def forward_two_microbatches(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """forward with the batch split in two halves whose communication overlaps the other's compute;
        equal to `forward` (bit for bit on CPU). Each half holds at most max_tokens_per_rank tokens. On a GPU the
        communication runs on the layer's side streams (CommStreams), concurrently with the compute."""
        x = self._check_input(hidden_states)
        return forward_two_microbatches([self], [x], self.comm_streams(x.device))[0]

    def predict(self, tokens: int, device: torch.device) -> Prediction:
        """The cost model's times of each schedule for `tokens` tokens per rank on `device` (ep_layer.moe.overlap)."""
        cost = LayerCost(self.hidden, self.intermediate, self.num_experts, self.top_k, self.num_ranks, self.fp8,
                         self.shared_experts.intermediate if self.shared_experts else 0, self.buffer.ranks_on_this_gpu)
        return predict(cost, tokens, GpuRates.for_device(device))

    def comm_streams(self, device: torch.device) -> CommStreams | None:
        """This layer's side streams for communication on `device` (None on CPU)."""
        if device.type != "cuda":
            return None
        streams = self._comm_streams.get(device)
        if streams is None:
            streams = self._comm_streams[device] = CommStreams.new(device)
        return streams

    def steps(self, hidden_states: torch.Tensor, streams: CommStreams | None = None,
              shared_under: str = "both", sbo: bool = False) -> Steps[torch.Tensor]:
        """One micro-batch's forward as a generator that yields after routing, after each send, after the
        shared expert and after each hook is queued, and returns the output (see ep_layer.moe.schedule).
        With `streams` the dispatch and combine kernels run on those side streams (layers of emulated ranks
        on one GPU share one).
        shared_under: the communication the shared expert runs under: "both" (its gate_up projection under
        the dispatch, its down projection under the combine: the plain forward, where both exchanges wait
        for it), "dispatch" or "combine" (the overlapped schedule's first and second micro-batch: the
        second one's dispatch already runs under the first one's experts, and its combine would
        otherwise have nothing to run under).
        sbo: single-batch overlap (`_combine_under_down`): the combine's send goes out expert by expert under
        the down GEMM; the same results, bit for bit."""
        if shared_under not in SHARED_UNDER:
            raise ValueError(f"shared_under: expected one of {SHARED_UNDER}, got {shared_under!r}")
        x = self._check_input(hidden_states)
        topk_idx, topk_weights = self.route(x)
        yield ROUTED
        dispatch_stream, combine_stream = (streams.dispatch, streams.combine) if streams else (None, None)
        with send_on(dispatch_stream):
            recv_x, recv_count, handle, _, dispatch_hook = self.buffer.low_latency_dispatch(
                x, topk_idx, self.max_tokens_per_rank, self.num_experts,
                cumulative_local_expert_recv_stats=self.expert_load,
                dispatch_wait_recv_cost_stats=self.dispatch_wait_recv_cost_stats, use_fp8=self.fp8,
                return_recv_hook=True, rows_in_place=self.rows_in_place(x.device))
        yield DISPATCH_SENT
        # On one stream the hook runs after the shared expert (between the send and the hook); on a side
        # stream it is queued right behind its send, under the shared expert, and only waited for here.
        wait_received = dispatch_hook if dispatch_stream is None else run_hook(dispatch_hook, dispatch_stream)
        yield DISPATCH_HOOKED
        if shared_under == "dispatch":
            shared = self.shared_expert(x)
            yield SHARED_QUEUED
        elif shared_under == "both":
            act = self.shared_gate_up(x)
            yield SHARED_QUEUED
        wait_received()
        # Zero-copy combine: the down GEMM writes where the combine reads (on the cuda backend, peers on
        # this GPU read the rows there: nothing is copied into their slots).
        y = self.buffer.get_next_low_latency_combine_buffer(handle)
        combine = partial(self.buffer.low_latency_combine, y, topk_idx, topk_weights, handle, zero_copy=True,
                          return_recv_hook=True, combine_wait_recv_cost_stats=self.combine_wait_recv_cost_stats)
        signals = None  # single-batch overlap's completion signals, held until the combine is waited for
        if sbo:
            combined, combine_hook, signals = self._combine_under_down(combine, recv_x, recv_count, y, combine_stream)
        else:
            self.run_experts(recv_x, recv_count, y)
            with send_on(combine_stream):
                combined, _, combine_hook = combine()
        yield COMBINE_SENT
        # Queued before the hook: on one stream too it runs while the rows travel.
        if shared_under == "combine":
            shared = self.shared_expert(x)
            yield SHARED_QUEUED
        elif shared_under == "both":
            shared = self.shared_down(act)
            yield SHARED_QUEUED
        wait_combined = run_hook(combine_hook, combine_stream)
        yield COMBINE_HOOKED
        wait_combined()
        # Made on this stream and read by the combine on its own: freed only now that this stream has waited for
        # it, or the allocator could hand the memory to this stream's next kernels (other ranks' steps run in
        # between) while the send still polls it.
        del signals
        return combined if shared is None else combined + shared

    def _combine_under_down(self, combine: Callable, recv_x: RecvX, recv_count: torch.Tensor, y: torch.Tensor,
                            stream: torch.cuda.Stream | None) -> tuple[torch.Tensor, Callable[[], None], SendSignals]:
        """Single-batch overlap: the routed experts into y with the combine's send waiting for the down GEMM's
        completion signals, so that each expert's rows leave as soon as they are written. Where the backend waits
        for signals on the device the send runs on its side stream behind the zeroed signals only, beside the
        GEMM, whose grid leaves it its SMs; elsewhere (one stream, or a backend that waits on the host) it
        follows the GEMM, and sends rows whose signals are all set. The GEMM is launched first either way: a
        kernel's first launch loads its module, and loading waits for the GPU's running kernels, a send
        spinning on the GEMM's signals among them (a GPU run hung so, until the 100 s timeout).
        Returns combine's output, its hook and the signals, which the caller holds until the combine is waited for."""
        kernels = self._kernels_for(recv_count.device)
        act = kernels.gate_up(recv_x, recv_count, self.experts)
        signals = kernels.completion_signals(self.num_local_experts, y.shape[1], self.hidden, recv_count.device)
        early = stream is not None and self.buffer.signals_waited_on_device
        zeroed = record(current_stream(y.device.index)) if early else None
        kernels.down(act, recv_count, self.experts, y, signals, spare_sms=SBO_SEND_SMS if early else 0)
        with send_on(stream, after=zeroed):
            combined, _, hook = combine(overlap=True, packed_recv_count=recv_count, comp_signal=signals.signals,
                                        block_m=signals.rows, threshold=signals.threshold,
                                        num_sms=SBO_SEND_SMS if early else None)
        return combined, hook, signals

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_idx int64 [N, K], topk_weights float32 [N, K]) by DeepSeek-V3's noaux_tc routing."""
        kernels = self._kernels_for(hidden_states.device)
        return kernels.route(hidden_states, self.gate_weight, self.e_score_correction_bias, self.routing)

    def rows_in_place(self, device: torch.device) -> bool:
        """Whether this layer's dispatch on `device` leaves the rows in place for its expert kernels
        (read_rows_in_place, where the backend and the kernels can)."""
        return (self.read_rows_in_place and self.buffer.supports_rows_in_place
                and self._kernels_for(device).reads_rows_in_place)

    def run_experts(self, x: RecvX, recv_count: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's experts on dispatch's output: bf16 [E_l, R*T, H] in dispatch's row order (into `out`)."""
        return self._kernels_for(recv_count.device)(x, recv_count, self.experts, out)

    def weighted_rows(self, y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
        """Normal mode's weighted sum of each received token's expert outputs (ExpertKernels.weighted_rows)."""
        self._kernels_for(out.device).weighted_rows(y, slot, weights, out)

    def shared_expert(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output bf16 [N, H] (None without shared experts): one expert's MLP on all N
        tokens (ExpertKernels.dense_mlp)."""
        if self.shared_experts is None:
            return None
        return self._kernels_for(hidden_states.device).dense_mlp(hidden_states, self.shared_experts)

    def shared_gate_up(self, hidden_states: torch.Tensor) -> DenseActivation | None:
        """shared_expert's first half: SiLU(gate) * up, bf16 [N, I] or already cast for the down projection
        (ExpertKernels.dense_gate_up; None without shared experts)."""
        if self.shared_experts is None:
            return None
        return self._kernels_for(hidden_states.device).dense_gate_up(hidden_states, self.shared_experts)

    def shared_down(self, act: DenseActivation | None) -> torch.Tensor | None:
        """shared_expert's second half: the down projection of shared_gate_up's output, bf16 [N, H]."""
        if act is None:
            return None
        device = (act[0] if isinstance(act, tuple) else act).device
        return self._kernels_for(device).dense_down(act, self.shared_experts)

    # ------------------------------------------------------------------ helpers
    def _check_input(self, hidden_states: torch.Tensor, normal: bool = False) -> torch.Tensor:
        """hidden_states, contiguous, once it is bf16 [N, H] on the layer's device with N <= max_tokens_per_rank
        (any N in normal mode)."""
        ok = (isinstance(hidden_states, torch.Tensor) and hidden_states.dtype == torch.bfloat16
              and hidden_states.dim() == 2 and hidden_states.shape[1] == self.hidden
              and (normal or hidden_states.shape[0] <= self.max_tokens_per_rank))
        if not ok:
            given = (f"{hidden_states.dtype} {list(hidden_states.shape)}" if isinstance(hidden_states, torch.Tensor)
                     else type(hidden_states).__name__)
            limit = "" if normal else f" with N <= max_tokens_per_rank={self.max_tokens_per_rank}"
            raise ValueError(f"hidden_states: expected bf16 [N, {self.hidden}]{limit}, got {given}")
        if hidden_states.device != self.gate_weight.device:
            raise ValueError(f"hidden_states: expected device {self.gate_weight.device} (the layer's), "
                             f"got {hidden_states.device}")
        return hidden_states.contiguous()

    def _kernels_for(self, device: torch.device) -> ExpertKernels:
        kernels = self._kernels.get(device)
        if kernels is None:
            kernels = self._kernels[device] = make_expert_kernels(self.expert_kernels, device)
        return kernels

    def extra_repr(self) -> str:
        r = self.routing
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, n_group={r.n_group}, topk_group={r.topk_group}, "
                f"quant={self.quant!r}, rank={self.rank}/{self.num_ranks}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}")


def microbatches(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two micro-batches of the overlapped forward: the first (larger) and the second half of the tokens."""
    half = (hidden_states.shape[0] + 1) // 2
    return hidden_states[:half], hidden_states[half:]


def forward_two_microbatches(layers: Sequence[FusedMoE], inputs: Sequence[torch.Tensor],
                             streams: CommStreams | None, depth: int = 1) -> list[torch.Tensor]:
    """The overlapped forward of ranks that step together (each layer of `layers` on its input; emulated
    ranks on one GPU, or a single rank): every input split into its two micro-batches, each micro-batch
    through `depth` calls of its layer in a row (a model's MoE layers), the two interleaved by
    run_two_microbatches with the communication on `streams` (None: the current stream); outputs in order."""
    first_under, second_under = MICROBATCH_SHARED_UNDER
    split = [(layer, microbatches(x)) for layer, x in zip(layers, inputs, strict=True)]
    first, second = run_two_microbatches(
        [chain_steps(layer, halves[0], depth, streams, first_under if len(halves[1]) else "both")
         for layer, halves in split],
        [chain_steps(layer, halves[1], depth, streams, second_under) for layer, halves in split])
    return [torch.cat(pair) for pair in zip(first, second)]


def chain_steps(layer: FusedMoE, hidden_states: torch.Tensor, depth: int, streams: CommStreams | None = None,
                shared_under: str = "both", sbo: bool = False) -> Steps[torch.Tensor]:
    """`depth` forwards of `layer` in a row as one generator of steps, each on the last one's output."""
    for _ in range(depth):
        hidden_states = yield from layer.steps(hidden_states, streams, shared_under, sbo)
    return hidden_states


def _check_sizes(hidden: int, intermediate: int, n_shared_experts: int, max_tokens_per_rank: int,
                 quant: str) -> None:
    if quant not in QUANT_MODES:
        raise ValueError(f"quant: expected one of {QUANT_MODES}, got {quant!r}")
    sizes = (("hidden", hidden, 1), ("intermediate", intermediate, 1), ("n_shared_experts", n_shared_experts, 0),
             ("max_tokens_per_rank", max_tokens_per_rank, 1))
    for name, value, low in sizes:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if max_tokens_per_rank > MAX_TOKENS_PER_RANK:
        raise ValueError(f"max_tokens_per_rank: expected at most {MAX_TOKENS_PER_RANK}, got {max_tokens_per_rank}")
    if quant == "fp8-block" and hidden % FP8_GROUP:
        raise ValueError(f"hidden: expected a multiple of {FP8_GROUP} for quant='fp8-block' (FP8 dispatch), "
                         f"got {hidden}")


def make_buffer(group: dist.ProcessGroup | None, max_tokens_per_rank: int, hidden: int, num_experts: int,
                backend: str = "auto", device: torch.device | str | None = None, *,
                normal_mode: bool = False, normal_tokens: int | None = None, transport: str = "auto") -> Buffer:
    """A low-latency Buffer for `group` (None: the default group, else one rank) sized for MoE layers on
    `device` that dispatch up to max_tokens_per_rank tokens of `hidden` channels to num_experts experts;
    with `normal_mode`, sized for normal-mode calls too (FusedMoE.forward(..., mode="normal")): of up to
    `normal_tokens` tokens a rank (normal_mode_bytes), and at least DeepEP's size hint (Config). `transport`
    is the Buffer's (the cuda backend's CUDA IPC or NVSHMEM)."""
    _, ranks = group_rank_and_size(group)
    if num_experts % ranks:
        raise ValueError(f"num_experts: expected a multiple of the EP size {ranks}, got {num_experts}")
    size = Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, ranks, num_experts)
    nvl_bytes = 0
    if normal_mode:
        nvl_bytes = Config().get_nvl_buffer_size_hint(2 * hidden, ranks)
        if normal_tokens is not None:
            nvl_bytes = max(nvl_bytes, normal_mode_bytes(normal_tokens, hidden, ranks))
    backend = resolve_backend(backend, device=torch.empty(0, device=device).device)
    return Buffer(group, num_nvl_bytes=nvl_bytes, num_rdma_bytes=size, low_latency_mode=True, backend=backend,
                  transport=transport)

"""Expert compute on dispatch's masked layout, behind one small interface so that implementations
(PyTorch here, Triton in triton_experts.py) plug in by name.

Contract shared by every implementation, so that they agree up to float32 summation order:
products accumulate in float32; a = SiLU(gate) * up is formed in float32 and rounded to bf16; with
FP8 weights, `a` is cast per token and 128 channels (ep_layer.quant, like the dispatch) before the
down GEMM, whose float32 result is rounded to bf16.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from ..backends.base import RecvX, RowsInPlace, SendSignals
from ..quant import FP8_GROUP, per_token_cast_back, per_token_cast_to_fp8
from .routing import RoutingConfig, route
from .tiles import map_row_tiles
from .weights import ExpertWeights

EXPERT_KERNELS = ("auto", "torch", "triton")
Activation = tuple[torch.Tensor, torch.Tensor | None]  # gate_up's output: bf16 [E, M, I], or FP8 with scales
# dense_gate_up's output, which dense_down of the same implementation reads: bf16 [N, I], or FP8 rows with scales
DenseActivation = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class ExpertKernels(ABC):
    """One way to run the expert GEMMs on the masked layout [E, M, H] with `recv_count` on device, and
    the router's expert selection."""

    name: str

    def __call__(self, x: RecvX, recv_count: torch.Tensor, weights: ExpertWeights,
                 out: torch.Tensor | None = None, signals: SendSignals | None = None) -> torch.Tensor:
        """bf16 [E, M, H] (`out` when given, e.g. a zero-copy combine buffer): row m of expert e is expert
        e's MLP of x[e, m] for m < recv_count[e]; later rows are unspecified (and should cost nothing).

        x is bf16 [E, M, H], or (float8_e4m3fn [E, M, H], float32 scales [E, M, H/128]) with any
        strides (dispatch's scales are column-major), or dispatch's RowsInPlace where the implementation
        reads rows where they lie (`reads_rows_in_place`). signals: see `down`."""
        return self.down(self.gate_up(x, recv_count, weights), recv_count, weights, out, signals)

    @abstractmethod
    def gate_up(self, x: RecvX, recv_count: torch.Tensor, weights: ExpertWeights) -> Activation:
        """The MLP's first half on the received rows (x as for __call__): SiLU(gate) * up rounded to bf16, in
        the form this implementation's `down` takes (the Triton one's already FP8-cast for FP8 weights)."""

    @abstractmethod
    def down(self, act: Activation, recv_count: torch.Tensor, weights: ExpertWeights,
             out: torch.Tensor | None = None, signals: SendSignals | None = None, spare_sms: int = 0) -> torch.Tensor:
        """The MLP's second half: the down projection of gate_up's output, bf16 [E, M, H] (into `out`).
        With `signals` (from `completion_signals`, zeroed) it also counts its finished rows there, so that
        a combine on another stream can send each row as soon as it is written (single-batch overlap):
        rows [j * signals.rows, (j + 1) * signals.rows) of expert e are written once signal
        e * signals.per_expert + j reaches signals.threshold. `spare_sms`: SMs a GEMM sized by the GPU's SMs
        leaves to a kernel running beside it (that combine's send)."""

    @abstractmethod
    def completion_signals(self, num_experts: int, rows: int, hidden: int, device: torch.device) -> SendSignals:
        """Zeroed signals for one `down` call on [num_experts, rows, hidden], in this implementation's
        granularity (its tile of rows, and how many writes complete one)."""

    reads_rows_in_place = False

    def route(self, hidden_states: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
              config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """routing.route: (topk_idx int64 [N, K], topk_weights float32 [N, K]) for hidden_states [N, H]."""
        return route(hidden_states, gate_weight, e_score_correction_bias, config)

    def dense_mlp(self, x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        """The MLP of `weights`' one expert on every row of x bf16 [N, H] (the shared experts), computed
        as the routed experts' is: bf16 [N, H]. In two halves, so that a caller can run something between
        them (FusedMoE runs the second while the combine travels)."""
        return self.dense_down(self.dense_gate_up(x, weights), weights)

    @abstractmethod
    def dense_gate_up(self, x: torch.Tensor, weights: ExpertWeights) -> DenseActivation:
        """The first half of dense_mlp: SiLU(gate) * up of x bf16 [N, H] (cast to FP8 first for FP8
        weights, as the routed experts' rows are), bf16 [N, I] (I padded as the weights are); an
        implementation may hand it to dense_down already cast to FP8 (e4m3 [N, I], float32 [N, I / 128]),
        as dense_down would cast it."""

    @abstractmethod
    def dense_down(self, act: DenseActivation, weights: ExpertWeights) -> torch.Tensor:
        """The second half of dense_mlp: the down projection of dense_gate_up's output (cast to FP8
        first for FP8 weights, where it comes as bf16), bf16 [N, H]."""

    def weighted_rows(self, y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
                      ) -> torch.Tensor:
        """Normal mode's weighted sum of each token's expert outputs: bf16 `out` [N, H] with
        out[i] = Σ_k weights[i, k] · y[slot[i, k]] over the entries with slot ≥ 0 (y bf16 [R, H], slot int64 [N, K],
        weights float32 [N, K]), in float32, ascending k, each product and sum rounded on its own (as the
        low-latency combine sums), rounded to bf16 once."""
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        for k in range(slot.shape[1]):
            term = weights[:, k, None] * y[slot[:, k].clamp(min=0)].float()
            acc = torch.where(slot[:, k, None] >= 0, acc + term, acc)
        return out.copy_(acc)

    def cast_to_fp8(self, x: torch.Tensor, recv_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 x [E, M, H] cast per token and 128 channels by ep_layer.quant's rule (rows from
        recv_count[e] on may be left unspecified): (float8_e4m3fn [E, M, H], float32 [E, M, H/128])."""
        e, m, h = x.shape
        data, scales = per_token_cast_to_fp8(x.reshape(e * m, h))
        return data.view(e, m, h), scales.view(e, m, h // FP8_GROUP)


def check_recv_count(recv_count: torch.Tensor, num_experts: int, device: torch.device) -> None:
    if recv_count.shape != (num_experts,) or recv_count.dtype != torch.int32 or recv_count.device != device:
        raise ValueError(f"recv_count: expected int32 [{num_experts}] on {device}, got {recv_count.dtype} "
                         f"{list(recv_count.shape)} on {recv_count.device}")


def check_rows_in_place(x: RowsInPlace, recv_count: torch.Tensor, weights: ExpertWeights) -> tuple[int, int]:
    """Check dispatch's rows in place against the weights and the module's quantisation; return (E, M)."""
    e, h = weights.num_experts, weights.hidden
    offsets = x.offsets
    if offsets.dim() != 2 or offsets.shape[0] != e or offsets.dtype != torch.int64:
        raise ValueError(f"x: expected row offsets int64 [{e}, rows], got {offsets.dtype} {list(offsets.shape)}")
    fp8 = x.scales is not None
    if x.hidden != h or fp8 != weights.fp8:
        raise ValueError(f"x: expected rows of {h} {'FP8' if weights.fp8 else 'bf16'} values, got rows of "
                         f"{x.hidden} {'FP8' if fp8 else 'bf16'} values")
    if fp8 and (x.scales.dtype != torch.float32 or x.scales.shape != (*offsets.shape, h // FP8_GROUP)):
        raise ValueError(f"x: expected float32 scales [{e}, {offsets.shape[1]}, {h // FP8_GROUP}] with the rows "
                         f"in place, got {x.scales.dtype} {list(x.scales.shape)}")
    check_recv_count(recv_count, e, offsets.device)
    return e, offsets.shape[1]


def split_recv_x(x: RecvX, recv_count: torch.Tensor, weights: ExpertWeights
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check x against the weights and the module's quantisation; return (data, scales or None)."""
    if isinstance(x, RowsInPlace):
        raise ValueError("x: rows in place (low_latency_dispatch(rows_in_place=True)) need expert kernels that "
                         "read them where they lie (the triton ones)")
    data, scales = x if isinstance(x, tuple) else (x, None)
    e, h = weights.num_experts, weights.hidden
    if data.dim() != 3 or data.shape[0] != e or data.shape[2] != h:
        raise ValueError(f"x: expected [{e}, rows, {h}] (local experts, rows, hidden), got {list(data.shape)}")
    if weights.fp8 != (scales is not None):
        want = "(fp8 data, float32 scales)" if weights.fp8 else "a bf16 tensor"
        raise ValueError(f"x: expected {want} for {'FP8' if weights.fp8 else 'bf16'} weights, got "
                         f"{'a tuple' if scales is not None else data.dtype}")
    if scales is None:
        if data.dtype != torch.bfloat16:
            raise ValueError(f"x: expected dtype torch.bfloat16, got {data.dtype}")
    elif data.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or \
            scales.shape != (*data.shape[:2], h // FP8_GROUP):
        raise ValueError(f"x: expected float8_e4m3fn data with float32 scales [{e}, rows, {h // FP8_GROUP}] "
                         f"(per-token, per-128 scales; UE8M0 is not supported here), got {data.dtype} data "
                         f"and {scales.dtype} scales {list(scales.shape)}")
    check_recv_count(recv_count, e, data.device)
    return data, scales


def gate_up_act(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's first half on float32 rows x [..., M, H] with float32 weights gate_up [..., 2I, H]: SiLU(gate) * up
    rounded to bf16, [..., M, I] (the module contract)."""
    gate, up = torch.matmul(x, gate_up.transpose(-1, -2)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def down_proj(act: torch.Tensor, down: torch.Tensor, fp8: bool) -> torch.Tensor:
    """The MLP's second half: the down projection of bf16 act [..., M, I] (FP8-cast first) by float32 weights
    down [..., H, I], bf16 [..., M, H]."""
    if fp8:
        flat = act.reshape(-1, act.shape[-1])
        a = per_token_cast_back(*per_token_cast_to_fp8(flat)).view(act.shape)
    else:
        a = act.float()
    return torch.matmul(a, down.transpose(-1, -2)).to(torch.bfloat16)


def rows_fp32(data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """float32 value of bf16 rows, or of fp8 rows with their per-128 scales."""
    return data.float() if scales is None else per_token_cast_back(data, scales)


class TorchExperts(ExpertKernels):
    """Plain PyTorch. On CPU it reads recv_count on the host and computes only the received rows;
    on a GPU (a fallback for machines without Triton) it computes every row, so that it needs no host
    sync and can be captured in a CUDA graph."""

    name = "torch"

    def gate_up(self, x: RecvX, recv_count: torch.Tensor, weights: ExpertWeights) -> Activation:
        data, scales = split_recv_x(x, recv_count, weights)
        if data.is_cuda:
            return gate_up_act(rows_fp32(data, scales), weights.gate_up_fp32(slice(None))), None
        e, m, _ = data.shape
        act = torch.empty(e, m, weights.padded_intermediate, dtype=torch.bfloat16)  # rows past a count unread
        for expert, count in enumerate(recv_count.tolist()):
            if count:
                gate_up = weights.gate_up_fp32(expert)
                received = (data[expert, :count],) if scales is None else (data[expert, :count],
                                                                            scales[expert, :count])
                act[expert, :count] = map_row_tiles(
                    lambda d, s=None: gate_up_act(rows_fp32(d, s), gate_up), *received)  # noqa: B023 - used at once
        return act, None

    def down(self, act: Activation, recv_count: torch.Tensor, weights: ExpertWeights,
             out: torch.Tensor | None = None, signals: SendSignals | None = None, spare_sms: int = 0) -> torch.Tensor:
        a = act[0]
        if a.is_cuda:  # every row, in one go: the signals all complete together
            y = down_proj(a, weights.down_fp32(slice(None)), weights.fp8)
            out = y if out is None else out.copy_(y)
            if signals is not None:
                signals.signals.add_(signals.threshold)
            return out
        if out is None:
            out = torch.empty(*a.shape[:2], weights.hidden, dtype=torch.bfloat16)
        for expert, count in enumerate(recv_count.tolist()):
            if count:
                down = weights.down_fp32(expert)
                out[expert, :count] = map_row_tiles(lambda rows: down_proj(rows, down, weights.fp8),  # noqa: B023
                                                    a[expert, :count])
                if signals is not None:  # one signal per expert (completion_signals)
                    signals.signals[signals.index(expert, 0)] += signals.threshold
        return out

    def completion_signals(self, num_experts: int, rows: int, hidden: int, device: torch.device) -> SendSignals:
        # An expert's rows are written together: one signal each, complete at its first write.
        return SendSignals(torch.zeros(num_experts, dtype=torch.int32, device=device), max(rows, 1), 1, 1)

    def dense_gate_up(self, x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        count = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        received = [r[0] for r in self.cast_to_fp8(x[None], count)] if weights.fp8 else [x]
        gate_up = weights.gate_up_fp32(0)
        return map_row_tiles(lambda data, scales=None: gate_up_act(rows_fp32(data, scales), gate_up), *received)

    def dense_down(self, act: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        down = weights.down_fp32(0)
        return map_row_tiles(lambda rows: down_proj(rows, down, weights.fp8), act)


def make_expert_kernels(name: str, device: torch.device) -> ExpertKernels:
    """The implementation called `name`; "auto" is Triton on a CUDA device where Triton works, else torch."""
    if name not in EXPERT_KERNELS:
        raise ValueError(f"expert_kernels: expected one of {EXPERT_KERNELS}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchExperts()
    from ..kernels import triton_support
    from . import triton_experts

    if triton_support.available():
        return triton_experts.TritonExperts()
    if name == "triton":
        raise ValueError(f"expert_kernels: 'triton' is not usable here ({triton_support.unavailable_reason()})")
    return TorchExperts()

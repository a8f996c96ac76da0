"""TritonExperts: the expert MLP on dispatch's masked layout, run by ep_layer.kernels' Triton kernels (GPU
only): the gate_up GEMM with SiLU(gate) * up, the FP8 cast of the intermediate for FP8 weights and the
down GEMM, all on the masked grouped GEMM's fixed grid (no host sync, CUDA-graph friendly); the router's
selection in one Triton kernel (triton_routing); the shared experts' MLP on the dense FP8 linear.

Importing this module needs neither Triton nor a GPU; ep_layer.kernels.triton_support.available() says
whether it can run.
"""

from __future__ import annotations

import torch

from ..backends.base import RowsInPlace, SendSignals
from ..kernels.fp8_cast import cast_rows_to_fp8
from ..kernels.fp8_linear import fp8_block_linear
from ..kernels.masked_gemm import completion_signals, masked_grouped_gemm
from ..kernels.weighted_rows import weighted_rows
from . import triton_routing
from .experts import Activation, DenseActivation, ExpertKernels, RecvX, check_rows_in_place, split_recv_x
from .routing import RoutingConfig
from .weights import ExpertWeights


def _bf16_one_expert(x: torch.Tensor, weight: torch.Tensor, columns: int, gated: bool = False) -> torch.Tensor:
    """x bf16 [M, K] through one expert's bf16 weight [1, rows, K] on the masked GEMM: bf16 [M, columns]
    (gated: gate rows [0, columns), up rows from `columns`, and SiLU(gate) * up)."""
    m = x.shape[0]
    out = torch.empty(m, columns, dtype=torch.bfloat16, device=x.device)
    if m > 0:
        count = torch.full((1,), m, dtype=torch.int32, device=x.device)
        masked_grouped_gemm(x[None], None, weight, None, count, out[None], up_offset=columns if gated else 0,
                            gated=gated)
    return out


class TritonExperts(ExpertKernels):
    """The expert MLP in two kernel launches (gate_up with SiLU * up, then down), plus the FP8 cast of
    the intermediate activation between them for FP8 weights. No host sync. The down GEMM counts each
    finished (row tile, column tile) in its completion signals. The shared experts' MLP
    (dense_gate_up, dense_down) takes the split-K GEMM at decode sizes."""

    name = "triton"
    reads_rows_in_place = True

    def gate_up(self, x: RecvX, recv_count: torch.Tensor, weights: ExpertWeights) -> Activation:
        if isinstance(x, RowsInPlace):  # the GEMM reads the rows where dispatch left them
            e, m = check_rows_in_place(x, recv_count, weights)
            a, a_scales, device = x, None, recv_count.device
        else:
            a, a_scales = split_recv_x(x, recv_count, weights)
            (e, m, _), device = a.shape, a.device
        act = torch.empty(e, m, weights.padded_intermediate, dtype=torch.bfloat16, device=device)
        if m == 0:
            return act, None
        masked_grouped_gemm(a, a_scales, weights.gate_up, weights.gate_up_scale, recv_count, act,
                            up_offset=weights.padded_intermediate, gated=True)
        if weights.fp8:  # only received rows are cast; the down GEMM never reads the others
            return cast_rows_to_fp8(act, recv_count)
        return act, None

    def down(self, act: Activation, recv_count: torch.Tensor, weights: ExpertWeights,
             out: torch.Tensor | None = None, signals: SendSignals | None = None, spare_sms: int = 0) -> torch.Tensor:
        data, scales = act
        e, m, _ = data.shape
        if out is None:
            out = torch.empty(e, m, weights.hidden, dtype=torch.bfloat16, device=data.device)
        if m == 0:
            return out
        return masked_grouped_gemm(data, scales, weights.down, weights.down_scale, recv_count, out, signals=signals,
                                   spare_sms=spare_sms)

    def completion_signals(self, num_experts: int, rows: int, hidden: int, device: torch.device) -> SendSignals:
        return completion_signals(num_experts, rows, hidden, device)

    def route(self, hidden_states: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: torch.Tensor,
              config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        # The selection in one launch, not a dozen; a decode step's few tokens' logits in a GEMV, not cuBLAS.
        return triton_routing.route(hidden_states, gate_weight, e_score_correction_bias, config)

    def dense_gate_up(self, x: torch.Tensor, weights: ExpertWeights) -> DenseActivation:
        if weights.fp8:  # it picks its GEMM: split-K at decode sizes (SiLU(gate) * up and the down's cast in its sum)
            return fp8_block_linear(x, weights.gate_up[0], weights.gate_up_scale[0], gated=True, fp8_out=True)
        return _bf16_one_expert(x, weights.gate_up, weights.padded_intermediate, gated=True)

    def dense_down(self, act: DenseActivation, weights: ExpertWeights) -> torch.Tensor:
        if weights.fp8:
            return fp8_block_linear(act, weights.down[0], weights.down_scale[0])  # it picks its GEMM
        return _bf16_one_expert(act, weights.down, weights.hidden)

    def weighted_rows(self, y: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
                      ) -> torch.Tensor:
        return weighted_rows(y, slot, weights.contiguous(), out)  # one launch (the PyTorch sum takes 5 a slot)

    def cast_to_fp8(self, x: torch.Tensor, recv_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cast_rows_to_fp8(x.contiguous(), recv_count)  # one launch (the PyTorch cast takes eight)

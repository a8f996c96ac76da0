"""Which schedule a FusedMoE forward runs (`FusedMoE(overlap=...)`), and the cost model behind "auto".

- "none": the plain forward; its dispatch and combine run beside the shared expert only.
- "sbo", single-batch overlap: one batch, and the combine's send starts expert by expert as the down
  GEMM's tiles finish (it waits for the GEMM's completion signals on a bounded share of SMs), so the
  combine travels under the down projection. Needs the exchange on a side stream and a backend that waits
  for the signals on the device (the cuda backend); elsewhere it runs in plain order, with the signals.
- "dbo", two micro-batches: each half's exchange under the other half's compute. Each half reads every
  active expert's weights again, so it pays only where the exchange outweighs that second read.
- "auto": "sbo" where `predict` says it saves at least AUTO_MARGIN of the plain forward's time, else
  "none" (FusedMoE.auto_schedule; never "dbo", which every rank would have to choose alike).

The model (docs/design.md section 4, "Choosing an overlap"): the expert GEMMs cost the larger of their
weight reads over HBM and their FP8 math; an exchange costs a fixed latency plus its bytes over the link
between ranks; every rank does the same work, and ranks emulated on one GPU share its HBM and its math
(`ranks_per_gpu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OVERLAP_MODES = ("none", "sbo", "dbo", "auto")
AUTO_MARGIN = 0.05  # "auto" overlaps only where the model says it saves at least this share of plain's time
# The SMs the combine's send may hold while it waits for the down GEMM's signals, which the GEMM's grid leaves free.
SBO_SEND_SMS = 8


# Copy rates as bench_ll measures them (benchmarks/RESULTS.md), Hopper's FP8 math as the expert GEMMs reach it
# at prefill sizes (about 60 % of the 1,979 TFLOP/s peak), one direction of NVLink 4 as an all-to-all reaches
# it; per µs. Between ranks on one GPU bench_moe's communication alone grows by 0.65 of the copy rate per byte
# (EP = 4 and 8, T = 128 to 256), and costs about 12 µs an op per rank at T = 0.
H100_HBM = 3.0e6
H200_HBM = 4.2e6
HOPPER_FP8_FLOPS = 1.2e9
NVLINK_BYTES = 0.40e6
SHARED_GPU_LINK_SHARE = 0.65
EXCHANGE_LATENCY_US = 12.0
SBO_OVERHEAD_US = 3.0  # zeroing the signals, and the send's launch and event beside the GEMM


@dataclass(frozen=True)
class GpuRates:
    """What the model charges, per µs: bytes a GEMM reads weights at (the measured copy rate), FP8 math,
    bytes of the link between ranks on different GPUs; and an exchange's fixed cost (launches, flags, the
    slowest rank)."""

    hbm_bytes_per_us: float
    fp8_flops_per_us: float
    link_bytes_per_us: float
    exchange_latency_us: float = EXCHANGE_LATENCY_US

    @classmethod
    def for_device(cls, device: torch.device) -> GpuRates:
        """Rates of `device`: an H200 by name, else an H100's."""
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        return cls(H200_HBM if "H200" in name else H100_HBM, HOPPER_FP8_FLOPS, NVLINK_BYTES)

    @property
    def shared_gpu_bytes_per_us(self) -> float:
        """What an exchange between ranks on one GPU moves per µs (its copies compete with the flags' polls)."""
        return self.hbm_bytes_per_us * SHARED_GPU_LINK_SHARE


@dataclass(frozen=True)
class LayerCost:
    """A MoE layer's sizes, and how its ranks sit on GPUs, as the model needs them."""

    hidden: int
    intermediate: int  # per routed expert
    num_experts: int
    top_k: int
    num_ranks: int
    fp8: bool  # FP8 weights and dispatch (else bf16)
    shared_intermediate: int  # the shared experts' width (0: none)
    ranks_per_gpu: int = 1  # ranks on one GPU share its HBM and math, and exchange through its memory

    @property
    def weight_bytes(self) -> float:
        """One routed expert's gate, up and down weights."""
        return 3 * self.hidden * self.intermediate * (1 if self.fp8 else 2)

    def active_experts(self, tokens: int) -> float:
        """Expected routed experts of one rank that receive a row when every rank routes `tokens` tokens,
        each to top_k distinct experts of num_experts, near uniformly."""
        picks = tokens * self.num_ranks
        return self.num_experts / self.num_ranks * (1 - (1 - self.top_k / self.num_experts) ** picks)

    def gemm_us(self, tokens: int, rates: GpuRates) -> tuple[float, float]:
        """(gate_up, down) of one GPU's ranks' routed experts on their rows (tokens x top_k each)."""
        rows = tokens * self.top_k
        active = self.active_experts(tokens)
        gate_up, down = (self._read_or_math_us(active * self.weight_bytes * share,
                                               2 * rows * 3 * self.hidden * self.intermediate * share, rates)
                         for share in (2 / 3, 1 / 3))  # gate_up holds two of the three matrices
        return gate_up, down

    def shared_us(self, tokens: int, rates: GpuRates) -> float:
        """One GPU's ranks' shared experts on `tokens` rows each."""
        if not self.shared_intermediate:
            return 0.0
        return self._read_or_math_us(3 * self.hidden * self.shared_intermediate * (1 if self.fp8 else 2),
                                     2 * tokens * 3 * self.hidden * self.shared_intermediate, rates)

    def _read_or_math_us(self, weight_bytes: float, flops: float, rates: GpuRates) -> float:
        """A GEMM on one GPU's ranks: its weight reads over HBM or its FP8 math, whichever takes longer."""
        return max(weight_bytes / rates.hbm_bytes_per_us, flops / rates.fp8_flops_per_us) * self.ranks_per_gpu

    def exchange_us(self, tokens: int, rates: GpuRates) -> Exchange:
        """One GPU's ranks' dispatch and combine of `tokens` tokens each: every token's rows to and from the
        ranks of its experts ((R - 1) / R of them elsewhere), FP8 (with scales) or bf16 out, bf16 back."""
        latency = rates.exchange_latency_us * self.ranks_per_gpu
        if self.num_ranks == 1:
            return Exchange(latency, latency / 2, latency / 2, combine_pushed=True)
        remote = tokens * self.top_k * (self.num_ranks - 1) / self.num_ranks * self.ranks_per_gpu
        row_out = self.hidden * (1 + 4 / 128) if self.fp8 else 2 * self.hidden
        one_gpu = self.ranks_per_gpu == self.num_ranks
        link = rates.shared_gpu_bytes_per_us if one_gpu else rates.link_bytes_per_us
        back = remote * 2 * self.hidden / link
        # Between GPUs the combine's send pushes the rows; on one GPU it only flags them and the receive reads them.
        return Exchange(latency + remote * row_out / link, latency / 2 + (0 if one_gpu else back),
                        latency / 2 + (back if one_gpu else 0), combine_pushed=not one_gpu)


@dataclass(frozen=True)
class Exchange:
    """µs of a dispatch, and of a combine's send and receive halves."""

    dispatch: float
    combine_send: float
    combine_receive: float
    combine_pushed: bool  # the send moves the rows (else the receive reads them)

    @property
    def combine(self) -> float:
        return self.combine_send + self.combine_receive


@dataclass(frozen=True)
class Prediction:
    """Predicted µs of one forward under each schedule."""

    none: float
    sbo: float
    dbo: float

    def best(self, overlaps: tuple[str, ...] = ("sbo", "dbo")) -> str:
        """The schedule to run: the fastest of `overlaps` where it saves at least AUTO_MARGIN of plain's
        time, else "none"."""
        mode = min(overlaps, key=lambda name: getattr(self, name))
        return mode if getattr(self, mode) <= self.none * (1 - AUTO_MARGIN) else "none"


def predict(layer: LayerCost, tokens: int, rates: GpuRates) -> Prediction:
    """The three schedules' times for `tokens` tokens per rank (the routing, the same in all three, left out).

    plain: the dispatch beside the shared expert's gate_up, the routed GEMMs, the combine beside its down.
    sbo: the same, but the combine's send runs under the down GEMM; its receive is left, beside the shared
    expert's down.
    dbo: the first half's dispatch beside its shared expert, the second half's dispatch under the first
    half's experts, the first half's combine under the second half's experts, the second half's combine
    beside its shared expert."""
    gate_up, down = layer.gemm_us(tokens, rates)
    x = layer.exchange_us(tokens, rates)
    shared = layer.shared_us(tokens, rates)
    before = max(x.dispatch, 2 / 3 * shared) + gate_up
    plain = before + down + max(x.combine, 1 / 3 * shared)
    sbo = before + max(down, x.combine_send) + max(x.combine_receive, 1 / 3 * shared) + SBO_OVERHEAD_US
    first, second = (tokens + 1) // 2, tokens // 2
    x1, x2 = layer.exchange_us(first, rates), layer.exchange_us(second, rates)
    dbo = (max(x1.dispatch, layer.shared_us(first, rates)) + max(sum(layer.gemm_us(first, rates)), x2.dispatch)
           + max(sum(layer.gemm_us(second, rates)), x1.combine) + max(x2.combine, layer.shared_us(second, rates)))
    return Prediction(plain, sbo, dbo)


def check_overlap(overlap: object) -> str:
    """`overlap`, once it is one of OVERLAP_MODES (else a ValueError naming it)."""
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap: expected one of {OVERLAP_MODES}, got {overlap!r}")
    return overlap  # type: ignore[return-value]

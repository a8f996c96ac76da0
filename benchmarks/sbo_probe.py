"""Where single-batch overlap's time goes, at EP = 1 on one GPU (the cuda backend, bench_moe.py's layer: DeepSeek-V3's
shapes, FP8 block weights): the down GEMM alone, with its completion signals (and their zeroing), and the zeroing
alone; then the layer plain beside SBO with the combine's send beside the down GEMM (as the layer runs it), and
plain beside SBO with the send queued after the GEMM (the layer's path for a backend that waits for signals on the
host, forced here). CUDA-graph replays, medians, the graphs of one row replayed in turn (bench_moe.py).
--sweep: plain beside SBO for SMs held by the send (ep_layer.moe.overlap.SBO_SEND_SMS) against SMs the down
GEMM's grid leaves free (its `spare_sms`; the layer leaves the send's), set here for each row.

    python benchmarks/sbo_probe.py                 # T = 128 and 32
    python benchmarks/sbo_probe.py --tokens 256
    python benchmarks/sbo_probe.py --sweep --tokens 128
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator

import torch
from bench_moe import Shape, cuda_buffers, hf_tensors, new_layer, time_graphs_in_turn

import ep_layer.moe.layer as layer_module
from ep_layer import Buffer
from ep_layer.kernels.masked_gemm import GEMM_PROGRAMS_PER_SM
from ep_layer.kernels.triton_support import sm_count
from ep_layer.moe import FusedMoE

# (SMs the send holds, SMs the down GEMM's grid leaves free): the full grid with three caps, then grids leaving
# some SMs (8 and 8: the layer's own).
SWEEP = ((8, 0), (1, 0), (32, 0), (8, 4), (8, 8), (32, 16))


@contextlib.contextmanager
def send_after_the_gemm(buffer: Buffer) -> Iterator[None]:
    """SBO's send queued behind the down GEMM (FusedMoE._combine_under_down's path when the backend waits for
    signals on the host), on the cuda backend."""
    cls = type(buffer)
    waited_on_device = cls.signals_waited_on_device
    cls.signals_waited_on_device = property(lambda self: False)
    try:
        yield
    finally:
        cls.signals_waited_on_device = waited_on_device


@contextlib.contextmanager
def send_and_grid(layer: FusedMoE, send_sms: int, spare_sms: int) -> Iterator[None]:
    """SBO with its send held to `send_sms` SMs and its down GEMM leaving `spare_sms` SMs free (where the layer
    leaves the send's)."""
    kernels = layer._kernels_for(torch.device("cuda"))
    layer_send_sms, down, spare = layer_module.SBO_SEND_SMS, kernels.down, spare_sms

    def down_on_grid(*args: object, spare_sms: int = 0, **kwargs: object) -> torch.Tensor:
        return down(*args, spare_sms=spare if spare_sms else 0, **kwargs)

    layer_module.SBO_SEND_SMS, kernels.down = send_sms, down_on_grid
    try:
        yield
    finally:
        layer_module.SBO_SEND_SMS, kernels.down = layer_send_sms, down


def layer_and_input(t: int) -> tuple[FusedMoE, torch.Tensor]:
    shape, dev = Shape(), torch.device("cuda")
    size = Buffer.get_low_latency_rdma_size_hint(t, shape.hidden, 1, shape.num_experts)
    layer = new_layer(shape, cuda_buffers(1, size)[0], t, dev)
    layer.load_weights(hf_tensors(shape, range(shape.num_experts), dev, seed=0))
    return layer, torch.randn(t, shape.hidden, device=dev).to(torch.bfloat16)


def plain_and_sbo(layer: FusedMoE, x: torch.Tensor) -> tuple[object, object]:
    def plain() -> None:
        layer.overlap = "none"
        layer(x)

    def sbo() -> None:
        layer.overlap = "sbo"
        layer(x)

    return plain, sbo


def sweep(t: int, reps: int) -> None:
    """Plain and SBO for each (send SMs, spare SMs) of SWEEP."""
    layer, x = layer_and_input(t)
    print(f"{torch.cuda.get_device_name()}, EP = 1, T = {t}, µs (graph replay, medians)")
    print(f"{'send SMs':>8s} | {'GEMM programs':>13s} | {'plain':>8s} | {'sbo':>8s} | {'sbo - plain':>11s}")
    sms = sm_count(x.device)
    for send_sms, spare_sms in SWEEP:
        with send_and_grid(layer, send_sms, spare_sms):
            plain, sbo = (statistics.median(s) for s in time_graphs_in_turn(list(plain_and_sbo(layer, x)), reps))
        print(f"{send_sms:8d} | {GEMM_PROGRAMS_PER_SM * (sms - spare_sms):13d} | {plain:8.1f} | {sbo:8.1f} | "
              f"{sbo - plain:11.1f}", flush=True)
    layer.buffer.destroy()


def probe(t: int, reps: int) -> list[float]:
    """One row of the table for T = t: the GEMM's three timings, then plain and SBO with the send beside the GEMM,
    then plain and SBO with the send after it."""
    layer, x = layer_and_input(t)
    dev = x.device
    topk_idx, _ = layer.route(x)
    recv_x, recv_count, handle, _, hook = layer.buffer.low_latency_dispatch(
        x, topk_idx, t, layer.num_experts, use_fp8=True, return_recv_hook=True, rows_in_place=True)
    hook()
    kernels = layer._kernels_for(dev)
    act = kernels.gate_up(recv_x, recv_count, layer.experts)
    y = layer.buffer.get_next_low_latency_combine_buffer(handle)
    signals = kernels.completion_signals(layer.num_local_experts, y.shape[1], layer.hidden, dev)

    def down() -> None:
        kernels.down(act, recv_count, layer.experts, y)

    def down_signalled() -> None:
        signals.signals.zero_()
        kernels.down(act, recv_count, layer.experts, y, signals)

    plain, sbo = plain_and_sbo(layer, x)
    row = [statistics.median(s) for s in time_graphs_in_turn([down, down_signalled, signals.signals.zero_], reps)]
    row += [statistics.median(s) for s in time_graphs_in_turn([plain, sbo], reps)]
    with send_after_the_gemm(layer.buffer):
        row += [statistics.median(s) for s in time_graphs_in_turn([plain, sbo], reps)]
    layer.buffer.destroy()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 32])
    p.add_argument("--reps", type=int, default=20, help="graph replays of each row's graphs")
    p.add_argument("--sweep", action="store_true", help="the send's SMs against the down GEMM's grid (SWEEP)")
    args = p.parse_args()
    if args.sweep:
        for t in args.tokens:
            sweep(t, args.reps)
        return
    columns = ("down GEMM", "+ signals", "zeroing", "plain", "sbo beside", "plain", "sbo after")
    print(f"{torch.cuda.get_device_name()}, EP = 1, µs (graph replay, medians)")
    print(" | ".join([f"{'T':>4s}", *(f"{c:>10s}" for c in columns)]))
    for t in args.tokens:
        row = probe(t, args.reps)
        print(" | ".join([f"{t:4d}", *(f"{us:10.1f}" for us in row)]), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

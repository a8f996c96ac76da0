"""The dense FP8 linears of a DeepSeek-V3 decode step (`ep_layer.kernels.fp8_linear.fp8_block_linear`: the
activation's cast, the split-K GEMM and its parts' sum, or the masked GEMM) against their floor: the bytes they
must move (the weight and its block scales, the activation, the output) over the GPU's measured copy rate.

Each projection is timed in a CUDA graph that calls it on enough copies of its weight to pass through HBM (four
times the L2 cache in total, taken in turn), as a decode step meets each layer's weight once; µs per call is the
replay's median over the copies. Every output is checked against float64 math on the same quantized operands.

--sweep times the split-K GEMM's tunables (column tile, programs per SM, warps, pipeline stages) for the rows
that take it, every configuration on the same weights, and prints the fastest few per projection beside the
module's own choice.

    python benchmarks/bench_linears.py                    # rows 1 8 32 64
    python benchmarks/bench_linears.py --sweep --rows 1 8
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from bench_ll import copy_bandwidth, print_table  # this script's folder is on sys.path
from bench_moe import random_fp8_weight, release_memory, require_gpu, time_graph

from ep_layer.block_fp8 import expand_block_scales
from ep_layer.kernels import fp8_linear
from ep_layer.kernels.fp8_linear import fp8_block_linear
from ep_layer.quant import FP8_GROUP, per_token_cast_to_fp8


@dataclass(frozen=True)
class Projection:
    name: str
    rows: int  # the weight's rows (gated: gate rows then up rows)
    columns: int  # input features
    gated: bool = False

    @property
    def outputs(self) -> int:
        """Output features: the weight's rows, or half of them for a gated projection."""
        return self.rows // 2 if self.gated else self.rows


# DeepSeek-V3's decode-step projections through fp8_block_linear (serving/models/mla.py, deepseek_v3.py).
PROJECTIONS = (
    Projection("fused_qkv_a", 1536 + 576, 7168),
    Projection("q_b", 128 * 192, 1536),
    Projection("o_proj", 7168, 128 * 128),
    Projection("shared gate_up", 2 * 2048, 7168, gated=True),
    Projection("shared down", 7168, 2048),
)
L2_PASSES = 4  # weight copies in one graph: this many times the L2 cache in total
TUNABLES = ("SPLITK_BLOCK_N", "SPLITK_PROGRAMS_PER_SM", "SPLITK_WARPS", "SPLITK_STAGES")
SWEEP = {"SPLITK_BLOCK_N": (32, 64, 128), "SPLITK_PROGRAMS_PER_SM": (1, 2, 4, 8), "SPLITK_WARPS": (4, 8),
         "SPLITK_STAGES": (2, 3, 4)}


@dataclass
class Operands:
    x: torch.Tensor
    weights: list[tuple[torch.Tensor, torch.Tensor]]  # the copies, each (e4m3 weight, its block scales)

    def bytes_per_call(self, projection: Projection) -> int:
        weight, scales = self.weights[0]
        return weight.numel() + 4 * scales.numel() + self.x.numel() * 2 + self.x.shape[0] * projection.outputs * 2


def operands(projection: Projection, rows: int, seed: int) -> Operands:
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    weight = random_fp8_weight(projection.rows, projection.columns, seed, device)
    copies = max(2, math.ceil(L2_PASSES * l2 / weight[0].numel()))
    weights = [weight] + [(weight[0].clone(), weight[1].clone()) for _ in range(copies - 1)]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(rows, projection.columns, device=device, generator=gen).to(torch.bfloat16)
    return Operands(x, weights)


def reference(projection: Projection, ops: Operands) -> torch.Tensor:
    """float64 math on the operands as the kernels quantize them (x per token and 128 channels, the weight's
    blocks), SiLU(gate) * up for a gated projection."""
    data, scales = per_token_cast_to_fp8(ops.x)
    x = (data.double().unflatten(1, (-1, FP8_GROUP)) * scales.double()[..., None]).flatten(1)
    weight, scale_inv = ops.weights[0]
    y = x @ (weight.double() * expand_block_scales(scale_inv, *weight.shape).double()).T
    if projection.gated:
        gate, up = y.chunk(2, dim=1)
        y = gate * torch.sigmoid(gate) * up
    return y


def relative_error(projection: Projection, ops: Operands) -> float:
    got = fp8_block_linear(ops.x, *ops.weights[0], gated=projection.gated).double()
    want = reference(projection, ops)
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - want).norm() / want.norm())


def us_per_call(projection: Projection, ops: Operands, reps: int) -> float:
    """Median µs of one call, from a graph of one call on each weight copy in turn."""
    def calls() -> None:
        for weight, scales in ops.weights:
            fp8_block_linear(ops.x, weight, scales, gated=projection.gated)

    return time_graph(calls, reps) / len(ops.weights)


@contextmanager
def tunables(values: dict[str, int]) -> Iterator[None]:
    """fp8_linear's split-K tunables set to `values` for the block, then restored."""
    saved = {name: getattr(fp8_linear, name) for name in values}
    for name, value in values.items():
        setattr(fp8_linear, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(fp8_linear, name, value)


def takes_splitk(projection: Projection, rows: int) -> bool:
    """Whether fp8_block_linear runs this projection's rows on the split-K GEMM (its own rule)."""
    return fp8_linear.takes_splitk(rows, projection.columns, projection.outputs, projection.gated, torch.device("cuda"))


def sweep_configs() -> list[dict[str, int]]:
    return [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())]


def measure(args: argparse.Namespace, rate: float) -> None:
    header = ("projection", "rows", "path", "us", "floor_us", "%floor", "rel_err")
    table = []
    for index, projection in enumerate(PROJECTIONS):
        for rows in args.rows:
            ops = operands(projection, rows, seed=index)
            err = relative_error(projection, ops)
            us = us_per_call(projection, ops, args.reps)
            floor = ops.bytes_per_call(projection) / rate * 1e6
            path = "split-K" if takes_splitk(projection, rows) else "masked"
            table.append((projection.name, rows, path, us, floor, 100 * floor / us, f"{err:.1e}"))
            if not err < args.tolerance:
                raise SystemExit(f"{projection.name} at {rows} rows: relative error {err:.2e} against float64")
            del ops
            release_memory()
    print_table(header, table)


def sweep(args: argparse.Namespace, rate: float, shown: int = 4) -> None:
    own = {name: getattr(fp8_linear, name) for name in TUNABLES}
    header = ("projection", "rows", *(name.removeprefix("SPLITK_").lower() for name in TUNABLES), "us", "%floor",
              "vs_own")
    for index, projection in enumerate(PROJECTIONS):
        for rows in args.rows:
            if not takes_splitk(projection, rows):
                continue
            table = []
            ops = operands(projection, rows, seed=index)
            floor = ops.bytes_per_call(projection) / rate * 1e6
            results: list[tuple[float, dict[str, int]]] = []
            for config in [own, *sweep_configs()]:
                with tunables(config):
                    err = relative_error(projection, ops)
                    if not err < args.tolerance:
                        raise SystemExit(f"{projection.name} at {rows} rows, {config}: relative error {err:.2e}")
                    results.append((us_per_call(projection, ops, args.reps), config))
            own_us = results[0][0]
            best = sorted(results[1:], key=lambda r: r[0])[:shown]
            for us, config in [results[0], *best]:
                mark = "own" if config is own else f"{own_us / us:.2f}x"
                table.append((projection.name, rows, *config.values(), us, 100 * floor / us, mark))
            print_table(header, table)  # as each projection ends: a long sweep cut short keeps what it found
            sys.stdout.flush()
            del ops
            release_memory()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="tokens in the step")
    parser.add_argument("--reps", type=int, default=30, help="timed replays per measurement (median)")
    parser.add_argument("--sweep", action="store_true", help="also time the split-K GEMM's tunables")
    parser.add_argument("--tolerance", type=float, default=1e-2,
                        help="largest relative error against float64 (bf16 output: ~4e-3)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_gpu("bench_linears.py")
    rate = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy rate {rate / 1e9:.0f} GB/s (read + write)")
    measure(args, rate)
    if args.sweep:
        sweep(args, rate)


if __name__ == "__main__":
    main()

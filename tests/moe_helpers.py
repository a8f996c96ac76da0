"""Shared pieces of the MoE tests: tiny DeepSeek-V3 configs, random HF-named weights, the rank
functions that run FusedMoE on gloo ranks, and float64 oracles.

This module must not import transformers: the rank functions run in child processes, which import
it by name, and they should start fast. The transformers oracles live in test_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ep_layer import Buffer
from ep_layer.moe import FusedMoE

PROJ_SHAPES = {"gate": ("i", "h"), "up": ("i", "h"), "down": ("h", "i")}
BLOCK = 128


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int = 16
    top_k: int = 4
    hidden: int = 256
    intermediate: int = 64
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    n_shared_experts: int = 1
    max_tokens: int = 24

    def layer(self, group: dist.ProcessGroup | None, quant: str, **kwargs: object) -> FusedMoE:
        buffer = Buffer(group, low_latency_mode=True, backend="reference")
        return FusedMoE(self.num_experts, self.top_k, self.hidden, self.intermediate, group,
                        n_group=self.n_group, topk_group=self.topk_group,
                        routed_scaling_factor=self.routed_scaling_factor, quant=quant,
                        n_shared_experts=self.n_shared_experts, buffer=buffer,
                        max_tokens_per_rank=self.max_tokens, **kwargs)


def proj_shape(projection: str, hidden: int, intermediate: int) -> tuple[int, int]:
    sizes = {"h": hidden, "i": intermediate}
    rows, cols = PROJ_SHAPES[projection]
    return sizes[rows], sizes[cols]


def hf_weights(cfg: MoeConfig, gen: torch.Generator, quant: str, bias_range: tuple[float, float] = (-0.3, 0.3)
               ) -> dict[str, torch.Tensor]:
    """Random weights named as in an HF DeepSeek-V3 checkpoint under `mlp.`: bf16, or FP8 (random e4m3
    codes with random positive 128x128 block scales). The bias is non-zero, so it changes routing."""
    h = cfg.hidden
    low, high = bias_range
    out = {
        "gate.weight": (torch.randn(cfg.num_experts, h, generator=gen) / h ** 0.5).to(torch.bfloat16),
        "gate.e_score_correction_bias": low + (high - low) * torch.rand(cfg.num_experts, generator=gen),
    }
    prefixes = [(f"experts.{e}", cfg.intermediate) for e in range(cfg.num_experts)]
    if cfg.n_shared_experts:
        prefixes.append(("shared_experts", cfg.intermediate * cfg.n_shared_experts))
    for prefix, inter in prefixes:
        for p in PROJ_SHAPES:
            rows, cols = proj_shape(p, h, inter)
            w = torch.randn(rows, cols, generator=gen)
            if quant == "bf16":
                out[f"{prefix}.{p}_proj.weight"] = (w / cols ** 0.5).to(torch.bfloat16)
            else:  # e4m3 codes spanning the format, and scales that bring them to ~1/sqrt(cols)
                out[f"{prefix}.{p}_proj.weight"] = (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
                blocks = (-(-rows // BLOCK), -(-cols // BLOCK))
                scale = (0.5 + torch.rand(blocks, generator=gen)) / (64 * cols ** 0.5)
                out[f"{prefix}.{p}_proj.weight_scale_inv"] = scale
    return out


def dequant_loop(weight: torch.Tensor, scale_inv: torch.Tensor) -> np.ndarray:
    """float64 value of a block-FP8 weight, block by block (independent of ep_layer's code)."""
    w = weight.float().double().numpy().copy()
    s = scale_inv.double().numpy()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= s[i, j]
    return w


def dense_weights(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, np.ndarray]:
    """float64 gate/up/down of one expert (dequantised if FP8)."""
    out = {}
    for p in PROJ_SHAPES:
        w = weights[f"{prefix}.{p}_proj.weight"]
        scale = weights.get(f"{prefix}.{p}_proj.weight_scale_inv")
        out[p] = w.double().numpy() if scale is None else dequant_loop(w, scale)
    return out


def mlp_float64(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    """SwiGLU MLP of float64 rows x [N, H]."""
    g, u = x @ w["gate"].T, x @ w["up"].T
    return (g / (1 + np.exp(-g)) * u) @ w["down"].T


def moe_float64(cfg: MoeConfig, weights: dict[str, torch.Tensor], x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> np.ndarray:
    """float64 MoE output for bf16 tokens x [N, H] with the given routing, on the (dequantised) weights."""
    xd = x.double().numpy()
    out = np.zeros_like(xd)
    if cfg.n_shared_experts:
        out += mlp_float64(xd, dense_weights(weights, "shared_experts"))
    idx, wts = topk_idx.numpy(), topk_weights.double().numpy()
    for e in np.unique(idx):
        tokens, slots = np.nonzero(idx == e)
        y = mlp_float64(xd[tokens], dense_weights(weights, f"experts.{e}"))
        out[tokens] += wts[tokens, slots, None] * y
    return out


def random_tokens(cfg: MoeConfig, gen: torch.Generator, world: int, min_tokens: int = 0) -> list[torch.Tensor]:
    """bf16 tokens per rank, a random count each (0 allowed), at most cfg.max_tokens."""
    counts = torch.randint(min_tokens, cfg.max_tokens + 1, (world,), generator=gen).tolist()
    return [torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16) for n in counts]


# ------------------------------------------------------------------ rank functions (run in child processes)
OVERLAPS = ("sbo", "dbo", "auto")  # layer_rank's forwards beside the plain and the two-micro-batch one


def layer_rank(rank: int, world: int, cfg: MoeConfig, quant: str, weights: dict[str, torch.Tensor],
               tokens: list[torch.Tensor], own_only: bool) -> dict[str, np.ndarray]:
    """FusedMoE on this rank's tokens: plain forward, two-micro-batch forward, a forward under each overlap of
    OVERLAPS (as `overlap=<mode>`) and its routing.

    own_only: load only this rank's experts (plus router and shared experts), not every expert.
    Results travel back as numpy arrays (bf16 as its exact float32 value): torch would share tensor
    memory through file descriptors, which die with the rank process."""
    layer = cfg.layer(dist.group.WORLD, quant)
    per_rank = cfg.num_experts // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    layer.load_weights((n, t) for n, t in weights.items()
                       if not own_only or not n.startswith("experts.") or int(n.split(".")[1]) in mine)
    x = tokens[rank]
    plain = layer(x)
    overlapped = layer.forward_two_microbatches(x)
    results = {"plain": plain, "overlapped": overlapped}
    for mode in OVERLAPS:
        layer.overlap = mode
        results[f"overlap={mode}"] = layer(x)
    topk_idx, topk_weights = layer.route(x)
    results |= {"topk_idx": topk_idx, "topk_weights": topk_weights, "expert_load": layer.stats().expert_load}
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy().copy() for k, v in results.items()}

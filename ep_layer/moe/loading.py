"""A FusedMoE's weight loading: HF DeepSeek-V3 checkpoint names (under a layer's `mlp.` prefix) to its
storage, strictly: unknown, duplicate, mis-shaped, wrongly typed and missing tensors are errors that name
the tensor. Where each expert's projection goes in ExpertWeights' layout: weight_slot, scale_slot.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..block_fp8 import WEIGHT_BLOCK
from .weights import ExpertWeights

_PROJECTIONS = ("gate", "up", "down")

_GATE = {"gate.weight", "gate.e_score_correction_bias"}
_EXPERT = re.compile(r"experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)")
_SHARED = re.compile(r"shared_experts\.(gate|up|down)_proj\.(weight|weight_scale_inv)")
_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
_MISSING_SHOWN = 8


@dataclass(frozen=True)
class LoadTargets:
    """Where a rank keeps what it loads: the router, its own experts [first_expert, + experts.num_experts)
    out of num_experts, and the shared experts (None when the layer has none)."""

    gate_weight: torch.Tensor
    e_score_correction_bias: torch.Tensor
    experts: ExpertWeights
    first_expert: int
    num_experts: int
    shared_experts: ExpertWeights | None

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.experts.num_experts

    def expected_names(self) -> set[str]:
        """Every name this rank needs: the router, its own experts and the shared experts."""
        suffixes = ["weight"] + (["weight_scale_inv"] if self.experts.fp8 else [])
        names = set(_GATE)
        for e in range(self.first_expert, self.first_expert + self.experts.num_experts):
            names |= {f"experts.{e}.{p}_proj.{s}" for p in _PROJECTIONS for s in suffixes}
        if self.shared_experts is not None:
            names |= {f"shared_experts.{p}_proj.{s}" for p in _PROJECTIONS for s in suffixes}
        return names


def load_moe_weights(weights: Iterable[tuple[str, torch.Tensor]], targets: LoadTargets) -> None:
    """Copy the tensors this rank owns into `targets`; skip other ranks' experts; raise on anything else."""
    seen: set[str] = set()
    for name, tensor in weights:
        destination = _destination(name, targets)
        if name in seen:
            raise ValueError(f"load_weights: {name} given twice")
        seen.add(name)
        if destination is not None:
            copy_checked(f"load_weights: {name}", tensor, destination)
    missing = sorted(targets.expected_names() - seen)
    if missing:
        shown = ", ".join(missing[:_MISSING_SHOWN]) + (", ..." if len(missing) > _MISSING_SHOWN else "")
        raise ValueError(f"load_weights: {len(missing)} tensor(s) missing: {shown}")


def _destination(name: str, targets: LoadTargets) -> torch.Tensor | None:
    """The storage view for `name`, None for another rank's expert; ValueError for a name we do not know."""
    if name == "gate.weight":
        return targets.gate_weight
    if name == "gate.e_score_correction_bias":
        return targets.e_score_correction_bias
    expert_match, shared_match = _EXPERT.fullmatch(name), _SHARED.fullmatch(name)
    if expert_match:
        expert, projection, kind = int(expert_match[1]), expert_match[2], expert_match[3]
        if expert >= targets.num_experts:
            raise ValueError(f"load_weights: unexpected tensor {name}: expert {expert} does not exist "
                             f"(num_experts={targets.num_experts})")
        _check_kind(name, kind, targets.experts)
        if not targets.owns(expert):
            return None
        store, local = targets.experts, expert - targets.first_expert
    elif shared_match and targets.shared_experts is not None:
        projection, kind = shared_match[1], shared_match[2]
        store, local = targets.shared_experts, 0
        _check_kind(name, kind, store)
    else:
        hint = (" (names are relative to the layer's `mlp.` prefix)" if name.startswith("mlp.") else
                " (this layer has no shared experts)" if shared_match else "")
        raise ValueError(f"load_weights: unexpected tensor {name}{hint}")
    return weight_slot(store, local, projection) if kind == "weight" else scale_slot(store, local, projection)


def weight_slot(store: ExpertWeights, expert: int, projection: str) -> torch.Tensor:
    """The view of `store` that holds this expert's `{projection}_proj.weight` (gate, up or down)."""
    i, padded = store.intermediate, store.padded_intermediate
    if projection == "down":
        return store.down[expert, :, :i]
    start = padded if projection == "up" else 0
    return store.gate_up[expert, start:start + i]


def scale_slot(store: ExpertWeights, expert: int, projection: str) -> torch.Tensor:
    """The view of `store`'s block scales for this expert's projection (FP8 only)."""
    if store.gate_up_scale is None or store.down_scale is None:
        raise ValueError("weight_scale_inv: this layer stores bf16 weights, which have no block scales")
    if projection == "down":
        return store.down_scale[expert]
    blocks = store.padded_intermediate // WEIGHT_BLOCK
    start = blocks if projection == "up" else 0
    return store.gate_up_scale[expert, start:start + blocks]


def _check_kind(name: str, kind: str, store: ExpertWeights) -> None:
    if kind == "weight_scale_inv" and not store.fp8:
        raise ValueError(f"load_weights: unexpected tensor {name}: block scales belong to FP8 checkpoints, "
                         "and this layer was built with quant='bf16' (use quant='fp8-block')")


def copy_checked(name: str, tensor: torch.Tensor, destination: torch.Tensor, *,
                 error: type[ValueError] = ValueError, fp8_because: str = "quant='fp8-block'",
                 fp8_needs: str = "an FP8 checkpoint needs quant='fp8-block'") -> None:
    """destination.copy_(tensor) after checking that it is a tensor of the destination's shape and kind
    (FP8 into FP8 storage, a float into float storage); otherwise `error` naming the tensor, with why
    the storage is FP8 (`fp8_because`) or what an FP8 tensor needs (`fp8_needs`)."""
    if not isinstance(tensor, torch.Tensor):
        raise error(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(destination.shape):
        raise error(f"{name}: expected shape {list(destination.shape)}, got {list(tensor.shape)}")
    want = destination.dtype
    if want == torch.float8_e4m3fn and tensor.dtype != want:
        raise error(f"{name}: expected dtype torch.float8_e4m3fn ({fp8_because}), got {tensor.dtype}")
    if want != torch.float8_e4m3fn and (not tensor.is_floating_point() or tensor.dtype in _FP8_DTYPES):
        hint = f" ({fp8_needs})" if tensor.dtype in _FP8_DTYPES else ""
        raise error(f"{name}: expected a bf16, fp16 or fp32 tensor, got {tensor.dtype}{hint}")
    destination.copy_(tensor)

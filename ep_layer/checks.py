"""Argument validation for `Buffer`: every bad input becomes a ValueError that names the argument.

Only shapes, dtypes and devices are checked here (free on any device). Checks that read tensor
values, such as expert ids in range, belong to the backends, which can do them without a host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import MAX_TOPK
from .quant import FP8_GROUP, UE8M0_PACK

MAX_TOKENS_PER_RANK = 1024


def expect(cond: bool, name: str, expected: str, given: object) -> None:
    if not cond:
        raise ValueError(f"{name}: expected {expected}, got {given}")


def check_tensor(t: object, name: str, dtype: torch.dtype, shape: Sequence[int | None],
                 device: torch.device) -> torch.Tensor:
    """`t` is a tensor of `dtype` and `shape` (None = any size) on `device`."""
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == device and t.dim() == len(shape):
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                break
        else:
            return t  # the common case: no message is built
    expect(isinstance(t, torch.Tensor), name, "a torch.Tensor", type(t).__name__)
    assert isinstance(t, torch.Tensor)
    expect(t.dtype == dtype, name, f"dtype {dtype}", t.dtype)
    shape_ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    want_shape = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    expect(shape_ok, name, f"shape {want_shape}", list(t.shape))
    expect(t.device == device, name, f"device {device}", t.device)
    raise AssertionError("unreachable: the fast path accepted every valid tensor")


def check_positive_int(v: object, name: str, limit: int | None = None) -> int:
    ok = isinstance(v, int) and not isinstance(v, bool) and v > 0 and (limit is None or v <= limit)
    expect(ok, name, "a positive int" + (f" <= {limit}" if limit else ""), v)
    assert isinstance(v, int)
    return v


def check_experts(num_experts: object, num_ranks: int, name: str = "num_experts") -> int:
    e = check_positive_int(num_experts, name)
    expect(e % num_ranks == 0, name, f"a multiple of the number of ranks ({num_ranks})", e)
    return e


def check_fp8_options(hidden: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> None:
    if use_ue8m0:
        expect(use_fp8, "use_ue8m0", "use_fp8=True (UE8M0 scales belong to FP8 dispatch)", use_ue8m0)
        expect(round_scale, "use_ue8m0", "round_scale=True (UE8M0 stores powers of two)",
               f"use_ue8m0=True with round_scale={round_scale}")
        expect(hidden % (FP8_GROUP * UE8M0_PACK) == 0, "x", "a hidden size that is a multiple of 512 "
               "for UE8M0 scales", hidden)
    elif use_fp8:
        expect(hidden % FP8_GROUP == 0, "x", f"a hidden size that is a multiple of {FP8_GROUP} for FP8",
               hidden)


def check_topk(topk_idx: object, num_tokens: int, max_tokens: int, device: torch.device,
               tokens_name: str = "x") -> torch.Tensor:
    """`tokens_name` is the argument whose rows are the tokens (x in dispatch, topk_idx in combine)."""
    t = check_tensor(topk_idx, "topk_idx", torch.int64, (num_tokens, None), device)
    expect(0 < t.shape[1] <= MAX_TOPK, "topk_idx", f"1 to {MAX_TOPK} experts per token", t.shape[1])
    expect(num_tokens <= max_tokens, tokens_name,
           f"at most num_max_dispatch_tokens_per_rank={max_tokens} tokens", num_tokens)
    return t


def check_topk_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids lie in [-1, num_experts). Reads the values: a host sync on GPU."""
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        expect(lo >= -1 and hi < num_experts, "topk_idx",
               f"expert ids in [-1, {num_experts}) (-1 = no expert)", f"ids from {lo} to {hi}")

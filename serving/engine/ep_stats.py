"""Expert-parallel counters read out of the model's MoE layers, at scrape time only (one device sync
per scrape, none per step): FusedMoE's `expert_load` (tokens each local expert received), where a
layer keeps them the Buffer wait-cost tensors `dispatch_wait_recv_cost_stats` /
`combine_wait_recv_cost_stats` (int64 [ranks], ns spent waiting on each source rank), and the
dispatch / combine latency histograms of the layers' Buffers (`Buffer.latency_stats()`)."""

from __future__ import annotations

import re

import torch

from ep_layer import Buffer
from ep_layer.latency import LatencyHistogram

from .messages import EPStats

_LAYER = re.compile(r"layers\.(\d+)\.")


def moe_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, module) of every module with an `expert_load` counter, in model order."""
    found = []
    for name, module in model.named_modules():
        load = getattr(module, "expert_load", None)
        if isinstance(load, torch.Tensor):
            m = _LAYER.search(name + ".")
            found.append((int(m.group(1)) if m else len(found), module))
    return found


def read_ep_stats(model: torch.nn.Module, rank: int, num_ranks: int, steps: dict[str, int],
                  step_seconds: dict[str, float]) -> EPStats:
    layers = moe_layers(model)
    loads = {i: m.expert_load.tolist() for i, m in layers}
    dispatch_latency, combine_latency = _latencies(layers)
    return EPStats(rank, num_ranks, loads, _summed(layers, "dispatch_wait_recv_cost_stats", num_ranks),
                   _summed(layers, "combine_wait_recv_cost_stats", num_ranks), steps, step_seconds,
                   dispatch_latency, combine_latency)


def _summed(layers: list[tuple[int, torch.nn.Module]], attr: str, num_ranks: int) -> list[int]:
    tensors = [getattr(m, attr) for _, m in layers if isinstance(getattr(m, attr, None), torch.Tensor)]
    if not tensors:
        return []
    total = torch.stack([t.to(torch.int64) for t in tensors]).sum(0).tolist()
    return total if len(total) == num_ranks else []


def _latencies(layers: list[tuple[int, torch.nn.Module]]) -> tuple[LatencyHistogram | None, LatencyHistogram | None]:
    """(dispatch, combine) histograms summed over the distinct Buffers of the layers (one shared by all
    layers, or one each); (None, None) without any."""
    buffers = {id(b): b for _, m in layers if isinstance(b := getattr(m, "buffer", None), Buffer)}
    if not buffers:
        return None, None
    stats = [b.latency_stats() for b in buffers.values()]
    return (sum((s["dispatch"] for s in stats), LatencyHistogram.empty()),
            sum((s["combine"] for s in stats), LatencyHistogram.empty()))

"""Expert-parallel counters read out of the model's MoE layers, at scrape time only (one device sync
per scrape, none per step): each FusedMoE's stats() (tokens each local expert received, and the
nanoseconds dispatch / combine waited on each source rank), and the dispatch / combine latency
histograms of the layers' Buffers (`Buffer.latency_stats()`)."""

from __future__ import annotations

import re

import torch

from ep_layer import Buffer
from ep_layer.latency import LatencyHistogram
from ep_layer.moe import FusedMoE

from .messages import EPStats, StepCounters

_LAYER = re.compile(r"layers\.(\d+)\.")


def moe_layers(model: torch.nn.Module) -> list[tuple[int, FusedMoE]]:
    """(layer index, layer) of every FusedMoE in the model, in model order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            m = _LAYER.search(name + ".")
            found.append((int(m.group(1)) if m else len(found), module))
    return found


def read_ep_stats(model: torch.nn.Module, rank: int, num_ranks: int, steps: StepCounters | None) -> EPStats:
    """This rank's EPStats: its MoE layers' counters, with the step counters given."""
    layers = moe_layers(model)
    stats = [(i, m.stats()) for i, m in layers]
    loads = {i: s.expert_load.tolist() for i, s in stats}
    dispatch_latency, combine_latency = _latencies([m.buffer for _, m in layers])
    return EPStats(rank, num_ranks, loads, _summed([s.dispatch_wait_ns for _, s in stats], num_ranks),
                   _summed([s.combine_wait_ns for _, s in stats], num_ranks), steps, dispatch_latency,
                   combine_latency)


def _summed(tensors: list[torch.Tensor], num_ranks: int) -> list[int]:
    """The per-source-rank counters summed over layers; [] without layers or for another group size."""
    if not tensors:
        return []
    total = torch.stack([t.to(torch.int64) for t in tensors]).sum(0).tolist()
    return total if len(total) == num_ranks else []


def _latencies(buffers: list[Buffer]) -> tuple[LatencyHistogram | None, LatencyHistogram | None]:
    """(dispatch, combine) histograms summed over the distinct Buffers (one shared by all layers, or one
    each); (None, None) without any."""
    distinct = {id(b): b for b in buffers}
    if not distinct:
        return None, None
    stats = [b.latency_stats() for b in distinct.values()]
    return (sum((s["dispatch"] for s in stats), LatencyHistogram.empty()),
            sum((s["combine"] for s in stats), LatencyHistogram.empty()))

"""CUDA-graph capture for the GPU tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture_after_warmup(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` once on a side stream (lazy initialisation, compilation), then capture one call of it;
    returns the graph and what the captured call returned (the graph's output tensors)."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out

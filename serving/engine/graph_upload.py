"""Step graphs put on the device when they are captured (the CUDA driver's cuGraphUpload), so that the first
replay of a graph (often a server's first request of that size) does not upload it first: a launch of an
executable graph not yet uploaded does that before it runs. Warm-up replays only the few sizes its own steps
take; start-up uploads all of them."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def upload(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, driver: Any = None) -> None:
    """Upload a captured graph's executable to the device in `stream` without running it (`driver`: the CUDA
    driver library, libcuda's by default)."""
    result = (driver or _driver()).cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                                                 ctypes.c_void_p(stream.cuda_stream))
    if result != 0:
        raise RuntimeError(f"cuGraphUpload of a step graph failed: CUresult {result}")

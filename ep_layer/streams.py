"""CUDA stream switches and joins with little host time, for eager calls that make several of each (a FusedMoE
forward on side streams: four switches and four joins a layer, ep_layer.moe.schedule; single-batch overlap's
event after the zeroed signals, ep_layer.moe.layer).

`torch.cuda.stream(s)` reads the current device, builds a Stream object for the current stream and sets streams
through Python wrappers on the way in and out; `Stream.wait_stream` builds an Event through its Python
constructor, then records and waits through three more Python methods (torch/cuda/__init__.py StreamContext,
torch/cuda/streams.py; torch 2.11 and 2.13). The helpers here call the C bindings those end in: torch._C's
`_cuda_getCurrentStream` / `_cuda_setStream` and the stream and event base classes. A stream of another device
than the current one goes torch's way, which also sets that device's stream.
"""

from __future__ import annotations

from typing import Any

import torch


class on_stream:
    """`with on_stream(stream):` makes `stream` current, as `torch.cuda.stream(stream)` does (lower case like
    it: used as a function)."""

    __slots__ = ("_previous", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._previous: Any = None

    def __enter__(self) -> None:
        stream = self._stream
        if stream.device_index != torch._C._cuda_getDevice():
            self._previous = torch.cuda.stream(stream)
            self._previous.__enter__()
            return
        self._previous = torch._C._cuda_getCurrentStream(stream.device_index)
        torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                                 device_type=stream.device_type)

    def __exit__(self, *exc: object) -> None:
        previous = self._previous
        if isinstance(previous, tuple):
            torch._C._cuda_setStream(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
        else:
            previous.__exit__(*exc)


def current_stream(device_index: int) -> torch.cuda.Stream:
    """The current stream of device `device_index`, as a stream object that events record on and wait in."""
    stream_id, index, device_type = torch._C._cuda_getCurrentStream(device_index)
    return torch._C._CudaStreamBase(stream_id=stream_id, device_index=index, device_type=device_type)


def record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A new event recorded on `stream` (no timing, not interprocess)."""
    event = torch._C._CudaEventBase()
    event.record(stream)
    return event


def join(waiter: torch.cuda.Stream, waited: torch.cuda.Stream) -> None:
    """`waiter.wait_stream(waited)`: later work on `waiter` runs after all work queued on `waited` so far."""
    record(waited).wait(waiter)

"""`EventOverlap`: DeepEP's handle for communication that finishes asynchronously."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .checks import expect


class EventOverlap:
    """A CUDA event marking when an `async_finish` call completes, plus tensors it keeps alive.

    On CPU (reference backend over gloo) calls complete synchronously and `event` is None.
    """

    def __init__(self, event: torch.cuda.Event | None = None,
                 extra_tensors: Sequence[torch.Tensor] | None = None) -> None:
        expect(event is None or isinstance(event, torch.cuda.Event), "event", "None or a torch.cuda.Event",
               type(event).__name__)
        expect(extra_tensors is None or (isinstance(extra_tensors, (list, tuple))
                                         and all(isinstance(t, torch.Tensor) for t in extra_tensors)),
               "extra_tensors", "None or a list or tuple of tensors", type(extra_tensors).__name__)
        self.event = event
        self.extra_tensors = tuple(extra_tensors or ())

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait until the communication is done."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait()

"""ep_layer.streams against torch's own stream switch and join, on a GPU: the same current stream inside and after
(nested, and after an exception), and the same order of work (a long kernel on the waited stream, then a read of
its result on the waiting one)."""

from __future__ import annotations

import pytest
import torch

from ep_layer import streams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SLEEP_CYCLES = 50_000_000  # ~25 ms at 2 GHz: the read would see the old values if it did not wait


def _current() -> int:
    return torch.cuda.current_stream().cuda_stream


def test_on_stream_sets_and_restores_the_current_stream_as_torch_does() -> None:
    outer, inner = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    start = _current()
    with streams.on_stream(outer):
        assert _current() == outer.cuda_stream
        with streams.on_stream(inner):
            assert _current() == inner.cuda_stream
        assert _current() == outer.cuda_stream
    assert _current() == start
    with pytest.raises(RuntimeError, match="inside"), streams.on_stream(outer):
        raise RuntimeError("inside")
    assert _current() == start


def test_current_stream_is_torchs() -> None:
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            assert streams.current_stream(torch.cuda.current_device()).cuda_stream == stream.cuda_stream


@pytest.mark.parametrize("how", ["join", "record"])
def test_the_waiting_stream_runs_after_the_waited_ones_work(how: str) -> None:
    waited, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(waited):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(7.0)
    if how == "join":
        streams.join(waiter, waited)
    else:
        streams.record(waited).wait(waiter)
    with torch.cuda.stream(waiter):
        seen = x.clone()
    torch.cuda.synchronize()
    assert torch.equal(seen, torch.full_like(x, 7.0))

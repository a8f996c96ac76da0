"""The cuda backend's recycled dispatch outputs (backends/cuda.py `_OutputSet`) and combined tensors
(`_CombineOutputs`), on CPU tensors: a set is
free for the next dispatch only when the caller holds none of its returned objects and no view of its
memory, no hook that uses it is pending, and it asks on the set's own stream, which then waits for the set's
uses on other streams; a set used on another stream in a graph capture is never recycled. (The kernels that fill
the sets run in tests/test_buffer_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

from ep_layer.backends import cuda
from ep_layer.backends.base import RowsInPlace
from ep_layer.backends.cuda import _CombineOutputs, _OutputSet

STREAM, OTHER = 7, 8


def output_set(kind: str) -> _OutputSet:
    """A set as the backend makes one: bf16 rows, FP8 (data, scales), or rows in place."""
    ints = torch.empty(2 + 4 * (1 + 2 * 10), dtype=torch.int32)
    recv_count, src_info = ints.as_strided((4,), (1,), 2), ints.as_strided((4, 10), (10, 1), 6)
    layout_range = torch.empty(4, 2, dtype=torch.int64)
    owned = [ints, layout_range]
    if kind == "bf16":
        recv_x = torch.empty(4, 10, 128, dtype=torch.bfloat16)
        owned.append(recv_x)
    elif kind == "fp8":
        data, scales = torch.empty(4, 10, 128, dtype=torch.float8_e4m3fn), torch.empty(4, 1, 10).transpose(1, 2)
        recv_x = (data, scales)
        owned += [data, scales]
    else:
        offsets, scales = torch.empty(4, 10, dtype=torch.int64), torch.empty(4, 1, 10).transpose(1, 2)
        recv_x = RowsInPlace(torch.empty(16, dtype=torch.uint8), offsets, scales, 128)
        owned += [offsets, scales]
    return _OutputSet(recv_x, recv_count, src_info, layout_range, ints, {}, owned, STREAM, 0)


def settled(kind: str) -> _OutputSet:
    out = output_set(kind)
    out.settle()  # as the backend does, once the function that made the parts has returned
    return out


def parts(out: _OutputSet) -> list:
    """Everything a caller can hold on to: each returned object, and the pieces of recv_x."""
    recv_x = out.recv_x
    pieces = list(recv_x) if isinstance(recv_x, tuple) else \
        [recv_x.offsets, recv_x.scales] if isinstance(recv_x, RowsInPlace) else []
    return [recv_x, *pieces, out.recv_count, out.src_info, out.layout_range]


def busy_while_held(out: _OutputSet, i: int) -> bool:
    """Part i held as the object itself, then (tensors) only through a view of its memory: busy both
    times. Returns whether the set is busy while the part is held; the locals die on return."""
    held = parts(out)[i]
    busy = not out.free_on(STREAM)
    if isinstance(held, torch.Tensor):
        view = held.view(-1)[:1]
        del held
        busy = busy and not out.free_on(STREAM)
        del view
    return busy


@pytest.mark.parametrize("kind", ["bf16", "fp8", "rows in place"])
def test_a_set_is_free_only_when_nothing_of_it_is_held(kind: str) -> None:
    out = settled(kind)
    assert out.free_on(STREAM)
    result = (out.recv_x, out.recv_count, (out.src_info, out.layout_range, 10, 128, 8))  # as dispatch returns it
    assert not out.free_on(STREAM)
    del result
    assert out.free_on(STREAM)
    for i in range(len(parts(out))):
        assert busy_while_held(out, i), (kind, i)
        assert out.free_on(STREAM), (kind, i)


class FakeStreams:
    """The fences' CUDA events, on CPU: which stream is current, and what was recorded and waited for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current, self.capturing = STREAM, False
        self.log: list[tuple] = []
        monkeypatch.setattr(cuda, "_record_fence", self.record)
        monkeypatch.setattr(cuda, "_wait_fences", self.wait)
        monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: self.capturing)

    def record(self, device_index: int, event: object) -> object:
        event = event or [len(self.log)]  # a new event: a fresh list
        self.log.append(("record", self.current, id(event)))
        return event

    def wait(self, device_index: int, fences: object) -> None:
        self.log.append(("wait", self.current, sorted(id(e) for e in fences)))


def test_pending_hooks_keep_a_set_busy_and_other_streams_fence_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeStreams(monkeypatch)
    out = settled("fp8")
    out.pending = 1  # a hook that writes or reads it has not been launched
    assert not out.free_on(STREAM)
    out.pending = 0
    assert out.free_on(STREAM) and not out.free_on(OTHER)
    out.used_on(STREAM)
    out.join_uses()
    assert fake.log == []  # its own stream: stream order suffices
    fake.current = OTHER
    out.used_on(OTHER)  # a combine on a side stream
    out.used_on(OTHER)  # and its hook: the same event, recorded again
    assert [entry[:2] for entry in fake.log] == [("record", OTHER)] * 2 and fake.log[0][2] == fake.log[1][2]
    fake.current = STREAM
    assert out.free_on(STREAM) and not out.free_on(OTHER)
    out.join_uses()  # the next dispatch on the set's own stream waits for the fence, once
    out.join_uses()
    assert fake.log[2:] == [("wait", STREAM, [fake.log[0][2]])]
    fake.current = OTHER
    out.used_on(OTHER)
    fake.capturing = True  # a fence recorded outside a capture cannot be waited for inside it
    assert not out.free_on(STREAM)
    fake.capturing = False
    fake.current = STREAM
    out.join_uses()
    fake.capturing, fake.current = True, OTHER
    out.used_on(OTHER)  # inside a capture: the set is the graph's, never recycled
    assert out.stream == _OutputSet.RETIRED
    assert not out.free_on(STREAM) and not out.free_on(OTHER)


def test_a_combined_tensor_is_handed_out_again_only_once_dropped() -> None:
    """`_CombineOutputs`: a tensor comes back to a later combine on its stream once the caller holds
    neither it nor a view of its memory; on another stream, or while held, a new one is made; at most
    four are kept, the least recently used going first."""
    made = [0]

    def make() -> torch.Tensor:
        made[0] += 1
        return torch.empty(4, 8, dtype=torch.bfloat16)

    pool = _CombineOutputs(make)
    first = pool.take(STREAM)
    address = first.data_ptr()
    second = pool.take(STREAM)  # the first is held
    assert second.data_ptr() != address and made[0] == 2
    del first
    again = pool.take(STREAM)
    assert again.data_ptr() == address and made[0] == 2
    view = again[1:]
    del again
    assert pool.take(OTHER).data_ptr() != address  # another stream: a new one
    kept = pool.take(STREAM)  # the view holds the first's memory: a new one
    assert kept.data_ptr() != address and made[0] == 4
    del view
    assert pool.take(STREAM).data_ptr() == address and made[0] == 4
    held = [pool.take(STREAM) for _ in range(6)]  # more than four at once: the oldest are dropped
    assert len({t.data_ptr() for t in held}) == 6
    assert len(pool._entries) == 4

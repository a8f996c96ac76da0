"""benchmarks/profile_eager.py's breakdown of Python calls by where their code lives, on CPU: a profiled
call of this repository's code is counted under its file, torch's operators under builtins, an installed
package under its name and the standard library as python."""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import pytest
import torch

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)  # the script imports its neighbours by name

import profile_eager  # noqa: E402

from ep_layer.quant import per_token_cast_to_fp8  # noqa: E402


def test_calls_are_counted_per_call_by_area() -> None:
    x = torch.randn(4, 256)
    n = 5
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        per_token_cast_to_fp8(x)
    profile.disable()
    table = profile_eager.calls_by_area(pstats.Stats(profile), n)
    rows = {area: (calls, own) for area, calls, own in table}
    assert rows["ep_layer/quant.py"][0] >= 1  # per_token_cast_to_fp8 itself, once per call at least
    assert rows["builtins"][0] > rows["ep_layer/quant.py"][0]  # the torch operators it calls
    assert all(own >= 0 for _, own in rows.values())
    calls = [calls for _, calls, _ in table]
    assert calls == sorted(calls, reverse=True)  # most calls first


def test_code_areas() -> None:
    assert profile_eager.code_area(os.path.join(profile_eager.REPO, "ep_layer", "moe", "layer.py")) == \
        "ep_layer/moe/layer.py"
    assert profile_eager.code_area("/x/lib/python3.12/site-packages/triton/runtime/jit.py") == "triton"
    assert profile_eager.code_area("/x/lib/python3.12/dist-packages/six.py") == "six"
    in_repo_venv = os.path.join(profile_eager.REPO, ".venv", "lib", "python3.11", "site-packages", "torch", "x.py")
    assert profile_eager.code_area(in_repo_venv) == "torch"
    assert profile_eager.code_area("/usr/lib/python3.12/contextlib.py") == "python"
    assert profile_eager.code_area("~") == "builtins"


def test_triton_own_launches_sends_every_launch_through_triton_then_restores_the_launcher() -> None:
    from ep_layer.kernels.launch import Launcher

    launched = []

    class Kernel:  # a @triton.jit kernel as Launcher sees it: kernel[grid](*args, **kwargs)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, args, kwargs))

    fast = Launcher.launch
    launcher = Launcher(Kernel())
    with profile_eager.triton_own_launches():
        for _ in range(3):
            launcher[(2, 1)](7, 8, BLOCK=64)
    assert launched == [((2, 1), (7, 8), {"BLOCK": 64})] * 3
    assert Launcher.launch is fast and not launcher._variants


def test_stand_in_runs_the_cuda_backends_python_and_recycles_its_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    """--stand-in: the cuda backend's dispatch and combine with launches that do nothing, on CPU. In DeepEP's loop
    (each call's results held until the next call returns) two output sets and two combined tensors serve every
    call: the previous ones are held, the ones before them come back."""
    args = argparse.Namespace(tokens=4, hidden=256, experts=16, topk=2, calls=30, top=3)
    profile_eager.profile_stand_in(args)
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] in ("dispatch", "combine", "pair"):
            rows[words[0]] = float(words[1])
    assert rows["dispatch"] > 0 and rows["combine"] > 0
    assert rows["pair"] == pytest.approx(rows["dispatch"] + rows["combine"], abs=0.011)

    buf = profile_eager.stand_in_buffer(1 << 30)
    x, idx = torch.randn(4, 256, dtype=torch.bfloat16), torch.randint(0, 16, (4, 2))
    y, w = torch.randn(16, 4, 256, dtype=torch.bfloat16), torch.rand(4, 2)
    addresses = set()
    capturing, torch._C._cuda_isCurrentStreamCapturing = torch._C._cuda_isCurrentStreamCapturing, lambda: False
    try:
        recv_x = combined = None
        for _ in range(6):
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 16, use_fp8=False)
            combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
            addresses.add((recv_x.data_ptr(), combined.data_ptr()))
    finally:
        torch._C._cuda_isCurrentStreamCapturing = capturing
    backend = buf._backend
    assert [len(pool) for pool in backend._output_sets.values()] == [2]
    assert [len(pool._entries) for pool in backend._combine_outputs.values()] == [2]
    assert len(addresses) == 2


def test_stand_in_recycles_a_set_whose_combine_runs_on_another_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """FusedMoE's schedule on the stand-in: each dispatch and its hook on one side stream, the combine and its hook on
    another. One output set serves every call: its combine's uses fence it, and each later dispatch that recycles
    it waits for that fence first."""
    from ep_layer.backends import cuda

    buf = profile_eager.stand_in_buffer(1 << 30)
    backend = buf._backend
    current = [1]
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(backend, "_stream", lambda: current[0])
    monkeypatch.setattr(cuda, "_record_fence", lambda device, event: log.append(("record", current[0])) or "event")
    monkeypatch.setattr(cuda, "_wait_fences", lambda device, fences: log.append(("wait", current[0])))
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
    x, idx = torch.randn(4, 256, dtype=torch.bfloat16), torch.randint(0, 16, (4, 2))
    y, w = torch.randn(16, 4, 256, dtype=torch.bfloat16), torch.rand(4, 2)
    for call in range(4):
        current[0] = 1
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, 4, 16, use_fp8=False, return_recv_hook=True)
        hook()
        current[0] = 2
        combined, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        hook()
        del recv_x, handle, combined, hook
        assert log == [("wait", 1)] * (call > 0) + [("record", 2)] * 2, call
        log.clear()
    assert [len(pool) for pool in backend._output_sets.values()] == [1]

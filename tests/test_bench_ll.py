"""benchmarks/bench_ll.py's table beside DeepEP: it is made only for DeepEP's own `deep_ep` (ep-layer's drop-in
is not one), and on a GPU it times both Buffers on the same calls (the drop-in stands in for DeepEP here: it
has DeepEP's API, and no DeepEP is installed)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for folder in (os.path.join(_ROOT, "benchmarks"), os.path.join(_ROOT, "dropin")):
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the script imports its neighbours by name; the drop-in is `deep_ep`

import bench_ll  # noqa: E402
import deep_ep  # noqa: E402

from ep_layer import native  # noqa: E402


def test_the_drop_in_is_not_taken_for_deep_ep():
    assert deep_ep.BACKEND == "ep_layer"
    assert bench_ll.importable_deep_ep() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built")
def test_both_buffers_are_timed_on_the_same_calls():
    rows = bench_ll.beside_deep_ep(deep_ep, [1, 32], 7168, [288], 8)
    assert [(r[0], r[1], r[2]) for r in rows] == [(name, t, 288) for t in (1, 32)
                                                  for name in ("ep-layer", f"DeepEP {deep_ep.__version__}")]
    for row in rows:
        assert len(row) == len(bench_ll.VERSUS_HEADER)
        assert all(math.isfinite(v) and v > 0 for v in row[3:]), row

"""ep_layer.emulation's streams: each emulated rank runs on a stream that nothing else is handed."""

from __future__ import annotations

import pytest
import torch

from ep_layer import native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built"),
]


def test_rank_streams_never_alias_torch_streams() -> None:
    """After torch's pool of 32 streams has gone round more than once, no rank's stream is the capture
    stream of torch.cuda.graph or a pool stream handed out since, and the ranks' streams all differ."""
    from ep_layer.emulation import RankStreams

    with torch.cuda.graph(torch.cuda.CUDAGraph()):  # makes torch.cuda.graph's default capture stream
        pass
    pool = [torch.cuda.Stream() for _ in range(70)]
    capture = torch.cuda.graph.default_capture_stream
    assert capture is not None
    ranks = RankStreams(8).streams
    taken = {s.cuda_stream for s in ranks}
    assert len(taken) == 8
    assert not taken & {s.cuda_stream for s in [*pool, capture, torch.cuda.current_stream()]}
    assert [s.cuda_stream for s in RankStreams(4).streams] == [s.cuda_stream for s in ranks[:4]]


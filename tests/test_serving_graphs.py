"""Decode steps without host syncs and their CUDA graphs (serving.engine.model_runner): the decode
attention layout against the general one, padded decode batches against unpadded ones on the tiny
DeepSeek-V3 model (CPU), and on a GPU the graph-replaying engine against the eager one, with async
scheduling and without."""

from __future__ import annotations

import pytest
import torch

from serving.engine.engine import LLMEngine
from serving.engine.model_runner import GRAPH_MAX_MODEL_LEN, graph_sizes, why_eager
from serving.engine.scheduler import ScheduledBatch
from serving.engine.sequence import SamplingParams
from serving.loading.checkpoint import load_checkpoint, read_tokenizer
from serving.models import mla_decode_triton
from serving.tiny_model import write_tiny_checkpoint

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16")


def make_engine(path: str, device: str, use_cuda_graphs: bool, backend: str, max_num_seqs: int = 8,
                async_scheduling: bool = False) -> LLMEngine:
    model = load_checkpoint(path, backend=backend, max_tokens_per_rank=32, dtype=torch.float32, device=device,
                       progress=False)
    return LLMEngine(model, read_tokenizer(path), num_blocks=64, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                     max_num_seqs=max_num_seqs, max_tokens_per_rank=32, device=torch.device(device),
                     use_cuda_graphs=use_cuda_graphs, async_scheduling=async_scheduling)


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def until_decoding(engine: LLMEngine, prompt_ids: list[list[int]]) -> ScheduledBatch:
    """Add the prompts, step through their prefills; the next (decode-only) batch, not yet run."""
    for i, p in enumerate(prompt_ids):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(50):
        batch = engine.schedule()
        if batch.is_decode_only:
            return batch
        engine.execute(batch)
    raise AssertionError("the prompts never reached decode")


def test_graph_sizes_ladder() -> None:
    assert graph_sizes(1) == [1]
    assert graph_sizes(3) == [1, 2, 3]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("pad", [0, 3])
def test_padded_decode_batch_equals_eager_step(checkpoint: str, pad: int) -> None:
    """The decode layout (whole block tables, masked) with padding rows gives the general layout's
    logits for the real rows, and the padding rows write only to the padding block."""
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference")
    batch = until_decoding(engine, prompts(5, seed=1))
    runner, model = engine.runner, engine.model
    cache_before = model.kv_cache.clone()
    want = model(runner.prepare(batch))
    cache_want = model.kv_cache.clone()
    model.kv_cache.copy_(cache_before)
    padded = runner.padded_decode_batch(batch, len(batch.seqs) + pad)
    assert padded.decode and padded.num_tokens == len(batch.seqs) + pad
    got = model(padded)
    torch.testing.assert_close(got[:len(batch.seqs)], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    own = slice(0, runner.pad_block)  # the engine's blocks: written as by the eager step
    torch.testing.assert_close(model.kv_cache[:, own], cache_want[:, own], rtol=1e-5, atol=1e-5)
    assert torch.equal(cache_want[:, runner.pad_block], cache_before[:, runner.pad_block])
    assert torch.equal(model.kv_cache[:, runner.pad_block], cache_before[:, runner.pad_block]) == (pad == 0)


def test_empty_batch_pads_to_one_token(checkpoint: str) -> None:
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference")
    padded = engine.runner.padded_decode_batch(ScheduledBatch(), 1)
    assert padded.input_ids.tolist() == [0] and padded.seq_lens.tolist() == [1]
    assert padded.slot_mapping.tolist() == [engine.runner.pad_block * BLOCK_SIZE]
    assert engine.model(padded).shape == (1, engine.vocab_size)
    with pytest.raises(ValueError, match="do not fit"):
        engine.runner.padded_decode_batch(until_decoding(engine, prompts(3, seed=2)), 2)


def test_cpu_engine_runs_eagerly(checkpoint: str) -> None:
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=True, backend="reference")
    assert engine.runner.captured_sizes == [] and engine.runner.eager_reason == "no GPU"
    assert engine.runner.graph_size(1) is None


def test_why_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    assert why_eager(cuda, "cuda", GRAPH_MAX_MODEL_LEN) is None
    assert why_eager(cuda, None, 1024) is None  # no MoE layers
    assert "reference" in why_eager(cuda, "reference", 1024)
    assert why_eager(torch.device("cpu"), "cuda", 1024) == "no GPU"
    # Long contexts: graphs with Triton's MLA decode kernel (own keys only), eager with the padded attention.
    monkeypatch.setattr(mla_decode_triton, "available", lambda: True)
    assert why_eager(cuda, "cuda", GRAPH_MAX_MODEL_LEN + 1) is None
    monkeypatch.setattr(mla_decode_triton, "available", lambda: False)
    assert "--max-model-len" in why_eager(cuda, "cuda", GRAPH_MAX_MODEL_LEN + 1)


@pytest.mark.gpu
def test_graph_replays_equal_eager_steps_on_gpu(checkpoint: str) -> None:
    """7 requests of staggered lengths decode through batch sizes 7 down to 1 (graphs 8, 4, 2, 1);
    at every replayed step the eager forward on the same inputs gives the same logits, and the
    greedy text equals an engine that never captured graphs."""
    from ep_layer import native

    if not native.available():
        pytest.skip("the cuda backend is not built")
    prompt_ids = prompts(7, seed=3)
    lengths = [4 + 2 * i for i in range(7)]
    eager = make_engine(checkpoint, "cuda", use_cuda_graphs=False, backend="cuda")
    want = generate(eager, prompt_ids, lengths)
    del eager
    engine = make_engine(checkpoint, "cuda", use_cuda_graphs=True, backend="cuda")
    runner = engine.runner
    assert runner.captured_sizes == [1, 2, 4, 8]
    replays = {size: 0 for size in runner.captured_sizes}
    replay = runner._replay

    def checked_replay(batch: ScheduledBatch, size: int, pending_tokens: torch.Tensor | None) -> torch.Tensor:
        replays[size] += 1
        eager_logits = engine.model(runner.prepare(batch)).clone()
        logits = replay(batch, size, pending_tokens)
        # Not bit for bit: the graph runs the padded batch, and kernels split their sums by batch size
        # (cuBLAS's choice, MLA decode's splits); in bf16 that moves a logit by about 0.02 (0.022 seen).
        # A stale or misplaced graph input moves them by far more.
        torch.testing.assert_close(logits, eager_logits, rtol=2e-2, atol=3e-2)
        return logits

    runner._replay = checked_replay
    assert generate(engine, prompt_ids, lengths) == want
    assert replays[8] > 0 and replays[4] > 0 and replays[1] > 0, replays


@pytest.mark.gpu
def test_async_scheduling_equals_sync_steps_on_gpu(checkpoint: str) -> None:
    """Graph replays whose input tokens are the last step's samples, copied on the device (in order, and
    by index once sequences finish), give the tokens of an engine that reads every step's samples on
    the host first: greedy and seeded sampling, staggered lengths, batches 7 down to 1, and eager steps
    that mix the prompts of three late requests into the others' decodes."""
    from ep_layer import native

    if not native.available():
        pytest.skip("the cuda backend is not built")
    prompt_ids = prompts(7, seed=4)
    lengths = [3 + 3 * i for i in range(7)]
    seeded = {1: 11, 4: 7}  # request: seed (temperature 1); the others greedy
    runs = []
    for mode in (False, True):
        engine = make_engine(checkpoint, "cuda", use_cuda_graphs=True, backend="cuda", async_scheduling=mode)
        runs.append(generate(engine, prompt_ids, lengths, seeded, late=3))
        assert not engine.has_work() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        del engine
    assert runs[1] == runs[0]
    assert [len(runs[1][str(i)]) for i in range(7)] == lengths


def generate(engine: LLMEngine, prompt_ids: list[list[int]], lengths: list[int],
             seeds: dict[int, int] | None = None, late: int = 0) -> dict[str, list[int]]:
    """Greedy (or seeded) tokens of each request; the last `late` requests arrive after four steps."""
    def add(i: int) -> None:
        seed = (seeds or {}).get(i)
        engine.add_request(str(i), prompt_ids[i], SamplingParams(max_tokens=lengths[i], seed=seed, ignore_eos=True,
                                                                 temperature=0.0 if seed is None else 1.0))

    first = len(prompt_ids) - late
    for i in range(first):
        add(i)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_ids))}
    steps = 0
    while engine.has_work() or steps <= 4:
        if steps == 4:
            for i in range(first, len(prompt_ids)):
                add(i)
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
    return got

"""Steps without host syncs and their CUDA graphs (serving.engine.model_runner): the capture sizes, step
graph inputs (prefill chunks and decodes mixed, padded to a graph's size) against the eager step's on the
tiny DeepSeek-V3 model (CPU), which batches fit a graph and which run eagerly, and on a GPU the
graph-replaying engine against the eager one (mixed steps included), with async scheduling and without,
alone and as two expert-parallel ranks on one GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ep_layer import native
from serving.engine.engine import LLMEngine
from serving.engine.engine_config import EngineConfig, capture_sizes
from serving.engine.graph_upload import upload
from serving.engine.model_runner import GRAPH_MAX_MODEL_LEN, why_eager
from serving.engine.scheduler import ScheduledBatch
from serving.engine.sequence import SamplingParams
from serving.loading.checkpoint import load_checkpoint, read_tokenizer
from serving.models import mla_decode_triton
from serving.tiny_model import write_tiny_checkpoint

BLOCK_SIZE = 4
NEEDS_KERNELS = pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built")
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16")


def make_engine(path: str, device: str, use_cuda_graphs: bool, backend: str, max_num_seqs: int = 8,
                async_scheduling: bool = False, graph_sizes: list[int] | None = None) -> LLMEngine:
    model = load_checkpoint(path, backend=backend, max_tokens_per_rank=32, dtype=torch.float32, device=device,
                       progress=False)
    return LLMEngine(model, read_tokenizer(path), num_blocks=64, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                     max_num_seqs=max_num_seqs, max_tokens_per_rank=32, device=torch.device(device),
                     use_cuda_graphs=use_cuda_graphs, graph_sizes=graph_sizes, async_scheduling=async_scheduling)


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_capture_sizes_are_vllms_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(300) == [1, 2, 4, *range(8, 256, 8), 256, 272, 288, 300]


def test_engine_config_graph_sizes() -> None:
    """Default: every low-latency step (up to the smaller of the step budget and T); vLLM's two flags
    narrow it; sizes a step graph cannot hold are refused, naming the flags."""
    assert EngineConfig("m").graph_sizes == capture_sizes(256)
    assert EngineConfig("m", max_num_batched_tokens=64).graph_sizes == capture_sizes(64)
    assert EngineConfig("m", deepep_mode="auto", max_tokens_per_rank=128).graph_sizes == capture_sizes(128)
    assert EngineConfig("m", max_cudagraph_capture_size=40).graph_sizes == capture_sizes(40)
    assert EngineConfig("m", cudagraph_capture_sizes=(16, 4, 16)).graph_sizes == [4, 16]
    for bad in (dict(cudagraph_capture_sizes=(0, 8)), dict(max_cudagraph_capture_size=257),
                dict(max_num_batched_tokens=64, cudagraph_capture_sizes=(128,))):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            EngineConfig("m", **bad)
    with pytest.raises(ValueError, match="max_cudagraph_capture_size: 8 is not the largest"):
        EngineConfig("m", cudagraph_capture_sizes=(4, 16), max_cudagraph_capture_size=8)


def until_mixed(engine: LLMEngine, seed: int) -> ScheduledBatch:
    """Requests of random lengths arriving over the first steps, run until a step mixes a prefill chunk
    with decodes (not yet run)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = prompts(6, seed)
    for step in range(60):
        if step < len(prompt_ids):
            n = int(torch.randint(1, 20, (1,), generator=gen)) if step else 3
            engine.add_request(str(step), prompt_ids[step] * (n // len(prompt_ids[step]) + 1),
                               SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        batch = engine.schedule()
        if step > 2 and not batch.is_decode_only and any(n == 1 for n in batch.num_new_tokens):
            return batch
        engine.execute(batch)
    raise AssertionError("no step mixed a prompt chunk with decodes")


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("pad", [0, 5])
def test_graph_inputs_equal_the_eager_step(checkpoint: str, seed: int, pad: int) -> None:
    """A step mixing prompt chunks with decodes, as the inputs of a step graph (per-token attention over
    each token's own block table row, padding tokens and sequence rows after it), gives the eager step's
    logits (host-layout attention) and KV cache; padding tokens write only to the padding block. The two
    attentions sum the same keys in another order: up to float32 rounding until the first MoE layer, whose
    bf16 rounding may then flip (2**-8 relative) and move the later layers' KV and the logits by about
    0.01 (0.0073 seen). A misplaced key or token moves them by far more."""
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference")
    batch = until_mixed(engine, seed)
    runner, model = engine.runner, engine.model
    cache_before = model.kv_cache.clone()
    eager = runner.prepare(batch)
    assert eager.token_seqs is None  # CPU: the host-layout attention, an independent oracle
    want = model(eager)
    cache_want = model.kv_cache.clone()
    model.kv_cache.copy_(cache_before)
    size = batch.num_tokens + pad
    assert runner.fits_graph(batch, size)
    padded = runner.graph_inputs(batch, size)
    assert padded.num_tokens == size and torch.equal(padded.logits_indices, eager.logits_indices)
    got = model(padded)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    assert torch.isfinite(got).all()
    own = slice(0, runner.pad_block)  # the engine's blocks: written as by the eager step
    before_moe = model.config.first_k_dense_replace + 1  # layers whose KV no MoE layer has touched
    torch.testing.assert_close(model.kv_cache[:before_moe, own], cache_want[:before_moe, own], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.kv_cache[before_moe:, own], cache_want[before_moe:, own], rtol=0, atol=2e-2)
    assert torch.equal(cache_want[:, runner.pad_block], cache_before[:, runner.pad_block])
    assert torch.equal(model.kv_cache[:, runner.pad_block], cache_before[:, runner.pad_block]) == (pad == 0)


def test_empty_batch_pads_to_its_size(checkpoint: str) -> None:
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference")
    runner = engine.runner
    padded = runner.graph_inputs(ScheduledBatch(), 2)
    assert padded.input_ids.tolist() == [0, 0] and padded.token_seqs.tolist() == [2, 2]
    assert padded.slot_mapping.tolist() == [runner.pad_block * BLOCK_SIZE] * 2
    assert padded.block_tables[2, 0] == runner.pad_block and (padded.block_tables[:2] == -1).all()
    assert engine.model(padded).shape == (0, engine.vocab_size)  # logits for no row
    hidden = engine.model.hidden_states(padded)
    assert hidden.shape == (2, engine.model.config.hidden_size) and torch.isfinite(hidden).all()


def test_which_batches_fit_a_step_graph(checkpoint: str) -> None:
    """A graph of T tokens holds at most T tokens of at most min(T, max_num_seqs) sequences, prompt
    logprobs too (its logits come after the replay, a row for each token that needs one)."""
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference", max_num_seqs=4)
    for i, n in enumerate((5, 3)):
        engine.add_request(str(i), prompts(1, i)[0][:1] * n, SamplingParams(max_tokens=4))
    batch = engine.schedule()
    runner = engine.runner
    assert batch.num_tokens == 8
    assert runner.fits_graph(batch, 8) and runner.fits_graph(batch, 16) and not runner.fits_graph(batch, 7)
    with pytest.raises(ValueError, match="do not fit the step graph of 7 tokens"):
        runner.graph_inputs(batch, 7)
    assert not runner.fits_graph(ScheduledBatch(batch.seqs * 3, [1] * 6), 6)  # 6 sequences, 4 rows
    engine.execute(batch)
    engine.add_request("logprobs", [5, 6, 7], SamplingParams(max_tokens=4, prompt_logprobs=1))
    mixed = engine.schedule()
    assert mixed.num_tokens == 5 and runner.fits_graph(mixed, 8)
    inputs = runner.graph_inputs(mixed, 8)
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 4]  # two decodes, then each prompt token
    assert torch.equal(inputs.logits_indices, runner.prepare(mixed).logits_indices)


def test_the_engine_picks_the_agreed_graph_or_runs_eagerly(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With graphs of 1, 2, 4 and 8 tokens: the smallest that holds the agreed token count (the largest
    rank's, which may exceed this rank's own), eager past the largest."""
    from serving.engine.step_sync import StepPlan

    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference")
    monkeypatch.setattr(type(engine.runner), "captured_sizes", property(lambda self: [1, 2, 4, 8]))
    assert engine._graph_size(StepPlan(True, 3)) == 4
    assert engine._graph_size(StepPlan(True, 7)) == 8  # a peer holds 7 tokens
    assert engine._graph_size(StepPlan(True, 9)) is None  # past the largest graph: every rank eager
    assert engine._graph_size(StepPlan(True, 0)) == 1  # where a rank steps alone on nothing


def test_cpu_engine_runs_eagerly(checkpoint: str) -> None:
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=True, backend="reference")
    assert engine.runner.captured_sizes == [] and engine.runner.eager_reason == "no GPU"
    assert engine.runner.graph_size(1) is None


def test_upload_hands_the_driver_the_graphs_executable_and_the_stream() -> None:
    """graph_upload.upload calls cuGraphUpload(exec, stream) with the graph's cudaGraphExec_t and the stream's
    handle, and a failure is an error naming the driver's result (a stand-in driver, graph and stream)."""
    class Driver:
        def __init__(self, result: int) -> None:
            self.result, self.calls = result, []

        def cuGraphUpload(self, graph_exec, stream) -> int:
            self.calls.append((graph_exec.value, stream.value))
            return self.result

    graph = SimpleNamespace(raw_cuda_graph_exec=lambda: 0x5EED)
    stream = SimpleNamespace(cuda_stream=0xC0DE)
    driver = Driver(0)
    upload(graph, stream, driver)
    assert driver.calls == [(0x5EED, 0xC0DE)]
    with pytest.raises(RuntimeError, match="cuGraphUpload of a step graph failed: CUresult 700"):
        upload(graph, stream, Driver(700))


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


def long_late_prompts(seed: int) -> tuple[list[list[int]], list[int]]:
    """7 prompts: four short ones, then three of 20 to 40 tokens that arrive late (generate's `late`) and
    are computed in chunks beside the others' decodes; and each one's output length (4 to 16)."""
    prompt_ids = prompts(7, seed)
    for i in range(4, 7):
        prompt_ids[i] = (prompt_ids[i] * 40)[:20 + 10 * (i - 4)]
    return prompt_ids, [4 + 2 * i for i in range(7)]


@pytest.mark.gpu
@NEEDS_KERNELS
def test_graph_replays_equal_eager_steps_on_gpu(checkpoint: str) -> None:
    """7 requests, 3 of them long and late: every step replays a step graph (prompt chunks mixed with
    decodes too; none is past the largest graph of 32 tokens), at every replay the eager forward on the
    same inputs gives the same logits, and the greedy text equals an engine that never captured graphs."""
    prompt_ids, lengths = long_late_prompts(seed=3)
    eager = make_engine(checkpoint, "cuda", use_cuda_graphs=False, backend="cuda")
    want = generate(eager, prompt_ids, lengths, late=3)
    del eager
    engine = make_engine(checkpoint, "cuda", use_cuda_graphs=True, backend="cuda")
    runner = engine.runner
    assert runner.captured_sizes == capture_sizes(32)
    replays: dict[str, int] = {"decode": 0, "mixed": 0, "eager": 0}
    replay, execute = runner._replay, runner.execute

    def checked_replay(batch: ScheduledBatch, size: int, pending_tokens: torch.Tensor | None) -> torch.Tensor:
        replays["decode" if batch.is_decode_only else "mixed"] += 1
        eager_logits = engine.model(runner.prepare(batch)).clone()
        logits = replay(batch, size, pending_tokens)
        # Not bit for bit: the graph runs the padded batch, and kernels split their sums by batch size
        # (cuBLAS's choice, MLA's splits); in bf16 that moves a logit by about 0.02 (0.022 seen).
        # A stale or misplaced graph input moves them by far more.
        torch.testing.assert_close(logits, eager_logits, rtol=2e-2, atol=3e-2)
        return logits

    def counted_execute(batch: ScheduledBatch, graph_size: int | None = None, *args) -> torch.Tensor:
        replays["eager"] += graph_size is None
        return execute(batch, graph_size, *args)

    runner._replay, runner.execute = checked_replay, counted_execute
    assert generate(engine, prompt_ids, lengths, late=3) == want
    assert replays["eager"] == 0 and replays["mixed"] >= 3 and replays["decode"] > 0, replays


def _ep_graph_rank(rank: int, world_size: int, path: str, use_cuda_graphs: bool) -> dict:
    """Rank 0 serves the long, late prompts; rank 1 two short ones, then idles (replaying padding in
    step with rank 0, or running empty batches without graphs)."""
    import torch.distributed as dist

    from serving.engine.step_sync import StepSync

    torch.cuda.set_device(0)
    model = load_checkpoint(path, group=dist.group.WORLD, backend="cuda", max_tokens_per_rank=32,
                            dtype=torch.float32, device="cuda", progress=False)
    engine = LLMEngine(model, read_tokenizer(path), num_blocks=64, block_size=BLOCK_SIZE,
                       max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_tokens_per_rank=32,
                       device=torch.device("cuda"), rank=rank, num_ranks=world_size, use_cuda_graphs=use_cuda_graphs)
    sync = StepSync(dist.new_group(backend="gloo"))
    prompt_ids, lengths = long_late_prompts(seed=5 + rank)
    mine = range(7) if rank == 0 else range(2)
    replays = {"graph": 0, "eager": 0}
    execute = engine.runner.execute

    def counted_execute(batch: ScheduledBatch, graph_size: int | None = None, *args) -> torch.Tensor:
        replays["eager" if graph_size is None else "graph"] += 1
        return execute(batch, graph_size, *args)

    engine.runner.execute = counted_execute
    got: dict[str, list[int]] = {str(i): [] for i in mine}
    for step in range(500):
        if step == 0 or (step == 4 and rank == 0):
            for i in (mine[:4] if step == 0 else mine[4:]):
                engine.add_request(str(i), prompt_ids[i], SamplingParams(max_tokens=lengths[i], temperature=0.0,
                                                                         ignore_eos=True))
        for out in engine.step(sync):
            got[out.request_id] += out.new_token_ids
        if step > 4 and not sync.plan.step and not engine.has_work():
            break
    engine.model.ep_buffer.destroy()
    return {"tokens": got, "replays": replays}


@pytest.mark.gpu
@NEEDS_KERNELS
def test_expert_parallel_ranks_replay_the_same_step_graphs_on_one_gpu(checkpoint: str) -> None:
    """Two expert-parallel ranks (processes on one GPU, the cuda backend): with step graphs every step of
    both ranks replays one (the idle rank on padding), and each rank's greedy tokens equal those of the
    same two ranks without graphs."""
    from dist_harness import run_ranks

    eager = run_ranks(_ep_graph_rank, 2, checkpoint, False, timeout_s=300)
    graphs = run_ranks(_ep_graph_rank, 2, checkpoint, True, timeout_s=300)
    for rank in range(2):
        assert graphs[rank]["tokens"] == eager[rank]["tokens"], rank
        assert graphs[rank]["replays"]["eager"] == 0 and graphs[rank]["replays"]["graph"] > 0, graphs[rank]
    assert graphs[0]["replays"] == graphs[1]["replays"]  # in step: the idle rank replays too


def test_a_failed_throwaway_capture_leaves_the_compiles_to_the_warm_up_runs(monkeypatch, caplog) -> None:
    """_compile_ahead's fallback (CPU, with stand-ins for the capture and the compile pool): a capture that fails
    (as the first form did on an H100) is logged, the device synchronised, and start-up goes on with nothing
    compiled ahead."""
    import contextlib
    import logging

    from serving.engine import model_runner

    calls: list[str] = []

    @contextlib.contextmanager
    def pool():
        calls.append("pool")
        yield {"variants": 0}
        calls.append("pool left")

    @contextlib.contextmanager
    def failing_capture(graph, **kwargs):
        raise RuntimeError("operation failed due to a previous error during capture")
        yield

    monkeypatch.setattr(model_runner, "compile_ahead", pool)
    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    runner = SimpleNamespace(model=None, device=torch.device("cpu"), _static_view=lambda size: size)
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        variants, seconds = model_runner.ModelRunner._compile_ahead(runner, [4, 2, 1])
    assert variants == 0 and seconds >= 0 and calls == ["pool", "synchronize"]
    assert "the warm-up runs compile them" in caplog.text and "previous error during capture" in caplog.text


def _compiles_while_capturing(rank: int, world_size: int, path: str) -> dict:
    """In a fresh process (Triton's in-memory caches empty): the Triton compiles (`triton.compiler.compile`
    calls, a disk-cache hit included) made before the step graphs are compiled ahead (loading the model), while
    they are, and after it (the warm-up runs and captures)."""
    import threading

    import triton.compiler

    from serving.engine.model_runner import ModelRunner

    compiles: list[str] = []  # the compiling thread's name, per compile
    real_compile, real_ahead = triton.compiler.compile, ModelRunner._compile_ahead
    ahead: dict[str, object] = {}

    def counted_compile(*args, **kwargs):
        compiles.append(threading.current_thread().name)
        return real_compile(*args, **kwargs)

    def counted_ahead(self, sizes: list[int]) -> tuple[int, float]:
        ahead["start"] = len(compiles)
        ahead["result"] = result = real_ahead(self, sizes)
        ahead["end"] = len(compiles)
        return result

    triton.compiler.compile, ModelRunner._compile_ahead = counted_compile, counted_ahead
    torch.cuda.set_device(0)
    engine = make_engine(path, "cuda", use_cuda_graphs=True, backend="cuda")
    return {"variants": ahead["result"][0], "before": compiles[:ahead["start"]],
            "ahead": compiles[ahead["start"]:ahead["end"]], "after": compiles[ahead["end"]:],
            "sizes": engine.runner.captured_sizes}


@pytest.mark.gpu
@NEEDS_KERNELS
def test_step_graphs_kernels_are_compiled_ahead_on_threads_on_gpu(checkpoint: str) -> None:
    """Start-up compiles the step graphs' Triton kernels on a pool of threads before any warm-up run: every
    compile happens there, one per variant, and the warm-up runs and captures compile nothing."""
    from dist_harness import run_ranks

    [got] = run_ranks(_compiles_while_capturing, 1, checkpoint, timeout_s=300)
    assert got["sizes"] == capture_sizes(32)
    assert got["variants"] > 0 and len(got["ahead"]) == got["variants"], got
    assert all(name.startswith("triton-compile") for name in got["ahead"]), got
    assert got["after"] == [], got


@pytest.mark.gpu
@NEEDS_KERNELS
def test_async_scheduling_equals_sync_steps_on_gpu(checkpoint: str) -> None:
    """Graph replays whose input tokens are the last step's samples, copied on the device (in order, and
    by index once sequences finish), give the tokens of an engine that reads every step's samples on
    the host first: greedy and seeded sampling, staggered lengths, batches 7 down to 1, and steps that mix
    the prompts of three late requests into the others' decodes."""
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


def test_eager_block_tables_have_a_multiple_of_16_columns(checkpoint: str) -> None:
    """An eager step's block tables are as wide as its longest sequence's table rounded up to SPECIALIZED_MULTIPLE
    (16), so that the attention kernel sees one class of width whatever the step holds; the padding is -1."""
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference")
    for i, length in enumerate((3, 20, 50)):
        engine.add_request(f"r{i}", list(range(3, 3 + length)), SamplingParams(max_tokens=2, ignore_eos=True))
    batch = engine.scheduler.schedule(0.0)
    inputs = engine.runner.prepare(batch)
    used = max(len(seq.block_table) for seq in batch.seqs)
    tables = inputs.block_tables
    assert used % 16 and tables.shape[1] == -(-used // 16) * 16
    assert (tables[:, used:] == -1).all() and (tables[:, :1] >= 0).all()

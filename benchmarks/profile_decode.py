"""Where a decode step's time goes, in one engine without HTTP: for a few batch sizes, the host time of
a decode step (schedule, inputs, graph replay, sampling, detokenizing) with async scheduling and
without it, next to the GPU time of what it runs (CUDA events): the decode graph's replay, then the LM head and
the sampler, which run outside the graph; and the GPU kernels that take the most time in one replay
(torch.profiler), against the weight-bytes floor of that step and the LM head's share of it.

    python -m serving.tiny_model /tmp/v3-4l --v3-shaped-layers 4
    python benchmarks/profile_decode.py /tmp/v3-4l --load-format dummy --batch 1 64
    python benchmarks/profile_decode.py            # the built-in tiny model (CPU works too: eager)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_ll import event_us  # this script's folder is on sys.path
from bench_serving import decode_step_bytes, local_hbm_bytes_per_s

from serving.engine.engine import LLMEngine
from serving.engine.sequence import SamplingParams
from serving.loading.checkpoint import load_checkpoint, read_tokenizer
from serving.tiny_model import tiny_checkpoint

PROMPT_LEN = 16
TOKENS_PER_STEP = 256  # ep-serve's default --max-tokens-per-rank


def build_engine(path: str, load_format: str, device: str, max_num_seqs: int, max_model_len: int) -> LLMEngine:
    model = load_checkpoint(path, max_tokens_per_rank=TOKENS_PER_STEP, device=device, progress=False,
                       load_format=load_format).eval()
    return LLMEngine(model, read_tokenizer(path), num_blocks=max_num_seqs * -(-max_model_len // 16), block_size=16,
                     max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_tokens_per_rank=TOKENS_PER_STEP,
                     device=torch.device(device), use_cuda_graphs=device == "cuda")


def decode_steps(engine: LLMEngine, batch: int, steps: int, async_scheduling: bool) -> list[float]:
    """Host seconds of the first `steps` decode-only steps of `batch` sequences (prefill not timed). With
    async scheduling a step's call returns once the step before it is done, so in a row of decode steps
    each call takes what a step takes: the GPU's time, or the host's if that is longer."""
    engine.async_scheduling = async_scheduling
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{async_scheduling}-{i}", [3 + (7 * i + j) % 200 for j in range(PROMPT_LEN)],
                           params)
    times: list[float] = []
    while engine.has_work():
        scheduled = engine.schedule()
        timed = len(times) < steps and scheduled.is_decode_only and len(scheduled.seqs) == batch
        start = time.perf_counter()
        if scheduled:
            engine.execute(scheduled, engine.graph_size_alone(scheduled))
        else:
            engine.flush()
        if timed:
            times.append(time.perf_counter() - start)
    return times


def replay_gpu_us(engine: LLMEngine, size: int, reps: int = 50) -> float:
    graph, _ = engine.runner._graphs[size]
    return statistics.median(event_us(graph.replay) for _ in range(reps))


def outside_graph_us(engine: LLMEngine, size: int, batch: int, reps: int = 50) -> tuple[float, float]:
    """GPU µs of what a decode step of `batch` sequences runs after the graph of `size` (medians): the LM head on
    the graph's output rows, and greedy sampling of its logits."""
    model, (_, hidden) = engine.runner.model, engine.runner._graphs[size]
    rows = hidden[:batch]
    logits = model.compute_logits(rows)
    params = [SamplingParams(max_tokens=1, temperature=0.0)] * batch
    head = statistics.median(event_us(lambda: model.compute_logits(rows)) for _ in range(reps))
    sample = statistics.median(event_us(lambda: engine.sampler.run(logits, params, [None] * batch))
                               for _ in range(reps))
    return head, sample


def top_kernels(engine: LLMEngine, size: int, shown: int) -> tuple[int, list[tuple[str, float]]]:
    """Kernels per replay of the decode graph of `size`, and the `shown` ones that take the most time (µs
    per replay)."""
    graph, _ = engine.runner._graphs[size]
    replays = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows = sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:shown]
    return (sum(e.count for e in kernels) // replays,
            [(r.key[:70], r.device_time_total / replays) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--hbm-bytes-per-s", type=float, default=None,
                        help="HBM bandwidth of the floor (default: the GPU's datasheet figure, H100 3.35e12 or H200 "
                             "4.8e12)")
    parser.add_argument("--kernels", type=int, default=12, help="GPU kernels listed per batch size (default 12)")
    args = parser.parse_args()
    args.hbm_bytes_per_s = args.hbm_bytes_per_s or local_hbm_bytes_per_s()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.model or tiny_checkpoint()
    engine = build_engine(path, args.load_format, device, max(args.batch), args.max_model_len)
    print(f"# {path} ({args.load_format}) on {device}; graphs {engine.runner.captured_sizes} captured in "
          f"{engine.runner.capture_seconds:.1f} s; step times are medians of {args.steps}")
    head_weight = engine.runner.model.lm_head.weight
    head_floor_ms = head_weight.numel() * head_weight.element_size() / args.hbm_bytes_per_s * 1e3
    print(f"{'batch':>6} | {'step_ms':>8} | {'sync_ms':>8} | {'replay_ms':>9} | {'head_ms':>8} | {'sample_ms':>9} | "
          f"{'gap_ms':>7} | {'floor_ms':>8} | {'head_floor_ms':>13}")
    nan = float("nan")
    for batch in args.batch:
        step_ms, sync_ms = (statistics.median(decode_steps(engine, batch, args.steps, mode)) * 1e3
                            for mode in (True, False))
        size = next((s for s in engine.runner.captured_sizes if s >= batch), None)
        replay_ms = replay_gpu_us(engine, size) / 1e3 if size else nan
        head_ms, sample_ms = (us / 1e3 for us in outside_graph_us(engine, size, batch)) if size else (nan, nan)
        floor_ms = decode_step_bytes(Path(path), batch, 1) / args.hbm_bytes_per_s * 1e3
        gap_ms = step_ms - replay_ms - head_ms - sample_ms
        print(f"{batch:>6} | {step_ms:8.2f} | {sync_ms:8.2f} | {replay_ms:9.2f} | {head_ms:8.2f} | {sample_ms:9.2f} | "
              f"{gap_ms:7.2f} | {floor_ms:8.2f} | {head_floor_ms:13.2f}")
        if size:
            count, rows = top_kernels(engine, size, args.kernels)
            print(f"         {count} kernels per replay")
            for name, us in rows:
                print(f"         {us:9.1f} us  {name}")
    print("step = host time of a decode step with async scheduling, sync = without it; replay = GPU time of the "
          "decode graph alone; head, sample = GPU time of the LM head and of greedy sampling, both outside the graph; "
          "gap = step - replay - head - sample: what the step adds to its GPU work (the host's time where it is "
          "longer, launch gaps); floor = weight bytes at the HBM bandwidth "
          f"({args.hbm_bytes_per_s / 1e12:.2f} TB/s), head_floor = the LM head's share of it")


if __name__ == "__main__":
    main()

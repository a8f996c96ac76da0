"""Prefill of one long prompt in one engine (no HTTP) on one GPU: the MoE layers in normal (high-throughput)
mode, the whole prompt in one step (or steps of `--budget` tokens), against low-latency mode, the prompt in
chunks of `--max-tokens-per-rank` tokens (ep-serve's default 256). Time to the first token: wall time from
adding the request to its first token, median of `--repeats` after one warm-up per mode and length, the
same model and weights for both modes.

    python -m serving.tiny_model /tmp/v3-4l --v3-shaped-layers 4
    python benchmarks/bench_prefill.py /tmp/v3-4l --load-format dummy --prompts 2048 8192
    python benchmarks/bench_prefill.py            # the built-in tiny model (CPU works too)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from serving.engine.engine import LLMEngine
from serving.engine.sequence import SamplingParams
from serving.loading.checkpoint import load_checkpoint, read_tokenizer
from serving.tiny_model import tiny_checkpoint

BLOCK_SIZE = 16


def engine_for(model: torch.nn.Module, tokenizer: object, device: str, mode: str, max_tokens_per_rank: int,
               budget: int, max_model_len: int) -> LLMEngine:
    """One sequence at a time; steps of `budget` prompt tokens (normal mode) or of the low-latency T. No
    prefix caching: every repeat of the prompt computes all of it."""
    return LLMEngine(model, tokenizer, num_blocks=-(-max_model_len // BLOCK_SIZE), block_size=BLOCK_SIZE,
                     max_model_len=max_model_len, max_num_seqs=1, max_tokens_per_rank=max_tokens_per_rank,
                     device=torch.device(device), token_budget=budget if mode == "normal" else max_tokens_per_rank,
                     deepep_mode=mode, enable_prefix_caching=False)


def time_to_first_tokens(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[float, int]:
    """Seconds from adding `prompts` (one output token each) to their tokens, and the steps that took."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    sync()
    return time.perf_counter() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192], help="prompt lengths in tokens")
    parser.add_argument("--max-tokens-per-rank", type=int, default=256, help="the low-latency T (its chunk)")
    parser.add_argument("--budget", type=int, default=0, help="normal mode's tokens per step (0: the whole prompt)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.model or tiny_checkpoint()
    longest = max(args.prompts)
    model = load_checkpoint(path, max_tokens_per_rank=args.max_tokens_per_rank, device=device, progress=False,
                       load_format=args.load_format, normal_mode=True).eval()
    tokenizer = read_tokenizer(path)
    vocab = int(model.config.vocab_size)
    print(f"# {path} ({args.load_format}) on {device}; low-latency T = {args.max_tokens_per_rank}; "
          f"medians of {args.repeats} after a warm-up", flush=True)
    print(f"{'prompt':>7} | {'mode':>11} | {'steps':>5} | {'ttft_ms':>9} | {'tokens/s':>9}")
    results = {}
    for length in args.prompts:
        prompt = [3 + (7 * j) % (vocab - 3) for j in range(length)]
        for mode in ("low_latency", "normal"):
            engine = engine_for(model, tokenizer, device, mode, args.max_tokens_per_rank, args.budget or length,
                                longest + BLOCK_SIZE)
            time_to_first_tokens(engine, [prompt], f"warm-{mode}-{length}")
            runs = [time_to_first_tokens(engine, [prompt], f"{mode}-{length}-{i}") for i in range(args.repeats)]
            seconds = statistics.median(s for s, _ in runs)
            results[length, mode] = seconds
            print(f"{length:>7} | {mode:>11} | {runs[0][1]:>5} | {seconds * 1e3:9.1f} | {length / seconds:9.0f}",
                  flush=True)
        print(f"{length:>7} | normal mode takes {results[length, 'normal'] / results[length, 'low_latency']:.2f}x "
              "the time of chunked low-latency")


if __name__ == "__main__":
    main()

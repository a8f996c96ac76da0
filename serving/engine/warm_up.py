"""Warm-up before a rank reports ready: a few requests through the engine itself, so that every path a
request can take runs once (and every kernel it launches is compiled, and every lazy initialisation done)
before the first real request pays for it: greedy and sampled draws (temperature, min_p, top-k, top-p,
seeded or not), penalties, min_tokens, logprobs and prompt logprobs, at prompt lengths that reach
Triton's specialisations (1, a multiple of 16, another). Step graphs are captured before it; its steps
replay them. Where a step may hold more tokens than the largest graph (or no graphs run here), two more
prompts follow, one at a time, each a step of its own that runs eagerly (in normal mode with deepep_mode
"auto"): as long as a step may be, rounded down to a multiple of 16, and one token shorter, since Triton
compiles a kernel once for each class of its token count. Afterwards the prefix cache and the step counters
are as at start.

Expert-parallel ranks warm up together: every rank runs the same requests, stepping with its peers'
agreement until no rank has work."""

from __future__ import annotations

import time

import torch

from ep_layer.kernels.launch import SPECIALIZED_MULTIPLE

from .engine import LLMEngine
from .sequence import SamplingParams
from .step_sync import StepSync

PROMPT_LENGTHS = (1, 16, 23)  # Triton specialises integer arguments equal to 1 and divisible by 16
MAX_TOKENS = 3
PARAMS = (
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5,
                   presence_penalty=0.5, min_tokens=2),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, prompt_logprobs=2, ignore_eos=True),
)
MAX_STEPS = 1000  # a bound on the loop; the requests above take a handful of steps
# The ids warm-up prompts cycle through: low ones past the usual BOS, EOS and padding. Any id serves a real
# model; test models keep their special ids at the top of the vocabulary.
PROMPT_IDS = range(3, 32)


def warm_up(engine: LLMEngine, sync: StepSync | None = None) -> float:
    """Run the warm-up requests to completion (sync: the peers' agreement, None: alone); seconds taken."""
    start = time.perf_counter()
    for length in PROMPT_LENGTHS:
        for j, params in enumerate(PARAMS):
            engine.add_request(f"warm-up-{length}-{j}", prompt_of(engine, length), params)
    run_to_completion(engine, sync)
    for i, length in enumerate(eager_step_lengths(engine), start=1):
        # Starting at another id than every earlier warm-up prompt: the prefix cache serves none of it.
        engine.add_request(f"warm-up-eager-{length}", prompt_of(engine, length, first=i), PARAMS[0])
        try:
            run_to_completion(engine, sync)
        except torch.cuda.OutOfMemoryError as e:  # the KV cache was sized before any step this long ran
            raise RuntimeError(f"warm-up: a step of {length} tokens ran out of GPU memory; lower "
                               f"--max-num-batched-tokens (the step budget, {engine.scheduler.token_budget} tokens) "
                               f"or --gpu-memory-utilization (the KV cache's share of the GPU): {e}") from e
    engine.forget_history()
    return time.perf_counter() - start


def eager_step_lengths(engine: LLMEngine) -> list[int]:
    """Prompt lengths whose first step runs eagerly, past the largest step graph (any length without graphs):
    the longest step, rounded down to a multiple of 16, and one token less."""
    graphs = engine.runner.captured_sizes
    longest = min(engine.scheduler.token_budget, engine.max_model_len - MAX_TOKENS)
    top = max(longest - longest % SPECIALIZED_MULTIPLE, 2)
    return [n for n in (top, top - 1) if not graphs or n > graphs[-1]]


def run_to_completion(engine: LLMEngine, sync: StepSync | None) -> None:
    """Step until no rank has work (sync: the peers' agreement, None: alone)."""
    for _ in range(MAX_STEPS):
        engine.step(sync)
        if not engine.has_work() and (sync is None or not sync.plan.step):
            return
    raise RuntimeError(f"warm-up: requests not done after {MAX_STEPS} steps")


def prompt_of(engine: LLMEngine, length: int, first: int = 0) -> list[int]:
    """A warm-up prompt of `length` token ids: PROMPT_IDS within the vocabulary over and over, from its `first`."""
    ids = [i for i in PROMPT_IDS if i < engine.vocab_size] or [0]
    return [ids[(first + i) % len(ids)] for i in range(length)]

"""Where a large prompt step's time goes, in one engine without HTTP: `--prompts` prompts of `--length` tokens
computed in one step through normal (high-throughput) mode, as ep-serve's default runs steps past the largest
step graph (8,192 tokens a step). Prints the step's wall time (median of `--repeats` after two warm-ups) with
each form of its prompt attention side by side, interleaved (on a GPU: the long chunks as blocks in MLA's
expanded form, as ep-serve runs them; the blocks with torch's own choice of fused attention kernel, cuDNN's
on Hopper, which ep-serve leaves out (mla.PROMPT_SDPA_BACKENDS); and every token through the per-token MLA
kernel; on CPU all take the host layout), and the GPU kernels that take the most time in one more step
(torch.profiler, the blocks), by kernel name. --new-lengths gives every prompt of every step a length no earlier
prompt had (from --length down), as a server's steps meet them: a kernel that plans per shape plans again.

    python -m serving.tiny_model /tmp/v3-4l --v3-shaped-layers 4
    python benchmarks/profile_prompt_step.py /tmp/v3-4l --load-format dummy --prompts 16 --length 512
    python benchmarks/profile_prompt_step.py /tmp/v3-4l --load-format dummy --prompts 4 --length 1024 --new-lengths
    python benchmarks/profile_prompt_step.py        # the built-in tiny model (CPU works too)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from bench_prefill import time_to_first_tokens
from torch.nn.attention import SDPBackend

from serving.engine.engine import LLMEngine
from serving.loading.checkpoint import load_checkpoint, read_tokenizer
from serving.models import mla, paged_attention
from serving.tiny_model import tiny_checkpoint

BLOCK_SIZE = 16
LOW_LATENCY_T = 256  # ep-serve's default low-latency T (steps up to it replay graphs; this step is larger)
# The prompt attention's forms: the fewest new tokens of a sequence that attend as a block, and the fused attention
# kernels a block may take (torch picks among them in its own order).
ATTENTION_FORMS = {
    "blocks": (paged_attention.PROMPT_BLOCK_MIN_TOKENS, mla.PROMPT_SDPA_BACKENDS),
    "blocks, cuDNN allowed": (paged_attention.PROMPT_BLOCK_MIN_TOKENS,
                              [SDPBackend.CUDNN_ATTENTION, *mla.PROMPT_SDPA_BACKENDS]),
    "per-token": (sys.maxsize, mla.PROMPT_SDPA_BACKENDS),
}


@contextmanager
def attention_form(name: str) -> Iterator[None]:
    """Steps in this form of the prompt attention (ATTENTION_FORMS), then ep-serve's again."""
    kept = paged_attention.PROMPT_BLOCK_MIN_TOKENS, mla.PROMPT_SDPA_BACKENDS
    paged_attention.PROMPT_BLOCK_MIN_TOKENS, mla.PROMPT_SDPA_BACKENDS = ATTENTION_FORMS[name]
    try:
        yield
    finally:
        paged_attention.PROMPT_BLOCK_MIN_TOKENS, mla.PROMPT_SDPA_BACKENDS = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--prompts", type=int, default=16, help="prompts in the step")
    parser.add_argument("--length", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="kernels to list")
    parser.add_argument("--new-lengths", action="store_true",
                        help="every prompt a length no earlier one had, from --length down (else all --length)")
    args = parser.parse_args()
    if min(args.prompts, args.length, args.repeats) < 1:
        parser.error("--prompts, --length and --repeats: expected at least 1")
    steps = (args.repeats + 3) * len(ATTENTION_FORMS)  # the warm-ups and the profiled step too
    if args.new_lengths and args.length - steps * args.prompts < paged_attention.PROMPT_BLOCK_MIN_TOKENS:
        parser.error(f"--new-lengths: {steps * args.prompts} distinct lengths from --length down must stay at least "
                     f"{paged_attention.PROMPT_BLOCK_MIN_TOKENS} (a block); raise --length or lower --prompts")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.model or tiny_checkpoint()
    model = load_checkpoint(path, max_tokens_per_rank=LOW_LATENCY_T, device=device, progress=False,
                            load_format=args.load_format, normal_mode=True).eval()
    vocab, tokens = int(model.config.vocab_size), args.prompts * args.length
    if args.length > int(model.config.max_position_embeddings):
        parser.error(f"--length: expected at most the model's max_position_embeddings, got {args.length}")
    # No prefix caching and distinct prompts: every step computes all of its tokens.
    engine = LLMEngine(model, read_tokenizer(path), num_blocks=-(-tokens // BLOCK_SIZE) + args.prompts,
                       block_size=BLOCK_SIZE, max_model_len=args.length + BLOCK_SIZE, max_num_seqs=args.prompts,
                       max_tokens_per_rank=LOW_LATENCY_T, device=torch.device(device), token_budget=tokens,
                       deepep_mode="normal", enable_prefix_caching=False)
    def prompts(seed: int) -> list[list[int]]:
        """Step `seed`'s prompts: distinct token ids, every one --length long, or (--new-lengths) lengths no
        other step's prompts have."""
        lengths = [args.length - (seed * args.prompts + i) if args.new_lengths else args.length
                   for i in range(args.prompts)]
        return [[3 + (7 * j + 13 * i + 101 * seed) % (vocab - 3) for j in range(n)] for i, n in enumerate(lengths)]

    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in ATTENTION_FORMS}
    for r in range(-2, args.repeats):  # two warm-ups of each form, then the forms in turn
        for i, name in enumerate(ATTENTION_FORMS):
            with attention_form(name):
                run = time_to_first_tokens(engine, prompts(len(ATTENTION_FORMS) * (r + 2) + i), f"{name}-{r}")
            if r >= 0:
                runs[name].append(run)
    print(f"# {path} ({args.load_format}) on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}: "
          f"{args.prompts} prompts of {'new lengths up to ' if args.new_lengths else ''}{args.length} tokens "
          f"(up to {tokens} tokens) in {runs['blocks'][0][1]} step(s), normal mode")
    for name, timed in runs.items():
        print(f"step wall time, prompt attention {name}: {statistics.median(s for s, _ in timed) * 1e3:.1f} ms "
              f"(median of {args.repeats})")
    if device != "cuda":
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof, attention_form("blocks"):
        time_to_first_tokens(engine, prompts(len(ATTENTION_FORMS) * (args.repeats + 2)), "profiled")
    time_by_kernel, calls = Counter(), Counter()
    for event in prof.key_averages():
        if event.device_time_total > 0:
            time_by_kernel[event.key[:90]] += event.device_time_total
            calls[event.key[:90]] += event.count
    print(f"GPU kernel time {sum(time_by_kernel.values()) / 1e3:.1f} ms; the top {args.top}:")
    print(f"{'ms':>8} | {'calls':>5} | kernel")
    for name, us in time_by_kernel.most_common(args.top):
        print(f"{us / 1e3:8.2f} | {calls[name]:5d} | {name}")


if __name__ == "__main__":
    main()

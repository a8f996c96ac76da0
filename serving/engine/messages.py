"""Typed messages between the API server and the engine ranks (over multiprocessing queues)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import NamedTuple

from ep_layer.latency import LatencyHistogram

from .sequence import SamplingParams

# ---------------------------------------------------------------- server -> rank


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # the priority scheduling policy's (LLMEngine.add_request)


@dataclass(frozen=True)
class AddRequests:
    """Requests for one rank, sent together: objects they share (a prompt's token list, stop strings)
    are pickled once, and the rank keeps one copy of them."""

    requests: list[AddRequest]


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Wake:
    """Sent to the other ranks with each request under expert parallelism, so idle ranks join the step."""


@dataclass(frozen=True)
class CollectStats:
    """Asks a rank for its device counters (read at scrape time only)."""

    token: int


@dataclass(frozen=True)
class ResetPrefixCache:
    """Asks a rank to forget its prefix cache between steps (LLMEngine.reset_prefix_cache)."""

    token: int


@dataclass(frozen=True)
class Shutdown:
    pass


# ---------------------------------------------------------------- rank -> server


@dataclass(frozen=True)
class ModelInfo:
    """What a rank loaded and built. ep_backend: its MoE layers' Buffer backend (None: no MoE layers);
    graph_sizes: the step graphs it captured (empty: steps run eagerly), and eager_reason why, where graphs
    cannot run there (ModelRunner.eager_reason)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    device: str
    ep_backend: str | None = None
    graph_sizes: tuple[int, ...] = ()
    eager_reason: str | None = None


@dataclass(frozen=True)
class RankReady:
    rank: int
    info: ModelInfo


@dataclass(frozen=True)
class RankFailed:
    rank: int
    error: str


class TokenLogprobs(NamedTuple):
    """One token's log-probability and the `k` likeliest tokens at its place (k: the request's logprobs
    or prompt_logprobs), likeliest first, as (token id, logprob); the token itself is the one at the
    same index of new_token_ids (or of the prompt). Log-probabilities are log_softmax of the model's
    float32 logits, before penalties, temperature and filters (vLLM's default "raw_logprobs"). As
    vLLM's, the token's own entry is separate: it may be among `top` too, or not (then the API's
    top_logprobs list it as the k + 1-th)."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int  # the token's: 1 + the tokens likelier than it (vLLM's Logprob.rank); the top's are 1, 2, ...


@dataclass(frozen=True)
class RequestOutput:
    """What one step did for a request: new tokens, the text they completed, and the end if reached.
    logprobs: one TokenLogprobs per new token, where the request asked (SamplingParams.logprobs);
    prompt_logprobs: once, on the output of the first token, one per prompt token (None for the
    first, which has no context), where it asked (SamplingParams.prompt_logprobs)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "repetition"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    queue_time: float | None = None  # seconds from arrival to first scheduled; on the first output only
    error: str | None = None  # why the engine refused the request or failed on it (finish_reason "abort")
    internal_error: bool = False  # error is the engine's own failure on this request (a bug), not bad input
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache; on the first output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """A rank's scheduler state; prefix_cache_queries / prefix_cache_hits: cumulative tokens of new
    requests looked up in the prefix cache and found there (block_manager.PrefixCacheStats)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass(frozen=True)
class StepOutputs:
    rank: int
    outputs: list[RequestOutput]
    stats: SchedulerStats


@dataclass(frozen=True)
class EPStats:
    """A rank's cumulative counters (see serving.engine.ep_stats)."""

    rank: int
    num_ranks: int
    expert_load: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> tokens per local expert
    dispatch_wait_ns: list[int] = field(default_factory=list)  # per source rank, summed over layers
    combine_wait_ns: list[int] = field(default_factory=list)
    steps: StepCounters | None = None
    # Per call of dispatch / combine, summed over the model's Buffers; None without any Buffer.
    dispatch_latency: LatencyHistogram | None = None
    combine_latency: LatencyHistogram | None = None


# vLLM's buckets of vllm:iteration_tokens_total (vllm/v1/metrics/loggers.py).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepCounters:
    """A rank's engine steps: count and host seconds by kind; and each non-empty step's tokens as vLLM counts an
    iteration's (prompt tokens computed plus tokens sampled): how many steps fell at or under each bound of
    ITERATION_TOKEN_BUCKETS and above (the last entry), and their sum."""

    count: dict[str, int]
    seconds: dict[str, float]
    tokens_per_bucket: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    tokens_sum: int = 0

    @classmethod
    def zero(cls, kinds: tuple[str, ...]) -> StepCounters:
        """Every kind at 0, so that each exports a series from the start."""
        return cls(dict.fromkeys(kinds, 0), dict.fromkeys(kinds, 0.0))

    def add(self, kind: str, seconds: float, tokens: int) -> None:
        """A step of `kind` that took `seconds` of host time and, unless empty, `tokens` iteration tokens."""
        self.count[kind] += 1
        self.seconds[kind] += seconds
        if kind != "empty":
            self.tokens_per_bucket[bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self.tokens_sum += tokens

    def copy(self) -> StepCounters:
        return StepCounters(dict(self.count), dict(self.seconds), list(self.tokens_per_bucket), self.tokens_sum)


@dataclass(frozen=True)
class StatsReply:
    token: int
    stats: EPStats


@dataclass(frozen=True)
class PrefixCacheReset:
    """A rank's answer to ResetPrefixCache: done, or not (sequences still hold blocks)."""

    token: int
    rank: int
    done: bool

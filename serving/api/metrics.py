"""Prometheus metrics on a registry of our own: vLLM's names, labels (model_name, engine) and bucket
boundaries, so existing vLLM dashboards work; plus `ep_layer:` metrics from the ranks' device counters,
read only when /metrics is scraped.

The ep_layer: latency histograms (dispatch_latency_seconds, combine_latency_seconds) have buckets of their
own, ep_layer.latency.BOUNDS_S (5 us to 100 ms), filled by the Buffers as they run (on the device with
the cuda backend) and only read here.

The vllm: metrics are fed by `ServingMetrics` as the coordinator's observer (from its reader thread):
TTFT, inter-token latency and end-to-end latency are measured in the server process from request
arrival to the arrival of each output; queue time is the engine's (arrival to first scheduled). A
finished request's phases are vLLM's (vllm/v1/metrics/stats.py, `update_from_finished_request`): prefill
from first scheduled (here: the server's arrival plus the engine's queue time) to the first token, decode
from the first token to the last, inference the two together, and the mean time per output token after
the first. The prefix cache and preemption counters are the ranks' own (serving.engine.block_manager.
PrefixCacheStats, the scheduler's preemptions), which come cumulative with each rank's scheduler state and
are added here as they grow."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ep_layer.latency import OPS, LatencyHistogram

from ..engine.dp_coordinator import Counted, Submission
from ..engine.messages import ITERATION_TOKEN_BUCKETS, EPStats, RequestOutput, SchedulerStats
from ..engine.sequence import FINISH_ABORT, FINISH_LENGTH, FINISH_REPETITION, FINISH_STOP

# vLLM's boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = INTER_TOKEN_BUCKETS  # the same list there
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_REPETITION)
# vllm:prompt_tokens_by_source's sources (vllm/v1/metrics/stats.py, PromptTokenStats): no KV comes from elsewhere here.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vllm:num_requests_waiting_by_reason's reasons: every waiting request here waits for capacity ("deferred" is
# vLLM's for LoRA budgets and KV transfers).
WAITING_REASONS = ("capacity", "deferred")
_LABELS = ("model_name", "engine")


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets of per-request token counts (loggers.py,
    build_1_2_5_buckets(max_model_len))."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class _Timing:
    arrival: float
    counted: Counted
    scheduled: float | None = None  # arrival plus the engine's queue time, once its first output says it
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    cached_tokens: int = 0  # of its prompt, found in the prefix cache (its first output says it)


class ServingMetrics:
    """The registry behind /metrics; an EngineObserver for the DPCoordinator."""

    def __init__(self, model_name: str, num_ranks: int, max_model_len: int) -> None:
        disable_created_metrics()  # no *_created series, as vLLM (a process-wide prometheus_client setting)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _LABELS, buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _LABELS, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _LABELS,
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             _LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             _LABELS, registry=r)
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: 'capacity' = "
            "waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
            "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.", (*_LABELS, "reason"),
            registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              _LABELS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", _LABELS,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         _LABELS, registry=r)
        self.prompt_tokens_by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                               (*_LABELS, "source"), registry=r)
        self.prompt_tokens_cached = Counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).", _LABELS, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", _LABELS, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", _LABELS, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*_LABELS, "finished_reason"), registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   _LABELS, registry=r)
        counts = token_count_buckets(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               _LABELS, buckets=counts, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", _LABELS, buckets=counts,
                                                   registry=r)
        self.prefill_kv_computed = Histogram("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                             "computed during prefill (excluding cached tokens).", _LABELS,
                                             buckets=counts, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _LABELS,
                                      buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _LABELS,
                                     buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", _LABELS,
                                        buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.max_tokens_param = Histogram("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", _LABELS, buckets=counts,
                                          registry=r)
        self.n_param = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", _LABELS,
                                 buckets=N_BUCKETS, registry=r)
        self.max_generation_tokens = Histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.",
                                               _LABELS, buckets=counts, registry=r)
        self.time_per_output_token = Histogram("vllm:request_time_per_output_token_seconds",
                                               "Histogram of time_per_output_token_seconds per request.", _LABELS,
                                               buckets=TIME_PER_OUTPUT_TOKEN_BUCKETS, registry=r)
        self.rejected = Counter("ep_layer:requests_rejected", "Requests refused with a 503 because the engine "
                                "ranks' running and waiting sequences were at their limits.", ["model_name"],
                                registry=r)
        self.rejected.labels(model_name)
        self.ep = EPCollector(model_name)
        r.register(self.ep)
        for rank in range(num_ranks):
            labels = (model_name, str(rank))
            for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.running, self.waiting,
                           self.kv_usage, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
                           self.prefix_hits, self.preemptions, self.request_prompt_tokens,
                           self.request_generation_tokens, self.prefill_time, self.decode_time, self.inference_time,
                           self.time_per_output_token, self.max_tokens_param, self.n_param,
                           self.max_generation_tokens, self.prompt_tokens_cached, self.prefill_kv_computed):
                metric.labels(*labels)
            for reason in FINISH_REASONS:
                self.success.labels(*labels, reason)
            for source in PROMPT_SOURCES:
                self.prompt_tokens_by_source.labels(*labels, source)
            for reason in WAITING_REASONS:
                self.waiting_by_reason.labels(*labels, reason)
        self._lock = threading.Lock()
        self._timing: dict[str, _Timing] = {}
        self._counters_seen: dict[int, tuple[int, int, int]] = {}  # rank -> (queries, hits, preemptions) so far
        # A parent request's choices not yet finished, and the most tokens one of its finished choices generated.
        self._parents: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ EngineObserver
    def on_request(self, rank: int, request: Submission, now: float) -> None:
        with self._lock:
            self._timing[request.request_id] = _Timing(now, request.counted)

    def on_output(self, rank: int, output: RequestOutput, now: float) -> None:
        labels = (self.model_name, str(rank))
        with self._lock:
            timing = self._timing.get(output.request_id)
            if timing is None:
                return
            if output.finished:
                del self._timing[output.request_id]
        if output.queue_time is not None:
            self.queue_time.labels(*labels).observe(output.queue_time)
            timing.scheduled = timing.arrival + output.queue_time
        n = len(output.new_token_ids)
        first = n > 0 and timing.first_token is None
        if output.num_cached_tokens is not None:
            timing.cached_tokens = output.num_cached_tokens
        if first and timing.counted.prompt:
            self._prompt_done(labels, output.num_prompt_tokens, timing.cached_tokens)
        if n:
            if first:
                timing.first_token = now
            if timing.counted.output:
                if first:
                    self.ttft.labels(*labels).observe(now - timing.arrival)
                else:
                    self.itl.labels(*labels).observe(now - timing.last_token)
                self.generation_tokens.labels(*labels).inc(n)
            timing.last_token, timing.tokens = now, timing.tokens + n
        if output.finished:
            self.e2e.labels(*labels).observe(now - timing.arrival)
            self.success.labels(*labels, output.finish_reason).inc()
            self._finished(labels, timing, output.num_prompt_tokens)
            self._choice_finished(labels, timing, output.request_id)

    def _prompt_done(self, labels: tuple[str, str], prompt_tokens: int, cached: int) -> None:
        """A prompt's tokens, once its first token came: those computed and those the prefix cache held (vLLM's
        vllm/v1/metrics/stats.py, PromptTokenStats; none come from another engine's KV here)."""
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        by_source = dict.fromkeys(PROMPT_SOURCES, 0) | {"local_compute": prompt_tokens - cached,
                                                        "local_cache_hit": cached}
        for source, tokens in by_source.items():
            self.prompt_tokens_by_source.labels(*labels, source).inc(tokens)
        self.prompt_tokens_cached.labels(*labels).inc(cached)

    def _finished(self, labels: tuple[str, str], timing: _Timing, prompt_tokens: int) -> None:
        """A finished request's token counts, its max_tokens and, where a token came, its phases (the module
        docstring)."""
        counted = timing.counted
        if counted.prompt:
            self.request_prompt_tokens.labels(*labels).observe(prompt_tokens)
            self.prefill_kv_computed.labels(*labels).observe(prompt_tokens - timing.cached_tokens)
        if counted.max_tokens:
            self.max_tokens_param.labels(*labels).observe(counted.max_tokens)
        if not counted.output:
            return
        self.request_generation_tokens.labels(*labels).observe(timing.tokens)
        if timing.first_token is None or timing.scheduled is None:
            return
        decode = timing.last_token - timing.first_token
        self.prefill_time.labels(*labels).observe(timing.first_token - timing.scheduled)
        self.decode_time.labels(*labels).observe(decode)
        self.inference_time.labels(*labels).observe(timing.last_token - timing.scheduled)
        self.time_per_output_token.labels(*labels).observe(decode / (timing.tokens - 1) if timing.tokens > 1 else 0)

    def _choice_finished(self, labels: tuple[str, str], timing: _Timing, request_id: str) -> None:
        """Once every choice of a parent request has finished: its n and the most tokens a choice generated
        (vLLM's vllm/v1/engine/parallel_sampling.py, `observe_finished_request`)."""
        counted = timing.counted
        parent = counted.parent or request_id
        with self._lock:
            entry = self._parents.setdefault(parent, [counted.choices, 0])
            entry[0] -= 1
            entry[1] = max(entry[1], timing.tokens if counted.output else 0)
            if entry[0] > 0:
                return
            del self._parents[parent]
        self.n_param.labels(*labels).observe(counted.choices)
        self.max_generation_tokens.labels(*labels).observe(entry[1])

    def on_rejected(self) -> None:
        self.rejected.labels(self.model_name).inc()

    def on_stats(self, rank: int, stats: SchedulerStats) -> None:
        labels = (self.model_name, str(rank))
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        for reason in WAITING_REASONS:
            self.waiting_by_reason.labels(*labels, reason).set(stats.num_waiting if reason == "capacity" else 0)
        self.kv_usage.labels(*labels).set(stats.kv_cache_usage)
        queries, hits, preemptions = self._counters_seen.get(rank, (0, 0, 0))
        self.prefix_queries.labels(*labels).inc(stats.prefix_cache_queries - queries)
        self.prefix_hits.labels(*labels).inc(stats.prefix_cache_hits - hits)
        self.preemptions.labels(*labels).inc(stats.num_preemptions - preemptions)
        self._counters_seen[rank] = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)

    # ------------------------------------------------------------------ exposition
    def render(self, ep_stats: list[EPStats]) -> bytes:
        """The text exposition, with the ep_layer: metrics from `ep_stats` (just collected)."""
        self.ep.snapshot = ep_stats
        return generate_latest(self.registry)


class EPCollector(Collector):
    """ep_layer: metrics from the ranks' counters, as of the last scrape:
    - expert_tokens_total{layer, expert}: tokens routed to each (global) expert, from FusedMoE.expert_load;
    - expert_load_imbalance{layer}: max over experts / mean of those tokens (1 = balanced);
    - dispatch_wait_seconds_total / combine_wait_seconds_total{engine, src_rank}: time each rank waited
      for each source rank in dispatch / combine (the Buffer's wait-cost stats, where the model keeps them);
    - dispatch_latency_seconds / combine_latency_seconds{engine}: histograms of one call's latency, the
      time it occupies the stream (send half + receive half, waits for peers included, the work between
      a send and its hook not), summed over the model's Buffers (Buffer.latency_stats(): device timers
      on the cuda backend, host time on the reference backend); every call counts, warm-up runs too;
    - engine_steps_total / engine_step_seconds_total{engine, kind}: steps by kind (prefill, decode, empty)
      and their host time, model forward + sampling (mean step latency = the ratio of their rates);
    and vLLM's vllm:iteration_tokens_total{engine}, a histogram of the tokens of each non-empty step (the prompt
    tokens it computed and the tokens it sampled), from the same step counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: list[EPStats] = []

    def collect(self) -> Iterable[Metric]:
        name, stats = self.model_name, self.snapshot
        tokens = CounterMetricFamily("ep_layer:expert_tokens", "Tokens routed to each expert (all ranks' "
                                     "experts, global ids).", labels=["model_name", "layer", "expert"])
        imbalance = GaugeMetricFamily("ep_layer:expert_load_imbalance", "Max over experts of routed tokens "
                                      "divided by their mean (1 = balanced).", labels=["model_name", "layer"])
        layers = sorted({layer for s in stats for layer in s.expert_load})
        for layer in layers:
            loads: list[int] = []
            for s in stats:
                local = s.expert_load.get(layer, [])
                for i, count in enumerate(local):  # rank r holds experts [r * E_l, (r + 1) * E_l)
                    tokens.add_metric([name, str(layer), str(s.rank * len(local) + i)], count)
                loads += local
            mean = sum(loads) / len(loads) if loads else 0
            if mean > 0:
                imbalance.add_metric([name, str(layer)], max(loads) / mean)
        yield tokens
        yield imbalance
        for what in ("dispatch", "combine"):
            wait = CounterMetricFamily(f"ep_layer:{what}_wait_seconds", f"Time spent waiting for each source "
                                       f"rank's data in {what}.", labels=["model_name", "engine", "src_rank"])
            for s in stats:
                for src, ns in enumerate(s.dispatch_wait_ns if what == "dispatch" else s.combine_wait_ns):
                    wait.add_metric([name, str(s.rank), str(src)], ns / 1e9)
            yield wait
        for what in OPS:
            latency = HistogramMetricFamily(
                f"ep_layer:{what}_latency_seconds", f"Latency of one {what} call: send half plus receive half "
                "(waits for peers included; the work between a send and its hook not).",
                labels=["model_name", "engine"])
            for s in stats:
                hist = s.dispatch_latency if what == "dispatch" else s.combine_latency
                if hist is not None:
                    latency.add_metric([name, str(s.rank)], _buckets(hist), hist.sum_s)
            yield latency
        steps = CounterMetricFamily("ep_layer:engine_steps", "Engine steps by kind (prefill, decode, empty).",
                                    labels=["model_name", "engine", "kind"])
        seconds = CounterMetricFamily("ep_layer:engine_step_seconds", "Host time of engine steps by kind "
                                      "(model forward and sampling).", labels=["model_name", "engine", "kind"])
        iteration = HistogramMetricFamily("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          labels=["model_name", "engine"])
        bounds = [floatToGoString(b) for b in (*ITERATION_TOKEN_BUCKETS, math.inf)]
        for s in stats:
            if s.steps is None:
                continue
            for kind, count in sorted(s.steps.count.items()):
                steps.add_metric([name, str(s.rank), kind], count)
                seconds.add_metric([name, str(s.rank), kind], s.steps.seconds.get(kind, 0.0))
            cumulative = itertools.accumulate(s.steps.tokens_per_bucket)
            iteration.add_metric([name, str(s.rank)], list(zip(bounds, cumulative)), s.steps.tokens_sum)
        yield steps
        yield seconds
        yield iteration


def _buckets(hist: LatencyHistogram) -> list[tuple[str, float]]:
    """Prometheus' cumulative (le, count) pairs, le written as prometheus_client's own histograms do."""
    return [(floatToGoString(bound), count) for bound, count in hist.cumulative()]

"""serving/api/metrics.py and serving/engine/ep_stats.py without a server: the dispatch / combine latency
histograms as Prometheus reads them (prometheus_client's own text parser), and read out of a model's MoE layers,
summed over their Buffers; the vllm: series against vLLM's own definitions (its source) and a finished request's
phases. Against a live server: tests/test_deploy_live.py."""

from __future__ import annotations

import math
import pickle
import random

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ep_layer import Buffer
from ep_layer.latency import BOUNDS_S, OPS, HostLatencyRecorder, LatencyHistogram
from ep_layer.moe import FusedMoE
from serving.api.metrics import EPCollector
from serving.engine.dp_coordinator import Counted, Submission
from serving.engine.ep_stats import read_ep_stats
from serving.engine.messages import EPStats, StepCounters
from serving.engine.sequence import SamplingParams

MODEL = "m"



def submitted(request_id: str, counted: Counted) -> Submission:
    """An engine request as the coordinator hands it to its observer (the metrics read its id and counts)."""
    return Submission(request_id, [3, 4, 5], SamplingParams(max_tokens=4), lambda output: None, counted)

def histogram(samples_ns: list[int]) -> LatencyHistogram:
    rec = HostLatencyRecorder()
    for ns in samples_ns:
        rec.record("dispatch", ns)
    return rec.snapshot()["dispatch"]


def exposition(stats: list[EPStats]) -> dict[str, dict]:
    """Families of one scrape of an EPCollector holding `stats`, by name, parsed as Prometheus would."""
    collector = EPCollector(MODEL)
    collector.snapshot = stats
    registry = CollectorRegistry()
    registry.register(collector)
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_latency_histograms_export_per_engine():
    d0, c0 = histogram([4_000, 12_000, 12_000, 3 * 10**9]), histogram([20_000])
    d1, c1 = histogram([60_000] * 5), LatencyHistogram.empty()
    stats = [EPStats(0, 3, dispatch_latency=d0, combine_latency=c0),
             EPStats(1, 3, dispatch_latency=d1, combine_latency=c1),
             EPStats(2, 3)]  # a rank without MoE layers: no series
    families = exposition(stats)
    for op, want in (("dispatch", {"0": d0, "1": d1}), ("combine", {"0": c0, "1": c1})):
        family = families[f"ep_layer:{op}_latency_seconds"]
        assert family.type == "histogram" and family.documentation.startswith(f"Latency of one {op} call")
        by_engine: dict[str, dict[str, dict]] = {}
        for s in family.samples:
            labels = dict(s.labels)
            engine, le = labels.pop("engine"), labels.pop("le", None)
            assert labels == {"model_name": MODEL}, s
            kind = s.name.removeprefix(f"ep_layer:{op}_latency_seconds")
            by_engine.setdefault(engine, {}).setdefault(kind, {})[le] = s.value
        assert set(by_engine) == set(want), op
        for engine, hist in want.items():
            got = by_engine[engine]
            assert [float(le) for le in got["_bucket"]] == [*BOUNDS_S, math.inf], (op, engine)
            assert list(got["_bucket"].values()) == [n for _, n in hist.cumulative()], (op, engine)
            assert got["_count"] == {None: hist.count} and got["_bucket"]["+Inf"] == hist.count
            assert got["_sum"][None] == pytest.approx(hist.sum_s)


def test_le_labels_as_prometheus_client_writes_them():
    """The bucket bounds read back exactly (le="5e-06", ..., "0.1", "+Inf"), so PromQL's le matching works."""
    text = generate_latest(_registry_with(EPStats(0, 1, dispatch_latency=LatencyHistogram.empty(),
                                                  combine_latency=LatencyHistogram.empty()))).decode()
    assert 'ep_layer:dispatch_latency_seconds_bucket{engine="0",le="5e-06",model_name="m"} 0.0' in text
    assert 'ep_layer:combine_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 0.0' in text
    assert 'ep_layer:combine_latency_seconds_count{engine="0",model_name="m"} 0.0' in text


def _registry_with(stats: EPStats) -> CollectorRegistry:
    collector = EPCollector(MODEL)
    collector.snapshot = [stats]
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


# ---------------------------------------------------------------------------- read out of a model
class TwoMoELayers(torch.nn.Module):
    """Named like the DeepSeek-V3 model (layers.{i}.mlp): MoE layers 1 and 2, sharing one Buffer or not."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        first = Buffer(None, low_latency_mode=True, backend="reference")
        buffers = [first, first if shared else Buffer(None, low_latency_mode=True, backend="reference")]
        self.layers = torch.nn.ModuleList([torch.nn.Identity()] + [torch.nn.ModuleDict({"mlp": FusedMoE(
            8, 2, 128, 64, None, n_group=1, topk_group=1, routed_scaling_factor=1.0, buffer=b)}) for b in buffers])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[1:]:
            x = x + layer["mlp"](x)
        return x


@pytest.mark.parametrize("shared", [True, False], ids=["one-buffer", "buffer-per-layer"])
def test_read_ep_stats_sums_the_model_buffers(shared: bool):
    model = TwoMoELayers(shared)
    steps = 3
    for _ in range(steps):
        model(torch.randn(5, 128).to(torch.bfloat16))
    stats = read_ep_stats(model, 0, 1, StepCounters({"decode": steps}, {"decode": 1.0}))
    assert sorted(stats.expert_load) == [1, 2]
    for op in OPS:
        hist = stats.dispatch_latency if op == "dispatch" else stats.combine_latency
        assert hist is not None and hist.count == 2 * steps, (op, hist)  # two MoE layers per forward
        assert hist.sum_s > 0
    again = pickle.loads(pickle.dumps(stats))  # how it travels from the rank to the server
    assert again == stats


def test_read_ep_stats_without_moe_layers_has_no_latency():
    stats = read_ep_stats(torch.nn.Linear(2, 2), 0, 1, None)
    assert stats.dispatch_latency is None and stats.combine_latency is None
    assert "ep_layer:dispatch_latency_seconds_bucket" not in generate_latest(_registry_with(stats)).decode()


def test_a_fresh_engine_exports_every_kind_of_step_at_zero():
    """Before its first step an engine's step counters are series at 0 (a query of their rate or sum has
    something to read), and a step counts under its kind."""
    from test_serving_engine import GREEDY, make_engine

    from serving.engine.engine import STEP_KINDS

    engine = make_engine(budget=16, max_num_seqs=8)
    steps = exposition([engine.ep_stats()])["ep_layer:engine_steps"]
    assert {s.labels["kind"]: s.value for s in steps.samples} == dict.fromkeys(STEP_KINDS, 0)
    engine.add_request("r", [3, 4, 5], GREEDY)
    engine.step()
    steps = exposition([engine.ep_stats()])["ep_layer:engine_steps"]
    assert {s.labels["kind"]: s.value for s in steps.samples} == {"prefill": 1, "decode": 0, "empty": 0}


def test_iteration_tokens_count_each_steps_prompt_tokens_and_samples() -> None:
    """vllm:iteration_tokens_total, as vLLM counts an iteration: the prompt tokens a step computes plus the tokens it
    samples. A 3-token prompt's step (3 + 1), two decodes (1 each), a 20-token prompt in a 16-token step (16 + 0)
    and its last 4 tokens (4 + 1); an empty step counts as a step but not here."""
    from test_serving_engine import make_engine

    from serving.engine.messages import ITERATION_TOKEN_BUCKETS
    from serving.engine.scheduler import ScheduledBatch
    from serving.engine.sequence import SamplingParams

    engine = make_engine(budget=16, max_num_seqs=8)
    engine.add_request("short", [3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.add_request("long", [3 + i % 7 for i in range(20)], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.execute(ScheduledBatch())
    family = exposition([engine.ep_stats()])["vllm:iteration_tokens_total"]
    samples = {(s.name.removeprefix("vllm:iteration_tokens_total"), s.labels.get("le")): s.value
               for s in family.samples}
    steps = [4, 1, 1, 16, 5]
    for bound in (*ITERATION_TOKEN_BUCKETS, math.inf):
        le = "+Inf" if bound == math.inf else str(float(bound))
        assert samples[("_bucket", le)] == sum(n <= bound for n in steps), bound
    assert (samples[("_count", None)], samples[("_sum", None)]) == (5, sum(steps))
    counts = {s.labels["kind"]: s.value for s in exposition([engine.ep_stats()])["ep_layer:engine_steps"].samples}
    assert counts == {"prefill": 3, "decode": 2, "empty": 1}


# ---------------------------------------------------------------------------- the vllm: series
def vllm_metric_definitions(version: str) -> tuple[dict[str, dict], dict[str, object]]:
    """vLLM's own metric definitions, read from its source (vllm/v1/metrics/loggers.py, through `ast`): by name,
    the documentation and the buckets as written (a list of numbers, a local list's name, or a call of
    build_1_2_5_buckets); and vLLM's bucket builders, run from that source."""
    import ast

    from engine_sources import source_dir

    path = source_dir("vllm", version) / "vllm" / "v1" / "metrics" / "loggers.py"
    tree = ast.parse(path.read_text())
    local_lists = {node.targets[0].id: ast.literal_eval(node.value) for node in ast.walk(tree)
                   if isinstance(node, ast.Assign) and isinstance(node.value, ast.List) and len(node.targets) == 1
                   and isinstance(node.targets[0], ast.Name) and all(isinstance(e, ast.Constant)
                                                                     for e in node.value.elts)}
    definitions = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        name = keywords.get("name")
        if not (isinstance(name, ast.Constant) and str(name.value).startswith("vllm:")):
            continue
        buckets = keywords.get("buckets")
        if isinstance(buckets, ast.List):
            buckets = ast.literal_eval(buckets)
        elif isinstance(buckets, ast.Name):
            buckets = local_lists[buckets.id]
        elif buckets is not None:
            buckets = ast.unparse(buckets)
        definitions[name.value] = {"documentation": ast.literal_eval(keywords["documentation"]), "buckets": buckets}
    builders: dict[str, object] = {}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name in ("build_buckets", "build_1_2_5_buckets")]
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(path), "exec"), builders)
    return definitions, builders


@pytest.mark.parametrize("max_model_len", [256, 163840])
def test_the_vllm_series_are_vllms_own_names_documentation_and_buckets(max_model_len: int) -> None:
    """Every vllm: series ServingMetrics exports is one of vLLM 0.20.0's, with its documentation and buckets: a
    dashboard or alert written for vLLM reads ours alike. The token-count buckets come from vLLM's own builder,
    run from its source, at the model's context length."""
    from serving.api.metrics import ServingMetrics

    definitions, builders = vllm_metric_definitions("0.20.0")
    metrics = ServingMetrics(MODEL, 1, max_model_len)
    metrics.ep.snapshot = [EPStats(0, 1, steps=StepCounters({"decode": 0}, {"decode": 0.0}))]
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    ours = {name: f for name, f in families.items() if name.startswith("vllm:")}
    assert len(ours) >= 18
    for name, family in ours.items():
        assert name in definitions, name
        want = definitions[name]
        assert family.documentation == want["documentation"], name
        if family.type != "histogram":
            continue
        bounds = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
        buckets = want["buckets"]
        if buckets == "build_1_2_5_buckets(max_model_len)":
            buckets = builders["build_1_2_5_buckets"](max_model_len)
        assert bounds == [*map(float, buckets), math.inf], name


def test_a_finished_requests_phases_and_counts() -> None:
    """vLLM's phases of a finished request, from the arrival, the engine's queue time and the tokens' arrivals:
    prefill (first scheduled to first token), decode (first to last token), inference (both), the mean time per
    output token after the first; its prompt and generated token counts and its max_tokens. A second choice of a
    prompt does not count the prompt again, an echo of the prompt alone counts no output, and a request aborted
    before its first token has no phases. A parent request's n and the most tokens one of its choices generated
    count once, when its last choice finishes. The ranks' cumulative preemption counts add up as they grow."""
    from serving.api.metrics import ServingMetrics
    from serving.engine.messages import RequestOutput, SchedulerStats

    metrics = ServingMetrics(MODEL, 1, 1024)

    def output(rid: str, tokens: int, finish: str | None = None, queue: float | None = None) -> RequestOutput:
        return RequestOutput(rid, [5] * tokens, "x" * tokens, 7, 0, finish_reason=finish, queue_time=queue)

    metrics.on_request(0, submitted("a", Counted(max_tokens=4, choices=2, parent="ab")), 100.0)
    sibling = Counted(prompt=False, max_tokens=4, choices=2, parent="ab")  # a's
    metrics.on_request(0, submitted("b", sibling), 100.0)
    metrics.on_output(0, output("a", 1, queue=0.25), 101.0)
    metrics.on_output(0, output("a", 2), 101.5)
    metrics.on_output(0, output("a", 1, "length"), 101.75)
    after_a = {(s.name, s.labels.get("le")): s.value
               for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}
    assert after_a[("vllm:request_params_n_count", None)] == 0  # b, a choice of the same request, still runs
    metrics.on_output(0, output("b", 1, "stop", queue=100.5), 201.0)
    metrics.on_request(0, submitted("c", Counted(output=False, max_tokens=1)), 300.0)  # an echo of its prompt alone
    metrics.on_output(0, output("c", 1, "length", queue=0.0), 300.5)
    metrics.on_request(0, submitted("d", Counted(max_tokens=5)), 400.0)
    metrics.on_output(0, output("d", 0, "abort"), 401.0)  # aborted while it waited
    for preemptions in (2, 2, 5):
        metrics.on_stats(0, SchedulerStats(num_preemptions=preemptions))
    values = {(s.name, s.labels.get("le")): s.value
              for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples}

    def observed(name: str) -> tuple[float, float]:
        return values[(f"vllm:{name}_count", None)], values[(f"vllm:{name}_sum", None)]

    assert observed("request_prompt_tokens") == (3, 21)  # a, c, d: 7 tokens each
    assert observed("request_generation_tokens") == (3, 4 + 1 + 0)  # a, b, d
    assert observed("request_prefill_time_seconds") == pytest.approx((2, 0.75 + 0.5))
    assert observed("request_decode_time_seconds") == pytest.approx((2, 0.75 + 0.0))
    assert observed("request_inference_time_seconds") == pytest.approx((2, 1.5 + 0.5))
    assert observed("request_time_per_output_token_seconds") == pytest.approx((2, 0.25 + 0.0))
    assert values[("vllm:num_preemptions_total", None)] == 5
    assert observed("request_params_max_tokens") == (4, 4 + 4 + 1 + 5)
    assert observed("request_params_n") == (3, 2 + 1 + 1)  # ab, c, d
    assert observed("request_max_num_generation_tokens") == (3, 4 + 0 + 0)


def test_prompt_tokens_by_source_and_the_prefill_that_was_computed() -> None:
    """A prompt's tokens by source once its first token came (computed, or found in the prefix cache, as its
    first output says), the cached ones counted again on their own, and at the end the tokens its prefill
    computed (vLLM's vllm/v1/metrics/stats.py PromptTokenStats and loggers.py). A second choice of a prompt does
    not count it again; a request aborted before its first token computed, as far as anyone knows, all of it.
    Waiting requests all wait for capacity."""
    from serving.api.metrics import ServingMetrics
    from serving.engine.messages import RequestOutput, SchedulerStats

    rng = random.Random(11)
    metrics = ServingMetrics(MODEL, 2, 1024)
    want_sources = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
    computed = []
    for i in range(12):
        rid, prompt = f"r{i}", rng.randint(1, 300)
        cached = rng.randrange(0, prompt, 16) if i % 3 else 0
        metrics.on_request(0, submitted(rid, Counted(max_tokens=4)), 0.0)
        if i == 11:  # aborted while it waited
            metrics.on_output(0, RequestOutput(rid, [], "", prompt, 0, finish_reason="abort"), 1.0)
            computed.append(prompt)
            continue
        metrics.on_output(0, RequestOutput(rid, [5], "x", prompt, 1, queue_time=0.1, num_cached_tokens=cached), 1.0)
        metrics.on_output(0, RequestOutput(rid, [5], "x", prompt, 2, finish_reason="length"), 2.0)
        want_sources["local_compute"] += prompt - cached
        want_sources["local_cache_hit"] += cached
        computed.append(prompt - cached)
        if i == 4:  # a second choice of the same prompt
            metrics.on_request(0, submitted(rid + "b", Counted(prompt=False, max_tokens=4)), 0.0)
            metrics.on_output(0, RequestOutput(rid + "b", [5], "x", prompt, 1, "stop", num_cached_tokens=prompt - 1),
                              1.0)
    metrics.on_stats(1, SchedulerStats(num_waiting=7))
    samples = [s for f in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in f.samples]
    by_source = {s.labels["source"]: s.value for s in samples
                 if s.name == "vllm:prompt_tokens_by_source_total" and s.labels["engine"] == "0"}
    assert by_source == want_sources
    cached_total = {s.labels["engine"]: s.value for s in samples if s.name == "vllm:prompt_tokens_cached_total"}
    assert cached_total == {"0": want_sources["local_cache_hit"], "1": 0}
    prompt_total = next(s.value for s in samples if s.name == "vllm:prompt_tokens_total" and s.labels["engine"] == "0")
    assert prompt_total == want_sources["local_compute"] + want_sources["local_cache_hit"]
    histogram = "vllm:request_prefill_kv_computed_tokens"
    kv = {s.name.rsplit("_", 1)[-1]: s.value for s in samples if s.labels.get("engine") == "0"
          and s.name in (f"{histogram}_count", f"{histogram}_sum")}
    assert kv == {"count": len(computed), "sum": sum(computed)}
    waiting = {(s.labels["engine"], s.labels["reason"]): s.value for s in samples
               if s.name == "vllm:num_requests_waiting_by_reason"}
    assert waiting == {("0", "capacity"): 0, ("0", "deferred"): 0, ("1", "capacity"): 7, ("1", "deferred"): 0}

"""SGLang 0.5.17's own DeepEP dispatcher drives the `deep_ep` drop-in (dropin/) on CPU ranks: nothing of SGLang is
re-written here.

SGLang's sources are those of its PyPI wheel (engine_sources.SGLANG_VERSION, fetched by `scripts/fetch_engines.py`
with the JIT kernel trees its imports check for). On two gloo ranks (tests/dist_harness.py), with the reference
backend, `sglang/srt/layers/moe/token_dispatcher/deepep.py`'s `DeepEPDispatcher` in `--deepep-mode low_latency`
(its `_DeepEPDispatcherImplLowLatency`, through `DeepEPBuffer`, which makes the one `deep_ep.Buffer` of the
process), bf16 and FP8 dispatch, with and without SGLang's receive hook: what `dispatch` returns exactly as DeepEP's
low-latency dispatch defines it, and `combine` of experts that scale their rows by (e + 1) / 8, bit-exact against
tests/test_deep_ep_dropin.py's oracle and within its tolerance of the float64 one; then SGLang's clean of the
low-latency buffer after a normal-mode step. The same file is also read as source: every deep_ep call in it, in
the branches the ranks do not take too (normal mode), binds to the drop-in (tests/deep_ep_calls.py).

What is stubbed, and nothing else (the dispatcher, its module and SGLang's other code run as shipped):
- **Triton** (`import triton`, sglang/srt/utils/common.py:87, on every import of SGLang): SGLang's own placeholder
  for machines without it, `sglang/_triton_stub.py` (which `sglang/__init__.py` installs on macOS only), loaded
  from its file. torch's inductor is imported first, so that it sees no Triton: SGLang's import runs
  `@torch.compile` (sglang/srt/layers/moe/moe_runner/deep_gemm.py:80), which imports inductor modules that build
  on Triton's classes when `import triton` succeeds (torch/_inductor/runtime/triton_heuristics.py).
- **torchvision and xgrammar**, compiled packages that SGLang's imports name and the dispatcher never calls:
  placeholder modules whose every name is another placeholder, which raises when called.
  torchvision: `decode_jpeg` (sglang/srt/utils/common.py:94), `transforms` and `InterpolationMode`
  (sglang/srt/multimodal/internvl_utils.py:5,7, via sglang/srt/configs/__init__.py:35); PyPI's torchvision is a
  CUDA build pinned to its torch. xgrammar (a 45 MB binary that requires Triton), via
  sglang/srt/server_args.py:52: `StructuralTag` (sglang/srt/function_call/inkling_detector.py:6 and others) is
  `typing.Any`, SGLang's own fallback without xgrammar (sglang/srt/entrypoints/openai/protocol.py:57-60).
  transformers is imported before them, so that its cached check finds no torchvision.
- **transformers' own `qwen3_asr` config** is dropped from its registry before the import: SGLang pins
  transformers 5.12.1, which has none, and registers its own (sglang/srt/configs/qwen3_asr.py:167, without
  exist_ok, via sglang/srt/configs/__init__.py:47); the test extra's transformers 5.24.0 has one.
- **Server arguments**: SGLang's `ServerArgs` of `--moe-a2a-backend deepep --deepep-mode low_latency`, every other
  field at its default (`model_path`, which has none, None), published the way SGLang's scheduler publishes them
  (`set_global_server_args_for_scheduler`, `initialize_moe_config`); made without `ServerArgs.__post_init__`
  (sglang/srt/server_args.py:3435), which resolves a model checkpoint and the GPU. The dispatcher reads them through
  `get_deepep_output_dtype`, `get_deepep_config` and `is_tbo_enabled` (sglang/srt/layers/moe/utils.py). bf16 is
  chosen as SGLang's unquantized method chooses it, `set_quant_config({"dispatcher_output_dtype": "bf16"})`
  (sglang/srt/layers/quantization/unquant.py:415); FP8 is the default.
- **Parallel state**: none; SGLang hands the dispatcher `get_tp_group().device_group`, here the ranks' gloo group.
- **One torch query** that raises on CPU torch: `torch.cuda.get_device_properties("cuda").multi_processor_count`
  (deepep.py:250, only to warn about a small SM share outside low-latency mode) answers an H100's 132.

What blocks the rest (normal mode and UE8M0 scales, so far checked by signature only):
- **Normal mode**: `_DeepEPDispatcherImplNormal.combine_a` raises NotImplementedError unless DeepGEMM (or ROCm's
  aiter, or an NPU) runs the experts (deepep.py:615-618: "triton runner ... temporarily disabled"), and
  `deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM` is SGLang's hardware detection, False without CUDA of SM90 or later and
  an importable `deep_gemm` (sglang/srt/layers/deep_gemm_wrapper/configurer.py:17-35), so a CPU rank cannot reach
  normal mode's combine without faking that detection, which the stubs above stop short of. (Tried by hand: with
  the flag set to True, bf16 normal-mode dispatch and combine ran on two CPU ranks and matched the float64 oracle;
  FP8 would also need a shim of the JIT kernel `sglang_per_token_group_quant_fp8`, deepep.py:511-519.)
- **UE8M0 scales** (`round_scale`, `use_ue8m0`) are dispatched only with DeepGEMM on Blackwell (deepep.py:737-742;
  `DEEPGEMM_BLACKWELL`, configurer.py:37: the same detection).
tests/test_deep_ep_dropin.py keeps replaying SGLang's DeepEP call sequences (normal, auto mode, UE8M0, two-batch
overlap, CUDA graphs) on CPU ranks and GPUs, as re-written there.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import typing
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from deep_ep_calls import check_calls
from dist_harness import run_ranks
from engine_sources import SGLANG_VERSION, source_dir
from test_deep_ep_dropin import (
    check_combine,
    check_dense,
    check_dispatch,
    draw,
    draw_counts,
    expert_factors,
    expert_outputs,
    for_parent,
    label,
    local_experts,
)

DISPATCHER = "sglang/srt/layers/moe/token_dispatcher/deepep.py"
RECEIVERS = {"Buffer", "buffer", "state.buffer"}  # how deepep.py names deep_ep's Buffer class and its instances
# What SGLang's dispatcher calls; the test fails if the file no longer makes one of these calls.
EXPECTED = {"Buffer", "Config", "get_dispatch_config", "get_combine_config", "get_low_latency_rdma_size_hint",
            "clean_low_latency_buffer", "capture", "get_dispatch_layout", "dispatch", "combine",
            "low_latency_dispatch", "low_latency_combine"}
# Keywords SGLang passes through **dict(...) only on other hardware, which the drop-in never sees on CUDA. (Those
# of DeepEP forks' NVFP4 dispatch it refuses by name; their single-batch overlap it serves.)
ELSEWHERE = {"topk_weights": "Ascend NPU's low_latency_dispatch (_is_npu)",
             "use_fabric": "hybrid-ep's MNNVL fabric (CUDA 13 on GB200/GB300)"}

# DeepSeek-V3's hidden size (one the low-latency kernels take); 16 experts, top-8, as in test_deep_ep_dropin.py's
# SGLang replay. T: SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK's default, which the dispatcher reads.
H, E, K, T = 2048, 16, 8, 128
MAX_BATCH = 24  # decode tokens per rank at most
# Placeholder packages (module docstring) and the names in them that must be more than a placeholder.
PLACEHOLDERS: dict[str, dict[str, Any]] = {"torchvision": {}, "xgrammar": {"StructuralTag": typing.Any}}


# ============================================================================================ SGLang, imported
class Placeholder(ModuleType):
    """A module of a package SGLang's imports name and the dispatcher never runs: every name in it is another
    placeholder, and calling one raises."""

    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        child = Placeholder(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{self.__name__} is a placeholder (tests/test_dropin_sglang.py)")


class PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports PLACEHOLDERS' packages, and any module in them, as Placeholders."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in PLACEHOLDERS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return Placeholder(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__.update(PLACEHOLDERS.get(module.__name__, {}))


def use_sglang() -> SimpleNamespace:
    """Import SGLang's DeepEP dispatcher from its cached sources, with the stubs of the module docstring; returns
    the modules the tests use. Once per rank process: the stubs stay in it."""
    path = source_dir("sglang", SGLANG_VERSION)
    sys.path.insert(0, str(path))
    import torch._inductor.compile_fx  # before Triton's placeholder, so that inductor sees no Triton
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # (before torchvision's placeholder)

    CONFIG_MAPPING._mapping.pop("qwen3_asr", None)
    spec = importlib.util.spec_from_file_location("sglang_triton_stub", path / "sglang" / "_triton_stub.py")
    assert spec is not None and spec.loader is not None
    triton_stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(triton_stub)
    triton_stub.install()
    sys.meta_path.insert(0, PlaceholderFinder())
    if not torch.cuda.is_available():
        torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(multi_processor_count=132)
    names = {"deepep": "sglang.srt.layers.moe.token_dispatcher.deepep", "moe_utils": "sglang.srt.layers.moe.utils",
             "server_args": "sglang.srt.server_args", "topk": "sglang.srt.layers.moe.topk"}
    return SimpleNamespace(**{key: importlib.import_module(name) for key, name in names.items()})


def publish_server_args(sgl: SimpleNamespace, deepep_mode: str) -> None:
    """`--moe-a2a-backend deepep --deepep-mode <deepep_mode>`, every other argument at ServerArgs' default,
    published as SGLang's scheduler publishes them."""
    server_args = sgl.server_args
    args = server_args.ServerArgs.__new__(server_args.ServerArgs)  # without __post_init__ (module docstring)
    for field in dataclasses.fields(server_args.ServerArgs):
        if field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = None
        setattr(args, field.name, value)
    args.moe_a2a_backend, args.deepep_mode = "deepep", deepep_mode
    server_args.set_global_server_args_for_scheduler(args)
    sgl.moe_utils.initialize_moe_config(args)


# ============================================================================================ low latency
def ll_step(sgl: SimpleNamespace, dispatcher: Any, every: list, rank: int, mode: str, where: str) -> None:
    """One MoE layer's `dispatch` and `combine` through the dispatcher: what the experts receive, exactly; the
    combined tokens bit-exact against the oracle and within tolerance of the float64 one."""
    world, tokens = len(every), every[rank]
    topk = sgl.topk.StandardTopKOutput(topk_weights=tokens.w.clone(), topk_ids=tokens.idx.clone(), router_logits=None)
    out = dispatcher.dispatch(tokens.x.clone(), topk)
    assert isinstance(out, sgl.deepep.DeepEPLLDispatchOutput), type(out)
    recv = out.hidden_states if mode == "bf16" else (out.hidden_states, out.hidden_states_scale)
    assert (out.hidden_states_scale is None) == (mode == "bf16"), where
    check_dispatch(recv, out.masked_m, every, rank, T, E, mode, where)
    expert_out = expert_outputs(recv, expert_factors(local_experts(rank, E // world), "cpu"))
    combined = dispatcher.combine(sgl.deepep.DeepEPLLCombineInput(expert_out, out.topk_ids, out.topk_weights))
    check_combine(combined, tokens, mode, where)
    check_dense(for_parent(combined), tokens, mode, where)


def rank_sglang_ll(rank: int, world: int, seed: int) -> dict[str, int]:
    """`--moe-a2a-backend deepep --deepep-mode low_latency`: per dispatch format and receive-hook setting a
    DeepEPDispatcher (one per MoE layer in SGLang) over the process's one Buffer; decode steps (idle ranks too),
    then a step after a normal-mode one, which cleans the low-latency buffer first. Returns the steps run per
    format."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the reference backend, on a GPU machine too (CPU tensors)
    import deep_ep

    sgl = use_sglang()
    publish_server_args(sgl, "low_latency")
    group = dist.new_group(list(range(world)), backend="gloo")
    deepep = sgl.deepep
    steps: dict[str, int] = {}
    for mode in ("bf16", "fp8"):
        for hook in (False, True):
            dispatcher = deepep.DeepEPDispatcher(
                group=group, router_topk=K, permute_fusion=True, num_experts=E, num_local_experts=E // world,
                hidden_size=H, params_dtype=torch.bfloat16, deepep_mode=sgl.moe_utils.DeepEPMode.LOW_LATENCY,
                async_finish=True, return_recv_hook=hook)
            if mode == "bf16":
                dispatcher.set_quant_config({"dispatcher_output_dtype": "bf16"})
            for step in range(2):
                tag = ("sglang-ll", mode, hook, step)
                counts = draw_counts(seed, tag, world, 0, MAX_BATCH)
                ll_step(sgl, dispatcher, draw(seed, tag, counts, H, E, K), rank, mode,
                        label(seed, rank, mode, f"hook={hook}", f"step {step} counts {counts}"))
                steps[mode] = steps.get(mode, 0) + 1
    buffer = deepep.DeepEPBuffer._state().buffer
    assert isinstance(buffer, deep_ep.Buffer) and buffer.backend_name == "reference"
    assert (buffer.group, buffer.group_size, buffer.rank, buffer.low_latency_mode) == (group, world, rank, True)
    assert buffer.num_rdma_bytes == deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    cleans = []
    clean = buffer.clean_low_latency_buffer
    buffer.clean_low_latency_buffer = lambda *args, **kwargs: (cleans.append(args), clean(*args, **kwargs))
    deepep.DeepEPBuffer.set_dispatch_mode_as_normal()  # a prefill ran in normal mode (auto mode's switch)
    counts = draw_counts(seed, ("sglang-ll-clean",), world, 0, MAX_BATCH)
    ll_step(sgl, dispatcher, draw(seed, ("sglang-ll-clean",), counts, H, E, K), rank, "fp8",
            label(seed, rank, "fp8", "after a normal-mode step", f"counts {counts}"))
    assert cleans == [(T, H, E)], cleans
    assert deepep.DeepEPBuffer._state().buffer is buffer, "one Buffer per process"
    return steps


def test_sglang_deepep_low_latency(seed: int) -> None:
    """SGLang's low-latency DeepEP dispatcher end to end on our Buffer: bf16 and FP8 dispatch, with and without
    the receive hook, and the clean after a normal-mode step."""
    source_dir("sglang", SGLANG_VERSION)  # fetched here once, so that the ranks find it cached
    results = run_ranks(rank_sglang_ll, 2, seed, timeout_s=300)
    assert results == [{"bf16": 4, "fp8": 4}] * 2, results


def test_sglang_deepep_calls_bind_to_the_drop_in() -> None:
    """Each call SGLang's DeepEP dispatcher makes on deep_ep.Buffer / Config binds to the drop-in's signature:
    its positional arguments, its keywords, and the keys of its **dict(...) arguments (unless the drop-in refuses
    them by name as DeepEP forks' keywords, or they are ELSEWHERE's other-hardware keywords)."""
    path = source_dir("sglang", SGLANG_VERSION) / DISPATCHER
    seen = check_calls(path, f"sglang {SGLANG_VERSION} {DISPATCHER}", RECEIVERS, {"Buffer", "Config"}, ELSEWHERE)
    assert seen >= EXPECTED, f"{DISPATCHER} no longer calls {sorted(EXPECTED - seen)}: has it moved?"

"""SGLang 0.5.17's own DeepEP dispatcher drives the `deep_ep` drop-in (dropin/) on CPU ranks: nothing of SGLang is
re-written here.

SGLang's sources are those of its PyPI wheel (engine_sources.SGLANG_VERSION, fetched by `scripts/fetch_engines.py`
with the JIT kernel trees its imports check for). On two gloo ranks (tests/dist_harness.py), with the reference
backend, `sglang/srt/layers/moe/token_dispatcher/deepep.py`'s `DeepEPDispatcher` (through `DeepEPBuffer`, which
makes the one `deep_ep.Buffer` of the process):
- `--deepep-mode low_latency` (its `_DeepEPDispatcherImplLowLatency`), bf16 and FP8 dispatch, with and without
  SGLang's receive hook: what `dispatch` returns exactly as DeepEP's low-latency dispatch defines it, and
  `combine` of experts that scale their rows by (e + 1) / 8, bit-exact against tests/test_deep_ep_dropin.py's
  oracle and within its tolerance of the float64 one; then SGLang's clean of the low-latency buffer after a
  normal-mode step.
- `--deepep-mode normal` (its `_DeepEPDispatcherImplNormal`) as on Hopper with DeepGEMM, bf16 and FP8 dispatch of
  prefill batches (idle ranks too), two layers each: what `dispatch` hands the experts, exactly
  (test_deep_ep_dropin.py's check_normal_dispatch: each token that picked one of the rank's experts once, by source
  rank then token, its rows or FP8 codes and scales as sent, ids made local, weights, and per local expert the
  count rounded up to DeepGEMM's expert_alignment of 128, deepep.py:590); the experts as DeepGEMM's contiguous
  layout runs them (sglang_normal_experts: ep_scatter into 128-aligned segments per expert, scaling, ep_gather's
  weighted sum per received row, sglang/srt/layers/moe/moe_runner/deep_gemm.py:1031-1155); `combine` bit-exact
  against DeepEP's normal combine of those rows (float32 sum over ranks, one bf16 rounding) and within tolerance
  of the float64 oracle.
- `--deepep-mode auto` (FP8): prefill batches in normal mode and decode batches in low-latency mode over one
  Buffer, as `DeepEPDispatcher._get_impl` resolves it (deepep.py:980-988) from `set_is_extend_in_batch`, which
  SGLang's ForwardBatch calls (sglang/srt/model_executor/forward_batch_info.py:1315); each step checked as above,
  and one clean of the low-latency buffer per switch from prefill to decode.
The same file is also read as source: every deep_ep call in it binds to the drop-in (tests/deep_ep_calls.py).

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
- **Server arguments**: SGLang's `ServerArgs` of `--moe-a2a-backend deepep --deepep-mode <mode>`, every other
  field at its default (`model_path`, which has none, None), published the way SGLang's scheduler publishes them
  (`set_global_server_args_for_scheduler`, `initialize_moe_config`); made without `ServerArgs.__post_init__`
  (sglang/srt/server_args.py:3435), which resolves a model checkpoint and the GPU. The dispatcher reads them through
  `get_deepep_output_dtype`, `get_deepep_config` and `is_tbo_enabled` (sglang/srt/layers/moe/utils.py). bf16 is
  chosen as SGLang's unquantized method chooses it, `set_quant_config({"dispatcher_output_dtype": "bf16"})`
  (sglang/srt/layers/quantization/unquant.py:415); FP8 is the default.
- **Parallel state**: none; SGLang hands the dispatcher `get_tp_group().device_group`, here the ranks' gloo group.
- **One torch query** that raises on CPU torch: `torch.cuda.get_device_properties("cuda").multi_processor_count`
  (deepep.py:250, only to warn about a small SM share outside low-latency mode) answers an H100's 132.
- **Hardware detection of DeepGEMM** (normal and auto mode only, `detect_hopper_deepgemm`): normal mode's
  `combine_a` raises NotImplementedError unless DeepGEMM (or ROCm's aiter, or an NPU) runs the experts
  (deepep.py:615-618: "triton runner ... temporarily disabled"), and SGLang detects DeepGEMM at import, from the
  GPU: `ENABLE_JIT_DEEPGEMM` is True on CUDA of SM90 or later (not SM120) with an importable `deep_gemm` and
  SGLANG_ENABLE_JIT_DEEPGEMM at its default (sglang/srt/layers/deep_gemm_wrapper/configurer.py:17-35), and
  `DEEPGEMM_BLACKWELL`, `DEEPGEMM_SCALE_UE8M0` and `DEEPGEMM_NEED_TMA_ALIGNED_SCALES` follow from it and SM100
  (configurer.py:37-39). They are set to what an H100 with deep_gemm gives (True, False, False, True) in
  configurer.py and where the package re-exports them (deep_gemm_wrapper/entrypoint.py:9-14 and
  deep_gemm_wrapper/__init__.py:1, which deepep.py reads as `deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM`), after SGLang's
  import: no DeepGEMM kernel is run or imported (the experts are the test's). With them, normal mode's FP8 dispatch
  casts on the sender (deepep.py:511-519) through `sglang_per_token_group_quant_fp8` (sglang/kernels/ops/
  quantization/fp8_kernel.py:600-652, run as shipped), whose kernel is the JIT CUDA op `per_token_group_quant`
  that fp8_kernel.py imports on CUDA only (fp8_kernel.py:58-61, called at :589): `per_token_group_quant` here, in
  plain torch, per token and 128 columns `scale = max(amax, 1e-10) / 448`, codes `clamp(x / scale)` in e4m3. (The
  CUDA kernel multiplies by 448 / amax in fast math instead, sglang/kernels/jit/csrc/gemm/
  per_token_group_quant.cuh:281-312, which may differ in a last bit; the plain-torch form is tests/fp8_oracle.py's
  cast, which the test checks the dispatched codes and scales against.)

What is not covered: **UE8M0 scales** (`round_scale`, `use_ue8m0` in low-latency mode, deepep.py:737-742; the
packed column-major scales of normal mode's cast, deepep.py:516-518) come only with DeepGEMM on Blackwell
(`DEEPGEMM_BLACKWELL`, configurer.py:37), and the shim covers Hopper's float32 scales only.
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
    as_made,
    check_combine,
    check_dense,
    check_dispatch,
    check_normal_dispatch,
    draw,
    draw_counts,
    expert_factors,
    expert_outputs,
    for_parent,
    fp8_columns,
    label,
    local_experts,
    sglang_normal_experts,
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
PREFILL_MAX = 160  # prefill tokens per rank at most (normal mode): more than the low-latency buffer's T holds
ALIGNMENT = 128  # the expert_alignment SGLang's normal dispatch asks for with DeepGEMM (deepep.py:590)
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
             "server_args": "sglang.srt.server_args", "topk": "sglang.srt.layers.moe.topk",
             "dp_attention": "sglang.srt.layers.dp_attention"}
    return SimpleNamespace(**{key: importlib.import_module(name) for key, name in names.items()})


def per_token_group_quant(input: torch.Tensor, output_q: torch.Tensor, output_s: torch.Tensor, group_size: int,
                          scale_ue8m0: bool = False, fuse_silu_and_mul: bool = False,
                          masked_m: torch.Tensor | None = None) -> None:
    """SGLang's JIT CUDA op `per_token_group_quant` (module docstring) in plain torch, as fp8_kernel.py calls it
    for a Hopper DeepGEMM dispatch: per token and group of `group_size` columns, `scale = max(amax, 1e-10) / 448`
    into float32 `output_s`, codes `clamp(x / scale, -448, 448)` in e4m3 into `output_q`."""
    assert not (scale_ue8m0 or fuse_silu_and_mul) and masked_m is None, "only Hopper's DeepGEMM dispatch cast"
    assert output_q.dtype == torch.float8_e4m3fn and output_s.dtype == torch.float32, (output_q.dtype, output_s.dtype)
    groups = input.float().unflatten(-1, (-1, group_size))
    amax = groups.abs().amax(dim=-1).clamp(min=1e-10)
    scale = amax / torch.full_like(amax, 448.0)  # by a tensor: a CUDA tensor by a number divides by its reciprocal
    output_q.copy_((groups / scale.unsqueeze(-1)).clamp(-448.0, 448.0).flatten(-2).to(torch.float8_e4m3fn))
    output_s.copy_(scale)


def detect_hopper_deepgemm() -> None:
    """SGLang's DeepGEMM detection as it comes out on an H100 with deep_gemm installed (module docstring):
    configurer.py's flags, wherever the package re-exports them, and the quant op fp8_kernel.py imports on CUDA."""
    fp8_kernel = importlib.import_module("sglang.kernels.ops.quantization.fp8_kernel")
    assert not hasattr(fp8_kernel, "per_token_group_quant"), "imported only on CUDA: has SGLang changed?"
    fp8_kernel.per_token_group_quant = per_token_group_quant
    hopper = {"ENABLE_JIT_DEEPGEMM": True, "DEEPGEMM_BLACKWELL": False, "DEEPGEMM_SCALE_UE8M0": False,
              "DEEPGEMM_NEED_TMA_ALIGNED_SCALES": True}
    for name in ("configurer", "entrypoint", ""):
        module = importlib.import_module("sglang.srt.layers.deep_gemm_wrapper" + (f".{name}" if name else ""))
        for flag, value in hopper.items():
            assert hasattr(module, flag), f"{module.__name__} has no {flag}: has SGLang changed?"
            setattr(module, flag, value)


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


# ============================================================================================ normal and auto mode
def normal_combine_oracle(every: list, sent: list, rank: int, world: int) -> torch.Tensor:
    """`rank`'s combined tokens, exactly: each rank d receives, by source rank then token, the tokens that picked
    one of its experts (check_normal_dispatch's routing, computed here from the draws); its experts
    (sglang_normal_experts) turn them into one bf16 row each; token t gets the float32 sum of its rows over d
    ascending, rounded once to bf16 (DeepEP's normal combine, docs/design.md section 2)."""
    num_local = E // world
    acc = torch.zeros(every[rank].x.shape[0], H, dtype=torch.float32)
    for d in range(world):
        lo = d * num_local
        picked = [((t.idx >= lo) & (t.idx < lo + num_local)).any(dim=1).nonzero().flatten() for t in every]
        columns = [torch.cat([(x if isinstance(x, tuple) else (x,))[c][p] for x, p in zip(sent, picked)])
                   for c in range(2 if isinstance(sent[0], tuple) else 1)]
        ids = torch.cat([t.idx[p] for t, p in zip(every, picked)])
        local = (ids >= lo) & (ids < lo + num_local)
        counts = torch.bincount(ids[local] - lo, minlength=num_local).tolist()
        received = SimpleNamespace(
            hidden_states=columns[0], hidden_states_scale=columns[1] if len(columns) == 2 else None,
            topk_ids=torch.where(local, ids - lo, -1),
            topk_weights=torch.where(local, torch.cat([t.w[p] for t, p in zip(every, picked)]), 0.0),
            num_recv_tokens_per_expert=[-(-c // ALIGNMENT) * ALIGNMENT for c in counts])
        y = sglang_normal_experts(received, expert_factors(local_experts(d, num_local), "cpu"), ALIGNMENT)
        start = sum(p.numel() for p in picked[:rank])
        acc[picked[rank]] += y[start:start + picked[rank].numel()].float()
    return acc.to(torch.bfloat16)


def normal_step(sgl: SimpleNamespace, dispatcher: Any, every: list, rank: int, mode: str, where: str) -> None:
    """One prefill MoE layer's `dispatch` and `combine` in normal mode: what the experts receive, exactly (rows as
    sent, local ids and weights, per-expert counts rounded up to DeepGEMM's 128); the experts as DeepGEMM's
    contiguous layout runs them; the combined tokens bit-exact against normal_combine_oracle and within
    tolerance of the float64 one."""
    world, tokens = len(every), as_made(every[rank])
    topk = sgl.topk.StandardTopKOutput(topk_weights=tokens.w, topk_ids=tokens.idx.to(torch.int32),
                                       router_logits=None)  # select_experts' int32 ids
    out = dispatcher.dispatch(tokens.x, topk)
    assert isinstance(out, sgl.deepep.DeepEPNormalDispatchOutput), type(out)
    assert (out.hidden_states_scale is None) == (mode == "bf16"), where
    # What each rank hands dispatch: its bf16 rows, or (e4m3, float32 scales [n, H/128]) from SGLang's
    # sglang_per_token_group_quant_fp8, here tests/fp8_oracle.py's cast of them (the shim must match it).
    sent = [t.x if mode == "bf16" else fp8_columns(t.x, mode) for t in every]
    recv = out.hidden_states if mode == "bf16" else (out.hidden_states, out.hidden_states_scale)
    check_normal_dispatch(recv, out.topk_ids, out.topk_weights, out.num_recv_tokens_per_expert, sent, every, rank,
                          E, ALIGNMENT, where)
    expert_out = sglang_normal_experts(out, expert_factors(local_experts(rank, E // world), "cpu"), ALIGNMENT)
    combined = dispatcher.combine(sgl.deepep.DeepEPNormalCombineInput(expert_out, out.topk_ids, out.topk_weights))
    want = normal_combine_oracle(every, sent, rank, world)
    assert combined.dtype == torch.bfloat16 and combined.shape == want.shape, f"{where}: {combined.dtype} " \
        f"{list(combined.shape)}"
    differ = (combined.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert not differ.numel(), f"{where}: combine differs at {differ[0].tolist()} ({differ.shape[0]} entries)"
    check_dense(for_parent(combined), tokens, mode, where)


def sglang_dispatcher(sgl: SimpleNamespace, group: Any, deepep_mode: str, mode: str) -> Any:
    """One MoE layer's DeepEPDispatcher as SGLang's FusedMoE makes it (fused_moe_triton/layer.py:157-168), its
    dispatch bf16 as SGLang's unquantized method asks for it, or FP8 (the default)."""
    world = dist.get_world_size()
    dispatcher = sgl.deepep.DeepEPDispatcher(
        group=group, router_topk=K, permute_fusion=True, num_experts=E, num_local_experts=E // world,
        hidden_size=H, params_dtype=torch.bfloat16, deepep_mode=sgl.moe_utils.DeepEPMode(deepep_mode),
        async_finish=True, return_recv_hook=True)
    if mode == "bf16":
        dispatcher.set_quant_config({"dispatcher_output_dtype": "bf16"})
    return dispatcher


def rank_sglang_normal(rank: int, world: int, seed: int) -> dict[str, int]:
    """`--moe-a2a-backend deepep --deepep-mode normal` on Hopper with DeepGEMM: per dispatch format two MoE layers
    (a DeepEPDispatcher each) over the process's one Buffer, prefill steps (idle ranks too). Returns the steps
    run per format."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the reference backend, on a GPU machine too (CPU tensors)
    import deep_ep

    sgl = use_sglang()
    publish_server_args(sgl, "normal")
    detect_hopper_deepgemm()
    group = dist.new_group(list(range(world)), backend="gloo")
    steps: dict[str, int] = {}
    for mode in ("bf16", "fp8"):
        layers = [sglang_dispatcher(sgl, group, "normal", mode) for _ in range(2)]
        for step in range(2):
            for li, dispatcher in enumerate(layers):
                tag = ("sglang-normal", mode, step, li)
                counts = draw_counts(seed, tag, world, 0, PREFILL_MAX)
                normal_step(sgl, dispatcher, draw(seed, tag, counts, H, E, K), rank, mode,
                            label(seed, rank, mode, f"step {step} layer {li} counts {counts}"))
                steps[mode] = steps.get(mode, 0) + 1
    buffer = sgl.deepep.DeepEPBuffer._state().buffer
    assert isinstance(buffer, deep_ep.Buffer) and buffer.backend_name == "reference"
    hidden_bytes = H * 2  # the dispatcher's params_bytes (deepep.py:375), FP8 dispatch too
    nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, world)
              for config in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)))
    assert (buffer.group, buffer.low_latency_mode, buffer.num_nvl_bytes, buffer.num_rdma_bytes) == \
        (group, False, nvl, 0)
    return steps


AUTO_STEPS = ("prefill", "decode", "decode", "prefill", "decode")


def count_cleans(buffer: Any, cleans: list[tuple]) -> None:
    """Record the arguments of each clean_low_latency_buffer call on `buffer` in `cleans` (and clean)."""
    clean = buffer.clean_low_latency_buffer
    buffer.clean_low_latency_buffer = lambda *args, **kwargs: (cleans.append(args), clean(*args, **kwargs))


def rank_sglang_auto(rank: int, world: int, seed: int) -> int:
    """`--deepep-mode auto` (FP8 dispatch) on Hopper with DeepGEMM: batches with extend (prefill) tokens dispatch
    in normal mode, decode batches in low-latency mode, as DeepEPDispatcher._get_impl resolves it from
    get_is_extend_in_batch (set as SGLang's ForwardBatch sets it, forward_batch_info.py:1315); one Buffer for
    both, and the first low-latency dispatch after a normal one cleans the low-latency buffer. Returns the
    cleans."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import deep_ep

    sgl = use_sglang()
    publish_server_args(sgl, "auto")
    detect_hopper_deepgemm()
    group = dist.new_group(list(range(world)), backend="gloo")
    layers = [sglang_dispatcher(sgl, group, "auto", "fp8") for _ in range(2)]
    cleans: list[tuple] = []
    for step, kind in enumerate(AUTO_STEPS):
        sgl.dp_attention.set_is_extend_in_batch(kind == "prefill")
        for li, dispatcher in enumerate(layers):
            tag = ("sglang-auto", step, li)
            counts = draw_counts(seed, tag, world, 0, PREFILL_MAX if kind == "prefill" else MAX_BATCH)
            where = label(seed, rank, "fp8", f"auto step {step} ({kind}) layer {li} counts {counts}")
            run = normal_step if kind == "prefill" else ll_step
            run(sgl, dispatcher, draw(seed, tag, counts, H, E, K), rank, "fp8", where)
        if step == 0:  # the first dispatch made the Buffer: count its cleans from here on
            buffer = sgl.deepep.DeepEPBuffer._state().buffer
            count_cleans(buffer, cleans)
    assert isinstance(buffer, deep_ep.Buffer) and buffer.backend_name == "reference"
    assert sgl.deepep.DeepEPBuffer._state().buffer is buffer, "one Buffer per process"
    nvl = max(config.get_nvl_buffer_size_hint(H * 2, world)
              for config in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)))
    assert (buffer.low_latency_mode, buffer.num_nvl_bytes, buffer.num_rdma_bytes) == \
        (True, nvl, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E))
    assert all(args == (T, H, E) for args in cleans), cleans
    return len(cleans)


def test_sglang_deepep_normal(seed: int) -> None:
    """SGLang's normal-mode DeepEP dispatcher end to end on our Buffer, as on Hopper with DeepGEMM: bf16 and FP8
    dispatch of prefill batches, two layers each."""
    source_dir("sglang", SGLANG_VERSION)
    results = run_ranks(rank_sglang_normal, 2, seed, timeout_s=300)
    assert results == [{"bf16": 4, "fp8": 4}] * 2, results


def test_sglang_deepep_auto(seed: int) -> None:
    """SGLang's auto mode: prefill in normal mode, decode in low-latency mode, over one Buffer; one clean of the
    low-latency buffer per switch from prefill to decode (the first layer's)."""
    source_dir("sglang", SGLANG_VERSION)
    results = run_ranks(rank_sglang_auto, 2, seed, timeout_s=300)
    assert results == [2, 2], results


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

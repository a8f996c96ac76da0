"""vLLM's own Python sources, imported in a test rank (CPU torch, or a GPU), to drive the `deep_ep` drop-in; and
where the engines' sources live.

The sources come from the engines' PyPI wheels (`scripts/fetch_engines.py`, a cache outside the repo; fetched
here on first use when missing): `source_dir(name, version)`. `use_vllm(version)` puts one vLLM release on
sys.path and imports it; each rank process imports one release only. (SGLang's importer, with its own stubs, is
tests/test_dropin_sglang.py's `use_sglang`.)

What is stubbed, and nothing else (the classes under test, their modules and vLLM's other code run as shipped):
- **vLLM's parallel state** (`vllm.distributed.parallel_state._DP`, `_TP`, `_EP`, `_PCP`): a `GroupStub` per
  group, holding the rank's gloo group, its rank and size, and for the EP group the all2all manager under test
  (`device_communicator.all2all_manager`). vLLM builds these GroupCoordinators in `initialize_model_parallel`
  from a whole engine configuration with device communicators (NCCL, custom all-reduce), which a CPU rank has
  none of; the all2all managers read only the ranks and sizes of these groups.
- **Compiled ops** that the path calls and that live in vLLM's CUDA extensions (`vllm._C`, `vllm._moe_C`, not in
  the wheel's Python): `torch.ops._C.silu_and_mul` and `torch.ops._moe_C.moe_sum`, registered in plain torch for
  CPU and CUDA tensors; and the Triton kernels `_per_token_group_quant_fp8` and
  `_per_token_group_quant_fp8_colmajor` of `vllm.model_executor.layers.quantization.utils.fp8_utils` (no Triton
  on CPU; replaced on a GPU too, so that both run the same math) by a plain-torch launcher of their math: per
  token and group, `scale = max(amax, eps) / fp8_max` (a power of two above it for UE8M0), codes
  `clamp(x / scale)`; with Triton's `next_power_of_2` (the wrapper sizes its launch with it) on vLLM's Triton
  placeholder. Their Python wrapper (`per_token_group_quant_fp8`: allocation, layout, scale format) runs as
  shipped.
- **Three torch queries that raise on a machine without an accelerator** instead of answering (torch 2.13's CPU
  build), on such a machine only: `torch.accelerator.empty_cache` does nothing, as its docstring says it does
  when no allocator is initialised (vLLM's `WorkspaceManager`, where the modular kernel takes its buffers,
  calls it when a workspace grows); `torch.cuda.is_current_stream_capturing` is False and
  `torch.accelerator.current_stream()` is the `CpuStream` below, which is not capturing (`NaiveBatchedExperts`
  asks, per expert, whether a CUDA graph is being captured).
- **CPU stand-ins for CUDA streams and events** handed to vLLM's `UBatchContext` on CPU ranks (two micro-batches):
  one stream object shared by the compute and comm roles whose `wait_event` does nothing, and events whose
  `record` does nothing (torch has no CPU events); every other step of the context (threads, CPU events, recv
  hooks) is vLLM's. On a GPU, vLLM's `make_ubatch_contexts` makes them with real streams and events.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
FETCH = ROOT / "scripts" / "fetch_engines.py"
VLLM_VERSIONS = ("0.20.0", "0.34.0")  # torch 2.11's first release; the newest (scripts/fetch_engines.py)
SGLANG_VERSION = "0.5.17"


def source_dir(name: str, version: str) -> Path:
    """One release's sources, fetched with scripts/fetch_engines.py when the cache lacks them (CI fetches them
    before the tests; a failed fetch fails the test, it never skips)."""
    done = subprocess.run([sys.executable, str(FETCH), f"{name}=={version}"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"scripts/fetch_engines.py {name}=={version} failed:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ op shims
_LIBS: list[torch.library.Library] = []  # kept alive: a Library's registrations die with it


def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """vLLM's `silu_and_mul` (csrc/activation_kernels.cu): silu(gate) * up, gate the first half, in float32."""
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    out.copy_(torch.nn.functional.silu(gate) * up)


def _moe_sum(x: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor | None = None,
             expert_map: torch.Tensor | None = None) -> None:
    """vLLM's `moe_sum` (csrc/moe/): out[m] = Σ_k x[m, k], accumulated in float32. (Later releases also pass
    topk_ids and expert_map, to skip other ranks' experts; the paths here pass None for both.)"""
    if expert_map is not None:
        raise NotImplementedError("the moe_sum shim takes no expert_map")
    out.copy_(x.float().sum(dim=1))


def _register_ops(custom_ops: ModuleType) -> None:
    """The shims, with the schemas this release's `vllm._custom_ops` calls them with."""
    if _LIBS:
        return
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None
        torch.cuda.is_current_stream_capturing = lambda: False
        torch.accelerator.current_stream = lambda device=None: CPU_STREAM
        # record_stream has no CPU kernel; on a CPU rank every operation is done when it returns, so there is
        # nothing to record.
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("record_stream", lambda tensor, stream: None, "CPU")
        _LIBS.append(lib)
    moe_sum = "moe_sum(Tensor input, Tensor(a!) output) -> ()"
    if "expert_map" in inspect.signature(custom_ops.moe_sum).parameters:
        moe_sum = "moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids, Tensor? expert_map) -> ()"
    for namespace, name, schema, fn in (("_C", "silu_and_mul", "silu_and_mul(Tensor(a!) out, Tensor input) -> ()",
                                         _silu_and_mul),
                                        ("_moe_C", "moe_sum", moe_sum, _moe_sum)):
        lib = torch.library.Library(namespace, "FRAGMENT")
        lib.define(schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, fn, key)
        _LIBS.append(lib)


class _GroupQuantLauncher:
    """Stands in for one of fp8_utils' Triton kernels: `kernel[grid](x, x_q, x_s, group_size, ...)` quantises
    every group of `x` into `x_q` and writes its scale into `x_s` (whatever strides the wrapper gave it)."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self._launch

    @staticmethod
    def _launch(x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, group_size: int, *args: Any,
                fp8_min: float, fp8_max: float, use_ue8m0: bool, **kwargs: Any) -> None:
        eps = next(a for a in args if isinstance(a, float))
        groups = x.float().unflatten(-1, (-1, group_size))
        amax = groups.abs().amax(dim=-1).clamp(min=eps)
        # A division by a tensor: torch divides a CUDA tensor by a Python number as a product with its reciprocal,
        # a rounding off the division (and off the CPU's) for a scale like 1 / 448.
        scale = amax / torch.full_like(amax, fp8_max)
        if use_ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        x_q.copy_((groups / scale.unsqueeze(-1)).clamp(fp8_min, fp8_max).flatten(-2).to(x_q.dtype))
        x_s.copy_(scale)


# ------------------------------------------------------------------------------------ parallel state stub
class GroupStub:
    """What vLLM's all2all managers and prepare/finalize read of a GroupCoordinator: ranks, sizes, the gloo
    group (None for a group of this rank alone, which nothing here talks through), and (EP group) the device
    communicator's all2all manager."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.cpu_group = self.device_group = group
        self.rank_in_group = group.rank() if group is not None else 0
        self.world_size = group.size() if group is not None else 1
        self.rank = dist.get_rank()
        self.ranks = list(range(self.world_size)) if group is not None else [self.rank]
        self.device_communicator = SimpleNamespace(all2all_manager=None)


def install_groups(vllm: SimpleNamespace, ep_group: dist.ProcessGroup) -> GroupStub:
    """The rank's parallel state: data parallel = expert parallel = `ep_group`, tensor and context parallel of one
    rank each (vLLM's `--data-parallel-size R --enable-expert-parallel`). Returns the EP group's stub."""
    ps = vllm.parallel_state
    ep = GroupStub(ep_group)
    ps._DP, ps._EP, ps._TP = GroupStub(ep_group), ep, GroupStub(None)
    if hasattr(ps, "_PCP"):
        ps._PCP = GroupStub(None)
    return ep


def engine_config(vllm: SimpleNamespace, device: torch.device, **parallel: Any) -> Any:
    """The context vLLM's code reads its configuration from (`get_current_vllm_config`): a default VllmConfig
    on `device` (vLLM cannot infer a device from sources without a built platform), with `parallel` given to its
    ParallelConfig."""
    more = {"parallel_config": vllm.config.ParallelConfig(**parallel)} if parallel else {}
    cfg = vllm.config.VllmConfig(device_config=vllm.config.DeviceConfig(device=device.type), **more)
    return vllm.config.set_current_vllm_config(cfg)


# ------------------------------------------------------------------------------------------ DBO stand-ins
class CpuStream(torch.Stream):
    """The one stream of a CPU rank, in both of UBatchContext's roles (compute and comm): a torch.Stream, since
    vLLM's DBO paths hand it to Tensor.record_stream (deepep_ht.py `_dbo_record_stream`, 0.34.0), which the CPU
    shim below takes as done."""

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False


CPU_STREAM = CpuStream(device="cpu")


class CpuEvent:
    """A CUDA event's place in UBatchContext; on CPU every operation is done when it returns."""

    def record(self, stream: Any = None) -> None:
        pass


def run_ubatches(vllm: SimpleNamespace, fns: list[Callable[[], Any]], device: torch.device) -> list[Any]:
    """Two micro-batches the way vLLM's gpu_ubatch_wrapper runs them: a thread each, in vLLM's own
    `UBatchContext`s, started together, micro-batch 0 first; returns their results. On a GPU the contexts are
    `make_ubatch_contexts`'s (compute on the current stream, comm on a new one, as the wrapper does); on CPU the
    same contexts are made with the stand-ins above (torch has no CPU events)."""
    ub = vllm.ubatching
    n = len(fns)
    barrier = threading.Barrier(n + 1)
    if device.type == "cuda":
        compute = torch.cuda.current_stream()
        ctxs = ub.make_ubatch_contexts(num_micro_batches=n, compute_stream=compute, comm_stream=torch.cuda.Stream(),
                                       forward_contexts=[None] * n, ready_barrier=barrier)
    else:
        ub._NUM_UBATCHES = n
        while len(ub._CURRENT_CONTEXTS) < n:
            ub._CURRENT_CONTEXTS.append(None)
        cpu_events = [threading.Event() for _ in range(n)]
        ctxs = [ub.UBatchContext(id=i, comm_stream=CPU_STREAM, compute_stream=CPU_STREAM, forward_context=None,
                                 ready_barrier=barrier, cpu_wait_event=cpu_events[i],
                                 cpu_signal_event=cpu_events[(i + 1) % n], gpu_comm_done_event=CpuEvent(),
                                 gpu_compute_done_event=CpuEvent()) for i in range(n)]
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(i: int) -> None:
        # The thread starts on the compute stream, as vLLM's current_stream() records it (vLLM's sources without a
        # built platform have no default stream of their own: vllm.utils.torch_utils.current_stream).
        if device.type == "cuda":
            torch.cuda.set_stream(compute)  # vLLM patches set_stream to record the stream as well
        else:
            vllm.torch_utils._current_stream_tls.value = CPU_STREAM
        try:
            with ctxs[i]:
                results[i] = fns[i]()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
            for ctx in ctxs:  # let the other micro-batch run out instead of waiting forever
                ctx.cpu_wait_event.set()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    ctxs[0].cpu_wait_event.set()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a micro-batch never finished"
    return results


# ------------------------------------------------------------------------------------------------ loading
def use_vllm(version: str) -> SimpleNamespace:
    """Import vLLM `version` from its cached sources, with the stubs above; returns the modules the tests use."""
    path = str(source_dir("vllm", version))
    loaded = sys.modules.get("vllm")
    if loaded is not None:
        assert str(Path(loaded.__file__).parent.parent) == path, f"this process already imported {loaded.__file__}"
    elif path not in sys.path:
        sys.path.insert(0, path)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's info and warnings about what a CPU rank lacks
    if not torch.accelerator.is_available() and importlib.util.find_spec("vllm.utils.platform_utils") is not None:
        # torch without an accelerator pins no memory. vLLM's sources without a built platform take pinned memory as
        # available, and its CPU platform, which says otherwise (vllm/platforms/cpu.py), needs triton-cpu: the CPU
        # ranks answer as that platform does, before vllm.utils.torch_utils reads it into PIN_MEMORY.
        importlib.import_module("vllm.utils.platform_utils").is_pin_memory_available = lambda: False
    fm = "vllm.model_executor.layers.fused_moe."
    names = {
        "vllm": "vllm", "envs": "vllm.envs", "parallel_state": "vllm.distributed.parallel_state",
        "all2all": "vllm.distributed.device_communicators.all2all", "config": "vllm.config",
        "mk": fm + "modular_kernel", "moe_config": fm + "config", "activation": fm + "activation",
        "ll": fm + "prepare_finalize.deepep_ll", "ht": fm + "prepare_finalize.deepep_ht",
        "topk_reduce": fm + "topk_weight_and_reduce", "ubatching": "vllm.v1.worker.ubatching",
        "workspace": "vllm.v1.worker.workspace", "torch_utils": "vllm.utils.torch_utils",
        "fp8_utils": "vllm.model_executor.layers.quantization.utils.fp8_utils",
    }
    moved = fm + "experts.fused_batched_moe"  # NaiveBatchedExperts' module after 0.20
    names["batched"] = moved if importlib.util.find_spec(moved) is not None else fm + "fused_batched_moe"
    mods = {key: importlib.import_module(name) for key, name in names.items()}
    _register_ops(importlib.import_module("vllm._custom_ops"))
    fp8_utils: ModuleType = mods["fp8_utils"]
    fp8_utils._per_token_group_quant_fp8 = _GroupQuantLauncher()
    fp8_utils._per_token_group_quant_fp8_colmajor = _GroupQuantLauncher()
    if not hasattr(fp8_utils.triton, "next_power_of_2"):  # vLLM's placeholder for a missing Triton
        fp8_utils.triton.next_power_of_2 = lambda n: 1 << (n - 1).bit_length()
    return SimpleNamespace(version=version, **mods)

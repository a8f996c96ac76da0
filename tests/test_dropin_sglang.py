"""SGLang 0.5.17's DeepEP dispatcher against the `deep_ep` drop-in, as far as its sources go on CPU.

SGLang's classes cannot be imported in this test environment (CPU torch 2.13, the test extra), so this module
reads the released source instead (`scripts/fetch_engines.py`: sglang-0.5.17's wheel,
`sglang/srt/layers/moe/token_dispatcher/deepep.py`) and checks every call it makes on `deep_ep`'s `Buffer` and
`Config` against the drop-in's signatures. What blocks importing it, in the order an import meets them:
- `sglang/__init__.py` -> `sglang/srt/utils/common.py:87`: `import triton`, unconditionally (SGLang installs its
  own stand-in, `sglang/_triton_stub.py`, on macOS with MPS only); Triton is a large install, for kernels that
  need a GPU anyway.
- `sglang/srt/utils/common.py:94`: `from torchvision.io import decode_jpeg`, unconditionally; PyPI's torchvision
  pins its own torch build (installing it replaced the CPU torch 2.13.0 with torch 2.14 and CUDA libraries).
- `sglang/srt/layers/moe/token_dispatcher/deepep.py:54` -> `sglang/kernels/ops/quantization/fp8_kernel.py:31` ->
  `sglang/kernels/jit/utils/compile.py:95`: RuntimeError "Cannot find sglang.kernels.jit path": the JIT kernels
  need their C++ sources (`include/`, `csrc/` of the wheel), which are not Python files, and a RuntimeError
  escapes the `except ImportError` around deepep.py's `from deep_ep import Buffer, Config`.
(Smaller imports on the way, orjson and IPython, would install; past these, the dispatcher reads SGLang's server
arguments and parallel state, which this module has not tried to stand up.)
tests/test_deep_ep_dropin.py keeps replaying SGLang's DeepEP call sequences (low-latency, normal, auto mode,
two-batch overlap) on CPU ranks, as re-written there.
"""

from __future__ import annotations

from deep_ep_calls import check_calls
from engine_sources import SGLANG_VERSION, source_dir

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


def test_sglang_deepep_calls_bind_to_the_drop_in() -> None:
    """Each call SGLang's DeepEP dispatcher makes on deep_ep.Buffer / Config binds to the drop-in's signature:
    its positional arguments, its keywords, and the keys of its **dict(...) arguments (unless the drop-in refuses
    them by name as DeepEP forks' keywords, or they are ELSEWHERE's other-hardware keywords)."""
    path = source_dir("sglang", SGLANG_VERSION) / DISPATCHER
    seen = check_calls(path, f"sglang {SGLANG_VERSION} {DISPATCHER}", RECEIVERS, {"Buffer", "Config"}, ELSEWHERE)
    assert seen >= EXPECTED, f"{DISPATCHER} no longer calls {sorted(EXPECTED - seen)}: has it moved?"

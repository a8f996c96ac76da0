"""SGLang 0.5.17's DeepEP dispatcher against the `deep_ep` drop-in, as far as its sources go on CPU.

SGLang's classes cannot be imported in this test environment (CPU torch 2.13, the test extra), so this module
reads the released source instead (`scripts/fetch_engines.py`: sglang-0.5.17's wheel,
`sglang/srt/layers/moe/token_dispatcher/deepep.py`) and checks every call it makes on `deep_ep`'s `Buffer` and
`Config` against the drop-in's signatures. What blocks importing it, in the order an import meets them:
- `sglang/__init__.py` -> `sglang/srt/utils/common.py:87`: `import triton`, unconditionally (SGLang installs its
  own stand-in, `sglang/_triton_stub.py`, on macOS with MPS only); Triton is a large install that would also
  change what this repo's Triton tests see.
- `sglang/srt/utils/common.py:94`: `from torchvision.io import decode_jpeg`, unconditionally; PyPI's torchvision
  pins its own torch build (installing it replaced the CPU torch 2.13.0 with torch 2.14 and CUDA libraries).
- `sglang/srt/layers/moe/token_dispatcher/deepep.py:53` -> `sglang/kernels/ops/quantization/fp8_kernel.py` ->
  `sglang/kernels/jit/utils/compile.py:95`: RuntimeError "Cannot find sglang.kernels.jit path": the JIT kernels
  need their C++ sources (`include/`, `csrc/` of the wheel), which are not Python files, and a RuntimeError
  escapes the `except ImportError` around deepep.py's `from deep_ep import Buffer, Config`.
tests/test_deep_ep_dropin.py keeps replaying SGLang's DeepEP call sequences (low-latency, normal, auto mode,
two-batch overlap) on CPU ranks, as re-written there.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
from engine_sources import SGLANG_VERSION, source_dir

from ep_layer.buffer import _FORK_ONLY

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("deep_ep") is None:  # not installed (scripts/bootstrap.sh installs it): the checkout's
    sys.path.append(str(ROOT / "dropin"))
import deep_ep  # noqa: E402

DISPATCHER = "sglang/srt/layers/moe/token_dispatcher/deepep.py"
RECEIVERS = {"Buffer", "buffer", "state.buffer"}  # how deepep.py names deep_ep's Buffer class and its instances
# What SGLang's dispatcher calls; the test fails if the file no longer makes one of these calls.
EXPECTED = {"Buffer", "Config", "get_dispatch_config", "get_combine_config", "get_low_latency_rdma_size_hint",
            "clean_low_latency_buffer", "capture", "get_dispatch_layout", "dispatch", "combine",
            "low_latency_dispatch", "low_latency_combine"}
# Keywords SGLang passes through **dict(...) only on other hardware, which the drop-in never sees on CUDA. (Those
# of DeepEP forks, NVFP4 dispatch and single-batch overlap, it refuses by name: ep_layer.buffer._FORK_ONLY.)
ELSEWHERE = {"topk_weights": "Ascend NPU's low_latency_dispatch (_is_npu)",
             "use_fabric": "hybrid-ep's MNNVL fabric (CUDA 13 on GB200/GB300)"}


def dict_keys(node: ast.AST, assigned: dict[str, set[str]]) -> set[str]:
    """The keys a `**splat` may carry: those of dict(...) calls (and dict literals) in it, either branch of a
    conditional, or of a name assigned such a dict (plus its `name["key"] = ...` stores). A name assigned no
    such dict (SGLang's `--deepep-config` JSON, passed to Config) adds no key."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {k.arg for k in node.keywords if k.arg}
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant)}
    if isinstance(node, ast.IfExp):
        return dict_keys(node.body, assigned) | dict_keys(node.orelse, assigned)
    if isinstance(node, ast.Name):
        return assigned.get(node.id, set())
    raise AssertionError(f"{DISPATCHER}: a ** argument this test cannot read: {ast.unparse(node)}")


def dict_names(tree: ast.AST) -> dict[str, set[str]]:
    """Per name, the keys of the dicts assigned to it anywhere in the file."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    out.setdefault(target.id, set()).update(dict_keys(node.value, out))
                except AssertionError:
                    continue  # not a dict
            elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and \
                    isinstance(target.slice, ast.Constant):
                out.setdefault(target.value.id, set()).add(target.slice.value)
    return out


def buffer_calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """(name of the deep_ep callable, call) for every call on Buffer, a buffer, or Config."""
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in ("Buffer", "Config"):
            calls.append((node.func.id, node))
        elif isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in RECEIVERS:
            calls.append((node.func.attr, node))
    return calls


def drop_in_signature(name: str) -> inspect.Signature:
    """The signature the drop-in offers for `name`, as a call sees it: no self, and no **catch-all (the Buffer
    takes other keywords only to refuse them with a message)."""
    if name in ("Buffer", "Config"):
        sig = inspect.signature(getattr(deep_ep, name))
    else:
        sig = inspect.signature(getattr(deep_ep.Buffer, name))
        if not isinstance(inspect.getattr_static(deep_ep.Buffer, name), (staticmethod, classmethod)):
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD])


@pytest.fixture(scope="module")
def dispatcher() -> ast.Module:
    path = source_dir("sglang", SGLANG_VERSION) / DISPATCHER
    return ast.parse(path.read_text(), filename=str(path))


def test_sglang_deepep_calls_bind_to_the_drop_in(dispatcher: ast.Module) -> None:
    """Each call SGLang's DeepEP dispatcher makes on deep_ep.Buffer / Config binds to the drop-in's signature:
    its positional arguments, its keywords, and the keys of its **dict(...) arguments (unless the drop-in refuses
    them by name as DeepEP forks' keywords, or they are ELSEWHERE's other-hardware keywords)."""
    assigned = dict_names(dispatcher)
    seen = set()
    for name, call in buffer_calls(dispatcher):
        where = f"{DISPATCHER}:{call.lineno}: {ast.unparse(call)[:120]}"
        assert hasattr(deep_ep, name) or hasattr(deep_ep.Buffer, name), f"{where}: the drop-in has no {name}"
        sig = drop_in_signature(name)
        positional = [a for a in call.args if not isinstance(a, ast.Starred)]
        assert len(positional) == len(call.args), f"{where}: *args this test cannot read"
        keywords = {k.arg for k in call.keywords if k.arg}
        try:
            sig.bind(*range(len(positional)), **dict.fromkeys(keywords))
        except TypeError as exc:
            raise AssertionError(f"{where}: does not bind to deep_ep's {name}{sig}: {exc}") from exc
        for splat in (k.value for k in call.keywords if k.arg is None):
            for key in dict_keys(splat, assigned):
                assert key in sig.parameters or key in _FORK_ONLY.get(name, ()) or key in ELSEWHERE, \
                    f"{where}: passes {key}=, which deep_ep's {name}{sig} does not take"
        seen.add(name)
    assert seen >= EXPECTED, f"{DISPATCHER} no longer calls {sorted(EXPECTED - seen)}: has it moved?"

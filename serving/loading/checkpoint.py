"""Load an HF DeepSeek-V3 checkpoint into DeepseekV3ForCausalLM: the checkpoint directory (config.json,
safetensors weights sharded with `model.safetensors.index.json` or one `model.safetensors`, BF16 or FP8
block weights, tokenizer.json), and the model's side of it: which tensors a rank reads (needs_tensor)
and where each checkpoint name goes (load_tensors; a FusedMoE layer takes its own through
FusedMoE.load_weights, ep_layer.moe.loading).

Each rank reads only the tensors it keeps (safetensors opens files lazily and reads tensor by
tensor): other ranks' routed experts and the multi-token-prediction layer are never read.

load_format "dummy" (vLLM's name) reads config.json and the tokenizer only and fills the weights with
random values made on the device (serving.random_weights): a real architecture without its weights.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ep_layer import Buffer
from ep_layer.moe.loading import copy_checked

from ..engine.engine_config import LOAD_FORMATS
from ..model_config import ModelConfig
from ..random_weights import random_weights

if TYPE_CHECKING:
    from ..models.deepseek_v3 import DeepseekV3ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
DUMMY_SEED = 0
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")
_MOE_PREFIX = "mlp."
_MISSING_SHOWN = 8  # missing tensors listed in an error
_PROGRESS_EVERY_S = 0.5

__all__ = ["CheckpointError", "checkpoint_tensor_files", "load_checkpoint", "load_config", "load_tensors",
           "load_weights", "needs_tensor", "read_tokenizer"]


class CheckpointError(ValueError):
    """A checkpoint does not fit the model: a tensor is missing, unexpected, mis-shaped or mistyped,
    or a file is missing or unreadable. The message names the tensor or file."""


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (or of a config.json file)."""
    return ModelConfig.from_file(path)


def read_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The `tokenizers.Tokenizer` saved as tokenizer.json in a checkpoint directory."""
    from tokenizers import Tokenizer

    file = os.path.join(os.fspath(path), TOKENIZER_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: no such file (the checkpoint needs a {TOKENIZER_FILE})")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise CheckpointError(f"{file}: not a tokenizers tokenizer.json ({e})") from None


def load_checkpoint(path: str | os.PathLike[str], *, ep_buffer: Buffer | None = None,
               group: dist.ProcessGroup | None = None, backend: str = "auto", max_tokens_per_rank: int = 128,
               device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
               expert_kernels: str = "auto", progress: bool = True,
               load_format: str = "auto", normal_mode: bool = False,
               moe_overlap: str = "none") -> DeepseekV3ForCausalLM:
    """Build DeepseekV3ForCausalLM from the checkpoint's config.json and load this rank's weights
    (arguments as DeepseekV3ForCausalLM's; progress: show a progress bar on stderr; load_format:
    "auto" reads the safetensors, "dummy" draws random weights instead)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    config = load_config(path)
    # Imported here: the server process reads the tokenizer from this module without the model's imports.
    from ..models.deepseek_v3 import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(config, ep_buffer=ep_buffer, group=group, backend=backend,
                                  max_tokens_per_rank=max_tokens_per_rank, device=device, dtype=dtype,
                                  expert_kernels=expert_kernels, normal_mode=normal_mode, moe_overlap=moe_overlap)
    if load_format == "dummy":
        load_tensors(model, random_weights(config, DUMMY_SEED, model.device, wanted=partial(needs_tensor, model)))
    else:
        load_weights(model, path, progress=progress)
    return model


def load_weights(model: DeepseekV3ForCausalLM, path: str | os.PathLike[str], *, progress: bool = True) -> None:
    """Read the tensors `needs_tensor` accepts from the checkpoint directory, shard by shard, into
    `load_tensors`."""
    files = checkpoint_tensor_files(path)
    wanted: dict[str, list[str]] = {}
    for name, file in files.items():
        if needs_tensor(model, name):
            wanted.setdefault(file, []).append(name)
    total = sum(len(names) for names in wanted.values())
    load_tensors(model, _read_tensors(wanted, _make_progress(total, progress)))


def needs_tensor(model: DeepseekV3ForCausalLM, name: str) -> bool:
    """False for checkpoint tensors this rank skips without reading: the multi-token-prediction
    layer(s) and other ranks' routed experts. Everything else goes to `load_tensors`."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return True
    layer, rest = int(match[1]), match[2]
    c = model.config
    if c.num_hidden_layers <= layer < c.num_hidden_layers + c.num_nextn_predict_layers:
        return False
    expert = _EXPERT.match(rest) if layer < c.num_hidden_layers and c.is_moe_layer(layer) else None
    if expert is None:
        return True
    first = model.ep_rank * model.experts_per_rank
    e = int(expert[1])
    return first <= e < first + model.experts_per_rank or e >= c.n_routed_experts  # bad ids fail in load


def load_tensors(model: DeepseekV3ForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load every tensor of an HF DeepSeek-V3 checkpoint into `model`, by its checkpoint name, in any
    order (tensors `needs_tensor` rejects are ignored). Raises CheckpointError naming the tensor for an
    unexpected, duplicate, mis-shaped or mistyped tensor, and listing any that are missing.

    A MoE layer's tensors go to its FusedMoE together once all of them (router, this rank's experts,
    shared experts) have arrived, so a loader reading shard by shard holds at most the layers that
    straddle the shards it is reading."""
    direct = _direct_targets(model)
    per_moe_layer = _moe_tensor_count(model)
    pending: dict[int, list[tuple[str, torch.Tensor]]] = {
        i: [] for i, layer in enumerate(model.model.layers) if layer.is_moe}
    seen: set[str] = set()
    for name, tensor in tensors:
        if name in seen:
            raise CheckpointError(f"{name}: given twice")
        seen.add(name)
        if not needs_tensor(model, name):
            continue
        match = _LAYER.fullmatch(name)
        layer = int(match[1]) if match else -1
        if layer in pending and match[2].startswith(_MOE_PREFIX):
            pending[layer].append((match[2][len(_MOE_PREFIX):], tensor))
            if len(pending[layer]) == per_moe_layer:
                _load_moe(model, layer, pending.pop(layer))
            continue
        target = direct.pop(name, None)
        if target is None:
            raise CheckpointError(f"unexpected tensor {name}" + _unexpected_hint(name, model.config))
        copy_checked(name, tensor, target, error=CheckpointError,
                     fp8_because="config.json has an FP8 quantization_config",
                     fp8_needs="an FP8 checkpoint: config.json needs its quantization_config")
    for layer, moe_tensors in pending.items():
        _load_moe(model, layer, moe_tensors)  # raises: some of the layer's tensors are missing
    if direct:
        missing = sorted(direct)
        shown = ", ".join(missing[:_MISSING_SHOWN]) + (", ..." if len(missing) > _MISSING_SHOWN else "")
        raise CheckpointError(f"{len(missing)} tensor(s) missing from the checkpoint: {shown}")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.absorb_weights()


def checkpoint_tensor_files(path: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it, from the index (or the single file)."""
    from safetensors import safe_open

    root = os.fspath(path)
    index, single = os.path.join(root, INDEX_FILE), os.path.join(root, SINGLE_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object "
                                  f"({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' should map tensor names to file names")
        files = {name: os.path.join(root, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: listed in {INDEX_FILE} but missing")
        return files
    if os.path.isfile(single):
        with _open(single, safe_open) as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(f"{root}: no {INDEX_FILE} or {SINGLE_FILE} (expected an HF safetensors checkpoint)")


def _read_tensors(wanted: dict[str, list[str]], progress: _Progress) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        for file in sorted(wanted):
            with _open(file, safe_open) as f:
                present = set(f.keys())
                for name in wanted[file]:
                    if name not in present:
                        raise CheckpointError(f"{name}: {INDEX_FILE} puts it in {os.path.basename(file)}, "
                                              "which does not hold it")
                    yield name, f.get_tensor(name)
                    progress.update(1)
    finally:
        progress.close()


def _open(file: str, safe_open: Any) -> Any:
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


# ---------------------------------------------------------------------------- where each tensor goes
def _direct_targets(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint name -> storage, for every tensor outside the FusedMoE layers."""
    moe = tuple(f"model.layers.{i}.mlp." for i, layer in enumerate(model.model.layers) if layer.is_moe)
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if not name.startswith(moe)}


def _moe_tensor_count(model: DeepseekV3ForCausalLM) -> int:
    """Tensors one MoE layer takes on this rank: router weight and bias, 3 projections per own expert
    and for the shared experts, each with its block scales for FP8."""
    per_projection = 2 if model.config.fp8 else 1
    experts = model.experts_per_rank + (1 if model.config.n_shared_experts else 0)
    return 2 + 3 * per_projection * experts


def _load_moe(model: DeepseekV3ForCausalLM, layer: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
    try:
        model.model.layers[layer].mlp.load_weights(tensors)
    except ValueError as e:
        raise CheckpointError(f"model.layers.{layer}.mlp: {e}") from None


def _unexpected_hint(name: str, config: ModelConfig) -> str:
    if name.endswith("weight_scale_inv") and not config.fp8:
        return " (FP8 block scales, but config.json has no FP8 quantization_config)"
    match = _LAYER.fullmatch(name)
    if match and int(match[1]) >= config.num_hidden_layers:
        return (f" (layer {match[1]}: the config has num_hidden_layers={config.num_hidden_layers} and "
                f"num_nextn_predict_layers={config.num_nextn_predict_layers})")
    return ""


# ---------------------------------------------------------------------------- progress
class _Progress(Protocol):
    def update(self, n: int) -> Any: ...

    def close(self) -> Any: ...


class _StderrCounter:
    """`Loading weights: i/total` on stderr, redrawn at most every half second (no tqdm needed)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self._last = total, 0, 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= _PROGRESS_EVERY_S or self.done == self.total:
            self._last = now
            print(f"\rLoading weights: {self.done}/{self.total} tensors", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.done:
            print(file=sys.stderr, flush=True)


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _make_progress(total: int, enabled: bool) -> _Progress:
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _StderrCounter(total)
    return tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr)

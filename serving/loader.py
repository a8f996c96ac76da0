"""Load an HF DeepSeek-V3 checkpoint directory: config.json, safetensors weights (sharded with
`model.safetensors.index.json`, or one `model.safetensors`), BF16 or FP8 block weights, tokenizer.json.

Each rank reads only the tensors it keeps (safetensors opens files lazily and reads tensor by
tensor): other ranks' routed experts and the multi-token-prediction layer are never read.

load_format "dummy" (vLLM's name) reads config.json and the tokenizer only and fills the weights with
random values made on the device (serving.random_weights): a real architecture without its weights.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ep_layer import Buffer

from .config import ModelConfig
from .engine.config import LOAD_FORMATS
from .models import CheckpointError, DeepseekV3ForCausalLM
from .random_weights import random_weights

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
DUMMY_SEED = 0
_PROGRESS_EVERY_S = 0.5

__all__ = ["CheckpointError", "checkpoint_tensor_files", "load_config", "load_model", "load_tokenizer",
           "load_weights"]


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (or of a config.json file)."""
    return ModelConfig.from_file(path)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The `tokenizers.Tokenizer` saved as tokenizer.json in a checkpoint directory."""
    from tokenizers import Tokenizer

    file = os.path.join(os.fspath(path), TOKENIZER_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: no such file (the checkpoint needs a {TOKENIZER_FILE})")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise CheckpointError(f"{file}: not a tokenizers tokenizer.json ({e})") from None


def load_model(path: str | os.PathLike[str], *, ep_buffer: Buffer | None = None,
               group: dist.ProcessGroup | None = None, backend: str = "auto", max_tokens_per_rank: int = 128,
               device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
               expert_kernels: str = "auto", progress: bool = True,
               load_format: str = "auto") -> DeepseekV3ForCausalLM:
    """Build DeepseekV3ForCausalLM from the checkpoint's config.json and load this rank's weights
    (arguments as DeepseekV3ForCausalLM's; progress: show a progress bar on stderr; load_format:
    "auto" reads the safetensors, "dummy" draws random weights instead)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    config = load_config(path)
    model = DeepseekV3ForCausalLM(config, ep_buffer=ep_buffer, group=group, backend=backend,
                                  max_tokens_per_rank=max_tokens_per_rank, device=device, dtype=dtype,
                                  expert_kernels=expert_kernels)
    if load_format == "dummy":
        model.load_weights(random_weights(config, DUMMY_SEED, model.device, wanted=model.needs_weight))
    else:
        load_weights(model, path, progress=progress)
    return model


def load_weights(model: DeepseekV3ForCausalLM, path: str | os.PathLike[str], *, progress: bool = True) -> None:
    """Read the tensors `model.needs_weight` accepts, shard by shard, into `model.load_weights`."""
    files = checkpoint_tensor_files(path)
    wanted: dict[str, list[str]] = {}
    for name, file in files.items():
        if model.needs_weight(name):
            wanted.setdefault(file, []).append(name)
    total = sum(len(names) for names in wanted.values())
    model.load_weights(_read_tensors(wanted, _make_progress(total, progress)))


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

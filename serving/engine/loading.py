"""The default model loader of the engine ranks (EngineConfig.loader names a module with these two
functions): an HF DeepSeek-V3 checkpoint directory through serving.loader, and the built-in tiny
checkpoint, written once to a cache directory so that it takes the same path."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from .config import EngineConfig

TINY_PREFIX = "tiny-deepseek-v3"


def load_model(config: EngineConfig, group: dist.ProcessGroup | None, device: torch.device) -> tuple[Any, Any]:
    """(DeepseekV3ForCausalLM with this rank's experts, its tokenizer)."""
    from .. import loader

    rank = dist.get_rank(group) if group is not None else 0
    model = loader.load_model(config.model, group=group, backend=config.ep_backend,
                              max_tokens_per_rank=config.max_tokens_per_rank, device=device, progress=rank == 0,
                              load_format=config.load_format)
    return model.eval(), loader.load_tokenizer(config.model)


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer alone (for the API server process)."""
    from .. import loader

    return loader.load_tokenizer(config.model)


def tiny_checkpoint(cache_dir: str | None = None) -> str:
    """The built-in tiny checkpoint's directory, written by serving.tiny_model on first use under
    `cache_dir` (default $EP_LAYER_CACHE, else ~/.cache/ep-layer), keyed by tiny_model.py's source so
    that a change rewrites it; a temporary directory if the cache is not writable."""
    from .. import tiny_model

    with open(tiny_model.__file__, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:12]
    root = cache_dir or os.environ.get("EP_LAYER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ep-layer")
    target = os.path.join(root, f"{TINY_PREFIX}-{key}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{TINY_PREFIX}-", dir=root)
    except OSError:
        return tiny_model.write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"{TINY_PREFIX}-"))
    tiny_model.write_tiny_checkpoint(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
    return target

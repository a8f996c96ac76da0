"""The default model loader of the engine ranks (EngineConfig.loader names a module with these two
functions): the checkpoint directory EngineConfig.model through serving.loader."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .engine_config import EngineConfig


def load_model(config: EngineConfig, group: dist.ProcessGroup | None, device: torch.device) -> tuple[Any, Any]:
    """(DeepseekV3ForCausalLM with this rank's experts, its tokenizer)."""
    from .. import loader

    rank = dist.get_rank(group) if group is not None else 0
    dtype = getattr(torch, loader.load_config(config.model).serving_dtype(config.dtype))
    model = loader.load_model(config.model, group=group, backend=config.ep_backend,
                              max_tokens_per_rank=config.max_tokens_per_rank, device=device, progress=rank == 0,
                              load_format=config.load_format, dtype=dtype,
                              normal_mode=config.deepep_mode != "low_latency")
    return model.eval(), load_tokenizer(config)


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer (--tokenizer, else the model's directory)."""
    from .. import loader

    return loader.load_tokenizer(config.tokenizer or config.model)

"""The default model loader of the engine ranks (EngineConfig.loader names a module with these two
functions): the checkpoint directory EngineConfig.model through serving.loader, its MoE layers over one
Buffer with the configured backend and transport."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ep_layer import Buffer
from ep_layer.moe import make_buffer

from ..model_config import ModelConfig
from .engine_config import EngineConfig
from .rank_worker import ep_backend_for


def load_model(config: EngineConfig, group: dist.ProcessGroup | None, device: torch.device) -> tuple[Any, Any]:
    """(DeepseekV3ForCausalLM with this rank's experts, its tokenizer)."""
    from .. import loader

    rank = dist.get_rank(group) if group is not None else 0
    checkpoint = loader.load_config(config.model)
    dtype = getattr(torch, checkpoint.serving_dtype(config.dtype))
    model = loader.load_model(config.model, ep_buffer=make_ep_buffer(config, checkpoint, group, device),
                              max_tokens_per_rank=config.max_tokens_per_rank, device=device, progress=rank == 0,
                              load_format=config.load_format, dtype=dtype,
                              normal_mode=config.deepep_mode != "low_latency")
    return model.eval(), load_tokenizer(config)


def make_ep_buffer(config: EngineConfig, checkpoint: ModelConfig, group: dist.ProcessGroup | None,
                   device: torch.device) -> Buffer | None:
    """The Buffer all MoE layers of `checkpoint` share (None without MoE layers), with config.ep_transport."""
    if checkpoint.first_k_dense_replace >= checkpoint.num_hidden_layers:
        return None
    return make_buffer(group, config.max_tokens_per_rank, checkpoint.hidden_size, checkpoint.n_routed_experts,
                       ep_backend_for(config, device), device, normal_mode=config.deepep_mode != "low_latency",
                       transport=config.ep_transport)


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer (--tokenizer, else the model's directory)."""
    from .. import loader

    return loader.load_tokenizer(config.tokenizer or config.model)

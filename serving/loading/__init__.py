"""Loading, in one package: `checkpoint` reads an HF DeepSeek-V3 checkpoint directory into the model
(weights, config, tokenizer); this module is the engine ranks' default loader (EngineConfig.loader
names a module with these two functions: load_model and load_tokenizer), which loads EngineConfig.model
with its MoE layers over one Buffer of the configured backend and transport."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ep_layer import Buffer
from ep_layer.moe import make_buffer

from ..engine.engine_config import EngineConfig, ep_backend_for
from ..model_config import ModelConfig
from .checkpoint import load_checkpoint, load_config, read_tokenizer


def load_model(config: EngineConfig, group: dist.ProcessGroup | None, device: torch.device) -> tuple[Any, Any]:
    """(DeepseekV3ForCausalLM with this rank's experts, its tokenizer)."""
    rank = dist.get_rank(group) if group is not None else 0
    checkpoint = load_config(config.model)
    dtype = getattr(torch, checkpoint.serving_dtype(config.dtype))
    model = load_checkpoint(config.model, ep_buffer=make_ep_buffer(config, checkpoint, group, device),
                            max_tokens_per_rank=config.max_tokens_per_rank, device=device, progress=rank == 0,
                            load_format=config.load_format, dtype=dtype,
                            normal_mode=config.deepep_mode != "low_latency", moe_overlap=config.moe_overlap)
    return model.eval(), load_tokenizer(config)


def make_ep_buffer(config: EngineConfig, checkpoint: ModelConfig, group: dist.ProcessGroup | None,
                   device: torch.device) -> Buffer | None:
    """The Buffer all MoE layers of `checkpoint` share (None without MoE layers), with config.ep_transport; with normal
    mode, for steps of the whole token budget."""
    if checkpoint.first_k_dense_replace >= checkpoint.num_hidden_layers:
        return None
    normal_mode = config.deepep_mode != "low_latency"
    return make_buffer(group, config.max_tokens_per_rank, checkpoint.hidden_size, checkpoint.n_routed_experts,
                       ep_backend_for(config, device), device, normal_mode=normal_mode,
                       normal_tokens=config.token_budget if normal_mode else None, transport=config.ep_transport)


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer (--tokenizer, else the model's directory)."""
    return read_tokenizer(config.tokenizer or config.model)

"""Random DeepSeek-V3 weights under HF checkpoint names, for any config: the built-in tiny model's
deterministic weights, and `--load-format dummy` (vLLM's name: a real config at real widths with
random weights, made on the device, for benchmarks without a checkpoint on disk).

`weight_specs` lists every checkpoint tensor of a config in one fixed order, with how to draw it;
`random_weights` draws them one at a time (only the ones a rank asks for), in float or as DeepSeek-V3's
FP8 checkpoints store them, so even an 11 GB MoE layer is never held twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ep_layer.block_fp8 import block_cast_to_fp8, num_blocks

from .model_config import ModelConfig

FP8_PROJECTIONS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                   "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class WeightSpec:
    """kind: "linear" (randn * gain / sqrt(in)), "norm" (1 + 0.1 randn), "bias" (uniform in
    [-0.05, 0.05)), "embedding" (randn) or "copy" (the tensor named `source`, drawn earlier)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    gain: float = 1.0
    source: str = ""


def weight_specs(config: ModelConfig) -> Iterator[WeightSpec]:
    """Every tensor of an HF DeepSeek-V3 checkpoint of `config` (MTP layers included), in float."""
    c = config
    h = c.hidden_size

    def linear(name: str, rows: int, cols: int, gain: float = 1.0) -> WeightSpec:
        return WeightSpec(name, "linear", (rows, cols), gain)

    def norm(name: str, dim: int) -> WeightSpec:
        return WeightSpec(name, "norm", (dim,))

    def mlp(prefix: str, inter: int) -> Iterator[WeightSpec]:
        yield linear(f"{prefix}.gate_proj.weight", inter, h)
        yield linear(f"{prefix}.up_proj.weight", inter, h)
        yield linear(f"{prefix}.down_proj.weight", h, inter, gain=0.5)

    def layer(i: int) -> Iterator[WeightSpec]:
        p = f"model.layers.{i}"
        yield norm(f"{p}.input_layernorm.weight", h)
        yield norm(f"{p}.post_attention_layernorm.weight", h)
        a = f"{p}.self_attn"
        heads = c.num_attention_heads
        if c.q_lora_rank is None:
            yield linear(f"{a}.q_proj.weight", heads * c.qk_head_dim, h)
        else:
            yield linear(f"{a}.q_a_proj.weight", c.q_lora_rank, h)
            yield norm(f"{a}.q_a_layernorm.weight", c.q_lora_rank)
            yield linear(f"{a}.q_b_proj.weight", heads * c.qk_head_dim, c.q_lora_rank)
        yield linear(f"{a}.kv_a_proj_with_mqa.weight", c.kv_cache_dim, h)
        yield norm(f"{a}.kv_a_layernorm.weight", c.kv_lora_rank)
        yield linear(f"{a}.kv_b_proj.weight", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        yield linear(f"{a}.o_proj.weight", h, heads * c.v_head_dim, gain=0.5)
        if not c.is_moe_layer(i):
            yield from mlp(f"{p}.mlp", c.intermediate_size)
            return
        yield linear(f"{p}.mlp.gate.weight", c.n_routed_experts, h)
        yield WeightSpec(f"{p}.mlp.gate.e_score_correction_bias", "bias", (c.n_routed_experts,))
        for e in range(c.n_routed_experts):
            yield from mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size)
        if c.n_shared_experts:
            yield from mlp(f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)

    yield WeightSpec("model.embed_tokens.weight", "embedding", (c.vocab_size, h))
    for i in range(c.num_hidden_layers):
        yield from layer(i)
    yield norm("model.norm.weight", h)
    yield linear("lm_head.weight", c.vocab_size, h, gain=2.0)
    for i in range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers):
        yield from layer(i)  # multi-token prediction: a MoE decoder layer plus its own embedding, norms and head
        p = f"model.layers.{i}"
        yield norm(f"{p}.enorm.weight", h)
        yield norm(f"{p}.hnorm.weight", h)
        yield linear(f"{p}.eh_proj.weight", h, 2 * h)
        yield norm(f"{p}.shared_head.norm.weight", h)
        yield WeightSpec(f"{p}.embed_tokens.weight", "copy", (c.vocab_size, h), source="model.embed_tokens.weight")
        yield WeightSpec(f"{p}.shared_head.head.weight", "copy", (c.vocab_size, h), source="lm_head.weight")


def is_fp8_weight(name: str) -> bool:
    """The tensors DeepSeek-V3's FP8 checkpoints store as e4m3 with block scales: the attention and
    MLP/expert projections (not embeddings, lm_head, norms, the router or the MTP-only parts)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in FP8_PROJECTIONS


def stored_bytes(config: ModelConfig) -> Iterator[tuple[str, int]]:
    """(name, bytes) of every tensor as the checkpoint stores it: FP8 projections one byte per value
    plus their float32 block scales (counted under the weight's name), the router bias float32, the
    rest bf16."""
    for spec in weight_specs(config):
        numel = math.prod(spec.shape)
        if config.fp8 and is_fp8_weight(spec.name):
            rows, cols = spec.shape
            yield spec.name, numel + 4 * num_blocks(rows) * num_blocks(cols)
        else:
            yield spec.name, numel * (4 if spec.kind == "bias" else 2)


def draw(spec: WeightSpec, gen: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """The spec's tensor in bf16 (the router's correction bias in float32, as in V3 checkpoints)."""
    if spec.kind == "linear":
        w = torch.randn(spec.shape, generator=gen, device=device) * (spec.gain / spec.shape[1] ** 0.5)
    elif spec.kind == "norm":
        w = 1 + 0.1 * torch.randn(spec.shape, generator=gen, device=device)
    elif spec.kind == "bias":
        return 0.1 * torch.rand(spec.shape, generator=gen, device=device) - 0.05
    elif spec.kind == "embedding":
        w = torch.randn(spec.shape, generator=gen, device=device)
    else:
        raise ValueError(f"{spec.name}: kind {spec.kind!r} is not drawn")
    return w.to(torch.bfloat16)


def random_weights(config: ModelConfig, seed: int, device: torch.device | str = "cpu", fp8: bool | None = None,
                   wanted: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor `wanted` accepts, drawn in `weight_specs` order from
    one generator seeded with `seed` (the same seed gives the same tensors on the same device kind).
    fp8 (default: config.fp8): projections as e4m3 plus their `weight_scale_inv`, as V3 ships them.
    Tensors not wanted are skipped without drawing, so their values depend on which were wanted."""
    fp8 = config.fp8 if fp8 is None else fp8
    specs = list(weight_specs(config))
    sources = {s.source for s in specs if s.kind == "copy" and wanted(s.name)}
    gen = torch.Generator(device=device).manual_seed(seed)
    kept: dict[str, torch.Tensor] = {}  # drawn tensors that a wanted "copy" repeats
    for spec in specs:
        if spec.kind == "copy":
            if wanted(spec.name):
                yield spec.name, kept[spec.source].clone()
            continue
        if not wanted(spec.name) and spec.name not in sources:
            continue
        tensor = draw(spec, gen, device)
        if spec.name in sources:
            kept[spec.name] = tensor
        if not wanted(spec.name):
            continue
        if fp8 and is_fp8_weight(spec.name):
            data, scale_inv = block_cast_to_fp8(tensor)
            yield spec.name, data
            yield f"{spec.name}_scale_inv", scale_inv
        else:
            yield spec.name, tensor

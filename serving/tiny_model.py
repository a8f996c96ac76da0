"""A built-in tiny DeepSeek-V3-architecture checkpoint with deterministic weights, so that `ep-serve`
works on any machine and the built-in model goes through the same loading code as real ones.

Same structure as V3 at toy sizes: MLA with a query LoRA, YaRN RoPE, one dense layer then MoE layers
(16 routed experts, top-4 of 2 of 4 groups, one shared expert), a multi-token-prediction layer that
loaders skip, a byte-level BPE tokenizer trained on a small embedded corpus, and an optional FP8
variant (e4m3 weights with 128x128 block scales, partial blocks included, as V3 has).

    python -m serving.tiny_model DIR [--fp8]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from ep_layer.moe import block_cast_to_fp8

from .config import ModelConfig

SEED = 20240917
# DeepSeek-V3's own special tokens, full-width bars included.
BOS_TOKEN, EOS_TOKEN = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # noqa: RUF001
NUM_SHARDS = 3

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    # mscale != mscale_all_dim (V3 has 1.0 for both) so that YaRN's cos/sin factor is not 1 either.
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}

CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not mind at all.
A mixture of experts sends every token to a few experts and adds their answers, weighted by the router.
Expert parallelism keeps each slice of the experts on its own rank; tokens travel to them and back.
Dispatch sends the tokens out, the experts compute, and combine brings the weighted results home.
Latent attention stores one small vector per token instead of a key and a value for every head.
The cache is paged: each sequence owns blocks of slots, listed in its block table, like pages of memory.
Prefill reads the whole prompt at once; decode then writes one new token at a time, step after step.
Once upon a time there was a small model that knew very little, but it always answered politely.
It lived on a computer with many cores and a fan that hummed quietly through the night.
Every morning it read the same short story and counted the words, one, two, three, four, five.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 and 3.14159.
def forward(self, x):
    return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
for i in range(10):
    print("hello, world", i)
Questions and answers: What is the capital of France? Paris. What is two plus two? Four.
Hello! How are you today? I am fine, thank you. The weather is nice and the sky is blue.
Rivers flow to the sea, mountains rise above the clouds, and the forest is green in summer.
Serving large language models well means batching requests, caching keys, and keeping the chips busy.
"""


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer (vocab_size entries, BOS id 0, EOS id 1) trained on CORPUS; the
    training is deterministic, and encoding prepends BOS, as DeepSeek-V3's tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_CONFIG["vocab_size"], special_tokens=[BOS_TOKEN, EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)])
    return tokenizer


def tiny_weights(config: ModelConfig, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Deterministic float weights under HF DeepSeek-V3 names (MTP layer included): bf16, except the
    router's correction bias (float32, as in V3 checkpoints)."""
    gen = torch.Generator().manual_seed(seed)
    c = config
    h = c.hidden_size
    out: dict[str, torch.Tensor] = {}

    def linear(name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        out[name] = (torch.randn(rows, cols, generator=gen) * (gain / cols ** 0.5)).to(torch.bfloat16)

    def norm(name: str, dim: int) -> None:
        out[name] = (1 + 0.1 * torch.randn(dim, generator=gen)).to(torch.bfloat16)

    def mlp(prefix: str, inter: int) -> None:
        linear(f"{prefix}.gate_proj.weight", inter, h)
        linear(f"{prefix}.up_proj.weight", inter, h)
        linear(f"{prefix}.down_proj.weight", h, inter, gain=0.5)

    def layer(i: int) -> None:
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", h)
        norm(f"{p}.post_attention_layernorm.weight", h)
        a = f"{p}.self_attn"
        heads = c.num_attention_heads
        linear(f"{a}.q_a_proj.weight", c.q_lora_rank, h)
        norm(f"{a}.q_a_layernorm.weight", c.q_lora_rank)
        linear(f"{a}.q_b_proj.weight", heads * c.qk_head_dim, c.q_lora_rank)
        linear(f"{a}.kv_a_proj_with_mqa.weight", c.kv_cache_dim, h)
        norm(f"{a}.kv_a_layernorm.weight", c.kv_lora_rank)
        linear(f"{a}.kv_b_proj.weight", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        linear(f"{a}.o_proj.weight", h, heads * c.v_head_dim, gain=0.5)
        if not c.is_moe_layer(i):
            mlp(f"{p}.mlp", c.intermediate_size)
            return
        linear(f"{p}.mlp.gate.weight", c.n_routed_experts, h)
        out[f"{p}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.rand(c.n_routed_experts, generator=gen) - 0.05
        for e in range(c.n_routed_experts):
            mlp(f"{p}.mlp.experts.{e}", c.moe_intermediate_size)
        mlp(f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)

    out["model.embed_tokens.weight"] = torch.randn(c.vocab_size, h, generator=gen).to(torch.bfloat16)
    for i in range(c.num_hidden_layers):
        layer(i)
    norm("model.norm.weight", h)
    linear("lm_head.weight", c.vocab_size, h, gain=2.0)
    for i in range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers):
        layer(i)  # multi-token prediction: a MoE decoder layer plus its own embedding, norms and head
        p = f"model.layers.{i}"
        norm(f"{p}.enorm.weight", h)
        norm(f"{p}.hnorm.weight", h)
        linear(f"{p}.eh_proj.weight", h, 2 * h)
        norm(f"{p}.shared_head.norm.weight", h)
        out[f"{p}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[f"{p}.shared_head.head.weight"] = out["lm_head.weight"].clone()
    return out


def is_fp8_weight(name: str) -> bool:
    """The tensors DeepSeek-V3's FP8 checkpoints store as e4m3 with block scales: the attention and
    MLP/expert projections (not embeddings, lm_head, norms, the router or the MTP-only parts)."""
    projections = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                   "gate_proj", "up_proj", "down_proj")
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in projections


def quantize_fp8(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of `weights`: projections cast to e4m3 with float32 `weight_scale_inv`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if is_fp8_weight(name):
            out[name], out[f"{name}_scale_inv"] = block_cast_to_fp8(tensor)
        else:
            out[name] = tensor
    return out


def write_tiny_checkpoint(directory: str | os.PathLike[str], fp8: bool = False) -> str:
    """Write config.json, NUM_SHARDS safetensors shards with model.safetensors.index.json, and the
    tokenizer (tokenizer.json, tokenizer_config.json) into `directory`; return its path."""
    root = os.fspath(directory)
    os.makedirs(root, exist_ok=True)
    raw = dict(TINY_CONFIG)
    if fp8:
        raw["quantization_config"] = FP8_QUANTIZATION
    config = ModelConfig.from_dict(raw)
    weights = tiny_weights(config)
    if fp8:
        weights = quantize_fp8(weights)
    save_sharded(root, weights)
    with open(os.path.join(root, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2, ensure_ascii=False)
        f.write("\n")
    tokenizer = build_tokenizer()
    tokenizer.save(os.path.join(root, "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
                        "eos_token": EOS_TOKEN, "add_bos_token": True, "add_eos_token": False,
                        "model_max_length": raw["max_position_embeddings"]}
    with open(os.path.join(root, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return root


def save_sharded(directory: str | os.PathLike[str], weights: dict[str, torch.Tensor],
                 num_shards: int = NUM_SHARDS) -> None:
    """Write tensors as HF does: `num_shards` safetensors files of about equal bytes (names in sorted
    order) and model.safetensors.index.json mapping each name to its file."""
    names = sorted(weights)
    sizes = [weights[n].numel() * weights[n].element_size() for n in names]
    total = sum(sizes)
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for name, size in zip(names, sizes):
        shards[min(done * num_shards // total, num_shards - 1)].append(name)
        done += size
    weight_map = {}
    root = os.fspath(directory)
    os.makedirs(root, exist_ok=True)
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in shard}, os.path.join(root, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(root, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serving.tiny_model",
                                     description="Write the built-in tiny DeepSeek-V3 checkpoint to DIR.")
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--fp8", action="store_true", help="FP8 block-quantised weights (as DeepSeek-V3 ships)")
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(args.directory, fp8=args.fp8)
    print(f"wrote the tiny DeepSeek-V3 {'FP8' if args.fp8 else 'BF16'} checkpoint to {path}")


if __name__ == "__main__":
    main()

"""A built-in tiny DeepSeek-V3-architecture checkpoint with deterministic weights, so that `ep-serve`
works on any machine and the built-in model goes through the same loading code as real ones
(tiny_checkpoint writes it once to a cache directory).

Same structure as V3 at toy sizes: MLA with a query LoRA, YaRN RoPE, one dense layer then MoE layers
(16 routed experts, top-4 of 2 of 4 groups, one shared expert), a multi-token-prediction layer that
loaders skip, a byte-level BPE tokenizer trained on a small embedded corpus, and an optional FP8
variant (e4m3 weights with 128x128 block scales, partial blocks included, as V3 has). Its
tokenizer_config.json carries a chat template in DeepSeek-V3's form (CHAT_TEMPLATE).

    python -m serving.tiny_model DIR [--fp8]
    python -m serving.tiny_model DIR --v3-shaped-layers 4     # V3's config at 4 layers, no weights
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

from .model_config import ModelConfig
from .random_weights import random_weights

SEED = 20240917
TINY_PREFIX = "tiny-deepseek-v3"  # the cache directory's name, before the key of this file's source
# DeepSeek-V3's own special tokens, full-width bars included.
BOS_TOKEN, EOS_TOKEN = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # noqa: RUF001
USER_TAG, ASSISTANT_TAG = "<｜User｜>", "<｜Assistant｜>"  # noqa: RUF001 - text to this tokenizer, not tokens
# DeepSeek-V3's template without its tool calls: BOS, the system prompts (OpenAI's developer messages are
# system prompts too), then each turn after its tag, an assistant's ended by EOS; add_generation_prompt
# opens the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages if message['role'] in ['system', 'developer'] %}"
    "{{ message['content'] }}{% if not loop.last %}{{ '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% for message in messages if message['role'] not in ['system', 'developer'] %}"
    "{% if message['role'] == 'user' %}" + USER_TAG + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT_TAG + "{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT_TAG + "{% endif %}"
)
NUM_SHARDS = 3

V3_CONFIG: dict[str, Any] = {  # deepseek-ai/DeepSeek-V3's config.json (auto_map and training-only fields left out)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}

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


def write_tiny_checkpoint(directory: str | os.PathLike[str], fp8: bool = False) -> str:
    """Write config.json, NUM_SHARDS safetensors shards with model.safetensors.index.json, and the
    tokenizer (tokenizer.json, tokenizer_config.json) into `directory`; return its path."""
    root = os.fspath(directory)
    os.makedirs(root, exist_ok=True)
    raw = dict(TINY_CONFIG)
    if fp8:
        raw["quantization_config"] = FP8_QUANTIZATION
    weights = dict(random_weights(ModelConfig.from_dict(raw), SEED))
    save_sharded(root, weights)
    write_config_and_tokenizer(root, raw)
    return root


def tiny_checkpoint(cache_dir: str | None = None) -> str:
    """The built-in tiny checkpoint's directory, written on first use under `cache_dir` (default
    $EP_LAYER_CACHE, else ~/.cache/ep-layer), keyed by this file's source so that a change rewrites it;
    a temporary directory if the cache is not writable."""
    with open(__file__, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:12]
    root = cache_dir or os.environ.get("EP_LAYER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ep-layer")
    target = os.path.join(root, f"{TINY_PREFIX}-{key}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{TINY_PREFIX}-", dir=root)
    except OSError:
        return write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"{TINY_PREFIX}-"))
    write_tiny_checkpoint(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_v3_shaped(directory: str | os.PathLike[str], num_layers: int) -> str:
    """A DeepSeek-V3-shaped model directory without weights: V3's config.json at `num_layers` layers
    (the first dense, the others MoE at V3's real widths, FP8) and the tiny tokenizer; serve it with
    `--load-format dummy` (random weights made on the device). Returns its path."""
    if num_layers < 2:
        raise ValueError(f"num_layers: expected >= 2 (one dense layer, then MoE layers), got {num_layers}")
    root = os.fspath(directory)
    os.makedirs(root, exist_ok=True)
    write_config_and_tokenizer(root, V3_CONFIG | {"num_hidden_layers": num_layers, "first_k_dense_replace": 1})
    return root


def write_config_and_tokenizer(root: str, raw: dict[str, Any]) -> None:
    """config.json from `raw`, and the tiny tokenizer (tokenizer.json, tokenizer_config.json with
    CHAT_TEMPLATE)."""
    with open(os.path.join(root, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2, ensure_ascii=False)
        f.write("\n")
    tokenizer = build_tokenizer()
    tokenizer.save(os.path.join(root, "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
                        "eos_token": EOS_TOKEN, "add_bos_token": True, "add_eos_token": False,
                        "model_max_length": raw["max_position_embeddings"], "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(root, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
        f.write("\n")


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
    parser.add_argument("--v3-shaped-layers", type=int, default=None, metavar="N",
                        help="instead: DeepSeek-V3's config at N layers with no weights, to serve with "
                             "--load-format dummy")
    args = parser.parse_args(argv)
    if args.v3_shaped_layers is not None:
        path = write_v3_shaped(args.directory, args.v3_shaped_layers)
        print(f"wrote a {args.v3_shaped_layers}-layer DeepSeek-V3-shaped config and tokenizer to {path}")
        return
    path = write_tiny_checkpoint(args.directory, fp8=args.fp8)
    print(f"wrote the tiny DeepSeek-V3 {'FP8' if args.fp8 else 'BF16'} checkpoint to {path}")


if __name__ == "__main__":
    main()

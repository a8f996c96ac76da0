"""serving's DeepSeek-V3 model (config, RoPE/YaRN, MLA over the paged latent cache, loader, tiny
checkpoint) on CPU against transformers 5's DeepseekV3ForCausalLM loaded from the same directory.

Every comparison runs scripted steps through our paged cache (block size 4, scattered blocks):
whole prompts of two sequences in one step, and chunked prefill + a mixed prefill/decode step +
token-by-token decode of two sequences; transformers runs each whole sequence in one forward.
Error = max |ours - ref| / (|ref| + rms(ref)) per logits row.

- Routing flips: FusedMoE routes the bf16-rounded hidden state, transformers the float32 one, so a
  near-tie between two experts can go either way (about 1 token-layer in 300 for BF16). Such a
  token's output differs by O(1) and both are right. Each test records every MoE layer's choice on
  both sides, allows flips at up to 5% of positions, and holds the rest to the tolerance, except
  the later positions of a sequence with a flip before its last MoE layer (they attend to its KV).
- BF16 checkpoint: transformers in float32, unmodified; ours in float32 except inside FusedMoE,
  which takes and returns bf16 and rounds a few times inside (tests/test_moe.py). 2**-5 (0.008 seen).
- The model in bf16, as serving runs it, against the same reference: 2**-4 (0.023 seen).
- FP8 checkpoint: transformers cannot load block-FP8 on CPU, so the reference loads a float32 copy
  whose weights are the e4m3 values times their block scales (exact in float32: serving_model_helpers.
  dequantised_copy). Our FP8 MoE also casts activations to e4m3 (dispatch, down GEMM), 2**-4
  relative each, which transformers does not. So (1) with transformers' MoE modules replaced by our
  FusedMoE, everything else must agree to float32 precision: median error <= 1e-4 (1e-6 seen), every
  row <= 2**-4 (0.0015 seen; a hidden value a float32 ulp away can land on the next e4m3 code);
  (2) against plain transformers the relative RMS error must stay under 2**-3 (0.040 seen), with the
  same greedy token at 75% of positions or more (29 of 30 seen). The FP8 weights themselves must
  equal the dequantised copy's exactly.
- EP = 2 (gloo ranks, reference backend) equals EP = 1 bit for bit: every step's batch is the same
  and FusedMoE's per-token results do not depend on what else is in the batch on CPU.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from dist_harness import run_ranks
from serving_model_helpers import (
    MIXED_SCRIPT,
    OTHER_SCRIPT,
    Key,
    PagedRunner,
    RoutingRecorder,
    Step,
    dequantised_copy,
    ep_rank,
    read_checkpoint,
    rewrite_checkpoint,
    script_tokens,
)

from serving.engine.engine_config import MOE_OVERLAPS
from serving.forward_batch import ForwardBatch
from serving.loading.checkpoint import CheckpointError, load_checkpoint, load_tensors, read_tokenizer
from serving.model_config import ConfigError, ModelConfig
from serving.models.rotary import RotaryEmbedding, inv_freq_and_attention_factor, softmax_scale
from serving.tiny_model import TINY_CONFIG, V3_CONFIG, main, write_tiny_checkpoint

TOL_HF = 2.0 ** -5
TOL_HF_BF16_MODEL = 2.0 ** -4
TOL_HF_FP8_HYBRID = 2.0 ** -4
TYPICAL_FP8_HYBRID = 1e-4
TOL_FP8_RMS = 2.0 ** -3
MAX_FLIP_FRACTION = 0.05
PREFILL_SCRIPT: list[Step] = [[(0, 19), (1, 13)]]  # two whole prompts in one step, logits at every position
SEED = 7



# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    bf16 = write_tiny_checkpoint(root / "bf16")
    fp8 = write_tiny_checkpoint(root / "fp8", fp8=True)
    return {"bf16": bf16, "fp8": fp8, "fp8-dequantised": dequantised_copy(fp8, str(root / "fp8-dequantised"))}


def hf_model(path: str) -> torch.nn.Module:
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()  # the MTP layer's tensors are "unexpected" to it
    transformers.utils.logging.disable_progress_bar()
    return DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def ours(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_checkpoint(path, backend="reference", max_tokens_per_rank=64, dtype=dtype, progress=False)


class FusedMoEForTransformers(torch.nn.Module):
    """Stands in for transformers' DeepseekV3MoE: our FusedMoE on the bf16-rounded input; records
    the experts it chooses per position of the current sequence."""

    def __init__(self, fused: torch.nn.Module, chosen: dict[Key, list[int]], current: list[int]) -> None:
        super().__init__()
        self.fused, self.chosen, self.current = fused, chosen, current

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1]).to(torch.bfloat16)
        experts = self.fused.route(flat)[0].sort(dim=1).values.tolist()
        self.chosen.update(((self.current[0], p), e) for p, e in enumerate(experts))
        return self.fused(flat).to(hidden.dtype).view(hidden.shape)


def reference(hf: torch.nn.Module, tokens: dict[int, list[int]], fused_from: torch.nn.Module | None = None) -> Run:
    """transformers' logits at every position of every sequence (each run whole, no cache), and the
    experts its MoE layers chose; with `fused_from`, its MoE modules are that model's FusedMoE."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    chosen: dict[int, dict[Key, list[int]]] = {}
    current = [0]
    for i, layer in enumerate(hf.model.layers):
        if not isinstance(layer.mlp, DeepseekV3MoE | FusedMoEForTransformers):
            continue
        chosen[i] = {}
        if fused_from is not None:
            layer.mlp = FusedMoEForTransformers(fused_from.model.layers[i].mlp, chosen[i], current)
        else:
            def record(module, args, out, table=chosen[i]) -> None:
                table.update(((current[0], p), e) for p, e in enumerate(out[2].sort(dim=1).values.tolist()))
            layer.mlp.gate.register_forward_hook(record)
    logits = {}
    with torch.no_grad():
        for seq, ids in tokens.items():
            current[0] = seq
            rows = hf(torch.tensor([ids])).logits[0]
            logits.update(((seq, p), row) for p, row in enumerate(rows))
    return Run(logits, chosen)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs() / (want.abs() + want.pow(2).mean().sqrt())).max().item()


@dataclass
class Run:
    """Logits per (sequence, position) and the experts each MoE layer chose per (sequence, position)."""

    logits: dict[Key, torch.Tensor]
    routing: dict[int, dict[Key, list[int]]]


def run_ours(model: torch.nn.Module, script: list[Step], all_logits: bool) -> tuple[Run, dict[int, list[int]]]:
    """`script` through our paged cache; also returns the token ids of its sequences."""
    tokens = script_tokens(script, model.config.vocab_size, SEED)
    recorder = RoutingRecorder(model)
    logits = PagedRunner(model, tokens, routing=recorder).run(script, all_logits=all_logits)
    return Run(logits, recorder.chosen), tokens


def compare(got: Run, want: Run, tol: float, what: str, typical: float | None = None) -> float:
    """Hold every logits row to `tol` (and, with `typical`, at least half of them to that) except
    where routing flipped (see the module docstring): at a flipped position, and, when the flip was
    in a MoE layer before the last, at the later positions of its sequence, whose attention reads
    that token's changed KV. Returns the worst error of the rows held to `tol`."""
    assert got.routing.keys() == want.routing.keys(), what
    last = max(got.routing)
    flipped: set[Key] = set()
    tainted_from: dict[int, int] = {}
    for layer, chosen in got.routing.items():
        for key, experts in chosen.items():
            if experts != want.routing[layer][key]:
                flipped.add(key)
                if layer != last:
                    tainted_from[key[0]] = min(key[1], tainted_from.get(key[0], key[1]))
    positions = len(got.routing[last])
    assert len(flipped) <= max(1, MAX_FLIP_FRACTION * positions), f"{what}: routing differs at {sorted(flipped)}"
    errors = {}
    for key, row in got.logits.items():
        assert torch.isfinite(row).all(), f"{what}: non-finite logits at {key}"
        if key not in flipped and key[1] < tainted_from.get(key[0], key[1] + 1):
            errors[key] = relative_error(row, want.logits[key])
    assert len(errors) >= len(got.logits) // 2, f"{what}: too few positions routed alike ({len(errors)})"
    worst_key = max(errors, key=errors.get)
    assert errors[worst_key] <= tol, f"{what}: (sequence, position) {worst_key}: relative error " \
                                     f"{errors[worst_key]:.2e} > {tol}"
    if typical is not None:
        median = sorted(errors.values())[len(errors) // 2]
        assert median <= typical, f"{what}: median relative error {median:.2e} > {typical}"
    return errors[worst_key]


# ---------------------------------------------------------------------------- config
def test_config_reads_deepseek_v3() -> None:
    c = ModelConfig.from_dict(V3_CONFIG)
    assert c.kv_cache_dim == 576 and c.qk_head_dim == 192 and c.fp8 and c.q_lora_rank == 1536
    assert c.quantization_config is not None and c.quantization_config.weight_block_size == (128, 128)
    assert c.rope_scaling is not None and c.rope_scaling.factor == 40 and c.rope_scaling.mscale_all_dim == 1.0
    assert c.rope_scaling.original_max_position_embeddings == 4096 and c.rope_theta == 10000.0
    assert (c.bos_token_id, c.eos_token_ids, c.torch_dtype) == (0, (1,), "bfloat16")
    assert [c.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert c.num_nextn_predict_layers == 1 and c.rope_interleave
    lite = ModelConfig.from_dict(V3_CONFIG | {"q_lora_rank": None, "eos_token_id": [1, 2], "rope_scaling": None})
    assert lite.q_lora_rank is None and lite.eos_token_ids == (1, 2) and lite.rope_scaling is None
    # transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_scaling
    params = dict(V3_CONFIG["rope_scaling"], rope_type="yarn", rope_theta=5000.0)
    moved = ModelConfig.from_dict({k: v for k, v in V3_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
                                  | {"rope_parameters": params})
    assert moved.rope_scaling == c.rope_scaling and moved.rope_theta == 5000.0


@pytest.mark.parametrize(("change", "match"), [
    ({"hidden_size": None}, "'hidden_size': missing"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers': expected an int >= 1, got 0"),
    ({"kv_lora_rank": 512.0}, "'kv_lora_rank': expected an int"),
    ({"q_lora_rank": "1536"}, "'q_lora_rank': expected an int"),
    ({"n_group": 7}, "'n_group': expected a divisor of n_routed_experts=256, got 7"),
    ({"topk_group": 9}, "'topk_group': expected at most n_group=8"),
    ({"num_experts_per_tok": 200}, "'num_experts_per_tok': expected at most 128"),
    ({"first_k_dense_replace": 62}, "'first_k_dense_replace': expected at most num_hidden_layers=61"),
    ({"qk_rope_head_dim": 63}, "'qk_rope_head_dim': expected an even number"),
    ({"routed_scaling_factor": -1}, "'routed_scaling_factor': expected a positive number"),
    ({"model_type": "llama"}, "'model_type': expected 'deepseek_v3', got 'llama'"),
    ({"hidden_act": "gelu"}, "'hidden_act': expected 'silu'"),
    ({"tie_word_embeddings": True}, "'tie_word_embeddings': expected false"),
    ({"eos_token_id": 200000}, "'eos_token_id': expected ids < vocab_size=129280"),
    ({"torch_dtype": "int8"}, "'torch_dtype': expected one of"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "'rope_scaling.type': expected 'yarn'"),
    ({"quantization_config": {"quant_method": "awq"}}, "'quantization_config.quant_method': expected 'fp8'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
     r"'quantization_config.weight_block_size': expected \[128, 128\], got \[64, 64\]"),
])
def test_config_errors(change: dict, match: str) -> None:
    raw = {k: v for k, v in (V3_CONFIG | change).items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_config_file_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in V3_CONFIG.items() if k != "q_lora_rank"}))
    with pytest.raises(ConfigError, match=r"config\.json: field 'q_lora_rank': missing"):
        ModelConfig.from_file(tmp_path)


# ---------------------------------------------------------------------------- RoPE / YaRN
@pytest.mark.parametrize("variant", ["v3", "tiny", "no-mscale", "no-yarn", "not-interleaved"])
def test_rope_matches_transformers(variant: str) -> None:
    """inv_freq, cos/sin factor, softmax scale and the rotation itself, bit for bit."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    raw = {"v3": V3_CONFIG, "tiny": TINY_CONFIG}.get(variant, TINY_CONFIG)
    if variant == "no-mscale":  # transformers then scales cos/sin by mscale(factor) and not the softmax
        raw = raw | {"rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}}
    elif variant == "no-yarn":
        raw = raw | {"rope_scaling": None}
    elif variant == "not-interleaved":
        raw = raw | {"rope_interleave": False}
    config = ModelConfig.from_dict(raw)
    hf_config = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("quantization_config", "architectures")})
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        want_freq, want_factor = hf.DeepseekV3RotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        want_freq, want_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    inv_freq, factor = inv_freq_and_attention_factor(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(inv_freq, want_freq) and factor == want_factor
    # DeepseekV3Attention's scaling (built without its weights, which are V3-sized)
    assert softmax_scale(config) == hf.yarn_apply_mscale(hf_config.rope_parameters, config.qk_head_dim ** -0.5)

    positions = torch.tensor([0, 1, 7, 300, 5000, 160000])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 3, config.qk_rope_head_dim, generator=gen)
    k = torch.randn(len(positions), 1, config.qk_rope_head_dim, generator=gen)
    cos, sin = hf.DeepseekV3RotaryEmbedding(hf_config)(q, positions[None])
    apply = hf.apply_rotary_pos_emb_interleave if config.rope_interleave else hf.apply_rotary_pos_emb
    want_q, want_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = RotaryEmbedding(config)
    my_cos, my_sin = rope.cos_sin(positions, torch.float32)
    assert torch.equal(rope.rotate(q, my_cos, my_sin, config.rope_interleave), want_q[0].transpose(0, 1))
    assert torch.equal(rope.rotate(k, my_cos, my_sin, config.rope_interleave), want_k[0].transpose(0, 1))


# ---------------------------------------------------------------------------- logits vs transformers
SCRIPTS = pytest.mark.parametrize(("script", "all_logits"), [(PREFILL_SCRIPT, True), (MIXED_SCRIPT, False)],
                                  ids=["prefill", "paged-steps"])


@SCRIPTS
def test_bf16_checkpoint_matches_transformers(checkpoints: dict[str, str], script: list[Step],
                                              all_logits: bool) -> None:
    got, tokens = run_ours(ours(checkpoints["bf16"]), script, all_logits)
    compare(got, reference(hf_model(checkpoints["bf16"]), tokens), TOL_HF, "bf16 checkpoint")


def test_fp8_checkpoint_matches_transformers(checkpoints: dict[str, str]) -> None:
    """Chunked prefill, mixed and decode steps, with logits at every position (FP8 experts on CPU
    are slow: one script covers both prefill and decode)."""
    model = ours(checkpoints["fp8"])
    got, tokens = run_ours(model, MIXED_SCRIPT, all_logits=True)
    hybrid = reference(hf_model(checkpoints["fp8-dequantised"]), tokens, fused_from=model)
    compare(got, hybrid, TOL_HF_FP8_HYBRID, "fp8 checkpoint vs transformers with our FusedMoE",
            typical=TYPICAL_FP8_HYBRID)
    # Against transformers' own MoE: within FP8 activation-quantisation error.
    want = reference(hf_model(checkpoints["fp8-dequantised"]), tokens).logits
    keys = list(got.logits)
    diff = torch.stack([got.logits[k] - want[k] for k in keys]).double()
    rms = (diff.pow(2).mean() / torch.stack([want[k] for k in keys]).double().pow(2).mean()).sqrt().item()
    assert rms <= TOL_FP8_RMS, f"fp8 checkpoint: relative RMS error {rms:.4f} vs plain transformers"
    same = sum(int(got.logits[k].argmax() == want[k].argmax()) for k in keys)
    assert same >= 0.75 * len(keys), f"fp8 checkpoint: greedy token equal at {same} of {len(keys)} positions"


def test_fp8_weights_equal_dequantised_checkpoint(checkpoints: dict[str, str]) -> None:
    model = ours(checkpoints["fp8"])
    want = read_checkpoint(checkpoints["fp8-dequantised"])
    checked = 0
    checkpoint_names = model.state_dict()  # not the stacked q_a/kv_a weight, which the parts' names fill
    for name, module in model.named_modules():
        if hasattr(module, "dense_weight") and module.fp8 and f"{name}.weight" in checkpoint_names:
            assert torch.equal(module.dense_weight(torch.float32), want[f"{name}.weight"]), name
            checked += 1
    assert checked == 3 + 3 * 5  # the dense MLP of layer 0, the attention of layers 0 to 2
    experts = model.model.layers[1].mlp.experts
    for e in (0, 15):
        gate_up = experts.gate_up_fp32(e)
        assert torch.equal(gate_up[:64], want[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(gate_up[128:192], want[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])


def test_bf16_model_matches_transformers(checkpoints: dict[str, str]) -> None:
    """The model running in bf16, as serving does, against float32 transformers."""
    got, tokens = run_ours(ours(checkpoints["bf16"], torch.bfloat16), MIXED_SCRIPT, False)
    compare(got, reference(hf_model(checkpoints["bf16"]), tokens), TOL_HF_BF16_MODEL, "bf16 model")


def test_kv_cache_layout_matches_transformers(checkpoints: dict[str, str]) -> None:
    """The cache holds, per token and layer, transformers' cached latent (kv_a_layernorm'd c_kv) and
    RoPE'd k_pe, at the slot the block table gives."""
    model, hf = ours(checkpoints["bf16"]), hf_model(checkpoints["bf16"])
    tokens = script_tokens(PREFILL_SCRIPT, model.config.vocab_size, SEED)
    runner = PagedRunner(model, tokens)
    runner.run(PREFILL_SCRIPT)
    with torch.no_grad():
        output = hf(torch.tensor([tokens[1]]), use_cache=True)
    # transformers 5.24 (pinned for the tests) calls it `cache`; the GPU machine's 5.17, `past_key_values`
    cache = output.cache if hasattr(output, "cache") else output.past_key_values
    slots = torch.tensor([runner.slot(1, p) for p in range(len(tokens[1]))])
    assert model.kv_cache is not None and model.kv_cache.shape == (3, 40, 4, 96)
    for layer in range(model.config.num_hidden_layers):
        got = model.kv_cache[layer].view(-1, 96)[slots]
        want = torch.cat([cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]], dim=-1)
        # Layers 0 and 1 see no MoE output yet: float32 exact up to summation order.
        tol = 1e-5 if layer < 2 else TOL_HF
        assert relative_error(got, want) <= tol, f"layer {layer}"


# ---------------------------------------------------------------------------- expert parallelism
def test_ep2_equals_ep1(checkpoints: dict[str, str]) -> None:
    paths = {"bf16": checkpoints["bf16"], "fp8": checkpoints["fp8"]}
    scripts = [MIXED_SCRIPT, OTHER_SCRIPT]
    ep2 = run_ranks(ep_rank, 2, paths, scripts, torch.bfloat16)
    (ep1,) = run_ranks(ep_rank, 1, paths, scripts, torch.bfloat16)
    merged = {**ep2[0]["logits"], **ep2[1]["logits"]}
    assert merged.keys() == ep1["logits"].keys()
    for key, row in ep1["logits"].items():
        assert (row == merged[key]).all(), f"EP=2 differs from EP=1 at {key}"
    for kind in paths:  # every routed token reached an expert once, at EP=2 spread over both ranks
        assert [a + b for a, b in zip(ep2[0]["expert_load"][kind], ep2[1]["expert_load"][kind])] == \
            ep1["expert_load"][kind]
    for rank, result in enumerate(ep2):  # each rank read its own experts and no MTP tensor
        read = [n for n in result["read"] if ".mlp.experts." in n]
        experts = {int(n.split(".")[5]) for n in read}
        assert experts == set(range(8 * rank, 8 * rank + 8)), f"rank {rank} read experts {sorted(experts)}"
        assert not [n for n in result["read"] if n.startswith("model.layers.3.")], f"rank {rank} read MTP"
    assert {int(n.split(".")[5]) for n in ep1["read"] if ".mlp.experts." in n} == set(range(16))


# ---------------------------------------------------------------------------- forward edge cases
def test_empty_batch_and_batch_errors(checkpoints: dict[str, str]) -> None:
    model = ours(checkpoints["bf16"])
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model(ForwardBatch.empty())
    cache = model.allocate_kv_cache(8, 4)
    assert cache.shape == (3, 8, 4, 96) and model.kv_cache_bytes_per_block(4) == 3 * 4 * 96 * 4
    logits = model(ForwardBatch.empty())
    assert logits.shape == (0, 512) and logits.dtype == torch.float32 and not cache.any()
    runner = PagedRunner(model, {0: list(range(2, 80))}, num_blocks=30)
    batch, _ = runner.batch([(0, 65)])
    with pytest.raises(ValueError, match="65 tokens, expected at most max_tokens_per_rank=64"):
        model(batch)
    runner = PagedRunner(model, {0: list(range(2, 20))})
    batch, _ = runner.batch([(0, 6)])
    bad = ForwardBatch(**{**vars(batch), "positions": batch.positions.int()})
    with pytest.raises(ValueError, match=r"batch.positions: expected torch.int64 \[6\]"):
        model(bad)
    batch.block_tables[0, 1] = -1
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[:2\]"):
        model(batch)


# ---------------------------------------------------------------------------- loader
TINY_FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _drop(name: str) -> Callable[[dict], None]:
    return lambda t: t.pop(name)


def _set(name: str, value: torch.Tensor) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(("kind", "edit", "config_edit", "match"), [
    ("bf16", _drop("model.layers.0.self_attn.kv_b_proj.weight"), None,
     r"1 tensor\(s\) missing from the checkpoint: model.layers.0.self_attn.kv_b_proj.weight"),
    ("bf16", _drop("model.layers.2.mlp.experts.5.up_proj.weight"), None,
     r"model.layers.2.mlp: load_weights: 1 tensor\(s\) missing: experts.5.up_proj.weight"),
    ("bf16", _set("model.layers.1.self_attn.o_proj.weight", torch.zeros(256, 64)), None,
     r"model.layers.1.self_attn.o_proj.weight: expected shape \[256, 128\], got \[256, 64\]"),
    ("bf16", _set("model.layers.1.mlp.experts.3.down_proj.weight", torch.zeros(256, 32)), None,
     r"model.layers.1.mlp: load_weights: experts.3.down_proj.weight: expected shape \[256, 64\], got \[256, 32\]"),
    ("bf16", _set("model.layers.0.self_attn.rotary.inv_freq", torch.zeros(16)), None,
     "unexpected tensor model.layers.0.self_attn.rotary.inv_freq"),
    ("bf16", _set("model.layers.7.input_layernorm.weight", torch.zeros(256)), None,
     "unexpected tensor model.layers.7.input_layernorm.weight .layer 7: the config has num_hidden_layers=3"),
    ("bf16", _set("model.layers.1.mlp.experts.16.up_proj.weight", torch.zeros(64, 256)), None,
     "expert 16 does not exist"),
    ("bf16", _set("lm_head.weight", torch.zeros(512, 256, dtype=torch.int8)), None,
     "lm_head.weight: expected a bf16, fp16 or fp32 tensor, got torch.int8"),
    ("fp8", None, lambda c: c.pop("quantization_config"),
     "expected a bf16, fp16 or fp32 tensor, got torch.float8_e4m3fn .an FP8 checkpoint"),
    ("bf16", None, lambda c: c.__setitem__("quantization_config", TINY_FP8_QUANT),
     r"expected dtype torch.float8_e4m3fn \(config.json has an FP8 quantization_config\), got torch.bfloat16"),
    ("bf16", None, lambda c: c.__setitem__("num_hidden_layers", 2),  # layer 2 becomes the MTP layer
     "unexpected tensor model.layers.3"),
])
def test_loader_errors(checkpoints: dict[str, str], tmp_path, kind: str, edit, config_edit, match: str) -> None:
    path = rewrite_checkpoint(checkpoints[kind], str(tmp_path / "broken"), edit, config_edit)
    with pytest.raises(CheckpointError, match=match):
        ours(path)


def test_loader_file_errors(checkpoints: dict[str, str], tmp_path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["bf16"], path)
    os.remove(path / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors: listed in .* but missing"):
        ours(str(path))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    moved = next(n for n, f in index["weight_map"].items() if f == "model-00001-of-00003.safetensors")
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != "model-00002-of-00003.safetensors"}
    index["weight_map"][moved] = "model-00003-of-00003.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{moved}: model.safetensors.index.json puts it in "
                                              "model-00003-of-00003.safetensors, which does not hold it"):
        ours(str(path))
    os.remove(path / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors\.index\.json or model\.safetensors"):
        ours(str(path))
    os.remove(path / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: no such file"):
        read_tokenizer(path)
    with pytest.raises(ConfigError, match="no such file"):
        ours(str(tmp_path / "nowhere"))


def test_load_tensors_duplicates_and_single_file(checkpoints: dict[str, str], tmp_path) -> None:
    from safetensors.torch import save_file

    tensors = read_checkpoint(checkpoints["bf16"])
    model = ours(checkpoints["bf16"])
    name = "model.norm.weight"
    with pytest.raises(CheckpointError, match=f"{name}: given twice"):
        load_tensors(model, [(name, tensors[name]), (name, tensors[name])])
    # One model.safetensors, tensors in another order: the same model.
    single = tmp_path / "single"
    single.mkdir()
    save_file(dict(reversed(tensors.items())), single / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(os.path.join(checkpoints["bf16"], "config.json"), single)
    other = ours(str(single))
    for (n, a), (m, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert n == m and torch.equal(a, b), n


# ---------------------------------------------------------------------------- tiny model and tokenizer
def test_tiny_checkpoint_is_deterministic(checkpoints: dict[str, str], tmp_path, capsys) -> None:
    main([str(tmp_path / "again")])
    assert "wrote the tiny DeepSeek-V3 BF16 checkpoint" in capsys.readouterr().out
    first = sorted(os.listdir(checkpoints["bf16"]))
    assert first == sorted(os.listdir(tmp_path / "again"))
    assert sum(f.endswith(".safetensors") for f in first) == 3
    for file in first:
        with open(os.path.join(checkpoints["bf16"], file), "rb") as a, open(tmp_path / "again" / file, "rb") as b:
            assert a.read() == b.read(), file
    config = ModelConfig.from_file(checkpoints["fp8"])
    assert config.fp8 and config.first_k_dense_replace == 1 and config.num_hidden_layers == 3


def test_tiny_tokenizer(checkpoints: dict[str, str]) -> None:
    tokenizer = read_tokenizer(checkpoints["bf16"])
    config = ModelConfig.from_file(checkpoints["bf16"])
    assert tokenizer.get_vocab_size() == config.vocab_size == 512
    assert tokenizer.id_to_token(config.bos_token_id) == "<｜begin▁of▁sentence｜>"  # noqa: RUF001
    assert tokenizer.id_to_token(config.eos_token_ids[0]) == "<｜end▁of▁sentence｜>"  # noqa: RUF001
    text = "Hello, experts! 42 tokens travel to their ranks; ünïcödé too."
    ids = tokenizer.encode(text).ids
    assert ids[0] == config.bos_token_id and len(ids) < len(text)
    assert tokenizer.decode(ids) == text


# ---------------------------------------------------------------------------- random weights, dummy loading
def test_weight_specs_count_deepseek_v3_parameters() -> None:
    """Every tensor of the real checkpoint: with the FP8 block scales, the total is the parameter count
    deepseek-ai/DeepSeek-V3 publishes for its safetensors (684,531,386,000)."""
    from serving.random_weights import is_fp8_weight, weight_specs

    total = 0
    for spec in weight_specs(ModelConfig.from_dict(V3_CONFIG)):
        total += math.prod(spec.shape)
        if is_fp8_weight(spec.name):
            total += math.ceil(spec.shape[0] / 128) * math.ceil(spec.shape[1] / 128)
    assert total == 684_531_386_000


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_dummy_load_format(checkpoints: dict[str, str], kind: str) -> None:
    """Random weights of the checkpoint's shapes and dtypes, the same for the same seed, unlike the
    checkpoint's; the model runs."""
    path = checkpoints[kind]
    dummy = load_checkpoint(path, backend="reference", max_tokens_per_rank=64, progress=False, load_format="dummy")
    again = load_checkpoint(path, backend="reference", max_tokens_per_rank=64, progress=False, load_format="dummy")
    real = load_checkpoint(path, backend="reference", max_tokens_per_rank=64, progress=False)
    got, same, want = dummy.state_dict(), again.state_dict(), real.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], same[name]), name
    w = "model.layers.1.self_attn.q_b_proj.weight"
    assert (got[w].dtype == torch.float8_e4m3fn) == (kind == "fp8")
    assert not torch.equal(got[w].float(), want[w].float())
    logits = PagedRunner(dummy, {0: list(range(2, 12))}).run([[(0, 10)]])
    assert all(torch.isfinite(v).all() for v in logits.values())
    with pytest.raises(ValueError, match="load_format"):
        load_checkpoint(path, load_format="npz")


def test_v3_shaped_directory(tmp_path) -> None:
    from serving.tiny_model import write_v3_shaped

    path = write_v3_shaped(tmp_path / "v3", 4)
    config = ModelConfig.from_dict(json.loads((tmp_path / "v3" / "config.json").read_text()))
    assert (config.num_hidden_layers, config.first_k_dense_replace, config.hidden_size) == (4, 1, 7168)
    assert config.fp8 and config.n_routed_experts == 256
    assert read_tokenizer(path).encode("hello").ids
    with pytest.raises(ValueError, match="num_layers"):
        write_v3_shaped(tmp_path / "v3-1", 1)


# ---------------------------------------------------------------------------- normal (high-throughput) mode
TOL_NORMAL_MODE = 2.0 ** -6  # normal vs low-latency: each rank's partial expert sum rounded to bf16 once more


def normal_mode_rank(rank: int, world: int, path: str, dtype: torch.dtype) -> dict[str, object]:
    """One prefill step of this rank's prompt, run through both dispatch modes (the step writes the same
    KV slots each time), and then, in a step of more tokens than T (which only normal mode takes), the
    same prompt again beside a longer one."""
    import torch.distributed as dist

    from serving.engine.engine import LLMEngine
    from serving.engine.sequence import SamplingParams

    model = load_checkpoint(path, group=dist.group.WORLD, backend="reference", max_tokens_per_rank=24, dtype=dtype,
                       progress=False, normal_mode=True)
    engine = LLMEngine(model, read_tokenizer(path), num_blocks=64, block_size=16, max_model_len=128,
                       max_num_seqs=4, max_tokens_per_rank=24, device=torch.device("cpu"), token_budget=64,
                       deepep_mode="auto")
    gen = torch.Generator().manual_seed(SEED + rank)
    engine.add_request("a", torch.randint(3, 500, ({0: 20, 1: 6}[rank],), generator=gen).tolist(),
                       SamplingParams(max_tokens=1))
    batch = engine.schedule()
    logits = {mode: engine.runner.execute(batch, moe_mode=mode) for mode in ("low_latency", "normal")}
    engine.add_request("b", torch.randint(3, 500, (40,), generator=gen).tolist(), SamplingParams(max_tokens=1))
    large = engine.schedule()
    big = engine.runner.execute(large, moe_mode="normal")
    with pytest.raises(ValueError, match=r"batch: \d+ tokens, expected at most max_tokens_per_rank=24"):
        engine.runner.execute(large, moe_mode="low_latency")  # all ranks raise before any dispatch
    # "a" again, beside "b": its last token's logits as in the low-latency step (tokens never mix).
    return {"error": relative_error(logits["normal"], logits["low_latency"]), "big_tokens": large.num_tokens,
            "big_error": relative_error(big[:1], logits["low_latency"])}


def test_normal_mode_step_matches_low_latency(checkpoints: dict[str, str]) -> None:
    results = run_ranks(normal_mode_rank, 2, checkpoints["bf16"], torch.float32)
    for rank, r in enumerate(results):
        assert r["error"] <= TOL_NORMAL_MODE, f"rank {rank}: relative error {r['error']:.2e}"
        assert r["big_tokens"] > 24 and r["big_error"] <= TOL_NORMAL_MODE, r


# ---------------------------------------------------------------------------- the MoE layers' overlap
def overlap_rank(rank: int, world: int, path: str) -> dict[str, object]:
    """One prefill step of this rank's prompt (rank 1's holds one token) on the model loaded with each
    moe_overlap: the logits, and the MoE layers' `overlap`."""
    import torch.distributed as dist

    from serving.engine.engine import LLMEngine
    from serving.engine.sequence import SamplingParams

    gen = torch.Generator().manual_seed(SEED + rank)
    prompt = torch.randint(3, 500, ({0: 13, 1: 1}[rank],), generator=gen).tolist()
    logits, overlaps = {}, {}
    for mode in MOE_OVERLAPS:
        model = load_checkpoint(path, group=dist.group.WORLD, backend="reference", max_tokens_per_rank=16,
                                dtype=torch.float32, progress=False, moe_overlap=mode)
        engine = LLMEngine(model, read_tokenizer(path), num_blocks=16, block_size=16, max_model_len=64,
                           max_num_seqs=2, max_tokens_per_rank=16, device=torch.device("cpu"))
        engine.add_request("a", prompt, SamplingParams(max_tokens=1))
        logits[mode] = engine.runner.execute(engine.schedule()).numpy().copy()
        overlaps[mode] = {layer.mlp.overlap for layer in model.model.layers if layer.is_moe}
    return {"logits": logits, "overlaps": overlaps}


def test_every_moe_overlap_serves_the_plain_logits(checkpoints: dict[str, str]) -> None:
    """--moe-overlap reaches every MoE layer, and each mode's step gives the plain forward's logits bit for bit
    (EP = 2, one rank with a single token)."""
    for rank, r in enumerate(run_ranks(overlap_rank, 2, checkpoints["bf16"])):
        for mode in MOE_OVERLAPS:
            assert r["overlaps"][mode] == {mode}, (rank, mode)
            assert np.array_equal(r["logits"][mode], r["logits"]["none"]), f"rank {rank}: {mode} differs"

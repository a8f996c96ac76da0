"""`ModelConfig`: a DeepSeek-V3 architecture as an HF `config.json` describes it, checked on the way in.

Every field the model needs is read here once; a missing or invalid field is a `ConfigError` that
names it, says what was expected and what was given. Defaults follow transformers' DeepseekV3Config
only where real checkpoints may leave a field out (token ids, eps, rope_theta, quantization).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

FP8_WEIGHT_BLOCK = (128, 128)  # the only block size the FP8 kernels (and ep_layer.moe) support
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
AUTO_DTYPE = "auto"  # vLLM's --dtype default: the checkpoint's (ModelConfig.serving_dtype)
QUANTIZATION_METHODS = ("fp8",)  # vLLM's --quantization names this code runs: DeepSeek-V3's block FP8

_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace",
                  "max_position_embeddings")
_POSITIVE = set(_REQUIRED_INTS) - {"first_k_dense_replace"}


class ConfigError(ValueError):
    """A config.json field is missing or has a value this model cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN (`rope_scaling` with type "yarn"), with transformers' defaults and derived values resolved:
    factor (None -> max_position_embeddings / original), beta_fast 32, beta_slow 1, truncate True.
    mscale, mscale_all_dim and attention_factor stay None when the config leaves them out, because
    transformers treats absence differently from any value (see serving.models.rotary)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class QuantizationConfig:
    """DeepSeek-V3's FP8 checkpoints: e4m3 linear weights with float32 `weight_scale_inv` per 128x128 block."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = FP8_WEIGHT_BLOCK


@dataclass(frozen=True)
class ModelConfig:
    """What DeepseekV3ForCausalLM needs from an HF DeepSeek-V3 config.json (same field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP of the first `first_k_dense_replace` layers
    moe_intermediate_size: int  # one routed (and, times n_shared_experts, the shared) expert
    num_hidden_layers: int  # without the multi-token-prediction layer(s), which we skip
    num_attention_heads: int
    q_lora_rank: int | None  # None: q_proj straight from hidden (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's eos_token_id, an int or a list
    torch_dtype: str
    quantization_config: QuantizationConfig | None
    rope_interleave: bool = True  # RoPE on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek does
    num_nextn_predict_layers: int = 1  # MTP layers in the checkpoint (model.layers.{num_hidden_layers + i})

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token and layer: the latent c_kv and the RoPE'd shared key k_pe (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def fp8(self) -> bool:
        """True for FP8 block-quantised checkpoints (linear weights e4m3 + weight_scale_inv)."""
        return self.quantization_config is not None

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    # ------------------------------------------------------------------ serving options
    def serving_dtype(self, requested: str = AUTO_DTYPE) -> str:
        """The dtype of activations and unquantised weights for vLLM's --dtype `requested`. "auto" is
        torch_dtype, but bfloat16 for float32 checkpoints (vLLM downcasts those to the device's preferred
        dtype) and for FP8 ones. FP8 block weights run with bfloat16 or float32 activations: their GEMMs
        and the MoE layers' dispatch work in bfloat16, which float16 activations would overflow."""
        if requested == AUTO_DTYPE:
            return "bfloat16" if self.fp8 or self.torch_dtype == "float32" else self.torch_dtype
        if requested not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype: expected {AUTO_DTYPE!r} or one of {SUPPORTED_DTYPES}, got {requested!r}")
        if self.fp8 and requested == "float16":
            raise ConfigError("dtype 'float16': this checkpoint's FP8 block weights run with bfloat16 activations "
                              "(the FP8 GEMMs and the MoE dispatch work in bfloat16); use bfloat16, or float32")
        return requested

    def check_quantization(self, requested: str | None) -> None:
        """vLLM's --quantization against this checkpoint: None takes what config.json says; "fp8" needs an
        FP8 checkpoint (weights are never quantised at load here); other methods are not supported."""
        if requested is None:
            return
        if requested not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization {requested!r}: not supported (DeepSeek-V3 checkpoints run unquantised "
                              f"or in block FP8, {QUANTIZATION_METHODS[0]!r}, which config.json's "
                              f"quantization_config announces)")
        if not self.fp8:
            raise ConfigError(f"quantization {requested!r}: this checkpoint is not FP8 (config.json has no "
                              f"quantization_config) and weights are not quantised at load; leave --quantization "
                              f"out to serve it in its dtype")

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read `config.json` (or the config.json of a checkpoint directory)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file (a checkpoint directory needs a config.json)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse and check an HF DeepSeek-V3 config dict."""
        if not isinstance(raw, dict):
            raise ConfigError(f"expected a JSON object, got {type(raw).__name__}")
        _check_choice(raw, "model_type", ("deepseek_v3",), required=True)
        _check_choice(raw, "hidden_act", ("silu",))
        _check_choice(raw, "topk_method", ("noaux_tc",))
        _check_choice(raw, "scoring_func", ("sigmoid",))
        for flag in ("tie_word_embeddings", "attention_bias"):
            if raw.get(flag):
                raise ConfigError(f"field {flag!r}: expected false (DeepSeek-V3 has none), got {raw[flag]!r}")
        ints = {name: _int(raw, name, low=1 if name in _POSITIVE else 0) for name in _REQUIRED_INTS}
        if "q_lora_rank" not in raw:
            raise ConfigError("field 'q_lora_rank': missing (give null for a model without a query LoRA)")
        q_lora_rank = None if raw["q_lora_rank"] is None else _int(raw, "q_lora_rank", low=1)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(_is_int(i) and i >= 0 for i in eos_ids):
            raise ConfigError(f"field 'eos_token_id': expected a token id or a list of them, got {eos!r}")
        rope_theta, rope_scaling = _rope(raw, ints["max_position_embeddings"])
        config = cls(
            **ints, q_lora_rank=q_lora_rank,
            n_shared_experts=_int(raw, "n_shared_experts", low=0),
            routed_scaling_factor=_float(raw, "routed_scaling_factor", positive=True),
            norm_topk_prob=_bool(raw, "norm_topk_prob", True),
            rms_norm_eps=_float(raw, "rms_norm_eps", positive=True, default=1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            bos_token_id=None if raw.get("bos_token_id") is None else _int(raw, "bos_token_id", low=0),
            eos_token_ids=eos_ids,
            torch_dtype=_dtype(raw),
            quantization_config=_quantization(raw.get("quantization_config")),
            rope_interleave=_bool(raw, "rope_interleave", True),
            num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", low=0, default=1),
        )
        config._check_consistency()
        return config

    def _check_consistency(self) -> None:
        e, g = self.n_routed_experts, self.n_group
        if e % g:
            raise ConfigError(f"field 'n_group': expected a divisor of n_routed_experts={e}, got {g}")
        if self.topk_group > g:
            raise ConfigError(f"field 'topk_group': expected at most n_group={g}, got {self.topk_group}")
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise ConfigError(f"field 'num_experts_per_tok': expected at most {self.topk_group * (e // g)} (the "
                              f"experts of topk_group groups), got {self.num_experts_per_tok}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"field 'first_k_dense_replace': expected at most num_hidden_layers="
                              f"{self.num_hidden_layers}, got {self.first_k_dense_replace}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"field 'qk_rope_head_dim': expected an even number (RoPE rotates pairs), "
                              f"got {self.qk_rope_head_dim}")
        if self.bos_token_id is not None and self.bos_token_id >= self.vocab_size:
            raise ConfigError(f"field 'bos_token_id': expected < vocab_size={self.vocab_size}, got {self.bos_token_id}")
        bad_eos = [i for i in self.eos_token_ids if i >= self.vocab_size]
        if bad_eos:
            raise ConfigError(f"field 'eos_token_id': expected ids < vocab_size={self.vocab_size}, got {bad_eos}")


# ---------------------------------------------------------------------------- field readers
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(raw: dict[str, Any], name: str, *, low: int, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"field {name!r}: missing (expected an int >= {low})")
    if not _is_int(value) or value < low:
        raise ConfigError(f"field {name!r}: expected an int >= {low}, got {value!r}")
    return value


def _float(raw: dict[str, Any], name: str, *, positive: bool, default: float | None = None) -> float:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"field {name!r}: missing (expected a number)")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise ConfigError(f"field {name!r}: expected a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _bool(raw: dict[str, Any], name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"field {name!r}: expected true or false, got {value!r}")
    return value


def _check_choice(raw: dict[str, Any], name: str, choices: tuple[str, ...], required: bool = False) -> None:
    if name not in raw and not required:
        return
    if raw.get(name) not in choices:
        raise ConfigError(f"field {name!r}: expected {' or '.join(map(repr, choices))}, got {raw.get(name)!r}")


def _dtype(raw: dict[str, Any]) -> str:
    value = raw.get("torch_dtype", raw.get("dtype", "bfloat16"))
    if value not in SUPPORTED_DTYPES:
        raise ConfigError(f"field 'torch_dtype': expected one of {SUPPORTED_DTYPES}, got {value!r}")
    return value


def _rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and YaRN from `rope_scaling` (+ `rope_theta`), or from transformers 5's `rope_parameters`."""
    params = raw.get("rope_scaling")
    source = "rope_scaling"
    if params is None and raw.get("rope_parameters") is not None:
        params, source = raw["rope_parameters"], "rope_parameters"
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"field {source!r}: expected an object or null, got {params!r}")
    params = params or {}
    theta_raw = {"rope_theta": raw.get("rope_theta", params.get("rope_theta", 10000.0))}
    rope_theta = _float(theta_raw, "rope_theta", positive=True)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return rope_theta, None
    if kind != "yarn":
        raise ConfigError(f"field '{source}.type': expected 'yarn' (or no rope scaling), got {kind!r}")

    def number(key: str, default: float | None, positive: bool = True) -> float | None:
        if params.get(key) is None:
            return default
        return _float(params, key, positive=positive)

    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if not _is_int(original) or original < 1:
        raise ConfigError(f"field '{source}.original_max_position_embeddings': expected an int >= 1, got {original!r}")
    factor = number("factor", None)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"field '{source}.truncate': expected true or false, got {truncate!r}")
    return rope_theta, RopeScaling(
        factor=factor if factor is not None else max_position_embeddings / original,
        original_max_position_embeddings=original,
        # transformers reads these with `or`: 0 means the default too.
        beta_fast=number("beta_fast", None, positive=False) or 32.0,
        beta_slow=number("beta_slow", None, positive=False) or 1.0,
        mscale=number("mscale", None, positive=False), mscale_all_dim=number("mscale_all_dim", None, positive=False),
        attention_factor=number("attention_factor", None), truncate=truncate)


def _quantization(raw: Any) -> QuantizationConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"field 'quantization_config': expected an object or null, got {raw!r}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"field 'quantization_config.quant_method': expected 'fp8' (DeepSeek-V3 block FP8), "
                          f"got {method!r}")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"field 'quantization_config.fmt': expected 'e4m3', got {fmt!r}")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"field 'quantization_config.activation_scheme': expected 'dynamic', got {scheme!r}")
    block = raw.get("weight_block_size")
    if block is None or tuple(block) != FP8_WEIGHT_BLOCK:
        raise ConfigError(f"field 'quantization_config.weight_block_size': expected {list(FP8_WEIGHT_BLOCK)}, "
                          f"got {block!r}")
    return QuantizationConfig(method, fmt, scheme, FP8_WEIGHT_BLOCK)

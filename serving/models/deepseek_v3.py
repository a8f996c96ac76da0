"""DeepSeek-V3 for serving: embedding, decoder layers (MLA attention over a paged latent KV cache, dense
MLP for the first `first_k_dense_replace` layers, ep_layer's FusedMoE for the others), final norm,
lm_head. One instance per expert-parallel rank: attention and dense parts are replicated, routed
experts are sharded (rank r owns experts [r * E_l, (r + 1) * E_l)), and every rank runs its own
batch, in step with the others (an idle rank runs ForwardBatch.empty(): the MoE layers must be
called on every rank, even with no tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ep_layer import Buffer
from ep_layer.moe import FusedMoE, make_buffer

from ..forward_batch import ForwardBatch
from ..model_config import ModelConfig
from .linear import GateUpLinear, Linear
from .mla import MLAttention
from .norm import Embedding, RMSNorm
from .paged_attention import AttentionMetadata, TokenMetadata
from .rotary import RotaryEmbedding


class DenseMLP(nn.Module):
    """SwiGLU: down_proj(SiLU(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden: int, intermediate: int, *, fp8: bool, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        kwargs = dict(fp8=fp8, dtype=dtype, device=device)
        self.gate_up_proj = GateUpLinear(hidden, intermediate, **kwargs)  # one GEMM; loads by the parts' names
        self.gate_proj, self.up_proj = self.gate_up_proj.parts
        self.down_proj = Linear(intermediate, hidden, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    mlp: DenseMLP | FusedMoE

    def __init__(self, config: ModelConfig, index: int, buffer: Buffer | None, max_tokens_per_rank: int,
                 expert_kernels: str, dtype: torch.dtype, device: torch.device | str | None,
                 moe_overlap: str = "none") -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = MLAttention(c, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)
        self.is_moe = c.is_moe_layer(index)
        if self.is_moe:
            self.mlp = FusedMoE(c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                                None, n_group=c.n_group, topk_group=c.topk_group,
                                routed_scaling_factor=c.routed_scaling_factor,
                                quant="fp8-block" if c.fp8 else "bf16", n_shared_experts=c.n_shared_experts,
                                buffer=buffer, max_tokens_per_rank=max_tokens_per_rank,
                                norm_topk_prob=c.norm_topk_prob, expert_kernels=expert_kernels, device=device,
                                overlap=moe_overlap)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, fp8=c.fp8, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata | TokenMetadata, moe_mode: str = "low_latency") -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        h = self.post_attention_layernorm(x)
        # FusedMoE works in bf16 (its dispatch sends bf16 or FP8); other dtypes round-trip through it.
        h = self.mlp(h.to(torch.bfloat16), mode=moe_mode).to(x.dtype) if self.is_moe else self.mlp(h)
        return x + h


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, buffer: Buffer | None, max_tokens_per_rank: int, expert_kernels: str,
                 dtype: torch.dtype, device: torch.device | str | None, moe_overlap: str = "none") -> None:
        super().__init__()
        c = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(c, i, buffer, max_tokens_per_rank, expert_kernels, dtype, device,
                                                 moe_overlap)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(c, device)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 on one expert-parallel rank; `forward(batch)` runs one paged-attention step.

    ep_buffer: the ep_layer low-latency Buffer all MoE layers share; without one, a Buffer is made for
    `group` (None: the default process group if torch.distributed is initialised, else one rank)
    with `backend` ("auto" | "cuda" | "reference"). max_tokens_per_rank: the most tokens a low-latency
    step may hold (every rank dispatches with this T); moe_overlap: the MoE layers' FusedMoE `overlap`;
    normal_mode: the Buffer serves normal-mode steps too (ForwardBatch.moe_mode "normal", of any size).
    dtype: activations and unquantised weights; FP8 checkpoints keep e4m3 weights with their block scales.
    Weights start at zero: serving.loading.checkpoint loads them (load_tensors by checkpoint name,
    load_weights from a checkpoint directory).
    """

    kv_cache: torch.Tensor | None

    def __init__(self, config: ModelConfig, *, ep_buffer: Buffer | None = None,
                 group: dist.ProcessGroup | None = None, backend: str = "auto", max_tokens_per_rank: int = 128,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
                 expert_kernels: str = "auto", normal_mode: bool = False, moe_overlap: str = "none") -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
        self.config, self.dtype = config, dtype
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.max_tokens_per_rank = max_tokens_per_rank
        has_moe = config.first_k_dense_replace < config.num_hidden_layers
        if ep_buffer is None and has_moe:
            ep_buffer = make_buffer(group, max_tokens_per_rank, config.hidden_size, config.n_routed_experts, backend,
                                    self.device, normal_mode=normal_mode)
        self.ep_buffer = ep_buffer
        self.ep_rank, self.ep_size = (ep_buffer.rank, ep_buffer.group_size) if ep_buffer is not None else (0, 1)
        if config.n_routed_experts % self.ep_size:
            raise ValueError(f"n_routed_experts={config.n_routed_experts} is not a multiple of the expert-parallel "
                             f"size {self.ep_size}")
        self.experts_per_rank = config.n_routed_experts // self.ep_size
        self.model = DeepseekV3Model(config, ep_buffer, max_tokens_per_rank, expert_kernels, dtype, self.device,
                                     moe_overlap)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, fp8=False, dtype=dtype, device=self.device)
        self.kv_cache = None

    # ------------------------------------------------------------------ KV cache
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """Allocate (zeroed) and keep the paged latent cache [num_layers, num_blocks, block_size,
        kv_cache_dim] in the model dtype: per token and layer, [c_kv | k_pe] (see paged_attention)."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        c = self.config
        self.kv_cache = torch.zeros(c.num_hidden_layers, num_blocks, block_size, c.kv_cache_dim, dtype=self.dtype,
                                    device=self.device)
        return self.kv_cache

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of `block_size` tokens takes over all layers (for sizing the cache)."""
        c = self.config
        return c.num_hidden_layers * block_size * c.kv_cache_dim * torch.empty(0, dtype=self.dtype).element_size()

    # ------------------------------------------------------------------ forward
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One step: writes the new tokens' latent KV to their slots, attends (prefill chunks to their
        sequence's earlier tokens and causally to the chunk, decodes to the cache) and returns float32
        logits [len(logits_indices), vocab] (the rows serving.forward_batch names)."""
        return self.compute_logits(self.hidden_states(batch).index_select(0, batch.logits_indices))

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """The step up to the final norm: [num_tokens, hidden] in the model dtype, every token's row (what a
        step CUDA graph captures; serving.engine.model_runner applies compute_logits to the rows it needs)."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("forward: no KV cache; call allocate_kv_cache(num_blocks, block_size) first")
        self._check_batch(batch)
        meta = (TokenMetadata.from_batch(batch, block_size=cache.shape[2]) if batch.token_seqs is not None else
                AttentionMetadata.from_batch(batch, block_size=cache.shape[2], num_blocks=cache.shape[1]))
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.model.rotary.cos_sin(batch.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache[i], meta, batch.moe_mode)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of final-normed hidden states [rows, hidden]."""
        return self.lm_head(hidden).float()

    def _check_batch(self, batch: ForwardBatch) -> None:
        t, s = batch.num_tokens, batch.num_seqs
        i64, i32 = torch.int64, torch.int32
        expected = (("input_ids", i64, (t,)), ("positions", i64, (t,)), ("slot_mapping", i64, (t,)),
                    ("query_start", i32, (s + 1,)), ("seq_lens", i32, (s,)),
                    ("block_tables", i32, (s, batch.block_tables.shape[-1])),
                    ("logits_indices", i64, (batch.logits_indices.shape[0],)))
        if batch.token_seqs is not None:
            expected += (("token_seqs", i64, (t,)),)
        for name, dtype, shape in expected:
            value = getattr(batch, name)
            if value.dtype != dtype or tuple(value.shape) != shape or value.device != self.device:
                raise ValueError(f"batch.{name}: expected {dtype} {list(shape)} on {self.device}, got "
                                 f"{value.dtype} {list(value.shape)} on {value.device}")
        if t > self.max_tokens_per_rank and batch.moe_mode == "low_latency":
            raise ValueError(f"batch: {t} tokens, expected at most max_tokens_per_rank={self.max_tokens_per_rank} "
                             "(every rank's low-latency MoE dispatch is sized for it; schedule fewer tokens per "
                             "step, or run the step in normal mode: batch.moe_mode)")

"""DeepSeek multi-head latent attention (MLA) over a paged latent KV cache, in the absorbed form.

Per token: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)), split per head into q_nope and
q_pe; [c_kv | k_pe] = kv_a_proj_with_mqa(x), c_kv normalised by kv_a_layernorm; q_pe and k_pe get
RoPE. The cache keeps [c_kv | k_pe] only. kv_b_proj maps c_kv to each head's k_nope (W_UK) and v
(W_UV); instead of expanding the cache, q_nope is absorbed into W_UK (q_nope . W_UK c = (W_UK^T
q_nope) . c), so a head's score is [q_nope W_UK | q_pe] . [c_kv | k_pe], and its output is W_UV
applied to the attention-weighted sum of c_kv. An eager step's long prompt chunks attend in the expanded form
instead (`prompt_attention`): their keys expanded once serve all of their tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..model_config import ModelConfig
from . import paged_attention
from .linear import Linear, StackedLinear
from .norm import RMSNorm
from .paged_attention import AttentionMetadata, TokenMetadata, paged_mla_attention, write_kv
from .rotary import RotaryEmbedding, softmax_scale

# DeepSeek's code and transformers build q_a_layernorm and kv_a_layernorm with RMSNorm's default eps,
# not config.rms_norm_eps (the two agree in V3's config).
LATENT_NORM_EPS = 1e-6
# The fused attention kernels a prompt block may take, in torch's own order of preference, without cuDNN's, which
# torch 2.11 picks first on an H100 or H200 for these shapes (benchmarks/RESULTS.md, profile_prompt_step.py): cuDNN
# builds an execution plan for every new shape (0.44 s each on a B200 under torch 2.11: modelscope/FunASR#3704), and
# every prompt length is a new shape; flash attention plans nothing.
PROMPT_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class MLAttention(nn.Module):
    """One layer's MLA; HF names for its weights (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        c, fp8 = config, config.fp8
        self.num_heads, self.kv_lora_rank = c.num_attention_heads, c.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.scale = softmax_scale(c)
        self.interleave = c.rope_interleave
        h, heads, q_dim = c.hidden_size, c.num_attention_heads, c.num_attention_heads * c.qk_head_dim
        kwargs = dict(fp8=fp8, dtype=dtype, device=device)
        self.q_lora = c.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = Linear(h, q_dim, **kwargs)
            self.kv_a_proj_with_mqa = Linear(h, c.kv_cache_dim, **kwargs)
        else:
            # q_a_proj and kv_a_proj_with_mqa read the same x: one GEMM for both (their weights stacked).
            self.fused_qkv_a_proj = StackedLinear(h, (c.q_lora_rank, c.kv_cache_dim), **kwargs)
            self.q_a_proj, self.kv_a_proj_with_mqa = self.fused_qkv_a_proj.parts
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
            self.q_b_proj = Linear(c.q_lora_rank, q_dim, **kwargs)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
        self.kv_b_proj = Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), **kwargs)
        self.o_proj = Linear(heads * c.v_head_dim, h, **kwargs)
        # Absorbed projections, derived from kv_b_proj by `absorb_weights` after loading.
        self.register_buffer("w_uk", torch.zeros(heads, c.qk_nope_head_dim, c.kv_lora_rank, dtype=dtype,
                                                 device=device), persistent=False)
        self.register_buffer("w_uv", torch.zeros(heads, c.v_head_dim, c.kv_lora_rank, dtype=dtype, device=device),
                             persistent=False)

    def absorb_weights(self) -> None:
        """Split kv_b_proj [H * (nope + v), kv_lora] into W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora]."""
        w = self.kv_b_proj.dense_weight(self.w_uk.dtype).view(self.num_heads, -1, self.kv_lora_rank)
        self.w_uk.copy_(w[:, :self.qk_nope_head_dim])
        self.w_uv.copy_(w[:, self.qk_nope_head_dim:])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata | TokenMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the new tokens' [c_kv | k_pe] to `cache` (this layer's
        [num_blocks, block_size, kv_cache_dim]) first, so that they attend to themselves."""
        n = x.shape[0]
        if self.q_lora:
            q_a, kv_a = self.fused_qkv_a_proj(x)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q = q.view(n, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = RotaryEmbedding.rotate(q_pe, cos, sin, self.interleave)
        k_pe = RotaryEmbedding.rotate(k_pe, cos, sin, self.interleave)
        write_kv(cache, meta.slot_mapping, torch.cat([c_kv, k_pe], dim=-1))

        prompts = meta.prompts if isinstance(meta, TokenMetadata) else None
        if prompts is None:
            out = self._absorbed(q_nope, q_pe, cache, meta)
        else:  # an eager step's long prompt chunks as blocks, its other rows per token
            out = q_nope.new_empty(n, self.num_heads, self.v_head_dim)
            if prompts.rows is not None:
                out[prompts.rows] = self._absorbed(q_nope[prompts.rows], q_pe[prompts.rows], cache, prompts.others)
            flat = cache.view(-1, cache.shape[-1])
            for chunk in prompts.chunks:
                span = slice(chunk.start, chunk.end)
                out[span] = prompt_attention(q_nope[span], q_pe[span], flat[chunk.slots], self.w_uk, self.w_uv,
                                             self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_head_dim))

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata | TokenMetadata) -> torch.Tensor:
        """Attention in the absorbed form over the paged cache: [T, H, v_head_dim]."""
        q_latent = torch.einsum("thd,hdc->thc", q_nope, self.w_uk)  # q_nope absorbed into W_UK
        attn = paged_mla_attention(q_latent, q_pe, cache, meta, self.scale)
        return torch.einsum("thc,hvc->thv", attn, self.w_uv)  # W_UV after attention


def prompt_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA in the expanded form (DeepSeek's and transformers' own) for one sequence's chunk of n new tokens, the last
    n of its L keys: q_nope [n, H, nope], q_pe [n, H, rope], keys [L, kv_lora_rank + rope] (its cache entries).
    Each head's k_nope and v are expanded from c_kv once (W_UK, W_UV), the RoPE part is shared by the heads, and
    new token i sees keys [0, L - n + i], in one fused attention call (flash attention on a GPU) instead of
    reading every key once per token; the heads go in groups whose expanded keys and values fit
    PROMPT_BLOCK_KV_ELEMENTS. Returns [n, H, v_head_dim]."""
    n, heads, _ = q_nope.shape
    lora, length, v_dim = w_uk.shape[-1], keys.shape[0], w_uv.shape[1]
    width = q_nope.shape[-1] + q_pe.shape[-1]  # a key's, and a padded value's
    keys = keys.to(q_nope.dtype)
    c_kv, k_pe = keys[:, :lora], keys[:, lora:]
    group = max(1, paged_attention.PROMPT_BLOCK_KV_ELEMENTS // (2 * length * width))
    out = q_nope.new_empty(n, heads, v_dim)
    with sdpa_kernel(PROMPT_SDPA_BACKENDS):  # once for all head groups
        for first in range(0, heads, group):
            h = slice(first, min(first + group, heads))
            k = torch.cat([torch.einsum("lc,hdc->hld", c_kv, w_uk[h]), k_pe.expand(h.stop - first, -1, -1)], dim=-1)
            v = F.pad(torch.einsum("lc,hvc->hlv", c_kv, w_uv[h]), (0, width - v_dim))  # every fused kernel takes it
            q = torch.cat([q_nope[:, h], q_pe[:, h]], dim=-1).transpose(0, 1)
            out[:, h] = causal_attention(q[None], k[None], v[None], scale)[0, ..., :v_dim].transpose(0, 1)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Fused attention of n queries over L >= n keys, [1, H, n or L, D] each, where query i sees keys [0, L - n + i]
    (causal aligned to the last key: torch's causal_lower_right). Flash attention aligns its causal mask so itself;
    elsewhere torch's attention bias does it, imported at the first such call: its module imports torch._dynamo, a
    second or two of every rank's start-up otherwise (`tests/test_serving_imports.py`)."""
    n, length = q.shape[-2], k.shape[-2]
    if n == length:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)
    if q.is_cuda and can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, False)):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, scale=scale, attn_mask=causal_lower_right(n, length))

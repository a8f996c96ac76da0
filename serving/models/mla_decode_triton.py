"""A Triton kernel for MLA over the paged latent cache (GPU only): each query row (a new token, of a
decode or of a prefill chunk alike) reads only its own keys (its block table up to its key count, read
on the device), so any step stays CUDA-graph capturable without gathering max_model_len keys per row.

Flash-decoding: the grid is [rows, head groups, splits of the row's keys]; each program runs an
online softmax over its part of the keys and writes its normalised partial output and log-sum-exp;
a second launch merges the splits with softmax weights over those. Each cache entry is
[c_kv (kv_lora_rank) | k_pe (rope dim)]: the score is q . entry, the output sums c_kv.

Importing this module needs neither Triton nor a GPU; `available()` says whether it can run.
"""

from __future__ import annotations

import torch

from ep_layer.kernels.launch import Launcher, cdiv, next_power_of_2
from ep_layer.kernels.triton_support import sm_count, tl, triton

BLOCK_H = 16  # heads per program (they share every key load)
BLOCK_T = 32  # keys per step of the online softmax
MAX_SPLITS = 8  # programs along each row's keys: 8 fill the GPU at batch 1 and 128 heads
PROGRAMS_PER_SM = 2  # fewer splits at larger batches: each split's partial output is a float32 pass more
NUM_WARPS = 4
MERGE_WARPS = 2  # the splits' merge: a program per (row, head), 512 float32 channels
NUM_STAGES = 2  # a float32 cache tile is 64 KB: two in flight fit shared memory, three would not


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def supports(kv_lora_rank: int, rope: int) -> bool:
    """Whether the kernel takes these widths: powers of two of at least 16 (its tiles' ranges and dot
    products; DeepSeek-V3's are 512 and 64)."""
    return all(w >= 16 and w & (w - 1) == 0 for w in (kv_lora_rank, rope))


if triton is not None:

    @Launcher
    @triton.jit
    def _mla_decode_kernel(q_latent_ptr, q_pe_ptr, cache_ptr, tables_ptr, counts_ptr, out_ptr, lse_ptr,
                           H, MAX_BLOCKS, BLOCK_SIZE, SPLITS, scale,
                           stride_nb, stride_nh, stride_pb, stride_ph, stride_cs,
                           LORA: tl.constexpr, ROPE: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
        """Program (b, g, s): heads [g*BLOCK_H, ...) of row b over its keys [s*chunk, (s+1)*chunk)
        with chunk = cdiv(key_count, SPLITS). Writes out[b, s, h] = sum_t p_t c_kv_t / sum_t p_t (float32;
        p_t = exp(score_t - m)) and lse[b, s, h] = m + log(sum_t p_t) (-inf for an empty part)."""
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        s = tl.program_id(2)
        heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < H
        lora = tl.arange(0, LORA)
        rope = tl.arange(0, ROPE)
        q_nope = tl.load(q_latent_ptr + b * stride_nb + heads[:, None] * stride_nh + lora[None, :],
                         mask=head_ok[:, None], other=0.0)
        q_pe = tl.load(q_pe_ptr + b * stride_pb + heads[:, None] * stride_ph + rope[None, :],
                       mask=head_ok[:, None], other=0.0)
        key_count = tl.load(counts_ptr + b)
        chunk = tl.cdiv(key_count, SPLITS)
        start = s * chunk
        stop = tl.minimum(start + chunk, key_count)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, LORA), tl.float32)
        for t0 in range(start, stop, BLOCK_T):
            pos = t0 + tl.arange(0, BLOCK_T)
            ok = pos < stop
            block = tl.load(tables_ptr + b * MAX_BLOCKS + pos // BLOCK_SIZE, mask=ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            entry = cache_ptr + slot[:, None] * stride_cs
            c_kv = tl.load(entry + lora[None, :], mask=ok[:, None], other=0.0)
            k_pe = tl.load(entry + LORA + rope[None, :], mask=ok[:, None], other=0.0)
            scores = (tl.dot(q_nope, tl.trans(c_kv)) + tl.dot(q_pe, tl.trans(k_pe))) * scale
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv)
            m = m_new
        part = (b * SPLITS + s) * H + heads
        acc = acc / tl.maximum(l_sum, 1e-30)[:, None]  # an empty part: 0 (its weight below is 0)
        tl.store(out_ptr + part[:, None] * LORA + lora[None, :], acc, mask=head_ok[:, None])
        tl.store(lse_ptr + part, m + tl.log(l_sum), mask=head_ok)

    @Launcher
    @triton.jit
    def _merge_splits_kernel(out_ptr, lse_ptr, merged_ptr, H, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                             LORA: tl.constexpr):
        """Program (b, h): merged[b, h] = sum_s softmax_s(lse[b, :, h]) * out[b, s, h] in merged's dtype.
        Part s holds its softmax-weighted mean of c_kv and the log of its weight sum, so the whole is their
        mean weighted by softmax over the parts' log-sum-exps (an empty part, -inf, weighs 0; part 0 is
        never empty)."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        parts = tl.arange(0, SPLITS_PAD)
        lse = tl.load(lse_ptr + (b * SPLITS + parts) * H + h, mask=parts < SPLITS, other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, axis=0))
        weights = weights / tl.sum(weights, axis=0)
        lora = tl.arange(0, LORA)
        acc = tl.zeros((LORA,), dtype=tl.float32)
        for s in range(SPLITS):
            weight = tl.sum(tl.where(parts == s, weights, 0.0), axis=0)
            acc += tl.load(out_ptr + ((b * SPLITS + s) * H + h) * LORA + lora) * weight
        tl.store(merged_ptr + (b * H + h) * LORA + lora, acc.to(merged_ptr.dtype.element_ty))


def num_splits(batch: int, heads: int, device: torch.device) -> int:
    """Splits along each row's keys: enough programs for PROGRAMS_PER_SM per SM, at most MAX_SPLITS."""
    programs = PROGRAMS_PER_SM * sm_count(device)
    return max(1, min(MAX_SPLITS, cdiv(programs, batch * cdiv(heads, BLOCK_H))))


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               key_counts: torch.Tensor, scale: float, splits: int | None = None) -> torch.Tensor:
    """Latent attention output [B, H, kv_lora_rank] (the queries' dtype) of the queries q_latent [B, H,
    kv_lora_rank] (q_nope absorbed into W_UK) and q_pe [B, H, rope] (one new token a row, already
    in the cache; either may be a strided view, read in place rather than concatenated) against one
    layer's cache [num_blocks, block_size, kv_lora_rank + rope], row b reading block_tables[b] (int32,
    -1 past its blocks) up to key_counts[b] (int32, >= 1) keys, in `splits` parts (default: num_splits)."""
    (b, h, kv_lora_rank), rope = q_latent.shape, q_pe.shape[-1]
    if not supports(kv_lora_rank, rope):
        raise ValueError(f"q_latent, q_pe: kv_lora_rank {kv_lora_rank} and rope {rope}: expected powers of two of "
                         "at least 16 (serving.models.paged_attention falls back to PyTorch for others)")
    if triton is None:
        raise RuntimeError("mla_decode needs Triton")
    d = kv_lora_rank + rope
    if q_pe.shape[:2] != (b, h) or cache.shape[-1] != d or q_pe.dtype != q_latent.dtype:
        raise ValueError(f"q_pe, cache: expected [{b}, {h}, rope] of {q_latent.dtype} and [..., {kv_lora_rank} + "
                         f"rope], got {list(q_pe.shape)} of {q_pe.dtype} and {list(cache.shape)}")
    if b == 0:  # an idle expert-parallel rank's step
        return q_latent.new_empty(0, h, kv_lora_rank)
    block_size = cache.shape[1]
    flat = cache.view(-1, d)
    splits = splits or num_splits(b, h, q_latent.device)
    out = torch.empty(b, splits, h, kv_lora_rank, dtype=torch.float32, device=q_latent.device)
    lse = torch.empty(b, splits, h, dtype=torch.float32, device=q_latent.device)
    q_latent, q_pe = (q if q.stride(-1) == 1 else q.contiguous() for q in (q_latent, q_pe))
    tables = block_tables.contiguous()
    grid = (b, cdiv(h, BLOCK_H), splits)
    _mla_decode_kernel[grid](q_latent, q_pe, flat, tables, key_counts, out, lse, h, tables.shape[1], block_size,
                             splits, scale, *q_latent.stride()[:2], *q_pe.stride()[:2], flat.stride(0),
                             LORA=kv_lora_rank, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_T=BLOCK_T, num_warps=NUM_WARPS,
                             num_stages=NUM_STAGES)
    if splits == 1:
        return out[:, 0].to(q_latent.dtype)
    merged = torch.empty(b, h, kv_lora_rank, dtype=q_latent.dtype, device=q_latent.device)
    _merge_splits_kernel[(b, h)](out, lse, merged, h, SPLITS=splits, SPLITS_PAD=next_power_of_2(splits),
                                 LORA=kv_lora_rank, num_warps=MERGE_WARPS)
    return merged

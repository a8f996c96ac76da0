"""An eager step's long prompt chunks attending as blocks in MLA's expanded form (serving.models.mla.prompt_attention):
against a float64 oracle written from the attention's definition (causal, the chunk being the last of the keys), and
in the tiny DeepSeek-V3 model, an eager step with the per-token layout a GPU uses (its long chunks as blocks, its
other rows per token) against the host-layout attention of the same step (an independent path, absorbed form)."""

from __future__ import annotations

import sys

import pytest
import torch
from test_serving_graphs import NEEDS_KERNELS, checkpoint, make_engine, until_mixed  # noqa: F401 (fixture)

from serving.engine.engine import LLMEngine
from serving.engine.scheduler import ScheduledBatch
from serving.engine.sequence import SamplingParams
from serving.models import mla, paged_attention


def oracle(q_nope: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
           scale: float) -> torch.Tensor:
    """float64, head by head and token by token: token i of the n new ones (the last n of L keys) sees keys
    [0, L - n + i]; score = q_nope . (W_UK c_kv) + q_pe . k_pe; output = softmax . (W_UV c_kv)."""
    q_nope, q_pe, keys, w_uk, w_uv = (t.double() for t in (q_nope, q_pe, keys, w_uk, w_uv))
    n, heads, _ = q_nope.shape
    lora, length = w_uk.shape[-1], keys.shape[0]
    out = torch.empty(n, heads, w_uv.shape[1], dtype=torch.float64)
    for h in range(heads):
        k_nope, v = keys[:, :lora] @ w_uk[h].T, keys[:, :lora] @ w_uv[h].T
        for i in range(n):
            seen = length - n + i + 1
            scores = (k_nope[:seen] @ q_nope[i, h] + keys[:seen, lora:] @ q_pe[i, h]) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:seen]
    return out


@pytest.mark.parametrize(("n", "length"), [(5, 5), (3, 11), (1, 7), (16, 40)])
@pytest.mark.parametrize("heads_at_once", [3, 2, 1])
def test_prompt_attention_equals_the_float64_oracle(n: int, length: int, heads_at_once: int, seed: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """All three heads at once, and in groups of two (the last one short) and one, as a budget of expanded keys and
    values (PROMPT_BLOCK_KV_ELEMENTS) makes them go."""
    monkeypatch.setattr(paged_attention, "PROMPT_BLOCK_KV_ELEMENTS", heads_at_once * 2 * length * (16 + 8))
    gen = torch.Generator().manual_seed(seed)
    heads, nope, rope, lora, v_dim = 3, 16, 8, 32, 12
    q_nope, q_pe = torch.randn(n, heads, nope, generator=gen), torch.randn(n, heads, rope, generator=gen)
    keys = torch.randn(length, lora + rope, generator=gen)
    w_uk, w_uv = torch.randn(heads, nope, lora, generator=gen) / 4, torch.randn(heads, v_dim, lora, generator=gen)
    args = (q_nope.double(), q_pe.double(), keys.double(), w_uk.double(), w_uv.double(), 0.3)
    got = mla.prompt_attention(*args)
    assert got.shape == (n, heads, v_dim)
    torch.testing.assert_close(got, oracle(*args), rtol=1e-10, atol=1e-10)


def test_prompt_attention_never_takes_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fused call of a prompt block runs with cuDNN's attention off (it plans again for every new prompt
    length) and the other fused kernels on, whatever the process had set; the setting is restored after."""
    seen: list[tuple[bool, bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        backends = torch.backends.cuda
        seen.append((backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(mla.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(paged_attention, "PROMPT_BLOCK_KV_ELEMENTS", 2 * 9 * 24)  # one head at a time
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        heads, n = 3, 9
        mla.prompt_attention(torch.randn(n, heads, 16), torch.randn(n, heads, 8), torch.randn(n, 40),
                             torch.randn(heads, 16, 32), torch.randn(heads, 12, 32), 0.3)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    assert seen == [(False, True, True)] * heads


def second_chunk_beside_decodes(engine: LLMEngine) -> ScheduledBatch:
    """Two short prompts run to their decodes, then a 45-token prompt whose second chunk (15 tokens after 30 cached:
    a step holds 32 tokens, two of them the decodes) is scheduled beside their decodes (not yet run)."""
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for rid, salt in (("a", 1), ("b", 2)):
        engine.add_request(rid, [3 + (5 * i + salt) % 150 for i in range(6)], greedy)
    engine.execute(engine.schedule())
    engine.add_request("long", [3 + (7 * i) % 150 for i in range(45)], greedy)
    engine.execute(engine.schedule())  # their decodes and the long prompt's first 30 tokens
    batch = engine.schedule()
    assert batch.num_new_tokens == [1, 1, 15] and batch.seqs[2].num_computed_tokens == 30, batch.num_new_tokens
    return batch


@pytest.mark.parametrize("step", ["mixed 1", "mixed 2", "mixed 3", "a second chunk"])
def test_eager_step_with_prompt_blocks_equals_the_host_layout_step(checkpoint: str, step: str,  # noqa: F811
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A step mixing prompt chunks with decodes, run as a GPU runs it eagerly (per-token layout and host layout: chunks
    of at least PROMPT_BLOCK_MIN_TOKENS, here 3, as blocks) against the CPU's host-layout step: the same logits and
    KV cache up to the float32 roundings that the first MoE layer's bf16 rounding may flip (test_serving_graphs.py's
    bound). Random steps (`until_mixed`), and a chunk after 30 cached tokens. A chunk that sees a key too many or
    too few moves them by far more."""
    monkeypatch.setattr(paged_attention, "PROMPT_BLOCK_MIN_TOKENS", 3)
    engine = make_engine(checkpoint, "cpu", use_cuda_graphs=False, backend="reference")
    batch = second_chunk_beside_decodes(engine) if step == "a second chunk" else until_mixed(engine, int(step[-1]))
    assert any(n >= 3 for n in batch.num_new_tokens) and any(n < 3 for n in batch.num_new_tokens)
    runner, model = engine.runner, engine.model
    cache_before = model.kv_cache.clone()
    host = runner.prepare(batch)
    assert host.token_seqs is None and host.host_layout is not None
    want = model(host)
    cache_want = model.kv_cache.clone()
    model.kv_cache.copy_(cache_before)
    monkeypatch.setattr(runner, "token_attention", True)  # the GPU's eager layout: token_seqs and the host layout
    blocks = runner.prepare(batch)
    assert blocks.token_seqs is not None and blocks.host_layout is not None
    calls = []
    attend = mla.prompt_attention
    monkeypatch.setattr(mla, "prompt_attention", lambda *a: calls.append(a[0].shape[0]) or attend(*a))
    got = model(blocks)
    layers = model.config.num_hidden_layers
    assert sorted(calls) == sorted([n for n in batch.num_new_tokens if n >= 3] * layers)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    torch.testing.assert_close(model.kv_cache, cache_want, rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_prompt_attention_on_gpu_in_bf16_equals_the_float64_oracle(seed: int) -> None:
    """DeepSeek-V3's head widths (128 + 64 query, 512 latent, 128 value) in bf16 on the GPU (flash attention, values
    padded to the keys' width), a chunk after cached keys and a whole prompt: within bf16's rounding of the inputs
    and the output (2**-8 relative) of the float64 oracle."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(seed)
    heads, nope, rope, lora, v_dim = 16, 128, 64, 512, 128
    for n, length in ((96, 96), (80, 300)):
        tensors = (torch.randn(n, heads, nope, generator=gen), torch.randn(n, heads, rope, generator=gen),
                   torch.randn(length, lora + rope, generator=gen),
                   torch.randn(heads, nope, lora, generator=gen) / lora ** 0.5,
                   torch.randn(heads, v_dim, lora, generator=gen) / lora ** 0.5)
        bf16 = [t.to(torch.bfloat16) for t in tensors]
        got = mla.prompt_attention(*(t.cuda() for t in bf16), (nope + rope) ** -0.5)
        assert got.dtype == torch.bfloat16 and got.shape == (n, heads, v_dim)
        want = oracle(*bf16, (nope + rope) ** -0.5)
        torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@NEEDS_KERNELS
def test_eager_gpu_step_with_prompt_blocks_equals_the_per_token_kernel(checkpoint: str,  # noqa: F811
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, an eager step whose long chunk (15 tokens after 30 cached, beside two decodes) attends as a block
    against the same step through the per-token Triton kernel: the same logits and KV cache up to the summation
    order's float32 roundings and the bf16 flips they may cause in the first MoE layer (as on CPU)."""
    engine = make_engine(checkpoint, "cuda", use_cuda_graphs=False, backend="cuda")
    batch = second_chunk_beside_decodes(engine)
    runner, model = engine.runner, engine.model
    cache_before = model.kv_cache.clone()
    monkeypatch.setattr(paged_attention, "PROMPT_BLOCK_MIN_TOKENS", sys.maxsize)
    per_token = runner.prepare(batch)
    assert per_token.token_seqs is not None and per_token.host_layout is not None
    want = model(per_token)
    cache_want = model.kv_cache.clone()
    model.kv_cache.copy_(cache_before)
    monkeypatch.setattr(paged_attention, "PROMPT_BLOCK_MIN_TOKENS", 3)
    calls = []
    attend = mla.prompt_attention
    monkeypatch.setattr(mla, "prompt_attention", lambda *a: calls.append(a[0].shape[0]) or attend(*a))
    got = model(runner.prepare(batch))
    assert calls == [15] * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    torch.testing.assert_close(model.kv_cache, cache_want, rtol=0, atol=2e-2)

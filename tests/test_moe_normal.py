"""FusedMoE through normal (high-throughput) mode on CPU ranks (reference backend), against the
low-latency path and a float64 oracle.

- one rank: the two modes run the same GEMMs on the same rows and weigh them in the same order, so they
  agree bit for bit (bf16 and FP8);
- several ranks: normal mode rounds each rank's partial sum to bf16 before the combine adds them (DeepEP's
  combine takes bf16 rows), the low-latency combine rounds once. Each rounding is 2**-9 relative to a
  partial sum that can exceed the result; with the shared expert's and the final add's roundings, we bound
  |normal - low-latency| by 2**-6 * (|ref| + rms(ref)) per element;
- a batch larger than the low-latency buffer's T goes through normal mode, against float64 (test_moe.py's
  tolerances and their reasons);
- the expert-load counters count normal mode's rows as the low-latency ones.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from moe_helpers import MoeConfig, hf_weights, moe_float64, random_tokens
from test_moe import TOL_FP8_RMS, TOL_FP8_TOKEN, assert_close

from ep_layer.moe import FusedMoE, make_buffer

TOL_MODES = 2**-6  # normal vs low-latency on several ranks (module docstring)
TOL_BF16_F64 = 2**-5  # bf16 weights vs float64 (test_moe.py's float32 bound: our path's bf16 roundings)


def both_modes_rank(rank: int, world: int, cfg: MoeConfig, quant: str, weights: dict[str, torch.Tensor],
                    tokens: list[torch.Tensor], big: list[torch.Tensor], backend: str) -> dict[str, np.ndarray]:
    """This rank's tokens through both modes, and a batch larger than T through normal mode."""
    device = torch.device("cpu")
    if backend == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = make_buffer(dist.group.WORLD, cfg.max_tokens, cfg.hidden, cfg.num_experts, backend, device,
                         normal_mode=True)
    layer = FusedMoE(cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate, dist.group.WORLD,
                     n_group=cfg.n_group, topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                     quant=quant, n_shared_experts=cfg.n_shared_experts, buffer=buffer,
                     max_tokens_per_rank=cfg.max_tokens, device=device)
    per_rank = cfg.num_experts // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    layer.load_weights((n, t) for n, t in weights.items()
                       if not n.startswith("experts.") or int(n.split(".")[1]) in mine)
    x = tokens[rank].to(device)
    results = {"low_latency": layer(x)}
    load_low_latency = layer.stats().expert_load.clone()
    results["normal"] = layer(x, mode="normal")
    results["load_normal"] = layer.stats().expert_load - load_low_latency
    results["load_low_latency"] = load_low_latency
    results["big"] = layer(big[rank].to(device), mode="normal")
    for name, batch in (("", x), ("big_", big[rank].to(device))):
        results[name + "topk_idx"], results[name + "topk_weights"] = layer.route(batch)
    buffer.destroy()
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).cpu().numpy().copy() for k, v in results.items()}


def run_both_modes(world: int, quant: str, seed: int, cfg: MoeConfig, backend: str = "reference",
                   ) -> tuple[list[dict[str, torch.Tensor]], dict, list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    weights = hf_weights(cfg, gen, "fp8" if quant == "fp8-block" else "bf16")
    tokens = random_tokens(cfg, gen, world)
    big = random_tokens(replace(cfg, max_tokens=3 * cfg.max_tokens), gen, world, min_tokens=cfg.max_tokens + 1)
    raw = run_ranks(both_modes_rank, world, cfg, quant, weights, tokens, big, backend)
    return [{k: torch.from_numpy(v) for k, v in r.items()} for r in raw], weights, tokens, big


@pytest.mark.parametrize("quant", ["bf16", "fp8-block"])
def test_one_rank_modes_agree_bit_for_bit(quant: str, seed: int) -> None:
    cfg = MoeConfig(intermediate=192 if quant == "fp8-block" else 64)
    (got,), _, _, _ = run_both_modes(1, quant, seed, cfg)
    assert torch.equal(got["normal"], got["low_latency"]), f"seed={seed} {quant}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant", ["bf16", "fp8-block"])
def test_one_rank_modes_agree_bit_for_bit_on_the_cuda_backend(quant: str, seed: int) -> None:
    """The cuda kernels of both modes, the normal mode's partial sums written in place (a zero-copy combine)."""
    cfg = MoeConfig(intermediate=192 if quant == "fp8-block" else 64)
    (got,), _, _, _ = run_both_modes(1, quant, seed, cfg, "cuda")
    assert torch.equal(got["normal"], got["low_latency"]), f"seed={seed} {quant}"


def _check_modes_across_ranks(world: int, seed: int, backend: str) -> None:
    cfg = MoeConfig(num_experts=12 if world == 3 else 16, intermediate=64)
    results, weights, _, big = run_both_modes(world, "bf16", seed, cfg, backend)
    for rank, got in enumerate(results):
        what = f"seed={seed} EP={world} rank {rank}"
        assert_close(got["normal"], got["low_latency"], TOL_MODES, what + ": normal vs low-latency")
        want = torch.from_numpy(moe_float64(cfg, weights, big[rank], got["big_topk_idx"], got["big_topk_weights"]))
        assert got["big"].shape[0] > cfg.max_tokens
        assert_close(got["big"], want, TOL_BF16_F64, what + ": a batch larger than T vs float64")
        assert torch.equal(got["load_normal"], got["load_low_latency"]), what + ": expert-load counters"
    # Each routed (token, expert) pair was counted once, at its expert.
    routed = torch.cat([r["topk_idx"] for r in results]).flatten()
    load = torch.cat([r["load_normal"] for r in results])
    assert torch.equal(load, torch.bincount(routed, minlength=cfg.num_experts).int())


@pytest.mark.parametrize("world", [2, 3])
def test_modes_agree_across_ranks_and_large_batches_are_right(world: int, seed: int) -> None:
    _check_modes_across_ranks(world, seed, "reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_modes_agree_across_cuda_ranks(seed: int) -> None:
    """Two processes on the cuda kernels, the same checks as the reference backend's."""
    _check_modes_across_ranks(2, seed, "cuda")


def test_fp8_large_batch_matches_float64(seed: int) -> None:
    cfg = MoeConfig(intermediate=192, max_tokens=16)
    results, weights, _, big = run_both_modes(2, "fp8-block", seed, cfg)
    for rank, got in enumerate(results):
        what = f"seed={seed} rank {rank}"
        want = torch.from_numpy(moe_float64(cfg, weights, big[rank], got["big_topk_idx"], got["big_topk_weights"]))
        err = got["big"].double() - want
        rel_rms = (err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
        assert rel_rms <= TOL_FP8_RMS, f"{what}: relative RMS error {rel_rms:.4f}"
        per_token = (err.norm(dim=1) / want.norm(dim=1)).max().item()
        assert per_token <= TOL_FP8_TOKEN, f"{what}: worst token's relative error {per_token:.4f}"
        assert_close(got["normal"], got["low_latency"], TOL_MODES, what + ": normal vs low-latency")


def test_mode_errors() -> None:
    cfg = MoeConfig()
    layer = cfg.layer(None, "bf16")  # a low-latency Buffer only: no normal-mode buffer
    x = torch.zeros(cfg.max_tokens + 1, cfg.hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^mode: expected one of \('low_latency', 'normal'\), got 'fast'"):
        layer(x[:1], mode="fast")
    with pytest.raises(ValueError, match=r"hidden_states: expected bf16 \[N, 256\] with N <= max_tokens_per_rank"):
        layer(x)
    with pytest.raises(RuntimeError, match=r"num_nvl_bytes=0"):
        layer(x, mode="normal")
    with pytest.raises(ValueError, match=r"hidden_states: expected bf16 \[N, 256\], got torch.float32"):
        layer(x.float(), mode="normal")


def one_rank_normal_layer(cfg: MoeConfig, gen: torch.Generator) -> FusedMoE:
    """A one-rank bf16 layer on the reference backend with a normal-mode buffer, its weights drawn from `gen`."""
    buffer = make_buffer(None, cfg.max_tokens, cfg.hidden, cfg.num_experts, "reference", "cpu", normal_mode=True)
    layer = FusedMoE(cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate, None, n_group=cfg.n_group,
                     topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                     n_shared_experts=cfg.n_shared_experts, buffer=buffer, max_tokens_per_rank=cfg.max_tokens)
    layer.load_weights(hf_weights(cfg, gen, "bf16").items())
    return layer


def test_normal_mode_packs_a_multiple_of_16_rows_per_expert(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The packed layout's rows per expert are the busiest expert's count rounded up to SPECIALIZED_MULTIPLE (16),
    so that the expert GEMM's strides fall in one class whatever the routing (one Triton compile, at warm-up)."""
    cfg = MoeConfig()
    gen = torch.Generator().manual_seed(seed)
    layer = one_rank_normal_layer(cfg, gen)
    packed = []
    run = layer.run_experts

    def spy(inputs: torch.Tensor, recv_count: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        packed.append((inputs.shape[1], int(recv_count.max())))
        return run(inputs, recv_count, out)

    monkeypatch.setattr(layer, "run_experts", spy)
    for n in (cfg.max_tokens + 1, 2 * cfg.max_tokens + 7):
        x = torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16)
        layer(x, mode="normal")
    assert len(packed) == 2 and all(m % 16 == 0 and busiest <= m < busiest + 16 for m, busiest in packed), packed


def test_normal_mode_packs_each_experts_rows_in_receive_order(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """local_expert_sums hands the expert kernels, for each local expert, exactly the received rows that picked it,
    in the order received (a row of only other ranks' experts, -1, in none), with their counts; a rank that received
    nothing runs no experts and counts nothing."""
    from ep_layer.moe.normal_forward import local_expert_sums

    cfg = MoeConfig()
    gen = torch.Generator().manual_seed(seed)
    layer = one_rank_normal_layer(cfg, gen)
    seen = []
    run = layer.run_experts

    def spy(inputs: torch.Tensor, recv_count: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        seen.append((inputs.clone(), recv_count.clone()))
        return run(inputs, recv_count, out)

    monkeypatch.setattr(layer, "run_experts", spy)
    n, k, experts = 37, cfg.top_k, layer.num_local_experts
    recv_idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])
    recv_idx[torch.rand(n, k, generator=gen) < 0.3] = -1
    recv_idx[5] = -1
    data = torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16)
    weights = torch.where(recv_idx >= 0, torch.rand(n, k, generator=gen), 0.0)
    busiest = int(torch.bincount(recv_idx[recv_idx >= 0], minlength=experts).max())
    local_expert_sums(layer, data, recv_idx, weights, busiest, torch.empty(n, cfg.hidden, dtype=torch.bfloat16))
    (inputs, recv_count), = seen
    for e in range(experts):
        rows = [i for i in range(n) if e in recv_idx[i].tolist()]
        assert recv_count[e] == len(rows) and torch.equal(inputs[e, :len(rows)], data[rows]), f"seed={seed} expert {e}"
    load = layer.expert_load.clone()
    out = torch.full((0, cfg.hidden), 7.0, dtype=torch.bfloat16)
    local_expert_sums(layer, data[:0], recv_idx[:0], weights[:0], 0, out)
    assert len(seen) == 1 and torch.equal(layer.expert_load, load)


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_normal_mode_buffer_holds_a_step_of_its_tokens_on_every_rank(ranks: int) -> None:
    """normal_mode_bytes for 8,192 tokens a rank passes the cuda backend's own capacity checks for a dispatch of that
    many bf16 tokens (top-8) and a combine of every rank's; DeepEP's size hint alone fails that combine from 2 ranks."""
    from ep_layer.backends.cuda_normal import CudaNormalMode
    from ep_layer.config import Config, normal_mode_bytes
    from ep_layer.layout import normal_half_bytes, row_stride

    hidden, tokens, k = 7168, 8192, 8

    def mode_with(num_bytes: int) -> CudaNormalMode:
        mode = object.__new__(CudaNormalMode)  # its capacity check reads these two only
        mode._half, mode._num_bytes = normal_half_bytes(num_bytes), num_bytes
        return mode

    sized = mode_with(normal_mode_bytes(tokens, hidden, ranks))
    sized._check_capacity("dispatch", tokens, row_stride(2 * hidden, 0, 8 * k, 4 * k), ranks)
    sized._check_capacity("combine", ranks * tokens, 2 * hidden, 4 * k)
    hint = mode_with(Config().get_nvl_buffer_size_hint(2 * hidden, ranks))
    if ranks > 1:
        with pytest.raises(ValueError, match="num_nvl_bytes: expected at least"):
            hint._check_capacity("combine", ranks * tokens, 2 * hidden, 4 * k)

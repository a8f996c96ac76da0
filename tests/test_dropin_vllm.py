"""vLLM's own classes drive the `deep_ep` drop-in (dropin/) on CPU ranks: nothing of vLLM is re-written here.

vLLM's sources are those of its PyPI wheels, releases 0.20.0 and 0.34.0 (engine_sources.VLLM_VERSIONS, fetched by
`scripts/fetch_engines.py` with the compiled packages 0.34.0's imports need; tests/engine_sources.py imports them
and says exactly what is stubbed: the parallel state, compiled ops and torch queries a CPU build cannot answer
(pinned memory, record_stream), CUDA stream and event objects). Per release,
on gloo ranks (tests/dist_harness.py), the reference backend (the `gpu` variants: the cuda backend, two processes
on one GPU):
- `vllm/distributed/device_communicators/all2all.py`: `DeepEPLLAll2AllManager` / `DeepEPHTAll2AllManager`
  `.get_handle` build the `deep_ep.Buffer` (one per set of arguments, cached), and `.destroy` frees it;
- `vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py` (`DeepEPLLPrepareAndFinalize`) and
  `deepep_ht.py` (`DeepEPHTPrepareAndFinalize`) inside `modular_kernel.py`'s `FusedMoEKernel` (the modular MoE
  kernel of both releases), with vLLM's `NaiveBatchedExperts` (`fused_batched_moe.py`, its reference batched
  experts) for the low-latency path;
- `vllm/v1/worker/ubatching.py`: two micro-batches (DBO) in vLLM's `UBatchContext`s, whose hooks and yields the
  prepare/finalize classes call;
checked against a dense float64 oracle of the MoE computed from the inputs, in bf16, FP8 with 128-column block
scales, and UE8M0 scales (low-latency), and what the prepare/finalize classes hand over exactly. The same files
are also read as source: every deep_ep call in them, in the branches a CPU rank does not take too, binds to the
drop-in (tests/deep_ep_calls.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from deep_ep_calls import check_calls
from dist_harness import run_ranks
from engine_sources import VLLM_VERSIONS, engine_config, install_groups, run_ubatches, source_dir, use_vllm
from test_deep_ep_dropin import (
    Tokens,
    check_combine,
    check_dense,
    check_dispatch,
    check_normal_dispatch,
    dequant_rows,
    draw,
    draw_counts,
    expert_factors,
    expert_outputs,
    for_parent,
    fp8_columns,
    gpu,
    label,
    local_experts,
    on_cpu,
    rng_for,
    setup_device,
)

# The low-latency kernels take the hidden sizes vLLM pads to (DeepEPLLPrepareAndFinalize.SUPPORTED_HIDDEN_SIZES,
# 2048 the smallest); 8 experts, top-4, a small SwiGLU intermediate (a multiple of the 128-wide FP8 blocks).
H, E, K, N, T = 2048, 8, 4, 128, 16
HT_TOKENS = 40  # prefill tokens per rank at most (normal mode)
BLOCK = 128
# Per token, |got - want| / |want| (Euclidean norms) within this: the experts round to bf16 (u = 2^-8) after each
# of their two GEMMs and the path after them a few times more (the combine; high throughput: also the weighting
# and the top-k sum), so a few u (measured: about 1.5 u); a wrong row, expert or weight is off by O(1).
RTOL = 6 * 2.0 ** -8


@pytest.fixture(scope="module", params=VLLM_VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    """A vLLM release, its sources fetched once here so that the ranks find them cached."""
    source_dir("vllm", request.param)
    return request.param


# ============================================================================================ weights and oracle
def expert_weights(seed: int, mode: str) -> dict[str, torch.Tensor]:
    """Every expert's SwiGLU weights in vLLM's layout: w1 [E, 2N, H] (gate rows, then up rows), w2 [E, H, N];
    bf16, or FP8 codes with float32 scales per 128x128 block (w1_scale [E, 2N/128, H/128], w2_scale
    [E, H/128, N/128])."""
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    shapes = {"w1": (E, 2 * N, H), "w2": (E, H, N)}
    out: dict[str, torch.Tensor] = {}
    for name, (e, rows, cols) in shapes.items():
        w = torch.randn(e, rows, cols, generator=gen)
        if mode == "bf16":
            out[name] = (w / cols ** 0.5).to(torch.bfloat16)
        else:
            out[name] = (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name + "_scale"] = (0.5 + torch.rand(e, rows // BLOCK, cols // BLOCK, generator=gen)) / (
                64 * cols ** 0.5)
    return out


def dense_weight(weights: dict[str, torch.Tensor], name: str, expert: int) -> np.ndarray:
    """float64 value of one expert's weight, FP8 blocks times their scales."""
    w = weights[name][expert].double()
    scale = weights.get(name + "_scale")
    if scale is None:
        return w.numpy()
    return (w * scale[expert].double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)).numpy()


def dense_moe(tokens: Tokens, weights: dict[str, torch.Tensor], mode: str) -> np.ndarray:
    """The oracle, float64 [n, H]: Σ_k w[t, k] · SwiGLU-MLP of expert idx[t, k] applied to token t as dispatched
    (its bf16 row, or the per-token 128-group FP8 cast of it with float32 or UE8M0 scales)."""
    if mode == "bf16":
        rows = tokens.x.double().numpy()
    else:
        codes, scales = fp8_columns(tokens.x, mode)
        if scales.dtype == torch.int32:  # four biased exponents per int32, group g in byte g % 4
            scales = (scales.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        rows = (codes.double().unflatten(-1, (-1, BLOCK)) * scales.double().unsqueeze(-1)).flatten(-2).numpy()
    out = np.zeros_like(rows)
    idx, wts = tokens.idx.numpy(), tokens.w.double().numpy()
    for e in np.unique(idx[idx >= 0]):
        t, k = np.nonzero(idx == e)
        w1, w2 = dense_weight(weights, "w1", e), dense_weight(weights, "w2", e)
        gate, up = rows[t] @ w1[:N].T, rows[t] @ w1[N:].T
        out[t] += wts[t, k, None] * ((gate / (1 + np.exp(-gate)) * up) @ w2.T)
    return out


def check_moe(out: torch.Tensor, tokens: Tokens, weights: dict[str, torch.Tensor], mode: str, where: str) -> float:
    """`out` (bf16 [n, H]) against the oracle: tokens without experts exactly 0, the others within RTOL.
    Returns the largest relative error."""
    want = dense_moe(tokens, weights, mode)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == want.shape, f"{where}: {out.dtype} {list(out.shape)}"
    got = out.cpu().double().numpy()
    none = (tokens.idx < 0).all(dim=1).numpy()
    assert not got[none].any(), f"{where}: a token without experts is not 0"
    err = np.linalg.norm(got - want, axis=1)
    scale = np.linalg.norm(want, axis=1)
    rel = np.where(none, 0.0, err / np.maximum(scale, 1e-300))
    bad = np.nonzero(rel > RTOL)[0]
    assert not bad.size, f"{where}: tokens {bad.tolist()} off the oracle by {rel[bad].tolist()} (rtol {RTOL})"
    return float(rel.max(initial=0.0))


# ============================================================================================ vLLM's objects
def parallel_config(v: Any, rank: int, world: int, backend: str) -> Any:
    """FusedMoEParallelConfig of `--data-parallel-size world --enable-expert-parallel --all2all-backend backend`."""
    return v.moe_config.FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0,
                                               pcp_rank=0, dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                               all2all_backend=backend, enable_eplb=False)


def moe_config(v: Any, rank: int, world: int, backend: str, device: torch.device) -> Any:
    """FusedMoEConfig of this layer. The intermediate size's field was renamed after 0.20
    (intermediate_size_per_partition -> intermediate_size): whichever this release has."""
    fields = {f.name for f in dataclasses.fields(v.moe_config.FusedMoEConfig)}
    inter = "intermediate_size" if "intermediate_size" in fields else "intermediate_size_per_partition"
    return v.moe_config.FusedMoEConfig(
        num_experts=E, experts_per_token=K, hidden_dim=H, num_local_experts=E // world, num_logical_experts=E,
        activation=v.activation.MoEActivation.SILU, device=device, routing_method=v.moe_config.RoutingMethodType.TopK,
        moe_parallel_config=parallel_config(v, rank, world, backend), in_dtype=torch.bfloat16, max_num_tokens=T,
        **{inter: N})


def quant_config(v: Any, weights: dict[str, torch.Tensor], mode: str) -> Any:
    """vLLM's quant config: unquantized, or FP8 weights and activations in 128x128 blocks."""
    if mode == "bf16":
        return v.moe_config.FUSED_MOE_UNQUANTIZED_CONFIG
    return v.moe_config.fp8_w8a8_moe_quant_config(w1_scale=weights["w1_scale"], w2_scale=weights["w2_scale"],
                                                  block_shape=[BLOCK, BLOCK])


def ue8m0_experts(v: Any) -> type:
    """vLLM's NaiveBatchedExperts taking packed UE8M0 activation scales (as vLLM's DeepGEMM experts do, which
    is what makes DeepEPLLPrepareAndFinalize dispatch UE8M0): it unpacks them to float32 and runs as shipped."""
    base = v.batched.NaiveBatchedExperts

    class Ue8m0NaiveBatchedExperts(base):
        def supports_packed_ue8m0_act_scales(self) -> bool:
            return True

        def apply(self, *args: Any, **kwargs: Any) -> None:
            scales = kwargs["a1q_scale"]
            assert scales.dtype == torch.int32, scales.dtype
            kwargs["a1q_scale"] = (scales.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
            super().apply(*args, **kwargs)

    return Ue8m0NaiveBatchedExperts


def local_weights(weights: dict[str, torch.Tensor], rank: int, world: int, device: torch.device) -> dict:
    lo, hi = rank * E // world, (rank + 1) * E // world
    return {k: w[lo:hi].to(device) for k, w in weights.items()}


def tokens_on(tokens: Tokens, device: torch.device) -> Tokens:
    return Tokens(*(t.to(device, copy=True) for t in tokens))


def hide_gpus(device: str) -> None:
    """CPU ranks see no GPU, so that the Buffer vLLM's managers make with DeepEP's defaults (backend "auto") is
    the reference backend's, on a GPU machine too. Before the rank's first CUDA call."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def dbo_step(v: Any, apply: Callable[[Tokens], torch.Tensor], halves: list[Tokens], dev: torch.device
             ) -> list[torch.Tensor]:
    """The halves as vLLM's two micro-batches. Checks that vLLM's ubatching saw them (dbo_enabled, the ids) and
    that micro-batch 1 started before micro-batch 0 ended: the prepare/finalize classes yielded between them."""
    order: list[tuple[str, int]] = []

    def micro(u: int, half: Tokens) -> torch.Tensor:
        assert v.ubatching.dbo_enabled() and v.ubatching.dbo_current_ubatch_id() == u
        order.append(("start", u))
        out = apply(half)
        order.append(("end", u))
        return out

    outs = run_ubatches(v, [functools.partial(micro, u, half) for u, half in enumerate(halves)], dev)
    assert order.index(("start", 1)) < order.index(("end", 0)), f"the micro-batches never overlapped: {order}"
    return outs


# ============================================================================================ low latency
def ll_exact_step(v: Any, pf: Any, qc: Any, every: list[Tokens], rank: int, mode: str, dev: torch.device,
                  where: str) -> None:
    """DeepEPLLPrepareAndFinalize's synchronous `prepare` and `finalize`: what prepare returns (rows, bf16 or FP8
    codes with their float32 or packed UE8M0 scales, and per-expert counts) exactly as DeepEP's dispatch defines
    it, and finalize's combine of experts that scale their rows by (e + 1) / 8, exactly."""
    t = tokens_on(every[rank], dev)
    expert_x, scale, meta, _, _ = pf.prepare(t.x, t.w, t.idx, E, None, False, qc)
    recv = expert_x if mode == "bf16" else (expert_x, scale)
    check_dispatch(on_cpu((recv,))[0], meta.expert_num_tokens.cpu(), every, rank, T, E, mode, where)
    y = expert_outputs(recv, expert_factors(local_experts(rank, E // len(every)), dev))
    out = torch.empty_like(t.x)
    pf.finalize(out, y, t.w, t.idx, False, v.topk_reduce.TopKWeightAndReduceDelegate())
    check_combine(out, every[rank], mode, where)


def rank_vllm_ll(rank: int, world: int, version: str, seed: int, device: str) -> dict[str, float]:
    """`--all2all-backend deepep_low_latency`: the manager's Buffer, then per dispatch format a FusedMoEKernel of
    DeepEPLLPrepareAndFinalize and NaiveBatchedExperts over it: plain steps and a two-micro-batch step, each
    output against the oracle; then the manager's teardown. Returns the largest relative error per format."""
    hide_gpus(device)
    import deep_ep

    v = use_vllm(version)
    dev = setup_device(rank, device)
    pg = dist.new_group(list(range(world)), backend="gloo")  # the EP group's cpu_group
    ep = install_groups(v, pg)
    with engine_config(v, dev):
        manager = v.all2all.DeepEPLLAll2AllManager(pg)
    ep.device_communicator.all2all_manager = manager
    handle_args = dict(max_num_tokens_per_dp_rank=T, token_hidden_size=H, num_ep_ranks=world, num_global_experts=E,
                       num_local_experts=E // world)
    buffer = manager.get_handle(handle_args)
    assert manager.get_handle(dict(handle_args)) is buffer, "one Buffer per set of arguments"
    assert isinstance(buffer, deep_ep.Buffer) and buffer.low_latency_mode and buffer.group_size == world
    assert buffer.num_rdma_bytes == deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    assert (buffer.group, buffer.num_nvl_bytes, buffer.explicitly_destroy, buffer.enable_shrink) == \
        (pg, v.envs.VLLM_DEEPEP_BUFFER_SIZE_MB << 20, True, False)
    assert buffer.backend_name == ("cuda" if device == "cuda" else "reference")
    draft = manager.get_handle({**handle_args, "token_hidden_size": 2 * H})  # a draft model's MoE layers
    assert draft is not buffer and draft.num_rdma_bytes == deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, 2 * H, world, E), "a Buffer per distinct set of arguments"
    if "enable_fault_tolerance" in {f.name for f in dataclasses.fields(v.config.ParallelConfig)}:
        with engine_config(v, dev, enable_fault_tolerance=True):  # --enable-fault-tolerance
            tolerant = v.all2all.DeepEPLLAll2AllManager(pg)
        shrinking = tolerant.get_handle(handle_args)
        assert shrinking is not buffer and shrinking.enable_shrink, "fault tolerance: a Buffer that masks ranks"
        if dev.type == "cuda":  # the manager's fault queries allocate on "cuda"
            assert tolerant.query_active_mask().tolist() == [0] * world and not tolerant.query_fault()
            tolerant.clean_buffers()
        shrinking.destroy()
    v.workspace.init_workspace_manager(dev, num_ubatches=2)

    worst: dict[str, float] = {}
    for mode in ("bf16", "fp8", "ue8m0"):
        weights = expert_weights(seed, mode)
        mine = local_weights(weights, rank, world, dev)
        qc = quant_config(v, mine, mode)
        experts_cls = ue8m0_experts(v) if mode == "ue8m0" else v.batched.NaiveBatchedExperts
        experts = experts_cls(moe_config=moe_config(v, rank, world, "deepep_low_latency", dev), quant_config=qc,
                              max_num_tokens=T, num_dispatchers=world)
        # all2all_utils.maybe_make_prepare_finalize's arguments (FP8 dispatch: FP8 activations in 128 blocks)
        pf = v.ll.DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=T, num_dispatchers=world,
                                             use_fp8_dispatch=mode != "bf16")
        kernel = v.mk.FusedMoEKernel(pf, experts)
        assert pf.use_ue8m0_dispatch == (mode == "ue8m0")
        counts = draw_counts(seed, ("ll-exact", mode), world, 0, T)
        ll_exact_step(v, pf, qc, draw(seed, ("ll-exact", mode), counts, H, E, K), rank, mode, dev,
                      label(seed, rank, version, mode, "prepare/finalize"))

        def apply(tokens: Tokens, kernel: Any = kernel, mine: dict = mine) -> torch.Tensor:
            t = tokens_on(tokens, dev)
            return kernel.apply(t.x, mine["w1"], mine["w2"], t.w, t.idx, activation=v.activation.MoEActivation.SILU,
                                global_num_experts=E, expert_map=None, apply_router_weight_on_input=False)

        errors = []
        for step in range(2):
            counts = draw_counts(seed, ("ll", mode, step), world, 0, T)
            every = draw(seed, ("ll", mode, step), counts, H, E, K)
            out = apply(every[rank])
            errors.append(check_moe(out, every[rank], weights, mode, label(seed, rank, version, mode, "step", step)))
        counts = draw_counts(seed, ("ll-dbo", mode), world, 0, T)
        every = draw(seed, ("ll-dbo", mode), counts, H, E, K)
        split = int(rng_for(seed, ("split", mode, rank)).integers(0, counts[rank] + 1))
        halves = [every[rank].rows(0, split), every[rank].rows(split, counts[rank])]
        outs = dbo_step(v, apply, halves, dev)
        for u, (out, half) in enumerate(zip(outs, halves)):
            errors.append(check_moe(out, half, weights, mode, label(seed, rank, version, mode, "DBO ubatch", u)))
        worst[mode] = max(errors)

    manager.destroy()
    for buf in (buffer, draft):
        with pytest.raises(RuntimeError, match="destroy"):
            buf.low_latency_dispatch(torch.zeros(1, H, dtype=torch.bfloat16, device=dev),
                                     torch.zeros(1, K, dtype=torch.int64, device=dev), T, E)
    return worst


# ============================================================================================ high throughput
def standard_experts(v: Any) -> type:
    """Experts in vLLM's standard activation format for the high-throughput path, in plain torch (vLLM ships
    only Triton, CUTLASS and DeepGEMM ones for it, none of which runs on CPU): per received row and top-k slot,
    the SwiGLU MLP of the slot's local expert (expert_map), through vLLM's own activation, into [M, topk, H];
    vLLM's TopKWeightAndReduceContiguous then weighs and sums the slots (finalize_weight_and_reduce_impl:
    the prepare/finalize's choice). It checks the per-expert counts the prepare handed over."""
    mk = v.mk

    class TorchStandardExperts(mk.FusedMoEExpertsModular):
        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device() -> bool:
            return True

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
            return True

        @staticmethod
        def _supports_activation(activation: Any) -> bool:
            return activation == v.activation.MoEActivation.SILU

        @staticmethod
        def _supports_parallel_config(moe_parallel_config: Any) -> bool:
            return True

        def supports_expert_map(self) -> bool:
            return True

        def finalize_weight_and_reduce_impl(self) -> Any:
            return v.topk_reduce.TopKWeightAndReduceDelegate()

        def workspace_shapes(self, M: int, N: int, K: int, topk: int, *args: Any, **kwargs: Any) -> tuple:
            return (M, topk, max(N, K)), (M, N // 2), (M, topk, K)

        def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
                  expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
                  workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
                  apply_router_weight_on_input: bool, **kwargs: Any) -> None:
            assert expert_map is not None
            local = expert_map[topk_ids]
            have = torch.bincount(local[local >= 0].long(), minlength=w1.shape[0]).to(torch.int32)
            assert torch.equal(expert_tokens_meta.expert_num_tokens.cpu(), have.cpu()), "expert_num_tokens"
            rows = hidden_states.float()
            if a1q_scale is not None:
                rows = (rows.unflatten(-1, (-1, BLOCK)) * a1q_scale.float().unsqueeze(-1)).flatten(-2)
            output.zero_()
            for e in range(w1.shape[0]):
                m, k = torch.nonzero(local == e, as_tuple=True)
                if m.numel() == 0:
                    continue
                w1e, w2e = (self._dense(w, s, e) for w, s in ((w1, self.w1_scale), (w2, self.w2_scale)))
                gate_up = (rows[m] @ w1e.T).to(output.dtype)
                act = torch.empty(m.numel(), w1e.shape[0] // 2, dtype=output.dtype, device=output.device)
                self.activation(activation, act, gate_up)
                output[m, k] = (act.float() @ w2e.T).to(output.dtype)

        @staticmethod
        def _dense(w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
            if scale is None:
                return w[e].float()
            blocks = scale[e].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            return w[e].float() * blocks

    return TorchStandardExperts


def ht_exact_step(v: Any, pf: Any, qc: Any, every: list[Tokens], rank: int, mode: str, expert_map: torch.Tensor,
                  dev: torch.device, where: str) -> None:
    """DeepEPHTPrepareAndFinalize's synchronous `prepare` and `finalize`: the rows prepare returns are exactly
    those DeepEP's normal-mode dispatch sends (bf16, or vLLM's own FP8 cast of them), with their weights and
    per-expert counts, and the ids the receiver makes global again; finalize (vLLM's TopKWeightAndReduceContiguous,
    then the combine) of experts that scale their rows by (e + 1) / 8 against the dense oracle."""
    world = len(every)
    lo, num_local = rank * (E // world), E // world
    t = tokens_on(every[rank], dev)
    expert_x, scale, meta, ids, wts = pf.prepare(t.x, t.w, t.idx, E, expert_map, False, qc)
    if mode == "bf16":
        recv, sent = expert_x, [tok.x for tok in every]
    else:
        recv = (expert_x, scale)
        # Each sender casts on its own device (vLLM's cast there, as prepare runs it): the same math, on dev.
        sent = [on_cpu(v.fp8_utils.per_token_group_quant_fp8(tok.x.to(dev), BLOCK)) for tok in every]
    local = torch.where((ids >= lo) & (ids < lo + num_local), ids - lo, -1)
    check_normal_dispatch(on_cpu((recv,))[0], local.cpu(), wts.cpu(), meta.expert_num_tokens.cpu().tolist(), sent,
                          every, rank, E, 1, where)
    factors = expert_factors(local_experts(rank, num_local), dev)
    slot = torch.where(local >= 0, factors[local.clamp(min=0)], 0.0)
    rows = dequant_rows(expert_x, scale if mode != "bf16" else None)
    fused = (rows[:, None, :] * slot[:, :, None]).to(torch.bfloat16) if rows.shape[0] else rows.to(torch.bfloat16)
    out = torch.empty_like(t.x)
    pf.finalize(out, fused, wts, ids, False, v.topk_reduce.TopKWeightAndReduceDelegate())
    check_dense(for_parent(out), every[rank], mode, where)


def rank_vllm_ht(rank: int, world: int, version: str, seed: int, device: str) -> dict[str, float]:
    """`--all2all-backend deepep_high_throughput`: the manager's Buffer, then per format (bf16, FP8 blocks) a
    FusedMoEKernel of DeepEPHTPrepareAndFinalize (all2all_utils' arguments) over it: plain steps and a
    two-micro-batch step against the oracle; then the teardown. Returns the largest relative error per format."""
    hide_gpus(device)
    import deep_ep

    v = use_vllm(version)
    dev = setup_device(rank, device)
    pg = dist.new_group(list(range(world)), backend="gloo")
    ep = install_groups(v, pg)
    with engine_config(v, dev):
        manager = v.all2all.DeepEPHTAll2AllManager(pg)
    ep.device_communicator.all2all_manager = manager
    buffer = manager.get_handle({})
    assert manager.get_handle({}) is buffer, "one Buffer for every layer"
    assert isinstance(buffer, deep_ep.Buffer) and not buffer.low_latency_mode and buffer.group_size == world
    assert (buffer.group, buffer.num_nvl_bytes, buffer.num_rdma_bytes, buffer.explicitly_destroy) == \
        (pg, v.envs.VLLM_DEEPEP_BUFFER_SIZE_MB << 20, 0, True)
    assert buffer.backend_name == ("cuda" if device == "cuda" else "reference")
    v.workspace.init_workspace_manager(dev, num_ubatches=2)
    num_local = E // world
    expert_map = torch.full((E,), -1, dtype=torch.int32, device=dev)  # FusedMoE's map of this EP rank
    expert_map[rank * num_local:(rank + 1) * num_local] = torch.arange(num_local, dtype=torch.int32, device=dev)

    worst: dict[str, float] = {}
    for mode in ("bf16", "fp8"):
        weights = expert_weights(seed, mode)
        mine = local_weights(weights, rank, world, dev)
        experts = standard_experts(v)(moe_config=moe_config(v, rank, world, "deepep_high_throughput", dev),
                                      quant_config=quant_config(v, mine, mode))
        pf = v.ht.DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=world, dp_size=world,
                                             rank_expert_offset=rank * num_local)
        kernel = v.mk.FusedMoEKernel(pf, experts)
        counts = draw_counts(seed, ("ht-exact", mode), world, 1, HT_TOKENS)
        ht_exact_step(v, pf, experts.quant_config, draw(seed, ("ht-exact", mode), counts, H, E, K), rank, mode,
                      expert_map, dev, label(seed, rank, version, mode, "prepare/finalize"))

        def apply(tokens: Tokens, kernel: Any = kernel, mine: dict = mine) -> torch.Tensor:
            t = tokens_on(tokens, dev)
            return kernel.apply(t.x, mine["w1"], mine["w2"], t.w, t.idx, activation=v.activation.MoEActivation.SILU,
                                global_num_experts=E, expert_map=expert_map, apply_router_weight_on_input=False)

        errors = []
        for step in range(2):  # prefill: no per-rank bound; vLLM pads an idle rank to one token
            counts = draw_counts(seed, ("ht", mode, step), world, 1, HT_TOKENS)
            every = draw(seed, ("ht", mode, step), counts, H, E, K)
            out = apply(every[rank])
            errors.append(check_moe(out, every[rank], weights, mode, label(seed, rank, version, mode, "step", step)))
        counts = draw_counts(seed, ("ht-dbo", mode), world, 2, HT_TOKENS)
        every = draw(seed, ("ht-dbo", mode), counts, H, E, K)
        split = int(rng_for(seed, ("ht-split", mode, rank)).integers(1, counts[rank]))
        halves = [every[rank].rows(0, split), every[rank].rows(split, counts[rank])]
        outs = dbo_step(v, apply, halves, dev)
        for u, (out, half) in enumerate(zip(outs, halves)):
            errors.append(check_moe(out, half, weights, mode, label(seed, rank, version, mode, "DBO ubatch", u)))
        worst[mode] = max(errors)

    manager.destroy()
    with pytest.raises(RuntimeError, match="destroy"):
        buffer.get_dispatch_layout(topk_idx=torch.zeros(1, K, dtype=torch.int64, device=dev), num_experts=E)
    return worst


@pytest.mark.parametrize("world", [2])
def test_vllm_deepep_low_latency(version: str, world: int, seed: int) -> None:
    """vLLM's low-latency path end to end on our Buffer, all three dispatch formats, plain and DBO steps."""
    results = run_ranks(rank_vllm_ll, world, version, seed, "cpu", timeout_s=300)
    assert all(set(r) == {"bf16", "fp8", "ue8m0"} for r in results), results
    print(f"vLLM {version}: largest relative error per rank and format {results}")


@gpu
def test_vllm_deepep_low_latency_cuda(version: str, seed: int) -> None:
    """The same on the cuda backend: two processes on one GPU, vLLM handing the Buffer its gloo group."""
    run_ranks(rank_vllm_ll, 2, version, seed, "cuda", timeout_s=300)


@pytest.mark.parametrize("world", [2])
def test_vllm_deepep_high_throughput(version: str, world: int, seed: int) -> None:
    """vLLM's high-throughput path end to end on our Buffer: bf16 and FP8 block dispatch, plain and DBO steps."""
    results = run_ranks(rank_vllm_ht, world, version, seed, "cpu", timeout_s=300)
    assert all(set(r) == {"bf16", "fp8"} for r in results), results
    print(f"vLLM {version}: largest relative error per rank and format {results}")


@pytest.mark.slow
def test_vllm_deepep_high_throughput_four_ranks(seed: int) -> None:
    """The same on four ranks, with the newest release only (the rank count is our Buffer's business, and four
    ranks importing vLLM on a small machine take a while)."""
    version = VLLM_VERSIONS[-1]
    source_dir("vllm", version)
    results = run_ranks(rank_vllm_ht, 4, version, seed, "cpu", timeout_s=300)
    assert all(set(r) == {"bf16", "fp8"} for r in results), results


@gpu
@pytest.mark.parametrize("world", [2])
def test_vllm_deepep_high_throughput_cuda(version: str, world: int, seed: int) -> None:
    """The same on the cuda backend's normal-mode kernels: two processes on one GPU."""
    run_ranks(rank_vllm_ht, world, version, seed, "cuda", timeout_s=300)


# Per file, how it names deep_ep's Buffer class and its Buffers, and what it calls on them in every release here.
VLLM_CALLERS = {
    "vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py": (
        {"self.buffer"}, {"low_latency_dispatch", "low_latency_combine"}),
    "vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py": (
        {"self.buffer", "deep_ep.Buffer"}, {"get_dispatch_config", "get_combine_config", "get_dispatch_layout",
                                            "dispatch", "combine"}),
    "vllm/distributed/device_communicators/all2all.py": (
        {"deep_ep.Buffer", "DeepEPLLAll2AllManager._buffer", "buf"}, {"set_num_sms", "get_low_latency_rdma_size_hint"}),
}


@pytest.mark.parametrize("path", sorted(VLLM_CALLERS))
def test_vllm_deepep_calls_bind_to_the_drop_in(version: str, path: str) -> None:
    """Every call these files make on deep_ep's Buffer binds to the drop-in's signature, in the branches the CPU
    ranks above do not take too (ROCm's, NVFP4's: the drop-in refuses DeepEP forks' keywords by name)."""
    receivers, expected = VLLM_CALLERS[path]
    seen = check_calls(source_dir("vllm", version) / path, f"vllm {version} {path}", receivers)
    assert seen >= expected, f"{path} no longer calls {sorted(expected - seen)}: has it moved?"

"""`ep_layer.moe` on a GPU: the Triton expert kernels (bf16: against the PyTorch path, itself checked
against float64 and transformers in test_moe.py; FP8: both paths against float64 with a derived error
bound), CUDA-graph capture, and the whole layer on one GPU with the reference backend and with emulated
ranks of the cuda backend. Skipped without a GPU and Triton.

bf16 tolerance: |triton - torch| <= 2**-5 * (|ref| + rms(ref)). The two paths round to bf16 at the same
points but sum in different orders, so an intermediate lands at most a bf16 ulp (2**-8) apart, and the
outputs a few output ulps apart: 2**-5 leaves a wide margin over that and catches any indexing error.
The FP8 expert check is explained at `fp8_expert_oracle`; the layer tests still compare the GPU layer
with the CPU layer at 2**-4 for FP8.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from cuda_graphs import capture_after_warmup
from moe_helpers import MoeConfig, dense_weights, hf_weights

from ep_layer import Buffer, native
from ep_layer.kernels import triton_support
from ep_layer.kernels.fp8_cast import cast_rows_to_fp8
from ep_layer.kernels.fp8_linear import fp8_block_linear
from ep_layer.kernels.masked_gemm import BLOCK_M, masked_grouped_gemm
from ep_layer.moe import (
    CommStreams,
    ExpertWeights,
    FusedMoE,
    TorchExperts,
    run_interleaved,
    triton_experts,
)
from ep_layer.moe.layer import forward_two_microbatches
from ep_layer.moe.loading import scale_slot, weight_slot
from ep_layer.quant import FP8_GROUP, per_token_cast_to_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_support.available(), reason=triton_support.unavailable_reason()),
]

TOL = {False: 2.0 ** -5, True: 2.0 ** -4}  # by fp8


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got, want = got.double().cpu(), want.double().cpu()
    if want.numel() == 0:
        return
    scale = want.abs() + want.pow(2).mean().sqrt()
    worst = ((got - want).abs() / scale).max().item()
    assert worst <= tol, f"{what}: max |err| / (|ref| + rms) = {worst:.4f} > {tol}"


def assert_close_fp8_paths(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Two whole FP8 layers (GPU vs CPU) agree in aggregate: where one path's intermediate lands on the
    other side of an e4m3 rounding boundary, single elements move by up to a step (~2**-4 relative), so
    the RMS difference is held to 2**-5 of the output's RMS and single elements only to 2**-3; an
    indexing or scale error moves the RMS by far more."""
    got, want = got.double().cpu(), want.double().cpu()
    if want.numel() == 0:
        return
    rms = want.pow(2).mean().sqrt()
    rel_rms = ((got - want).pow(2).mean().sqrt() / rms).item()
    worst = ((got - want).abs() / (want.abs() + rms)).max().item()
    assert rel_rms <= 2.0 ** -5 and worst <= 2.0 ** -3, f"{what}: rms diff {rel_rms:.4f}, worst element {worst:.4f}"


def assert_layer_close(got: torch.Tensor, want: torch.Tensor, quant: str, what: str) -> None:
    if quant == "fp8-block":
        assert_close_fp8_paths(got, want, what)
    else:
        assert_close(got, want, TOL[False], what)


def expert_store(gen: torch.Generator, num_experts: int, hidden: int, inter: int, fp8: bool,
                 device: str) -> ExpertWeights:
    return expert_weights(gen, num_experts, hidden, inter, fp8, device)[0]


def expert_weights(gen: torch.Generator, num_experts: int, hidden: int, inter: int, fp8: bool,
                   device: str) -> tuple[ExpertWeights, dict[str, torch.Tensor]]:
    """Random experts in the kernels' storage, and the same tensors with their HF names."""
    cfg = MoeConfig(num_experts=num_experts, hidden=hidden, intermediate=inter, n_group=1, topk_group=1)
    weights = hf_weights(cfg, gen, "fp8" if fp8 else "bf16")
    store = ExpertWeights(num_experts, hidden, inter, fp8, device)
    for e in range(num_experts):
        for p in ("gate", "up", "down"):
            weight_slot(store, e, p).copy_(weights[f"experts.{e}.{p}_proj.weight"])
            if fp8:
                scale_slot(store, e, p).copy_(weights[f"experts.{e}.{p}_proj.weight_scale_inv"])
    return store, weights


def masked_inputs(gen: torch.Generator, counts: list[int], rows: int, hidden: int, fp8: bool, device: str):
    """Dispatch-shaped input: random rows below each count, NaN garbage above; FP8 with column-major scales."""
    x = torch.full((len(counts), rows, hidden), float("nan"))
    for e, n in enumerate(counts):
        x[e, :n] = torch.randn(n, hidden, generator=gen) * 2
    x = x.to(torch.bfloat16).to(device)
    if not fp8:
        return x
    data, scales = per_token_cast_to_fp8(x.view(-1, hidden))
    scales = scales.view(len(counts), rows, -1).transpose(1, 2).contiguous().transpose(1, 2)
    return data.view(x.shape), scales


def to_cpu(x):
    return tuple(t.cpu() for t in x) if isinstance(x, tuple) else x.cpu()


# ---------------------------------------------------------------------------- FP8 expert oracle
BF16_BITS = 8  # significant bits of bf16: rounding moves a value by at most 2**(e - 8) in binade [2**e, 2**(e+1))
E4M3_BITS = 4  # of e4m3 (3 stored + the implicit one); binades below 2**-6 are subnormal with 2**-6's spacing
E4M3_MIN_EXP = -6
HOEFFDING_Z = 8.5  # P(|sum of bounded zero-mean terms| > Z * sqrt(sum of squared bounds)) <= 2 exp(-Z**2 / 2) = 4e-16
RMS_SIGMAS = 6.0  # the per-expert mean square error may exceed its expectation by this many standard deviations
ACCUMULATION = 2.0 ** -9  # float32 sums, FP8 tensor-core partial sums, scale products: relative to rms(ref)
TRITON_VS_TORCH = 1.5  # the Triton path's RMS error (all rows) may be at most this multiple of PyTorch's


def half_ulp(v: torch.Tensor, bits: int, min_exp: int | None = None) -> torch.Tensor:
    """The most rounding to nearest moves a value of magnitude v (>= 0) on a grid with `bits` significant
    bits (and below 2**min_exp, subnormal spacing): 2**(floor(log2 v) - bits), 0 for v = 0 without
    subnormals."""
    exponent = torch.floor(torch.log2(v))
    if min_exp is not None:
        exponent = exponent.clamp(min=min_exp)
    return torch.exp2(exponent - bits)


class Fp8Oracle:
    """float64 truth for one expert on FP8 inputs, and how far an implementation of the module contract
    (ep_layer/moe/experts.py) may honestly be from it.

    Reference: the exact SwiGLU MLP, in float64, of the dequantised FP8 input rows with the dequantised
    FP8 block weights, WITHOUT re-quantising the intermediate a = SiLU(gate) * up. That is deliberate.
    The contract rounds `a` to bf16 and casts it to e4m3 per token and 128 channels; a reference that did
    the same from its float64 `a` would be a third FP8 path: wherever an implementation's float32 (or
    reduced-precision tensor-core) `a` lies on the other side of a rounding boundary, it picks the
    neighbouring e4m3 value, a whole step (up to 2**-3 relative) away from the reference's, and such
    flips are what made comparing two FP8 paths fail. Against the exact `a`, an implementation is within
    half a step of its own grid whichever neighbour it picks, so its deviation is a sum of bounded,
    zero-mean rounding errors whose size is known element by element:

      delta_j (one intermediate) <= c_j = half_ulp_bf16(a_j) + half_step_e4m3(a_j on its group's grid),
      the group's grid being amax / 448 (amax over the token's 128 channels, as the implementation's bf16
      values have it: within 2**-8 of the exact one, so the grid gets a 2**-7 margin, and the binade
      a 2**-5 one);
      err_i = sum_j down_ij * delta_j + bf16 rounding of the output (<= half_ulp_bf16(y_i)) + float32 /
      tensor-core accumulation (<= ACCUMULATION * rms(y), generous: float32 sums are ~1e-6 relative).

    Two checks follow, per expert and per path:
    - per element (Hoeffding, independent rounding errors assumed): |err_i| <= Z * sqrt(sum_j down_ij**2
      * c_j**2) + half_ulp_bf16(y_i) + ACCUMULATION * rms(y); a false alarm has probability < 1e-8 over
      a whole test (< 5e6 elements), while an indexing bug (wrong scale block, row, expert, K block)
      moves elements by the order of |y|, about 3x this bound on a typical element;
    - mean square (the sensitive one): with uniform rounding errors, var_j = (bf16 half_ulp**2 + e4m3
      half_step**2) / 3, the error's mean square over the expert has expectation E = sum_i sum_j
      down_ij**2 var_j + output rounding, and variance <= 2 sum_rows var^T (G o G) var, G = down^T down
      (the Gaussian bound on each delta_j**2's variance, and the cross terms); the RMS error must stay
      within sqrt(E + 6 sd) + ACCUMULATION * rms(y). Rounding gives RMS errors of ~3% of rms(y) with a
      ratio measured / expected close to 1; an indexing bug gives errors of order rms(y).
    """

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, weights: dict[str, torch.Tensor],
                 prefix: str, device: torch.device | str) -> None:
        n, h = data.shape
        w = {p: torch.from_numpy(v).to(device) for p, v in dense_weights(weights, prefix).items()}
        groups = data.to(device).double().view(n, h // FP8_GROUP, FP8_GROUP)
        x = (groups * scales.to(device).double().unsqueeze(-1)).view(n, h)  # exact: 4 x 24 significant bits
        gate, up = x @ w["gate"].T, x @ w["up"].T
        a = gate * torch.sigmoid(gate) * up
        self.ref = a @ w["down"].T
        self.rms_ref = self.ref.pow(2).mean().sqrt().item()
        inter = a.shape[1]
        padded = -(-inter // FP8_GROUP) * FP8_GROUP  # the kernels' zero padding joins the last group
        mag = torch.zeros(n, padded, dtype=torch.float64, device=device)
        mag[:, :inter] = a.abs()
        amax = mag.view(n, -1, FP8_GROUP).amax(dim=-1).clamp(min=1e-4)
        grid = (amax / 448 * (1 + 2.0 ** -7)).repeat_interleave(FP8_GROUP, dim=1)[:, :inter]
        e4m3 = grid * half_ulp(a.abs() / grid * (1 + 2.0 ** -5), E4M3_BITS, E4M3_MIN_EXP)
        bf16 = half_ulp(a.abs(), BF16_BITS)
        bound = bf16 + e4m3  # the most each intermediate can be off
        var = (bf16.pow(2) + e4m3.pow(2)) / 3  # its variance for uniform rounding errors
        down2 = w["down"].pow(2)  # [H, I]
        out_round = half_ulp(self.ref.abs() * (1 + 2.0 ** -6), BF16_BITS)
        self.slack = ACCUMULATION * self.rms_ref
        self.width = HOEFFDING_Z * (bound.pow(2) @ down2.T).sqrt() + out_round + self.slack
        self.expected_ms = ((var @ down2.T).sum() + out_round.pow(2).sum() / 3).item() / (n * h)
        gram = w["down"].T @ w["down"]
        self.sd_ms = (2 * ((var @ gram.pow(2)) * var).sum()).sqrt().item() / (n * h)
        self.rms_bound = (self.expected_ms + RMS_SIGMAS * self.sd_ms) ** 0.5 + self.slack

    def errors(self, got: torch.Tensor) -> dict[str, float]:
        """Error statistics of one path's bf16 output [n, H] (printed with every failure)."""
        err = got.to(self.ref.device).double() - self.ref
        rel = err.abs() / self.width
        worst = int(rel.flatten().argmax()) if rel.numel() else 0
        row, col = divmod(worst, self.ref.shape[1])
        rms = err.pow(2).mean().sqrt().item()
        return {"rms_err": rms, "rel_rms": rms / self.rms_ref, "rms_bound": self.rms_bound,
                "rms_vs_expected": rms / self.expected_ms ** 0.5, "z_ms": (rms ** 2 - self.expected_ms) / self.sd_ms,
                "worst_vs_bound": rel.max().item(), "worst_row": row, "worst_col": col,
                "worst_err": err[row, col].item(), "worst_ref": self.ref[row, col].item(),
                "over_bound": int((rel > 1).sum()), "finite": bool(got.isfinite().all())}

    def describe(self, stats: dict[str, float]) -> str:
        return (f"rms err {stats['rms_err']:.4g} = {stats['rel_rms']:.4f} rms(ref) (bound {stats['rms_bound']:.4g}, "
                f"expected {self.expected_ms ** 0.5:.4g} = {self.expected_ms ** 0.5 / self.rms_ref:.4f} rms(ref); "
                f"measured/expected {stats['rms_vs_expected']:.3f}, {stats['z_ms']:+.1f} sd); worst element "
                f"|err| / bound {stats['worst_vs_bound']:.3f} at [{stats['worst_row']}, {stats['worst_col']}] "
                f"(err {stats['worst_err']:.4g}, ref {stats['worst_ref']:.4g}); {stats['over_bound']} element(s) "
                f"over bound; finite {stats['finite']}")


def check_fp8_experts(got: torch.Tensor, want: torch.Tensor, x: tuple[torch.Tensor, torch.Tensor],
                      counts: list[int], weights: dict[str, torch.Tensor], what: str) -> None:
    """Triton (got) and PyTorch (want) FP8 expert outputs [E, M, H] against float64 (Fp8Oracle), each expert
    on its own; then the Triton path's RMS error against the PyTorch path's over all received rows (pooled:
    an expert with one row has too few rounding errors for a steady ratio)."""
    data, scales = x
    reports, square_sums, ref_square_sum = [], {"triton": 0.0, "torch": 0.0}, 0.0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        oracle = Fp8Oracle(data[e, :n], scales[e, :n], weights, f"experts.{e}", got.device)
        stats = {name: oracle.errors(out[e, :n]) for name, out in (("triton", got), ("torch", want))}
        reports.append(f"{what} expert {e} ({n} rows, rms(ref) {oracle.rms_ref:.4g}):\n" + "\n".join(
            f"  {name}: {oracle.describe(s)}" for name, s in stats.items()))
        for s in stats.values():
            assert s["finite"] and s["over_bound"] == 0 and s["rms_err"] <= oracle.rms_bound, reports[-1]
        for name, s in stats.items():
            square_sums[name] += s["rms_err"] ** 2 * n
        ref_square_sum += oracle.rms_ref ** 2 * n
    rows = sum(counts)
    triton_rms, torch_rms = ((square_sums[name] / rows) ** 0.5 for name in ("triton", "torch"))
    limit = TRITON_VS_TORCH * torch_rms + ACCUMULATION * (ref_square_sum / rows) ** 0.5
    assert triton_rms <= limit, (f"{what}: triton's RMS error over all rows {triton_rms:.4g} is over "
                                 f"{TRITON_VS_TORCH} x torch's {torch_rms:.4g}\n" + "\n".join(reports))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("hidden", "inter", "rows"), [(256, 192, 96), (512, 256, 128), (7168, 2048, 64)])
def test_triton_experts_match_torch(fp8: bool, hidden: int, inter: int, rows: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_experts = 5
    counts = [0, rows, int(torch.randint(1, rows, (1,), generator=gen)), 1, 65 % rows]
    store, weights = expert_weights(gen, num_experts, hidden, inter, fp8, "cuda")
    x = masked_inputs(gen, counts, rows, hidden, fp8, "cuda")
    recv_count = torch.tensor(counts, dtype=torch.int32, device="cuda")
    got = triton_experts.TritonExperts()(x, recv_count, store)
    want = TorchExperts()(to_cpu(x), recv_count.cpu(), copy.deepcopy(store).cpu())
    what = f"seed={seed} hidden={hidden} inter={inter} fp8={fp8}"
    if fp8:
        check_fp8_experts(got, want, x, counts, weights, what)
        return
    for e, n in enumerate(counts):
        assert_close(got[e, :n], want[e, :n], TOL[fp8], f"{what} expert {e} ({n} rows)")


@pytest.mark.parametrize(("hidden", "inter", "rows"),
                         [(256, 192, 1), (512, 256, 16), (512, 256, 17), (256, 192, 130), (7168, 2048, 64),
                          (256, 192, 2200)])
def test_triton_dense_mlp_matches_torch(hidden: int, inter: int, rows: int, seed: int) -> None:
    """The shared experts' MLP (TritonExperts.dense_mlp: FP8 through the split-K GEMM and its gated sum;
    16-row and 64-row tiles, an intermediate padded to 128; at 2200 rows the masked GEMM, whose tiles then
    fill the GPU) against float64, as the routed experts are."""
    gen = torch.Generator().manual_seed(seed)
    store, weights = expert_weights(gen, 1, hidden, inter, True, "cuda")
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(torch.bfloat16).cuda()
    got = triton_experts.TritonExperts().dense_mlp(x, store)
    want = TorchExperts().dense_mlp(x.cpu(), copy.deepcopy(store).cpu())
    assert got.shape == (rows, hidden) and got.dtype == torch.bfloat16
    data, scales = per_token_cast_to_fp8(x)
    check_fp8_experts(got[None], want[None], (data[None], scales[None]), [rows], weights,
                      f"seed={seed} hidden={hidden} inter={inter} rows={rows}")
    assert triton_experts.TritonExperts().dense_mlp(x[:0], store).shape == (0, hidden)


@pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built")
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_experts_read_rows_in_place(fp8: bool, seed: int) -> None:
    """The expert kernels on dispatch's rows in place (each row read where it arrived) equal them on the
    packed copy of the same dispatch, bit for bit: two emulated ranks, experts with several row tiles."""
    from ep_layer.emulation import each_rank, emulated_buffers

    gen = torch.Generator().manual_seed(seed)
    ranks, num_experts, topk, max_tokens, hidden, inter = 2, 6, 2, 128, 512, 256
    size = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, ranks, num_experts)
    buffers = emulated_buffers(ranks, size)
    xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16).cuda() for n in (max_tokens, 77)]
    idxs = [torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(len(x))]).cuda() for x in xs]
    store = expert_store(gen, num_experts // ranks, hidden, inter, fp8, "cuda")
    kernels = triton_experts.TritonExperts()

    def dispatch(in_place: bool) -> list[tuple]:
        sent = each_rank([lambda b=b, x=x, i=i: b.low_latency_dispatch(
            x, i, max_tokens, num_experts, use_fp8=fp8, return_recv_hook=True, rows_in_place=in_place)
            for b, x, i in zip(buffers, xs, idxs)])
        each_rank([s[4] for s in sent])
        return sent

    packed, in_place = dispatch(False), dispatch(True)  # two results outstanding: both stay valid
    for r, (p, q) in enumerate(zip(packed, in_place)):
        assert torch.equal(p[1], q[1]), f"seed={seed} rank {r}: recv_count"
        assert max(p[1].tolist()) > BLOCK_M, "the case should have experts of several row tiles"
        want, got = kernels(p[0], p[1], store), kernels(q[0], q[1], store)
        for e, n in enumerate(p[1].tolist()):
            assert torch.equal(got[e, :n], want[e, :n]), f"seed={seed} rank {r} expert {e}: in place != packed"
    for b in buffers:
        b.destroy()


@pytest.mark.parametrize("fp8", [False, True])
def test_rows_past_recv_count_are_not_written(fp8: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    counts, rows, hidden, inter = [0, 70, 128, 3], 128, 256, 128
    store = expert_store(gen, len(counts), hidden, inter, fp8, "cuda")
    x = masked_inputs(gen, counts, rows, hidden, fp8, "cuda")
    data, scales = x if fp8 else (x, None)
    recv_count = torch.tensor(counts, dtype=torch.int32, device="cuda")
    out = torch.full((len(counts), rows, inter), 7.0, dtype=torch.bfloat16, device="cuda")
    masked_grouped_gemm(data, scales, store.gate_up, store.gate_up_scale, recv_count, out,
                                       up_offset=store.padded_intermediate, gated=True)
    for e, n in enumerate(counts):
        assert bool((out[e, n:] == 7.0).all()), f"expert {e}: rows past recv_count={n} were written"
        assert not out[e, :n].isnan().any(), f"expert {e}: garbage rows leaked into valid ones"


@pytest.mark.parametrize("spare", ["none", "some", "all but one"])
@pytest.mark.parametrize("fp8", [False, True])
def test_down_gemm_counts_each_finished_tile_in_its_signals(fp8: bool, spare: str, seed: int) -> None:
    """The down GEMM with completion signals, on a grid that leaves SMs spare (single-batch overlap's send runs
    there) or not, writes what the full grid writes without them, bit for bit, and leaves each received row
    tile's signal at the number of column tiles (what the combine waits for), the signals of tiles without
    rows at 0. Spare SMs are checked: at least one stays with the GEMM."""
    gen = torch.Generator().manual_seed(seed)
    counts, rows, hidden, inter = [0, 70, 128, 3, 65], 128, 384, 256
    store = expert_store(gen, len(counts), hidden, inter, fp8, "cuda")
    x = masked_inputs(gen, counts, rows, hidden, fp8, "cuda")
    recv_count = torch.tensor(counts, dtype=torch.int32, device="cuda")
    kernels = triton_experts.TritonExperts()
    act = kernels.gate_up(x, recv_count, store)
    signals = kernels.completion_signals(len(counts), rows, hidden, recv_count.device)
    sms = triton_support.sm_count(recv_count.device)
    spare_sms = {"none": 0, "some": 8, "all but one": sms - 1}[spare]
    got = kernels.down(act, recv_count, store, signals=signals, spare_sms=spare_sms)
    want = kernels.down(act, recv_count, store)
    with pytest.raises(ValueError, match="spare_sms"):
        kernels.down(act, recv_count, store, spare_sms=sms)
    for e, n in enumerate(counts):
        assert torch.equal(got[e, :n], want[e, :n]), f"seed={seed} expert {e}"
    tiles = -(-hidden // 128)
    expected = torch.zeros(len(counts), signals.per_expert, dtype=torch.int32)
    for e, n in enumerate(counts):
        expected[e, :-(-n // signals.rows)] = tiles
    assert signals.threshold == tiles
    assert torch.equal(signals.signals.cpu().view(len(counts), -1), expected)


def test_triton_fp8_cast_equals_the_pytorch_cast(seed: int) -> None:
    """TritonExperts.cast_to_fp8 (one kernel) against ep_layer.quant's PyTorch cast, bit for bit on the
    rows below recv_count: groups whose magnitudes span 12 orders, and an all-zero group (the floor)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts, rows, hidden = [5, 0, 17], 24, 512
    shape = (len(counts), rows, hidden // FP8_GROUP)
    magnitude = 10.0 ** torch.empty(*shape, 1, device="cuda").uniform_(-8, 4, generator=gen)
    x = torch.randn(*shape, FP8_GROUP, generator=gen, device="cuda") * magnitude
    x[0, 1, 2] = 0
    x = x.view(len(counts), rows, hidden).to(torch.bfloat16)
    recv_count = torch.tensor(counts, dtype=torch.int32, device="cuda")
    got_data, got_scales = triton_experts.TritonExperts().cast_to_fp8(x, recv_count)
    want_data, want_scales = TorchExperts().cast_to_fp8(x, recv_count)
    for e, count in enumerate(counts):
        assert torch.equal(got_scales[e, :count], want_scales[e, :count]), f"scales of expert {e}"
        assert torch.equal(got_data[e, :count].view(torch.uint8), want_data[e, :count].view(torch.uint8)), \
            f"data of expert {e}"
    # Without counts (the dense layers' cast) every row is cast: as with counts of all rows.
    all_data, all_scales = cast_rows_to_fp8(x, None)
    want_data, want_scales = TorchExperts().cast_to_fp8(x, torch.full_like(recv_count, rows))
    assert torch.equal(all_scales, want_scales)
    assert torch.equal(all_data.view(torch.uint8), want_data.view(torch.uint8))
    # Two dimensions: one group of all rows (fp8_block_linear's cast), as the first group of three.
    rows_data, rows_scales = cast_rows_to_fp8(x[1], None)
    assert rows_data.shape == x[1].shape and torch.equal(rows_scales, want_scales[1])
    assert torch.equal(rows_data.view(torch.uint8), want_data[1].view(torch.uint8))


@pytest.mark.parametrize(("tokens", "hidden"), [(0, 256), (37, 7168), (300, 1000)])
def test_triton_weighted_rows_equal_the_pytorch_sum(tokens: int, hidden: int, seed: int) -> None:
    """Normal mode's weighted sum (one kernel) against ExpertKernels' PyTorch sum, bit for bit: rows at magnitudes
    where a fused multiply-add would round differently, slots of other ranks' experts (-1) whose weights and rows
    must not count, a hidden size past the kernel's block, and a non-contiguous output."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, topk = 50, 8
    magnitude = 10.0 ** torch.empty(rows, 1, device="cuda").uniform_(-6, 6, generator=gen)
    y = (torch.randn(rows, hidden, generator=gen, device="cuda") * magnitude).to(torch.bfloat16)
    slot = torch.randint(0, rows, (tokens, topk), generator=gen, device="cuda")
    slot[torch.rand(tokens, topk, generator=gen, device="cuda") < 0.3] = -1
    weights = torch.rand(tokens, topk, generator=gen, device="cuda") * 3
    want = TorchExperts().weighted_rows(y, slot, weights, torch.empty(tokens, hidden, dtype=torch.bfloat16,
                                                                      device="cuda"))
    got = triton_experts.TritonExperts().weighted_rows(y, slot, weights, torch.empty_like(want))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    wide = torch.zeros(tokens, 2 * hidden, dtype=torch.bfloat16, device="cuda")
    triton_experts.TritonExperts().weighted_rows(y, slot, weights, wide[:, :hidden])
    assert torch.equal(wide[:, :hidden].view(torch.int16), want.view(torch.int16))
    assert not wide[:, hidden:].any()


@pytest.mark.parametrize("arrangement", ["neighbours", "shuffled"])
def test_triton_fp8_cast_of_every_bf16_value(arrangement: str, seed: int) -> None:
    """Every finite bf16 bit pattern (-0 included, arranged as fp8_oracle.every_finite_bf16 says) through
    the Triton FP8 cast, which divides through the scale's reciprocal and one FMA correction, against
    ep_layer.quant's cast (IEEE divisions), bit for bit."""
    import fp8_oracle

    rows, hidden = 16, 4096
    bits = fp8_oracle.every_finite_bf16(arrangement, rows * hidden, seed)
    x = torch.from_numpy(bits.view(np.int16).reshape(1, rows, hidden)).view(torch.bfloat16).cuda()
    recv_count = torch.tensor([rows], dtype=torch.int32, device="cuda")
    got_data, got_scales = triton_experts.TritonExperts().cast_to_fp8(x, recv_count)
    want_data, want_scales = TorchExperts().cast_to_fp8(x, recv_count)
    assert torch.equal(got_scales, want_scales)
    assert torch.equal(got_data.view(torch.uint8), want_data.view(torch.uint8))


@pytest.mark.parametrize("fp8", [False, True])
def test_triton_experts_in_cuda_graph(fp8: bool, seed: int) -> None:
    """Captured once, replayed with new data and new recv_count: no host sync, counts read on device."""
    gen = torch.Generator().manual_seed(seed)
    num_experts, rows, hidden, inter = 4, 64, 512, 256
    store = expert_store(gen, num_experts, hidden, inter, fp8, "cuda")
    kernels = triton_experts.TritonExperts()
    static_x = masked_inputs(gen, [rows] * num_experts, rows, hidden, fp8, "cuda")
    static_count = torch.full((num_experts,), rows, dtype=torch.int32, device="cuda")
    kernels(static_x, static_count, store)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernels(static_x, static_count, store)
    for _ in range(3):
        counts = torch.randint(0, rows + 1, (num_experts,), generator=gen).tolist()
        fresh = masked_inputs(gen, counts, rows, hidden, fp8, "cuda")
        for dst, src in zip(static_x if fp8 else (static_x,), fresh if fp8 else (fresh,)):
            dst.copy_(src)
        static_count.copy_(torch.tensor(counts, dtype=torch.int32))
        graph.replay()
        want = kernels(fresh, static_count.clone(), store)
        for e, n in enumerate(counts):
            assert torch.equal(static_out[e, :n], want[e, :n]), f"seed={seed} replay differs, expert {e}"


# ---------------------------------------------------------------------------- the layer on a GPU
def loaded_layer(cfg: MoeConfig, quant: str, weights: dict, buffer: Buffer, device: str) -> FusedMoE:
    layer = FusedMoE(cfg.num_experts, cfg.top_k, cfg.hidden, cfg.intermediate, None, n_group=cfg.n_group,
                     topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor, quant=quant,
                     n_shared_experts=cfg.n_shared_experts, buffer=buffer, max_tokens_per_rank=cfg.max_tokens,
                     device=device)
    layer.load_weights(weights.items())
    return layer


def cpu_layer(cfg: MoeConfig, quant: str, weights: dict) -> FusedMoE:
    """The layer on CPU at EP = 1 with PyTorch experts: the reference, as a token's output does not depend on EP."""
    return loaded_layer(cfg, quant, weights, Buffer(None, low_latency_mode=True, backend="reference"), "cpu")


@pytest.mark.parametrize("quant", ["bf16", "fp8-block"])
def test_layer_on_gpu_matches_cpu(quant: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    cfg = MoeConfig(hidden=512, intermediate=256, num_experts=32, top_k=8, n_group=8, topk_group=4, max_tokens=64)
    weights = hf_weights(cfg, gen, "bf16" if quant == "bf16" else "fp8")
    x = torch.randn(64, cfg.hidden, generator=gen).to(torch.bfloat16)
    layer = loaded_layer(cfg, quant, weights, Buffer(None, low_latency_mode=True, backend="reference"), "cuda")
    want = cpu_layer(cfg, quant, weights)(x)
    assert_layer_close(layer(x.cuda()), want, quant, f"seed={seed} {quant}")
    assert_layer_close(layer.forward_two_microbatches(x.cuda()), want, quant, f"seed={seed} {quant} two micro-batches")


@pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built")
@pytest.mark.parametrize("quant", ["bf16", "fp8-block"])
@pytest.mark.parametrize("schedule", ["plain", "two-microbatches", "two-microbatches-side-streams",
                                      "sbo-side-streams"])
def test_layer_on_emulated_ranks_in_cuda_graph(quant: str, schedule: str, seed: int) -> None:
    """4 emulated EP ranks (cuda backend) step together; the whole step is captured in one CUDA graph and
    replayed on fresh tokens. Each replay equals the same schedule run eagerly with all communication on
    the current stream, bit for bit: the side streams (shared by the ranks) change when kernels run,
    not what they compute. Single-batch overlap (each rank's combine send beside its down GEMM, sending
    rows as the GEMM signals them) equals the plain schedule, bit for bit."""
    from ep_layer.emulation import emulated_buffers

    gen = torch.Generator().manual_seed(seed)
    ranks = 4
    cfg = MoeConfig(hidden=512, intermediate=256, num_experts=16, top_k=4, n_group=4, topk_group=2, max_tokens=32)
    weights = hf_weights(cfg, gen, "bf16" if quant == "bf16" else "fp8")
    size = Buffer.get_low_latency_rdma_size_hint(cfg.max_tokens, cfg.hidden, ranks, cfg.num_experts)
    layers = [loaded_layer(cfg, quant, weights, b, "cuda") for b in emulated_buffers(ranks, size)]
    reference = cpu_layer(cfg, quant, weights)
    counts = [cfg.max_tokens, 0, 1, 17]
    xs = [torch.zeros(n, cfg.hidden, dtype=torch.bfloat16, device="cuda") for n in counts]
    side_streams = CommStreams.new() if schedule.endswith("side-streams") else None

    def run(streams: CommStreams | None) -> list[torch.Tensor]:
        if schedule == "plain" or (schedule.startswith("sbo") and streams is None):  # sbo's eager twin: plain
            return run_interleaved([layer.steps(x) for layer, x in zip(layers, xs)])
        if schedule.startswith("sbo"):
            return run_interleaved([layer.steps(x, streams, sbo=True) for layer, x in zip(layers, xs)])
        return forward_two_microbatches(layers, xs, streams)

    graph, outs = capture_after_warmup(lambda: run(side_streams))  # compiles and warms up outside the graph
    for replay in range(3):
        tokens = [torch.randn(n, cfg.hidden, generator=gen).to(torch.bfloat16) for n in counts]
        for x, t in zip(xs, tokens):
            x.copy_(t)
        graph.replay()
        eager = run(None)
        for layer in layers:
            layer.buffer.check()
        for r, (got, want, x) in enumerate(zip(outs, eager, tokens)):
            assert torch.equal(got, want), f"seed={seed} replay {replay} rank {r}: {schedule} replay != eager"
            assert_layer_close(got, reference(x), quant, f"seed={seed} replay {replay} rank {r}")
    for layer in layers:  # the experts read a packed copy of the rows instead of the rows in place
        assert layer.read_rows_in_place and layer.buffer.supports_rows_in_place
        layer.read_rows_in_place = False
    for r, (got, want) in enumerate(zip(outs, run(None))):
        assert torch.equal(got, want), f"seed={seed} rank {r}: rows in place != a packed copy ({schedule})"
    for layer in layers:
        layer.buffer.destroy()


def _fp8_linear_case(rows: int, out_features: int, in_features: int, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 x [rows, in], FP8 weight [out, in] with block scales, and x @ weight.T in float64 on the
    same FP8 activations and dequantised weights."""
    from ep_layer.block_fp8 import block_dequant, num_blocks

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=gen, device="cuda") * 64).to(torch.float8_e4m3fn)
    scales = torch.rand(num_blocks(out_features), num_blocks(in_features), generator=gen, device="cuda") / 256 + 1e-4
    xq, xs = per_token_cast_to_fp8(x)
    x_deq = (xq.double().view(rows, -1, FP8_GROUP) * xs.double()[..., None]).view(rows, in_features)
    return x, weight, scales, x_deq @ block_dequant(weight, scales).double().t()


@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 576, 7168), (16, 640, 1536), (37, 1536, 512), (130, 256, 384),
                          (64, 4352, 256), (48, 4352, 4096)])
def test_fp8_block_linear_matches_float64(rows: int, out_features: int, in_features: int, seed: int) -> None:
    """A dense FP8 linear (serving's attention/MLP projections; N need not be a multiple of 128)
    against float64 math on the same FP8 activations and dequantised weights: split-K with 16- and 64-row
    tiles, the masked GEMM where its tiles fill the GPU (64 rows x 4352 columns, 256 deep), and split-K
    again for as many tiles when the projection is deep (4096)."""
    x, weight, scales, want = _fp8_linear_case(rows, out_features, in_features, seed)
    got = fp8_block_linear(x, weight, scales)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    assert_close(got, want, 2.0 ** -7, "fp8_block_linear")
    assert fp8_block_linear(x[:0], weight, scales).shape == (0, out_features)


@pytest.mark.parametrize(("rows", "intermediate", "in_features"), [(1, 256, 7168), (48, 2048, 1024), (300, 2048, 512)])
def test_fp8_block_linear_gated_matches_float64(rows: int, intermediate: int, in_features: int, seed: int) -> None:
    """The gated FP8 linear (the shared expert's gate_up: gate rows then up rows, SiLU(gate) * up) against
    float64 math: split-K with 16- and 64-row tiles (the SiLU in the parts' sum), and the gated masked GEMM
    where its tiles fill the GPU (300 rows x 2048 columns)."""
    x, weight, scales, both = _fp8_linear_case(rows, 2 * intermediate, in_features, seed)
    gate, up = both[:, :intermediate], both[:, intermediate:]
    got = fp8_block_linear(x, weight, scales, gated=True)
    assert got.shape == (rows, intermediate) and got.dtype == torch.bfloat16
    assert_close(got, torch.nn.functional.silu(gate) * up, 2.0 ** -7, "gated fp8_block_linear")
    with pytest.raises(ValueError, match="weight"):
        fp8_block_linear(x, weight[:-128], scales[:-1], gated=True)


@pytest.mark.parametrize(("rows", "out_features", "in_features", "gated"),
                         [(1, 2 * 1024, 7168, True), (16, 2 * 256, 1536, True), (300, 2 * 2048, 512, True),
                          (1, 7168, 2048, False), (48, 4352, 4096, False), (64, 4352, 256, False)])
def test_fp8_block_linear_casts_its_output_as_the_next_linear_would(rows: int, out_features: int, in_features: int,
                                                                     gated: bool, seed: int) -> None:
    """fp8_out (the shared expert's gate_up hands its down projection FP8 rows): the bf16 result cast by the FP8
    cast kernel, bit for bit, on the split-K GEMM (cast in its sum) and the masked one; the next linear gives
    the same bits from those rows as from the bf16 result."""
    x, weight, scales, _ = _fp8_linear_case(rows, out_features, in_features, seed)
    _, next_weight, next_scales, _ = _fp8_linear_case(rows, 256, out_features // 2 if gated else out_features,
                                                      seed + 1)
    bf16 = fp8_block_linear(x, weight, scales, gated=gated)
    want = cast_rows_to_fp8(bf16, None)
    got = fp8_block_linear(x, weight, scales, gated=gated, fp8_out=True)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert torch.equal(fp8_block_linear(got, next_weight, next_scales), fp8_block_linear(bf16, next_weight,
                                                                                           next_scales))
    with pytest.raises(ValueError, match="fp8_out"):
        fp8_block_linear(x, weight[:200], scales[:2], fp8_out=True)


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_kernel_matches_padded_attention(dtype: torch.dtype, splits: int | None, seed: int) -> None:
    """The Triton MLA decode kernel (own keys only, split over the sequence: as many parts as fill the
    GPU, one part, three) against the padded PyTorch layout in float64: DeepSeek-V3's widths (512 + 64,
    128 heads), lengths from 1 to a few blocks."""
    import math

    from serving.forward_batch import ForwardBatch
    from serving.models import mla_decode_triton
    from serving.models.paged_attention import TokenMetadata, paged_mla_attention

    gen = torch.Generator().manual_seed(seed)
    lora, rope, heads, block_size, num_blocks, max_blocks = 512, 64, 128, 16, 64, 12
    lens = torch.tensor([1, 17, 100, 190, 33], dtype=torch.int32)
    b = len(lens)
    tables = torch.randperm(num_blocks, generator=gen)[:b * max_blocks].view(b, max_blocks).int()
    for i, n in enumerate(lens.tolist()):
        tables[i, -(-n // block_size):] = -1
    cache = torch.randn(num_blocks, block_size, lora + rope, generator=gen)
    q = torch.randn(b, heads, lora + rope, generator=gen)
    scale = 1 / math.sqrt(192)
    q_gpu = q.to(dtype).cuda()  # its two parts as strided views, as MLA passes them
    got = mla_decode_triton.mla_decode(q_gpu[..., :lora], q_gpu[..., lora:], cache.to(dtype).cuda(), tables.cuda(),
                                       lens.cuda(), scale, splits)
    batch = ForwardBatch(torch.zeros(b, dtype=torch.long), (lens - 1).long(), torch.arange(b + 1, dtype=torch.int32),
                         lens, tables, torch.zeros(b, dtype=torch.long), torch.arange(b), token_seqs=torch.arange(b))
    q64 = q.to(dtype).double()
    want = paged_mla_attention(q64[..., :lora], q64[..., lora:], cache.to(dtype).double(),
                               TokenMetadata.from_batch(batch, 16), scale)
    assert_close(got, want, 2.0 ** -6 if dtype == torch.bfloat16 else 2.0 ** -8, "mla_decode")  # float32: TF32 dots
    with pytest.raises(ValueError, match="q_pe, cache"):
        mla_decode_triton.mla_decode(q_gpu[..., :lora], q_gpu[:, :-1, lora:], cache.to(dtype).cuda(), tables.cuda(),
                                     lens.cuda(), scale, splits)


# ---------------------------------------------------------------------------- single-batch overlap across processes
def _sbo_rank(rank: int, world_size: int, quant: str, weights: dict, counts: list[int], seed: int) -> None:
    """This rank's layer (cuda backend over CUDA IPC, processes sharing the GPU) with overlap="sbo" against
    the plain forward, eagerly and replayed from a CUDA graph on fresh tokens: bit for bit."""
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    cfg = SBO_CONFIG
    size = Buffer.get_low_latency_rdma_size_hint(cfg.max_tokens, cfg.hidden, world_size, cfg.num_experts)
    buffer = Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, backend="cuda", timeout_s=20)
    layer = loaded_layer(cfg, quant, weights, buffer, "cuda")
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(counts[rank], cfg.hidden, generator=gen).to(torch.bfloat16).cuda()
    layer.overlap = "none"
    plain = layer(x)
    layer.overlap = "sbo"
    assert torch.equal(layer(x), plain), f"seed={seed} rank {rank}: eager sbo != plain"
    static_x = x.clone()
    graph, out = capture_after_warmup(lambda: layer(static_x))
    for replay in range(3):
        fresh = torch.randn(counts[rank], cfg.hidden, generator=gen).to(torch.bfloat16).cuda()
        static_x.copy_(fresh)
        graph.replay()
        layer.overlap = "none"
        want = layer(fresh)
        layer.overlap = "sbo"
        assert torch.equal(out, want), f"seed={seed} rank {rank} replay {replay}: sbo graph != plain"
    buffer.check()
    dist.barrier()
    buffer.destroy()


SBO_CONFIG = MoeConfig(hidden=512, intermediate=256, num_experts=16, top_k=4, n_group=4, topk_group=2, max_tokens=32)


@pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built")
@pytest.mark.parametrize("quant", ["bf16", "fp8-block"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_sbo_equals_plain_with_processes_on_one_gpu(world_size: int, quant: str, seed: int) -> None:
    """EP = 2 and 4 as processes (one with no tokens), single-batch overlap against the plain forward."""
    from dist_harness import run_ranks

    gen = torch.Generator().manual_seed(seed)
    weights = hf_weights(SBO_CONFIG, gen, "bf16" if quant == "bf16" else "fp8")
    counts = [SBO_CONFIG.max_tokens, 0, 1, 17][:world_size]
    run_ranks(_sbo_rank, world_size, quant, weights, counts, seed, timeout_s=300)

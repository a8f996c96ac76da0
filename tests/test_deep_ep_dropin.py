"""The `deep_ep` drop-in (dropin/): vLLM's and SGLang's DeepEP call sequences, low-latency and normal
(high-throughput), replayed as their source makes them, on ep-layer's Buffer, against oracles.

The engine code is copied here in miniature, call for call, and each replica names the file and commit
it follows (the commits the research notes read):
- vLLM 055e47c28003156421365af985d676fc921cb075: vllm/backends/distributed/device_communicators/all2all.py
  (DeepEPLLAll2AllManager, DeepEPHTAll2AllManager), vllm/model_executor/layers/fused_moe/prepare_finalize/
  deepep_ll.py (DeepEPLLPrepareAndFinalize) and deepep_ht.py (DeepEPHTPrepareAndFinalize),
  vllm/model_executor/layers/fused_moe/modular_kernel.py (hooks), vllm/v1/worker/ubatching.py (two
  micro-batches, DBO); base_device_communicator.py@a8f1d79812aa (Cache); topk_weight_and_reduce.py@02e454004d42
  (TopKWeightAndReduceContiguous); tests/kernels/moe/parallel_utils.py@0ff715e7811a (vLLM's own test helper).
- SGLang 003a81bf2870c07b110de13641ad4f0ba63b1fa1: python/sglang/srt/layers/moe/token_dispatcher/deepep.py
  (both inner dispatchers, and DeepEPDispatcher's choice between them in auto mode); python/sglang/srt/
  operations.py@1260bf3a1c3f and operations_strategy.py@1e90555b085425 (two-batch overlap).

CPU ranks (tests/dist_harness.py) run the reference backend; the `gpu` variants run the cuda backend, several
processes on one GPU through CUDA IPC (the low-latency and the normal-mode replays). vLLM's real classes drive the
drop-in in tests/test_dropin_vllm.py; its high-throughput path on CPU ranks is checked there only (the replay here
runs on the GPU). Every rank draws every rank's inputs from one generator, so the oracles need no communication:
routing in plain Python (the rows each local expert receives, by source rank then token), the FP8 cast of
tests/fp8_oracle.py, experts that scale their rows by (e + 1) / 8, and low-latency combine as the float32 sum in
ascending k of w * y, rounded once to bf16. Normal-mode dispatches are checked exactly in the ranks (rows, ids,
weights, counts); the outputs of whole MoE calls come back to the test process and are checked there against a
dense float64 oracle, within the rounding the engines' own steps add (DENSE_RTOL).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import warnings
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from fp8_oracle import cast_to_fp8

import ep_layer
from ep_layer import native
from ep_layer.backends import resolve_backend

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("deep_ep") is None:  # not installed (scripts/bootstrap.sh installs it): the checkout's
    sys.path.append(str(ROOT / "dropin"))
import deep_ep  # noqa: E402

# (use_fp8, round_scale, use_ue8m0)
MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "ue8m0": (True, True, True)}
FP8_GROUP = 128

needs_cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not native.available(), reason="ep_layer._C (the CUDA kernels) is not built"),
]


def gpu(fn: Callable) -> Callable:
    for mark in reversed(needs_cuda):
        fn = mark(fn)
    return fn


# ==================================================================================== inputs and oracles
class Tokens(NamedTuple):
    """One rank's tokens of one MoE call, on the CPU."""

    x: torch.Tensor  # bf16 [n, H]
    idx: torch.Tensor  # int64 [n, K], -1 = no expert
    w: torch.Tensor  # float32 [n, K]

    def rows(self, lo: int, hi: int) -> Tokens:
        return Tokens(self.x[lo:hi], self.idx[lo:hi], self.w[lo:hi])


def rng_for(seed: int, tag: tuple) -> np.random.Generator:
    """The generator of one draw: the same on every rank."""
    return np.random.default_rng([seed, zlib.crc32(repr(tag).encode())])


def draw(seed: int, tag: tuple, counts: Sequence[int], hidden: int, num_experts: int, topk: int) -> list[Tokens]:
    """Every rank's tokens (rank r has counts[r]), the same on every rank: rows at three magnitudes, distinct
    experts per token, some entries -1."""
    rng = rng_for(seed, tag)
    every = []
    for n in counts:
        scale = rng.choice(np.array([1e-3, 1.0, 30.0], dtype=np.float32), size=(n, 1))
        x = torch.from_numpy(rng.standard_normal((n, hidden), dtype=np.float32) * scale).to(torch.bfloat16)
        idx = np.array([rng.permutation(num_experts)[:topk] for _ in range(n)], dtype=np.int64).reshape(n, topk)
        idx[rng.random((n, topk)) < 0.15] = -1
        every.append(Tokens(x, torch.from_numpy(idx), torch.from_numpy(rng.random((n, topk), dtype=np.float32))))
    return every


def draw_counts(seed: int, tag: tuple, world: int, lo: int, hi: int) -> list[int]:
    """Tokens per rank, in [lo, hi], the ends themselves likely."""
    rng = rng_for(seed, ("counts", *tag))
    return [int(rng.choice([lo, hi, rng.integers(lo, hi + 1)])) for _ in range(world)]


def expert_factors(experts: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Expert e scales its rows by (e + 1) / 8 (float32 [len(experts)])."""
    return torch.tensor([(e + 1) / 8 for e in experts], dtype=torch.float32, device=device)


def local_experts(rank: int, num_local: int) -> range:
    return range(rank * num_local, (rank + 1) * num_local)


def expert_outputs(recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], factors: torch.Tensor) -> torch.Tensor:
    """The experts: [E_l, M, H] rows (bf16, or FP8 dequantised with their float32 or UE8M0 scales) times the
    expert's factor in float32, rounded once to bf16. Over all M rows (those past recv_count are never
    combined), so that a step reads no count on the host and captures in a CUDA graph."""
    if isinstance(recv_x, tuple):
        data, scales = recv_x
        if scales.dtype == torch.int32:  # UE8M0: four biased exponents per int32, group g in byte g % 4
            scales = (scales.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        groups = data.float().unflatten(-1, (-1, FP8_GROUP))
        rows = (groups * scales.unsqueeze(-1)).flatten(-2)
    else:
        rows = recv_x.float()
    return (rows * factors[:, None, None]).to(torch.bfloat16)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def received_rows(every: list[Tokens], expert: int) -> list[tuple[int, int]]:
    """The (source rank, token) rows that `expert` receives, by source rank, then token."""
    return [(s, t) for s, tokens in enumerate(every) for t in range(tokens.x.shape[0])
            if expert in tokens.idx[t].tolist()]


def fp8_cast(x: torch.Tensor, mode: str) -> tuple[np.ndarray, np.ndarray]:
    _, round_scale, use_ue8m0 = MODES[mode]
    return cast_to_fp8(bf16_bits(x), round_scale, use_ue8m0)


def check_dispatch(recv_x: Any, recv_count: torch.Tensor, every: list[Tokens], rank: int, max_tokens: int,
                   num_experts: int, mode: str, where: str) -> None:
    """What DeepEP's low_latency_dispatch returns on `rank`: dtypes, shapes, counts, and every valid row (bf16
    bits, or FP8 codes and scale bits) in order."""
    world, hidden = len(every), every[0].x.shape[1]
    num_local, rows = num_experts // world, world * max_tokens
    use_fp8, _, use_ue8m0 = MODES[mode]
    assert recv_count.dtype == torch.int32 and tuple(recv_count.shape) == (num_local,), where
    if use_fp8:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2, where
        data, scales = recv_x
        assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (num_local, rows, hidden), where
        cols = hidden // (4 * FP8_GROUP if use_ue8m0 else FP8_GROUP)
        assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32), where
        assert tuple(scales.shape) == (num_local, rows, cols), where
        assert scales.stride() == (cols * rows, 1, rows), f"{where}: scales not column-major (DeepGEMM's TMA)"
        casts = [fp8_cast(tokens.x, mode) for tokens in every]
    else:
        assert isinstance(recv_x, torch.Tensor), where
        assert recv_x.dtype == torch.bfloat16 and tuple(recv_x.shape) == (num_local, rows, hidden), where
    counts = recv_count.cpu().tolist()
    for local in range(num_local):
        want = received_rows(every, rank * num_local + local)
        assert counts[local] == len(want), f"{where}: recv_count[{local}] = {counts[local]}, want {len(want)}"
        if not want:
            continue
        n = len(want)
        if not use_fp8:
            sent = np.stack([bf16_bits(every[s].x[t]) for s, t in want])
            assert np.array_equal(bf16_bits(recv_x[local, :n]), sent), f"{where}: rows of local expert {local}"
            continue
        codes = np.stack([casts[s][0][t] for s, t in want])
        want_scales = np.stack([casts[s][1][t] for s, t in want]).view(np.uint32)
        assert np.array_equal(data[local, :n].cpu().contiguous().view(torch.uint8).numpy(), codes), \
            f"{where}: FP8 codes of local expert {local}"
        assert np.array_equal(scales[local, :n].cpu().contiguous().numpy().view(np.uint32), want_scales), \
            f"{where}: scales of local expert {local}"


def expected_combine(tokens: Tokens, mode: str) -> torch.Tensor:
    """Token t: the float32 sum over ascending k of w[t, k] * expert(idx[t, k]) applied to what that expert
    received of token t (its bf16 row, or the FP8 cast of it), rounded once to bf16; 0 without experts."""
    n, k = tokens.idx.shape
    use_fp8 = MODES[mode][0]
    casts = fp8_cast(tokens.x, mode) if use_fp8 else None
    acc = torch.zeros(n, tokens.x.shape[1], dtype=torch.float32)
    for t in range(n):
        if casts is None:
            row: Any = tokens.x[t][None, None]
        else:
            row = (torch.from_numpy(casts[0][t].copy()).view(torch.float8_e4m3fn)[None, None],
                   torch.from_numpy(casts[1][t].copy())[None, None])
        for j in range(k):
            e = int(tokens.idx[t, j])
            if e < 0:
                continue
            y = expert_outputs(row, expert_factors([e], "cpu"))[0, 0]
            acc[t] = acc[t] + tokens.w[t, j] * y.float()
    return acc.to(torch.bfloat16)


def check_combine(out: torch.Tensor, tokens: Tokens, mode: str, where: str) -> None:
    want = expected_combine(tokens, mode)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(want.shape), f"{where}: {out.dtype} {out.shape}"
    got = out.cpu()
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()[0].tolist()
        raise AssertionError(f"{where}: combine differs at {bad}: got {got[tuple(bad)]}, want {want[tuple(bad)]}")


# ------------------------------------------------------------------------------------ normal mode
# The dense oracle's tolerance, relative, per element. A token's output is a sum of same-sign terms
# w_k * (e_k + 1) / 8 * x (weights and factors positive), so no cancellation: every rounding on the way is at
# most a relative u = 2^-8 (bf16's unit roundoff) of what it rounds, and the errors compound to at most
# (1 + u)^n - 1 of the exact value. The engines round at most n = 4 times: vLLM's path rounds the expert output
# to bf16, w * y to bf16 (TopKWeightAndReduceContiguous's mul_), the top-k sum to bf16 (moe_sum), and the
# combine's float32 sum over ranks to bf16 (SGLang's normal path: 3, the low-latency path: 2); float32
# accumulation adds ~K * 2^-24. (1 + u)^4 - 1 < 4.1 u, so 5 u bounds all of them, while a wrong expert, weight,
# row or rank is off by far more (weights are uniform in [0, 1), factors 1/8 apart).
DENSE_RTOL = 5 * 2.0 ** -8


def fp8_columns(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token, per-128-channel FP8 cast of bf16 rows (vLLM's per_token_group_quant_fp8, SGLang's
    sglang_per_token_group_quant_fp8) as tensors on x's device: e4m3 [T, H] and float32 scales [T, H/128]
    ("fp8"), or UE8M0 scales packed four to an int32 [T, H/512] ("ue8m0")."""
    codes, scales = fp8_cast(x, mode)
    return (torch.from_numpy(codes).view(torch.float8_e4m3fn).clone(memory_format=torch.contiguous_format).to(x.device),
            torch.from_numpy(scales).clone(memory_format=torch.contiguous_format).to(x.device))


def as_made(tokens: Tokens) -> Tokens:
    """Fresh tensors with the strides a model's layer gives them. (numpy hands an empty draw strides of 0,
    which the normal-mode calls do not take yet: test_normal_mode_takes_inputs_that_pytorch_counts_contiguous.)"""
    return Tokens(*(t.clone(memory_format=torch.contiguous_format) for t in tokens))


def dequant_rows(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """Rows [N, H] as `dtype`: bf16 ones, or e4m3 ones times their float32 (or packed UE8M0) group scales."""
    if scales is None:
        return data.to(dtype)
    if scales.dtype == torch.int32:  # four biased exponents per int32, group g in byte g % 4
        scales = (scales.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return (data.to(dtype).unflatten(-1, (-1, FP8_GROUP)) * scales.to(dtype).unsqueeze(-1)).flatten(-2)


def dispatched_rows(tokens: Tokens, mode: str) -> torch.Tensor:
    """float64 [n, H]: the rows as the experts see them (mode "bf16", or the FP8 cast of "fp8" / "ue8m0")."""
    if mode == "bf16":
        return tokens.x.double()
    return dequant_rows(*fp8_columns(tokens.x, mode), dtype=torch.float64)


def dense_moe(tokens: Tokens, mode: str) -> torch.Tensor:
    """The dense oracle, float64 [n, H]: each token's weighted sum over its experts (id -1: none) of the
    expert's output, expert e scaling the dispatched row by (e + 1) / 8."""
    idx = tokens.idx
    coef = torch.where(idx >= 0, tokens.w.double() * (idx.double() + 1) / 8, 0.0).sum(dim=1)
    return dispatched_rows(tokens, mode) * coef[:, None]


def for_parent(out: torch.Tensor) -> np.ndarray:
    """A rank's bf16 output as it travels back to the test process: its bits in a numpy array (a tensor would
    travel as shared memory that the rank's exit takes away)."""
    return bf16_bits(out).copy()


def check_dense(out: np.ndarray, tokens: Tokens, mode: str, where: str) -> None:
    """`out`: a rank's bf16 output (for_parent) of `tokens`."""
    want = dense_moe(tokens, mode)
    out = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == tuple(want.shape), f"{where}: {out.dtype} {out.shape}"
    got = out.double()
    bad = ((got - want).abs() > DENSE_RTOL * want.abs()).nonzero()
    if bad.numel():
        t, h = bad[0].tolist()
        raise AssertionError(f"{where}: {bad.shape[0]} entries off the dense oracle, first token {t} channel {h}: "
                             f"got {got[t, h].item()}, want {want[t, h].item()} (rtol {DENSE_RTOL})")


def check_normal_dispatch(recv_x: Any, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                          num_recv_tokens_per_expert: list[int], sent: list[Any], every: list[Tokens], rank: int,
                          num_experts: int, expert_alignment: int, where: str) -> None:
    """What DeepEP's normal-mode dispatch returns on `rank` (docs/design.md section 2, normal mode): every
    (source rank, token) that picked one of its experts, once, by source then token; its columns exactly as
    sent (`sent[s]`: rank s's x as it dispatched it, bf16 rows or (e4m3, scales)); its ids made local (-1 for
    experts elsewhere) and weights (0 there); per local expert the top-k entries received, rounded up to a
    multiple of `expert_alignment`."""
    num_local = num_experts // len(every)
    lo = rank * num_local
    picked = [((t.idx >= lo) & (t.idx < lo + num_local)).any(dim=1).nonzero().flatten() for t in every]
    src_idx = torch.cat([t.idx[p] for t, p in zip(every, picked)])
    src_w = torch.cat([t.w[p] for t, p in zip(every, picked)])
    n = src_idx.shape[0]
    columns = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    sent_columns = [x if isinstance(x, tuple) else (x,) for x in sent]
    assert len(columns) == len(sent_columns[0]), f"{where}: {len(columns)} columns received"
    for c, got in enumerate(columns):
        want = torch.cat([cols[c][p] for cols, p in zip(sent_columns, picked)])
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), \
            f"{where}: column {c} is {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)}"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits)), \
            f"{where}: column {c}: rows differ from those sent"
    local = (src_idx >= lo) & (src_idx < lo + num_local)
    assert recv_topk_idx.dtype == torch.int64 and tuple(recv_topk_idx.shape) == tuple(src_idx.shape), where
    assert torch.equal(recv_topk_idx, torch.where(local, src_idx - lo, -1)), f"{where}: recv_topk_idx"
    assert recv_topk_weights.dtype == torch.float32, where
    assert torch.equal(recv_topk_weights, torch.where(local, src_w, 0.0)), f"{where}: recv_topk_weights"
    per_expert = torch.bincount(src_idx[local] - lo, minlength=num_local).tolist()
    aligned = [-(-c // expert_alignment) * expert_alignment for c in per_expert]
    assert num_recv_tokens_per_expert == aligned, \
        f"{where}: num_recv_tokens_per_expert_list {num_recv_tokens_per_expert}, want {aligned} ({n} rows)"


def on_cpu(values: tuple) -> tuple:
    """A call's returned values with its tensors (and tuples of them) copied to the CPU, for the oracles."""
    return tuple(v.cpu() if isinstance(v, torch.Tensor) else on_cpu(v) if isinstance(v, tuple) else v for v in values)


def on_device(tokens: Tokens, device: torch.device | str) -> Tokens:
    """Fresh tensors, as a model's layer makes them (not views into a larger batch)."""
    return Tokens(*(t.to(device, copy=True) for t in tokens))


def engine_buffer(device: str) -> Callable[..., deep_ep.Buffer]:
    """The constructor the engines call, `deep_ep.Buffer`, with their arguments untouched. On CPU ranks of a
    machine where "auto" means the cuda backend, the reference backend is pinned: these tensors live on the
    CPU (the gpu variants make the same calls with "auto")."""
    if device == "cpu" and resolve_backend("auto") != "reference":
        return functools.partial(deep_ep.Buffer, backend="reference")
    return deep_ep.Buffer


def setup_device(rank: int, device: str) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU: processes share it through CUDA IPC
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def label(seed: int, rank: int, *what: object) -> str:
    return f"seed={seed} rank={rank} " + " ".join(str(w) for w in what)


# ==================================================================================== vLLM, in miniature
class VllmCache:
    """base_device_communicator.py@a8f1d798 `Cache`: Buffers by their sorted keyword arguments, held weakly
    (the prepare/finalize objects keep them alive), built with keywords only."""

    def __init__(self) -> None:
        self._cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.RLock()

    def get_or_create(self, kwargs: dict, func: Callable[..., Any]) -> Any:
        key = tuple(sorted((k, v) for k, v in kwargs.items()))
        with self._lock:
            instance = self._cache.get(key)
            if instance is None:
                instance = func(**kwargs)
                self._cache[key] = instance
            return instance


class VllmLLManager:
    """all2all.py@055e47c2 `DeepEPLLAll2AllManager` (with its base's `destroy`): one size hint per MoE layer,
    one Buffer per distinct set of kwargs, on the EP group's gloo `cpu_group`."""

    def __init__(self, cpu_group: dist.ProcessGroup, make_buffer: Callable[..., Any],
                 enable_fault_tolerance: bool = False) -> None:
        self.cpu_group = cpu_group
        self.world_size = cpu_group.size()
        self.handle_cache = VllmCache()
        self.make_buffer = make_buffer  # deep_ep.Buffer
        self.support_fault_tolerance = enable_fault_tolerance

    def _make_all2all_kwargs(self, max_num_tokens_per_dp_rank: int, token_hidden_size: int, num_ep_ranks: int,
                             num_global_experts: int, num_local_experts: int) -> dict[str, Any]:
        num_nvl_bytes = 1024 * 1024 * 1024  # envs.VLLM_DEEPEP_BUFFER_SIZE_MB (default 1024) MiB
        num_qps_per_rank = num_local_experts
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=max_num_tokens_per_dp_rank, hidden=token_hidden_size,
            num_ranks=num_ep_ranks, num_experts=num_global_experts)
        assert num_rdma_bytes is not None
        return dict(group=self.cpu_group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                    low_latency_mode=True, num_qps_per_rank=num_qps_per_rank,
                    allow_nvlink_for_low_latency_mode=True,
                    allow_mnnvl=False,  # envs.VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL (default 0)
                    explicitly_destroy=True, enable_shrink=self.support_fault_tolerance)

    def get_handle(self, kwargs: dict[str, Any]) -> Any:
        buffer_kwargs = self._make_all2all_kwargs(**kwargs)
        return self.handle_cache.get_or_create(buffer_kwargs, self.make_buffer)

    def destroy(self) -> None:
        with self.handle_cache._lock:
            for _, handle in self.handle_cache._cache.items():
                handle.destroy()
            self.handle_cache._cache.clear()


class UBatchContext:
    """vllm/v1/worker/ubatching.py@055e47c2 `UBatchContext`, the parts the low-latency path uses: one thread
    per micro-batch, strictly alternating through CPU events, on one shared compute stream. (The waits are
    bounded here, so that a failing replay fails instead of hanging.)"""

    def __init__(self, ubatching: Ubatching, id: int, ready_barrier: threading.Barrier,
                 cpu_wait_event: threading.Event, cpu_signal_event: threading.Event,
                 compute_stream: torch.cuda.Stream | None) -> None:
        self.ubatching, self.id = ubatching, id
        self.ready_barrier = ready_barrier
        self.cpu_wait_event, self.cpu_signal_event = cpu_wait_event, cpu_signal_event
        self.compute_stream = compute_stream
        self.recv_hook: Callable[[], Any] | None = None

    def __enter__(self) -> UBatchContext:
        self.ubatching.thread_to_context[threading.get_ident()] = self.id
        self.ubatching.current_contexts[self.id] = self
        self.ready_barrier.wait()
        self._wait()
        if self.compute_stream is not None:  # update_stream(compute_stream)
            torch.cuda.set_device(self.compute_stream.device)
            torch.cuda.set_stream(self.compute_stream)
        return self

    def __exit__(self, *exc: object) -> bool:
        self.ubatching.current_contexts[self.id] = None
        del self.ubatching.thread_to_context[threading.get_ident()]
        self.maybe_run_recv_hook()
        self.cpu_signal_event.set()
        self.cpu_wait_event.clear()
        return False

    def _wait(self) -> None:
        if not self.cpu_wait_event.wait(timeout=120):
            raise TimeoutError(f"ubatch {self.id}: the other micro-batch never yielded")
        self.cpu_wait_event.clear()

    def maybe_run_recv_hook(self) -> None:
        if self.recv_hook is not None:
            self.recv_hook()
            self.recv_hook = None

    def yield_(self) -> None:  # _cpu_yield
        assert not self.cpu_wait_event.is_set()
        self.cpu_signal_event.set()
        self._wait()


class Ubatching:
    """ubatching.py@055e47c2's module functions (dbo_enabled, dbo_current_ubatch_id, dbo_maybe_run_recv_hook,
    dbo_register_recv_hook, dbo_yield) over its two globals, and gpu_ubatch_wrapper.py's `_run_ubatches`."""

    def __init__(self, compute_stream: torch.cuda.Stream | None = None) -> None:
        self.thread_to_context: dict[int, int] = {}
        self.current_contexts: list[UBatchContext | None] = [None, None]
        self.compute_stream = compute_stream

    def enabled(self) -> bool:
        return len(self.thread_to_context) > 0

    def current_ubatch_id(self) -> int:
        return self.thread_to_context[threading.get_ident()] if self.enabled() else 0

    def _context(self) -> UBatchContext:
        ctx = self.current_contexts[self.thread_to_context[threading.get_ident()]]
        assert ctx is not None
        return ctx

    def maybe_run_recv_hook(self) -> None:
        if self.enabled():
            self._context().maybe_run_recv_hook()

    def register_recv_hook(self, recv_hook: Callable[[], Any]) -> None:
        """My hook goes to the other micro-batch, which runs it at its next maybe_run_recv_hook."""
        if self.enabled():
            next_ctx = self.current_contexts[(self.current_ubatch_id() + 1) % 2]
            assert next_ctx is not None
            next_ctx.recv_hook = recv_hook

    def yield_(self) -> None:
        if self.enabled():
            self._context().yield_()

    # The stream switches the DeepEP high-throughput path makes (dbo_get_previous_event, dbo_switch_to_comm,
    # dbo_switch_to_compute, dbo_switch_to_compute_sync, dbo_yield_and_switch_from_compute_to_comm and
    # dbo_yield_and_switch_from_comm_to_compute). That path is replayed on CPU ranks only, where there are no
    # streams to switch: what is left of them is where they yield.
    def get_previous_event(self, func: Callable[[], Any]) -> Any:
        """`func()` (Buffer.capture) on the micro-batch's compute stream; None outside DBO."""
        assert self.compute_stream is None, "the high-throughput replay runs on CPU ranks"
        return func() if self.enabled() else None

    def yield_and_switch_from_compute_to_comm(self) -> None:
        self.yield_()

    def yield_and_switch_from_comm_to_compute(self) -> None:
        self.yield_()

    def switch_to_comm(self) -> None:
        pass

    def switch_to_compute(self) -> None:
        pass

    def switch_to_compute_sync(self) -> None:
        pass

    def run(self, ubatch_fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Each function in its own thread inside its context; micro-batch 0 starts."""
        events = [threading.Event(), threading.Event()]
        barrier = threading.Barrier(3)
        contexts = [UBatchContext(self, i, barrier, events[i], events[(i + 1) % 2], self.compute_stream)
                    for i in range(2)]
        results: list[Any] = [None, None]
        errors: list[BaseException] = []

        def body(i: int) -> None:
            try:
                with contexts[i]:
                    results[i] = ubatch_fns[i]()
            except BaseException as e:
                errors.append(e)
                events[(i + 1) % 2].set()  # let the other micro-batch run into its own end

        threads = [threading.Thread(target=body, args=(i,), name=f"ubatch{i}", daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        barrier.wait(timeout=60)
        contexts[0].cpu_wait_event.set()
        for thread in threads:
            thread.join(timeout=180)
            assert not thread.is_alive(), "a micro-batch thread did not finish"
        if errors:
            raise errors[0]
        return results


class TracedBuffer:
    """A Buffer that logs its calls (low-latency ones with their hooks, normal-mode ones, the low-latency clean)
    as (who, what, whose) in the order they run: who makes the call or runs the hook, whose call the hook belongs
    to (micro-batch ids from `who()`)."""

    def __init__(self, buffer: Any, log: list[tuple], who: Callable[[], object]) -> None:
        self._buffer, self._log, self._who = buffer, log, who
        self.dispatched: list[tuple[object, tuple]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffer, name)

    def _traced(self, op: str, hook: Callable[[], Any] | None) -> Callable[[], Any] | None:
        owner = self._who()
        self._log.append((owner, op, owner))
        if hook is None:
            return None

        def traced() -> Any:
            self._log.append((self._who(), f"{op} hook", owner))
            return hook()

        return traced

    def low_latency_dispatch(self, *args: Any, **kwargs: Any) -> tuple:
        result = self._buffer.low_latency_dispatch(*args, **kwargs)
        return (*result[:4], self._traced("dispatch", result[4]))

    def low_latency_combine(self, *args: Any, **kwargs: Any) -> tuple:
        result = self._buffer.low_latency_combine(*args, **kwargs)
        return (*result[:2], self._traced("combine", result[2]))

    # Normal mode: calls without hooks, logged as ("layout" | "normal dispatch" | "normal combine"); each
    # dispatch's (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list) is kept, by caller.
    def get_dispatch_layout(self, *args: Any, **kwargs: Any) -> tuple:
        self._traced("layout", None)
        return self._buffer.get_dispatch_layout(*args, **kwargs)

    def dispatch(self, *args: Any, **kwargs: Any) -> tuple:
        self._traced("normal dispatch", None)
        result = self._buffer.dispatch(*args, **kwargs)
        self.dispatched.append((self._who(), result[:4]))
        return result

    def combine(self, *args: Any, **kwargs: Any) -> tuple:
        self._traced("normal combine", None)
        return self._buffer.combine(*args, **kwargs)

    def clean_low_latency_buffer(self, *args: Any, **kwargs: Any) -> None:
        self._traced("clean", None)
        self._buffer.clean_low_latency_buffer(*args, **kwargs)

    def take_dispatched(self, who: object = None) -> tuple:
        """The oldest kept dispatch of `who`, removed."""
        at = next(i for i, (owner, _) in enumerate(self.dispatched) if owner == who)
        return self.dispatched.pop(at)[1]


def ubatch_of_thread() -> int | None:
    return {"ubatch0": 0, "ubatch1": 1}.get(threading.current_thread().name)


# ubatching.py@055e47c2 with two micro-batches A = 0, B = 1, per layer (the research notes' trace): A sends its
# dispatch; B runs A's dispatch hook, sends its own; A runs B's dispatch hook, sends its combine; B runs A's combine
# hook, sends its own; A runs B's combine hook (at its next layer's _prepare, or on leaving its context).
DBO_ORDER = [(0, "dispatch", 0), (1, "dispatch hook", 0), (1, "dispatch", 1), (0, "dispatch hook", 1),
             (0, "combine", 0), (1, "combine hook", 0), (1, "combine", 1), (0, "combine hook", 1)]


class Received(NamedTuple):
    """What an expert stage received, copied when it ran (the dispatch's outputs are reused two calls later)."""

    recv_x: Any
    recv_count: torch.Tensor


def _copy(recv_x: Any) -> Any:
    return tuple(t.clone() for t in recv_x) if isinstance(recv_x, tuple) else recv_x.clone()


class VllmLLPrepareFinalize:
    """deepep_ll.py@055e47c2 `DeepEPLLPrepareAndFinalize` (no EPLB remapping, no NVFP4): dispatch with the
    hook always on, combine into `out` with the hook always on (the modular kernel calls finalize_async),
    one dispatch handle per micro-batch."""

    SUPPORTED_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)

    def __init__(self, buffer: Any, max_tokens_per_rank: int, num_dispatchers: int, use_fp8_dispatch: bool,
                 use_ue8m0_dispatch: bool, ubatching: Ubatching) -> None:
        self.buffer = buffer
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_dispatchers = num_dispatchers
        self.use_fp8_dispatch = use_fp8_dispatch
        self.use_ue8m0_dispatch = use_ue8m0_dispatch  # post_init_setup: DeepGEMM's packed UE8M0 scales
        self.ubatching = ubatching
        self.handles: list[Any] = [None, None]

    def prepare_async(self, a1: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
                      ) -> tuple[Callable[[], Any], Callable[[], tuple]]:
        hidden_size = a1.size(1)
        assert hidden_size in self.SUPPORTED_HIDDEN_SIZES
        a2a_idx = self.ubatching.current_ubatch_id()
        if self.use_fp8_dispatch:
            assert hidden_size % 128 == 0
        expert_x, expert_num_tokens, handle, _, hook = self.buffer.low_latency_dispatch(
            a1, topk_ids, self.max_tokens_per_rank, num_experts,
            use_fp8=self.use_fp8_dispatch, round_scale=self.use_ue8m0_dispatch, use_ue8m0=self.use_ue8m0_dispatch,
            async_finish=False, return_recv_hook=True)
        self.handles[a2a_idx] = handle
        return hook, lambda: (expert_x, expert_num_tokens)

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], None]]:
        a2a_idx = self.ubatching.current_ubatch_id()
        do_recv_hook = self.ubatching.enabled() or True  # finalize_async: do_async=True
        handle = self.handles[a2a_idx]
        assert handle is not None
        self.ubatching.maybe_run_recv_hook()  # the other micro-batch's pending hook
        _, _, recv_hook = self.buffer.low_latency_combine(
            fused_expert_output, topk_ids, topk_weights, handle,
            async_finish=False, zero_copy=False, return_recv_hook=do_recv_hook, out=output)
        return recv_hook, lambda: None


def vllm_moe_apply(pf: VllmLLPrepareFinalize, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   num_experts: int, factors: torch.Tensor, workspaces: dict[int, torch.Tensor],
                   received: list[Received] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """modular_kernel.py@055e47c2 `FusedMoEKernelModularImpl.apply` for an all2all that supports_async():
    _prepare (run the other micro-batch's hook, dispatch, then the hook: now, or handed to the other micro-batch
    and yield), the experts into a workspace view [E_l, T*R, H], _finalize (combine into `output`, the shared
    experts, then the hook the same way). Returns the routed and the shared experts' outputs. `received`:
    where the experts' inputs are copied for the checks (None inside CUDA graphs)."""
    ub = pf.ubatching
    output = torch.empty_like(x)
    # _prepare
    ub.maybe_run_recv_hook()
    hook, receiver = pf.prepare_async(x, topk_ids, num_experts)
    if ub.enabled():
        ub.register_recv_hook(hook)
        ub.yield_()
    else:
        hook()
    expert_x, expert_num_tokens = receiver()
    # _fused_experts: moe_problem_size's checks; the output is `_resize_cache(workspace13, (E_l, T*R, H))`
    a1 = expert_x[0] if isinstance(expert_x, tuple) else expert_x
    assert a1.dim() == 3 and a1.size(0) == factors.numel() == expert_num_tokens.numel()
    if received is not None:
        received.append(Received(_copy(expert_x), expert_num_tokens.clone()))
    if ub.current_ubatch_id() not in workspaces:  # the workspace manager's buffer, one per micro-batch
        workspaces[ub.current_ubatch_id()] = torch.empty(a1.numel() + 4096, dtype=torch.bfloat16, device=x.device)
    workspace = workspaces[ub.current_ubatch_id()]
    fused_out = workspace.flatten()[: a1.numel()].view(a1.shape)
    fused_out.copy_(expert_outputs(expert_x, factors))
    # _finalize
    hook, receiver = pf.finalize_async(output, fused_out, topk_weights, topk_ids)
    shared = (x.float() * 0.5).to(torch.bfloat16)  # the shared experts, overlapping the combine
    if ub.enabled():
        ub.register_recv_hook(hook)
        ub.yield_()
    else:
        hook()
    receiver()
    return output, shared


class CountingFactory:
    """Calls the Buffer constructor as given, and records each call's keyword arguments and how often each
    Buffer's destroy() runs."""

    def __init__(self, make: Callable[..., Any]) -> None:
        self.make = make
        self.calls: list[dict[str, Any]] = []
        self.destroyed: dict[int, int] = {}

    def __call__(self, **kwargs: Any) -> Any:
        buffer = self.make(**kwargs)
        self.calls.append(kwargs)
        self.destroyed[id(buffer)] = 0
        destroy = buffer.destroy

        def counted() -> None:
            self.destroyed[id(buffer)] += 1
            destroy()

        buffer.destroy = counted
        return buffer


def capture(run_once: Callable[[], Any], group: dist.ProcessGroup) -> tuple[torch.cuda.CUDAGraph, Any]:
    """SGLang's cuda_graph_runner (`_capture_init`, then `_capture_graph`), as vLLM's capture too: two eager
    runs, each after a device sync and a barrier of the group, then one captured on a side stream. Returns the
    graph and what the captured run returned (its output tensors)."""
    for _ in range(2):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        run_once()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        out = run_once()
    return graph, out


def refill(static: Tokens, tokens: Tokens) -> None:
    """New inputs into a captured graph's input tensors."""
    for dst, src in zip(static, tokens):
        dst.copy_(src)


VLLM_T = 16  # max_num_tokens per DP rank (vLLM's default for batched DP MoE is 256)
VLLM_H, VLLM_DRAFT_H = 2048, 2560  # from SUPPORTED_HIDDEN_SIZES; the draft model's MoE gets a second Buffer
VLLM_E, VLLM_K, VLLM_LAYERS = 16, 6, 3


def rank_vllm(rank: int, world: int, seed: int, mode: str, device: str) -> None:
    """vLLM with `--all2all-backend deepep_low_latency`: Buffers made per MoE layer through the manager's cache,
    plain steps over every layer, two-micro-batch (DBO) steps over the main model's layers, then teardown."""
    dev = setup_device(rank, device)
    use_fp8, _, use_ue8m0 = MODES[mode]
    num_local = VLLM_E // world
    pg = dist.new_group(list(range(world)), backend="gloo")  # parallel_state.py: the EP group's cpu_group
    factory = CountingFactory(engine_buffer(device))
    manager = VllmLLManager(pg, factory)
    ub = Ubatching(torch.cuda.Stream() if dev.type == "cuda" else None)
    hiddens = [VLLM_H] * VLLM_LAYERS + [VLLM_DRAFT_H]
    pfs = []
    for hidden in hiddens:  # all2all_utils.py maybe_make_prepare_finalize, once per MoE layer
        handle = manager.get_handle(dict(max_num_tokens_per_dp_rank=VLLM_T, token_hidden_size=hidden,
                                         num_ep_ranks=world, num_global_experts=VLLM_E, num_local_experts=num_local))
        pfs.append(VllmLLPrepareFinalize(handle, VLLM_T, world, use_fp8, use_ue8m0, ub))
    main, draft = pfs[0].buffer, pfs[-1].buffer
    assert all(pf.buffer is main for pf in pfs[:-1]) and draft is not main, "one Buffer per distinct kwargs"
    assert [sorted(kw) for kw in factory.calls] == [sorted(
        ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
         "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink"])] * 2
    for kw, hidden in zip(factory.calls, (VLLM_H, VLLM_DRAFT_H)):
        assert kw["num_rdma_bytes"] == deep_ep.Buffer.get_low_latency_rdma_size_hint(VLLM_T, hidden, world, VLLM_E)
    for buf in (main, draft):
        assert (buf.rank, buf.group_size, buf.low_latency_mode) == (rank, world, True)
        assert buf.backend_name == ("cuda" if dev.type == "cuda" else "reference")
    factors = expert_factors(local_experts(rank, num_local), dev)
    workspaces: list[dict[int, torch.Tensor]] = [{} for _ in pfs]

    for step in range(2):  # plain: dispatch, hook, experts, combine, shared experts, hook, per layer
        for li, hidden in enumerate(hiddens):
            counts = draw_counts(seed, ("vllm", step, li), world, 1, VLLM_T)
            every = draw(seed, ("vllm", step, li), counts, hidden, VLLM_E, VLLM_K)
            mine, received = on_device(every[rank], dev), []
            out, shared = vllm_moe_apply(pfs[li], *mine, VLLM_E, factors, workspaces[li], received)
            synchronize(dev)
            at = label(seed, rank, mode, f"plain step {step} layer {li}")
            check_dispatch(*received[0], every, rank, VLLM_T, VLLM_E, mode, at)
            check_combine(out, every[rank], mode, at)
            assert torch.equal(shared.cpu(), (every[rank].x.float() * 0.5).to(torch.bfloat16)), at

    for step in range(3):  # DBO: two micro-batches of unequal size (n = 1 leaves micro-batch 0 empty)
        counts = draw_counts(seed, ("vllm-dbo", step), world, 1, VLLM_T)
        splits = [n // 2 for n in counts]  # ubatch_utils: split_point = num_tokens // 2, the rest to the last
        layers = [draw(seed, ("vllm-dbo", step, li), counts, VLLM_H, VLLM_E, VLLM_K) for li in range(VLLM_LAYERS)]
        bounds = [(0, splits[rank]), (splits[rank], counts[rank])]
        inputs = [[on_device(every[rank].rows(*bounds[u]), dev) for every in layers] for u in range(2)]

        def ubatch(u: int, inputs: list[list[Tokens]] = inputs) -> list[tuple]:
            results = []
            for li, tokens in enumerate(inputs[u]):
                received: list[Received] = []
                out, shared = vllm_moe_apply(pfs[li], *tokens, VLLM_E, factors, workspaces[li], received)
                results.append((out, shared, received))
            return results

        if ub.compute_stream is not None:
            ub.compute_stream.wait_stream(torch.cuda.current_stream())
        log: list[tuple] = []
        for pf in pfs[:VLLM_LAYERS]:
            pf.buffer = TracedBuffer(main, log, ubatch_of_thread)
        results = ub.run([functools.partial(ubatch, 0), functools.partial(ubatch, 1)])
        synchronize(dev)
        for pf in pfs[:VLLM_LAYERS]:
            pf.buffer = main
        assert log == DBO_ORDER * VLLM_LAYERS, log
        for u, per_layer in enumerate(results):
            for li, (out, shared, received) in enumerate(per_layer):
                every = [tokens.rows(*((0, s) if u == 0 else (s, n)))
                         for tokens, s, n in zip(layers[li], splits, counts)]
                at = label(seed, rank, mode, f"DBO step {step} ubatch {u} layer {li} counts {counts}")
                assert len(received) == 1, at
                check_dispatch(*received[0], every, rank, VLLM_T, VLLM_E, mode, at)
                check_combine(out, every[rank], mode, at)
                assert torch.equal(shared.cpu(), (every[rank].x.float() * 0.5).to(torch.bfloat16)), at

    if dev.type == "cuda":  # full CUDA graphs capture the plain step (dispatch, hooks and combine included)
        counts = draw_counts(seed, ("vllm-graph",), world, 1, VLLM_T)
        static = on_device(draw(seed, ("vllm-graph", -1), counts, VLLM_H, VLLM_E, VLLM_K)[rank], dev)
        graph, (out, _) = capture(lambda: vllm_moe_apply(pfs[0], *static, VLLM_E, factors, workspaces[0], None), pg)
        for replay in range(3):
            every = draw(seed, ("vllm-graph", replay), counts, VLLM_H, VLLM_E, VLLM_K)
            refill(static, on_device(every[rank], dev))
            graph.replay()
            torch.cuda.synchronize()
            main.check()
            check_combine(out, every[rank], mode, label(seed, rank, mode, f"graph replay {replay}"))

    manager.destroy()
    assert sorted(factory.destroyed.values()) == [1, 1], factory.destroyed
    after = on_device(draw(seed, ("after",), [1] * world, VLLM_H, VLLM_E, VLLM_K)[rank], dev)
    with pytest.raises(RuntimeError, match="destroy"):
        main.low_latency_dispatch(after.x, after.idx, VLLM_T, VLLM_E, use_fp8=use_fp8)


def rank_vllm_test_helper(rank: int, world: int, seed: int, device: str) -> None:
    """vLLM's own test helper (tests/kernels/moe/parallel_utils.py@0ff715e7 `make_deepep_ll_a2a`): the size hint
    positional, a short Buffer(...) on a new group, then one plain MoE call through the prepare/finalize."""
    dev = setup_device(rank, device)
    num_experts, hidden, max_tokens = 8 * world, 4096, 8
    pg = dist.new_group(list(range(world)))
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
    buffer = engine_buffer(device)(group=pg, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                                   num_qps_per_rank=num_experts // world)
    pf = VllmLLPrepareFinalize(buffer, max_tokens, world, False, False, Ubatching())
    counts = draw_counts(seed, ("helper",), world, 1, max_tokens)
    every = draw(seed, ("helper",), counts, hidden, num_experts, 8)
    received: list[Received] = []
    out, _ = vllm_moe_apply(pf, *on_device(every[rank], dev), num_experts, expert_factors(
        local_experts(rank, num_experts // world), dev), {}, received)
    synchronize(dev)
    at = label(seed, rank, "vLLM test helper")
    check_dispatch(*received[0], every, rank, max_tokens, num_experts, "bf16", at)
    check_combine(out, every[rank], "bf16", at)


def rank_vllm_fault_tolerance(rank: int, world: int, seed: int) -> None:
    """`--enable-fault-tolerance`: the Buffer gets enable_shrink=True; all2all.py's query_active_mask and
    clean_buffers calls, then a plain MoE call, exact."""
    pg = dist.new_group(list(range(world)), backend="gloo")
    manager = VllmLLManager(pg, engine_buffer("cpu"), enable_fault_tolerance=True)
    num_local = VLLM_E // world
    buffer = manager.get_handle(dict(max_num_tokens_per_dp_rank=VLLM_T, token_hidden_size=VLLM_H, num_ep_ranks=world,
                                     num_global_experts=VLLM_E, num_local_experts=num_local))
    assert buffer.enable_shrink
    mask = torch.zeros(world, dtype=torch.int32)  # vLLM: device="cuda"; these ranks are CPU ones
    mask.fill_(7)
    buffer.low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0] * world, mask
    buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    buffer.low_latency_clean_mask_buffer()
    pf = VllmLLPrepareFinalize(buffer, VLLM_T, world, True, False, Ubatching())
    every = draw(seed, ("ft",), draw_counts(seed, ("ft",), world, 1, VLLM_T), VLLM_H, VLLM_E, VLLM_K)
    received: list[Received] = []
    out, _ = vllm_moe_apply(pf, *every[rank], VLLM_E, expert_factors(local_experts(rank, num_local), "cpu"), {},
                            received)
    at = label(seed, rank, "fault tolerance")
    check_dispatch(*received[0], every, rank, VLLM_T, VLLM_E, "fp8", at)
    check_combine(out, every[rank], "fp8", at)
    manager.destroy()


class VllmHTManager:
    """all2all.py@055e47c2 `DeepEPHTAll2AllManager` (with its base's handle cache and `destroy`), inside one node
    (`internode` False): the manager computes the Buffer's kwargs alone, so every MoE layer gets the one Buffer."""

    def __init__(self, cpu_group: dist.ProcessGroup, make_buffer: Callable[..., Any]) -> None:
        self.cpu_group = cpu_group
        self.handle_cache = VllmCache()
        self.make_buffer = make_buffer  # deep_ep.Buffer

    def _make_all2all_kwargs(self) -> dict[str, Any]:
        num_nvl_bytes = 1024 * 1024 * 1024  # envs.VLLM_DEEPEP_BUFFER_SIZE_MB (default 1024) MiB
        num_rdma_bytes, num_qps_per_rank = 0, 1  # intranode
        return dict(group=self.cpu_group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                    low_latency_mode=False, num_qps_per_rank=num_qps_per_rank, explicitly_destroy=True)

    def get_handle(self, kwargs: dict[str, Any]) -> Any:
        assert len(kwargs) == 0, "DeepEPHTAll2AllManager expects no arguments"
        return self.handle_cache.get_or_create(self._make_all2all_kwargs(), self.make_buffer)

    def destroy(self) -> None:
        with self.handle_cache._lock:
            for _, handle in self.handle_cache._cache.items():
                handle.destroy()
            self.handle_cache._cache.clear()


def per_token_group_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_kernel_quantize_input for block-quantised FP8 ([128, 128] weight blocks): per token and 128 channels,
    e4m3 [T, H] and float32 scales [T, H/128]."""
    return fp8_columns(x, "fp8")


def topk_weight_and_reduce_contiguous(fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                                      topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_weight_and_reduce.py@02e45400 `TopKWeightAndReduceContiguous.apply(output=None, ...)`: the
    experts' [m, topk, K] rows times their weights in place (bf16), then summed over topk (ops.moe_sum; here
    torch's sum, which accumulates in float32) into a new [m, K]."""
    m, num_topk = topk_ids.size()
    k = fused_expert_output.size(-1)
    if fused_expert_output.ndim == 2:
        fused_expert_output = fused_expert_output.view(m, num_topk, k)
    assert fused_expert_output.size() == (m, num_topk, k)
    fused_expert_output.mul_(topk_weights.view(m, -1, 1))
    output = torch.empty((m, k), device=fused_expert_output.device, dtype=fused_expert_output.dtype)
    output.copy_(fused_expert_output.sum(dim=1))
    return output


class VllmHTPrepareFinalize:
    """deepep_ht.py@055e47c2 `DeepEPHTPrepareAndFinalize` on CUDA (no ROCm sync), without
    apply_router_weight_on_input or deferred input quantisation: block-quantised FP8 models quantise before the
    dispatch and send (x, scales), the others send bf16 (any other quantisation follows the dispatch, outside
    deep_ep); one handle per micro-batch; finalize weighs and reduces the experts' [M, topk, H] output here
    (the experts leave it to the prepare/finalize: TopKWeightAndReduceDelegate becomes Contiguous) and combines
    the rows unweighted (topk_weights=None)."""

    def __init__(self, buffer: Any, num_dispatchers: int, dp_size: int, rank_expert_offset: int,
                 ubatching: Ubatching, block_quantized: bool) -> None:
        self.buffer = buffer
        self.num_dispatchers_ = num_dispatchers
        self.dp_size = dp_size
        self.rank_expert_offset = rank_expert_offset
        self.async_prepare = True
        self.handles: list[Any] = [None, None]
        self.available_rank_configs = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]  # DeepEP's tuned rank counts
        self.ubatching = ubatching
        self.block_quantized = block_quantized  # quant_config.is_block_quantized

    def _get_dispatch_config(self) -> Any:
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return deep_ep.Buffer.get_dispatch_config(self.num_dispatchers_)

    def _get_combine_config(self) -> Any:
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return deep_ep.Buffer.get_combine_config(self.num_dispatchers_)

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int) -> Callable[[], tuple]:
        if self.block_quantized:  # DeepEP only supports FP8 block scales: quantise before the dispatch
            a1q, a1q_scale = per_token_group_quant_fp8(a1)
            if a1q_scale is not None and a1q_scale.numel() == 1:
                a1q_scale = a1q_scale.view(1, 1)
        else:
            a1q, a1q_scale = a1, None
        return self._do_dispatch(a1q, a1q_scale, topk_ids, topk_weights, num_experts)

    def _do_dispatch(self, tokens: torch.Tensor, token_scales: torch.Tensor | None, rank_topk_ids: torch.Tensor,
                     rank_topk_weights: torch.Tensor, num_experts: int) -> Callable[[], tuple]:
        ub = self.ubatching
        has_scales = token_scales is not None
        previous_event = ub.get_previous_event(self.buffer.capture)  # before the yield: this micro-batch's work
        ub.yield_and_switch_from_compute_to_comm()
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens, is_token_in_rank,
         event) = self.buffer.get_dispatch_layout(
            topk_idx=rank_topk_ids, num_experts=num_experts, previous_event=previous_event, async_finish=False,
            allocate_on_comm_stream=False)
        token_data: Any = (tokens, token_scales) if has_scales else tokens
        (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle,
         event) = self.buffer.dispatch(
            x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=rank_topk_ids, topk_weights=rank_topk_weights,
            expert_alignment=1, config=self._get_dispatch_config(), previous_event=previous_event,
            async_finish=self.async_prepare and not ub.enabled(), allocate_on_comm_stream=False)
        self.handles[ub.current_ubatch_id()] = handle
        ub.switch_to_compute_sync()
        return lambda: self._receiver(event, has_scales, token_data, expert_topk_ids, num_experts,
                                      expert_num_tokens_per_expert_list, expert_topk_weights)

    def _receiver(self, event: Any, has_scales: bool, token_data: Any, expert_topk_ids: torch.Tensor | None,
                  num_experts: int, expert_num_tokens_per_expert_list: list[int],
                  expert_topk_weights: torch.Tensor | None) -> tuple:
        if event.event is not None:
            event.current_stream_wait()
        expert_x, expert_x_scale = token_data if has_scales else (token_data, None)
        # The -1 ids go to an expert of another rank (which expert_map maps to -1), the others back to global ids.
        assert expert_topk_ids is not None
        expert_topk_ids = torch.where(expert_topk_ids == -1, num_experts - 1 if self.rank_expert_offset == 0 else 0,
                                      expert_topk_ids + self.rank_expert_offset)
        expert_num_tokens = torch.tensor(expert_num_tokens_per_expert_list, dtype=torch.int32,
                                         device=expert_x.device)  # ExpertTokensMetadata.make_from_list
        return expert_x, expert_x_scale, expert_num_tokens, expert_topk_ids, expert_topk_weights

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> Callable[[], None]:
        """`_finalize(..., do_async=True)`."""
        ub = self.ubatching
        handle = self.handles[ub.current_ubatch_id()]
        assert handle is not None
        if fused_expert_output.numel() != 0:  # no rows when no token reached this rank
            fused_expert_output = topk_weight_and_reduce_contiguous(fused_expert_output, topk_weights, topk_ids)
        previous_event = ub.get_previous_event(self.buffer.capture)
        ub.yield_and_switch_from_compute_to_comm()
        assert fused_expert_output.dtype == torch.bfloat16
        combined_x, _, event = self.buffer.combine(
            x=fused_expert_output, handle=handle, topk_weights=None, config=self._get_combine_config(),
            previous_event=previous_event, async_finish=not ub.enabled(), allocate_on_comm_stream=False)
        ub.switch_to_compute()

        def _receiver() -> None:
            if event.event is not None:
                event.current_stream_wait()
            ub.switch_to_comm()
            output.copy_(combined_x, non_blocking=True)
            ub.yield_and_switch_from_comm_to_compute()

        return _receiver


def vllm_ht_experts(a1q: torch.Tensor, a1q_scale: torch.Tensor | None, topk_ids: torch.Tensor,
                    expert_map: torch.Tensor, expert_num_tokens: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """The fused experts in vLLM's standard activation format, leaving the weights to the prepare/finalize:
    [M, topk, H], per received row and top-k slot the slot's expert's output (expert_map: global id -> local
    one, -1 elsewhere; 0 for those), from the row dequantised in float32, rounded to bf16. The per-expert counts
    the prepare handed over (ExpertTokensMetadata) must be the rows each local expert has."""
    local = expert_map[topk_ids]
    have = torch.bincount(local[local >= 0].long(), minlength=factors.numel()).to(torch.int32)
    assert torch.equal(expert_num_tokens, have), f"expert_num_tokens {expert_num_tokens.tolist()}, have {have.tolist()}"
    rows = dequant_rows(a1q, a1q_scale)
    scale = torch.where(local >= 0, factors[local.clamp(min=0).long()], 0.0)
    return (rows[:, None, :] * scale[:, :, None]).to(torch.bfloat16)


def vllm_ht_moe_apply(pf: VllmHTPrepareFinalize, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      num_experts: int, expert_map: torch.Tensor, factors: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """modular_kernel.py@055e47c2 `FusedMoEKernelModularImpl.apply` for a prepare_async that returns a receiver
    alone (no hook): _prepare (the other micro-batch's pending hook, prepare_async, the receiver; the top-k ids
    and weights become the dispatched ones), _fused_experts (an empty output when no token reached this rank),
    _finalize (finalize_async, the shared experts, the receiver). Returns the routed and the shared experts'
    outputs."""
    ub = pf.ubatching
    output = torch.empty_like(x)
    ub.maybe_run_recv_hook()
    receiver = pf.prepare_async(x, topk_weights, topk_ids, num_experts)
    a1q, a1q_scale, expert_num_tokens, topk_ids, topk_weights = receiver()
    if a1q.size(0) == 0:  # M_full == 0
        fused_out = torch.empty_like(a1q, dtype=x.dtype)
    else:
        fused_out = vllm_ht_experts(a1q, a1q_scale, topk_ids, expert_map, expert_num_tokens, factors)
    receiver = pf.finalize_async(output, fused_out, topk_weights, topk_ids)
    shared = (x.float() * 0.5).to(torch.bfloat16)  # the shared experts, overlapping the combine
    receiver()
    return output, shared


VLLM_HT_T, VLLM_HT_LAYERS = 40, 2  # prefill tokens per rank (normal mode has no per-rank bound), MoE layers
VLLM_HT_H = 512  # maybe_roundup_layer_hidden_size leaves it (1024 bytes: whole 512-byte copy atoms)
# ubatching.py@055e47c2 with two micro-batches A = 0, B = 1, per layer: A yields before its layout; B yields
# before its own; A sends its layout and dispatch, runs its experts and yields before its combine; B does the same;
# A combines, then yields after copying its output; B combines.
HT_DBO_ORDER = [(0, "layout", 0), (0, "normal dispatch", 0), (1, "layout", 1), (1, "normal dispatch", 1),
                (0, "normal combine", 0), (1, "normal combine", 1)]


def vllm_ht_step(seed: int, world: int, kind: str, step: int, li: int) -> tuple[list[int], list[Tokens]]:
    """The tokens per rank and every rank's tokens of one MoE layer in one step (1 at least: vLLM pads an idle
    DP rank's batch to one dummy token)."""
    counts = draw_counts(seed, ("vllm-ht", kind, step), world, 1, VLLM_HT_T)
    return counts, draw(seed, ("vllm-ht", kind, step, li), counts, VLLM_HT_H, VLLM_E, VLLM_K)


def rank_vllm_ht(rank: int, world: int, seed: int, mode: str, device: str) -> dict[tuple, np.ndarray]:
    """vLLM with `--all2all-backend deepep_high_throughput`: the manager's one Buffer for every MoE layer, plain
    steps over the layers, two-micro-batch (DBO) steps, teardown. Each dispatch is checked here; the MoE
    outputs go back to the test, which checks them against the dense oracle."""
    fp8 = mode == "fp8"
    num_local = VLLM_E // world
    dev = setup_device(rank, device)
    pg = dist.new_group(list(range(world)), backend="gloo")  # parallel_state.py: the EP group's cpu_group
    factory = CountingFactory(engine_buffer(device))
    manager = VllmHTManager(pg, factory)
    handles = [manager.get_handle({}) for _ in range(VLLM_HT_LAYERS)]  # all2all_utils: once per MoE layer
    buffer = handles[0]
    assert all(h is buffer for h in handles) and len(factory.calls) == 1, "one Buffer for every layer"
    assert factory.calls[0] == dict(group=pg, num_nvl_bytes=1 << 30, num_rdma_bytes=0, low_latency_mode=False,
                                    num_qps_per_rank=1, explicitly_destroy=True), factory.calls
    assert (buffer.rank, buffer.group_size, buffer.low_latency_mode) == (rank, world, False)
    assert (buffer.num_nvl_bytes, buffer.num_rdma_bytes, buffer.backend_name) == \
        (1 << 30, 0, "cuda" if dev.type == "cuda" else "reference")
    log: list[tuple] = []
    traced = TracedBuffer(buffer, log, ubatch_of_thread)
    ub = Ubatching()
    pfs = [VllmHTPrepareFinalize(traced, world, world, rank * num_local, ub, fp8) for _ in range(VLLM_HT_LAYERS)]
    assert pfs[0]._get_dispatch_config() is not None and pfs[0]._get_combine_config() is not None
    expert_map = torch.full((VLLM_E,), -1, dtype=torch.int32, device=dev)  # FusedMoE's expert_map of this EP rank
    expert_map[rank * num_local:(rank + 1) * num_local] = torch.arange(num_local, dtype=torch.int32, device=dev)
    factors = expert_factors(local_experts(rank, num_local), dev)
    outputs: dict[tuple, np.ndarray] = {}

    def sent(every: list[Tokens]) -> list[Any]:
        return [per_token_group_quant_fp8(t.x) if fp8 else t.x for t in every]

    for step in range(2):
        for li in range(VLLM_HT_LAYERS):
            counts, every = vllm_ht_step(seed, world, "plain", step, li)
            log.clear()
            out, shared = vllm_ht_moe_apply(pfs[li], *on_device(as_made(every[rank]), dev), VLLM_E, expert_map,
                                            factors)
            at = label(seed, rank, mode, f"plain step {step} layer {li} counts {counts}")
            assert log == [(None, "layout", None), (None, "normal dispatch", None), (None, "normal combine", None)], log
            check_normal_dispatch(*on_cpu(traced.take_dispatched()), sent(every), every, rank, VLLM_E, 1, at)
            assert torch.equal(shared.cpu(), (every[rank].x.float() * 0.5).to(torch.bfloat16)), at
            outputs[("plain", step, li)] = for_parent(out)

    for step in range(2):  # DBO: two micro-batches, split at n // 2 (n = 1 leaves micro-batch 0 empty)
        layers = [vllm_ht_step(seed, world, "dbo", step, li) for li in range(VLLM_HT_LAYERS)]
        counts = layers[0][0]
        splits = [n // 2 for n in counts]
        bounds = [(0, splits[rank]), (splits[rank], counts[rank])]

        def ubatch(u: int, layers: list = layers, bounds: list = bounds) -> list[torch.Tensor]:
            outs = []
            for li, (_, every) in enumerate(layers):
                tokens = on_device(as_made(every[rank].rows(*bounds[u])), dev)
                outs.append(vllm_ht_moe_apply(pfs[li], *tokens, VLLM_E, expert_map, factors)[0])
            return outs

        log.clear()
        results = ub.run([functools.partial(ubatch, 0), functools.partial(ubatch, 1)])
        assert log == HT_DBO_ORDER * VLLM_HT_LAYERS, log
        for li, (_, every) in enumerate(layers):
            for u in range(2):
                sub = [t.rows(*((0, s) if u == 0 else (s, n))) for t, s, n in zip(every, splits, counts)]
                at = label(seed, rank, mode, f"DBO step {step} ubatch {u} layer {li} counts {counts}")
                check_normal_dispatch(*on_cpu(traced.take_dispatched(u)), sent(sub), sub, rank, VLLM_E, 1, at)
                outputs[("dbo", step, u, li)] = for_parent(results[u][li])
    assert not traced.dispatched

    manager.destroy()
    assert list(factory.destroyed.values()) == [1], factory.destroyed
    with pytest.raises(RuntimeError, match="destroy"):
        buffer.get_dispatch_layout(topk_idx=torch.zeros(1, VLLM_K, dtype=torch.int64), num_experts=VLLM_E)
    return outputs


def check_vllm_ht_outputs(results: list[dict[tuple, np.ndarray]], world: int, seed: int, mode: str) -> None:
    """Every rank's MoE outputs against the dense oracle, all computed here from the tokens the ranks drew."""
    for rank, outputs in enumerate(results):
        assert len(outputs) == 2 * VLLM_HT_LAYERS * 3, sorted(outputs)
        for key, out in outputs.items():
            if key[0] == "plain":
                _, step, li = key
                tokens = vllm_ht_step(seed, world, "plain", step, li)[1][rank]
            else:
                _, step, u, li = key
                every = vllm_ht_step(seed, world, "dbo", step, li)[1]
                n = every[rank].x.shape[0]
                tokens = every[rank].rows(*((0, n // 2) if u == 0 else (n // 2, n)))
            check_dense(out, tokens, mode, label(seed, rank, mode, *key))


# ==================================================================================== SGLang, in miniature
class DeepEPMode:
    """sglang/srt/layers/moe/utils.py `DeepEPMode` (--deepep-mode)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def enable_normal(self) -> bool:
        return self.value in ("normal", "auto")

    def enable_low_latency(self) -> bool:
        return self.value in ("low_latency", "auto")

    def resolve(self, is_extend_in_batch: bool) -> DeepEPMode:
        """Auto mode: normal dispatch for a batch with extend (prefill) tokens on any rank, else low latency."""
        if self.value != "auto":
            return self
        return DeepEPMode("normal" if is_extend_in_batch else "low_latency")


class DeepEPConfig:
    """deepep.py@003a81bf `DeepEPConfig`: `--deepep-config` (JSON) becomes two `deep_ep.Config`s; without it,
    the SM count is `Buffer.num_sms`."""

    def __init__(self, config_str: str | None) -> None:
        if config_str:
            config_parsed = json.loads(config_str)
            config_dispatch, config_combine = config_parsed["normal_dispatch"], config_parsed["normal_combine"]
            self.normal_dispatch_config = deep_ep.Config(**config_dispatch)
            self.normal_combine_config = deep_ep.Config(**config_combine)
            assert config_dispatch["num_sms"] == config_combine["num_sms"]
            self.num_sms = config_dispatch["num_sms"]
        else:
            self.normal_dispatch_config = self.normal_combine_config = None
            self.num_sms = deep_ep.Buffer.num_sms


class DeepEPBuffer:
    """deepep.py@003a81bf `DeepEPBuffer` (class-level state there: one Buffer per process, made at the first
    dispatch and kept; an instance here, one per rank function): the Buffer's sizing and construction, and the
    clean on a switch from normal to low-latency dispatch. `make_buffer` is `deep_ep.Buffer`."""

    NORMAL, LOW_LATENCY = "normal", "low_latency"  # DeepEPDispatchMode

    def __init__(self, config: DeepEPConfig, make_buffer: Callable[..., Any]) -> None:
        self.config, self.make_buffer = config, make_buffer
        self._buffer: Any = None
        self._dispatch_mode: str | None = None
        self.made = 0

    def get_deepep_buffer(self, group: Any, hidden_size: int, param_bytes: int, deepep_mode: DeepEPMode,
                          num_max_dispatch_tokens_per_rank: int = -1, num_experts: int = -1) -> Any:
        if self._buffer is not None:
            return self._buffer
        self._hidden_size = hidden_size
        self._num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self._num_experts = num_experts
        num_nvl_bytes, num_rdma_bytes = 0, 0
        if deepep_mode.enable_normal():
            hidden_bytes = hidden_size * param_bytes
            for config in (self.config.normal_dispatch_config or deep_ep.Buffer.get_dispatch_config(group.size()),
                           self.config.normal_combine_config or deep_ep.Buffer.get_combine_config(group.size())):
                num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
                num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
        if deepep_mode.enable_low_latency():
            assert num_max_dispatch_tokens_per_rank != -1
            assert num_experts != -1 and num_experts % group.size() == 0
            num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(
                num_max_dispatch_tokens_per_rank, hidden_size, group.size(), num_experts), num_rdma_bytes)
        if deepep_mode.value == "normal":
            num_qps_per_rank = self.config.num_sms
        elif deepep_mode.value == "low_latency":
            num_qps_per_rank = num_experts // group.size()
        else:
            num_qps_per_rank = max(self.config.num_sms, num_experts // group.size())
        self._buffer = self.make_buffer(group, num_nvl_bytes, num_rdma_bytes,
                                        low_latency_mode=deepep_mode.enable_low_latency(),
                                        num_qps_per_rank=num_qps_per_rank, allow_mnnvl=True)
        self.made += 1
        return self._buffer

    def clean_buffer(self) -> None:
        if not self._buffer.low_latency_mode:
            return
        self._buffer.clean_low_latency_buffer(self._num_max_dispatch_tokens_per_rank, self._hidden_size,
                                              self._num_experts)

    def set_dispatch_mode_as_normal(self) -> None:
        self._dispatch_mode = self.NORMAL

    def set_dispatch_mode_as_low_latency(self) -> None:
        if self._dispatch_mode == self.NORMAL:
            self.clean_buffer()
        self._dispatch_mode = self.LOW_LATENCY


class TopKOutput(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


class DeepEPLLDispatchOutput(NamedTuple):
    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    masked_m: torch.Tensor
    expected_m: int


class SglangDispatcherBase:
    """deepep.py@003a81bf: what `DeepEPDispatcher`'s implementations share: the stage order of the four calls,
    and the one DeepEPBuffer, sized by the dispatcher's fields."""

    deepep_buffer: DeepEPBuffer
    group: Any
    hidden_size: int
    params_bytes: int
    deepep_mode: DeepEPMode
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    stage: str

    def _shared_buffer(self) -> Any:
        return self.deepep_buffer.get_deepep_buffer(self.group, self.hidden_size, self.params_bytes, self.deepep_mode,
                                                    self.num_max_dispatch_tokens_per_rank, self.num_experts)

    def _update_stage(self, old: str, new: str) -> None:
        assert self.stage == old
        self.stage = new


class SglangLLDispatcher(SglangDispatcherBase):
    """deepep.py@003a81bf `DeepEPDispatcher` in low-latency mode, with its `_DeepEPDispatcherImplLowLatency`:
    dispatch_a sends (low_latency_dispatch), dispatch_b receives (the hook, or the event's wait with
    return_recv_hook=False); combine_a / combine_b the same for low_latency_combine, all keywords. The dispatch
    handle is kept on the dispatcher; every dispatcher shares the one DeepEPBuffer."""

    def __init__(self, deepep_buffer: DeepEPBuffer, group: Any, num_experts: int, hidden_size: int,
                 num_max_dispatch_tokens_per_rank: int, use_fp8: bool, blackwell_deepgemm: bool,
                 return_recv_hook: bool, deepep_mode: str = "low_latency") -> None:
        self.deepep_buffer, self.group = deepep_buffer, group
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.deepep_mode = DeepEPMode(deepep_mode)  # the DeepEPDispatcher's (--deepep-mode)
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        assert self.num_max_dispatch_tokens_per_rank <= 1024
        self.use_fp8 = use_fp8
        self.params_bytes = 1 if use_fp8 else 2  # set_deepep_dispatcher_dtype
        self.blackwell_deepgemm = blackwell_deepgemm  # ENABLE_JIT_DEEPGEMM and DEEPGEMM_BLACKWELL
        self.return_recv_hook = return_recv_hook
        self.handle: Any = None
        self.stage = "initial"

    def _get_buffer(self) -> Any:
        self.deepep_buffer.set_dispatch_mode_as_low_latency()
        return self._shared_buffer()

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: TopKOutput) -> None:
        self._update_stage("initial", "after_dispatch_a")
        buffer = self._get_buffer()
        topk_weights, topk_ids = topk_output.topk_weights, topk_output.topk_ids
        topk_ids = topk_ids.to(torch.int64)
        expected_m = (hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1] + self.num_experts
                      ) // self.num_experts
        fp8_deepgemm_scale_opts = (dict(round_scale=self.blackwell_deepgemm, use_ue8m0=self.blackwell_deepgemm)
                                   if self.use_fp8 else {})
        buffer = self._get_buffer()
        packed_recv_hidden, self.packed_recv_count, self.handle, event, hook = buffer.low_latency_dispatch(
            hidden_states, topk_ids, self.num_max_dispatch_tokens_per_rank, self.num_experts,
            use_fp8=self.use_fp8, async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook,
            **fp8_deepgemm_scale_opts)
        self._dispatch_state = (packed_recv_hidden, topk_ids, topk_weights, self.packed_recv_count, expected_m,
                                event, hook)

    def dispatch_b(self) -> DeepEPLLDispatchOutput:
        self._update_stage("after_dispatch_a", "after_dispatch_b")
        hidden_states, topk_ids, topk_weights, masked_m, expected_m, event, hook = self._dispatch_state
        del self._dispatch_state
        hook() if self.return_recv_hook else event.current_stream_wait()
        if isinstance(hidden_states, tuple):
            hidden_states, hidden_states_scale = hidden_states
        else:
            hidden_states_scale = None
        return DeepEPLLDispatchOutput(hidden_states, hidden_states_scale, topk_ids, topk_weights, masked_m,
                                      expected_m)

    def combine_a(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._update_stage("after_dispatch_b", "after_combine_a")
        buffer = self._get_buffer()
        combined_hidden_states, event, hook = buffer.low_latency_combine(
            x=hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, handle=self.handle,
            async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook)
        self.packed_recv_count = self.handle = None
        self._combine_state = (combined_hidden_states, event, hook)

    def combine_b(self) -> torch.Tensor:
        self._update_stage("after_combine_a", "initial")
        hidden_states, event, hook = self._combine_state
        del self._combine_state
        hook() if self.return_recv_hook else event.current_stream_wait()
        return hidden_states


class Yield:
    """operations.py's YieldOperation."""


def to_stages(operations: list[Any]) -> list[list[Callable[[], None]]]:
    """operations.py@1260bf3a `_convert_operations_to_stages`: the operations cut at each Yield."""
    stages, pending = [], []
    for op in operations:
        if isinstance(op, Yield):
            stages.append(pending)
            pending = []
        else:
            pending.append(op)
    if pending:
        stages.append(pending)
    assert all(stages)
    return stages


def execute_operations(operations: list[Any]) -> None:
    """operations.py@1260bf3a `execute_operations`: one batch, stage after stage."""
    for stage in to_stages(operations):
        for op in stage:
            op()


def execute_overlapped_operations(operations_a: list[Any], operations_b: list[Any], delta_stage: int) -> None:
    """operations.py@1260bf3a `execute_overlapped_operations`: micro-batch B runs `delta_stage` stages behind A."""
    stages_a, stages_b = to_stages(operations_a), to_stages(operations_b)
    a, b = iter(stages_a), iter(stages_b)

    def run(stages: Any) -> None:
        for op in next(stages):
            op()

    for _ in range(delta_stage):
        run(a)
    for _ in range(len(stages_a) - delta_stage):
        run(a)
        run(b)
    for _ in range(delta_stage):
        run(b)
    assert next(a, None) is None and next(b, None) is None


class SglangMoELayer:
    """One DeepSeek MoE layer's operations for a batch (deepseek_v2.py's op_* methods, reduced to what touches
    deep_ep): the gate's top-k (int32 ids, as select_experts returns them), dispatch, the experts (DeepGEMM's
    masked grouped GEMM: here the scaling experts over [E_l, R*T, H]), combine."""

    def __init__(self, dispatcher: SglangLLDispatcher, factors: torch.Tensor) -> None:
        self.dispatcher, self.factors = dispatcher, factors

    def operations(self, tokens: Tokens, state: dict[str, Any], overlapped: bool) -> list[Any]:
        d = self.dispatcher

        def select_experts() -> None:
            state["topk_output"] = TopKOutput(tokens.w, tokens.idx.to(torch.int32))

        def dispatch_a() -> None:
            d.dispatch_a(tokens.x, state.pop("topk_output"))

        def shared_experts() -> None:
            state["shared"] = (tokens.x.float() * 0.5).to(torch.bfloat16)

        def dispatch_b() -> None:
            state["dispatch_output"] = d.dispatch_b()

        def experts() -> None:
            out = state["dispatch_output"]
            recv_x = out.hidden_states if out.hidden_states_scale is None else (out.hidden_states,
                                                                              out.hidden_states_scale)
            if state.get("received") is not None:
                state["received"].append(Received(_copy(recv_x), out.masked_m.clone()))
            state["combine_input"] = (expert_outputs(recv_x, self.factors), out.topk_ids, out.topk_weights)

        def combine_a() -> None:
            d.combine_a(*state.pop("combine_input"))

        def combine_b() -> None:
            state["out"] = d.combine_b()

        def noop() -> None:  # attention, communication preparation, layer output: no deep_ep calls
            pass

        if not overlapped:  # operations_strategy.py@1e90555b `_compute_moe_normal`
            return [noop, noop, noop, noop, shared_experts, select_experts, dispatch_a, dispatch_b, experts,
                    combine_a, combine_b, noop, noop]
        # operations_strategy.py@1e90555b `_compute_moe_deepseek_blog_decode` (tbo_delta_stages=2)
        return [noop, noop, Yield(), noop, noop, noop, select_experts, Yield(), dispatch_a, shared_experts, Yield(),
                dispatch_b, experts, combine_a, Yield(), combine_b, Yield(), noop, noop]


SGL_T = 128  # SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK's default
SGL_H, SGL_E, SGL_K, SGL_LAYERS, SGL_MAX_BATCH = 2048, 16, 8, 2, 24
SGL_MODES = {"bf16": (False, False), "fp8": (True, False), "ue8m0": (True, True)}  # (use_fp8, Blackwell DeepGEMM)


class SglangModel:
    """SGLang's LL model state on one rank: one DeepEPBuffer, and per MoE layer a MaybeTboDeepEPDispatcher's two
    inner dispatchers (one per two-batch-overlap sub-batch)."""

    def __init__(self, rank: int, world: int, dev: torch.device, group: Any, mode: str, return_recv_hook: bool,
                 make_buffer: Callable[..., Any]) -> None:
        use_fp8, blackwell = SGL_MODES[mode]
        self.log: list[tuple] = []  # the Buffer's calls (TracedBuffer), by sub-batch
        self.running: int | None = None  # the sub-batch whose operation runs

        def traced(*args: Any, **kwargs: Any) -> TracedBuffer:
            return TracedBuffer(make_buffer(*args, **kwargs), self.log, lambda: self.running)

        self.deepep_buffer = DeepEPBuffer(DeepEPConfig(None), traced)
        factors = expert_factors(local_experts(rank, SGL_E // world), dev)
        self.layers = [[SglangMoELayer(SglangLLDispatcher(self.deepep_buffer, group, SGL_E, SGL_H, SGL_T, use_fp8,
                                                          blackwell, return_recv_hook), factors) for _ in range(2)]
                       for _ in range(SGL_LAYERS)]

    def forward(self, batches: list[list[Tokens]], record: bool = True) -> list[list[dict[str, Any]]]:
        """One decode step over the layers, `batches[u][layer]` sub-batch u's tokens on this rank: one batch,
        or two overlapped. Returns each sub-batch's states per layer ("out": the combined tokens, "received":
        what the experts got)."""
        overlapped = len(batches) == 2
        states = [[{"received": [] if record else None} for _ in self.layers] for _ in batches]
        ops = [[self._tagged(u, op) for layer, tokens, state in zip(self.layers, batch, states[u])
                for op in layer[u].operations(tokens, state, overlapped)] for u, batch in enumerate(batches)]
        if overlapped:
            execute_overlapped_operations(*ops, delta_stage=2)
        else:
            execute_operations(ops[0])
        return states

    def _tagged(self, sub_batch: int, op: Any) -> Any:
        return op if isinstance(op, Yield) else functools.partial(self._run, sub_batch, op)

    def _run(self, sub_batch: int, op: Callable[[], None]) -> None:
        self.running = sub_batch
        op()

    def expected_log(self, overlapped: bool, hooks: bool) -> list[tuple]:
        """The order of the Buffer's calls in one forward: per layer, each sub-batch's dispatch, its hook, its
        combine, its hook, sub-batch 0 first (B runs two stages behind A, and every LL call falls in a stage
        of its own sub-batch: no two sub-batches' calls interleave)."""
        ops = ["dispatch", "dispatch hook", "combine", "combine hook"] if hooks else ["dispatch", "combine"]
        return [(u, op, u) for _ in self.layers for u in ((0, 1) if overlapped else (0,)) for op in ops]


def sub_batches(every: list[Tokens], splits: list[int] | None) -> list[list[Tokens]]:
    """Every rank's tokens of each sub-batch: all of them, or [0, split) and [split, n)."""
    if splits is None:
        return [every]
    return [[t.rows(0, s) for t, s in zip(every, splits)], [t.rows(s, t.x.shape[0]) for t, s in zip(every, splits)]]


def check_sglang_step(results: list[list[dict[str, Any]]], layers: list[list[Tokens]], splits: list[int] | None,
                      rank: int, mode: str, at: str) -> None:
    for li, every in enumerate(layers):
        for u, sub in enumerate(sub_batches(every, splits)):
            state, where_ = results[u][li], f"{at} layer {li} sub-batch {u}"
            assert len(state["received"]) == 1, where_
            check_dispatch(*state["received"][0], sub, rank, SGL_T, SGL_E, mode, where_)
            check_combine(state["out"], sub[rank], mode, where_)


def sglang_group(world: int, device: str) -> dist.ProcessGroup:
    """SGLang hands the Buffer `get_tp_group().device_group`: NCCL on GPUs. Several processes on one GPU cannot
    form an NCCL group (NCCL refuses a GPU twice), so there the ranks' gloo group stands in."""
    if device == "cuda" and torch.cuda.device_count() >= world:
        return dist.new_group(list(range(world)), backend="nccl")
    return dist.group.WORLD


def rank_sglang(rank: int, world: int, seed: int, mode: str, return_recv_hook: bool, device: str) -> None:
    """SGLang with `--moe-a2a-backend deepep --deepep-mode low_latency`: the Buffer made at the first dispatch
    and reused; plain decode steps, two-batch-overlap steps, ranks and sub-batches without tokens, the clean on
    a switch back from normal dispatch; on GPUs, CUDA graphs captured after two eager runs."""
    dev = setup_device(rank, device)
    group = sglang_group(world, device)
    model = SglangModel(rank, world, dev, group, mode, return_recv_hook, engine_buffer(device))
    assert model.deepep_buffer.config.num_sms == deep_ep.Buffer.num_sms == 20  # DeepEPConfig without a config

    def step(tag: tuple, overlapped: bool, cleans: bool = False) -> None:
        counts = draw_counts(seed, ("sglang", *tag), world, 0, SGL_MAX_BATCH)  # 0: an idle DP rank
        layers = [draw(seed, ("sglang", *tag, li), counts, SGL_H, SGL_E, SGL_K) for li in range(SGL_LAYERS)]
        splits = [n // 2 for n in counts] if overlapped else None  # decode TBO: split_token_index = n // 2
        model.log.clear()
        batches = [[on_device(sub[rank], dev) for sub in per_batch] for per_batch in
                   zip(*(sub_batches(every, splits) for every in layers))]
        results = model.forward(batches)
        synchronize(dev)
        clean = [(0, "clean", 0)] if cleans else []  # sub-batch 0's first dispatch_a, through _get_buffer
        assert model.log == clean + model.expected_log(overlapped, return_recv_hook), model.log
        check_sglang_step(results, layers, splits, rank, mode, label(seed, rank, mode, f"hook={return_recv_hook}",
                                                                     f"step {tag} counts {counts}"))

    for i in range(2):
        step(("plain", i), overlapped=False)
    buffer = model.deepep_buffer._buffer
    assert (buffer.group_size, buffer.low_latency_mode, buffer.rank) == (world, True, rank)
    assert buffer.backend_name == ("cuda" if dev.type == "cuda" else "reference")
    for i in range(3):
        step(("tbo", i), overlapped=True)
    # A prefill in normal mode, then decode again: DeepEPBuffer.clean_buffer runs clean_low_latency_buffer.
    model.deepep_buffer.set_dispatch_mode_as_normal()
    step(("after clean", 0), overlapped=True, cleans=True)
    step(("after clean", 1), overlapped=False)
    assert model.deepep_buffer.made == 1 and model.deepep_buffer._buffer is buffer

    if dev.type == "cuda":
        for overlapped in (False, True):
            counts = draw_counts(seed, ("sglang-graph", overlapped), world, 1, SGL_MAX_BATCH)
            splits = [n // 2 for n in counts] if overlapped else None

            def inputs(replay: int, overlapped: bool = overlapped, counts: list[int] = counts,
                       splits: list[int] | None = splits) -> list[list[list[Tokens]]]:
                """[sub-batch][layer]: every rank's tokens."""
                layers = [draw(seed, ("sglang-graph", overlapped, replay, li), counts, SGL_H, SGL_E, SGL_K)
                          for li in range(SGL_LAYERS)]
                return [list(per_batch) for per_batch in zip(*(sub_batches(every, splits) for every in layers))]

            static = [[on_device(sub[rank], dev) for sub in per_batch] for per_batch in inputs(-1)]

            def run_once(static: list[list[Tokens]] = static) -> list[list[torch.Tensor]]:
                return [[state["out"] for state in per_batch] for per_batch in model.forward(static, record=False)]

            graph, outs = capture(run_once, group)
            for replay in range(3):
                fresh = inputs(replay)
                for static_batch, batch in zip(static, fresh):
                    for st, sub in zip(static_batch, batch):
                        refill(st, on_device(sub[rank], dev))
                graph.replay()
                torch.cuda.synchronize()
                buffer.check()
                at = label(seed, rank, mode, f"graph overlapped={overlapped} replay {replay}")
                for u, (per_batch, batch) in enumerate(zip(outs, fresh)):
                    for li, (out, sub) in enumerate(zip(per_batch, batch)):
                        check_combine(out, sub[rank], mode, f"{at} sub-batch {u} layer {li}")
    assert model.deepep_buffer.made == 1


class DeepEPNormalDispatchOutput(NamedTuple):
    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_recv_tokens_per_expert: list[int]


# Normal-mode configurations: (FP8 dispatch, deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM, DEEPGEMM_SCALE_UE8M0).
# "fp8": Hopper DeepGEMM; "ue8m0": Blackwell DeepGEMM; "bf16": DeepGEMM with a bf16 dispatch (deepep_output_dtype
# BF16); "bf16-aiter": ROCm's aiter runner, no DeepGEMM (combine_a's other path), so expert_alignment 1.
SGL_NORMAL_MODES = {"fp8": (True, True, False), "ue8m0": (True, True, True), "bf16": (False, True, False),
                    "bf16-aiter": (False, False, False)}
SGL_PREFILL_MAX = 160  # prefill tokens per rank: more than the low-latency buffer's SGL_T holds
SGL_NORMAL_H = 1024  # the hidden size of the normal-mode and auto-mode replays (UE8M0: a multiple of 512)
SGL_DEEPEP_CONFIG = {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8, "num_max_nvl_chunked_recv_tokens": 256,
                     "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128}  # --deepep-config


def sglang_per_token_group_quant_fp8(x: torch.Tensor, group_size: int, column_major_scales: bool,
                                     scale_tma_aligned: bool, scale_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_kernel.py's `sglang_per_token_group_quant_fp8` as the normal dispatcher calls it: e4m3 [T, H] and a
    float32 scale per token and 128 channels [T, H/128]; for DeepGEMM's UE8M0 (all three flags) power-of-two
    scales packed four to an int32, [T, H/512] column-major in storage whose columns are padded to 16 bytes
    (TMA-aligned): strides (1, T rounded up to 4)."""
    assert group_size == FP8_GROUP and column_major_scales == scale_tma_aligned == scale_ue8m0
    data, scales = fp8_columns(x, "ue8m0" if scale_ue8m0 else "fp8")
    if column_major_scales:
        t = scales.shape[0]
        storage = torch.zeros(scales.shape[1], -(-t // 4) * 4, dtype=scales.dtype, device=scales.device)
        storage[:, :t] = scales.t()
        scales = storage.t()[:t]
    return data, scales


class SglangNormalDispatcher(SglangDispatcherBase):
    """deepep.py@003a81bf `DeepEPDispatcher` in normal mode, with its `_DeepEPDispatcherImplNormal`: dispatch_a
    quantises for DeepGEMM (unless the dispatch is bf16) and, with async_finish, captures an event;
    dispatch_b runs get_dispatch_layout and dispatch on it (expert_alignment 128 for DeepGEMM's contiguous
    layout, else 1; this version passes no num_worst_tokens) and waits for the dispatch's event; combine_a
    captures an event, combine_b combines the experts' output (already weighted and reduced per received row)
    and drops the handle. The handle is kept on the dispatcher; every dispatcher shares the one DeepEPBuffer."""

    def __init__(self, deepep_buffer: DeepEPBuffer, group: Any, num_experts: int, hidden_size: int,
                 num_max_dispatch_tokens_per_rank: int, mode: str, async_finish: bool,
                 deepep_mode: str = "normal") -> None:
        self.deepep_buffer, self.group = deepep_buffer, group
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.deepep_mode = DeepEPMode(deepep_mode)
        use_fp8, self.deepgemm, self.scale_ue8m0 = SGL_NORMAL_MODES[mode]
        self.deepep_output_dtype = "fp8" if use_fp8 else "bf16"
        self.params_bytes = 1 if use_fp8 else 2  # set_deepep_dispatcher_dtype
        self.async_finish = async_finish
        self.handle: Any = None
        self.src2dst = None
        self.stage = "initial"

    def _get_buffer(self) -> Any:
        self.deepep_buffer.set_dispatch_mode_as_normal()
        return self._shared_buffer()

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: TopKOutput) -> None:
        self._update_stage("initial", "after_dispatch_a")
        topk_weights, topk_ids = topk_output.topk_weights, topk_output.topk_ids
        topk_ids = topk_ids.to(torch.int64)
        if self.deepgemm and self.deepep_output_dtype != "bf16":  # (and a MoE runner other than cutlass)
            ue8m0 = self.scale_ue8m0
            hidden_states = sglang_per_token_group_quant_fp8(hidden_states, 128, column_major_scales=ue8m0,
                                                             scale_tma_aligned=ue8m0, scale_ue8m0=ue8m0)
        previous_event = deep_ep.Buffer.capture() if self.async_finish else None
        self._dispatch_state = (hidden_states, topk_ids, topk_weights, previous_event)

    def dispatch_b(self) -> DeepEPNormalDispatchOutput:
        self._update_stage("after_dispatch_a", "after_dispatch_b")
        hidden_states, topk_ids, topk_weights, previous_event = self._dispatch_state
        del self._dispatch_state
        hidden_states, topk_ids, topk_weights, num_recv_tokens_per_expert, event = self._dispatch_core(
            hidden_states, topk_ids, topk_weights, previous_event)
        event.current_stream_wait() if self.async_finish else ()
        if isinstance(hidden_states, tuple):
            hidden_states, hidden_states_scale = hidden_states
        else:
            hidden_states_scale = None
        return DeepEPNormalDispatchOutput(hidden_states, hidden_states_scale, topk_ids, topk_weights,
                                          num_recv_tokens_per_expert)

    def _dispatch_core(self, x: Any, topk_ids: torch.Tensor, topk_weights: torch.Tensor, previous_event: Any
                       ) -> tuple:
        buffer = self._get_buffer()
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
            buffer.get_dispatch_layout(topk_ids, self.num_experts, previous_event=previous_event,
                                       async_finish=self.async_finish,
                                       allocate_on_comm_stream=previous_event is not None)
        recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, self.handle, event = buffer.dispatch(
            x, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event,
            async_finish=self.async_finish, allocate_on_comm_stream=(previous_event is not None) and self.async_finish,
            expert_alignment=128 if self.deepgemm else 1, config=self.deepep_buffer.config.normal_dispatch_config)
        return recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, event

    def combine_a(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._update_stage("after_dispatch_b", "after_combine_a")
        output = hidden_states  # DeepGEMM or aiter (the Triton runner raises NotImplementedError here)
        previous_event = deep_ep.Buffer.capture() if self.async_finish else None
        self._combine_state = (output, previous_event)

    def combine_b(self) -> torch.Tensor:
        self._update_stage("after_combine_a", "initial")
        output, previous_event = self._combine_state
        del self._combine_state
        hidden_states, event = self._combine_core(output, previous_event)
        event.current_stream_wait() if self.async_finish else ()
        self.handle = None
        self.src2dst = None
        return hidden_states

    def _combine_core(self, x: torch.Tensor, previous_event: Any) -> tuple[torch.Tensor, Any]:
        buffer = self._get_buffer()
        combined_x, _, event = buffer.combine(x, self.handle, async_finish=self.async_finish,
                                              previous_event=previous_event,
                                              allocate_on_comm_stream=previous_event is not None,
                                              config=self.deepep_buffer.config.normal_combine_config)
        return combined_x, event


def sglang_normal_experts(out: DeepEPNormalDispatchOutput, factors: torch.Tensor, expert_alignment: int
                          ) -> torch.Tensor:
    """DeepEPMoE's normal-mode experts, reduced to their layout (forward_deepgemm_contiguous: ep_scatter, DeepGEMM's
    grouped GEMM over the contiguous layout, ep_gather). The received rows are scattered expert after expert into
    segments of num_recv_tokens_per_expert[e] rows, each a multiple of the alignment that must hold the expert's
    rows; every segment row is scaled by its expert's factor in float32 and rounded to bf16; each received row
    then gathers the float32 sum over its local top-k slots of weight * output, rounded to bf16: [N, H]."""
    ids, weights, counts = out.topk_ids, out.topk_weights, out.num_recv_tokens_per_expert
    hidden = out.hidden_states.shape[1]
    rows = dequant_rows(out.hidden_states, out.hidden_states_scale)
    assert len(counts) == factors.numel(), counts
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    dev = rows.device
    layout = torch.zeros(starts[-1], hidden, device=dev)
    layout_factor = torch.zeros(starts[-1], device=dev)  # padding rows: factor 0 (and never gathered)
    slot_row = torch.full(ids.shape, -1, dtype=torch.int64, device=dev)  # the layout row of each (row, top-k slot)
    for e, count in enumerate(counts):
        mine = (ids == e).nonzero()  # (received row, slot), by row
        assert count % expert_alignment == 0 and mine.shape[0] <= count < mine.shape[0] + expert_alignment, \
            f"num_recv_tokens_per_expert[{e}] = {count} for {mine.shape[0]} rows, alignment {expert_alignment}"
        at = starts[e] + torch.arange(mine.shape[0], device=dev)
        layout[at] = rows[mine[:, 0]]
        layout_factor[at] = factors[e]
        slot_row[mine[:, 0], mine[:, 1]] = at
    y = (layout * layout_factor[:, None]).to(torch.bfloat16)
    gathered = y[slot_row.clamp(min=0)].float() if y.shape[0] else torch.zeros(*ids.shape, hidden, device=dev)
    w = torch.where(slot_row >= 0, weights, 0.0)
    return (gathered * w[:, :, None]).sum(dim=1).to(torch.bfloat16)


def sglang_sent(tokens: Tokens, mode: str) -> Any:
    """A rank's x as the normal dispatcher hands it to dispatch."""
    use_fp8, deepgemm, ue8m0 = SGL_NORMAL_MODES[mode]
    if not (use_fp8 and deepgemm):
        return tokens.x
    return sglang_per_token_group_quant_fp8(tokens.x, 128, ue8m0, ue8m0, ue8m0)


def sglang_cast(mode: str) -> str:
    """The dense oracle's mode of a normal-mode configuration (the cast the experts see)."""
    use_fp8, deepgemm, ue8m0 = SGL_NORMAL_MODES[mode]
    return ("ue8m0" if ue8m0 else "fp8") if use_fp8 and deepgemm else "bf16"


def sglang_prefill(seed: int, world: int, tag: tuple, li: int) -> tuple[list[int], list[Tokens]]:
    """Tokens per rank and every rank's tokens of one prefill (extend) batch at MoE layer `li`; 0 is an idle
    DP rank."""
    counts = draw_counts(seed, ("sglang-prefill", *tag), world, 0, SGL_PREFILL_MAX)
    return counts, draw(seed, ("sglang-prefill", *tag, li), counts, SGL_NORMAL_H, SGL_E, SGL_K)


def sglang_moe(dispatcher: Any, tokens: Tokens, factors: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """One MoE layer's deep_ep part (DeepEPMoE.forward: dispatch, the experts the dispatch output's format picks,
    combine); returns the combined tokens and the dispatch output."""
    dispatcher.dispatch_a(tokens.x, TopKOutput(tokens.w, tokens.idx.to(torch.int32)))  # select_experts: int32 ids
    out = dispatcher.dispatch_b()
    if isinstance(out, DeepEPNormalDispatchOutput):
        normal = dispatcher._get_impl() if isinstance(dispatcher, SglangDeepEPDispatcher) else dispatcher
        y = sglang_normal_experts(out, factors, 128 if normal.deepgemm else 1)
    else:  # DeepEPLLDispatchOutput: DeepGEMM's masked grouped GEMM over [E_l, R*T, H]
        y = expert_outputs(out.hidden_states if out.hidden_states_scale is None else
                           (out.hidden_states, out.hidden_states_scale), factors)
    dispatcher.combine_a(y, out.topk_ids, out.topk_weights)
    return dispatcher.combine_b(), out


def traced_factory(log: list[tuple], made: list[tuple], device: str = "cpu") -> Callable[..., TracedBuffer]:
    """deep_ep.Buffer as the engines make it on `device`'s ranks (engine_buffer), each call's arguments recorded,
    the Buffer traced."""
    def make(*args: Any, **kwargs: Any) -> TracedBuffer:
        made.append((args, kwargs))
        return TracedBuffer(engine_buffer(device)(*args, **kwargs), log, lambda: None)

    return make


NORMAL_LOG = [(None, "layout", None), (None, "normal dispatch", None), (None, "normal combine", None)]


def rank_sglang_normal(rank: int, world: int, seed: int, mode: str, async_finish: bool, config_str: str | None,
                       device: str = "cpu") -> dict[tuple, np.ndarray]:
    """SGLang with `--moe-a2a-backend deepep --deepep-mode normal`: the Buffer made at the first dispatch with
    the normal-mode size hints, then prefill batches over the layers. Each dispatch is checked here; the MoE
    outputs go back to the test, which checks them against the dense oracle."""
    dev = setup_device(rank, device)
    group = sglang_group(world, device)
    log: list[tuple] = []
    made: list[tuple] = []
    config = DeepEPConfig(config_str)
    deepep_buffer = DeepEPBuffer(config, traced_factory(log, made, device))
    dispatchers = [SglangNormalDispatcher(deepep_buffer, group, SGL_E, SGL_NORMAL_H, SGL_T, mode, async_finish)
                   for _ in range(SGL_LAYERS)]
    factors = expert_factors(local_experts(rank, SGL_E // world), dev)
    alignment = 128 if SGL_NORMAL_MODES[mode][1] else 1
    outputs: dict[tuple, np.ndarray] = {}
    for step in range(3):
        for li, d in enumerate(dispatchers):
            counts, every = sglang_prefill(seed, world, ("normal", step), li)
            log.clear()
            out, dispatched = sglang_moe(d, on_device(as_made(every[rank]), dev), factors)
            at = label(seed, rank, mode, f"async_finish={async_finish} step {step} layer {li} counts {counts}")
            assert log == NORMAL_LOG, log
            assert d.handle is None and d.stage == "initial", at
            recv_x = dispatched.hidden_states.cpu() if dispatched.hidden_states_scale is None else \
                (dispatched.hidden_states.cpu(), dispatched.hidden_states_scale.cpu())
            check_normal_dispatch(recv_x, dispatched.topk_ids.cpu(), dispatched.topk_weights.cpu(),
                                  dispatched.num_recv_tokens_per_expert, [sglang_sent(t, mode) for t in every],
                                  every, rank, SGL_E, alignment, at)
            deepep_buffer._buffer.dispatched.clear()
            outputs[(step, li)] = for_parent(out)

    assert deepep_buffer.made == 1 and len(made) == 1
    hidden_bytes = SGL_NORMAL_H * dispatchers[0].params_bytes
    configs = (config.normal_dispatch_config or deep_ep.Buffer.get_dispatch_config(world),
               config.normal_combine_config or deep_ep.Buffer.get_combine_config(world))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in configs)
    assert made[0] == ((group, nvl, 0), dict(low_latency_mode=False, num_qps_per_rank=config.num_sms,
                                              allow_mnnvl=True)), made
    buffer = deepep_buffer._buffer
    assert (buffer.low_latency_mode, buffer.num_nvl_bytes, buffer.num_rdma_bytes) == (False, nvl, 0)
    assert buffer.backend_name == ("cuda" if dev.type == "cuda" else "reference")
    return outputs


def check_sglang_normal_outputs(results: list[dict[tuple, np.ndarray]], world: int, seed: int, mode: str) -> None:
    for rank, outputs in enumerate(results):
        assert len(outputs) == 3 * SGL_LAYERS, sorted(outputs)
        for (step, li), out in outputs.items():
            tokens = sglang_prefill(seed, world, ("normal", step), li)[1][rank]
            check_dense(out, tokens, sglang_cast(mode), label(seed, rank, mode, f"step {step} layer {li}"))


class SglangDeepEPDispatcher:
    """deepep.py@003a81bf `DeepEPDispatcher` with both inner dispatchers (--deepep-mode auto): every call goes to
    the one `_get_impl` resolves for the batch, normal dispatch when some rank's batch has extend (prefill)
    tokens (get_is_extend_in_batch, the same on every rank), low-latency dispatch otherwise."""

    def __init__(self, normal: SglangNormalDispatcher, low_latency: SglangLLDispatcher,
                 is_extend_in_batch: Callable[[], bool]) -> None:
        self.deepep_mode = DeepEPMode("auto")
        self._normal_dispatcher, self._low_latency_dispatcher = normal, low_latency
        self.is_extend_in_batch = is_extend_in_batch

    def _get_impl(self) -> Any:
        resolved = self.deepep_mode.resolve(self.is_extend_in_batch())
        return self._normal_dispatcher if resolved.value == "normal" else self._low_latency_dispatcher

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: TopKOutput) -> None:
        self._get_impl().dispatch_a(hidden_states, topk_output)

    def dispatch_b(self) -> Any:
        return self._get_impl().dispatch_b()

    def combine_a(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._get_impl().combine_a(hidden_states, topk_ids, topk_weights)

    def combine_b(self) -> torch.Tensor:
        return self._get_impl().combine_b()


SGL_AUTO_STEPS = ("prefill", "decode", "decode", "prefill", "decode")
LL_LOG = [(None, "dispatch", None), (None, "dispatch hook", None), (None, "combine", None),
          (None, "combine hook", None)]


def sglang_auto_step(seed: int, world: int, step: int, li: int) -> tuple[list[int], list[Tokens]]:
    if SGL_AUTO_STEPS[step] == "prefill":
        return sglang_prefill(seed, world, ("auto", step), li)
    counts = draw_counts(seed, ("sglang-auto-decode", step), world, 0, SGL_MAX_BATCH)
    return counts, draw(seed, ("sglang-auto-decode", step, li), counts, SGL_NORMAL_H, SGL_E, SGL_K)


def rank_sglang_auto(rank: int, world: int, seed: int) -> dict[tuple, np.ndarray]:
    """SGLang with `--deepep-mode auto`: one Buffer for both modes, made at the first dispatch (a prefill, in normal
    mode); prefill batches dispatch in normal mode, decode batches in low-latency mode (FP8, with hooks), and
    the first low-latency dispatch after a normal one cleans the low-latency buffer (DeepEPBuffer.clean_buffer).
    Low-latency calls are checked exactly here, normal dispatches too; the MoE outputs go back to the test,
    which checks them against the dense oracle."""
    group = sglang_group(world, "cpu")
    log: list[tuple] = []
    made: list[tuple] = []
    deepep_buffer = DeepEPBuffer(DeepEPConfig(None), traced_factory(log, made))
    extend = [False]  # get_is_extend_in_batch()
    layers = [SglangDeepEPDispatcher(
        SglangNormalDispatcher(deepep_buffer, group, SGL_E, SGL_NORMAL_H, SGL_T, "fp8", async_finish=True,
                               deepep_mode="auto"),
        SglangLLDispatcher(deepep_buffer, group, SGL_E, SGL_NORMAL_H, SGL_T, use_fp8=True, blackwell_deepgemm=False,
                           return_recv_hook=True, deepep_mode="auto"),
        lambda: extend[0]) for _ in range(SGL_LAYERS)]
    factors = expert_factors(local_experts(rank, SGL_E // world), "cpu")
    outputs: dict[tuple, np.ndarray] = {}
    previous = None
    for step, kind in enumerate(SGL_AUTO_STEPS):
        extend[0] = kind == "prefill"
        log.clear()
        for li, d in enumerate(layers):
            counts, every = sglang_auto_step(seed, world, step, li)
            out, dispatched = sglang_moe(d, as_made(every[rank]), factors)
            at = label(seed, rank, f"auto step {step} ({kind}) layer {li} counts {counts}")
            if kind == "prefill":
                check_normal_dispatch((dispatched.hidden_states, dispatched.hidden_states_scale), dispatched.topk_ids,
                                      dispatched.topk_weights, dispatched.num_recv_tokens_per_expert,
                                      [sglang_sent(t, "fp8") for t in every], every, rank, SGL_E, 128, at)
                deepep_buffer._buffer.dispatched.clear()
            else:
                assert isinstance(dispatched, DeepEPLLDispatchOutput), at
                check_dispatch((dispatched.hidden_states, dispatched.hidden_states_scale), dispatched.masked_m, every,
                               rank, SGL_T, SGL_E, "fp8", at)
                check_combine(out, every[rank], "fp8", at)
            outputs[(step, li)] = for_parent(out)
        if kind == "prefill":
            want = NORMAL_LOG * SGL_LAYERS
        else:  # the first layer's dispatch_a after a prefill: set_dispatch_mode_as_low_latency cleans
            want = ([(None, "clean", None)] if previous == "prefill" else []) + LL_LOG * SGL_LAYERS
        assert log == want, (step, kind, log)
        previous = kind

    assert deepep_buffer.made == 1 and len(made) == 1, made
    hidden_bytes = SGL_NORMAL_H * 1  # the normal dispatcher's params_bytes (FP8) made it
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in (deep_ep.Buffer.get_dispatch_config(world),
                                                                        deep_ep.Buffer.get_combine_config(world)))
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(SGL_T, SGL_NORMAL_H, world, SGL_E)
    assert made[0] == ((group, nvl, rdma), dict(low_latency_mode=True, num_qps_per_rank=max(20, SGL_E // world),
                                                 allow_mnnvl=True)), made
    buffer = deepep_buffer._buffer
    assert (buffer.low_latency_mode, buffer.num_nvl_bytes, buffer.num_rdma_bytes) == (True, nvl, rdma)
    return outputs


def check_sglang_auto_outputs(results: list[dict[tuple, np.ndarray]], world: int, seed: int) -> None:
    for rank, outputs in enumerate(results):
        assert len(outputs) == len(SGL_AUTO_STEPS) * SGL_LAYERS, sorted(outputs)
        for (step, li), out in outputs.items():
            tokens = sglang_auto_step(seed, world, step, li)[1][rank]
            check_dense(out, tokens, "fp8", label(seed, rank, f"auto step {step} ({SGL_AUTO_STEPS[step]}) layer {li}"))


# ==================================================================================== the module itself
def test_import_surface() -> None:
    """What vLLM (import_utils.has_deep_ep: a trial import; deepep_ht.py's signature annotations, evaluated at
    import) and SGLang (`from deep_ep import Buffer, Config`) need, and what DeepEP v1 exports."""
    assert importlib.util.find_spec("deep_ep") is not None
    module = importlib.import_module("deep_ep")
    from deep_ep import Buffer, Config, EventOverlap, topk_idx_t  # DeepEP v1's __all__

    assert Buffer is ep_layer.Buffer and Config is ep_layer.config.Config and EventOverlap is ep_layer.EventOverlap
    assert topk_idx_t is torch.int64
    assert not hasattr(module, "ElasticBuffer"), "vLLM would take the DeepEP v2 path (has_deep_ep_v2)"
    assert deep_ep.Config | None is not None and deep_ep.Buffer is not None  # deepep_ht.py's annotations
    assert module.BACKEND == "ep_layer"
    assert module.__version__ == f"{ep_layer.__version__}+ep.layer"
    assert set(module.__all__) >= {"Buffer", "Config", "EventOverlap", "topk_idx_t", "BACKEND"}
    assert all(hasattr(module, name) for name in module.__all__)
    assert Buffer.num_sms == 20 and callable(Buffer.get_low_latency_rdma_size_hint)


def test_distribution_version_is_ep_layers() -> None:
    """dropin/pyproject.toml: named ep-layer-deep-ep, ep-layer's version, depending on ep-layer alone."""
    def field(path: Path, name: str) -> str:
        match = re.search(rf"^{name} = (.+)$", path.read_text(), re.M)
        assert match is not None, f"{path}: no {name}"
        return match.group(1)

    dropin = ROOT / "dropin" / "pyproject.toml"
    assert field(dropin, "name") == '"ep-layer-deep-ep"'
    assert field(dropin, "version") == field(ROOT / "pyproject.toml", "version") == f'"{ep_layer.__version__}"'
    assert field(dropin, "dependencies") == '["ep-layer"]'


def _fake_deep_ep(tmp_path: Path, kind: str) -> Path:
    """A directory that makes a real DeepEP look installed: its v1 extension module, or its distribution."""
    if kind == "extension":
        (tmp_path / "deep_ep_cpp.py").write_text("raise ImportError('a stand-in: never imported')\n")
    else:
        info = tmp_path / "deep_ep-1.2.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deep_ep\nVersion: 1.2.1\n")
    return tmp_path


@pytest.fixture
def reload_deep_ep() -> Any:
    """Re-runs deep_ep's import; the module is reloaded once more afterwards (with sys.path restored)."""
    yield lambda: importlib.reload(deep_ep)
    importlib.invalidate_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.reload(deep_ep)


@pytest.mark.parametrize("kind", ["extension", "distribution"])
def test_warns_when_a_real_deep_ep_is_installed(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               reload_deep_ep: Callable[[], Any]) -> None:
    monkeypatch.syspath_prepend(str(_fake_deep_ep(tmp_path, kind)))
    importlib.invalidate_caches()
    with pytest.warns(RuntimeWarning) as caught:
        module = reload_deep_ep()
    message = str(caught[0].message)
    assert "ep-layer" in message and "real DeepEP" in message, message
    assert ("deep_ep_cpp" if kind == "extension" else "deep_ep 1.2.1") in message, message
    assert "pip uninstall deep_ep" in message and "pip uninstall ep-layer-deep-ep" in message, message
    assert module.Buffer is ep_layer.Buffer  # still ep-layer's


def test_no_warning_without_a_real_deep_ep(reload_deep_ep: Callable[[], Any]) -> None:
    if deep_ep.real_deep_ep():
        pytest.skip(f"a real DeepEP is installed here: {deep_ep.real_deep_ep()}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reload_deep_ep()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]


def _run_main(extra_path: Path | None = None) -> subprocess.CompletedProcess:
    paths = [str(p) for p in (extra_path, Path(deep_ep.__file__).parent.parent, ROOT) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "deep_ep"], capture_output=True, text=True, env=env, timeout=120)


def test_main_reports_which_deep_ep_this_is() -> None:
    run = _run_main()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 4, run.stdout
    assert "ep-layer's drop-in" in lines[0] and deep_ep.__version__ in lines[0], lines
    assert f"ep_layer {ep_layer.__version__}" in lines[1], lines
    assert f'backend "auto" resolves to: {resolve_backend("auto")}' in lines[2], lines
    want = "no" if not deep_ep.real_deep_ep() else "distribution"
    assert lines[3].startswith("real DeepEP also installed: ") and want in lines[3], lines


def test_main_names_a_real_deep_ep(tmp_path: Path) -> None:
    run = _run_main(_fake_deep_ep(tmp_path, "extension"))
    assert run.returncode == 0, run.stderr
    assert "real DeepEP also installed: module deep_ep_cpp" in run.stdout, run.stdout
    assert "RuntimeWarning" in run.stderr, run.stderr


# ==================================================================================== what is refused
def test_normal_mode_buffers_and_what_a_buffer_without_nvl_bytes_refuses() -> None:
    """vLLM's deepep_high_throughput Buffer (all2all.py DeepEPHTAll2AllManager's kwargs: no low-latency buffer)
    is built on the backend `auto` picks, and on the cuda backend where there is a GPU (its low-latency calls
    then raise, naming low_latency_mode). A Buffer made without num_nvl_bytes (SGLang's and vLLM's low-latency
    test helper's) refuses the normal-mode calls, naming it."""
    ht_kwargs = dict(num_nvl_bytes=1 << 30, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1,
                     explicitly_destroy=True)
    buf = deep_ep.Buffer(None, **ht_kwargs)
    assert (buf.backend_name, buf.low_latency_mode, buf.num_nvl_bytes) == (resolve_backend("auto"), False, 1 << 30)
    buf.destroy()
    if torch.cuda.is_available():
        buf = deep_ep.Buffer(None, **ht_kwargs, backend="cuda")
        with pytest.raises(RuntimeError, match=r"^low_latency_dispatch: this Buffer was made with low_latency_mode"):
            buf.low_latency_dispatch(torch.zeros(1, 128, dtype=torch.bfloat16, device="cuda"),
                                     torch.zeros(1, 1, dtype=torch.int64, device="cuda"), 1, 8, use_fp8=False)
        buf.destroy()
    else:  # a cuda Buffer needs the GPU first
        ll_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 2048, 1, 8)
        for low_latency_mode, rdma in ((False, 0), (True, ll_bytes)):
            with pytest.raises(ValueError, match=r"^backend: 'cuda' needs a CUDA GPU, and torch sees none$"):
                deep_ep.Buffer(None, num_nvl_bytes=1 << 30, num_rdma_bytes=rdma, low_latency_mode=low_latency_mode,
                               backend="cuda")

    topk_idx = torch.tensor([[0, 3], [1, -1]])
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    for low_latency_mode in (True, False):
        buf = deep_ep.Buffer(None, low_latency_mode=low_latency_mode, backend="reference")  # num_nvl_bytes=0
        for op, kwargs in (("get_dispatch_layout", dict(topk_idx=topk_idx, num_experts=8, previous_event=None,
                                                        async_finish=False, allocate_on_comm_stream=False)),
                           ("dispatch", dict(x=x, handle=None, topk_idx=topk_idx)),
                           ("combine", dict(x=x, handle=None))):
            with pytest.raises(RuntimeError, match=rf"^{op}: this Buffer has no normal-mode buffer "
                                                   r"\(num_nvl_bytes=0\); make it with num_nvl_bytes >= "
                                                   r"Config.get_nvl_buffer_size_hint"):
                getattr(buf, op)(**kwargs)
        buf.destroy()
    buf = deep_ep.Buffer(None, num_nvl_bytes=1 << 20, low_latency_mode=False, backend="reference")
    with pytest.raises(RuntimeError, match=r"^low_latency_dispatch: this Buffer was made with low_latency_mode=False"):
        buf.low_latency_dispatch(x, topk_idx, 8, 8, use_fp8=False)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, 8)
    recv_x, _, _, counts, _, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=topk_idx)  # with num_nvl_bytes, normal mode runs
    assert torch.equal(recv_x, x) and counts == [1, 1, 0, 1, 0, 0, 0, 0]
    buf.destroy()


def test_fork_only_and_unknown_arguments_are_refused() -> None:
    """vLLM's NVFP4 dispatch (VLLM_DEEPEPLL_NVFP4_DISPATCH=1) passes keywords that only DeepEP forks know (refused
    by name); SGLang's single-batch-overlap combine (Hopper form) is served (tests/test_combine_overlap.py); a
    misspelt keyword is a TypeError."""
    buf = deep_ep.Buffer(None, low_latency_mode=True, backend="reference")
    x, idx = torch.ones(2, 2048, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, -1]])
    with pytest.raises(NotImplementedError, match=r"use_nvfp4, x_global_scale exist only in forks of DeepEP"):
        buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False, round_scale=False, use_ue8m0=False, use_nvfp4=True,
                                 x_global_scale=torch.ones(1), async_finish=False, return_recv_hook=True)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
    _, _, hook = buf.low_latency_combine(x=recv_x, topk_idx=idx, topk_weights=torch.ones(2, 2), handle=handle,
                                         async_finish=False, return_recv_hook=True, overlap=True,
                                         packed_recv_count=recv_count, comp_signal=torch.ones(4, dtype=torch.int32),
                                         block_m=64, threshold=1, num_sms=3)
    hook()
    with pytest.raises(TypeError, match="use_fp9"):
        buf.low_latency_dispatch(x, idx, 8, 4, use_fp9=True)
    with pytest.raises(TypeError, match="zero_cpy"):
        buf.low_latency_combine(recv_x, idx, torch.ones(2, 2), handle, zero_cpy=True)
    out, _, _ = buf.low_latency_combine(recv_x, idx, torch.ones(2, 2), handle)  # the refusals left it usable
    assert torch.equal(out, x * torch.tensor([[2.0], [1.0]], dtype=torch.bfloat16))
    # DeepEP V1's use_fabric (fabric memory handles, which SGLang asks for on MNNVL hardware): False is what
    # this Buffer does, True is refused by name.
    deep_ep.Buffer(None, low_latency_mode=True, use_fabric=False, backend="reference").destroy()
    with pytest.raises(NotImplementedError, match="use_fabric"):
        deep_ep.Buffer(None, low_latency_mode=True, use_fabric=True)
    buf.destroy()


def test_sglang_config_and_auto_mode_sizing() -> None:
    """deepep.py@003a81bf: `--deepep-config` JSON into Config(**dict) with DeepEP's keyword names; normal and auto
    mode size the Buffer by the larger of the two Configs' NVLink hints (no RDMA buffer inside one node), auto
    and low-latency mode by the low-latency hint as well. Past one node (8 ranks) the sizing is refused."""
    config = {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 16, "num_max_nvl_chunked_recv_tokens": 512,
              "num_max_rdma_chunked_send_tokens": 8, "num_max_rdma_chunked_recv_tokens": 128}
    combine = {**config, "num_max_nvl_chunked_send_tokens": 4}
    parsed = DeepEPConfig(json.dumps({"normal_dispatch": config, "normal_combine": combine}))
    assert isinstance(parsed.normal_dispatch_config, deep_ep.Config) and parsed.num_sms == 24
    assert {k: getattr(parsed.normal_dispatch_config, k) for k in config} == config
    assert parsed.normal_combine_config.num_max_nvl_chunked_send_tokens == 4
    assert DeepEPConfig(None).num_sms == deep_ep.Buffer.num_sms == 20

    class TpGroup:  # get_deepep_buffer reads only the group's size
        def __init__(self, size: int) -> None:
            self._size = size

        def size(self) -> int:
            return self._size

    made: list[tuple] = []

    def record(*args: Any, **kwargs: Any) -> object:  # deep_ep.Buffer's arguments
        made.append((args, kwargs))
        return object()

    group, hidden, param_bytes, num_experts = TpGroup(8), 7168, 1, 256
    ll = deep_ep.Buffer.get_low_latency_rdma_size_hint(SGL_T, hidden, 8, num_experts)
    largest = {}
    for config_str in (None, json.dumps({"normal_dispatch": config, "normal_combine": combine})):
        deepep_config = DeepEPConfig(config_str)
        configs = (deepep_config.normal_dispatch_config or deep_ep.Buffer.get_dispatch_config(8),
                   deepep_config.normal_combine_config or deep_ep.Buffer.get_combine_config(8))
        nvl = [c.get_nvl_buffer_size_hint(hidden * param_bytes, 8) for c in configs]
        assert all(type(n) is int and n > 0 for n in nvl), nvl
        assert [c.get_rdma_buffer_size_hint(hidden * param_bytes, 8) for c in configs] == [0, 0]
        largest[config_str is not None] = max(nvl)
        for mode in ("normal", "auto", "low_latency"):
            made.clear()
            deepep_buffer = DeepEPBuffer(deepep_config, record)
            deepep_buffer.get_deepep_buffer(group, hidden, param_bytes, DeepEPMode(mode), SGL_T, num_experts)
            normal, low_latency = DeepEPMode(mode).enable_normal(), DeepEPMode(mode).enable_low_latency()
            qps = {"normal": deepep_config.num_sms, "low_latency": num_experts // 8,
                   "auto": max(deepep_config.num_sms, num_experts // 8)}[mode]
            assert made == [((group, max(nvl) if normal else 0, ll if low_latency else 0),
                             dict(low_latency_mode=low_latency, num_qps_per_rank=qps, allow_mnnvl=True))], (mode, made)
            assert deepep_buffer.made == 1
    assert largest[True] > largest[False]  # the JSON's 512 NVLink receive tokens per channel, against DeepEP's 256

    # Two nodes of 8 (16 ranks): SGLang's normal-mode sizing runs into the one-node limit. (The NVLink hint is
    # asked first and refuses 16 as an argument; the RDMA hint would say that normal mode across nodes is not
    # implemented.)
    for mode in ("normal", "auto"):
        with pytest.raises((ValueError, NotImplementedError), match=r"num_ranks.*<= 8.*16|16 ranks > 8"):
            DeepEPBuffer(DeepEPConfig(None), record).get_deepep_buffer(TpGroup(16), hidden, param_bytes,
                                                                       DeepEPMode(mode), SGL_T, num_experts)
    with pytest.raises(NotImplementedError, match=r"normal mode across nodes \(16 ranks > 8\) is not implemented"):
        deep_ep.Buffer.get_dispatch_config(16).get_rdma_buffer_size_hint(hidden, 16)


def test_normal_mode_takes_inputs_that_pytorch_counts_contiguous() -> None:
    """Inputs whose strides PyTorch ignores when it calls a tensor contiguous: an idle rank's empty batch of
    any strides (numpy hands an empty array strides of 0), and a size-1 last dimension of any stride (SGLang's
    UE8M0 scales for DeepGEMM are column-major, [T, H/512] with strides (1, T rounded up to 4): at hidden 512 that
    is [T, 1] of stride 4). One rank's dispatch must hand the rows back as sent, and combine must take them.
    Fails today: backends/reference_normal.py `_byte_rows` calls `t.contiguous().view(torch.uint8)`;
    `contiguous()` returns such a tensor unchanged, and `view` raises "self.stride(-1) must be 1 to view ... as
    Byte" (among several ranks the failing one raises before its header goes out, so its peers wait out
    timeout_s)."""
    buf = deep_ep.Buffer(None, num_nvl_bytes=1 << 20, low_latency_mode=False, backend="reference")
    empty_x = torch.from_numpy(np.zeros((0, 512), np.float32)).to(torch.bfloat16)
    _, empty_scales = fp8_cast(torch.zeros(0, 512, dtype=torch.bfloat16), "fp8")
    tokens = as_made(draw(0, ("strides",), [3], 512, 8, 2)[0])
    ue8m0 = sglang_per_token_group_quant_fp8(tokens.x, 128, True, True, True)
    no_tokens = torch.zeros(0, 2, dtype=torch.int64)
    cases = {"empty bf16 x of strides (0, 0)": (empty_x, no_tokens),
             "empty FP8 scales of strides (0, 0)": ((torch.zeros(0, 512, dtype=torch.float8_e4m3fn),
                                                     torch.from_numpy(empty_scales)), no_tokens),
             "UE8M0 scales [3, 1] of strides (1, 4)": (ue8m0, tokens.idx)}
    assert empty_x.stride() == (0, 0) and empty_x.is_contiguous()
    assert ue8m0[1].shape == (3, 1) and ue8m0[1].stride() == (1, 4) and ue8m0[1].is_contiguous()
    failures = []
    for name, (x, topk_idx) in cases.items():
        try:
            per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, 8)
            recv_x, _, _, _, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx)
            sent = x if isinstance(x, tuple) else (x,)
            got = recv_x if isinstance(recv_x, tuple) else (recv_x,)
            picked = (topk_idx >= 0).any(dim=1)
            assert all(torch.equal(g.view(torch.uint8), c[picked].contiguous().view(torch.uint8))
                       for g, c in zip(got, sent)), name
            combined, _, _ = buf.combine(empty_x if not picked.any() else torch.zeros(int(picked.sum()), 512,
                                                                                      dtype=torch.bfloat16), handle)
            assert combined.shape == (topk_idx.shape[0], 512), name
        except RuntimeError as e:
            failures.append(f"{name}: {e}")
    buf.destroy()
    assert not failures, failures


# ==================================================================================== the replays
@pytest.mark.parametrize("world,mode", [(2, "bf16"), (2, "fp8"), (2, "ue8m0"), (4, "fp8")])
def test_vllm_deepep_low_latency(world: int, mode: str, seed: int) -> None:
    run_ranks(rank_vllm, world, seed, mode, "cpu", timeout_s=240)


def test_vllm_test_helper_form(seed: int) -> None:
    run_ranks(rank_vllm_test_helper, 2, seed, "cpu", timeout_s=120)


def test_vllm_fault_tolerance_calls(seed: int) -> None:
    run_ranks(rank_vllm_fault_tolerance, 2, seed, timeout_s=120)


@pytest.mark.parametrize("world,mode,return_recv_hook", [(2, "fp8", True), (2, "bf16", True), (2, "ue8m0", True),
                                                         (2, "fp8", False), (4, "fp8", True)])
def test_sglang_deepep_low_latency(world: int, mode: str, return_recv_hook: bool, seed: int) -> None:
    run_ranks(rank_sglang, world, seed, mode, return_recv_hook, "cpu", timeout_s=240)


@gpu
@pytest.mark.parametrize("world,mode", [(2, "fp8"), (4, "bf16")])
def test_vllm_deepep_high_throughput_cuda(world: int, mode: str, seed: int) -> None:
    """`deepep_high_throughput` on the cuda backend: processes on one GPU (through CUDA IPC), plain and DBO steps."""
    check_vllm_ht_outputs(run_ranks(rank_vllm_ht, world, seed, mode, "cuda", timeout_s=300), world, seed, mode)


@pytest.mark.parametrize("world,mode,async_finish,deepep_config", [
    (2, "fp8", True, None), (2, "ue8m0", False, None), (2, "bf16-aiter", False, None), (4, "bf16", True, "json")])
def test_sglang_deepep_normal(world: int, mode: str, async_finish: bool, deepep_config: str | None,
                              seed: int) -> None:
    config_str = None if deepep_config is None else json.dumps({"normal_dispatch": SGL_DEEPEP_CONFIG,
                                                               "normal_combine": SGL_DEEPEP_CONFIG})
    results = run_ranks(rank_sglang_normal, world, seed, mode, async_finish, config_str, timeout_s=240)
    check_sglang_normal_outputs(results, world, seed, mode)


@gpu
@pytest.mark.parametrize("world,mode,async_finish", [(2, "fp8", True), (2, "ue8m0", False), (4, "bf16", True)])
def test_sglang_deepep_normal_cuda(world: int, mode: str, async_finish: bool, seed: int) -> None:
    """SGLang's normal mode on the cuda backend: processes on one GPU (through CUDA IPC), the Buffer SGLang's
    size hint makes, against the same oracles as on CPU ranks."""
    results = run_ranks(rank_sglang_normal, world, seed, mode, async_finish, None, "cuda", timeout_s=300)
    check_sglang_normal_outputs(results, world, seed, mode)


def test_sglang_deepep_auto_mode(seed: int) -> None:
    check_sglang_auto_outputs(run_ranks(rank_sglang_auto, 2, seed, timeout_s=240), 2, seed)


@gpu
@pytest.mark.parametrize("world,mode", [(2, "fp8"), (2, "ue8m0"), (4, "bf16")])
def test_vllm_deepep_low_latency_cuda(world: int, mode: str, seed: int) -> None:
    run_ranks(rank_vllm, world, seed, mode, "cuda", timeout_s=300)


@gpu
def test_vllm_test_helper_form_cuda(seed: int) -> None:
    run_ranks(rank_vllm_test_helper, 2, seed, "cuda", timeout_s=180)


@gpu
@pytest.mark.parametrize("world,mode,return_recv_hook", [(2, "fp8", True), (2, "ue8m0", True), (2, "bf16", False),
                                                         (4, "fp8", True)])
def test_sglang_deepep_low_latency_cuda(world: int, mode: str, return_recv_hook: bool, seed: int) -> None:
    run_ranks(rank_sglang, world, seed, mode, return_recv_hook, "cuda", timeout_s=300)

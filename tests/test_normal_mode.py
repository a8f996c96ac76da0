"""DeepEP's normal (high-throughput) mode of `ep_layer.Buffer` with the reference backend on 1 to 4 gloo
CPU ranks, against an oracle written from docs/design.md section 2, "Normal (high-throughput) mode".

Every rank's inputs come from generators seeded by (seed, case tag, world size, rank), so each rank
rebuilds every other rank's inputs, and its oracle computes with plain Python loops and numpy what the
spec says it must get: the layout (is_token_in_rank, the per-rank and per-expert counts), the rows it
receives ordered by (source rank, token) with their bytes, local top-k ids and weights, the per-expert
counts rounded up to `expert_alignment`, the handle, and each combined token as a float32 sum over the
ranks in its is_token_in_rank row, in ascending rank, plus the biases, rounded once to bf16 (compared
bit for bit). Nothing here calls the library's own layout, transport or combine code.

The rank functions are top-level, as dist_harness.run_ranks needs. The argument checks run before any
communication, so most of them run on one rank in the pytest process (`Buffer(None)` without a process
group); device checks need a process group (it fixes the device) and run on two ranks that all make the
same mistake.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from dist_harness import run_ranks
from fp8_oracle import bf16_bits_to_f32, cast_to_fp8, f32_to_bf16_bits, random_bf16_bits

from ep_layer import Buffer, Config, EventOverlap, NormalHandle

NVL_BYTES = 1 << 22
HIDDENS = (16, 128, 256, 512)  # bf16 rows of 32 bytes up to 1 KiB; e4m3 rows of 16 bytes and more
ALIGNMENTS = (1, 4, 128)
FP8_SCALES = ("groups", "ue8m0", "token", "token_1", "column_major")
BF16_NAN = 0x7FC0
META = torch.device("meta")


# ==================================================================================== tensors and bits
def make_buffer(**kwargs: Any) -> Buffer:
    """A normal-mode Buffer on the default group (None: one rank without torch.distributed)."""
    return Buffer(None, num_nvl_bytes=NVL_BYTES, low_latency_mode=False, backend="reference", **kwargs)


def as_tensor(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh, ordinarily strided tensor with `a`'s bytes, viewed as `dtype` (same element size).
    (torch.from_numpy gives a 0-row array strides (0, 0): test_inputs_with_other_strides takes such
    inputs on purpose, the other tests ordinary ones.)"""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype is not None:
        t = t.view(dtype)
    return fresh(t)


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in a new tensor of ordinary (row-major) strides, whatever its size."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def bf16_tensor(bits: np.ndarray) -> torch.Tensor:
    return as_tensor(np.asarray(bits, dtype=np.uint16).view(np.int16), torch.bfloat16)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def normal_bf16_bits(rng: np.random.Generator, n: int, h: int) -> np.ndarray:
    """Ordinary bf16 rows (standard normal times a power of two per row), far from overflow."""
    rows = rng.standard_normal((n, h)) * np.exp2(rng.integers(-3, 4, (n, 1)))
    return f32_to_bf16_bits(rows.astype(np.float32))


def wide_bf16_bits(rng: np.random.Generator, n: int, h: int) -> np.ndarray:
    """bf16 values whose magnitudes differ by up to 2**24, so that float32 sums of a few of them round,
    and the order of the additions shows in the result (combine inputs and biases)."""
    values = rng.standard_normal((n, h)) * np.exp2(rng.integers(-12, 13, (n, h)))
    return f32_to_bf16_bits(values.astype(np.float32))


def row_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of each row of a tensor [N] or [N, ...] (any dtype, any strides) as uint8 [N, bytes]."""
    width = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
    return fresh(t).view(torch.uint8).numpy().reshape(t.shape[0], width)  # (contiguous() may keep strides)


def np_row_bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    width = int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize
    return a.view(np.uint8).reshape(a.shape[0], width)


def stack(rows: list[np.ndarray], like: np.ndarray) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, *like.shape[1:]), dtype=like.dtype)


def torch_of(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """numpy bits -> a tensor of `dtype` holding exactly those bytes."""
    a = np.ascontiguousarray(a)
    if dtype == torch.bfloat16:
        return bf16_tensor(a)
    if dtype == torch.float8_e4m3fn:
        return as_tensor(a.astype(np.uint8), torch.float8_e4m3fn)
    return as_tensor(a)


def names(name: str) -> str:
    """A regex for `name` as a whole word of an error message (so "x" does not match "x[1]" or "max")."""
    return rf"(?<![\w.\[]){re.escape(name)}(?![\w\[])"


# ==================================================================================== inputs and oracle
@dataclass(frozen=True)
class Setup:
    """What all ranks of one case share: sizes, tokens per rank, how many ids are -1."""

    seed: int
    tag: tuple[int, ...]
    world: int
    ts: tuple[int, ...]  # tokens per rank
    h: int
    k: int
    num_local: int
    drop: float  # probability of a -1 top-k entry
    busy: bool  # no -1 entries at all
    quiet: int  # a rank none of whose experts any token picks (it receives nothing); -1: none

    @property
    def e(self) -> int:
        return self.num_local * self.world

    def rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *self.tag, self.world, *stream])

    def msg(self, rank: int, what: str = "") -> str:
        return (f"seed={self.seed} case={self.tag} world={self.world} rank={rank} T={list(self.ts)} "
                f"H={self.h} K={self.k} E={self.e} {what}")


def make_setup(seed: int, tag: tuple[int, ...], world: int, *, h: int | None = None, k: int | None = None,
               num_local: int | None = None, ts: tuple[int, ...] | None = None, busy: bool = False,
               quiet: int = -1) -> Setup:
    rng = np.random.default_rng([seed, *tag, world, 0])
    h = h if h is not None else int(rng.choice(HIDDENS))
    k = k if k is not None else int(rng.integers(1, 9))
    num_local = num_local if num_local is not None else int(rng.integers(1, 4))
    num_local = max(num_local, -(-k // (world - (quiet >= 0))))  # room for K distinct experts per token
    if ts is None:
        ts = tuple(int(rng.integers(4, 13)) if busy else int(rng.choice([0, 1, 3, 7, 12])) for _ in range(world))
    drop = 0.0 if busy else float(rng.choice([0.0, 0.2, 0.5]))
    return Setup(seed, tuple(tag), world, tuple(ts), h, k, num_local, drop, busy, quiet)


class RankInputs:
    """One rank's dispatch inputs: bf16 rows in every regime (random_bf16_bits), K distinct expert ids
    per token (off the quiet rank), some -1, sometimes a token with all -1; weights of either sign."""

    def __init__(self, s: Setup, r: int) -> None:
        rng = s.rng(1, r)
        t = s.ts[r]
        if s.h % 128 == 0:
            self.x_bits = random_bf16_bits(rng, t, s.h)
        else:  # random_bf16_bits needs whole 128-channel groups: any finite bit pattern
            bits = rng.integers(0, 1 << 16, (t, s.h)).astype(np.uint16)
            self.x_bits = np.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits).astype(np.uint16)
        allowed = np.array([e for e in range(s.e) if e // s.num_local != s.quiet])
        idx = np.array([rng.permutation(allowed)[: s.k] for _ in range(t)], dtype=np.int64).reshape(t, s.k)
        if not s.busy:
            idx[rng.random((t, s.k)) < s.drop] = -1
            if t and rng.random() < 0.5:
                idx[rng.integers(t)] = -1  # a token sent nowhere
        self.idx = idx
        self.w = (rng.uniform(0.1, 1.0, (t, s.k)) * rng.choice([-1.0, 1.0], (t, s.k))).astype(np.float32)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return bf16_tensor(self.x_bits), as_tensor(self.idx), as_tensor(self.w)


class Layout(NamedTuple):
    per_rank: list[int]
    per_expert: list[int]
    in_rank: np.ndarray  # bool [T, R]


def layout_oracle(idx: np.ndarray, e: int, r: int) -> Layout:
    """The spec's layout by loops: a token is in rank d if one of its ids in [0, E) is an expert of d;
    every id in [0, E) counts once for its expert; other ids count nowhere."""
    el = e // r
    in_rank = np.zeros((idx.shape[0], r), dtype=bool)
    per_expert = [0] * e
    for t in range(idx.shape[0]):
        for v in idx[t].tolist():
            if 0 <= v < e:
                in_rank[t, v // el] = True
                per_expert[v] += 1
    return Layout([int(in_rank[:, d].sum()) for d in range(r)], per_expert, in_rank)


class Oracle:
    """Everything one case's ranks must receive, computed from every rank's rebuilt inputs."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.inputs = [RankInputs(s, r) for r in range(s.world)]
        self.layouts = [layout_oracle(i.idx, s.e, s.world) for i in self.inputs]
        # rows[d]: (source rank, token) of every row rank d receives, by source rank, then token.
        self.rows = [[(src, tok) for src in range(s.world) for tok in range(s.ts[src])
                      if self.layouts[src].in_rank[tok, d]] for d in range(s.world)]

    def n(self, d: int) -> int:
        return len(self.rows[d])

    def prefix(self) -> list[list[int]]:
        """[s][d]: rows that ranks 0..s send rank d."""
        r = self.s.world
        return [[sum(self.layouts[src].per_rank[d] for src in range(s + 1)) for d in range(r)] for s in range(r)]

    def recv_columns(self, d: int, sent: list[list[np.ndarray]]) -> list[np.ndarray]:
        """The rows of each column (sent[src][c]: what rank src passed) rank d receives."""
        return [stack([sent[src][c][tok] for src, tok in self.rows[d]], sent[d][c]) for c in range(len(sent[d]))]

    def recv_topk(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        el = self.s.num_local
        ids, weights = [], []
        for src, tok in self.rows[d]:
            row = self.inputs[src].idx[tok].tolist()
            local = [v - d * el if d * el <= v < (d + 1) * el else -1 for v in row]
            ids.append(local)
            weights.append([float(w) if v >= 0 else 0.0 for v, w in zip(local, self.inputs[src].w[tok].tolist())])
        k = self.s.k
        return (np.array(ids, dtype=np.int64).reshape(-1, k),
                np.array(weights, dtype=np.float32).reshape(-1, k))

    def recv_counts(self, d: int, alignment: int = 1) -> list[int]:
        el = self.s.num_local
        counts = [sum(lay.per_expert[d * el + l] for lay in self.layouts) for l in range(el)]
        return [(c + alignment - 1) // alignment * alignment for c in counts]

    def combine(self, me: int, ys: list[np.ndarray], biases: list[np.ndarray],
                tws: list[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray | None]:
        """Rank me's combined tokens: a float32 sum (from +0) of the rows ranks d = 0, 1, ... in the
        token's is_token_in_rank row return (ys[d][i], i the token's row on d), then each bias, rounded
        once to bf16 (nearest even); the weights summed the same way. ys: bf16 bits."""
        s = self.s
        pos = [{st: i for i, st in enumerate(rows)} for rows in self.rows]
        t = s.ts[me]
        out = np.zeros((t, s.h), dtype=np.uint16)
        k = tws[me].shape[1] if tws is not None else 0
        weights = np.zeros((t, k), dtype=np.float32)
        for tok in range(t):
            acc = np.zeros(s.h, dtype=np.float32)
            acc_w = np.zeros(k, dtype=np.float32)
            for d in range(s.world):
                if self.layouts[me].in_rank[tok, d]:
                    i = pos[d][(me, tok)]
                    acc = acc + bf16_bits_to_f32(ys[d][i])
                    if tws is not None:
                        acc_w = acc_w + tws[d][i]
            for b in biases:
                acc = acc + bf16_bits_to_f32(b[tok])
            out[tok] = f32_to_bf16_bits(acc)
            weights[tok] = acc_w
        return out, (weights if tws is not None else None)


def fp8_columns(s: Setup, inputs: RankInputs, r: int, kind: str) -> list[tuple[np.ndarray, torch.dtype]]:
    """Rank r's FP8 x as numpy (e4m3 codes [T, H], scales) plus their torch dtypes. The codes and the
    [T, H/128] / packed UE8M0 scales come from the numpy FP8 oracle where H allows, else random bytes."""
    rng = s.rng(2, r, FP8_SCALES.index(kind))
    t, h = s.ts[r], s.h
    if h % 128 == 0:
        codes, scales = cast_to_fp8(inputs.x_bits)
    else:
        codes, scales = rng.integers(0, 256, (t, h), dtype=np.uint8), rng.standard_normal((t, 1)).astype(np.float32)
    if kind == "ue8m0":
        if h % 512 == 0:
            codes, scales = cast_to_fp8(inputs.x_bits, round_scale=True, use_ue8m0=True)
        else:
            scales = rng.integers(-(1 << 31), 1 << 31, (t, 2)).astype(np.int32)
    elif kind == "token":
        scales = rng.standard_normal(t).astype(np.float32)
    elif kind == "token_1":
        scales = rng.standard_normal((t, 1)).astype(np.float32)
    elif kind == "column_major":
        scales = rng.standard_normal((t, 3)).astype(np.float32)
    dtype = torch.int32 if scales.dtype == np.int32 else torch.float32
    return [(codes, torch.float8_e4m3fn), (scales, dtype)]


def fp8_tensors(columns: list[tuple[np.ndarray, torch.dtype]], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    data, scales = (torch_of(a, dt) for a, dt in columns)
    if kind == "column_major" and scales.shape[0] > 1:  # same values, column-major storage (DeepGEMM's)
        scales = scales.t().contiguous().t()
        assert not scales.is_contiguous()
    return data, scales


# ==================================================================================== checks
def check_layout(got: tuple, want: Layout, t: int, r: int, e: int, m: str) -> None:
    assert isinstance(got, tuple) and len(got) == 5, m
    per_rank, per_rdma, per_expert, in_rank, event = got
    assert per_rdma is None, f"{m}: num_tokens_per_rdma_rank"
    assert per_rank.dtype == torch.int32 and tuple(per_rank.shape) == (r,), f"{m}: num_tokens_per_rank"
    assert per_expert.dtype == torch.int32 and tuple(per_expert.shape) == (e,), f"{m}: num_tokens_per_expert"
    assert in_rank.dtype == torch.bool and tuple(in_rank.shape) == (t, r), f"{m}: is_token_in_rank"
    assert per_rank.tolist() == want.per_rank, f"{m}: num_tokens_per_rank {per_rank.tolist()} != {want.per_rank}"
    assert per_expert.tolist() == want.per_expert, f"{m}: num_tokens_per_expert"
    assert np.array_equal(in_rank.numpy(), want.in_rank), f"{m}: is_token_in_rank"
    assert isinstance(event, EventOverlap) and event.event is None, m


def check_recv(o: Oracle, me: int, recv_x: Any, sent: list[list[tuple[np.ndarray, torch.dtype]]], m: str,
               worst: int = 0) -> None:
    """recv_x: the rows of each column exactly as their source sent them (first N rows), worst or N rows."""
    n = o.n(me)
    total = worst or n
    if len(sent[me]) == 1:
        assert isinstance(recv_x, torch.Tensor), f"{m}: recv_x is {type(recv_x).__name__}"
        cols: tuple = (recv_x,)
    else:
        assert isinstance(recv_x, tuple) and len(recv_x) == len(sent[me]), f"{m}: recv_x is {type(recv_x)}"
        cols = recv_x
    want = o.recv_columns(me, [[a for a, _ in cols_of_rank] for cols_of_rank in sent])
    for c, (got, (like, dtype)) in enumerate(zip(cols, sent[me])):
        shape = (total, *like.shape[1:])
        assert isinstance(got, torch.Tensor) and got.dtype == dtype and tuple(got.shape) == shape, \
            f"{m}: column {c} is {getattr(got, 'dtype', got)} {tuple(getattr(got, 'shape', ()))}, want {dtype} {shape}"
        assert np.array_equal(row_bytes(got[:n]), np_row_bytes(want[c])), f"{m}: bytes of column {c} differ"


def check_topk(o: Oracle, me: int, recv_idx: Any, recv_w: Any, m: str, worst: int = 0) -> None:
    n, k = o.n(me), o.s.k
    total = worst or n
    want_idx, want_w = o.recv_topk(me)
    assert isinstance(recv_idx, torch.Tensor) and recv_idx.dtype == torch.int64, f"{m}: recv_topk_idx"
    assert tuple(recv_idx.shape) == (total, k), f"{m}: recv_topk_idx shape {tuple(recv_idx.shape)}"
    assert np.array_equal(recv_idx[:n].numpy(), want_idx), f"{m}: recv_topk_idx\n{recv_idx[:n]}\n{want_idx}"
    assert bool((recv_idx[n:] == -1).all()), f"{m}: recv_topk_idx past N"
    assert isinstance(recv_w, torch.Tensor) and recv_w.dtype == torch.float32, f"{m}: recv_topk_weights"
    assert tuple(recv_w.shape) == (total, k), f"{m}: recv_topk_weights shape"
    assert np.array_equal(recv_w[:n].numpy(), want_w), f"{m}: recv_topk_weights"
    assert bool((recv_w[n:] == 0).all()), f"{m}: recv_topk_weights past N"


def check_handle(o: Oracle, me: int, handle: Any, m: str, k: int, worst: int = 0) -> None:
    assert isinstance(handle, NormalHandle), f"{m}: handle is {type(handle).__name__}"
    n = o.n(me)
    pad = [-1] * ((worst or n) - n)
    assert handle.recv_src_idx.dtype == torch.int32 and handle.recv_src_rank.dtype == torch.int32, m
    assert handle.recv_src_idx.tolist() == [t for _, t in o.rows[me]] + pad, f"{m}: recv_src_idx"
    assert handle.recv_src_rank.tolist() == [s for s, _ in o.rows[me]] + pad, f"{m}: recv_src_rank"
    assert handle.rank_prefix_matrix.dtype == torch.int32, m
    assert handle.rank_prefix_matrix.tolist() == o.prefix(), f"{m}: rank_prefix_matrix"
    assert handle.is_token_in_rank.dtype == torch.bool, m
    assert np.array_equal(handle.is_token_in_rank.numpy(), o.layouts[me].in_rank), f"{m}: handle.is_token_in_rank"
    assert handle.num_topk == k, f"{m}: num_topk {handle.num_topk} != {k}"


def check_combine(o: Oracle, me: int, result: tuple, ys: list[np.ndarray], biases: list[np.ndarray],
                  tws: list[np.ndarray] | None, m: str) -> None:
    assert isinstance(result, tuple) and len(result) == 3, m
    out, out_w, event = result
    s = o.s
    assert isinstance(event, EventOverlap) and event.event is None, m
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (s.ts[me], s.h), f"{m}: combined_x {out.shape}"
    want, want_w = o.combine(me, ys, biases, tws)
    got = bf16_bits(out)
    bad = np.argwhere(got != want)
    assert not len(bad), (f"{m}: combined_x differs at {len(bad)} elements, first {tuple(bad[0])}: "
                          f"got 0x{got[tuple(bad[0])]:04x}, want 0x{want[tuple(bad[0])]:04x}")
    if tws is None:
        assert out_w is None, f"{m}: combined_topk_weights without topk_weights"
        return
    assert isinstance(out_w, torch.Tensor) and out_w.dtype == torch.float32, f"{m}: combined_topk_weights"
    assert want_w is not None and tuple(out_w.shape) == want_w.shape, f"{m}: combined_topk_weights shape"
    assert np.array_equal(out_w.numpy().view(np.uint32), want_w.view(np.uint32)), f"{m}: combined_topk_weights"


def dispatch_fresh(buf: Buffer, x: Any, layout: tuple, **kwargs: Any) -> tuple:
    """A dispatch with the layout get_dispatch_layout returned."""
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    return buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, **kwargs)


def expert_outputs(o: Oracle, tag: int, rows: list[int] | None = None) -> list[np.ndarray]:
    """Every rank's combine input (bf16 bits [N_d, H], or [rows[d], H] with NaN past N_d)."""
    out = []
    for d in range(o.s.world):
        y = wide_bf16_bits(o.s.rng(3, tag, d), o.n(d), o.s.h)
        if rows is not None:
            y = np.concatenate([y, np.full((rows[d] - o.n(d), o.s.h), BF16_NAN, dtype=np.uint16)])
        out.append(y)
    return out


def combine_weights(o: Oracle, tag: int, rows: list[int] | None = None) -> list[np.ndarray]:
    out = []
    for d in range(o.s.world):
        w = o.s.rng(4, tag, d).standard_normal((o.n(d), o.s.k)).astype(np.float32)
        if rows is not None:
            w = np.concatenate([w, np.full((rows[d] - o.n(d), o.s.k), np.nan, dtype=np.float32)])
        out.append(w)
    return out


def check_still_works(buf: Buffer, rank: int, world: int, seed: int, tag: tuple[int, ...]) -> int:
    """One plain dispatch and combine, checked: the group is usable after whatever came before."""
    s = make_setup(seed, tag, world, busy=True)
    o = Oracle(s)
    x, idx, w = o.inputs[rank].tensors()
    res = dispatch_fresh(buf, x, buf.get_dispatch_layout(idx, s.e), topk_idx=idx, topk_weights=w)
    m = s.msg(rank, "still works")
    check_recv(o, rank, res[0], [[(i.x_bits, torch.bfloat16)] for i in o.inputs], m)
    check_topk(o, rank, res[1], res[2], m)
    ys = expert_outputs(o, 0)
    check_combine(o, rank, buf.combine(bf16_tensor(ys[rank]), res[4]), ys, [], None, m)
    return o.n(rank)


# ==================================================================================== rank functions
BIASES = ("none", "tensor", "first", "second", "both")


def rank_dispatch_combine(rank: int, world: int, seed: int, rounds: int) -> list[dict[str, int]]:
    """Random cases: layout, dispatch (bf16 with top-k), a cached FP8 dispatch along its handle, a fresh
    FP8 dispatch without top-k, combines with every kind of bias and with topk_weights, all checked."""
    buf = make_buffer()
    seen = []
    for it in range(rounds):
        quiet = world - 1 if it == 1 and world > 1 else -1
        ts = None
        if it == 2:  # rank 0 has no tokens at all
            ts = tuple(0 if r == 0 else 3 + r for r in range(world))
        s = make_setup(seed, (1, it), world, busy=it < 2, quiet=quiet, ts=ts)  # busy: surely some traffic
        o = Oracle(s)
        mine = o.inputs[rank]
        x, idx, w = mine.tensors()
        t, n, r, e = s.ts[rank], o.n(rank), world, s.e

        # Layout; out-of-range ids count nowhere.
        layout = buf.get_dispatch_layout(idx, e)
        check_layout(layout, o.layouts[rank], t, r, e, s.msg(rank, "layout"))
        odd = mine.idx.copy()
        rng = s.rng(9, rank)
        if t:
            odd = np.where(rng.random(odd.shape) < 0.4, rng.choice([-2, -7, e, e + 5, 1 << 40], odd.shape), odd)
            m = s.msg(rank, f"layout of out-of-range ids {odd.tolist()}")
            check_layout(buf.get_dispatch_layout(as_tensor(odd), e), layout_oracle(odd, e, r), t, r, e, m)

        # bf16 dispatch with top-k ids and weights.
        alignment = ALIGNMENTS[it % len(ALIGNMENTS)]
        res = dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w, expert_alignment=alignment)
        m = s.msg(rank, f"bf16 dispatch alignment={alignment}")
        assert isinstance(res, tuple) and len(res) == 6, m
        check_recv(o, rank, res[0], [[(i.x_bits, torch.bfloat16)] for i in o.inputs], m)
        check_topk(o, rank, res[1], res[2], m)
        assert res[3] == o.recv_counts(rank, alignment) and all(type(c) is int for c in res[3]), \
            f"{m}: num_recv_tokens_per_expert_list {res[3]} != {o.recv_counts(rank, alignment)}"
        check_handle(o, rank, res[4], m, s.k)
        assert isinstance(res[5], EventOverlap) and res[5].event is None, m
        handle = res[4]

        # Cached dispatch of FP8 rows along the handle; then a fresh FP8 dispatch without top-k.
        for j, cached in enumerate((True, False)):
            kind = FP8_SCALES[(2 * it + j) % len(FP8_SCALES)]
            sent = [fp8_columns(s, o.inputs[src], src, kind) for src in range(world)]
            x8 = fp8_tensors(sent[rank], kind)
            m = s.msg(rank, f"fp8 {kind} {'cached' if cached else 'fresh, no topk_idx'} dispatch")
            if cached:
                got = buf.dispatch(x8, handle=handle)
                assert isinstance(got, tuple) and len(got) == 6 and got[1:5] == (None, None, None, None), m
                assert isinstance(got[5], EventOverlap), m
            else:
                got = dispatch_fresh(buf, x8, layout)
                assert got[1] is None and got[2] is None, f"{m}: top-k outputs without topk_idx"
                assert got[3] == o.recv_counts(rank), f"{m}: num_recv_tokens_per_expert_list {got[3]}"
                check_handle(o, rank, got[4], m, 0)
            check_recv(o, rank, got[0], sent, m)

        # Combine: every kind of bias; weights summed back; then the dispatch's own recv weights.
        ys = expert_outputs(o, it)
        tws = combine_weights(o, it)
        bias_kind = BIASES[it % len(BIASES)]
        b_bits = [wide_bf16_bits(s.rng(5, rank, i), t, s.h) for i in range(2)]
        b = [bf16_tensor(bits) for bits in b_bits]
        bias: Any = {"none": None, "tensor": b[0], "first": (b[0], None), "second": (None, b[1]),
                     "both": (b[0], b[1])}[bias_kind]
        used = {"none": [], "tensor": [0], "first": [0], "second": [1], "both": [0, 1]}[bias_kind]
        biases = [b_bits[i] for i in used]
        y = bf16_tensor(ys[rank])
        m = s.msg(rank, f"combine bias={bias_kind}")
        check_combine(o, rank, buf.combine(y, handle, topk_weights=as_tensor(tws[rank]), bias=bias),
                      ys, biases, tws, m)
        nowhere = ~o.layouts[rank].in_rank.any(axis=1)
        out = buf.combine(y, handle, bias=bias)
        check_combine(o, rank, out, ys, biases, None, m + " without topk_weights")
        if len(biases) <= 1:  # a token sent nowhere gets exactly its bias (0 without)
            want_nowhere = (biases[0] if biases else np.zeros((t, s.h), np.uint16))[nowhere]
            assert np.array_equal(bf16_bits(out[0])[nowhere], want_nowhere), f"{m}: tokens sent nowhere"
        _, back, _ = buf.combine(y, handle, topk_weights=res[2])
        want_w = np.where(mine.idx >= 0, mine.w, np.float32(0))
        assert np.array_equal(back.numpy(), want_w), f"{m}: recv_topk_weights combined back != the weights"
        seen.append({"t": t, "n": n})
    buf.destroy()
    return seen


def rank_worst_tokens(rank: int, world: int, seed: int) -> bool:
    """num_worst_tokens: outputs of exactly that many rows, padding rows named -1 / 0, an empty list;
    cached dispatch and combine of such a handle (rows past N hold NaN and must not be read); fewer rows
    than received is a ValueError on the receiving rank (raised after the exchange: nobody hangs)."""
    buf = make_buffer(timeout_s=20)
    s = make_setup(seed, (4,), world, busy=True)
    o = Oracle(s)
    x, idx, w = o.inputs[rank].tensors()
    n = o.n(rank)
    worst = max(o.n(d) for d in range(world)) + 3
    layout = buf.get_dispatch_layout(idx, s.e)
    bf16_sent = [[(i.x_bits, torch.bfloat16)] for i in o.inputs]

    m = s.msg(rank, f"num_worst_tokens={worst} N={n}")
    res = dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w, expert_alignment=4, num_worst_tokens=worst)
    check_recv(o, rank, res[0], bf16_sent, m, worst)
    check_topk(o, rank, res[1], res[2], m, worst)
    assert res[3] == [], f"{m}: num_recv_tokens_per_expert_list {res[3]}"
    check_handle(o, rank, res[4], m, s.k, worst)
    handle = res[4]

    sent = [fp8_columns(s, o.inputs[src], src, "token") for src in range(world)]
    got = dispatch_fresh(buf, fp8_tensors(sent[rank], "token"), layout, num_worst_tokens=worst)
    check_recv(o, rank, got[0], sent, m + " fp8", worst)
    assert got[1] is None and got[2] is None and got[3] == [], m
    check_handle(o, rank, got[4], m + " fp8", 0, worst)

    # A cached dispatch along the padded handle gives one row per row of the handle (combine needs them).
    x2_bits = [normal_bf16_bits(s.rng(6, src), s.ts[src], s.h) for src in range(world)]
    got = buf.dispatch(bf16_tensor(x2_bits[rank]), handle=handle)
    assert got[0].shape[0] == handle.recv_src_idx.shape[0] == worst, f"{m}: cached rows {tuple(got[0].shape)}"
    assert np.array_equal(row_bytes(got[0][:n]),
                          np_row_bytes(o.recv_columns(rank, [[b] for b in x2_bits])[0])), f"{m}: cached rows"

    rows = [worst] * world
    ys, tws = expert_outputs(o, 0, rows), combine_weights(o, 0, rows)
    check_combine(o, rank, buf.combine(bf16_tensor(ys[rank]), handle, topk_weights=as_tensor(tws[rank])),
                  ys, [], tws, m + " combine (NaN rows past N)")

    # Too few rows: a ValueError naming num_worst_tokens where N > num_worst_tokens.
    mine = n - 1 if n >= 2 else n + 1
    raised = False
    try:
        dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w, num_worst_tokens=mine)
    except ValueError as err:
        assert re.search(names("num_worst_tokens"), str(err)), f"{m}: {err}"
        raised = True
    assert raised == (n >= 2), f"{m}: num_worst_tokens={mine} for N={n}: raised={raised}"
    check_still_works(buf, rank, world, seed, (4, 1))
    return raised


def rank_moe_round_trip(rank: int, world: int, seed: int) -> int:
    """An MoE layer: dispatch, each local expert e computes x @ W_e on its rows weighted by
    recv_topk_weights, summed over local experts, combine; vs the dense single-process result."""
    buf = make_buffer()
    s = make_setup(seed, (6,), world, h=128, ts=tuple(8 + 3 * r for r in range(world)))
    el, h = s.num_local, s.h
    experts = s.rng(7).standard_normal((s.e, h, h)) / np.sqrt(h)
    xs = [normal_bf16_bits(s.rng(8, r), s.ts[r], h) for r in range(world)]
    inputs = [RankInputs(s, r) for r in range(world)]
    x = bf16_tensor(xs[rank])
    idx, w = as_tensor(inputs[rank].idx), as_tensor(inputs[rank].w)
    recv_x, recv_idx, recv_w, counts, handle, _ = dispatch_fresh(buf, x, buf.get_dispatch_layout(idx, s.e),
                                                                 topk_idx=idx, topk_weights=w)
    m = s.msg(rank, "moe")
    assert counts == [int((recv_idx == l).sum()) for l in range(el)], f"{m}: counts {counts}"
    y = torch.zeros(recv_x.shape[0], h, dtype=torch.float32)
    for l in range(el):
        weight = (recv_w * (recv_idx == l)).sum(dim=1, keepdim=True)
        y += weight * (recv_x.float() @ as_tensor(experts[rank * el + l].astype(np.float32)))
    out = buf.combine(y.to(torch.bfloat16), handle)[0]

    # Dense: out[t] = sum_k w[t, k] * (x[t] @ W[idx[t, k]]) in float64.
    x64 = bits_to_f64(xs[rank])
    exact = np.zeros((s.ts[rank], h))
    magnitude = np.zeros((s.ts[rank], h))
    for t in range(s.ts[rank]):
        for v, wt in zip(inputs[rank].idx[t].tolist(), inputs[rank].w[t].tolist()):
            if v >= 0:
                exact[t] += wt * (x64[t] @ experts[v].astype(np.float32).astype(np.float64))
                magnitude[t] += abs(wt) * (np.abs(x64[t]) @ np.abs(experts[v].astype(np.float32).astype(np.float64)))
    got = bits_to_f64(bf16_bits(out))
    # Tolerance: each rank's partial sum is rounded to bf16 (2**-8 of at most `magnitude`), the float32
    # matmuls and sums add about H * 2**-24 of `magnitude`, and the result is rounded to bf16 once more
    # (2**-8 of |exact| plus the errors before): 2**-7 * (|exact| + magnitude) holds with room. A row
    # routed to the wrong token or expert is off by the size of the values themselves. Tokens without
    # experts have exact = magnitude = 0 and must come out exactly 0.
    err = np.abs(got - exact)
    tol = 2.0 ** -7 * (np.abs(exact) + magnitude)
    bad = np.argwhere(err > tol)
    assert not len(bad), (f"{m}: {len(bad)} elements off, first {tuple(bad[0])}: got {got[tuple(bad[0])]!r}, "
                          f"want {exact[tuple(bad[0])]!r}")
    return recv_x.shape[0]


def bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(bits).astype(np.float64)


def rank_events(rank: int, world: int, seed: int) -> None:
    """previous_event=Buffer.capture(), async_finish and allocate_on_comm_stream work on CPU: the same
    outputs as plain calls, and EventOverlap events (event None) that can be waited for."""
    buf = make_buffer()
    s = make_setup(seed, (3,), world, busy=True)
    o = Oracle(s)
    x, idx, w = o.inputs[rank].tensors()
    m = s.msg(rank, "events")
    plain_layout = buf.get_dispatch_layout(idx, s.e)
    plain = dispatch_fresh(buf, x, plain_layout, topk_idx=idx, topk_weights=w)
    ys = expert_outputs(o, 0)
    y = bf16_tensor(ys[rank])
    plain_out = buf.combine(y, plain[4])
    for flags in ({"previous_event": Buffer.capture()}, {"async_finish": True},
                  {"previous_event": Buffer.capture(), "async_finish": True, "allocate_on_comm_stream": True}):
        layout = buf.get_dispatch_layout(idx, s.e, **flags)
        check_layout(layout, o.layouts[rank], s.ts[rank], world, s.e, f"{m} {flags}")
        res = dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w, **flags)
        cached = buf.dispatch(x, handle=res[4], **flags)
        out = buf.combine(y, res[4], **flags)
        for event in (layout[4], res[5], cached[5], out[2]):
            assert isinstance(event, EventOverlap) and event.event is None, f"{m} {flags}"
            event.current_stream_wait()
            with event:
                pass
        assert torch.equal(res[0].view(torch.int16), plain[0].view(torch.int16)), f"{m} {flags}: recv_x"
        assert torch.equal(cached[0].view(torch.int16), plain[0].view(torch.int16)), f"{m} {flags}: cached"
        assert torch.equal(res[1], plain[1]) and torch.equal(res[2], plain[2]) and res[3] == plain[3], m
        assert torch.equal(out[0].view(torch.int16), plain_out[0].view(torch.int16)), f"{m} {flags}: combine"
    check_combine(o, rank, plain_out, ys, [], None, m)


def rank_disagreement(rank: int, world: int, seed: int) -> None:
    """The last rank calls with a different hidden size, K, E, topk_weights, row format, or a cached
    dispatch while the others dispatch afresh, or combines rows of another hidden size or with weights:
    a ValueError naming the ranks on every rank, and the group keeps working."""
    buf = make_buffer(timeout_s=10)
    odd = rank == world - 1
    s = make_setup(seed, (5,), world, h=128, k=2, num_local=2, busy=True)
    o = Oracle(s)
    x, idx, w = o.inputs[rank].tensors()
    layout = buf.get_dispatch_layout(idx, s.e)
    handle = dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w)[4]
    n = o.n(rank)
    wide = torch.zeros(s.ts[rank], 2 * s.h, dtype=torch.bfloat16)
    idx3 = torch.cat([idx, torch.full((s.ts[rank], 1), -1, dtype=torch.int64)], dim=1)
    w3 = torch.cat([w, torch.zeros(s.ts[rank], 1)], dim=1)
    idx_e2 = torch.where(idx >= 0, idx * 2, idx)  # the same ranks, of 2E experts
    layout_e2 = buf.get_dispatch_layout(idx_e2, 2 * s.e)
    fp8 = (torch.zeros(s.ts[rank], s.h, dtype=torch.float8_e4m3fn), torch.ones(s.ts[rank], 1))
    x136 = torch.zeros(s.ts[rank], 136, dtype=torch.bfloat16)
    y = torch.ones(n, s.h, dtype=torch.bfloat16)
    scenarios: list[tuple[str, Callable[[], Any]]] = [
        ("hidden", lambda: dispatch_fresh(buf, wide if odd else x, layout, topk_idx=idx, topk_weights=w)),
        ("top-k", lambda: dispatch_fresh(buf, x, layout, topk_idx=idx3 if odd else idx, topk_weights=w3 if odd else w)),
        ("topk_weights", lambda: dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=None if odd else w)),
        ("num_experts", lambda: dispatch_fresh(buf, x, layout_e2 if odd else layout, topk_idx=idx_e2 if odd else idx,
                                               topk_weights=w)),
        ("fp8 rows", lambda: dispatch_fresh(buf, fp8 if odd else x, layout)),
        # Rows of the same bytes (136 * 2 + 1 * 8 = 128 * 2 + 3 * 8), K differs.
        ("top-k, same row bytes", lambda: dispatch_fresh(buf, x136 if odd else x, layout,
                                                         topk_idx=idx[:, :1].contiguous() if odd else idx3)),
        ("cached", lambda: buf.dispatch(x, handle=handle) if odd else dispatch_fresh(buf, x, layout)),
        ("combine hidden", lambda: buf.combine(torch.ones(n, 2 * s.h, dtype=torch.bfloat16) if odd else y, handle)),
        ("combine topk_weights", lambda: buf.combine(y, handle, topk_weights=torch.ones(n, 2) if odd else None)),
    ]
    failures = []
    for it, (label, call) in enumerate(scenarios):
        try:
            call()
        except ValueError as err:
            msg = str(err)
            if not (re.search(r"\brank 0\b", msg) and re.search(rf"\brank {world - 1}\b", msg)):
                failures.append(f"{label}: the ValueError does not name ranks 0 and {world - 1}: {msg!r}")
        else:
            failures.append(f"{label}: no ValueError")
        check_still_works(buf, rank, world, seed, (5, it))
    assert not failures, s.msg(rank, "\n" + "\n".join(failures))


def rank_dispatch_versus_combine(rank: int, world: int, seed: int) -> None:
    """The last rank combines while the others dispatch: a ValueError naming the ranks on every rank."""
    buf = make_buffer(timeout_s=5)
    s = make_setup(seed, (7,), world, h=128, k=2, num_local=2, busy=True)
    o = Oracle(s)
    x, idx, w = o.inputs[rank].tensors()
    layout = buf.get_dispatch_layout(idx, s.e)
    handle = dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w)[4]
    with pytest.raises(ValueError, match=rf"\brank {world - 1}\b"):
        if rank == world - 1:
            buf.combine(torch.ones(o.n(rank), s.h, dtype=torch.bfloat16), handle)
        else:
            dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w)
    check_still_works(buf, rank, world, seed, (7, 1))


def rank_device_errors(rank: int, world: int, seed: int) -> int:
    """In a process group the device is the group's (CPU for gloo): tensors elsewhere are a ValueError
    naming them; so are E not a multiple of R and a handle of another group. Every rank makes the same
    mistake, so every rank raises before any communication; then the group still works."""
    buf = make_buffer(timeout_s=10)
    s = make_setup(seed, (8,), world, h=128, k=2, num_local=2, busy=True)
    o = Oracle(s)
    x, idx, w = o.inputs[rank].tensors()
    t = s.ts[rank]
    layout = buf.get_dispatch_layout(idx, s.e)
    res = dispatch_fresh(buf, x, layout, topk_idx=idx, topk_weights=w)
    handle, n = res[4], o.n(rank)
    y = torch.zeros(n, s.h, dtype=torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = layout
    fp8 = (torch.zeros(t, s.h, dtype=torch.float8_e4m3fn), torch.ones(t, 1))
    one_rank = NormalHandle(torch.zeros(1, 1, dtype=torch.int32), handle.recv_src_idx, handle.recv_src_rank,
                            handle.is_token_in_rank, handle.num_topk)

    def d(**kw: Any) -> Callable[[], Any]:
        args = {"x": x, "num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
                "num_tokens_per_expert": per_expert, "topk_idx": idx, "topk_weights": w}
        args.update(kw)
        return lambda: buf.dispatch(**args)

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("x", d(x=x.to(META))),
        ("x[0]", d(x=(fp8[0].to(META), fp8[1]), topk_idx=None, topk_weights=None)),
        ("x[1]", d(x=(fp8[0], fp8[1].to(META)), topk_idx=None, topk_weights=None)),
        ("is_token_in_rank", d(is_token_in_rank=in_rank.to(META))),
        ("num_tokens_per_rank", d(num_tokens_per_rank=per_rank.to(META))),
        ("num_tokens_per_expert", d(num_tokens_per_expert=per_expert.to(META))),
        ("topk_idx", d(topk_idx=idx.to(META))),
        ("topk_weights", d(topk_weights=w.to(META))),
        ("num_tokens_per_expert", d(num_tokens_per_expert=torch.zeros(s.e + 1, dtype=torch.int32))),
        ("topk_idx", lambda: buf.get_dispatch_layout(idx.to(META), s.e)),
        ("num_experts", lambda: buf.get_dispatch_layout(idx, s.e + 1)),
        ("handle", lambda: buf.dispatch(x, handle=one_rank)),
        ("x", lambda: buf.combine(y.to(META), handle)),
        ("topk_weights", lambda: buf.combine(y, handle, topk_weights=torch.zeros(n, 2, device=META))),
        ("bias", lambda: buf.combine(y, handle, bias=torch.zeros(t, s.h, dtype=torch.bfloat16, device=META))),
        ("handle", lambda: buf.combine(y, one_rank)),
    ]
    failures = []
    for name, call in cases:
        try:
            with pytest.raises(ValueError, match=names(name)):
                call()
        except BaseException as err:  # pytest.raises fails with an outcome exception, not an AssertionError
            failures.append(f"{name}: {type(err).__name__}: {err}")
    assert not failures, s.msg(rank, "\n" + "\n".join(failures))
    check_still_works(buf, rank, world, seed, (8, 1))
    return len(cases)


# ==================================================================================== multi-rank tests
ROUNDS = {1: 6, 2: 5, 3: 4, 4: 4}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dispatch_and_combine_match_the_oracle(world: int, seed: int) -> None:
    """Layout, dispatch (bf16, FP8 in five scale formats, cached, without top-k, three alignments) and
    combine (five bias forms, topk_weights) bit-exact against the oracle on random cases."""
    seen = run_ranks(rank_dispatch_combine, world, seed, ROUNDS[world], timeout_s=120)
    rounds = list(zip(*seen))  # per round, every rank's counts
    m = f"seed={seed}: {seen}"
    assert sum(c["n"] for c in rounds[0]) > 0, f"{m}: the busy round moved no rows"
    assert any(c["t"] == 0 for c in rounds[2]), f"{m}: no rank without tokens"
    if world > 1:
        assert rounds[1][-1]["n"] == 0, f"{m}: the quiet rank received rows"
        assert any(c["n"] > 0 for c in rounds[1]), m


@pytest.mark.parametrize("world", [2, 3])
def test_num_worst_tokens(world: int, seed: int) -> None:
    """Padded outputs, their cached dispatch and combine; too few rows raise on the ranks concerned."""
    raised = run_ranks(rank_worst_tokens, world, seed, timeout_s=120)
    assert any(raised), f"seed={seed}: no rank received two rows or more"


@pytest.mark.parametrize("world", [2, 4])
def test_moe_round_trip_matches_dense(world: int, seed: int) -> None:
    """Dispatch, per-expert matmuls weighted by recv_topk_weights, combine == a dense MoE layer."""
    received = run_ranks(rank_moe_round_trip, world, seed, timeout_s=120)
    assert sum(received) > 0, f"seed={seed}: no rows moved"


def test_events_and_async_finish_on_cpu(seed: int) -> None:
    """previous_event / async_finish / allocate_on_comm_stream: same results, EventOverlap(None) events."""
    run_ranks(rank_events, 2, seed, timeout_s=60)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_get_a_value_error(world: int, seed: int) -> None:
    """Hidden size, K, E, topk_weights, row format, cached vs fresh, combine hidden and weights."""
    run_ranks(rank_disagreement, world, seed, timeout_s=120)


def test_dispatch_on_some_ranks_combine_on_another(seed: int) -> None:
    """docs/design.md: ranks that disagree on the operation get a ValueError naming the ranks."""
    run_ranks(rank_dispatch_versus_combine, 2, seed, timeout_s=30)


def test_tensors_on_another_device_in_a_group(seed: int) -> None:
    """Device checks (and E % R, a handle of another group) on two ranks making the same mistake."""
    counts = run_ranks(rank_device_errors, 2, seed, timeout_s=60)
    assert min(counts) >= 16


# ==================================================================================== one rank, in process
def test_layout_edge_cases() -> None:
    """-1 ids, a token with all -1, ids outside [0, E) (counted nowhere), T = 0; dtypes and None."""
    buf = make_buffer()
    e = 6
    idx = np.array([[0, 5, -1], [-1, -1, -1], [6, -2, 2], [7, 100, -5], [3, 3, 4]], dtype=np.int64)
    got = buf.get_dispatch_layout(as_tensor(idx), e)
    check_layout(got, layout_oracle(idx, e, 1), 5, 1, e, "layout")
    assert got[2].tolist() == [1, 0, 1, 2, 1, 1], got[2]  # by hand, not only by the loop oracle
    assert got[3][:, 0].tolist() == [True, False, True, False, True] and got[0].tolist() == [3]
    empty = buf.get_dispatch_layout(torch.zeros(0, 4, dtype=torch.int64), 8)
    check_layout(empty, layout_oracle(np.zeros((0, 4), np.int64), 8, 1), 0, 1, 8, "T=0")
    assert empty[2].tolist() == [0] * 8


def test_nothing_received_on_one_rank() -> None:
    """Every id -1: N = 0 rows; a combine of 0 rows gives 0, or exactly the bias."""
    buf = make_buffer()
    idx = torch.full((3, 2), -1, dtype=torch.int64)
    x = torch.ones(3, 64, dtype=torch.bfloat16)
    recv_x, recv_idx, recv_w, counts, handle, _ = dispatch_fresh(buf, x, buf.get_dispatch_layout(idx, 4),
                                                                 topk_idx=idx, topk_weights=torch.ones(3, 2),
                                                                 expert_alignment=128)
    assert tuple(recv_x.shape) == (0, 64) and tuple(recv_idx.shape) == (0, 2) and tuple(recv_w.shape) == (0, 2)
    assert counts == [0, 0, 0, 0]
    assert handle.recv_src_idx.tolist() == [] and handle.rank_prefix_matrix.tolist() == [[0]]
    out, weights, _ = buf.combine(torch.zeros(0, 64, dtype=torch.bfloat16), handle, topk_weights=torch.zeros(0, 2))
    assert tuple(out.shape) == (3, 64) and bool((out == 0).all()) and torch.equal(weights, torch.zeros(3, 2))
    bias = bf16_tensor(normal_bf16_bits(np.random.default_rng(1), 3, 64))
    out = buf.combine(torch.zeros(0, 64, dtype=torch.bfloat16), handle, bias=(None, bias))[0]
    assert torch.equal(out.view(torch.int16), bias.view(torch.int16))


def test_a_combine_of_rows_written_into_get_next_combine_buffer(seed: int) -> None:
    """The combine buffer holds one row per received row; written and passed as x, it combines as any x."""
    one = One()
    rows = one.buf.get_next_combine_buffer(one.handle, one.h)
    assert rows.dtype == torch.bfloat16 and tuple(rows.shape) == (one.n, one.h) and rows.device == one.y.device
    y = bf16_tensor(normal_bf16_bits(np.random.default_rng(seed), one.n, one.h))
    weights = torch.from_numpy(np.random.default_rng([seed, 1]).random((one.n, 2)).astype(np.float32))
    rows.copy_(y)
    got = one.buf.combine(rows, one.handle, topk_weights=weights)
    want = one.buf.combine(y, one.handle, topk_weights=weights)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)) and torch.equal(got[1], want[1])


def _spoiled_strides() -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    return [
        ("column slice", lambda t: torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)[:, ::2].copy_(t)),
        ("from_numpy", lambda t: torch.from_numpy(t.view(torch.int16).numpy().copy()).view(t.dtype)
         if t.dtype == torch.bfloat16 else torch.from_numpy(t.numpy().copy())),
        ("transposed", lambda t: torch.empty(t.shape[1], t.shape[0], dtype=t.dtype).copy_(t.t()).t()),
    ]


STRIDE_CASES = [("x", 0, "column slice"), ("x", 0, "from_numpy"), ("topk_idx", 0, "from_numpy"),
                ("topk_weights", 0, "from_numpy"), ("x[1]", 3, "transposed"), ("topk_weights", 3, "transposed"),
                ("combine x", 0, "column slice"), ("combine topk_weights", 0, "from_numpy")]


@pytest.mark.parametrize(("arg", "t", "how"), STRIDE_CASES, ids=[f"{a}-T{t}-{h}" for a, t, h in STRIDE_CASES])
def test_inputs_with_other_strides(arg: str, t: int, how: str) -> None:
    """Inputs that torch counts as contiguous although their last stride is not 1: any tensor of 0 rows
    (a rank without tokens: a column slice, torch.from_numpy of an empty array with strides (0, 0)) and
    [T, 1] tensors transposed from [1, T]. They are valid: the results equal those of a fresh copy."""
    spoil = dict(_spoiled_strides())[how]
    buf = make_buffer()
    x = bf16_tensor(normal_bf16_bits(np.random.default_rng(t), t, 128))
    data = torch.arange(t * 128, dtype=torch.int32).view(t, 128).to(torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.arange(t, dtype=torch.float32).view(t, 1)
    idx = fresh(torch.tensor([[0], [1], [-1]], dtype=torch.int64)[:t])
    w = fresh(torch.tensor([[0.5], [0.25], [1.0]])[:t])
    data, scales = fresh(data), fresh(scales)
    layout = buf.get_dispatch_layout(idx, 2)
    inputs: dict[str, Any] = {"x": (data, scales) if arg == "x[1]" else x, "topk_idx": idx, "topk_weights": w}
    want = dispatch_fresh(buf, inputs["x"], layout, topk_idx=idx, topk_weights=w)
    recv_w = fresh(want[2])  # ordinary strides (the library's own [0, 1] has others: the quiet-rank test)
    y = torch.ones(want[4].recv_src_idx.shape[0], 128, dtype=torch.bfloat16)
    want_out = buf.combine(y, want[4], topk_weights=recv_w)
    if arg == "x[1]":
        inputs["x"] = (data, spoil(scales))
    elif arg in inputs:
        inputs[arg] = spoil(inputs[arg])
    got = dispatch_fresh(buf, inputs["x"], layout, topk_idx=inputs["topk_idx"], topk_weights=inputs["topk_weights"])
    for a, b in zip(got[:3], want[:3]):
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert np.array_equal(row_bytes(u), row_bytes(v)), arg
    combine_x = spoil(y) if arg == "combine x" else y
    combine_w = spoil(recv_w) if arg == "combine topk_weights" else recv_w
    for v in (combine_x, combine_w, *(inputs["x"] if arg == "x[1]" else (inputs.get(arg, x),))):
        assert v.is_contiguous()  # as torch counts it: the input is not a strided view in its eyes
    out = buf.combine(combine_x, want[4], topk_weights=combine_w)
    assert torch.equal(out[0].view(torch.int16), want_out[0].view(torch.int16)) and torch.equal(out[1], want_out[1])


def rank_weights_back_from_a_quiet_rank(rank: int, world: int, seed: int) -> None:
    """K = 1 and the last rank receives nothing; every rank passes its recv_topk_weights straight back to
    combine (as DeepEP callers do): the tokens get their weights back."""
    buf = make_buffer(timeout_s=3)
    s = make_setup(seed, (10,), world, h=128, k=1, num_local=1, busy=True, quiet=world - 1)
    o = Oracle(s)
    x, idx, w = o.inputs[rank].tensors()
    recv_x, _, recv_w, _, handle, _ = dispatch_fresh(buf, x, buf.get_dispatch_layout(idx, s.e), topk_idx=idx,
                                                     topk_weights=w)
    assert (o.n(rank) == 0) == (rank == world - 1), s.msg(rank)
    _, back, _ = buf.combine(torch.zeros_like(recv_x), handle, topk_weights=recv_w)
    assert torch.equal(back, w), s.msg(rank, "weights back")


def test_recv_topk_weights_back_to_combine_on_a_rank_that_received_nothing(seed: int) -> None:
    run_ranks(rank_weights_back_from_a_quiet_rank, 2, seed, timeout_s=30)


class One:
    """A valid normal-mode call on one rank (T=4, H=128, K=2, E=4, N=3) to spoil one argument of."""

    def __init__(self) -> None:
        self.buf = make_buffer()
        self.t, self.h, self.k, self.e = 4, 128, 2, 4
        self.x = torch.arange(4 * 128, dtype=torch.float32).view(4, 128).to(torch.bfloat16)
        self.idx = torch.tensor([[0, 3], [2, -1], [-1, -1], [1, 0]], dtype=torch.int64)
        self.w = torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.0, 0.0], [0.75, 0.125]])
        self.layout = self.buf.get_dispatch_layout(self.idx, self.e)
        self.fp8 = (torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.ones(4, 1))
        self.handle = self.dispatch()[4]
        self.n = 3
        self.y = torch.ones(self.n, self.h, dtype=torch.bfloat16)
        self.bias = torch.zeros(self.t, self.h, dtype=torch.bfloat16)
        self.two_ranks = NormalHandle(torch.zeros(2, 2, dtype=torch.int32), self.handle.recv_src_idx,
                                      self.handle.recv_src_rank, self.handle.is_token_in_rank, 2)

    def get_layout(self, **kw: Any) -> tuple:
        args: dict[str, Any] = {"topk_idx": self.idx, "num_experts": self.e}
        args.update(kw)
        return self.buf.get_dispatch_layout(**args)

    def dispatch(self, **kw: Any) -> tuple:
        per_rank, _, per_expert, in_rank, _ = self.layout
        args: dict[str, Any] = {"x": self.x, "num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
                                "num_tokens_per_expert": per_expert, "topk_idx": self.idx, "topk_weights": self.w}
        args.update(kw)
        return self.buf.dispatch(**args)

    def cached(self, **kw: Any) -> tuple:
        args: dict[str, Any] = {"x": self.x, "handle": self.handle}
        args.update(kw)
        return self.buf.dispatch(**args)

    def combine(self, **kw: Any) -> tuple:
        args: dict[str, Any] = {"x": self.y, "handle": self.handle}
        args.update(kw)
        return self.buf.combine(**args)


def _counts(o: One, which: int, delta: list[int]) -> torch.Tensor:
    return o.layout[which] + torch.tensor(delta, dtype=torch.int32)


def _flipped(o: One) -> torch.Tensor:
    in_rank = o.layout[3].clone()
    in_rank[2, 0] = True  # token 2 (all -1) sent to rank 0 too: 4 tokens, num_tokens_per_rank says 3
    return in_rank


BAD_ARGUMENTS: list[tuple[str, str, Callable[[One], Any]]] = [
    # get_dispatch_layout
    ("layout topk_idx int32", "topk_idx", lambda o: o.get_layout(topk_idx=o.idx.int())),
    ("layout topk_idx 1-D", "topk_idx", lambda o: o.get_layout(topk_idx=o.idx.flatten())),
    ("layout topk_idx K=0", "topk_idx", lambda o: o.get_layout(topk_idx=torch.zeros(4, 0, dtype=torch.int64))),
    ("layout topk_idx K=17", "topk_idx", lambda o: o.get_layout(topk_idx=torch.zeros(4, 17, dtype=torch.int64))),
    ("layout topk_idx list", "topk_idx", lambda o: o.get_layout(topk_idx=o.idx.tolist())),
    ("layout num_experts 0", "num_experts", lambda o: o.get_layout(num_experts=0)),
    ("layout num_experts float", "num_experts", lambda o: o.get_layout(num_experts=4.0)),
    ("layout num_experts bool", "num_experts", lambda o: o.get_layout(num_experts=True)),
    ("layout previous_event", "previous_event", lambda o: o.get_layout(previous_event=object())),
    ("layout allocate_on_comm_stream", "allocate_on_comm_stream",
     lambda o: o.get_layout(allocate_on_comm_stream=True)),
    # dispatch: x
    ("x float32", "x", lambda o: o.dispatch(x=o.x.float())),
    ("x 1-D", "x", lambda o: o.dispatch(x=o.x.flatten())),
    ("x 3-D", "x", lambda o: o.dispatch(x=o.x.unsqueeze(0))),
    ("x list", "x", lambda o: o.dispatch(x=o.x.tolist())),
    ("x tuple of 3", "x", lambda o: o.dispatch(x=(*o.fp8, o.fp8[1]))),
    ("x tuple with a list", "x", lambda o: o.dispatch(x=(o.fp8[0], [1.0] * 4))),
    ("x hidden 0", "x", lambda o: o.dispatch(x=torch.zeros(4, 0, dtype=torch.bfloat16))),
    ("x rows of 8 bytes", "x", lambda o: o.dispatch(x=torch.zeros(4, 4, dtype=torch.bfloat16))),
    ("x rows of 24 bytes", "x", lambda o: o.dispatch(x=torch.zeros(4, 12, dtype=torch.bfloat16))),
    ("fp8 rows of 8 bytes", "x", lambda o: o.dispatch(x=(torch.zeros(4, 8, dtype=torch.float8_e4m3fn), o.fp8[1]))),
    ("x[0] bf16", "x[0]", lambda o: o.dispatch(x=(o.x, o.fp8[1]))),
    ("x[0] 1-D", "x[0]", lambda o: o.dispatch(x=(o.fp8[0].flatten(), o.fp8[1]))),
    ("x[1] float64", "x[1]", lambda o: o.dispatch(x=(o.fp8[0], o.fp8[1].double()))),
    ("x[1] bf16", "x[1]", lambda o: o.dispatch(x=(o.fp8[0], o.fp8[1].bfloat16()))),
    ("x[1] rows", "x[1]", lambda o: o.dispatch(x=(o.fp8[0], torch.ones(5, 1)))),
    ("x[1] 0-D", "x[1]", lambda o: o.dispatch(x=(o.fp8[0], torch.ones(())))),
    ("x[1] 3-D", "x[1]", lambda o: o.dispatch(x=(o.fp8[0], torch.ones(4, 1, 1)))),
    ("x[1] device", "x[1]", lambda o: o.dispatch(x=(o.fp8[0], o.fp8[1].to(META)))),
    # dispatch: layout tensors
    ("is_token_in_rank None", "is_token_in_rank", lambda o: o.dispatch(is_token_in_rank=None)),
    ("is_token_in_rank int", "is_token_in_rank", lambda o: o.dispatch(is_token_in_rank=o.layout[3].int())),
    ("is_token_in_rank rows", "is_token_in_rank", lambda o: o.dispatch(is_token_in_rank=torch.ones(5, 1, dtype=bool))),
    ("is_token_in_rank ranks", "is_token_in_rank", lambda o: o.dispatch(is_token_in_rank=torch.ones(4, 2, dtype=bool))),
    ("is_token_in_rank device", "is_token_in_rank", lambda o: o.dispatch(is_token_in_rank=o.layout[3].to(META))),
    ("num_tokens_per_rank None", "num_tokens_per_rank", lambda o: o.dispatch(num_tokens_per_rank=None)),
    ("num_tokens_per_rank int64", "num_tokens_per_rank", lambda o: o.dispatch(num_tokens_per_rank=o.layout[0].long())),
    ("num_tokens_per_rank shape", "num_tokens_per_rank",
     lambda o: o.dispatch(num_tokens_per_rank=torch.zeros(2, dtype=torch.int32))),
    ("num_tokens_per_rank device", "num_tokens_per_rank",
     lambda o: o.dispatch(num_tokens_per_rank=o.layout[0].to(META))),
    ("num_tokens_per_rank values", "num_tokens_per_rank", lambda o: o.dispatch(num_tokens_per_rank=_counts(o, 0, [1]))),
    ("is_token_in_rank vs num_tokens_per_rank", "num_tokens_per_rank",
     lambda o: o.dispatch(is_token_in_rank=_flipped(o))),
    ("num_tokens_per_rdma_rank", "num_tokens_per_rdma_rank",
     lambda o: o.dispatch(num_tokens_per_rdma_rank=torch.zeros(1, dtype=torch.int32))),
    ("num_tokens_per_expert None", "num_tokens_per_expert", lambda o: o.dispatch(num_tokens_per_expert=None)),
    ("num_tokens_per_expert int64", "num_tokens_per_expert",
     lambda o: o.dispatch(num_tokens_per_expert=o.layout[2].long())),
    ("num_tokens_per_expert 2-D", "num_tokens_per_expert",
     lambda o: o.dispatch(num_tokens_per_expert=o.layout[2].view(2, 2))),
    ("num_tokens_per_expert empty", "num_tokens_per_expert",
     lambda o: o.dispatch(num_tokens_per_expert=torch.zeros(0, dtype=torch.int32), topk_idx=None, topk_weights=None)),
    ("num_tokens_per_expert device", "num_tokens_per_expert",
     lambda o: o.dispatch(num_tokens_per_expert=o.layout[2].to(META))),
    ("num_tokens_per_expert values", "num_tokens_per_expert",
     lambda o: o.dispatch(num_tokens_per_expert=_counts(o, 2, [0, 1, -1, 0]))),
    # dispatch: top-k
    ("topk_idx int32", "topk_idx", lambda o: o.dispatch(topk_idx=o.idx.int())),
    ("topk_idx rows", "topk_idx", lambda o: o.dispatch(topk_idx=torch.zeros(5, 2, dtype=torch.int64))),
    ("topk_idx 1-D", "topk_idx", lambda o: o.dispatch(topk_idx=o.idx.flatten(), topk_weights=None)),
    ("topk_idx K=0", "topk_idx",
     lambda o: o.dispatch(topk_idx=torch.zeros(4, 0, dtype=torch.int64), topk_weights=None)),
    ("topk_idx K=17", "topk_idx",
     lambda o: o.dispatch(topk_idx=torch.zeros(4, 17, dtype=torch.int64), topk_weights=None)),
    ("topk_idx device", "topk_idx", lambda o: o.dispatch(topk_idx=o.idx.to(META))),
    ("topk_idx id E", "topk_idx", lambda o: o.dispatch(topk_idx=torch.where(o.idx == 3, 4, o.idx))),
    ("topk_idx id -2", "topk_idx", lambda o: o.dispatch(topk_idx=torch.where(o.idx == 3, -2, o.idx))),
    ("topk_weights float64", "topk_weights", lambda o: o.dispatch(topk_weights=o.w.double())),
    ("topk_weights shape", "topk_weights", lambda o: o.dispatch(topk_weights=torch.zeros(4, 3))),
    ("topk_weights device", "topk_weights", lambda o: o.dispatch(topk_weights=o.w.to(META))),
    ("topk_weights without topk_idx", "topk_weights", lambda o: o.dispatch(topk_idx=None)),
    # dispatch: options
    ("expert_alignment 0", "expert_alignment", lambda o: o.dispatch(expert_alignment=0)),
    ("expert_alignment -4", "expert_alignment", lambda o: o.dispatch(expert_alignment=-4)),
    ("expert_alignment float", "expert_alignment", lambda o: o.dispatch(expert_alignment=4.0)),
    ("expert_alignment bool", "expert_alignment", lambda o: o.dispatch(expert_alignment=True)),
    ("num_worst_tokens -1", "num_worst_tokens", lambda o: o.dispatch(num_worst_tokens=-1)),
    ("num_worst_tokens float", "num_worst_tokens", lambda o: o.dispatch(num_worst_tokens=8.0)),
    ("num_worst_tokens < N", "num_worst_tokens", lambda o: o.dispatch(num_worst_tokens=2)),
    ("config str", "config", lambda o: o.dispatch(config="fast")),
    ("config class", "config", lambda o: o.dispatch(config=Config)),
    ("previous_event", "previous_event", lambda o: o.dispatch(previous_event=object())),
    ("allocate_on_comm_stream without async_finish", "allocate_on_comm_stream",
     lambda o: o.dispatch(allocate_on_comm_stream=True, previous_event=Buffer.capture())),
    ("allocate_on_comm_stream without previous_event", "allocate_on_comm_stream",
     lambda o: o.dispatch(allocate_on_comm_stream=True, async_finish=True)),
    # cached dispatch
    ("handle tuple", "handle", lambda o: o.cached(handle=tuple(o.handle))),
    ("handle of two ranks", "handle", lambda o: o.cached(handle=o.two_ranks)),
    ("cached x rows", "x", lambda o: o.cached(x=torch.zeros(5, 128, dtype=torch.bfloat16))),
    ("cached with topk_idx", "topk_idx", lambda o: o.cached(topk_idx=o.idx)),
    ("cached with topk_weights", "topk_weights", lambda o: o.cached(topk_weights=o.w)),
    # combine
    ("combine x float32", "x", lambda o: o.combine(x=o.y.float())),
    ("combine x rows", "x", lambda o: o.combine(x=torch.ones(o.n + 1, o.h, dtype=torch.bfloat16))),
    ("combine x 1-D", "x", lambda o: o.combine(x=o.y.flatten())),
    ("combine x list", "x", lambda o: o.combine(x=o.y.tolist())),
    ("combine x fp8 tuple", "x", lambda o: o.combine(x=(o.y.to(torch.float8_e4m3fn), torch.ones(o.n, 1)))),
    ("combine handle tuple", "handle", lambda o: o.combine(handle=tuple(o.handle))),
    ("combine handle None", "handle", lambda o: o.combine(handle=None)),
    ("combine handle of two ranks", "handle", lambda o: o.combine(handle=o.two_ranks)),
    ("combine topk_weights float64", "topk_weights", lambda o: o.combine(topk_weights=torch.zeros(o.n, 2).double())),
    ("combine topk_weights rows", "topk_weights", lambda o: o.combine(topk_weights=torch.zeros(o.n + 1, 2))),
    ("combine topk_weights 1-D", "topk_weights", lambda o: o.combine(topk_weights=torch.zeros(o.n))),
    ("bias float32", "bias", lambda o: o.combine(bias=o.bias.float())),
    ("bias hidden", "bias", lambda o: o.combine(bias=torch.zeros(4, 129, dtype=torch.bfloat16))),
    ("bias rows", "bias", lambda o: o.combine(bias=torch.zeros(5, 128, dtype=torch.bfloat16))),
    ("bias str", "bias", lambda o: o.combine(bias="zeros")),
    ("bias tuple of 3", "bias", lambda o: o.combine(bias=(o.bias, o.bias, o.bias))),
    ("bias tuple of 1", "bias", lambda o: o.combine(bias=(o.bias,))),
    ("bias[0] shape", "bias[0]", lambda o: o.combine(bias=(o.bias[:, :64], None))),
    ("bias[1] shape, bias[0] given", "bias[1]", lambda o: o.combine(bias=(o.bias, o.bias[:, :64]))),
    ("bias[1] shape, bias[0] None", "bias[1]", lambda o: o.combine(bias=(None, o.bias[:, :64]))),
    ("combine config", "config", lambda o: o.combine(config=1)),
    ("combine previous_event", "previous_event", lambda o: o.combine(previous_event="event")),
    ("combine allocate_on_comm_stream", "allocate_on_comm_stream",
     lambda o: o.combine(allocate_on_comm_stream=True)),
    # get_next_combine_buffer
    ("combine buffer handle tuple", "handle", lambda o: o.buf.get_next_combine_buffer(tuple(o.handle), o.h)),
    ("combine buffer hidden 0", "hidden", lambda o: o.buf.get_next_combine_buffer(o.handle, 0)),
    ("combine buffer hidden float", "hidden", lambda o: o.buf.get_next_combine_buffer(o.handle, 128.0)),
]


@pytest.mark.parametrize(("name", "call"), [(n, c) for _, n, c in BAD_ARGUMENTS],
                         ids=[label for label, _, _ in BAD_ARGUMENTS])
def test_bad_argument_is_a_value_error_naming_it(name: str, call: Callable[[One], Any]) -> None:
    one = One()
    with pytest.raises(ValueError, match=names(name)):
        call(one)
    # The Buffer still works after the refusal.
    assert one.combine()[0].shape == (one.t, one.h)


def test_the_valid_call_of_the_bad_argument_table() -> None:
    """The call that BAD_ARGUMENTS spoils is valid, in each of its forms (so each case fails for its
    one argument): fp8 x with [T, 1] scales, a cached dispatch, a combine with every option."""
    one = One()
    recv_x, recv_idx, recv_w, counts, handle, _ = one.dispatch(x=one.fp8, config=Config(), expert_alignment=2,
                                                               num_worst_tokens=3)
    assert recv_x[0].shape == (3, 128) and recv_x[1].shape == (3, 1) and counts == []
    assert recv_idx.tolist() == [[0, 3], [2, -1], [1, 0]] and recv_w[1].tolist() == [1.0, 0.0]
    assert handle.recv_src_idx.tolist() == [0, 1, 3]
    assert one.dispatch(x=torch.zeros(4, 8, dtype=torch.bfloat16))[0].shape == (3, 8)  # 16-byte rows
    assert one.dispatch(x=(torch.zeros(4, 16, dtype=torch.float8_e4m3fn), torch.ones(4)))[0][1].shape == (3,)
    assert one.cached(config=Config())[0].shape == (3, 128)
    out, weights, _ = one.combine(topk_weights=torch.ones(3, 2), bias=(one.bias, one.bias), config=Config())
    assert out.shape == (4, 128) and weights.tolist()[2] == [0.0, 0.0] and weights.tolist()[0] == [1.0, 1.0]


def test_buffers_refuse_the_other_mode() -> None:
    """num_nvl_bytes=0: normal calls are a RuntimeError; low_latency_mode=False: low-latency calls are;
    a Buffer with both runs both; after destroy() everything is a RuntimeError."""
    one = One()
    ll = Buffer(None, low_latency_mode=True, backend="reference")
    for call in (lambda: ll.get_dispatch_layout(one.idx, 4), lambda: dispatch_fresh(ll, one.x, one.layout),
                 lambda: ll.combine(one.y, one.handle)):
        with pytest.raises(RuntimeError, match="num_nvl_bytes"):
            call()
    for call in (lambda: one.buf.low_latency_dispatch(one.x, one.idx, 4, 4),
                 lambda: one.buf.clean_low_latency_buffer(4, 128, 4)):
        with pytest.raises(RuntimeError, match="low_latency_mode"):
            call()
    both = Buffer(None, num_nvl_bytes=NVL_BYTES, low_latency_mode=True, backend="reference")
    recv = dispatch_fresh(both, one.x, both.get_dispatch_layout(one.idx, 4), topk_idx=one.idx)
    assert recv[0].shape == (3, 128)
    assert both.low_latency_dispatch(one.x, one.idx, 4, 4, use_fp8=False)[1].tolist() == [2, 1, 1, 1]
    one.buf.destroy()
    for call in (lambda: one.get_layout(), lambda: one.dispatch(), lambda: one.combine()):
        with pytest.raises(RuntimeError, match="destroy"):
            call()
    with pytest.raises(ValueError, match=names("num_nvl_bytes")):
        Buffer(None, num_nvl_bytes=-1, low_latency_mode=False, backend="reference")


# ==================================================================================== Config
def test_config_defaults_and_checks() -> None:
    c = Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 256)
    assert isinstance(Buffer.get_dispatch_config(8), Config) and isinstance(Buffer.get_combine_config(2), Config)
    for kwargs, name in (({"num_sms": -1}, "num_sms"), ({"num_sms": 2.0}, "num_sms"),
                         ({"num_max_nvl_chunked_send_tokens": 256}, "num_max_nvl_chunked_send_tokens"),
                         ({"num_max_nvl_chunked_send_tokens": 0}, "num_max_nvl_chunked_send_tokens"),
                         ({"num_max_nvl_chunked_recv_tokens": "256"}, "num_max_nvl_chunked_recv_tokens"),
                         ({"num_max_rdma_chunked_send_tokens": 129}, "num_max_rdma_chunked_send_tokens"),
                         ({"num_max_rdma_chunked_recv_tokens": -2}, "num_max_rdma_chunked_recv_tokens")):
        with pytest.raises(ValueError, match=names(name)):
            Config(**kwargs)


def test_nvl_buffer_size_hint() -> None:
    """Positive multiples of 128 bytes that hold two staging halves of Config.tokens_per_call tokens (10,240
    with DeepEP's defaults, more with larger rings) of rows of hidden_bytes with FP8 scales, 16 top-k ids and
    weights, as the cuda backend stages them (its own formula, csrc/normal.cuh, written out here), for the
    ranks of one node (more ranks are not all NVLink peers: the hint stays the 8-rank one); the hint is a
    valid num_nvl_bytes; bad arguments are ValueErrors."""
    c = Config()
    assert c.tokens_per_call == 10 * 256 * 4 and Config(num_sms=24).tokens_per_call == 12 * 256 * 4
    for hb in (16, 256, 2048, 7168 * 2):
        row = -(-hb // 16) * 16 + -(-(hb // 128 * 4) // 16) * 16 + 128 + 64
        for r in range(1, 9):
            hint = c.get_nvl_buffer_size_hint(hb, r)
            assert type(hint) is int and hint > 0 and hint % 128 == 0, (hb, r, hint)
            half = -(-(8192 + 10240 * row) // 128) * 128 + 10240 * r
            assert (hint - 4096) // 2 >= half, (hb, r, hint)
            assert hint < 4096 + 2 * half + 3 * 128, (hb, r, hint)  # no more than alignment beyond that
        assert all(c.get_nvl_buffer_size_hint(hb, r) == c.get_nvl_buffer_size_hint(hb, 8) for r in (9, 16, 64))
    assert Config(num_max_nvl_chunked_recv_tokens=512).get_nvl_buffer_size_hint(2048, 8) > \
        c.get_nvl_buffer_size_hint(2048, 8)
    hint = c.get_nvl_buffer_size_hint(256, 1)
    Buffer(None, num_nvl_bytes=hint, low_latency_mode=False, backend="reference").destroy()
    for args, name in (((0, 8), "hidden_bytes"), ((-16, 8), "hidden_bytes"), ((16.0, 8), "hidden_bytes"),
                       ((True, 8), "hidden_bytes"), ((256, 0), "num_ranks"), ((256, -2), "num_ranks"),
                       ((256, 2.0), "num_ranks"), ((256, None), "num_ranks")):
        with pytest.raises(ValueError, match=names(name)):
            c.get_nvl_buffer_size_hint(*args)


def test_rdma_buffer_size_hint() -> None:
    """0 inside one node (up to 8 ranks); NotImplementedError across nodes; bad arguments ValueErrors."""
    c = Config()
    assert all(c.get_rdma_buffer_size_hint(hb, r) == 0 for hb in (16, 7168 * 2) for r in range(1, 9))
    for r in (9, 16, 64):
        with pytest.raises(NotImplementedError):
            c.get_rdma_buffer_size_hint(7168 * 2, r)
    for args, name in (((0, 8), "hidden_bytes"), ((1.5, 8), "hidden_bytes"), ((256, 0), "num_ranks"),
                       ((256, -1), "num_ranks")):
        with pytest.raises(ValueError, match=names(name)):
            c.get_rdma_buffer_size_hint(*args)

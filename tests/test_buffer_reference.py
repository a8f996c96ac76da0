"""`ep_layer.Buffer` with the reference backend on 1, 2 and 4 gloo ranks, against independent oracles.

Every rank draws its own random inputs (fresh seed per run, named in every assertion message), the
group all-gathers them, and a plain-Python loop computes what docs/design.md section 2 says each rank must
receive: rows per local expert ordered by (source rank, token), src_info, layout_range, the bf16 rows
or the FP8 bytes and scales (numpy oracle in fp8_oracle.py), and each token's combined output
(float64 weighted sum). The rank functions run in child processes through dist_harness.run_ranks;
world size 1 without any process group runs them in the pytest process itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from fp8_oracle import cast_to_fp8, f32_to_bf16_bits, random_bf16_bits

from ep_layer import Buffer, EPTimeoutError, EventOverlap

MODES: dict[str, dict[str, bool]] = {
    "bf16": {"use_fp8": False},
    "fp8": {"use_fp8": True},
    "fp8_round": {"use_fp8": True, "round_scale": True},
    "ue8m0": {"use_fp8": True, "round_scale": True, "use_ue8m0": True},
}
HIDDENS = (128, 256, 512, 1024)


# ==================================================================================== group plumbing
class Group:
    """The EP group a rank works in and how to all-gather over it.

    kind: "none" (no torch.distributed at all, Buffer(None)), "world" (Buffer(dist.group.WORLD)),
    "default" (Buffer(None) with the default group initialised) or "pairs" (two groups of the even
    and the odd ranks, so that group ranks differ from global ranks).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.color = 0
        if kind == "none":
            assert not dist.is_initialized()
            self.pg, self.buffer_group, self.rank, self.size = None, None, 0, 1
            return
        world = dist.get_world_size()
        if kind == "pairs":
            groups = [dist.new_group([r for r in range(world) if r % 2 == c]) for c in range(2)]
            self.color = dist.get_rank() % 2
            self.pg = groups[self.color]
        else:
            self.pg = dist.group.WORLD
        self.buffer_group = None if kind == "default" else self.pg
        self.rank, self.size = dist.get_rank(self.pg), dist.get_world_size(self.pg)

    def buffer(self, **kwargs: Any) -> Buffer:
        return Buffer(self.buffer_group, low_latency_mode=True, backend="reference", **kwargs)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """all_gather of equal-shaped tensors (as raw bytes, which gloo moves for any dtype)."""
        if self.pg is None:
            return [t.clone()]
        src = t.contiguous().view(torch.uint8)
        out = [torch.empty_like(src) for _ in range(self.size)]
        dist.all_gather(out, src, group=self.pg)
        return [o.view(t.dtype) for o in out]

    def gather_rows(self, t: torch.Tensor, max_rows: int) -> list[torch.Tensor]:
        """all_gather of [n, ...] tensors whose n differs by rank (n <= max_rows)."""
        n = torch.tensor([t.shape[0]], dtype=torch.int64)
        counts = [int(c) for c in self.gather(n)]
        padded = torch.zeros((max_rows, *t.shape[1:]), dtype=t.dtype)
        padded[: t.shape[0]] = t
        return [p[:c] for p, c in zip(self.gather(padded), counts)]

    def barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)


def to_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def bits_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ==================================================================================== one dispatch's data
class Case:
    """One rank's inputs for one dispatch, the gathered inputs of the whole group, and the oracle.

    Config (T, H, K, E) comes from a generator shared by the group; x, topk_idx and topk_weights from
    one private to the rank. Some ranks get N = 0, some top-k entries are -1.
    """

    def __init__(self, grp: Group, seed: int, tag: tuple[int, ...], *, t: int | None = None,
                 h: int | None = None, k: int | None = None, num_local: int | None = None,
                 n: int | None = None, busy: bool = False) -> None:
        shared = np.random.default_rng([seed, grp.color, *tag])
        mine = np.random.default_rng([seed, grp.color, *tag, 1 + grp.rank])
        self.grp, self.seed, self.tag = grp, seed, tag
        r = grp.size
        self.t = t if t is not None else int(shared.integers(1, 9))
        self.h = h if h is not None else int(shared.choice(HIDDENS))
        self.k = k if k is not None else int(shared.integers(1, 10))
        if num_local is None:
            num_local = int(shared.integers(1, 5))
        num_local = max(num_local, -(-self.k // r))  # E >= K: a token's K experts are distinct
        self.num_local, self.e = num_local, num_local * r
        drop = float(shared.choice([0.0, 0.1, 0.4, 1.0], p=[0.3, 0.3, 0.35, 0.05]))
        empty_rank = int(shared.integers(0, 2 * r))  # this rank (if < r) sends nothing
        if busy:  # surely some traffic: every rank sends tokens, every token has K experts
            drop, empty_rank = 0.0, -1
        if n is None:
            n = 0 if grp.rank == empty_rank else int(mine.integers(int(busy), self.t + 1))
        self.n = n
        self.x_bits = random_bf16_bits(mine, n, self.h)
        idx = np.stack([mine.permutation(self.e)[: self.k] for _ in range(n)]) if n else np.zeros(
            (0, self.k), dtype=np.int64)
        idx[mine.random(idx.shape) < drop] = -1
        self.idx = idx.astype(np.int64)
        self.w = mine.uniform(-1, 1, (n, self.k)).astype(np.float32)
        self.x = to_bf16(self.x_bits)
        self.topk_idx = torch.from_numpy(self.idx.copy())
        self.topk_weights = torch.from_numpy(self.w.copy())
        # What every rank really passed, as the group sees it.
        self.xs = [bf16_bits(g) for g in grp.gather_rows(self.x, self.t)]
        self.idxs = [g.numpy() for g in grp.gather_rows(self.topk_idx, self.t)]
        # rows[r][l] = [(source rank, token), ...] that rank r's local expert l receives, in order.
        self.rows = [self._oracle_rows(dest) for dest in range(r)]
        self._fp8: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def msg(self, what: str = "") -> str:
        return (f"seed={self.seed} case={self.tag} group={self.grp.kind} rank={self.grp.rank}/"
                f"{self.grp.size} T={self.t} H={self.h} K={self.k} E={self.e} N={self.n} {what}")

    def _oracle_rows(self, dest: int) -> list[list[tuple[int, int]]]:
        rows: list[list[tuple[int, int]]] = []
        for local in range(self.num_local):
            expert = dest * self.num_local + local
            rows.append([(s, tok) for s, idx in enumerate(self.idxs) for tok in range(idx.shape[0])
                         if expert in idx[tok].tolist()])
        return rows

    def dispatch(self, buf: Buffer, mode: str, x: torch.Tensor | None = None, **kwargs: Any) -> tuple:
        return buf.low_latency_dispatch(self.x if x is None else x, self.topk_idx, self.t, self.e,
                                        **MODES[mode], **kwargs)

    # ------------------------------------------------------------------ dispatch oracle
    def check_dispatch(self, recv_x: Any, recv_count: torch.Tensor, handle: tuple, mode: str) -> None:
        r, el, rows_total, my_rows = self.grp.size, self.num_local, self.grp.size * self.t, self.rows[
            self.grp.rank]
        m = self.msg(f"mode={mode}")
        assert recv_count.dtype == torch.int32 and tuple(recv_count.shape) == (el,), m
        assert recv_count.tolist() == [len(rows) for rows in my_rows], f"{m}: recv_count"
        assert isinstance(handle, tuple) and len(handle) == 5, m
        src_info, layout_range, *sizes = handle
        assert sizes == [self.t, self.h, self.e], f"{m}: handle sizes {sizes}"
        assert src_info.dtype == torch.int32 and tuple(src_info.shape) == (el, rows_total), m
        assert layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (el, r), m
        for local, rows in enumerate(my_rows):
            assert src_info[local, : len(rows)].tolist() == [tok for _, tok in rows], f"{m}: src_info[{local}]"
            want_range = []
            for s in range(r):
                begin = sum(1 for src, _ in rows if src < s)
                count = sum(1 for src, _ in rows if src == s)
                want_range.append((begin << 32) | count)
            assert layout_range[local].tolist() == want_range, f"{m}: layout_range[{local}]"
        if mode == "bf16":
            assert isinstance(recv_x, torch.Tensor), m
            assert recv_x.dtype == torch.bfloat16 and tuple(recv_x.shape) == (el, rows_total, self.h), m
            for local, rows in enumerate(my_rows):
                got = bf16_bits(recv_x[local, : len(rows)])
                assert np.array_equal(got, self._stack([self.xs[s][tok] for s, tok in rows])), \
                    f"{m}: recv_x rows of local expert {local}"
            return
        data, scales = recv_x
        flags = MODES[mode]
        ue8m0 = flags.get("use_ue8m0", False)
        cols = self.h // (512 if ue8m0 else 128)
        assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (el, rows_total, self.h), m
        assert scales.dtype == (torch.int32 if ue8m0 else torch.float32), m
        assert tuple(scales.shape) == (el, rows_total, cols), m
        # Column-major in the last two dims: [E_l, G, R*T] storage, transposed.
        assert scales.stride() == (cols * rows_total, 1, rows_total), f"{m}: scales strides {scales.stride()}"
        oracle = self._fp8_oracle(mode)
        for local, rows in enumerate(my_rows):
            n = len(rows)
            want_data = self._stack([oracle[s][0][tok] for s, tok in rows], np.uint8)
            assert np.array_equal(data[local, :n].contiguous().view(torch.uint8).numpy(), want_data), \
                f"{m}: fp8 data of local expert {local}"
            want_scales = self._stack([oracle[s][1][tok].view(np.uint32) for s, tok in rows], np.uint32, cols)
            got_scales = scales[local, :n].contiguous().numpy().view(np.uint32)
            assert np.array_equal(got_scales, want_scales), f"{m}: scales of local expert {local}"

    def _fp8_oracle(self, mode: str) -> list[tuple[np.ndarray, np.ndarray]]:
        if mode not in self._fp8:
            flags = MODES[mode]
            self._fp8[mode] = [cast_to_fp8(x, flags.get("round_scale", False), flags.get("use_ue8m0", False))
                               for x in self.xs]
        return self._fp8[mode]

    def _stack(self, rows: list[np.ndarray], dtype: Any = np.uint16, width: int | None = None) -> np.ndarray:
        return np.stack(rows) if rows else np.zeros((0, width or self.h), dtype=dtype)

    # ------------------------------------------------------------------ combine oracle
    def expert_outputs(self, tag: int) -> tuple[torch.Tensor, list[np.ndarray]]:
        """Random bf16 expert outputs [E_l, R*T, H] (rows past recv_count random too), and everyone's."""
        rng = np.random.default_rng([self.seed, self.grp.color, *self.tag, 1000 + tag, self.grp.rank])
        shape = (self.num_local, self.grp.size * self.t, self.h)
        y = to_bf16(f32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32)))
        return y, [bf16_bits(g) for g in self.grp.gather(y)]

    def check_combine(self, out: torch.Tensor, ys: list[np.ndarray], what: str) -> None:
        """out[t] vs sum_k w[t,k] * y(expert, t) in float64.

        Tolerance: the library accumulates in float32 (K products and K additions, each within
        2**-24 relative: at most K * 2**-23 * sum|w y| together) and rounds once to bf16 (2**-8
        relative). So |out - S| <= 2**-8 |S| + K * 2**-22 * sum_k |w_k y_k|; tokens without experts
        must come out exactly 0.
        """
        m = self.msg(what)
        assert out.dtype == torch.bfloat16 and tuple(out.shape) == (self.n, self.h), m
        pos = [[{src_tok: i for i, src_tok in enumerate(rows)} for rows in dest] for dest in self.rows]
        exact = np.zeros((self.n, self.h))
        magnitude = np.zeros((self.n, self.h))
        for tok in range(self.n):
            for k in range(self.k):
                expert = int(self.idx[tok, k])
                if expert < 0:
                    continue
                dest, local = divmod(expert, self.num_local)
                row = pos[dest][local][(self.grp.rank, tok)]
                term = float(self.w[tok, k]) * bits_f64(ys[dest][local, row])
                exact[tok] += term
                magnitude[tok] += np.abs(term)
        got = bits_f64(bf16_bits(out))
        err = np.abs(got - exact)
        tol = 2.0 ** -8 * np.abs(exact) + self.k * 2.0 ** -22 * magnitude
        bad = np.argwhere(err > tol)
        assert not len(bad), (f"{m}: combine off at {len(bad)} elements, first {tuple(bad[0])}: "
                              f"got {got[tuple(bad[0])]!r}, want {exact[tuple(bad[0])]!r}")

    def combine(self, buf: Buffer, y: torch.Tensor, handle: tuple, **kwargs: Any) -> tuple:
        return buf.low_latency_combine(y, self.topk_idx, self.topk_weights, handle, **kwargs)


def valid_rows(recv_x: Any, recv_count: torch.Tensor) -> list[np.ndarray]:
    """The specified part of a dispatch result (rows below recv_count) as raw bytes, for bitwise compares."""
    parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    out = []
    for part in parts:
        for local, n in enumerate(recv_count.tolist()):
            out.append(part[local, :n].clone(memory_format=torch.contiguous_format).view(torch.uint8).numpy())
    return out


def dispatch_state(result: tuple) -> list[np.ndarray]:
    recv_x, recv_count, handle = result[:3]
    src_info, layout_range = handle[:2]
    counts = recv_count.tolist()
    src = [src_info[local, :n].numpy().copy() for local, n in enumerate(counts)]
    return [recv_count.numpy().copy(), layout_range.numpy().copy(), *src, *valid_rows(recv_x, recv_count)]


def assert_same(a: list[np.ndarray], b: list[np.ndarray], msg: str) -> None:
    assert len(a) == len(b), msg
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.shape == v.shape and np.array_equal(u, v), f"{msg} (part {i})"


# ==================================================================================== rank functions
def rank_random_rounds(rank: int, world: int, kind: str, seed: int, rounds: int) -> int:
    """Random configurations; every mode; dispatch and combine checked against the oracles."""
    grp = Group(kind)
    buf = grp.buffer()
    received = 0
    for it in range(rounds):
        case = Case(grp, seed, (it,), busy=it == rounds - 1)
        for mode in MODES:
            if mode == "ue8m0" and case.h % 512:
                continue
            recv_x, recv_count, handle, event, hook = case.dispatch(buf, mode)
            assert event is None and hook is None, case.msg(mode)
            case.check_dispatch(recv_x, recv_count, handle, mode)
            y, ys = case.expert_outputs(0)
            out, event, hook = case.combine(buf, y, handle)
            assert event is None and hook is None, case.msg(mode)
            case.check_combine(out, ys, f"mode={mode}")
            received += int(recv_count.sum())
    return received


def rank_api_paths(rank: int, world: int, kind: str, seed: int) -> None:
    """Hooks, async_finish, two outstanding dispatches, zero_copy, out=, reruns, stats, clean."""
    grp = Group(kind)
    buf = grp.buffer()
    r = grp.size
    a = Case(grp, seed, (1,), t=6, h=512, k=4, num_local=3)
    b = Case(grp, seed, (2,), t=5, h=512, k=3, num_local=3)
    c = Case(grp, seed, (3,), t=6, h=512, k=4, num_local=3)
    ya, yas = a.expert_outputs(0)
    yb, ybs = b.expert_outputs(0)
    rng = np.random.default_rng([seed, grp.color, 99, grp.rank])
    recv_stats = torch.from_numpy(rng.integers(0, 1000, a.num_local).astype(np.int32))
    want_recv_stats = recv_stats.clone()
    dispatch_wait = torch.zeros(r, dtype=torch.int64)
    combine_wait = torch.zeros(r, dtype=torch.int64)
    waits = {"dispatch": [dispatch_wait.clone()], "combine": [combine_wait.clone()]}

    def stats() -> dict[str, Any]:
        return {"cumulative_local_expert_recv_stats": recv_stats, "dispatch_wait_recv_cost_stats": dispatch_wait}

    def noted(result: tuple) -> tuple:
        want_recv_stats.add_(result[1])
        waits["dispatch"].append(dispatch_wait.clone())
        return result

    for mode in ("bf16", "ue8m0", "fp8"):
        m = a.msg(mode)
        # Plain, and its rerun: bit-identical.
        plain = noted(a.dispatch(buf, mode, **stats()))
        a.check_dispatch(*plain[:3], mode)
        plain_out = a.combine(buf, ya, plain[2], combine_wait_recv_cost_stats=combine_wait)[0]
        waits["combine"].append(combine_wait.clone())
        a.check_combine(plain_out, yas, f"mode={mode} plain")
        rerun = noted(a.dispatch(buf, mode, **stats()))
        assert_same(dispatch_state(plain), dispatch_state(rerun), f"{m}: rerun dispatch differs")
        rerun_out = a.combine(buf, ya, rerun[2])[0]
        assert torch.equal(rerun_out.view(torch.int16), plain_out.view(torch.int16)), f"{m}: rerun combine"

        # Hooks: the send half returns, hook() completes it; same bits as the plain path.
        hooked = a.dispatch(buf, mode, return_recv_hook=True, **stats())
        assert hooked[3] is None and callable(hooked[4]), m
        hooked[4]()
        noted(hooked)
        assert_same(dispatch_state(plain), dispatch_state(hooked), f"{m}: hook dispatch differs")
        out, event, hook = a.combine(buf, ya, hooked[2], return_recv_hook=True)
        assert event is None and callable(hook), m
        hook()
        assert torch.equal(out.view(torch.int16), plain_out.view(torch.int16)), f"{m}: hook combine differs"

        # async_finish: an EventOverlap that holds the inputs; same bits.
        asynced = a.dispatch(buf, mode, async_finish=True, **stats())
        noted(asynced)
        event = asynced[3]
        assert isinstance(event, EventOverlap) and asynced[4] is None, m
        assert any(t is a.x for t in event.extra_tensors), m
        event.current_stream_wait()
        with event:
            pass
        assert_same(dispatch_state(plain), dispatch_state(asynced), f"{m}: async dispatch differs")
        out, event, hook = a.combine(buf, ya, asynced[2], async_finish=True)
        assert isinstance(event, EventOverlap) and hook is None, m
        event.current_stream_wait()
        assert torch.equal(out.view(torch.int16), plain_out.view(torch.int16)), f"{m}: async combine differs"

        # out= is written in place and returned; zero_copy reads get_next_low_latency_combine_buffer.
        given = torch.full((a.n, a.h), 7.0, dtype=torch.bfloat16)
        plain_handle = asynced[2]  # plain and rerun are no longer outstanding
        ret = a.combine(buf, ya, plain_handle, out=given)[0]
        assert ret is given, m
        assert torch.equal(given.view(torch.int16), plain_out.view(torch.int16)), f"{m}: out= differs"
        zc = buf.get_next_low_latency_combine_buffer(plain_handle)
        assert zc.dtype == torch.bfloat16 and tuple(zc.shape) == (a.num_local, r * a.t, a.h), m
        zc.copy_(ya)
        zc_out = a.combine(buf, torch.zeros_like(ya), plain_handle, zero_copy=True)[0]
        assert torch.equal(zc_out.view(torch.int16), plain_out.view(torch.int16)), f"{m}: zero_copy differs"

    # Two outstanding dispatches (A then B, both with hooks, hooks in order), combines B then A.
    for mode in ("bf16", "fp8_round"):
        plain_a = a.dispatch(buf, mode)
        out_a = a.combine(buf, ya, plain_a[2])[0]
        plain_b = b.dispatch(buf, mode)
        out_b = b.combine(buf, yb, plain_b[2])[0]
        da = a.dispatch(buf, mode, return_recv_hook=True)
        db = b.dispatch(buf, mode, return_recv_hook=True)
        da[4]()
        db[4]()
        assert_same(dispatch_state(plain_a), dispatch_state(da), a.msg(f"{mode}: outstanding A"))
        assert_same(dispatch_state(plain_b), dispatch_state(db), b.msg(f"{mode}: outstanding B"))
        ob, _, hook_b = b.combine(buf, yb, db[2], return_recv_hook=True)
        oa, _, hook_a = a.combine(buf, ya, da[2], return_recv_hook=True)
        hook_b()
        hook_a()
        assert torch.equal(ob.view(torch.int16), out_b.view(torch.int16)), b.msg(f"{mode}: outstanding B combine")
        assert torch.equal(oa.view(torch.int16), out_a.view(torch.int16)), a.msg(f"{mode}: outstanding A combine")
        b.check_combine(ob, ybs, f"{mode}: outstanding B")

        # Zero-copy buffers of the two outstanding dispatches are distinct.
        da = a.dispatch(buf, mode)
        db = b.dispatch(buf, mode)
        za, zb = buf.get_next_low_latency_combine_buffer(da[2]), buf.get_next_low_latency_combine_buffer(db[2])
        assert za.data_ptr() != zb.data_ptr(), a.msg(mode)
        za.copy_(ya)
        zb.copy_(yb)
        ob = b.combine(buf, torch.empty_like(yb), db[2], zero_copy=True)[0]
        oa = a.combine(buf, torch.empty_like(ya), da[2], zero_copy=True)[0]
        assert torch.equal(ob.view(torch.int16), out_b.view(torch.int16)), b.msg(f"{mode}: zero_copy B")
        assert torch.equal(oa.view(torch.int16), out_a.view(torch.int16)), a.msg(f"{mode}: zero_copy A")

        # A third dispatch retires the first: its handle is refused (on every rank, before any traffic).
        dc = c.dispatch(buf, mode)
        with raises(ValueError, "handle"):
            a.combine(buf, ya, da[2])
        with raises(ValueError, "handle"):
            buf.get_next_low_latency_combine_buffer(da[2])
        b.check_combine(b.combine(buf, yb, db[2])[0], ybs, f"{mode}: B after C")
        yc, ycs = c.expert_outputs(0)
        c.check_combine(c.combine(buf, yc, dc[2])[0], ycs, f"{mode}: C")

    # clean_low_latency_buffer forgets outstanding dispatches; the buffer keeps working.
    pending = a.dispatch(buf, "bf16")
    buf.clean_low_latency_buffer(a.t, a.h, a.e)
    with raises(ValueError, "handle"):
        a.combine(buf, ya, pending[2])
    fresh = a.dispatch(buf, "bf16")
    a.check_combine(a.combine(buf, ya, fresh[2])[0], yas, "after clean")

    # Stats: recv counts accumulated on every dispatch that passed them; wait costs non-negative
    # int64 that never decrease.
    assert recv_stats.dtype == torch.int32 and torch.equal(recv_stats, want_recv_stats), \
        a.msg(f"cumulative stats {recv_stats.tolist()} != {want_recv_stats.tolist()}")
    for what, snaps in waits.items():
        assert all(s.dtype == torch.int64 and tuple(s.shape) == (r,) for s in snaps), what
        assert all((s >= 0).all() for s in snaps), a.msg(f"{what} wait stats negative")
        assert all((later >= earlier).all() for earlier, later in pairwise(snaps)), a.msg(what)
    buf.destroy()


def rank_wait_stats(rank: int, world: int, seed: int, sleeper: int, nap_s: float) -> None:
    """A rank that arrives late shows up in everyone else's wait-cost entry for it."""
    grp = Group("world")
    buf = grp.buffer()
    case = Case(grp, seed, (7,), t=4, h=256, k=2, num_local=2)
    y, ys = case.expert_outputs(0)
    recv_stats = torch.zeros(case.num_local, dtype=torch.int32)
    dwait = torch.zeros(world, dtype=torch.int64)
    cwait = torch.zeros(world, dtype=torch.int64)
    counts = torch.zeros(case.num_local, dtype=torch.int32)
    for rnd in range(2):
        before_d, before_c = dwait.clone(), cwait.clone()
        grp.barrier()
        if rank == sleeper:
            time.sleep(nap_s)
        res = case.dispatch(buf, "fp8", cumulative_local_expert_recv_stats=recv_stats,
                            dispatch_wait_recv_cost_stats=dwait)
        counts += res[1]
        case.check_dispatch(*res[:3], "fp8")
        grp.barrier()
        if rank == sleeper:
            time.sleep(nap_s)
        out = case.combine(buf, y, res[2], combine_wait_recv_cost_stats=cwait)[0]
        case.check_combine(out, ys, "wait stats")
        for name, now, before in (("dispatch", dwait, before_d), ("combine", cwait, before_c)):
            m = case.msg(f"round {rnd} {name} wait stats {before.tolist()} -> {now.tolist()}")
            assert now.dtype == torch.int64 and (now >= before).all() and (before >= 0).all(), m
            if rank != sleeper:
                assert now[sleeper] - before[sleeper] >= 0.66 * nap_s * 1e9, m
    assert torch.equal(recv_stats, counts), case.msg("cumulative stats")


# ------------------------------------------------------------------------------------ errors
@contextmanager
def raises(exc: type[BaseException], *names: str) -> Iterator[None]:
    """Expect `exc` whose message names at least one of `names` as a whole word."""
    try:
        yield
    except exc as e:
        msg = str(e)
        if names and not any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", msg) for n in names):
            raise AssertionError(f"{type(e).__name__} does not name any of {names}: {msg!r}") from e
    else:
        raise AssertionError(f"expected {exc.__name__} naming {names}, nothing raised")


def error_cases(grp: Group, buf: Buffer, case: Case, other_device: torch.device | None
                ) -> list[tuple[str, type[BaseException], tuple[str, ...], Callable[[], Any]]]:
    """(label, exception, names, call) for every bad input docs/design.md lists (section 2). Every rank makes the same
    mistake, so every rank raises before any traffic."""
    t, h, e, el, r = case.t, case.h, case.e, case.num_local, grp.size
    x, idx, w = case.x, case.topk_idx, case.topk_weights
    n = case.n
    foreign_handle = case.dispatch(grp.buffer(), "bf16")[2]  # from another Buffer on the same group
    handle = case.dispatch(buf, "bf16")[2]
    y = torch.zeros(el, r * t, h, dtype=torch.bfloat16)

    def d(**kw: Any) -> Callable[[], Any]:
        args = {"x": x, "topk_idx": idx, "num_max_dispatch_tokens_per_rank": t, "num_experts": e}
        args.update(kw)
        return lambda: buf.low_latency_dispatch(**args)

    def cmb(**kw: Any) -> Callable[[], Any]:
        args = {"x": y, "topk_idx": idx, "topk_weights": w, "handle": handle}
        args.update(kw)
        return lambda: buf.low_latency_combine(**args)

    too_many = torch.zeros(t + 1, h, dtype=torch.bfloat16)
    bad_ids = idx.clone()
    cases = [
        ("x dtype", ValueError, ("x",), d(x=x.float())),
        ("x 1-D", ValueError, ("x",), d(x=x.reshape(-1))),
        ("x 3-D", ValueError, ("x",), d(x=x.unsqueeze(0))),
        ("x not a tensor", ValueError, ("x",), d(x=x.tolist())),
        ("N > T", ValueError, ("x", "num_max_dispatch_tokens_per_rank"),
         d(x=too_many, topk_idx=torch.zeros(t + 1, case.k, dtype=torch.int64))),
        ("topk dtype", ValueError, ("topk_idx",), d(topk_idx=idx.int())),
        ("topk rows", ValueError, ("topk_idx",), d(topk_idx=torch.zeros(n + 1, case.k, dtype=torch.int64))),
        ("topk 1-D", ValueError, ("topk_idx",), d(topk_idx=idx.reshape(-1))),
        ("topk K=0", ValueError, ("topk_idx",), d(topk_idx=torch.zeros(n, 0, dtype=torch.int64))),
        ("topk K=17", ValueError, ("topk_idx",), d(topk_idx=torch.zeros(n, 17, dtype=torch.int64))),
        ("T=0", ValueError, ("num_max_dispatch_tokens_per_rank",), d(num_max_dispatch_tokens_per_rank=0)),
        ("T float", ValueError, ("num_max_dispatch_tokens_per_rank",),
         d(num_max_dispatch_tokens_per_rank=float(t))),
        ("E=0", ValueError, ("num_experts",), d(num_experts=0)),
        ("E bool", ValueError, ("num_experts",), d(num_experts=True)),
        ("fp8 H=100", ValueError, ("x", "hidden"),
         d(x=torch.zeros(n, 100, dtype=torch.bfloat16), use_fp8=True)),
        ("fp8 H=192", ValueError, ("x", "hidden"),
         d(x=torch.zeros(n, 192, dtype=torch.bfloat16), use_fp8=True)),
        ("ue8m0 H=384", ValueError, ("x", "hidden"),
         d(x=torch.zeros(n, 384, dtype=torch.bfloat16), use_fp8=True, round_scale=True, use_ue8m0=True)),
        ("ue8m0 no round_scale", ValueError, ("use_ue8m0", "round_scale"),
         d(use_fp8=True, round_scale=False, use_ue8m0=True)),
        ("ue8m0 no fp8", ValueError, ("use_ue8m0", "use_fp8"), d(use_fp8=False, round_scale=True, use_ue8m0=True)),
        ("dispatch async+hook", ValueError, ("async_finish", "return_recv_hook"),
         d(async_finish=True, return_recv_hook=True)),
        ("recv stats dtype", ValueError, ("cumulative_local_expert_recv_stats",),
         d(cumulative_local_expert_recv_stats=torch.zeros(el, dtype=torch.int64))),
        ("recv stats shape", ValueError, ("cumulative_local_expert_recv_stats",),
         d(cumulative_local_expert_recv_stats=torch.zeros(el + 1, dtype=torch.int32))),
        ("dispatch wait dtype", ValueError, ("dispatch_wait_recv_cost_stats",),
         d(dispatch_wait_recv_cost_stats=torch.zeros(r, dtype=torch.int32))),
        ("dispatch wait shape", ValueError, ("dispatch_wait_recv_cost_stats",),
         d(dispatch_wait_recv_cost_stats=torch.zeros(r, 1, dtype=torch.int64))),
        # combine
        ("combine x dtype", ValueError, ("x",), cmb(x=y.float())),
        ("combine x shape", ValueError, ("x",), cmb(x=y[:, :-1])),
        ("combine x hidden", ValueError, ("x",), cmb(x=torch.zeros(el, r * t, h + 128, dtype=torch.bfloat16))),
        ("combine topk dtype", ValueError, ("topk_idx",), cmb(topk_idx=idx.int())),
        ("combine N > T", ValueError, ("topk_idx",),
         cmb(topk_idx=torch.zeros(t + 1, case.k, dtype=torch.int64),
             topk_weights=torch.zeros(t + 1, case.k))),
        ("combine weights dtype", ValueError, ("topk_weights",), cmb(topk_weights=w.double())),
        ("combine weights shape", ValueError, ("topk_weights",),
         cmb(topk_weights=torch.zeros(n, case.k + 1))),
        ("combine weights not a tensor", ValueError, ("topk_weights",), cmb(topk_weights=w.tolist())),
        ("out dtype", ValueError, ("out",), cmb(out=torch.zeros(n, h))),
        ("out shape", ValueError, ("out",), cmb(out=torch.zeros(n + 1, h, dtype=torch.bfloat16))),
        ("combine wait dtype", ValueError, ("combine_wait_recv_cost_stats",),
         cmb(combine_wait_recv_cost_stats=torch.zeros(r, dtype=torch.float32))),
        ("combine wait shape", ValueError, ("combine_wait_recv_cost_stats",),
         cmb(combine_wait_recv_cost_stats=torch.zeros(r + 1, dtype=torch.int64))),
        ("combine async+hook", ValueError, ("async_finish", "return_recv_hook"),
         cmb(async_finish=True, return_recv_hook=True)),
        ("combine logfmt", ValueError, ("use_logfmt",), cmb(use_logfmt=True)),
        ("handle garbage", ValueError, ("handle",), cmb(handle=(1, 2, 3))),
        ("handle copied", ValueError, ("handle",), cmb(handle=(handle[0].clone(), *handle[1:]))),
        ("handle of another buffer", ValueError, ("handle",), cmb(handle=foreign_handle)),
    ]
    if n:  # (always, in rank_errors)
        bad_ids[0, 0] = e
        cases.append(("expert id == E", ValueError, ("topk_idx",), d(topk_idx=bad_ids.clone())))
        bad_ids[0, 0] = -2
        cases.append(("expert id == -2", ValueError, ("topk_idx",), d(topk_idx=bad_ids.clone())))
        bad_ids[0, 0] = e + 5
        cases.append(("combine expert id >= E", ValueError, ("topk_idx",), cmb(topk_idx=bad_ids.clone())))
    if r > 1:
        cases.append(("E % R", ValueError, ("num_experts",), d(num_experts=e + 1)))
    if other_device is not None:
        cases += [
            ("x device", ValueError, ("x",), d(x=x.to(other_device))),
            ("topk device", ValueError, ("topk_idx",), d(topk_idx=idx.to(other_device))),
            ("recv stats device", ValueError, ("cumulative_local_expert_recv_stats",),
             d(cumulative_local_expert_recv_stats=torch.zeros(el, dtype=torch.int32, device=other_device))),
            ("dispatch wait device", ValueError, ("dispatch_wait_recv_cost_stats",),
             d(dispatch_wait_recv_cost_stats=torch.zeros(r, dtype=torch.int64, device=other_device))),
            ("combine topk device", ValueError, ("topk_idx",), cmb(topk_idx=idx.to(other_device))),
            ("combine weights device", ValueError, ("topk_weights",), cmb(topk_weights=w.to(other_device))),
            ("out device", ValueError, ("out",),
             cmb(out=torch.zeros(n, h, dtype=torch.bfloat16, device=other_device))),
            ("combine wait device", ValueError, ("combine_wait_recv_cost_stats",),
             cmb(combine_wait_recv_cost_stats=torch.zeros(r, dtype=torch.int64, device=other_device))),
        ]
    return cases


def rank_errors(rank: int, world: int, kind: str, seed: int) -> int:
    grp = Group(kind)
    buf = grp.buffer(timeout_s=20.0)
    case = Case(grp, seed, (11,), t=4, h=256, k=3, num_local=2, n=3)
    # In a process group the backend's device is fixed (CPU for gloo): 'meta' tensors are on the wrong
    # one. Without a group any device goes as long as all tensors share it: topk_idx on 'meta' then.
    other = torch.device("meta")
    failures = []
    cases = error_cases(grp, buf, case, other if grp.size > 1 else None)
    if grp.size == 1:
        cases.append(("topk device differs from x", ValueError, ("topk_idx",),
                      lambda: buf.low_latency_dispatch(case.x, case.topk_idx.to(other), case.t, case.e)))
    for label, exc, names, call in cases:
        try:
            with raises(exc, *names):
                call()
        except AssertionError as e:
            failures.append(f"{label}: {e}")
    assert not failures, case.msg("\n" + "\n".join(failures))

    # Constructor errors; MPI communicators are not implemented, by name. A normal-mode-only Buffer
    # refuses the low-latency calls.
    with raises(NotImplementedError, "comm"):
        Buffer(grp.buffer_group, low_latency_mode=True, comm=object())
    with raises(NotImplementedError, "use_fabric"):
        Buffer(grp.buffer_group, low_latency_mode=True, use_fabric=True)
    # DeepEP's positional order: use_fabric between allow_mnnvl and explicitly_destroy.
    positional = Buffer(grp.buffer_group, 0, 0, True, 24, True, False, False, True, False, backend="reference")
    assert positional.explicitly_destroy and not positional.enable_shrink
    normal_only = Buffer(grp.buffer_group, num_nvl_bytes=1 << 20, low_latency_mode=False, backend="reference")
    with raises(RuntimeError, "low_latency_dispatch", "low_latency_mode=False"):
        normal_only.low_latency_dispatch(case.x, case.topk_idx, case.t, case.e)
    with raises(RuntimeError, "clean_low_latency_buffer", "low_latency_mode=False"):
        normal_only.clean_low_latency_buffer(case.t, case.x.shape[1], case.e)
    for kwargs, names in (({"low_latency_mode": True, "backend": "nccl-ish"}, ("backend",)),
                          ({"low_latency_mode": True, "timeout_s": 0}, ("timeout_s",)),
                          ({"low_latency_mode": True, "num_rdma_bytes": -1}, ("num_rdma_bytes",))):
        with raises(ValueError, *names):
            Buffer(grp.buffer_group, **kwargs)
    if not torch.cuda.is_available():
        with raises(ValueError, "backend"):
            Buffer(grp.buffer_group, low_latency_mode=True, backend="cuda")

    # After all that the buffer still works, and a full check passes.
    y, ys = case.expert_outputs(0)
    res = case.dispatch(buf, "fp8")
    case.check_dispatch(*res[:3], "fp8")
    case.check_combine(case.combine(buf, y, res[2])[0], ys, "after errors")

    # Use after destroy: RuntimeError everywhere; destroy twice is fine.
    handle = res[2]
    buf.destroy()
    buf.destroy()
    for label, call in (("dispatch", lambda: case.dispatch(buf, "bf16")),
                        ("combine", lambda: case.combine(buf, y, handle)),
                        ("combine buffer", lambda: buf.get_next_low_latency_combine_buffer(handle)),
                        ("clean", lambda: buf.clean_low_latency_buffer(case.t, case.h, case.e)),
                        ("check", buf.check)):
        try:
            with raises(RuntimeError, "destroy"):
                call()
        except AssertionError as e:
            failures.append(f"after destroy, {label}: {e}")
    assert not failures, case.msg("\n" + "\n".join(failures))
    return len(cases)


def rank_disagreement(rank: int, world: int, seed: int) -> None:
    """Ranks that call with different T, H, E or FP8 flags: ValueError on every rank, no hang, and the
    group keeps working."""
    grp = Group("world")
    buf = grp.buffer(timeout_s=20.0)
    base = Case(grp, seed, (21,), t=4, h=256, k=2, num_local=2)
    odd = rank == world - 1  # the one rank that differs

    def check_still_works(it: int) -> None:
        case = Case(grp, seed, (22, it))
        mode = "fp8_round" if it % 2 else "bf16"
        res = case.dispatch(buf, mode)
        case.check_dispatch(*res[:3], mode)
        y, ys = case.expert_outputs(0)
        case.check_combine(case.combine(buf, y, res[2])[0], ys, f"after disagreement {it}")

    wide = to_bf16(np.zeros((base.n, 512), dtype=np.uint16))
    scenarios: list[tuple[str, tuple[str, ...], Callable[[], Any]]] = [
        ("T", ("num_max_dispatch_tokens_per_rank",),
         lambda: buf.low_latency_dispatch(base.x, base.topk_idx, base.t + odd, base.e, use_fp8=False)),
        ("H", ("hidden",),
         lambda: buf.low_latency_dispatch(wide if odd else base.x, base.topk_idx, base.t, base.e)),
        ("E", ("num_experts",),
         lambda: buf.low_latency_dispatch(base.x, base.topk_idx, base.t, base.e * (1 + odd))),
        ("use_fp8", ("use_fp8",),
         lambda: buf.low_latency_dispatch(base.x, base.topk_idx, base.t, base.e, use_fp8=not odd)),
        ("round_scale", ("round_scale",),
         lambda: buf.low_latency_dispatch(base.x, base.topk_idx, base.t, base.e, round_scale=odd)),
        ("use_ue8m0", ("use_ue8m0",),
         lambda: buf.low_latency_dispatch(wide, base.topk_idx, base.t, base.e, round_scale=True, use_ue8m0=odd)),
    ]
    failures = []
    for it, (label, names, call) in enumerate(scenarios):
        try:
            with raises(ValueError, *names):
                call()
        except AssertionError as e:
            failures.append(f"{label}: {e}")
        check_still_works(it)

    # Combines of two different outstanding dispatches (their T differs), then the right ones.
    other = Case(grp, seed, (23,), t=base.t + 1, h=base.h, k=base.k, num_local=base.num_local)
    ha = base.dispatch(buf, "bf16")[2]
    hb = other.dispatch(buf, "bf16")[2]
    ya, yas = base.expert_outputs(0)
    yb, ybs = other.expert_outputs(0)
    try:
        with raises(ValueError, "num_max_dispatch_tokens_per_rank"):
            if odd:
                other.combine(buf, yb, hb)
            else:
                base.combine(buf, ya, ha)
    except AssertionError as e:
        failures.append(f"combine T: {e}")
    base.check_combine(base.combine(buf, ya, ha)[0], yas, "combine after disagreement")
    other.check_combine(other.combine(buf, yb, hb)[0], ybs, "combine after disagreement")

    # One rank combines while the others dispatch: all refuse.
    hb = other.dispatch(buf, "bf16")[2]
    try:
        with raises(ValueError):
            if odd:
                other.combine(buf, yb, hb)
            else:
                base.dispatch(buf, "bf16")
    except AssertionError as e:
        failures.append(f"dispatch vs combine: {e}")
    check_still_works(len(scenarios))
    assert not failures, base.msg("\n" + "\n".join(failures))


def rank_timeouts(rank: int, world: int, seed: int, timeout_s: float) -> dict[str, float]:
    """Ranks that never call: the others raise EPTimeoutError naming exactly them, within ~timeout."""
    elapsed = {}
    # Each scenario on its own group: a timed-out exchange leaves transfers posted on its group.
    for scenario, absent in (("dispatch", {world - 1}), ("dispatch2", {1, world - 1}), ("combine", {0})):
        pg = dist.new_group(list(range(world)))
        if scenario == "dispatch2" and world < 3:
            continue
        buf = Buffer(pg, low_latency_mode=True, backend="reference", timeout_s=timeout_s)
        x = torch.ones(2, 128, dtype=torch.bfloat16)
        idx = torch.tensor([[0, world - 1], [world - 1, -1]], dtype=torch.int64)
        handle = None
        if scenario == "combine":
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 2, world, use_fp8=False)
        if rank in absent:
            continue
        start = time.monotonic()
        try:
            if handle is None:
                buf.low_latency_dispatch(x, idx, 2, world, use_fp8=False)
            else:
                buf.low_latency_combine(torch.zeros(1, 2 * world, 128, dtype=torch.bfloat16), idx,
                                        torch.ones(2, 2), handle)
        except EPTimeoutError as e:
            took = time.monotonic() - start
            m = f"seed={seed} rank {rank} {scenario}: {e} after {took:.2f} s"
            assert e.ranks == sorted(absent), m
            assert all(re.search(rf"\b{a}\b", str(e)) for a in absent), m
            assert 0.9 * timeout_s <= took <= timeout_s + 3.0, m
            elapsed[scenario] = took
        else:
            raise AssertionError(f"rank {rank} {scenario}: no EPTimeoutError though ranks {absent} never came")
    return elapsed


# ==================================================================================== pytest entry points
GROUPS = [(1, "none"), (1, "world"), (2, "world"), (2, "default"), (4, "world"), (4, "pairs")]
ROUNDS = {1: 12, 2: 8, 4: 5}


def run(world: int, kind: str, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> list[Any]:
    if kind == "none":
        return [fn(0, 1, kind, *args)]
    return run_ranks(fn, world, kind, *args, timeout_s=timeout_s)


@pytest.mark.parametrize(("world", "kind"), GROUPS, ids=[f"{w}-{k}" for w, k in GROUPS])
def test_dispatch_combine_random(world: int, kind: str, seed: int) -> None:
    received = run(world, kind, rank_random_rounds, seed, ROUNDS[world])
    # Not vacuous: rows did travel (the last round is busy by construction).
    assert sum(received) > 0, f"seed={seed}: no rows received in any round"


@pytest.mark.parametrize(("world", "kind"), GROUPS, ids=[f"{w}-{k}" for w, k in GROUPS])
def test_api_paths(world: int, kind: str, seed: int) -> None:
    run(world, kind, rank_api_paths, seed)


@pytest.mark.parametrize(("world", "kind"), [(1, "none"), (2, "world"), (4, "pairs")])
def test_errors_name_the_argument(world: int, kind: str, seed: int) -> None:
    counts = run(world, kind, rank_errors, seed)
    assert min(counts) >= 40, counts


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_disagree_all_get_value_error(world: int, seed: int) -> None:
    run_ranks(rank_disagreement, world, seed, timeout_s=120.0)


@pytest.mark.parametrize("world", [2, 4])
def test_wait_cost_stats_see_a_late_rank(world: int, seed: int) -> None:
    run_ranks(rank_wait_stats, world, seed, 1, 0.3, timeout_s=60.0)


@pytest.mark.parametrize("world", [2, 4])
def test_missing_rank_times_out_with_its_name(world: int, seed: int) -> None:
    timeout_s = 1.0
    results = run_ranks(rank_timeouts, world, seed, timeout_s, timeout_s=60.0)
    assert results[0], f"seed={seed}: rank 0 saw no timeout scenario"


def test_rdma_size_hint() -> None:
    hint = Buffer.get_low_latency_rdma_size_hint
    base = hint(128, 7168, 4, 256)
    assert isinstance(base, int) and base > 0
    assert hint(256, 7168, 4, 256) > base
    assert hint(128, 7168 + 128, 4, 256) > base
    assert hint(128, 7168, 8, 256) > base
    assert hint(1, 128, 1, 1) > 0
    for t, h, r, e in ((1, 128, 1, 1), (7, 384, 3, 9), (64, 4096, 2, 64)):
        assert hint(t + 1, h, r, e) > hint(t, h, r, e) < hint(t, h * 2, r, e) < hint(t, h * 2, r * 2, e * 2)
    for args, name in (((0, 7168, 8, 256), "num_max_dispatch_tokens_per_rank"),
                       ((1025, 7168, 8, 256), "num_max_dispatch_tokens_per_rank"),
                       ((128.0, 7168, 8, 256), "num_max_dispatch_tokens_per_rank"),
                       ((128, 0, 8, 256), "hidden"),
                       ((128, -128, 8, 256), "hidden"),
                       ((128, 7168, 0, 256), "num_ranks"),
                       ((128, 7168, 8, 0), "num_experts"),
                       ((128, 7168, 8, 257), "num_experts"),
                       ((128, 7168, 8, None), "num_experts")):
        with raises(ValueError, name):
            hint(*args)
    # The hint is a valid num_rdma_bytes, and DeepEP's tuning arguments are accepted.
    Buffer(None, 0, base, True, 24, True, False, False, backend="reference").destroy()


def test_dead_handles_do_not_retire_live_ones(seed: int) -> None:
    """Dropped handles free their tensors, whose ids Python reuses: the two newest dispatches must
    stay combinable whatever ids they get (a regression: an id reused in place kept its old
    position and the newer dispatch was retired first)."""
    grp = Group("none")
    buf = grp.buffer()
    case = Case(grp, seed, (31,), t=2, h=128, k=1, num_local=2, n=2)
    y, ys = case.expert_outputs(0)
    for it in range(300):
        case.dispatch(buf, "bf16")  # dropped at once
        case.dispatch(buf, "bf16")
        a = case.dispatch(buf, "bf16")[2]
        b = case.dispatch(buf, "bf16")[2]
        out = case.combine(buf, y, a)[0]
        if it == 0:
            case.check_combine(out, ys, "dead handles")
        case.combine(buf, y, b)
        del a, b


def test_a_hook_runs_once(seed: int) -> None:
    """A second call of a receive hook raises instead of receiving again (and counting the stats twice);
    the first call's results stay as they were."""
    grp = Group("none")
    buf = grp.buffer()
    case = Case(grp, seed, (31,), t=4, h=128, k=2, num_local=2, n=3)
    stats = torch.zeros(2, dtype=torch.int32)
    recv_x, count, handle, _, hook = case.dispatch(buf, "bf16", return_recv_hook=True,
                                                   cumulative_local_expert_recv_stats=stats)
    hook()
    before = (recv_x.view(torch.int16).clone(), count.clone(), stats.clone())  # bits: unused rows may be NaN
    with raises(RuntimeError, "low_latency_dispatch"):
        hook()
    assert torch.equal(recv_x.view(torch.int16), before[0])
    assert torch.equal(count, before[1]) and torch.equal(stats, before[2])
    assert torch.equal(stats, count), "the expert-load stats counted the one receive"
    y, ys = case.expert_outputs(0)
    out, _, combine_hook = case.combine(buf, y, handle, return_recv_hook=True)
    combine_hook()
    case.check_combine(out, ys, "hooked once")
    with raises(RuntimeError, "low_latency_combine"):
        combine_hook()


@pytest.mark.parametrize("share", [0, 3])
def test_emulated_buffers_check_the_gpu_share_first(share: int) -> None:
    """Checked before any buffer is allocated (or the kernels are needed): runs without a GPU."""
    from ep_layer.emulation import emulated_buffers

    with pytest.raises(ValueError, match=r"gpu_share: expected in \[1, 2\], got " + str(share)):
        emulated_buffers(2, Buffer.get_low_latency_rdma_size_hint(8, 256, 2, 4), gpu_share=share)

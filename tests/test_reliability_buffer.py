"""Faults at the Buffer (docs/reliability.md), reference backend on CPU (the cuda backend's own timeout
tests are in tests/test_buffer_cuda.py):

- a rank that stops calling, after rounds that worked, at dispatch or between dispatch and combine: the
  others raise EPTimeoutError naming exactly that rank, within about timeout_s, instead of hanging;
- bad arguments to every public function of `ep_layer` (its __all__: Buffer and its methods,
  EventOverlap), drawn by hypothesis: each call with one bad argument raises ValueError naming that
  argument (docs/design.md section 2), and the same calls with good arguments work.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ep_layer
from ep_layer import Buffer, EPTimeoutError, EventOverlap
from ep_layer.backends import BACKENDS, resolve_backend
from ep_layer.layout import CONTROL_BYTES

TIMEOUT_S = 1.0
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_MORE = settings(FUZZ, max_examples=400)  # dispatch and combine: ~40 ways each to get an argument wrong


# ---------------------------------------------------------------------------- a rank stops calling
def rank_stops_calling(rank: int, world: int, seed: int, quitter: int) -> dict[str, float]:
    """Three good rounds of dispatch and combine, then `quitter` stops: before a dispatch, or between a
    dispatch and its combine. It sleeps (a hung rank, not a dead one); every other rank must raise
    EPTimeoutError naming it. Returns, per scenario, how long the failing call took."""
    took = {}
    t, h, e, k = 4, 128, 2 * world, 2
    gen = torch.Generator().manual_seed(seed + rank)
    for scenario in ("dispatch", "combine"):
        group = dist.new_group(list(range(world)))  # a timed-out exchange leaves transfers posted on its group
        buf = Buffer(group, low_latency_mode=True, backend="reference", timeout_s=TIMEOUT_S)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        weights = torch.full((t, k), 1.0 / k)
        for _ in range(3):
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
            out, _, _ = buf.low_latency_combine(recv_x, idx, weights, handle)  # identity experts
            torch.testing.assert_close(out, x, rtol=2e-2, atol=2e-2)
        handle = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)[2] if scenario == "combine" else None
        if rank == quitter:
            time.sleep(TIMEOUT_S + 0.5)  # past the others' timeout, then on to the next scenario
            continue
        start = time.monotonic()
        with pytest.raises(EPTimeoutError) as info:
            if handle is None:
                buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
            else:
                buf.low_latency_combine(recv_x, idx, weights, handle)
        took[scenario] = time.monotonic() - start
        msg = f"seed={seed} rank {rank} {scenario}: {info.value} after {took[scenario]:.2f} s"
        assert info.value.ranks == [quitter] and re.search(rf"\b{quitter}\b", str(info.value)), msg
        assert 0.9 * TIMEOUT_S <= took[scenario] <= TIMEOUT_S + 3.0, msg
    return took


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_stops_calling_makes_the_others_time_out(world: int, seed: int) -> None:
    took = run_ranks(rank_stops_calling, world, seed, world - 1, timeout_s=60)
    assert all(len(t) == 2 for t in took[:-1]) and took[-1] == {}, took
    print(f"world {world}: EPTimeoutError after {[round(s, 2) for t in took for s in t.values()]} s "
          f"(timeout_s={TIMEOUT_S})")


# ---------------------------------------------------------------------------- bad arguments
def raises_naming(names: tuple[str, ...], call: Any, label: str = "") -> None:
    """`call()` raises ValueError whose message names one of `names` as a whole word."""
    try:
        call()
    except ValueError as e:
        msg = str(e)
        assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", msg) for n in names), (label, names, msg)
    except Exception as e:
        raise AssertionError(f"{label}: {type(e).__name__}: {e}, expected a ValueError naming one of {names}") from e
    else:
        raise AssertionError(f"{label}: nothing raised, expected a ValueError naming one of {names}")


BAD_SCALARS = [0, -1, -128, True, False, None, 1.5, float("nan"), float("inf"), "8", [8], torch.tensor(8)]


def positive_int(v: Any, limit: int | None = None) -> bool:
    return type(v) is int and v > 0 and (limit is None or v <= limit)


@FUZZ
@given(args=st.tuples(*[st.one_of(st.integers(1, 2048), st.sampled_from(BAD_SCALARS)) for _ in range(4)]))
def test_rdma_size_hint_arguments(args: tuple) -> None:
    t, h, r, e = args
    names = ("num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts")
    valid = (positive_int(t, 1024), positive_int(h), positive_int(r),
             positive_int(e) and (not positive_int(r) or e % r == 0))
    call = lambda: Buffer.get_low_latency_rdma_size_hint(t, h, r, e)  # noqa: E731
    if all(valid):
        assert call() > 0
    else:
        raises_naming((names[valid.index(False)],), call)


@FUZZ
@given(kwargs=st.fixed_dictionaries({}, optional={
    "low_latency_mode": st.sampled_from([True, False, None, 1, "yes"]),
    "num_rdma_bytes": st.one_of(st.integers(0, 1 << 20), st.sampled_from(BAD_SCALARS)),
    "timeout_s": st.one_of(st.floats(1e-3, 1e3), st.sampled_from(BAD_SCALARS)),
    "backend": st.sampled_from(["auto", "reference", "cuda", "nccl", "", None, 3])}))
def test_buffer_constructor_arguments(kwargs: dict) -> None:
    kwargs = {"low_latency_mode": True, **kwargs}
    rdma, timeout = kwargs.get("num_rdma_bytes", 0), kwargs.get("timeout_s", 10.0)
    backend = kwargs.get("backend", "auto")
    # The cuda backend (what "auto" picks where the kernels and a GPU are) needs room past its control block.
    least = CONTROL_BYTES + 1 if backend in BACKENDS and resolve_backend(backend) == "cuda" else 0
    checks = [("num_rdma_bytes", type(rdma) is int and rdma >= least),
              ("timeout_s", type(timeout) in (int, float) and 0 < timeout < math.inf),
              ("backend", backend in ("auto", "reference") or (backend == "cuda" and torch.cuda.is_available()))]
    bad = [name for name, ok in checks if not ok]
    if not bad:
        Buffer(None, **kwargs).destroy()
    else:
        raises_naming(tuple(bad), lambda: Buffer(None, **kwargs))


@FUZZ
@given(v=st.one_of(st.integers(1, 256), st.sampled_from(BAD_SCALARS)))
def test_set_num_sms_argument(v: Any) -> None:
    """An even positive int, as DeepEP asks; it becomes Buffer.num_sms, which configs are built from."""
    before = Buffer.num_sms
    try:
        if positive_int(v) and v % 2 == 0:
            Buffer.set_num_sms(v)
            assert Buffer.num_sms == v == Buffer.get_dispatch_config(8).num_sms == Buffer.get_combine_config(2).num_sms
        else:
            raises_naming(("new_num_sms",), lambda: Buffer.set_num_sms(v))
            assert Buffer.num_sms == before
    finally:
        Buffer.num_sms = before


@FUZZ
@given(args=st.tuples(*[st.one_of(st.integers(1, 16), st.sampled_from(BAD_SCALARS)) for _ in range(3)]))
def test_clean_low_latency_buffer_arguments(args: tuple) -> None:
    t, h, e = args
    buf = Buffer(None, low_latency_mode=True, backend="reference")
    names = ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts")
    valid = (positive_int(t, 1024), positive_int(h), positive_int(e))
    if all(valid):
        buf.clean_low_latency_buffer(t, h, e)
    else:
        raises_naming((names[valid.index(False)],), lambda: buf.clean_low_latency_buffer(t, h, e))


@FUZZ
@given(event=st.sampled_from([None, 0, "event", object()]), extra=st.sampled_from(
    [None, (), [torch.zeros(1)], (torch.zeros(1), torch.ones(2)), 5, "ab", [1, 2], [torch.zeros(1), None]]))
def test_event_overlap_arguments(event: Any, extra: Any) -> None:
    ok_extra = extra is None or (isinstance(extra, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in extra))
    if event is None and ok_extra:
        with EventOverlap(event, extra) as e:  # CPU: nothing to wait for
            assert len(e.extra_tensors) == len(extra or ())
    else:
        raises_naming(("event",) if event is not None else ("extra_tensors",), lambda: EventOverlap(event, extra))


# A dispatch's arguments, drawn at random (one rank, no group); then one of them replaced by a bad value.
@st.composite
def dispatch_case(draw: Any) -> dict[str, Any]:
    t = draw(st.integers(1, 8))
    n = draw(st.integers(0, t))
    e = draw(st.integers(1, 8))
    k = draw(st.integers(1, min(e, 4)))
    fp8 = draw(st.booleans())
    ue8m0 = fp8 and draw(st.booleans())
    h = draw(st.sampled_from([512, 1024] if ue8m0 else [128, 256, 384]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1 << 30)))
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]) if n else torch.zeros(0, k)
    idx = idx.to(torch.int64).masked_fill(torch.rand(idx.shape, generator=gen) < 0.2, -1)
    return {"x": torch.randn(n, h, generator=gen).to(torch.bfloat16), "topk_idx": idx,
            "num_max_dispatch_tokens_per_rank": t, "num_experts": e, "use_fp8": fp8,
            "round_scale": ue8m0 or (fp8 and draw(st.booleans())), "use_ue8m0": ue8m0}


def dispatch_mutations(a: dict[str, Any]) -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    """(label, replaced arguments, names the error may give)."""
    x, idx, t, e = a["x"], a["topk_idx"], a["num_max_dispatch_tokens_per_rank"], a["num_experts"]
    n, h = x.shape
    k = idx.shape[1]
    out = [
        ("x float32", {"x": x.float()}, ("x",)), ("x 1-D", {"x": x.reshape(-1)}, ("x",)),
        ("x 3-D", {"x": x.unsqueeze(0)}, ("x",)), ("x a list", {"x": x.tolist()}, ("x",)),
        ("x None", {"x": None}, ("x",)),
        ("N > T", {"x": torch.zeros(t + 1, h, dtype=torch.bfloat16),
                   "topk_idx": torch.zeros(t + 1, k, dtype=torch.int64)}, ("x", "num_max_dispatch_tokens_per_rank")),
        ("topk int32", {"topk_idx": idx.int()}, ("topk_idx",)),
        ("topk float", {"topk_idx": idx.float()}, ("topk_idx",)),
        ("topk rows", {"topk_idx": torch.zeros(n + 1, k, dtype=torch.int64)}, ("topk_idx",)),
        ("topk 1-D", {"topk_idx": idx.reshape(-1)}, ("topk_idx",)),
        ("topk K=0", {"topk_idx": torch.zeros(n, 0, dtype=torch.int64)}, ("topk_idx",)),
        ("topk K=17", {"topk_idx": torch.zeros(n, 17, dtype=torch.int64)}, ("topk_idx",)),
        ("topk a list", {"topk_idx": idx.tolist()}, ("topk_idx",)),
        ("topk on meta", {"topk_idx": idx.to("meta")}, ("topk_idx",)),
        ("T > 1024", {"num_max_dispatch_tokens_per_rank": 1025}, ("num_max_dispatch_tokens_per_rank",)),
        ("recv stats int64", {"cumulative_local_expert_recv_stats": torch.zeros(e, dtype=torch.int64)},
         ("cumulative_local_expert_recv_stats",)),
        ("recv stats shape", {"cumulative_local_expert_recv_stats": torch.zeros(e + 1, dtype=torch.int32)},
         ("cumulative_local_expert_recv_stats",)),
        ("recv stats a list", {"cumulative_local_expert_recv_stats": [0] * e}, ("cumulative_local_expert_recv_stats",)),
        ("wait stats int32", {"dispatch_wait_recv_cost_stats": torch.zeros(1, dtype=torch.int32)},
         ("dispatch_wait_recv_cost_stats",)),
        ("wait stats shape", {"dispatch_wait_recv_cost_stats": torch.zeros(2, dtype=torch.int64)},
         ("dispatch_wait_recv_cost_stats",)),
        ("async and hook", {"async_finish": True, "return_recv_hook": True}, ("async_finish", "return_recv_hook")),
        ("ue8m0 without round_scale", {"use_fp8": True, "round_scale": False, "use_ue8m0": True},
         ("use_ue8m0", "round_scale")),
        ("ue8m0 without fp8", {"use_fp8": False, "round_scale": True, "use_ue8m0": True}, ("use_ue8m0", "use_fp8")),
        ("fp8 H=100", {"x": torch.zeros(n, 100, dtype=torch.bfloat16), "use_fp8": True}, ("x", "hidden")),
        ("rows in place on the reference backend", {"rows_in_place": True}, ("rows_in_place",)),
    ]
    out += [(f"T={v!r}", {"num_max_dispatch_tokens_per_rank": v}, ("num_max_dispatch_tokens_per_rank",))
            for v in BAD_SCALARS]
    out += [(f"E={v!r}", {"num_experts": v}, ("num_experts",)) for v in BAD_SCALARS]
    if n:
        for bad in (e, e + 7, -2, 1 << 40):
            wrong = idx.clone()
            wrong[0, 0] = bad
            out.append((f"expert id {bad}", {"topk_idx": wrong}, ("topk_idx",)))
    if h % 512:
        out.append(("ue8m0 H not a multiple of 512", {"use_fp8": True, "round_scale": True, "use_ue8m0": True},
                    ("x", "hidden")))
    return out


@FUZZ_MORE
@given(case=dispatch_case(), pick=st.integers(0, 1 << 16))
def test_dispatch_arguments(case: dict[str, Any], pick: int) -> None:
    buf = Buffer(None, low_latency_mode=True, backend="reference")
    recv_count = buf.low_latency_dispatch(**case)[1]
    e = case["num_experts"]
    assert recv_count.shape == (e,) and int(recv_count.sum()) == int((case["topk_idx"] >= 0).sum())
    label, replaced, names = (m := dispatch_mutations(case))[pick % len(m)]
    raises_naming(names, lambda: buf.low_latency_dispatch(**{**case, **replaced}), label)
    # The failed call left the buffer working.
    buf.low_latency_dispatch(**case)


def combine_mutations(a: dict[str, Any], y: torch.Tensor, handle: tuple, older: tuple
                      ) -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    idx = a["topk_idx"]
    n, k = idx.shape
    t, h = a["num_max_dispatch_tokens_per_rank"], a["x"].shape[1]
    w = torch.full((n, k), 0.5)
    out = [
        ("x float32", {"x": y.float()}, ("x",)), ("x shape", {"x": y[:, :-1]}, ("x",)),
        ("x a list", {"x": y.tolist()}, ("x",)), ("x None", {"x": None}, ("x",)),
        ("topk int32", {"topk_idx": idx.int()}, ("topk_idx",)),
        ("topk a list", {"topk_idx": idx.tolist()}, ("topk_idx",)),
        ("topk N > T", {"topk_idx": torch.zeros(t + 1, k, dtype=torch.int64), "topk_weights": torch.zeros(t + 1, k)},
         ("topk_idx",)),
        ("weights float64", {"topk_weights": w.double()}, ("topk_weights",)),
        ("weights shape", {"topk_weights": torch.zeros(n, k + 1)}, ("topk_weights",)),
        ("weights a list", {"topk_weights": w.tolist()}, ("topk_weights",)), ("weights None", {"topk_weights": None},
                                                                              ("topk_weights",)),
        ("out float32", {"out": torch.zeros(n, h)}, ("out",)),
        ("out shape", {"out": torch.zeros(n + 1, h, dtype=torch.bfloat16)}, ("out",)),
        ("out a list", {"out": [0.0] * h}, ("out",)),
        ("wait stats float", {"combine_wait_recv_cost_stats": torch.zeros(1)}, ("combine_wait_recv_cost_stats",)),
        ("logfmt", {"use_logfmt": True}, ("use_logfmt",)),
        ("async and hook", {"async_finish": True, "return_recv_hook": True}, ("async_finish", "return_recv_hook")),
        ("handle of a retired dispatch", {"handle": older}, ("handle",)),
        ("handle copied", {"handle": (handle[0].clone(), *handle[1:])}, ("handle",)),
    ]
    out += [(f"handle {v!r}", {"handle": v}, ("handle",)) for v in (None, (), (1, 2, 3, 4, 5), [*handle], "handle")]
    for i, name in ((1, "layout_range"), (2, "T"), (3, "H"), (4, "E")):
        for bad in (None, "8", 0, handle[i] + 1 if isinstance(handle[i], int) else handle[i].clone()):
            tampered = list(handle)
            tampered[i] = bad
            out.append((f"handle with {name}={bad!r}", {"handle": tuple(tampered)}, ("handle",)))
    return out


@FUZZ_MORE
@given(case=dispatch_case(), pick=st.integers(0, 1 << 16))
def test_combine_arguments(case: dict[str, Any], pick: int) -> None:
    buf = Buffer(None, low_latency_mode=True, backend="reference")
    args = {**case, "use_fp8": False, "round_scale": False, "use_ue8m0": False}
    older = buf.low_latency_dispatch(**args)[2]
    for _ in range(2):  # retires `older` (two dispatches may be outstanding)
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(**args)
    idx = case["topk_idx"]
    good = {"x": recv_x, "topk_idx": idx, "topk_weights": torch.full(idx.shape, 0.5), "handle": handle}
    label, replaced, names = (m := combine_mutations(case, recv_x, handle, older))[pick % len(m)]
    raises_naming(names, lambda: buf.low_latency_combine(**{**good, **replaced}), label)
    for bad in (None, (), "handle"):
        raises_naming(("handle",), lambda bad=bad: buf.get_next_low_latency_combine_buffer(bad))
    out, _, _ = buf.low_latency_combine(**good)  # still works: weights 0.5 of the token for each expert
    want = case["x"].float() * 0.5 * (idx >= 0).sum(1, keepdim=True)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", [None, "reference", object(),
                                     Buffer(None, low_latency_mode=True, backend="reference")])
def test_from_backend_argument(backend: Any) -> None:
    raises_naming(("backend",), lambda: Buffer.from_backend(backend))


def test_every_public_name_is_covered() -> None:
    assert sorted(ep_layer.__all__) == ["Buffer", "Config", "EPTimeoutError", "EventOverlap", "NormalHandle",
                                        "RowsInPlace"]
    public = sorted(n for n in dir(Buffer) if not n.startswith("_") and callable(getattr(Buffer, n)))
    assert public == ["capture", "check", "clean_low_latency_buffer", "combine", "destroy", "dispatch",
                      "from_backend", "get_combine_config", "get_comm_stream", "get_dispatch_config",
                      "get_dispatch_layout", "get_local_buffer_tensor", "get_low_latency_rdma_size_hint",
                      "get_next_combine_buffer", "get_next_low_latency_combine_buffer", "is_sm90_compiled",
                      "latency_stats", "low_latency_clean_mask_buffer", "low_latency_combine",
                      "low_latency_dispatch", "low_latency_query_mask_buffer", "low_latency_update_mask_buffer",
                      "set_num_sms"], public

"""The reference backend's normal (high-throughput) mode: DeepEP's `dispatch` / `combine` as plain
PyTorch over point-to-point messages, in the order docs/design.md states it; the oracle of the kernels.

Each exchange is one message per peer: first a header (what ranks must agree on and the row counts
that size the receive buffers), then the rows, each row the token's index and the bytes of its columns.
"""

from __future__ import annotations

import math

import torch

from ..checks import check_topk_values, expect
from .exchange import PeerExchange
from .normal import NormalCombineArgs, NormalDispatchArgs, NormalDispatchResult, NormalHandle

_DISPATCH, _CACHED_DISPATCH, _COMBINE = 11, 12, 13
_AGREED = ("operation (dispatch, cached dispatch or combine)", "bytes per token", "top-k (0: no topk_idx)",
           "topk_weights given", "num_experts")


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """`t`'s rows ([T] or [T, ...]) as uint8 [T, bytes], so that every dtype travels the same way."""
    width = math.prod(t.shape[1:]) * t.element_size()
    # A fresh copy: torch counts an empty tensor, or one whose last dimension has size 1, as contiguous
    # whatever its strides, and view(uint8) needs a unit last stride.
    return t.clone(memory_format=torch.contiguous_format).view(torch.uint8).view(t.shape[0], width)


def _from_byte_rows(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows made by _byte_rows back as `like`'s dtype and trailing shape."""
    b = b.clone(memory_format=torch.contiguous_format)  # a column slice is not viewable as another dtype
    return b.view(like.dtype).view(b.shape[0], *like.shape[1:])


class ReferenceNormalMode:
    """Normal-mode dispatch and combine of one rank, over the reference backend's PeerExchange."""

    def __init__(self, exchange: PeerExchange, rank: int, num_ranks: int) -> None:
        self._exchange = exchange
        self.rank, self.num_ranks = rank, num_ranks

    def _swap(self, what: str, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list[torch.Tensor]:
        pending = self._exchange.start(what, sends, recvs)
        pending.wait()
        missing = [r for r, got in enumerate(pending.recvs) if got is None]
        if missing:
            raise RuntimeError(f"{what}: rank(s) {missing} are masked; normal mode has no rank masking "
                               "(enable_shrink applies to the low-latency calls)")
        return pending.recvs

    def _agree(self, what: str, header: list[int], device: torch.device) -> list[list[int]]:
        """Send every peer `header` (the fields of _AGREED first); every rank's header; raise if any of
        the agreed fields differ."""
        sends = [torch.tensor(header, dtype=torch.int64, device=device) for _ in range(self.num_ranks)]
        recvs = [torch.empty(len(header), dtype=torch.int64, device=device) for _ in range(self.num_ranks)]
        headers = [h.tolist() for h in self._swap(what, sends, recvs)]
        for field, name in enumerate(_AGREED):
            values = [h[field] for h in headers]
            if len(set(values)) > 1:
                raise ValueError(f"{what}: ranks disagree on {name}: " +
                                 ", ".join(f"rank {r} has {v}" for r, v in enumerate(values)))
        return headers

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, args: NormalDispatchArgs) -> NormalDispatchResult:
        num_ranks, me = self.num_ranks, self.rank
        in_rank = args.is_token_in_rank
        device = in_rank.device
        cached = args.cached
        per_rank = in_rank.sum(dim=0, dtype=torch.int64)
        if cached is None:
            expect(torch.equal(per_rank, args.num_tokens_per_rank.to(torch.int64)), "num_tokens_per_rank",
                   "the number of tokens is_token_in_rank sends each rank", args.num_tokens_per_rank.tolist())
        k = 0 if args.topk_idx is None else args.topk_idx.shape[1]
        if args.topk_idx is not None:
            check_topk_values(args.topk_idx, args.num_experts)
        payload = [_byte_rows(c) for c in args.columns]
        if args.topk_idx is not None:
            payload.append(_byte_rows(args.topk_idx))
        if args.topk_weights is not None:
            payload.append(_byte_rows(args.topk_weights))
        row_bytes = 8 + sum(p.shape[1] for p in payload)
        op = _DISPATCH if cached is None else _CACHED_DISPATCH
        header = [op, row_bytes, k, int(args.topk_weights is not None), args.num_experts, *per_rank.tolist()]
        headers = self._agree("dispatch", header, device)
        counts = torch.tensor([h[len(_AGREED):] for h in headers], dtype=torch.int64)  # [source, destination]
        if cached is not None:
            expect(torch.equal(counts.cumsum(0).to(torch.int32), cached.rank_prefix_matrix.cpu()), "handle",
                   "a handle of this group's dispatch (the ranks' counts differ from it)", "another layout")

        # Per destination, its tokens in ascending order, each row: token index, then the payload.
        tokens = torch.arange(in_rank.shape[0], device=device)
        sends = []
        for dest in range(num_ranks):
            picked = tokens[in_rank[:, dest]]
            index = _byte_rows(picked.to(torch.int64))
            sends.append(torch.cat([index, *(p[picked] for p in payload)], dim=1))
        recvs = [torch.empty(int(counts[s, me]), row_bytes, dtype=torch.uint8, device=device)
                 for s in range(num_ranks)]
        expert_counts = None
        if cached is None:
            num_local = args.num_experts // num_ranks
            mine = args.num_tokens_per_expert.to(torch.int64).view(num_ranks, num_local)
            got = self._swap("dispatch", list(mine.unbind(0)),
                             [torch.empty(num_local, dtype=torch.int64, device=device) for _ in range(num_ranks)])
            expert_counts = torch.stack(got).sum(dim=0)
        rows = torch.cat(self._swap("dispatch", sends, recvs))  # ordered by source rank, then token

        n = rows.shape[0]
        src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device), counts[:, me].to(device))
        fields = rows.split([8, *(p.shape[1] for p in payload)], dim=1)
        src_idx = _from_byte_rows(fields[0], torch.empty(0, dtype=torch.int64))
        outputs = [_from_byte_rows(f, c) for f, c in zip(fields[1:], args.columns)]
        recv_topk_idx = recv_topk_weights = None
        if args.topk_idx is not None:
            got_idx = _from_byte_rows(fields[1 + len(outputs)], args.topk_idx)
            num_local = args.num_experts // num_ranks
            mine = (got_idx >= me * num_local) & (got_idx < (me + 1) * num_local)
            recv_topk_idx = torch.where(mine, got_idx - me * num_local, -1)
            if args.topk_weights is not None:
                got_weights = _from_byte_rows(fields[-1], args.topk_weights)
                recv_topk_weights = torch.where(mine, got_weights, 0.0)
        per_expert = None
        if expert_counts is not None:
            per_expert = expert_counts.tolist()
            if recv_topk_idx is not None:
                seen = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=len(per_expert)).tolist()
                expect(seen == per_expert, "num_tokens_per_expert", "the number of tokens each expert has in "
                       f"topk_idx (rank {me} receives {seen} for its experts)", per_expert)

        if args.num_worst_tokens:
            expect(n <= args.num_worst_tokens, "num_worst_tokens", f"at least the {n} tokens rank {me} receives",
                   args.num_worst_tokens)
            outputs, src_idx, src_rank = (_pad(t, args.num_worst_tokens, 0) for t in (outputs, src_idx, src_rank))
            src_idx[n:], src_rank[n:] = -1, -1
            if recv_topk_idx is not None:
                recv_topk_idx = _pad(recv_topk_idx, args.num_worst_tokens, -1)
            if recv_topk_weights is not None:
                recv_topk_weights = _pad(recv_topk_weights, args.num_worst_tokens, 0)
            per_expert = None
        handle = NormalHandle(counts.cumsum(0).to(torch.int32).to(device), src_idx.to(torch.int32),
                              src_rank.to(torch.int32), in_rank, k)
        return NormalDispatchResult(tuple(outputs), recv_topk_idx, recv_topk_weights, per_expert, handle)

    # ---------------------------------------------------------------- combine
    def combine(self, args: NormalCombineArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
        num_ranks, me = self.num_ranks, self.rank
        handle, x = args.handle, args.x
        device = x.device
        in_rank = handle.is_token_in_rank
        num_tokens, hidden = in_rank.shape[0], x.shape[1]
        k = 0 if args.topk_weights is None else args.topk_weights.shape[1]
        # As long as a dispatch's header, so that ranks calling different operations compare the fields.
        self._agree("combine", [_COMBINE, 2 * hidden, k, int(args.topk_weights is not None), 0, *[0] * num_ranks],
                    device)

        # Back to each source rank the rows it sent here, in the order it sent them.
        prefix = handle.rank_prefix_matrix[:, me].tolist()
        bounds = [0, *prefix]
        payload = [_byte_rows(x)] + ([_byte_rows(args.topk_weights)] if args.topk_weights is not None else [])
        row_bytes = sum(p.shape[1] for p in payload)
        sends = [torch.cat([p[bounds[s]:bounds[s + 1]] for p in payload], dim=1) for s in range(num_ranks)]
        per_dest = in_rank.sum(dim=0).tolist()
        recvs = [torch.empty(per_dest[d], row_bytes, dtype=torch.uint8, device=device) for d in range(num_ranks)]
        got = self._swap("combine", sends, recvs)

        tokens = torch.arange(num_tokens, device=device)
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        weights = torch.zeros(num_tokens, k, dtype=torch.float32, device=device) if k else None
        for dest in range(num_ranks):  # ascending rank, float32, rounded once at the end
            picked = tokens[in_rank[:, dest]]
            rows = got[dest]
            acc[picked] += _from_byte_rows(rows[:, :2 * hidden], x).float()
            if weights is not None:
                weights[picked] += _from_byte_rows(rows[:, 2 * hidden:], args.topk_weights)
        for b in args.bias:
            acc += b.float()
        return acc.to(torch.bfloat16), weights


def _pad(t: torch.Tensor | list[torch.Tensor], rows: int, value: float) -> torch.Tensor | list[torch.Tensor]:
    """`t` (or each of a list) with rows appended up to `rows`, filled with `value`."""
    if isinstance(t, list):
        return [_pad(c, rows, value) for c in t]
    out = torch.full((rows, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t
    return out

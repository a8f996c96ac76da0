"""The interface every Buffer backend implements: a send half that returns at once, and a receive
half that the caller runs now or later (the hook)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..latency import LatencyHistogram
from ..quant import FP8_GROUP, UE8M0_PACK
from .normal import NormalCombineArgs, NormalDispatchArgs, NormalDispatchResult

# (src_info int32 [E_l, R*T], layout_range int64 [E_l, R], T, H, E), as DeepEP's handle.
Handle = tuple[torch.Tensor, torch.Tensor, int, int, int]
ReceiveHalf = Callable[[], None]


@dataclass(frozen=True, eq=False)  # tensors: compare fields, not the objects
class RowsInPlace:
    """Dispatch's received rows left where they arrived in the communication buffer
    (`low_latency_dispatch(..., rows_in_place=True)`), for kernels that read each row where it lies
    instead of from a packed copy: row m of local expert l (m < recv_count[l]) is the H values (e4m3, or
    bf16 without FP8) at byte offset `offsets[l, m]` from `base`'s first byte (in this rank's buffer, or,
    for ranks sharing a GPU, in a peer's mapped one). The FP8 scales are packed as a copy's are (a GEMM
    reads a tile's scales side by side): float32 [E_l, R*T, H/128], column-major. Like a zero-copy
    combine buffer, the rows stay valid until the dispatch two calls later."""

    base: torch.Tensor  # uint8 [16] at the start of this rank's communication buffer
    offsets: torch.Tensor  # int64 [E_l, R*T]; on 128-byte lines; rows at or past recv_count unspecified
    scales: torch.Tensor | None  # FP8 only
    hidden: int


RecvX = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | RowsInPlace


@dataclass(frozen=True, eq=False)  # a tensor: compare fields, not the objects
class SendSignals:
    """Single-batch overlap (a combine with DeepEP forks' `overlap=True`): the expert GEMM, on another stream,
    counts its finished tiles in `signals`, and the combine's send of row m of local expert l waits until
    signals[l * per_expert + m // rows] >= threshold instead of relying on stream order for x's rows."""

    signals: torch.Tensor  # int32, at least E_l * per_expert of them
    rows: int  # an expert's rows per signal
    per_expert: int  # signals per local expert
    threshold: int

    def index(self, expert: int, row: int) -> int:
        """The signal that row `row` of local expert `expert` waits for."""
        return expert * self.per_expert + row // self.rows


class DispatchSpec(NamedTuple):
    """What every rank must agree on for one dispatch."""

    max_tokens: int  # T, num_max_dispatch_tokens_per_rank
    hidden: int  # H
    num_experts: int  # E
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool


def empty_recv_x(spec: DispatchSpec, num_local: int, rows: int, device: torch.device) -> RecvX:
    """Dispatch's received-token output, uninitialised: bf16 [E_l, rows, H], or with FP8 (e4m3 data
    [E_l, rows, H], scales) where the scales (float32 [.., H/128], or UE8M0 int32 [.., H/512]) are
    column-major in the last two dims, as DeepEP's grouped GEMMs want them."""
    h = spec.hidden
    if not spec.use_fp8:
        return torch.empty(num_local, rows, h, dtype=torch.bfloat16, device=device)
    data = torch.empty(num_local, rows, h, dtype=torch.float8_e4m3fn, device=device)
    if spec.use_ue8m0:
        cols, dtype = h // (FP8_GROUP * UE8M0_PACK), torch.int32
    else:
        cols, dtype = h // FP8_GROUP, torch.float32
    return data, torch.empty(num_local, cols, rows, dtype=dtype, device=device).transpose(1, 2)


class DispatchResult(NamedTuple):  # a tuple: built on every call, cheaply
    recv_x: RecvX
    recv_count: torch.Tensor
    handle: Handle
    receive: ReceiveHalf
    private: object = None  # backend state that combine needs; the Buffer hands it back by handle


class Backend(ABC):
    """One rank's end of the low-latency exchange."""

    name: str
    num_nvl_bytes = 0  # a normal-mode buffer of this size (backends that keep one)

    def __init__(self, group: dist.ProcessGroup | None, rank: int, num_ranks: int,
                 num_rdma_bytes: int, timeout_s: float, shrink: bool = False) -> None:
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_rdma_bytes = num_rdma_bytes
        self.timeout_s = timeout_s
        self.shrink = shrink  # rank masking: a peer that misses a wait is masked instead of failing the call

    @property
    @abstractmethod
    def device(self) -> torch.device | None:
        """Where every tensor must live; None = any device, the same for all tensors of a call."""

    supports_rows_in_place = False  # dispatch(..., rows_in_place=True) returns RowsInPlace
    # A combine's send waits for its overlap signals on the device, so it may run beside the GEMM that sets
    # them (else it waits on the host, and must come after it in stream order).
    signals_waited_on_device = False

    @property
    def ranks_on_this_gpu(self) -> int:
        """The group's ranks that run on this rank's GPU (sharing its memory and SMs), itself included."""
        return 1

    @abstractmethod
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, spec: DispatchSpec,
                 recv_stats: torch.Tensor | None, wait_stats: torch.Tensor | None, *,
                 hook: bool, rows_in_place: bool = False) -> DispatchResult:
        """Launch the send half; the result's `receive` launches the receive half. With `hook=False` the
        caller runs `receive` right after, so a backend may do both halves at once here.
        `rows_in_place` (only where `supports_rows_in_place`): recv_x is a RowsInPlace, not a copy."""

    @abstractmethod
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: Handle, private: object, out: torch.Tensor,
                wait_stats: torch.Tensor | None, *, hook: bool, slot: int, signals: SendSignals | None = None,
                send_sms: int | None = None) -> ReceiveHalf:
        """Launch the send half of combine; the returned callable writes the weighted sums to `out`. With
        `hook=False` the caller runs it right after, so a backend may do both halves at once here. `slot`
        is the zero-copy combine buffer that belongs to the dispatch (combine_buffer). `signals`: the send
        waits for each row's signal (single-batch overlap); `send_sms`: at most this many SMs send."""

    # DeepEP's normal (high-throughput) mode: the Buffer checked the arguments (docs/design.md section 2).
    @abstractmethod
    def normal_dispatch(self, args: NormalDispatchArgs) -> NormalDispatchResult:
        """Send each token once to every rank in its row of is_token_in_rank; the rows received."""

    @abstractmethod
    def normal_combine(self, args: NormalCombineArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum each token's rows back on its rank; (combined bf16 [T, H], summed top-k weights or None)."""

    def normal_combine_buffer(self, rows: int, hidden: int, device: torch.device) -> torch.Tensor:
        """bf16 [rows, hidden] for a caller to write a normal-mode combine's rows into, then pass as its x; a
        backend that stages those rows returns the place it stages them in, which saves the copy."""
        return torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)

    def combine_output(self, num_tokens: int, hidden: int, device: torch.device) -> torch.Tensor:
        """A bf16 [num_tokens, hidden] tensor on `device` for a plain combine (no hook, no async_finish) to
        write; the cuda backend recycles the ones its callers have dropped."""
        return torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)

    def combine_buffer(self, slot: int, handle: Handle) -> torch.Tensor | None:
        """The bf16 [E_l, R*T, H] zero-copy combine buffer of dispatch slot `slot` (0 or 1), if this backend
        keeps one where its combine can use it without a copy; None: Buffer keeps a plain tensor per slot."""
        del slot, handle
        return None

    @abstractmethod
    def latency_stats(self) -> dict[str, LatencyHistogram]:
        """Histograms of the "dispatch" and "combine" calls since the backend was made (may synchronize)."""

    def check(self) -> None:  # noqa: B027 - backends without deferred errors need nothing here
        """Raise any error recorded on the device since the last check."""

    def clean(self, max_tokens: int, hidden: int, num_experts: int) -> None:  # noqa: B027
        """Reset communication state (DeepEP's clean_low_latency_buffer)."""

    def destroy(self) -> None:  # noqa: B027
        """Release memory and peer mappings."""

    @abstractmethod
    def local_buffer(self, offset: int) -> torch.Tensor:
        """This rank's communication buffer from byte `offset` on, as a flat uint8 tensor."""

    # Rank masking, with `shrink` only (the Buffer checks that).
    @abstractmethod
    def query_mask(self, out: torch.Tensor) -> None:
        """Write 1 for each masked rank and 0 for the others into int32 `out` [num_ranks]."""

    @abstractmethod
    def update_mask(self, rank: int, masked: bool) -> None:
        """Mask or unmask one rank."""

    @abstractmethod
    def clean_mask(self) -> None:
        """Unmask every rank."""

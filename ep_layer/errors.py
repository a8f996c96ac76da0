"""Exceptions raised by ep_layer."""

from __future__ import annotations


class EPTimeoutError(TimeoutError):
    """A bounded wait for peer ranks ran out; `ranks` names those that never arrived."""

    def __init__(self, what: str, ranks: list[int], timeout_s: float, rank: int | None = None) -> None:
        self.ranks = sorted(ranks)
        self.timeout_s = timeout_s
        where = f"rank {rank}: " if rank is not None else ""
        super().__init__(
            f"{where}{what} timed out after {timeout_s:g} s waiting for rank(s) {self.ranks}; "
            "they never arrived (crashed, hung, or called a different operation)"
        )


def overlap_signal_timeout(rank: int, signals: list[int], timeout_s: float,
                           threshold: int | None = None) -> TimeoutError:
    """A combine's single-batch-overlap signals (their indices) that stayed below the threshold for timeout_s."""
    below = "the threshold" if threshold is None else f"the threshold {threshold}"
    return TimeoutError(f"rank {rank}: low_latency_combine: the overlap signals {signals} stayed below {below} for "
                        f"{timeout_s:g} s (comp_signal or src_signals: the expert GEMM never signalled those rows)")

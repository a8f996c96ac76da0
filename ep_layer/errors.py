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

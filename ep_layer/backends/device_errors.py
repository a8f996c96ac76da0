"""Errors the cuda backend's kernels record on the device (csrc/ll_common.cuh: ErrorRecord, at the same place
in both of a rank's buffers), read back on the host."""

from __future__ import annotations

import torch


def take_recorded_error(c: object, base: int, host_flag: int) -> tuple[int, int, int, int] | None:
    """(code, op, bitmask of ranks, detail) of the error a kernel recorded in the buffer at `base`, cleared
    there; None when the host-mapped flag says there is none (which costs no wait)."""
    if not c.read_host_flag(host_flag):
        return None
    torch.cuda.current_stream().synchronize()
    record = c.read_error(base)
    c.clear_error(base)
    c.clear_host_flag(host_flag)
    return record

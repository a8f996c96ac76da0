"""The cuda backend's NVSHMEM transport (`transport="nvshmem"`): its communication buffers on NVSHMEM's
symmetric heap (nvshmem4py), one NVSHMEM job per process bootstrapped with a unique id that the group's
first rank broadcasts over the Buffer's torch.distributed group.

The kernels reach each peer's buffer by loads and stores at the address NVSHMEM maps it to here
(nvshmem_ptr), as they reach a peer mapped through CUDA IPC. A peer with no such address (another node,
reached over RDMA) needs NVSHMEM puts in the kernels, which are not built yet: it is a NotImplementedError.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..checks import expect

# Set for NVSHMEM unless the environment says otherwise: NVLink SHARP (multicast objects) off, which these
# machines' drivers and the kernels do not use; and a symmetric heap sized by the first Buffer (heap_bytes).
ENV_DEFAULTS = {"NVSHMEM_DISABLE_NVLS": "1"}
MIN_HEAP_BYTES = 1 << 30
INSTALL_HINT = "pip install 'ep-layer[nvshmem]' (nvshmem4py-cu13, with the nvidia-nvshmem-cu13 library)"


class SymmetricBuffer(NamedTuple):
    buffer: Any  # the cuda.core Buffer nvshmem4py allocated (freed collectively)
    bases: list[int]  # every rank's buffer, as this process addresses it


_job: tuple[int, int] | None = None  # (rank, num_ranks) of this process's NVSHMEM job


def _nvshmem() -> Any:
    try:
        import nvshmem.core
    except ImportError as e:
        raise RuntimeError(f"transport: 'nvshmem' needs nvshmem4py; {INSTALL_HINT}") from e
    return nvshmem.core


def join(group: dist.ProcessGroup | None, rank: int, num_ranks: int, device: torch.device, buffer_bytes: int) -> None:
    """Starts this process's NVSHMEM job as `rank` of `num_ranks` on `device` (a collective over `group`),
    or checks that the job already started is that one: NVSHMEM has one job per process. The heap (fixed
    for the job) holds twice the first Buffer's `buffer_bytes`, so that a second Buffer of its size fits
    (engines make one per micro-batch slot or mode), unless NVSHMEM_SYMMETRIC_SIZE says otherwise."""
    global _job
    if _job is not None:
        expect(_job == (rank, num_ranks), "group", f"the ranks of this process's NVSHMEM job (rank {_job[0]} of "
               f"{_job[1]}): NVSHMEM runs one job per process", f"rank {rank} of {num_ranks}")
        return
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(MIN_HEAP_BYTES, 2 * buffer_bytes)))
    nvshmem = _nvshmem()
    from cuda.core import Device

    cuda_device = Device(device.index)
    cuda_device.set_current()
    uid = nvshmem.get_unique_id(empty=rank != 0)
    if num_ranks > 1:
        data = [uid._data.tobytes()] if rank == 0 else [None]
        dist.broadcast_object_list(data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if rank != 0:
            uid._data[...] = np.frombuffer(data[0], dtype=uid._data.dtype).reshape(uid._data.shape)
    nvshmem.init(device=cuda_device, uid=uid, rank=rank, nranks=num_ranks, initializer_method="uid")
    _job = (rank, num_ranks)


def allocate(num_bytes: int, num_ranks: int) -> SymmetricBuffer:
    """`num_bytes` on every rank's heap (a collective), and each rank's address here."""
    nvshmem = _nvshmem()
    buffer = nvshmem.buffer(num_bytes)
    bases = []
    for pe in range(num_ranks):
        try:
            bases.append(int(nvshmem.get_peer_buffer(buffer, pe).handle))
        except Exception as e:  # nvshmem4py's NvshmemError: no load/store path to that PE
            nvshmem.free(buffer)
            raise NotImplementedError(f"transport: rank {pe} is not reachable by loads and stores from here (another "
                                      "node); NVSHMEM puts for such peers are not built yet") from e
    return SymmetricBuffer(buffer, bases)


def free(buffer: SymmetricBuffer) -> None:
    """Frees `buffer` on every rank (a collective)."""
    _nvshmem().free(buffer.buffer)

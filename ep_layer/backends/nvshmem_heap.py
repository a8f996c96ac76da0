"""The cuda backend's NVSHMEM transport (`transport="nvshmem"`): its communication buffers on NVSHMEM's
symmetric heap (nvshmem4py), one NVSHMEM job per process bootstrapped with a unique id that the group's
first rank broadcasts over the Buffer's torch.distributed group.

The kernels (ep_layer._C_nvshmem) reach each peer's buffer by loads and stores at the address NVSHMEM maps
it to here (nvshmem_ptr), as they reach a peer mapped through CUDA IPC, and a peer with no such address
(another node, over RDMA) by NVSHMEM puts; EP_LAYER_NVSHMEM_FORCE_PUTS=1 sends puts to every rank, so that
their code path runs on one node.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..checks import expect
from ..native import nvshmem_core

# Set for NVSHMEM unless the environment says otherwise: NVLink SHARP (multicast objects) off, which the
# kernels do not use and many drivers refuse; GPU-initiated RDMA (IBGDA: the kernels' puts post their own
# work requests, no proxy thread); queue pairs deeper than the 1024 tokens a rank may send a peer in one call;
# and a symmetric heap sized by the first Buffer (join).
ENV_DEFAULTS = {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_QP_DEPTH": "2048"}
FORCE_PUTS = "EP_LAYER_NVSHMEM_FORCE_PUTS"  # "1": every rank is reached by puts, load/store paths or not
MIN_HEAP_BYTES = 1 << 30


class SymmetricBuffer(NamedTuple):
    buffer: Any  # the cuda.core Buffer nvshmem4py allocated (freed collectively)
    bases: list[int | None]  # every rank's buffer as this process addresses it; None: no load/store path


_job: tuple[int, int] | None = None  # (rank, num_ranks) of this process's NVSHMEM job


def join(group: dist.ProcessGroup | None, rank: int, num_ranks: int, device: torch.device, buffer_bytes: int,
         kernels: Any) -> None:
    """Starts this process's NVSHMEM job as `rank` of `num_ranks` on `device` (a collective over `group`),
    or checks that the job already started is that one: NVSHMEM has one job per process. The heap (fixed
    for the job) holds twice the first Buffer's `buffer_bytes`, so that a second Buffer of its size fits
    (engines make one per micro-batch slot or mode), unless NVSHMEM_SYMMETRIC_SIZE says otherwise.
    `kernels` (ep_layer._C_nvshmem) is then attached to the job, and must see it as this rank."""
    global _job
    if _job is not None:
        expect(_job == (rank, num_ranks), "group", f"the ranks of this process's NVSHMEM job (rank {_job[0]} of "
               f"{_job[1]}): NVSHMEM runs one job per process", f"rank {rank} of {num_ranks}")
        return
    for name, value in ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(MIN_HEAP_BYTES, 2 * buffer_bytes)))
    nvshmem = nvshmem_core()
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
    kernels.attach_nvshmem()
    seen = kernels.nvshmem_view(0)[:2]
    if seen != (rank, num_ranks):
        raise RuntimeError(f"transport: the NVSHMEM build of the kernels sees PE {seen[0]} of {seen[1]}, not rank "
                           f"{rank} of {num_ranks}: it and nvshmem4py loaded different NVSHMEM host libraries")
    _job = (rank, num_ranks)


def allocate(num_bytes: int, rank: int, kernels: Any) -> SymmetricBuffer:
    """`num_bytes` on every rank's heap (a collective), and each rank's address here as the kernels see it
    (nvshmem_ptr in `kernels`, ep_layer._C_nvshmem)."""
    buffer = nvshmem_core().buffer(num_bytes)
    own = int(buffer.handle)
    bases = [p or None for p in kernels.nvshmem_view(own)[2]]
    if bases[rank] != own:
        free(SymmetricBuffer(buffer, bases))
        raise RuntimeError(f"transport: the kernels map this rank's NVSHMEM buffer {own:#x} at {bases[rank]}")
    return SymmetricBuffer(buffer, bases)


def put_ranks(buffer: SymmetricBuffer) -> int:
    """The ranks this process reaches by NVSHMEM puts (bit r): those without a load/store path to their
    part of `buffer`, or every rank with EP_LAYER_NVSHMEM_FORCE_PUTS=1."""
    forced = os.environ.get(FORCE_PUTS, "0")
    expect(forced in ("0", "1"), FORCE_PUTS, "0 or 1", forced)
    return sum(1 << r for r, base in enumerate(buffer.bases) if forced == "1" or base is None)


def free(buffer: SymmetricBuffer) -> None:
    """Frees `buffer` on every rank (a collective)."""
    nvshmem_core().free(buffer.buffer)

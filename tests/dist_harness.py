"""Run a test function on N gloo ranks (127.0.0.1) in child processes, bounded by a timeout.

    results = run_ranks(fn, world_size, *args, timeout_s=60)

`fn(rank, world_size, *args)` must be a top-level (picklable) function; it runs in every rank after
`torch.distributed` is initialised with gloo, and its return values come back as a list indexed by
rank. An exception in any rank, a rank that dies, or a rank still running at the deadline fails the
caller with an AssertionError that names the rank(s) and carries their tracebacks; every child is
killed before run_ranks returns or raises, so nothing hangs.

Children come from a `forkserver` that has imported torch once, so a run costs a fork and a gloo
rendezvous (~0.1-0.3 s), not a fresh interpreter per rank. The rendezvous store lives in the parent
on a free port chosen by the OS, so there is no port race.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

_HOST = "127.0.0.1"
_GRACE_S = 2.0  # after a failure, how long to wait for the other ranks' errors before killing them
_context: Any = None


def _ctx() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "torch.distributed", "numpy", "ep_layer"])
    return _context


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...],
            conn: Connection, timeout_s: float) -> None:
    status, payload = "error", "not started"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share a few cores
        store = dist.TCPStore(_HOST, port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        status, payload = "ok", fn(rank, world_size, *args)
    except BaseException:
        status, payload = "error", traceback.format_exc()
    try:
        conn.send((status, payload))
    except Exception:
        conn.send(("error", f"result of rank {rank} could not be sent back:\n{traceback.format_exc()}"))
    conn.close()
    if status == "ok":
        # Leave together, so that no rank tears its connections down while a peer still talks to it.
        with contextlib.suppress(Exception):
            dist.barrier()
    # Skip interpreter teardown: destroying a gloo group with transfers still posted (the timeout
    # tests leave some on purpose) can block.
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0,
              dies: tuple[int, ...] = ()) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results by rank. Ranks in
    `dies` may exit without a result (a test of surviving a dead rank): theirs is None."""
    import torch.distributed as dist

    ctx = _ctx()
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    procs, conns = [], []
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"{fn.__name__}-rank{rank}", daemon=True,
                               args=(fn, rank, world_size, store.port, args, writer, timeout_s))
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        results, errors = _collect(procs, conns, timeout_s, dies)
    finally:
        # After a success the ranks leave through a final barrier: give them a moment, then kill.
        deadline = time.monotonic() + (5.0 if len(results) == world_size else 0.0)
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in conns:
            conn.close()
        del store
    if errors:
        details = "\n".join(f"---- rank {rank}: {msg}" for rank, msg in sorted(errors.items()))
        raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)} of {world_size}:\n{details}")
    return [results[rank] for rank in range(world_size)]


def _collect(procs: list[Any], conns: list[Connection], timeout_s: float, dies: tuple[int, ...]
             ) -> tuple[dict[int, Any], dict[int, str]]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = set(range(len(procs)))
    while pending:
        now = time.monotonic()
        if errors:  # give the other ranks a moment to report their own failure, then stop
            deadline = min(deadline, now + _GRACE_S)
        if now >= deadline:
            break
        waitables = {conns[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for ready in wait(list(waitables), timeout=deadline - now):
            rank = waitables[ready]
            if rank not in pending:
                continue
            conn = conns[rank]
            if ready is not conn and not conn.poll(0.5):  # exited without a word
                _died(procs, rank, dies, results, errors)
            else:
                try:
                    status, payload = conn.recv()
                except EOFError:
                    _died(procs, rank, dies, results, errors)
                else:
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
            pending.discard(rank)
    why = ("still running when another rank failed (killed)" if errors
           else f"did not finish within {timeout_s:g} s (killed)")
    for rank in sorted(pending):
        errors[rank] = why
    return results, errors


def _died(procs: list[Any], rank: int, dies: tuple[int, ...], results: dict[int, Any], errors: dict[int, str]) -> None:
    procs[rank].join(1)
    if rank in dies:
        results[rank] = None
    else:
        errors[rank] = f"process died (exit code {procs[rank].exitcode}) without a result"

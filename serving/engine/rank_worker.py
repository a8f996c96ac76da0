"""The engine rank process: joins the rank group (expert parallelism), loads the model through the
configured loader, then loops: take messages from the server, step with the other ranks
(LLMEngine.step), send the outputs back."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .engine import LLMEngine, eos_token_ids
from .engine_config import EngineConfig, ep_backend_for
from .heartbeat import RankBeat
from .messages import (
    AbortRequest,
    AddRequests,
    CollectStats,
    ModelInfo,
    PrefixCacheReset,
    RankFailed,
    RankReady,
    RequestOutput,
    ResetPrefixCache,
    SchedulerStats,
    Shutdown,
    StatsReply,
    StepOutputs,
    Wake,
)
from .step_sync import StepSync
from .warm_up import warm_up

IDLE_POLL_S = 0.05  # an idle expert-parallel rank joins the step agreement at least this often
LONE_IDLE_POLL_S = 1.0  # an idle rank without peers passes its loop at least this often (heartbeat.py)
PARENT_POLL_S = 0.2  # how often a rank checks that the server process is still there
_DIST_TIMEOUT = timedelta(minutes=30)


class Phases:
    """Seconds each start-up phase of a rank took, for its log line, from `since` (a time.time(): the server's
    spawn of the process, so that the first phase holds the process's start and imports)."""

    def __init__(self, since: float) -> None:
        self.last = since
        self.seconds: list[tuple[str, float]] = []

    def done(self, name: str) -> None:
        now = time.time()
        self.seconds.append((name, now - self.last))
        self.last = now

    def summary(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds)
        return f"{sum(s for _, s in self.seconds):.1f} s ({parts})"


def resolve_device(config: EngineConfig, local_rank: int) -> torch.device:
    """This process's local_rank-th rank runs on GPU local_rank mod #GPUs (or on the CPU)."""
    kind = config.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(kind)


def num_kv_blocks(config: EngineConfig, model: Any, device: torch.device, max_model_len: int) -> int:
    """config.num_kv_blocks, else what memory allows: on GPU vLLM's gpu_memory_utilization share of the
    whole GPU (split between the ranks that share it) less what this rank holds already, and no more
    than is free; on CPU cpu_kv_cache_bytes; never more than max_num_seqs full-length sequences need,
    never less than one."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    cfg = model.config
    if hasattr(model, "kv_cache_bytes_per_block"):
        block_bytes = model.kv_cache_bytes_per_block(config.block_size)
    else:
        block_bytes = config.block_size * cfg.num_hidden_layers * cfg.kv_cache_dim * 2  # bf16 latent KV
    per_seq = -(-max_model_len // config.block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        ranks_per_gpu = -(-len(config.local_ranks) // torch.cuda.device_count())
        held = torch.cuda.memory_reserved(device)  # torch's; the Buffer's own memory counts only through `free`
        budget = min(free, config.kv_cache_budget_bytes(total, held, ranks_per_gpu))
    else:
        budget = config.cpu_kv_cache_bytes
    return max(per_seq, min(budget // block_bytes, per_seq * config.max_num_seqs))


def run_rank(rank: int, config: EngineConfig, inbox: mp.Queue, outbox: mp.Queue, beat: RankBeat,
             spawned_at: float) -> None:
    """Process entry point (spawned by serving.engine.dp_coordinator at time.time() `spawned_at`); `rank` is
    global."""
    phases = Phases(spawned_at)
    phases.done("process start")
    # Ctrl-C reaches the whole process group: the server stops the ranks in step, not the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(rank)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(config.local_ranks)))
        device = resolve_device(config, rank - config.local_ranks.start)
        # `auto` decided once, here: the loader's Buffers and the kind of the MoE group follow it.
        config = dataclasses.replace(config, ep_backend=ep_backend_for(config, device))
        group, sync_group = _init_group(config, rank, device)
        phases.done("device and group")
        model, tokenizer = importlib.import_module(config.loader).load_model(config, group, device)
        phases.done("load")
        max_positions = int(model.config.max_position_embeddings)
        max_model_len = config.max_model_len or max_positions
        if max_model_len > max_positions:
            raise ValueError(f"max_model_len: expected at most the model's max_position_embeddings="
                             f"{max_positions}, got {max_model_len}")
        blocks = num_kv_blocks(config, model, device, max_model_len)
        engine = LLMEngine(model, tokenizer, num_blocks=blocks, block_size=config.block_size,
                           max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                           max_tokens_per_rank=config.max_tokens_per_rank, device=device, seed=config.seed + rank,
                           rank=rank, num_ranks=config.data_parallel_size,
                           use_cuda_graphs=not config.enforce_eager, graph_sizes=config.graph_sizes,
                           async_scheduling=config.async_scheduling, token_budget=config.token_budget,
                           deepep_mode=config.deepep_mode, enable_prefix_caching=config.enable_prefix_caching,
                           long_prefill_token_threshold=config.long_prefill_token_threshold,
                           scheduling_policy=config.scheduling_policy)
        sync = StepSync(sync_group, beat)
        phases.done("KV cache and CUDA graphs")
        warm_up(engine, sync)
        phases.done("warm-up")
        runner = engine.runner
        if rank == 0:
            if runner.captured_sizes:
                variants, seconds = runner.compiled_ahead
                graphs = (f"{len(runner.captured_sizes)} step CUDA graphs of {runner.captured_sizes[0]} to "
                          f"{runner.captured_sizes[-1]} tokens captured in {runner.capture_seconds:.1f} s "
                          f"({variants} Triton kernel variants compiled ahead in {seconds:.1f} s)")
            elif device.type == "cuda" and not config.enforce_eager:
                graphs = f"steps run eagerly: {runner.eager_reason}"
            else:
                graphs = "steps run eagerly"
            print(f"Rank ready in {phases.summary()}; {graphs}", file=sys.stderr, flush=True)
        info = ModelInfo(engine.vocab_size, tuple(sorted(eos_token_ids(model.config))), max_model_len, blocks,
                         config.block_size, str(device), runner.ep_backend, tuple(runner.captured_sizes),
                         runner.eager_reason)
        outbox.put(RankReady(rank, info))
        RankLoop(rank, engine, sync, inbox, outbox, config.expert_parallel, beat).run()
    except BaseException:
        outbox.put(RankFailed(rank, traceback.format_exc()))
        _flush(outbox)
        # Skip interpreter teardown: a process group with a dead or stuck peer can block in it.
        os._exit(1)
    _flush(outbox)
    if dist.is_initialized():
        dist.destroy_process_group()  # all ranks agreed to stop: nothing is in flight


def exit_with_parent(rank: int) -> None:
    """Exit within PARENT_POLL_S of the server process going away, whatever this rank is doing (a step,
    a collective, a write to a full pipe that nobody reads): a thread watches the parent and ends the
    process at once, which frees its memory, the GPU's included."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        print(f"engine rank {rank}: the server process ({parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="ep-serve-parent-watch", daemon=True).start()


def _init_group(config: EngineConfig, rank: int,
                device: torch.device) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(the MoE group, a gloo group for the step agreement); (None, None) for an independent rank.
    The MoE group is NCCL with one GPU per rank; gloo on CPU, and when ranks share GPUs (NCCL cannot;
    the cuda backend only exchanges IPC handles through the group). Every host's ranks meet at the
    store that the process running rank 0 keeps at data_parallel_address:dist_port."""
    if not config.expert_parallel:
        return None, None
    world = config.data_parallel_size
    backend = "gloo"
    if device.type == "cuda":
        local = len(config.local_ranks)
        if local <= torch.cuda.device_count():
            backend = "nccl"
        elif config.ep_backend == "reference":
            raise ValueError(f"ep_backend: the reference backend on GPU needs a GPU per rank (NCCL), got {local} "
                             f"ranks on {torch.cuda.device_count()} GPU(s); build the cuda backend for shared GPUs")
    store = dist.TCPStore(config.data_parallel_address, config.dist_port, world, is_master=False,
                          timeout=_DIST_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_DIST_TIMEOUT)
    # The step agreement has a CPU group of its own, apart from the MoE layers' traffic.
    return dist.group.WORLD, dist.new_group(backend="gloo")


def _flush(outbox: mp.Queue) -> None:
    with contextlib.suppress(Exception):
        outbox.close()
        outbox.join_thread()


class RankLoop:
    """beat: where the loop's passes are seen by the server (None: nowhere)."""

    def __init__(self, rank: int, engine: LLMEngine, sync: StepSync, inbox: mp.Queue, outbox: mp.Queue,
                 expert_parallel: bool, beat: RankBeat | None = None) -> None:
        self.rank, self.engine, self.sync = rank, engine, sync
        self.inbox, self.outbox = inbox, outbox
        self.expert_parallel = expert_parallel
        self.beat = beat
        self._last_stats = SchedulerStats()

    def run(self) -> None:
        """Until the ranks agree to stop: apply the server's messages, step (LLMEngine.step, with the
        other ranks), send the outputs."""
        while True:
            if self.beat is not None:
                self.beat.passed()
            leaving = not self._handle(self._receive(block=self._idle()))
            outputs = self.engine.step(self.sync, leaving)
            if self.sync.plan.stop:
                return
            self._send(outputs)

    def _idle(self) -> bool:
        """No rank stepped last time and this one has no work: wait for a message (an expert-parallel
        rank at most IDLE_POLL_S before it joins the next agreement)."""
        return not self.sync.plan.step and not self.engine.has_work()

    def _receive(self, block: bool) -> list[Any]:
        """The messages waiting in the inbox; when `block`, first wait for one, at most IDLE_POLL_S
        (expert parallelism: the peers wait in the agreement) or LONE_IDLE_POLL_S."""
        messages: list[Any] = []
        if block:
            with contextlib.suppress(queue.Empty):
                messages.append(self.inbox.get(timeout=IDLE_POLL_S if self.expert_parallel else LONE_IDLE_POLL_S))
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, messages: list[Any]) -> bool:
        """Apply the server's messages (between steps); False on shutdown."""
        outputs: list[RequestOutput] = []
        for msg in messages:
            if isinstance(msg, AddRequests):
                for add in msg.requests:
                    try:
                        self.engine.add_request(add.request_id, add.prompt_token_ids, add.params, add.priority)
                    except ValueError as e:
                        outputs.append(RequestOutput(add.request_id, [], "", len(add.prompt_token_ids), 0,
                                                     "abort", error=str(e)))
            elif isinstance(msg, AbortRequest):
                out = self.engine.abort(msg.request_id)
                if out is not None:
                    outputs.append(out)
            elif isinstance(msg, CollectStats):
                self.outbox.put(StatsReply(msg.token, self.engine.ep_stats()))
            elif isinstance(msg, ResetPrefixCache):
                self.outbox.put(PrefixCacheReset(msg.token, self.rank, self.engine.reset_prefix_cache()))
            elif isinstance(msg, Shutdown):
                return False
            elif not isinstance(msg, Wake):
                raise TypeError(f"rank {self.rank}: unexpected message {type(msg).__name__}")
        if outputs:
            self._send(outputs)
        return True

    def _send(self, outputs: list[RequestOutput]) -> None:
        """Outputs with the scheduler's state; nothing when there is nothing new."""
        stats = self.engine.scheduler_stats()
        if outputs or stats != self._last_stats:
            self._last_stats = stats
            self.outbox.put(StepOutputs(self.rank, outputs, stats))

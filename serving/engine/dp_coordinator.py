"""The server side of the engine ranks: spawns them, sends each request to the least-loaded rank, and
hands their outputs back to per-request callbacks from one reader thread. Knows when a rank died.

Processes: the API server (this object, FastAPI, metrics) + N engine ranks (rank_worker.py), talking
through typed messages (messages.py) over one multiprocessing queue per rank and one shared queue back.
In a multi-host job this process runs only its own ranks (config.local_ranks) and serves their requests;
the one that runs rank 0 also keeps the store where every host's ranks meet (torch.distributed).
Ranks are global everywhere outside this class (messages, observer); inside, lists are by local index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from .engine_config import EngineConfig
from .heartbeat import DEFAULT_STALL_TIMEOUT_S, Heartbeats
from .messages import (
    AbortRequest,
    AddRequest,
    AddRequests,
    CollectStats,
    EPStats,
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
from .sequence import FINISH_ABORT, SamplingParams

if TYPE_CHECKING:
    import torch.distributed as dist

OutputSink = Callable[[RequestOutput], None]
log = logging.getLogger(__name__)
_READ_POLL_S = 0.2
_REAP_TIMEOUT_S = 5.0  # for a killed rank to be gone
_HOST = "127.0.0.1"


def _run_rank(*args: Any) -> None:
    """A rank process's entry: serving.engine.rank_worker.run_rank, imported here, in the rank, so that the server
    process never imports the engine and the model (seconds of its start-up, before it can spawn the ranks)."""
    from .rank_worker import run_rank

    run_rank(*args)


@dataclasses.dataclass(frozen=True)
class Counted:
    """What an engine request counts for in the metrics: its prompt's tokens (not for the second and
    later choices of one prompt, which share it) and its output's (not for an echo of the prompt alone,
    whose one token the server drops); its max_tokens parameter; and the request it is a choice of (vLLM's
    parent request: its `choices` share `parent`, which defaults to the request itself)."""

    prompt: bool = True
    output: bool = True
    max_tokens: int | None = None
    choices: int = 1
    parent: str | None = None


@dataclasses.dataclass(frozen=True)
class Submission:
    """One engine request to submit: its outputs go to `sink`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    counted: Counted = Counted()
    priority: int = 0  # the priority scheduling policy's


class EngineObserver(Protocol):
    """Sees what the ranks do (the metrics), from the reader thread."""

    def on_request(self, rank: int, request: Submission, now: float) -> None: ...

    def on_output(self, rank: int, output: RequestOutput, now: float) -> None: ...

    def on_stats(self, rank: int, stats: SchedulerStats) -> None: ...


class EngineUnavailableError(RuntimeError):
    """The engine takes no requests now (a 503)."""


class EngineDeadError(EngineUnavailableError):
    """An engine rank died; the engine takes no more requests."""


class EngineStalledError(EngineUnavailableError):
    """Engine ranks make no progress; the engine takes requests again once they do."""


@dataclasses.dataclass
class _InFlight:
    rank: int  # local index
    sink: OutputSink


class DPCoordinator:
    """stall_timeout_s: a rank that has not passed its loop for this long (heartbeat.py) makes the engine
    unavailable until it does (`unavailable`, EngineStalledError)."""

    def __init__(self, config: EngineConfig, observer: EngineObserver | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s: expected > 0, got {stall_timeout_s}")
        self.config = config
        self.first_rank = config.local_ranks.start
        self.num_ranks = len(config.local_ranks)  # the ranks this process runs
        self.observer = observer
        self.info: ModelInfo | None = None
        self.dead_reason: str | None = None  # why the engine died, with a rank's traceback (for the log)
        self.dead_summary: str | None = None  # which rank and how, without exception text (for /health)
        self.stalled_reason: str | None = None  # which ranks make no progress, while they do not
        self.stall_timeout_s = stall_timeout_s
        self._ctx = mp.get_context("spawn")
        self._heartbeats = Heartbeats(self._ctx, self.num_ranks)
        self._inboxes = [self._ctx.Queue() for _ in range(self.num_ranks)]
        self._outbox = self._ctx.Queue()
        self._procs: list[Any] = []
        self._store: dist.TCPStore | None = None
        self._lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}
        self._load = [0] * self.num_ranks
        self._replies: dict[int, list[Any]] = {}  # token -> the ranks' answers to one question (_ask_every_rank)
        self._replies_cv = threading.Condition(self._lock)
        self._tokens = itertools.count(1)
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def launch(self, timeout_s: float = 600.0) -> None:
        """Spawn the ranks (they start loading the model at once; wait_ready waits for them). timeout_s: how long
        the rendezvous store waits for the ranks of other hosts."""
        config = self.config
        if config.expert_parallel and self.first_rank == 0:
            import torch.distributed as dist  # only here: a rank alone is spawned before this process imports torch

            # Listens on every interface: the other hosts' ranks reach it at data_parallel_address.
            self._store = dist.TCPStore(_HOST, config.dist_port, config.data_parallel_size, is_master=True,
                                        wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
            config = dataclasses.replace(config, dist_port=self._store.port)
        if config.spans_processes:
            # After the store is bound: with dist_port 0 this is where the other hosts learn its port.
            log.info("ranks %d..%d of %d run here; all ranks meet at %s:%d", config.local_ranks.start,
                     config.local_ranks.stop - 1, config.data_parallel_size, config.data_parallel_address,
                     config.dist_port)
        for i, rank in enumerate(config.local_ranks):
            proc = self._ctx.Process(target=_run_rank, args=(rank, config, self._inboxes[i], self._outbox,
                                                             self._heartbeats.beat(i), time.time()),
                                     name=f"ep-serve-rank{rank}", daemon=True)
            proc.start()
            self._procs.append(proc)

    def wait_ready(self, timeout_s: float = 600.0) -> ModelInfo:
        """Wait until every rank launch() spawned has loaded the model; raise with a rank's traceback if one fails
        (the ranks are stopped then)."""
        config = self.config
        ready: dict[int, ModelInfo] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(ready) < self.num_ranks:
                try:
                    msg = self._outbox.get(timeout=_READ_POLL_S)
                except queue.Empty:
                    dead = [self.first_rank + i for i, p in enumerate(self._procs)
                            if not p.is_alive() and self.first_rank + i not in ready]
                    if dead:
                        raise RuntimeError(f"engine rank(s) {dead} exited while loading the model") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"engine ranks not ready after {timeout_s:.0f} s: "
                                           f"{sorted(set(config.local_ranks) - set(ready))}") from None
                    continue
                if isinstance(msg, RankFailed):
                    raise RuntimeError(f"engine rank {msg.rank} failed to start:\n{msg.error}")
                if isinstance(msg, RankReady):
                    ready[msg.rank] = msg.info
        except BaseException:
            self.shutdown()
            raise
        self.info = ready[self.first_rank]
        self._heartbeats.restart(time.monotonic())
        self._reader = threading.Thread(target=self._read_loop, name="ep-serve-outputs", daemon=True)
        self._reader.start()
        return self.info

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the ranks (politely, then by force) and fail what is still in flight."""
        self._stopping.set()
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    inbox.put(Shutdown())
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout_s)
        self._fail_all("the engine was shut down")
        for q in (*self._inboxes, self._outbox):
            q.close()
            q.cancel_join_thread()
        if self._procs:
            log.info("engine ranks stopped (exit codes %s)", [p.exitcode for p in self._procs])

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and all(p.is_alive() for p in self._procs)

    def unavailable(self) -> str | None:
        """Why the engine takes no requests now, naming the ranks but no exception text (what an
        unauthenticated /health may show); None while it takes them. Sees a rank's exit also before the
        reader thread has."""
        if not self.alive:
            return f"engine is dead: {self.dead_summary or self._exited_reason() or 'a rank exited'}"
        return None if self.stalled_reason is None else f"engine is stalled: {self.stalled_reason}"

    # ------------------------------------------------------------------ requests
    def submit(self, requests: list[Submission]) -> list[int]:
        """Send requests (the choices of one API request) to the least-loaded local ranks, one message
        per rank, so that what they share (a prompt, stop strings) travels and is kept once per rank;
        each one's sink gets its outputs (from the reader thread). Returns their (global) ranks."""
        by_rank: dict[int, list[AddRequest]] = {}
        with self._lock:
            if self.dead_reason is not None:
                raise EngineDeadError(f"engine is dead: {self.dead_reason}")
            if self.stalled_reason is not None:
                raise EngineStalledError(f"engine is stalled: {self.stalled_reason}")
            taken = [r.request_id for r in requests if r.request_id in self._inflight]
            if taken or len({r.request_id for r in requests}) < len(requests):
                raise ValueError(f"request_id: {taken or [r.request_id for r in requests]} already in flight")
            ranks = []
            for r in requests:
                rank = min(range(self.num_ranks), key=lambda i: (self._load[i], i))
                self._inflight[r.request_id] = _InFlight(rank, r.sink)
                self._load[rank] += 1
                ranks.append(rank)
                by_rank.setdefault(rank, []).append(AddRequest(r.request_id, r.prompt_token_ids, r.params, r.priority))
        if self.observer is not None:
            now = time.monotonic()
            for r, rank in zip(requests, ranks):
                self.observer.on_request(self.first_rank + rank, r, now)
        for rank, adds in by_rank.items():
            self._inboxes[rank].put(AddRequests(adds))
        if self.config.expert_parallel:
            for other in range(self.num_ranks):
                if other not in by_rank:
                    self._inboxes[other].put(Wake())
        return [self.first_rank + rank for rank in ranks]

    def abort(self, request_id: str) -> None:
        """Stop a request (its blocks are freed); its final output comes with finish_reason "abort"."""
        with self._lock:
            entry = self._inflight.get(request_id)
        if entry is not None:
            self._inboxes[entry.rank].put(AbortRequest(request_id))

    def load(self) -> list[int]:
        """Requests in flight per local rank (config.local_ranks order)."""
        with self._lock:
            return list(self._load)

    def collect_stats(self, timeout_s: float = 5.0) -> list[EPStats]:
        """Every local rank's device counters (read by the ranks between steps), by rank; [] if they
        do not answer within the timeout."""
        replies: list[StatsReply] = self._ask_every_rank(CollectStats, timeout_s)
        return sorted((r.stats for r in replies), key=lambda s: s.rank)

    def reset_prefix_cache(self, timeout_s: float = 5.0) -> dict[int, bool]:
        """Ask every local rank to forget its prefix cache between steps (LLMEngine.reset_prefix_cache);
        whether each (global) rank did, or {} if they do not all answer within the timeout."""
        replies: list[PrefixCacheReset] = self._ask_every_rank(ResetPrefixCache, timeout_s)
        return {r.rank: r.done for r in sorted(replies, key=lambda r: r.rank)}

    def _ask_every_rank(self, question: Callable[[int], Any], timeout_s: float) -> list[Any]:
        """Send question(token) to every local rank and wait for their answers carrying that token (the
        reader thread collects them); [] if the engine is dead or not all answer within the timeout."""
        if not self.alive:
            return []
        token = next(self._tokens)
        with self._lock:
            self._replies[token] = []
        for inbox in self._inboxes:
            inbox.put(question(token))
        deadline = time.monotonic() + timeout_s
        with self._replies_cv:
            while len(self._replies[token]) < self.num_ranks:
                left = deadline - time.monotonic()
                if left <= 0 or not self._replies_cv.wait(left):
                    break
            replies = self._replies.pop(token)
        return replies if len(replies) == self.num_ranks else []

    # ------------------------------------------------------------------ reader thread
    def _read_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                msg = self._outbox.get(timeout=_READ_POLL_S)
            except queue.Empty:
                self._check_ranks()
                continue
            except (EOFError, OSError):
                break
            now = time.monotonic()
            if isinstance(msg, StepOutputs):
                self._deliver(msg, now)
            elif isinstance(msg, (StatsReply, PrefixCacheReset)):
                with self._replies_cv:
                    if msg.token in self._replies:
                        self._replies[msg.token].append(msg)
                        self._replies_cv.notify_all()
            elif isinstance(msg, RankFailed):
                # A rank whose collective broke because a peer died reports a library error about a
                # closed connection; the peer that exited is the news.
                exited = self._exited_reason(but=msg.rank)
                summary = exited or f"engine rank {msg.rank} failed"
                self._mark_dead(exited or f"{summary}:\n{msg.error}", summary)
            self._check_ranks()

    def _deliver(self, msg: StepOutputs, now: float) -> None:
        if self.observer is not None:
            try:
                self.observer.on_stats(msg.rank, msg.stats)
            except Exception:
                log.exception("observer.on_stats failed")
        for out in msg.outputs:
            with self._lock:
                entry = self._inflight.get(out.request_id)
                if entry is not None and out.finished:
                    del self._inflight[out.request_id]
                    self._load[entry.rank] -= 1
            if entry is not None:
                self._hand_out(entry, out, now)

    def _check_ranks(self) -> None:
        """Note a rank that exited (the engine is dead; exited ranks are reaped, never left as zombies)
        or one that makes no progress (the engine is unavailable while it does not)."""
        reason = self._exited_reason()  # polls every rank process, which reaps those that exited
        if self._stopping.is_set() or self.dead_reason is not None:
            return
        if reason is not None:
            self._mark_dead(reason, reason)
            return
        blamed, late_s = self._heartbeats.stalled(time.monotonic(), self.stall_timeout_s,
                                                  [p.pid for p in self._procs])
        stalled = None
        if blamed:
            stalled = (f"engine rank(s) {[self.first_rank + i for i in blamed]} (pid "
                       f"{[self._procs[i].pid for i in blamed]}) made no progress for {late_s:.1f} s "
                       f"(--rank-stall-timeout {self.stall_timeout_s:g} s)")
        if (stalled is None) != (self.stalled_reason is None):
            if stalled is not None:
                log.error("%s: new requests get 503 until they do", stalled)
            else:
                log.warning("engine ranks make progress again: taking requests")
        self.stalled_reason = stalled

    def _exited_reason(self, but: int | None = None) -> str | None:
        """Which local ranks' processes have exited, other than (global) rank `but`; None if none has."""
        dead = [i for i, p in enumerate(self._procs) if not p.is_alive() and self.first_rank + i != but]
        if not dead:
            return None
        return (f"engine rank(s) {[self.first_rank + i for i in dead]} exited (exit code "
                f"{[self._procs[i].exitcode for i in dead]})")

    def _mark_dead(self, reason: str, summary: str) -> None:
        """reason: for the log and the requests' errors; summary: the same without exception text."""
        with self._lock:
            if self.dead_reason is not None:
                return
            self.dead_reason, self.dead_summary = reason, summary
        if self.config.expert_parallel:
            # The others would wait for the dead rank in their next collective: stop them too.
            killed = [proc for proc in self._procs if proc.is_alive()]
            for proc in killed:
                proc.kill()
            for proc in killed:
                proc.join(_REAP_TIMEOUT_S)
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            entries = list(self._inflight.items())
            self._inflight.clear()
            self._load = [0] * self.num_ranks
        now = time.monotonic()
        for request_id, entry in entries:
            self._hand_out(entry, RequestOutput(request_id, [], "", 0, 0, FINISH_ABORT, error=reason), now)

    def _hand_out(self, entry: _InFlight, out: RequestOutput, now: float) -> None:
        """Observer, then sink; their errors are logged, never allowed to stop the reader thread."""
        try:
            if self.observer is not None:
                self.observer.on_output(self.first_rank + entry.rank, out, now)
            entry.sink(out)
        except Exception:
            log.exception("handing out the output of request %s failed", out.request_id)

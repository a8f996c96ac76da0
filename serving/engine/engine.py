"""`LLMEngine`: one rank's engine. Requests in, a step at a time (schedule, run the model, sample,
detokenize, check stops), request outputs out. `step` is the one step protocol: tests and scripts call
it alone, the rank process (rank_worker.py) with its expert-parallel peers' agreement (step_sync.py);
docs/design.md section 5.

Async scheduling (vLLM's --async-scheduling; SGLang's overlap scheduler): a step's sampled tokens stay
on the device while the next step is scheduled and launched, which reads them there (ModelRunner); only
then does the host wait for them and detokenize, check stops and emit them, while the GPU already runs
that next step. The host's per-step work (scheduling, inputs, detokenizing) then hides under the GPU's
instead of adding to it (benchmarks/RESULTS.md, profile_decode.py). The price: a step's outputs come
back from the next step, and a sequence that stops on EOS or a stop string is computed one step more,
its extra token dropped. Before a step that takes a prompt, `step` only hands out the pending outputs
(`flush_if_prompt_next`): that step runs eagerly, its launch is long, and the last step's outputs (first
tokens among them) would wait for it. Outputs are the same as without it."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from ..forward_batch import to_device
from .block_manager import BlockManager
from .detokenizer import Codec, OutputText, as_codec
from .ep_stats import read_ep_stats
from .messages import EPStats, RequestOutput, SchedulerStats
from .model_runner import ModelRunner
from .sampling import Sampler, make_generator
from .scheduler import ScheduledBatch, Scheduler
from .sequence import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams, Sequence, check_prompt
from .step_sync import StepPlan, StepSync, plan_alone


def eos_token_ids(config: Any) -> frozenset[int]:
    """The model's end-of-sequence ids: config.eos_token_ids (a tuple) or eos_token_id (an int or a list)."""
    eos = getattr(config, "eos_token_ids", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


@dataclass
class PendingStep:
    """A launched step whose sampled tokens the host has not read yet (async scheduling)."""

    seqs: list[Sequence]  # the sequences it sampled, in the order of `tokens`
    tokens: torch.Tensor  # int64 [len(seqs)] on the device: the next step's inputs read them there
    host_tokens: torch.Tensor  # their copy in pinned host memory, complete once `copied` has passed
    copied: torch.cuda.Event | None  # None on CPU


class LLMEngine:
    """async_scheduling: see the module docstring."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, num_blocks: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_tokens_per_rank: int, device: torch.device,
                 seed: int = 0, rank: int = 0, num_ranks: int = 1, use_cuda_graphs: bool = False,
                 async_scheduling: bool = False) -> None:
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_ids = eos_token_ids(cfg)
        self.max_model_len = max_model_len
        if num_blocks * block_size < max_model_len:
            raise ValueError(f"num_kv_blocks: {num_blocks} blocks of {block_size} tokens cannot hold one "
                             f"sequence of max_model_len={max_model_len} tokens")
        self.codec: Codec = as_codec(tokenizer)
        self.device, self.rank, self.num_ranks = device, rank, num_ranks
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_tokens_per_rank, max_model_len)
        self.runner = ModelRunner(model, device, num_blocks, block_size, max_model_len, max_tokens_per_rank,
                                  max_num_seqs, use_cuda_graphs)
        self.sampler = Sampler(device, seed)
        self.model = model
        self.requests: dict[str, Sequence] = {}
        self.async_scheduling = async_scheduling
        self._pending: PendingStep | None = None
        self._alone = StepSync()  # the agreement of a step without peers
        self._steps: dict[str, int] = defaultdict(int)
        self._step_seconds: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; ValueError for an id in use, BadRequest (sequence.check_prompt) for a prompt
        the engine cannot take."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        prompt = list(prompt_token_ids)
        seq = Sequence(request_id, prompt, params, OutputText(self.codec, prompt, params.stop), time.monotonic(),
                       make_generator(params.seed, self.device) if params.seed is not None else None)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its final output, or None if it is not here."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        seq.finish(FINISH_ABORT)
        self.scheduler.finish(seq)
        return self._output(seq, [])

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ------------------------------------------------------------------ stepping
    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule(time.monotonic())

    def execute(self, batch: ScheduledBatch, graph_size: int | None = None) -> list[RequestOutput]:
        """Run the model on `batch` (an empty one too: the MoE layers must take part), sample the
        sequences whose prompt is complete, and return their outputs; with async scheduling, the
        outputs of the step before instead (this step's come from the next execute or flush).
        graph_size: replay the decode graph of that size (a decode-only or empty batch;
        ModelRunner.graph_size), None: eagerly."""
        start = time.perf_counter()
        kind = "empty" if not batch else "decode" if batch.is_decode_only else "prefill"
        before, self._pending = self._pending, None
        outputs: list[RequestOutput] = []
        logits = self.runner.execute(batch, graph_size, before.tokens if before is not None else None)
        done = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        if done:
            seqs = [batch.seqs[i] for i in done]
            rows = logits if len(done) == len(batch.seqs) else logits[to_device(done, torch.int64, logits.device)]
            tokens = self.sampler.sample(rows, [s.params for s in seqs], [s.generator for s in seqs])
            if self.async_scheduling:
                self._pending = self._defer(seqs, tokens)
            else:
                outputs += [self._append(seq, token) for seq, token in zip(seqs, tokens.tolist())]
        if before is not None:
            outputs += self._receive(before)
        self._steps[kind] += 1
        self._step_seconds[kind] += time.perf_counter() - start
        return outputs

    def flush(self) -> list[RequestOutput]:
        """The outputs of the step whose tokens are still on the device (async scheduling), if any."""
        before, self._pending = self._pending, None
        return self._receive(before) if before is not None else []

    def flush_if_prompt_next(self) -> list[RequestOutput]:
        """flush, where the next step may take a prompt (async scheduling): such a step runs eagerly and
        its launch takes the host longer than a decode step takes the GPU, so the pending outputs (first
        tokens among them) go out before it, not after (benchmarks/RESULTS.md, bench_serving.py)."""
        if self._pending is None or not self.scheduler.has_prompt_work():
            return []
        return self.flush()

    def step(self, sync: StepSync | None = None, leaving: bool = False) -> list[RequestOutput]:
        """One step of the protocol (module docstring); the outputs ready now. Where a prompt step is next
        and outputs are pending, it only hands those out. Otherwise it agrees with the peers once (sync;
        None: no peers) and runs the agreed step, an empty batch where this rank has nothing, or, where
        no rank steps, hands out the last step's tokens. leaving: this rank was told to stop; every rank
        then stops (sync.plan.stop) without running anything."""
        if not leaving and (flushed := self.flush_if_prompt_next()):
            return flushed
        batch = ScheduledBatch() if leaving else self.schedule()
        plan = (sync if sync is not None else self._alone).agree(len(batch.seqs), batch.is_decode_only, leaving)
        if plan.stop:
            return []
        if not plan.step:
            return self.flush()
        return self.execute(batch, self._graph_size(plan))

    def _graph_size(self, plan: StepPlan) -> int | None:
        """The decode graph the ranks replay for `plan` (None: eager): where no rank computes a prefill
        chunk, the captured size that holds the agreed padded batch."""
        return self.runner.graph_size(plan.max_num_seqs) if plan.decode_only else None

    def graph_size_alone(self, batch: ScheduledBatch) -> int | None:
        """The decode graph an engine without peers replays for `batch` (None: eager), for callers that
        `execute` batches themselves (benchmarks/profile_decode.py)."""
        return self._graph_size(plan_alone(len(batch.seqs), batch.is_decode_only)) if batch else None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_steps: int = 100_000) -> list[str]:
        """Run prompts to completion (a bounded loop); their output texts, in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        texts = dict.fromkeys(ids, "")
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        for _ in range(max_steps):
            if not any(rid in self.requests for rid in ids):
                break
            for out in self.step():
                if out.request_id in texts:
                    texts[out.request_id] += out.new_text
        else:
            raise RuntimeError(f"generate: not done after {max_steps} steps")
        return [texts[rid] for rid in ids]

    # ------------------------------------------------------------------ stats
    def scheduler_stats(self) -> SchedulerStats:
        s = self.scheduler
        return SchedulerStats(len(s.running), len(s.waiting), self.block_manager.usage, s.num_preemptions)

    def ep_stats(self) -> EPStats:
        """Cumulative device counters (a device sync: call at scrape time only) and step timings."""
        return read_ep_stats(self.model, self.rank, self.num_ranks, dict(self._steps), dict(self._step_seconds))

    # ------------------------------------------------------------------ helpers
    def _defer(self, seqs: list[Sequence], tokens: torch.Tensor) -> PendingStep:
        """Leave `tokens` on the device as the sequences' pending tokens; start their copy to the host."""
        for row, seq in enumerate(seqs):
            seq.num_pending += 1
            seq.pending_row = row
        if tokens.device.type == "cpu":
            return PendingStep(seqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return PendingStep(seqs, tokens, host, copied)

    def _receive(self, pending: PendingStep) -> list[RequestOutput]:
        """Wait for a pending step's tokens and append them; a sequence that finished (or was aborted)
        since then drops its token."""
        if pending.copied is not None:
            pending.copied.synchronize()
        outputs = []
        for seq, token in zip(pending.seqs, pending.host_tokens.tolist()):
            seq.num_pending -= 1
            if not seq.finished:
                outputs.append(self._append(seq, token))
        return outputs

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.output_token_ids.append(token)
        p = seq.params
        if token in self.eos_token_ids and not p.ignore_eos:
            seq.finish(FINISH_STOP)
        elif token in p.stop_token_ids:
            seq.finish(FINISH_STOP, token)
        else:
            stop = seq.text.add(token)
            if stop is not None:
                seq.finish(FINISH_STOP, stop)
            elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens - seq.num_pending >= self.max_model_len:
                seq.finish(FINISH_LENGTH)
        if seq.finished:
            self.requests.pop(seq.request_id, None)
            self.scheduler.finish(seq)
        return self._output(seq, [token])

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        first = bool(new_tokens) and len(seq.output_token_ids) == 1 and seq.first_scheduled_time is not None
        return RequestOutput(
            seq.request_id, new_tokens, seq.text.take(seq.finished), seq.num_prompt_tokens,
            len(seq.output_token_ids), seq.finish_reason, seq.stop_reason,
            seq.first_scheduled_time - seq.arrival_time if first else None)

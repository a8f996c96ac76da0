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
its extra token dropped. Without step graphs, before a step that takes a prompt `step` only hands out
the pending outputs (`flush_if_prompt_next`): that step runs eagerly, its launch is long, and the last
step's outputs (first tokens among them) would wait for it. Outputs are the same as without it.

Logprobs (sampled tokens' and prompt tokens') travel with the sampled tokens: computed on the device,
copied to the host with them (HostCopy) and read when they are read; a request's prompt logprobs go out
with its first token. Penalties read token counts kept on the device (sampling.TokenCounts).

Faults stay with their request: where a request's own host work raises (its token counts, logprobs,
detokenizing, stop checks), that request ends with an error (RequestOutput.internal_error; the
traceback goes to the log) and the engine serves the others. Work on the whole batch (the model, the
sampler, the copies) is not guarded: its failure is a bug that ends the rank."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..forward_batch import HostCopy, to_device
from .block_manager import BlockManager, PrefixCacheStats
from .detokenizer import Codec, OutputText, as_codec
from .engine_config import capture_sizes, graph_budget
from .ep_stats import read_ep_stats
from .messages import EPStats, RequestOutput, SchedulerStats, StepCounters, TokenLogprobs
from .model_runner import ModelRunner, logits_rows
from .sampling import Sampler, SamplerOutput, TokenCounts, make_generator, token_logprobs
from .scheduler import ScheduledBatch, Scheduler
from .sequence import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_REPETITION,
    FINISH_STOP,
    REPETITION_DETECTED,
    PromptLogprobsPart,
    SamplingParams,
    Sequence,
    check_prompt,
)
from .step_sync import StepPlan, StepSync, plan_alone

log = logging.getLogger(__name__)

STEP_KINDS = ("prefill", "decode", "empty")  # the kinds of step the engine counts (StepCounters)


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
    logprob_rows: list[int]  # each sequence's row of the logprobs (SamplerOutput), -1 for none
    copy: HostCopy  # the tokens, then the logprob ids and values where a sequence asked for them


class LLMEngine:
    """async_scheduling: see the module docstring. enable_prefix_caching: sequences start after the
    longest prefix of theirs that earlier ones left in the KV cache (block_manager.py). use_cuda_graphs:
    capture step graphs of `graph_sizes` tokens (None: engine_config.capture_sizes up to the smaller of
    the step budget and T; ModelRunner decides whether graphs can run here)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, num_blocks: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_tokens_per_rank: int, device: torch.device,
                 seed: int = 0, rank: int = 0, num_ranks: int = 1, use_cuda_graphs: bool = False,
                 graph_sizes: list[int] | None = None, async_scheduling: bool = False,
                 token_budget: int | None = None, deepep_mode: str = "low_latency",
                 enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
                 scheduling_policy: str = "fcfs") -> None:
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_ids = eos_token_ids(cfg)
        self.max_model_len = max_model_len
        if num_blocks * block_size < max_model_len:
            raise ValueError(f"num_kv_blocks: {num_blocks} blocks of {block_size} tokens cannot hold one "
                             f"sequence of max_model_len={max_model_len} tokens")
        self.codec: Codec = as_codec(tokenizer)
        self.device, self.rank, self.num_ranks = device, rank, num_ranks
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.max_tokens_per_rank, self.deepep_mode = max_tokens_per_rank, deepep_mode
        budget = token_budget or max_tokens_per_rank
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, budget, max_model_len,
                                   long_prefill_token_threshold, scheduling_policy)
        if not use_cuda_graphs or deepep_mode == "normal":
            graph_sizes = []
        elif graph_sizes is None:
            graph_sizes = capture_sizes(graph_budget(budget, max_tokens_per_rank))
        self.runner = ModelRunner(model, device, num_blocks, block_size, max_model_len, max_tokens_per_rank,
                                  max_num_seqs, graph_sizes)
        self.sampler = Sampler(device, seed)
        self.token_counts = TokenCounts(self.vocab_size, device)
        self.model = model
        self.requests: dict[str, Sequence] = {}
        self.async_scheduling = async_scheduling
        self._pending: PendingStep | None = None
        self._alone = StepSync()  # the agreement of a step without peers
        self._step_counters = StepCounters.zero(STEP_KINDS)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Queue a request; ValueError for an id in use or a priority without the priority policy, BadRequest
        (sequence.check_prompt, SamplingParams.check_vocabulary) for a prompt or token ids the engine cannot take."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if priority and not self.scheduler.by_priority:
            raise ValueError(f"priority: {priority} needs the priority scheduling policy (this engine's is fcfs)")
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        params.check_vocabulary(self.vocab_size)
        prompt = list(prompt_token_ids)
        text = OutputText(self.codec, prompt, params.stop, min_tokens=params.min_tokens,
                          include_stop=params.include_stop_str_in_output,
                          skip_special_tokens=params.skip_special_tokens,
                          spaces_between_special_tokens=params.spaces_between_special_tokens)
        seq = Sequence(request_id, prompt, params, text, time.monotonic(),
                       make_generator(params.seed, self.device) if params.seed is not None else None, priority)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its final output, or None if it is not here."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        seq.finish(FINISH_ABORT)
        self._release(seq)
        try:
            return self._output(seq, [])
        except Exception as e:  # its text's last decode
            return self._fail(seq, e)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ------------------------------------------------------------------ stepping
    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule(time.monotonic())

    def execute(self, batch: ScheduledBatch, graph_size: int | None = None,
                moe_mode: str = "low_latency") -> list[RequestOutput]:
        """Run the model on `batch` (an empty one too: the MoE layers must take part), sample the
        sequences whose prompt is complete, and return their outputs; with async scheduling, the
        outputs of the step before instead (this step's come from the next execute or flush).
        graph_size: replay the step graph of that size (ModelRunner.graph_size; the batch must fit it),
        None: eagerly. moe_mode: the MoE layers' dispatch mode, the same on every rank (FusedMoE.forward)."""
        start = time.perf_counter()
        kind = "empty" if not batch else "decode" if batch.is_decode_only else "prefill"
        before, self._pending = self._pending, None
        outputs: list[RequestOutput] = []
        logits = self.runner.execute(batch, graph_size, before.tokens if before is not None else None, moe_mode)
        ends = list(itertools.accumulate(logits_rows(batch)))  # past each sequence's logits rows
        self._prompt_logprobs(batch, ends, logits)
        done = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        # The step's tokens as vLLM counts an iteration's: the prompt tokens it computed and the tokens it samples.
        iteration_tokens = len(done) if kind == "decode" else len(done) + sum(
            min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_computed_tokens < seq.num_prompt_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        if done:
            seqs = [batch.seqs[i] for i in done]
            last = [ends[i] - 1 for i in done]  # each sequence's last logits row gives its next token
            if last != list(range(logits.shape[0])):
                logits = logits[to_device(last, torch.int64, logits.device)]
            step = self._sample(seqs, logits, outputs)
            if self.async_scheduling:
                self._pending = step
            else:
                outputs += self._receive(step)
        if before is not None:
            outputs += self._receive(before)
        self._step_counters.add(kind, time.perf_counter() - start, iteration_tokens)
        return outputs

    def flush(self) -> list[RequestOutput]:
        """The outputs of the step whose tokens are still on the device (async scheduling), if any."""
        before, self._pending = self._pending, None
        return self._receive(before) if before is not None else []

    def flush_if_prompt_next(self) -> list[RequestOutput]:
        """flush, where the next step may take a prompt and run eagerly (async scheduling): no step graphs are
        captured, or it may hold more tokens than the largest. An eager step's launch takes the host longer
        than a decode step takes the GPU (and a normal-mode step waits for its dispatch's counts), so the
        pending outputs (first tokens among them) go out before it, not after it."""
        if self._pending is None or not self.scheduler.has_prompt_work():
            return []
        sizes = self.runner.captured_sizes
        if sizes and not self.scheduler.may_take_more_than(sizes[-1]):
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
        plan = (sync if sync is not None else self._alone).agree(batch.num_tokens, leaving)
        if plan.stop:
            return []
        if not plan.step:
            return self.flush()
        mode = self.moe_mode(plan)
        return self.execute(batch, self._graph_size(plan) if mode == "low_latency" else None, mode)

    def moe_mode(self, plan: StepPlan) -> str:
        """The MoE layers' dispatch mode for `plan` (every rank derives the same one from it): deepep_mode,
        where "auto" is normal mode for a step in which some rank holds more tokens than the low-latency
        buffer's T."""
        if self.deepep_mode == "auto":
            return "normal" if plan.max_num_tokens > self.max_tokens_per_rank else "low_latency"
        return self.deepep_mode

    def _graph_size(self, plan: StepPlan) -> int | None:
        """The step graph every rank replays for `plan` (None: eager): the captured size that holds the
        agreed token count. Each rank's batch fits it: at most that many tokens, so at most that many
        sequences, and the scheduler runs at most max_num_seqs (ModelRunner.fits_graph)."""
        return self.runner.graph_size(plan.max_num_tokens)

    def graph_size_alone(self, batch: ScheduledBatch) -> int | None:
        """The step graph an engine without peers replays for `batch` (None: eager), for callers that
        `execute` batches themselves (benchmarks/profile_decode.py)."""
        return self._graph_size(plan_alone(batch.num_tokens)) if batch else None

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
        s, bm = self.scheduler, self.block_manager
        return SchedulerStats(len(s.running), len(s.waiting), bm.usage, s.num_preemptions, bm.stats.queries,
                              bm.stats.hits)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached blocks (BlockManager.reset): only while no sequence holds blocks, else False."""
        return self.block_manager.reset()

    def forget_history(self) -> None:
        """Back to the state of a fresh engine once idle (after warm_up.py): no cached prefix, no prefix cache
        queries or preemptions counted, no step timings."""
        if self.has_work() or not self.block_manager.reset():
            raise RuntimeError("forget_history: the engine still has requests")
        self.block_manager.stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0
        self._step_counters = StepCounters.zero(STEP_KINDS)

    def ep_stats(self) -> EPStats:
        """Cumulative device counters (a device sync: call at scrape time only) and step counters."""
        return read_ep_stats(self.model, self.rank, self.num_ranks, self._step_counters.copy())

    # ------------------------------------------------------------------ helpers
    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, outputs: list[RequestOutput]) -> PendingStep:
        """Sample the sequences' next tokens from their logits rows (penalized ones with their token
        counts, which then count the new tokens), leave them on the device as the sequences' pending
        tokens and start their copy to the host, with their logprobs. A sequence whose token counts
        cannot be set up fails alone (its output joins `outputs`); its token is sampled without
        penalties and dropped."""
        penalized = []
        for i, seq in enumerate(seqs):
            if not seq.params.penalized:
                continue
            if seq.counts_row < 0:
                try:
                    seq.counts_row = self.token_counts.assign(seq.prompt_token_ids, seq.output_token_ids)
                except Exception as e:
                    outputs.append(self._fail(seq, e))
                    continue
            penalized.append(i)
        history = None
        if penalized:
            history = self.token_counts.history(penalized, [seqs[i].counts_row for i in penalized])
        out: SamplerOutput = self.sampler.run(logits, [s.params for s in seqs], [s.generator for s in seqs], history,
                                              self._banned(seqs, logits.shape[1]))
        if history is not None:
            self.token_counts.record(history, out.tokens)
        for row, seq in enumerate(seqs):
            seq.num_pending += 1
            seq.pending_row = row
        tensors = [out.tokens]
        if out.logprob_ids is not None and out.logprob_values is not None and out.logprob_ranks is not None:
            tensors += [out.logprob_ids, out.logprob_values, out.logprob_ranks]
        return PendingStep(seqs, out.tokens, out.logprob_rows, HostCopy(tensors))

    def _banned(self, seqs: list[Sequence], vocab: int) -> tuple[list[int], list[int]] | None:
        """The (row, token id) pairs the sampler may not draw: a sequence's stop tokens (EOS unless
        ignore_eos, its stop token ids) while its output is shorter than min_tokens; None for none."""
        rows: list[int] = []
        token_ids: list[int] = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.min_tokens and len(seq.output_token_ids) + seq.num_pending < p.min_tokens:
                ids = [t for t in p.banned_before_min_tokens(self.eos_token_ids) if t < vocab]
                rows += [row] * len(ids)
                token_ids += ids
        return (rows, token_ids) if rows else None

    def _prompt_logprobs(self, batch: ScheduledBatch, ends: list[int], logits: torch.Tensor) -> None:
        """Compute, on the device, the prompt logprobs this step's logits give (each sequence's rows end
        before `ends`) and start their copy to the host; they wait on the sequences until their first
        token goes out."""
        picks: list[int] = []
        targets: list[int] = []
        owners: list[tuple[Sequence, int, int]] = []
        for seq, n, end in zip(batch.seqs, batch.num_new_tokens, ends):
            positions = seq.prompt_logprob_positions(n)
            if not positions:
                continue
            first_row = end - n - seq.num_computed_tokens  # the row of position p is first_row + p
            lo = len(picks)
            picks += [first_row + p for p in positions]
            targets += seq.prompt_token_ids[positions.start + 1:positions.stop + 1]
            owners.append((seq, lo, len(picks)))
            seq.num_prompt_logprobs = positions.stop
        if not picks:
            return
        k = max(seq.params.prompt_logprobs or 0 for seq, _, _ in owners)
        device = logits.device
        copy = HostCopy(list(token_logprobs(logits[to_device(picks, torch.int64, device)],
                                            to_device(targets, torch.int64, device), k)))
        for seq, lo, hi in owners:
            seq.prompt_logprob_parts.append(PromptLogprobsPart(copy, lo, hi))

    def _receive(self, pending: PendingStep) -> list[RequestOutput]:
        """Wait for a pending step's tokens (and logprobs) and append them; a sequence that finished (or
        was aborted) since then drops its token. One whose logprobs, text or stop checks raise fails alone."""
        host = pending.copy.get()
        ids, values, ranks = (host[1].tolist(), host[2].tolist(), host[3].tolist()) if len(host) > 1 else ([], [], [])
        outputs = []
        for seq, token, row in zip(pending.seqs, host[0].tolist(), pending.logprob_rows):
            seq.num_pending -= 1
            if seq.finished:
                continue
            try:
                logprobs = _logprobs(ids[row], values[row], ranks[row], seq.params.logprobs) if row >= 0 else None
                outputs.append(self._append(seq, token, logprobs))
            except Exception as e:
                outputs.append(self._fail(seq, e))
        return outputs

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a request whose own host work raised `error` (a bug, or a tokenizer that cannot decode its
        tokens) instead of the rank and everyone on it: the traceback goes to the log, its blocks and
        token counts are freed, and its last output says so (internal_error; only the exception's type,
        as the server's 500s)."""
        log.error("request %s failed; it ends, the engine goes on", seq.request_id, exc_info=error)
        seq.finish(FINISH_ABORT)
        self.requests.pop(seq.request_id, None)
        self._release(seq)
        return RequestOutput(seq.request_id, [], "", seq.num_prompt_tokens, len(seq.output_token_ids), FINISH_ABORT,
                             error=f"request {seq.request_id}: internal error ({type(error).__name__}); see the "
                                   "server log", internal_error=True)

    def _release(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks and token counts."""
        self.scheduler.finish(seq)
        if seq.counts_row >= 0:
            self.token_counts.release(seq.counts_row)
            seq.counts_row = -1

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        seq.output_token_ids.append(token)
        p = seq.params
        eos = token in self.eos_token_ids and not p.ignore_eos
        if eos or token in p.stop_token_ids:
            if p.include_stop_str_in_output:  # the stop token's text too (vLLM's detokenizer)
                seq.text.add(token, check_stops=False)
            seq.finish(FINISH_STOP, None if eos else token)
        else:
            stop = seq.text.add(token)
            if stop is not None:
                seq.finish(FINISH_STOP, stop)
            elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens - seq.num_pending >= self.max_model_len:
                seq.finish(FINISH_LENGTH)
            elif (p.repetition_detection is not None and len(seq.output_token_ids) >= p.min_tokens
                  and p.repetition_detection.found(seq.output_token_ids)):
                seq.finish(FINISH_REPETITION, REPETITION_DETECTED)
        if seq.finished:
            self.requests.pop(seq.request_id, None)
            self._release(seq)
        return self._output(seq, [token], logprobs)

    def _output(self, seq: Sequence, new_tokens: list[int], logprobs: TokenLogprobs | None = None) -> RequestOutput:
        first = bool(new_tokens) and len(seq.output_token_ids) == 1
        return RequestOutput(
            seq.request_id, new_tokens, seq.text.take(seq.finished), seq.num_prompt_tokens,
            len(seq.output_token_ids), seq.finish_reason, seq.stop_reason,
            seq.first_scheduled_time - seq.arrival_time if first and seq.first_scheduled_time is not None else None,
            logprobs=[logprobs] if logprobs is not None else None,
            prompt_logprobs=_take_prompt_logprobs(seq) if first and seq.params.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens if first else None)


def _logprobs(ids: list[int], values: list[float], rank: int, k: int | None) -> TokenLogprobs:
    """A token's TokenLogprobs from its row of a step's logprobs (its own first, then the step's top) and rank."""
    k = k or 0
    return TokenLogprobs(values[0], tuple(zip(ids[1:1 + k], values[1:1 + k])), rank)


def _take_prompt_logprobs(seq: Sequence) -> list[TokenLogprobs | None]:
    """A sequence's prompt logprobs (None for its first token), read from the host copies of its chunks."""
    out: list[TokenLogprobs | None] = [None]
    for part in seq.prompt_logprob_parts:
        ids, values, ranks = part.copy.get()
        out += map(_logprobs, ids[part.lo:part.hi].tolist(), values[part.lo:part.hi].tolist(),
                   ranks[part.lo:part.hi].tolist(), [seq.params.prompt_logprobs] * (part.hi - part.lo))
    seq.prompt_logprob_parts = []
    if len(out) != seq.num_prompt_tokens:
        raise RuntimeError(f"request {seq.request_id!r}: {len(out)} prompt logprobs for {seq.num_prompt_tokens} "
                           "prompt tokens")
    return out

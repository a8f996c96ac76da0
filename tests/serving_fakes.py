"""A fake model and tokenizer that obey the engine/model contract (serving/forward_batch.py), for the
engine and API tests.

FakeModel checks every ForwardBatch invariant, writes each new token id into its paged "KV cache" at
the batch's slot, and computes a sequence's logits from the last three tokens *read back through its
block table* and the position: a scheduler or block manager bug changes the text. `reference_next`
computes the same logits from a plain token list, so tests know the right answer independently.
With a process group, every forward (empty ones too) all-gathers a step counter: ranks that do not
step together fail, as a real MoE layer's dispatch would hang.

FakeTokenizer: byte-level, with tokens that are single UTF-8 bytes of multi-byte characters (so the
incremental detokenizer must hold text back) and a few multi-character tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from serving.forward_batch import ForwardBatch

EOS = 0
_REAL: list[bytes] = [b"<eos>", *(bytes([c]) for c in b" abcdefghijklmnopqrstuvwxyz.,!?"),
                      b"the ", b"ing ", b"and ", "é".encode(), b"\xc3", b"\xa9", "€".encode()[:2],
                      "€".encode()[2:], "日本".encode()]
VOCAB = 64
_PIECES = _REAL + [f"<{i}>".encode() for i in range(len(_REAL), VOCAB)]  # rarely sampled filler tokens
KV_DIM, LAYERS = 4, 2
_WINDOW = 3


class FakeTokenizer:
    """encode: longest match over the pieces (bytes); decode: join the pieces, UTF-8 with replacement."""

    def encode(self, text: str) -> list[int]:
        data, ids, i = text.encode(), [], 0
        by_len = sorted(range(1, len(_PIECES)), key=lambda t: -len(_PIECES[t]))
        while i < len(data):
            tok = next((t for t in by_len if data.startswith(_PIECES[t], i) and not _PIECES[t].startswith(b"<")),
                       None)
            if tok is None:
                raise ValueError(f"FakeTokenizer cannot encode {data[i:i + 1]!r}")
            ids.append(tok)
            i += len(_PIECES[tok])
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """EOS (<eos>) is its one special token."""
        kept = (t for t in token_ids if t != EOS or not skip_special_tokens)
        return b"".join(_PIECES[t] for t in kept).decode("utf-8", errors="replace")

    def special_tokens(self) -> dict[int, str]:
        return {EOS: _PIECES[EOS].decode()}


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = VOCAB
    eos_token_id: int = EOS
    max_position_embeddings: int = 256
    kv_cache_dim: int = KV_DIM
    num_hidden_layers: int = LAYERS


def _logits_for(window: list[int], position: int, eos_bias: float) -> torch.Tensor:
    """Deterministic float32 [VOCAB] from the last tokens and the position."""
    seed = 1469598103934665603
    for v in [*window, position]:
        seed = (seed ^ (v + 1)) * 1099511628211 % (1 << 61)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=gen) * 3
    logits[len(_REAL):] -= 6  # filler tokens: unlikely
    logits[EOS] += eos_bias
    return logits


class FakeModel(nn.Module):
    def __init__(self, max_tokens_per_rank: int, group: dist.ProcessGroup | None = None, eos_bias: float = -4.0,
                 max_position_embeddings: int = 256, step_delay_s: float = 0.0) -> None:
        super().__init__()
        self.config = FakeConfig(max_position_embeddings=max_position_embeddings)
        self.max_tokens_per_rank, self.group, self.eos_bias = max_tokens_per_rank, group, eos_bias
        self.step_delay_s = step_delay_s
        self.kv: torch.Tensor | None = None
        self.block_size = 0
        self.num_forwards = 0
        self.num_empty_forwards = 0
        self.max_batch_tokens = 0
        self.batches: list[tuple[int, int]] = []  # (num_seqs, num_tokens) of each forward
        self.moe_modes: list[str] = []  # ForwardBatch.moe_mode of each forward

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        # Token id + 1 per slot (0 = never written), so a read of a stale or foreign slot shows up.
        self.kv = torch.zeros(num_blocks * block_size, dtype=torch.int64)
        self.block_size = block_size

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert self.kv is not None, "allocate_kv_cache was not called"
        self._check(batch)
        self._lockstep(batch.moe_mode)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_forwards += 1
        self.num_empty_forwards += batch.num_tokens == 0
        self.max_batch_tokens = max(self.max_batch_tokens, batch.num_tokens)
        self.batches.append((batch.num_seqs, batch.num_tokens))
        self.moe_modes.append(batch.moe_mode)
        self.kv[batch.slot_mapping] = batch.input_ids + 1
        # One row per entry of logits_indices (a sequence's last new token, or each of its new tokens
        # where it asks for prompt logprobs): the logits after the tokens up to that one.
        rows = batch.logits_indices.tolist()
        starts = batch.query_start.tolist()
        out = torch.empty(len(rows), VOCAB, dtype=torch.float32)
        bs = self.block_size
        i = 0
        for r, j in enumerate(rows):
            while j >= starts[i + 1]:
                i += 1
            length = int(batch.positions[j]) + 1  # the sequence's tokens up to and including token j
            table = batch.block_tables[i]
            positions = range(max(0, length - _WINDOW), length)
            window = [int(self.kv[int(table[p // bs]) * bs + p % bs]) - 1 for p in positions]
            assert min(window) >= 0, f"sequence {i}: read a KV slot that was never written"
            out[r] = self._next_logits(window, length - 1)
        return out

    def _next_logits(self, window: list[int], position: int) -> torch.Tensor:
        """The logits after the last tokens `window`, the last one at `position`."""
        return _logits_for(window, position, self.eos_bias)

    def _check(self, b: ForwardBatch) -> None:
        n, s = b.num_tokens, b.num_seqs
        assert b.input_ids.dtype == torch.int64 and b.positions.dtype == torch.int64
        assert b.slot_mapping.dtype == torch.int64 and b.logits_indices.dtype == torch.int64
        assert b.query_start.dtype == torch.int32 and b.seq_lens.dtype == torch.int32
        assert b.block_tables.dtype == torch.int32 and b.block_tables.dim() == 2
        assert b.positions.shape == (n,) and b.slot_mapping.shape == (n,)
        assert b.query_start.shape == (s + 1,) and b.logits_indices.dim() == 1
        assert b.block_tables.shape[0] == s
        assert b.moe_mode in ("low_latency", "normal"), b.moe_mode
        assert n <= self.max_tokens_per_rank or b.moe_mode == "normal", \
            f"{n} tokens > max_tokens_per_rank={self.max_tokens_per_rank} in low-latency mode"
        assert int(b.query_start[0]) == 0 and int(b.query_start[-1]) == n
        assert n == 0 or (int(b.input_ids.min()) >= 0 and int(b.input_ids.max()) < VOCAB)
        rows = b.logits_indices.tolist()
        assert rows == sorted(set(rows)) and all(0 <= j < n for j in rows), f"logits_indices {rows}"
        bs = self.block_size
        for i in range(s):
            lo, hi = int(b.query_start[i]), int(b.query_start[i + 1])
            length = int(b.seq_lens[i])
            assert hi > lo, f"sequence {i} has no new tokens"
            assert b.positions[lo:hi].tolist() == list(range(length - (hi - lo), length))
            # This sequence's rows: its last new token, or all its new tokens (prompt logprobs).
            mine = [j for j in rows if lo <= j < hi]
            assert mine in ([hi - 1], list(range(lo, hi))), f"sequence {i}: logits rows {mine}, new tokens [{lo}, {hi})"
            table = b.block_tables[i].tolist()
            used = -(-length // bs)
            assert all(x >= 0 for x in table[:used]) and all(x == -1 for x in table[used:])
            for j in range(lo, hi):
                p = int(b.positions[j])
                assert int(b.slot_mapping[j]) == table[p // bs] * bs + p % bs
        assert len(set(b.slot_mapping.tolist())) == n, "two tokens write the same KV slot"

    def _lockstep(self, moe_mode: str) -> None:
        """Every rank runs its n-th forward together with the others, in the same MoE dispatch mode."""
        if self.group is None:
            return
        mine = torch.tensor([self.num_forwards, moe_mode == "normal"], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        counts, normal = [int(t[0]) for t in every], [bool(t[1]) for t in every]
        assert len(set(counts)) == 1, f"ranks out of step: forward counts {counts}"
        assert len(set(normal)) == 1, f"ranks disagree on the MoE dispatch mode (normal: {normal})"


def reference_next(tokens: list[int], eos_bias: float = -4.0) -> torch.Tensor:
    """The logits FakeModel gives after `tokens`, computed from the plain list."""
    return _logits_for(tokens[-_WINDOW:], len(tokens) - 1, eos_bias)


def reference_greedy(prompt: list[int], max_tokens: int, eos_bias: float = -4.0,
                     ignore_eos: bool = False) -> list[int]:
    """Greedy continuation of `prompt` (stops after EOS unless ignore_eos)."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = int(torch.argmax(reference_next(tokens, eos_bias)))
        out.append(t)
        tokens.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


THINK_START_ID, THINK_END_ID = VOCAB - 2, VOCAB - 1  # two filler ids, "<think>" and "</think>" to ThinkingTokenizer
# ThinkingModel's one output: "<think>", "a", "b", "</think>", " ", "c", EOS (each token's successor).
THINKING_CHAIN = {THINK_START_ID: 2, 2: 3, 3: THINK_END_ID, THINK_END_ID: 1, 1: 4, 4: EOS}


class ThinkingTokenizer(FakeTokenizer):
    """FakeTokenizer whose last two filler ids are DeepSeek's thinking markers, added tokens that are not special
    (decoded into the text, as DeepSeek-R1's tokenizer has them)."""

    _MARKERS: ClassVar[dict[int, bytes]] = {THINK_START_ID: b"<think>", THINK_END_ID: b"</think>"}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = (t for t in token_ids if t != EOS or not skip_special_tokens)
        return b"".join(self._MARKERS.get(t, _PIECES[t]) for t in kept).decode("utf-8", errors="replace")

    def special_tokens(self) -> dict[int, str]:
        return {**super().special_tokens(), **{t: m.decode() for t, m in self._MARKERS.items()}}


class ThinkingModel(FakeModel):
    """After any token outside THINKING_CHAIN it starts the chain: every answer thinks "ab" and says " c"."""

    def _next_logits(self, window: list[int], position: int) -> torch.Tensor:
        logits = torch.zeros(VOCAB)
        logits[THINKING_CHAIN.get(window[-1], THINK_START_ID)] = 30.0
        return logits


# ToolCallingModel's one output, as ToolCallingTokenizer decodes it (DeepSeek-V3's tool call format): content, then
# two calls. Filler ids stand for the markers (added tokens that are not special) and for longer pieces.
TOOL_PIECES: dict[int, bytes] = {
    48: "<｜tool▁calls▁begin｜>".encode(), 49: "<｜tool▁calls▁end｜>".encode(),  # noqa: RUF001
    50: "<｜tool▁call▁begin｜>".encode(), 51: "<｜tool▁call▁end｜>".encode(), 52: "<｜tool▁sep｜>".encode(),  # noqa: RUF001
    53: b"Let me look.", 54: b"function", 55: b"function", 56: b"get_weather", 57: b"get_time", 58: b"\n```json\n",
    59: b'{"city": "Paris", "unit": "celsius"}', 60: b'{"zone": "CET"}', 61: b"\n```"}
TOOL_CALLS_SCRIPT = [53, 48, 50, 54, 52, 56, 58, 59, 61, 51, 50, 55, 52, 57, 58, 60, 61, 51, 49, EOS]
TOOL_CALLS_TEXT = b"".join(TOOL_PIECES.get(t, b"") for t in TOOL_CALLS_SCRIPT).decode()


# ThinkingToolCallingModel's: it thinks "a", then says and calls as ToolCallingModel.
THINK_TOOL_CALLS_SCRIPT = [THINK_START_ID, 2, THINK_END_ID, *TOOL_CALLS_SCRIPT]


class ToolCallingTokenizer(ThinkingTokenizer):
    """ThinkingTokenizer with DeepSeek-V3's tool call markers and ToolCallingModel's pieces (TOOL_PIECES)."""

    _MARKERS: ClassVar[dict[int, bytes]] = {**ThinkingTokenizer._MARKERS, **TOOL_PIECES}

    def special_tokens(self) -> dict[int, str]:
        return {**super().special_tokens(), **{t: TOOL_PIECES[t].decode() for t in range(48, 53)}}


class ToolCallingModel(FakeModel):
    """Follows its script (TOOL_CALLS_SCRIPT): the next token is the one after the longest end of the window that
    occurs in the script once; after anything else it starts the script."""

    script: ClassVar[list[int]] = TOOL_CALLS_SCRIPT

    def _next_logits(self, window: list[int], position: int) -> torch.Tensor:
        script = self.script
        following = script[0]
        for n in range(min(3, len(window)), 0, -1):
            after = {script[i + n] for i in range(len(script) - n) if script[i:i + n] == window[-n:]}
            if len(after) == 1:
                following = after.pop()
                break
        logits = torch.zeros(VOCAB)
        logits[following] = 30.0
        return logits


class ThinkingToolCallingModel(ToolCallingModel):
    script: ClassVar[list[int]] = THINK_TOOL_CALLS_SCRIPT


# This module is an EngineConfig.loader ("serving_fakes"): config.model "fake", "fake-eos" (EOS likely),
# "fake-slow" (10 ms per forward), "fake-think" (ThinkingModel and ThinkingTokenizer), "fake-tools" (ToolCallingModel
# and ToolCallingTokenizer) or "fake-think-tools" (ThinkingToolCallingModel and ToolCallingTokenizer).
SCRIPTED_MODELS = {"fake-think": ThinkingModel, "fake-tools": ToolCallingModel,
                   "fake-think-tools": ThinkingToolCallingModel}


def load_model(config: Any, group: dist.ProcessGroup | None, device: torch.device) -> tuple[FakeModel, FakeTokenizer]:
    if config.model in SCRIPTED_MODELS:
        return SCRIPTED_MODELS[config.model](config.max_tokens_per_rank, group), load_tokenizer(config)
    eos_bias = 8.0 if config.model == "fake-eos" else -4.0
    delay = 0.01 if config.model == "fake-slow" else 0.0
    return FakeModel(config.max_tokens_per_rank, group, eos_bias, step_delay_s=delay), FakeTokenizer()


def load_tokenizer(config: Any) -> FakeTokenizer:
    tokenizers = {"fake-think": ThinkingTokenizer, "fake-tools": ToolCallingTokenizer,
                  "fake-think-tools": ToolCallingTokenizer}
    return tokenizers.get(config.model, FakeTokenizer)()

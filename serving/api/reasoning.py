"""vLLM's --reasoning-parser for DeepSeek's thinking models: a chat response's text before "</think>" is its
`reasoning`, the rest its `content` (vLLM 0.34.0's vllm/reasoning/basic_parsers.py, BaseThinkingReasoningParser,
and deepseek_r1_reasoning_parser.py / deepseek_v3_reasoning_parser.py, the rules followed here).

- deepseek_r1: every response thinks. DeepSeek-R1's chat template ends the prompt with "<think>", so the output
  starts inside the thinking: text before "</think>" is reasoning even without a "<think>" in the output.
- deepseek_v3: a request thinks where its chat_template_kwargs set `thinking` or `enable_thinking` (DeepSeek-V3.1's
  template reads them); otherwise everything is content.

Streamed, each output's new text goes to one side or splits at the marker; an output that is the marker token
alone sends nothing. The markers are found by their token ids (the tokenizer's added tokens must hold both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTokens:
    """The tokenizer's ids of the thinking markers."""

    start: int
    end: int

    @classmethod
    def of(cls, added_tokens: Mapping[int, str]) -> ThinkTokens:
        """From the tokenizer's added tokens, id to text (Codec.special_tokens; DeepSeek's thinking tokenizers add
        both markers): ValueError naming --reasoning-parser where a marker is not among them."""
        ids = {text: i for i, text in added_tokens.items()}
        missing = [m for m in (THINK_START, THINK_END) if m not in ids]
        if missing:
            raise ValueError(f"--reasoning-parser: the tokenizer has no {' and no '.join(missing)} token, which "
                             f"DeepSeek's thinking models mark their reasoning with")
        return cls(ids[THINK_START], ids[THINK_END])


def thinks(parser: str, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a request's response is split into reasoning and content under `parser`."""
    if parser == "deepseek_r1":
        return True
    kwargs = chat_template_kwargs or {}
    return bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """A whole response's (reasoning, content): after a "<think>" if there is one, the text up to "</think>" is
    the reasoning and the rest the content (None where empty); without "</think>" all of it is reasoning."""
    before, marker, after = text.partition(THINK_START)
    text = after if marker else before
    if THINK_END not in text:
        return text, None
    reasoning, _, content = text.partition(THINK_END)
    return reasoning, content or None


class ReasoningStream:
    """One streamed choice's split: `feed` each output's new text and token ids, in order; it returns that
    output's (reasoning, content) pieces, None for a side it adds nothing to (both None: send nothing)."""

    def __init__(self, tokens: ThinkTokens) -> None:
        self.tokens = tokens
        self._started = self._ended = False  # the markers among the earlier outputs' tokens

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        start, end = self.tokens.start, self.tokens.end
        started, ended = self._started, self._ended
        self._started |= start in token_ids
        self._ended |= end in token_ids
        if len(token_ids) == 1 and token_ids[0] in (start, end):
            return None, None
        if not started and start in token_ids:  # the thinking opens in this output
            if end in token_ids:
                begin, stop = text.find(THINK_START), text.find(THINK_END)
                return text[begin + len(THINK_START):stop], text[stop + len(THINK_END):] or None
            return text, None
        if end in token_ids:
            stop = text.find(THINK_END)
            return text[:stop], text[stop + len(THINK_END):] or None
        return (None, text) if ended else (text, None)

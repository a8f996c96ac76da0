"""vLLM's --tool-call-parser for DeepSeek-V3: the tool calls in a chat response's text, whole and streamed.

DeepSeek-V3 writes its calls after any content, between marker tokens (one token each in its tokenizer,
added tokens that are not special, so they stay in the decoded text):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>...more calls...<｜tool▁calls▁end｜>

The format, and what a response's content is around it (the text before the first calls marker and after the
last end marker), as vLLM 0.34.0's vllm/tool_parsers/deepseekv3_tool_parser.py reads them; the tests check the
whole-response parse against that parser. A streamed choice's deltas add up to the whole parse of a complete
response: its content, then each call's name (with its id) once known, and its arguments as they grow.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("deepseek_v3",)
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # noqa: RUF001 - DeepSeek's tokens
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"  # noqa: RUF001
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
ARGUMENTS_OPEN, ARGUMENTS_CLOSE = "\n```json\n", "\n```"
# One complete call: its type and name (each within one line) and its arguments, up to the first close.
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?P<type>.*)" + re.escape(SEP) + r"(?P<name>.*)"
                   + re.escape(ARGUMENTS_OPEN) + r"(?P<arguments>[\s\S]*?)" + re.escape(ARGUMENTS_CLOSE + CALL_END))


def check_markers(added_tokens: Mapping[int, str]) -> None:
    """ValueError naming --tool-call-parser where the tokenizer's added tokens (id to text) lack a marker."""
    have = set(added_tokens.values())
    missing = [m for m in MARKERS if m not in have]
    if missing:
        raise ValueError(f"--tool-call-parser: the tokenizer has no {', '.join(missing)} token (DeepSeek-V3's tool "
                         f"call markers)")


def tool_call_id() -> str:
    """A new call's id, in vLLM's form (make_tool_call_id: "chatcmpl-tool-" and 16 hex digits)."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class ToolCall:
    type: str
    name: str
    arguments: str


def extract_tool_calls(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """A whole response's (content, calls), or None where it holds no calls marker (all of it is content).
    Content is the text before the calls marker and after the last end marker (None where empty); a call
    that does not match the format is left out."""
    begin = text.find(CALLS_BEGIN)
    if begin < 0:
        return None
    calls = [ToolCall(m["type"], m["name"], m["arguments"]) for m in _CALL.finditer(text)]
    end = text.rfind(CALLS_END)
    content = text[:begin] + (text[end + len(CALLS_END):] if end >= 0 else "")
    return content or None, calls


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (to be held until the next output says)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _StreamedCall:
    index: int  # among the calls sent (one that does not follow the format is left out, as the whole parse does)
    id: str
    name_sent: bool = False
    arguments_sent: int = 0  # characters of the arguments sent


@dataclass
class ToolCallStream:
    """One streamed choice's parse: `feed` each output's new text, in order, with finished on the last; it returns
    that output's content piece (None: nothing) and tool-call deltas (OpenAI's: {"index", "id", "type",
    "function": {"name"}} for a call's start, then {"index", "function": {"arguments"}} pieces)."""

    _text: str = ""
    _content_sent: int = 0  # characters of the content sent
    _calls: dict[int, _StreamedCall] = field(default_factory=dict)  # by the call's place in the text

    def feed(self, new_text: str, finished: bool = False) -> tuple[str | None, list[dict]]:
        self._text += new_text
        text = self._text
        begin = text.find(CALLS_BEGIN)
        if begin < 0:  # content so far, less a tail that may still become the calls marker
            return self._content(text[:len(text) - (0 if finished else _held_back(text, CALLS_BEGIN))]), []
        deltas: list[dict] = []
        end = text.find(CALLS_END, begin)
        region = text[begin + len(CALLS_BEGIN):end if end >= 0 else len(text)]
        for place, piece in enumerate(region.split(CALL_BEGIN)[1:]):
            deltas.extend(self._call_deltas(place, piece, finished))
        after = text[end + len(CALLS_END):] if end >= 0 else ""
        content = self._content(text[:begin] + after)
        return content, deltas

    def _content(self, content: str) -> str | None:
        piece = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        return piece or None

    def _call_deltas(self, place: int, piece: str, finished: bool) -> list[dict]:
        """The deltas of the call at `place` in the text, whose text after its begin marker is `piece` so far
        (finished: all of it; a call cut short sends what it has)."""
        complete = CALL_END in piece
        head, sep, rest = piece.partition(SEP)
        name, opened, arguments = rest.partition(ARGUMENTS_OPEN)
        if not sep or not opened or "\n" in head or "\n" in name:
            return []  # its name is not known yet (or it does not follow the format)
        call = self._calls.get(place)
        if call is None:
            call = self._calls[place] = _StreamedCall(len(self._calls), tool_call_id())
        index, deltas = call.index, []
        if not call.name_sent:
            call.name_sent = True
            deltas.append({"index": index, "id": call.id, "type": "function", "function": {"name": name}})
        if complete:
            closed = arguments.find(ARGUMENTS_CLOSE + CALL_END)
            arguments = arguments[:closed] if closed >= 0 else ""
        elif not finished:  # a tail that may still be the close is held back
            arguments = arguments[:len(arguments) - _held_back(arguments, ARGUMENTS_CLOSE + CALL_END)]
        if len(arguments) > call.arguments_sent:
            deltas.append({"index": index, "function": {"arguments": arguments[call.arguments_sent:]}})
            call.arguments_sent = len(arguments)
        return deltas

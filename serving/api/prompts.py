"""Prompts to token ids and back, for the HTTP server, with the work bounded before it is spent
(docs/reliability.md):

- A text longer than the room left in max_model_len could hold is refused before it is tokenized: no
  token covers more characters than the tokenizer's longest vocabulary entry (`longest_token_chars`),
  so a prompt of more than room x that x NORMALIZER_SLACK characters cannot fit (the slack covers
  normalizers that merge characters, such as Unicode composition).
- Texts of up to INLINE_CHARS characters are tokenized on the event loop (a millisecond or two); longer
  ones, and chats whose messages are, on the server's pool of TOKENIZE_THREADS threads. The tokenizers
  library releases the GIL in encode_batch, so the event loop keeps answering (/health among others)
  while they run, and the memory a large text took is handed back to the operating system afterwards.
- /tokenize, /detokenize and logprobs' token strings use the same helpers.

Bad input raises BadRequest naming the request field, which the server answers with a 400."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.sequence import BadRequest
from .chat_template import ChatTemplate, ChatTemplateError
from .protocol import CHAT_ROLES, ChatMessage, MessageToolCall

if TYPE_CHECKING:
    from .server import ServerState

INLINE_CHARS = 4096  # texts up to this long are tokenized on the event loop
# The pool that tokenizes longer texts: a quarter of the cores, 1 to 4, so that the engine's ranks keep theirs.
TOKENIZE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
TOKENIZE_NICE = 10  # the pool's threads' nice value increment (setpriority)
NORMALIZER_SLACK = 4  # characters a normalizer may merge into one (Unicode composition: at most 3 into 1)
_T = TypeVar("_T")


def make_tokenize_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="ep-serve-tokenize", initializer=_yield_cpu)


def _yield_cpu() -> None:
    """Lower this pool thread's CPU priority (Linux threads have their own nice value): long texts are
    tokenized with the cores the engine's ranks and the event loop leave over, so that a client sending them
    cannot slow other requests down."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priorities here: it keeps the server's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICE)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token covers: the longest entry of the vocabulary, added tokens
    included (a byte-level entry has a character per byte, at least as many as the text it stands for);
    None for a tokenizer without a vocabulary to read."""
    vocab = None
    if _is_tokenizers(tokenizer):
        vocab = tokenizer.get_vocab(with_added_tokens=True)
    elif hasattr(tokenizer, "get_vocab"):
        vocab = tokenizer.get_vocab()
    return max(map(len, vocab), default=1) if vocab else None


@dataclasses.dataclass(frozen=True)
class Truncation:
    """A request's truncate_prompt_tokens as vLLM applies it: the prompt's last `keep` tokens (left: vLLM's
    default for generation), or its first. A text is cut to what `keep` tokens could cover before it is tokenized,
    so the work stays bounded: it then still holds at least NORMALIZER_SLACK x keep tokens, and the kept ones are
    those of the whole text (a cut changes only the tokens next to it)."""

    keep: int
    left: bool = True

    def text(self, state: ServerState, text: str) -> str:
        if state.max_token_chars is None:
            return text
        most = self.keep * state.max_token_chars * NORMALIZER_SLACK
        if len(text) <= most:
            return text
        return text[len(text) - most:] if self.left else text[:most]

    def ids(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.keep:
            return ids
        return ids[len(ids) - self.keep:] if self.left else ids[:self.keep]


def check_size(state: ServerState, chars: int, room: int, where: str) -> None:
    """BadRequest when `chars` characters of prompt text cannot fit in `room` tokens."""
    if state.max_token_chars is None:
        return
    most = max(room, 0) * state.max_token_chars * NORMALIZER_SLACK
    if chars > most:
        raise BadRequest(f"{where}: {chars} characters cannot fit in the {max(room, 0)} tokens left of this model's "
                         f"maximum context length (max_model_len {state.max_model_len}); at most {most} characters "
                         f"are tokenized", _param(where))


async def encode_text(state: ServerState, text: str, add_special_tokens: bool, where: str, room: int,
                      truncation: Truncation | None = None) -> list[int]:
    """A text's token ids (with or without the tokenizer's special tokens), refused unread when it is
    longer than `room` tokens could hold (with a truncation: cut to it instead); long texts are tokenized off the
    event loop."""
    if truncation is None:
        check_size(state, len(text), room, where)
    else:
        text = truncation.text(state, text)
    if len(text) <= INLINE_CHARS:
        ids = _encode(state, text, add_special_tokens, where)
    else:
        ids = await _off_the_loop(state, _encode, state, text, add_special_tokens, where)
    return ids if truncation is None else truncation.ids(ids)


async def encode_chat(state: ServerState, chat: list[dict[str, Any]], add_generation_prompt: bool,
                      continue_final_message: bool, variables: Mapping[str, Any] | None, add_special_tokens: bool,
                      room: int, template: str | None = None, tools: list[dict[str, Any]] | None = None,
                      truncation: Truncation | None = None,
                      documents: list[dict[str, str]] | None = None) -> tuple[str, list[int]]:
    """The text and token ids of a chat: rendered by the chat template (the request's own `template` where given: the
    caller checked --trust-request-chat-template) with the request's `tools` and `documents`, then encoded (with the
    tokenizer's special tokens on top of the template's only when add_special_tokens); refused unrendered when its
    messages are longer than `room` tokens could hold (with a truncation: the rendered text cut to it instead), and
    off the event loop when they are long."""
    chars = chat_chars(chat, tools, documents)
    if truncation is None:
        check_size(state, chars, room, "messages")
    renderer = state.chat_template if template is None else dataclasses.replace(state.chat_template, source=template)
    work = functools.partial(_render_and_encode, state, renderer, chat, add_generation_prompt, continue_final_message,
                             template_variables(state, variables), add_special_tokens, tools, truncation, documents)
    return work() if chars <= INLINE_CHARS else await _off_the_loop(state, work)


def template_variables(state: ServerState, variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs over --default-chat-template-kwargs (the request's win, as vLLM's)."""
    return {**state.default_chat_template_kwargs, **(variables or {})}


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them: role, content (a list of text parts joined by
    newlines, as vLLM does for templates that take a string; None only for an assistant's), name, an assistant's
    tool_calls (their arguments parsed from JSON, as transformers' templates take them and vLLM hands them over)
    and reasoning (as both reasoning and reasoning_content, as vLLM passes it), and a tool message's tool_call_id,
    where given. BadRequest naming any role, content part type or tool call arguments that are not served."""
    unsupported: dict[str, str] = {}  # part type -> where it first is
    chat = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role: expected one of {', '.join(map(repr, CHAT_ROLES))}, got "
                             f"{m.role!r}", "messages")
        if m.content is None and m.role != "assistant":
            raise BadRequest(f"messages[{i}].content: expected a string or a list of content parts for a "
                             f"{m.role!r} message (only an assistant's may be null)", "messages")
        texts = [m.content] if isinstance(m.content, str) else []
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                unsupported.setdefault(part.type, f"messages[{i}].content[{j}]")
            elif part.text is None:
                raise BadRequest(f"messages[{i}].content[{j}].text: expected a string", "messages")
            else:
                texts.append(part.text)
        message = {"role": m.role, "content": None if m.content is None else "\n".join(texts), "name": m.name,
                   "tool_call_id": m.tool_call_id}
        if m.tool_calls:
            message["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(m.tool_calls)]
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if m.role == "assistant" and reasoning is not None:  # vLLM's interleaved thinking: under both names
            message["reasoning"] = message["reasoning_content"] = reasoning
        chat.append(message)
    if unsupported:
        names = ", ".join(repr(t) for t in unsupported)
        raise BadRequest(f"{next(iter(unsupported.values()))}: content parts of type {names} are not supported "
                         f"(only 'text')", "messages")
    return chat


def _template_tool_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    """A tool call as templates take it: its arguments a JSON object (empty where the text is)."""
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments else {}
    except ValueError as e:
        raise BadRequest(f"{where}.function.arguments: expected JSON ({e})", "messages") from None
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def chat_chars(chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               documents: list[dict[str, str]] | None = None) -> int:
    """About how many characters of text a chat puts in the prompt (its contents, names, reasoning, tool calls,
    tools and documents), to bound its rendering by the context's room (check_size)."""
    chars = sum(len(m["content"] or "") + len(m["name"] or "") + len(m.get("reasoning") or "") for m in chat)
    extras = [m["tool_calls"] for m in chat if "tool_calls" in m], tools, documents
    return chars + sum(len(json.dumps(x)) for x in extras if x)


def check_token_ids(state: ServerState, ids: list[int]) -> None:
    """BadRequest for an id outside the model's vocabulary or one the tokenizer does not have."""
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"tokens: token id {bad} is outside the vocabulary [0, {state.vocab_size})", "tokens")
    tok = state.tokenizer
    if _is_tokenizers(tok):
        missing = next((t for t in ids if tok.id_to_token(t) is None), None)
    elif hasattr(tok, "convert_ids_to_tokens"):
        missing = next((t for t in ids if t >= len(tok)), None)
    else:
        missing = None
    if missing is not None:
        raise BadRequest(f"tokens: token id {missing} is not in the tokenizer's vocabulary", "tokens")


async def decode_text(state: ServerState, ids: list[int]) -> str:
    """decode_all, off the event loop for long id lists."""
    if len(ids) <= INLINE_CHARS:
        return decode_all(state, ids)
    return await _off_the_loop(state, decode_all, state, ids)


def decode_all(state: ServerState, ids: list[int]) -> str:
    """The text of token ids, special tokens included (vLLM's /detokenize)."""
    tok = state.tokenizer
    if _is_tokenizers(tok):
        return tok.decode_batch([list(ids)], skip_special_tokens=False)[0]  # releases the GIL
    if hasattr(tok, "convert_ids_to_tokens"):
        return tok.decode(list(ids), skip_special_tokens=False)
    return state.codec.decode(list(ids))


def token_strs(state: ServerState, ids: list[int]) -> list[str]:
    """Each token id's string in the tokenizer's vocabulary (byte-level BPE's "Ġ" for a space included)."""
    tok = state.tokenizer
    if _is_tokenizers(tok):
        return [tok.id_to_token(t) for t in ids]
    if hasattr(tok, "convert_ids_to_tokens"):
        return list(tok.convert_ids_to_tokens(ids))
    return [state.codec.decode([t]) for t in ids]


def _render_and_encode(state: ServerState, template: ChatTemplate, chat: list[dict[str, Any]],
                       add_generation_prompt: bool, continue_final_message: bool, variables: Mapping[str, Any] | None,
                       add_special_tokens: bool, tools: list[dict[str, Any]] | None,
                       truncation: Truncation | None = None,
                       documents: list[dict[str, str]] | None = None) -> tuple[str, list[int]]:
    try:
        text = template.render(chat, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, variables=variables, tools=tools,
                               documents=documents)
    except ChatTemplateError as e:
        raise BadRequest(str(e), e.param or "messages") from None
    if truncation is None:
        return text, _encode(state, text, add_special_tokens, "messages")
    return text, truncation.ids(_encode(state, truncation.text(state, text), add_special_tokens, "messages"))


def _encode(state: ServerState, text: str, add_special_tokens: bool, where: str) -> list[int]:
    """A text's token ids (a codec that is not a tokenizers or transformers tokenizer encodes as it
    does, with its own special tokens); BadRequest for text the tokenizer cannot take."""
    tok = state.tokenizer
    try:
        if _is_tokenizers(tok):
            return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids  # releases the GIL
        if hasattr(tok, "convert_ids_to_tokens"):
            return list(tok.encode(text, add_special_tokens=add_special_tokens))
        return state.codec.encode(text)
    except ValueError as e:  # text this tokenizer cannot take (UnicodeError is a ValueError too)
        raise BadRequest(f"{where}: cannot be tokenized: {e}", _param(where)) from None


async def _off_the_loop(state: ServerState, fn: Callable[..., _T], *args: Any) -> _T:
    """fn(*args) on the tokenizing pool; then the memory it freed goes back to the operating system."""
    def run() -> _T:
        try:
            return fn(*args)
        finally:
            _release_free_memory()

    return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, run)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim (None elsewhere): freed heap memory back to the operating system."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    return trim


def _release_free_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _param(where: str) -> str:
    return "messages" if where == "messages" else "prompt"


def _is_tokenizers(tok: Any) -> bool:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        return False
    return isinstance(tok, Tokenizer)

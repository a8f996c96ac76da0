"""Text out of token ids, one token at a time: incremental detokenization, stop strings, and the
hold-back that keeps a streamed text from showing the start of a stop string it later drops."""

from __future__ import annotations

from typing import Any, Protocol

# Prompt tokens decoded in front of the output so that the first output tokens get their spacing right.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of an unfinished UTF-8 character


class Codec(Protocol):
    """What the engine and the server need of a tokenizer. encode adds the tokenizer's own special
    tokens (BOS for DeepSeek-V3), as vLLM does for completions; decode skips special tokens."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class _TokenizersCodec:
    """A `tokenizers.Tokenizer` (what tokenizer.json loads into) as a Codec."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


class _HFCodec:
    """A transformers tokenizer as a Codec."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


def as_codec(tokenizer: Any) -> Codec:
    """Wrap a `tokenizers.Tokenizer`, a transformers tokenizer, or anything with encode/decode on ids."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        Tokenizer = ()
    if isinstance(tokenizer, Tokenizer):
        return _TokenizersCodec(tokenizer)
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return _HFCodec(tokenizer)
    if callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None)):
        return tokenizer
    raise TypeError(f"tokenizer: expected a tokenizers.Tokenizer or an object with encode/decode, "
                    f"got {type(tokenizer).__name__}")


class IncrementalDetokenizer:
    """Decodes a growing token list window by window (as vLLM does): the text of the new tokens is the
    decode of a short window minus the decode of its older part, held back while it ends in an
    unfinished UTF-8 character."""

    def __init__(self, codec: Codec, prompt_token_ids: list[int]) -> None:
        self._codec = codec
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._tokens)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ("" while a character is unfinished)."""
        self._tokens.append(token_id)
        before = self._codec.decode(self._tokens[self._prefix:self._read])
        after = self._codec.decode(self._tokens[self._prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before):]

    def flush(self) -> str:
        """The text of the tokens not returned yet, unfinished characters included (at the end)."""
        before = self._codec.decode(self._tokens[self._prefix:self._read])
        after = self._codec.decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return after[len(before):]


class OutputText:
    """A sequence's output text: grows token by token, is cut at the first stop string (which is not
    part of the output), and hands out the part that is safe to stream."""

    def __init__(self, codec: Codec, prompt_token_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self._detok = IncrementalDetokenizer(codec, prompt_token_ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self._closed = False

    def add(self, token_id: int) -> str | None:
        """Append a token's text; return the stop string it completed, if any (the text is cut there)."""
        delta = self._detok.add(token_id)
        if not delta:
            return None
        start = len(self.text)
        self.text += delta
        hit: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is None:
            return None
        self.text = self.text[:hit[0]]
        self._closed = True
        return hit[1]

    def take(self, finished: bool) -> str:
        """The text not handed out yet; while running, minus a tail that could begin a stop string.
        Once finished, all of it, with any unfinished character the last tokens left (unless a stop
        string cut the text)."""
        if finished and not self._closed:
            self.text += self._detok.flush()
            self._closed = True
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        delta, self._sent = self.text[self._sent:end], end
        return delta

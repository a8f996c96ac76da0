"""Text out of token ids, one token at a time: incremental detokenization, stop strings, and the
hold-back that keeps a streamed text from showing the start of a stop string it later drops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

# Prompt tokens decoded in front of the output so that the first output tokens get their spacing right.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a decoder gives for the first bytes of an unfinished UTF-8 character


class Codec(Protocol):
    """What the engine and the server need of a tokenizer. encode adds the tokenizer's own special
    tokens (BOS for DeepSeek-V3), as vLLM does for completions; decode skips special tokens unless told
    otherwise; special_tokens: the added (special) tokens' ids and texts."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def special_tokens(self) -> Mapping[int, str]: ...


class _TokenizersCodec:
    """A `tokenizers.Tokenizer` (what tokenizer.json loads into) as a Codec."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> Mapping[int, str]:
        return {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items()}


class _HFCodec:
    """A transformers tokenizer as a Codec."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> Mapping[int, str]:
        return {i: t.content for i, t in self._tokenizer.added_tokens_decoder.items()}


def as_codec(tokenizer: Any) -> Codec:
    """Wrap a `tokenizers.Tokenizer`, a transformers tokenizer, or anything with encode/decode on ids
    (and special_tokens; without it, a tokenizer of no special tokens)."""
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
    unfinished UTF-8 character. skip_special_tokens: as the codec's decode; spaces_between_special_tokens
    False (with special tokens shown): a special token right after another is its own text, nothing
    added before it (vLLM's FastIncrementalDetokenizer)."""

    def __init__(self, codec: Codec, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._codec = codec
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._tokens)
        self._skip = skip_special_tokens
        self._specials: Mapping[int, str] = {}
        if not skip_special_tokens and not spaces_between_special_tokens:
            special_tokens = getattr(codec, "special_tokens", None)
            self._specials = special_tokens() if special_tokens is not None else {}

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ("" while a character is unfinished)."""
        after_special = bool(self._tokens) and self._tokens[-1] in self._specials
        self._tokens.append(token_id)
        if after_special and token_id in self._specials and self._read == len(self._tokens) - 1:
            self._prefix, self._read = self._read, len(self._tokens)
            return self._specials[token_id]
        before = self._decode(self._tokens[self._prefix:self._read])
        after = self._decode(self._tokens[self._prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before):]

    def flush(self) -> str:
        """The text of the tokens not returned yet, unfinished characters included (at the end)."""
        before = self._decode(self._tokens[self._prefix:self._read])
        after = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return after[len(before):]

    def _decode(self, token_ids: list[int]) -> str:
        return self._codec.decode(token_ids) if self._skip else self._codec.decode(token_ids, skip_special_tokens=False)


class OutputText:
    """A sequence's output text: grows token by token, is cut at the first stop string, and hands out
    the part that is safe to stream. As vLLM's detokenizer: no stop string is looked for in the text of
    the first `min_tokens` tokens (one may start there and end later); `include_stop`: the stop string
    stays in the text (and no tail is held back), else the text ends before it."""

    def __init__(self, codec: Codec, prompt_token_ids: list[int], stop: tuple[str, ...] = (), *,
                 min_tokens: int = 0, include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(codec, prompt_token_ids, skip_special_tokens,
                                             spaces_between_special_tokens)
        self._stop = stop
        self._min_tokens, self._include_stop = min_tokens, include_stop
        self._hold = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self._tokens = 0
        self.text = ""
        self._sent = 0
        self._closed = False

    def add(self, token_id: int, check_stops: bool = True) -> str | None:
        """Append a token's text; return the stop string it completed, if any (the text is cut there).
        check_stops False: the token ends the output anyway (EOS, a stop token id)."""
        delta = self._detok.add(token_id)
        self._tokens += 1
        if not delta:
            return None
        start = len(self.text)
        self.text += delta
        if not check_stops or self._tokens <= self._min_tokens:
            return None
        hit: tuple[int, str] | None = None  # (end, stop string): the one that completes first, as vLLM's
        for s in self._stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (hit is None or i + len(s) < hit[0]):
                hit = (i + len(s), s)
        if hit is None:
            return None
        end, stop = hit
        self.text = self.text[:end if self._include_stop else end - len(stop)]
        self._closed = True
        return stop

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

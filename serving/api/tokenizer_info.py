"""GET /tokenizer_info's body (vLLM's `--enable-tokenizer-info-endpoint`): the tokenizer's configuration, as vLLM
0.34.0 builds it from the tokenizer's init_kwargs (vllm/entrypoints/serve/tokenize/serving.py, TokenizerInfo):
tokenizer_config.json's keys without the file paths, each added token as its text, the tokenizer's class, and the
chat template the server renders with."""

from __future__ import annotations

from typing import Any

from .chat_template import ChatTemplate, tokenizer_config

FILE_PATH_KEYS = ("vocab_file", "merges_file")  # what vLLM leaves out
# The keys of an added token as tokenizer_config.json writes it (transformers' AddedToken, serialized).
ADDED_TOKEN_KEYS = frozenset({"__type", "content", "lstrip", "rstrip", "normalized", "single_word", "special"})


def tokenizer_info(directory: str, template: ChatTemplate, tokenizer: Any) -> dict[str, Any]:
    """The body for the tokenizer of `directory`, with `template`'s source as chat_template (where the server has
    one). tokenizer_class: the configuration's own, else `tokenizer`'s class name (as vLLM names it)."""
    info = {key: _as_json(value) for key, value in tokenizer_config(directory).items() if key not in FILE_PATH_KEYS}
    info.setdefault("tokenizer_class", type(tokenizer).__name__)
    if template.source is not None:
        info["chat_template"] = template.source
    return info


def _as_json(value: Any) -> Any:
    """`value` with every added token as its text (vLLM sends an AddedToken's content)."""
    if isinstance(value, dict):
        if "content" in value and value.keys() <= ADDED_TOKEN_KEYS:
            return value["content"]
        return {key: _as_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_json(item) for item in value]
    return value

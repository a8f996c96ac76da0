"""The model's default sampling parameters, as vLLM's `--generation-config` gives them: "auto" (the
default) reads `generation_config.json` in the model's directory, a directory path reads the one there,
"vllm" takes none (vLLM's neutral defaults). Of that file vLLM applies repetition_penalty, temperature,
top_k, top_p, min_p and max_new_tokens (as a request's default max_tokens), to the requests that leave
those fields unset (vllm/config/model.py `get_diff_sampling_param`, vLLM 0.29.0)."""

from __future__ import annotations

import json
import os
from typing import Any

from .engine.sequence import BadRequest, SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
SOURCES = ("auto", "vllm")  # besides a directory
_APPLIED = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def generation_defaults(source: str, model_dir: str) -> dict[str, Any]:
    """The request defaults `source` gives (keys as SamplingParams', max_new_tokens as max_tokens);
    ValueError naming --generation-config for a file that is missing (a directory given), unreadable,
    or holds values no request could use."""
    if source == "vllm":
        return {}
    directory = model_dir if source == "auto" else source
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        if source == "auto":
            return {}
        raise ValueError(f"--generation-config {source!r}: no {GENERATION_CONFIG_FILE} there (expected 'auto', "
                         f"'vllm' or a directory holding one)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: {path}: not readable as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path}: expected a JSON object")
    defaults = {("max_tokens" if key == "max_new_tokens" else key): config[key] for key in _APPLIED
                if config.get(key) is not None}
    try:
        SamplingParams(**{"max_tokens": 1, **defaults})
    except (BadRequest, TypeError) as e:
        raise ValueError(f"--generation-config: {path}: {e}") from None
    return defaults

"""OpenAI-compatible request and response bodies (the subset /v1/completions serves), and vLLM's error
envelope. Types are strict (a string is not a number, true is not a token id), strings are valid
Unicode (JSON's "\\ud800" escapes can smuggle in lone surrogates, which no tokenizer or UTF-8 encoder
takes), and numbers and list lengths are range checked here, so that bad input is a 400 and never
reaches the engine."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_N = 16  # choices per prompt
MAX_STOP_STRINGS = 64  # each is searched for after every token
MAX_STOP_TOKEN_IDS = 1024
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode: a lone surrogate ({s[e.start]!r}) at position {e.start}") from None
    return s


Float = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
Prompt = Text | list[Text] | list[StrictInt] | list[list[StrictInt]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """Fields we do not support are refused with a 400 when set to anything but their default
    (see server.unsupported); unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    temperature: Annotated[Float, Field(ge=0.0)] | None = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=UINT64_MAX)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Accepted only at their defaults:
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: Text | None = None
    logit_bias: dict[str, Float] | None = None
    presence_penalty: Float | None = 0.0
    frequency_penalty: Float | None = 0.0
    repetition_penalty: Float | None = 1.0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ep-layer"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), param=param,
                                         code=status)).model_dump()

"""OpenAI-compatible request and response bodies (the subset /v1/completions serves), and vLLM's error
envelope. Types are strict (a string is not a number, true is not a token id) and numbers are range
checked here, so that bad input is a 400 and never reaches the engine."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_N = 16  # choices per prompt
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1

Float = Annotated[float, Field(allow_inf_nan=False)]
Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """Fields we do not support are refused with a 400 when set to anything but their default
    (see server.unsupported); unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    temperature: Annotated[Float, Field(ge=0.0)] | None = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=UINT64_MAX)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Accepted only at their defaults:
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
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
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), param=param,
                                         code=status)).model_dump()

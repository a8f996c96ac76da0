"""OpenAI-compatible request and response bodies (the subsets /v1/completions and /v1/chat/completions
serve), vLLM's /tokenize and /detokenize, and vLLM's error envelope. Types are strict (a string is not
a number, true is not a token id), strings are valid Unicode (JSON's "\\ud800" escapes can smuggle in
lone surrogates, which no tokenizer or UTF-8 encoder takes), and numbers and list lengths are range
checked here, so that bad input is a 400 and never reaches the engine."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_N = 16  # choices per prompt
MAX_STOP_STRINGS = 64  # each is searched for after every token
MAX_STOP_TOKEN_IDS = 1024
CHAT_ROLES = ("system", "user", "assistant")
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
    (see server._refuse_unsupported); unknown fields are ignored, as vLLM does. max_tokens 0 only
    with echo (the prompt alone, as vLLM)."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    temperature: Annotated[Float, Field(ge=0.0)] | None = 1.0
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Float | None = 0.0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=UINT64_MAX)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    echo: StrictBool = False
    logprobs: StrictInt | None = None  # top-N per token (range checked by SamplingParams: a 400 naming it)
    presence_penalty: Float | None = 0.0
    frequency_penalty: Float | None = 0.0
    repetition_penalty: Float | None = 1.0
    # Accepted only at their defaults:
    best_of: StrictInt | None = None
    suffix: Text | None = None
    logit_bias: dict[str, Float] | None = None


class ContentPart(BaseModel):
    """One part of a message's content; only {"type": "text", "text": ...} is served (the server names
    any other type in its 400)."""

    model_config = ConfigDict(extra="allow")
    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    """role is checked against CHAT_ROLES by the server, so that its 400 names the role given."""

    model_config = ConfigDict(extra="ignore")
    role: Text
    content: Text | list[ContentPart]
    name: Text | None = None


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request plus vLLM's extras (top_k, stop_token_ids, ignore_eos and the
    chat template's add_generation_prompt, continue_final_message, chat_template_kwargs); sampling
    fields as CompletionRequest's. As there, fields we do not support are refused when set to anything
    but their default, and unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    messages: Messages
    model: Text | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # None: up to max_model_len
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # OpenAI's newer name; wins
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
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None  # 0..20, only with logprobs
    presence_penalty: Float | None = 0.0
    frequency_penalty: Float | None = 0.0
    repetition_penalty: Float | None = 1.0
    min_p: Float | None = 0.0
    # Accepted only at their defaults:
    logit_bias: dict[str, Float] | None = None
    best_of: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template: Text | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    """vLLM's (OpenAI's legacy completions logprobs): per token its string, log-probability, the top
    {token string: logprob} (the request's N and the token itself: N or N + 1 entries; None where the
    token has none, the first of an echoed prompt) and its offset in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None  # the token string's UTF-8 bytes


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class ChatCompletionStreamChoice(BaseModel):
    """delta: {"role": "assistant"} on a choice's first chunk, then {"content": text}; {} on a last
    chunk without text."""

    index: int
    delta: dict[str, str]
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class TokenizeCompletionRequest(BaseModel):
    """vLLM's (vllm/entrypoints/openai/protocol.py): a prompt's token ids."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    prompt: Text
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's: the token ids of the chat as /v1/chat/completions renders it. add_special_tokens adds
    the tokenizer's own (BOS) on top of what the template writes."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    messages: Messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False
    chat_template_kwargs: dict[Text, Any] | None = None
    # Accepted only at their defaults:
    chat_template: Text | None = None
    tools: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


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

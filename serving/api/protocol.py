"""OpenAI-compatible request and response bodies (the subsets /v1/completions and /v1/chat/completions
serve), vLLM's /tokenize and /detokenize, and vLLM's error envelope. Types are strict (a string is not
a number, true is not a token id), strings are valid Unicode (JSON's "\\ud800" escapes can smuggle in
lone surrogates, which no tokenizer or UTF-8 encoder takes), and numbers and list lengths are range
checked here, so that bad input is a 400 and never reaches the engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_serializer

from ..engine.sequence import BadRequest, RepetitionDetection, SamplingParams

MAX_N = 16  # choices per prompt
MAX_STOP_STRINGS = 64  # each is searched for after every token
MAX_STOP_TOKEN_IDS = 1024
# Each step builds the sampler's mask and biases from these lists: bounded, so one request cannot slow the others.
MAX_LOGIT_BIAS, MAX_ALLOWED_TOKEN_IDS = 1024, 32768
LOGIT_BIAS_RANGE = 100.0  # a bias is clamped to +-this (vLLM's)
# repetition_detection's largest pattern and count: each token's check is bounded (sizes x count tokens at most).
MAX_REPETITION_PATTERN, MAX_REPETITION_COUNT = 512, 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's successor to system
MAX_REQUEST_ID_CHARS = 256
# vLLM's defaults of the fields a model's generation config may set (its _DEFAULT_SAMPLING_PARAMS).
VLLM_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
INT64_MIN, INT64_MAX, UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1


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
    """include_usage: a last chunk with the request's usage; with continuous_usage_stats every chunk carries its
    choice's usage so far too (vLLM's)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


def _one_of(*values: Any) -> Callable[[Any, Any], bool]:
    """A refused field's test beside its default: one of these values means the same."""
    return lambda value, request: value in values


def _empty(value: Any, request: Any) -> bool:
    return not value


class RepetitionDetectionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_pattern_size: Annotated[StrictInt, Field(ge=0, le=MAX_REPETITION_PATTERN)] = 0
    min_pattern_size: Annotated[StrictInt, Field(ge=0, le=MAX_REPETITION_PATTERN)] = 0
    min_count: Annotated[StrictInt, Field(ge=0, le=MAX_REPETITION_COUNT)] = 0


class SamplingRequest(BaseModel):
    """What both completion endpoints take besides their prompt: one home for the sampling fields (the
    types, ranges and vLLM's defaults; None where the model's generation config may give the default,
    `to_sampling_params`), and for the fields of vLLM's request schema this server does not serve:
    `REFUSED` names them; set to anything but its default (or a value `ALSO_DEFAULT` takes for it), one is
    a 400 naming it (`refused_field`). Unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")
    REFUSED: ClassVar[tuple[str, ...]] = (
        "best_of", "use_beam_search", "length_penalty", "logprob_token_ids", "bad_words", "structured_outputs",
        "response_format", "session_id", "routed_experts_prompt_start", "return_token_offsets", "kv_transfer_params",
        "ec_transfer_params", "vllm_xargs", "thinking_token_budget", "watermarking",
        "return_weight_versions", "mm_payload", "return_mm_kwargs")
    # What a refused field may hold besides its default, meaning the same.
    ALSO_DEFAULT: ClassVar[dict[str, Callable[[Any, Any], bool]]] = {
        "best_of": lambda value, request: value == request.n, "bad_words": _empty,
        "response_format": _one_of({"type": "text"}), "watermarking": _one_of(False),
        "return_mm_kwargs": _one_of(False)}

    model: Text | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[Float, Field(ge=0.0)] | None = None
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float | None = 0.0
    frequency_penalty: Float | None = 0.0
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=UINT64_MAX)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    request_id: Annotated[Text, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = None
    # Under --scheduling-policy priority, a smaller value starts first (vLLM's; elsewhere only 0 is served).
    priority: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    # Logprobs' tokens as "token_id:{id}" (None: --return-tokens-as-token-ids decides).
    return_tokens_as_token_ids: StrictBool | None = None
    # Token id (as a string, as JSON keys are) to a bias added to its logit, clamped to [-100, 100] (vLLM's).
    logit_bias: Annotated[dict[Text, Float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # Only these can be drawn.
    allowed_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                                 Field(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    # The prompt's and each choice's token ids in the response (streamed: the prompt's in a choice's first chunk,
    # each chunk's own new ids), as vLLM adds them.
    return_token_ids: StrictBool | None = None
    # Per prompt token (after the first) its logprob, rank and the top N (vLLM's; not with stream).
    prompt_logprobs: StrictInt | None = None
    # Keep this many of the prompt's tokens (-1: max_model_len - 1), its last unless truncation_side is "right".
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Prefix-cache hits only among requests of the same salt (vLLM's: against guessing other tenants' prompts).
    cache_salt: Text | None = None
    # A stream's chunks carry this many tokens (its first and last at once), at least --stream-interval's (vLLM's).
    stream_interval: Annotated[StrictInt, Field(ge=1)] | None = None
    # End an output whose last tokens repeat a pattern min_count times (vLLM's; finish reason "repetition").
    repetition_detection: RepetitionDetectionRequest | None = None
    # Refused unless left at their default (REFUSED):
    best_of: Any = None
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    logprob_token_ids: Any = None
    bad_words: Any = None
    structured_outputs: Any = None
    response_format: Any = None
    session_id: Any = None
    routed_experts_prompt_start: Any = 0
    return_token_offsets: Any = False
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    thinking_token_budget: Any = None
    watermarking: Any = None
    return_weight_versions: Any = False
    mm_payload: Any = "tensors"  # what vLLM's multimodal render responses carry
    return_mm_kwargs: Any = None

    def refused_field(self) -> str | None:
        """The first field this server does not serve that the request sets to anything but its default."""
        for name in self.REFUSED:
            value, same = getattr(self, name), self.ALSO_DEFAULT.get(name)
            if value != type(self).model_fields[name].default and not (same is not None and same(value, self)):
                return name
        return None

    def to_sampling_params(self, *, max_tokens: int, defaults: Mapping[str, Any], logprobs: int | None,
                           prompt_logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams of the request (BadRequest naming a field it refuses): a field
        left unset takes the model's generation-config default in `defaults`, else vLLM's."""
        def unset_or(name: str) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, VLLM_SAMPLING_DEFAULTS[name])

        return SamplingParams(
            max_tokens=max_tokens, temperature=unset_or("temperature"), top_p=unset_or("top_p"),
            top_k=unset_or("top_k"), min_p=unset_or("min_p"), repetition_penalty=unset_or("repetition_penalty"),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=self._logit_bias(), cache_salt=self.cache_salt,
            repetition_detection=None if self.repetition_detection is None else
            RepetitionDetection(**self.repetition_detection.model_dump()),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids))

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, each bias clamped to [-100, 100] as vLLM's to_sampling_params does;
        BadRequest for a key that is not an integer."""
        biases: dict[int, float] = {}  # keys naming one id twice ("7", "07"): the last wins, as in vLLM's dict
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise BadRequest(f"logit_bias: expected token ids (integers as strings) for keys, got {key!r}",
                                 "logit_bias") from None
            biases[token] = min(LOGIT_BIAS_RANGE, max(-LOGIT_BIAS_RANGE, bias))
        return tuple(biases.items())


class CompletionRequest(SamplingRequest):
    """OpenAI's legacy completion request with vLLM's extras. max_tokens 0 only with echo (the prompt
    alone, as vLLM); add_special_tokens: the tokenizer's own (BOS) in front of a text prompt."""

    REFUSED: ClassVar[tuple[str, ...]] = (*SamplingRequest.REFUSED, "suffix", "prompt_embeds")

    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None  # top-N per token (range checked by SamplingParams: a 400 naming it)
    add_special_tokens: StrictBool = True
    # Refused unless left at their default:
    suffix: Any = None
    prompt_embeds: Any = None


class ContentPart(BaseModel):
    """One part of a message's content; only {"type": "text", "text": ...} is served (the server names
    any other type in its 400)."""

    model_config = ConfigDict(extra="allow")
    type: Text
    text: Text | None = None


class FunctionCallText(BaseModel):
    name: Text
    arguments: Text  # JSON, as the model wrote it


class MessageToolCall(BaseModel):
    """A tool call in an assistant message: as a response gives it, and as a client sends it back."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallText


class ChatMessage(BaseModel):
    """role is checked against CHAT_ROLES by the server, so that its 400 names the role given. content may be
    null or left out in an assistant's message (one with tool_calls); a "tool" message answers the call named by
    tool_call_id."""

    model_config = ConfigDict(extra="ignore")
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning: Text | None = None  # an assistant's earlier thinking (reasoning_content: its older name)
    reasoning_content: Text | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. OpenAI's strict: handed to the template as given
    name: Text
    description: Text | None = None
    parameters: dict[Text, Any] | None = None  # a JSON Schema


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatCompletionRequest(SamplingRequest):
    """OpenAI's chat completion request with vLLM's extras (the chat template's add_generation_prompt,
    continue_final_message, chat_template_kwargs; add_special_tokens: the tokenizer's own on top of the
    template's)."""

    REFUSED: ClassVar[tuple[str, ...]] = (
        *SamplingRequest.REFUSED, "media_io_kwargs", "mm_processor_kwargs", "return_assistant_tokens_mask")

    messages: Messages
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # None: up to max_model_len
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # OpenAI's newer name; wins
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None  # 0..20, only with logprobs
    include_reasoning: StrictBool = True  # with --reasoning-parser: False leaves the reasoning out (vLLM's)
    chat_template: Text | None = None  # rendered instead of the server's, with --trust-request-chat-template
    tools: list[ChatTool] | None = None  # handed to the chat template
    # "auto" where tools are given and this is not (`effective_tool_choice`); null is "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    parallel_tool_calls: StrictBool | None = True  # false: a response keeps its first tool call only
    return_prompt_text: StrictBool | None = None  # the rendered chat as the response's prompt_text (vLLM's)
    # The last message's content before each choice's, where it has the responses' role (vLLM's chat echo).
    echo: StrictBool = False
    # A template variable, as vLLM passes it, with enable_thinking (false for "none") unless chat_template_kwargs
    # set that.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    documents: list[dict[Text, Text]] | None = None  # the template's documents (retrieval-augmented templates)
    # Refused unless left at their default:
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_assistant_tokens_mask: Any = False

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs with reasoning_effort's variables (vLLM's build_chat_params): reasoning_effort itself,
        and enable_thinking (its effort other than "none") unless the request's kwargs set it."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """tool_choice as vLLM resolves it: "auto" where tools are given and tool_choice is not; an empty tools
        list counts as none given ("auto" and "required" then fall back to "none")."""
        if not self.tools:
            return self.tool_choice if isinstance(self.tool_choice, NamedToolChoice) else "none"
        if "tool_choice" not in self.model_fields_set:
            return "auto"
        return self.tool_choice or "none"


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int = 0  # of the prompt tokens, those found in the prefix cache (not computed again)


class UsageInfo(BaseModel):
    """vLLM's; prompt_tokens_details only with --enable-prompt-tokens-details (absent from the JSON otherwise)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _details_only_where_given(self, handler: Any) -> dict:
        data = handler(self)
        if data.get("prompt_tokens_details", 0) is None:
            del data["prompt_tokens_details"]
        return data


class CompletionLogProbs(BaseModel):
    """vLLM's (OpenAI's legacy completions logprobs): per token its string, log-probability, the top
    {token string: logprob} (the request's N and the token itself: N or N + 1 entries; None where the
    token has none, the first of an echoed prompt) and its offset in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _ExtrasWhereAsked(BaseModel):
    """A response part with vLLM's extra fields (token ids, prompt logprobs, prompt text), left out of the JSON
    unless the request asked for them (return_token_ids, prompt_logprobs, return_prompt_text)."""

    @model_serializer(mode="wrap")
    def _extras_only_where_given(self, handler: Any) -> dict:
        data = handler(self)
        for name in ("token_ids", "prompt_token_ids", "prompt_logprobs", "prompt_text"):
            if name in data and data[name] is None:
                del data[name]
        return data


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as prompt_logprobs give it per token id."""

    logprob: float
    rank: int  # 1: the likeliest
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # per prompt token; None for the first


class CompletionChoice(_ExtrasWhereAsked):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort", "repetition"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # the choice's output (return_token_ids)
    prompt_token_ids: list[int] | None = None  # its prompt's (return_token_ids; streamed: in its first chunk)
    prompt_logprobs: PromptLogprobs | None = None  # its prompt's (prompt_logprobs, or echo with logprobs)


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
    role: str = "assistant"  # --response-role, or the continued message's (vLLM's get_chat_request_role)
    content: str | None  # None: --reasoning-parser found only reasoning, or --tool-call-parser only calls
    reasoning: str | None = None  # --reasoning-parser's (vLLM's field)
    tool_calls: list[MessageToolCall] = Field(default_factory=list)  # --tool-call-parser's


class ChatCompletionChoice(_ExtrasWhereAsked):
    index: int
    message: AssistantMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort", "repetition", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_ExtrasWhereAsked):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs
    prompt_text: str | None = None  # return_prompt_text: the chat as its template rendered it


class ChatCompletionStreamChoice(_ExtrasWhereAsked):
    """delta: {"role": "assistant"} on a choice's first chunk, then {"content": text} (and with --reasoning-parser
    {"reasoning": text}, with --tool-call-parser {"tool_calls": [...]}); {} on a chunk without text."""

    index: int
    delta: dict[str, Any]
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort", "repetition", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # the chunk's new ids (return_token_ids)


class ChatCompletionStreamResponse(_ExtrasWhereAsked):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # on each choice's opening chunk (return_token_ids)
    prompt_text: str | None = None  # on each choice's opening chunk (return_prompt_text)


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
    chat_template: Text | None = None  # with --trust-request-chat-template
    tools: list[ChatTool] | None = None  # handed to the chat template
    # Accepted only at their defaults:
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    response_format: Any = None


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

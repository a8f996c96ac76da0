"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions and /v1/chat/completions (+ SSE
streaming), vLLM's /tokenize and /detokenize, /v1/models, /health, /version, /metrics, and in vLLM's
development mode (VLLM_SERVER_DEV_MODE=1) POST /reset_prefix_cache. It validates and
tokenizes requests (chats through the model's chat template), hands them to the engine ranks through
the DPCoordinator and turns the ranks' outputs into responses. Bad input is a 400 in vLLM's error
envelope, an unknown model a 404, a body over the size limit a 413; only a full engine (503 with
Retry-After: running and waiting sequences at their limits), a dead or stalled one (503), a request the
engine failed on alone (500 naming it) or a bug (500) is a 5xx; a stream that fails ends with an error
event, then [DONE]. Error bodies never carry a traceback: those go to the server log."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import importlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ep_layer import __version__

from ..engine.detokenizer import Codec, as_codec
from ..engine.dp_coordinator import Counted, DPCoordinator, EngineUnavailableError, Submission
from ..engine.engine_config import EngineConfig
from ..engine.heartbeat import DEFAULT_STALL_TIMEOUT_S
from ..engine.messages import RequestOutput, TokenLogprobs
from ..engine.sequence import MAX_LOGPROBS, BadRequest, SamplingParams, check_prompt
from .chat_template import ChatTemplate, load_chat_template
from .connections import ConnectionLimits, raise_open_files_limit
from .cors import Cors
from .metrics import ServingMetrics
from .prompts import (
    Truncation,
    check_token_ids,
    conversation,
    decode_all,
    decode_text,
    encode_chat,
    encode_text,
    longest_token_chars,
    make_tokenize_pool,
    template_variables,
    token_strs,
)
from .protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCallText,
    MessageToolCall,
    ModelCard,
    ModelList,
    NamedToolChoice,
    PromptLogprob,
    PromptTokenUsageInfo,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UsageInfo,
    error_body,
)
from .reasoning import ReasoningStream, ThinkTokens, split_reasoning, thinks
from .request_id import RequestIdHeaders
from .tls import CertRefresher, Tls
from .tool_calls import ToolCallStream, extract_tool_calls, tool_call_id

DEFAULT_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # reachable without the API key
MAX_BODY_BYTES = 16 << 20  # a longer request body is a 413
WAITING_PER_RUNNING = 4  # default waiting sequences per rank, as a multiple of max_num_seqs
RETRY_AFTER_S = 1  # what a 503 for a full engine tells the client to wait
SHUTDOWN_GRACE_S = 10  # on SIGTERM/SIGINT: how long requests in flight may take to finish
SHUTTING_DOWN = "the server is shutting down"  # the 503 of requests still running when the grace is over
SHUTDOWN_FLUSH_S = 5  # after the grace: for those 503s to be written, before uvicorn cancels what is left
_DISCONNECT_POLL_S = 1.0
SSE_KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic (vLLM's)
_MAX_ECHOED_CHARS = 100  # of a request's value that an error message repeats
_STATS_TIMEOUT_S = 5.0
_TRACEBACK = "Traceback (most recent call last):"
MIN_LOGPROB = -9999.0  # what a logprob of -inf is reported as (JSON has no -inf; vLLM's and OpenAI's floor)
log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """capacity: most sequences (prompts x n) in flight at once over all ranks, running and waiting;
    past it new requests get a 503 (None: no limit). open_paths: served without the API key.
    tokenizer: what the loader gave (codec wraps it), for /tokenize's and the chat's options (None: the
    codec alone). max_token_chars: the most characters one token covers (prompts.longest_token_chars;
    None: unknown, texts are not refused by length before tokenizing). tokenize_pool: where long texts
    are tokenized (prompts.py). generation_defaults: the model's defaults of the sampling fields a
    request leaves unset (serving.generation_config). max_logprobs: --max-logprobs. prompt_tokens_details:
    --enable-prompt-tokens-details (usage's cached prompt tokens). force_include_usage: --enable-force-include-usage
    (a stream's usage chunk without stream_options asking for it). response_role: --response-role (the chat
    responses' role where the template adds the generation prompt). return_tokens_as_token_ids:
    --return-tokens-as-token-ids (logprobs' tokens as "token_id:{id}" unless a request says otherwise).
    scheduling_policy: the engine's (a request's priority other than 0 needs "priority"). reasoning_parser:
    --reasoning-parser (reasoning.py), with think_tokens, the tokenizer's markers (serve sets both).
    served_model_aliases: --served-model-name's names after the first (served_model_name), which requests may use
    too. stream_interval: --stream-interval (the fewest tokens a streamed chunk carries but a choice's first and
    last; a request's stream_interval may raise it). tool_call_parser: --tool-call-parser (tool_calls.py), used
    where auto_tool_choice (--enable-auto-tool-choice) lets a request's tool_choice be "auto";
    exclude_tools_when_tool_choice_none: --exclude-tools-when-tool-choice-none (tool_choice "none" leaves the tools
    out of the prompt).
    default_chat_template_kwargs: --default-chat-template-kwargs (under a request's own). request_id_headers:
    --enable-request-id-headers (request_id.py). access_log: uvicorn's (--disable-uvicorn-access-log: off).
    sse_keep_alive_s: --sse-keep-alive-interval (0: none). trust_request_chat_template: render a request's own
    chat_template (--trust-request-chat-template). tokenizer_info: GET /tokenizer_info's body
    (--enable-tokenizer-info-endpoint, tokenizer_info.py; None: no such endpoint). cors: the
    CORS policy (cors.py; no origin allowed by default). openapi: serve /openapi.json (--disable-fastapi-docs:
    not). root_path: --root-path (the path prefix of a proxy in front; open_paths are matched without it). tls:
    run_http's TLS (tls.py).
    connection_limits: run_http's (connections.py), and the pace of a body. shutdown_deadline:
    time.monotonic() by which requests in flight end, set on SIGTERM. dev_mode: serve vLLM's
    development endpoints (POST /reset_prefix_cache), as vLLM does with VLLM_SERVER_DEV_MODE=1 (the
    default here reads that variable)."""

    coordinator: DPCoordinator
    codec: Codec
    metrics: ServingMetrics
    served_model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    open_paths: frozenset[str] = DEFAULT_OPEN_PATHS
    capacity: int | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    tokenizer: Any = None
    chat_template: ChatTemplate = field(default_factory=lambda: ChatTemplate(None))
    max_token_chars: int | None = None
    tokenize_pool: ThreadPoolExecutor = field(default_factory=make_tokenize_pool)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS
    prompt_tokens_details: bool = False
    force_include_usage: bool = False
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    scheduling_policy: str = "fcfs"
    reasoning_parser: str | None = None
    think_tokens: ThinkTokens | None = None
    served_model_aliases: tuple[str, ...] = ()
    stream_interval: int = 1
    tool_call_parser: str | None = None
    auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    request_id_headers: bool = False
    access_log: bool = True
    sse_keep_alive_s: float = 0.0
    trust_request_chat_template: bool = False
    tokenizer_info: dict[str, Any] | None = None
    cors: Cors = field(default_factory=Cors)
    openapi: bool = True
    root_path: str = ""
    tls: Tls = field(default_factory=Tls)
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    shutdown_deadline: float | None = None
    dev_mode: bool = field(default_factory=lambda: dev_mode_from_env(os.environ))

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name requests may give the model (--served-model-name's), the first the one metrics carry."""
        return (self.served_model_name, *self.served_model_aliases)


def dev_mode_from_env(env: Mapping[str, str]) -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE: an integer, on where it is not 0 (unset: off)."""
    value = env.get("VLLM_SERVER_DEV_MODE", "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"VLLM_SERVER_DEV_MODE: expected an integer (0 or 1), got {value!r}") from None


def make_server_state(config: EngineConfig, api_key: str | None = None, start_timeout_s: float = 600.0, *,
                      open_paths: frozenset[str] = DEFAULT_OPEN_PATHS, max_waiting_seqs: int | None = None,
                      rank_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> ServerState:
    """Load the tokenizer and the chat template (config.chat_template, else the tokenizer directory's
    own), start the engine ranks (waits until they have loaded the model). max_waiting_seqs: waiting
    sequences per rank before new requests get a 503 (default WAITING_PER_RUNNING x max_num_seqs).
    rank_stall_timeout_s: a rank without progress for this long makes the server answer 503."""
    if max_waiting_seqs is None:
        max_waiting_seqs = WAITING_PER_RUNNING * config.max_num_seqs
    if max_waiting_seqs < 0:
        raise ValueError(f"max_waiting_seqs: expected >= 0, got {max_waiting_seqs}")
    coordinator = DPCoordinator(config, stall_timeout_s=rank_stall_timeout_s)
    coordinator.launch(start_timeout_s)  # the ranks load the model while this process loads the tokenizer
    try:
        template = load_chat_template(config.tokenizer or config.model, config.chat_template)
        tokenizer = importlib.import_module(config.loader).load_tokenizer(config)
        codec = as_codec(tokenizer)
    except BaseException:
        coordinator.shutdown()
        raise
    info = coordinator.wait_ready(start_timeout_s)
    # Made once the ranks say the context length (the token-count buckets'), before any request: the cumulative
    # counters of the ranks' stats lose nothing, and no output comes before a request.
    metrics = coordinator.observer = ServingMetrics(config.served_model_name, config.data_parallel_size,
                                                    info.max_model_len)
    capacity = len(coordinator.load()) * (config.max_num_seqs + max_waiting_seqs)  # over the ranks served here
    return ServerState(coordinator, codec, metrics, config.served_model_name, config.model, info.max_model_len,
                       info.vocab_size, api_key, frozenset(open_paths), capacity, tokenizer=tokenizer,
                       chat_template=template, max_token_chars=longest_token_chars(tokenizer),
                       scheduling_policy=config.scheduling_policy)


class _KeepAlive:
    """_next's answer where a stream's keep-alive comment is due."""


KEEP_ALIVE = _KeepAlive()


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def _error(status: int, message: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _internal_error(exc: Exception) -> str:
    """What a client is told of a bug: the exception's type only (the traceback goes to the log)."""
    return f"internal error ({type(exc).__name__}); see the server log"


@functools.lru_cache(maxsize=64)
def _public(reason: str) -> str:
    """An engine error as a client sees it: a rank's traceback goes to the server log (once per
    distinct reason), only its last line (the exception) into the response."""
    head, found, trace = reason.partition(_TRACEBACK)
    if not found:
        return reason
    log.error("%s", reason)
    last = next((line.strip() for line in reversed(trace.splitlines()) if line.strip()), "")
    return f"{head.strip()} {last}".strip()


class _Guard:
    """ASGI middleware in front of everything that reads a request: the API key (401), then the body:
    413 at once for a Content-Length over the limit, else read here up to the limit (413 past it),
    each part within the header-read timeout of the last (408 past it), and handed on."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        headers = dict(scope["headers"])
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if state.api_key is not None and path not in state.open_paths:
            given = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(given) > 1:
                return await _error(400, f"Authorization: expected one Authorization header, got {len(given)}")(
                    scope, receive, send)
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), state.api_key.encode()):
                return await _error(401, "Unauthorized: a valid 'Authorization: Bearer <api key>' header is "
                                         "required")(scope, receive, send)
        limit = state.max_body_bytes
        too_large = _error(413, f"request body: expected at most {limit} bytes")
        length = headers.get(b"content-length")
        if length is not None and int(length) > limit:  # the HTTP parser holds the body to this length
            return await too_large(scope, receive, send)
        wait = state.connection_limits.header_read_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                return await _error(408, f"request body: nothing received for {wait:g} s")(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> dict:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)


@contextlib.asynccontextmanager
async def _load_streaming(_: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan: before it takes requests, open and close an anyio task group, as every streamed
    response does. That loads anyio's asyncio backend, which the first stream would otherwise import while its
    chunks wait (the first request after ready came ~17 ms late, all its chunks at once: benchmarks/RESULTS.md)."""
    async with anyio.create_task_group():
        pass
    yield


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ep-serve", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if state.openapi else None, lifespan=_load_streaming)
    app.state.serving = state
    app.root_path = state.root_path  # as vLLM sets it: requests may come with the prefix or without
    app.add_middleware(_Guard, state=state)
    if state.request_id_headers:  # outside the guard: its 401s, 413s and 503s carry the header too
        app.add_middleware(RequestIdHeaders)
    state.cors.add_to(app)  # added last: the outermost middleware

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc.errors())
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this handler; the client gets the exception's type only.
        return _error(500, _internal_error(exc))

    @app.get("/health")
    async def health() -> Response:
        problem = state.coordinator.unavailable()
        if problem is None:
            return Response(status_code=200)
        return _error(503, problem)

    @app.get("/ping")
    @app.post("/ping", operation_id="ping_post")
    async def ping() -> Response:
        """vLLM's (SageMaker's) name for /health."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        ep_stats = await asyncio.to_thread(state.coordinator.collect_stats, _STATS_TIMEOUT_S)
        return Response(state.metrics.render(ep_stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
                               for name in state.served_model_names])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _TextCompletionCall(state, body, raw).run()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _ChatCompletionCall(state, body, raw).run()

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> TokenizeResponse:
        data = await _json_object(raw)
        body: TokenizeChatRequest | TokenizeCompletionRequest
        if "messages" in data:
            body = _parse(TokenizeChatRequest, data)
            _check_model(state, body.model)
            _check_request_template(state, body.chat_template)
            _refuse((("mm_processor_kwargs", bool(body.mm_processor_kwargs)),
                     ("media_io_kwargs", bool(body.media_io_kwargs)),
                     ("response_format", body.response_format is not None)))
            _, ids = await encode_chat(state, conversation(body.messages), body.add_generation_prompt,
                                       body.continue_final_message, body.chat_template_kwargs, body.add_special_tokens,
                                       state.max_model_len, body.chat_template,
                                       [t.model_dump() for t in body.tools] if body.tools else None)
            where = "messages"
        else:
            body = _parse(TokenizeCompletionRequest, data)
            _check_model(state, body.model)
            where = "prompt"
            ids = await encode_text(state, body.prompt, body.add_special_tokens, where, state.max_model_len)
        if len(ids) > state.max_model_len:  # as vLLM's tokenization: an input no request could hold is refused
            raise APIError(400, f"{where}: {len(ids)} tokens, more than this model's maximum context length "
                                f"(max_model_len {state.max_model_len})", where)
        strs = token_strs(state, ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)

    if state.tokenizer_info is not None:
        info = state.tokenizer_info

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            """vLLM's --enable-tokenizer-info-endpoint: the tokenizer's configuration and the chat template."""
            return info

    if state.dev_mode:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> Response:
            """vLLM's development endpoint: every local rank forgets its prefix cache between steps, where
            no request holds blocks (vLLM's rule; a rank with requests running keeps its cache, which the
            log says). 200 with no body either way, as vLLM answers."""
            _refuse((("reset_running_requests", reset_running_requests), ("reset_external", reset_external)))
            log.info("Resetting prefix cache...")
            done = await asyncio.to_thread(state.coordinator.reset_prefix_cache, _STATS_TIMEOUT_S)
            kept = [rank for rank, ok in done.items() if not ok]
            if not done:
                log.warning("prefix cache reset: the engine ranks did not all answer within %g s", _STATS_TIMEOUT_S)
            elif kept:
                log.warning("prefix cache not reset on rank(s) %s: requests there hold KV blocks (reset when idle)",
                            kept)
            return Response(status_code=200)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        _check_model(state, body.model)
        check_token_ids(state, body.tokens)
        return DetokenizeResponse(prompt=await decode_text(state, body.tokens))

    return app


class _CompletionCall:
    """One call of a completions endpoint: n choices for each prompt, each an engine request. The
    endpoint's subclass says what its prompts are (_items, _encode), which fields it refuses, and what
    its responses and stream chunks look like."""

    id_prefix: ClassVar[str]

    def __init__(self, state: ServerState, body: Any, raw: Request) -> None:
        self.state, self.body, self.raw = state, body, raw
        self.id = f"{self.id_prefix}-{body.request_id or uuid.uuid4().hex}"  # vLLM's: the client's request_id
        self.created = int(time.time())  # one time for the response and every chunk of its stream, as OpenAI's
        # The served name the request used (vLLM echoes it), else the first.
        self.model_name = body.model if body.model in state.served_model_names else state.served_model_name

    # ------------------------------------------------------------------ what an endpoint says
    @property
    def max_tokens(self) -> int | None:
        return self.body.max_tokens

    @property
    def prompt_only(self) -> bool:
        """Whether the choices are the prompt alone (the engine's one token is dropped)."""
        return False

    @property
    def max_tokens_param(self) -> str:
        """The request field max_tokens comes from (a 400 names it)."""
        return "max_tokens"

    def _refuse_unsupported(self) -> None:
        """400 for a field this server does not serve (set to anything but its default), or fields that
        contradict each other."""
        field = self.body.refused_field()
        if field is not None:
            raise APIError(400, f"{field}: not supported by this server (leave it at its default)", field)
        if self.body.stream_options is not None and not self.body.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
        if self.body.priority and self.state.scheduling_policy != "priority":
            raise APIError(400, f"priority: {self.body.priority} needs --scheduling-policy priority (this server "
                                f"starts requests first come, first served)", "priority")
        plps = self.body.prompt_logprobs
        if plps is not None and not 0 <= plps <= self.state.max_logprobs:
            raise APIError(400, f"prompt_logprobs: expected in [0, {self.state.max_logprobs}] (--max-logprobs), got "
                                f"{plps}", "prompt_logprobs")
        if plps and self.body.stream:
            raise APIError(400, "prompt_logprobs: not available when stream is true (vLLM's rule)", "prompt_logprobs")
        keep = self.body.truncate_prompt_tokens
        if keep is not None and keep > self.state.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens: {keep} is more than this model's maximum context length "
                                f"(max_model_len {self.state.max_model_len})", "truncate_prompt_tokens")

    @property
    def truncation(self) -> Truncation | None:
        """The request's truncate_prompt_tokens (vLLM's: -1 keeps max_model_len - 1, a token of room for output)."""
        keep = self.body.truncate_prompt_tokens
        if keep is None:
            return None
        return Truncation(self.state.max_model_len - 1 if keep == -1 else keep, self.body.truncation_side != "right")

    def _items(self) -> list[Any]:
        """The prompts of the request, before tokenizing."""
        raise NotImplementedError

    async def _encode(self, item: Any, where: str, room: int) -> list[int]:
        """One prompt's token ids (a 400 when it cannot be tokenized, or cannot fit in `room` tokens)."""
        raise NotImplementedError

    def _response(self, texts: list[str], finals: list[RequestOutput], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def _opening_chunks(self) -> list[dict]:
        """Chunks a stream starts with, before any output."""
        return []

    def _chunk(self, index: int, out: RequestOutput) -> dict:
        raise NotImplementedError

    def _usage_chunk(self, usage: UsageInfo) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ the call
    async def run(self) -> Response:
        _check_model(self.state, self.body.model)
        if self.state.shutdown_deadline is not None:
            raise APIError(503, SHUTTING_DOWN)
        self._refuse_unsupported()
        items = self._items()
        self._admit(len(items) * self.body.n)  # before the work of tokenizing
        base = self._params()  # the sampling fields' 400s, before the work of tokenizing too
        prompts = await self._tokenize(items)
        params = [self._choice_params(base, p, j) for p in prompts for j in range(self.body.n)]
        self.items, self.prompts = items, prompts
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.cached_tokens = 0  # of the prompt tokens, found in the prefix cache (each prompt's first choice says)
        count = len(params)
        # What each choice has had so far: token ids, their logprobs, the prompt's logprobs (once).
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(count)]
        self.prompt_logprobs: list[list[TokenLogprobs | None] | None] = [None] * count
        self._token_str_cache: dict[int, str] = {}
        as_ids = self.body.return_tokens_as_token_ids  # the request's, else --return-tokens-as-token-ids
        self._tokens_as_ids = as_ids if as_ids is not None else self.state.return_tokens_as_token_ids
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.request_ids = [f"{self.id}-{i}" for i in range(len(params))]
        self.pending = set(self.request_ids)
        self._next_poll = time.monotonic() + _DISCONNECT_POLL_S
        loop = asyncio.get_running_loop()
        self._admit(len(params))  # again: the load changed while tokenizing; no await from here to submit
        n = self.body.n
        submissions = [Submission(rid, prompts[i // n], p, self._sink(loop, i),
                                  Counted(prompt=self._counts_prompt(i), output=not self.prompt_only,
                                          max_tokens=p.max_tokens,
                                          choices=n, parent=f"{self.id}-prompt-{i // n}"),
                                  self.body.priority)
                       for i, (rid, p) in enumerate(zip(self.request_ids, params))]
        try:
            self.state.coordinator.submit(submissions)
        except EngineUnavailableError as e:
            self._abort_pending()
            raise APIError(503, _public(str(e))) from None
        except ValueError:  # the ids are another request's, still in flight: nothing here was submitted
            self.pending = set()
            raise APIError(400, f"request_id: {self.body.request_id!r} is the id of a request still in flight",
                           "request_id") from None
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return await self._complete()

    def _admit(self, need: int) -> None:
        """400 for a request larger than the server's capacity; 503 with Retry-After when `need` more
        sequences would not fit beside those in flight (the ranks' running and waiting limits)."""
        capacity = self.state.capacity
        if capacity is None:
            return
        if need > capacity:
            raise APIError(400, f"n: the request needs {need} sequences (prompts x n), the server holds at "
                                f"most {capacity} at once", "n")
        in_flight = sum(self.state.coordinator.load())
        if in_flight + need > capacity:
            self.state.metrics.on_rejected()
            raise APIError(503, f"the server is busy ({in_flight} sequences running or waiting, at most "
                                f"{capacity}): retry later", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _tokenize(self, items: list[Any]) -> list[list[int]]:
        """Each prompt's token ids, checked by sequence.check_prompt (the vocabulary, max_model_len)."""
        token_lists = []
        room = self.state.max_model_len - (1 if self.max_tokens is None else self.max_tokens)
        if room < 1:
            raise APIError(400, f"{self.max_tokens_param}: {self.max_tokens} leaves no room for a prompt within this "
                                f"model's maximum context length (max_model_len {self.state.max_model_len})",
                           self.max_tokens_param)
        for i, item in enumerate(items):
            where = self._where(i, len(items))
            ids = await self._encode(item, where, room)
            try:
                check_prompt(ids, self.state.vocab_size, self.state.max_model_len, self.max_tokens, where,
                             self.max_tokens_param)
            except BadRequest as e:
                raise APIError(400, str(e), e.param) from None
            token_lists.append(ids)
        return token_lists

    def _where(self, index: int, count: int) -> str:
        return "prompt" if count == 1 else f"prompt[{index}]"

    def _choice_params(self, base: SamplingParams, prompt: list[int], choice: int) -> SamplingParams:
        """`base` (from _params) for one choice of one prompt: max_tokens defaults to what the prompt
        leaves of max_model_len, or the model's generation config's max_new_tokens if that is fewer (vLLM's
        get_max_tokens), and choice i draws from seed + i."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            room = self.state.max_model_len - len(prompt)
            max_tokens = min(room, self.state.generation_defaults.get("max_tokens", room))
        return dataclasses.replace(base, max_tokens=max_tokens, seed=None if base.seed is None else base.seed + choice)

    def _params(self) -> SamplingParams:
        """The engine's SamplingParams of the request; a 400 for a value they refuse."""
        logprobs, prompt_logprobs = self._logprobs_params()
        # Until the prompt is known, max_tokens is checked against the most it could be.
        max_tokens = self.state.max_model_len if self.max_tokens is None else self.max_tokens
        params = self.body.to_sampling_params(max_tokens=max_tokens, defaults=self.state.generation_defaults,
                                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        params.check_vocabulary(self.state.vocab_size)
        return params

    def _logprobs_params(self) -> tuple[int | None, int | None]:
        """SamplingParams' (logprobs, prompt_logprobs) for the request."""
        raise NotImplementedError

    def _transform(self, out: RequestOutput) -> RequestOutput:
        """An engine output as the endpoint counts it (the same, but for /v1/completions' echo alone)."""
        return out

    def _collect(self, index: int, out: RequestOutput) -> None:
        """Keep what a choice's output adds (token ids, logprobs, the prompt's logprobs)."""
        self.token_ids[index] += out.new_token_ids
        if out.logprobs is not None:
            self.logprobs[index] += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[index] = out.prompt_logprobs

    def _token_str(self, token_id: int) -> str:
        """A token as logprobs name it: its text on its own (vLLM's decoded token: the tokenizer's decode of the one
        id), or "token_id:{id}" where the request (return_tokens_as_token_ids), else --return-tokens-as-token-ids,
        asks for ids (vLLM's format_token_id_placeholder)."""
        return f"token_id:{token_id}" if self._tokens_as_ids else self._decoded(token_id)

    def _decoded(self, token_id: int) -> str:
        """A token's text on its own: the tokenizer's decode of the one id."""
        text = self._token_str_cache.get(token_id)
        if text is None:
            text = self._token_str_cache[token_id] = decode_all(self.state, [token_id])
        return text

    def _prompt_logprobs_json(self, index: int) -> list[dict[int, PromptLogprob] | None] | None:
        """Choice `index`'s prompt logprobs as vLLM gives them (None where none were computed): per prompt token
        after the first, its own entry (its rank) and the top ones' (ranks 1, 2, ...), by token id."""
        entries = self.prompt_logprobs[index]
        if entries is None:
            return None

        def entry(token: int, logprob: float, rank: int) -> PromptLogprob:
            return PromptLogprob(logprob=max(logprob, MIN_LOGPROB), rank=rank, decoded_token=self._decoded(token))

        out: list[dict[int, PromptLogprob] | None] = []
        for token, e in zip(self._prompt(index), entries):
            if e is None:
                out.append(None)
                continue
            ranked = {token: entry(token, e.logprob, e.rank)}
            ranked.update((t, entry(t, lp, r)) for r, (t, lp) in enumerate(e.top, 1))
            out.append(ranked)
        return out

    # ------------------------------------------------------------------ outputs
    def _sink(self, loop: asyncio.AbstractEventLoop, index: int) -> Any:
        def put(output: RequestOutput) -> None:
            if not loop.is_closed():  # the server may have stopped since
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, output))
        return put

    async def _next(self, keep_alive_by: float | None = None) -> tuple[int, RequestOutput] | _KeepAlive | None:
        """The next output; None once the client has gone; a 503 once the server is shutting down and
        the grace for requests in flight is over; KEEP_ALIVE where no output came by time.monotonic()
        `keep_alive_by` (a stream's keep-alive comment is due). The client is checked at least every
        _DISCONNECT_POLL_S, also while outputs keep coming."""
        while True:
            wait = _DISCONNECT_POLL_S
            deadline = self.state.shutdown_deadline
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise APIError(503, SHUTTING_DOWN)
                wait = min(wait, left)
            if keep_alive_by is not None:
                wait = max(0.0, min(wait, keep_alive_by - time.monotonic()))
            try:
                item = await asyncio.wait_for(self.queue.get(), wait)
            except asyncio.TimeoutError:
                item = None
            now = time.monotonic()
            if item is None and keep_alive_by is not None and now >= keep_alive_by:
                return KEEP_ALIVE
            if item is None or now >= self._next_poll:
                self._next_poll = now + _DISCONNECT_POLL_S
                if await self.raw.is_disconnected():
                    return None
            if item is not None:
                return item

    def _abort_pending(self) -> None:
        for rid in list(self.pending):
            self.state.coordinator.abort(rid)

    def _prompt(self, index: int) -> list[int]:
        """Choice `index`'s prompt token ids (a copy)."""
        return list(self.prompts[index // self.body.n])

    def _counts_prompt(self, index: int) -> bool:
        """Whether choice `index` counts its prompt (in the metrics and the usage): its prompt's first choice only."""
        return index % self.body.n == 0

    def _account(self, index: int, out: RequestOutput) -> None:
        if out.num_cached_tokens is not None and self._counts_prompt(index):
            self.cached_tokens += out.num_cached_tokens
        if out.finished:
            self.pending.discard(self.request_ids[index])
        if out.error is not None:
            dead = not self.state.coordinator.alive
            raise APIError(503 if dead else 500 if out.internal_error else 400, _public(out.error))

    def _usage(self, completion_tokens: int) -> UsageInfo:
        details = PromptTokenUsageInfo(cached_tokens=self.cached_tokens) if self.state.prompt_tokens_details else None
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=self.prompt_tokens + completion_tokens, prompt_tokens_details=details)

    async def _complete(self) -> Response:
        texts = [""] * len(self.request_ids)
        finals: list[RequestOutput | None] = [None] * len(self.request_ids)
        try:
            while self.pending:
                item = await self._next()
                if item is None:
                    return _error(400, "client disconnected")
                index, out = item
                out = self._transform(out)
                self._account(index, out)
                self._collect(index, out)
                texts[index] += out.new_text
                if out.finished:
                    finals[index] = out
        finally:
            self._abort_pending()  # the client went away, an error, or cancelled: free the engine's blocks
        done = [f for f in finals if f is not None]
        response = self._response(texts, done, self._usage(sum(f.num_output_tokens for f in done)))
        return JSONResponse(response.model_dump())

    def _choice_usage(self, index: int) -> dict:
        """Choice `index`'s usage so far, as a stream's chunk carries it with continuous_usage_stats (vLLM's)."""
        prompt, made = len(self._prompt(index)), len(self.token_ids[index])
        return UsageInfo(prompt_tokens=prompt, completion_tokens=made, total_tokens=prompt + made).model_dump()

    async def _stream(self) -> AsyncIterator[str]:
        completion_tokens = 0
        interval = self.state.sse_keep_alive_s
        options = self.body.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        batch = _OutputBatches(max(self.state.stream_interval, self.body.stream_interval or 1))
        try:
            for chunk in self._opening_chunks():
                if continuous:
                    chunk["usage"] = self._choice_usage(chunk["choices"][0]["index"])
                yield _sse(chunk)
            sent = time.monotonic()  # of the last event; a keep-alive comment is due `interval` after it
            while self.pending:
                try:
                    item = await self._next(sent + interval if interval else None)
                    if item is KEEP_ALIVE:
                        yield SSE_KEEP_ALIVE
                        sent = time.monotonic()
                        continue
                    if item is None:
                        return
                    index, out = item
                    out = self._transform(out)
                    self._account(index, out)
                    self._collect(index, out)
                    completion_tokens += len(out.new_token_ids)
                    # A chunk per step that made tokens, even when they add no text yet (an incomplete
                    # UTF-8 sequence), as vLLM does: clients time tokens by chunks (or by stream_interval's).
                    out = batch.add(index, out)
                    chunk = self._chunk(index, out) if out is not None and (out.new_text or out.new_token_ids
                                                                            or out.finished) else None
                except APIError as e:
                    yield _sse(error_body(e.status, e.message))
                    break
                except Exception as e:  # a bug of this server's: the stream still ends in the protocol's way
                    log.exception("request %s: its stream failed", self.id)
                    yield _sse(error_body(500, _internal_error(e)))
                    break
                if chunk is not None:
                    if continuous:
                        chunk["usage"] = self._choice_usage(index)
                    yield _sse(chunk)
                    sent = time.monotonic()
            else:
                if self.state.force_include_usage or (options is not None and options.include_usage):
                    yield _sse(self._usage_chunk(self._usage(completion_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            self._abort_pending()  # the client went away, an error, or cancelled: free the engine's blocks


class _TextCompletionCall(_CompletionCall):
    """/v1/completions: prompts are strings or token ids, encoded with the tokenizer's special tokens.
    echo puts the prompt's text before the choice's (and, with logprobs, its tokens and their
    logprobs, the first None, before the choice's); echo with max_tokens 0 is the prompt alone (the
    engine makes one token for the prompt's logprobs, which is dropped), as vLLM's serving_completion."""

    id_prefix = "cmpl"
    body: CompletionRequest

    @property
    def prompt_only(self) -> bool:
        return self.body.echo and self.body.max_tokens == 0

    @property
    def max_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.body.max_tokens

    def __init__(self, state: ServerState, body: Any, raw: Request) -> None:
        super().__init__(state, body, raw)
        self.started: set[int] = set()  # the choices whose stream has sent a chunk (the echo, the prompt's ids)
        self.text_lens: dict[int, int] = {}  # the text a choice's stream has sent (vLLM's text_offset base)

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        b = self.body
        if b.max_tokens == 0 and not b.echo:
            raise APIError(400, "max_tokens: expected >= 1 (0 only with echo: the prompt alone)", "max_tokens")
        if b.logprobs is not None and not 0 <= b.logprobs <= self.state.max_logprobs:
            raise APIError(400, f"logprobs: expected in [0, {self.state.max_logprobs}] (--max-logprobs), got "
                                f"{b.logprobs}", "logprobs")

    def _logprobs_params(self) -> tuple[int | None, int | None]:
        """The prompt's logprobs where prompt_logprobs asks, else as many as logprobs where echo shows them (vLLM's
        rule)."""
        b = self.body
        if b.prompt_logprobs is not None:
            return b.logprobs, b.prompt_logprobs
        return b.logprobs, b.logprobs if b.echo and b.logprobs is not None else None

    def _transform(self, out: RequestOutput) -> RequestOutput:
        if not self.prompt_only:
            return out
        return dataclasses.replace(out, new_token_ids=[], new_text="", num_output_tokens=0,
                                   logprobs=None if out.logprobs is None else [],
                                   finish_reason="length" if out.finished else None, stop_reason=None)

    def _items(self) -> list[Any]:
        """The prompts of the request, each a string or a list of token ids."""
        prompt = self.body.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt: expected at least one prompt", "prompt")
        return items

    async def _encode(self, item: Any, where: str, room: int) -> list[int]:
        if not isinstance(item, str):
            truncation = self.truncation
            return list(item) if truncation is None else truncation.ids(list(item))
        return await encode_text(self.state, item, self.body.add_special_tokens, where, room, self.truncation)

    def _prompt_text(self, index: int) -> str:
        """The prompt as echo shows it: its text as sent, or its ids' decoding (given as ids, or truncated: vLLM
        detokenizes the truncated ids)."""
        item = self.items[index // self.body.n]
        if isinstance(item, str) and self.truncation is None:
            return item
        return decode_all(self.state, self._prompt(index))

    def _echo(self, index: int) -> tuple[str, list[int], list[TokenLogprobs | None]]:
        """The prompt's text, token ids and logprobs (the first None) as a choice's echo."""
        plps = self.prompt_logprobs[index]
        prompt = self._prompt(index)
        return self._prompt_text(index), prompt, list(plps) if plps is not None else [None] * len(prompt)

    def _completion_logprobs(self, token_ids: list[int], entries: list[TokenLogprobs | None],
                             offset: int) -> CompletionLogProbs:
        """vLLM's _create_completion_logprobs: per token its string, logprob, the top N and the token
        itself as {string: logprob} (N or N + 1 entries; likeliest first here, the likelier kept where
        two tokens have the same string), and the offset of its text, from `offset` on."""
        result = CompletionLogProbs()
        for token_id, entry in zip(token_ids, entries):
            token = self._token_str(token_id)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(max(entry.logprob, MIN_LOGPROB))
            ranked = list(entry.top)
            if all(t != token_id for t, _ in ranked):
                ranked.append((token_id, entry.logprob))
            ranked.sort(key=lambda x: -x[1])
            top: dict[str, float] = {}
            for t, lp in ranked:
                top.setdefault(self._token_str(t), max(lp, MIN_LOGPROB))
            result.top_logprobs.append(top)
        return result

    def _response(self, texts: list[str], finals: list[RequestOutput], usage: UsageInfo) -> BaseModel:
        b = self.body
        choices = []
        for i, f in enumerate(finals):
            text, token_ids = texts[i], self.token_ids[i]
            entries: list[TokenLogprobs | None] = list(self.logprobs[i])
            if b.echo:
                prompt_text, prompt_ids, prompt_entries = self._echo(i)
                text, token_ids, entries = prompt_text + text, prompt_ids + token_ids, prompt_entries + entries
            logprobs = self._completion_logprobs(token_ids, entries, 0) if b.logprobs is not None else None
            ids = dict(token_ids=self.token_ids[i], prompt_token_ids=self._prompt(i)) if b.return_token_ids else {}
            choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=f.finish_reason,
                                            stop_reason=f.stop_reason, prompt_logprobs=self._prompt_logprobs_json(i),
                                            **ids))
        return CompletionResponse(id=self.id, created=self.created, model=self.model_name,
                                  choices=choices, usage=usage)

    def _chunk(self, index: int, out: RequestOutput) -> dict:
        b = self.body
        text, token_ids = out.new_text, list(out.new_token_ids)
        entries: list[TokenLogprobs | None] = list(out.logprobs or [])
        first = index not in self.started
        self.started.add(index)
        if b.echo and first:
            prompt_text, prompt_ids, prompt_entries = self._echo(index)
            text, token_ids, entries = prompt_text + text, prompt_ids + token_ids, prompt_entries + entries
        logprobs = None
        if b.logprobs is not None:
            logprobs = self._completion_logprobs(token_ids, entries, self.text_lens.get(index, 0))
        self.text_lens[index] = self.text_lens.get(index, 0) + len(text)
        ids = {}
        if b.return_token_ids:
            ids = dict(token_ids=list(out.new_token_ids), prompt_token_ids=self._prompt(index) if first else None)
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason, **ids)
        chunk = CompletionResponse(id=self.id, created=self.created, model=self.model_name,
                                   choices=[choice])
        return chunk.model_dump(exclude={"usage"})

    def _usage_chunk(self, usage: UsageInfo) -> dict:
        return CompletionResponse(id=self.id, created=self.created, model=self.model_name, choices=[],
                                  usage=usage).model_dump()


class _ChatCompletionCall(_CompletionCall):
    """/v1/chat/completions: one prompt, the messages rendered by the chat template and encoded without
    adding special tokens again (as transformers' apply_chat_template(tokenize=True))."""

    id_prefix = "chatcmpl"
    body: ChatCompletionRequest

    def __init__(self, state: ServerState, body: Any, raw: Request) -> None:
        super().__init__(state, body, raw)
        # Whether the responses split into reasoning and content (--reasoning-parser), and each streamed choice's
        # split by index.
        parser = state.reasoning_parser
        self._thinks = parser is not None and thinks(parser, template_variables(state, body.template_kwargs))
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        # Whether the responses' tool calls are parsed (--tool-call-parser, where tool_choice is "auto" and the
        # server allows it), each streamed choice's parse by index, and the choices that streamed a call.
        self._tool_choice = body.effective_tool_choice
        self._parses_tools = (self._tool_choice == "auto" and state.auto_tool_choice
                              and state.tool_call_parser is not None)
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._called: set[int] = set()
        self._prompt_text = ""  # the chat as its template rendered it (return_prompt_text)

    @property
    def max_tokens(self) -> int | None:
        b = self.body
        return b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.body.max_completion_tokens is None else "max_completion_tokens"

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        b = self.body
        _check_request_template(self.state, b.chat_template)
        if not b.include_reasoning and self.state.reasoning_parser is None:
            raise APIError(400, "include_reasoning: false needs --reasoning-parser (without it nothing is taken "
                                "for reasoning)", "include_reasoning")
        self._check_tools()
        if b.top_logprobs is not None:  # vLLM's checks (ChatCompletionRequest.check_logprobs)
            if not b.logprobs:
                raise APIError(400, "top_logprobs: only allowed when logprobs is true", "top_logprobs")
            if not 0 <= b.top_logprobs <= self.state.max_logprobs:
                raise APIError(400, f"top_logprobs: expected in [0, {self.state.max_logprobs}] (--max-logprobs), got "
                                    f"{b.top_logprobs}", "top_logprobs")

    def _check_tools(self) -> None:
        """vLLM's checks of tools and tool_choice (ChatCompletionRequest.check_tool_usage, and the server's flags);
        a choice that forces a call is refused: it needs output constrained to the call's schema."""
        b, choice = self.body, self.body.tool_choice
        if "tool_choice" in b.model_fields_set and choice not in (None, "none") and b.tools is None:
            raise APIError(400, "tool_choice: needs tools (the functions the model may call)", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in b.tools or ()]
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice: names the function {choice.function.name!r}, which is not among "
                                    f"tools ({', '.join(map(repr, names)) or 'none'})", "tool_choice")
        choice = self._tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            shown = '"required"' if choice == "required" else "a named function"
            raise APIError(400, f"tool_choice: {shown} is not supported by this server (forcing a call needs output "
                                f"constrained to its schema); use \"auto\" or \"none\"", "tool_choice")
        if choice == "auto" and not self._parses_tools:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", "tool_choice")

    def _tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions the chat template gets (vLLM's: all of them, unless tool_choice is "none" and
        --exclude-tools-when-tool-choice-none)."""
        b = self.body
        if not b.tools or (self._tool_choice == "none" and self.state.exclude_tools_when_tool_choice_none):
            return None
        return [t.model_dump() for t in b.tools]

    def _logprobs_params(self) -> tuple[int | None, int | None]:
        b = self.body
        return (b.top_logprobs or 0) if b.logprobs else None, b.prompt_logprobs

    def _chat_logprobs(self, token_ids: list[int], entries: list[TokenLogprobs]) -> ChatCompletionLogProbs:
        """vLLM's _create_chat_logprobs: per token its string, logprob and UTF-8 bytes, and the
        top_logprobs likeliest tokens likewise (likeliest first). With tokens as ids a chosen token's bytes stay its
        text's, the top ones' are their strings', as vLLM has them."""
        def one(token_id: int, logprob: float, text: str | None = None) -> dict[str, Any]:
            token = self._token_str(token_id)
            return {"token": token, "logprob": max(logprob, MIN_LOGPROB),
                    "bytes": list((token if text is None else text).encode("utf-8", errors="replace"))}

        n = self.body.top_logprobs or 0
        return ChatCompletionLogProbs(content=[
            ChatCompletionLogProbsContent(**one(t, e.logprob, self._decoded(t)),
                                          top_logprobs=[ChatCompletionLogProb(**one(u, lp)) for u, lp in e.top[:n]])
            for t, e in zip(token_ids, entries)])

    def _items(self) -> list[Any]:
        return [conversation(self.body.messages)]

    def _where(self, index: int, count: int) -> str:
        return "messages"

    async def _encode(self, item: Any, where: str, room: int) -> list[int]:
        b = self.body
        self._prompt_text, ids = await encode_chat(self.state, item, b.add_generation_prompt, b.continue_final_message,
                                                   b.template_kwargs, b.add_special_tokens, room, b.chat_template,
                                                   self._tools(), self.truncation, b.documents)
        return ids

    def _echoed(self) -> str:
        """What echo puts before each choice's content (vLLM's): the last message's, where its role is the
        responses' (a message being continued); else nothing."""
        if not self.body.echo:
            return ""
        last = conversation(self.body.messages[-1:])[0]
        return (last["content"] or "") if last["role"] == self._role() else ""

    def _message(self, text: str) -> AssistantMessage:
        reasoning, content = split_reasoning(text) if self._thinks else (None, text)
        calls: list[MessageToolCall] = []
        parsed = extract_tool_calls(content) if self._parses_tools and content is not None else None
        if parsed is not None:
            content, found = parsed
            calls = [MessageToolCall(id=tool_call_id(), function=FunctionCallText(name=c.name, arguments=c.arguments))
                     for c in found[:1 if self.body.parallel_tool_calls is False else None]]
        echoed = self._echoed()
        if echoed:
            content = echoed + (content or "")
        return AssistantMessage(role=self._role(), content=content,
                                reasoning=reasoning if self.body.include_reasoning else None, tool_calls=calls)

    @staticmethod
    def _finish_reason(reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" for a choice that called a tool and stopped by itself (a cut one stays "length")."""
        return "tool_calls" if called and reason == "stop" else reason

    def _response(self, texts: list[str], finals: list[RequestOutput], usage: UsageInfo) -> BaseModel:
        want, ids = bool(self.body.logprobs), bool(self.body.return_token_ids)
        messages = [self._message(text) for text in texts]
        choices = [ChatCompletionChoice(index=i, message=messages[i],
                                        logprobs=self._chat_logprobs(self.token_ids[i], self.logprobs[i]) if want
                                        else None, finish_reason=self._finish_reason(f.finish_reason,
                                                                                     bool(messages[i].tool_calls)),
                                        stop_reason=f.stop_reason, token_ids=self.token_ids[i] if ids else None)
                   for i, f in enumerate(finals)]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model_name,
                                      choices=choices, usage=usage,
                                      prompt_token_ids=self._prompt(0) if self.body.return_token_ids else None,
                                      prompt_logprobs=self._prompt_logprobs_json(0),
                                      prompt_text=self._prompt_text if self.body.return_prompt_text else None)

    def _stream_chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None,
                      **prompt: Any) -> dict:
        """A stream's chunk; prompt: the opening chunks' prompt_token_ids and prompt_text, where asked for."""
        chunk = ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model_name,
                                             choices=choices, usage=usage, **prompt)
        return chunk.model_dump(exclude=None if usage is not None else {"usage"})

    def _opening_chunks(self) -> list[dict]:
        """The role of each choice, before its text (as OpenAI and vLLM send it; with return_token_ids the prompt's
        token ids too, with return_prompt_text its rendered text)."""
        role = self._role()
        b = self.body
        prompt = dict(prompt_token_ids=self._prompt(0) if b.return_token_ids else None,
                      prompt_text=self._prompt_text if b.return_prompt_text else None)
        chunks = [self._stream_chunk([ChatCompletionStreamChoice(index=i, delta={"role": role, "content": ""})],
                                     **prompt)
                  for i in range(len(self.request_ids))]
        echoed = self._echoed()
        if echoed:  # then the echo, a chunk per choice (vLLM's)
            chunks += [self._stream_chunk([ChatCompletionStreamChoice(index=i, delta={"content": echoed})])
                       for i in range(len(self.request_ids))]
        return chunks

    def _role(self) -> str:
        """The responses' role, as vLLM's get_chat_request_role: --response-role where the template adds the
        generation prompt, else the last message's (continuing a message keeps its role)."""
        return self.state.response_role if self.body.add_generation_prompt else self.body.messages[-1].role

    def _chunk(self, index: int, out: RequestOutput) -> dict:
        if self._thinks:
            delta = self._reasoning_delta(index, out)
        else:
            delta = {"content": out.new_text} if out.new_text or not out.finished else {}
        if self._parses_tools:
            content = delta.pop("content", None)
            delta.update(self._tool_delta(index, content, out.finished))
        logprobs = None
        if self.body.logprobs:
            logprobs = self._chat_logprobs(list(out.new_token_ids), list(out.logprobs or []))
        finish_reason = self._finish_reason(out.finish_reason, index in self._called)
        ids = list(out.new_token_ids) if self.body.return_token_ids else None
        return self._stream_chunk([ChatCompletionStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                              finish_reason=finish_reason,
                                                              stop_reason=out.stop_reason, token_ids=ids)])

    def _tool_delta(self, index: int, content: str | None, finished: bool) -> dict[str, Any]:
        """A choice's content piece run through its ToolCallStream: the content outside the calls, and the calls'
        deltas (the first call's only where parallel_tool_calls is false)."""
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = ToolCallStream()
        content, calls = stream.feed(content or "", finished)
        if self.body.parallel_tool_calls is False:
            calls = [c for c in calls if c["index"] == 0]
        delta: dict[str, Any] = {}
        if content is not None:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
            self._called.add(index)
        return delta

    def _reasoning_delta(self, index: int, out: RequestOutput) -> dict[str, str]:
        """A thinking choice's delta: this output's text split by its ReasoningStream (the reasoning left out where
        include_reasoning is false)."""
        stream = self._reasoning_streams.get(index)
        if stream is None:
            assert self.state.think_tokens is not None
            stream = self._reasoning_streams[index] = ReasoningStream(self.state.think_tokens)
        reasoning, content = stream.feed(out.new_text, out.new_token_ids)
        delta = {}
        if reasoning is not None and self.body.include_reasoning:
            delta["reasoning"] = reasoning
        if content is not None:
            delta["content"] = content
        return delta

    def _usage_chunk(self, usage: UsageInfo) -> dict:
        return self._stream_chunk([], usage)


class _OutputBatches:
    """stream_interval's batching (vLLM's output processor): a choice's outputs are held until they hold `interval`
    tokens, except its first, which goes at once, and its last; then they go as one."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[int, list[RequestOutput]] = {}
        self._started: set[int] = set()

    def add(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """`out`, or the held outputs of its choice with it as one, where a chunk is due; else None (held)."""
        if self.interval == 1:
            return out
        held = self._held.setdefault(index, [])
        held.append(out)
        due = out.finished or index not in self._started or sum(len(o.new_token_ids) for o in held) >= self.interval
        if not due:
            return None
        self._started.add(index)
        del self._held[index]
        return out if len(held) == 1 else _merged(held)


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """Successive outputs of one request as one: their tokens, text and logprobs in order, the first-output fields
    of the first, the end of the last."""
    def first(name: str) -> Any:
        return next((getattr(o, name) for o in outs if getattr(o, name) is not None), None)

    last = outs[-1]
    return dataclasses.replace(
        last, new_token_ids=[t for o in outs for t in o.new_token_ids], new_text="".join(o.new_text for o in outs),
        logprobs=None if last.logprobs is None else [lp for o in outs for lp in o.logprobs or ()],
        queue_time=first("queue_time"), prompt_logprobs=first("prompt_logprobs"),
        num_cached_tokens=first("num_cached_tokens"))


# ---------------------------------------------------------------------------- shared by the endpoints
def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in (*state.served_model_names, state.model_path):
        shown = model
        if len(model) > _MAX_ECHOED_CHARS:
            shown = f"{model[:_MAX_ECHOED_CHARS]}... ({len(model)} characters)"
        raise APIError(404, f"The model `{shown}` does not exist.", "model")


def _check_request_template(state: ServerState, template: str | None) -> None:
    """400 for a request's own chat_template unless --trust-request-chat-template (vLLM's rule)."""
    if template is not None and not state.trust_request_chat_template:
        raise APIError(400, "chat_template: a request's own template needs --trust-request-chat-template (this "
                            "server renders with its own)", "chat_template")


def _refuse(checks: tuple[tuple[str, bool], ...]) -> None:
    """400 naming the first field (name, set to something but its default) this server does not implement."""
    for name, bad in checks:
        if bad:
            raise APIError(400, f"{name}: not supported by this server (leave it at its default)", name)


async def _json_object(raw: Request) -> dict[str, Any]:
    try:
        data = json.loads(await raw.body())
    except ValueError as e:
        raise APIError(400, f"invalid JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "invalid JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"body: expected a JSON object, got {type(data).__name__}")
    return data


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _describe_validation_errors(e.errors(), {})
        raise APIError(400, message, param) from None


_PROMPT_TYPES = "expected a string, a list of strings, a list of token ids or a list of lists of token ids"
_UNION_FIELDS = {"prompt": _PROMPT_TYPES}  # fields whose pydantic errors (one per union branch) say too much
_CONTENT_TYPES = 'expected a message content: a string or a list of {"type": "text", "text": string} parts'


def _describe_validation_errors(errors: list[Any],
                                union_fields: dict[str, str] = _UNION_FIELDS) -> tuple[str, str | None]:
    """One line per offending field (pydantic reports each union branch apart: keep the first, or
    union_fields' line for the field), and the first field's name as `param`."""
    by_field: dict[str, str] = {}
    for e in errors:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        field = str(loc[0]) if loc and isinstance(loc[0], str) else "body"
        # Where in the field, without pydantic's names of union branches ("list[int]", "function-after[...]").
        path = [x for x in loc[1:] if not (isinstance(x, str) and "[" in x)]
        detail = ".".join(str(x) for x in path)
        type_error = e.get("type") not in ("missing", "value_error")
        if field in union_fields and e.get("type") == "value_error":  # a string of the right type, but invalid
            by_field[field] = e.get("msg")
        elif field in union_fields and type_error:
            by_field.setdefault(field, union_fields[field])
        elif field == "messages" and type_error and path[1:2] == ["content"]:
            by_field.setdefault(field, f"{_CONTENT_TYPES} (at {path[0]}.content)")
        else:
            by_field.setdefault(field, f"{e.get('msg')}{f' (at {detail})' if detail else ''}")
    if not by_field:
        return "invalid request body", None
    message = "; ".join(f"{field}: {msg}" for field, msg in by_field.items())
    first = next(iter(by_field))
    return message, None if first == "body" else first


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def uvicorn_config(state: ServerState, *, host: str, port: int, log_level: str = "info",
                   shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> Any:
    """run_http's uvicorn.Config: build_app(state) under state.connection_limits, with state.tls."""
    import uvicorn

    limits = state.connection_limits
    return uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level, http=limits.protocol(),
                          access_log=state.access_log,
                          timeout_keep_alive=limits.keep_alive_timeout_s,
                          timeout_graceful_shutdown=shutdown_grace_s + SHUTDOWN_FLUSH_S, **state.tls.uvicorn_options())


def make_http_server(state: ServerState, *, host: str, port: int, log_level: str = "info",
                     shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> Any:
    """run_http's uvicorn.Server over uvicorn_config: on shutdown it sets state.shutdown_deadline, and with
    state.tls.refresh (--enable-ssl-refresh) it reloads its TLS context while it serves (tls.CertRefresher)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if state.tls.refresh:  # config.ssl: the context uvicorn made at load, which new connections use
                self.cert_refresh = asyncio.create_task(CertRefresher(state.tls, self.config.ssl).watch())

        async def shutdown(self, sockets: Any = None) -> None:
            state.shutdown_deadline = time.monotonic() + shutdown_grace_s  # read by the calls in flight
            refresh = getattr(self, "cert_refresh", None)
            if refresh is not None:
                refresh.cancel()
            await super().shutdown(sockets)

    return Server(uvicorn_config(state, host=host, port=port, log_level=log_level, shutdown_grace_s=shutdown_grace_s))


def run_http(state: ServerState, *, host: str, port: int, log_level: str = "info",
             shutdown_grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serve build_app(state) under state.connection_limits until SIGTERM or SIGINT, then return: new
    connections stop at once, requests in flight get shutdown_grace_s to finish; those still running
    then end with a 503 (SHUTTING_DOWN; a stream: an error event, then data: [DONE]), which aborts
    them in the engine. The caller stops the engine ranks afterwards, and the process exits normally."""
    raise_open_files_limit(state.connection_limits)
    server = make_http_server(state, host=host, port=port, log_level=log_level, shutdown_grace_s=shutdown_grace_s)
    if threading.current_thread() is not threading.main_thread():
        server.run()
        return
    # uvicorn re-raises the signal that stopped it to the handler it found installed; with the
    # default one the process would die there, before the caller has stopped the engine ranks.
    stop_signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stop_signals}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

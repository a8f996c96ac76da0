"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions (+ SSE streaming), /v1/models, /health,
/version, /metrics. It validates and tokenizes requests, hands them to the engine ranks through the
DPCoordinator and turns the ranks' outputs into responses. Bad input is a 400 in vLLM's error
envelope, an unknown model a 404, a body over the size limit a 413; only a full engine (503 with
Retry-After: running and waiting sequences at their limits), a dead one (503) or a bug (500) is a 5xx.
Error bodies never carry a traceback: those go to the server log."""

from __future__ import annotations

import asyncio
import functools
import hmac
import importlib
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ep_layer import __version__

from ..engine.detokenizer import Codec, as_codec
from ..engine.dp_coordinator import DPCoordinator, EngineDeadError
from ..engine.engine_config import EngineConfig
from ..engine.messages import RequestOutput
from ..engine.sequence import BadRequest, SamplingParams, check_prompt
from .metrics import ServingMetrics
from .protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    error_body,
)

DEFAULT_OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key
MAX_BODY_BYTES = 16 << 20  # a longer request body is a 413
WAITING_PER_RUNNING = 4  # default waiting sequences per rank, as a multiple of max_num_seqs
RETRY_AFTER_S = 1  # what a 503 for a full engine tells the client to wait
SHUTDOWN_GRACE_S = 10  # on SIGTERM/SIGINT: how long requests in flight may take to finish
_DISCONNECT_POLL_S = 1.0
_STATS_TIMEOUT_S = 5.0
_TRACEBACK = "Traceback (most recent call last):"
log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """capacity: most sequences (prompts x n) in flight at once over all ranks, running and waiting;
    past it new requests get a 503 (None: no limit). open_paths: served without the API key."""

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


def make_server_state(config: EngineConfig, api_key: str | None = None, start_timeout_s: float = 600.0, *,
                      open_paths: frozenset[str] = DEFAULT_OPEN_PATHS,
                      max_waiting_seqs: int | None = None) -> ServerState:
    """Load the tokenizer, start the engine ranks (waits until they have loaded the model).
    max_waiting_seqs: waiting sequences per rank before new requests get a 503 (default
    WAITING_PER_RUNNING x max_num_seqs)."""
    if max_waiting_seqs is None:
        max_waiting_seqs = WAITING_PER_RUNNING * config.max_num_seqs
    if max_waiting_seqs < 0:
        raise ValueError(f"max_waiting_seqs: expected >= 0, got {max_waiting_seqs}")
    codec = as_codec(importlib.import_module(config.loader).load_tokenizer(config))
    metrics = ServingMetrics(config.served_model_name, config.data_parallel_size)
    coordinator = DPCoordinator(config, metrics)
    info = coordinator.start(start_timeout_s)
    capacity = len(coordinator.load()) * (config.max_num_seqs + max_waiting_seqs)  # over the ranks served here
    return ServerState(coordinator, codec, metrics, config.served_model_name, config.model, info.max_model_len,
                       info.vocab_size, api_key, frozenset(open_paths), capacity)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def _error(status: int, message: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


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
    """ASGI middleware in front of everything that reads a request: the API key (401), then the body
    size (413 at once for a Content-Length over the limit; a chunked body is read up to the limit
    and handed on)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        headers = dict(scope["headers"])
        if state.api_key is not None and scope["path"] not in state.open_paths:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), state.api_key.encode()):
                return await _error(401, "Unauthorized: a valid 'Authorization: Bearer <api key>' header is "
                                         "required")(scope, receive, send)
        limit = state.max_body_bytes
        too_large = _error(413, f"request body: expected at most {limit} bytes")
        length = headers.get(b"content-length")
        if length is not None:  # the HTTP parser holds the body to exactly this length
            if int(length) > limit:
                return await too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
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


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ep-serve", version=__version__, docs_url=None, redoc_url=None)
    app.state.serving = state
    app.add_middleware(_Guard, state=state)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc.errors())
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this handler; the client gets the exception's type only.
        return _error(500, f"internal error ({type(exc).__name__}); see the server log")

    @app.get("/health")
    async def health() -> Response:
        if state.coordinator.alive:
            return Response(status_code=200)
        return _error(503, f"engine is dead: {_public(state.coordinator.why_dead())}")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        ep_stats = await asyncio.to_thread(state.coordinator.collect_stats, _STATS_TIMEOUT_S)
        return Response(state.metrics.render(ep_stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.served_model_name, root=state.model_path,
                                         max_model_len=state.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _Completion(state, body, raw).run()

    return app


class _Completion:
    """One /v1/completions call: n choices for each prompt, each an engine request."""

    def __init__(self, state: ServerState, body: CompletionRequest, raw: Request) -> None:
        self.state, self.body, self.raw = state, body, raw
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())  # one time for the response and every chunk of its stream, as OpenAI's

    async def run(self) -> Response:
        self._check_model()
        _refuse_unsupported(self.body)
        items = self._items()
        self._admit(len(items) * self.body.n)  # before the work of tokenizing
        prompts = await asyncio.to_thread(self._tokenize, items)
        params = [self._params(p, j) for p in prompts for j in range(self.body.n)]
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.request_ids = [f"{self.id}-{i}" for i in range(len(params))]
        self.pending = set(self.request_ids)
        self._next_poll = time.monotonic() + _DISCONNECT_POLL_S
        loop = asyncio.get_running_loop()
        self._admit(len(params))  # again: the load changed while tokenizing; no await from here to submit
        try:
            for i, (rid, p) in enumerate(zip(self.request_ids, params)):
                prompt = prompts[i // self.body.n]
                self.state.coordinator.submit(rid, prompt, p, self._sink(loop, i))
        except EngineDeadError as e:
            self._abort_pending()
            raise APIError(503, f"engine is dead: {_public(str(e))}") from None
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return await self._complete()

    # ------------------------------------------------------------------ checks
    def _check_model(self) -> None:
        model = self.body.model
        if model is not None and model not in (self.state.served_model_name, self.state.model_path):
            raise APIError(404, f"The model `{model}` does not exist.", "model")

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

    def _tokenize(self, items: list[Any]) -> list[list[int]]:
        """Each prompt's token ids, checked by sequence.check_prompt (the vocabulary, max_model_len)."""
        token_lists = []
        for i, item in enumerate(items):
            where = "prompt" if len(items) == 1 else f"prompt[{i}]"
            try:
                ids = self.state.codec.encode(item) if isinstance(item, str) else list(item)
            except ValueError as e:  # text this tokenizer cannot take (UnicodeError is a ValueError too)
                raise APIError(400, f"{where}: cannot be tokenized: {e}", "prompt") from None
            try:
                check_prompt(ids, self.state.vocab_size, self.state.max_model_len, self.body.max_tokens, where)
            except BadRequest as e:
                raise APIError(400, str(e), e.param) from None
            token_lists.append(ids)
        return token_lists

    def _params(self, prompt: list[int], choice: int) -> SamplingParams:
        """The engine's SamplingParams for one choice; a 400 for a value they refuse."""
        b = self.body
        stop_ids = tuple(b.stop_token_ids or ())
        bad = next((t for t in stop_ids if t >= self.state.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids: {bad} is outside the vocabulary [0, {self.state.vocab_size})",
                           "stop_token_ids")
        try:
            return SamplingParams(
                max_tokens=b.max_tokens if b.max_tokens is not None else self.state.max_model_len - len(prompt),
                temperature=1.0 if b.temperature is None else b.temperature,
                top_p=1.0 if b.top_p is None else b.top_p, top_k=b.top_k or 0,
                seed=None if b.seed is None else b.seed + choice,
                stop=(b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ()), stop_token_ids=stop_ids,
                ignore_eos=b.ignore_eos)
        except BadRequest as e:
            raise APIError(400, str(e), e.param) from None

    # ------------------------------------------------------------------ outputs
    def _sink(self, loop: asyncio.AbstractEventLoop, index: int) -> Any:
        def put(output: RequestOutput) -> None:
            if not loop.is_closed():  # the server may have stopped since
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, output))
        return put

    async def _next(self) -> tuple[int, RequestOutput] | None:
        """The next output; None once the client has gone. The client is checked at least every
        _DISCONNECT_POLL_S, also while outputs keep coming."""
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                item = None
            now = time.monotonic()
            if item is None or now >= self._next_poll:
                self._next_poll = now + _DISCONNECT_POLL_S
                if await self.raw.is_disconnected():
                    return None
            if item is not None:
                return item

    def _abort_pending(self) -> None:
        for rid in list(self.pending):
            self.state.coordinator.abort(rid)

    def _account(self, index: int, out: RequestOutput) -> None:
        if out.finished:
            self.pending.discard(self.request_ids[index])
        if out.error is not None:
            dead = not self.state.coordinator.alive
            raise APIError(503 if dead else 400, _public(out.error))

    async def _complete(self) -> Response:
        texts = [""] * len(self.request_ids)
        finals: list[RequestOutput | None] = [None] * len(self.request_ids)
        try:
            while self.pending:
                item = await self._next()
                if item is None:
                    return _error(400, "client disconnected")
                index, out = item
                self._account(index, out)
                texts[index] += out.new_text
                if out.finished:
                    finals[index] = out
        finally:
            self._abort_pending()  # the client went away, an error, or cancelled: free the engine's blocks
        choices = [CompletionChoice(index=i, text=texts[i], finish_reason=f.finish_reason, stop_reason=f.stop_reason)
                   for i, f in enumerate(finals) if f is not None]
        completion_tokens = sum(f.num_output_tokens for f in finals if f is not None)
        usage = UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=self.prompt_tokens + completion_tokens)
        response = CompletionResponse(id=self.id, created=self.created, model=self.state.served_model_name,
                                      choices=choices, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream(self) -> AsyncIterator[str]:
        completion_tokens = 0
        try:
            while self.pending:
                item = await self._next()
                if item is None:
                    return
                index, out = item
                try:
                    self._account(index, out)
                except APIError as e:
                    yield _sse(error_body(e.status, e.message))
                    break
                completion_tokens += len(out.new_token_ids)
                # A chunk per step that made tokens, even when they add no text yet (an incomplete
                # UTF-8 sequence), as vLLM does: clients time tokens by chunks.
                if out.new_text or out.new_token_ids or out.finished:
                    choice = CompletionChoice(index=index, text=out.new_text, finish_reason=out.finish_reason,
                                              stop_reason=out.stop_reason)
                    chunk = CompletionResponse(id=self.id, created=self.created, model=self.state.served_model_name,
                                               choices=[choice])
                    yield _sse(chunk.model_dump(exclude={"usage"}))
            else:
                options = self.body.stream_options
                if options is not None and options.include_usage:
                    usage = UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                                      total_tokens=self.prompt_tokens + completion_tokens)
                    chunk = CompletionResponse(id=self.id, created=self.created, model=self.state.served_model_name,
                                               choices=[], usage=usage)
                    yield _sse(chunk.model_dump())
            yield "data: [DONE]\n\n"
        finally:
            self._abort_pending()  # the client went away, an error, or cancelled: free the engine's blocks


_PROMPT_TYPES = "expected a string, a list of strings, a list of token ids or a list of lists of token ids"


def _describe_validation_errors(errors: list[Any]) -> tuple[str, str | None]:
    """One line per offending field (pydantic reports each union branch apart: keep the first), and
    the first field's name as `param`."""
    by_field: dict[str, str] = {}
    for e in errors:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        field = str(loc[0]) if loc and isinstance(loc[0], str) else "body"
        if field == "prompt" and e.get("type") == "value_error":  # a string of the right type, but invalid
            by_field[field] = e.get("msg")
        elif field == "prompt" and e.get("type") != "missing":
            by_field.setdefault(field, _PROMPT_TYPES)
        else:
            detail = ".".join(str(x) for x in loc[1:])
            by_field.setdefault(field, f"{e.get('msg')}{f' (at {detail})' if detail else ''}")
    if not by_field:
        return "invalid request body", None
    message = "; ".join(f"{field}: {msg}" for field, msg in by_field.items())
    first = next(iter(by_field))
    return message, None if first == "body" else first


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _refuse_unsupported(b: CompletionRequest) -> None:
    """400 for OpenAI fields this server does not implement, when set to anything but their default."""
    checks = (("echo", b.echo), ("logprobs", b.logprobs is not None), ("suffix", b.suffix is not None),
              ("logit_bias", bool(b.logit_bias)), ("best_of", b.best_of not in (None, b.n)),
              ("presence_penalty", b.presence_penalty not in (None, 0.0)),
              ("frequency_penalty", b.frequency_penalty not in (None, 0.0)),
              ("repetition_penalty", b.repetition_penalty not in (None, 1.0)))
    for name, bad in checks:
        if bad:
            raise APIError(400, f"{name}: not supported by this server (leave it at its default)", name)
    if b.stream_options is not None and not b.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")


def run_http(state: ServerState, *, host: str, port: int, log_level: str = "info") -> None:
    """Serve build_app(state) until SIGTERM or SIGINT, then return: new connections stop at once,
    requests in flight get SHUTDOWN_GRACE_S to finish (then they are cancelled, which aborts them
    in the engine). The caller stops the engine ranks afterwards, and the process exits normally."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(state), host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
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

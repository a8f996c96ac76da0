"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions (+ SSE streaming), /v1/models, /health,
/version, /metrics. It validates and tokenizes requests, hands them to the engine ranks through the
DPCoordinator and turns the ranks' outputs into responses. Bad input is a 400 in vLLM's error
envelope, an unknown model a 404; only a dead engine (503) or a bug (500) is a 5xx."""

from __future__ import annotations

import asyncio
import hmac
import importlib
import json
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

from ..engine.config import EngineConfig
from ..engine.detokenizer import Codec, as_codec
from ..engine.dp_coordinator import DPCoordinator, EngineDeadError
from ..engine.messages import RequestOutput
from ..engine.sequence import SamplingParams
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

_OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key
_DISCONNECT_POLL_S = 1.0
_STATS_TIMEOUT_S = 5.0


@dataclass
class ServerState:
    coordinator: DPCoordinator
    codec: Codec
    metrics: ServingMetrics
    served_model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None


def make_server_state(config: EngineConfig, api_key: str | None = None,
                      start_timeout_s: float = 600.0) -> ServerState:
    """Load the tokenizer, start the engine ranks (waits until they have loaded the model)."""
    codec = as_codec(importlib.import_module(config.loader).load_tokenizer(config))
    metrics = ServingMetrics(config.served_model_name, config.data_parallel_size)
    coordinator = DPCoordinator(config, metrics)
    info = coordinator.start(start_timeout_s)
    return ServerState(coordinator, codec, metrics, config.served_model_name, config.model, info.max_model_len,
                       info.vocab_size, api_key)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ep-serve", version=__version__, docs_url=None, redoc_url=None)
    app.state.serving = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc.errors())
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if state.api_key is not None and request.url.path not in _OPEN_PATHS:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
                return _error(401, "Unauthorized: a valid 'Authorization: Bearer <api key>' header is required")
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if state.coordinator.alive:
            return Response(status_code=200)
        return _error(503, f"engine is dead: {state.coordinator.dead_reason or 'a rank exited'}")

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

    async def run(self) -> Response:
        self._check_model()
        _refuse_unsupported(self.body)
        prompts = await asyncio.to_thread(self._prompts)
        params = [self._params(p, j) for p in prompts for j in range(self.body.n)]
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.request_ids = [f"{self.id}-{i}" for i in range(len(params))]
        self.pending = set(self.request_ids)
        loop = asyncio.get_running_loop()
        try:
            for i, (rid, p) in enumerate(zip(self.request_ids, params)):
                prompt = prompts[i // self.body.n]
                self.state.coordinator.submit(rid, prompt, p, self._sink(loop, i))
        except EngineDeadError as e:
            self._abort_pending()
            raise APIError(503, f"engine is dead: {e}") from None
        if self.body.stream:
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return await self._complete()

    # ------------------------------------------------------------------ checks
    def _check_model(self) -> None:
        model = self.body.model
        if model is not None and model not in (self.state.served_model_name, self.state.model_path):
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def _prompts(self) -> list[list[int]]:
        prompt = self.body.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt: expected at least one prompt", "prompt")
        token_lists = [self.state.codec.encode(x) if isinstance(x, str) else list(x) for x in items]
        vocab, max_len = self.state.vocab_size, self.state.max_model_len
        for i, ids in enumerate(token_lists):
            where = "prompt" if len(token_lists) == 1 else f"prompt[{i}]"
            if not ids:
                raise APIError(400, f"{where}: the prompt is empty (no tokens)", "prompt")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{where}: token id {bad} is out of the vocabulary [0, {vocab})", "prompt")
            want = self.body.max_tokens if self.body.max_tokens is not None else 1
            if len(ids) + want > max_len:
                raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                               f"requested {len(ids) + want} tokens ({len(ids)} in the prompt, {want} in the "
                               f"completion). Please reduce the length of the prompt or the completion.",
                               "max_tokens" if self.body.max_tokens is not None else "prompt")
        return token_lists

    def _params(self, prompt: list[int], choice: int) -> SamplingParams:
        b = self.body
        stop = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ())
        if any(not s for s in stop):
            raise APIError(400, "stop: expected non-empty strings", "stop")
        stop_ids = tuple(b.stop_token_ids or ())
        bad = next((t for t in stop_ids if t >= self.state.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids: {bad} is out of the vocabulary [0, {self.state.vocab_size})",
                           "stop_token_ids")
        return SamplingParams(
            max_tokens=b.max_tokens if b.max_tokens is not None else self.state.max_model_len - len(prompt),
            temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p, top_k=b.top_k or 0,
            seed=None if b.seed is None else b.seed + choice, stop=stop, stop_token_ids=stop_ids,
            ignore_eos=b.ignore_eos)

    # ------------------------------------------------------------------ outputs
    def _sink(self, loop: asyncio.AbstractEventLoop, index: int) -> Any:
        def put(output: RequestOutput) -> None:
            if not loop.is_closed():  # the server may have stopped since
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, output))
        return put

    async def _next(self) -> tuple[int, RequestOutput] | None:
        """The next output; None once the client has gone (everything still running is aborted)."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await self.raw.is_disconnected():
                    self._abort_pending()
                    return None

    def _abort_pending(self) -> None:
        for rid in list(self.pending):
            self.state.coordinator.abort(rid)

    def _account(self, index: int, out: RequestOutput) -> None:
        if out.finished:
            self.pending.discard(self.request_ids[index])
        if out.error is not None:
            self._abort_pending()
            dead = not self.state.coordinator.alive
            raise APIError(503 if dead else 400, out.error)

    async def _complete(self) -> Response:
        texts = [""] * len(self.request_ids)
        finals: list[RequestOutput | None] = [None] * len(self.request_ids)
        while self.pending:
            item = await self._next()
            if item is None:
                return _error(400, "client disconnected")
            index, out = item
            self._account(index, out)
            texts[index] += out.new_text
            if out.finished:
                finals[index] = out
        choices = [CompletionChoice(index=i, text=texts[i], finish_reason=f.finish_reason, stop_reason=f.stop_reason)
                   for i, f in enumerate(finals) if f is not None]
        completion_tokens = sum(f.num_output_tokens for f in finals if f is not None)
        usage = UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=self.prompt_tokens + completion_tokens)
        response = CompletionResponse(id=self.id, model=self.state.served_model_name, choices=choices, usage=usage)
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
                if out.new_text or out.finished:
                    choice = CompletionChoice(index=index, text=out.new_text, finish_reason=out.finish_reason,
                                              stop_reason=out.stop_reason)
                    chunk = CompletionResponse(id=self.id, model=self.state.served_model_name, choices=[choice])
                    yield _sse(chunk.model_dump(exclude={"usage"}))
            else:
                options = self.body.stream_options
                if options is not None and options.include_usage:
                    usage = UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                                      total_tokens=self.prompt_tokens + completion_tokens)
                    chunk = CompletionResponse(id=self.id, model=self.state.served_model_name, choices=[],
                                               usage=usage)
                    yield _sse(chunk.model_dump())
            yield "data: [DONE]\n\n"
        finally:
            self._abort_pending()  # the client went away mid-stream: free the engine's blocks


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
        if field == "prompt" and e.get("type") != "missing":
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

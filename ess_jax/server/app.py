"""The FastAPI app: routes onto the plain handlers (``completions``, ``chat``, ``tokenization``), OpenAI's error
JSON for every refusal, the API key on every endpoint but ``/health``, a bound on request bodies (413), and the engine
thread's lifespan. Tokenizing and detokenizing run on worker threads, never on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ess_jax.engine.loop import EngineDied, EngineLoop, ready
from ess_jax.server import tokenization
from ess_jax.server.chat import chat
from ess_jax.server.completions import completions
from ess_jax.server.context import ServeContext
from ess_jax.server.metrics import Metrics
from ess_jax.server.protocol import APIError, ChatBody, CompletionBody, invalid
from ess_jax.tokenizer import ChatTemplate


MAX_BODY_BYTES = 64 << 20  # the default bound on a request's body


def create_app(engine, *, model_name: str, chat_template: ChatTemplate | None = None, api_key: str | None = None,
               max_waiting: int = 64, metrics_every: int = 16, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine``; its engine thread starts and stops with the app's lifespan. The
    engine is warmed up here, on the calling thread (``Engine.warm_up``): the engine thread only runs
    compiled steps. ``chat_template``: the one chat uses (default: the model's own, if it has one);
    ``max_body_bytes``: larger request bodies are refused with a 413."""
    metrics = Metrics()
    ready(engine, metrics)
    loop = EngineLoop(engine, metrics, metrics_every=metrics_every)
    ctx = ServeContext(loop, model_name, chat_template or engine.model.chat_template, max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="ess_jax", lifespan=lifespan)
    app.state.engine_loop = loop
    add_error_handlers(app)
    if api_key is not None:
        require_key(app, api_key)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    add_routes(app, ctx, metrics)
    return app


class BodyLimit:
    """Refuse a request whose body has more than ``limit`` bytes with a 413: at once by its Content-Length, else
    once its chunks pass the bound (the body is read here, then handed to the app)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit
        self.message = f"the request body exceeds the server's bound of {limit} bytes (--max-body-mb)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = APIError(413, self.message, code="request_too_large").response()
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return await refused(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                return await refused(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal as OpenAI's ``{"error": {...}}``: APIError as raised, a body pydantic refused as a 400
    naming the field, a dead engine thread as a 500."""
    app.add_exception_handler(APIError, lambda request, e: e.response())
    app.add_exception_handler(RequestValidationError, lambda request, e: invalid(e.errors()).response())
    app.add_exception_handler(EngineDied, lambda request, e: APIError(500, str(e), kind="internal_error").response())


def require_key(app: FastAPI, api_key: str) -> None:
    """``Authorization: Bearer <api_key>`` on every endpoint but ``/health``, else a 401."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path != "/health" and not secrets.compare_digest(given, expected):
            return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            kind="authentication_error", code="invalid_api_key").response()
        return await call_next(request)


def health(ctx: ServeContext) -> dict:
    if ctx.loop.error is not None:
        raise APIError(500, f"the engine stopped: {ctx.loop.error!r}", kind="internal_error")
    return {"status": "ok"}


def models(ctx: ServeContext) -> dict:
    return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "ess_jax",
                                        "max_model_len": ctx.engine.max_seq_len}]}


def reply(result: dict | Any) -> dict | StreamingResponse:
    """A handler's JSON object as it is, its server-sent events as a streaming response."""
    return result if isinstance(result, dict) else StreamingResponse(result, media_type="text/event-stream")


def add_routes(app: FastAPI, ctx: ServeContext, metrics: Metrics) -> None:
    app.get("/health")(lambda: health(ctx))
    app.get("/v1/models")(lambda: models(ctx))
    app.get("/metrics")(lambda: Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST))
    app.get("/tokenizer_info")(lambda: tokenization.tokenizer_info(ctx))

    @app.post("/v1/completions")
    async def completions_route(body: CompletionBody, request: Request):
        return reply(await completions(ctx, body, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_route(body: ChatBody, request: Request):
        return reply(await chat(ctx, body, request.is_disconnected))

    @app.post("/tokenize")
    async def tokenize_route(body: dict[str, Any]):
        return await asyncio.to_thread(tokenization.tokenize, ctx, body)

    @app.post("/detokenize")
    async def detokenize_route(body: dict[str, Any]):
        return await asyncio.to_thread(tokenization.detokenize, ctx, body)

"""The OpenAI-compatible HTTP server on the online engine (``python -m ess_jax.serve``).

One engine thread (``EngineLoop``) steps the engine while the HTTP handlers, on uvicorn's event
loop, add requests and read their outputs from per-request asyncio queues. Endpoints:
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). Errors are OpenAI's error JSON. A client that
goes away aborts its request, which frees its pages, batch row and pool slots at once.

``stop`` strings are matched on the decoded text: a streamed reply holds back the last
``len(longest stop) - 1`` characters until they cannot start a stop string, and the reply ends
before the stop string, which is not returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import threading
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

import jax
import numpy as np

from ess_jax.engine import Engine, RequestOutput, check_sampling
from ess_jax.sampling import SamplingParams

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error reply: HTTP ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# ---- request bodies ----------------------------------------------------------------------------

class _Body(BaseModel):
    """Fields both endpoints share (OpenAI's names; ``top_k``, ``stop_token_ids``, ``ignore_eos`` as vLLM's)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: every token
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    ignore_eos: bool = False
    stream: bool = False
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def sampling(self) -> SamplingParams:
        seed = self.seed if self.seed is not None else secrets.randbelow(2**32)
        return SamplingParams(self.temperature, max(self.top_k, 0), self.top_p, seed)

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        return stops

    def refuse_unsupported(self):
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: ess_jax returns one choice per prompt; send n "
                                "requests (with different seeds) instead", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; leave it at 0", param=name)


class CompletionBody(_Body):
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    max_tokens: Annotated[int, Field(ge=1)] = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def plain(self) -> dict[str, Any]:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return dict(self.model_dump(exclude={"content"}), content=content or "")


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


# ---- the engine thread -------------------------------------------------------------------------

class EngineDied(RuntimeError):
    """The engine thread stopped on an error; every request in flight gets it."""


class EngineLoop:
    """Steps the engine on its own thread; each request's ``RequestOutput``s go to its asyncio queue.

    The HTTP handlers never touch the engine: ``add`` checks a request and queues it, ``abort`` queues its
    abort, and the engine thread carries out what was queued, in order, before each step (``Ticks``: in a
    run of several processes, process 0's engine thread sends each tick's adds and aborts to the others,
    whose engines ``follow``, so every process steps the same requests). The engine thread sleeps while no
    request is unfinished. Device counters (tier hits, pool slots) are read every ``metrics_every`` steps,
    and when the engine goes idle, never once per request.
    """

    def __init__(self, engine: Engine, metrics: Metrics, *, metrics_every: int = 16):
        self.engine, self.metrics, self.metrics_every = engine, metrics, metrics_every
        self.ticks = Ticks()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # by the loop's request id
        self._timing: dict[int, list[float]] = {}  # loop request id -> [added, last token]
        self._ops: list[tuple] = []  # ("add", loop id, request) / ("abort", loop id) not yet carried out
        self._next_id = 0
        self._lock = threading.Lock()  # guards every field above
        self._engine_ids: dict[int, int] = {}  # the engine thread's: loop id -> engine id of unfinished requests
        self._loop_ids: dict[int, int] = {}  # the engine thread's: the reverse
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ess_jax-engine", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        """Abort what is left and end the thread (and the other processes' engine loops)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=60)

    @property
    def waiting(self) -> int:
        """Requests waiting for a batch row."""
        return self.waiting_with(0)

    def waiting_with(self, more: int) -> int:
        """Requests that would wait for a batch row with ``more`` added."""
        with self._lock:
            return max(len(self._queues) + more - self.engine.config.max_batch, 0)

    def add(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop_token_ids, ignore_eos: bool,
            logprobs: int | None) -> tuple[int, asyncio.Queue]:
        """Check a request (APIError 400 naming the problem) and queue it for the engine: its id here, and the
        queue its outputs arrive on."""
        if self.error is not None:
            raise EngineDied(f"the engine stopped: {self.error!r}")
        try:
            self.engine.check_request(prompt_ids, max_tokens, stop_token_ids, logprobs=logprobs)
            check_sampling(sampling)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        request = {"prompt_ids": [int(t) for t in prompt_ids], "max_new_tokens": int(max_tokens),
                   "sampling": dataclasses.asdict(sampling), "stop_token_ids": [int(t) for t in stop_token_ids],
                   "ignore_eos": bool(ignore_eos), "logprobs": logprobs}
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._ops.append(("add", request_id, request))
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._timing[request_id] = [time.perf_counter()] * 2
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._wake.set()
        return request_id, queue

    def abort(self, request_id: int):
        """Queue the abort of request ``request_id`` (an id ``add`` gave); the engine thread frees its pages,
        batch row and pool slots before its next step."""
        with self._lock:
            self._ops.append(("abort", request_id))
        self._wake.set()

    def _tick(self) -> tuple[list, bool]:
        """Carry out what was queued, in order: the engine's adds and aborts as ``apply`` takes them, and
        whether the loop stops (then every unfinished request is aborted)."""
        with self._lock:
            ops, self._ops = self._ops, []
            stop = self._stopping.is_set()
        done = []
        for op in ops:
            if op[0] == "add":
                engine_id = apply(self.engine, op[2])
                self._engine_ids[op[1]], self._loop_ids[engine_id] = engine_id, op[1]
                done.append(op[2])
            elif op[1] in self._engine_ids:  # (a request that finished is left alone)
                done.append(self._engine_ids[op[1]])
                self.engine.abort(done[-1])
        if stop:
            done += list(self._loop_ids)
            for engine_id in self._loop_ids:
                self.engine.abort(engine_id)
        return done, stop

    def _run(self):
        steps = 0
        try:
            while True:
                done, stop = self._tick()
                self.ticks.send(done, stop)
                if stop:
                    return
                busy = self.engine.has_unfinished()
                outputs, steps = advance(self.engine, self.metrics, steps, self.metrics_every, done)
                self._dispatch(outputs)
                if busy:
                    self.metrics.set_queue(self.engine, waiting=self.waiting)
                else:
                    self._wake.wait(self.ticks.idle_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - every request in flight must hear of it
            self.error = e
            with self._lock:
                queues, self._queues = self._queues, {}
            for loop, queue in queues.values():
                loop.call_soon_threadsafe(queue.put_nowait, EngineDied(f"the engine stopped: {e!r}"))
            raise

    def _dispatch(self, outputs: list[RequestOutput]):
        now = time.perf_counter()
        with self._lock:
            for out in outputs:
                request_id = self._loop_ids[out.request_id]
                loop, queue = self._queues[request_id]
                added_last = self._timing[request_id]
                if out.new_token_ids:
                    if added_last[0] == added_last[1]:
                        self.metrics.ttft.observe(now - added_last[0])
                    else:
                        self.metrics.itl.observe((now - added_last[1]) / len(out.new_token_ids))
                    added_last[1] = now
                    self.metrics.generation_tokens.inc(len(out.new_token_ids))
                if out.finished:
                    del self._queues[request_id], self._timing[request_id], self._loop_ids[out.request_id]
                    del self._engine_ids[request_id]
                    self.metrics.e2e.observe(now - added_last[0])
                    self.metrics.requests.labels(out.finish_reason).inc()
                loop.call_soon_threadsafe(queue.put_nowait, out)


def apply(engine: Engine, request: dict) -> int:
    """Add a request ``EngineLoop.add`` checked (its fields as ``Ticks`` sends them) to ``engine``: its id."""
    return engine.add_request(request["prompt_ids"], request["max_new_tokens"], SamplingParams(**request["sampling"]),
                              request["stop_token_ids"], ignore_eos=request["ignore_eos"], logprobs=request["logprobs"])


def advance(engine: Engine, metrics: Metrics, steps: int, metrics_every: int, done: list) -> tuple[list, int]:
    """One tick of an engine loop after its adds and aborts ``done``: a step if a request is unfinished or was
    aborted (the step reports it), the device counters read every ``metrics_every`` steps and when the engine
    goes idle; the outputs and the steps since the last idle. Every process of a run calls it alike (the reads
    are collectives there)."""
    if not engine.has_unfinished() and not any(isinstance(item, int) for item in done):
        if steps:
            metrics.read_device(engine)
        return [], 0
    outputs = engine.step()
    steps += 1
    if steps % metrics_every == 0:
        metrics.read_device(engine)
    return outputs, steps


class Ticks:
    """Each tick's adds and aborts, from process 0's engine loop to the other processes' (``follow``), over
    ``jax.distributed`` (``multihost_utils.broadcast_one_to_all`` of the JSON bytes: their length, then the
    bytes in a power-of-two buffer, so few shapes compile). One process: nothing to send. An idle loop ticks
    every ``idle_s`` seconds, so the others never wait long in a collective."""

    idle_s = 0.5

    def send(self, done: list, stop: bool) -> None:
        if jax.process_count() > 1:
            _broadcast(json.dumps({"done": done, "stop": stop}).encode())

    def receive(self) -> tuple[list, bool]:
        message = json.loads(_broadcast(b""))
        return message["done"], message["stop"]


def _broadcast(data: bytes) -> bytes:
    """Process 0's ``data`` on every process (a collective)."""
    from jax.experimental import multihost_utils

    size = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))[0])
    buffer = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    return multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes()


def ready(engine: Engine, metrics: Metrics) -> None:
    """What every process does before it serves: compile ahead (``Engine.warm_up``), then a first read of the
    device counters."""
    engine.warm_up()
    metrics.read_device(engine)


def follow(engine: Engine, *, metrics_every: int = 16) -> None:
    """A process other than 0 of a served run: the engine takes process 0's adds and aborts and steps with it,
    its outputs unread, until process 0's loop stops."""
    metrics, ticks, steps = Metrics(), Ticks(), 0
    ready(engine, metrics)
    while True:
        done, stop = ticks.receive()
        for item in done:
            if isinstance(item, dict):
                apply(engine, item)
            else:
                engine.abort(item)
        if stop:
            return
        _, steps = advance(engine, metrics, steps, metrics_every, done)


# ---- metrics -----------------------------------------------------------------------------------

class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ess_jax_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.running = Gauge("ess_jax_requests_running", "Requests holding a batch row", registry=r)
        self.waiting = Gauge("ess_jax_requests_waiting", "Requests waiting for a batch row", registry=r)
        self.prompt_tokens = Counter("ess_jax_prompt_tokens", "Prompt tokens of added requests", registry=r)
        self.generation_tokens = Counter("ess_jax_generation_tokens", "Generated tokens", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("ess_jax_time_to_first_token_seconds", "Time to first token", buckets=buckets, registry=r)
        self.itl = Histogram("ess_jax_inter_token_latency_seconds", "Time between tokens", buckets=buckets, registry=r)
        self.e2e = Histogram("ess_jax_e2e_request_latency_seconds", "Request latency", buckets=buckets, registry=r)
        self.pages_in_use = Gauge("ess_jax_kv_pages_in_use", "Cache pages reserved by admitted requests", registry=r)
        self.pages_total = Gauge("ess_jax_kv_pages_total", "Allocatable cache pages", registry=r)
        self._tier: dict[str, Any] = {}
        r.register(_TierCollector(self))

    def set_queue(self, engine: Engine, *, waiting: int):
        usage = engine.scheduler.usage()  # host bookkeeping only: no device read
        self.running.set(usage["rows_in_use"])
        self.waiting.set(waiting)
        self.pages_total.set(usage["pages_total"])  # every data shard's
        self.pages_in_use.set(usage["pages_in_use"])

    def read_device(self, engine: Engine):
        """Snapshot what lives on the device: tier counters and pool slots (one read each)."""
        offload = engine.offload_metrics()
        if offload is None:
            return
        usage = engine.usage()
        self._tier.update(offload=offload, pool_slots_in_use=usage["pool_slots_in_use"],
                          pool_slots_total=usage["pool_slots_total"], host_bytes_in_use=usage["host_bytes_in_use"],
                          host_bytes_capacity=usage["host_bytes_total"])


class _TierCollector:
    """The tier's counters from the last device snapshot, as Prometheus counters and gauges per layer."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        tier = self.metrics._tier
        if "offload" not in tier:
            return
        per_layer = tier["offload"]["per_layer"]
        for name, key, text in (("lookups", "lookups", "Top-k entries looked up"), ("hits", "hits", "Pool hits"),
                                ("misses", "misses", "Pool misses (fetched from the host)"),
                                ("h2d_bytes", "h2d_bytes", "Bytes fetched host to device"),
                                ("d2h_bytes", "decode_d2h_bytes", "Decode bytes backed up device to host")):
            family = CounterMetricFamily(f"ess_jax_tier_{name}", text, labels=["layer"])
            for c in per_layer:
                family.add_metric([str(c["layer"])], c[key])
            yield family
        for name, key, text in (("pool_slots_in_use", "pool_slots_in_use", "Device pool slots holding an entry"),
                                ("pool_slots_total", "pool_slots_total", "Device pool slots"),
                                ("host_store_bytes_in_use", "host_bytes_in_use", "Host store bytes of admitted requests"),
                                ("host_store_bytes_capacity", "host_bytes_capacity", "Host store bytes")):
            yield GaugeMetricFamily(f"ess_jax_tier_{name}", text, value=tier[key])


# ---- one request's stream ----------------------------------------------------------------------

@dataclasses.dataclass
class Piece:
    """What a request produced since the last piece, after stop strings."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None = None


async def _stream(loop: EngineLoop, request: Request, prompt_ids: list[int], max_tokens: int, body: _Body,
                  logprobs: int | None) -> AsyncIterator[Piece]:
    """The pieces of one request; the request is aborted if the consumer stops early or the client leaves."""
    stops = body.stops()
    hold = max((len(s) for s in stops), default=1) - 1
    request_id, queue = loop.add(prompt_ids, max_tokens, body.sampling(), body.stop_token_ids, body.ignore_eos,
                                 logprobs)
    text, sent, done = "", 0, False
    try:
        while True:
            try:
                out = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if isinstance(out, EngineDied):
                raise out
            text += out.text_delta
            cut = min((i for i in (text.find(s, max(sent - len(s) + 1, 0)) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                done = out.finished
                yield Piece(text[sent:cut], out.new_token_ids, out.logprobs, "stop")
                return
            end = len(text) if out.finished else max(len(text) - hold, sent)
            done = out.finished
            yield Piece(text[sent:end], out.new_token_ids, out.logprobs, out.finish_reason if out.finished else None)
            sent = end
            if done:
                return
    finally:
        if not done:
            loop.abort(request_id)


# ---- the app -----------------------------------------------------------------------------------

def create_app(engine: Engine, *, model_name: str, api_key: str | None = None, max_waiting: int = 64,
               metrics_every: int = 16) -> FastAPI:
    """The FastAPI app serving ``engine``; its engine thread starts and stops with the app's lifespan. The
    engine is warmed up here, on the calling thread (``Engine.warm_up``): the engine thread only runs
    compiled steps."""
    metrics = Metrics()
    ready(engine, metrics)
    loop = EngineLoop(engine, metrics, metrics_every=metrics_every)
    tokenizer, chat_template = engine.model.tokenizer, engine.model.chat_template

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="ess_jax", lifespan=lifespan)
    app.state.engine_loop = loop

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                            ).response()
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "malformed request body")
        return APIError(400, message, param=where or None).response()

    @app.exception_handler(EngineDied)
    async def engine_died(request, e: EngineDied):
        return APIError(500, str(e), kind="internal_error").response()

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                kind="authentication_error", code="invalid_api_key").response()
        return await call_next(request)

    def admit(body: _Body, prompts: list[list[int]], max_tokens: list[int]):
        body.refuse_unsupported()
        if body.model != model_name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        for ids, new in zip(prompts, max_tokens):  # refuse at once what could never run, before queueing any
            try:
                engine.check_request(ids, new, body.stop_token_ids)
            except ValueError as e:
                raise APIError(400, str(e)) from None
        if loop.waiting_with(len(prompts)) > max_waiting:
            raise APIError(503, f"{loop.waiting} requests are waiting for a batch row and --max-waiting is "
                                f"{max_waiting}; retry later", kind="server_overloaded", headers={"Retry-After": "1"})

    @app.get("/health")
    async def health():
        if loop.error is not None:
            raise APIError(500, f"the engine stopped: {loop.error!r}", kind="internal_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "ess_jax",
                                            "max_model_len": engine.max_seq_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def encode_prompt(prompt) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return ids

    def token_logprobs(lp, top: int) -> tuple[str, float, dict[str, float]]:
        return (tokenizer.token_text(lp.token_id), lp.logprob,
                {tokenizer.token_text(t): v for t, v in lp.top[:top]})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
            else [body.prompt]
        encoded = [encode_prompt(p) for p in prompts]
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt log-probabilities)", param="echo")
        admit(body, encoded, [body.max_tokens] * len(encoded))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        streams = [_stream(loop, request, ids, body.max_tokens, body, body.logprobs) for ids in encoded]
        echoes = [tokenizer.decode(ids) if body.echo else "" for ids in encoded]

        def choice(index, text, logprobs, finish_reason):
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

        def logprob_block(pieces_lp, offset):
            if body.logprobs is None:
                return None
            rows = [token_logprobs(lp, body.logprobs) for lp in pieces_lp]
            offsets, at = [], offset
            for token, _, _ in rows:
                offsets.append(at)
                at += len(token)
            return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                    "top_logprobs": [r[2] for r in rows], "text_offset": offsets}

        if body.stream:
            async def events():
                tokens = [0] * len(streams)
                async for index, piece in _merged(streams):
                    tokens[index] += len(piece.token_ids)
                    text = (echoes[index] if tokens[index] == len(piece.token_ids) else "") + piece.text
                    yield _sse(dict(head, choices=[choice(index, text, logprob_block(piece.logprobs or [], 0),
                                                          piece.finish_reason)]))
                yield _sse(dict(head, choices=[], usage=_usage(encoded, tokens)))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        results = await asyncio.gather(*(_collect(s) for s in streams))
        choices = []
        for index, (text, ids, lps, reason) in enumerate(results):
            choices.append(choice(index, echoes[index] + text, logprob_block(lps, len(echoes[index])), reason))
        return dict(head, choices=choices, usage=_usage(encoded, [len(r[1]) for r in results]))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        if chat_template is None:
            raise APIError(400, f"model {model_name!r} has no chat template (tokenizer_config.json 'chat_template'); "
                                "use /v1/completions", param="messages")
        try:
            rendered = chat_template.render([m.plain() for m in body.messages], add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(engine.max_seq_len - len(ids), 1)
        top = (body.top_logprobs or 0) if body.logprobs else None
        admit(body, [ids], [max_tokens])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": model_name}
        stream = _stream(loop, request, ids, max_tokens, body, top)

        def chat_logprobs(lps):
            if top is None:
                return None
            content = []
            for lp in lps:
                token, value, best = token_logprobs(lp, top)
                content.append({"token": token, "logprob": value, "bytes": list(token.encode()),
                                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                                 for t, v in best.items()]})
            return {"content": content}

        if body.stream:
            async def events():
                chunk = dict(head, object="chat.completion.chunk")
                yield _sse(dict(chunk, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]))
                tokens = 0
                async for piece in stream:
                    tokens += len(piece.token_ids)
                    yield _sse(dict(chunk, choices=[{"index": 0, "delta": {"content": piece.text},
                                                     "logprobs": chat_logprobs(piece.logprobs or []),
                                                     "finish_reason": piece.finish_reason}]))
                yield _sse(dict(chunk, choices=[], usage=_usage([ids], [tokens])))
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        text, out_ids, lps, reason = await _collect(stream)
        return dict(head, object="chat.completion",
                    choices=[{"index": 0, "message": {"role": "assistant", "content": text},
                              "logprobs": chat_logprobs(lps), "finish_reason": reason}],
                    usage=_usage([ids], [len(out_ids)]))

    return app


async def _collect(stream: AsyncIterator[Piece]) -> tuple[str, list[int], list, str | None]:
    text, ids, lps, reason = [], [], [], None
    async for piece in stream:
        text.append(piece.text)
        ids += piece.token_ids
        lps += piece.logprobs or []
        reason = piece.finish_reason or reason
    return "".join(text), ids, lps, reason


async def _merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """Pieces of several streams as they come, tagged with the stream's index; closing it closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for piece in stream:
                await queue.put((index, piece))
            await queue.put((index, None))
        except Exception as e:  # noqa: BLE001 - raised again by the consumer
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            index, piece = await queue.get()
            if isinstance(piece, Exception):
                raise piece
            if piece is None:
                open_streams -= 1
                continue
            yield index, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(prompts: list[list[int]], completion_tokens: list[int]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": sum(completion_tokens),
            "total_tokens": prompt + sum(completion_tokens)}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"



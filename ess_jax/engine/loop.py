"""The engine thread of a served engine and the lockstep of several processes: no HTTP here.

``EngineLoop`` steps an engine on its own thread while other threads (the HTTP handlers, on uvicorn's
event loop) add requests and read their outputs from per-request asyncio queues. Callers never touch
the engine: ``add`` and ``abort`` queue what the engine thread carries out, in order, before its next
step. In a run of several processes, process 0's engine thread sends each tick's adds and aborts to the
others (``Ticks``), whose engines ``follow``, so every process steps the same requests.

The engine's usage (pages, batch rows, pool slots) is read after every step whose tick carried out adds
or aborts, every ``metrics_every`` steps, and when the engine goes idle; its tier counters every
``metrics_every`` steps and when it goes idle. On several processes these reads are collectives, so
every process makes them at the same ticks (``tick``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np
import jax

from ess_jax.engine.request import RequestSpec

if TYPE_CHECKING:
    from ess_jax.engine import Engine, RequestOutput


class EngineDied(RuntimeError):
    """The engine thread stopped on an error; every request in flight gets it."""


class LoopMetrics(Protocol):
    """What an ``EngineLoop`` reports as it runs (``ess_jax.server.metrics.Metrics`` implements it)."""

    def added(self, prompt_tokens: int) -> None:
        """A request of ``prompt_tokens`` was queued."""

    def produced(self, out: RequestOutput, since_added_s: float, since_last_s: float | None) -> None:
        """A request's output, seconds after it was added and after its last token (None: none yet)."""

    def usage(self, usage: dict) -> None:
        """A fresh ``Engine.usage()``."""

    def offload(self, offload: dict) -> None:
        """A fresh ``Engine.offload_metrics()`` (only on offloaded engines)."""


class EngineLoop:
    """Steps the engine on its own thread; each request's ``RequestOutput``s go to its asyncio queue. The
    thread sleeps while no request is unfinished."""

    def __init__(self, engine: Engine, metrics: LoopMetrics, *, metrics_every: int = 16):
        self.engine, self.metrics, self.metrics_every = engine, metrics, metrics_every
        self.ticks = Ticks()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # by the loop's request id
        self._timing: dict[int, list[float]] = {}  # loop request id -> [added, last token]
        self._ops: list[tuple] = []  # ("add", loop id, request) / ("abort", loop id) not yet carried out
        self._leaving: set[int] = set()  # loop ids of unfinished requests whose abort is queued
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
        """Requests that would wait for a batch row with ``more`` added (those being aborted count as gone)."""
        with self._lock:
            return max(len(self._queues) - len(self._leaving) + more - self.engine.config.max_batch, 0)

    def add(self, spec: RequestSpec) -> tuple[int, asyncio.Queue]:
        """Check a request (ValueError naming the problem: ``Engine.check_request``) and queue it for the engine:
        its id here, and the queue its outputs arrive on. Call it on an asyncio loop."""
        if self.error is not None:
            raise EngineDied(f"the engine stopped: {self.error!r}")
        self.engine.check_request(spec)
        request = spec.to_dict()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._ops.append(("add", request_id, request))
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._timing[request_id] = [time.perf_counter()] * 2
        self.metrics.added(len(spec.prompt_ids))
        self._wake.set()
        return request_id, queue

    def abort(self, request_id: int):
        """Queue the abort of request ``request_id`` (an id ``add`` gave); the engine thread frees its pages,
        batch row and pool slots before its next step."""
        with self._lock:
            self._ops.append(("abort", request_id))
            if request_id in self._queues:
                self._leaving.add(request_id)
        self._wake.set()

    def _take_ops(self) -> tuple[list, bool]:
        """Carry out what was queued, in order: the engine's adds and aborts as ``Ticks`` send them to ``follow``
        (a request as ``RequestSpec.to_dict``, an abort as its engine id), and whether the loop stops (then every
        unfinished request is aborted)."""
        with self._lock:
            ops, self._ops = self._ops, []
            stop = self._stopping.is_set()
        done = []
        for op in ops:
            if op[0] == "add":
                engine_id = self.engine.add_request(RequestSpec.from_dict(op[2]))
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
                done, stop = self._take_ops()
                self.ticks.send(done, stop)
                if stop:
                    return
                busy = self.engine.has_unfinished()
                outputs, steps = tick(self.engine, done, steps, self.metrics_every, self.metrics)
                self._dispatch(outputs)
                if not busy:
                    self._wake.wait(self.ticks.idle_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - every request in flight must hear of it
            self.error = e
            with self._lock:
                queues, self._queues = self._queues, {}
                self._leaving.clear()
            for loop, queue in queues.values():
                _deliver(loop, queue, EngineDied(f"the engine stopped: {e!r}"))
            raise

    def _dispatch(self, outputs: list[RequestOutput]):
        now = time.perf_counter()
        with self._lock:
            for out in outputs:
                request_id = self._loop_ids[out.request_id]
                loop, queue = self._queues[request_id]
                added_last = self._timing[request_id]
                first = added_last[0] == added_last[1]
                self.metrics.produced(out, now - added_last[0], None if first else now - added_last[1])
                if out.new_token_ids:
                    added_last[1] = now
                if out.finished:
                    del self._queues[request_id], self._timing[request_id], self._loop_ids[out.request_id]
                    del self._engine_ids[request_id]
                    self._leaving.discard(request_id)
                _deliver(loop, queue, out)


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    """Put ``item`` on ``queue`` from the engine thread; a queue whose event loop was closed (its reader is gone,
    its abort on the way) gets nothing."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(queue.put_nowait, item)


def tick(engine: Engine, done: list, steps: int, metrics_every: int,
         metrics: LoopMetrics | None) -> tuple[list, int]:
    """One tick of an engine loop after its adds and aborts ``done`` (requests as dicts, aborts as engine ids):
    a step if a request is unfinished or was aborted (the step reports it), and the reads of the module
    docstring, handed to ``metrics`` if given; the outputs and the steps since the engine was last idle. Every
    process of a run calls it alike."""
    if not engine.has_unfinished() and not any(isinstance(item, int) for item in done):
        if steps:
            read_engine(engine, metrics, counters=True)
        return [], 0
    outputs = engine.step()
    steps += 1
    counters = steps % metrics_every == 0
    if counters or done:
        read_engine(engine, metrics, counters=counters)
    return outputs, steps


def read_engine(engine: Engine, metrics: LoopMetrics | None, *, counters: bool) -> None:
    """Read the engine's usage and, with ``counters``, its tier counters (collectives on several processes,
    so every process reads them alike); hand them to ``metrics`` if given."""
    usage = engine.usage()
    offload = engine.offload_metrics() if counters else None
    if metrics is not None:
        metrics.usage(usage)
        if offload is not None:
            metrics.offload(offload)


def ready(engine: Engine, metrics: LoopMetrics | None) -> None:
    """What every process does before it serves: compile ahead (``Engine.warm_up``), then a first read."""
    engine.warm_up()
    read_engine(engine, metrics, counters=True)


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


def follow(engine: Engine, *, metrics_every: int = 16) -> None:
    """A process other than 0 of a served run: the engine takes process 0's adds and aborts and steps with it,
    its outputs unread, until process 0's loop stops."""
    ticks, steps = Ticks(), 0
    ready(engine, None)
    while True:
        done, stop = ticks.receive()
        for item in done:
            if isinstance(item, dict):
                engine.add_request(RequestSpec.from_dict(item))
            else:
                engine.abort(item)
        if stop:
            return
        _, steps = tick(engine, done, steps, metrics_every, None)

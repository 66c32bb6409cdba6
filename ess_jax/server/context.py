"""What the handlers share: ``ServeContext`` (the engine loop and the served model's name and limits) and
the checks every generating request passes before it is queued (``admit``)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import AsyncIterator

from ess_jax.engine.loop import EngineLoop
from ess_jax.engine.request import RequestSpec
from ess_jax.server.protocol import APIError, RequestBody
from ess_jax.server.stream import Disconnected, Piece, stream_request
from ess_jax.tokenizer import ChatTemplate


@dataclasses.dataclass(frozen=True)
class ServeContext:
    """The handlers' view of a server: its engine loop (the engine itself only for its model, its limits and
    ``check_request``), the model name clients send, the chat template (None: chat is refused), and how many
    requests may wait for a batch row."""

    loop: EngineLoop
    model_name: str
    chat_template: ChatTemplate | None = None
    max_waiting: int = 64

    @property
    def engine(self):
        return self.loop.engine

    @property
    def tokenizer(self):
        return self.engine.model.tokenizer

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint``: the engine configuration the replies come from."""
        config = self.engine.config
        return f"ess_jax-{config.offload}-b{config.max_batch}-p{config.page_size}-s{self.engine.max_seq_len}"

    def head(self, prefix: str, kind: str) -> dict:
        """The fields every reply (and every chunk of a stream) of one request starts with."""
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": self.fingerprint}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def stream(self, spec: RequestSpec, stops: list[str], disconnected: Disconnected) -> AsyncIterator[Piece]:
        """One choice's pieces, its text cut at the first of ``stops`` (the request is queued when the stream is
        first read)."""
        return stream_request(self.loop, spec, stops, disconnected)


def admit(ctx: ServeContext, body: RequestBody, specs: list[RequestSpec]) -> None:
    """Refuse at once, before queueing any, what could never run (400 naming the field) and what would wait
    beyond ``max_waiting`` (503 with ``Retry-After``)."""
    body.refuse_unsupported()
    ctx.check_model(body.model)
    body.stops()
    for spec in specs:
        length = len(spec.prompt_ids)
        if length > ctx.engine.max_seq_len:  # at once: the ids' own checks are linear in them, on the event loop
            raise APIError(400, f"the prompt's {length} tokens exceed the {ctx.engine.max_seq_len} tokens a "
                                "request may have (the server's --max-seq-len); shorten it", param="prompt")
        try:
            ctx.engine.check_request(spec)
        except ValueError as e:
            raise APIError(400, str(e)) from None
    if ctx.loop.waiting_with(len(specs)) > ctx.max_waiting:
        raise APIError(503, f"{ctx.loop.waiting} requests are waiting for a batch row and --max-waiting is "
                            f"{ctx.max_waiting}; retry later", kind="server_overloaded", headers={"Retry-After": "1"})

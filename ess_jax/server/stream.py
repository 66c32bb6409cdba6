"""One request's outputs as the HTTP replies use them: text pieces after ``stop`` strings.

``stop`` strings are matched on the decoded text: a streamed reply holds back the last
``len(longest stop) - 1`` characters until they cannot start a stop string, and the reply ends before
the stop string, which is not returned. A request whose consumer stops early, or whose client goes
away, is aborted, which frees its pages, batch row and pool slots at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Awaitable, Callable

from ess_jax.engine.loop import EngineDied, EngineLoop
from ess_jax.engine.request import RequestSpec
from ess_jax.server.protocol import APIError

Disconnected = Callable[[], Awaitable[bool]]  # whether the client went away (Starlette's request.is_disconnected)


@dataclasses.dataclass
class Piece:
    """What a request produced since the last piece, after stop strings."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None = None
    prompt_logprobs: list | None = None  # the first piece's, when the request scores its prompt


@dataclasses.dataclass
class StopStrings:
    """The text of a growing reply cut at the first of ``stops``: ``push`` takes each text delta and gives
    what may be sent now."""

    stops: list[str]
    text: str = ""
    sent: int = 0  # characters of ``text`` given out

    def push(self, delta: str, final: bool) -> tuple[str, bool]:
        """The text to send after ``delta`` (``final``: the reply's last), and whether a stop string ended it."""
        self.text += delta
        starts = (self.text.find(s, max(self.sent - len(s) + 1, 0)) for s in self.stops)
        cut = min((i for i in starts if i >= 0), default=-1)
        if cut >= 0:
            piece, self.sent = self.text[self.sent:cut], cut
            return piece, True
        hold = max((len(s) for s in self.stops), default=1) - 1
        end = len(self.text) if final else max(len(self.text) - hold, self.sent)
        piece, self.sent = self.text[self.sent:end], end
        return piece, False


async def stream_request(loop: EngineLoop, spec: RequestSpec, stops: list[str], disconnected: Disconnected
                         ) -> AsyncIterator[Piece]:
    """The pieces of one request, its text cut at the first of ``stops``; it is aborted if the consumer stops
    early or the client goes away."""
    try:
        request_id, queue = loop.add(spec)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    cut, done = StopStrings(stops), False
    try:
        while not done:
            try:
                out = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await disconnected():
                    return
                continue
            if isinstance(out, EngineDied):
                raise out
            done = out.finished
            text, stopped = cut.push(out.text_delta, out.finished)
            yield Piece(text, out.new_token_ids, out.logprobs, "stop" if stopped else out.finish_reason,
                        out.prompt_logprobs)
            if stopped:
                return
    finally:
        if not done:
            loop.abort(request_id)


async def collect(stream: AsyncIterator[Piece]) -> Piece:
    """A whole stream as one piece."""
    text, ids, lps, reason, prompt = [], [], [], None, None
    async for piece in stream:
        text.append(piece.text)
        ids += piece.token_ids
        lps += piece.logprobs or []
        reason = piece.finish_reason or reason
        prompt = prompt or piece.prompt_logprobs
    return Piece("".join(text), ids, lps, reason, prompt)


async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
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

"""``POST /v1/chat/completions``: the messages rendered with the checkpoint's chat template, one choice, as one
JSON reply or as server-sent events (generation only)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from ess_jax.server.completions import token_logprobs
from ess_jax.server.context import ServeContext, admit
from ess_jax.server.protocol import DONE, APIError, ChatBody, Message, sse, usage
from ess_jax.server.stream import Disconnected, Piece, collect


def render_chat(ctx: ServeContext, messages: list[Message], add_generation_prompt: bool = True) -> str:
    """The messages through the server's chat template; 400 if it has none or refuses them."""
    if ctx.chat_template is None:
        raise APIError(400, f"model {ctx.model_name!r} has no chat template (tokenizer_config.json 'chat_template'); "
                            "start the server with --chat-template FILE, or use /v1/completions", param="messages")
    try:
        return ctx.chat_template.render([m.plain() for m in messages], add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def chat_logprobs(tokenizer, lps: list, top: int | None) -> dict | None:
    """The chat ``logprobs`` object (None unless asked for): each token with its bytes and its ``top`` best."""
    if top is None:
        return None
    content = []
    for lp in lps:
        token, value, best = token_logprobs(tokenizer, lp, top)
        content.append({"token": token, "logprob": value, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in best.items()]})
    return {"content": content}


async def chat(ctx: ServeContext, body: ChatBody, disconnected: Disconnected) -> dict | AsyncIterator[str]:
    """The reply to ``body``: a JSON object, or (``stream``) the server-sent events. ``max_tokens`` defaults to
    the rest of the context. Raises APIError before anything is queued if the request cannot run."""
    ids = await asyncio.to_thread(lambda: ctx.tokenizer.encode(render_chat(ctx, body.messages),
                                                               add_special_tokens=False))
    max_tokens = body.max_completion_tokens or body.max_tokens or max(ctx.engine.max_seq_len - len(ids), 1)
    top = (body.top_logprobs or 0) if body.logprobs else None
    spec = body.spec(ids, max_tokens, top)
    admit(ctx, body, [spec])
    stream = ctx.stream(spec, body.stops(), disconnected)
    if body.stream:
        return events(ctx, body, ctx.head("chatcmpl", "chat.completion.chunk"), len(ids), top, stream)
    piece = await collect(stream)
    return dict(ctx.head("chatcmpl", "chat.completion"),
                choices=[{"index": 0, "message": {"role": "assistant", "content": piece.text},
                          "logprobs": chat_logprobs(ctx.tokenizer, piece.logprobs, top),
                          "finish_reason": piece.finish_reason}],
                usage=usage(len(ids), len(piece.token_ids)))


async def events(ctx: ServeContext, body: ChatBody, head: dict, prompt_tokens: int, top: int | None,
                 stream: AsyncIterator[Piece]) -> AsyncIterator[str]:
    """A first chunk with the role, then one chunk per piece; the usage as the completions' ``events``."""
    def chunk(delta: dict, logprobs: dict | None, finish_reason: str | None, tokens: int) -> str:
        out = dict(head, choices=[{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])
        if body.include_usage:
            out["usage"] = usage(prompt_tokens, tokens) if body.continuous_usage else None
        return sse(out)

    yield chunk({"role": "assistant", "content": ""}, None, None, 0)
    tokens = 0
    async with contextlib.aclosing(stream):  # closing the events aborts the request at once
        async for piece in stream:
            tokens += len(piece.token_ids)
            yield chunk({"content": piece.text}, chat_logprobs(ctx.tokenizer, piece.logprobs or [], top),
                        piece.finish_reason, tokens)
    if body.include_usage:
        yield sse(dict(head, choices=[], usage=usage(prompt_tokens, tokens)))
    yield DONE

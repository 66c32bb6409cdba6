"""``POST /v1/completions``: one choice per prompt (a string, a list of ids, a list of strings or a list of
id lists; ``index`` in that order), as one JSON reply or as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from ess_jax.server.context import ServeContext, admit
from ess_jax.server.protocol import DONE, APIError, CompletionBody, sse, usage
from ess_jax.server.stream import Disconnected, Piece, collect, merged


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids (a string through the tokenizer); 400 if it is empty or cannot be encoded."""
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


def token_logprobs(tokenizer, lp, top: int) -> tuple[str, float, dict[str, float]]:
    """A ``TokenLogprob`` as text: the token, its log-probability and the ``top`` best by their text."""
    return (tokenizer.token_text(lp.token_id), lp.logprob, {tokenizer.token_text(t): v for t, v in lp.top[:top]})


def logprob_block(tokenizer, lps: list, top: int | None, offset: int) -> dict | None:
    """The legacy ``logprobs`` object of a choice (None unless asked for); ``text_offset`` from ``offset``."""
    if top is None:
        return None
    rows = [token_logprobs(tokenizer, lp, top) for lp in lps]
    offsets, at = [], offset
    for token, _, _ in rows:
        offsets.append(at)
        at += len(token)
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": offsets}


def choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


async def completions(ctx: ServeContext, body: CompletionBody, disconnected: Disconnected
                      ) -> dict | AsyncIterator[str]:
    """The reply to ``body``: a JSON object, or (``stream``) the server-sent events, each choice's prompt in
    front of its text with ``echo``. Raises APIError before anything is queued if a prompt cannot run."""
    prompts = [encode_prompt(ctx.tokenizer, p) for p in body.prompts()]
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt log-probabilities)", param="echo")
    admit(ctx, body, prompts, [body.max_tokens] * len(prompts))
    head = ctx.head("cmpl", "text_completion")
    streams = [ctx.stream(body, ids, body.max_tokens, body.logprobs, disconnected) for ids in prompts]
    echoes = [ctx.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    if body.stream:
        return events(ctx, body, head, prompts, streams, echoes)
    pieces = await asyncio.gather(*(collect(s) for s in streams))
    choices = [choice(i, echo + p.text, logprob_block(ctx.tokenizer, p.logprobs, body.logprobs, len(echo)),
                      p.finish_reason) for i, (echo, p) in enumerate(zip(echoes, pieces))]
    return dict(head, choices=choices,
                usage=usage(sum(map(len, prompts)), sum(len(p.token_ids) for p in pieces)))


async def events(ctx: ServeContext, body: CompletionBody, head: dict, prompts: list[list[int]],
                 streams: list[AsyncIterator[Piece]], echoes: list[str]) -> AsyncIterator[str]:
    """The choices' pieces as they come, one chunk each (its echo in front of its first); with
    ``stream_options.include_usage`` a last chunk of ``"choices": []`` with the usage, and with
    ``continuous_usage_stats`` each chunk's choice's usage so far."""
    tokens, started = [0] * len(streams), [False] * len(streams)
    async with contextlib.aclosing(merged(streams)) as pieces:  # closing the events aborts the requests at once
        async for index, piece in pieces:
            tokens[index] += len(piece.token_ids)
            text = ("" if started[index] else echoes[index]) + piece.text
            started[index] = True
            lps = logprob_block(ctx.tokenizer, piece.logprobs or [], body.logprobs, 0)
            chunk = dict(head, choices=[choice(index, text, lps, piece.finish_reason)])
            if body.include_usage:
                chunk["usage"] = usage(len(prompts[index]), tokens[index]) if body.continuous_usage else None
            yield sse(chunk)
    if body.include_usage:
        yield sse(dict(head, choices=[], usage=usage(sum(map(len, prompts)), sum(tokens))))
    yield DONE

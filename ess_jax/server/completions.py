"""``POST /v1/completions``: one choice per prompt (a string, a list of ids, a list of strings or a list of
id lists; ``index`` in that order), as one JSON reply or as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from ess_jax.server.context import ServeContext, admit
from ess_jax.server.protocol import DONE, APIError, CompletionBody, sse, usage
from ess_jax.server.stream import Disconnected, Piece, collect, merged


def encode_prompt(tokenizer, prompt: str | list[int], limit: int | None = None) -> list[int]:
    """A prompt's token ids (a string through the tokenizer); 400 if it is empty, cannot be encoded or is more than
    ``limit`` tokens."""
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt, limit=limit)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
    else:
        ids = list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def token_logprobs(tokenizer, lp, top: int) -> tuple[str, float, dict[str, float]]:
    """A ``TokenLogprob`` as text: the token, its log-probability and the ``top`` best by their text (of tokens
    with one text, the most likely: the best stays the maximum, which lm-evaluation-harness's greedy check reads)."""
    best: dict[str, float] = {}
    for t, v in lp.top[:top]:
        best.setdefault(tokenizer.token_text(t), v)
    return tokenizer.token_text(lp.token_id), lp.logprob, best


def prompt_rows(tokenizer, prompt_ids: list[int], scores: list, top: int) -> list[tuple]:
    """The echoed prompt's logprobs rows: its first token with ``None`` (nothing precedes it), the rest scored."""
    return [(tokenizer.token_text(prompt_ids[0]), None, None)] + [token_logprobs(tokenizer, lp, top)
                                                                  for lp in scores[1:]]


def logprob_block(rows: list[tuple], offset: int) -> tuple[dict, int]:
    """The legacy ``logprobs`` object of ``rows`` (token text, log-probability, top) with ``text_offset`` counted
    from ``offset`` by the tokens' texts (as vLLM), and the offset after them."""
    offsets = []
    for token, _, _ in rows:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [r[2] for r in rows], "text_offset": offsets}, offset


def vllm_prompt_logprobs(tokenizer, scores: list, top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first ``None``) the token and its ``top`` best by id, each
    with its log-probability, rank and text."""
    def entry(token: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token)}

    out: list[dict | None] = [None]
    for lp in scores[1:]:
        row = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        row.update({str(t): entry(t, v, r) for r, (t, v) in enumerate(lp.top[:top], start=1) if t != lp.token_id})
        out.append(row)
    return out


def choice(ctx: ServeContext, body: CompletionBody, index: int, prompt_ids: list[int], echo: str,
                  piece: Piece, offset: int) -> tuple[dict, int]:
    """A choice (or a stream's chunk of one) of ``piece``: its echo in front, the prompt's rows leading its
    ``logprobs`` when it carries the prompt's scores and echoes, vLLM's ``prompt_logprobs`` when asked; and the
    ``text_offset`` after it."""
    logprobs = None
    if body.logprobs is not None:
        rows = []
        if body.echo and piece.prompt_logprobs is not None:
            rows = prompt_rows(ctx.tokenizer, prompt_ids, piece.prompt_logprobs, body.logprobs)
        rows += [token_logprobs(ctx.tokenizer, lp, body.logprobs) for lp in piece.logprobs or []]
        logprobs, offset = logprob_block(rows, offset)
    out = {"index": index, "text": echo + piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}
    if body.prompt_logprobs is not None and piece.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokenizer, piece.prompt_logprobs, body.prompt_logprobs)
    return out, offset


async def completions(ctx: ServeContext, body: CompletionBody, disconnected: Disconnected
                      ) -> dict | AsyncIterator[str]:
    """The reply to ``body``: a JSON object, or (``stream``) the server-sent events, each choice's prompt in
    front of its text with ``echo`` (and its tokens leading the logprobs). Raises APIError before anything is
    queued if a prompt cannot run."""
    prompts = await asyncio.to_thread(lambda: [encode_prompt(ctx.tokenizer, p, ctx.engine.max_seq_len)
                                               for p in body.prompts()])
    top = body.prompt_top()
    specs = [body.spec(ids, body.max_tokens, body.logprobs, top) for ids in prompts]
    admit(ctx, body, specs)
    head = ctx.head("cmpl", "text_completion")
    streams = [ctx.stream(spec, body.stops(), disconnected) for spec in specs]
    echoes = await asyncio.to_thread(lambda: [ctx.tokenizer.decode(ids) if body.echo else "" for ids in prompts])
    if body.stream:
        return events(ctx, body, head, prompts, streams, echoes)
    pieces = await asyncio.gather(*(collect(s) for s in streams))
    choices = [choice(ctx, body, i, ids, echo, p, 0)[0]
               for i, (ids, echo, p) in enumerate(zip(prompts, echoes, pieces))]
    return dict(head, choices=choices,
                usage=usage(sum(map(len, prompts)), sum(len(p.token_ids) for p in pieces)))


async def events(ctx: ServeContext, body: CompletionBody, head: dict, prompts: list[list[int]],
                 streams: list[AsyncIterator[Piece]], echoes: list[str]) -> AsyncIterator[str]:
    """The choices' pieces as they come, one chunk each (its echo and the prompt's scores in its first); with
    ``stream_options.include_usage`` a last chunk of ``"choices": []`` with the usage, and with
    ``continuous_usage_stats`` each chunk's choice's usage so far."""
    tokens, started, offsets = [0] * len(streams), [False] * len(streams), [0] * len(streams)
    async with contextlib.aclosing(merged(streams)) as pieces:  # closing the events aborts the requests at once
        async for index, piece in pieces:
            tokens[index] += len(piece.token_ids)
            echo = "" if started[index] else echoes[index]
            started[index] = True
            out, offsets[index] = choice(ctx, body, index, prompts[index], echo, piece, offsets[index])
            chunk = dict(head, choices=[out])
            if body.include_usage:
                chunk["usage"] = usage(len(prompts[index]), tokens[index]) if body.continuous_usage else None
            yield sse(chunk)
    if body.include_usage:
        yield sse(dict(head, choices=[], usage=usage(sum(map(len, prompts)), sum(tokens))))
    yield DONE

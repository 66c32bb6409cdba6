"""vLLM's tokenizer endpoints: ``POST /tokenize`` (a text, or chat messages through the chat template),
``POST /detokenize`` and ``GET /tokenizer_info``, with vLLM's request and reply schemas."""

from __future__ import annotations

from typing import Any

from ess_jax.server.chat import render_chat
from ess_jax.server.context import ServeContext
from ess_jax.server.protocol import APIError, DetokenizeBody, TokenizeChatBody, TokenizeCompletionBody, parse


def tokenize(ctx: ServeContext, data: Any) -> dict:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` of a ``prompt`` or of ``messages`` (whichever
    the body has); ``token_strs`` (each token's text) only with ``return_token_strs``."""
    chat = isinstance(data, dict) and "messages" in data
    body = parse(TokenizeChatBody if chat else TokenizeCompletionBody, data)
    ctx.check_model(body.model)
    if chat:
        if body.continue_final_message:
            raise APIError(400, "continue_final_message is not supported: the chat template renders whole "
                                "messages; leave it false", param="continue_final_message")
        text = render_chat(ctx, body.messages, body.add_generation_prompt)
    else:
        text = body.prompt
    try:
        ids = ctx.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    strs = [ctx.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.engine.max_seq_len, "tokens": ids, "token_strs": strs}


def detokenize(ctx: ServeContext, data: Any) -> dict:
    """``{"prompt"}``: the text of ``tokens`` (special tokens dropped, as the replies' text)."""
    body = parse(DetokenizeBody, data)
    ctx.check_model(body.model)
    vocab = ctx.engine.model.cfg.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}


def tokenizer_info(ctx: ServeContext) -> dict:
    """The tokenizer's configuration, as vLLM's ``tokenizer_config.json``-like reply: ``tokenizer_class``,
    the special tokens' text and ids, the context length, and the chat template if there is one."""
    tokenizer, cfg = ctx.tokenizer, ctx.engine.model.cfg
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": ctx.engine.max_seq_len,
                            "vocab_size": cfg.vocab_size}
    for name, token_id in (("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id[0] if cfg.eos_token_id else None),
                           ("pad", cfg.pad_token_id)):
        if token_id is not None:
            info[f"{name}_token"], info[f"{name}_token_id"] = tokenizer.token_text(token_id), token_id
    if ctx.chat_template is not None:
        info["chat_template"] = ctx.chat_template.source
    return info

"""Request bodies, errors and reply pieces of the OpenAI-compatible API (OpenAI's field names; ``top_k``,
``stop_token_ids``, ``ignore_eos``, ``continuous_usage_stats`` and the tokenizer endpoints as vLLM's)."""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ess_jax.engine.request import RequestSpec
from ess_jax.sampling import SamplingParams

MAX_LOGPROBS = 20
MAX_STOPS, MAX_STOP_CHARS = 64, 512  # stop strings a request may send, and the characters of each
TokenId = Annotated[int, Field(ge=0)]


class APIError(Exception):
    """An error reply: HTTP ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(errors: list[dict]) -> APIError:
    """The 400 for a body pydantic refused: the first problem, named by its field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "malformed request body")
    return APIError(400, message, param=where or None)


def parse(model: type[BaseModel], data: Any) -> BaseModel:
    """``data`` as a ``model`` body, or the 400 naming the first problem."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise invalid(e.errors()) from None


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage and ``"choices": []``; ``continuous_usage_stats`` (with
    ``include_usage``, as vLLM): every chunk carries its choice's usage so far."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class RequestBody(BaseModel):
    """Fields both generating endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] = 0  # 0 or -1: every token
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None  # vLLM's: requests of other
    # salts never share cached prompt pages (a client's prefixes hidden from the others')

    def spec(self, prompt_ids: list[int], max_tokens: int, logprobs: int | None,
             prompt_logprobs: int | None = None) -> RequestSpec:
        """One choice's request to the engine (each its own random seed when the body sends none);
        ``prompt_logprobs``: the top-N per prompt token the engine reports (None: the prompt is not scored)."""
        seed = self.seed if self.seed is not None else secrets.randbelow(2**32)
        sampling = SamplingParams(self.temperature, max(self.top_k, 0), self.top_p, seed)
        return RequestSpec(prompt_ids, max_tokens, sampling, self.stop_token_ids, ignore_eos=self.ignore_eos,
                           logprobs=logprobs, prompt_logprobs=prompt_logprobs, cache_salt=self.cache_salt)

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each are "
                                f"allowed; got {len(stops)}, the longest {max(map(len, stops))}", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def refuse_unsupported(self):
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: ess_jax returns one choice per prompt; send n "
                                "requests (with different seeds) instead", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; leave it at 0", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


class CompletionBody(RequestBody):
    """``echo`` with ``logprobs``: the prompt's tokens lead the logprobs (the first with ``null``); ``max_tokens``
    0 (with ``echo`` or ``prompt_logprobs``): the prompt is scored and nothing generated; ``prompt_logprobs``
    (vLLM's): each prompt token's log-probability, rank and top N in the choice's ``prompt_logprobs``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0)] = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def prompt_top(self) -> int | None:
        """The engine's ``prompt_logprobs``: the most top entries a prompt token shows (``echo`` with ``logprobs``,
        ``prompt_logprobs``), 0 for an echo of no new tokens; None: the prompt is not scored. 400 for
        ``max_tokens`` 0 with neither ``echo`` nor ``prompt_logprobs`` (a reply of nothing)."""
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise APIError(400, "max_tokens=0 generates nothing: send echo: true (the prompt back, with its logprobs "
                                "if asked) or prompt_logprobs, or max_tokens >= 1", param="max_tokens")
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(asked) if asked else 0 if self.max_tokens == 0 else None

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice: a string, a list of ids, a list of strings or a list of id lists."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            return list(self.prompt)
        return [self.prompt]


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


class ChatBody(RequestBody):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TokenizeCompletionBody(BaseModel):
    """vLLM's ``/tokenize`` body for a text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(BaseModel):
    """vLLM's ``/tokenize`` body for chat messages, rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"

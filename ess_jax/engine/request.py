"""A request's parameters and progress (``Request``), its stop rules (``Request.accept``), the checks a new
request passes, and what a step reports for it (``RequestOutput``, ``TokenLogprob``). Host-only."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from ess_jax.sampling import SamplingParams
from ess_jax.tokenizer import IncrementalDetokenizer

MAX_PROMPT_LOGPROBS = 20  # the top-N a prefill piece keeps per prompt token (``steps.PromptScores``)


@dataclasses.dataclass
class Request:
    """One request's parameters and what it has produced so far."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]  # tokens that end it ("stop"): the config's eos ids unless ignored, and stop_token_ids
    detokenizer: IncrementalDetokenizer
    logprobs: int | None = None  # top-N log-probabilities to report per output token (0: the chosen one only)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # f32[V] per output token, if kept
    finish_reason: str | None = None  # "stop" (a stop id), "length" (max_new_tokens) or "abort"
    prefilled: int = 0  # prompt tokens in the cache (chunked prefill progress)
    forced_ids: tuple[int, ...] | None = None  # teacher forcing: the output tokens, taken instead of the sampled ones
    prompt_logprobs: int | None = None  # top-N log-probabilities to report per prompt token (0: the token only)
    prompt_scores: list[TokenLogprob | None] = dataclasses.field(default_factory=list)  # per prompt token so far
    reported: bool = False  # an output of it was made (the first carries the prompt's scores)
    cache_salt: str | None = None  # the prefix cache shares its pages only with requests of the same salt

    def accept(self, sampled: int) -> tuple[int, str | None]:
        """Append the next output token (``sampled``, or a forced request's next forced id); the token taken and
        the finish reason it causes: "stop" (a stop id), "length" (``max_new_tokens`` reached) or None."""
        token = sampled if self.forced_ids is None else self.forced_ids[len(self.output_ids)]
        self.output_ids.append(token)
        if token in self.stop_ids:
            return token, "stop"
        if len(self.output_ids) >= self.max_new_tokens:
            return token, "length"
        return token, None

    @property
    def wants_logits(self) -> bool:
        return self.logprobs is not None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (raw logits, before sampling filters) and the
    ``top`` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int  # 1 + the number of tokens more likely than it


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one ``Engine.step`` produced for one request."""

    request_id: int
    new_token_ids: list[int]  # tokens generated this step (the prefill's first token and a decode token at most)
    text_delta: str  # new text; never splits a UTF-8 character; the deltas concatenate to the full decode
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the request's first output, when it asked for them
    # and its prompt was all prefilled: one per prompt token, the first None (nothing precedes it)


def make_output(request_id: int, request: Request, tokens: list[tuple[int, np.ndarray | None]]) -> RequestOutput:
    """The step's output for a request that produced ``tokens`` (token, its f32[V] logits or None) this step."""
    ids = [t for t, _ in tokens]
    finished = request.finish_reason is not None
    delta = request.detokenizer.push(ids, final=finished)
    logprobs = None
    if request.logprobs is not None:
        logprobs = [token_logprob(t, logits, request.logprobs) for t, logits in tokens]
    prompt = None
    if request.prompt_logprobs is not None and not request.reported and len(request.prompt_scores) == len(
            request.prompt_ids):
        prompt = request.prompt_scores
    request.reported = True
    return RequestOutput(request_id, ids, delta, finished, request.finish_reason, logprobs, prompt)


def token_logprob(token: int, logits_V: np.ndarray, top: int) -> TokenLogprob:
    """Log-softmax of the raw logits (float64 on the host): the token's value and the ``top`` largest."""
    logits = logits_V.astype(np.float64)
    shifted = logits - logits.max()
    logprobs_V = shifted - np.log(np.exp(shifted).sum())
    best = np.argsort(-logprobs_V, kind="stable")[:top] if top else ()
    return TokenLogprob(token, float(logprobs_V[token]), tuple((int(i), float(logprobs_V[i])) for i in best),
                        int((logprobs_V > logprobs_V[token]).sum()) + 1)


def prompt_token_logprobs(targets: Sequence[int], logprob_T: np.ndarray, rank_T: np.ndarray, top_ids_TK: np.ndarray,
                          top_TK: np.ndarray, top: int) -> list[TokenLogprob]:
    """The ``TokenLogprob`` of each of ``targets`` from a prefill piece's scores (``steps.PromptScores`` on the
    host, one row per target): its log-probability, rank and the ``top`` best."""
    return [TokenLogprob(int(t), float(logprob_T[i]),
                         tuple((int(j), float(v)) for j, v in zip(top_ids_TK[i, :top], top_TK[i, :top])),
                         int(rank_T[i])) for i, t in enumerate(targets)]


def check_sampling(sampling: SamplingParams) -> None:
    """What ``SamplingParams`` leaves to the engine: finite values, integers that fit the int32 / uint32
    arrays the sampler reads; ValueError naming the parameter."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number")
    for name, value, high in (("top_k", sampling.top_k, 2**31), ("seed", sampling.seed, 2**32)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < high:
            raise ValueError(f"{name}={value!r} must be an integer in [0, {high})")


def _is_int(t) -> bool:
    return not isinstance(t, bool) and isinstance(t, (int, np.integer))


def check_ids(vocab: int, max_new_tokens, prompt_ids, stop_token_ids=(), *, logprobs=None, forced_ids=None,
              prompt_logprobs=None) -> None:
    """ValueError naming the problem unless the request's ids and counts are well formed for a vocabulary
    of ``vocab``: integers inside it, ``logprobs`` in [0, vocab], ``prompt_logprobs`` in [0, MAX_PROMPT_LOGPROBS],
    ``max_new_tokens`` >= 1 (0 only with ``prompt_logprobs``: a prefill that scores the prompt), forced ids that
    are exactly ``max_new_tokens`` of them and come without stop ids. (Lengths against the pool: the scheduler.)"""
    if prompt_logprobs is not None and (not _is_int(prompt_logprobs)
                                        or not 0 <= prompt_logprobs <= min(MAX_PROMPT_LOGPROBS, vocab)):
        raise ValueError(f"prompt_logprobs={prompt_logprobs!r} must be an integer in "
                         f"[0, {min(MAX_PROMPT_LOGPROBS, vocab)}] (the top-N the prefill keeps per token)")
    low = 0 if prompt_logprobs is not None else 1
    if not _is_int(max_new_tokens) or max_new_tokens < low:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1 (0 only with prompt_logprobs: "
                         "a prefill that scores the prompt and generates nothing)")
    for name, ids in (("prompt token id", prompt_ids), ("stop token id", stop_token_ids),
                      ("forced token id", forced_ids or ())):
        if isinstance(ids, (str, bytes)):
            raise ValueError(f"{name}s must be a sequence of integers, got {type(ids).__name__}")
        ids = list(ids)
        wrong = [t for t in ids if not _is_int(t)]
        if wrong:
            raise ValueError(f"{name} {wrong[0]!r} is not an integer")
        bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"{name} {bad[0]} is outside the vocabulary [0, {vocab})")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= vocab):
        raise ValueError(f"logprobs={logprobs!r} must be an integer in [0, {vocab}] (the vocabulary size)")
    if forced_ids is not None:
        if len(forced_ids) != max_new_tokens:
            raise ValueError(f"{len(forced_ids)} forced ids for max_new_tokens={max_new_tokens}; "
                             "a forced request outputs exactly its forced ids")
        if len(stop_token_ids):
            raise ValueError("stop_token_ids with forced_ids: a forced request outputs all its forced ids")


def make_request(tokenizer, eos_ids: Sequence[int], prompt_ids, max_new_tokens: int, sampling: SamplingParams,
                 stop_token_ids=(), *, ignore_eos: bool = False, logprobs: int | None = None,
                 forced_ids=None, prompt_logprobs: int | None = None, cache_salt: str | None = None) -> Request:
    """A checked request's ``Request``: its stop ids (``eos_ids`` unless ``ignore_eos``, and ``stop_token_ids``;
    none for a forced request, which reports logprobs, 0 by default); with ``prompt_logprobs`` its prompt's
    scores start with None (its first token has nothing before it)."""
    check_sampling(sampling)
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
    forced = None if forced_ids is None else tuple(int(t) for t in forced_ids)
    stop = frozenset(() if ignore_eos else eos_ids) | frozenset(map(int, stop_token_ids))
    if forced is not None:
        stop, logprobs = frozenset(), 0 if logprobs is None else logprobs
    return Request([int(t) for t in prompt_ids], max_new_tokens, sampling, stop, IncrementalDetokenizer(tokenizer),
                   logprobs, forced_ids=forced, prompt_logprobs=prompt_logprobs,
                   prompt_scores=[None] if prompt_logprobs is not None else [], cache_salt=cache_salt)

"""What a caller asks of the engine (``RequestSpec``: its parameters and the checks a new request passes), a
request's progress (``Request``), its stop rules (``Request.accept``), and what a step reports for it
(``RequestOutput``, ``TokenLogprob``). Host-only."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ess_jax.sampling import SamplingParams
from ess_jax.tokenizer import IncrementalDetokenizer

MAX_PROMPT_LOGPROBS = 20  # the top-N a prefill piece keeps per prompt token (``steps.PromptScores``)


def _is_int(t) -> bool:
    return not isinstance(t, bool) and isinstance(t, (int, np.integer))


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request as a caller asks it of the engine (vLLM's ``EngineCoreRequest``): what ``Engine.add_request``
    takes and, as ``to_dict``, what ``Ticks`` send to the other processes.

    Stops at one of the config's eos ids (unless ``ignore_eos``), one of ``stop_token_ids``, or after
    ``max_new_tokens``. ``logprobs=N`` reports each output token's log-probability and the top N.
    ``forced_ids`` (teacher forcing, to score a text): the request outputs exactly these tokens, one per step
    (the prefill's, then each decode step's), each fed to the next step in place of the sampled one, and reports
    each one's log-probability under the step's logits (``logprobs`` defaults to 0 then); ``max_new_tokens``
    must equal their number, and no eos or stop id ends it early. ``prompt_logprobs=N`` (at most
    ``MAX_PROMPT_LOGPROBS``): the log-probability of every prompt token after the first and the top N, computed
    in the prefill pieces (each piece's logits reduced on the device), in the request's first output
    (``RequestOutput.prompt_logprobs``); with it ``max_new_tokens`` may be 0, a request that ends after its
    prefill. ``cache_salt`` (vLLM's): the prefix cache shares its prompt's pages only with requests of the same
    salt. The id sequences are kept as tuples (their integers as ``int``; a str or bytes as itself, for
    ``check`` to refuse)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    forced_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None

    def __post_init__(self):
        for name in ("prompt_ids", "stop_token_ids", "forced_ids"):
            ids = getattr(self, name)
            if ids is not None and not isinstance(ids, (str, bytes)):
                object.__setattr__(self, name, tuple(int(t) if _is_int(t) else t for t in ids))

    def check(self, vocab: int) -> None:
        """ValueError naming the problem unless the request is well formed for a vocabulary of ``vocab``: ids
        that are integers inside it, ``logprobs`` in [0, vocab], ``prompt_logprobs`` in [0,
        MAX_PROMPT_LOGPROBS], ``max_new_tokens`` >= 1 (0 only with ``prompt_logprobs``: a prefill that scores the
        prompt), forced ids that are exactly ``max_new_tokens`` of them and come without stop ids, a
        ``SamplingParams`` that passes ``SamplingParams.check``, a non-empty ``cache_salt``. (Lengths against the
        pool: the scheduler.)"""
        top = min(MAX_PROMPT_LOGPROBS, vocab)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= top):
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs!r} must be an integer in [0, {top}] (the top-N "
                             "the prefill keeps per token)")
        low = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < low:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1 (0 only with "
                             "prompt_logprobs: a prefill that scores the prompt and generates nothing)")
        for name, ids in (("prompt token id", self.prompt_ids), ("stop token id", self.stop_token_ids),
                          ("forced token id", self.forced_ids or ())):
            if isinstance(ids, (str, bytes)):
                raise ValueError(f"{name}s must be a sequence of integers, got {type(ids).__name__}")
            wrong = [t for t in ids if not _is_int(t)]
            if wrong:
                raise ValueError(f"{name} {wrong[0]!r} is not an integer")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} {bad[0]} is outside the vocabulary [0, {vocab})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= vocab):
            raise ValueError(f"logprobs={self.logprobs!r} must be an integer in [0, {vocab}] (the vocabulary size)")
        if self.forced_ids is not None:
            if len(self.forced_ids) != self.max_new_tokens:
                raise ValueError(f"{len(self.forced_ids)} forced ids for max_new_tokens={self.max_new_tokens}; "
                                 "a forced request outputs exactly its forced ids")
            if self.stop_token_ids:
                raise ValueError("stop_token_ids with forced_ids: a forced request outputs all its forced ids")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        self.sampling.check()
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")

    def to_dict(self) -> dict:
        """The spec as ``json.dumps`` takes it (``sampling`` as its fields); ``from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> RequestSpec:
        """The spec of a ``to_dict`` (also after a JSON round trip: its tuples as lists)."""
        return cls(**{**fields, "sampling": SamplingParams(**fields["sampling"])})


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

    @classmethod
    def from_spec(cls, spec: RequestSpec, tokenizer, eos_ids: Sequence[int]) -> Request:
        """A checked spec's ``Request``: its stop ids (``eos_ids`` unless ``ignore_eos``, and ``stop_token_ids``;
        none for a forced request, which reports logprobs, 0 by default); with ``prompt_logprobs`` its prompt's
        scores start with None (its first token has nothing before it)."""
        stop, logprobs = frozenset(() if spec.ignore_eos else eos_ids) | frozenset(spec.stop_token_ids), spec.logprobs
        if spec.forced_ids is not None:
            stop, logprobs = frozenset(), 0 if logprobs is None else logprobs
        return cls(list(spec.prompt_ids), spec.max_new_tokens, spec.sampling, stop, IncrementalDetokenizer(tokenizer),
                   logprobs, forced_ids=spec.forced_ids, prompt_logprobs=spec.prompt_logprobs,
                   prompt_scores=[None] if spec.prompt_logprobs is not None else [], cache_salt=spec.cache_salt)

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

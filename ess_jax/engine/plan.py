"""What the engine's parts hand each other, as plain data (no jax): the scheduler's plans (``PrefillSlice`` in a
``PrefillGroup``, ``DecodeBatch``), what the device returned (``PrefillResult``, ``DecodeResult``), what an ended
request frees (``Released``), the engine's counters (``EngineStats``, ``StepTimes``, taken by ``StepTimer``), and the
prefill-piece rule: a prompt is cut into pieces of ``prefill_chunk`` tokens, the remainder into powers of
``prefill_piece_ratio``, largest first (``piece_size``); a piece never depends on other prompts."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import numpy as np

from ess_jax.sampling import SamplingParams


@dataclasses.dataclass
class StepTimes:
    """One ``Engine.step``'s seconds (``EngineStats.steps``)."""

    prefill_s: list[float] = dataclasses.field(default_factory=list)  # each prefill call, its handoff included
    decode_s: float | None = None  # the decode step with its bookkeeping (None: no request was decoding)
    decode_dispatch_s: float | None = None  # the compiled decode step's call until it returned (the host's part)
    verify_s: float | None = None  # with MTP drafting: the decode step until its verified tokens were on the host
    draft_s: float | None = None  # then until the MTP module's drafts were (launched behind the verification)
    decode_rows: int = 0  # requests decoded
    decode_tokens: int = 0  # tokens they produced (more than one per request with speculative decoding)


@dataclasses.dataclass
class EngineStats:
    """The engine's counters. ``reserved_pages``: what the unfinished requests reserve now;
    ``peak_reserved_pages``: the most at once; ``steps``: per-step times when the engine records them."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float | None = None
    prompt_rows_to_host: int = 0
    reserved_pages: int = 0
    peak_reserved_pages: int = 0
    steps: list[StepTimes] | None = None


class StepTimer:
    """One ``Engine.step``'s timing, as a context around the step: each prefill call's seconds into
    ``EngineStats.prefill_s``, and with recorded steps (``EngineStats.steps``) the step's ``StepTimes`` (``times``),
    appended when the step ends."""

    def __init__(self, stats: EngineStats):
        self.stats = stats
        self.times = StepTimes() if stats.steps is not None else None

    def __enter__(self) -> StepTimer:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None and self.times is not None:
            self.stats.steps.append(self.times)

    @contextlib.contextmanager
    def prefill(self):
        """A prefill call (its handoff included)."""
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.stats.prefill_s += seconds
        if self.times is not None:
            self.times.prefill_s.append(seconds)

    @contextlib.contextmanager
    def decode(self, batch: DecodeBatch):
        """The decode step of ``batch`` with its bookkeeping: its seconds, rows and tokens."""
        start, tokens = time.perf_counter(), self.stats.decode_tokens
        yield
        if self.times is not None:
            self.times.decode_s, self.times.decode_rows = time.perf_counter() - start, int(batch.active_B.sum())
            self.times.decode_tokens = self.stats.decode_tokens - tokens


@dataclasses.dataclass(frozen=True)
class PrefixWork:
    """The prefix cache's part of a prefill piece (``ess_jax.engine.prefix``; nothing to do by default)."""

    resume: Any = None  # the row state at the piece's start (a snapshot per cache the piece writes), loaded before the
    # first piece past a cached prefix of a family with row state; None: nothing to load
    snapshot: bool = False  # take the row state after this piece
    loaded: int = 0  # the prompt's tokens after ``PrefillSlice.cached`` read from the disk store into its own pages
    disk: tuple = ()  # the first piece past them: those pages' arrays (``PrefixDisk.pages``), written before it
    save: tuple[int, ...] = ()  # the last piece: the prompt pages (indices in the request's pages) to read back after
    # it for the disk store


@dataclasses.dataclass(frozen=True)
class PrefillSlice:
    """The next piece of one request's prompt."""

    request_id: int
    row: int  # the request's batch row
    start: int  # prompt position of the piece's first token
    tokens: tuple[int, ...]
    pages_X: np.ndarray  # i32[pages_per_row] the request's page table (null page past its pages)
    prompt_len: int
    last: bool  # the prompt is all in the cache after this piece
    sampling: SamplingParams
    wants_logits: bool  # its first output token's logits are read back (logprobs or kept logits)
    targets: tuple[int, ...]  # the prompt token after each of its positions (the last piece: one fewer)
    prompt_logprobs: int | None  # the top-N of each target's log-probability to report (None: not scored)
    cached: int = 0  # the prompt's first tokens read from the prefix cache (its first pages, shared); the first
    # piece starts there (or past the pages read from the disk store)
    prefix: PrefixWork = PrefixWork()

    @property
    def first(self) -> bool:
        """The request's first piece: it starts where the cache left off."""
        return self.start == self.cached + self.prefix.loaded


@dataclasses.dataclass(frozen=True)
class PrefillGroup:
    """Pieces of one size, one per data shard at most: one device call."""

    size: int
    slices: dict[int, PrefillSlice]  # data shard -> its piece

    @property
    def scored(self) -> bool:
        """Some piece's prompt log-probabilities are read back."""
        return any(piece.prompt_logprobs is not None for piece in self.slices.values())


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    sampled_D: np.ndarray  # i32[D] the token sampled after each shard's piece
    logits: dict[int, np.ndarray]  # data shard -> f32[V], for the finishing slices that want them
    scores: dict[int, tuple[np.ndarray, ...]]  # data shard -> its piece's ``steps.PromptScores`` fields on the host
    # (logprob_T, rank_T, top_ids_TK, top_TK), for the scored pieces
    drafts: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # data shard -> i32[K] the MTP module's
    # drafts after a prompt its piece finished (speculative decoding)
    states: dict[int, tuple[Any, int] | None] = dataclasses.field(default_factory=dict)  # data shard -> the row
    # state after its piece and its bytes (``PrefixWork.snapshot``; None: not taken)
    saved: dict[int, list | None] = dataclasses.field(default_factory=dict)  # data shard -> the arrays of the pages
    # its piece asked for (``PrefixWork.save``), in that order (None: none asked)


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step of every batch row (inactive rows masked)."""

    request_ids: tuple[int | None, ...]  # per batch row: the request decoding there
    tokens_B: np.ndarray  # i32[B] the token each row feeds
    drafts_BK: np.ndarray  # i32[B, K] the tokens drafted after it, verified in the step (K = 0 without speculation)
    forced_B: np.ndarray  # bool[B] rows that accept every draft (teacher forcing: their drafts are the forced ids)
    lengths_B: np.ndarray  # i32[B] tokens in the cache per row
    page_table_BX: np.ndarray  # i32[B, pages_per_row]
    sampling: tuple[SamplingParams, ...]  # per row (defaults for inactive rows)
    steps_B: np.ndarray  # i32[B] tokens each row's request has generated
    wants_logits: bool  # some row's logits are read back

    @property
    def active_B(self) -> np.ndarray:
        return np.array([r is not None for r in self.request_ids])

    @classmethod
    def idle(cls, rows: int, pages_per_row: int, drafts: int = 0) -> DecodeBatch:
        """A batch with no active row (the shapes the decode step compiles for)."""
        zeros = np.zeros(rows, np.int32)
        return cls((None,) * rows, zeros, np.zeros((rows, drafts), np.int32), np.zeros(rows, bool), zeros,
                   np.zeros((rows, pages_per_row), np.int32), (SamplingParams(),) * rows, zeros, False)


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    tokens_BT: np.ndarray  # i32[B, 1 + K] each row's tokens: its output is the first accepted_B + 1 of them
    accepted_B: np.ndarray  # i32[B] drafts each row accepted (0 without speculation)
    logits_BTV: np.ndarray | None  # f32[B, 1 + K, V] each position's logits when the batch wants logits
    drafts_BK: np.ndarray | None = None  # i32[B, K] the MTP module's drafts for each row's next step


@dataclasses.dataclass(frozen=True)
class Released:
    """What an ended request held: its batch row, for the offload mode to empty."""

    row: int


def piece_sizes(chunk: int, ratio: int) -> tuple[int, ...]:
    """Every prefill piece size: the powers of ``ratio`` below ``chunk``, and ``chunk``. Each is a compiled prefill
    step (minutes each for a full model on a TPU), for at most ``ratio - 1`` pieces of each size in a prompt's tail
    (exact pieces: no padding); the default ratio of four halves their number against powers of two."""
    sizes = [1]
    while sizes[-1] < chunk:
        sizes.append(min(sizes[-1] * ratio, chunk))
    return tuple(sizes)


def piece_size(remaining: int, chunk: int, ratio: int) -> int:
    """The next piece of a prompt with ``remaining`` tokens left: the largest size that fits."""
    return max(s for s in piece_sizes(chunk, ratio) if s <= remaining)


def prefill_pieces(length: int, chunk: int, ratio: int) -> list[int]:
    """The pieces a prompt of ``length`` tokens is prefilled in, in order."""
    pieces = []
    while (done := sum(pieces)) < length:
        pieces.append(piece_size(length - done, chunk, ratio))
    return pieces

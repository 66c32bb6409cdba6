"""Speculative decoding's proposers, chosen once when the engine is built (``proposer_for``; vLLM's
``create_proposer``). Each answers the same calls, so the scheduler and the runner never ask which they have:

- ``NoDrafts``: one token per request and step;
- ``CallerDrafts``: a caller's ``drafter(request)`` on the host, its K drafts checked before they reach the model;
- ``MtpDrafts``: the checkpoint's multi-token-prediction module, with its own cache (resident, the request's pages
  and batch row), drafting in each prefill piece that ends a prompt and after each decode step.

The scheduler asks a proposer for each decode step's drafts (``propose``: teacher-forced requests' forced ids are
their drafts, all accepted), how far a request's steps may write past its last token (``reserve``) and what the
prefix cache's page keys must name past a page (``lookahead``), and hands it what came back (``prefilled``,
``decoded``). The runner asks it for its device part (``place``, ``prefill_args``, ``prefill_done``, ``compile``,
``draft``, ``targets``): nothing but with ``MtpDrafts``. ``SpecStats`` are its counters (vLLM's ``spec_decode``)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ess_jax import families, mesh
from ess_jax.cache import StepMeta
from ess_jax.engine import steps
from ess_jax.engine.config import EngineConfig
from ess_jax.engine.plan import DecodeBatch, DecodeResult, PrefillGroup, PrefillSlice, StepTimes
from ess_jax.engine.request import Request

Drafter = Callable[[Request], Sequence[int]]  # a request -> the K tokens it drafts after its last one


@dataclasses.dataclass
class SpecStats:
    """Speculative decoding's counters: drafts verified, drafts accepted, and per draft position how often it was
    accepted (vLLM's ``spec_decode`` counters)."""

    num_drafts: int = 0  # verification steps of one request (each verifies K drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [K]

    def record(self, drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def report(self) -> dict:
        """The ``--json`` ``metrics.speculative`` object: acceptance rate per draft position, mean accepted length
        (tokens per verification step: the accepted drafts and the token after them), drafts and accepted."""
        n = self.num_drafts
        return {"acceptance_rate": [a / n if n else 0.0 for a in self.accepted_per_position],
                "mean_accepted_length": 1 + self.accepted_tokens / n if n else 0.0,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "num_drafts": n, "accepted_per_position": list(self.accepted_per_position)}


class OnHost:
    """The device part of a proposer that drafts on the host (or not at all): nothing."""

    def abstract(self, size: families.CacheSize) -> list:
        return []

    def place(self, build: Callable, size: families.CacheSize) -> None:
        pass

    def prefill_args(self, positions, valid, pages_DX, rows_D, last_D) -> dict:
        return {}

    def prefill_done(self, mtp_cache, drafts_DK, group: PrefillGroup) -> dict[int, np.ndarray]:
        return {}

    def compile(self, graph: steps.Graph, params, decode, meta) -> None:
        pass

    def draft(self, params, hidden, tokens_BT, meta, kept_B) -> None:
        return None

    def targets(self, piece: PrefillSlice) -> list:
        return []

    def resumed(self, caches: list) -> None:
        pass


class NoDrafts(OnHost):
    """No speculative decoding: each decode step feeds one token per request."""

    drafts = reserve = lookahead = 0

    def __init__(self, rows: int):
        self.rows = rows

    def propose(self, requests: Sequence[Request | None]) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((self.rows, 0), np.int32), np.zeros(self.rows, bool)

    def prefilled(self, row: int, drafts_K: np.ndarray | None) -> None:
        pass

    def decoded(self, batch: DecodeBatch, result: DecodeResult) -> None:
        pass

    def metrics(self, steps: list[StepTimes] | None) -> None:
        return None

    def usage(self, steps: list[StepTimes] | None) -> dict:
        return {}


class CallerDrafts(OnHost):
    """Each decode step verifies ``k`` drafts per request: a caller's drafter's (``drafter(request)``, checked: K
    token ids of the vocabulary), a teacher-forced request's forced ids."""

    lookahead = 0

    def __init__(self, rows: int, k: int, vocab: int, drafter: Drafter | None = None):
        self.rows, self.drafts, self.vocab, self.drafter = rows, k, vocab, drafter
        # positions past its last token a request's steps may write: a verification step's K drafts, then the MTP
        # module's chain of K - 1 more (undone, but written)
        self.reserve = 2 * k
        self.stats = SpecStats(accepted_per_position=[0] * k)

    def propose(self, requests: Sequence[Request | None]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's drafts ``i32[B, K]`` and the rows that accept every one ``bool[B]`` (teacher forcing)."""
        drafts_BK, forced_B = self._start(), np.zeros(self.rows, bool)
        for row, request in enumerate(requests):
            if request is None:
                continue
            if request.forced_ids is not None:  # the forced tokens are the drafts, all accepted
                forced = request.forced_ids[len(request.output_ids):][:self.drafts]
                drafts_BK[row], forced_B[row] = 0, True
                drafts_BK[row, :len(forced)] = forced
            elif self.drafter is not None:
                drafts_BK[row] = self._checked(request)
        return drafts_BK, forced_B

    def _start(self) -> np.ndarray:
        """The drafts before the caller's: none."""
        return np.zeros((self.rows, self.drafts), np.int32)

    def _checked(self, request: Request) -> np.ndarray:
        ids = np.asarray(self.drafter(request))
        if (ids.shape != (self.drafts,) or not np.issubdtype(ids.dtype, np.integer)
                or not ((0 <= ids) & (ids < self.vocab)).all()):
            raise ValueError(f"the drafter must give {self.drafts} token ids in [0, {self.vocab}), got "
                             f"{ids.tolist()!r}")
        return ids

    def prefilled(self, row: int, drafts_K: np.ndarray | None) -> None:
        pass

    def decoded(self, batch: DecodeBatch, result: DecodeResult) -> None:
        """Count each active row's accepted drafts (teacher-forced rows aside)."""
        for row, request_id in enumerate(batch.request_ids):
            if request_id is not None and not batch.forced_B[row]:
                self.stats.record(self.drafts, int(result.accepted_B[row]))

    def metrics(self, steps: list[StepTimes] | None) -> dict:
        """The ``--json`` ``metrics.speculative`` object (``SpecStats.report``); with recorded ``steps`` (an engine's
        ``record_steps``) also the median seconds per decode step of verifying (``verify_s``: the main model's pass
        over each row's token and drafts) and of the MTP module's drafting (``draft_s``)."""
        timed = [s for s in steps or () if s.draft_s is not None]
        return self.stats.report() | ({"verify_s": statistics.median(s.verify_s for s in timed),
                                       "draft_s": statistics.median(s.draft_s for s in timed)} if timed else {})

    def usage(self, steps: list[StepTimes] | None) -> dict:
        """What ``Engine.usage`` adds: the counters so far (``speculative``)."""
        return {"speculative": self.metrics(steps)}


class MtpDrafts(CallerDrafts):
    """The MTP module drafts: its drafts after each prompt's last piece and each decode step are the next step's.
    Its cache holds a row at a position made of the token after it, so a cached page's key names the token past the
    page too (``lookahead``). It holds its cache on the devices (``place``) and runs its part of the runner's steps:
    within each prefill piece (``prefill_args``), after each decode step (``draft``)."""

    lookahead = 1

    def __init__(self, rows: int, k: int, vocab: int, cache: Callable[[families.CacheSize], object]):
        super().__init__(rows, k, vocab)
        self.empty = cache  # the MTP module's empty cache of a size
        self.cache = self.shardings = self._compiled = None
        self._drafted = np.zeros((rows, k), np.int32)  # each row's drafts for its next step

    def _start(self) -> np.ndarray:
        return self._drafted.copy()

    def prefilled(self, row: int, drafts_K: np.ndarray | None) -> None:
        """A prompt ended in batch row ``row``: the drafts after it."""
        self._drafted[row] = drafts_K

    def decoded(self, batch: DecodeBatch, result: DecodeResult) -> None:
        super().decoded(batch, result)
        self._drafted[:] = result.drafts_BK

    # ---- the runner's part ---------------------------------------------------------------------
    def abstract(self, size: families.CacheSize) -> list:
        """Its cache of ``size``'s shapes (``jax.eval_shape``), as a list of the caches it adds."""
        return [jax.eval_shape(lambda: self.empty(size))]

    def place(self, build: Callable, size: families.CacheSize) -> None:
        """Its cache of ``size``, built and placed by the runner's ``build``."""
        self.cache, self.shardings = build(self.empty, size)

    def prefill_args(self, positions, valid, pages_DX, rows_D, last_D) -> dict:
        """``steps.prefill``'s MTP arguments: its cache at the request's own pages and batch row."""
        meta = StepMeta(*(jnp.asarray(x) for x in (positions, valid, pages_DX, rows_D)))
        return dict(mtp_cache=self.cache, mtp_meta=meta, last_B=jnp.asarray(last_D), mtp_shardings=self.shardings,
                    drafts=self.drafts)

    def prefill_done(self, mtp_cache, drafts_DK, group: PrefillGroup) -> dict[int, np.ndarray]:
        """Its cache after a prefill call; the drafts after each prompt the call ended, by data shard."""
        self.cache, drafts = mtp_cache, mesh.host_array(drafts_DK)
        return {shard: drafts[shard] for shard, piece in group.slices.items() if piece.last}

    def compile(self, graph: steps.Graph, params, decode, meta) -> None:
        """Its drafting step, compiled ahead for the compiled ``decode``'s outputs and the decode ``meta``."""
        tokens_BT, _, _, _, hidden, kept_B = decode.out_info  # placed as the decode returns them
        self._compiled = steps.draft.lower(graph, params, hidden, tokens_BT, meta, kept_B, self.cache,
                                           mtp_shardings=self.shardings).compile()

    def draft(self, params, hidden, tokens_BT, meta, kept_B):
        """The next drafts after a decode step (launched behind its verification, which the device runs first), on
        the devices."""
        drafts_BK, self.cache = self._compiled(params, hidden, tokens_BT, meta, kept_B, self.cache)
        return drafts_BK

    def targets(self, piece: PrefillSlice) -> list:
        """Its cache as a prefix cache's ``prefix.Target`` of a piece: the request's own batch row and pages."""
        return [(self.cache, self.shardings, piece.row, piece.pages_X)]

    def resumed(self, caches: list) -> None:
        """Its cache after the prefix cache's ``before`` (``targets``' order)."""
        (self.cache,) = caches


def has_mtp(model) -> bool:
    """The model carries a multi-token-prediction module (the checkpoint's MTP layer)."""
    return getattr(model.module, "mtp", None) is not None


def proposer_for(model, config: EngineConfig, drafter: Drafter | None, entry_dtype) -> NoDrafts | CallerDrafts:
    """The engine's proposer: none without ``config.speculative``, the caller's ``drafter``, else the MTP module
    (its cache in ``entry_dtype`` rows). ValueError naming the fix when speculative decoding cannot run: a drafter
    without speculation, drafts from an MTP module the checkpoint does not have, more tokens per step than a row's
    rings hold apart."""
    k, rows, vocab = config.num_speculative_tokens, config.max_batch, model.cfg.vocab_size
    if drafter is not None and not k:
        raise ValueError("a drafter needs speculative decoding: --speculative mtp --num-speculative-tokens K")
    if not k:
        return NoDrafts(rows)
    if drafter is None and not has_mtp(model):
        raise ValueError("--speculative mtp: this checkpoint has no MTP layer (num_nextn_predict_layers = 0) to "
                         "draft with; use a checkpoint with one, or serve without --speculative")
    family = families.get(model.cfg.family)
    if config.offload == "ess" and config.ring_placement == "host" and family.ring_layers(model.cfg):
        raise ValueError("--speculative with --rings host: the host rings take one token per request and step; leave "
                         "--rings unset or use --rings device (the HCA compressor rings on the device)")
    limit = family.step_tokens_limit(model.cfg)
    if limit is not None and 1 + k > limit:
        raise ValueError(f"--num-speculative-tokens {k}: a step of 1 + {k} tokens per request exceeds the smallest "
                         f"ring of positions this model keeps per request ({limit}); use at most {limit - 1}")
    if drafter is not None:
        return CallerDrafts(rows, k, vocab, drafter)
    module = model.module
    return MtpDrafts(rows, k, vocab, lambda size: module.init_mtp_cache(size.rows, size.pages, size.page_size,
                                                                         entry_dtype, config.index_dtype))

"""The scheduler: requests, admission, the plan of each step and its bookkeeping. Host-only, data in and data
out: ``schedule_prefill`` / ``schedule_decode`` say what the device runs, ``update_prefill`` /
``update_decode`` take what it returned (sampled tokens, logits where asked) and apply the stop rules; a
request that ends comes back as a ``Released`` (its batch row and pages), for the offload mode to empty.

Batch rows are engine-wide (data shard ``d`` owns rows ``d*R .. (d+1)*R-1``); page ids are local to the
row's shard (``ess_jax.allocator``)."""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from ess_jax.allocator import Admission, Admitted, PageAllocator
from ess_jax.engine.config import EngineConfig
from ess_jax.engine.plan import (DecodeBatch, DecodeResult, EngineStats, PrefillGroup, PrefillResult, PrefillSlice,
                                 Released, piece_size)
from ess_jax.engine.request import Request, RequestOutput, make_output, prompt_token_logprobs
from ess_jax.sampling import SamplingParams

if TYPE_CHECKING:
    from ess_jax.engine.prefix import NoPrefixCache, PrefixCache
    from ess_jax.engine.speculate import CallerDrafts, NoDrafts


class Inbox:
    """The unfinished requests, added and aborted from any thread; the engine's thread takes what arrived."""

    def __init__(self, stats: EngineStats):
        self.stats = stats
        self._requests: dict[int, Request] = {}  # unfinished requests by id
        self._reserved: dict[int, int] = {}  # pages each unfinished request reserves
        self._next_id = 0
        self._added: deque[int] = deque()  # added requests not yet taken
        self._aborts: set[int] = set()  # aborts not yet taken
        self._lock = threading.Lock()

    def add(self, request: Request, pages: int) -> int:
        """Queue a request that reserves ``pages``; its id."""
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._requests[request_id] = request
            self._added.append(request_id)
            self._reserved[request_id] = pages
            self.stats.reserved_pages += pages
            self.stats.peak_reserved_pages = max(self.stats.peak_reserved_pages, self.stats.reserved_pages)
        return request_id

    def abort(self, request_id: int) -> None:
        """Queue an abort; KeyError for an id never added, nothing for one already finished."""
        with self._lock:
            if not 0 <= request_id < self._next_id:
                raise KeyError(f"request {request_id} was never added")
            if request_id in self._requests:
                self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)

    def unfinished(self) -> dict[int, Request]:
        """The unfinished requests by id (a copy)."""
        with self._lock:
            return dict(self._requests)

    def take(self) -> tuple[list[tuple[int, Request]], list[int]]:
        """What arrived since the last call: the added requests in order, the aborts of unfinished ones."""
        with self._lock:
            added = [(i, self._requests[i]) for i in self._added]
            aborts = sorted(i for i in self._aborts if i in self._requests)
            self._added, self._aborts = deque(), set()
        return added, aborts

    def remove(self, request_id: int) -> None:
        """A finished request: gone, its reservation with it."""
        with self._lock:
            del self._requests[request_id]
            self.stats.reserved_pages -= self._reserved.pop(request_id)


class Scheduler:
    def __init__(self, config: EngineConfig, *, shards: int, pages: int, pages_per_row: int, max_seq_len: int,
                 stats: EngineStats, prefix: PrefixCache | NoPrefixCache, proposer: NoDrafts | CallerDrafts):
        """``pages``: each data shard's pool, its null page included. ``prefix``: the prefix cache's scheduler half
        (``ess_jax.engine.prefix``): the keys a request may share, where its prefill starts and is cut, what its
        finished prompt leaves cached. ``proposer``: speculative decoding's (``ess_jax.engine.speculate``): each
        decode step's drafts per request, and the room a request reserves for them."""
        self.config, self.stats, self.pages_per_row = config, stats, pages_per_row
        self.prefix, self.proposer = prefix, proposer
        self.allocators = [PageAllocator(pages, config.page_size, prefix.states) for _ in range(shards)]
        self.admission = Admission(self.allocators, max_batch=config.max_batch, max_position_embeddings=max_seq_len,
                                   block=prefix.block // config.page_size)
        self.inbox = Inbox(stats)
        self._requests: dict[int, Request] = {}  # the requests taken from the inbox and not finished
        self._prefilling: deque[Admitted] = deque()  # admitted requests whose prompt is not all cached
        self._decoding: dict[int, int] = {}  # request id -> batch row, past their prefill
        self._lengths = np.zeros(config.max_batch, np.int32)  # tokens in the cache per batch row
        self._last = np.zeros(config.max_batch, np.int32)  # token each row feeds next
        self._new: dict[int, tuple[Request, list]] = {}  # this step's tokens: id -> (request, [(token, logits)])
        self._finished: dict[int, RequestOutput] = {}  # outputs of aborts carried out between steps

    def check(self, prompt_len: int, max_new_tokens: int) -> int:
        """The pages a request would reserve (ValueError naming the numbers if it can never run). Any thread."""
        return self.admission.check(None, prompt_len, max_new_tokens + self.proposer.reserve)

    # ---- the engine's thread -------------------------------------------------------------------
    def take_inbox(self) -> list[Released]:
        """Queue the added requests for admission and carry out the aborts."""
        added, aborts = self.inbox.take()
        for request_id, request in added:
            self._requests[request_id] = request
            self.admission.submit(request_id, len(request.prompt_ids), request.max_new_tokens + self.proposer.reserve,
                                  self.prefix.keys(request_id, request))
        released = []
        for request_id in aborts:
            request = self._requests[request_id]
            released += self.finish(request_id, "abort")
            self._finished[request_id] = make_output(request_id, request, [])
        return released

    def _admit(self) -> None:
        """Admit what fits; a request sharing cached pages starts its prefill past them (and past the pages the prefix
        cache reads for it from the disk store)."""
        for entry in self.admission.admit(self.config.max_batch):
            request = self._requests[entry.request_id]
            request.prefilled = entry.shared * self.config.page_size
            request.prefilled += self.prefix.admitted(self.admission, entry, request)
            self._prefilling.append(entry)

    def schedule_prefill(self) -> list[PrefillGroup]:
        """Admit what fits, then this step's prefill calls: each data shard prefills its prompts in admission
        order, one exact piece at a time (``plan.piece_size``) from its first position not cached, while its
        ``prefill_chunk`` tokens last; the shards' pieces of one size run as one call, largest first."""
        self._admit()
        chunk, ratio = self.config.prefill_chunk, self.config.prefill_piece_ratio
        table = self.admission.page_table(self.pages_per_row)  # the rows' pages, fixed until the next admission
        budget = [chunk] * len(self.allocators)
        planned = {e.request_id: self._requests[e.request_id].prefilled for e in self._prefilling}
        groups = []
        while True:
            heads: dict[int, tuple[Admitted, int]] = {}  # each shard's first unfinished prompt and its next piece
            for entry in self._prefilling:
                shard, length = self.admission.shard_of(entry.row), len(self._requests[entry.request_id].prompt_ids)
                if shard not in heads and (done := planned[entry.request_id]) < length:
                    end = next((at for at in self.prefix.points(entry.request_id) if at > done), length)
                    heads[shard] = (entry, piece_size(end - done, chunk, ratio))
            runs = {shard: head for shard, head in heads.items() if head[1] <= budget[shard]}
            if not runs:
                return groups
            for size in sorted({n for _, n in runs.values()}, reverse=True):
                slices = {}
                for shard, (entry, n) in runs.items():
                    if n == size:
                        budget[shard] -= size
                        slices[shard] = self._slice(entry, table[entry.row], planned[entry.request_id], size)
                        planned[entry.request_id] += size
                groups.append(PrefillGroup(size, slices))

    def _slice(self, entry: Admitted, pages_X: np.ndarray, start: int, size: int) -> PrefillSlice:
        request, end = self._requests[entry.request_id], start + size
        length = len(request.prompt_ids)
        return PrefillSlice(entry.request_id, entry.row, start, tuple(request.prompt_ids[start:end]), pages_X,
                            length, end == length, request.sampling, self._wants_logits(request),
                            tuple(request.prompt_ids[start + 1:end + 1]), request.prompt_logprobs,
                            entry.shared * self.config.page_size, self.prefix.work(entry, request, start, size))

    def update_prefill(self, group: PrefillGroup, result: PrefillResult) -> list[Released]:
        """Record a prefill call: its prompt log-probabilities; the prompts it finished join the decode with
        their first token, or end (those of no new tokens)."""
        released = []
        for shard, piece in group.slices.items():
            request = self._requests[piece.request_id]
            request.prefilled += group.size
            self.stats.prefill_tokens += group.size
            self.prefix.took(piece, group.size, result.states.get(shard))
            if piece.last:
                self.admission.settle(piece.request_id)  # (cache_pages settles it too)
                self.prefix.finished(self.admission, piece, result.saved.get(shard))
            if piece.prompt_logprobs is not None:
                request.prompt_scores += prompt_token_logprobs(piece.targets, *result.scores[shard],
                                                               piece.prompt_logprobs)
            if piece.last and request.max_new_tokens == 0:  # (finish drops it from the prefilling queue)
                self._new.setdefault(piece.request_id, (request, []))
                released += self.finish(piece.request_id, "length")
            elif piece.last:
                self._prefilling = deque(e for e in self._prefilling if e.request_id != piece.request_id)
                self._lengths[piece.row] = piece.prompt_len
                self._decoding[piece.request_id] = piece.row
                self.proposer.prefilled(piece.row, result.drafts.get(shard))
                released += self._accept(piece.request_id, piece.row, int(result.sampled_D[shard]),
                                         result.logits.get(shard))
        return released

    def schedule_decode(self) -> DecodeBatch | None:
        """One decode step of every request past its prefill; None when there is none."""
        if not self._decoding:
            return None
        ids: list[int | None] = [None] * self.config.max_batch
        for request_id, row in self._decoding.items():
            ids[row] = request_id
        requests = [self._requests[i] if i is not None else None for i in ids]
        drafts_BK, forced_B = self.proposer.propose(requests)
        return DecodeBatch(tuple(ids), self._last.copy(), drafts_BK, forced_B, self._lengths.copy(),
                           self.admission.page_table(self.pages_per_row),
                           tuple(r.sampling if r else SamplingParams() for r in requests),
                           np.array([len(r.output_ids) if r else 0 for r in requests], np.int32),
                           any(self._wants_logits(r) for r in requests if r))

    def update_decode(self, batch: DecodeBatch, result: DecodeResult) -> list[Released]:
        """Record a decode step: each active row's tokens (its accepted drafts and the token after them, up to
        the one that ends it), and the requests it ends."""
        released = []
        self.proposer.decoded(batch, result)
        for row, request_id in enumerate(batch.request_ids):
            if request_id is None:
                continue
            accepted = int(result.accepted_B[row])
            self._lengths[row] += accepted + 1
            for t in range(accepted + 1):
                self.stats.decode_tokens += 1
                logits = None if result.logits_BTV is None else result.logits_BTV[row, t]
                released += self._accept(request_id, row, int(result.tokens_BT[row, t]), logits)
                if request_id not in self._requests:  # it ended inside the accepted run: exactly there
                    break
        return released

    def _wants_logits(self, request: Request) -> bool:
        return self.config.keep_logits or request.wants_logits

    def _accept(self, request_id: int, row: int, sampled: int, logits_V: np.ndarray | None) -> list[Released]:
        request = self._requests[request_id]
        token, reason = request.accept(sampled)
        kept = None
        if self._wants_logits(request):
            kept = np.asarray(logits_V, np.float32)
            if self.config.keep_logits:
                request.logits.append(kept)
        self._new.setdefault(request_id, (request, []))[1].append((token, kept))
        self._last[row] = token
        return self.finish(request_id, reason) if reason else []

    def finish(self, request_id: int, reason: str) -> list[Released]:
        """End a request: its queue place, or its pages and batch row (returned, for the offload mode)."""
        request = self._requests[request_id]
        request.finish_reason = reason
        released = []
        if request_id in self.admission.waiting:
            self.admission.cancel(request_id)
        elif request_id in self.admission.running:
            row = self.admission.running[request_id].row
            released.append(Released(row))
            self.admission.finish(request_id)
            self._decoding.pop(request_id, None)
            self._prefilling = deque(e for e in self._prefilling if e.request_id != request_id)
            self._lengths[row] = 0
        del self._requests[request_id]
        self.prefix.release(request_id)
        self.inbox.remove(request_id)
        return released

    def outputs(self) -> list[RequestOutput]:
        """One output per request that produced tokens, finished or was aborted since the last call."""
        outputs, self._finished = self._finished, {}
        for request_id, (request, tokens) in self._new.items():
            outputs[request_id] = make_output(request_id, request, tokens)
        self._new = {}
        return list(outputs.values())

    def usage(self) -> dict:
        """Pages and batch rows the admitted requests hold, in all and per data shard; the pages the prefix cache
        keeps that no request holds (evictable, counted free), and with row state its snapshots and their bytes; the
        requests waiting."""
        rows = self.admission.rows_per_shard
        shards = [{"shard": d, "pages_in_use": a.num_held, "pages_total": a.capacity,
                   "prefix_cache_pages": a.num_cached,
                   "rows_in_use": rows - len(self.admission.free_rows(d)), "rows_total": rows,
                   **self.prefix.shard_usage(a)}
                  for d, a in enumerate(self.allocators)]
        out = {k: sum(s[k] for s in shards) for k in shards[0] if k != "shard"}
        out["per_shard"] = shards
        out["requests_waiting"] = len(self.admission.waiting)
        return out

"""The scheduler: requests, admission, the plan of each step and its bookkeeping. Host-only, data in and data
out: ``schedule_prefill`` / ``schedule_decode`` say what the device runs, ``update_prefill`` /
``update_decode`` take what it returned (sampled tokens, logits where asked) and apply the stop rules; a
request that ends comes back as a ``Released`` (its batch row and pages), for the offload mode to empty.

Batch rows are engine-wide (data shard ``d`` owns rows ``d*R .. (d+1)*R-1``); page ids are local to the
row's shard (``ess_jax.allocator``)."""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from ess_jax.allocator import Admission, Admitted, PageAllocator, page_keys
from ess_jax.engine.config import EngineConfig
from ess_jax.engine.plan import (DecodeBatch, DecodeResult, EngineStats, PrefillGroup, PrefillResult, PrefillSlice,
                                 Released, SpecStats, piece_size)
from ess_jax.engine.request import Request, RequestOutput, make_output, prompt_token_logprobs
from ess_jax.prefix_store import PrefixDisk
from ess_jax.sampling import SamplingParams


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


Drafter = Callable[[Request], Sequence[int]]  # a request -> the K tokens it drafts after its last one


class Scheduler:
    def __init__(self, config: EngineConfig, *, shards: int, pages: int, pages_per_row: int, max_seq_len: int,
                 stats: EngineStats, drafter: Drafter | None = None, prefix_salt: bytes | None = None,
                 prefix_tail: int = 1, prefix_block: int | None = None, row_state: bool = False,
                 disk: PrefixDisk | None = None):
        """``pages``: each data shard's pool, its null page included. With speculative decoding each decode step
        verifies ``config.num_speculative_tokens`` drafts per request: ``drafter``'s (a caller's, on the host),
        else those the last decode step drafted (the MTP module's); a request reserves room for them.
        ``prefix_salt``: the prefix cache is on, its page keys salted with it (``allocator.page_keys``: what else
        changes a page's bytes); None: off. ``prefix_tail``: a prompt's last tokens always prefilled (the offload
        mode's ``computed_tail``). ``prefix_block``: the tokens a shared prefix is a multiple of
        (``Family.prefix_block``; None: the page size). ``row_state``: the cache has state per batch row: each prompt
        takes a snapshot of it at its cacheable boundary (the last multiple of ``prefix_block`` before its last
        ``prefix_tail`` tokens) and where it leaves the longest run of cached pages (a branch point: a prompt that
        shares an earlier one's pages but not its snapshot pays their prefill once, the next ones share them); its
        pieces are cut there, the snapshots kept with the pages before them (at most ``config.prefix_cache_states``
        per data shard), and a request sharing them resumes from the deepest. ``disk``: the
        prefix cache's disk store (None: none): a prompt's cached pages (and snapshot) are written there when its
        prefill ends, and a request reads the pages past its cached prefix found there into its own pages."""
        self.config, self.stats, self.pages_per_row = config, stats, pages_per_row
        self.drafts, self.drafter = config.num_speculative_tokens, drafter
        # positions past its last token a request's steps may write: a verification step's K drafts, then the MTP
        # module's chain of K - 1 more (undone, but written)
        self.reserve = 2 * self.drafts
        if self.drafts:
            stats.speculative = SpecStats(accepted_per_position=[0] * self.drafts)
        self._drafted = np.zeros((config.max_batch, self.drafts), np.int32)  # each row's drafts for its next step
        self.prefix_salt, self.prefix_tail = prefix_salt, prefix_tail
        # the MTP module's cache (drafts without a caller's drafter) is in the request's pages, its row at a position
        # made of the token after it: a cached page's key names the token past the page too
        self.prefix_lookahead = 1 if self.drafts and drafter is None else 0
        self._keys: dict[int, list[bytes]] = {}  # with the prefix cache, the keys of each request's full prompt pages
        self.prefix_block, self.row_state = prefix_block or config.page_size, row_state and prefix_salt is not None
        self._resume: dict[int, Any] = {}  # request id -> the row state its prefill resumes from (a cached prefix's)
        self._points: dict[int, list[int]] = {}  # request id -> where its prefill takes its row state
        self._taken: dict[int, dict[int, tuple[Any, int]]] = {}  # request id -> the row states its prefill took
        # there (and their bytes), by position
        self.disk = disk if prefix_salt is not None else None
        self._loaded: dict[int, tuple[int, list]] = {}  # request id -> tokens read from the disk store and the arrays
        # of their pages, until its first piece
        states = config.prefix_cache_states if self.row_state else None
        self.allocators = [PageAllocator(pages, config.page_size, states) for _ in range(shards)]
        self.admission = Admission(self.allocators, max_batch=config.max_batch, max_position_embeddings=max_seq_len,
                                   block=self.prefix_block // config.page_size)
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
        return self.admission.check(None, prompt_len, max_new_tokens + self.reserve)

    # ---- the engine's thread -------------------------------------------------------------------
    def take_inbox(self) -> list[Released]:
        """Queue the added requests for admission and carry out the aborts."""
        added, aborts = self.inbox.take()
        for request_id, request in added:
            self._requests[request_id] = request
            self.admission.submit(request_id, len(request.prompt_ids), request.max_new_tokens + self.reserve,
                                  self._lookup_keys(request_id, request))
        released = []
        for request_id in aborts:
            request = self._requests[request_id]
            released += self.finish(request_id, "abort")
            self._finished[request_id] = make_output(request_id, request, [])
        return released

    def _lookup_keys(self, request_id: int, request: Request) -> list[bytes]:
        """With the prefix cache, keep the keys of the request's full prompt pages (those ``prefix_lookahead``
        prompt tokens follow); the keys of those it may share: the full pages before its last ``prefix_tail`` prompt
        tokens (always computed: the last one's logits give the first output token), none for a request that scores
        its prompt (each position's logits are computed)."""
        if self.prefix_salt is None:
            return []
        prompt, salt = request.prompt_ids, self.prefix_salt
        if request.cache_salt is not None:  # its pages named apart from every other salt's
            salt = hashlib.blake2b(salt + b"\0cache_salt\0" + request.cache_salt.encode(), digest_size=16).digest()
        self._keys[request_id] = page_keys(prompt, self.config.page_size, salt, self.prefix_lookahead)
        if request.prompt_logprobs is not None:
            return []
        return self._keys[request_id][:self.boundary(len(prompt)) // self.config.page_size]

    def boundary(self, prompt_len: int) -> int:
        """A prompt's cacheable boundary: the last multiple of the prefix block before its last ``prefix_tail``
        tokens (what a request sharing it may read from the cache)."""
        return max(prompt_len - self.prefix_tail, 0) // self.prefix_block * self.prefix_block

    def _admit(self) -> None:
        """Admit what fits; a request sharing cached pages starts its prefill past them."""
        for entry in self.admission.admit(self.config.max_batch):
            request = self._requests[entry.request_id]
            request.prefilled = entry.shared * self.config.page_size
            if self.row_state and entry.shared:
                self._resume[entry.request_id] = self.admission.shared_state(entry.request_id,
                                                                             self._keys[entry.request_id])
            if self.prefix_salt is not None and request.prompt_logprobs is None:
                shard = self.admission.shard_of(entry.row)
                queries, hits = self.stats.prefix_queries, self.stats.prefix_hits
                queries[shard] = queries.get(shard, 0) + len(request.prompt_ids)
                hits[shard] = hits.get(shard, 0) + request.prefilled
                if self.disk is not None:
                    loaded = self._read_disk(entry, request)
                    request.prefilled += loaded
                    disk_hits = self.stats.prefix_disk_hits
                    disk_hits[shard] = disk_hits.get(shard, 0) + loaded
            if self.row_state:
                self._points[entry.request_id] = self._snapshot_points(entry, request)
            self._prefilling.append(entry)

    def _snapshot_points(self, entry: Admitted, request: Request) -> list[int]:
        """Where a prompt's prefill takes its row state: its boundary, and its branch points (``Admitted.points``:
        where it leaves its shard's cached run, and where a waiting prompt's pages part from its own), each past where
        its prefill starts."""
        ps, length = self.config.page_size, len(request.prompt_ids)
        return sorted({at for at in (*(n * ps for n in entry.points), self.boundary(length)) if at > request.prefilled})

    def _read_disk(self, entry: Admitted, request: Request) -> int:
        """The pages past a request's cached prefix that the disk store has, up to its boundary (with row state: up
        to the deepest one whose snapshot reads back, found before any page is read, the request resuming from it),
        read for its first piece; the tokens they hold."""
        ps = self.config.page_size
        keys = self._keys[entry.request_id][entry.shared:self.boundary(len(request.prompt_ids)) // ps]
        run, found = next((i for i, key in enumerate(keys) if not self.disk.has(key)), len(keys)), None
        if self.row_state:
            while run and (not self.disk.has(keys[run - 1], ".state")
                           or (found := self.disk.state(keys[run - 1])) is None):
                run -= 1
        pages = self.disk.pages(keys[:run])
        if self.row_state and len(pages) < run:  # a page before the snapshot did not read back: nothing to resume
            pages = []
        if pages and self.row_state:
            self._resume[entry.request_id] = found[0]
            if len(pages) == len(keys):  # resumed at its boundary: the snapshot kept there is this one
                self._taken[entry.request_id] = {(entry.shared + len(pages)) * ps: found}
        if pages:
            self._loaded[entry.request_id] = (len(pages) * ps, pages)
        return len(pages) * ps

    def schedule_prefill(self) -> list[PrefillGroup]:
        """Admit what fits, then this step's prefill calls: each data shard prefills its prompts in admission
        order, one exact piece at a time (``plan.piece_size``) from its first position not cached, while its
        ``prefill_chunk`` tokens last; the shards' pieces of one size run as one call, largest first."""
        self._admit()
        budget = [self.config.prefill_chunk] * len(self.allocators)
        planned = {e.request_id: self._requests[e.request_id].prefilled for e in self._prefilling}
        groups = []
        while True:
            heads: dict[int, tuple[Admitted, int]] = {}  # each shard's first unfinished prompt and its next piece
            for entry in self._prefilling:
                shard, length = self.admission.shard_of(entry.row), len(self._requests[entry.request_id].prompt_ids)
                if shard not in heads and (done := planned[entry.request_id]) < length:
                    end = next((at for at in self._points.get(entry.request_id, ()) if at > done), length)
                    heads[shard] = (entry, piece_size(end - done, self.config.prefill_chunk))
            runs = {shard: head for shard, head in heads.items() if head[1] <= budget[shard]}
            if not runs:
                return groups
            for size in sorted({n for _, n in runs.values()}, reverse=True):
                slices = {}
                for shard, (entry, n) in runs.items():
                    if n == size:
                        budget[shard] -= size
                        slices[shard] = self._slice(entry, planned[entry.request_id], size)
                        planned[entry.request_id] += size
                groups.append(PrefillGroup(size, slices))

    def _slice(self, entry: Admitted, start: int, size: int) -> PrefillSlice:
        request_id = entry.request_id
        request = self._requests[request_id]
        length, cached = len(request.prompt_ids), entry.shared * self.config.page_size
        loaded, disk = self._loaded.get(request_id, (0, []))
        first, last = start == cached + loaded, start + size == length
        if first:
            self._loaded.pop(request_id, None)
        save = ()
        if last and self.disk is not None:  # its cacheable pages the disk store does not have yet
            save = tuple(j for j, key in enumerate(self._cacheable(request_id, length)) if not self.disk.has(key))
        return PrefillSlice(request_id, entry.row, start, tuple(request.prompt_ids[start:start + size]),
                            self.page_table(entry.pages), length, last, request.sampling,
                            self._wants_logits(request), tuple(request.prompt_ids[start + 1:start + size + 1]),
                            request.prompt_logprobs, cached, self._resume.pop(request_id, None) if first else None,
                            start + size in self._points.get(request_id, ()), loaded, tuple(disk) if first else (),
                            save)

    def _cacheable(self, request_id: int, prompt_len: int) -> list[bytes]:
        """The keys of a prompt's pages cached when its prefill ends: its full pages (with row state, those before its
        boundary)."""
        keys = self._keys.get(request_id, [])
        return keys[:self.boundary(prompt_len) // self.config.page_size] if self.row_state else keys

    def update_prefill(self, group: PrefillGroup, result: PrefillResult) -> list[Released]:
        """Record a prefill call: its prompt log-probabilities; the prompts it finished join the decode with
        their first token, or end (those of no new tokens)."""
        released = []
        for shard, piece in group.slices.items():
            request = self._requests[piece.request_id]
            request.prefilled += group.size
            self.stats.prefill_tokens += group.size
            if shard in result.states:
                self._taken.setdefault(piece.request_id, {})[piece.start + group.size] = result.states[shard]
            if piece.last:
                self.admission.settle(piece.request_id)  # (cache_pages settles it too)
            if piece.last and (keys := self._cacheable(piece.request_id, piece.prompt_len)):
                # its prompt pages, for others to share: all written now (ESS: handed off to the host store); with
                # row state those before its boundary, with the snapshots taken there and at its branch point
                taken = self._taken.pop(piece.request_id, {})
                state = taken.pop(len(keys) * self.config.page_size, None)
                if state is not None or not self.row_state:
                    self.admission.cache_pages(piece.request_id, keys, state)
                    for at, branch in taken.items():
                        self.admission.keep_state(piece.request_id, keys[at // self.config.page_size - 1], branch)
                if self.disk is not None:
                    self.disk.save_pages([keys[j] for j in piece.save], result.saved.get(shard, []))
                    snapshots = {**taken, len(keys) * self.config.page_size: state} if state is not None else taken
                    for at, (snapshot, _) in snapshots.items():
                        if not self.disk.has(key := keys[at // self.config.page_size - 1], ".state"):
                            self.disk.save_state(key, snapshot)
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
                self._drafted[piece.row] = result.drafts.get(shard, 0)
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
        drafts_BK, forced_B = self._drafted.copy(), np.zeros(self.config.max_batch, bool)
        for row, request in enumerate(requests):
            if request is not None and self.drafts:
                if request.forced_ids is not None:  # the forced tokens are the drafts, all accepted
                    forced = request.forced_ids[len(request.output_ids):][:self.drafts]
                    drafts_BK[row], forced_B[row] = 0, True
                    drafts_BK[row, :len(forced)] = forced
                elif self.drafter is not None:
                    drafts_BK[row] = self.drafter(request)
        return DecodeBatch(tuple(ids), self._last.copy(), drafts_BK, forced_B, self._lengths.copy(),
                           self.admission.page_table(self.pages_per_row),
                           tuple(r.sampling if r else SamplingParams() for r in requests),
                           np.array([len(r.output_ids) if r else 0 for r in requests], np.int32),
                           any(self._wants_logits(r) for r in requests if r))

    def update_decode(self, batch: DecodeBatch, result: DecodeResult) -> list[Released]:
        """Record a decode step: each active row's tokens (its accepted drafts and the token after them, up to
        the one that ends it), and the requests it ends."""
        released = []
        if result.drafts_BK is not None:
            self._drafted[:] = result.drafts_BK
        for row, request_id in enumerate(batch.request_ids):
            if request_id is None:
                continue
            accepted = int(result.accepted_B[row])
            if self.drafts and not batch.forced_B[row]:
                self.stats.speculative.record(self.drafts, accepted)
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
        for held in (self._keys, self._resume, self._taken, self._loaded, self._points):
            held.pop(request_id, None)
        self.inbox.remove(request_id)
        return released

    def page_table(self, pages: np.ndarray) -> np.ndarray:
        """A request's pages as a page-table row ``i32[pages_per_row]`` (the null page past them)."""
        pages_X = np.zeros(self.pages_per_row, np.int32)
        pages_X[: pages.size] = pages
        return pages_X

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
                   "rows_in_use": rows - len(self.admission.free_rows(d)), "rows_total": rows}
                  for d, a in enumerate(self.allocators)]
        keys = ("pages_in_use", "pages_total", "prefix_cache_pages", "rows_in_use", "rows_total")
        if self.row_state:  # the row-state snapshots kept with the cached pages, in host memory
            for shard, a in zip(shards, self.allocators):
                shard.update(prefix_cache_states=a.num_states, prefix_cache_state_bytes=a.state_bytes)
            keys += ("prefix_cache_states", "prefix_cache_state_bytes")
        out = {k: sum(s[k] for s in shards) for k in keys}
        out["per_shard"] = shards
        out["requests_waiting"] = len(self.admission.waiting)
        return out

"""The prefix cache, chosen once when the engine is built (``prefix_cache_for``), as two halves that answer the
same calls whether it is on or off (vLLM's ``KVCacheManager(enable_caching=...)`` and a KV connector's scheduler
and worker halves):

- ``PrefixCache`` (the scheduler's half, host only): each request's page keys, where its prefill starts (its shared
  pages, the pages read from the disk store, the row state it resumes from), where its prefill takes row-state
  snapshots, and, when its prompt is all prefilled, its pages and snapshots cached for later requests (and written
  to the disk store); its counters. ``NoPrefixCache`` answers with nothing.
- ``PrefixIO`` (the runner's half): before a piece, the pages read from the disk store written into the request's
  pages and its row resumed from a snapshot; after it, the snapshot taken and the pages the disk store lacks read
  back. ``NoPrefixIO`` leaves the caches alone.

Row states (DeepSeek-V4's window and compressor rings): a prefix is shared only up to a page whose key holds a
snapshot of the row state at its end (``allocator``). A prompt's prefill is cut, and snapshots, at its cacheable
boundary, at its branch points (``Admitted.points``: where it leaves its shard's cached run, where a waiting
prompt parts from it), and at the landmarks in the second half of its prefix: block boundaries at most two
significant bits apart (``landmark``: blocks 1, 2, 3, 4, 6, 8, 12, ...), two at most. So from the second prompt
on, one that shares three quarters of an earlier one's prefix or more (one system prompt, distinct messages)
resumes at least two thirds into the shared run, and a prompt keeps at most three snapshots beside its branch
points."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ess_jax import families
from ess_jax.allocator import Admission, Admitted, PageAllocator, page_keys
from ess_jax.engine import steps
from ess_jax.engine.config import EngineConfig
from ess_jax.engine.layout import entry_dtype
from ess_jax.engine.plan import PrefillSlice, PrefixWork
from ess_jax.engine.request import Request
from ess_jax.prefix_store import PrefixDisk, PrefixStore, weights_fingerprint


def landmark(blocks: int) -> bool:
    """A count of blocks with at most two significant bits (1, 2, 3, 4, 6, 8, 12, 16, ...): every run of blocks
    has one within a third of its end."""
    low = max(blocks.bit_length() - 2, 0)
    return blocks > 0 and blocks >> low << low == blocks


@dataclasses.dataclass
class PrefixStats:
    """Per data shard: prompt tokens of the requests admitted there that looked the prefix cache up, of them those
    found cached in memory and those read from the disk store."""

    queries: dict[int, int] = dataclasses.field(default_factory=dict)
    hits: dict[int, int] = dataclasses.field(default_factory=dict)
    disk_hits: dict[int, int] = dataclasses.field(default_factory=dict)

    def count(self, shard: int, queries: int, hits: int, disk_hits: int) -> None:
        for counts, n in ((self.queries, queries), (self.hits, hits), (self.disk_hits, disk_hits)):
            counts[shard] = counts.get(shard, 0) + n

    def reset(self) -> None:
        for counts in (self.queries, self.hits, self.disk_hits):
            counts.clear()


class PrefixCache:
    """The scheduler's half of the prefix cache (the module docstring)."""

    def __init__(self, config: EngineConfig, *, salt: bytes, tail: int, block: int, row_state: bool, lookahead: int,
                 disk: PrefixDisk | None, tier: str, shards: int):
        """``salt``: what a page's bytes depend on besides its tokens (``allocator.page_keys``); ``tail``: a
        prompt's last tokens always prefilled (the offload mode's ``computed_tail``); ``block``: the tokens a shared
        prefix is a multiple of (``Family.prefix_block``); ``row_state``: the cache has state per batch row;
        ``lookahead``: the tokens past a page its rows depend on (the MTP module's cache); ``disk``: the disk store
        (None: none); ``tier``: where a cached prefix is read from (the offload mode's ``prefix_tier``)."""
        self.page_size, self.salt, self.tail, self.block = config.page_size, salt, tail, block
        self.row_state, self.lookahead, self.disk, self.tier, self.shards = row_state, lookahead, disk, tier, shards
        self.states = config.prefix_cache_states if row_state else None  # snapshots a shard keeps (``allocator``)
        self.stats = PrefixStats()
        self._keys: dict[int, list[bytes]] = {}  # request id -> the keys of its full prompt pages
        self._resume: dict[int, Any] = {}  # request id -> the row state its prefill resumes from (a cached prefix's)
        self._points: dict[int, list[int]] = {}  # request id -> where its prefill is cut to take its row state
        self._taken: dict[int, dict[int, tuple[Any, int]]] = {}  # request id -> the row states its prefill took
        # there (and their bytes), by position
        self._loaded: dict[int, tuple[int, list]] = {}  # request id -> tokens read from the disk store and the arrays
        # of their pages, until its first piece

    def keys(self, request_id: int, request: Request) -> list[bytes]:
        """Keep the keys of the request's full prompt pages (those ``lookahead`` prompt tokens follow); the keys of
        those it may share: the full pages before its boundary, none for a request that scores its prompt (each
        position's logits are computed)."""
        salt = self.salt
        if request.cache_salt is not None:  # its pages named apart from every other salt's
            salt = hashlib.blake2b(salt + b"\0cache_salt\0" + request.cache_salt.encode(), digest_size=16).digest()
        self._keys[request_id] = page_keys(request.prompt_ids, self.page_size, salt, self.lookahead)
        if request.prompt_logprobs is not None:
            return []
        return self._keys[request_id][:self.boundary(len(request.prompt_ids)) // self.page_size]

    def boundary(self, prompt_len: int) -> int:
        """A prompt's cacheable boundary: the last multiple of the block before its last ``tail`` tokens (what a
        request sharing it may read from the cache)."""
        return max(prompt_len - self.tail, 0) // self.block * self.block

    def admitted(self, admission: Admission, entry: Admitted, request: Request) -> int:
        """A request admitted sharing ``entry.shared`` cached pages: the row state it resumes from, the pages past them
        the disk store has, its counts and where its prefill takes snapshots; the tokens read from the disk store."""
        request_id, shared = entry.request_id, entry.shared * self.page_size
        if self.row_state and entry.shared:
            self._resume[request_id] = admission.shared_state(request_id, self._keys[request_id])
        loaded = 0
        if request.prompt_logprobs is None:
            loaded = self._read_disk(entry, request) if self.disk is not None else 0
            self.stats.count(admission.shard_of(entry.row), len(request.prompt_ids), shared, loaded)
        if self.row_state and request.prompt_logprobs is None:  # a scored prompt is shared with none: never cut
            boundary = self.boundary(len(request.prompt_ids))
            marks = (n * self.block for n in range(boundary // self.block) if 2 * n * self.block >= boundary
                     and landmark(n))
            ends = (*(n * self.page_size for n in entry.points), *marks, boundary)
            self._points[request_id] = sorted({at for at in ends if at > shared + loaded})
        return loaded

    def _read_disk(self, entry: Admitted, request: Request) -> int:
        """The pages past a request's cached prefix that the disk store has, up to its boundary (with row state: up
        to the deepest one whose snapshot reads back, found before any page is read, the request resuming from it),
        read for its first piece; the tokens they hold."""
        ps = self.page_size
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

    def points(self, request_id: int) -> Sequence[int]:
        """Where a request's prefill is cut (its pieces end there)."""
        return self._points.get(request_id, ())

    def work(self, entry: Admitted, request: Request, start: int, size: int) -> PrefixWork:
        """The prefix cache's part of a request's piece of ``size`` tokens from ``start``."""
        request_id, length, end = entry.request_id, len(request.prompt_ids), start + size
        loaded, disk = self._loaded.get(request_id, (0, []))
        first = start == entry.shared * self.page_size + loaded
        if first:
            self._loaded.pop(request_id, None)
        save = ()
        if end == length and self.disk is not None:  # its cacheable pages the disk store does not have yet
            save = tuple(j for j, key in enumerate(self._cacheable(request_id, length)) if not self.disk.has(key))
        return PrefixWork(self._resume.pop(request_id, None) if first else None, end in self.points(request_id), loaded,
                          tuple(disk) if first else (), save)

    def _cacheable(self, request_id: int, prompt_len: int) -> list[bytes]:
        """The keys of a prompt's pages cached when its prefill ends: its full pages (with row state, those before its
        boundary)."""
        keys = self._keys.get(request_id, [])
        return keys[:self.boundary(prompt_len) // self.page_size] if self.row_state else keys

    def took(self, piece: PrefillSlice, size: int, state: tuple[Any, int] | None) -> None:
        """A piece ran; ``state``: the row state after it and its bytes (``PrefixWork.snapshot``), or None."""
        if state is not None:
            self._taken.setdefault(piece.request_id, {})[piece.start + size] = state

    def finished(self, admission: Admission, piece: PrefillSlice, saved: list | None) -> None:
        """A prompt is all prefilled: its pages, for others to share, are all written now (ESS: handed off to the
        host store); with row state those before its boundary, with the snapshots its prefill took. ``saved``: the
        arrays of the pages the disk store lacked (``PrefixWork.save``)."""
        keys = self._cacheable(piece.request_id, piece.prompt_len)
        if not keys:
            return
        ps, taken = self.page_size, self._taken.pop(piece.request_id, {})
        state = taken.pop(len(keys) * ps, None)
        if state is not None or not self.row_state:
            admission.cache_pages(piece.request_id, keys, state)
            for at, branch in taken.items():
                admission.keep_state(piece.request_id, keys[at // ps - 1], branch)
        if self.disk is not None:
            self.disk.save_pages([keys[j] for j in piece.prefix.save], saved or [])
            snapshots = {**taken, len(keys) * ps: state} if state is not None else taken
            for at, (snapshot, _) in snapshots.items():
                if not self.disk.has(key := keys[at // ps - 1], ".state"):
                    self.disk.save_state(key, snapshot)

    def release(self, request_id: int) -> None:
        """A request ended: what was kept for it goes."""
        for held in (self._keys, self._resume, self._taken, self._loaded, self._points):
            held.pop(request_id, None)

    def shard_usage(self, pool: PageAllocator) -> dict:
        """What a data shard's pool keeps of the prefix cache besides its pages: with row state its snapshots and their
        bytes."""
        if not self.row_state:
            return {}
        return {"prefix_cache_states": pool.num_states, "prefix_cache_state_bytes": pool.state_bytes}

    def metrics(self) -> dict:
        """The ``--json`` ``metrics.prefix_cache`` object: prompt tokens of the requests that looked the cache up
        (``query_tokens``) and those found cached (``hit_tokens``), per tier (where the cached pages were read from)
        and per data shard."""
        stats = self.stats
        queries, memory, disk = (sum(d.values()) for d in (stats.queries, stats.hits, stats.disk_hits))
        hits = memory + disk
        return {"query_tokens": queries, "hit_tokens": hits, "hit_rate": hits / queries if queries else 0.0,
                "per_tier": {"device": 0, "host": 0, self.tier: memory, "disk": disk},
                "per_shard": [{"shard": d, "query_tokens": stats.queries.get(d, 0),
                               "hit_tokens": stats.hits.get(d, 0) + stats.disk_hits.get(d, 0)}
                              for d in range(self.shards)]}

    def usage(self) -> dict:
        """What ``Engine.usage`` adds: the counters (``prefix_cache``)."""
        return {"prefix_cache": self.metrics()}

    def flush(self) -> None:
        """The disk store's queued writes done."""
        if self.disk is not None:
            self.disk.store.flush()


class NoPrefixCache:
    """The prefix cache off: no keys, nothing shared, nothing kept."""

    states = None
    stats = PrefixStats()

    def __init__(self, page_size: int):
        self.block = page_size

    def keys(self, request_id: int, request: Request) -> list[bytes]:
        return []

    def admitted(self, admission: Admission, entry: Admitted, request: Request) -> int:
        return 0

    def points(self, request_id: int) -> Sequence[int]:
        return ()

    def work(self, entry: Admitted, request: Request, start: int, size: int) -> PrefixWork:
        return PrefixWork()

    def took(self, piece: PrefillSlice, size: int, state: tuple[Any, int] | None) -> None:
        pass

    def finished(self, admission: Admission, piece: PrefillSlice, saved: list | None) -> None:
        pass

    def release(self, request_id: int) -> None:
        pass

    def shard_usage(self, pool: PageAllocator) -> dict:
        return {}

    def metrics(self) -> None:
        return None

    def usage(self) -> dict:
        return {}

    def flush(self) -> None:
        pass


Target = tuple  # (cache, its shardings, the request's batch row in it, its pages there i32[pages_per_row]): a cache
# a piece writes (the decode cache or the ESS scratch; the MTP module's)


class PrefixIO:
    """The runner's half of the prefix cache (the module docstring): ``before`` and ``after`` each piece, over the
    caches the piece writes (``Target``s: the main cache, then the MTP module's)."""

    def __init__(self, page_size: int, pages_per_row: int, shards: int):
        self.page_size, self.pages_per_row, self.shards = page_size, pages_per_row, shards

    def before(self, targets: list[Target], shard: int, piece: PrefillSlice) -> list:
        """The targets' caches with the pages read from the disk store in the request's pages past its shared ones
        (each target's arrays in turn) and its row resumed from the snapshot it starts from."""
        work, caches = piece.prefix, [target[0] for target in targets]
        if work.disk:
            at, skip = piece.cached // self.page_size + np.arange(len(work.disk)), 0
            for i, (cache, shardings, _, pages_X) in enumerate(targets):
                caches[i] = self._write_pages(cache, shardings, shard, pages_X[at], work.disk, skip)
                skip += len(jax.tree.leaves(cache.paged_arrays()))
        if work.resume is not None:
            caches = [steps.resume(cache, jnp.int32(row), state, shardings=shardings)
                      for cache, (_, shardings, row, _), state in zip(caches, targets, work.resume)]
        return caches

    def after(self, targets: list[Target], shard: int, piece: PrefillSlice) -> tuple[tuple | None, list | None]:
        """The row state after the piece and its bytes, if it takes one; the arrays of the pages the disk store
        lacks, a list per page (each target's in turn), if it reads them."""
        work, state, saved = piece.prefix, None, None
        if work.snapshot:
            snapshot = jax.device_get(tuple(steps.row_state(cache, jnp.int32(row)) for cache, _, row, _ in targets))
            state = (snapshot, sum(x.nbytes for x in jax.tree.leaves(snapshot)))
        if work.save:
            at = np.asarray(work.save)
            read = [self._read_pages(cache, shard, pages_X[at]) for cache, _, _, pages_X in targets]
            saved = [sum(arrays, []) for arrays in zip(*read)]
        return state, saved

    def _global_pages(self, cache, shard: int, local) -> jax.Array:
        """Pages ``local`` of data shard ``shard`` as ids in ``cache``'s whole paged arrays, padded with the shard's
        null page to a request's width (one compiled shape)."""
        per_shard = jax.tree.leaves(cache.paged_arrays())[0].shape[1] // self.shards
        ids = np.zeros(self.pages_per_row, np.int32)
        ids[:len(local)] = local
        return jnp.asarray(shard * per_shard + ids)

    def _read_pages(self, cache, shard: int, local) -> list[list[np.ndarray]]:
        """The arrays of pages ``local`` of ``shard`` in ``cache``, a list per page."""
        leaves = jax.tree.leaves(jax.device_get(steps.read_pages(cache, self._global_pages(cache, shard, local))))
        return [[np.asarray(x[:, j]) for x in leaves] for j in range(len(local))]

    def _write_pages(self, cache, shardings, shard: int, local, pages: tuple, skip: int):
        """``cache`` with pages ``local`` of ``shard`` set to ``pages`` (a list of arrays per page, its own from
        ``skip`` on)."""
        structure = jax.tree.structure(cache.paged_arrays())
        leaves = []
        for i in range(structure.num_leaves):
            stacked = np.stack([page[skip + i] for page in pages], axis=1)
            padded = np.zeros(stacked.shape[:1] + (self.pages_per_row,) + stacked.shape[2:], stacked.dtype)
            padded[:, :len(pages)] = stacked
            leaves.append(jnp.asarray(padded))
        return steps.write_pages(cache, self._global_pages(cache, shard, local), jax.tree.unflatten(structure, leaves),
                                 shardings=shardings)


class NoPrefixIO:
    """The prefix cache off: the caches as they are."""

    def before(self, targets: list[Target], shard: int, piece: PrefillSlice) -> list:
        return [target[0] for target in targets]

    def after(self, targets: list[Target], shard: int, piece: PrefillSlice) -> tuple[None, None]:
        return None, None


def prefix_cache_for(model, config: EngineConfig, layout, mode, proposer
                     ) -> tuple[PrefixCache | NoPrefixCache, PrefixIO | NoPrefixIO]:
    """The prefix cache's two halves for an engine (``config.prefix_cache``; off: the null objects): its pages salted
    with what their bytes depend on, its disk store with ``config.prefix_cache_dir``. ``mode``: the offload mode's
    ``layout.ModeSpec``; ``proposer``: speculative decoding's (the MTP module's cache is in the pages too: its page
    keys name the tokens past a page, ``lookahead``, and its pages go to the disk store)."""
    if not config.prefix_cache:
        return NoPrefixCache(config.page_size), NoPrefixIO()
    family = families.get(model.cfg.family)
    salt = _salt(model, config, layout)
    disk = _disk(model, config, proposer.abstract(layout.size), salt) if config.prefix_cache_dir else None
    scheduler_half = PrefixCache(config, salt=salt, tail=mode.computed_tail,
                                 block=family.prefix_block(model.cfg, config.page_size), row_state=family.row_state,
                                 lookahead=proposer.lookahead, disk=disk, tier=mode.prefix_tier,
                                 shards=layout.size.shards)
    return scheduler_half, PrefixIO(config.page_size, layout.pages_per_row, layout.size.shards)


def _salt(model, config: EngineConfig, layout) -> bytes:
    """What a cached page's bytes depend on besides its tokens: the weights (``prefix_store.weights_fingerprint``: a
    checkpoint's real path and files, or the parameters' values; the ess_jax version), the model's config, its
    parameters' formats, the cache's stored formats and the kernels that write them."""
    params = jax.tree.map(lambda x: f"{x.dtype}{x.shape}", model.params)
    what = (weights_fingerprint(model.name, model.params).hex(), repr(model.cfg), str(jax.tree.leaves(params)),
            repr(layout.parts), config.kernels)
    return hashlib.blake2b(repr(what).encode(), digest_size=16).digest()


def _disk(model, config: EngineConfig, more: list, salt: bytes) -> PrefixDisk:
    """The disk store (a process of several: its own subdirectory), with what a page holds (the resident cache's paged
    arrays at one page, then ``more``'s: the MTP module's cache) and, with row state, the snapshot's structure."""
    module = model.module
    family = families.get(module.cfg.family)
    size = families.CacheSize(rows=1, pages=2, page_size=config.page_size, max_seq_len=config.page_size)
    dtype = entry_dtype(module, config.cache_dtype)
    main = jax.eval_shape(lambda: family.resident_cache(module, size, dtype, config.index_dtype))
    caches = [main, *more]
    page = [(np.dtype(x.dtype).str, (x.shape[0], *x.shape[2:]))
            for cache in caches for x in jax.tree.leaves(cache.paged_arrays())]
    state = None
    if family.row_state:
        shapes = jax.eval_shape(lambda: tuple(steps.row_state(cache, 0) for cache in caches))
        state = (jax.tree.structure(shapes), [(np.dtype(x.dtype).str, x.shape) for x in jax.tree.leaves(shapes)])
    directory = Path(config.prefix_cache_dir)
    if jax.process_count() > 1:
        directory /= f"process-{jax.process_index()}"
    return PrefixDisk(PrefixStore(directory, int(config.prefix_cache_disk_gb * 2**30), salt), page, state)

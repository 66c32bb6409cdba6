"""The offloaded tier as a store (``ess_jax.cache``'s contract): every entry of the sparse layers in a host
store, an LRU working set of it in a device pool. Family-neutral: DeepSeek-V3.2's latent rows (one per
token) and DeepSeek-V4's CSA entries (one per m tokens) alike; no attention math here.

A decode step, per sparse layer (``Tier.read``, one token per batch row):

1. the indexer's top-k entries resolve to slots through the residency map (``lru.LruPool``);
2. the new entry and every miss take the least recently used slots that no hit of this step holds;
3. missed rows are fetched from the host store (``host``: inline or split) through a buffer of the miss budget's
   rows (``miss_budget``: a fraction of the ids looked up per batch row, every batch row's misses compacted into
   it), once per buffer they fill: a step that misses more takes more rounds (exact at any pool size); with Index
   Share (``sources``) a full layer also fetches the misses of the shared layers that read its top-k, as soon as it
   is known, and a shared layer takes its rows from that ``ahead`` buffer (``lead_metrics``: per layer, how many
   layers ahead its misses were fetched);
4. the sources handed to attention: the pool with the hits and the new entry (ready), the fetched rows
   (in flight); ``ops.dual_attention`` attends over both and merges them by log-sum-exp (ESS
   Dual-Attention), so the transfer can hide behind the hit half; ``settle`` then writes the misses
   into their slots;
5. the new rows are staged and written to the host store batched over layers at the start of the next
   compiled step, before its fetches (``begin_step``).
Lookups, hits, misses and staged entries are counted on the device and read once at the end.

With ``P >=`` a request's entries nothing is ever evicted and the tier equals the resident store.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax import mesh
from ess_jax.cache import (RowSource, Sources, StepMeta, entries_per_page, first_row, layer_view, locate, row_runs,
                           with_layer_view)
from ess_jax.tier import lru
from ess_jax.tier.host import fetch_wanted, host_store


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tier:
    """Rows of ``L`` sparse layers behind an LRU device pool (B batch rows, P pool slots per row)."""

    pool: jax.Array  # [L, B, P * W] working-set rows (the store's format), a batch row's P slots as one run
    # (``ess_jax.cache.row_runs``)
    lru: lru.LruPool  # slot tables and the residency map
    staged: jax.Array  # [L, B, M, W] rows written by the last step (M per row), backed up at the start of the next
    staged_page: jax.Array  # i32[B, M] their host page (0, the null page, when nothing is pending)
    staged_offset: jax.Array  # i32[B, M] their offset in the page
    counters: jax.Array  # i32[L, B, 4] lookups, hits, misses, entries staged for the host, per batch row, since the
    # engine started (so a mesh's data shards count their own rows); over the union of a step's queries' ids
    query_counters: jax.Array  # i32[L, B, T, 3] lookups, hits, misses of each query position's own top-k ids (T: a
    # decode step's query tokens per row, 1 + the drafts it verifies)
    host: Any  # host.PinnedHostStore | host.NumpyHostStore: [L, G, Z, W]
    ahead: jax.Array | None  # [A, B, U, W] Index Share: the misses a full layer fetched for the A shared layers
    # after it (A: the most a full layer serves; U: a step's queries times top-k), read when they run; None without
    # sharing (no zero-sized arrays: XLA:CPU's SPMD compile crashes on one sharded over the batch rows)
    ahead_counters: jax.Array | None  # i32[L, B, 2] per layer and row: misses fetched at an earlier layer's step
    # than the layer's own, and the layer whose step last fetched its misses; None without sharing
    page_size: int = dataclasses.field(metadata=dict(static=True))  # tokens per page (Z)
    rate: int = dataclasses.field(metadata=dict(static=True))  # tokens per entry (m)
    miss_budget: float = dataclasses.field(default=1.0, metadata=dict(static=True))  # rows fetched per batch row
    # and step, a fraction of the ids it looks up (1: every id, no compaction)
    sources: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))  # Index Share:
    # each layer's full layer, whose top-k it reads (``share_sources``); None: every layer its own

    @property
    def dtype(self):
        return self.pool.dtype

    @property
    def width(self) -> int:
        """W: a row's elements."""
        return self.staged.shape[-1]

    def _locate(self, page_table_BX, ids):
        return locate(page_table_BX, ids, page_size=self.page_size, rate=self.rate)

    def read(self, layer, meta: StepMeta, new_ids_BM: jax.Array, new_rows_BMW: jax.Array,
             ids_BTK: jax.Array) -> Sources:
        """One decode step of sparse layer ``layer`` (an int, or i32[] inside a scan over layers): ``T`` query
        tokens per row (1, or a verification step's last token and drafts) and ``M`` new entries. The union of
        the queries' top-k ids is resolved once (``lru.resolve``), its misses fetched once; sources: the pool
        with the hits (ready) and the step's arrivals, its new rows and fetched misses (in flight); ``settle``
        writes the arrivals into the slots they took."""
        b, t, k = ids_BTK.shape
        m = new_ids_BM.shape[1]
        active_B = meta.valid[:, 0]
        p, w = self.lru.slots, self.width
        ids_BU, first_BTK = jax.vmap(union)(ids_BTK)  # U = T * K distinct ids (-1 past them), each query's place
        u = ids_BU.shape[1]
        page_BU, offset_BU = self._locate(meta.page_table, ids_BU)
        with jax.named_scope("resolve"):
            res, evicted_BK1 = self.lru.lookup(layer, ids_BU, new_ids_BM, active_B)
            # every read of the old maps happens before their in-place updates in settle
            evicted_BK1, old = jax.lax.optimization_barrier((evicted_BK1, self.lru))
        with jax.named_scope("fetch"):
            fetched_BUW, ahead, ahead_counters = self._fetch_misses(layer, res.miss_K, ids_BU, new_ids_BM, active_B,
                                                                    page_BU, offset_BU)
        # the step's arrivals: its new rows, then the fetched misses (A = M + U rows per batch row)
        arrivals_BAW = jnp.concatenate([new_rows_BMW.astype(fetched_BUW.dtype), fetched_BUW], axis=1)
        new_of_BU = jnp.argmax(ids_BU[:, :, None] == new_ids_BM[:, None, :], axis=2)
        arrival_BU = jnp.where(res.is_new_K, new_of_BU, jnp.where(res.miss_K, m + jnp.arange(u), -1))
        row_B1 = jnp.arange(b)[:, None]
        # the pool as the layer's step sees it (cache.layer_view), as one row array: row first + b * P + slot
        flat, at = layer_view(self.pool, layer)
        pool = flat.reshape(*flat.shape[:-1], p, w)
        hit_BU = jnp.where(res.hit_K, first_row(pool, at) + row_B1 * p + res.slot_K, -1)
        inflight_BU = jnp.where(arrival_BU >= 0, row_B1 * (m + u) + arrival_BU, -1)
        picked = lambda x_BU: jnp.where(ids_BTK >= 0, jax.vmap(lambda x, f: x[f])(x_BU, first_BTK), -1)  # noqa: E731

        def settle(ready: list[RowSource]) -> Tier:
            """The arrivals into the slots they took (the pool read by the ready half first), residency and LRU
            state, counters, and the new entries staged for the host backup."""
            with jax.named_scope("pool_update"):
                view = ready[0].rows_PW.reshape(pool.shape)
                slot_BA = jnp.concatenate([res.new_slot, jnp.where(res.miss_K & (res.slot_K >= 0), res.slot_K, p)],
                                          axis=1)
                view = view.at[(*at, row_B1, slot_BA)].set(arrivals_BAW.astype(view.dtype), mode="drop")
                new_page_BM, new_offset_BM = self._locate(meta.page_table, new_ids_BM)
                counts_B4 = jnp.stack([(ids_BU >= 0).sum(-1), (res.hit_K | res.is_new_K).sum(-1), res.miss_K.sum(-1),
                                       (new_ids_BM >= 0).sum(-1)], axis=-1).astype(jnp.int32)
                counts_B4 = jnp.where(active_B[:, None], counts_B4, 0)  # a row that does not run looks nothing up
                at_query = lambda x_BU: jax.vmap(lambda x, f: x[f])(x_BU, first_BTK) & (ids_BTK >= 0)  # noqa: E731
                counts_BT3 = jnp.stack([(ids_BTK >= 0).sum(-1), at_query(res.hit_K | res.is_new_K).sum(-1),
                                        at_query(res.miss_K).sum(-1)], axis=-1).astype(jnp.int32)
                counts_BT3 = jnp.where(active_B[:, None, None], counts_BT3, 0)
            return dataclasses.replace(
                self, pool=with_layer_view(self.pool, view.reshape(flat.shape), layer),
                lru=old.commit(layer, res, ids_BU, new_ids_BM, evicted_BK1),
                staged=self.staged.at[layer].set(new_rows_BMW.astype(self.staged.dtype)),
                staged_page=new_page_BM,  # the null page where no entry is new
                staged_offset=new_offset_BM, counters=self.counters.at[layer].add(counts_B4),
                query_counters=self.query_counters.at[layer].add(counts_BT3), ahead=ahead,
                ahead_counters=ahead_counters)

        ready = [RowSource(pool.reshape(-1, w), picked(hit_BU))]
        return Sources(ready, [RowSource(arrivals_BAW.reshape(b * (m + u), w), picked(inflight_BU))], settle)

    def _fetch_misses(self, layer, miss_BU, ids_BU, new_ids_BM, active_B, page_BU, offset_BU):
        """Layer ``layer``'s missed rows ``[B, U, W]`` and the ``ahead`` buffer and counters after its step. With
        Index Share a full layer fetches its own misses and, as soon as its top-k is known, those of each shared
        layer reading it (their pools' misses at these ids, the same their own lookups find: no other step touches
        a layer's pool in between), into ``ahead``; a shared layer fetches nothing and takes its rows from there."""
        if self.sources is None:
            return self._fetch(layer, miss_BU, page_BU, offset_BU), self.ahead, self.ahead_counters
        u = miss_BU.shape[1]
        leads = share_leads(self.sources)
        lead_L = jnp.asarray(leads + (0,) * self.ahead.shape[0], jnp.int32)  # past the last layer: none
        lead = lead_L[layer]  # layers after its full one (0: a full layer)
        own_BUW = self._fetch(layer, miss_BU & (lead == 0), page_BU, offset_BU)
        fetched_BUW = jnp.where(lead > 0, self.ahead[jnp.maximum(lead - 1, 0), :, :u].astype(own_BUW.dtype), own_BUW)
        counters = self.ahead_counters
        counters = counters.at[layer, :, 1].set(jnp.where(lead == 0, layer, counters[layer, :, 1]))
        ahead = self.ahead
        for a in range(ahead.shape[0]):  # the layer a + 1 after this one, where it shares this layer's top-k
            follower = layer + a + 1
            serves = (lead == 0) & (lead_L[follower] == a + 1)
            at = jnp.minimum(follower, len(leads) - 1)
            wanted_BU = self.lru.misses(at, ids_BU, new_ids_BM, active_B) & serves
            rows_BUW = self._fetch(at, wanted_BU, page_BU, offset_BU).astype(ahead.dtype)
            ahead = ahead.at[a, :, :u].set(jnp.where(serves, rows_BUW, ahead[a, :, :u]))
            counters = counters.at[at, :, 0].add(wanted_BU.sum(-1).astype(jnp.int32))
            counters = counters.at[at, :, 1].set(jnp.where(serves, layer, counters[at, :, 1]))
        return fetched_BUW, ahead, counters

    def lead_metrics(self, layers: list[int]) -> list[dict]:
        """Per layer (``layers``: the model's layer of each) where its misses were fetched, from the device counters:
        ``lead``, the model layers between the layer whose step fetched them last and the layer (0: its own step),
        and ``fetched_ahead``, the misses fetched at an earlier layer's step (Index Share's shared layers)."""
        if self.sources is None:
            return [{"lead": 0, "fetched_ahead": 0} for _ in layers]
        counts_LB2 = mesh.host_array(self.ahead_counters)
        return [{"lead": layer - layers[int(c[:, 1].max())] if c[:, 1].max() >= 0 else 0,
                 "fetched_ahead": int(c[:, 0].sum())} for layer, c in zip(layers, counts_LB2)]

    def _fetch(self, layer, miss_BU: jax.Array, page_BU: jax.Array, offset_BU: jax.Array) -> jax.Array:
        """The missed rows ``[B, U, W]`` (zeros elsewhere) of layer ``layer`` from the host store: every batch row's
        misses compacted, fetched through a buffer of ``fetch_rows`` rows, once per buffer they fill (none when
        nothing misses; a step that misses more than the budget takes more, exact at any pool size)."""
        b, u = miss_BU.shape
        x, w = b * u, self.width
        page_X, offset_X = page_BU.reshape(-1), offset_BU.reshape(-1)

        def read(at_N):
            used_N, source_N = at_N < x, jnp.minimum(at_N, x - 1)
            return self.host.fetch(layer, jnp.where(used_N, page_X[source_N], 0),
                                   jnp.where(used_N, offset_X[source_N], 0))

        rows_XW = fetch_wanted(read, miss_BU.reshape(-1), fetch_rows(b, u, self.miss_budget),
                               jax.ShapeDtypeStruct((x, w), self.host.dtype))
        return rows_XW.reshape(b, u, w)

    def rollback(self, meta: StepMeta, length_B: jax.Array) -> Tier:
        """Forget the entries past each row's ``length_B`` tokens, written by a verification step's rejected
        tokens: their slots emptied (first in the recency order), their residency cleared, their rows not backed
        up, and not counted as staged."""
        limit_B = length_B // self.rate  # the row's entries: those closed by its first length_B tokens
        lru = self.lru.forget(self.lru.slot_entry >= limit_B[None, :, None])
        # the staged rows' entries, from their pages' places in the page table
        per_page = entries_per_page(self.page_size, self.rate)
        staged_BM = self.staged_page
        place_BM = jnp.argmax(meta.page_table[:, None, :] == staged_BM[:, :, None], axis=2)
        entry_BM = place_BM * per_page + self.staged_offset
        unstage_BM = (staged_BM > 0) & (entry_BM >= limit_B[:, None])
        counters = self.counters.at[:, :, 3].add(-unstage_BM.sum(-1).astype(jnp.int32)[None, :])
        return dataclasses.replace(self, lru=lru, staged_page=jnp.where(unstage_BM, 0, staged_BM), counters=counters)

    def begin_step(self) -> Tier:
        """Back up the previous step's staged rows (batched over layers) and mark nothing pending.

        Written at the start of the next compiled step, before any fetch reads the store (backing up at the
        end of the step would make XLA copy a pinned store the step's fetches read); no fetch of a step
        needs the rows staged by the step before, which are in the pool. Rows staged for the null page
        (nothing pending) are harmless."""
        host = self.host.backup(self.staged_page, self.staged_offset, self.staged)
        return dataclasses.replace(self, host=host, staged_page=jnp.zeros_like(self.staged_page))

    def store_prompt(self, scratch_pages_LGZW, scratch_table_X, pages_X) -> Tier:
        """The prompt's rows from the prefill scratch's pages ``scratch_table_X`` into the host store's
        ``pages_X`` (whole pages; unused columns copy to the null page)."""
        return dataclasses.replace(self, host=self.host.store_prompt(scratch_pages_LGZW[:, scratch_table_X], pages_X))

    def warm(self, scratch_pages_LGZW, scratch_table_X, row, count, ids_LTK) -> Tier:
        """Fill batch row ``row``'s pools (every layer) from the prefill scratch: ESS LRU-Warmup with the top-k
        ids of the last prompt queries, or all ``count`` entries of the prompt when they fit (a row past the
        last: none)."""
        capacity = self.lru.resident_slot.shape[2]
        entry_LP, order_LP = jax.vmap(lru.warm_layer, in_axes=(0, None, None, None))(ids_LTK, count, self.lru.slots,
                                                                                    capacity)
        scratch_page_LP, offset_LP = self._locate(scratch_table_X[None], entry_LP.reshape(1, -1))
        scratch_page_LP, offset_LP = scratch_page_LP.reshape(entry_LP.shape), offset_LP.reshape(entry_LP.shape)
        rows_LPW = jax.vmap(lambda pages, g, e: pages[g, e])(scratch_pages_LGZW, scratch_page_LP, offset_LP)
        rows_LY = rows_LPW.reshape(len(rows_LPW), -1).astype(self.pool.dtype)  # a row's slots as one run
        return dataclasses.replace(
            self, pool=self.pool.at[:, row].set(rows_LY, mode="drop"),
            lru=self.lru.warm(row, entry_LP, order_LP))

    def load_prefix(self, pages_X) -> jax.Array:
        """The rows of the host store's pages ``pages_X`` on the device ``[L, X, Z, W]`` (a cached prefix's, for a
        prefill that continues it)."""
        return self.host.load(pages_X)

    def release(self, row) -> Tier:
        """Empty batch row ``row``'s pools and residency when its request finishes or is aborted: the tier then
        holds nothing of it on the device (a row past the last: none)."""
        return dataclasses.replace(self, lru=self.lru.release(row))


def union(ids_TK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One row's selected ids over its ``T`` queries ``i32[T, K]`` (-1 = none) as distinct ids ``i32[T * K]`` in
    order of first appearance, repeats -1, and the place of each query's id in it ``i32[T, K]``. One query's
    top-k ids are distinct already."""
    t, k = ids_TK.shape
    flat = ids_TK.reshape(-1)
    if t == 1:
        return flat, jnp.arange(k, dtype=jnp.int32)[None]
    order = jnp.argsort(flat, stable=True)
    ordered = flat[order]
    starts = jnp.concatenate([jnp.ones(1, bool), ordered[1:] != ordered[:-1]])
    first_ordered = order[jax.lax.cummax(jnp.where(starts, jnp.arange(flat.size), 0))]
    first = jnp.zeros(flat.size, jnp.int32).at[order].set(first_ordered.astype(jnp.int32))
    return jnp.where(first == jnp.arange(flat.size), flat, -1), first.reshape(t, k)


def share_sources(indexer_types: tuple[str, ...]) -> tuple[int, ...] | None:
    """Each sparse layer's full layer under Index Share (``ModelConfig.indexer_types``, one per sparse layer): its
    own index if full, else the nearest preceding full layer's; None when every layer is full."""
    if "shared" not in indexer_types:
        return None
    sources, full = [], 0
    for i, kind in enumerate(indexer_types):
        full = i if kind == "full" else full
        sources.append(full)
    return tuple(sources)


def share_leads(sources: tuple[int, ...] | None) -> tuple[int, ...]:
    """Each sparse layer's distance from its full layer (``share_sources``; 0: full): its place among the layers
    its full layer fetches ahead for."""
    return tuple(i - s for i, s in enumerate(sources or ()))


def fetch_rows(rows: int, ids: int, miss_budget: float) -> int:
    """Rows of the miss buffer a step fetches into for ``rows`` batch rows looking up ``ids`` ids each: the budget's
    fraction of the ids, at least one row, per batch row."""
    return rows * min(ids, max(1, math.ceil(miss_budget * ids)))


def init_tier(*, layers: int, rows: int, slots: int, pages: int, page_size: int, rate: int, width: int, dtype,
              fetch: str, entries: int, new_entries: int = 1, queries: int = 1, topk: int = 0,
              sources: tuple[int, ...] | None = None) -> Tier:
    """An empty tier: ``slots`` pool slots per (layer, batch row), a residency map of ``entries`` entry ids per
    row (a request's most), a host store of ``pages`` pages (allocated directly in pinned host memory for
    ``inline``, in NumPy for ``split``); ``new_entries``: the entries a decode step writes per row (more than one
    in a verification step); ``queries``: a decode step's query tokens per row (counted per position);
    ``sources``: Index Share's full layer of each layer (``share_sources``), whose ``topk`` ids per query it
    reads."""
    per_page = entries_per_page(page_size, rate)
    staged = (rows, new_entries)
    ahead = max(share_leads(sources), default=0)
    return Tier(
        pool=row_runs(layers, rows, slots, width, dtype),
        lru=lru.LruPool.empty(layers=layers, rows=rows, slots=slots, entries=entries),
        staged=jnp.zeros((layers, *staged, width), dtype),
        staged_page=jnp.zeros(staged, jnp.int32),
        staged_offset=jnp.zeros(staged, jnp.int32),
        counters=jnp.zeros((layers, rows, 4), jnp.int32),
        query_counters=jnp.zeros((layers, rows, queries, 3), jnp.int32),
        host=host_store(fetch, (layers, pages, per_page, width), dtype),
        ahead=jnp.zeros((ahead, rows, queries * topk, width), dtype) if ahead else None,
        ahead_counters=jnp.full((layers, rows, 2), -1, jnp.int32).at[..., 0].set(0) if ahead else None,
        page_size=page_size, rate=rate, sources=sources,
    )


def device_bytes(*, layers: int, rows: int, slots: int, row_bytes: int, entries: int, new_entries: int = 1,
                 queries: int = 1, topk: int = 0, sources: tuple[int, ...] | None = None) -> int:
    """Bytes of an ``init_tier`` tier's device arrays (all but the host store), for ``layers`` sparse layers,
    ``rows`` batch rows of ``slots`` pool slots, rows of ``row_bytes``, a residency map of ``entries`` entry ids
    per row, ``new_entries`` entries and ``queries`` query tokens a decode step: per (layer, row) the pool, its
    two int32 slot tables, the staged rows, four int32 counters, three per query position and an int32 slot per
    entry id; per row the staged rows' int32 pages and offsets. With Index Share (``sources``) per row the rows
    fetched ahead (``queries * topk`` per layer a full layer serves) and two int32 counters per layer."""
    ahead = max(share_leads(sources), default=0)
    return (layers * rows * (slots * (row_bytes + 8) + new_entries * row_bytes + 16 + 12 * queries + entries * 4)
            + rows * new_entries * 8 + (rows * (ahead * queries * topk * row_bytes + layers * 8) if ahead else 0))

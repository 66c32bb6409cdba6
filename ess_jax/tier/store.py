"""The offloaded tier as a store (``ess_jax.cache``'s contract): every entry of the sparse layers in a host
store, an LRU working set of it in a device pool. Family-neutral: DeepSeek-V3.2's latent rows (one per
token) and DeepSeek-V4's CSA entries (one per m tokens) alike; no attention math here.

A decode step, per sparse layer (``Tier.read``, one token per batch row):

1. the indexer's top-k entries resolve to slots through the residency map (``lru.LruPool``);
2. the new entry and every miss take the least recently used slots that no hit of this step holds;
3. missed rows are fetched from the host store (``host``: inline or split);
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
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.cache import RowSource, Sources, StepMeta, entries_per_page, locate
from ess_jax.tier import lru
from ess_jax.tier.host import host_store


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tier:
    """Rows of ``L`` sparse layers behind an LRU device pool (B batch rows, P pool slots per row)."""

    pool: jax.Array  # [L, B, P, W] working-set rows (the store's format)
    lru: lru.LruPool  # slot tables and the residency map
    staged: jax.Array  # [L, B, W] rows written by the last step, backed up at the start of the next
    staged_page: jax.Array  # i32[B] their host page (0, the null page, when nothing is pending)
    staged_offset: jax.Array  # i32[B] their offset in the page
    counters: jax.Array  # i32[L, B, 4] lookups, hits, misses, entries staged for the host, per batch row, since the
    # engine started (so a mesh's data shards count their own rows)
    host: Any  # host.PinnedHostStore | host.NumpyHostStore: [L, G, Z, W]
    page_size: int = dataclasses.field(metadata=dict(static=True))  # tokens per page (Z)
    rate: int = dataclasses.field(metadata=dict(static=True))  # tokens per entry (m)

    @property
    def dtype(self):
        return self.pool.dtype

    def _locate(self, page_table_BX, ids):
        return locate(page_table_BX, ids, page_size=self.page_size, rate=self.rate)

    def read(self, layer, meta: StepMeta, new_ids_BM: jax.Array, new_rows_BMW: jax.Array,
             ids_BTK: jax.Array) -> Sources:
        """One decode token per row (T = 1, at most one new entry: M = 1) of sparse layer ``layer`` (an int, or
        i32[] inside a scan over layers): the new entry into a slot no hit holds, the misses fetched; sources:
        the pool with the hits and the new entry (ready) and the fetched rows (in flight)."""
        if ids_BTK.shape[1] != 1 or new_ids_BM.shape[1] != 1:
            raise ValueError(f"the tier serves decode steps of one token per request, got T={ids_BTK.shape[1]}")
        ids_BK, new_id_B, new_row_BW = ids_BTK[:, 0], new_ids_BM[:, 0], new_rows_BMW[:, 0]
        active_B = meta.valid[:, 0]
        b, k = ids_BK.shape
        _, rows, p, w = self.pool.shape
        page_BK, offset_BK = self._locate(meta.page_table, ids_BK)
        with jax.named_scope("resolve"):
            res, evicted_BK1 = self.lru.lookup(layer, ids_BK, new_id_B, active_B)
            # every read of the old maps happens before their in-place updates in settle
            evicted_BK1, old = jax.lax.optimization_barrier((evicted_BK1, self.lru))
        with jax.named_scope("fetch"):
            fetched_BKW = self.host.fetch(layer, jnp.where(res.miss_K, page_BK, 0), jnp.where(res.miss_K, offset_BK, 0))
        pool = self.pool.at[layer, jnp.arange(b), jnp.where(new_id_B >= 0, res.new_slot, p)].set(new_row_BW,
                                                                                                 mode="drop")
        in_pool_BK = res.hit_K | res.is_new_K
        # the pool viewed as one row array (every layer): row ((layer * B) + b) * P + slot
        hit_ids_BK = jnp.where(in_pool_BK, (layer * rows + jnp.arange(b)[:, None]) * p + res.slot_K, -1)
        miss_ids_BK = jnp.where(res.miss_K, jnp.arange(b * k, dtype=jnp.int32).reshape(b, k), -1)

        def settle(ready: list[RowSource]) -> Tier:
            """The fetched misses into their slots (the pool read by the ready half first), residency and
            LRU state, counters, and the new entry staged for the host backup."""
            with jax.named_scope("pool_update"):
                pool = ready[0].rows_PW.reshape(self.pool.shape)
                pool = pool.at[layer, jnp.arange(b)[:, None], jnp.where(res.miss_K, res.slot_K, p)].set(
                    fetched_BKW, mode="drop")
                new_page_B1, new_offset_B1 = self._locate(meta.page_table, new_id_B[:, None])
                counts_B4 = jnp.stack([(ids_BK >= 0).sum(-1), in_pool_BK.sum(-1), res.miss_K.sum(-1),
                                       new_id_B >= 0], axis=-1).astype(jnp.int32)
            return dataclasses.replace(
                self, pool=pool, lru=old.commit(layer, res, ids_BK, new_id_B, evicted_BK1),
                staged=self.staged.at[layer].set(new_row_BW),
                staged_page=new_page_B1[:, 0],  # the null page where no entry is new
                staged_offset=new_offset_B1[:, 0], counters=self.counters.at[layer].add(counts_B4))

        ready = [RowSource(pool.reshape(-1, w), hit_ids_BK[:, None])]
        return Sources(ready, [RowSource(fetched_BKW.reshape(b * k, w), miss_ids_BK[:, None])], settle)

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
        return dataclasses.replace(
            self, pool=self.pool.at[:, row].set(rows_LPW.astype(self.pool.dtype), mode="drop"),
            lru=self.lru.warm(row, entry_LP, order_LP))

    def load_prefix(self, pages_X) -> jax.Array:
        """The rows of the host store's pages ``pages_X`` on the device ``[L, X, Z, W]`` (a cached prefix's, for a
        prefill that continues it)."""
        return self.host.load(pages_X)

    def release(self, row) -> Tier:
        """Empty batch row ``row``'s pools and residency when its request finishes or is aborted: the tier then
        holds nothing of it on the device (a row past the last: none)."""
        return dataclasses.replace(self, lru=self.lru.release(row))


def init_tier(*, layers: int, rows: int, slots: int, pages: int, page_size: int, rate: int, width: int, dtype,
              fetch: str, entries: int) -> Tier:
    """An empty tier: ``slots`` pool slots per (layer, batch row), a residency map of ``entries`` entry ids per
    row (a request's most), a host store of ``pages`` pages (allocated directly in pinned host memory for
    ``inline``, in NumPy for ``split``)."""
    per_page = entries_per_page(page_size, rate)
    return Tier(
        pool=jnp.zeros((layers, rows, slots, width), dtype),
        lru=lru.LruPool.empty(layers=layers, rows=rows, slots=slots, entries=entries),
        staged=jnp.zeros((layers, rows, width), dtype),
        staged_page=jnp.zeros((rows,), jnp.int32),
        staged_offset=jnp.zeros((rows,), jnp.int32),
        counters=jnp.zeros((layers, rows, 4), jnp.int32),
        host=host_store(fetch, (layers, pages, per_page, width), dtype),
        page_size=page_size, rate=rate,
    )


def device_bytes(*, layers: int, rows: int, slots: int, row_bytes: int, entries: int) -> int:
    """Bytes of an ``init_tier`` tier's device arrays (all but the host store), for ``layers`` sparse layers,
    ``rows`` batch rows of ``slots`` pool slots, rows of ``row_bytes`` and a residency map of ``entries`` entry
    ids per row: per (layer, row) the pool, its two int32 slot tables, the staged row, four int32 counters and an
    int32 slot per entry id; per row the staged row's int32 page and offset."""
    return layers * rows * (slots * (row_bytes + 8) + row_bytes + 16 + entries * 4) + rows * 8

"""The ESS tier for DeepSeek-V3.2: latent rows in host memory, an LRU working set on the device.

Every latent row of every admitted request lives in a host store ``[L, G, Z, W]`` (the same page
ids as the indexer keys, which stay on the device). Each (layer, batch row) owns ``P`` device pool
slots. A decode step, per layer (``TieredLatents.attend``):

1. the indexer's top-k positions resolve to slots through the residency map ``position -> slot``,
   kept in pages beside the indexer keys, so a hit costs one gather, not a k x P comparison;
2. the new entry and every miss take the least recently used slots that no hit of this step holds,
   read off the front of a recency order of the slots (no sort: see ``_resolve``);
3. missed rows are fetched from the host store (``inline``: a host-side gather under
   ``compute_on('device_host')`` and an in-step ``device_put`` to device memory; ``split``: a host
   callback at the fetch point gathers them from a NumPy store, one batched transfer per layer);
4. attention runs over the hits and over the misses separately and the halves merge exactly by
   log-sum-exp (ESS Dual-Attention), so the transfer can hide behind the hit half;
5. the new rows are staged and written to the host store batched over layers: ``inline`` at the
   start of the next compiled step (before its fetches), ``split`` by the engine after the step.
Lookups, hits, misses and staged entries are counted on the device and read once at the end.

With ``P >=`` a request's entries nothing is ever evicted and the tier equals the resident cache.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from ess_jax import ops
from ess_jax.cache import StepMeta

FETCH_BACKENDS = ("inline", "split")
WARMUP_QUERIES = 32  # prompt positions whose top-k warm the pool (ESS LRU-Warmup)


class HostStore:
    """The ``split`` backend's host store: a NumPy array ``[L, G, Z, W]``, identified by object."""

    def __init__(self, shape, dtype):
        self.array = np.zeros(shape, dtype)

    def gather(self, layer: int, page_BK: np.ndarray, offset_BK: np.ndarray) -> np.ndarray:
        return self.array[layer, page_BK, offset_BK]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TieredLatents:
    """V3.2 latent rows behind an LRU device pool (R = batch rows, P = pool slots per row)."""

    pool: jax.Array  # [L, R, P, W] working-set rows
    slot_entry: jax.Array  # i32[L, R, P] position held by each slot, -1 = empty
    slot_order: jax.Array  # i32[L, R, P] the slots from least to most recently used (empty ones first)
    resident_slot: jax.Array  # i32[L, G, Z] slot holding each position, -1 = host only
    staged: jax.Array  # [L, R, W] rows written by the last step, backed up at the start of the next
    staged_page: jax.Array  # i32[R] their host page (0, the null page, when nothing is pending)
    staged_offset: jax.Array  # i32[R] their offset in the page
    counters: jax.Array  # i32[L, 4] lookups, hits, misses, entries staged for the host, since the engine started
    host: jax.Array | None  # inline: [L, G, Z, W] pinned_host store; split: None
    store: HostStore | None = dataclasses.field(default=None, metadata=dict(static=True))  # split only
    kernels: str = dataclasses.field(default="xla", metadata=dict(static=True))  # ops kernel choice

    @property
    def fetch(self) -> str:
        return "split" if self.store is not None else "inline"

    def attend(self, layer: int, meta: StepMeta, rows_BTW: jax.Array, ids_BTK: jax.Array,
               q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, scale: float) -> tuple[jax.Array, TieredLatents]:
        """V3.2, one decode token per row (T = 1): the new latent row is this step's position; absorbed
        MLA over the hits and over the fetched misses, merged."""
        _check_decode(ids_BTK)
        new_row_BW = ops.encode_mla_rows(rows_BTW[:, 0], self.pool.dtype, latent_dim=q_latent_BTNC.shape[-1])
        active_B = meta.valid[:, 0]
        new_id_B = jnp.where(active_B, meta.positions[:, 0], -1)
        look = self._lookup(layer, meta.page_table, ids_BTK[:, 0], new_row_BW, new_id_B, active_B)
        with jax.named_scope("dual_attention"):
            # the hit half reads its rows straight from the pool (gathered inside the kernel with
            # --kernels pallas): the pool viewed as one row array, row ((layer * R) + b) * P + slot
            _, r, p, w = self.pool.shape
            hit_ids_BK = jnp.where(look.hit_BK, (layer * r + jnp.arange(r)[:, None]) * p + look.res.slot_K, -1)
            out_hit, lse_hit = ops.sparse_mla_pool(q_latent_BTNC, q_rope_BTNR, look.pool.reshape(-1, w),
                                                   hit_ids_BK[:, None], scale=scale, kernels=self.kernels)
            # ... before the misses land in it
            out_hit, lse_hit, pool = jax.lax.optimization_barrier((out_hit, lse_hit, look.pool))
            look = dataclasses.replace(look, pool=pool)
            out_miss, lse_miss = ops.sparse_mla(q_latent_BTNC, q_rope_BTNR, look.fetched_BKW[:, None],
                                                look.res.miss_K[:, None], scale=scale, kernels=self.kernels)
            out_BTNC = ops.merge_attention(out_hit, lse_hit, out_miss, lse_miss)
        return out_BTNC, self._commit(layer, meta.page_table, look)

    def attend_entries(self, layer: int, page_table_BX: jax.Array, active_B: jax.Array, new_row_BW: jax.Array,
                       new_id_B: jax.Array, ids_BTK: jax.Array, q_BTNH: jax.Array, window_BTSH: jax.Array,
                       window_valid_BTS: jax.Array, sinks_N: jax.Array, scale: float, *, rope_dim: int
                       ) -> tuple[jax.Array, TieredLatents]:
        """V4 CSA (HiSparse), one decode token per row: entry ids ``ids_BTK`` from the indexer,
        ``new_id_B`` the entry whose window closed this step (-1: none). The hit half attends over the
        window rows and the resident entries with the sink, the miss half over the fetched entries
        alone; the merge is the one softmax over window + picked entries + sink. ``new_row_BW`` is in
        the pool's storage format (FP8 rows when uint8; ``rope_dim`` decodes them)."""
        _check_decode(ids_BTK)
        look = self._lookup(layer, page_table_BX, ids_BTK[:, 0], new_row_BW, new_id_B, active_B)
        decode = lambda rows: ops.decode_v4_rows(rows, window_BTSH.dtype, head_dim=q_BTNH.shape[-1], rope_dim=rope_dim)
        with jax.named_scope("dual_attention"):
            hit_rows_BKW = look.pool[layer, jnp.arange(ids_BTK.shape[0])[:, None], jnp.maximum(look.res.slot_K, 0)]
            hit_rows_BKW, pool = jax.lax.optimization_barrier((hit_rows_BKW, look.pool))  # read before the misses land
            look = dataclasses.replace(look, pool=pool)
            rows_BTKH = jnp.concatenate([window_BTSH, decode(hit_rows_BKW[:, None])], axis=2)
            valid_BTK = jnp.concatenate([window_valid_BTS, look.hit_BK[:, None]], axis=2)
            out_hit, lse_hit = ops.sparse_sink_attention(q_BTNH, rows_BTKH, valid_BTK, sinks_N, scale=scale,
                                                         kernels=self.kernels)
            no_sink_N = jnp.full(sinks_N.shape, -jnp.inf, jnp.float32)
            out_miss, lse_miss = ops.sparse_sink_attention(q_BTNH, decode(look.fetched_BKW[:, None]),
                                                           look.res.miss_K[:, None],
                                                           no_sink_N, scale=scale, kernels=self.kernels)
            out_BTNH = ops.merge_attention(out_hit, lse_hit, out_miss, lse_miss)
        return out_BTNH, self._commit(layer, page_table_BX, look)

    def _lookup(self, layer: int, page_table_BX, ids_BK, new_row_BW, new_id_B, active_B) -> Lookup:
        """Resolve the step's ids to slots, fetch the misses and write the new entry into its slot (a slot
        no hit holds); the hits are then read from the returned pool, before ``_commit`` writes the misses."""
        b = ids_BK.shape[0]
        page_size = self.resident_slot.shape[2]
        page_BK, offset_BK = _locate(page_table_BX, ids_BK, page_size)
        known_BK = jnp.where(ids_BK >= 0, self.resident_slot[layer, page_BK, offset_BK], -1)
        with jax.named_scope("resolve"):
            res = jax.vmap(_resolve)(ids_BK, known_BK, new_id_B, active_B, self.slot_entry[layer],
                                     self.slot_order[layer])
        with jax.named_scope("fetch"):
            fetched_BKW = self._fetch(layer, jnp.where(res.miss_K, page_BK, 0), jnp.where(res.miss_K, offset_BK, 0))
        p = self.pool.shape[2]
        pool = self.pool.at[layer, jnp.arange(b), jnp.where(new_id_B >= 0, res.new_slot, p)].set(new_row_BW,
                                                                                                 mode="drop")
        # the entries leaving the slots taken this step (-1: the slot was empty, or no taker)
        held_BJ = jnp.take_along_axis(self.slot_entry[layer], jnp.minimum(res.taker_J, p - 1), axis=1)
        evicted_BJ = jnp.where(res.taker_J < p, held_BJ, -1)
        # every read of the old maps happens before their in-place updates in _commit
        evicted_BJ, resident, slot_entry = jax.lax.optimization_barrier(
            (evicted_BJ, self.resident_slot, self.slot_entry))
        return Lookup(res, ids_BK, page_BK, offset_BK, fetched_BKW, res.hit_K | res.is_new_K, evicted_BJ,
                      new_row_BW, new_id_B, pool, resident, slot_entry)

    def _commit(self, layer: int, page_table_BX, look: Lookup) -> TieredLatents:
        """The fetched misses into their slots, residency (the new entry and the misses) and LRU state,
        counters, and the new entry staged for the host backup."""
        with jax.named_scope("pool_update"):
            res, b = look.res, look.ids_BK.shape[0]
            page_size, p, g = self.resident_slot.shape[2], self.pool.shape[2], self.resident_slot.shape[1]
            pool = look.pool.at[layer, jnp.arange(b)[:, None], jnp.where(res.miss_K, res.slot_K, p)].set(
                look.fetched_BKW, mode="drop")
            has_new_B = look.new_id_B >= 0
            write_BJ = jnp.concatenate([has_new_B[:, None], res.miss_K], axis=1)  # J = 1 + K arrivals per row
            slot_BJ = jnp.where(write_BJ, jnp.concatenate([res.new_slot[:, None], res.slot_K], axis=1), p)
            # residency: evicted entries leave first, then the new entry and the misses arrive
            ev_page_BJ, ev_offset_BJ = _locate(page_table_BX, look.evicted_BJ, page_size)
            resident = look.resident.at[layer, jnp.where(look.evicted_BJ >= 0, ev_page_BJ, g), ev_offset_BJ].set(
                -1, mode="drop")
            new_page_B1, new_offset_B1 = _locate(page_table_BX, look.new_id_B[:, None], page_size)
            arrive_page_BJ = jnp.where(write_BJ, jnp.concatenate([new_page_B1, look.page_BK], axis=1), g)
            arrive_offset_BJ = jnp.concatenate([new_offset_B1, look.offset_BK], axis=1)
            resident = resident.at[layer, arrive_page_BJ, arrive_offset_BJ].set(slot_BJ, mode="drop")
            counts = jnp.stack([(look.ids_BK >= 0).sum(), look.hit_BK.sum(), res.miss_K.sum(),
                                has_new_B.sum()]).astype(jnp.int32)
        return dataclasses.replace(
            self,
            pool=pool,
            slot_entry=look.slot_entry.at[layer].set(res.slot_entry_P),
            slot_order=self.slot_order.at[layer].set(res.order_P),
            resident_slot=resident,
            staged=self.staged.at[layer].set(look.new_row_BW),
            staged_page=new_page_B1[:, 0],  # the null page where no entry is new
            staged_offset=new_offset_B1[:, 0],
            counters=self.counters.at[layer].add(counts),
        )

    def _fetch(self, layer: int, page_BK: jax.Array, offset_BK: jax.Array) -> jax.Array:
        """Rows of the host store at (page, offset) ``[B, K, W]`` on the device."""
        shape = page_BK.shape + (self.pool.shape[-1],)
        if self.store is not None:
            return jax.pure_callback(lambda p, o: self.store.gather(layer, np.asarray(p), np.asarray(o)),
                                     jax.ShapeDtypeStruct(shape, self.pool.dtype), page_BK, offset_BK)
        # every operand of a host computation must live in host memory, the layer index included
        index = jax.device_put((jnp.full_like(page_BK, layer), page_BK, offset_BK), jax.memory.Space.Host)
        rows = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
            lambda store, l, p, o: store[l, p, o])(self.host, *index)
        return jax.device_put(rows, jax.memory.Space.Device)

    def begin_step(self) -> TieredLatents:
        """Back up the previous step's staged rows (batched over layers).

        inline: the pinned host store is written here, at the start of the next compiled step and
        before any fetch reads it (backing up at the end of the step would make XLA copy the whole
        store, since the step's fetches read it); rows staged for the null page (nothing pending) are
        harmless. split: the engine copies ``staged`` into the NumPy store right after each step.
        """
        return self if self.store is not None else self.flush()

    def flush(self) -> TieredLatents:
        """Write the staged rows to their host positions and mark nothing pending (inline)."""
        page_B, offset_B, staged = jax.device_put((self.staged_page, self.staged_offset, self.staged),
                                                  jax.memory.Space.Host)
        host = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
            lambda store, p, o, rows: store.at[:, p, o].set(rows))(self.host, page_B, offset_B, staged)
        return dataclasses.replace(self, host=host, staged_page=jnp.zeros_like(self.staged_page))


@dataclasses.dataclass
class Resolution:
    slot_K: jax.Array  # i32[K] slot of each selected position (-1 invalid)
    hit_K: jax.Array  # bool[K] resident before this step
    miss_K: jax.Array  # bool[K] fetched from the host this step
    is_new_K: jax.Array  # bool[K] the entry written this step
    new_slot: jax.Array  # i32[] the slot the new entry takes
    taker_J: jax.Array  # i32[K + 1] the slots taken this step, least recently used first (P = none)
    slot_entry_P: jax.Array  # i32[P] updated slot -> position table
    order_P: jax.Array  # i32[P] updated recency order


jax.tree_util.register_dataclass(Resolution)


@dataclasses.dataclass
class Lookup:
    """What ``TieredLatents._lookup`` hands to the attention and to ``_commit`` (K = top-k, P = slots)."""

    res: Resolution  # per row [B, ...]
    ids_BK: jax.Array  # i32[B, K] the step's selected ids (-1 = none)
    page_BK: jax.Array  # i32[B, K] their host page
    offset_BK: jax.Array  # i32[B, K] and offset
    fetched_BKW: jax.Array  # [B, K, W] missed rows from the host store (garbage where not a miss)
    hit_BK: jax.Array  # bool[B, K] hits and the new entry, all in the pool at res.slot_K
    evicted_BJ: jax.Array  # i32[B, K + 1] ids evicted from the taken slots this step, -1 none
    new_row_BW: jax.Array  # [B, W] the entry written this step (stored format)
    new_id_B: jax.Array  # i32[B] its id, -1 where no entry is new
    pool: jax.Array  # [L, R, P, W] the pool with the new entry written
    resident: jax.Array  # the residency map and slot table, read (barrier-ordered) before their writes
    slot_entry: jax.Array


def _check_decode(ids_BTK: jax.Array):
    if ids_BTK.shape[1] != 1:
        raise ValueError(f"the tier serves decode steps of one token per request, got T={ids_BTK.shape[1]}")


def _resolve(ids_K, known_K, new_id, active, slot_entry_P, order_P) -> Resolution:
    """LRU resolution for one (layer, request): ``known_K`` is the residency map's slot per id (ids
    are distinct, as top-k ids are), ``new_id`` the entry written this step (-1: none), ``active``
    whether the row runs at all, ``order_P`` the slots from least to most recently used.

    The new entry and the misses take, in that order, the first slots of ``order_P`` that no hit
    holds. Hits and takers together are at most K + 1 slots, so the takers lie within the order's
    first K + 1 positions. Every slot used this step then moves to the back of the order, by slot
    number, the others keeping theirs: the order stays sorted by (last use, slot), without a sort."""
    valid_K = ids_K >= 0
    has_new = new_id >= 0
    is_new_K = valid_K & (ids_K == new_id) & has_new
    hit_K = valid_K & ~is_new_K & (known_K >= 0)
    miss_K = valid_K & ~is_new_K & ~hit_K & active
    p, k = slot_entry_P.shape[0], ids_K.shape[0]
    hit_slot_K = jnp.where(hit_K, known_K, p)  # p = none
    front_J = order_P[: k + 1]  # J = K + 1 (the pool holds at least that many slots)
    free_J = ~(front_J[:, None] == hit_slot_K[None, :]).any(axis=1)
    rank_J = jnp.cumsum(free_J) - 1
    take_J = free_J & (rank_J < miss_K.sum() + has_new.astype(jnp.int32))
    taker_J = jnp.full(k + 1, p, jnp.int32).at[jnp.where(take_J, rank_J, k + 1)].set(front_J, mode="drop")
    new_slot = taker_J[0]
    miss_slot_K = taker_J[jnp.clip(has_new + jnp.cumsum(miss_K) - 1, 0, k)]  # after the new entry's slot
    slot_K = jnp.where(hit_K, known_K, jnp.where(is_new_K, new_slot, jnp.where(miss_K, miss_slot_K, -1)))
    # every taker is overwritten: the new entry's slot, then one per miss
    entries = slot_entry_P.at[jnp.where(has_new, new_slot, p)].set(new_id, mode="drop")
    entries = entries.at[jnp.where(miss_K, miss_slot_K, p)].set(ids_K, mode="drop")
    # the recency order: slots untouched this step keep their order, then the used ones by slot
    used_U = jnp.sort(jnp.concatenate([hit_slot_K, jnp.where(take_J, front_J, p)]))  # p = none
    used_P = jnp.zeros(p, bool).at[used_U].set(True, mode="drop")
    keep_P = ~used_P[order_P]
    n_keep = keep_P.sum()
    order = jnp.zeros(p, jnp.int32).at[jnp.where(keep_P, jnp.cumsum(keep_P) - 1, p)].set(order_P, mode="drop")
    order = order.at[jnp.where(used_U < p, n_keep + jnp.arange(used_U.shape[0]), p)].set(used_U, mode="drop")
    return Resolution(slot_K, hit_K, miss_K, is_new_K, new_slot, taker_J, entries, order)


def _locate(page_table_BX: jax.Array, ids_BK: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of request positions ``ids_BK``; -1 maps to the null page."""
    safe = jnp.maximum(ids_BK, 0)
    page = jnp.take_along_axis(page_table_BX, safe // page_size, axis=1)
    return jnp.where(ids_BK >= 0, page, 0), safe % page_size


def pool_slots(*, pool_size: int | None, pool_ratio: float | None, max_seq_len: int, index_topk: int) -> int:
    """Pool slots ``P`` per (layer, request): ``pool_size``, or ``pool_ratio`` of the longest request's
    entries raised to the minimum. The minimum is top-k + 1 (k hits plus the entry written this step),
    or every entry when requests are shorter than that."""
    minimum = min(min(index_topk, max_seq_len) + 1, max_seq_len)
    if pool_size is not None:
        if pool_size < minimum:
            raise ValueError(f"--pool-size {pool_size} is below the minimum {minimum} (index_topk + 1: the top-k "
                             "hits plus the entry written this step); raise it")
        return min(pool_size, max_seq_len)
    if pool_ratio is None or not 0 < pool_ratio <= 1:
        raise ValueError(f"--pool-ratio {pool_ratio} must be in (0, 1]")
    return min(max(math.ceil(pool_ratio * max_seq_len), minimum), max_seq_len)


def init_tiered(*, layers: int, batch: int, slots: int, num_pages: int, page_size: int, width: int, dtype,
                fetch: str, kernels: str = "xla") -> TieredLatents:
    """An empty tier; the host store is allocated directly in pinned host memory (inline) or NumPy."""
    if fetch not in FETCH_BACKENDS:
        raise ValueError(f"--fetch {fetch!r} is not a fetch backend; use one of {', '.join(FETCH_BACKENDS)}")
    host_shape = (layers, num_pages, page_size, width)
    store, host = None, None
    if fetch == "split":
        store = HostStore(host_shape, jnp.dtype(dtype))
    else:
        # zeros computed on the host side: the store never passes through device memory
        host = jax.jit(compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
            lambda: jnp.zeros(host_shape, dtype)))()
    return TieredLatents(
        pool=jnp.zeros((layers, batch, slots, width), dtype),
        slot_entry=jnp.full((layers, batch, slots), -1, jnp.int32),
        slot_order=jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (layers, batch, slots)),
        resident_slot=jnp.full((layers, num_pages, page_size), -1, jnp.int32),
        staged=jnp.zeros((layers, batch, width), dtype),
        staged_page=jnp.zeros((batch,), jnp.int32),
        staged_offset=jnp.zeros((batch,), jnp.int32),
        counters=jnp.zeros((layers, 4), jnp.int32),
        host=host,
        store=store,
        kernels=kernels,
    )


def _warm_layer(ids_QK, prompt_len, slots: int, capacity: int):
    """Pool contents for one layer after prefill: the ``slots`` most recently selected positions of
    the last prompt queries (their top-k ids in order, ``ids_QK``), or the whole prompt if it fits.
    Returns ``slot_entry i32[P]`` (-1 empty) and the recency order ``i32[P]`` (empty slots first)."""
    flat = ids_QK.reshape(-1)
    order = jnp.arange(flat.shape[0], dtype=jnp.int32)
    seen_S = jnp.full((capacity,), -1, jnp.int32).at[jnp.where(flat >= 0, flat, capacity)].max(order, mode="drop")
    every_S = jnp.where(jnp.arange(capacity) < prompt_len, jnp.arange(capacity, dtype=jnp.int32), -1)
    seen_S = jnp.where(prompt_len <= slots, every_S, seen_S)
    stamp, entry = jax.lax.top_k(seen_S, slots)
    held = stamp >= 0
    return jnp.where(held, entry, -1), jnp.argsort(jnp.where(held, stamp, -1), stable=True).astype(jnp.int32)


def warm(tier: TieredLatents, scratch_pages_LGZW, scratch_table_X, pages_X, slot, prompt_len, ids_LQK
         ) -> TieredLatents:
    """Fill batch row ``slot``'s pools (every layer) from the prefill scratch: ESS LRU-Warmup with the
    top-k ids of the last prompt queries. Also clears the residency of the request's pages, which
    may hold stale slots of an earlier request."""
    layers, _, slots, _ = tier.pool.shape
    page_size = tier.resident_slot.shape[2]
    capacity = pages_X.shape[0] * page_size
    entry_LP, order_LP = jax.vmap(_warm_layer, in_axes=(0, None, None, None))(ids_LQK, prompt_len, slots, capacity)
    safe = jnp.maximum(entry_LP, 0)
    rows_LPW = jax.vmap(lambda pages, e: pages[scratch_table_X[e // page_size], e % page_size])(scratch_pages_LGZW,
                                                                                               safe)
    resident = tier.resident_slot.at[:, pages_X].set(-1)
    g = resident.shape[1]
    page_LP = jnp.where(entry_LP >= 0, pages_X[safe // page_size], g)
    resident = resident.at[jnp.arange(layers)[:, None], page_LP, safe % page_size].set(
        jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), entry_LP.shape), mode="drop")
    return dataclasses.replace(
        tier,
        pool=tier.pool.at[:, slot].set(rows_LPW.astype(tier.pool.dtype)),
        slot_entry=tier.slot_entry.at[:, slot].set(entry_LP),
        slot_order=tier.slot_order.at[:, slot].set(order_LP),
        resident_slot=resident,
    )


def store_prompt(tier: TieredLatents, scratch_pages_LGZW, scratch_table_X, pages_X) -> TieredLatents:
    """Write the prompt's rows from the prefill scratch to the host store (inline backend)."""
    rows = scratch_pages_LGZW[:, scratch_table_X]  # [L, X, Z, W]; unused columns copy to the null page
    rows, pages_X = jax.device_put((rows, pages_X), jax.memory.Space.Host)
    host = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
        lambda store, p, r: store.at[:, p].set(r))(tier.host, pages_X, rows)
    return dataclasses.replace(tier, host=host)


def release(tier: TieredLatents, row, pages_X) -> TieredLatents:
    """Empty batch row ``row``'s pools (every layer) and the residency of the request's host pages
    ``pages_X`` (0 = none), when the request finishes or is aborted: the tier then holds nothing of it."""
    slots = tier.slot_entry.shape[2]
    return dataclasses.replace(
        tier,
        slot_entry=tier.slot_entry.at[:, row].set(-1),
        slot_order=tier.slot_order.at[:, row].set(jnp.arange(slots, dtype=jnp.int32)),
        resident_slot=tier.resident_slot.at[:, pages_X].set(-1),
    )

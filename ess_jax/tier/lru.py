"""The tier's device pool bookkeeping: per (sparse layer, batch row) ``P`` slots with an LRU over them.

``LruPool`` holds which entry each slot has (``slot_entry``), the slots from least to most recently used
(``slot_order``) and the residency map entry -> slot (``resident_slot``, per batch row over its request's entry
ids, so a hit costs one gather, not a k x P comparison, and requests sharing the host pages of a cached prefix
each keep their own residency). ``resolve`` is one step's resolution for one (layer, row); it
knows no rows, stores or attention. Axis letters: ess_jax.notation (P pool slots, K1 = K + 1: the slots one
step can take, the new entry and one per miss).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

WARMUP_QUERIES = 32  # prompt positions whose top-k warm the pool (ESS LRU-Warmup)


def pool_slots(entries: int, topk: int, *, pool_size: int | None = None, pool_ratio: float | None = None) -> int:
    """Pool slots ``P`` per (layer, request) for requests of up to ``entries`` entries: ``pool_size``, or
    ``pool_ratio`` of ``entries`` raised to the minimum. The minimum is top-k + 1 (k hits plus the entry
    written this step), or every entry when requests have fewer."""
    minimum = min(min(topk, entries) + 1, entries)
    if pool_size is not None:
        if pool_size < minimum:
            raise ValueError(f"--pool-size {pool_size} is below the minimum {minimum} (index_topk + 1: the top-k "
                             "hits plus the entry written this step); raise it")
        return min(pool_size, entries)
    if pool_ratio is None or not 0 < pool_ratio <= 1:
        raise ValueError(f"--pool-ratio {pool_ratio} must be in (0, 1]")
    return min(max(math.ceil(pool_ratio * entries), minimum), entries)


@dataclasses.dataclass
class Resolution:
    """One step's resolution for one (layer, row)."""

    slot_K: jax.Array  # i32[K] slot of each selected entry (-1 invalid)
    hit_K: jax.Array  # bool[K] resident before this step
    miss_K: jax.Array  # bool[K] fetched from the host this step
    is_new_K: jax.Array  # bool[K] the entry written this step
    new_slot: jax.Array  # i32[] the slot the new entry takes
    taker_K1: jax.Array  # i32[K + 1] the slots taken this step, least recently used first (P = none)
    slot_entry_P: jax.Array  # i32[P] updated slot -> entry table
    order_P: jax.Array  # i32[P] updated recency order


jax.tree_util.register_dataclass(Resolution)


def resolve(ids_K, known_K, new_id, active, slot_entry_P, order_P) -> Resolution:
    """LRU resolution for one (layer, row): ``known_K`` is the residency map's slot per id (ids are
    distinct, as top-k ids are), ``new_id`` the entry written this step (-1: none), ``active`` whether the
    row runs at all, ``order_P`` the slots from least to most recently used.

    The new entry and the misses take, in that order, the first slots of ``order_P`` that no hit holds.
    Hits and takers together are at most K + 1 slots, so the takers lie within the order's first K + 1
    positions. Every slot used this step then moves to the back of the order, by slot number, the others
    keeping theirs: the order stays sorted by (last use, slot), without a sort."""
    valid_K = ids_K >= 0
    has_new = new_id >= 0
    is_new_K = valid_K & (ids_K == new_id) & has_new
    hit_K = valid_K & ~is_new_K & (known_K >= 0)
    miss_K = valid_K & ~is_new_K & ~hit_K & active
    p, k = slot_entry_P.shape[0], ids_K.shape[0]
    hit_slot_K = jnp.where(hit_K, known_K, p)  # p = none
    front_K1 = order_P[: k + 1]  # the pool holds at least K + 1 slots
    free_K1 = ~(front_K1[:, None] == hit_slot_K[None, :]).any(axis=1)
    rank_K1 = jnp.cumsum(free_K1) - 1
    take_K1 = free_K1 & (rank_K1 < miss_K.sum() + has_new.astype(jnp.int32))
    taker_K1 = jnp.full(k + 1, p, jnp.int32).at[jnp.where(take_K1, rank_K1, k + 1)].set(front_K1, mode="drop")
    new_slot = taker_K1[0]
    miss_slot_K = taker_K1[jnp.clip(has_new + jnp.cumsum(miss_K) - 1, 0, k)]  # after the new entry's slot
    slot_K = jnp.where(hit_K, known_K, jnp.where(is_new_K, new_slot, jnp.where(miss_K, miss_slot_K, -1)))
    # every taker is overwritten: the new entry's slot, then one per miss
    entries = slot_entry_P.at[jnp.where(has_new, new_slot, p)].set(new_id, mode="drop")
    entries = entries.at[jnp.where(miss_K, miss_slot_K, p)].set(ids_K, mode="drop")
    # the recency order: slots untouched this step keep their order, then the used ones by slot
    used = jnp.sort(jnp.concatenate([hit_slot_K, jnp.where(take_K1, front_K1, p)]))  # p = none
    used_P = jnp.zeros(p, bool).at[used].set(True, mode="drop")
    keep_P = ~used_P[order_P]
    n_keep = keep_P.sum()
    order = jnp.zeros(p, jnp.int32).at[jnp.where(keep_P, jnp.cumsum(keep_P) - 1, p)].set(order_P, mode="drop")
    order = order.at[jnp.where(used < p, n_keep + jnp.arange(used.shape[0]), p)].set(used, mode="drop")
    return Resolution(slot_K, hit_K, miss_K, is_new_K, new_slot, taker_K1, entries, order)


def warm_layer(ids_TK, count, slots: int, capacity: int):
    """Pool contents for one layer after prefill: the ``slots`` most recently selected entries of the last
    prompt queries (their top-k ids in order, ``ids_TK``), or all ``count`` entries if they fit.
    Returns ``slot_entry i32[P]`` (-1 empty) and the recency order ``i32[P]`` (empty slots first)."""
    flat = ids_TK.reshape(-1)
    order = jnp.arange(flat.shape[0], dtype=jnp.int32)
    seen = jnp.full((capacity,), -1, jnp.int32).at[jnp.where(flat >= 0, flat, capacity)].max(order, mode="drop")
    every = jnp.where(jnp.arange(capacity) < count, jnp.arange(capacity, dtype=jnp.int32), -1)
    seen = jnp.where(count <= slots, every, seen)
    stamp, entry = jax.lax.top_k(seen, slots)
    held = stamp >= 0
    return jnp.where(held, entry, -1), jnp.argsort(jnp.where(held, stamp, -1), stable=True).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LruPool:
    """Slot tables and the residency map of every sparse layer (B batch rows, P slots each, E entry ids a row)."""

    slot_entry: jax.Array  # i32[L, B, P] entry held by each slot, -1 = empty
    slot_order: jax.Array  # i32[L, B, P] the slots from least to most recently used (empty ones first)
    resident_slot: jax.Array  # i32[L, B, E] slot holding each entry of the row's request, -1 = host only

    @classmethod
    def empty(cls, *, layers: int, rows: int, slots: int, entries: int) -> LruPool:
        return cls(slot_entry=jnp.full((layers, rows, slots), -1, jnp.int32),
                   slot_order=jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (layers, rows, slots)),
                   resident_slot=jnp.full((layers, rows, entries), -1, jnp.int32))

    @property
    def slots(self) -> int:
        return self.slot_entry.shape[2]

    def lookup(self, layer, ids_BK, new_id_B, active_B) -> tuple[Resolution, jax.Array]:
        """Resolve layer ``layer``'s ids (an int, or i32[] inside a scan over layers): the resolution per row
        and the entries leaving the taken slots ``i32[B, K + 1]`` (-1: the slot was empty, or no taker)."""
        rows_B1 = jnp.arange(ids_BK.shape[0])[:, None]
        known_BK = jnp.where(ids_BK >= 0, self.resident_slot[layer, rows_B1, jnp.maximum(ids_BK, 0)], -1)
        res = jax.vmap(resolve)(ids_BK, known_BK, new_id_B, active_B, self.slot_entry[layer], self.slot_order[layer])
        p = self.slots
        held_BK1 = jnp.take_along_axis(self.slot_entry[layer], jnp.minimum(res.taker_K1, p - 1), axis=1)
        return res, jnp.where(res.taker_K1 < p, held_BK1, -1)

    def commit(self, layer, res: Resolution, ids_BK, new_id_B, evicted_BK1) -> LruPool:
        """Residency (evicted entries leave first, then the new entry and the misses arrive) and the slot
        tables after the step."""
        p, e = self.slots, self.resident_slot.shape[2]
        rows_B1 = jnp.arange(ids_BK.shape[0])[:, None]
        has_new_B = new_id_B >= 0
        write_BK1 = jnp.concatenate([has_new_B[:, None], res.miss_K], axis=1)  # the new entry, then each miss
        slot_BK1 = jnp.where(write_BK1, jnp.concatenate([res.new_slot[:, None], res.slot_K], axis=1), p)
        resident = self.resident_slot.at[layer, rows_B1, jnp.where(evicted_BK1 >= 0, evicted_BK1, e)].set(
            -1, mode="drop")
        arrive_BK1 = jnp.concatenate([new_id_B[:, None], ids_BK], axis=1)
        resident = resident.at[layer, rows_B1, jnp.where(write_BK1, arrive_BK1, e)].set(slot_BK1, mode="drop")
        return LruPool(self.slot_entry.at[layer].set(res.slot_entry_P), self.slot_order.at[layer].set(res.order_P),
                       resident)

    def warm(self, row, entry_LP, order_LP) -> LruPool:
        """Batch row ``row``'s pools (every layer) after prefill: slot tables ``entry_LP`` / ``order_LP`` and
        the residency of those entries; the row's residency is cleared first (it may hold stale slots of an
        earlier request)."""
        layers, e = entry_LP.shape[0], self.resident_slot.shape[2]
        resident = self.resident_slot.at[:, row].set(-1, mode="drop")
        resident = resident.at[jnp.arange(layers)[:, None], row, jnp.where(entry_LP >= 0, entry_LP, e)].set(
            jnp.broadcast_to(jnp.arange(self.slots, dtype=jnp.int32), entry_LP.shape), mode="drop")
        return LruPool(self.slot_entry.at[:, row].set(entry_LP, mode="drop"),
                       self.slot_order.at[:, row].set(order_LP, mode="drop"), resident)

    def release(self, row) -> LruPool:
        """Empty batch row ``row``'s pools and residency (a row past the last: none)."""
        return LruPool(self.slot_entry.at[:, row].set(-1, mode="drop"),
                       self.slot_order.at[:, row].set(jnp.arange(self.slots, dtype=jnp.int32), mode="drop"),
                       self.resident_slot.at[:, row].set(-1, mode="drop"))

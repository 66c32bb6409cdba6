"""The tier's device pool bookkeeping: per (sparse layer, batch row) ``P`` slots with an LRU over them.

``LruPool`` holds which entry each slot has (``slot_entry``), the slots from least to most recently used
(``slot_order``) and the residency map entry -> slot (``resident_slot``, per batch row over its request's entry
ids, so a hit costs one gather, not a k x P comparison, and requests sharing the host pages of a cached prefix
each keep their own residency). ``resolve`` is one step's resolution for one (layer, row); it
knows no rows, stores or attention. Axis letters: ess_jax.notation (P pool slots, K1 = K + 1: the slots one
step can take, the new entry and one per miss; in a verification step K1 = min(P, K + M): M new entries and
K the union of its queries' top-k ids).
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
    """One step's resolution for one (layer, row). ``K``: the step's selected ids (one query's top-k, or the union
    of a verification step's queries' top-k ids); ``M``: the entries the step writes; ``K1``: the slots the step
    may take, ``min(P, K + M)``."""

    slot_K: jax.Array  # i32[K] slot of each selected entry (-1 invalid, or a miss the pool had no room for)
    hit_K: jax.Array  # bool[K] resident before this step
    miss_K: jax.Array  # bool[K] fetched from the host this step
    is_new_K: jax.Array  # bool[K] an entry written this step
    new_slot: jax.Array  # i32[M] the slot each new entry takes (P = none)
    taker_K1: jax.Array  # i32[K1] the slots taken this step, in the order they are taken (P = none)
    slot_entry_P: jax.Array  # i32[P] updated slot -> entry table
    order_P: jax.Array  # i32[P] updated recency order


jax.tree_util.register_dataclass(Resolution)


def resolve(ids_K, known_K, new_ids_M, active, slot_entry_P, order_P) -> Resolution:
    """LRU resolution for one (layer, row): ``known_K`` is the residency map's slot per id (ids are
    distinct, as top-k ids and their union are), ``new_ids_M`` the entries written this step (-1: none),
    ``active`` whether the row runs at all, ``order_P`` the slots from least to most recently used.

    The new entries and then the misses take, in that order, the first slots of ``order_P`` that no hit holds.
    With one query (K + 1 <= P) there is always room; a verification step's union may have more hits and misses
    than the pool has slots: then a new entry takes the least recently used hit's slot (the hit is read before
    the slot is written), and misses without a slot are attended from the fetched rows without being kept.
    Takers lie within the order's first ``K1 = min(P, K + M)`` positions. Every slot used this step then moves
    to the back of the order, by slot number, the others keeping theirs: the order stays sorted by (last use,
    slot), without a sort."""
    has_new_M = new_ids_M >= 0
    is_new_K, hit_K, miss_K = classify(ids_K, known_K, new_ids_M, active)
    p, k, m = slot_entry_P.shape[0], ids_K.shape[0], new_ids_M.shape[0]
    f = min(p, k + m)
    hit_slot_K = jnp.where(hit_K, known_K, p)  # p = none
    held_P = jnp.zeros(p, bool).at[hit_slot_K].set(True, mode="drop")
    front_K1 = order_P[:f]
    held_K1 = held_P[front_K1]
    free = (~held_K1).sum()
    # candidates: the front's free slots, then its hits' slots, each in recency order
    rank_K1 = jnp.where(held_K1, free + jnp.cumsum(held_K1) - 1, jnp.cumsum(~held_K1) - 1)
    candidate_K1 = jnp.zeros(f, jnp.int32).at[rank_K1].set(front_K1)
    n_new = has_new_M.sum()
    new_slot = jnp.where(has_new_M, candidate_K1[jnp.clip(jnp.cumsum(has_new_M) - 1, 0, f - 1)], p)
    miss_rank_K = n_new + jnp.cumsum(miss_K) - 1  # after the new entries' slots
    kept_K = miss_K & (miss_rank_K < free)
    miss_slot_K = jnp.where(kept_K, candidate_K1[jnp.clip(miss_rank_K, 0, f - 1)], p)
    new_of_K = jnp.argmax(ids_K[:, None] == new_ids_M[None, :], axis=1)
    slot_K = jnp.where(hit_K, known_K, jnp.where(is_new_K, new_slot[new_of_K], jnp.where(kept_K, miss_slot_K, -1)))
    taken = n_new + kept_K.sum()
    taker_K1 = jnp.where(jnp.arange(f) < taken, candidate_K1, p)
    # every taker is overwritten: the new entries' slots, then one per kept miss
    entries = slot_entry_P.at[new_slot].set(new_ids_M, mode="drop")
    entries = entries.at[miss_slot_K].set(ids_K, mode="drop")
    # the recency order: slots untouched this step keep their order, then the used ones by slot
    used_P = held_P.at[taker_K1].set(True, mode="drop")
    keep_P = ~used_P[order_P]
    n_keep = keep_P.sum()
    order = jnp.zeros(p, jnp.int32).at[jnp.where(keep_P, jnp.cumsum(keep_P) - 1, p)].set(order_P, mode="drop")
    order = order.at[jnp.where(used_P, n_keep + jnp.cumsum(used_P) - 1, p)].set(jnp.arange(p, dtype=jnp.int32),
                                                                                mode="drop")
    return Resolution(slot_K, hit_K, miss_K, is_new_K, new_slot, taker_K1, entries, order)


def classify(ids_K, known_K, new_ids_M, active) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each selected id of one (layer, row) as ``bool[K]`` (new, hit, miss): written this step (one of
    ``new_ids_M``), resident before it (``known_K``: its slot, -1 none), or to be fetched from the host (the row
    runs, ``active``); -1 ids are none of them."""
    valid_K = ids_K >= 0
    is_new_K = valid_K & (ids_K[:, None] == jnp.where(new_ids_M >= 0, new_ids_M, -2)[None, :]).any(axis=1)
    hit_K = valid_K & ~is_new_K & (known_K >= 0)
    return is_new_K, hit_K, valid_K & ~is_new_K & ~hit_K & active


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

    def lookup(self, layer, ids_BK, new_ids_BM, active_B) -> tuple[Resolution, jax.Array]:
        """Resolve layer ``layer``'s ids (an int, or i32[] inside a scan over layers) and the step's new entries
        ``new_ids_BM``: the resolution per row and the entries leaving the taken slots ``i32[B, K1]`` (-1: the
        slot was empty, or no taker)."""
        res = jax.vmap(resolve)(ids_BK, self._known(layer, ids_BK), new_ids_BM, active_B, self.slot_entry[layer],
                                self.slot_order[layer])
        p = self.slots
        held_BK1 = jnp.take_along_axis(self.slot_entry[layer], jnp.minimum(res.taker_K1, p - 1), axis=1)
        return res, jnp.where(res.taker_K1 < p, held_BK1, -1)

    def misses(self, layer, ids_BK, new_ids_BM, active_B) -> jax.Array:
        """``bool[B, K]``: the ids ``lookup`` would fetch for layer ``layer`` now, without resolving slots (what a
        full layer of Index Share fetches ahead for the shared layers that read its ids)."""
        return jax.vmap(classify)(ids_BK, self._known(layer, ids_BK), new_ids_BM, active_B)[2]

    def _known(self, layer, ids_BK) -> jax.Array:
        """The residency map's slot of each id ``i32[B, K]`` of layer ``layer`` (-1: host only, or no id)."""
        rows_B1 = jnp.arange(ids_BK.shape[0])[:, None]
        return jnp.where(ids_BK >= 0, self.resident_slot[layer, rows_B1, jnp.maximum(ids_BK, 0)], -1)

    def commit(self, layer, res: Resolution, ids_BK, new_ids_BM, evicted_BK1) -> LruPool:
        """Residency (evicted entries leave first, then the new entries and the kept misses arrive) and the slot
        tables after the step."""
        p, e = self.slots, self.resident_slot.shape[2]
        rows_B1 = jnp.arange(ids_BK.shape[0])[:, None]
        # the new entries, then each miss given a slot
        write_BA = jnp.concatenate([new_ids_BM >= 0, res.miss_K & (res.slot_K >= 0)], axis=1)
        slot_BA = jnp.where(write_BA, jnp.concatenate([res.new_slot, res.slot_K], axis=1), p)
        resident = self.resident_slot.at[layer, rows_B1, jnp.where(evicted_BK1 >= 0, evicted_BK1, e)].set(
            -1, mode="drop")
        arrive_BA = jnp.concatenate([new_ids_BM, ids_BK], axis=1)
        resident = resident.at[layer, rows_B1, jnp.where(write_BA, arrive_BA, e)].set(slot_BA, mode="drop")
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

    def forget(self, drop_LBP) -> LruPool:
        """Empty the slots ``drop_LBP`` (their entries leave the residency map), moved to the front of each recency
        order, the others keeping theirs (empty slots stay first)."""
        l, b, _ = drop_LBP.shape
        e = self.resident_slot.shape[2]
        layers, rows = jnp.arange(l)[:, None, None], jnp.arange(b)[None, :, None]
        resident = self.resident_slot.at[layers, rows, jnp.where(drop_LBP, self.slot_entry, e)].set(-1, mode="drop")
        dropped_LBP = jnp.take_along_axis(drop_LBP, self.slot_order, axis=-1)  # in recency order
        n_LB1 = dropped_LBP.sum(-1, keepdims=True)
        place_LBP = jnp.where(dropped_LBP, jnp.cumsum(dropped_LBP, -1) - 1, n_LB1 + jnp.cumsum(~dropped_LBP, -1) - 1)
        scatter = lambda place_P, order_P: jnp.zeros_like(order_P).at[place_P].set(order_P)  # noqa: E731
        order = jax.vmap(jax.vmap(scatter))(place_LBP, self.slot_order)
        return LruPool(jnp.where(drop_LBP, -1, self.slot_entry), order, resident)

    def release(self, row) -> LruPool:
        """Empty batch row ``row``'s pools and residency (a row past the last: none)."""
        return LruPool(self.slot_entry.at[:, row].set(-1, mode="drop"),
                       self.slot_order.at[:, row].set(jnp.arange(self.slots, dtype=jnp.int32), mode="drop"),
                       self.resident_slot.at[:, row].set(-1, mode="drop"))

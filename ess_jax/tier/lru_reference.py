"""A plain-NumPy reference of the tier's LRU for one (layer, batch row) pool: ``Pool.warmed`` is
``lru.warm_layer``, ``Pool.step`` is ``lru.resolve``, written from the policy's definition: each slot keeps
the stamp of its last use, and the least recently used slot is the one of smallest (stamp, slot)
(``lru`` keeps that order without a sort). The tests hold ``lru`` to it; ``replay`` counts what the
tier's device counters count over a request's recorded top-k ids, at any pool size. Axis letters:
ess_jax.notation (P pool slots, K top-k, L layers, T warm-up queries, S decode steps).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Step:
    """One step's resolution (as ``lru.Resolution``)."""

    hit_K: np.ndarray  # bool[K] resident before this step
    miss_K: np.ndarray  # bool[K] fetched from the host this step
    is_new_K: np.ndarray  # bool[K] the entry written this step
    takers: list[int]  # the slots taken this step: the new entry's first, then one per miss, in id order


class Pool:
    """P slots over the entries ``[0, entries)`` of one (layer, batch row)."""

    def __init__(self, slots: int, entries: int):
        self.entry_P = np.full(slots, -1, np.int64)  # entry held by each slot, -1 = empty
        self.stamp_P = np.full(slots, -1, np.int64)  # last use of each slot, -1 = never
        self.slot_of = np.full(entries, -1, np.int64)  # the residency map: entry -> slot, -1 = host only
        self.clock = 0  # the next step's stamp

    @classmethod
    def warmed(cls, warm_TK: np.ndarray, count: int, slots: int, entries: int) -> Pool:
        """The pool after prefill: all ``count`` prompt entries if they fit, else the ``slots`` entries last
        selected by the warm-up queries' ids ``warm_TK`` (-1 = none), stamped with their last index in the
        flattened ids. Slot i holds the i-th most recent."""
        if count <= slots:
            stamps = {e: e for e in range(count)}
        else:
            stamps = {int(e): i for i, e in enumerate(warm_TK.reshape(-1)) if e >= 0}  # the last occurrence wins
        pool = cls(slots, entries)
        for slot, entry in enumerate(sorted(stamps, key=stamps.get, reverse=True)[:slots]):
            pool.entry_P[slot], pool.stamp_P[slot], pool.slot_of[entry] = entry, stamps[entry], slot
        pool.clock = max(stamps.values(), default=-1) + 1
        return pool

    @property
    def order_P(self) -> np.ndarray:
        """The slots from least to most recently used, by (stamp, slot): the empty ones first."""
        return np.lexsort((np.arange(self.stamp_P.size), self.stamp_P))

    def step(self, ids_K: np.ndarray, new_id: int) -> Step:
        """One decode step: the selected entries ``ids_K`` (distinct; -1 = none), ``new_id`` the entry written
        this step (-1 = none). The new entry, then the misses in id order, take the least recently used slots
        that no hit holds, evicting their entries; every slot used this step (hits and takers) then becomes
        the most recent."""
        ids_K = np.asarray(ids_K)
        valid_K = ids_K >= 0
        is_new_K = valid_K & (ids_K == new_id) & (new_id >= 0)
        known_K = np.where(valid_K, self.slot_of[np.where(valid_K, ids_K, 0)], -1)
        hit_K = valid_K & ~is_new_K & (known_K >= 0)
        miss_K = valid_K & ~is_new_K & ~hit_K
        arrivals = ([int(new_id)] if new_id >= 0 else []) + ids_K[miss_K].tolist()
        hit_slots = known_K[hit_K]
        order = self.order_P
        takers = order[~np.isin(order, hit_slots)][:len(arrivals)].tolist()
        for slot, entry in zip(takers, arrivals):
            if self.entry_P[slot] >= 0:
                self.slot_of[self.entry_P[slot]] = -1
            self.entry_P[slot], self.slot_of[entry] = entry, slot
        self.stamp_P[hit_slots] = self.stamp_P[takers] = self.clock
        self.clock += 1
        return Step(hit_K, miss_K, is_new_K, takers)


def replay(warm_LTK: np.ndarray, ids_LSK: np.ndarray, new_S: np.ndarray, prompt_entries: int, entries: int,
           slots: int) -> np.ndarray:
    """Lookups, hits and misses ``i64[L, 3]`` of one request, as the tier's device counters count them, with
    ``slots`` pool slots per layer: each layer's pool ``Pool.warmed`` from the warm-up queries' ids
    ``warm_LTK`` and the prompt's ``prompt_entries`` entries, then one ``Pool.step`` per decode step with its
    ids ``ids_LSK`` and new entry ``new_S`` (-1 = none), of ``entries`` entries in all. Every valid id is a
    lookup; a hit or a selected new entry counts as a hit."""
    counts = np.zeros((ids_LSK.shape[0], 3), np.int64)
    for layer, (warm_TK, ids_SK) in enumerate(zip(warm_LTK, ids_LSK)):
        pool = Pool.warmed(warm_TK, prompt_entries, slots, entries)
        for ids_K, new_id in zip(ids_SK, new_S):
            step = pool.step(ids_K, int(new_id))
            counts[layer] += ((ids_K >= 0).sum(), step.hit_K.sum() + step.is_new_K.sum(), step.miss_K.sum())
    return counts

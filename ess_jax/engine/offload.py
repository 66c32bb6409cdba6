"""Where the offloaded part of the cache lives (V3.2's latent rows, V4's CSA entries) while the engine runs, chosen
once when the engine is built: ``Resident`` (every part on the device) or ``Ess`` (the part in a host store behind an
LRU device pool, ``ess_jax.tier``). Their static half (sizes, cache builders, the steps they add) is
``layout.MODE_SPECS``. Both answer the same calls, so nothing else in the engine asks which it has. The runner owns
the decode cache: each call takes it and returns it, the mode holding only what is its own (``Ess``: the prefill
scratch):

- ``decode_cache``: the empty decode cache of a size; ``place``: the decode cache's shardings (and ``Ess`` its
  scratch, built by the runner's ``build``); ``prefill_on``: what prefill pieces run on (the decode cache, the
  scratch);
- ``prefill``: run a prefill group through the runner's ``run`` (``Ess``: on a device scratch of one prompt per data
  shard, then the finished prompts handed off to the decode cache and the host store);
- ``release``: empty what ended requests held on the device; ``flush``: the last step's rows to the host;
- ``usage``, ``metrics``, ``cache_bytes``: what the mode adds to the engine's reports."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import jax
import jax.numpy as jnp

from ess_jax import families, mesh, tier
from ess_jax.engine import steps
from ess_jax.engine.config import EngineConfig, Offload
from ess_jax.engine.layout import MODE_SPECS, CacheLayout
from ess_jax.engine.plan import EngineStats, PrefillGroup, Released

Run = Callable  # (cache, shardings, window, group, table_DX, row_D, rows) -> (cache, window, result): the runner's
# prefill of ``group`` on ``cache`` (``rows`` batch rows per data shard), each shard's page table and batch row given


class Mode(Protocol):
    """What the runner and the engine ask of the offload mode (``Resident`` or ``Ess``)."""

    def decode_cache(self, size: families.CacheSize): ...
    def place(self, build: Callable, shardings: mesh.Layout | None) -> None: ...
    def prefill_on(self, cache, shardings: mesh.Layout | None) -> tuple: ...
    def prefill(self, cache, window, group: PrefillGroup, *, run: Run) -> tuple: ...
    def release(self, cache, released: list[Released]): ...
    def flush(self, cache): ...
    def usage(self, cache, scheduled: dict) -> dict: ...
    def metrics(self, cache) -> dict | None: ...
    def cache_bytes(self, cache) -> dict[str, int]: ...


class Resident:
    """Every part on the device: prompts prefill straight into the decode cache; nothing moves."""

    def __init__(self, module, config: EngineConfig, layout: CacheLayout, stats: EngineStats):
        self.module, self.config, self.layout = module, config, layout
        self.rows_per_shard = config.max_batch // layout.size.shards
        self.shardings = None

    def decode_cache(self, size: families.CacheSize):
        return MODE_SPECS[Offload.NONE].decode_cache(self.module, size, self.config, self.layout)

    def place(self, build: Callable, shardings: mesh.Layout | None) -> None:
        self.shardings = shardings

    def prefill_on(self, cache, shardings: mesh.Layout | None) -> tuple:
        """What prefill pieces run on, and its shardings: the decode cache itself."""
        return cache, shardings

    def prefill(self, cache, window, group: PrefillGroup, *, run: Run) -> tuple:
        """The decode cache, the window and the result after ``group``, run on the decode cache."""
        table_DX = np.zeros((self.layout.size.shards, self.layout.pages_per_row), np.int32)
        row_D = np.zeros(self.layout.size.shards, np.int32)
        for shard, piece in group.slices.items():
            table_DX[shard], row_D[shard] = piece.pages_X, piece.row % self.rows_per_shard
        return run(cache, self.shardings, window, group, table_DX, row_D, self.rows_per_shard)

    def release(self, cache, released: list[Released]):
        """Nothing to empty: a freed row's pages are overwritten before they are read again."""
        return cache

    def flush(self, cache):
        """No host store."""
        return cache

    def usage(self, cache, scheduled: dict) -> dict:
        return {}

    def metrics(self, cache) -> dict | None:
        return None

    def cache_bytes(self, cache) -> dict[str, int]:
        return {"device_bytes": int(sum(x.nbytes for x in jax.tree.leaves(cache))), "host_bytes": 0}


class Ess:
    """The offloaded part in each data shard's host store, an LRU pool of ``pool_slots`` slots per (layer, batch
    row) of it on the device (``ess_jax.tier``). A prompt prefills on a scratch cache (one row per data shard, its
    pages 1..n), then hands off: its rows to the host store, its resident parts into the decode cache, its pool
    warmed from the top-k of its last prompt queries (the runner's window)."""

    def __init__(self, module, config: EngineConfig, layout: CacheLayout, stats: EngineStats):
        self.module, self.config, self.layout, self.stats = module, config, layout, stats
        self.family = families.get(module.cfg.family)
        self.shards, self.rows_per_shard = layout.size.shards, config.max_batch // layout.size.shards
        self.shardings = self.scratch = self.scratch_shardings = None

    def decode_cache(self, size: families.CacheSize):
        return MODE_SPECS[Offload.ESS].decode_cache(self.module, size, self.config, self.layout)

    def place(self, build: Callable, shardings: mesh.Layout | None) -> None:
        """The decode cache's ``shardings``; the prefill scratch, built and placed by the runner's ``build``."""
        self.shardings = shardings
        self.scratch, self.scratch_shardings = build(*MODE_SPECS[Offload.ESS].prefill_cache(self.module, self.config,
                                                                                             self.layout))

    def prefill_on(self, cache, shardings: mesh.Layout | None) -> tuple:
        """What prefill pieces run on, and its shardings: the scratch."""
        return self.scratch, self.scratch_shardings

    def _scratch_table(self, pages_X: np.ndarray) -> np.ndarray:
        """A prompt's scratch pages: 1..n where it has pages."""
        return np.where(pages_X > 0, np.arange(1, pages_X.size + 1), 0).astype(np.int32)

    def prefill(self, cache, window, group: PrefillGroup, *, run: Run) -> tuple:
        """The decode cache, the window and the result after ``group``, run on the scratch: the cached prefixes of
        the prompts starting past them loaded first, the prompts it finishes handed off after."""
        table_DX = np.zeros((self.shards, self.layout.pages_per_row), np.int32)
        for shard, piece in group.slices.items():
            table_DX[shard] = self._scratch_table(piece.pages_X)
        starting = {shard: piece for shard, piece in group.slices.items()
                    if piece.cached and piece.first}  # their first piece: past a cached prefix
        if starting:
            self.scratch = self._load_prefix(cache, starting)
        self.scratch, window, result = run(self.scratch, self.scratch_shardings, window, group, table_DX,
                                           np.zeros(self.shards, np.int32), 1)
        finished = {shard: piece for shard, piece in group.slices.items() if piece.last}
        if finished:
            cache = self._handoff(cache, window, finished)
        return cache, window, result

    def _load_prefix(self, cache, starting: dict):
        """The scratch with the cached prefixes of the prompts whose prefill starts past them in their shards' rows,
        one call (the shards without one: the null page)."""
        width = self.layout.pages_per_row
        table_DX, pages_DX = np.zeros((self.shards, width), np.int32), np.zeros((self.shards, width), np.int32)
        for shard, piece in starting.items():
            shared_X = np.arange(width) < piece.cached // self.layout.size.page_size
            pages_DX[shard] = np.where(shared_X, piece.pages_X, 0)
            table_DX[shard] = self._scratch_table(pages_DX[shard])
        return steps.load_prefix(self.family, cache, self.scratch, jnp.asarray(table_DX), jnp.asarray(pages_DX),
                                 shardings=self.shardings, scratch_shardings=self.scratch_shardings)

    def _handoff(self, cache, window, finished: dict):
        """The decode cache with the prompts that finished on their shards' scratch rows in it, one call (the shards
        without one: no row, no pages, no entries)."""
        part, d, width = self.layout.offloaded, self.shards, self.layout.pages_per_row
        table_DX, pages_DX = np.zeros((d, width), np.int32), np.zeros((d, width), np.int32)
        row_D, entries_D = np.full(d, self.rows_per_shard, np.int32), np.zeros(d, np.int32)
        shared_D = np.zeros(d, np.int32)
        for shard, piece in finished.items():
            pages_DX[shard], table_DX[shard] = piece.pages_X, self._scratch_table(piece.pages_X)
            row_D[shard] = piece.row % self.rows_per_shard
            entries_D[shard] = part.entries(piece.prompt_len)
            shared_D[shard] = piece.cached // self.layout.size.page_size
            self.stats.prompt_rows_to_host += (int(entries_D[shard]) - part.entries(piece.cached)) * part.layers
        return steps.handoff(self.family, cache, self.scratch, *map(jnp.asarray, (
            table_DX, pages_DX, row_D, entries_D)), window, jnp.asarray(shared_D), shardings=self.shardings,
            scratch_shardings=self.scratch_shardings)

    def release(self, cache, released: list[Released]):
        """The decode cache with each ended request's pool slots and their residency emptied, on its shard."""
        for ended in released:
            shard, row = divmod(ended.row, self.rows_per_shard)
            row_D = np.full(self.shards, self.rows_per_shard, np.int32)
            row_D[shard] = row
            cache = steps.release(self.family, cache, jnp.asarray(row_D), shardings=self.shardings)
        return cache

    def flush(self, cache):
        return steps.flush(self.family, cache, shardings=self.shardings)

    def store(self, cache) -> tier.Tier:
        """The decode cache's tier."""
        return self.family.store_of(cache)

    def usage(self, cache, scheduled: dict) -> dict:
        """Device pool slots in use (read from the device) and the host stores' pages and bytes (the host store
        has the cache's pages, each shard's null page included in its bytes; the host rings a ring per batch
        row, in use where a request holds the row)."""
        page_bytes = self.layout.offloaded.page_bytes(self.layout.size.page_size)
        ring_bytes = sum(p.bytes(0) for p in self.layout.placed if p.where == "host")  # per batch row
        return {"pool_slots_in_use": int((mesh.host_array(self.store(cache).lru.slot_entry) >= 0).sum()),
                "pool_slots_total": self.layout.pool_slots * self.layout.size.rows * self.layout.offloaded.layers,
                "host_pages_in_use": scheduled["pages_in_use"], "host_pages_total": scheduled["pages_total"],
                "host_bytes_in_use": scheduled["pages_in_use"] * page_bytes + scheduled["rows_in_use"] * ring_bytes,
                "host_bytes_total": ((scheduled["pages_total"] + self.layout.size.shards) * page_bytes
                                     + scheduled["rows_total"] * ring_bytes)}

    def metrics(self, cache) -> dict:
        """Tier counters (read from the device once) as the ``--json`` ``metrics.offload`` object: over the union of
        each step's queries' top-k ids (what was fetched), per layer and per data shard, and over each query position's
        own ids (``per_position``: a verification step's last token, then its drafts; one position without)."""
        store = self.store(cache)
        rows_LB4 = mesh.host_array(store.counters)  # lookups, hits, misses, staged per layer and row
        counts = rows_LB4.sum(1)
        lookups, hits, misses, staged = (int(x) for x in counts.sum(0))
        per_shard = rows_LB4.reshape(rows_LB4.shape[0], self.layout.size.shards, -1, 4).sum((0, 2))
        row_bytes = self.layout.offloaded.row_bytes
        layers = self.family.sparse_layers(self.module.cfg)
        return {"lookups": lookups, "hits": hits, "misses": misses,
                "hit_rate": hits / lookups if lookups else 0.0,
                "h2d_bytes": misses * row_bytes,
                "d2h_bytes": (self.stats.prompt_rows_to_host + staged) * row_bytes,
                "decode_d2h_bytes": staged * row_bytes,
                "pool_slots": self.layout.pool_slots,
                "per_layer": [{"layer": i, "lookups": int(c[0]), "hits": int(c[1]), "misses": int(c[2]),
                               "h2d_bytes": int(c[2]) * row_bytes, "decode_d2h_bytes": int(c[3]) * row_bytes, **lead}
                              for i, c, lead in zip(layers, counts, store.lead_metrics(layers))],
                "per_shard": [{"shard": d, "lookups": int(c[0]), "hits": int(c[1]), "misses": int(c[2])}
                              for d, c in enumerate(per_shard)],
                "per_position": [{"position": t, "lookups": int(c[0]), "hits": int(c[1]), "misses": int(c[2])}
                                 for t, c in enumerate(mesh.host_array(store.query_counters).sum((0, 1)))]}

    def cache_bytes(self, cache) -> dict[str, int]:
        """Bytes of the decode cache's arrays: its host stores (the tier's, the HCA rings') and the rest."""
        is_store = lambda x: isinstance(x, tier.HOST_STORES)  # noqa: E731
        hosts = [x for x in jax.tree.leaves(cache, is_leaf=is_store) if is_store(x)]
        stored = jax.tree.leaves(hosts)
        device = [x for x in jax.tree.leaves(cache) if all(x is not y for y in stored)]
        return {"device_bytes": int(sum(x.nbytes for x in device)), "host_bytes": int(sum(x.nbytes for x in hosts)),
                "prefill_scratch_bytes": int(sum(x.nbytes for x in jax.tree.leaves(self.scratch)))}


MODES: dict[Offload, type[Resident] | type[Ess]] = {Offload.NONE: Resident, Offload.ESS: Ess}

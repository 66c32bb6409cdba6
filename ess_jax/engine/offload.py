"""Where the offloaded part of the cache lives (V3.2's latent rows, V4's CSA entries), chosen once when the
engine is built: ``Resident`` (every part on the device) or ``Ess`` (the part in a host store behind an LRU
device pool, ``ess_jax.tier``). Both answer the same calls, so nothing else in the engine asks which it has:

- ``sizes``: the layout's sizes and bytes for the mode (``layout.cache_layout``);
- ``decode_cache``: the empty decode cache of a size;
- ``prefill``: run a prefill group (``Ess``: on a device scratch of one prompt per data shard, then the
  finished prompts handed off to the decode cache and the host store);
- ``release``: empty what ended requests held on the device; ``flush``: the last step's rows to the host;
- ``usage``, ``metrics``, ``cache_bytes``: what the mode adds to the engine's reports."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import numpy as np
import jax
import jax.numpy as jnp

from ess_jax import families, mesh, tier
from ess_jax.engine import steps
from ess_jax.engine.config import CACHE_DTYPES, EngineConfig, Offload
from ess_jax.engine.plan import EngineStats, PrefillGroup, PrefillResult, Released

if TYPE_CHECKING:
    from ess_jax.engine.layout import CacheLayout
    from ess_jax.engine.runner import Runner


def entry_dtype(module, config: EngineConfig):
    """The dtype of the offloaded part's rows: ``--cache-dtype``, or the model's."""
    return CACHE_DTYPES[config.cache_dtype] if config.cache_dtype else module.dtype


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a mode makes of the layout's sizes."""

    size: families.CacheSize
    pool_slots: int | None  # device pool slots per (layer, request)
    device_bytes: int
    host_bytes: int
    parts: list | None = None  # the parts as the mode places them (``families.host_rings``); None: as given


class Mode(Protocol):
    """What the engine asks of its offload mode (``Resident`` or ``Ess``)."""

    computed_tail: int  # a prompt's last tokens always prefilled, never read from the prefix cache
    prefix_tier: str  # where a cached prefix is read from: "device" | "host"

    def prefill(self, group: PrefillGroup) -> PrefillResult: ...
    def release(self, released: list[Released]) -> None: ...
    def flush(self) -> None: ...
    def usage(self, scheduled: dict) -> dict: ...
    def metrics(self) -> dict | None: ...
    def cache_bytes(self) -> dict[str, int]: ...


class Resident:
    """Every part on the device: prompts prefill straight into the decode cache; nothing moves."""

    @staticmethod
    def sizes(cfg, config: EngineConfig, size: families.CacheSize, parts, *, lower_bound: bool) -> Sizes:
        return Sizes(size, None, families.resident_bytes(parts, size, size.pages), 0)

    steps: tuple[str, ...] = ()  # the mode's own jitted steps (``ess_jax.engine.steps``) beside prefill and decode
    computed_tail = 1  # prompt tokens always prefilled: the last (its logits give the first output token)
    prefix_tier = "device"  # where a cached prefix is read from

    @staticmethod
    def decode_cache(module, size: families.CacheSize, config: EngineConfig, layout: CacheLayout):
        return families.get(module.cfg.family).resident_cache(module, size, entry_dtype(module, config),
                                                              config.index_dtype)

    @staticmethod
    def prefill_cache(module, config: EngineConfig, layout: CacheLayout):
        """What prompts prefill on, as a builder of it and its size: the decode cache itself."""
        return (lambda size: Resident.decode_cache(module, size, config, layout)), layout.size

    def __init__(self, runner: Runner, layout: CacheLayout, stats: EngineStats):
        self.runner = runner

    def prefill(self, group: PrefillGroup) -> PrefillResult:
        runner = self.runner
        table_DX = np.zeros((runner.shards, runner.layout.pages_per_row), np.int32)
        row_D = np.zeros(runner.shards, np.int32)
        for shard, piece in group.slices.items():
            table_DX[shard], row_D[shard] = piece.pages_X, piece.row % runner.rows_per_shard
        result, runner.cache = runner.prefill(runner.cache, runner.shardings, group, table_DX, row_D,
                                              runner.rows_per_shard)
        return result

    def release(self, released: list[Released]) -> None:
        """Nothing to empty: a freed row's pages are overwritten before they are read again."""

    def flush(self) -> None:
        """No host store."""

    def usage(self, scheduled: dict) -> dict:
        return {}

    def metrics(self) -> dict | None:
        return None

    def cache_bytes(self) -> dict[str, int]:
        return {"device_bytes": int(sum(x.nbytes for x in jax.tree.leaves(self.runner.cache))), "host_bytes": 0}


class Ess:
    """The offloaded part in each data shard's host store, an LRU pool of ``pool_slots`` slots per (layer, batch
    row) of it on the device (``ess_jax.tier``). A prompt prefills on a scratch cache (one row per data shard, its
    pages 1..n), then hands off: its rows to the host store, its resident parts into the decode cache, its pool
    warmed from the top-k of its last prompt queries (the runner's window)."""

    @staticmethod
    def sizes(cfg, config: EngineConfig, size: families.CacheSize, parts, *, lower_bound: bool) -> Sizes:
        """Refuses, naming the flags, a model or length with nothing to offload (unless ``lower_bound``: a CLI's
        check before the requests are known)."""
        part = next(p for p in parts if p.where == "offloaded")
        entries = part.entries(size.max_seq_len)
        if not part.layers or entries < 1:
            if lower_bound:
                return Resident.sizes(cfg, config, size, parts, lower_bound=True)
            why = "no layers holding them" if not part.layers else "requests too short for one entry"
            raise ValueError(f"--offload ess offloads the {part.name}; this {cfg.family} model has {why} "
                             f"(max_seq_len {size.max_seq_len}): use --offload none")
        slots = tier.pool_slots(entries, part.topk, pool_size=config.pool_size, pool_ratio=config.pool_ratio)
        tokens = 1 + config.num_speculative_tokens  # a decode step's query tokens per row
        if config.host_cache_mb is not None:
            size = families.fit_host_budget(size, part, config.host_cache_mb)
        placed = families.host_rings(parts) if config.ring_placement == "host" else parts
        pages_host = size.pages * part.page_bytes(size.page_size)
        rings_host = size.rows * sum(p.bytes(0) for p in placed if p.where == "host")
        scratch = Ess.scratch_size(size)
        pool = tier.device_bytes(layers=part.layers, rows=size.rows, slots=slots, row_bytes=part.row_bytes,
                                 entries=part.row_entries(size), new_entries=part.step_entries(tokens), queries=tokens,
                                 topk=part.topk, sources=tier.share_sources(cfg.indexer_types))
        device = (families.resident_bytes(placed, size, size.pages) - pages_host + pool
                  + families.resident_bytes(parts, scratch, scratch.pages))  # the scratch: every part resident
        return Sizes(size, slots, device, pages_host + rings_host, placed)

    @staticmethod
    def scratch_size(size: families.CacheSize) -> families.CacheSize:
        """The prefill scratch: a batch row per data shard, the longest request's pages and a null page each."""
        pages_per_row = -(-size.max_seq_len // size.page_size)
        return dataclasses.replace(size, rows=size.shards, pages=size.shards * (pages_per_row + 1))

    steps: tuple[str, ...] = ("handoff", "release", "flush", "load_prefix")
    computed_tail = tier.WARMUP_QUERIES  # prompt tokens always prefilled: the queries whose top-k warm the pool
    prefix_tier = "host"  # where a cached prefix is read from: its rows from the host store (its indexer keys on
    # the device)

    @staticmethod
    def prefill_cache(module, config: EngineConfig, layout: CacheLayout):
        """What prompts prefill on, as a builder of it and its size: every part resident, a row per data shard."""
        family, dtype = families.get(module.cfg.family), entry_dtype(module, config)
        return (lambda size: family.resident_cache(module, size, dtype, config.index_dtype)), Ess.scratch_size(
            layout.size)

    @staticmethod
    def decode_cache(module, size: families.CacheSize, config: EngineConfig, layout: CacheLayout):
        family = families.get(module.cfg.family)
        cache = family.offloaded_cache(
            module, size, layout.offloaded, entry_dtype(module, config), slots=layout.pool_slots, fetch=config.fetch,
            index=config.index_dtype, rings=config.ring_placement, tokens=1 + config.num_speculative_tokens)
        return family.with_store(cache, dataclasses.replace(family.store_of(cache), miss_budget=config.miss_budget))

    def __init__(self, runner: Runner, layout: CacheLayout, stats: EngineStats):
        self.runner, self.layout, self.stats = runner, layout, stats
        module = runner.model.module
        self.family = families.get(module.cfg.family)
        with runner.on_mesh():
            self.scratch, self.scratch_shardings = runner.build(*Ess.prefill_cache(module, runner.config, layout))

    def _scratch_table(self, pages_X: np.ndarray) -> np.ndarray:
        """A prompt's scratch pages: 1..n where it has pages."""
        return np.where(pages_X > 0, np.arange(1, pages_X.size + 1), 0).astype(np.int32)

    def prefill(self, group: PrefillGroup) -> PrefillResult:
        runner = self.runner
        table_DX = np.zeros((runner.shards, self.layout.pages_per_row), np.int32)
        for shard, piece in group.slices.items():
            table_DX[shard] = self._scratch_table(piece.pages_X)
        starting = {shard: piece for shard, piece in group.slices.items()
                    if piece.cached and piece.first}  # their first piece: past a cached prefix
        if starting:
            self._load_prefix(starting)
        result, self.scratch = runner.prefill(self.scratch, self.scratch_shardings, group, table_DX,
                                              np.zeros(runner.shards, np.int32), 1)
        finished = {shard: piece for shard, piece in group.slices.items() if piece.last}
        if finished:
            self._handoff(finished)
        return result

    def _load_prefix(self, starting: dict) -> None:
        """The cached prefixes of the prompts whose prefill starts past them into their shards' scratch rows, one
        call (the shards without one: the null page)."""
        d, width = self.runner.shards, self.layout.pages_per_row
        table_DX, pages_DX = np.zeros((d, width), np.int32), np.zeros((d, width), np.int32)
        for shard, piece in starting.items():
            shared_X = np.arange(width) < piece.cached // self.layout.size.page_size
            pages_DX[shard] = np.where(shared_X, piece.pages_X, 0)
            table_DX[shard] = self._scratch_table(pages_DX[shard])
        self.scratch = steps.load_prefix(self.family, self.runner.cache, self.scratch, jnp.asarray(table_DX),
                                         jnp.asarray(pages_DX), shardings=self.runner.shardings,
                                         scratch_shardings=self.scratch_shardings)

    def _handoff(self, finished: dict) -> None:
        """The prompts that finished on their shards' scratch rows into the decode cache, one call (the shards
        without one: no row, no pages, no entries)."""
        runner, part = self.runner, self.layout.offloaded
        d, width = runner.shards, self.layout.pages_per_row
        table_DX, pages_DX = np.zeros((d, width), np.int32), np.zeros((d, width), np.int32)
        row_D, entries_D = np.full(d, runner.rows_per_shard, np.int32), np.zeros(d, np.int32)
        shared_D = np.zeros(d, np.int32)
        for shard, piece in finished.items():
            pages_DX[shard], table_DX[shard] = piece.pages_X, self._scratch_table(piece.pages_X)
            row_D[shard] = piece.row % runner.rows_per_shard
            entries_D[shard] = part.entries(piece.prompt_len)
            shared_D[shard] = piece.cached // self.layout.size.page_size
            self.stats.prompt_rows_to_host += (int(entries_D[shard]) - part.entries(piece.cached)) * part.layers
        runner.cache = steps.handoff(self.family, runner.cache, self.scratch, *map(jnp.asarray, (
            table_DX, pages_DX, row_D, entries_D)), runner.window, jnp.asarray(shared_D), shardings=runner.shardings,
            scratch_shardings=self.scratch_shardings)

    def release(self, released: list[Released]) -> None:
        """Each ended request's pool slots and their residency emptied, on its shard."""
        runner = self.runner
        for ended in released:
            shard, row = divmod(ended.row, runner.rows_per_shard)
            row_D = np.full(runner.shards, runner.rows_per_shard, np.int32)
            row_D[shard] = row
            runner.cache = steps.release(self.family, runner.cache, jnp.asarray(row_D), shardings=runner.shardings)

    def flush(self) -> None:
        with self.runner.on_mesh():
            self.runner.cache = steps.flush(self.family, self.runner.cache, shardings=self.runner.shardings)

    def store(self) -> tier.Tier:
        """The decode cache's tier."""
        return self.family.store_of(self.runner.cache)

    def usage(self, scheduled: dict) -> dict:
        """Device pool slots in use (read from the device) and the host stores' pages and bytes (the host store
        has the cache's pages, each shard's null page included in its bytes; the host rings a ring per batch
        row, in use where a request holds the row)."""
        page_bytes = self.layout.offloaded.page_bytes(self.layout.size.page_size)
        ring_bytes = sum(p.bytes(0) for p in self.layout.placed if p.where == "host")  # per batch row
        return {"pool_slots_in_use": int((mesh.host_array(self.store().lru.slot_entry) >= 0).sum()),
                "pool_slots_total": self.layout.pool_slots * self.layout.size.rows * self.layout.offloaded.layers,
                "host_pages_in_use": scheduled["pages_in_use"], "host_pages_total": scheduled["pages_total"],
                "host_bytes_in_use": scheduled["pages_in_use"] * page_bytes + scheduled["rows_in_use"] * ring_bytes,
                "host_bytes_total": ((scheduled["pages_total"] + self.layout.size.shards) * page_bytes
                                     + scheduled["rows_total"] * ring_bytes)}

    def metrics(self) -> dict:
        """Tier counters (read from the device once) as the ``--json`` ``metrics.offload`` object: over the union of
        each step's queries' top-k ids (what was fetched), per layer and per data shard, and over each query position's
        own ids (``per_position``: a verification step's last token, then its drafts; one position without)."""
        store = self.store()
        rows_LB4 = mesh.host_array(store.counters)  # lookups, hits, misses, staged per layer and row
        counts = rows_LB4.sum(1)
        lookups, hits, misses, staged = (int(x) for x in counts.sum(0))
        per_shard = rows_LB4.reshape(rows_LB4.shape[0], self.layout.size.shards, -1, 4).sum((0, 2))
        row_bytes = self.layout.offloaded.row_bytes
        layers = self.family.sparse_layers(self.runner.model.cfg)
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

    def cache_bytes(self) -> dict[str, int]:
        """Bytes of the decode cache's arrays: its host stores (the tier's, the HCA rings') and the rest."""
        is_store = lambda x: isinstance(x, tier.HOST_STORES)  # noqa: E731
        hosts = [x for x in jax.tree.leaves(self.runner.cache, is_leaf=is_store) if is_store(x)]
        stored = jax.tree.leaves(hosts)
        device = [x for x in jax.tree.leaves(self.runner.cache) if all(x is not y for y in stored)]
        return {"device_bytes": int(sum(x.nbytes for x in device)), "host_bytes": int(sum(x.nbytes for x in hosts)),
                "prefill_scratch_bytes": int(sum(x.nbytes for x in jax.tree.leaves(self.scratch)))}


MODES: dict[Offload, type[Resident] | type[Ess]] = {Offload.NONE: Resident, Offload.ESS: Ess}

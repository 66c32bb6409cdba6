"""The engine's cache sizes and bytes from the configs alone (``cache_layout``), checked against the machine
(``check_memory``), and the static half of each offload mode (``MODE_SPECS``: its sizes, its cache builders, the
steps it adds; ``ess_jax.engine.offload`` is the half that runs). Importable before any model loads: the CLIs refuse
a layout the machine cannot hold before reading the weights."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax import families, mesh, tier
from ess_jax.cache import StepMeta, check_geometry
from ess_jax.engine.config import CACHE_DTYPES, EngineConfig, Offload
from ess_jax.plan import snapshot_bytes

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The sizes an engine's caches get from a model config and an EngineConfig, and their bytes."""

    max_seq_len: int
    pages_per_row: int
    size: families.CacheSize
    parts: list  # families.Part of one request's cache, in the stored formats
    offloaded: families.Part  # the tier's part with --offload ess
    pool_slots: int | None  # ess: device pool slots per (layer, request)
    device_bytes: int  # the decode-time cache (with ess: resident parts, pools; and the prefill scratch; with
    # speculative decoding the MTP module's cache), every data shard's together (a shard's devices each hold
    # 1 / shards of it)
    host_bytes: int  # ess: the host store, every data shard's together
    logits_bytes: int  # one decode step's float32 logits [max_batch, 1 + drafts, vocab]
    placed: list  # the parts where the mode places them (ess: ``families.host_rings`` with --rings host)
    snapshot_bytes: int  # the prefix cache's row-state snapshots at most (DeepSeek-V4's: ``prefix_cache_states`` per
    # data shard, each ``plan.snapshot_bytes`` of the model's parts and the MTP module's), in host memory


def cache_layout(cfg, config: EngineConfig, model_format: str, *, lower_bound: bool = False) -> CacheLayout:
    """The engine's cache sizes and bytes, from the config alone (no array is built). Raises ValueError naming
    the flags when ``--offload ess`` cannot serve these requests, the pool is too small or the host budget
    cannot hold the longest request. ``lower_bound``: sizes the engine gets at least (a CLI's check before
    the model loads, when the requests are not known yet), so an ess cache with no entries is not an error."""
    family = families.get(cfg.family)
    if config.max_seq_len is not None and config.max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len={config.max_seq_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}); lower --max-seq-len")
    max_seq_len = config.max_seq_len or cfg.max_position_embeddings
    pages_per_row = math.ceil(max_seq_len / config.page_size)
    shards = mesh.parse(config.mesh).data if config.mesh else 1
    pages = config.num_pages if config.num_pages is not None else config.max_batch // shards * pages_per_row + 1
    size = families.CacheSize(config.max_batch, shards * pages, config.page_size, max_seq_len, shards)
    parts = family.cache_parts(cfg, family.stored_formats(config.cache_dtype or model_format, model_format,
                                                          config.index_dtype))
    for p in parts:
        if p.tokens_per_row and p.layers:
            check_geometry(config.page_size, p.tokens_per_row)
    part = next(p for p in parts if p.where == "offloaded")
    sized = MODE_SPECS[config.offload].sizes(cfg, config, size, parts, lower_bound=lower_bound)
    device, snapshot = sized.device_bytes, snapshot_bytes(parts)
    if config.speculative:  # the MTP module's cache: its one block's parts, resident, in every page
        formats = family.stored_formats(config.cache_dtype or model_format, model_format, config.index_dtype)
        mtp = family.mtp_cache_parts(cfg, formats)
        device += families.resident_bytes(mtp, sized.size, sized.size.pages)
        snapshot += snapshot_bytes(mtp)
    snapshots = shards * config.prefix_cache_states * snapshot if config.prefix_cache and family.row_state else 0
    logits = 4 * config.max_batch * (1 + config.num_speculative_tokens) * cfg.vocab_size
    return CacheLayout(max_seq_len, pages_per_row, sized.size, parts, part, sized.pool_slots, int(device),
                       int(sized.host_bytes), logits, sized.parts or parts, int(snapshots))


def entry_dtype(module, cache_dtype: str | None):
    """The dtype of the offloaded part's rows: ``cache_dtype`` (``--cache-dtype``), or the model's."""
    return CACHE_DTYPES[cache_dtype] if cache_dtype else module.dtype


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a mode makes of the layout's sizes."""

    size: families.CacheSize
    pool_slots: int | None  # device pool slots per (layer, request)
    device_bytes: int
    host_bytes: int
    parts: list | None = None  # the parts as the mode places them (``families.host_rings``); None: as given


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """The static half of an offload mode: what the layout, the export and the engine's construction need of it
    before a runner exists."""

    sizes: Callable[..., Sizes]  # (cfg, config, size, parts, *, lower_bound) -> the mode's sizes and bytes
    decode_cache: Callable  # (module, size, config, layout) -> the empty decode cache of ``size``
    prefill_cache: Callable  # (module, config, layout) -> what prompts prefill on, as a builder of it and its size
    steps: tuple[str, ...]  # the mode's own jitted steps (``ess_jax.engine.steps``) beside prefill and decode
    computed_tail: int  # a prompt's last tokens always prefilled, never read from the prefix cache
    prefix_tier: str  # where a cached prefix is read from: "device" | "host"


def _resident_sizes(cfg, config: EngineConfig, size: families.CacheSize, parts, *, lower_bound: bool) -> Sizes:
    return Sizes(size, None, families.resident_bytes(parts, size, size.pages), 0)


def _resident_cache(module, size: families.CacheSize, config: EngineConfig, layout: CacheLayout):
    return families.get(module.cfg.family).resident_cache(module, size, entry_dtype(module, config.cache_dtype),
                                                          config.index_dtype)


def _resident_prefill(module, config: EngineConfig, layout: CacheLayout):
    """The decode cache itself."""
    return (lambda size: _resident_cache(module, size, config, layout)), layout.size


def _ess_sizes(cfg, config: EngineConfig, size: families.CacheSize, parts, *, lower_bound: bool) -> Sizes:
    """Refuses, naming the flags, a model or length with nothing to offload (unless ``lower_bound``: a CLI's check
    before the requests are known)."""
    part = next(p for p in parts if p.where == "offloaded")
    entries = part.entries(size.max_seq_len)
    if not part.layers or entries < 1:
        if lower_bound:
            return _resident_sizes(cfg, config, size, parts, lower_bound=True)
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
    scratch = scratch_size(size)
    pool = tier.device_bytes(layers=part.layers, rows=size.rows, slots=slots, row_bytes=part.row_bytes,
                             entries=part.row_entries(size), new_entries=part.step_entries(tokens), queries=tokens,
                             topk=part.topk, sources=tier.share_sources(cfg.indexer_types))
    device = (families.resident_bytes(placed, size, size.pages) - pages_host + pool
              + families.resident_bytes(parts, scratch, scratch.pages))  # the scratch: every part resident
    return Sizes(size, slots, device, pages_host + rings_host, placed)


def scratch_size(size: families.CacheSize) -> families.CacheSize:
    """The ESS prefill scratch of an engine whose decode cache is of ``size``: a batch row per data shard, the longest
    request's pages and a null page each."""
    pages_per_row = -(-size.max_seq_len // size.page_size)
    return dataclasses.replace(size, rows=size.shards, pages=size.shards * (pages_per_row + 1))


def prefill_scratch(module, size: families.CacheSize, cache_dtype: str | None, index_dtype: str | None = None):
    """What an ESS engine whose decode cache is of ``size`` prefills prompts on, as a builder of it and its size
    (``scratch_size``): every part resident, the offloaded part's rows in ``entry_dtype``, the indexer keys in
    ``index_dtype``."""
    family, dtype = families.get(module.cfg.family), entry_dtype(module, cache_dtype)
    return (lambda size: family.resident_cache(module, size, dtype, index_dtype)), scratch_size(size)


def meta_shapes(rows: int, tokens: int, pages: int) -> StepMeta:
    """The shapes of a step's metadata: ``rows`` batch rows of ``tokens`` tokens, page tables of ``pages`` pages."""
    return StepMeta(jax.ShapeDtypeStruct((rows, tokens), jnp.int32), jax.ShapeDtypeStruct((rows, tokens), bool),
                    jax.ShapeDtypeStruct((rows, pages), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32))


def window_shape(graph, params, size: families.CacheSize) -> tuple[int, ...]:
    """The shape ``[L, D, Q, K]`` of the running window of prompt top-k ids (``steps.next_window``) of an engine whose
    decode cache is of ``size``: the layers and top-k of a prefill piece's ids, a row per data shard. ``graph``: the
    model and its kernels (``steps.Graph``). Traced once per model, kernels and geometry (jit's cache): engines of
    one shape share it."""
    shards, pages_per_row = size.shards, -(-size.max_seq_len // size.page_size)
    tokens, meta = jax.ShapeDtypeStruct((shards, 1), jnp.int32), meta_shapes(shards, 1, pages_per_row)
    ids_LBTK = _prefill_ids.eval_shape(graph, size, params, tokens, meta)
    return ids_LBTK.shape[0], shards, tier.WARMUP_QUERIES, ids_LBTK.shape[3]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prefill_ids(graph, size: families.CacheSize, params, tokens, meta):
    """A prefill piece's top-k ids on a resident cache of a row per shard (only its shape is ever taken)."""
    module = nnx.merge(graph.graphdef, params)
    cache = families.get(module.cfg.family).resident_cache(module, scratch_size(size), module.dtype)
    return module.step(tokens, meta, cache, kernels=graph.kernels)[1]


def _ess_cache(module, size: families.CacheSize, config: EngineConfig, layout: CacheLayout):
    """The offloaded part in a host store behind an LRU device pool (``ess_jax.tier``)."""
    family = families.get(module.cfg.family)
    cache = family.offloaded_cache(
        module, size, layout.offloaded, entry_dtype(module, config.cache_dtype), slots=layout.pool_slots,
        fetch=config.fetch, index=config.index_dtype, rings=config.ring_placement,
        tokens=1 + config.num_speculative_tokens)
    return family.with_store(cache, dataclasses.replace(family.store_of(cache), miss_budget=config.miss_budget))


def _ess_prefill(module, config: EngineConfig, layout: CacheLayout):
    return prefill_scratch(module, layout.size, config.cache_dtype, config.index_dtype)


MODE_SPECS = {
    # every part on the device: prompts prefill straight into the decode cache; the last prompt token always
    # prefilled (its logits give the first output token)
    Offload.NONE: ModeSpec(_resident_sizes, _resident_cache, _resident_prefill, steps=(), computed_tail=1,
                           prefix_tier="device"),
    # the offloaded part in a host store: prompts prefill on a scratch, then hand off; the queries whose top-k warm
    # the pool always prefilled; a cached prefix's rows read from the host store (its indexer keys on the device)
    Offload.ESS: ModeSpec(_ess_sizes, _ess_cache, _ess_prefill, steps=("handoff", "release", "flush", "load_prefix"),
                          computed_tail=tier.WARMUP_QUERIES, prefix_tier="host"),
}


def memory_limits() -> tuple[int | None, int]:
    """The device's memory (jax's ``bytes_limit``; None where the device does not say, as on CPU, whose
    memory is the host's) and the host's physical memory, in bytes."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics
        stats = {}
    return stats.get("bytes_limit"), host


def check_memory(layout: CacheLayout, weights_bytes: int = 0) -> None:
    """Refuse a layout the machine cannot hold, with the numbers: a device's part of the caches and logits (1 /
    data shards of them) and ``weights_bytes`` (the weights on one device) against the device memory, the host
    store and the prefix cache's snapshots against the host memory (all of it against the host's on a device without
    its own memory)."""
    device_limit, host_limit = memory_limits()
    s = layout.size
    what = (f"{s.pages} pages of {s.page_size} tokens, {s.rows} batch rows of up to {layout.max_seq_len} tokens"
            + (f", {layout.pool_slots} pool slots per layer and row" if layout.pool_slots else "")
            + (f" over {s.shards} data shards" if s.shards > 1 else ""))
    fix = "lower --num-pages, --page-size, --max-batch or --max-seq-len"
    host = layout.host_bytes + layout.snapshot_bytes
    if device_limit is None:
        need = layout.device_bytes + layout.logits_bytes + weights_bytes + host
        if need > host_limit:
            raise ValueError(f"the engine needs {need / GiB:.2f} GiB ({what}: device cache "
                             f"{layout.device_bytes / GiB:.2f} GiB, host store and snapshots {host / GiB:.2f} GiB, "
                             f"logits {layout.logits_bytes / GiB:.2f} GiB, weights {weights_bytes / GiB:.2f} GiB) but "
                             f"this machine has {host_limit / GiB:.2f} GiB: {fix}")
        return
    cache, logits = layout.device_bytes // s.shards, layout.logits_bytes // s.shards
    if cache + logits + weights_bytes > device_limit:
        raise ValueError(f"the engine needs {(cache + logits + weights_bytes) / GiB:.2f} GiB on each device ({what}: "
                         f"cache {cache / GiB:.2f} GiB, logits {logits / GiB:.2f} GiB, weights "
                         f"{weights_bytes / GiB:.2f} GiB) but a device has {device_limit / GiB:.2f} GiB: {fix}")
    if host > host_limit:
        raise ValueError(f"the host store and the prefix cache's snapshots need {host / GiB:.2f} GiB ({what}) but this "
                         f"machine has {host_limit / GiB:.2f} GiB: {fix}, or set --host-cache-mb or "
                         "--prefix-cache-states")

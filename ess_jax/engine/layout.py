"""The engine's cache sizes and bytes from the configs alone (``cache_layout``; the offload mode's part from
``offload.MODES``), checked against the machine (``check_memory``). Importable before any model loads: the
CLIs refuse a layout the machine cannot hold before reading the weights."""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from ess_jax import families, mesh
from ess_jax.cache import check_geometry
from ess_jax.engine import offload
from ess_jax.engine.config import EngineConfig
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
    sized = offload.MODES[config.offload].sizes(cfg, config, size, parts, lower_bound=lower_bound)
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

"""The serving engine: paged cache, admission, chunked prefill interleaved with continuous batched decode.

Online API: ``add_request`` (any thread, while the engine runs), ``step`` (admission, prefill pieces
of at most ``prefill_chunk`` tokens in all, one decode step; returns each request's new tokens and
text), ``abort``, ``has_unfinished``; ``run`` steps until every added request is finished.

The host does bookkeeping (pages, batch rows, stop rules) in NumPy; the device runs two jitted
functions, both donating the cache:
- ``prefill``: one piece of one request's prompt, ``[D, T]`` (a row per ``--mesh`` data shard, the
  request's on its shard, the others not running): pieces of ``prefill_chunk`` tokens, the remainder
  cut into power-of-two pieces (exact, never padded, so compiles stay bounded), and the token sampled
  after the prompt's last token;
- ``decode``: one token for every batch row, ``[max_batch, 1]``; inactive rows are masked (a row
  whose prompt is mid-prefill keeps its cache).
On a mesh both run per data shard (``mesh.per_shard``): each shard has its own batch rows, page pool and
tier (``ess_jax.allocator``), and a request lives on one shard.
Requests join the batch when admitted (their pages reserved for prompt + max_new_tokens) and
leave when they stop or are aborted, while the others keep decoding. A request's tokens do not
depend on what else is in the batch or when it arrived: every row is computed independently, its
prompt is cut into the same pieces, and it samples from its own seed."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from collections import deque
from typing import Sequence

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec
from tqdm import tqdm

from ess_jax import families, mesh, ops, tier
from ess_jax.allocator import Admission, Admitted, PageAllocator
from ess_jax.cache import StepMeta, check_geometry
from ess_jax.sampling import SamplingParams, sample
from ess_jax.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Request:
    """One request's parameters and what it has produced so far."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]  # tokens that end it ("stop"): the config's eos ids unless ignored, and stop_token_ids
    detokenizer: IncrementalDetokenizer
    logprobs: int | None = None  # top-N log-probabilities to report per output token (0: the chosen one only)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # f32[V] per output token, if kept
    finish_reason: str | None = None  # "stop" (a stop id), "length" (max_new_tokens) or "abort"
    prefilled: int = 0  # prompt tokens in the cache (chunked prefill progress)
    forced_ids: tuple[int, ...] | None = None  # teacher forcing: the output tokens, taken instead of the sampled ones
    windows: list = dataclasses.field(default_factory=list)  # warm-up ids of each prefill piece (offloaded)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (raw logits, before sampling filters) and the
    ``top`` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one ``Engine.step`` produced for one request."""

    request_id: int
    new_token_ids: list[int]  # tokens generated this step (the prefill's first token and a decode token at most)
    text_delta: str  # new text; never splits a UTF-8 character; the deltas concatenate to the full decode
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked for them


CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "fp8": jnp.uint8}  # fp8: 656-byte-style rows


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # decode batch rows
    page_size: int = 64  # tokens per cache page
    num_pages: int | None = None  # pages in each data shard's pool incl. its null page; default: its rows' requests
    # at full length
    max_seq_len: int | None = None  # longest prompt + max_new_tokens served; default: max_position_embeddings
    prefill_chunk: int = 256  # longest prefill piece; a shorter remainder is cut into power-of-two pieces
    offload: str = "none"  # "ess": latent rows in host memory behind an LRU device pool (ess_jax.tier)
    pool_size: int | None = None  # ess: pool slots per (layer, request); wins over pool_ratio
    pool_ratio: float = 0.2  # ess: pool slots as a fraction of the longest request's entries
    fetch: str = "inline"  # ess: "inline" or "split" (ess_jax.tier)
    host_cache_mb: float | None = None  # ess: host store budget per data shard; sets the page count when given
    keep_logits: bool = False  # keep each output token's float32 logits in Request.logits
    kernels: str = "xla"  # attention kernels: "xla", "pallas", "auto" (Pallas on GPU, XLA elsewhere)
    cache_dtype: str | None = None  # V3.2 latent rows / V4 CSA entries: None = the model's dtype, or "bfloat16",
    # "float32", "fp8" (656-byte V3.2 rows, 584-byte V4 rows at the real shapes; ess_jax.pallas_kernels.fp8_rows)
    mesh: str | None = None  # "data=D,expert=E": a device mesh over every device (ess_jax.mesh); None: one device

    def __post_init__(self):
        for name in ("max_batch", "page_size", "prefill_chunk", "num_pages", "max_seq_len", "pool_size"):
            value = getattr(self, name)
            if value is None and name in ("num_pages", "max_seq_len", "pool_size"):
                continue
            low = 2 if name == "num_pages" else 1
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                why = " (page 0 is the reserved null page)" if name == "num_pages" else ""
                raise ValueError(f"{_flag(name)} {value!r} must be an integer >= {low}{why}")
        if (isinstance(self.pool_ratio, bool) or not isinstance(self.pool_ratio, (int, float))
                or not 0 < self.pool_ratio <= 1):
            raise ValueError(f"--pool-ratio {self.pool_ratio!r} must be a number in (0, 1]")
        if self.host_cache_mb is not None and (
                isinstance(self.host_cache_mb, bool) or not isinstance(self.host_cache_mb, (int, float))
                or not math.isfinite(self.host_cache_mb) or self.host_cache_mb <= 0):
            raise ValueError(f"--host-cache-mb {self.host_cache_mb!r} must be a finite number of MiB > 0")
        if not isinstance(self.keep_logits, bool):
            raise ValueError(f"keep_logits={self.keep_logits!r} must be True or False")
        if self.offload not in ("none", "ess"):
            raise ValueError(f"--offload {self.offload!r} is not a mode; use 'ess' or 'none'")
        ops.check_kernels(self.kernels)  # the backend is asked when the engine is built (a config starts no backend)
        if self.cache_dtype not in (None, *CACHE_DTYPES):
            raise ValueError(f"--cache-dtype {self.cache_dtype!r} is not a cache dtype; use one of "
                             f"{', '.join(CACHE_DTYPES)}")
        if self.fetch not in tier.FETCH_BACKENDS:
            raise ValueError(f"--fetch {self.fetch!r} is not a fetch backend; use one of "
                             f"{', '.join(tier.FETCH_BACKENDS)}")
        if self.mesh is not None:
            mesh.check_rows(mesh.parse(self.mesh), self.max_batch)
        # The ESS-only fields are ignored with offload "none" (one config serves both paths through
        # dataclasses.replace); the CLIs refuse ESS-only flags given with --offload none (cli.engine_config).


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_sampling(sampling: SamplingParams) -> None:
    """What ``SamplingParams`` leaves to the engine: finite values, integers that fit the int32 / uint32
    arrays the sampler reads; ValueError naming the parameter."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number")
    for name, value, high in (("top_k", sampling.top_k, 2**31), ("seed", sampling.seed, 2**32)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < high:
            raise ValueError(f"{name}={value!r} must be an integer in [0, {high})")


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
    device_bytes: int  # the decode-time cache (with ess: resident parts, pools; and the prefill scratch), every
    # data shard's together (a shard's devices each hold 1 / shards of it)
    host_bytes: int  # ess: the host store, every data shard's together
    logits_bytes: int  # one decode step's float32 logits [max_batch, vocab]


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
    parts = family.cache_parts(cfg, family.stored_formats(config.cache_dtype or model_format, model_format))
    for p in parts:
        if p.tokens_per_row and p.layers:
            check_geometry(config.page_size, p.tokens_per_row)
    part = next(p for p in parts if p.where == "offloaded")
    resident = families.resident_bytes(parts, size, size.pages)
    slots, host = None, 0
    device = resident
    entries = part.entries(max_seq_len)
    if config.offload == "ess" and (part.layers and entries >= 1 or not lower_bound):
        if not part.layers or entries < 1:
            why = "no layers holding them" if not part.layers else "requests too short for one entry"
            raise ValueError(f"--offload ess offloads the {part.name}; this {cfg.family} model has {why} "
                             f"(max_seq_len {max_seq_len}): use --offload none")
        slots = tier.pool_slots(entries, part.topk, pool_size=config.pool_size, pool_ratio=config.pool_ratio)
        if config.host_cache_mb is not None:
            size = families.fit_host_budget(size, part, config.host_cache_mb)
            resident = families.resident_bytes(parts, size, size.pages)
        host = size.pages * part.page_bytes(size.page_size)
        scratch = dataclasses.replace(size, rows=shards, pages=shards * (pages_per_row + 1))
        device = (resident - host + part.layers * size.rows * slots * part.row_bytes
                  + families.resident_bytes(parts, scratch, scratch.pages))
    return CacheLayout(max_seq_len, pages_per_row, size, parts, part, slots, int(device), int(host),
                       4 * config.max_batch * cfg.vocab_size)


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
    store against the host memory (all of it against the host's on a device without its own memory)."""
    device_limit, host_limit = memory_limits()
    s = layout.size
    what = (f"{s.pages} pages of {s.page_size} tokens, {s.rows} batch rows of up to {layout.max_seq_len} tokens"
            + (f", {layout.pool_slots} pool slots per layer and row" if layout.pool_slots else "")
            + (f" over {s.shards} data shards" if s.shards > 1 else ""))
    fix = "lower --num-pages, --page-size, --max-batch or --max-seq-len"
    if device_limit is None:
        need = layout.device_bytes + layout.logits_bytes + weights_bytes + layout.host_bytes
        if need > host_limit:
            raise ValueError(f"the engine needs {need / GiB:.2f} GiB ({what}: device cache "
                             f"{layout.device_bytes / GiB:.2f} GiB, host store {layout.host_bytes / GiB:.2f} GiB, "
                             f"logits {layout.logits_bytes / GiB:.2f} GiB, weights {weights_bytes / GiB:.2f} GiB) but "
                             f"this machine has {host_limit / GiB:.2f} GiB: {fix}")
        return
    cache, logits = layout.device_bytes // s.shards, layout.logits_bytes // s.shards
    if cache + logits + weights_bytes > device_limit:
        raise ValueError(f"the engine needs {(cache + logits + weights_bytes) / GiB:.2f} GiB on each device ({what}: "
                         f"cache {cache / GiB:.2f} GiB, logits {logits / GiB:.2f} GiB, weights "
                         f"{weights_bytes / GiB:.2f} GiB) but a device has {device_limit / GiB:.2f} GiB: {fix}")
    if layout.host_bytes > host_limit:
        raise ValueError(f"the host store needs {layout.host_bytes / GiB:.2f} GiB ({what}) but this machine has "
                         f"{host_limit / GiB:.2f} GiB: {fix}, or set --host-cache-mb")


def latent_dtype(module, config: EngineConfig):
    """The dtype of the offloaded part's rows (V3.2 latent rows, V4 CSA entries): ``--cache-dtype``, or the model's."""
    return CACHE_DTYPES[config.cache_dtype] if config.cache_dtype else module.dtype


def decode_cache(module, size: families.CacheSize, config: EngineConfig, layout: CacheLayout):
    """The engine's empty decode cache of ``size`` (``layout.size``, or another size for its shapes): every part
    resident, or with ``--offload ess`` the tier (``layout.pool_slots`` slots) in the offloaded part's place."""
    family, dtype = families.get(module.cfg.family), latent_dtype(module, config)
    if config.offload == "ess":
        return family.offloaded_cache(module, size, layout.offloaded, dtype, slots=layout.pool_slots,
                                      fetch=config.fetch)
    return family.resident_cache(module, size, dtype)


def _placed(layout: mesh.Layout | None, cache):
    """``cache`` in the shardings of ``layout`` (the engine's mesh; None: one device, as it is)."""
    return layout.constrain(cache) if layout else cache


def _on_shards(fn, layout: mesh.Layout | None, in_specs, out_specs):
    """``fn`` per data shard on the engine's mesh (``mesh.per_shard``; ``layout``: the cache's shardings);
    on one device (None) ``fn`` itself, its arguments then those of the one shard."""
    return mesh.per_shard(fn, layout.mesh, in_specs, out_specs) if layout else fn


_ROWS, _ALL = PartitionSpec("data"), PartitionSpec()  # a batch-row-major argument split over the shards; replicated


def _prefill(graphdef, kernels: str, params, tokens_BT, meta: StepMeta, cache, last_B, sampling, layout=None):
    """One prefill chunk, a row per data shard (on the shards the request is not on: not valid, nothing
    written). Returns the token sampled after each row's last real token ``i32[B]``, the top-k ids of the
    chunk's last ``WARMUP_QUERIES`` real tokens ``i32[L, B, T, K]`` (-1 before the chunk) and the cache (in
    ``layout``'s shardings, as every step returns its cache)."""
    def run(params, tokens_BT, meta, cache, last_B, sampling):
        logits_BTV, ids_LBTK, cache = nnx.merge(graphdef, params).step(tokens_BT, meta, cache, kernels=kernels)
        logits_BV = jnp.take_along_axis(logits_BTV, last_B[:, None, None], axis=1)[:, 0]
        window_BT = last_B[:, None] - tier.WARMUP_QUERIES + 1 + jnp.arange(tier.WARMUP_QUERIES)
        ids_LBTK = jnp.take_along_axis(ids_LBTK, jnp.maximum(window_BT, 0)[None, :, :, None], axis=2)
        ids_LBTK = jnp.where((window_BT >= 0)[None, :, :, None], ids_LBTK, -1)
        return sample(logits_BV, *sampling), logits_BV, ids_LBTK, cache

    specs = layout and layout.specs
    token, logits_BV, ids_LBTK, cache = _on_shards(
        run, layout, (_ALL, _ROWS, _ROWS, specs, _ROWS, _ROWS), (_ROWS, _ROWS, PartitionSpec(None, "data"), specs))(
        params, tokens_BT, meta, cache, last_B, sampling)
    return token, logits_BV, ids_LBTK, _placed(layout, cache)


def _decode(graphdef, kernels: str, params, tokens_BT, meta: StepMeta, cache, sampling, layout=None):
    """One decode step for every batch row; the sampled tokens ``i32[B]``."""
    def run(params, tokens_BT, meta, cache, sampling):
        logits_BTV, _, cache = nnx.merge(graphdef, params).step(tokens_BT, meta, cache.begin_step(), kernels=kernels)
        return sample(logits_BTV[:, -1], *sampling), logits_BTV[:, -1], cache

    specs = layout and layout.specs
    tokens, logits_BV, cache = _on_shards(run, layout, (_ALL, _ROWS, _ROWS, specs, _ROWS), (_ROWS, _ROWS, specs))(
        params, tokens_BT, meta, cache, sampling)
    return tokens, logits_BV, _placed(layout, cache)


def _handoff(family: families.Family, cache, scratch, table_DX, pages_DX, row_D, entries_D, ids_LDTK, layout=None,
             scratch_layout=None):
    """The prompt prefilled on each data shard's scratch row into that shard's decode cache (``Family.handoff``):
    per shard its scratch pages ``table_DX``, its pages ``pages_DX``, its batch row ``row_D`` (past the last:
    none, the shards the request is not on), its entries and the top-k ids of the last prompt queries."""
    def run(cache, scratch, table_X, pages_X, row, entries, ids_LTK):
        return family.handoff(cache, scratch, table_X[0], pages_X[0], row[0], entries[0], ids_LTK[:, 0])

    specs = layout and layout.specs
    cache = _on_shards(run, layout, (specs, scratch_layout and scratch_layout.specs, _ROWS, _ROWS, _ROWS, _ROWS,
                                     PartitionSpec(None, "data")), specs)(
        cache, scratch, table_DX, pages_DX, row_D, entries_D, ids_LDTK)
    return _placed(layout, cache)


def _flush(family: families.Family, cache, layout=None):
    def run(cache):
        return family.with_store(cache, family.store_of(cache).begin_step())

    specs = layout and layout.specs
    return _placed(layout, _on_shards(run, layout, (specs,), specs)(cache))


def _release(family: families.Family, cache, row_D, pages_DX, layout=None):
    """Empty each data shard's batch row ``row_D`` (past the last: none) and the residency of its pages."""
    def run(cache, row, pages_X):
        return family.with_store(cache, family.store_of(cache).release(row[0], pages_X[0]))

    specs = layout and layout.specs
    return _placed(layout, _on_shards(run, layout, (specs, _ROWS, _ROWS), specs)(cache, row_D, pages_DX))


# Module-level jits: engines over the same model and shapes share compiled executables (the split backend's
# NumPy store is part of the step's static identity: its engine's own). ``layout``: static, the caches'
# shardings on the engine's mesh.
_PREFILL = jax.jit(_prefill, static_argnums=(0, 1), static_argnames="layout", donate_argnums=5)
_DECODE = jax.jit(_decode, static_argnums=(0, 1), static_argnames="layout", donate_argnums=5)
_HANDOFF = jax.jit(_handoff, static_argnums=0, static_argnames=("layout", "scratch_layout"), donate_argnums=1)
_FLUSH = jax.jit(_flush, static_argnums=0, static_argnames="layout", donate_argnums=1)
_RELEASE = jax.jit(_release, static_argnums=0, static_argnames="layout", donate_argnums=1)


def _buckets(chunk: int) -> tuple[int, ...]:
    """Prefill piece sizes: powers of two up to ``chunk``, and ``chunk`` itself."""
    sizes = [1]
    while sizes[-1] < chunk:
        sizes.append(min(sizes[-1] * 2, chunk))
    return tuple(sizes)


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig(), *, progress: bool = False):
        cfg = model.cfg
        self.model, self.config, self.progress = model, config, progress
        self.family = families.get(cfg.family)
        module = model.module
        self.latent_dtype = latent_dtype(module, config)
        # sizes and bytes from the config, checked against the machine before any cache array exists
        layout = cache_layout(cfg, config, jnp.dtype(module.dtype).name)
        shape = mesh.parse(config.mesh) if config.mesh else mesh.MeshShape()
        check_memory(layout, mesh.param_bytes_per_device(model.params, shape))
        self.max_seq_len, self.pages_per_row, size = layout.max_seq_len, layout.pages_per_row, layout.size
        self.parts, part, self.pool_slots = layout.parts, layout.offloaded, layout.pool_slots
        self.offloaded_part, self.row_bytes = part, part.row_bytes  # the tier's part with ess
        self.scratch = None
        ops.resolve_kernels(config.kernels)  # Pallas where this backend has no kernels for it: refused here
        self.kernels = config.kernels  # static in the compiled steps
        # a mesh: the parameters placed by ess_jax.mesh's rules (a copy unless the model's already are); every
        # data shard has its own batch rows and pages (ess_jax.allocator), the steps run per shard
        self.mesh = mesh.make(shape) if config.mesh else None
        self.shards, self.rows_per_shard = size.shards, config.max_batch // size.shards
        self.layout = self.scratch_layout = None  # the caches' shardings on the mesh (mesh.Layout)
        self.params = mesh.place_params(model.params, self.mesh) if self.mesh else model.params
        # prefill computes on a device scratch for one prompt per data shard (a prefill node's view), then hands off
        scratch_size = dataclasses.replace(size, rows=size.shards, pages=size.shards * (self.pages_per_row + 1))
        with self.on_mesh():
            self.cache = decode_cache(module, size, config, layout)
            if config.offload == "ess":
                self.scratch = self.family.resident_cache(module, scratch_size, self.latent_dtype)
            if self.mesh:
                self.cache, self.layout = self._shard(self.cache, lambda rows, pages: decode_cache(
                    module, dataclasses.replace(size, rows=rows, pages=pages), config, layout))
                if self.scratch is not None:
                    self.scratch, self.scratch_layout = self._shard(self.scratch, lambda rows, pages: (
                        self.family.resident_cache(module, dataclasses.replace(size, rows=rows, pages=pages),
                                                   self.latent_dtype)))
        self.size = size
        self.allocators = [PageAllocator(size.pages // size.shards, config.page_size) for _ in range(size.shards)]
        self.admission = Admission(self.allocators, max_batch=config.max_batch,
                                   max_position_embeddings=self.max_seq_len)
        self.buckets = _buckets(config.prefill_chunk)
        self.requests: dict[int, Request] = {}  # unfinished requests by id (added from any thread)
        # reserved_pages: what the unfinished requests reserve now; peak_reserved_pages: the most at once
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "decode_s": 0.0, "prefill_s": 0.0,
                      "prompt_rows_to_host": 0, "reserved_pages": 0, "peak_reserved_pages": 0}
        self._reserved: dict[int, int] = {}  # pages each unfinished request reserves
        b = config.max_batch
        self._lengths = np.zeros(b, np.int32)  # tokens in the cache per batch row
        self._last = np.zeros(b, np.int32)  # token each row feeds next
        self._decoding: dict[int, int] = {}  # request id -> batch row, for requests past their prefill
        self._prefilling: deque = deque()  # admitted requests (allocator.Admitted) whose prompt is not all cached
        self._pending: dict[int, RequestOutput] = {}  # outputs of aborts done between steps, for the next step
        self._next_id = 0
        self._inbox: deque[int] = deque()  # added requests not yet queued for admission
        self._aborts: set[int] = set()  # abort requests not yet carried out
        self._inbox_lock = threading.Lock()  # guards requests, _inbox, _aborts, _next_id across threads
        self._step_lock = threading.Lock()  # held while the engine's state changes (step, abort)
        self._decode = None  # compiled on the first step

    def _shard(self, cache, build):
        """``cache`` placed on the mesh, each array over ``data`` on its batch-row or page axis (``build(rows,
        pages)`` makes such a cache, for ``mesh.shard_axes``), and its ``mesh.Layout``."""
        shardings = mesh.cache_shardings(cache, mesh.shard_axes(build), self.mesh)
        return jax.device_put(cache, shardings), mesh.Layout.of(shardings)

    def on_mesh(self):
        """The context the engine's arrays are made and its steps run in: ``jax.set_mesh`` of its mesh."""
        return jax.set_mesh(self.mesh) if self.mesh else contextlib.nullcontext()

    # ---- the online API ------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                    stop_token_ids: Sequence[int] = (), *, ignore_eos: bool = False, logprobs: int | None = None,
                    forced_ids: Sequence[int] | None = None) -> int:
        """Queue a request; its id. Safe to call from any thread, also while another thread steps.
        Stops at one of the config's eos ids (unless ``ignore_eos``), one of ``stop_token_ids``, or after
        ``max_new_tokens``. ``logprobs=N`` reports each output token's log-probability and the top N.
        ``forced_ids`` (teacher forcing, to score a text): the request outputs exactly these tokens, one per
        step (the prefill's, then each decode step's), each fed to the next step in place of the sampled one,
        and reports each one's log-probability under the step's logits (``logprobs`` defaults to 0 then);
        ``max_new_tokens`` must equal their number, and no eos or stop id ends it early.
        Raises ValueError naming the problem if the request can never be served."""
        listed = lambda ids: ids if isinstance(ids, (str, bytes)) else list(ids)  # noqa: E731 (str: refused below)
        prompt_ids, stop_token_ids = listed(prompt_ids), listed(stop_token_ids)
        forced_ids = None if forced_ids is None else listed(forced_ids)
        pages = self.check_request(prompt_ids, max_new_tokens, stop_token_ids, logprobs=logprobs, forced_ids=forced_ids)
        check_sampling(sampling)
        prompt = [int(t) for t in prompt_ids]
        forced = None if forced_ids is None else tuple(int(t) for t in forced_ids)
        stop = frozenset(() if ignore_eos else self.model.cfg.eos_token_id) | frozenset(map(int, stop_token_ids))
        if forced is not None:
            stop, logprobs = frozenset(), 0 if logprobs is None else logprobs
        request = Request(prompt, max_new_tokens, sampling, stop, IncrementalDetokenizer(self.model.tokenizer),
                          logprobs, forced_ids=forced)
        with self._inbox_lock:
            request_id = self._next_id
            self._next_id += 1
            self.requests[request_id] = request
            self._inbox.append(request_id)
            self._reserved[request_id] = pages
            self.stats["reserved_pages"] += pages
            self.stats["peak_reserved_pages"] = max(self.stats["peak_reserved_pages"], self.stats["reserved_pages"])
        return request_id

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = (), *,
                      logprobs: int | None = None, forced_ids: Sequence[int] | None = None) -> int:
        """The pages a request would reserve; raises ValueError naming the problem (and the numbers) if it can
        never be served: token ids outside the vocabulary, an empty prompt, more tokens than the engine serves,
        more pages than the pool has, forced ids that are not ``max_new_tokens`` of them or come with stop ids.
        ``add_request`` runs it; callers may run it first to refuse early."""
        vocab = self.model.cfg.vocab_size
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        for name, ids in (("prompt token id", prompt_ids), ("stop token id", stop_token_ids),
                          ("forced token id", forced_ids or ())):
            if isinstance(ids, (str, bytes)):
                raise ValueError(f"{name}s must be a sequence of integers, got {type(ids).__name__}")
            ids = list(ids)
            ints = [t for t in ids if not isinstance(t, bool) and isinstance(t, (int, np.integer))]
            if len(ints) != len(ids):
                wrong = next(t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
                raise ValueError(f"{name} {wrong!r} is not an integer")
            bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"{name} {bad[0]} is outside the vocabulary [0, {vocab})")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer))
                                     or not 0 <= logprobs <= vocab):
            raise ValueError(f"logprobs={logprobs!r} must be an integer in [0, {vocab}] (the vocabulary size)")
        if forced_ids is not None:
            if len(forced_ids) != max_new_tokens:
                raise ValueError(f"{len(forced_ids)} forced ids for max_new_tokens={max_new_tokens}; "
                                 "a forced request outputs exactly its forced ids")
            if len(stop_token_ids):
                raise ValueError("stop_token_ids with forced_ids: a forced request outputs all its forced ids")
        return self.admission.check(None, len(prompt_ids), max_new_tokens)

    def abort(self, request_id: int) -> None:
        """Stop a request: its pages, batch row, host pages and pool slots are free when this returns if
        no step is running, else when the running step ends; the next ``step`` reports it finished with
        reason "abort". A request that already finished is left alone. Safe from any thread."""
        with self._inbox_lock:
            if not 0 <= request_id < self._next_id:
                raise KeyError(f"request {request_id} was never added")
            if request_id not in self.requests:
                return
            self._aborts.add(request_id)
        if self._step_lock.acquire(blocking=False):
            try:
                with self.on_mesh():
                    self._take_inbox()
            finally:
                self._step_lock.release()

    def has_unfinished(self) -> bool:
        with self._inbox_lock:
            return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Admit what fits, run prefill pieces of up to ``prefill_chunk`` tokens in all (the running
        requests wait for at most one chunk), then one decode step for every request past its prefill.
        One output per request that produced tokens, finished or was aborted."""
        with self._step_lock, self.on_mesh():
            if self._decode is None:  # one shape: compile ahead, so decode timings never include compilation
                self._compile_decode()
            self._take_inbox()
            self._prefilling.extend(self.admission.admit(self.config.max_batch))
            new: dict[int, tuple[Request, list]] = {}  # request id -> (request, [(token, f32[V] logits | None)])
            self._prefill_pieces(new)
            if self._decoding:
                self._decode_step(new)
            outputs, self._pending = self._pending, {}
            for request_id, (request, tokens) in new.items():
                outputs[request_id] = _output(request_id, request, tokens)
            return list(outputs.values())

    def run(self) -> list[Request]:
        """Step until every request added so far is finished; those requests in id order."""
        with self._inbox_lock:
            requests = dict(self.requests)
        bar = tqdm(total=sum(r.max_new_tokens for r in requests.values()), desc="generate", unit="tok",
                   file=sys.stderr, disable=not self.progress, leave=False)
        while self.has_unfinished():
            bar.update(sum(len(out.new_token_ids) for out in self.step()))
        if self.scratch is not None:
            with self.on_mesh():  # the last step's rows reach the host store too
                self.cache = _FLUSH(self.family, self.cache, layout=self.layout)
        bar.close()
        return [requests[i] for i in sorted(requests)]

    def usage(self) -> dict[str, int]:
        """What the admitted requests hold now: pages (of the device cache, or the host store with offload),
        batch rows, and device pool slots in use (read from the device); in all and per data shard
        (``per_shard``: pages and rows)."""
        shards = [{"shard": d, "pages_in_use": a.capacity - a.num_free, "pages_total": a.capacity,
                   "rows_in_use": self.rows_per_shard - len(self.admission.free_slots(d)),
                   "rows_total": self.rows_per_shard} for d, a in enumerate(self.allocators)]
        out = {k: sum(s[k] for s in shards) for k in ("pages_in_use", "pages_total", "rows_in_use", "rows_total")}
        out["per_shard"] = shards
        out["requests_waiting"] = len(self.admission.waiting)
        if self.scratch is not None:
            out["pool_slots_in_use"] = int((mesh.host_array(self.family.store_of(self.cache).lru.slot_entry) >= 0).sum())
            out["pool_slots_total"] = self.pool_slots * self.config.max_batch * self.offloaded_part.layers
            out["host_pages_in_use"] = out["pages_in_use"]  # the host store has the cache's pages
            out["host_pages_total"] = out["pages_total"]
            page_bytes = self.offloaded_part.page_bytes(self.config.page_size)
            out["host_bytes_in_use"] = out["pages_in_use"] * page_bytes
            out["host_bytes_total"] = (out["pages_total"] + self.shards) * page_bytes  # with each shard's null page
        return out

    def warm_up(self) -> None:
        """Compile ahead on the calling thread: the decode step, every prefill piece size and the handoff to
        the decode cache, through one request of ``2 x prefill_chunk - 1`` tokens (one piece of each size),
        served to the end. Call it on an idle engine, before serving."""
        if self.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine: requests are unfinished")
        room = min(self.max_seq_len, self.allocators[0].capacity * self.config.page_size) - 1
        self.add_request([0] * min(2 * self.config.prefill_chunk - 1, room), 1, ignore_eos=True)
        self.run()
        self.stats["peak_reserved_pages"] = self.stats["reserved_pages"]  # the warm-up request is no workload

    # ---- host loop -----------------------------------------------------------------------------
    def _take_inbox(self):
        """Queue the added requests for admission and carry out the aborts (engine state; step lock held)."""
        with self._inbox_lock:
            added, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = self._aborts, set()
        for request_id in added:
            request = self.requests[request_id]
            self.admission.submit(request_id, len(request.prompt_ids), request.max_new_tokens)
        for request_id in sorted(aborts):
            if request_id in self.requests:
                request = self.requests[request_id]
                self._finish(request_id, "abort")
                self._pending[request_id] = _output(request_id, request, [])

    def _compile_decode(self):
        b, start = self.config.max_batch, time.perf_counter()
        self._decode = _DECODE.lower(
            self.model.graphdef, self.kernels, self.params, jnp.zeros((b, 1), jnp.int32),
            self._decode_meta(np.zeros(b, bool)), self.cache, self._sampling_arrays([None] * b),
            layout=self.layout).compile()
        self.stats["compile_s"] = time.perf_counter() - start

    def _sampling_arrays(self, requests: list[Request | None]):
        params = [r.sampling if r else SamplingParams() for r in requests]
        steps = [len(r.output_ids) if r else 0 for r in requests]
        return (jnp.asarray([p.temperature for p in params], jnp.float32),
                jnp.asarray([p.top_k for p in params], jnp.int32),
                jnp.asarray([p.top_p for p in params], jnp.float32),
                jnp.asarray([p.seed for p in params], jnp.uint32),
                jnp.asarray(steps, jnp.int32))

    def _prefill_pieces(self, new: dict[int, tuple[Request, list]]):
        """Prefill the admitted prompts, each data shard its own in admission order, one exact piece at a time
        (the largest bucket that fits the rest of the prompt, so a prompt's pieces never depend on the others),
        while the shard's ``prefill_chunk`` tokens of the step last. The shards' pieces of one size run as one
        call, a row per shard (offloaded engines prefill a prompt per shard on their scratch)."""
        budget = [self.config.prefill_chunk] * self.shards
        while True:
            heads: dict[int, tuple[Admitted, Request, int]] = {}  # each shard's first prompt and its next piece
            for entry in self._prefilling:
                shard = entry.slot // self.rows_per_shard
                if shard not in heads:
                    request = self.requests[entry.request_id]
                    real = max(b for b in self.buckets if b <= len(request.prompt_ids) - request.prefilled)
                    heads[shard] = (entry, request, real)
            runs = {shard: head for shard, head in heads.items() if head[2] <= budget[shard]}
            if not runs:
                return
            for real in sorted({head[2] for head in runs.values()}, reverse=True):
                group = {shard: head[:2] for shard, head in runs.items() if head[2] == real}
                for shard in group:
                    budget[shard] -= real
                self._prefill_piece(group, real, new)

    def _tables(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A request's page table ``pages_X`` and its scratch table ``table_X`` (offloaded prompts fill their
        shard's scratch pages 1..n, then move to their own pages)."""
        pages_X = np.zeros(self.pages_per_row, np.int32)
        pages_X[: pages.size] = pages
        return pages_X, np.where(pages_X > 0, np.arange(1, self.pages_per_row + 1), 0).astype(np.int32)

    def _prefill_piece(self, group: dict[int, tuple[Admitted, Request]], real: int,
                       new: dict[int, tuple[Request, list]]):
        """The next ``real`` prompt tokens of one request per data shard in ``group`` (shard -> request), as one
        call; the shards without one do not run. Requests whose prompt is then all cached join the decode."""
        shards, offloaded = self.shards, self.scratch is not None
        tokens, positions = np.zeros((shards, real), np.int32), np.zeros((shards, real), np.int32)
        valid, rows = np.zeros((shards, real), bool), np.zeros(shards, np.int32)
        table = np.zeros((shards, self.pages_per_row), np.int32)
        requests: list[Request | None] = [None] * shards
        for shard, (entry, request) in group.items():
            pages_X, table_X = self._tables(entry.pages)
            start = request.prefilled
            tokens[shard] = request.prompt_ids[start:start + real]
            positions[shard], valid[shard] = start + np.arange(real), True
            table[shard] = table_X if offloaded else pages_X
            rows[shard] = 0 if offloaded else entry.slot % self.rows_per_shard  # offloaded: the shard's scratch row
            requests[shard] = request
        cache, layout = (self.scratch, self.scratch_layout) if offloaded else (self.cache, self.layout)
        start_time = time.perf_counter()
        meta = StepMeta(*(jnp.asarray(x) for x in (positions, valid, table, rows)))
        token, logits_BV, ids_LBTK, cache = _PREFILL(self.model.graphdef, self.kernels, self.params,
                                                     jnp.asarray(tokens), meta, cache,
                                                     jnp.full((shards,), real - 1, jnp.int32),
                                                     self._sampling_arrays(requests), layout=layout)
        token.block_until_ready()  # stats["prefill_s"] times the piece, not its dispatch
        done: dict[int, tuple[Admitted, Request]] = {}
        for shard, (entry, request) in group.items():
            if offloaded:  # the warm-up reads the last two pieces' windows
                request.windows = request.windows[-1:] + [(real, ids_LBTK[:, shard])]
            request.prefilled += real
            self.stats["prefill_tokens"] += real
            if request.prefilled == len(request.prompt_ids):
                done[shard] = (entry, request)
        if offloaded:
            self.scratch = cache
            if done:
                self._handoff(done)
        else:
            self.cache = cache
        self.stats["prefill_s"] += time.perf_counter() - start_time
        if not done:
            return
        finished = {entry.request_id for entry, _ in done.values()}
        self._prefilling = deque(e for e in self._prefilling if e.request_id not in finished)
        sampled = mesh.host_array(token)
        for shard, (entry, request) in done.items():
            request.windows = []
            self._lengths[entry.slot] = len(request.prompt_ids)
            self._decoding[entry.request_id] = entry.slot
            self._append(entry.request_id, entry.slot, int(sampled[shard]), logits_BV, shard, new)

    def _handoff(self, done: dict[int, tuple[Admitted, Request]]):
        """The prompts prefilled on their shards' scratch rows (``done``: shard -> request) into the decode cache:
        one call, a request per shard (the others: no row, no pages, no entries)."""
        shards, width = self.shards, self.pages_per_row
        table, pages = np.zeros((shards, width), np.int32), np.zeros((shards, width), np.int32)
        rows, entries = np.full(shards, self.rows_per_shard, np.int32), np.zeros(shards, np.int32)
        ids = {}
        for shard, (entry, request) in done.items():
            pages[shard], table[shard] = self._tables(entry.pages)
            rows[shard] = entry.slot % self.rows_per_shard
            entries[shard] = self.offloaded_part.entries(len(request.prompt_ids))
            ids[shard] = _last_queries(request.windows)
            self.stats["prompt_rows_to_host"] += int(entries[shard]) * self.offloaded_part.layers
        none = jnp.full_like(next(iter(ids.values())), -1)
        ids_LDTK = jnp.stack([ids.get(shard, none) for shard in range(shards)], axis=1)
        self.cache = _HANDOFF(self.family, self.cache, self.scratch, jnp.asarray(table), jnp.asarray(pages),
                              jnp.asarray(rows), jnp.asarray(entries), ids_LDTK, layout=self.layout,
                              scratch_layout=self.scratch_layout)

    def _decode_step(self, new: dict[int, tuple[Request, list]]) -> int:
        rows: list[Request | None] = [None] * self.config.max_batch
        for request_id, slot in self._decoding.items():
            rows[slot] = self.requests[request_id]
        active = np.array([r is not None for r in rows])
        meta = self._decode_meta(active)
        start = time.perf_counter()
        tokens, logits_BV, self.cache = self._decode(self.params, jnp.asarray(self._last[:, None]), meta,
                                                     self.cache, self._sampling_arrays(rows))
        tokens = mesh.host_array(tokens)
        self.stats["decode_s"] += time.perf_counter() - start
        self._lengths += active
        self.stats["decode_tokens"] += len(self._decoding)
        for request_id, slot in list(self._decoding.items()):
            self._append(request_id, slot, int(tokens[slot]), logits_BV, slot, new)
        return int(active.sum())

    def _decode_meta(self, active_B: np.ndarray) -> StepMeta:
        return StepMeta(jnp.asarray(self._lengths[:, None]), jnp.asarray(active_B[:, None]),
                        jnp.asarray(self.admission.page_table(self.pages_per_row)),
                        jnp.asarray(np.arange(self.config.max_batch, dtype=np.int32) % self.rows_per_shard))

    def _append(self, request_id: int, slot: int, token: int, logits_BV: jax.Array, b: int,
                new: dict[int, tuple[Request, list]]):
        """Record ``token`` (a forced request's next forced id instead) for the request; its logits (row
        ``b`` of ``logits_BV``) are read back only if kept or asked for (logprobs)."""
        request = self.requests[request_id]
        if request.forced_ids is not None:
            token = request.forced_ids[len(request.output_ids)]
        request.output_ids.append(token)
        kept = None
        if self.config.keep_logits or request.logprobs is not None:
            kept = mesh.host_array(logits_BV[b]).astype(np.float32)
            if self.config.keep_logits:
                request.logits.append(kept)
        new.setdefault(request_id, (request, []))[1].append((token, kept))
        self._last[slot] = token
        if token in request.stop_ids:
            self._finish(request_id, "stop")
        elif len(request.output_ids) >= request.max_new_tokens:
            self._finish(request_id, "length")

    def _finish(self, request_id: int, reason: str):
        """Release everything the request holds: queue place, or pages, batch row and pool slots."""
        request = self.requests[request_id]
        request.finish_reason = reason
        if request_id in self.admission.waiting:
            self.admission.cancel(request_id)
        elif request_id in self.admission.running:
            _, slot, pages = self.admission.running[request_id]
            if self.scratch is not None:
                shard, row = divmod(slot, self.rows_per_shard)  # on its shard; the others: no row, no pages
                rows_D = np.full(self.shards, self.rows_per_shard, np.int32)
                pages_DX = np.zeros((self.shards, self.pages_per_row), np.int32)
                rows_D[shard], pages_DX[shard] = row, self._tables(pages)[0]
                self.cache = _RELEASE(self.family, self.cache, jnp.asarray(rows_D), jnp.asarray(pages_DX),
                                      layout=self.layout)
            self.admission.finish(request_id)
            self._decoding.pop(request_id, None)
            self._prefilling = deque(e for e in self._prefilling if e.request_id != request_id)
            self._lengths[slot] = 0
        with self._inbox_lock:
            del self.requests[request_id]
            self.stats["reserved_pages"] -= self._reserved.pop(request_id, 0)

    def cache_bytes(self) -> dict[str, int]:
        """Bytes of the real cache arrays: device (the decode-time cache), host (the offload store), and
        what the requests would occupy on the device without offload (from the cache parts: their reserved
        pages of every paged part and every batch row's fixed parts): at the peak of the requests reserved at
        once (``resident_device_bytes``; for a batch added at once, all of it) and for the unfinished requests
        now (``resident_device_bytes_now``). Finished requests count in neither once gone, so a long-lived
        engine's figures stay bounded."""
        arrays = jax.tree.leaves(self.cache)
        host = 0
        if self.scratch is not None:
            store = self.family.store_of(self.cache).host
            host = store.nbytes
            arrays = [x for x in arrays if all(x is not y for y in jax.tree.leaves(store))]
        peak = families.resident_bytes(self.parts, self.size, self.stats["peak_reserved_pages"])
        now = families.resident_bytes(self.parts, self.size, self.stats["reserved_pages"])
        out = {"device_bytes": int(sum(x.nbytes for x in arrays)), "host_bytes": int(host),
               "resident_device_bytes": int(peak), "resident_device_bytes_now": int(now)}
        if self.scratch is not None:
            out["prefill_scratch_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(self.scratch)))
        return out

    def offload_metrics(self) -> dict | None:
        """Tier counters (read from the device once) as the ``--json`` ``metrics.offload`` object."""
        if self.scratch is None:
            return None
        rows_LB4 = mesh.host_array(self.family.store_of(self.cache).counters)  # lookups, hits, misses, staged
        counts = rows_LB4.sum(1)
        layers = self.family.sparse_layers(self.model.cfg)
        lookups, hits, misses, staged = (int(x) for x in counts.sum(0))
        shards = self.mesh.shape["data"] if self.mesh else 1
        per_shard = rows_LB4.reshape(rows_LB4.shape[0], shards, -1, 4).sum((0, 2))  # the data shards' rows, in order
        row_bytes = self.row_bytes
        return {"lookups": lookups, "hits": hits, "misses": misses,
                "hit_rate": hits / lookups if lookups else 0.0,
                "h2d_bytes": misses * row_bytes,
                "d2h_bytes": (self.stats["prompt_rows_to_host"] + staged) * row_bytes,
                "decode_d2h_bytes": staged * row_bytes,
                "pool_slots": self.pool_slots,
                "per_layer": [{"layer": i, "lookups": int(c[0]), "hits": int(c[1]), "misses": int(c[2]),
                               "h2d_bytes": int(c[2]) * row_bytes, "decode_d2h_bytes": int(c[3]) * row_bytes}
                              for i, c in zip(layers, counts)],
                "per_shard": [{"shard": d, "lookups": int(c[0]), "hits": int(c[1]), "misses": int(c[2])}
                              for d, c in enumerate(per_shard)]}



def _output(request_id: int, request: Request, tokens: list) -> RequestOutput:
    ids = [t for t, _ in tokens]
    finished = request.finish_reason is not None
    delta = request.detokenizer.push(ids, final=finished)
    logprobs = None
    if request.logprobs is not None:
        logprobs = [_token_logprob(t, logits, request.logprobs) for t, logits in tokens]
    return RequestOutput(request_id, ids, delta, finished, request.finish_reason, logprobs)


def _token_logprob(token: int, logits_V: np.ndarray, top: int) -> TokenLogprob:
    """Log-softmax of the raw logits (float64 on the host): the token's value and the ``top`` largest."""
    logits = logits_V.astype(np.float64)
    shifted = logits - logits.max()
    logprobs_V = shifted - np.log(np.exp(shifted).sum())
    best = np.argsort(-logprobs_V, kind="stable")[:top] if top else ()
    return TokenLogprob(token, float(logprobs_V[token]), tuple((int(i), float(logprobs_V[i])) for i in best))


def _last_queries(windows: list[tuple[int, jax.Array]]) -> jax.Array:
    """The top-k ids ``i32[L, T, K]`` of the prompt's last ``WARMUP_QUERIES`` positions, from the
    per-chunk windows (each chunk's last Q real tokens, -1 before the chunk)."""
    q = tier.WARMUP_QUERIES
    real, ids = windows[-1]
    if real >= q or len(windows) == 1:
        return ids
    return jnp.concatenate([windows[-2][1][:, real:], ids[:, q - real:]], axis=1)

"""The serving engine: paged cache, admission, chunked prefill, continuous batched decode.

The host does bookkeeping (pages, batch rows, stop conditions) in NumPy; the device runs two
jitted functions, both donating the cache:
- ``prefill``: one piece of one request's prompt, ``[1, T]``: pieces of ``prefill_chunk`` tokens,
  the remainder cut into power-of-two pieces (exact, never padded, so compiles stay bounded),
  and the token sampled after the prompt's last token;
- ``decode``: one token for every batch row, ``[max_batch, 1]``; inactive rows are masked.
Requests join the batch when admitted (their pages reserved for prompt + max_new_tokens) and
leave when they stop, while the others keep decoding. A request's tokens do not depend on what
else is in the batch: every row is computed independently and sampled from its own seed.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Sequence

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from ess_jax import ops, tier
from ess_jax.allocator import Admission, PageAllocator
from ess_jax.cache import PagedCacheV32, StepMeta
from ess_jax.models.deepseek_v4 import V4Cache, V4Entries
from ess_jax.sampling import SamplingParams, sample


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # f32[V] per output token, if kept
    finish_reason: str | None = None  # "stop" (an eos token) or "length" (max_new_tokens)


CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "fp8": jnp.uint8}  # fp8: 656-byte-style rows


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # decode batch rows
    page_size: int = 64  # tokens per cache page
    num_pages: int | None = None  # pages in the pool incl. the null page; default: max_batch full-length requests
    max_seq_len: int | None = None  # longest prompt + max_new_tokens served; default: max_position_embeddings
    prefill_chunk: int = 256  # longest prefill piece; a shorter remainder is cut into power-of-two pieces
    offload: str = "none"  # "ess": latent rows in host memory behind an LRU device pool (ess_jax.tier)
    pool_size: int | None = None  # ess: pool slots per (layer, request); wins over pool_ratio
    pool_ratio: float = 0.2  # ess: pool slots as a fraction of the longest request's entries
    fetch: str = "inline"  # ess: "inline" or "split" (ess_jax.tier)
    host_cache_mb: float | None = None  # ess: host store budget; sets the page count when given
    keep_logits: bool = False  # keep each output token's float32 logits in Request.logits
    kernels: str = "xla"  # attention kernels: "xla", "pallas", "auto" (Pallas on GPU, XLA elsewhere)
    cache_dtype: str | None = None  # V3.2 latent rows / V4 CSA entries: None = the model's dtype, or "bfloat16",
    # "float32", "fp8" (656-byte V3.2 rows, 584-byte V4 rows at the real shapes; ess_jax.pallas_kernels.fp8_rows)

    def __post_init__(self):
        for name in ("max_batch", "page_size", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.offload not in ("none", "ess"):
            raise ValueError(f"--offload {self.offload!r} is not a mode; use 'ess' or 'none'")
        ops.resolve_kernels(self.kernels)  # raises for an unknown choice
        if self.cache_dtype not in (None, *CACHE_DTYPES):
            raise ValueError(f"--cache-dtype {self.cache_dtype!r} is not a cache dtype; use one of "
                             f"{', '.join(CACHE_DTYPES)}")
        if self.fetch not in tier.FETCH_BACKENDS:
            raise ValueError(f"--fetch {self.fetch!r} is not a fetch backend; use one of "
                             f"{', '.join(tier.FETCH_BACKENDS)}")


def _prefill(graphdef, params, tokens_BT, meta: StepMeta, cache, last_B, sampling):
    """One prefill chunk. Returns the token sampled after each row's last real token ``i32[B]``, the
    top-k ids of the chunk's last ``WARMUP_QUERIES`` real tokens ``i32[L, B, Q, K]`` (-1 before the
    chunk) and the cache."""
    logits_BTV, ids_LBTK, cache = nnx.merge(graphdef, params).step(tokens_BT, meta, cache)
    logits_BV = jnp.take_along_axis(logits_BTV, last_B[:, None, None], axis=1)[:, 0]
    window_BQ = last_B[:, None] - tier.WARMUP_QUERIES + 1 + jnp.arange(tier.WARMUP_QUERIES)
    ids_LBQK = jnp.take_along_axis(ids_LBTK, jnp.maximum(window_BQ, 0)[None, :, :, None], axis=2)
    ids_LBQK = jnp.where((window_BQ >= 0)[None, :, :, None], ids_LBQK, -1)
    return sample(logits_BV, *sampling), logits_BV, ids_LBQK, cache


def _decode(graphdef, params, tokens_BT, meta: StepMeta, cache, sampling):
    """One decode step for every batch row; the sampled tokens ``i32[B]``."""
    logits_BTV, _, cache = nnx.merge(graphdef, params).step(tokens_BT, meta, cache.begin_step())
    return sample(logits_BTV[:, -1], *sampling), logits_BTV[:, -1], cache


def _admit_offloaded(cache, scratch, scratch_table_X, pages_X, slot, prompt_len, ids_LQK):
    """After an offloaded prefill: the prompt's indexer keys into their global pages, its latent rows
    into the host store (inline), and the request's pool rows warmed."""
    index_keys = cache.index_keys.at[:, pages_X].set(scratch.index_keys[:, scratch_table_X])
    latent = cache.latent
    if latent.store is None:  # pending rows first: a finished request's last row must not land on reused pages
        latent = tier.store_prompt(latent.flush(), scratch.latent.pages, scratch_table_X, pages_X)
    latent = tier.warm(latent, scratch.latent.pages, scratch_table_X, pages_X, slot, prompt_len, ids_LQK)
    return dataclasses.replace(cache, index_keys=index_keys, latent=latent)


def _admit_offloaded_v4(cache: V4Cache, scratch: V4Cache, slot, prompt_len, entries, ids_LQK):
    """After a V4 offloaded prefill (HiSparse): the request's state, indexer keys and HCA entries into
    its batch row, its CSA entries into its host page (row + 1; inline), and its pools warmed."""
    put = lambda x, new: x.at[:, slot].set(new[:, 0])
    en, sc = cache.entries, scratch.entries
    table_X, pages_X = jnp.zeros((1,), jnp.int32), jnp.reshape(slot + 1, (1,)).astype(jnp.int32)
    csa = en.csa
    if csa.store is None:  # pending rows first, as for V3.2
        csa = tier.store_prompt(csa.flush(), sc.csa, table_X, pages_X)
    csa = tier.warm(csa, sc.csa, table_X, pages_X, slot, entries, ids_LQK)
    return V4Cache(jax.tree.map(put, cache.state, scratch.state),
                   V4Entries(csa, put(en.index_keys, sc.index_keys), put(en.hca, sc.hca)),
                   cache.lengths.at[slot].set(prompt_len), cache.kernels)


def _tier_of(cache):
    """The offloaded store of a cache: V3.2's latent rows or V4's CSA entries."""
    return cache.entries.csa if isinstance(cache, V4Cache) else cache.latent


def _flush(cache):
    flushed = _tier_of(cache).flush()
    if isinstance(cache, V4Cache):
        return dataclasses.replace(cache, entries=dataclasses.replace(cache.entries, csa=flushed))
    return dataclasses.replace(cache, latent=flushed)


# Module-level jits: engines over the same model and shapes share compiled executables.
_PREFILL = jax.jit(_prefill, static_argnums=0, donate_argnums=4)
_DECODE = jax.jit(_decode, static_argnums=0, donate_argnums=4)
_ADMIT_OFFLOADED = jax.jit(_admit_offloaded, donate_argnums=0)
_ADMIT_OFFLOADED_V4 = jax.jit(_admit_offloaded_v4, donate_argnums=0)
_FLUSH = jax.jit(_flush, donate_argnums=0)


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
        self.max_seq_len = min(config.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.pages_per_row = math.ceil(self.max_seq_len / config.page_size)
        num_pages = config.num_pages or config.max_batch * self.pages_per_row + 1
        module = model.module
        self.pool_slots = None
        self.latent_dtype = CACHE_DTYPES[config.cache_dtype] if config.cache_dtype else module.dtype
        if cfg.family == "deepseek_v32":
            self.row_bytes = (ops.mla_row_width(cfg.kv_lora_rank, cfg.qk_rope_head_dim, self.latent_dtype)
                              * jnp.dtype(self.latent_dtype).itemsize)
        else:  # one CSA entry
            self.row_bytes = (ops.v4_row_width(cfg.head_dim, cfg.qk_rope_head_dim, self.latent_dtype)
                              * jnp.dtype(self.latent_dtype).itemsize)
        if config.offload == "ess" and cfg.family == "deepseek_v32":
            self.pool_slots = tier.pool_slots(pool_size=config.pool_size, pool_ratio=config.pool_ratio,
                                              max_seq_len=self.max_seq_len, index_topk=cfg.index_topk)
            if config.host_cache_mb is not None:
                page_bytes = cfg.num_hidden_layers * config.page_size * self.row_bytes
                num_pages = int(config.host_cache_mb * 2**20 // page_bytes)
                if num_pages < 1 + self.pages_per_row:
                    raise ValueError(
                        f"--host-cache-mb {config.host_cache_mb} holds {max(num_pages - 1, 0)} pages of "
                        f"{page_bytes / 2**20:.3f} MiB; the longest request needs {self.pages_per_row}: raise it to at "
                        f"least {math.ceil((1 + self.pages_per_row) * page_bytes / 2**20)}")
        elif config.offload == "ess":  # V4: HiSparse over the CSA entries, one host page of entries per batch row
            self.csa_layers, _ = module.layer_groups()
            self.entries_per_row = self.max_seq_len // cfg.compress_rate_csa
            if not self.csa_layers or self.entries_per_row < 1:
                raise ValueError(f"--offload ess offloads CSA entries; this {cfg.family} model has "
                                 f"{'no CSA layers' if not self.csa_layers else 'requests too short for one entry'} "
                                 f"(max_seq_len {self.max_seq_len}): use --offload none")
            self.pool_slots = tier.pool_slots(pool_size=config.pool_size, pool_ratio=config.pool_ratio,
                                              max_seq_len=self.entries_per_row, index_topk=cfg.index_topk)
            host_bytes = len(self.csa_layers) * (config.max_batch + 1) * self.entries_per_row * self.row_bytes
            if config.host_cache_mb is not None and host_bytes > config.host_cache_mb * 2**20:
                raise ValueError(f"--host-cache-mb {config.host_cache_mb} is below the CSA entry store of "
                                 f"--max-batch {config.max_batch} requests of {self.max_seq_len} tokens "
                                 f"({host_bytes / 2**20:.2f} MiB): raise it or lower --max-batch / --max-seq-len")
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.admission = Admission(self.allocator, max_batch=config.max_batch,
                                   max_position_embeddings=self.max_seq_len)
        self.scratch = None
        if cfg.family == "deepseek_v4" and self.pool_slots is None:  # per-request rows, sized for max_seq_len
            self.cache = dataclasses.replace(module.init_cache(config.max_batch, self.max_seq_len, self.latent_dtype),
                                             kernels=config.kernels)
        elif cfg.family == "deepseek_v4":  # HiSparse: CSA entries to the tier, the rest resident per row
            shapes = jax.eval_shape(lambda: module.init_cache(config.max_batch, self.max_seq_len, self.latent_dtype))
            zeros = lambda x: jnp.zeros(x.shape, x.dtype)
            csa = tier.init_tiered(layers=len(self.csa_layers), batch=config.max_batch, slots=self.pool_slots,
                                   num_pages=config.max_batch + 1, page_size=self.entries_per_row,
                                   width=shapes.entries.csa.shape[-1], dtype=self.latent_dtype, fetch=config.fetch,
                                   kernels=config.kernels)
            self.cache = V4Cache(jax.tree.map(zeros, shapes.state),
                                 V4Entries(csa, zeros(shapes.entries.index_keys), zeros(shapes.entries.hca)),
                                 zeros(shapes.lengths), config.kernels)
            # one prompt's resident cache
            self.scratch = dataclasses.replace(module.init_cache(1, self.max_seq_len, self.latent_dtype),
                                               kernels=config.kernels)
        elif self.pool_slots is None:  # V3.2, resident: latent pages shared by all requests
            self.cache = self._resident_cache(module, num_pages)
        else:  # V3.2, ESS: indexer keys stay in device pages, latent rows go to the tier
            shapes = jax.eval_shape(lambda: module.init_cache(num_pages, config.page_size, self.latent_dtype))
            self.cache = PagedCacheV32(
                index_keys=jnp.zeros(shapes.index_keys.shape, shapes.index_keys.dtype),
                latent=tier.init_tiered(layers=cfg.num_hidden_layers, batch=config.max_batch, slots=self.pool_slots,
                                        num_pages=num_pages, page_size=config.page_size,
                                        width=shapes.latent.pages.shape[-1], dtype=self.latent_dtype,
                                        fetch=config.fetch, kernels=config.kernels))
            # prefill computes on a device scratch for one prompt (a prefill node's view), then hands off
            self.scratch = self._resident_cache(module, self.pages_per_row + 1)
        self.buckets = _buckets(config.prefill_chunk)
        self.requests: dict[int, Request] = {}
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "decode_s": 0.0, "prefill_s": 0.0,
                      "prompt_rows_to_host": 0}
        b = config.max_batch
        self._lengths = np.zeros(b, np.int32)  # tokens in the cache per batch row
        self._last = np.zeros(b, np.int32)  # token each row feeds next
        self._decode = None  # compiled on the first run()

    def _resident_cache(self, module, num_pages: int) -> PagedCacheV32:
        cache = module.init_cache(num_pages, self.config.page_size, self.latent_dtype)
        return dataclasses.replace(cache, latent=dataclasses.replace(cache.latent, kernels=self.config.kernels))

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams()) -> int:
        """Queue a request; raises ValueError naming the problem if it can never be served."""
        prompt = [int(t) for t in prompt_ids]
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        request_id = len(self.requests)
        self.admission.submit(request_id, len(prompt), max_new_tokens)
        self.requests[request_id] = Request(prompt, max_new_tokens, sampling)
        return request_id

    def run(self) -> list[Request]:
        """Serve every submitted request to completion; requests in submission order."""
        if self._decode is None:  # one shape: compile ahead, so decode timings never include compilation
            b, start = self.config.max_batch, time.perf_counter()
            self._decode = _DECODE.lower(
                self.model.graphdef, self.model.params, jnp.zeros((b, 1), jnp.int32),
                self._decode_meta(np.zeros(b, bool)), self.cache, self._sampling_arrays([None] * b)).compile()
            self.stats["compile_s"] = time.perf_counter() - start
        pending = [r for r in self.requests.values() if r.finish_reason is None]
        self._bar = tqdm(total=sum(len(r.prompt_ids) + r.max_new_tokens for r in pending), desc="prefill + decode",
                         unit="tok", file=sys.stderr, disable=not self.progress, leave=False)
        while self.admission.running or self.admission.waiting:
            for entry in self.admission.admit(self.config.max_batch):
                self._prefill_request(entry.request_id, entry.slot, entry.pages)
                self._bar.update(1)
            if self.admission.running:
                self._bar.update(self._decode_step())
        if self.scratch is not None and _tier_of(self.cache).store is None:
            self.cache = _FLUSH(self.cache)  # the last step's rows reach the host store too
        self._bar.close()
        return [self.requests[i] for i in sorted(self.requests)]

    # ---- host loop -----------------------------------------------------------------------------
    def _sampling_arrays(self, requests: list[Request | None]):
        params = [r.sampling if r else SamplingParams() for r in requests]
        steps = [len(r.output_ids) if r else 0 for r in requests]
        return (jnp.asarray([p.temperature for p in params], jnp.float32),
                jnp.asarray([p.top_k for p in params], jnp.int32),
                jnp.asarray([p.top_p for p in params], jnp.float32),
                jnp.asarray([p.seed for p in params], jnp.uint32),
                jnp.asarray(steps, jnp.int32))

    def _prefill_request(self, request_id: int, slot: int, pages: np.ndarray):
        request = self.requests[request_id]
        prompt = np.asarray(request.prompt_ids, np.int32)
        pages_X = np.zeros(self.pages_per_row, np.int32)
        pages_X[: pages.size] = pages
        offloaded = self.scratch is not None
        v4 = self.model.cfg.family == "deepseek_v4"
        # offloaded V3.2 prompts fill the scratch's pages 1..n, then move to their global pages; offloaded
        # V4 prompts fill the scratch's one row
        table_X = np.where(pages_X > 0, np.arange(1, self.pages_per_row + 1), 0).astype(np.int32)
        cache = self.scratch if offloaded else self.cache
        row = 0 if offloaded and v4 else slot
        start_time, start, windows = time.perf_counter(), 0, []
        while start < len(prompt):
            # exact pieces, no padding: the largest bucket that fits, so compiles stay bounded
            real = max(b for b in self.buckets if b <= len(prompt) - start)
            meta = StepMeta(jnp.asarray((start + np.arange(real, dtype=np.int32))[None]), jnp.ones((1, real), bool),
                            jnp.asarray((table_X if offloaded else pages_X)[None]), jnp.asarray([row], jnp.int32))
            token, logits_BV, ids_LBQK, cache = _PREFILL(self.model.graphdef, self.model.params,
                                                         jnp.asarray(prompt[None, start:start + real]), meta, cache,
                                                         jnp.asarray([real - 1], jnp.int32),
                                                         self._sampling_arrays([request]))
            windows.append((real, ids_LBQK[:, 0]))
            start += real
            self._bar.update(real)
        if offloaded and v4:
            self.scratch = cache
            entries = len(prompt) // self.model.cfg.compress_rate_csa
            self.cache = _ADMIT_OFFLOADED_V4(self.cache, self.scratch, slot, len(prompt), entries,
                                             _last_queries(windows))
            csa = self.cache.entries.csa
            if csa.store is not None:  # split: the prompt's entries go to the NumPy store from here
                csa.store.array[:, slot + 1] = np.asarray(self.scratch.entries.csa)[:, 0]
            self.stats["prompt_rows_to_host"] += entries * len(self.csa_layers)
        elif offloaded:
            self.scratch = cache
            self.cache = _ADMIT_OFFLOADED(self.cache, self.scratch, jnp.asarray(table_X), jnp.asarray(pages_X),
                                          slot, len(prompt), _last_queries(windows))
            latent = self.cache.latent
            if latent.store is not None:  # split: the prompt's rows go to the NumPy store from here
                scratch_rows = np.asarray(self.scratch.latent.pages)[:, table_X[: pages.size]]
                latent.store.array[:, pages] = scratch_rows
            self.stats["prompt_rows_to_host"] += len(prompt) * self.model.cfg.num_hidden_layers
        else:
            self.cache = cache
        self.stats["prefill_tokens"] += len(prompt)
        self.stats["prefill_s"] += time.perf_counter() - start_time
        self._lengths[slot] = len(prompt)
        if self.config.keep_logits:
            request.logits.append(np.asarray(logits_BV[0]))
        self._append(request_id, slot, int(token[0]))

    def _decode_step(self) -> int:
        running = self.admission.running
        rows: list[Request | None] = [None] * self.config.max_batch
        for request_id, entry in running.items():
            rows[entry.slot] = self.requests[request_id]
        active = np.array([r is not None for r in rows])
        meta = self._decode_meta(active)
        start = time.perf_counter()
        tokens, logits_BV, self.cache = self._decode(self.model.params, jnp.asarray(self._last[:, None]), meta, self.cache,
                                          self._sampling_arrays(rows))
        tokens = np.asarray(tokens)
        offloaded = _tier_of(self.cache) if self.scratch is not None else None
        if offloaded is not None and offloaded.store is not None:  # split: back up this step's new entries,
            pages, offsets = np.asarray(offloaded.staged_page), np.asarray(offloaded.staged_offset)  # page 0: none
            new = pages > 0
            offloaded.store.array[:, pages[new], offsets[new]] = np.asarray(offloaded.staged)[:, new]  # one transfer
        self.stats["decode_s"] += time.perf_counter() - start
        self._lengths += active
        self.stats["decode_tokens"] += len(running)
        for request_id, entry in running.items():
            if self.config.keep_logits:
                self.requests[request_id].logits.append(np.asarray(logits_BV[entry.slot]))
            self._append(request_id, entry.slot, int(tokens[entry.slot]))
        return len(running)

    def _decode_meta(self, active_B: np.ndarray) -> StepMeta:
        return StepMeta(jnp.asarray(self._lengths[:, None]), jnp.asarray(active_B[:, None]),
                        jnp.asarray(self.admission.page_table(self.pages_per_row)),
                        jnp.arange(self.config.max_batch, dtype=jnp.int32))

    def _append(self, request_id: int, slot: int, token: int):
        request = self.requests[request_id]
        request.output_ids.append(token)
        self._last[slot] = token
        if token in self.model.cfg.eos_token_id:
            request.finish_reason = "stop"
        elif len(request.output_ids) >= request.max_new_tokens:
            request.finish_reason = "length"
        if request.finish_reason is not None:
            self.admission.finish(request_id)
            self._lengths[slot] = 0

    def cache_bytes(self) -> dict[str, int]:
        """Bytes of the real cache arrays: device (the decode-time cache), host (the offload store), and
        what the served requests would occupy on the device without offload (V3.2: their reserved
        pages of latent rows and indexer keys; V4: the resident per-row cache of ``max_batch`` rows)."""
        arrays = jax.tree.leaves(self.cache)
        host = 0
        if self.scratch is not None:
            offloaded = _tier_of(self.cache)
            host = offloaded.store.array.nbytes if offloaded.store is not None else offloaded.host.nbytes
            arrays = [x for x in arrays if x is not offloaded.host]
        device = sum(x.nbytes for x in arrays)
        resident = device
        cfg = self.model.cfg
        if cfg.family == "deepseek_v4":
            shapes = jax.eval_shape(lambda: self.model.module.init_cache(self.config.max_batch, self.max_seq_len,
                                                                         self.latent_dtype))
            resident = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
        else:
            keys = self.cache.index_keys
            per_token = cfg.num_hidden_layers * (self.row_bytes + keys.shape[-1] * keys.itemsize)
            reserved = sum(self.allocator.pages_for(len(r.prompt_ids) + r.max_new_tokens)
                           for r in self.requests.values())
            resident = reserved * self.config.page_size * per_token
        out = {"device_bytes": int(device), "host_bytes": int(host), "resident_device_bytes": int(resident)}
        if self.scratch is not None:
            out["prefill_scratch_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(self.scratch)))
        return out

    def offload_metrics(self) -> dict | None:
        """Tier counters (read from the device once) as the ``--json`` ``metrics.offload`` object."""
        if self.scratch is None:
            return None
        counts = np.asarray(_tier_of(self.cache).counters)  # [L, 4] lookups, hits, misses, staged (per layer)
        layers = self.csa_layers if self.model.cfg.family == "deepseek_v4" else range(len(counts))
        lookups, hits, misses, staged = (int(x) for x in counts.sum(0))
        row_bytes = self.row_bytes
        return {"lookups": lookups, "hits": hits, "misses": misses,
                "hit_rate": hits / lookups if lookups else 0.0,
                "h2d_bytes": misses * row_bytes,
                "d2h_bytes": (self.stats["prompt_rows_to_host"] + staged) * row_bytes,
                "decode_d2h_bytes": staged * row_bytes,
                "pool_slots": self.pool_slots,
                "per_layer": [{"layer": i, "lookups": int(c[0]), "hits": int(c[1]), "misses": int(c[2])}
                              for i, c in zip(layers, counts)]}


def _last_queries(windows: list[tuple[int, jax.Array]]) -> jax.Array:
    """The top-k ids ``i32[L, Q, K]`` of the prompt's last ``WARMUP_QUERIES`` positions, from the
    per-chunk windows (each chunk's last Q real tokens, -1 before the chunk)."""
    q = tier.WARMUP_QUERIES
    real, ids = windows[-1]
    if real >= q or len(windows) == 1:
        return ids
    return jnp.concatenate([windows[-2][1][:, real:], ids[:, q - real:]], axis=1)

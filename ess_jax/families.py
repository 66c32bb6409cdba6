"""The model families: one registry entry per ``model_type``, carrying everything that differs between
DeepSeek-V3.2 and DeepSeek-V4 above the models.

A ``Family`` holds (its config parser and checks are ``ess_jax.config``'s, which imports nothing of
ess_jax)
- the NNX module class and the checkpoint's tensor renames (both imported on first use: the models
  import flax, which ``python -m ess_jax.plan`` never loads);
- a request's KV cache as ``Part``s with their byte sizes in given storage ``Formats``: the release
  formats (the planner) or the formats the model's ``init_cache`` stores (``stored_formats``: the
  engine's row bytes and resident byte count, the benchmark's through it);
- the sparse layers, whose entries the indexer selects and the tier offloads; a request's entries
  are its offloaded part's ``entries(tokens)``;
- the engine's caches: the resident cache, the decode cache with the offloaded part's store the tier
  (``ess_jax.tier``), the scratch -> decode-cache handoff after an offloaded prefill, and ``store_of`` /
  ``with_store``.

Both families page their cache through the engine's page tables (``ess_jax.cache``: ``Z`` rows of a
part per page of ``Z`` tokens) and the host store has the same pages. DeepSeek-V3.2 offloads every
layer's latent rows; DeepSeek-V4 the CSA layers' entries (HiSparse), its window and compressor rings
fixed-size per batch row.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ess_jax import config, tier
from ess_jax.cache import entries_per_page
from ess_jax.config import ModelConfig, V4Layer
from ess_jax.pallas_kernels import fp8_rows

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "int32": 4}


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """The geometry of an engine cache."""

    rows: int  # batch rows
    pages: int  # pages of every data shard's pool together, each shard's null page included
    page_size: int  # tokens per page
    max_seq_len: int  # positions per request
    shards: int = 1  # data shards: each has rows / shards batch rows and pages / shards pages
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of a request's KV cache."""

    name: str
    where: str  # "offloaded" | "resident" | "fixed"
    layers: int  # layers holding it
    row_bytes: int  # bytes of one row (fixed parts: bytes per layer)
    tokens_per_row: int  # tokens one row covers (1 raw, m compressed); 0 for fixed parts
    topk: int = 0  # offloaded parts: entries the indexer selects per step
    ring: int = 0  # fixed parts that are compressor rings the tier can hold in host memory (``host_rings``): the
    # positions a ring holds

    def entries(self, context: int) -> int:
        """Rows per layer for a context of ``context`` tokens (closed windows only; the open tail is
        in the compressor state)."""
        return context // self.tokens_per_row if self.tokens_per_row else 0

    def bytes_per_token(self) -> float:
        return self.layers * self.row_bytes / self.tokens_per_row if self.tokens_per_row else 0.0

    def bytes(self, context: int) -> int:
        """Bytes of this part for one request, every row present."""
        if not self.tokens_per_row:
            return self.layers * self.row_bytes
        return self.layers * self.entries(context) * self.row_bytes

    def row_entries(self, size: CacheSize) -> int:
        """Entry ids one request's pages hold (its page-table width times the rows a page holds): the tier's
        residency map per batch row."""
        return -(-size.max_seq_len // size.page_size) * entries_per_page(size.page_size, self.tokens_per_row)

    def step_entries(self, tokens: int) -> int:
        """The most entries a decode step of ``tokens`` query tokens per row writes per row."""
        return -(-tokens // self.tokens_per_row)

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of ``page_size`` tokens of this part (every layer; 0 for fixed parts): the
        engine's paged arrays hold ``cache.entries_per_page`` rows per page."""
        return (self.layers * entries_per_page(page_size, self.tokens_per_row) * self.row_bytes
                if self.tokens_per_row else 0)


def resident_bytes(parts: list[Part], size: CacheSize, reserved_pages: int) -> int:
    """Bytes the engine's cache of ``size`` holds without offload for requests that reserved ``reserved_pages``
    pages in all: their pages of every paged part and every batch row's fixed parts (not those in host memory)."""
    paged = reserved_pages * sum(p.page_bytes(size.page_size) for p in parts)
    return paged + size.rows * sum(p.bytes(0) for p in parts if not p.tokens_per_row and p.where != "host")


def host_rings(parts: list[Part]) -> list[Part]:
    """``parts`` with each compressor ring part (``Part.ring``) in host memory (where "host", ``ess_jax.tier.rings``)
    and what the device keeps of it: per layer the newest position's row, per batch row its int32 slot."""
    out = []
    for p in parts:
        if not (p.ring and p.layers):
            out.append(p)
            continue
        out += [dataclasses.replace(p, name=f"{p.name} in host", where="host", ring=0),
                Part(f"{p.name}: newest row", "fixed", p.layers, p.row_bytes // p.ring, 0),
                Part("ring slot (int32)", "fixed", 1, 4, 0)]
    return out


def fit_host_budget(size: CacheSize, part: Part, host_cache_mb: float) -> CacheSize:
    """``size`` with the page count a host store budget of ``host_cache_mb`` MiB per data shard sets (of the host
    store, the resident paged parts and the allocators); raises ValueError naming the numbers when the longest
    request cannot fit."""
    page_bytes = part.page_bytes(size.page_size)
    pages, pages_per_row = int(host_cache_mb * 2**20 // page_bytes), math.ceil(size.max_seq_len / size.page_size)
    if pages < 1 + pages_per_row:
        per = " per data shard" if size.shards > 1 else ""
        raise ValueError(
            f"--host-cache-mb {host_cache_mb} holds {max(pages - 1, 0)} pages{per} of {page_bytes / 2**20:.3f} MiB; "
            f"the longest request needs {pages_per_row}: raise it to at least "
            f"{math.ceil((1 + pages_per_row) * page_bytes / 2**20)}")
    return dataclasses.replace(size, pages=pages * size.shards)


@dataclasses.dataclass(frozen=True)
class Formats:
    """How each kind of cached row is stored: "float32", "bfloat16" or "fp8" (the FP8 row formats of
    ``ess_jax.pallas_kernels.fp8_rows``: V3.2 latent rows and indexer keys, V4 entries); indexer keys
    also "fp4" (J/2 e2m1 + J/32 ue8m0)."""

    entries: str  # the offloaded part: V3.2 latent rows [c | k_rope], V4 CSA entries
    index: str  # indexer keys
    rows: str  # V4's other rows: HCA entries and the SWA window
    ring: str  # V4 compressor rings: the projected inputs and gate projections (DeepSeek's release: float32)




def _mla_row_bytes(latent_dim: int, rope_dim: int, fmt: str) -> int:
    """One V3.2 latent row ``[c | k_rope]`` (with ``rope_dim`` 0: one indexer key): ``C + R`` values, or
    the FP8 row (C e4m3 + an fp32 scale per 128 + R bf16: FlashMLA's 656 bytes at C = 512, R = 64)."""
    return fp8_rows.mla_row_bytes(latent_dim, rope_dim) if fmt == "fp8" else _ITEMSIZE[fmt] * (latent_dim + rope_dim)


def _v4_row_bytes(head_dim: int, rope_dim: int, fmt: str) -> int:
    """One V4 row: ``H`` values, or the FP8 row ((H - R) e4m3 + R bf16 + a ue8m0 scale per 64, padded to
    8 bytes: 584 at H = 512, R = 64)."""
    return fp8_rows.v4_row_bytes(head_dim, rope_dim) if fmt == "fp8" else _ITEMSIZE[fmt] * head_dim


def _index_key_bytes(width: int, fmt: str) -> int:
    """One indexer key: ``width`` values, the FP8 row (132 bytes at 128) or the FP4 key (68 bytes at 128)."""
    if fmt == "fp4":
        return fp8_rows.fp4_key_bytes(width)
    return _mla_row_bytes(width, 0, fmt)


# the release's FP8 (e4m3, 128 x 128 block scales) weights besides the routed experts
_V32_FP8 = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "gate_proj", "up_proj",
            "down_proj"}
_V4_FP8 = {"q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"}


def _fp8_block_bytes(shape: tuple[int, ...], scale_bytes: int) -> int:
    *lead, out, inp = shape
    return math.prod(shape) + scale_bytes * math.prod(lead) * math.ceil(out / 128) * math.ceil(inp / 128)


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its fields, and the methods each family implements (those raising
    NotImplementedError here), which ``offloaded_cache`` and ``handoff`` compose."""

    model_type: str
    architecture: str  # config.json's "architectures" entry (transformers' class)
    row_state: bool  # a request's cache has state per batch row besides its pages (V4's window and compressor
    # rings, ``row_arrays``): a cached prefix is resumed from a snapshot of it; False: its pages are all of it
    module: str  # "package.module:Class" of the NNX module
    rename: str | None  # "package.module:function": (a checkpoint's tensor name, layers=num_hidden_layers) ->
    # transformers' name (the MTP block as layer num_hidden_layers); None: unchanged

    @property
    def module_cls(self) -> type:
        return _load(self.module)

    @property
    def hf_rename(self) -> Callable[[str], str] | None:
        return _load(self.rename) if self.rename else None

    # ---- the cache, part by part -----------------------------------------------------------------
    def cache_parts(self, cfg: ModelConfig, formats: Formats) -> list[Part]:
        """The KV cache of one request, part by part (parts of no layer included)."""
        raise NotImplementedError

    def mtp_cache_parts(self, cfg: ModelConfig, formats: Formats) -> list[Part]:
        """The MTP module's cache of one request (``models.mtp``: its block's, in the main cache's pages), part
        by part, named "MTP ..."; none for a model without one."""
        if not cfg.num_nextn_predict_layers:
            return []
        return [dataclasses.replace(p, name=f"MTP {p.name}") for p in self.cache_parts(cfg.mtp_block(), formats)]

    def stored_formats(self, entries: str, model: str, index: str | None = None) -> Formats:
        """The formats ``init_cache`` stores, for offloaded entries in ``entries``, a model in ``model`` and
        indexer keys in ``index`` (None: the family's default)."""
        raise NotImplementedError

    def sparse_layers(self, cfg: ModelConfig) -> list[int]:
        """Layer indices whose entries the indexer selects (the tier's layers, in order)."""
        raise NotImplementedError

    def release_bytes(self, names: list[str], routed: bool, shape: tuple[int, ...]) -> float | None:
        """Bytes of a parameter (state path ``names``) in the official release's quantized format; None for
        a parameter the release keeps unquantized."""
        raise NotImplementedError

    def prefix_block(self, cfg: ModelConfig, page_size: int) -> int:
        """The tokens a prefix the prefix cache shares is a multiple of: before such a boundary every page holds all
        it ever will (no later token writes it; V4: every compressed entry there closed)."""
        return page_size

    def step_tokens_limit(self, cfg: ModelConfig) -> int | None:
        """The most tokens per row one decode step may write (a verification step's last token and drafts): the
        smallest ring of positions a row keeps (its tokens must not share a slot); None: no limit."""
        return None

    # ---- the engine's caches ---------------------------------------------------------------------
    def resident_cache(self, module, size: CacheSize, dtype, index: str | None = None):
        """An empty cache with every part on the device, the offloaded part's rows in ``dtype``, the indexer keys
        in ``index`` (``--index-dtype``; None: the family's default)."""
        return module.init_cache(size.rows, size.pages, size.page_size, dtype, index)

    def store_of(self, cache):
        """The offloaded part's store (``ess_jax.cache.ResidentPages`` or the tier)."""
        raise NotImplementedError

    def with_store(self, cache, store):
        """``cache`` with ``store`` in the offloaded part's place."""
        raise NotImplementedError

    def admit_resident(self, cache, scratch, table_X, pages_X, row):
        """The prompt's resident parts from the prefill scratch (its pages ``table_X``, batch row 0) into the
        decode cache (the request's pages ``pages_X``, batch row ``row``; a row past the last: none, on a data
        shard the request is not on)."""
        raise NotImplementedError

    def load_prefix(self, cache, scratch, table_X, pages_X):
        """The scratch with a cached prompt prefix's pages ``pages_X`` (decode cache and host store) in its pages
        ``table_X`` (the null page past them): what a prefill continuing the prefix reads of it."""
        raise NotImplementedError

    def offloaded_cache(self, module, size: CacheSize, part: Part, dtype, *, slots: int, fetch: str,
                        index: str | None = None, rings: str = "host", tokens: int = 1):
        """An empty decode cache whose offloaded part is the tier (``slots`` pool slots per sparse layer and
        batch row, a host store of the cache's pages), every other part resident (the indexer keys in
        ``index``) but, with ``rings`` "host", the compressor rings ``host_rings`` moves; ``tokens``: the query
        tokens of a decode step per row (1 + the drafts it verifies)."""
        shapes = jax.eval_shape(lambda: self.resident_cache(module, size, dtype, index))
        pages = self.store_of(shapes).pages
        tiered = tier.init_tier(layers=pages.shape[0], rows=size.rows, slots=slots, pages=size.pages,
                                page_size=size.page_size, rate=part.tokens_per_row, width=pages.shape[-1], dtype=dtype,
                                fetch=fetch, entries=part.row_entries(size),
                                new_entries=part.step_entries(tokens), queries=tokens, topk=part.topk,
                                sources=tier.share_sources(module.cfg.indexer_types))
        device = self.with_store(shapes, None)
        if rings == "host":
            device = self.rings_to_host(device, fetch)
        resident = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x,
                                device)
        return self.with_store(resident, tiered)

    def rings_to_host(self, shapes, fetch: str):
        """A cache's shapes with its ring parts (``Part.ring``) moved into host stores of the fetch backend
        ``fetch`` (arrays), the device part left as shapes; a family without such parts: ``shapes``."""
        return shapes

    def handoff(self, cache, scratch, table_X, pages_X, row, entries, ids_LTK, shared):
        """After an offloaded prefill on ``scratch`` (the prompt in its pages ``table_X``): the prompt's resident
        parts into batch row ``row`` and pages ``pages_X`` of the decode cache, its offloaded rows into the host
        store's ``pages_X`` and the row's pools warmed with its ``entries`` entries. Its first ``shared`` pages are
        a cached prefix it shares (loaded into the scratch, ``load_prefix``): already there, not written. On the
        data shards the request is not on: ``row`` past the last, no pages (the null page) and no entries: nothing
        changes."""
        rows = self.store_of(scratch).pages
        own_X = jnp.arange(pages_X.shape[0]) >= shared
        own_table_X, own_pages_X = jnp.where(own_X, table_X, 0), jnp.where(own_X, pages_X, 0)
        # pending rows first: a finished request's last row must not land on reused pages
        tiered = self.store_of(cache).begin_step().store_prompt(rows, own_table_X, own_pages_X)
        tiered = tiered.warm(rows, table_X, row, entries, ids_LTK)
        return self.with_store(self.admit_resident(cache, scratch, own_table_X, own_pages_X, row), tiered)


class _DeepseekV32(Family):
    """Per layer and token one latent row (offloaded) and one indexer key, in the engine's pages."""

    def cache_parts(self, cfg, formats):
        n, full = cfg.num_hidden_layers, cfg.indexer_types.count("full")  # Index Share: keys of full layers only
        latent = _mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, formats.entries)
        return [Part("latent [c | k_rope]", "offloaded", n, latent, 1, cfg.index_topk),
                Part("indexer key", "resident", full, _index_key_bytes(cfg.index_head_dim, formats.index), 1)]

    def stored_formats(self, entries, model, index=None):
        if index == "fp4":  # what init_cache refuses, refused before a model loads
            raise ValueError("--index-dtype fp4 is DeepSeek-V4's indexer format (its QAT round trip); DeepSeek-V3.2's "
                             "indexer was trained for FP8 keys: use fp8 (its official format) or bfloat16")
        return Formats(entries, index=index or ("fp8" if entries == "fp8" else model), rows=model, ring=model)

    def sparse_layers(self, cfg):
        return list(range(cfg.num_hidden_layers))

    def release_bytes(self, names, routed, shape):
        leaf = names[-2] if names[-1] == "weight" else names[-1]
        if leaf == "gate_up_proj":  # each expert's gate and up: two matrices, each with its own block scales
            *lead, rows, cols = shape  # [(L,) E, 2F, D]
            return 2 * _fp8_block_bytes((*lead, rows // 2, cols), 4)
        if routed or (names[-1] == "weight" and leaf in _V32_FP8):
            return _fp8_block_bytes(shape, 4)  # e4m3 + fp32 block scales
        return None

    def store_of(self, cache):
        return cache.latent

    def with_store(self, cache, store):
        return dataclasses.replace(cache, latent=store)

    def admit_resident(self, cache, scratch, table_X, pages_X, row):
        index_keys = cache.index_keys.at[:, pages_X].set(scratch.index_keys[:, table_X])
        return dataclasses.replace(cache, index_keys=index_keys)

    def load_prefix(self, cache, scratch, table_X, pages_X):
        latent = scratch.latent
        rows = latent.pages.at[:, table_X].set(cache.latent.load_prefix(pages_X).astype(latent.pages.dtype))
        return dataclasses.replace(scratch, index_keys=scratch.index_keys.at[:, table_X].set(
            cache.index_keys[:, pages_X]), latent=dataclasses.replace(latent, pages=rows))


class _DeepseekV4(Family):
    """In the engine's pages: the CSA entries (offloaded), the CSA indexer keys and the HCA entries; per batch
    row: the SWA window and the compressor rings."""

    def cache_parts(self, cfg, formats):
        n_csa, n_hca = cfg.layer_types.count(V4Layer.CSA), cfg.layer_types.count(V4Layer.HCA)
        n_index = cfg.indexer_types.count("full")  # the CSA layers with an indexer (Index Share: the full ones)
        h, r, j = cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim
        m, m_h = cfg.compress_rate_csa, cfg.compress_rate_hca
        row = _v4_row_bytes(h, r, formats.rows)
        ring = 2 * _ITEMSIZE[formats.ring]  # per value: the ring input and its gate projection
        # the rings hold [coff * m, coff * D] values, coff = 2 for CSA (overlapping windows), 1 for HCA
        csa_tail, index_tail, hca_tail = (2 * m) * (2 * h) * ring, (2 * m) * (2 * j) * ring, m_h * h * ring
        parts = [Part("CSA main rows", "offloaded", n_csa, _v4_row_bytes(h, r, formats.entries), m, cfg.index_topk),
                 Part("CSA indexer keys", "resident", n_index, _index_key_bytes(j, formats.index), m),
                 Part("HCA rows", "resident", n_hca, row, m_h),
                 Part("SWA window", "fixed", cfg.num_hidden_layers, cfg.sliding_window * row, 0),
                 Part(f"CSA compressor tails ({_SHORT[formats.ring]})", "fixed", n_csa, csa_tail, 0),
                 Part(f"CSA indexer compressor tails ({_SHORT[formats.ring]})", "fixed", n_index, index_tail, 0),
                 Part(f"HCA compressor tails ({_SHORT[formats.ring]})", "fixed", n_hca, hca_tail, 0, ring=m_h)]
        return parts

    def stored_formats(self, entries, model, index=None):
        return Formats(entries, index=index or model, rows=model, ring=model)

    def sparse_layers(self, cfg):
        return [i for i, t in enumerate(cfg.layer_types) if t == V4Layer.CSA]

    def prefix_block(self, cfg, page_size):
        blocks = [cfg] + ([cfg.mtp_block()] if cfg.num_nextn_predict_layers else [])
        rates = {c.compress_rate(i) for c in blocks for i in range(c.num_hidden_layers)}
        return math.lcm(page_size, *rates - {0})

    def step_tokens_limit(self, cfg):
        rings = [cfg.sliding_window]  # the window, then the compressor rings of the layers present
        rings += [2 * cfg.compress_rate_csa] if V4Layer.CSA in cfg.layer_types else []
        rings += [cfg.compress_rate_hca] if V4Layer.HCA in cfg.layer_types else []
        return min(rings)

    def release_bytes(self, names, routed, shape):
        if routed:  # e2m1 + one ue8m0 scale per 32 values
            return math.prod(shape) / 2 + math.prod(shape) / 32
        leaf = names[-2] if names[-1] == "weight" else names[-1]
        if names[-1] == "weight" and "compressor" not in names and (leaf in _V4_FP8 or "shared_experts" in names):
            return _fp8_block_bytes(shape, 1)  # e4m3 + ue8m0 block scales
        return None

    def store_of(self, cache):
        return cache.csa.entries

    def rings_to_host(self, shapes, fetch):
        """The HCA rings in host stores (``tier.HostRings``); the device keeps each ring's newest row."""
        hca = shapes.hca
        lh, b, u, h = hca.kv_ring.shape
        if not lh:
            return shapes
        host = tier.init_host_rings(layers=lh, rows=b, slots=u, width=h, dtype=hca.kv_ring.dtype, fetch=fetch)
        newest = lambda x: jax.ShapeDtypeStruct((lh, b, 1, h), x.dtype)  # noqa: E731
        return dataclasses.replace(shapes, hca=dataclasses.replace(hca, kv_ring=newest(hca.kv_ring),
                                                                   gate_ring=newest(hca.gate_ring), host=host))

    def with_store(self, cache, store):
        return dataclasses.replace(cache, csa=dataclasses.replace(cache.csa, entries=store))

    def admit_resident(self, cache, scratch, table_X, pages_X, row):
        def put_row(x, new):  # the scratch's batch row 0 -> batch row ``row`` (past the last: none)
            return x.at[:, row].set(new[:, 0], mode="drop")

        def put_pages(x, new):
            return x.at[:, pages_X].set(new[:, table_X])

        csa, hca = cache.csa, cache.hca
        csa = dataclasses.replace(csa, index_keys=put_pages(csa.index_keys, scratch.csa.index_keys),
                                  **{k: put_row(getattr(csa, k), getattr(scratch.csa, k)) for k in csa.ROW_STATE})
        if hca.host is None:
            rings = {k: put_row(getattr(hca, k), getattr(scratch.hca, k)) for k in hca.ROW_STATE}
        else:  # the whole rings to the host, their newest row (slot 0) on the device
            host, kv_LUH, gate_LUH = hca.host.store_prompt(row, scratch.hca.kv_ring[:, 0], scratch.hca.gate_ring[:, 0])
            rings = dict(host=host, kv_ring=put_row(hca.kv_ring, kv_LUH[:, None, None]),
                         gate_ring=put_row(hca.gate_ring, gate_LUH[:, None, None]))
        hca = dataclasses.replace(hca, entries=put_pages(hca.entries, scratch.hca.entries), **rings)
        return dataclasses.replace(cache, window=put_row(cache.window, scratch.window), csa=csa, hca=hca)

    def load_prefix(self, cache, scratch, table_X, pages_X):
        csa, hca = scratch.csa, scratch.hca
        entries = csa.entries.pages.at[:, table_X].set(
            cache.csa.entries.load_prefix(pages_X).astype(csa.entries.pages.dtype))
        csa = dataclasses.replace(csa, entries=dataclasses.replace(csa.entries, pages=entries),
                                  index_keys=csa.index_keys.at[:, table_X].set(cache.csa.index_keys[:, pages_X]))
        hca = dataclasses.replace(hca, entries=hca.entries.at[:, table_X].set(cache.hca.entries[:, pages_X]))
        return dataclasses.replace(scratch, csa=csa, hca=hca)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _DeepseekV32(model_type="deepseek_v32", architecture="DeepseekV32ForCausalLM", row_state=False,
                 module="ess_jax.models.deepseek_v32:DeepseekV32", rename=None),
    _DeepseekV4(model_type="deepseek_v4", architecture="DeepseekV4ForCausalLM", row_state=True,
                module="ess_jax.models.deepseek_v4:DeepseekV4",
                rename="ess_jax.models.deepseek_v4.names:release_to_hf_name"),
)}


def get(model_type: str) -> Family:
    """The family of ``model_type``; ConfigError if it is not served."""
    config.check_model_type(model_type)
    return FAMILIES[model_type]

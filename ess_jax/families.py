"""The model families: the one registry, ``FAMILIES`` (one line per ``model_type``: where its family entry is,
imported on first use), and what a family entry is, ``Family``: everything that differs between families above
the models. Each family is one package, ``models/<model_type>/``, whose ``family.py`` holds its entry; the
runtime reaches a family only through ``get(model_type)`` and ``load_config(raw)``.

A ``Family`` holds
- its config class (``ess_jax.config.ModelConfig``'s subclass in the family's ``config.py``: fields, parser,
  checks);
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

Every family pages its cache through the engine's page tables (``ess_jax.cache``: ``Z`` rows of a part per
page of ``Z`` tokens) and the host store has the same pages. DeepSeek-V3.2 offloads every layer's latent rows;
DeepSeek-V4 the CSA layers' entries (HiSparse), its window and compressor rings fixed-size per batch row.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ess_jax import tier
from ess_jax.cache import entries_per_page
from ess_jax.config import ConfigError, ModelConfig, ModelSource, check_tokens, short
from ess_jax.pallas_kernels import fp8_rows

# model_type -> "package.module:NAME" of its ``Family`` (its package's family.py), imported on first use
FAMILIES: dict[str, str] = {
    "deepseek_v32": "ess_jax.models.deepseek_v32.family:FAMILY",
    "deepseek_v4": "ess_jax.models.deepseek_v4.family:FAMILY",
}

ITEMSIZE = {"float32": 4, "bfloat16": 2, "int32": 4}


@dataclasses.dataclass(frozen=True)
class CacheSize:
    """The geometry of an engine cache."""

    rows: int  # batch rows
    pages: int  # pages of every data shard's pool together, each shard's null page included
    page_size: int  # tokens per page
    max_seq_len: int  # positions per request
    shards: int = 1  # data shards: each has rows / shards batch rows and pages / shards pages


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
    release: bool = False  # the byte layouts of DeepSeek's release (V4 FP8 rows of 584 bytes), not the engine's
    # (592: ``fp8_rows.v4_row_bytes``)


def mla_row_bytes(latent_dim: int, rope_dim: int, fmt: str) -> int:
    """One V3.2 latent row ``[c | k_rope]`` (with ``rope_dim`` 0: one indexer key): ``C + R`` values, or
    the FP8 row (C e4m3 + an fp32 scale per 128 + R bf16: FlashMLA's 656 bytes at C = 512, R = 64)."""
    return fp8_rows.mla_row_bytes(latent_dim, rope_dim) if fmt == "fp8" else ITEMSIZE[fmt] * (latent_dim + rope_dim)


def index_key_bytes(width: int, fmt: str) -> int:
    """One indexer key: ``width`` values, the FP8 row (132 bytes at 128) or the FP4 key (68 bytes at 128)."""
    if fmt == "fp4":
        return fp8_rows.fp4_key_bytes(width)
    return mla_row_bytes(width, 0, fmt)


def fp8_block_bytes(shape: tuple[int, ...], scale_bytes: int) -> int:
    """Bytes of a weight in the releases' FP8 format: e4m3 values and a ``scale_bytes`` scale per 128 x 128 block."""
    *lead, out, inp = shape
    return math.prod(shape) + scale_bytes * math.prod(lead) * math.ceil(out / 128) * math.ceil(inp / 128)


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its fields, and the methods each family implements (those raising
    NotImplementedError here), which ``offloaded_cache`` and ``handoff`` compose."""

    config: type[ModelConfig]  # the family's config class (its ``model_type``, fields, parser and checks)
    architecture: str  # config.json's "architectures" entry (transformers' class)
    row_state: bool  # a request's cache has state per batch row besides its pages (V4's window and compressor
    # rings, ``row_arrays``): a cached prefix is resumed from a snapshot of it; False: its pages are all of it
    module: str  # "package.module:Class" of the NNX module
    rename: str | None  # "package.module:function": (a checkpoint's tensor name, layers=num_hidden_layers) ->
    # transformers' name (the MTP block as layer num_hidden_layers); None: unchanged

    @property
    def model_type(self) -> str:
        return self.config.model_type

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
        """The MTP module's cache of one request (the family's ``mtp.py``: its block's, in the main cache's pages), part
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

    def ring_layers(self, cfg: ModelConfig) -> int:
        """Layers with compressor rings ``rings_to_host`` moves to host memory (``--rings host``); 0: none."""
        return 0

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


def get(model_type: str) -> Family:
    """The family of ``model_type``; ConfigError if it is not served."""
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type={model_type!r} is not served; supported: {', '.join(FAMILIES)}")
    return _load(FAMILIES[model_type])


def load_config(raw: Any, where: str | Path | None = None) -> ModelConfig:
    """A config.json's contents (a checkpoint's or a preset's) -> the config of its family (``model_type``), checked;
    a ConfigError names the field, after ``where`` (the file it was read from) when given."""
    try:
        if not isinstance(raw, dict):
            raise ConfigError(f"a config must be a JSON object of fields, got {type(raw).__name__} {short(raw)}")
        served = " or ".join(map(repr, FAMILIES))
        if "model_type" not in raw:
            raise ConfigError(f"config.json has no 'model_type' (expected {served})")
        if not isinstance(raw["model_type"], str):
            raise ConfigError(f"config field model_type={short(raw['model_type'])} must be a string ({served})")
        cfg = get(raw["model_type"]).config.from_hf_dict(raw)
        check_tokens(cfg)  # a config.json's special ids (a config built in code may leave them out of range)
        return cfg
    except ConfigError as e:
        if where is None:
            raise
        raise ConfigError(f"{where}: {e}") from None


def source_config(source: ModelSource) -> ModelConfig:
    """The config a resolved model name (``ess_jax.config.resolve_model``) serves: its config.json's (a ConfigError
    names a checkpoint's file), with the Index Share pattern it was resolved with."""
    return load_config(source.raw_config(), source.config_json).with_index_share(source.index_share)

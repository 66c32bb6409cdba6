"""The per-step metadata pytree and the resident store (registered dataclasses, donated by the jitted steps), the
one page-table translator, and the seam between cache stores and attention: row sources. Each family's cache
records are its package's (``models.deepseek_v32.cache``, ``models.deepseek_v4.cache``).

Requests of different lengths share one global pool of pages per cache part; a request's pages
are listed in its row of the page table, one page per ``page_size`` tokens. A part with one row per
``m`` tokens (V3.2: m = 1; V4's compressed entries: m = 4 or 128) keeps ``Z = max(1, page_size / m)``
rows per page: entry ``e`` covers tokens from ``e * m`` and lives in the page holding that token
(``locate``).
Page 0 is the null page: rows of padding tokens and of inactive batch rows are written there, and
page-table entries past a request's reservation point at it. Nothing ever reads the null page as a
valid position, because every read is masked by the query's position.

A **store** turns this step's top-k ids into **row sources** (DESIGN.md §4): a flat row array and the
ids to read from it (-1 = none). ``read`` writes the step's new rows and returns the ``Sources``:
those ready now and those in flight (the tier's fetched misses); ``ops.dual_attention`` attends over
both and hands the ready rows back to ``settle`` for the store's writes after the attention.
Axis letters: ess_jax.notation (G = pages in the pool, Z = rows per page, X = pages per request in the
page table).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ess_jax import ops


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepMeta:
    """Where this step's tokens go. One per step, shared by every layer."""

    positions: jax.Array  # i32[B, T] absolute position of each token in its request
    valid: jax.Array  # bool[B, T] False for padding tokens and inactive batch rows
    page_table: jax.Array  # i32[B, X] the request's pages in position order; 0 past its reservation
    rows: jax.Array  # i32[B] the request's batch row, indexing per-request state (V4's window and rings)


def entries_per_page(page_size: int, rate: int) -> int:
    """``Z``: rows per page of a part with one row per ``rate`` tokens, in pages of ``page_size`` tokens."""
    return max(1, page_size // rate)


def check_geometry(page_size: int, rate: int) -> None:
    """A part's rows must tile the pages: ``rate`` divides ``page_size`` or ``page_size`` divides ``rate``."""
    if page_size % rate and rate % page_size:
        raise ValueError(f"--page-size {page_size} does not tile a compressed part of one entry per {rate} tokens: "
                         f"use a page size that divides {rate} or a multiple of it")


def locate(page_table_BX: jax.Array, ids: jax.Array, *, page_size: int, rate: int = 1
           ) -> tuple[jax.Array, jax.Array]:
    """(page, offset in the page) of entry ids ``[B, ...]`` of a part with one entry per ``rate`` tokens
    in pages of ``page_size`` tokens; id -1 maps to the null page. The one page-table translator."""
    b = ids.shape[0]
    safe = jnp.maximum(ids, 0)
    per_page = entries_per_page(page_size, rate)
    index = (safe * rate) // page_size
    page = jnp.take_along_axis(page_table_BX, jnp.clip(index, 0, page_table_BX.shape[1] - 1).reshape(b, -1), axis=1)
    return jnp.where(ids >= 0, page.reshape(ids.shape), 0), safe % per_page


def flat_ids(page_table_BX: jax.Array, ids: jax.Array, *, page_size: int, rate: int = 1) -> jax.Array:
    """Entry ids -> global row ids into pages ``[G, Z, W]`` viewed as ``[G * Z, W]`` (FlashMLA's sparse
    index); -1 kept."""
    page, offset = locate(page_table_BX, ids, page_size=page_size, rate=rate)
    return jnp.where(ids >= 0, page * entries_per_page(page_size, rate) + offset, -1).astype(jnp.int32)


def write_slots(meta: StepMeta, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Page and in-page offset ``i32[B, T]`` each token is written to (the null page if invalid)."""
    return locate(meta.page_table, jnp.where(meta.valid, meta.positions, -1), page_size=page_size)


def entry_pages(page_table_BX: jax.Array, *, page_size: int, rate: int) -> jax.Array:
    """The pages of each request's page table that hold a part's entries (one per ``rate`` tokens), in entry
    order: every page, or with entries longer than a page the first page of each entry the table holds whole."""
    step, pages = max(1, rate // page_size), page_table_BX.shape[1]
    return page_table_BX[:, :pages - pages % step:step]


def layer_view(stack_LX: jax.Array, layer) -> tuple[jax.Array, tuple]:
    """What a step of layer ``layer`` (an int, or i32[] inside a scan over layers) reads and writes of the stacked
    ``[L, ...]``, and the index of the layer's part in it: traced for a TPU the layer's slice and ``()``, as a
    scatter or gather into a stacked 8-bit array at a traced layer makes XLA:TPU relay the whole stack out
    (``T(32,128)`` to ``T(8,128)``) and back, every layer of every step, where the slice costs one layer's copy
    (about 1 GB a layer for V3.2's FP8 indexer keys at batch 46 and 32K, against 0.2 GB); elsewhere the stack
    itself and ``(layer,)``, updated in place (a slice would be a copy). ``with_layer_view`` puts it back."""
    if ops.target_device().platform == "tpu":
        return jax.lax.dynamic_index_in_dim(stack_LX, layer, keepdims=False), ()
    return stack_LX, (layer,)


def with_layer_view(stack_LX: jax.Array, view: jax.Array, layer) -> jax.Array:
    """The stack with ``view`` (from ``layer_view``, then updated) in place of layer ``layer``'s part."""
    return view if view.ndim == stack_LX.ndim else jax.lax.dynamic_update_index_in_dim(stack_LX, view, layer, 0)


def first_row(view: jax.Array, at: tuple):
    """Where the layer's rows begin in ``view`` (``layer_view``'s) seen as one row array ``[-1, W]``."""
    return at[0] * math.prod(view.shape[1:-1]) if at else 0


def layer_source(view: jax.Array, at: tuple, ids_BTK: jax.Array) -> RowSource:
    """The rows ``ids_BTK`` (-1 = none) of the layer's part of ``view`` (``layer_view``'s) as a source: ``view`` as one
    row array, the ids offset to the layer's rows in it."""
    return RowSource(view.reshape(-1, view.shape[-1]), jnp.where(ids_BTK >= 0, first_row(view, at) + ids_BTK, -1))


def write_then_gather(pages_LGY: jax.Array, layer, write_at: tuple[jax.Array, jax.Array], rows: jax.Array,
                      page_table_BX: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``rows`` ``[B, M, X]`` written into layer ``layer`` of the pages at ``write_at`` ``(page, offset)``, then that
    layer's rows of every page of each request's ``page_table_BX``, in order ``[B, pages * Z, X]``: the pages and
    the rows read (through ``layer_view``). The pages hold each page's rows as one run ``[L, G, Z * X]``
    (``row_runs``) and are read as whole runs, one gathered row a page rather than one a key (V4-Flash's decode on
    v5p: 630 GB accessed a step by XLA:TPU's count, against 744 GB gathering each key)."""
    view, at = layer_view(pages_LGY, layer)
    b, width = page_table_BX.shape[0], rows.shape[-1]
    view = view.reshape(*view.shape[:-1], -1, width).at[(*at, *write_at)].set(rows.astype(view.dtype)).reshape(
        view.shape)
    return with_layer_view(pages_LGY, view, layer), view[(*at, page_table_BX)].reshape(b, -1, width)


def row_runs(layers: int, groups: int, per_group: int, width: int, dtype) -> jax.Array:
    """Empty rows that only the engine's steps read, each group's rows as one run ``[L, N, R * W]``: pages of ``R``
    rows (the indexer keys) or a batch row's ``R`` pool slots (``ess_jax.tier``). A TPU then tiles them in one
    layout whatever ``R`` and ``W``: a ``[L, N, R, W]`` stack of byte rows is laid out with another axis minor as a
    step's argument than in its loop over layers, and relaid between them every step (V4-Flash at 43 layers and
    967 requests on v5p: its 132-byte FP8 indexer keys padded to 256 in a 39.7 GiB copy, its 592-byte pool rows
    in an 18.7 GiB one)."""
    return jnp.zeros((layers, groups, per_group * width), dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSource:
    """Rows attention reads: a flat row array and the rows of it each query reads."""

    rows_PW: jax.Array  # [P, W] rows in the store's format (P: rows of the flat array)
    ids_BTK: jax.Array  # i32[B, T, K] rows of rows_PW to read, -1 = none


@dataclasses.dataclass
class Sources:
    """What a store's ``read`` hands the attention (lives only inside a trace): the sources ready now, those
    in flight (attended after the ready half), and ``settle(ready)`` -> the updated store, called with the
    ready sources once the attention over them is done."""

    ready: list[RowSource]
    inflight: list[RowSource]
    settle: Callable[[list[RowSource]], Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResidentPages:
    """Rows of a sparse part, every one resident on the device in pages (``--offload none``, the prefill
    scratch): V3.2 latent rows (rate 1), V4 CSA entries (rate m)."""

    pages: jax.Array  # [L, G, Z, W] rows in the store's format (latent [c | k_rope], V4 entries; or FP8 rows)
    page_size: int = dataclasses.field(metadata=dict(static=True))  # tokens per page (Z)
    rate: int = dataclasses.field(metadata=dict(static=True))  # tokens per row (m)

    @property
    def dtype(self):
        return self.pages.dtype

    def read(self, layer, meta: StepMeta, new_ids_BM: jax.Array, new_rows_BMW: jax.Array,
             ids_BTK: jax.Array) -> Sources:
        """Store the step's new rows of layer ``layer`` (an int, or i32[] inside a scan over layers) at their
        ids (-1 = none), then one source: every layer's pages as one row array (row ``(layer * G + page) * Z +
        offset``) and the rows at ``ids_BTK``."""
        geometry = dict(page_size=self.page_size, rate=self.rate)
        page_BM, offset_BM = locate(meta.page_table, new_ids_BM, **geometry)
        view, at = layer_view(self.pages, layer)
        view = view.at[(*at, page_BM, offset_BM)].set(new_rows_BMW)
        source = layer_source(view, at, flat_ids(meta.page_table, ids_BTK, **geometry))
        pages = with_layer_view(self.pages, view, layer)
        return Sources([source], [], lambda ready: dataclasses.replace(self, pages=pages))

    def begin_step(self) -> ResidentPages:
        """Nothing to do before a step: every row is already where it is read from."""
        return self

    def rollback(self, meta: StepMeta, length_B: jax.Array) -> ResidentPages:
        """Nothing to undo after a verification step (``rollback``): rows past a request's ``length_B`` tokens
        are never read (every read is masked by the query's position) and are written again before they are."""
        return self


def kept_length(meta: StepMeta, kept_B: jax.Array) -> jax.Array:
    """Each row's tokens in the cache after a verification step that kept its first ``kept_B`` tokens
    ``i32[B]``; a row that did not run: a length past every entry (nothing to forget)."""
    return jnp.where(meta.valid[:, 0], meta.positions[:, 0] + kept_B, jnp.iinfo(jnp.int32).max)

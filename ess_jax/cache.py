"""Cache and per-step metadata pytrees (registered dataclasses, donated by the jitted steps).

Requests of different lengths share one global pool of pages per cache part; a request's pages
are listed in its row of the page table. Page 0 is the null page: rows of padding tokens and of
inactive batch rows are written there, and page-table entries past a request's reservation point
at it. Nothing ever reads the null page as a valid position, because every read is masked by the
query's position. Axis letters: ess_jax.notation (G = pages in the pool, Z = page size,
X = pages per request in the page table).
"""

from __future__ import annotations

import dataclasses
from typing import Any

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceLatents:
    """V3.2 latent rows, every position resident on the device in pages (``--offload none``)."""

    pages: jax.Array  # [L, G, Z, W] latent rows [c (C) | k_rope (R, interleaved)]
    kernels: str = dataclasses.field(default="xla", metadata=dict(static=True))  # ops kernel choice

    def attend(self, layer: int, meta: StepMeta, rows_BTW: jax.Array, ids_BTK: jax.Array,
               q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, scale: float) -> tuple[jax.Array, DeviceLatents]:
        """Store this step's rows, then absorbed MLA over the rows at ``ids_BTK`` (-1 = none).
        Returns the attended latent ``f32[B, T, N, C]`` and the updated store."""
        page_BT, offset_BT = write_slots(meta, self.pages.shape[2])
        rows_BTW = ops.encode_mla_rows(rows_BTW, self.pages.dtype, latent_dim=q_latent_BTNC.shape[-1])
        pages = self.pages.at[layer, page_BT, offset_BT].set(rows_BTW)
        rows_BTKW = rows_at(pages[layer], meta.page_table, ids_BTK)
        out_BTNC, _ = ops.sparse_mla(q_latent_BTNC, q_rope_BTNR, rows_BTKW, ids_BTK >= 0, scale=scale,
                                     kernels=self.kernels)
        return out_BTNC, dataclasses.replace(self, pages=pages)

    def begin_step(self) -> DeviceLatents:
        """Nothing to do before a step: every row is already where it is read from."""
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCacheV32:
    """DeepSeek-V3.2's cache: per layer one indexer key (always on the device) and one latent row per
    token. ``latent`` is any store with an ``attend`` method: ``DeviceLatents`` or the offloaded tier."""

    index_keys: jax.Array  # [L, G, Z, J] indexer keys (LayerNorm + RoPE applied), or FP8 rows u8[L, G, Z, J + 4]
    latent: Any  # DeviceLatents | ess_jax.tier.TieredLatents

    @property
    def page_size(self) -> int:
        return self.index_keys.shape[2]

    def begin_step(self) -> PagedCacheV32:
        """Start-of-step work of the latent store (the tier's backup of the last step's rows)."""
        return dataclasses.replace(self, latent=self.latent.begin_step())

    @property
    def num_pages(self) -> int:
        return self.index_keys.shape[1]


def write_slots(meta: StepMeta, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Page and in-page offset ``i32[B, T]`` each token is written to (the null page if invalid)."""
    page_index_BT = meta.positions // page_size
    page_BT = jnp.take_along_axis(meta.page_table, jnp.clip(page_index_BT, 0, meta.page_table.shape[1] - 1), axis=1)
    return jnp.where(meta.valid, page_BT, 0), meta.positions % page_size


def gather_positions(pages_GZX: jax.Array, page_table_BX: jax.Array) -> jax.Array:
    """A request's rows in position order: ``[G, Z, ...]`` pages -> ``[B, X * Z, ...]``."""
    rows = pages_GZX[page_table_BX]  # [B, X, Z, ...]
    return rows.reshape(rows.shape[0], rows.shape[1] * rows.shape[2], *rows.shape[3:])


def rows_at(pages_GZW: jax.Array, page_table_BX: jax.Array, ids_BTK: jax.Array) -> jax.Array:
    """Rows at request positions ``ids_BTK`` (-1 reads position 0; mask it): ``[B, T, K, W]``."""
    b = ids_BTK.shape[0]
    page_size = pages_GZW.shape[1]
    safe_ids_BTK = jnp.maximum(ids_BTK, 0)
    pages_BTK = jnp.take_along_axis(page_table_BX, (safe_ids_BTK // page_size).reshape(b, -1), axis=1)
    return pages_GZW[pages_BTK.reshape(ids_BTK.shape), safe_ids_BTK % page_size]

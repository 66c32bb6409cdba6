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

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepMeta:
    """Where this step's tokens go. One per step, shared by every layer."""

    positions: jax.Array  # i32[B, T] absolute position of each token in its request
    valid: jax.Array  # bool[B, T] False for padding tokens and inactive batch rows
    page_table: jax.Array  # i32[B, X] the request's pages in position order; 0 past its reservation


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCacheV32:
    """DeepSeek-V3.2's cache: per layer, one latent row and one indexer key per token, paged."""

    latent: jax.Array  # [L, G, Z, W] latent rows [c (C) | k_rope (R, interleaved)]
    index_keys: jax.Array  # [L, G, Z, J] indexer keys (LayerNorm + RoPE applied)

    @property
    def page_size(self) -> int:
        return self.latent.shape[2]

    @property
    def num_pages(self) -> int:
        return self.latent.shape[1]

    def nbytes_per_token(self) -> int:
        """Device bytes one token occupies across all layers."""
        layers = self.latent.shape[0]
        return layers * (self.latent.shape[-1] * self.latent.dtype.itemsize
                         + self.index_keys.shape[-1] * self.index_keys.dtype.itemsize)


def write_slots(meta: StepMeta, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Page and in-page offset ``i32[B, T]`` each token is written to (the null page if invalid)."""
    page_index_BT = meta.positions // page_size
    page_BT = jnp.take_along_axis(meta.page_table, jnp.clip(page_index_BT, 0, meta.page_table.shape[1] - 1), axis=1)
    return jnp.where(meta.valid, page_BT, 0), meta.positions % page_size


def gather_positions(pages_GZX: jax.Array, page_table_BX: jax.Array) -> jax.Array:
    """A request's rows in position order: ``[G, Z, ...]`` pages -> ``[B, X * Z, ...]``."""
    rows = pages_GZX[page_table_BX]  # [B, X, Z, ...]
    return rows.reshape(rows.shape[0], rows.shape[1] * rows.shape[2], *rows.shape[3:])

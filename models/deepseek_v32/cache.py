"""DeepSeek-V3.2's cache record (a registered dataclass, donated by the jitted steps): per layer and token one
indexer key and one latent row, in the engine's pages (``ess_jax.cache``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ess_jax.cache import StepMeta, kept_length


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCacheV32:
    """DeepSeek-V3.2's cache: per layer one indexer key (always on the device) and one latent row per
    token. ``latent`` is a store: ``ResidentPages`` or the offloaded tier (``ess_jax.tier.Tier``)."""

    index_keys: jax.Array  # [L, G, Z * J] indexer keys (LayerNorm + RoPE applied), or FP8 rows u8[L, G, Z * (J + 4)],
    # a page's keys as one run (``ess_jax.cache.row_runs``)
    latent: Any  # ResidentPages | ess_jax.tier.Tier

    @property
    def page_size(self) -> int:
        return self.latent.page_size

    def row_arrays(self) -> dict:
        """The per-batch-row arrays: none (a request's whole cache is in its pages)."""
        return {}

    def paged_arrays(self) -> dict:
        """The paged arrays ``[L, G, Z, ...]`` of a cache whose latent rows are resident (``ResidentPages``)."""
        return {"index_keys": self.index_keys, "latent": self.latent.pages}

    def with_paged_arrays(self, arrays: dict) -> PagedCacheV32:
        return dataclasses.replace(self, index_keys=arrays["index_keys"],
                                   latent=dataclasses.replace(self.latent, pages=arrays["latent"]))

    def with_row_arrays(self, arrays: dict) -> PagedCacheV32:
        return self

    def begin_step(self) -> PagedCacheV32:
        """Start-of-step work of the latent store (the tier's backup of the last step's rows)."""
        return dataclasses.replace(self, latent=self.latent.begin_step())

    def rollback(self, before: PagedCacheV32, meta: StepMeta, kept_B: jax.Array) -> PagedCacheV32:
        """Undo what a verification step's rejected tokens wrote (``rollback``): each row keeps its first
        ``kept_B`` tokens. Indexer keys and resident latent rows of later positions are invisible (the reads are
        masked by position) and written again before they are read; the tier forgets their entries."""
        return dataclasses.replace(self, latent=self.latent.rollback(meta, kept_length(meta, kept_B)))

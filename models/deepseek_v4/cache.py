"""DeepSeek-V4's cache records (registered dataclasses, donated by the jitted steps): every layer's sliding window
and the compressor rings per batch row, the CSA and HCA entries and the CSA indexer keys in the engine's pages
(``ess_jax.cache``: one entry per ``m`` tokens)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ess_jax.cache import StepMeta, kept_length


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CsaCache:
    """DeepSeek-V4's CSA layers (Lc of them): compressor rings per batch row, entries and indexer keys in
    pages (one per ``m`` tokens). ``entries`` is a store: ``ResidentPages`` or the HiSparse tier."""

    ROW_STATE: ClassVar = ("kv_ring", "gate_ring", "index_kv_ring", "index_gate_ring")  # the fields per batch row

    kv_ring: jax.Array  # [Lc, B, 2m, 2H] compressor inputs a of the open and the previous window
    gate_ring: jax.Array  # [Lc, B, 2m, 2H] their gate projections (the position bias is added when pooling)
    index_kv_ring: jax.Array  # [Lc, B, 2m, 2J] the same for the indexer's compressor
    index_gate_ring: jax.Array  # [Lc, B, 2m, 2J]
    entries: Any  # ResidentPages [Lc, G, Z, W] (kv_norm + RoPE at e*m; W = H or FP8 bytes) | ess_jax.tier.Tier
    index_keys: jax.Array  # [Lc, G, Z * J] the indexer's keys, one per entry, a page's as one run
    # (``ess_jax.cache.row_runs``); FP4 / FP8 keys u8[Lc, G, Z * key bytes]
    index_format: str = dataclasses.field(metadata=dict(static=True))  # "fp4" | "fp8" | a float dtype's name
    # (ess_jax.ops.index_key_storage); FP4 keys are stored rotated (compressor.Indexer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HcaCache:
    """DeepSeek-V4's HCA layers (Lh of them): the compressor ring per batch row, entries in pages. With the rings
    in the host tier (``host``: ``ess_jax.tier.HostRings``, ``--offload ess``) the device keeps of each ring only
    its newest position's row (``kv_ring`` / ``gate_ring`` ``[Lh, B, 1, H]``, its slot ``host.slot``)."""

    ROW_STATE: ClassVar = ("kv_ring", "gate_ring")

    kv_ring: jax.Array  # [Lh, B, m', H] compressor inputs of the open window (host rings: [Lh, B, 1, H])
    gate_ring: jax.Array  # [Lh, B, m', H] their gate projections
    entries: jax.Array  # [Lh, G, Z, H] entries (kv_norm + RoPE at e*m'), Z = max(1, page size / m')
    page_size: int = dataclasses.field(metadata=dict(static=True))  # tokens per page (Z)
    host: Any = None  # ess_jax.tier.HostRings: the whole rings in host memory; None: on the device

    def begin_step(self) -> HcaCache:
        """Start-of-step work of the host rings (the last step's newest rows into their host slots)."""
        if self.host is None:
            return self
        return dataclasses.replace(self, host=self.host.begin_step(self.kv_ring[:, :, 0], self.gate_ring[:, :, 0]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class V4Cache:
    """DeepSeek-V4's cache: every layer's sliding window per batch row, the CSA and HCA layers' records."""

    window: jax.Array  # [L, B, n_win, H] keys (K = V, kv_norm + RoPE) of the last n_win positions, slot s % n_win
    csa: CsaCache
    hca: HcaCache

    def row_arrays(self) -> dict:
        """The per-batch-row arrays ``[layers, batch rows, ...]``: the window and the rings (``ROW_STATE``)."""
        return {"window": self.window, "csa": {k: getattr(self.csa, k) for k in self.csa.ROW_STATE},
                "hca": {k: getattr(self.hca, k) for k in self.hca.ROW_STATE}}

    def paged_arrays(self) -> dict:
        """The paged arrays ``[L, G, Z, ...]`` of a cache whose CSA entries are resident (``ResidentPages``)."""
        return {"csa_entries": self.csa.entries.pages, "csa_index_keys": self.csa.index_keys,
                "hca_entries": self.hca.entries}

    def with_paged_arrays(self, arrays: dict) -> V4Cache:
        entries = dataclasses.replace(self.csa.entries, pages=arrays["csa_entries"])
        return dataclasses.replace(self, csa=dataclasses.replace(self.csa, entries=entries,
                                                                 index_keys=arrays["csa_index_keys"]),
                                   hca=dataclasses.replace(self.hca, entries=arrays["hca_entries"]))

    def with_row_arrays(self, arrays: dict) -> V4Cache:
        """The cache with its per-batch-row arrays (``row_arrays``) replaced by ``arrays``."""
        return V4Cache(arrays["window"], dataclasses.replace(self.csa, **arrays["csa"]),
                       dataclasses.replace(self.hca, **arrays["hca"]))

    def begin_step(self) -> V4Cache:
        """Start-of-step work of the CSA entries' store (the tier's backup of the last step's entries) and of the
        HCA host rings."""
        return dataclasses.replace(self, csa=dataclasses.replace(self.csa, entries=self.csa.entries.begin_step()),
                                   hca=self.hca.begin_step())

    def rollback(self, before: V4Cache, meta: StepMeta, kept_B: jax.Array) -> V4Cache:
        """Undo what a verification step's rejected tokens wrote (``rollback``), ``before`` being the cache the
        step started from: each row keeps its first ``kept_B`` tokens. The window and compressor rings are
        rings of positions (slot ``p % size``): a slot a rejected token wrote takes back its content from
        ``before`` (a step's tokens never share a slot: ``1 + K`` is at most the smallest ring). Compressed
        entries and indexer keys closed by rejected tokens are invisible to every later query until the token
        that closes them again rewrites them (a query sees an entry only once its window closed), and the
        CSA tier forgets them."""
        keep_BT = jnp.arange(meta.positions.shape[1])[None, :] < kept_B[:, None]
        reject_BT = meta.valid & ~keep_BT

        def restore(new, old):  # [L, rows, size, ...]: slots rejected tokens wrote take back their old content
            size = new.shape[2]
            back = jnp.zeros(new.shape[1:3], bool).at[meta.rows[:, None], meta.positions % size].max(reject_BT)
            return jnp.where(back.reshape((1,) + back.shape + (1,) * (new.ndim - 3)), old, new)

        def rings(new, old):
            return {k: restore(getattr(new, k), getattr(old, k)) for k in new.ROW_STATE}

        csa = dataclasses.replace(self.csa, **rings(self.csa, before.csa),
                                  entries=self.csa.entries.rollback(meta, kept_length(meta, kept_B)))
        return V4Cache(window=restore(self.window, before.window), csa=csa,
                       hca=dataclasses.replace(self.hca, **rings(self.hca, before.hca)))

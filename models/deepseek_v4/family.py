"""DeepSeek-V4's family entry (``ess_jax.families``): its config and model, the release's tensor names and weight
formats, its cache part by part with byte sizes, and the engine's handling of its cache (the CSA entries offloaded,
the HCA compressor rings in host memory with ``--rings host``)."""

from __future__ import annotations

import dataclasses
import math

import jax

from ess_jax import tier
from ess_jax.families import ITEMSIZE, Family, Formats, Part, fp8_block_bytes, index_key_bytes
from ess_jax.models.deepseek_v4.config import DeepseekV4Config, V4Layer
from ess_jax.pallas_kernels import fp8_rows

_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
# the release's FP8 (e4m3, 128 x 128 block scales) weights besides the routed experts
_V4_FP8 = {"q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"}


def _v4_row_bytes(head_dim: int, rope_dim: int, formats: Formats, fmt: str) -> int:
    """One V4 row: ``H`` values, or the FP8 row ((H - R) e4m3 + R bf16 + a ue8m0 scale per 64, padded: 592 bytes
    at H = 512, R = 64 as the engine stores it, 584 in DeepSeek's release)."""
    if fmt != "fp8":
        return ITEMSIZE[fmt] * head_dim
    return (fp8_rows.v4_release_row_bytes if formats.release else fp8_rows.v4_row_bytes)(head_dim, rope_dim)


class _DeepseekV4(Family):
    """In the engine's pages: the CSA entries (offloaded), the CSA indexer keys and the HCA entries; per batch
    row: the SWA window and the compressor rings."""

    def cache_parts(self, cfg, formats):
        n_csa, n_hca = cfg.layer_types.count(V4Layer.CSA), cfg.layer_types.count(V4Layer.HCA)
        n_index = cfg.indexer_types.count("full")  # the CSA layers with an indexer (Index Share: the full ones)
        h, r, j = cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim
        m, m_h = cfg.compress_rate_csa, cfg.compress_rate_hca
        row = _v4_row_bytes(h, r, formats, formats.rows)
        ring = 2 * ITEMSIZE[formats.ring]  # per value: the ring input and its gate projection
        # the rings hold [coff * m, coff * D] values, coff = 2 for CSA (overlapping windows), 1 for HCA
        csa_tail, index_tail, hca_tail = (2 * m) * (2 * h) * ring, (2 * m) * (2 * j) * ring, m_h * h * ring
        parts = [Part("CSA main rows", "offloaded", n_csa, _v4_row_bytes(h, r, formats, formats.entries), m,
                      cfg.index_topk),
                 Part("CSA indexer keys", "resident", n_index, index_key_bytes(j, formats.index), m),
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

    def ring_layers(self, cfg):
        return cfg.layer_types.count(V4Layer.HCA)

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
            return fp8_block_bytes(shape, 1)  # e4m3 + ue8m0 block scales
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


FAMILY = _DeepseekV4(config=DeepseekV4Config, architecture="DeepseekV4ForCausalLM", row_state=True,
                     module="ess_jax.models.deepseek_v4.model:DeepseekV4",
                     rename="ess_jax.models.deepseek_v4.names:release_to_hf_name")

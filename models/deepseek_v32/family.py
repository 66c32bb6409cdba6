"""DeepSeek-V3.2's family entry (``ess_jax.families``): its config and model, its cache part by part with byte
sizes, the release's weight formats, and the engine's handling of its cache."""

from __future__ import annotations

import dataclasses

from ess_jax.families import Family, Formats, Part, fp8_block_bytes, index_key_bytes, mla_row_bytes
from ess_jax.models.deepseek_v32.config import DeepseekV32Config

# the release's FP8 (e4m3, 128 x 128 block scales) weights besides the routed experts
_V32_FP8 = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "gate_proj", "up_proj",
            "down_proj"}


class _DeepseekV32(Family):
    """Per layer and token one latent row (offloaded) and one indexer key, in the engine's pages."""

    def cache_parts(self, cfg, formats):
        n, full = cfg.num_hidden_layers, cfg.indexer_types.count("full")  # Index Share: keys of full layers only
        latent = mla_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, formats.entries)
        return [Part("latent [c | k_rope]", "offloaded", n, latent, 1, cfg.index_topk),
                Part("indexer key", "resident", full, index_key_bytes(cfg.index_head_dim, formats.index), 1)]

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
            return 2 * fp8_block_bytes((*lead, rows // 2, cols), 4)
        if routed or (names[-1] == "weight" and leaf in _V32_FP8):
            return fp8_block_bytes(shape, 4)  # e4m3 + fp32 block scales
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


FAMILY = _DeepseekV32(config=DeepseekV32Config, architecture="DeepseekV32ForCausalLM", row_state=False,
                      module="ess_jax.models.deepseek_v32.model:DeepseekV32", rename=None)

"""Axis letters used in einsums, shape comments and suffixed names (``q_BTNH``, ``latent_BSW``).

    B  batch rows (requests)       T  query tokens in this call      S  cache positions
    K  top-k selected entries      M  compressed entries (V4)        D  model width (hidden_size)
    N  attention heads             H  head dim                       C  latent width (kv_lora_rank)
    R  rope dims                   W  row width (V3.2 latent: C + R) Q  q-LoRA rank
    I  indexer heads               J  indexer head dim               L  layers
    P  pool slots                  V  vocabulary                     E  routed experts
    F  expert / MLP hidden width   A  token-expert assignments (tokens x experts per token)
    G  pages of a pool             X  a request's pages (page-table columns)
    O  mHC residual streams (V4)   U  compressor pooling slots       Y  compressor projection width (coff * D
                                                                        or coff * J, V4)
    Z  rows per page of a paged part: positions (V3.2), or max(1, page_size / m) compressed entries (V4)
    K1 (suffix) K + 1: the pool slots one step can take (the new entry and one per miss)

Sizes without a letter (V4's output groups and o-LoRA rank, training's micro-batches) are written out in
shape comments.

A model's cached form is its ``step(tokens, meta, cache) -> (logits, ids, cache)``: the new tokens
``i32[B, T]``, their ``ess_jax.cache.StepMeta`` and the cache in; logits ``f32[B, T, V]``, the indexer's
top-k ids per sparse layer and the updated cache out. Caches are registered dataclass pytrees whose
fields are documented with these letters.
"""

"""Axis letters used in einsums, shape comments and suffixed names (``q_BTNH``, ``latent_BSW``).

    B  batch (requests)            T  query tokens in this call      S  cache positions
    K  top-k selected entries      M  compressed entries (V4)        D  model width (hidden_size)
    N  attention heads             H  head dim                       C  latent width (kv_lora_rank)
    R  rope dims                   W  latent row width (C + R)       Q  q-LoRA rank
    I  indexer heads               J  indexer head dim               L  layers
    P  pool slots                  V  vocabulary                     E  routed experts
    F  expert / MLP hidden width   A  token-expert assignments (tokens x experts per token)

The model is a pure function ``(params, tokens, cache) -> (logits, cache)``; caches are registered
dataclass pytrees whose fields are documented with these letters.
"""

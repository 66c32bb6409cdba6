"""Axis letters used in einsums, shape comments and suffixed names (``q_BTNH``, ``latent_BSW``).

    B  batch (requests)            T  query tokens in this call      S  cache positions
    K  top-k selected entries      M  compressed entries (V4)        D  model width (hidden_size)
    N  attention heads             H  head dim                       C  latent width (kv_lora_rank)
    R  rope dims                   W  latent row width (C + R)       Q  q-LoRA rank
    I  indexer heads               J  indexer head dim               L  layers
    P  pool slots                  V  vocabulary                     E  routed experts
    F  expert / MLP hidden width   A  token-expert assignments (tokens x experts per token)
    X  mHC residual streams (V4)   G  output-projection groups (V4)  O  o-LoRA rank per group (V4)
    U  compressor pooling slots    Y  compressor projection width (coff * D or coff * J, V4)

The model is a pure function ``(params, tokens, cache) -> (logits, cache)``; caches are registered
dataclass pytrees whose fields are documented with these letters.
"""

"""DeepSeek-V4's tensor names: the original release's (no ``model.`` prefix, ``layers.N.{attn,ffn}.*``, FP8 scales
as ``.scale``, the MTP block under ``mtp.*``) as transformers names them, so the loader (``ess_jax.checkpoint``)
looks every V4 checkpoint up by transformers name (the family's ``rename``)."""

from __future__ import annotations

import re

# DeepSeek-V4 release names -> transformers names (transformers' conversion_mapping for deepseek_v4,
# DOMAIN.md 2.8), applied in order to the name without its "model." prefix. transformers'
# save_pretrained writes these release-style names back (with the prefix, and the attention's kv_norm
# as "attn.norm"), so every V4 checkpoint goes through them; transformers names are fixed points.
_V4_RELEASE_RULES = [(re.compile(p), r) for p, r in [
    (r"(?<!_hc)\.scale$", ".weight_scale_inv"),  # FP8 block scales; attn_hc.scale / ffn_hc.scale are parameters
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.", "lm_head."),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.ape$", ".position_bias"),
    (r"\.self_attn\.(compressor\.(?:indexer\.)?)?norm\.", r".self_attn.\1kv_norm."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.", ".gate_proj."),
    (r"\.w3\.", ".up_proj."),
    (r"\.w2\.", ".down_proj."),
]]


# the release's MTP block ``mtp.K.*`` -> layer ``num_hidden_layers + K``: its own names first
_V4_MTP_RULES = [(re.compile(p), r) for p, r in [
    (r"^norm\.", "shared_head.norm."),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"^head\.", "shared_head.head."),
    (r"^embed\.", "embed_tokens."),
]]


def release_to_hf_name(key: str, layers: int | None = None) -> str:
    """A DeepSeek-V4 tensor name (release, transformers-saved or transformers) as transformers names it; the
    release's MTP block ``mtp.K.*`` as layer ``layers + K`` (``layers``: num_hidden_layers; None leaves it)."""
    mtp = re.match(r"^mtp\.(\d+)\.(.*)$", key)
    if mtp and layers is None:
        return key
    if mtp:
        rest = mtp.group(2)
        for pattern, replacement in _V4_MTP_RULES:
            rest = pattern.sub(replacement, rest)
        key = f"layers.{layers + int(mtp.group(1))}.{rest}"
    name = key.removeprefix("model.")
    for pattern, replacement in _V4_RELEASE_RULES:
        name = pattern.sub(replacement, name)
    return name if name.startswith("lm_head.") else "model." + name

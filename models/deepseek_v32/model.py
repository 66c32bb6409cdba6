"""DeepSeek-V3.2: MLA with q/kv LoRA, the DSA lightning indexer, DeepSeek MoE.

Two forward forms over the same parameters:
- ``__call__(tokens)``: the full causal forward (training / prefill form). Keys and values are
  expanded per head and the indexer's top-k enters as an attention mask, as in transformers.
- ``step(tokens, meta, cache)``: the cached forward over a paged cache (ess_jax.cache). The latent
  rows ``[c | k_rope]`` and indexer keys of the new tokens are written into their pages, the indexer
  picks top-k positions per query token, and MLA runs in the absorbed form over just those gathered
  latent rows (DOMAIN.md 1.2).

Axis letters: ess_jax.notation. RoPE on MLA rope slices keeps DeepSeek's interleaved order, so cached
rows match the 656-byte FlashMLA row layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax import ops
from ess_jax.cache import ResidentPages, StepMeta, row_runs, write_slots, write_then_gather
from ess_jax.models.deepseek_v32.cache import PagedCacheV32
from ess_jax.models.deepseek_v32.config import DeepseekV32Config
from ess_jax.models.layers import (
    MLP, LayerNorm, Linear, MoE, MTPHost, RMSNorm, Router, apply_rope_half, apply_rope_interleaved, check_stage,
    index_scores, index_topk, indexer_kl, rope_cos_sin, rope_inv_freq, scan_runs, stack_runs)


class Indexer(nnx.Module):
    """The DSA lightning indexer: keys and index scores of every visible position (top-k: ``layers.index_topk``)."""

    def __init__(self, cfg: DeepseekV32Config, *, dtype, rngs: nnx.Rngs):
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.top_k = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype=dtype, rngs=rngs)
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, dtype=dtype, rngs=rngs)
        self.k_norm = LayerNorm(cfg.index_head_dim, 1e-6, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, dtype=jnp.float32, rngs=rngs)

    def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim:]
        return jnp.concatenate([apply_rope_half(rot, cos, sin), rest], axis=-1)

    def keys(self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Indexer keys ``[B, T, J]`` of the given tokens."""
        return self._rope(self.k_norm(self.wk(x_BTD)), cos, sin)

    def scores(self, x_BTD, q_resid_BTQ, keys_BSJ, visible_BTS, cos, sin) -> jax.Array:
        """Index scores ``f32[B, T, S]`` (``layers.index_scores``); -inf where ``visible_BTS`` is False."""
        b, t, _ = x_BTD.shape
        q_BTIJ = self._rope(self.wq_b(q_resid_BTQ).reshape(b, t, self.n_heads, self.head_dim), cos, sin)
        return index_scores(q_BTIJ, keys_BSJ, self.weights_proj(x_BTD.astype(jnp.float32)), visible_BTS)


class MLA(nnx.Module):
    """Multi-head latent attention with DSA sparse selection. A shared layer of Index Share (``indexer`` None,
    DOMAIN.md 1.7) has no indexer: it attends over its own latent rows at the top-k of the nearest preceding full
    layer."""

    def __init__(self, cfg: DeepseekV32Config, layer: int, *, dtype, rngs: nnx.Rngs):
        self.n_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.top_k = cfg.index_topk
        eps = cfg.rms_norm_eps
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps, dtype=dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.latent_dim, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs) if cfg.indexer_full(layer) else None

    def _project(self, x_BTD, cos, sin):
        """Queries (nope, rope), the q-LoRA residual and the new latent rows ``[B, T, W]``."""
        b, t, _ = x_BTD.shape
        q_resid_BTQ = self.q_a_layernorm(self.q_a_proj(x_BTD))
        q_BTNH = self.q_b_proj(q_resid_BTQ).reshape(b, t, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope_BTNH, q_rope_BTNR = q_BTNH[..., : self.nope_dim], q_BTNH[..., self.nope_dim:]
        q_rope_BTNR = apply_rope_interleaved(q_rope_BTNR, cos, sin)
        kv_BTW = self.kv_a_proj_with_mqa(x_BTD)
        latent_BTC = self.kv_a_layernorm(kv_BTW[..., : self.kv_rank])
        k_rope_BTR = apply_rope_interleaved(kv_BTW[..., self.kv_rank:], cos, sin)
        rows_BTW = jnp.concatenate([latent_BTC, k_rope_BTR], axis=-1)
        return q_nope_BTNH, q_rope_BTNR, q_resid_BTQ, rows_BTW

    def _kv_b(self) -> tuple[jax.Array, jax.Array]:
        """``W_UK [N, H_nope, C]`` and ``W_UV [N, H_v, C]`` views of kv_b_proj."""
        w = self.kv_b_proj.weight[...].reshape(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)  # [N, H + V, C]
        return w[:, : self.nope_dim], w[:, self.nope_dim:]

    def __call__(self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array, stage: str | None = None,
                 picks: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, jax.Array, tuple]:
        """Full causal forward: expanded keys / values, the indexer's top-k as a mask (``stage`` None or
        "sparse"; "dense" / "warmup": every causal position, ``layers.STAGES``). ``picks``: the top-k ids
        ``i32[B, T, K]`` and index scores ``f32[B, T, T]`` of the nearest preceding full layer, what a shared
        layer selects by (``index_picks``: placeholders for a full layer). Returns the output, the indexer's loss
        (``layers.indexer_kl``; 0 for None / "dense") and the picks the next layer shares (a full layer's own). A
        shared layer's loss is the full layer's indexer against this layer's attention: Index Share's multi-layer
        distillation, each kept indexer trained for every layer it serves."""
        b, t, _ = x_BTD.shape
        q_nope_BTNH, q_rope_BTNR, q_resid_BTQ, rows_BTW = self._project(x_BTD, cos, sin)
        causal_TS = jnp.tril(jnp.ones((t, t), bool))
        mask_BTS = jnp.broadcast_to(causal_TS, (b, t, t))
        if picks is None:
            picks = index_picks(b, t, t, self.top_k)
        if stage != "dense":
            if self.indexer is not None:
                with jax.named_scope("indexer"):
                    if stage is not None:  # the indexer's loss reaches no other parameter
                        x_BTD, q_resid_BTQ = jax.lax.stop_gradient(x_BTD), jax.lax.stop_gradient(q_resid_BTQ)
                    keys_BSJ = self.indexer.keys(x_BTD, cos, sin)
                    scores_BTS = self.indexer.scores(x_BTD, q_resid_BTQ, keys_BSJ, causal_TS[None], cos, sin)
                    picks = (index_topk(scores_BTS, self.top_k), scores_BTS)
            ids_BTK, scores_BTS = picks
            if stage != "warmup":
                selected_BTS = jnp.zeros((b, t, t + 1), bool)
                selected_BTS = selected_BTS.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
                                               jnp.where(ids_BTK < 0, t, ids_BTK)].set(True)[..., :t]
                mask_BTS = selected_BTS & causal_TS[None]
        w_uk_NHC, w_uv_NVC = self._kv_b()
        latent_BSC, k_rope_BSR = rows_BTW[..., : self.kv_rank], rows_BTW[..., self.kv_rank:]
        k_nope_BSNH = jnp.einsum("bsc,nhc->bsnh", latent_BSC, w_uk_NHC)
        v_BSNV = jnp.einsum("bsc,nvc->bsnv", latent_BSC, w_uv_NVC)
        logits_BNTS = (jnp.einsum("btnh,bsnh->bnts", q_nope_BTNH, k_nope_BSNH)
                       + jnp.einsum("btnr,bsr->bnts", q_rope_BTNR, k_rope_BSR)).astype(jnp.float32) * self.scale
        logits_BNTS = jnp.where(mask_BTS[:, None], logits_BNTS, -jnp.inf)
        probs_BNTS = jax.nn.softmax(logits_BNTS, axis=-1)
        out_BTNV = jnp.einsum("bnts,bsnv->btnv", probs_BNTS.astype(v_BSNV.dtype), v_BSNV)
        kl = jnp.zeros((), jnp.float32)
        if stage in ("warmup", "sparse"):
            kl = indexer_kl(probs_BNTS.sum(1), scores_BTS, mask_BTS)
        return self.o_proj(out_BTNV.reshape(b, t, -1)), kl, picks

    def step(self, x_BTD, cos, sin, meta: StepMeta, layer: jax.Array, cache: PagedCacheV32, kernels: str,
             ids_BTK: jax.Array | None = None, key_layer: jax.Array | None = None):
        """Cached forward for ``T`` new tokens per request: ``(out, top-k ids i32[B, T, K], cache)``; ``layer``
        (i32[], traced in the scan over layers) indexes the latent store's ``[L, ...]`` arrays and ``key_layer``
        (default ``layer``) the indexer keys' (full layers only: ``PagedCacheV32.index_keys``), the latent store
        gives the row sources, ``ops`` attends over them (``kernels``: the ops kernel choice). A shared layer
        (no indexer) reads its rows at ``ids_BTK``, the nearest preceding full layer's top-k."""
        b, t, _ = x_BTD.shape
        q_nope_BTNH, q_rope_BTNR, q_resid_BTQ, rows_BTW = self._project(x_BTD, cos, sin)
        if self.indexer is not None:
            ids_BTK, cache = self._select(x_BTD, q_resid_BTQ, cos, sin, meta, layer if key_layer is None else
                                          key_layer, cache)
        with jax.named_scope("sparse_mla"):
            w_uk_NHC, w_uv_NVC = self._kv_b()
            q_latent_BTNC = jnp.einsum("btnh,nhc->btnc", q_nope_BTNH, w_uk_NHC)
            rows_BTW = ops.encode_mla_rows(rows_BTW, cache.latent.dtype, latent_dim=self.kv_rank)
            sources = cache.latent.read(layer, meta, jnp.where(meta.valid, meta.positions, -1), rows_BTW, ids_BTK)
            attend = lambda srcs, ready: ops.mla_attention(q_latent_BTNC, q_rope_BTNR, srcs,  # noqa: E731
                                                           scale=self.scale, kernels=kernels)
            out_BTNC, latent = ops.dual_attention(attend, sources)
            out_BTNV = jnp.einsum("btnc,nvc->btnv", out_BTNC.astype(x_BTD.dtype), w_uv_NVC)
        return self.o_proj(out_BTNV.reshape(b, t, -1)), ids_BTK, PagedCacheV32(cache.index_keys, latent)

    def _select(self, x_BTD, q_resid_BTQ, cos, sin, meta: StepMeta, key_layer, cache: PagedCacheV32):
        """The indexer of a full layer: its new keys written at ``key_layer`` of the indexer keys, its top-k ids
        ``i32[B, T, K]`` over every visible position, and the cache."""
        with jax.named_scope("indexer"):
            page_BT, offset_BT = write_slots(meta, cache.page_size)
            # FP8 keys (uint8 pages) are V3.2 FP8 rows without a rope part: 128 e4m3 + one float32 scale
            new_keys_BTJ = self.indexer.keys(x_BTD, cos, sin)
            j = new_keys_BTJ.shape[-1]
            index_keys, keys_BSX = write_then_gather(
                cache.index_keys, key_layer, (page_BT, offset_BT),
                ops.encode_mla_rows(new_keys_BTJ, cache.index_keys.dtype, latent_dim=j), meta.page_table)
            keys_BSJ = ops.decode_mla_rows(keys_BSX, x_BTD.dtype, latent_dim=j, rope_dim=0)
            visible_BTS = ((jnp.arange(keys_BSJ.shape[1])[None, None, :] <= meta.positions[..., None])
                           & meta.valid[..., None])
            scores_BTS = self.indexer.scores(x_BTD, q_resid_BTQ, keys_BSJ, visible_BTS, cos, sin)
            return index_topk(scores_BTS, self.top_k), dataclasses.replace(cache, index_keys=index_keys)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekV32Config, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLA(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.mlp_layer_types[layer] == "sparse":
            router = Router(cfg.hidden_size, cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                            norm_topk_prob=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor, n_group=cfg.n_group,
                            topk_group=cfg.topk_group, rngs=rngs)
            self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.n_shared_experts,
                           router=router, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, h, cos, sin, stage: str | None = None, picks=None):
        out, kl, picks = self.self_attn(self.input_layernorm(h), cos, sin, stage, picks)
        h = h + out
        return h + self.mlp(self.post_attention_layernorm(h)), kl, picks

    def step(self, h, cos, sin, meta: StepMeta, layer: jax.Array, cache: PagedCacheV32, kernels: str,
             ids_BTK: jax.Array | None = None, key_layer: jax.Array | None = None):
        out, ids_BTK, cache = self.self_attn.step(self.input_layernorm(h), cos, sin, meta, layer, cache, kernels,
                                                  ids_BTK, key_layer)
        h = h + out
        return h + self.mlp(self.post_attention_layernorm(h)), ids_BTK, cache


class DeepseekV32(MTPHost, nnx.Module):
    """``DeepseekV32ForCausalLM``: parameter names mirror transformers' module tree, the decoder layers held as
    stacked runs (``layers.stack_runs``: the dense-MLP layers, then the MoE ones)."""

    def __init__(self, cfg: DeepseekV32Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)).astype(dtype))
        self.runs = stack_runs([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        if cfg.num_nextn_predict_layers:  # the MTP module, named as layer num_hidden_layers (mtp.py)
            from ess_jax.models.deepseek_v32.mtp import MTPLayerV32
            self.mtp = nnx.Dict({str(cfg.num_hidden_layers): MTPLayerV32(cfg, dtype=dtype, rngs=rngs)})

    def cos_sin(self, positions_BT):
        inv_freq = rope_inv_freq(self.cfg.rope, self.cfg.qk_rope_head_dim)
        return rope_cos_sin(positions_BT, inv_freq, self.cfg.rope.cos_sin_scale)

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        """Full causal forward: logits ``[B, T, V]`` (float32)."""
        return self.train_forward(tokens_BT, None)[0]

    def train_forward(self, tokens_BT: jax.Array, stage: str | None) -> tuple[jax.Array, jax.Array]:
        """The full causal forward at a training ``stage`` (``layers.STAGES``; None: inference): logits
        ``f32[B, T, V]`` and the indexer's loss summed over layers."""
        h_BTD, kl = self.hidden_states(tokens_BT, stage)
        return self.head(h_BTD), kl

    def hidden_states(self, tokens_BT: jax.Array, stage: str | None) -> tuple[jax.Array, jax.Array]:
        """The full causal forward up to the final norm: the last layer's hidden states ``[B, T, D]`` (what
        the MTP module reads) and the indexer's loss summed over layers."""
        check_stage(stage)
        b, t = tokens_BT.shape
        cos, sin = self.cos_sin(jnp.broadcast_to(jnp.arange(t), (b, t)))
        h = self.embed_tokens[...][tokens_BT]

        def body(layer, index, carry):
            h, kl, picks = carry
            h, layer_kl, picks = layer(h, cos, sin, stage, picks)
            return (h, kl + layer_kl, picks), None

        (h, kl, _), _ = scan_runs(self.runs, body, (h, jnp.zeros((), jnp.float32),
                                                    index_picks(b, t, t, self.cfg.index_topk)))
        return h, kl

    def head(self, h_BTD: jax.Array) -> jax.Array:
        """Logits ``f32[B, T, V]`` of final hidden states: the final norm and ``lm_head``."""
        return self.lm_head(self.norm(h_BTD)).astype(jnp.float32)

    def init_cache(self, rows: int, num_pages: int, page_size: int, latent_dtype=None, index_dtype: str | None = None
                   ) -> PagedCacheV32:
        """An empty, fully resident paged cache: ``num_pages`` pages (page 0 is the null page) of ``page_size``
        tokens; V3.2 keeps nothing per batch row, so ``rows`` (the batch rows) only fixes the signature both
        families share.
        ``latent_dtype`` stores the latent rows (default: the model's dtype; uint8 = FP8 rows: 656-byte
        latent rows at DeepSeek's shapes). ``index_dtype``: the indexer keys, "fp8" (132-byte FP8 rows, the
        official format) or a float dtype's name; default: "fp8" with FP8 latent rows, else the model's dtype.
        No "fp4": V3.2's indexer was trained for FP8 keys, and DeepSeek has no FP4 round trip for it."""
        return _init_cache(self.cfg, self.dtype, num_pages, page_size, latent_dtype, index_dtype)

    def step(self, tokens_BT: jax.Array, meta: StepMeta, cache: PagedCacheV32, *, kernels: str = "xla"
             ) -> tuple[jax.Array, jax.Array, PagedCacheV32]:
        """Write ``T`` tokens per request into ``cache``. Returns their logits ``f32[B, T, V]``, every
        layer's top-k positions ``i32[L, B, T, K]`` (-1 = none) and the new cache (``step_hidden`` without
        the hidden states)."""
        logits_BTV, _, ids_LBTK, cache = self.step_hidden(tokens_BT, meta, cache, kernels=kernels)
        return logits_BTV, ids_LBTK, cache

    def step_hidden(self, tokens_BT: jax.Array, meta: StepMeta, cache: PagedCacheV32, *, kernels: str = "xla"
                    ) -> tuple[jax.Array, jax.Array, jax.Array, PagedCacheV32]:
        """The cached step, also returning the final hidden states ``[B, T, D]`` (before the final norm: the
        MTP module's input, ``mtp_step``): ``(logits f32[B, T, V], hidden, ids i32[L, B, T, K], cache)``.
        ``kernels``: the ops kernel choice for attention (static).

        The layers run as one ``jax.lax.scan`` per stacked run (``layers.scan_runs``); the cache's ``[L, ...]``
        arrays are carried whole and read and written at the layer index, so the compiled step does not grow
        with depth."""
        cos, sin = self.cos_sin(meta.positions)
        b, t = tokens_BT.shape
        key_layers = jnp.asarray(index_key_layers(self.cfg), jnp.int32)  # each layer's place among the full ones
        ids_BTK, _ = index_picks(b, t, meta.page_table.shape[1] * cache.page_size, self.cfg.index_topk)

        def body(layer, index, carry):
            h, cache, ids_BTK = carry
            h, ids_BTK, cache = layer.step(h, cos, sin, meta, index, cache, kernels, ids_BTK, key_layers[index])
            return (h, cache, ids_BTK), ids_BTK

        (h, cache, _), ids_LBTK = scan_runs(self.runs, body, (self.embed_tokens[...][tokens_BT], cache, ids_BTK))
        return self.head(h), h, ids_LBTK, cache

    # ---- the MTP module (models.deepseek_v32.mtp) ------------------------------------------------
    def init_mtp_cache(self, rows: int, num_pages: int, page_size: int, latent_dtype=None,
                       index_dtype: str | None = None) -> PagedCacheV32:
        """The MTP module's empty cache: ``init_cache`` of its one block (``L = 1``), in the same pages."""
        return _init_cache(self.cfg.mtp_block(), self.dtype, num_pages, page_size, latent_dtype, index_dtype)


def index_picks(b: int, t: int, s: int, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Placeholder picks (no top-k ids ``i32[B, T, K]``, -inf scores ``f32[B, T, S]``, ``K = min(top_k, S)``)
    before the first full layer: the scan over layers carries the picks a shared layer reuses."""
    return jnp.full((b, t, min(top_k, s)), -1, jnp.int32), jnp.full((b, t, s), -jnp.inf, jnp.float32)


def index_key_layers(cfg: DeepseekV32Config) -> list[int]:
    """Each layer's index into the indexer keys ``[Lf, ...]`` (only full layers store keys): its place among the
    full layers (a shared layer: the preceding full layer's, never read)."""
    places, full = [], -1
    for i in range(cfg.num_hidden_layers):
        full += cfg.indexer_full(i)
        places.append(max(full, 0))
    return places


def _init_cache(cfg: DeepseekV32Config, dtype, num_pages: int, page_size: int, latent_dtype, index_dtype: str | None
                ) -> PagedCacheV32:
    """``DeepseekV32.init_cache`` for the layers of ``cfg`` in a model of ``dtype``."""
    n = cfg.num_hidden_layers
    latent_dtype = latent_dtype or dtype
    width = ops.mla_row_width(cfg.kv_lora_rank, cfg.qk_rope_head_dim, latent_dtype)
    if index_dtype == "fp4":
        raise ValueError("index_dtype='fp4': DeepSeek-V3.2's indexer was trained for FP8 keys; use 'fp8' or a "
                         "float dtype")
    index_dtype = index_dtype or ("fp8" if jnp.dtype(latent_dtype) == jnp.uint8 else jnp.dtype(dtype).name)
    key_width, key_dtype = ops.index_key_storage(cfg.index_head_dim, index_dtype)
    return PagedCacheV32(
        index_keys=row_runs(cfg.indexer_types.count("full"), num_pages, page_size, key_width, key_dtype),
        latent=ResidentPages(jnp.zeros((n, num_pages, page_size, width), latent_dtype), page_size=page_size, rate=1),
    )

"""DeepSeek-V4: sliding-window / compressed-sparse / heavily-compressed attention, mHC, hash-routed MoE.

Every layer attends to its last ``sliding_window`` keys; a CSA layer adds the indexer's top-k of its
4:1 compressed entries, an HCA layer all of its 128:1 entries, all in one softmax with a learned
per-head sink (DOMAIN.md 2.1-2.5). Keys are values (one shared K = V head of ``head_dim``). The
residual is ``hc_mult`` streams mixed by mHC (models/mhc.py); the MoE routes by ``tid2eid[token]`` on
hash layers and by top-k of ``score + e_score_correction_bias`` elsewhere, with SwiGLU clamped at
``swiglu_limit`` (DOMAIN.md 2.7).

Two forward forms over the same parameters:
- ``__call__(tokens)``: the full causal forward (training / reference form): dense masked attention
  over every window key and compressed entry, the indexer's top-k entering as a mask, as in
  transformers.
- ``step(tokens, cache)``: the cached form for any number of new tokens per request. The window
  keys, compressor rings and compressed entries live in an explicit ``V4Cache``; each query gathers
  its window rows and its compressed rows (CSA: top-k ids, HCA: all visible) and attends over just
  those (``ops.sparse_sink_attention``). Prefill in chunks of any sizes gives the one-shot result.

Parameter names mirror transformers' ``DeepseekV4ForCausalLM`` module tree (``checkpoint.hf_name``).
Axis letters: ess_jax.notation; X = hc streams, G = output groups, O = o-LoRA rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax import ops
from ess_jax.cache import StepMeta
from ess_jax.config import ModelConfig
from ess_jax.models import mhc
from ess_jax.models.compressor import CSACompressor, Compressor, Indexer, TailRope, visible_entries, write_entries
from ess_jax.models.layers import Linear, MoE, RMSNorm, Router, check_stage, index_topk, indexer_kl, rms_normalize

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# ---- cache -------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class V4State:
    """Fixed-size per-request state: what the next tokens need besides the compressed entries.

    ``n_win`` = sliding_window; ``m`` / ``m'`` the CSA / HCA compress rates; Lc / Lh the number of
    CSA / HCA layers (in layer order). Position ``s`` lives at ring slot ``s % ring``.
    """

    window: jax.Array  # [L, B, n_win, H] keys (K = V, kv_norm + RoPE applied) of the last n_win positions
    csa_kv: jax.Array  # [Lc, B, 2m, 2H] CSA compressor inputs a of the open and the previous window
    csa_gate: jax.Array  # f32[Lc, B, 2m, 2H] their gate logits + position bias z
    index_kv: jax.Array  # [Lc, B, 2m, 2J] the same for the indexer's compressor
    index_gate: jax.Array  # f32[Lc, B, 2m, 2J]
    hca_kv: jax.Array  # [Lh, B, m', H] HCA compressor inputs of the open window
    hca_gate: jax.Array  # f32[Lh, B, m', H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class V4Entries:
    """Compressed entries, growing by one per closed window; entry ``e`` covers tokens from ``e * m``.

    ``csa`` is resident ``[Lc, B, Mc, H]`` or, with HiSparse offload, an ``ess_jax.tier.TieredLatents``
    over ``Lc`` layers whose host store holds one page of ``Mc`` entries per batch row (page
    ``row + 1``; page 0 is the null page) and whose device pool holds each row's working set."""

    csa: Any  # [Lc, B, Mc, H] CSA entries (kv_norm + RoPE at e*m), Mc = capacity // m; or a TieredLatents
    index_keys: jax.Array  # [Lc, B, Mc, J] the CSA indexer's keys, one per CSA entry
    hca: jax.Array  # [Lh, B, Mh, H] HCA entries, Mh = capacity // m'


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class V4Cache:
    state: V4State
    entries: V4Entries
    lengths: jax.Array  # i32[B] positions already written per request
    kernels: str = dataclasses.field(default="xla", metadata=dict(static=True))  # ops kernel choice

    def begin_step(self) -> V4Cache:
        """Start-of-step work of the HiSparse tier (the backup of the last step's entries);
        nothing for a resident cache."""
        if isinstance(self.entries.csa, jax.Array):
            return self
        return dataclasses.replace(self, entries=dataclasses.replace(self.entries, csa=self.entries.csa.begin_step()))


@dataclasses.dataclass
class TierLayer:
    """One CSA layer's view of the HiSparse tier during a decode step (lives only inside a trace)."""

    tier: Any  # ess_jax.tier.TieredLatents over the CSA layers
    layer: int  # this layer's index among the CSA layers
    page_table_BX: jax.Array  # i32[B, 1] each request's host page (batch row + 1)
    active_B: jax.Array  # bool[B] rows that decode


# ---- attention ---------------------------------------------------------------------------------


class GroupedLinear(nnx.Module):
    """Block-diagonal ``o_a_proj``: ``weight [G*O, N*H/G]`` viewed ``[G, O, N*H/G]``, one block per head group."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (groups * out_per_group, in_per_group),
                                                          jnp.float32)).astype(dtype))
        self.groups = groups

    def __call__(self, x_BTGI: jax.Array) -> jax.Array:
        w_GOI = self.weight[...].reshape(self.groups, -1, x_BTGI.shape[-1])
        return jnp.einsum("btgi,goi->btgo", x_BTGI, w_GOI)


class Attention(nnx.Module):
    """Shared-KV attention over a sliding window plus, for CSA/HCA layers, compressed entries."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.layer_type = cfg.layer_types[layer]
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.o_groups, self.eps = cfg.o_groups, cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        # Sliding layers use the main rope; compressed layers the compress rope (YaRN) for everything.
        self.rope = TailRope(cfg.rope if self.layer_type == SLIDING else cfg.compress_rope, cfg.qk_rope_head_dim)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.q_a_proj = Linear(d, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps, dtype=jnp.float32)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, rngs=rngs)
        self.kv_proj = Linear(d, self.head_dim, dtype=dtype, rngs=rngs)
        self.kv_norm = RMSNorm(self.head_dim, eps, dtype=jnp.float32)
        self.o_a_proj = GroupedLinear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_lora_rank, cfg.o_groups,
                                      dtype=dtype, rngs=rngs)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, d, dtype=dtype, rngs=rngs)
        self.sinks = nnx.Param(jnp.zeros((self.n_heads,), jnp.float32))
        if self.layer_type == CSA:
            indexer = Indexer(d, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.compress_rate_csa,
                              cfg.index_topk, rope=self.rope, eps=eps, dtype=dtype, rngs=rngs)
            self.compressor = CSACompressor(d, self.head_dim, cfg.compress_rate_csa, indexer=indexer, rope=self.rope,
                                            eps=eps, dtype=dtype, rngs=rngs)
        elif self.layer_type == HCA:
            self.compressor = Compressor(d, self.head_dim, cfg.compress_rate_hca, overlap=False, rope=self.rope,
                                         eps=eps, dtype=dtype, rngs=rngs)
        else:
            self.compressor = None

    def _project(self, x_BTD, cos, sin):
        """Queries ``[B, T, N, H]`` (unweighted RMSNorm per head, RoPE), the q-LoRA residual, keys ``[B, T, H]``."""
        b, t, _ = x_BTD.shape
        q_resid_BTQ = self.q_a_norm(self.q_a_proj(x_BTD))
        q_BTNH = self.q_b_proj(q_resid_BTQ).reshape(b, t, self.n_heads, self.head_dim)
        q_BTNH = self.rope.apply(rms_normalize(q_BTNH, self.eps).astype(q_BTNH.dtype), cos, sin)
        kv_BTH = self.rope.apply(self.kv_norm(self.kv_proj(x_BTD)), cos, sin)
        return q_BTNH, q_resid_BTQ, kv_BTH

    def _output(self, out_BTNH, cos, sin, dtype):
        """Undo the rope phase of the values (rotation by -t), then the grouped low-rank output projection."""
        b, t = out_BTNH.shape[:2]
        out_BTNH = self.rope.apply(out_BTNH, cos, -sin).astype(dtype)
        grouped_BTGO = self.o_a_proj(out_BTNH.reshape(b, t, self.o_groups, -1))
        return self.o_b_proj(grouped_BTGO.reshape(b, t, -1))

    def __call__(self, x_BTD: jax.Array, stage: str | None = None) -> tuple[jax.Array, jax.Array]:
        """Full causal forward over a whole sequence: dense logits, window / compressed / top-k masks
        (a CSA layer's top-k at ``stage`` None or "sparse"; "dense" / "warmup": every visible entry,
        ``layers.STAGES``). Returns the output and a CSA layer's indexer loss over its entries
        (``layers.indexer_kl``; 0 elsewhere and for None / "dense")."""
        b, t, _ = x_BTD.shape
        positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
        cos, sin = self.rope.cos_sin(positions_BT)
        q_BTNH, q_resid_BTQ, kv_BTH = self._project(x_BTD, cos, sin)
        s = jnp.arange(t)
        keys_BSH = kv_BTH
        visible_BTS = jnp.broadcast_to((s[None, :] <= s[:, None]) & (s[None, :] > s[:, None] - self.window), (b, t, t))
        scores_BTM = None
        if self.compressor is not None and t >= self.compressor.rate:
            with jax.named_scope("compressor"):
                entries_BMH = self.compressor(x_BTD)
            n = entries_BMH.shape[1]
            visible_BTM = visible_entries(positions_BT, n, self.compressor.rate)
            if self.layer_type == CSA and stage != "dense":
                with jax.named_scope("indexer"):
                    indexer = self.compressor.indexer
                    x_in, q_in = x_BTD, q_resid_BTQ
                    if stage is not None:  # the indexer's loss reaches no other parameter
                        x_in, q_in = jax.lax.stop_gradient(x_BTD), jax.lax.stop_gradient(q_resid_BTQ)
                    scores_BTM = indexer.scores(x_in, q_in, indexer(x_in), visible_BTM, cos, sin)
                    ids_BTK = index_topk(scores_BTM, indexer.top_k)
                    if stage != "warmup":
                        picked = jnp.zeros((b, t, n + 1), bool).at[
                            jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
                            jnp.where(ids_BTK < 0, n, ids_BTK)].set(True)
                        visible_BTM = picked[..., :n] & visible_BTM
            keys_BSH = jnp.concatenate([kv_BTH, entries_BMH.astype(kv_BTH.dtype)], axis=1)
            visible_BTS = jnp.concatenate([visible_BTS, visible_BTM], axis=-1)
        logits_BTNS = jnp.einsum("btnh,bsh->btns", q_BTNH.astype(jnp.float32), keys_BSH.astype(jnp.float32))
        logits_BTNS = jnp.where(visible_BTS[:, :, None, :], logits_BTNS * self.scale, -jnp.inf)
        sink_BTN1 = jnp.broadcast_to(self.sinks[...], (b, t, self.n_heads))[..., None]
        probs_BTNS = jax.nn.softmax(jnp.concatenate([logits_BTNS, sink_BTN1], axis=-1), axis=-1)[..., :-1]
        out_BTNH = jnp.einsum("btns,bsh->btnh", probs_BTNS, keys_BSH.astype(jnp.float32))
        kl = jnp.zeros((), jnp.float32)
        if scores_BTM is not None and stage in ("warmup", "sparse"):
            kl = indexer_kl(probs_BTNS[..., t:].sum(2), scores_BTM, visible_BTS[..., t:])
        return self._output(out_BTNH, cos, sin, x_BTD.dtype), kl

    def step(self, x_BTD, positions_BT, window_BSH, comp, kernels: str = "xla"
             ) -> tuple[jax.Array, jax.Array, tuple, jax.Array | None]:
        """Cached forward for ``T`` new tokens per request at ``positions_BT``.

        ``window_BSH`` is the request's window ring ``[B, n_win, H]``; ``comp`` this layer's compressor
        arrays: CSA ``(ring_kv, ring_gate, entries, index_ring_kv, index_ring_gate, index_keys)``,
        HCA ``(ring_kv, ring_gate, entries)``, sliding ``()``. A CSA layer's entries may be a
        ``TierLayer`` (HiSparse decode, T = 1). ``kernels``: the ops kernel choice for attention.
        Returns ``(out, window, comp, ids)`` updated, ``ids``
        the CSA indexer's picks ``i32[B, T, K]`` (None for other layers or before the first entry).
        """
        b, t, _ = x_BTD.shape
        n_win = self.window
        cos, sin = self.rope.cos_sin(positions_BT)
        q_BTNH, q_resid_BTQ, kv_BTH = self._project(x_BTD, cos, sin)
        p0_B1 = positions_BT[:, :1]
        # Window rows: key positions t - n_win + 1 .. t, from the ring (before p0) or the new keys.
        pool_BSH = jnp.concatenate([window_BSH.astype(kv_BTH.dtype), kv_BTH], axis=1)
        key_pos_BTS = positions_BT[..., None] - n_win + 1 + jnp.arange(n_win)
        slot_BTS = jnp.where(key_pos_BTS < p0_B1[..., None], key_pos_BTS % n_win,
                             n_win + key_pos_BTS - p0_B1[..., None])
        rows = [jax.vmap(lambda pool, ids: pool[ids])(pool_BSH, slot_BTS)]
        valid = [key_pos_BTS >= 0]
        ids_BTK, out_BTNH = None, None
        if self.layer_type == CSA:
            ring_kv, ring_gate, entries, index_kv, index_gate, keys_BMJ = comp
            indexer = self.compressor.indexer
            tiered = isinstance(entries, TierLayer)
            store_dtype = entries.tier.pool.dtype if tiered else entries.dtype  # uint8: FP8 rows
            with jax.named_scope("compressor"):
                new_BEH, entry_BE, closes_BE, ring_kv, ring_gate = self.compressor.close(x_BTD, positions_BT, ring_kv,
                                                                                         ring_gate)
                new_BEX = ops.encode_v4_rows(new_BEH, store_dtype, rope_dim=self.rope.dim)
                if not tiered:
                    entries = write_entries(entries, new_BEX, entry_BE, closes_BE)
            with jax.named_scope("indexer"):
                keys_BMJ, index_kv, index_gate = indexer.step(x_BTD, positions_BT, index_kv, index_gate, keys_BMJ)
            if keys_BMJ.shape[1] > 0:  # a cache too small for one entry has nothing to select
                with jax.named_scope("indexer"):
                    visible_BTM = visible_entries(positions_BT, keys_BMJ.shape[1], self.compressor.rate)
                    scores_BTM = indexer.scores(x_BTD, q_resid_BTQ, keys_BMJ, visible_BTM, cos, sin)
                    ids_BTK = index_topk(scores_BTM, indexer.top_k)
                if tiered:  # HiSparse: window + resident entries, fetched entries, merged
                    new_id_B = jnp.where(closes_BE[:, 0] & entries.active_B, entry_BE[:, 0], -1)
                    with jax.named_scope("sparse_attention"):
                        out_BTNH, tier = entries.tier.attend_entries(
                            entries.layer, entries.page_table_BX, entries.active_B, new_BEX[:, 0], new_id_B, ids_BTK,
                            q_BTNH, rows[0].astype(kv_BTH.dtype), valid[0], self.sinks[...], self.scale,
                            rope_dim=self.rope.dim)
                    entries = dataclasses.replace(entries, tier=tier)
                else:
                    picked_BTKX = jax.vmap(lambda e, ids: e[ids])(entries, jnp.maximum(ids_BTK, 0))
                    rows.append(ops.decode_v4_rows(picked_BTKX, kv_BTH.dtype, head_dim=self.head_dim,
                                                   rope_dim=self.rope.dim))
                    valid.append(ids_BTK >= 0)
            comp = (ring_kv, ring_gate, entries, index_kv, index_gate, keys_BMJ)
        elif self.layer_type == HCA:
            ring_kv, ring_gate, entries_BMH = comp
            with jax.named_scope("compressor"):
                entries_BMH, ring_kv, ring_gate = self.compressor.step(x_BTD, positions_BT, ring_kv, ring_gate,
                                                                       entries_BMH)
            n = entries_BMH.shape[1]
            rows.append(jnp.broadcast_to(entries_BMH[:, None], (b, t) + entries_BMH.shape[1:]))
            valid.append(visible_entries(positions_BT, n, self.compressor.rate))
            comp = (ring_kv, ring_gate, entries_BMH)
        if out_BTNH is None:
            with jax.named_scope("sparse_attention"):
                rows_BTKH = jnp.concatenate([r.astype(kv_BTH.dtype) for r in rows], axis=2)
                out_BTNH, _ = ops.sparse_sink_attention(q_BTNH, rows_BTKH, jnp.concatenate(valid, axis=2),
                                                        self.sinks[...], scale=self.scale, kernels=kernels)
        # Only the last n_win new keys reach the ring (earlier ones would collide on a slot).
        write_BT = jnp.where(jnp.arange(t)[None, :] >= t - n_win, positions_BT % n_win, n_win)
        window_BSH = window_BSH.at[jnp.arange(b)[:, None], write_BT].set(kv_BTH.astype(window_BSH.dtype), mode="drop")
        return self._output(out_BTNH, cos, sin, x_BTD.dtype), window_BSH, comp, ids_BTK


# ---- model -------------------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        hc = dict(sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, rngs=rngs)
        self.self_attn = Attention(cfg, layer, dtype=dtype, rngs=rngs)
        # hash layers route by token id; softmax scores are not renormalised (DeepSeek's V4 reference)
        hashed = cfg.mlp_layer_types[layer] == "hash_moe"
        router = Router(cfg.hidden_size, cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring=cfg.scoring_func,
                        norm_topk_prob=cfg.scoring_func != "softmax", scaling=cfg.routed_scaling_factor,
                        hash_vocab=cfg.vocab_size if hashed else None, rngs=rngs)
        self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, 1, router=router,
                       limit=cfg.swiglu_limit, dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=jnp.float32)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=jnp.float32)
        self.attn_hc = mhc.HyperConnection(cfg.hidden_size, cfg.hc_mult, **hc)
        self.ffn_hc = mhc.HyperConnection(cfg.hidden_size, cfg.hc_mult, **hc)

    def _ffn(self, streams_BTXD, tokens_BT):
        post, comb, x_BTD = self.ffn_hc(streams_BTXD)
        return mhc.merge(post, comb, self.mlp(self.post_attention_layernorm(x_BTD), tokens_BT), streams_BTXD)

    def __call__(self, streams_BTXD: jax.Array, tokens_BT: jax.Array, stage: str | None = None):
        post, comb, x_BTD = self.attn_hc(streams_BTXD)
        out, kl = self.self_attn(self.input_layernorm(x_BTD), stage)
        streams_BTXD = mhc.merge(post, comb, out, streams_BTXD)
        return self._ffn(streams_BTXD, tokens_BT), kl

    def step(self, streams_BTXD, tokens_BT, positions_BT, window_BSH, comp, kernels: str = "xla"):
        post, comb, x_BTD = self.attn_hc(streams_BTXD)
        out, window_BSH, comp, ids_BTK = self.self_attn.step(self.input_layernorm(x_BTD), positions_BT, window_BSH,
                                                             comp, kernels)
        streams_BTXD = mhc.merge(post, comb, out, streams_BTXD)
        return self._ffn(streams_BTXD, tokens_BT), window_BSH, comp, ids_BTK


class DeepseekV4(nnx.Module):
    """``DeepseekV4ForCausalLM``: parameter names mirror transformers' module tree."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if cfg.family != "deepseek_v4":
            raise ValueError(f"DeepseekV4 needs a deepseek_v4 config, got model_type={cfg.model_type!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)).astype(dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=jnp.float32)
        self.hc_head = mhc.HyperHead(cfg.hidden_size, cfg.hc_mult, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                                     rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def _embed(self, tokens_BT: jax.Array) -> jax.Array:
        """The embedding copied into all ``hc_mult`` streams ``[B, T, X, D]``."""
        h_BTD = self.embed_tokens[...][tokens_BT]
        return jnp.broadcast_to(h_BTD[:, :, None, :], h_BTD.shape[:2] + (self.cfg.hc_mult,) + h_BTD.shape[2:])

    def _head(self, streams_BTXD: jax.Array) -> jax.Array:
        return self.lm_head(self.norm(self.hc_head(streams_BTXD))).astype(jnp.float32)

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        """Full causal forward: logits ``f32[B, T, V]``."""
        return self.train_forward(tokens_BT, None)[0]

    def train_forward(self, tokens_BT: jax.Array, stage: str | None) -> tuple[jax.Array, jax.Array]:
        """The full causal forward at a training ``stage`` (``layers.STAGES``; None: inference): logits
        ``f32[B, T, V]`` and the CSA indexers' loss summed over layers."""
        check_stage(stage)
        streams_BTXD = self._embed(tokens_BT)
        kl = jnp.zeros((), jnp.float32)
        for layer in self.layers:
            streams_BTXD, layer_kl = layer(streams_BTXD, tokens_BT, stage)
            kl = kl + layer_kl
        return self._head(streams_BTXD), kl

    def layer_groups(self) -> tuple[list[int], list[int]]:
        """Layer indices of the CSA and of the HCA layers (the order of their cache stacks)."""
        types = self.cfg.layer_types
        return [i for i, t in enumerate(types) if t == CSA], [i for i, t in enumerate(types) if t == HCA]

    def init_cache(self, batch: int, capacity: int, csa_dtype=None) -> V4Cache:
        """An empty cache for ``batch`` requests of up to ``capacity`` positions each. ``csa_dtype``: the
        CSA entries' storage (default the model dtype; uint8 = FP8 rows, ops.encode_v4_rows)."""
        cfg, dtype = self.cfg, self.dtype
        csa_dtype = dtype if csa_dtype is None else csa_dtype
        csa, hca = self.layer_groups()
        lc, lh, m, mh = len(csa), len(hca), cfg.compress_rate_csa, cfg.compress_rate_hca
        h, j = cfg.head_dim, cfg.index_head_dim
        zeros = lambda *shape, dt=dtype: jnp.zeros(shape, dt)
        state = V4State(
            window=zeros(cfg.num_hidden_layers, batch, cfg.sliding_window, h),
            csa_kv=zeros(lc, batch, 2 * m, 2 * h), csa_gate=zeros(lc, batch, 2 * m, 2 * h, dt=jnp.float32),
            index_kv=zeros(lc, batch, 2 * m, 2 * j), index_gate=zeros(lc, batch, 2 * m, 2 * j, dt=jnp.float32),
            hca_kv=zeros(lh, batch, mh, h), hca_gate=zeros(lh, batch, mh, h, dt=jnp.float32),
        )
        csa_width = ops.v4_row_width(h, cfg.qk_rope_head_dim, csa_dtype)
        entries = V4Entries(csa=zeros(lc, batch, capacity // m, csa_width, dt=csa_dtype),
                            index_keys=zeros(lc, batch, capacity // m, j),
                            hca=zeros(lh, batch, capacity // mh, h))
        return V4Cache(state, entries, jnp.zeros((batch,), jnp.int32))

    def step(self, tokens_BT: jax.Array, meta: StepMeta, cache: V4Cache) -> tuple[jax.Array, jax.Array, V4Cache]:
        """The engine's step: ``T`` tokens for the requests in batch rows ``meta.rows`` of ``cache``.

        A row whose first position is 0 starts a new request: its state is cleared first. Every token
        must be real (no padding: the compressors would pool it); inactive rows (``meta.valid`` False)
        run but leave their rows unchanged, so a row whose prompt is mid-prefill survives decode steps.
        With the HiSparse tier in ``cache.entries.csa`` the step is a decode step over every batch row
        (``meta.rows`` = 0..B-1, T = 1) and inactive rows leave the tier alone. Returns logits ``f32[B, T, V]``, the CSA indexer's top-k entry ids
        ``i32[Lc, B, T, K]`` (-1 = none; ``K = 0`` before the cache holds an entry) and the cache.
        """
        rows_B, start_B = meta.rows, meta.positions[:, 0]
        fresh_B = start_B == 0

        def take(x):  # [layers, batch, ...] -> this step's rows, cleared for new requests
            sub = x[:, rows_B]
            return jnp.where(fresh_B.reshape((1, -1) + (1,) * (sub.ndim - 2)), jnp.zeros_like(sub), sub)

        run_B = meta.valid[:, 0]  # rows that run; the others keep their rows (a prompt mid-prefill among them)

        def put(x, new):
            keep = run_B.reshape((1, -1) + (1,) * (new.ndim - 2))
            return x.at[:, rows_B].set(jnp.where(keep, new, x[:, rows_B]))

        en = cache.entries
        tiered = not isinstance(en.csa, jax.Array)
        csa = en.csa if tiered else take(en.csa)
        tier_meta = ((rows_B + 1)[:, None], meta.valid[:, 0]) if tiered else None
        sub = V4Cache(jax.tree.map(take, cache.state), V4Entries(csa, take(en.index_keys), take(en.hca)), start_B,
                      cache.kernels)
        logits, ids_LBTK, sub = self._step_rows(tokens_BT, sub, tier_meta)
        entries = V4Entries(sub.entries.csa if tiered else put(en.csa, sub.entries.csa),
                            put(en.index_keys, sub.entries.index_keys), put(en.hca, sub.entries.hca))
        lengths = cache.lengths.at[rows_B].set(jnp.where(run_B, sub.lengths, cache.lengths[rows_B]))
        cache = V4Cache(jax.tree.map(put, cache.state, sub.state), entries, lengths, cache.kernels)
        return logits, ids_LBTK, cache

    def step_contiguous(self, tokens_BT: jax.Array, cache: V4Cache) -> tuple[jax.Array, V4Cache]:
        """Append ``T`` tokens per request to a resident ``cache`` (batch row b = request b); logits
        ``f32[B, T, V]`` and the new cache."""
        logits_BTV, _, cache = self._step_rows(tokens_BT, cache, None)
        return logits_BTV, cache

    def _step_rows(self, tokens_BT: jax.Array, cache: V4Cache, tier_meta) -> tuple[jax.Array, jax.Array, V4Cache]:
        """``step_contiguous`` plus the CSA top-k ids ``i32[Lc, B, T, K]``; ``tier_meta =
        (page_table_BX, active_B)`` when ``cache.entries.csa`` is the HiSparse tier, else None."""
        b, t = tokens_BT.shape
        positions_BT = cache.lengths[:, None] + jnp.arange(t)[None, :]
        st, en = cache.state, cache.entries
        csa, hca = self.layer_groups()
        tier = en.csa if tier_meta is not None else None
        windows, csa_out, hca_out, csa_ids = [], [], [], []
        streams_BTXD = self._embed(tokens_BT)
        for i, layer in enumerate(self.layers):
            if i in csa:
                c = csa.index(i)
                entries = en.csa[c] if tier is None else TierLayer(tier, c, *tier_meta)
                comp = (st.csa_kv[c], st.csa_gate[c], entries, st.index_kv[c], st.index_gate[c], en.index_keys[c])
            elif i in hca:
                c = hca.index(i)
                comp = (st.hca_kv[c], st.hca_gate[c], en.hca[c])
            else:
                comp = ()
            streams_BTXD, window_BSH, comp, ids_BTK = layer.step(streams_BTXD, tokens_BT, positions_BT, st.window[i],
                                                                 comp, cache.kernels)
            windows.append(window_BSH)
            if i in csa:
                if tier is not None:
                    tier = comp[2].tier
                    comp = comp[:2] + (None,) + comp[3:]
                csa_out.append(comp)
                csa_ids.append(jnp.zeros((b, t, 0), jnp.int32) if ids_BTK is None else ids_BTK)
            elif i in hca:
                hca_out.append(comp)

        def stack(group, k, old):
            return jnp.stack([g[k] for g in group]) if group else old

        state = V4State(window=jnp.stack(windows),
                        csa_kv=stack(csa_out, 0, st.csa_kv), csa_gate=stack(csa_out, 1, st.csa_gate),
                        index_kv=stack(csa_out, 3, st.index_kv), index_gate=stack(csa_out, 4, st.index_gate),
                        hca_kv=stack(hca_out, 0, st.hca_kv), hca_gate=stack(hca_out, 1, st.hca_gate))
        entries = V4Entries(csa=tier if tier is not None else stack(csa_out, 2, en.csa),
                            index_keys=stack(csa_out, 5, en.index_keys), hca=stack(hca_out, 2, en.hca))
        ids_LBTK = jnp.stack(csa_ids) if csa_ids else jnp.zeros((0, b, t, 0), jnp.int32)
        return self._head(streams_BTXD), ids_LBTK, V4Cache(state, entries, cache.lengths + t, cache.kernels)

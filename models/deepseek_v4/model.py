"""DeepSeek-V4: sliding-window / compressed-sparse / heavily-compressed attention, mHC, hash-routed MoE.

Every layer attends to its last ``sliding_window`` keys; a CSA layer adds the indexer's top-k of its
4:1 compressed entries, an HCA layer all of its 128:1 entries, all in one softmax with a learned
per-head sink (DOMAIN.md 2.1-2.5). Keys are values (one shared K = V head of ``head_dim``). The
residual is ``hc_mult`` streams mixed by mHC (mhc.py); the MoE routes by ``tid2eid[token]`` on
hash layers and by top-k of ``score + e_score_correction_bias`` elsewhere, with SwiGLU clamped at
``swiglu_limit`` (DOMAIN.md 2.7).

Two forward forms over the same parameters:
- ``__call__(tokens)``: the full causal forward (training / reference form): dense masked attention
  over every window key and compressed entry, the indexer's top-k entering as a mask, as in
  transformers.
- ``step(tokens, meta, cache)``: the cached form for any number of new tokens per request. The window
  keys and compressor rings live per batch row in an explicit ``cache.V4Cache``, the compressed
  entries and the CSA indexer keys in pages (one entry per m tokens) through the request's page table;
  each query attends over its window rows and its compressed rows (CSA: the indexer's top-k, read through
  the entries' store, resident or the HiSparse tier; HCA: every visible entry) as row sources
  (``ops.sink_attention``). Prefill in chunks of any sizes gives the one-shot result.

Parameter names mirror transformers' ``DeepseekV4ForCausalLM`` module tree (``checkpoint.hf_name``).
Axis letters: ess_jax.notation (O = mHC streams).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax import ops
from ess_jax.cache import (ResidentPages, RowSource, StepMeta, check_geometry, entries_per_page, entry_pages,
                           flat_ids, layer_source, layer_view, locate, row_runs, with_layer_view, write_then_gather)
from ess_jax.models.deepseek_v4 import mhc
from ess_jax.models.deepseek_v4.cache import CsaCache, HcaCache, V4Cache
from ess_jax.models.deepseek_v4.compressor import (CSACompressor, Compressor, Indexer, TailRope, hadamard,
                                                   visible_entries)
from ess_jax.models.deepseek_v4.config import DeepseekV4Config, V4Layer
from ess_jax.models.layers import (Linear, MoE, MTPHost, RMSNorm, Router, check_stage, index_topk, indexer_kl,
                                   rms_normalize, scan_runs, stack_runs)

SLIDING, CSA, HCA = V4Layer


# ---- attention ---------------------------------------------------------------------------------


class GroupedLinear(nnx.Module):
    """Block-diagonal ``o_a_proj``: ``weight [groups * out_per_group, in_per_group]`` viewed ``[groups, out_per_group,
    in_per_group]``, one block per head group (``in_per_group = N * H / groups``)."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((0.02 * jax.random.normal(rngs.params(), (groups * out_per_group, in_per_group),
                                                          jnp.float32)).astype(dtype))
        self.groups = groups

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [B, T, groups, in_per_group]`` -> ``[B, T, groups, out_per_group]``."""
        w = self.weight[...].reshape(self.groups, -1, x.shape[-1])
        return jnp.einsum("btgi,goi->btgo", x, w)


def reach(page_table_BX: jax.Array, page_size: int, rate: int) -> int:
    """Entries of a part with one per ``rate`` tokens that a request's page table reaches (static)."""
    return page_table_BX.shape[1] * page_size // rate


class Attention(nnx.Module):
    """Shared-KV attention over a sliding window plus, for CSA/HCA layers, compressed entries."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, *, dtype, rngs: nnx.Rngs):
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
        self.top_k = cfg.index_topk
        if self.layer_type == CSA:  # a shared CSA layer of Index Share (DOMAIN.md 1.7) has no indexer
            indexer = Indexer(d, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.compress_rate_csa,
                              cfg.index_topk, rope=self.rope, eps=eps, dtype=dtype,
                              rngs=rngs) if cfg.indexer_full(layer) else None
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
        grouped = self.o_a_proj(out_BTNH.reshape(b, t, self.o_groups, -1))  # [B, T, o_groups, o_lora_rank]
        return self.o_b_proj(grouped.reshape(b, t, -1))

    def __call__(self, x_BTD: jax.Array, stage: str | None = None, picks: tuple[jax.Array, jax.Array] | None = None
                 ) -> tuple[jax.Array, jax.Array, tuple | None]:
        """Full causal forward over a whole sequence: dense logits, window / compressed / top-k masks
        (a CSA layer's top-k at ``stage`` None or "sparse"; "dense" / "warmup": every visible entry,
        ``layers.STAGES``). ``picks``: the top-k entry ids ``i32[B, T, K]`` and index scores ``f32[B, T, M]`` of
        the nearest preceding full CSA layer, what a shared CSA layer (no indexer, Index Share) selects by.
        Returns the output, a CSA layer's indexer loss over its entries (``layers.indexer_kl``; 0 elsewhere and
        for None / "dense"; a shared layer's: the full layer's indexer against this layer's attention, Index
        Share's multi-layer distillation) and the picks the next CSA layer shares (a full layer's own)."""
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
                indexer = self.compressor.indexer
                if indexer is not None:
                    with jax.named_scope("indexer"):
                        x_in, q_in = x_BTD, q_resid_BTQ
                        if stage is not None:  # the indexer's loss reaches no other parameter
                            x_in, q_in = jax.lax.stop_gradient(x_BTD), jax.lax.stop_gradient(q_resid_BTQ)
                        scores_BTM = indexer.scores(x_in, q_in, indexer(x_in), visible_BTM, cos, sin)
                        picks = (index_topk(scores_BTM, self.top_k), scores_BTM)
                ids_BTK, scores_BTM = picks
                with jax.named_scope("indexer"):
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
        return self._output(out_BTNH, cos, sin, x_BTD.dtype), kl, picks

    def _hca_rings(self, record: HcaCache, index, meta: StepMeta):
        """The HCA compressor's rings ``[B, m', H]`` for this step, and the host rings (None: on the device). With
        host rings (decode steps of one token) the rows whose window closes now read theirs from the host."""
        kv_ring, gate_ring = record.kv_ring[index], record.gate_ring[index]
        if record.host is None:
            return kv_ring, gate_ring, None
        if meta.positions.shape[1] != 1:
            raise ValueError(f"host rings serve decode steps of one token per request, got T={meta.positions.shape[1]}")
        m = self.compressor.rate
        closes_B = meta.valid[:, 0] & (meta.positions[:, 0] % m == m - 1)
        kv_ring, gate_ring = record.host.read(index, closes_B, kv_ring[:, 0], gate_ring[:, 0])
        return kv_ring, gate_ring, record.host

    def _hca_newest(self, kv_ring_BUH, gate_ring_BUH, meta: StepMeta):
        """Of the rings after this step's token: its row ``[B, 1, H]``, what the device keeps."""
        slot_B = meta.positions[:, 0] % self.compressor.rate
        newest = lambda ring: jnp.take_along_axis(ring, slot_B[:, None, None], axis=1)  # noqa: E731
        return newest(kv_ring_BUH), newest(gate_ring_BUH)

    def step(self, x_BTD, meta: StepMeta, window_BSH, record, index, kernels: str, ids_BTK=None, key_index=None):
        """Cached forward for ``T`` new tokens per request at ``meta.positions``.

        ``window_BSH`` is the request's window ring ``[B, n_win, H]``; ``record`` the layer kind's cache
        (``CsaCache`` / ``HcaCache``, rings already this step's batch rows; None for sliding layers) and
        ``index`` this layer's place in it (an int, or i32[] inside the scan over layers). Rows that do not run
        (``meta.valid`` False) write their entries to the null page. ``kernels``: the ops kernel choice. A full
        CSA layer's indexer state (its rings, its keys) is at ``key_index`` of the record's indexer arrays (default
        ``index``; only full layers have them); a shared one (no indexer, Index Share) selects its entries at
        ``ids_BTK``, the nearest preceding full CSA layer's picks. Returns ``(out, window, record, ids)``, ``ids``
        the CSA layer's picks ``i32[B, T, K]`` (None for other layers or before the first entry)."""
        b, t, _ = x_BTD.shape
        n_win, positions_BT = self.window, meta.positions
        run_B1 = meta.valid[:, :1]
        cos, sin = self.rope.cos_sin(positions_BT)
        q_BTNH, q_resid_BTQ, kv_BTH = self._project(x_BTD, cos, sin)
        p0_B1 = positions_BT[:, :1]
        # Window rows: key positions t - n_win + 1 .. t, from the ring (before p0) or the new keys.
        keys_BSH = jnp.concatenate([window_BSH.astype(kv_BTH.dtype), kv_BTH], axis=1)
        key_pos_BTS = positions_BT[..., None] - n_win + 1 + jnp.arange(n_win)
        slot_BTS = jnp.where(key_pos_BTS < p0_B1[..., None], key_pos_BTS % n_win,
                             n_win + key_pos_BTS - p0_B1[..., None])
        row_BTS = jnp.arange(b)[:, None, None] * keys_BSH.shape[1] + slot_BTS
        window = RowSource(keys_BSH.reshape(-1, keys_BSH.shape[-1]), jnp.where(key_pos_BTS >= 0, row_BTS, -1))
        attend = functools.partial(ops.sink_attention, q_BTNH, scale=self.scale, rope_dim=self.rope.dim,
                                   kernels=kernels)
        sinks_N, out_BTNH = self.sinks[...], None
        ids_BTK = ids_BTK if self.layer_type == CSA else None
        key_index = index if key_index is None else key_index
        if self.layer_type == CSA:
            page_size, m = record.entries.page_size, self.compressor.rate
            geometry = dict(page_size=page_size, rate=m)
            indexer = self.compressor.indexer
            with jax.named_scope("compressor"):
                new_BMH, entry_BM, closes_BM, kv_ring, gate_ring = self.compressor.close(
                    x_BTD, positions_BT, record.kv_ring[index], record.gate_ring[index])
                new_ids_BM = jnp.where(closes_BM & run_B1, entry_BM, -1)
                new_BMW = ops.encode_v4_rows(new_BMH, record.entries.dtype, rope_dim=self.rope.dim)
            key_format = record.index_format
            fp4 = key_format == "fp4"
            index_keys, index_kv_ring, index_gate_ring = record.index_keys, record.index_kv_ring, record.index_gate_ring
            count = reach(meta.page_table, page_size, m)
            if indexer is not None:
                with jax.named_scope("indexer"):
                    keys_BMJ, key_BM, key_closes_BM, index_kv, index_gate = indexer.close(
                        x_BTD, positions_BT, index_kv_ring[key_index], index_gate_ring[key_index])
                    index_kv_ring = index_kv_ring.at[key_index].set(index_kv)
                    index_gate_ring = index_gate_ring.at[key_index].set(index_gate)
                    key_at = locate(meta.page_table, jnp.where(key_closes_BM & run_B1, key_BM, -1), **geometry)
                    index_keys, keys_BMX = write_then_gather(
                        index_keys, key_index, key_at,
                        ops.encode_index_keys(hadamard(keys_BMJ) if fp4 else keys_BMJ, key_format),
                        entry_pages(meta.page_table, **geometry))
            entries = record.entries
            if count > 0:  # a cache too small for one entry has nothing to select
                if indexer is not None:
                    with jax.named_scope("indexer"):
                        keys_BMJ = ops.decode_index_keys(keys_BMX, key_format, x_BTD.dtype, width=indexer.dim)
                        scores_BTM = indexer.scores(x_BTD, q_resid_BTQ, keys_BMJ,
                                                    visible_entries(positions_BT, count, m), cos, sin, fp4=fp4)
                        ids_BTK = index_topk(scores_BTM, self.top_k)
                with jax.named_scope("sparse_attention"):  # HiSparse: window + resident entries, fetched entries
                    sources = entries.read(index, meta, new_ids_BM, new_BMW, ids_BTK)
                    no_sink_N = jnp.full(sinks_N.shape, -jnp.inf, jnp.float32)
                    out_BTNH, entries = ops.dual_attention(
                        lambda srcs, ready: attend(window if ready else None, srcs, sinks_N if ready else no_sink_N),
                        sources)
            record = CsaCache(record.kv_ring.at[index].set(kv_ring), record.gate_ring.at[index].set(gate_ring),
                              index_kv_ring, index_gate_ring, entries, index_keys, key_format)
        elif self.layer_type == HCA:
            geometry = dict(page_size=record.page_size, rate=self.compressor.rate)
            with jax.named_scope("compressor"):
                kv_ring, gate_ring, host = self._hca_rings(record, index, meta)
                new_BMH, entry_BM, closes_BM, kv_ring, gate_ring = self.compressor.close(
                    x_BTD, positions_BT, kv_ring, gate_ring)
                if host is not None:  # the device keeps the newest position's row (its slot: DeepseekV4.step)
                    kv_ring, gate_ring = self._hca_newest(kv_ring, gate_ring, meta)
                page_BM, offset_BM = locate(meta.page_table, jnp.where(closes_BM & run_B1, entry_BM, -1), **geometry)
                view, at = layer_view(record.entries, index)
                view = view.at[(*at, page_BM, offset_BM)].set(new_BMH.astype(view.dtype))
            count = reach(meta.page_table, record.page_size, self.compressor.rate)
            ids_BTM = jnp.where(visible_entries(positions_BT, count, self.compressor.rate), jnp.arange(count), -1)
            hca = layer_source(view, at, flat_ids(meta.page_table, ids_BTM, **geometry))
            entries = with_layer_view(record.entries, view, index)
            with jax.named_scope("sparse_attention"):
                out_BTNH, _ = attend(window, [hca], sinks_N)
            record = HcaCache(record.kv_ring.at[index].set(kv_ring), record.gate_ring.at[index].set(gate_ring),
                              entries, record.page_size, host)
        if out_BTNH is None:
            with jax.named_scope("sparse_attention"):
                out_BTNH, _ = attend(window, [], sinks_N)
        # Only the last n_win new keys reach the ring (earlier ones would collide on a slot).
        write_BT = jnp.where(jnp.arange(t)[None, :] >= t - n_win, positions_BT % n_win, n_win)
        window_BSH = window_BSH.at[jnp.arange(b)[:, None], write_BT].set(kv_BTH.astype(window_BSH.dtype), mode="drop")
        return self._output(out_BTNH, cos, sin, x_BTD.dtype), window_BSH, record, ids_BTK


# ---- model -------------------------------------------------------------------------------------


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, *, dtype, rngs: nnx.Rngs):
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

    def _ffn(self, streams_BTOD, tokens_BT):
        post, comb, x_BTD = self.ffn_hc(streams_BTOD)
        return mhc.merge(post, comb, self.mlp(self.post_attention_layernorm(x_BTD), tokens_BT), streams_BTOD)

    def __call__(self, streams_BTOD: jax.Array, tokens_BT: jax.Array, stage: str | None = None, picks=None):
        post, comb, x_BTD = self.attn_hc(streams_BTOD)
        out, kl, picks = self.self_attn(self.input_layernorm(x_BTD), stage, picks)
        streams_BTOD = mhc.merge(post, comb, out, streams_BTOD)
        return self._ffn(streams_BTOD, tokens_BT), kl, picks

    def step(self, streams_BTOD, tokens_BT, meta: StepMeta, window_BSH, record, index, kernels: str, ids_BTK=None,
             key_index=None):
        post, comb, x_BTD = self.attn_hc(streams_BTOD)
        out, window_BSH, record, ids_BTK = self.self_attn.step(self.input_layernorm(x_BTD), meta, window_BSH, record,
                                                               index, kernels, ids_BTK, key_index)
        streams_BTOD = mhc.merge(post, comb, out, streams_BTOD)
        return self._ffn(streams_BTOD, tokens_BT), window_BSH, record, ids_BTK


class DeepseekV4(MTPHost, nnx.Module):
    """``DeepseekV4ForCausalLM``: parameter names mirror transformers' module tree, the decoder layers held as
    stacked runs (``layers.stack_runs``: the leading sliding / hash-routed layers, then the CSA / HCA pairs as
    blocks of two), so the full forward and the cached step scan them (``layers.scan_runs``) and compile in a
    time that does not grow with depth."""

    def __init__(self, cfg: DeepseekV4Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if cfg.family != "deepseek_v4":
            raise ValueError(f"DeepseekV4 needs a deepseek_v4 config, got model_type={cfg.model_type!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)).astype(dtype))
        self.runs = stack_runs([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=jnp.float32)
        self.hc_head = mhc.HyperHead(cfg.hidden_size, cfg.hc_mult, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                                     rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        if cfg.num_nextn_predict_layers:  # the MTP module, named as layer num_hidden_layers (mtp.py)
            from ess_jax.models.deepseek_v4.mtp import MTPLayerV4
            self.mtp = nnx.Dict({str(cfg.num_hidden_layers): MTPLayerV4(cfg, dtype=dtype, rngs=rngs)})

    def _embed(self, tokens_BT: jax.Array) -> jax.Array:
        """The embedding copied into all ``hc_mult`` streams ``[B, T, O, D]``."""
        h_BTD = self.embed_tokens[...][tokens_BT]
        return jnp.broadcast_to(h_BTD[:, :, None, :], h_BTD.shape[:2] + (self.cfg.hc_mult,) + h_BTD.shape[2:])

    def head(self, streams_BTOD: jax.Array) -> jax.Array:
        """Logits ``f32[B, T, V]`` of the final streams: ``hc_head``, the final norm and ``lm_head``."""
        return self.lm_head(self.norm(self.hc_head(streams_BTOD))).astype(jnp.float32)

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        """Full causal forward: logits ``f32[B, T, V]``."""
        return self.train_forward(tokens_BT, None)[0]

    def train_forward(self, tokens_BT: jax.Array, stage: str | None) -> tuple[jax.Array, jax.Array]:
        """The full causal forward at a training ``stage`` (``layers.STAGES``; None: inference): logits
        ``f32[B, T, V]`` and the CSA indexers' loss summed over layers."""
        streams_BTOD, kl = self.hidden_states(tokens_BT, stage)
        return self.head(streams_BTOD), kl

    def hidden_states(self, tokens_BT: jax.Array, stage: str | None) -> tuple[jax.Array, jax.Array]:
        """The full causal forward up to ``hc_head``: the last layer's residual streams ``[B, T, O, D]`` (what
        the MTP module reads) and the CSA indexers' loss summed over layers."""
        check_stage(stage)
        b, t = tokens_BT.shape

        def body(layer, index, carry):
            streams_BTOD, kl, picks = carry
            streams_BTOD, layer_kl, picks = layer(streams_BTOD, tokens_BT, stage, picks)
            return (streams_BTOD, kl + layer_kl, picks), None

        n = t // self.cfg.compress_rate_csa  # the CSA layers' entries: what their picks select from
        carry = (self._embed(tokens_BT), jnp.zeros((), jnp.float32), index_picks(b, t, n, self.cfg.index_topk))
        streams_BTOD, kl, _ = scan_runs(self.runs, body, carry)[0]
        return streams_BTOD, kl

    def layer_groups(self) -> tuple[list[int], list[int]]:
        """Layer indices of the CSA and of the HCA layers (the order of their cache stacks)."""
        return layer_groups(self.cfg)

    def init_cache(self, rows: int, num_pages: int, page_size: int, csa_dtype=None, index_dtype: str | None = None
                   ) -> V4Cache:
        """An empty cache: window and compressor rings for ``rows`` batch rows, compressed entries and indexer
        keys in ``num_pages`` pages (page 0 is the null page) of ``page_size`` tokens. ``csa_dtype``: the CSA
        entries' storage (default the model dtype; uint8 = FP8 rows, ops.encode_v4_rows). ``index_dtype``: the
        indexer keys' format (``CsaCache.index_format``; default the model dtype): "fp4" is the official one,
        the indexer's QAT round trip (68-byte keys at J = 128, ``compressor.Indexer``); "fp8" stores the keys
        as V3.2's 132-byte FP8 rows (no rotation, no query quantization: V4 has no FP8 indexer)."""
        return _init_cache(self.cfg, self.dtype, rows, num_pages, page_size, csa_dtype, index_dtype)

    def step(self, tokens_BT: jax.Array, meta: StepMeta, cache: V4Cache, *, kernels: str = "xla"
             ) -> tuple[jax.Array, jax.Array, V4Cache]:
        """``step_hidden`` without the hidden states: ``(logits, ids, cache)``."""
        logits_BTV, _, ids_LBTK, cache = self.step_hidden(tokens_BT, meta, cache, kernels=kernels)
        return logits_BTV, ids_LBTK, cache

    def step_hidden(self, tokens_BT: jax.Array, meta: StepMeta, cache: V4Cache, *, kernels: str = "xla"
                    ) -> tuple[jax.Array, jax.Array, jax.Array, V4Cache]:
        """The engine's step: ``T`` tokens for the requests in batch rows ``meta.rows`` of ``cache``.

        A row whose first position is 0 starts a new request: its window and rings are cleared first. Every
        token must be real (no padding: the compressors would pool it); rows that do not run (``meta.valid``
        False) leave their rows and pages unchanged, so a row whose prompt is mid-prefill survives decode
        steps. With the HiSparse tier as the CSA entries' store the step is a decode step over every batch
        row (``meta.rows`` = 0..B-1, T = 1). The layers run as one scan per stacked run, the window, the CSA and
        HCA records and the indexer's picks carried whole and indexed at the layer's (traced) place in them.
        ``kernels``: the ops kernel choice (static). Returns logits
        ``f32[B, T, V]``, the final residual streams ``[B, T, O, D]`` (before ``hc_head``: the MTP module's
        input, ``mtp_step``), the CSA indexer's top-k entry ids ``i32[Lc, B, T, K]`` (-1 = none; ``K = 0``
        before the cache holds an entry) and the cache.
        """
        b, t = tokens_BT.shape
        # a step over every row (the decode) clears and keeps each layer's window in place: taken and put back
        # whole, the window (the bulk of the row state) would be copied twice
        in_place = every_row(meta, cache)
        rows = take_rows(meta, cache, window=not in_place)
        csa_layers, hca_layers = self.layer_groups()
        # each layer's place among the layers of its kind (the index into the CSA or HCA record)
        places = jnp.asarray([csa_layers.index(i) if i in csa_layers else hca_layers.index(i) if i in hca_layers
                              else 0 for i in range(self.cfg.num_hidden_layers)], jnp.int32)
        # a full CSA layer's place among the full ones: its index into the indexer's rings and keys (Index Share)
        key_places = jnp.asarray(index_key_places(self.cfg), jnp.int32)
        # the CSA indexer's picks per CSA layer: K = min(top-k, the entries a request's page table reaches)
        count = reach(meta.page_table, cache.csa.entries.page_size, self.cfg.compress_rate_csa)
        ids_LBTK = jnp.full((len(csa_layers), b, t, min(self.cfg.index_topk, count)), -1, jnp.int32)

        def body(layer, index, carry):
            streams_BTOD, window_LBSH, csa, hca, ids_LBTK, shared_BTK = carry
            kind, place = layer.self_attn.layer_type, places[index]
            record = csa if kind == CSA else hca if kind == HCA else None
            old_BSH = window_LBSH[index]
            streams_BTOD, window_BSH, record, ids_BTK = layer.step(
                streams_BTOD, tokens_BT, meta, _fresh(meta, old_BSH, 0) if in_place else old_BSH, record, place,
                kernels, shared_BTK, key_places[index])
            if in_place:
                window_BSH = _kept(meta, window_BSH, old_BSH, 0)
            if kind == CSA:
                csa = record
                if ids_BTK is not None:
                    ids_LBTK, shared_BTK = ids_LBTK.at[place].set(ids_BTK), ids_BTK
            elif kind == HCA:
                hca = record
            return (streams_BTOD, window_LBSH.at[index].set(window_BSH), csa, hca, ids_LBTK, shared_BTK), None

        carry = (self._embed(tokens_BT), rows.window, rows.csa, rows.hca, ids_LBTK, ids_LBTK[0] if csa_layers else
                 jnp.full((b, t, 0), -1, jnp.int32))
        (streams_BTOD, window_LBSH, csa, hca, ids_LBTK, _), _ = scan_runs(self.runs, body, carry)
        if hca.host is not None:  # every HCA layer's newest row is now this step's token's
            hca = dataclasses.replace(hca, host=hca.host.appended(meta.positions[:, -1] % self.cfg.compress_rate_hca,
                                                                  meta.valid[:, 0]))
        cache = put_rows(meta, cache, V4Cache(window_LBSH, csa, hca), window=not in_place)
        return self.head(streams_BTOD), streams_BTOD, ids_LBTK, cache

    # ---- the MTP module (models.deepseek_v4.mtp) -------------------------------------------------
    def init_mtp_cache(self, rows: int, num_pages: int, page_size: int, csa_dtype=None, index_dtype: str | None = None
                       ) -> V4Cache:
        """The MTP module's empty cache: ``init_cache`` of its one block (its window, and its compressors'
        rings, entries and indexer keys when the block is a CSA / HCA layer), in the same pages."""
        return _init_cache(self.cfg.mtp_block(), self.dtype, rows, num_pages, page_size, csa_dtype, index_dtype)


def index_picks(b: int, t: int, n: int, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Placeholder picks (no top-k entry ids ``i32[B, T, K]``, -inf scores ``f32[B, T, M]``, ``K = min(top_k, M)``)
    before the first full CSA layer: the scan over layers carries the picks a shared CSA layer reuses."""
    return jnp.full((b, t, min(top_k, n)), -1, jnp.int32), jnp.full((b, t, n), -jnp.inf, jnp.float32)


def index_key_places(cfg: DeepseekV4Config) -> list[int]:
    """Each layer's index into the CSA indexer's rings and keys ``[Lf, ...]`` (only full CSA layers have them): its
    place among the full CSA layers (other layers: 0, never read)."""
    full = [i for i in cfg.index_layers if cfg.indexer_full(i)]
    return [full.index(i) if i in full else 0 for i in range(cfg.num_hidden_layers)]


def layer_groups(cfg: DeepseekV4Config) -> tuple[list[int], list[int]]:
    """Layer indices of the CSA and of the HCA layers of ``cfg`` (the order of their cache stacks)."""
    types = cfg.layer_types
    return [i for i, t in enumerate(types) if t == CSA], [i for i, t in enumerate(types) if t == HCA]


def every_row(meta: StepMeta, cache: V4Cache) -> bool:
    """A step over as many rows as ``cache`` has runs every batch row in order (``meta.rows`` 0..B-1: the decode;
    in each data shard, its own rows): its row state is used where it is, not gathered and scattered back."""
    return meta.rows.shape[0] == cache.window.shape[1]


def _fresh(meta: StepMeta, x: jax.Array, rows_axis: int = 1) -> jax.Array:
    """``x`` (batch rows on ``rows_axis``) with the rows of new requests (first position 0) cleared."""
    fresh = meta.positions[:, 0] == 0
    return jnp.where(fresh.reshape((1,) * rows_axis + (-1,) + (1,) * (x.ndim - rows_axis - 1)), jnp.zeros_like(x), x)


def _kept(meta: StepMeta, new: jax.Array, old: jax.Array, rows_axis: int = 1) -> jax.Array:
    """``new`` in the rows that ran (``meta.valid``), ``old`` in the others."""
    keep = meta.valid[:, 0]
    return jnp.where(keep.reshape((1,) * rows_axis + (-1,) + (1,) * (new.ndim - rows_axis - 1)), new, old)


def take_rows(meta: StepMeta, cache: V4Cache, window: bool = True) -> V4Cache:
    """``cache`` with its per-batch-row state ``[layers, batch rows, ...]`` cut to this step's rows (``meta.rows``),
    cleared for new requests (first position 0); ``window`` False: the window left as it is, for a step over every
    row (``every_row``) that clears and keeps it layer by layer in place."""
    everyone = every_row(meta, cache)
    kept = {} if window else {"window": cache.window}
    arrays = {k: v for k, v in cache.row_arrays().items() if k not in kept}
    taken = jax.tree.map(lambda x: _fresh(meta, x if everyone else x[:, meta.rows]), arrays)
    return cache.with_row_arrays(taken | kept)


def put_rows(meta: StepMeta, cache: V4Cache, ran: V4Cache, window: bool = True) -> V4Cache:
    """``take_rows``' inverse: ``ran`` (this step's rows, its paged parts the new ones) with the rows that ran
    (``meta.valid``) put back into their batch rows of ``cache``; ``window`` False: ``ran``'s window as it is (kept
    layer by layer, as ``take_rows``)."""
    everyone = every_row(meta, cache)

    def put(x, new):
        kept = _kept(meta, new, x if everyone else x[:, meta.rows])
        return kept if everyone else x.at[:, meta.rows].set(kept)

    kept = {} if window else {"window": ran.window}
    arrays = {k: v for k, v in cache.row_arrays().items() if k not in kept}
    news = {k: v for k, v in ran.row_arrays().items() if k not in kept}
    return ran.with_row_arrays(jax.tree.map(put, arrays, news) | kept)


def _init_cache(cfg: DeepseekV4Config, dtype, rows: int, num_pages: int, page_size: int, csa_dtype,
                index_dtype: str | None) -> V4Cache:
    """``DeepseekV4.init_cache`` for the layers of ``cfg`` in a model of ``dtype``."""
    csa_dtype = dtype if csa_dtype is None else csa_dtype
    index_format = index_dtype or jnp.dtype(dtype).name
    key_width, key_dtype = ops.index_key_storage(cfg.index_head_dim, index_format)
    csa, hca = layer_groups(cfg)
    lc, lh, m, mh = len(csa), len(hca), cfg.compress_rate_csa, cfg.compress_rate_hca
    lf = cfg.indexer_types.count("full")  # the CSA layers with an indexer (Index Share: the full ones)
    for rate in (m, mh):
        check_geometry(page_size, rate)
    h, j = cfg.head_dim, cfg.index_head_dim
    zeros = lambda *shape, dt=dtype: jnp.zeros(shape, dt)  # noqa: E731
    per_csa, per_hca = entries_per_page(page_size, m), entries_per_page(page_size, mh)
    csa_width = ops.v4_row_width(h, cfg.qk_rope_head_dim, csa_dtype)
    return V4Cache(
        window=zeros(cfg.num_hidden_layers, rows, cfg.sliding_window, h),
        csa=CsaCache(kv_ring=zeros(lc, rows, 2 * m, 2 * h), gate_ring=zeros(lc, rows, 2 * m, 2 * h),
                     index_kv_ring=zeros(lf, rows, 2 * m, 2 * j), index_gate_ring=zeros(lf, rows, 2 * m, 2 * j),
                     entries=ResidentPages(zeros(lc, num_pages, per_csa, csa_width, dt=csa_dtype),
                                           page_size=page_size, rate=m),
                     index_keys=row_runs(lf, num_pages, per_csa, key_width, key_dtype),
                     index_format=index_format),
        hca=HcaCache(kv_ring=zeros(lh, rows, mh, h), gate_ring=zeros(lh, rows, mh, h),
                     entries=zeros(lh, num_pages, per_hca, h), page_size=page_size))

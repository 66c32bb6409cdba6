"""DeepSeek's multi-token-prediction (MTP) module, one per family (DOMAIN.md 1.6).

The module (DeepSeek-V3 report 2.2, depth D = 1) predicts the token two ahead: at position ``i`` it combines
the main model's final hidden state ``h_i`` with the embedding of the next token ``t_{i+1}``, runs one
decoder block of the family over the combined sequence (causal, its own attention cache) and reads the
shared output head; its logits at ``i`` predict ``t_{i+2}``. It shares the embedding and the output head
with the main model: they are the main model's ``embed_tokens`` and ``lm_head`` (tied). The releases also
store copies of both under the MTP layer; the loader does not read them (``ess_jax.checkpoint``).

**DeepSeek-V3.2** (``MTPLayerV32``, as vLLM's ``deepseek_mtp.py`` and the V3 report define it; release names
``model.layers.{num_hidden_layers}.*``)::

    x_i      = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])       embedding first, eh_proj [D, 2D]
    h'_i     = block(x)_i                                           MLA + its own DSA indexer + MoE
    logits_i = lm_head(shared_head.norm(h'_i))                      predicts t_{i+2}

``h_i`` is the last decoder layer's output before the final norm (``DeepseekV32.hidden_states`` /
``step_hidden``).

**DeepSeek-V4** (``MTPLayerV4``, as DeepSeek's own V4 inference code defines ``MTPBlock``, which SGLang and
vLLM follow; release names ``mtp.0.*``, loaded as ``model.layers.{num_hidden_layers}.*``): the module reads
the main model's ``hc_mult`` residual streams ``X_i [O, D]`` after the last layer, before ``hc_head``; the
embedding is added to every stream, each stream projected alone; the block is a full mHC decoder layer
(``attn_hc`` / ``ffn_hc``) of the attention the schedule gives it (``mtp_layer_types``: the
``compress_ratios`` entry past the layers, sliding in both releases; a CSA / HCA block has its own
compressors and indexer); the module has its own ``hc_head`` and norm before the shared head::

    X'_i     = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(X_i))     e_proj, h_proj [D, D]; per stream
    Y        = block(X')                                                      streams [O, D] per position
    logits_i = lm_head(shared_head.norm(hc_head(Y_i)))                       the MTP's own hc_head_{fn,base,scale}

(the release's ``e_proj`` / ``h_proj`` are the two halves of V3's ``eh_proj``, the embedding's shared by the
streams.) vLLM zeroes the embedding at position 0; DeepSeek's definition and V4 code do not, and neither
does this module.

**Chaining.** The module's output hidden (``h'`` / ``Y``, before its head) is what the next draft reads in
place of the main model's: vLLM's chaining of the one module for K > 1 drafts.

**Forms** (the models' methods, ``DeepseekV32`` / ``DeepseekV4``):

- ``mtp_forward(hidden [B, T, ...], next_tokens [B, T], stage)`` -> ``(logits f32[B, T, V], hidden_out, kl)``:
  the training form, differentiable, causal over positions ``0..T-1`` (``stage`` as the main model's:
  ``models.layers.STAGES``; ``kl`` the block's indexer loss). Training pairs ``hidden_states(t[:, :-1])[:, :-1]``
  with ``next_tokens = t[:, 1:-1]`` and the labels ``t[:, 2:]``.
- ``step_hidden(tokens, meta, cache)`` -> ``(logits, hidden, ids, cache)``: the main model's cached step with
  its final hidden states (``step`` is it without them).
- ``init_mtp_cache(rows, num_pages, page_size, ...)``: the module's own cache, the family's cache type for its
  one block (``L = 1``: V3.2 latent rows and indexer keys; V4 its window, and a CSA / HCA block's rings,
  entries and indexer keys) in pages of the same geometry as the main cache, so the main model's page table
  serves it (``ess_jax.families.Family.mtp_cache_parts`` sizes it for the planner).
- ``mtp_step(hidden [B, T, ...], next_tokens [B, T], meta, mtp_cache)`` -> ``(logits f32[B, T, V],
  hidden_out, mtp_cache)``: the cached form. The token at MTP position ``i`` is the pair ``(h_i, t_{i+1})``,
  written at position ``i`` of the MTP cache (``meta.positions``, ``meta.page_table``: the main step's). So:
  (a) in prefill, after the main step over prompt positions ``p..q`` (their ``h``), run it at positions
  ``p..q-1`` with ``next_tokens = t_{p+1..q}`` and at ``q`` once ``t_{q+1}`` is sampled; (b) in decode, run it
  on the verified positions with the accepted next tokens (its last logits draft the first token), then chain:
  position ``+1`` with its own ``hidden_out`` and the draft, K times. Positions written by chained drafts are
  rewritten when the verified ``h`` reaches them; V4 rows start fresh at position 0 and rows that do not run
  (``meta.valid``) keep their state, as in the main step. Next tokens must be real ids (padding rows: any id).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.cache import PagedCacheV32, StepMeta, V4Cache
from ess_jax.config import ModelConfig, V4Layer
from ess_jax.models import deepseek_v32, deepseek_v4, mhc
from ess_jax.models.layers import Linear, RMSNorm


class SharedHead(nnx.Module):
    """The norm before the shared output head (``shared_head.norm``; the release's ``shared_head.head`` is a
    copy of ``lm_head``, not read)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.norm = RMSNorm(dim, eps, dtype=dtype)


class MTPLayerV32(deepseek_v32.DecoderLayer):
    """DeepSeek-V3.2's MTP module: a decoder layer (MLA, its own indexer, MoE) with ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm``."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg.mtp_block(), 0, dtype=dtype, rngs=rngs)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps, dtype=dtype)
        self.hnorm = RMSNorm(d, eps, dtype=dtype)
        self.eh_proj = Linear(2 * d, d, dtype=dtype, rngs=rngs)
        self.shared_head = SharedHead(d, eps, dtype=dtype)

    def _input(self, model, h_BTD: jax.Array, next_tokens_BT: jax.Array) -> jax.Array:
        e_BTD = model.embed_tokens[...][next_tokens_BT]
        return self.eh_proj(jnp.concatenate([self.enorm(e_BTD), self.hnorm(h_BTD)], axis=-1))

    def _logits(self, model, h_BTD: jax.Array) -> jax.Array:
        return model.lm_head(self.shared_head.norm(h_BTD)).astype(jnp.float32)

    def predict(self, model, h_BTD, next_tokens_BT, stage):
        """The full causal form (``DeepseekV32.mtp_forward``)."""
        b, t = next_tokens_BT.shape
        cos, sin = model._cos_sin(jnp.broadcast_to(jnp.arange(t), (b, t)))
        out_BTD, kl, _ = deepseek_v32.DecoderLayer.__call__(self, self._input(model, h_BTD, next_tokens_BT), cos,
                                                            sin, stage)
        return self._logits(model, out_BTD), out_BTD, kl

    def predict_step(self, model, h_BTD, next_tokens_BT, meta: StepMeta, cache: PagedCacheV32, kernels: str):
        """The cached form (``DeepseekV32.mtp_step``): the block as layer 0 of its own cache."""
        cos, sin = model._cos_sin(meta.positions)
        out_BTD, _, cache = deepseek_v32.DecoderLayer.step(self, self._input(model, h_BTD, next_tokens_BT), cos, sin,
                                                           meta, 0, cache, kernels)
        return self._logits(model, out_BTD), out_BTD, cache


class MTPLayerV4(deepseek_v4.DecoderLayer):
    """DeepSeek-V4's MTP module: an mHC decoder layer with ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, its own
    ``hc_head`` and ``shared_head.norm``."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg.mtp_block(), 0, dtype=dtype, rngs=rngs)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps, dtype=jnp.float32)
        self.hnorm = RMSNorm(d, eps, dtype=jnp.float32)
        self.e_proj = Linear(d, d, dtype=dtype, rngs=rngs)
        self.h_proj = Linear(d, d, dtype=dtype, rngs=rngs)
        self.shared_head = SharedHead(d, eps, dtype=jnp.float32)
        self.hc_head = mhc.HyperHead(d, cfg.hc_mult, hc_eps=cfg.hc_eps, norm_eps=eps, rngs=rngs)

    def _input(self, model, streams_BTOD: jax.Array, next_tokens_BT: jax.Array) -> jax.Array:
        e_BTD = self.enorm(model.embed_tokens[...][next_tokens_BT])
        return self.e_proj(e_BTD)[:, :, None, :] + self.h_proj(self.hnorm(streams_BTOD))

    def _logits(self, model, streams_BTOD: jax.Array) -> jax.Array:
        return model.lm_head(self.shared_head.norm(self.hc_head(streams_BTOD))).astype(jnp.float32)

    def predict(self, model, streams_BTOD, next_tokens_BT, stage):
        """The full causal form (``DeepseekV4.mtp_forward``); the block's hash router (none: it routes by
        score) would read ``next_tokens``, as DeepSeek's code passes them."""
        out_BTOD, kl, _ = deepseek_v4.DecoderLayer.__call__(self, self._input(model, streams_BTOD, next_tokens_BT),
                                                            next_tokens_BT, stage)
        return self._logits(model, out_BTOD), out_BTOD, kl

    def predict_step(self, model, streams_BTOD, next_tokens_BT, meta: StepMeta, cache: V4Cache, kernels: str):
        """The cached form (``DeepseekV4.mtp_step``): the block as layer 0 of its own cache, the batch rows'
        state taken and put back as the main step does (``deepseek_v4.take_rows`` / ``put_rows``)."""
        rows = deepseek_v4.take_rows(meta, cache)
        kind = self.self_attn.layer_type
        record = rows.csa if kind == V4Layer.CSA else rows.hca if kind == V4Layer.HCA else None
        out_BTOD, window_BSH, record, _ = deepseek_v4.DecoderLayer.step(
            self, self._input(model, streams_BTOD, next_tokens_BT), next_tokens_BT, meta, rows.window[0], record, 0,
            kernels)
        ran = V4Cache(rows.window.at[0].set(window_BSH), record if kind == V4Layer.CSA else rows.csa,
                      record if kind == V4Layer.HCA else rows.hca)
        return self._logits(model, out_BTOD), out_BTOD, deepseek_v4.put_rows(meta, cache, ran)

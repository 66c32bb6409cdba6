"""DeepSeek-V4's multi-token-prediction (MTP) module (``models.mtp`` has what both families share).

``MTPLayerV4``, as DeepSeek's own V4 inference code defines ``MTPBlock``, which SGLang and vLLM follow; release
names ``mtp.0.*``, loaded as ``model.layers.{num_hidden_layers}.*``: the module reads the main model's ``hc_mult``
residual streams ``X_i [O, D]`` after the last layer, before ``hc_head``; the embedding is added to every stream,
each stream projected alone; the block is a full mHC decoder layer (``attn_hc`` / ``ffn_hc``) of the attention
the schedule gives it (``mtp_layer_types``: the ``compress_ratios`` entry past the layers, sliding in both
releases; a CSA / HCA block has its own compressors and indexer); the module has its own ``hc_head`` and norm
before the shared head::

    X'_i     = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(X_i))     e_proj, h_proj [D, D]; per stream
    Y        = block(X')                                                      streams [O, D] per position
    logits_i = lm_head(shared_head.norm(hc_head(Y_i)))                       the MTP's own hc_head_{fn,base,scale}

(the release's ``e_proj`` / ``h_proj`` are the two halves of V3's ``eh_proj``, the embedding's shared by the
streams.) vLLM zeroes the embedding at position 0; DeepSeek's definition and V4 code do not, and neither
does this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.cache import StepMeta
from ess_jax.models.deepseek_v4 import mhc
from ess_jax.models.deepseek_v4 import model as deepseek_v4
from ess_jax.models.deepseek_v4.cache import V4Cache
from ess_jax.models.deepseek_v4.config import DeepseekV4Config, V4Layer
from ess_jax.models.layers import Linear, RMSNorm
from ess_jax.models.mtp import SharedHead


class MTPLayerV4(deepseek_v4.DecoderLayer):
    """DeepSeek-V4's MTP module: an mHC decoder layer with ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, its own
    ``hc_head`` and ``shared_head.norm``."""

    def __init__(self, cfg: DeepseekV4Config, *, dtype, rngs: nnx.Rngs):
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

"""DeepSeek-V3.2's multi-token-prediction (MTP) module (``models.mtp`` has what both families share).

``MTPLayerV32``, as vLLM's ``deepseek_mtp.py`` and the V3 report define it; release names
``model.layers.{num_hidden_layers}.*``::

    x_i      = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])       embedding first, eh_proj [D, 2D]
    h'_i     = block(x)_i                                           MLA + its own DSA indexer + MoE
    logits_i = lm_head(shared_head.norm(h'_i))                      predicts t_{i+2}

``h_i`` is the last decoder layer's output before the final norm (``DeepseekV32.hidden_states`` /
``step_hidden``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.cache import StepMeta
from ess_jax.models.deepseek_v32 import model as deepseek_v32
from ess_jax.models.deepseek_v32.cache import PagedCacheV32
from ess_jax.models.deepseek_v32.config import DeepseekV32Config
from ess_jax.models.layers import Linear, RMSNorm
from ess_jax.models.mtp import SharedHead


class MTPLayerV32(deepseek_v32.DecoderLayer):
    """DeepSeek-V3.2's MTP module: a decoder layer (MLA, its own indexer, MoE) with ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm``."""

    def __init__(self, cfg: DeepseekV32Config, *, dtype, rngs: nnx.Rngs):
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
        cos, sin = model.cos_sin(jnp.broadcast_to(jnp.arange(t), (b, t)))
        out_BTD, kl, _ = deepseek_v32.DecoderLayer.__call__(self, self._input(model, h_BTD, next_tokens_BT), cos,
                                                            sin, stage)
        return self._logits(model, out_BTD), out_BTD, kl

    def predict_step(self, model, h_BTD, next_tokens_BT, meta: StepMeta, cache: PagedCacheV32, kernels: str):
        """The cached form (``DeepseekV32.mtp_step``): the block as layer 0 of its own cache."""
        cos, sin = model.cos_sin(meta.positions)
        out_BTD, _, cache = deepseek_v32.DecoderLayer.step(self, self._input(model, h_BTD, next_tokens_BT), cos, sin,
                                                           meta, 0, cache, kernels)
        return self._logits(model, out_BTD), out_BTD, cache

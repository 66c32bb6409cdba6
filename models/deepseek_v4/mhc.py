"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream (DOMAIN.md 2.6).

The residual is ``O`` parallel streams per token (``hc_mult``, axis letter O), ``streams_BTOD``. Each
sub-block (attention, MoE) reads one collapsed input and writes back through three weight sets computed
from the streams themselves:

    n = flat(streams) * rsqrt(mean(flat(streams)^2) + eps)          flat: [B, T, O*D]
    [pre | post | comb] = fn n                                      fn: [(2 + O) * O, O * D]
    pre  = sigmoid(scale_0 pre + base_pre) + hc_eps                 [B, T, O]
    post = 2 sigmoid(scale_1 post + base_post)                      [B, T, O]
    comb = Sinkhorn(softmax_rows(scale_2 comb + base_comb) + hc_eps)  [B, T, O, O], doubly stochastic
    block input  = sum_x pre_x streams_x
    new streams_k = post_k * block(input) + sum_j comb[j, k] streams_j        (comb^T streams)

``HyperHead`` collapses the streams once more (``pre`` only) before the final norm and ``lm_head``.
Parameters keep transformers' names (``attn_hc.{fn,base,scale}``, ``model.hc_head.hc_{fn,base,scale}``)
and stay float32 as in the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.models.layers import rms_normalize


def sinkhorn(comb_BTOO: jax.Array, iters: int, eps: float) -> jax.Array:
    """Column-normalise once, then ``iters - 1`` rounds of rows-then-columns (transformers' order)."""
    comb_BTOO = comb_BTOO / (comb_BTOO.sum(axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, comb_BTOO)


class HyperConnection(nnx.Module):
    """The mHC weights of one sub-block: ``fn [(2+O)O, O*D]``, ``base [(2+O)O]``, ``scale [3]`` (float32)."""

    def __init__(self, hidden: int, hc_mult: int, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 rngs: nnx.Rngs):
        n = (2 + hc_mult) * hc_mult
        self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (n, hc_mult * hidden), jnp.float32))
        self.base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, streams_BTOD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns ``post f32[B, T, O]``, ``comb f32[B, T, O, O]`` and the block input ``[B, T, D]``."""
        b, t, o, _ = streams_BTOD.shape
        flat = rms_normalize(streams_BTOD.reshape(b, t, -1), self.norm_eps)
        mix = jnp.einsum("btk,mk->btm", flat, self.fn[...])
        base, scale = self.base[...], self.scale[...]
        pre_BTO = jax.nn.sigmoid(mix[..., :o] * scale[0] + base[:o]) + self.hc_eps
        post_BTO = 2.0 * jax.nn.sigmoid(mix[..., o:2 * o] * scale[1] + base[o:2 * o])
        comb_logits = mix[..., 2 * o:].reshape(b, t, o, o) * scale[2] + base[2 * o:].reshape(o, o)
        comb_BTOO = sinkhorn(jax.nn.softmax(comb_logits, axis=-1) + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        collapsed_BTD = jnp.einsum("bto,btod->btd", pre_BTO, streams_BTOD.astype(jnp.float32))
        return post_BTO, comb_BTOO, collapsed_BTD.astype(streams_BTOD.dtype)


def merge(post_BTO: jax.Array, comb_BTOO: jax.Array, block_BTD: jax.Array, streams_BTOD: jax.Array) -> jax.Array:
    """``new_k = post_k * block + sum_j comb[j, k] streams_j`` in the streams' dtype."""
    dtype = streams_BTOD.dtype
    expanded = post_BTO.astype(dtype)[..., None] * block_BTD.astype(dtype)[:, :, None, :]
    return expanded + jnp.einsum("btjk,btjd->btkd", comb_BTOO.astype(dtype), streams_BTOD)


class HyperHead(nnx.Module):
    """Final collapse of the streams: ``hc_fn [O, O*D]``, ``hc_base [O]``, ``hc_scale [1]`` (float32)."""

    def __init__(self, hidden: int, hc_mult: int, *, hc_eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.hc_fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (hc_mult, hc_mult * hidden), jnp.float32))
        self.hc_base = nnx.Param(jnp.zeros((hc_mult,), jnp.float32))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, streams_BTOD: jax.Array) -> jax.Array:
        b, t, _, _ = streams_BTOD.shape
        flat = rms_normalize(streams_BTOD.reshape(b, t, -1), self.norm_eps)
        mix_BTO = jnp.einsum("btk,ok->bto", flat, self.hc_fn[...])
        pre_BTO = jax.nn.sigmoid(mix_BTO * self.hc_scale[...] + self.hc_base[...]) + self.hc_eps
        collapsed_BTD = jnp.einsum("bto,btod->btd", pre_BTO, streams_BTOD.astype(jnp.float32))
        return collapsed_BTD.astype(streams_BTOD.dtype)

"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream (DOMAIN.md 2.6).

The residual is ``X`` parallel streams per token (``hc_mult``, axis letter X), ``streams_BTXD``. Each
sub-block (attention, MoE) reads one collapsed input and writes back through three weight sets computed
from the streams themselves:

    n = flat(streams) * rsqrt(mean(flat(streams)^2) + eps)          flat: [B, T, X*D]
    [pre | post | comb] = fn n                                      fn: [(2 + X) * X, X * D]
    pre  = sigmoid(scale_0 pre + base_pre) + hc_eps                 [B, T, X]
    post = 2 sigmoid(scale_1 post + base_post)                      [B, T, X]
    comb = Sinkhorn(softmax_rows(scale_2 comb + base_comb) + hc_eps)  [B, T, X, X], doubly stochastic
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


def sinkhorn(comb_BTXX: jax.Array, iters: int, eps: float) -> jax.Array:
    """Column-normalise once, then ``iters - 1`` rounds of rows-then-columns (transformers' order)."""
    comb_BTXX = comb_BTXX / (comb_BTXX.sum(axis=-2, keepdims=True) + eps)

    def round_(_, c):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, comb_BTXX)


class HyperConnection(nnx.Module):
    """The mHC weights of one sub-block: ``fn [(2+X)X, X*D]``, ``base [(2+X)X]``, ``scale [3]`` (float32)."""

    def __init__(self, hidden: int, hc_mult: int, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 rngs: nnx.Rngs):
        n = (2 + hc_mult) * hc_mult
        self.fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (n, hc_mult * hidden), jnp.float32))
        self.base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, streams_BTXD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns ``post f32[B, T, X]``, ``comb f32[B, T, X, X]`` and the block input ``[B, T, D]``."""
        b, t, x, _ = streams_BTXD.shape
        flat = rms_normalize(streams_BTXD.reshape(b, t, -1), self.norm_eps)
        mix = jnp.einsum("btk,ok->bto", flat, self.fn[...])
        base, scale = self.base[...], self.scale[...]
        pre_BTX = jax.nn.sigmoid(mix[..., :x] * scale[0] + base[:x]) + self.hc_eps
        post_BTX = 2.0 * jax.nn.sigmoid(mix[..., x:2 * x] * scale[1] + base[x:2 * x])
        comb_logits = mix[..., 2 * x:].reshape(b, t, x, x) * scale[2] + base[2 * x:].reshape(x, x)
        comb_BTXX = sinkhorn(jax.nn.softmax(comb_logits, axis=-1) + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        collapsed_BTD = jnp.einsum("btx,btxd->btd", pre_BTX, streams_BTXD.astype(jnp.float32))
        return post_BTX, comb_BTXX, collapsed_BTD.astype(streams_BTXD.dtype)


def merge(post_BTX: jax.Array, comb_BTXX: jax.Array, block_BTD: jax.Array, streams_BTXD: jax.Array) -> jax.Array:
    """``new_k = post_k * block + sum_j comb[j, k] streams_j`` in the streams' dtype."""
    dtype = streams_BTXD.dtype
    expanded = post_BTX.astype(dtype)[..., None] * block_BTD.astype(dtype)[:, :, None, :]
    return expanded + jnp.einsum("btjk,btjd->btkd", comb_BTXX.astype(dtype), streams_BTXD)


class HyperHead(nnx.Module):
    """Final collapse of the streams: ``hc_fn [X, X*D]``, ``hc_base [X]``, ``hc_scale [1]`` (float32)."""

    def __init__(self, hidden: int, hc_mult: int, *, hc_eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.hc_fn = nnx.Param(0.02 * jax.random.normal(rngs.params(), (hc_mult, hc_mult * hidden), jnp.float32))
        self.hc_base = nnx.Param(jnp.zeros((hc_mult,), jnp.float32))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, streams_BTXD: jax.Array) -> jax.Array:
        b, t, _, _ = streams_BTXD.shape
        flat = rms_normalize(streams_BTXD.reshape(b, t, -1), self.norm_eps)
        mix_BTX = jnp.einsum("btk,xk->btx", flat, self.hc_fn[...])
        pre_BTX = jax.nn.sigmoid(mix_BTX * self.hc_scale[...] + self.hc_base[...]) + self.hc_eps
        collapsed_BTD = jnp.einsum("btx,btxd->btd", pre_BTX, streams_BTXD.astype(jnp.float32))
        return collapsed_BTD.astype(streams_BTXD.dtype)

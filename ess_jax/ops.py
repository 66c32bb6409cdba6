"""The one place models reach compute kernels through.

Each op has a pure-XLA implementation here; Pallas kernels (pallas_kernels/) plug in behind the
same signatures. Axis letters: ess_jax.notation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sparse_mla(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, rows_BTKW: jax.Array, valid_BTK: jax.Array, *,
               scale: float) -> tuple[jax.Array, jax.Array]:
    """Absorbed-form MLA over gathered latent rows.

    Each query head scores the ``K`` rows ``[c | k_rope]`` by ``q_latent . c + q_rope . k_rope``
    (times ``scale``), softmaxes in float32 over the valid rows and returns the weighted latent
    ``out f32[B, T, N, C]`` and the log-sum-exp ``lse f32[B, T, N]`` of the scaled scores, so
    partial results over disjoint row sets merge exactly. A query with no valid row returns
    ``out = 0`` and ``lse = -inf``.
    """
    c = q_latent_BTNC.shape[-1]
    rows_BTKW = rows_BTKW.astype(jnp.float32)
    latent_BTKC, rope_BTKR = rows_BTKW[..., :c], rows_BTKW[..., c:]
    logits_BTNK = (jnp.einsum("btnc,btkc->btnk", q_latent_BTNC.astype(jnp.float32), latent_BTKC)
                   + jnp.einsum("btnr,btkr->btnk", q_rope_BTNR.astype(jnp.float32), rope_BTKR)) * scale
    logits_BTNK = jnp.where(valid_BTK[:, :, None, :], logits_BTNK, -jnp.inf)
    lse_BTN = jax.nn.logsumexp(logits_BTNK, axis=-1)
    safe_lse_BTN = jnp.where(jnp.isfinite(lse_BTN), lse_BTN, 0.0)
    probs_BTNK = jnp.exp(logits_BTNK - safe_lse_BTN[..., None])
    out_BTNC = jnp.einsum("btnk,btkc->btnc", probs_BTNK, latent_BTKC)
    return out_BTNC, lse_BTN


def sparse_sink_attention(q_BTNH: jax.Array, rows_BTKH: jax.Array, valid_BTK: jax.Array, sinks_N: jax.Array, *,
                          scale: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V4 attention over gathered rows with a learned per-head sink (DOMAIN.md 2.5).

    Every row is both key and value (V4 shares one K = V head). Each query head scores its ``K``
    rows by ``q . row * scale``; the sink ``sinks_N[n]`` is one more logit in the softmax
    denominator only: ``p_j = exp(s_j) / (sum_j' exp(s_j') + exp(sink))``. Returns
    ``out f32[B, T, N, H] = sum_j p_j row_j`` and ``lse f32[B, T, N]``, the log of that denominator.
    A query with no valid row returns ``out = 0``. Pass ``sinks_N = -inf`` for a plain partial result
    over a subset of rows: such ``(out, lse)`` pairs merge exactly by log-sum-exp.
    """
    rows_BTKH = rows_BTKH.astype(jnp.float32)
    logits_BTNK = jnp.einsum("btnh,btkh->btnk", q_BTNH.astype(jnp.float32), rows_BTKH) * scale
    logits_BTNK = jnp.where(valid_BTK[:, :, None, :], logits_BTNK, -jnp.inf)
    sink_BTN = jnp.broadcast_to(sinks_N.astype(jnp.float32), logits_BTNK.shape[:-1])
    lse_BTN = jnp.logaddexp(jax.nn.logsumexp(logits_BTNK, axis=-1), sink_BTN)
    safe_lse_BTN = jnp.where(jnp.isfinite(lse_BTN), lse_BTN, 0.0)
    probs_BTNK = jnp.exp(logits_BTNK - safe_lse_BTN[..., None])
    return jnp.einsum("btnk,btkh->btnh", probs_BTNK, rows_BTKH), lse_BTN


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Combine attention over two disjoint row sets: ``out [..., C]`` with ``lse [...]`` each.

    Exact up to float rounding: the softmax over the union weighs each half by
    ``exp(lse_half - lse_union)``. Halves with no rows (``lse = -inf``) contribute nothing; if both
    are empty the result is 0.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
    weight_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
    return out_a * weight_a[..., None] + out_b * weight_b[..., None]

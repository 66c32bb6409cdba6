"""Fused gather + MLA decode attention in the absorbed form (DeepSeek-V3.2 DSA, DOMAIN.md 1.2).

For each (request b, query token t, head n) the kernel reads the pool rows named by
``ids_BTK[b, t]`` straight from the row pool and computes

    s_k   = scale * (q_latent[b, t, n] . c_k + q_rope[b, t, n] . k_rope_k)     row_k = [c_k | k_rope_k]
    out   = sum_k softmax(s)_k c_k                                             f32[B, T, N, C]
    lse   = log sum_k exp(s_k)                                                 f32[B, T, N]

with an online softmax in float32, ``block_k`` rows at a time (ess_jax.pallas_kernels._gather_attention).

**The pool and ids.** One flat row pool ``pool_PW [P, W = C + R]`` shared by the whole batch, and
*global* row ids ``i32[B, T, K]`` into it, FlashMLA's convention (its sparse indices are
``page * page_size + offset`` into the flattened paged cache). Both ess_jax stores are a free
reshape away:
  - the tier's pool ``[R, P, W]`` of one layer -> ``pool.reshape(R * P, W)``, ids ``b * P + slot``;
  - the resident pages ``[G, Z, W]`` of one layer -> ``pages.reshape(G * Z, W)``, ids
    ``page_table[b, pos // Z] * Z + pos % Z`` (``ess_jax.ops.paged_row_ids``).

**Sentinels.** An id ``< 0`` means "no row": it is skipped, whatever the pool holds at any row it
could alias (unused rows may be NaN). A query with no valid id returns ``out = 0`` and
``lse = -inf``, so its (out, lse) pair merges with any other as an empty half
(``ess_jax.ops.merge_attention``). Valid ids must be ``< P`` (not checked on the device).

**Lowering.** CPU runs ``interpret=True``. On GPU the kernel goes through ``pl.pallas_call``'s
default GPU lowering, Triton (deprecated in jax 0.11), with ``num_warps`` / ``num_stages``; the kernel
lowers to Triton IR for an abstract H200 (tests/kernels), but compiling and running it on a GPU is
unverified. There is no Mosaic GPU (``plgpu``) version yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ess_jax.pallas_kernels._gather_attention import (KNOBS, check_float, check_ids, check_knobs,
                                                      check_mla_queries, check_rank, gather_attention, plain_layout)


def _check(q_latent_BTNC, q_rope_BTNR, pool_PW, ids_BTK):
    b, t, _, c, r = check_mla_queries(q_latent_BTNC, q_rope_BTNR)
    check_rank("pool_PW", pool_PW, 2, "[P, W = C + R]")
    if pool_PW.shape[1] != c + r:
        raise ValueError(f"pool_PW must be [P, W] with W = C + R = {c} + {r}, got {pool_PW.shape}")
    if pool_PW.shape[0] < 1:
        raise ValueError(f"pool_PW must hold at least one row, got {pool_PW.shape}")
    check_ids("ids_BTK", ids_BTK, b, t)
    check_float("pool_PW", pool_PW)
    return c, r


@functools.partial(jax.jit, static_argnames=("scale", *KNOBS))
def sparse_mla(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, pool_PW: jax.Array, ids_BTK: jax.Array, *,
               scale: float, block_h: int = 16, block_k: int = 32, num_splits: int | None = None,
               num_warps: int = 4, num_stages: int = 2, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA over the pool rows at ``ids_BTK`` (-1 = none). Returns ``(out f32[B, T, N, C],
    lse f32[B, T, N])``.

    Knobs: ``block_h`` heads and ``block_k`` ids per step (powers of two; heads are padded up to a
    multiple of ``block_h``, ids with -1 up to a multiple of ``num_splits * block_k``);
    ``num_splits`` programs per query, each over a contiguous part of the ids, merged exactly by
    log-sum-exp (split-K for small batches; ``None``: about two programs per SM on a GPU, 1
    elsewhere); ``num_warps`` / ``num_stages`` reach the GPU compiler only.
    """
    c, r = _check(q_latent_BTNC, q_rope_BTNR, pool_PW, ids_BTK)
    check_knobs(block_h=block_h, block_k=block_k, num_splits=num_splits)
    return gather_attention(q_latent_BTNC, q_rope_BTNR if r else None, [(pool_PW, ids_BTK)], None,
                            layouts=(plain_layout(c, r, pool_PW.dtype),), scale=scale, block_h=block_h,
                            block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                            interpret=interpret, name="sparse_mla")


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_mla_reference(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, pool_PW: jax.Array, ids_BTK: jax.Array,
                         *, scale: float) -> tuple[jax.Array, jax.Array]:
    """``sparse_mla`` in plain jnp: gather, mask, softmax in float32."""
    c, _ = _check(q_latent_BTNC, q_rope_BTNR, pool_PW, ids_BTK)
    valid_BTK = ids_BTK >= 0
    rows_BTKW = pool_PW[jnp.where(valid_BTK, ids_BTK, 0)].astype(jnp.float32)
    rows_BTKW = jnp.where(valid_BTK[..., None], rows_BTKW, 0.0)
    latent_BTKC, rope_BTKR = rows_BTKW[..., :c], rows_BTKW[..., c:]
    hi = jax.lax.Precision.HIGHEST
    logits_BTNK = (jnp.einsum("btnc,btkc->btnk", q_latent_BTNC.astype(jnp.float32), latent_BTKC, precision=hi)
                   + jnp.einsum("btnr,btkr->btnk", q_rope_BTNR.astype(jnp.float32), rope_BTKR, precision=hi)) * scale
    logits_BTNK = jnp.where(valid_BTK[:, :, None, :], logits_BTNK, -jnp.inf)
    lse_BTN = jax.nn.logsumexp(logits_BTNK, axis=-1)
    safe_lse_BTN = jnp.where(jnp.isfinite(lse_BTN), lse_BTN, 0.0)
    probs_BTNK = jnp.exp(logits_BTNK - safe_lse_BTN[..., None])
    return jnp.einsum("btnk,btkc->btnc", probs_BTNK, latent_BTKC, precision=hi), lse_BTN

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
    ``page_table[b, pos // Z] * Z + pos % Z`` (``ess_jax.cache.flat_ids``).

**Sentinels.** An id ``< 0`` means "no row": it is skipped, whatever the pool holds at any row it
could alias (unused rows may be NaN). A query with no valid id returns ``out = 0`` and
``lse = -inf``, so its (out, lse) pair merges with any other as an empty half
(``ess_jax.ops.merge_attention``). Valid ids must be ``< P`` (not checked on the device).

**Lowering.** One kernel per ``target`` (ess_jax.pallas_kernels.target): Mosaic GPU for Hopper
(TMA row copies, ``wgmma``; ``_gather_attention``), Mosaic GPU for Ampere / Ada (``_gather_attention_sm80``)
and Mosaic TPU (scalar-prefetched ids, row DMAs; ``_gather_attention_tpu``). ``interpret=True`` runs
the target's kernel in its interpreter on the CPU (simulated shared memory / VMEM, copies / DMAs,
barriers / semaphores); tests/kernels checks each there against the reference and lowers each for
abstract devices of its target (H200; A100 and L40; TPU v5e and v6e). Compiling those modules and
running them on a device is unverified (tests/kernels/test_devices.py, tools/gpu_check.sh).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from ess_jax.pallas_kernels.row_layout import (KNOBS, check_float, check_ids, check_knobs, check_mla_queries,
                                               check_rank, check_words_target, is_words, plain_layout)
from ess_jax.pallas_kernels.target import gather_attention

if TYPE_CHECKING:
    from ess_jax.pallas_kernels.target import Interpret


def _check(q_latent_BTNC, q_rope_BTNR, pool_PW, ids_BTK, target: str | None):
    """The inputs of ``target``'s kernel (``None``: the reference's); returns ``(C, R)``."""
    b, t, _, c, r = check_mla_queries(q_latent_BTNC, q_rope_BTNR)
    check_rank("pool_PW", pool_PW, 2, "[P, W = C + R]")
    check_words_target("pool_PW", pool_PW, target)
    if is_words(pool_PW):
        if 2 * pool_PW.shape[1] != c + r:
            raise ValueError(f"pool_PW as words must be u32[P, (C + R) / 2] (bf16 pairs) with C + R = {c} + {r}, "
                             f"got {pool_PW.shape}")
    elif pool_PW.shape[1] != c + r:
        raise ValueError(f"pool_PW must be [P, W] with W = C + R = {c} + {r}, got {pool_PW.shape}")
    if pool_PW.shape[0] < 1:
        raise ValueError(f"pool_PW must hold at least one row, got {pool_PW.shape}")
    check_ids("ids_BTK", ids_BTK, b, t)
    if not is_words(pool_PW):
        check_float("pool_PW", pool_PW)
    return c, r


@functools.partial(jax.jit, static_argnames=("scale", *KNOBS))
def sparse_mla(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, pool_PW: jax.Array, ids_BTK: jax.Array, *,
               scale: float, block_k: int = 64, num_splits: int | None = None, target: str = "mosaic_gpu",
               interpret: Interpret = False) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA over the pool rows at ``ids_BTK`` (-1 = none). Returns ``(out f32[B, T, N, C],
    lse f32[B, T, N])``.

    Knobs: ``block_k`` ids per step (a multiple of 64 up to 256; on GPUs heads go 64 to a program,
    padded up to a multiple of 64); ``num_splits`` programs per query, each over every S-th of its
    valid ids, merged exactly by log-sum-exp (split-K for small batches; ``None``: about two programs
    per SM on a GPU, 1 elsewhere); ``target`` the compiler the kernel is built for
    (``ess_jax.pallas_kernels.target``: ``"mosaic_gpu"`` Hopper / Blackwell, ``"mosaic_gpu_sm80"``
    Ampere / Ada, ``"mosaic_tpu"`` TPU); ``interpret`` (``True`` or the target interpreter's params,
    ``plgpu.InterpretGPUParams`` / ``pltpu.InterpretParams``) runs the kernel in that interpreter
    instead of compiling it (the only way it runs on a CPU).

    ``pool_PW``: float rows ``[P, C + R]``, or for ``target="mosaic_tpu"`` bf16 rows as 32-bit words
    ``u32[P, (C + R) / 2]`` (``row_layout.as_words``: the form that kernel reads; bf16 rows given to it
    are viewed as words by a relayout copy of the whole pool on every call).
    """
    c, r = _check(q_latent_BTNC, q_rope_BTNR, pool_PW, ids_BTK, target)
    check_knobs(block_k=block_k, num_splits=num_splits, target=target)
    dtype = jnp.bfloat16 if is_words(pool_PW) else pool_PW.dtype
    return gather_attention(q_latent_BTNC, q_rope_BTNR if r else None, [(pool_PW, ids_BTK)], None,
                            layout=plain_layout(c, r, dtype), scale=scale, block_k=block_k,
                            num_splits=num_splits, target=target, interpret=interpret, name="sparse_mla")


def absorbed_mla_reference(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, rows_BTKW: jax.Array, valid_BTK: jax.Array,
                           scale: float, *, precision: jax.lax.Precision | None = jax.lax.Precision.HIGHEST
                           ) -> tuple[jax.Array, jax.Array]:
    """The math of ``sparse_mla`` on gathered float32 rows ``[B, T, K, C + R]`` (zero where invalid):
    mask, softmax in float32. ``precision``: of the einsums (``None``: JAX's default matmul precision,
    the XLA path of ``ess_jax.ops.sparse_mla``)."""
    c = q_latent_BTNC.shape[-1]
    latent_BTKC, rope_BTKR = rows_BTKW[..., :c], rows_BTKW[..., c:]
    logits_BTNK = (jnp.einsum("btnc,btkc->btnk", q_latent_BTNC.astype(jnp.float32), latent_BTKC, precision=precision)
                   + jnp.einsum("btnr,btkr->btnk", q_rope_BTNR.astype(jnp.float32), rope_BTKR, precision=precision)
                   ) * scale
    logits_BTNK = jnp.where(valid_BTK[:, :, None, :], logits_BTNK, -jnp.inf)
    lse_BTN = jax.nn.logsumexp(logits_BTNK, axis=-1)
    safe_lse_BTN = jnp.where(jnp.isfinite(lse_BTN), lse_BTN, 0.0)
    probs_BTNK = jnp.exp(logits_BTNK - safe_lse_BTN[..., None])
    return jnp.einsum("btnk,btkc->btnc", probs_BTNK, latent_BTKC, precision=precision), lse_BTN


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_mla_reference(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, pool_PW: jax.Array, ids_BTK: jax.Array,
                         *, scale: float) -> tuple[jax.Array, jax.Array]:
    """``sparse_mla`` in plain jnp: gather (zero where invalid), then ``absorbed_mla_reference``."""
    _check(q_latent_BTNC, q_rope_BTNR, pool_PW, ids_BTK, None)
    valid_BTK = ids_BTK >= 0
    rows_BTKW = pool_PW[jnp.where(valid_BTK, ids_BTK, 0)].astype(jnp.float32)
    rows_BTKW = jnp.where(valid_BTK[..., None], rows_BTKW, 0.0)
    return absorbed_mla_reference(q_latent_BTNC, q_rope_BTNR, rows_BTKW, valid_BTK, scale)

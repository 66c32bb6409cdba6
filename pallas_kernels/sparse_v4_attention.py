"""DeepSeek-V4 decode attention over the sliding window plus compressed entries, with the per-head
sink in the denominator (DOMAIN.md 2.5), fused with the gather of both.

Every row is both key and value (V4 shares one K = V head of width ``H``). For each (request b,
query token t, head n) the kernel reads the window rows at ``window_ids_BTK[b, t]`` and the
compressed entries at ``entry_ids_BTK[b, t]`` (CSA: the indexer's picks; HCA: every visible entry)
straight from their pools and computes, over the union ``J`` of both row sets,

    s_j  = scale * q[b, t, n] . row_j
    out  = sum_j exp(s_j) row_j / (sum_j exp(s_j) + exp(sinks[n]))          f32[B, T, N, H]
    lse  = log(sum_j exp(s_j) + exp(sinks[n]))                               f32[B, T, N]

the semantics of ``ess_jax.ops.sparse_sink_attention`` on the gathered rows. Pass ``sinks_N = -inf``
for a plain partial result over a subset of rows; such (out, lse) pairs merge exactly by
log-sum-exp. Sliding-window-only layers pass ``entries_MH = entry_ids_BTK = None``.

**Pools and ids** (as in ``sparse_mla``): each pool is one flat row array shared by the batch and
the ids are global row ids into it, -1 = no row. The model's window ring plus this step's keys
``[B, S, H]`` -> ``reshape(B * S, H)`` with ids ``b * S + slot``; its entries ``[B, M, H]`` ->
``reshape(B * M, H)`` with ids ``b * M + entry``.

**Sentinels.** Ids ``< 0`` are skipped, whatever the pool holds. A query with no valid row returns
``out = 0`` and ``lse = sinks[n]`` (``-inf`` for a ``-inf`` sink).

**Lowering and targets** as ``sparse_mla`` (the ``target`` knob), unverified on a device. The window
and entry pools of one call must share a dtype (the kernel reads both through one row layout).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from ess_jax.pallas_kernels.row_layout import (KNOBS, check_float, check_ids, check_knobs, check_rank,
                                               check_words_target, is_words, plain_layout)
from ess_jax.pallas_kernels.target import gather_attention

if TYPE_CHECKING:
    from ess_jax.pallas_kernels.target import Interpret


def check_v4_inputs(q_BTNH, window_PX, window_ids_BTK, entries_MX, entry_ids_BTK, sinks_N, *,
                    row_width: int | None, pool_names: tuple[str, str], target: str | None):
    """Shared by the float and FP8 wrappers: float pools of width H (``row_width=None``) or uint8
    pools of ``row_width`` bytes, or (``target="mosaic_tpu"``) either as 32-bit words (bf16 pairs /
    bytes: ``u32[rows, 2H / 4]`` / ``u32[rows, row_width / 4]``). ``target=None``: the reference's
    inputs. Returns the sources ``[(pool, ids), ...]`` that select rows."""
    check_rank("q_BTNH", q_BTNH, 4, "[B, T, N, H]")
    check_float("q_BTNH", q_BTNH)
    b, t, n, h = q_BTNH.shape
    float_pools = row_width is None
    row_width = h if float_pools else row_width
    row_bytes = 2 * h if float_pools else row_width  # of the bf16 / byte rows that words hold
    check_rank("sinks_N", sinks_N, 1, "[N]")
    if sinks_N.shape != (n,):
        raise ValueError(f"sinks_N must be [N] with N = {n} query heads, got {sinks_N.shape}")
    if (entries_MX is None) != (entry_ids_BTK is None):
        raise ValueError("entries_MX and entry_ids_BTK go together: pass both, or both None for a window-only layer")
    sources = [(pool_names[0], window_PX, "window_ids_BTK", window_ids_BTK)]
    if entries_MX is not None:
        sources.append((pool_names[1], entries_MX, "entry_ids_BTK", entry_ids_BTK))
    out = []
    for pool_name, pool, ids_name, ids in sources:
        check_rank(pool_name, pool, 2, f"[rows, {row_width}]")
        check_words_target(pool_name, pool, target)
        if is_words(pool):
            if 4 * pool.shape[1] != row_bytes or pool.shape[0] < 1:
                raise ValueError(f"{pool_name} as words must be u32[rows >= 1, {row_bytes} / 4] ({row_bytes}-byte "
                                 f"{'bf16' if float_pools else 'FP8'} rows), got {pool.shape}")
        else:
            if pool.shape[1] != row_width or pool.shape[0] < 1:
                raise ValueError(f"{pool_name} must be [rows >= 1, {row_width}], got {pool.shape}")
            if float_pools:
                check_float(pool_name, pool)
            elif pool.dtype != jnp.uint8:
                raise ValueError(f"{pool_name} must hold uint8 FP8 rows, got dtype {pool.dtype}")
        check_ids(ids_name, ids, b, t)
        if ids.shape[2] > 0:  # an empty selection contributes nothing
            out.append((pool, ids))
    if not out:
        raise ValueError(f"window_ids_BTK selects no rows (K = 0); got {window_ids_BTK.shape}")
    if entries_MX is not None and entries_MX.dtype != window_PX.dtype:
        raise ValueError(f"{pool_names[0]} and {pool_names[1]} must share a dtype, got {window_PX.dtype} and "
                         f"{entries_MX.dtype}")
    return out


@functools.partial(jax.jit, static_argnames=("scale", *KNOBS))
def sparse_v4_attention(q_BTNH: jax.Array, window_PH: jax.Array, window_ids_BTK: jax.Array,
                        entries_MH: jax.Array | None, entry_ids_BTK: jax.Array | None, sinks_N: jax.Array, *,
                        scale: float, block_k: int = 64, num_splits: int | None = None, target: str = "mosaic_gpu",
                        interpret: Interpret = False) -> tuple[jax.Array, jax.Array]:
    """V4 attention over window rows + compressed entries with a sink. Returns ``(out f32[B, T, N, H],
    lse f32[B, T, N])``. Knobs as ``sparse_mla``; pools float ``[rows, H]``, or for ``target="mosaic_tpu"``
    bf16 rows as words ``u32[rows, H / 2]`` (``row_layout.as_words``, as ``sparse_mla``'s pool)."""
    sources = check_v4_inputs(q_BTNH, window_PH, window_ids_BTK, entries_MH, entry_ids_BTK, sinks_N,
                              row_width=None, pool_names=("window_PH", "entries_MH"), target=target)
    check_knobs(block_k=block_k, num_splits=num_splits, target=target)
    dtype = jnp.bfloat16 if is_words(window_PH) else window_PH.dtype  # the entries share its dtype (checked)
    layout = plain_layout(q_BTNH.shape[-1], 0, dtype)
    return gather_attention(q_BTNH, None, sources, sinks_N, layout=layout, scale=scale, block_k=block_k,
                            num_splits=num_splits, target=target, interpret=interpret, name="sparse_v4_attention")


def attention_with_sink_reference(q_BTNH, rows_BTKH, valid_BTK, sinks_N, scale, *,
                                  precision: jax.lax.Precision | None = jax.lax.Precision.HIGHEST):
    """The math of ``sparse_v4_attention`` on gathered float32 rows (zero where invalid). ``precision``:
    of the einsums (``None``: JAX's default matmul precision, the XLA path of
    ``ess_jax.ops.sparse_sink_attention``)."""
    logits_BTNK = jnp.einsum("btnh,btkh->btnk", q_BTNH.astype(jnp.float32), rows_BTKH, precision=precision) * scale
    logits_BTNK = jnp.where(valid_BTK[:, :, None, :], logits_BTNK, -jnp.inf)
    sink_BTN = jnp.broadcast_to(sinks_N.astype(jnp.float32), logits_BTNK.shape[:-1])
    lse_BTN = jnp.logaddexp(jax.nn.logsumexp(logits_BTNK, axis=-1), sink_BTN)
    safe_lse_BTN = jnp.where(jnp.isfinite(lse_BTN), lse_BTN, 0.0)
    probs_BTNK = jnp.exp(logits_BTNK - safe_lse_BTN[..., None])
    return jnp.einsum("btnk,btkh->btnh", probs_BTNK, rows_BTKH, precision=precision), lse_BTN


def gather_rows_reference(pool_PX, ids_BTK, decode=lambda rows: rows):
    """Rows at ``ids_BTK`` as float32 (``decode`` turns stored rows into values), zero where id < 0."""
    valid_BTK = ids_BTK >= 0
    rows = decode(pool_PX[jnp.where(valid_BTK, ids_BTK, 0)]).astype(jnp.float32)
    return jnp.where(valid_BTK[..., None], rows, 0.0), valid_BTK


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_v4_attention_reference(q_BTNH: jax.Array, window_PH: jax.Array, window_ids_BTK: jax.Array,
                                  entries_MH: jax.Array | None, entry_ids_BTK: jax.Array | None, sinks_N: jax.Array,
                                  *, scale: float) -> tuple[jax.Array, jax.Array]:
    """``sparse_v4_attention`` in plain jnp: gather both row sets, concatenate, softmax with the sink."""
    sources = check_v4_inputs(q_BTNH, window_PH, window_ids_BTK, entries_MH, entry_ids_BTK, sinks_N,
                              row_width=None, pool_names=("window_PH", "entries_MH"), target=None)
    gathered = [gather_rows_reference(pool, ids) for pool, ids in sources]
    rows_BTKH = jnp.concatenate([r for r, _ in gathered], axis=2)
    valid_BTK = jnp.concatenate([v for _, v in gathered], axis=2)
    return attention_with_sink_reference(q_BTNH, rows_BTKH, valid_BTK, sinks_N, scale)

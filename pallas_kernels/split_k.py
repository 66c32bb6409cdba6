"""How the gather-attention kernels share one query's ids among programs (split-K), finish a
program's softmax and merge the programs' partial results: plain JAX, common to every target
(Mosaic GPU, Mosaic TPU).

Each query's ids are sorted so the valid ones (>= 0) come first, padded with -1 to ``S`` whole
parts of whole blocks, and dealt round-robin to the parts (id ``i`` to part ``i % S``), so a program
knows from the count of valid ids how many of its part's ids are valid (they come first) and skips
the blocks without any. The parts' ``(out, lse)`` pairs merge exactly by log-sum-exp, and a sink
joins the denominator once, after the merge.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def pad_axis(x, axis: int, size: int, value):
    """``x`` padded with ``value`` along ``axis`` up to ``size`` (at least its own size)."""
    pad = size - x.shape[axis]
    if pad <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def deal_ids(ids_BTK, splits: int, block_k: int):
    """``ids i32[B, T, K]`` -> ``(ids i32[B * T, S, Ks], valid count i32[B * T])``: each query's ids
    valid ones first, padded with -1 to S parts of whole ``block_k`` blocks, id i in part i % S."""
    b, t, k = ids_BTK.shape
    ids = ids_BTK.astype(jnp.int32).reshape(b * t, k)
    count = jnp.sum(ids >= 0, axis=-1, dtype=jnp.int32)
    ids = pad_axis(jnp.flip(jnp.sort(ids, axis=-1), axis=-1), 1, round_up(k, splits * block_k), -1)
    return ids.reshape(b * t, ids.shape[-1] // splits, splits).transpose(0, 2, 1), count


def finish_softmax(m, l, sink):
    """A program's epilogue, every target's: from the running max ``m`` and sum ``l`` of its heads
    (``l = 0``: nothing seen) and an optional per-head sink logit joining the denominator, ``(lse, w)``
    with ``lse = log(denominator)`` (``-inf`` when empty) and ``w = exp(m - lse)``, so that ``out = acc * w``
    (0 when nothing was seen)."""
    seen = l > 0
    m_seen = jnp.where(seen, m, 0.0)
    lse = jnp.where(seen, m_seen + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    if sink is not None:
        top = jnp.maximum(lse, sink)
        top_safe = jnp.where(top == -jnp.inf, 0.0, top)
        lse = top_safe + jnp.log(jnp.exp(lse - top_safe) + jnp.exp(sink - top_safe))
    return lse, jnp.where(seen, jnp.exp(m_seen - jnp.where(seen, lse, 0.0)), 0.0)


def merge_splits(out_BTSNC, lse_BTSN, sinks_N):
    """Exact log-sum-exp merge of the S partial results, then the sink (if any) in the denominator."""
    top_BTN = jnp.max(lse_BTSN, axis=2)
    top_BTN = jnp.where(jnp.isfinite(top_BTN), top_BTN, 0.0)
    weight_BTSN = jnp.exp(lse_BTSN - top_BTN[:, :, None])  # 0 for empty parts
    total_BTN = jnp.sum(weight_BTSN, axis=2)
    lse_BTN = jnp.where(total_BTN > 0, top_BTN + jnp.log(jnp.where(total_BTN > 0, total_BTN, 1.0)), -jnp.inf)
    out_BTNC = jnp.einsum("btsn,btsnc->btnc", weight_BTSN / jnp.where(total_BTN > 0, total_BTN, 1.0)[:, :, None],
                          out_BTSNC, precision=lax.Precision.HIGHEST)
    if sinks_N is None:
        return out_BTNC, lse_BTN
    with_sink_BTN = jnp.logaddexp(lse_BTN, sinks_N.astype(jnp.float32))
    keep_BTN = jnp.where(jnp.isfinite(lse_BTN), jnp.exp(lse_BTN - jnp.where(jnp.isfinite(with_sink_BTN),
                                                                             with_sink_BTN, 0.0)), 0.0)
    return out_BTNC * keep_BTN[..., None], with_sink_BTN

"""DeepSeek-V4 KV compressors and the CSA lightning indexer (DOMAIN.md 2.4, 2.5).

A compressor turns every ``m`` tokens (one window) into one entry of width ``D`` by per-channel gated
softmax pooling:

    a_j = W_kv x_j,   z_j = W_gate x_j + B[j mod m]          (B: ``position_bias [m, coff*D]``)
    C_e[ch] = sum_j softmax_j(z_j[ch]) a_j[ch]               then kv_norm, RoPE at position e*m

- HCA (``overlap=False``, coff 1): entry ``e`` pools window ``e`` (tokens ``e*m .. e*m+m-1``).
- CSA and its indexer (``overlap=True``, coff 2): the projections are ``2D`` wide. Entry ``e`` pools 2m
  slots: window ``e-1``'s first halves ``[:D]`` and window ``e``'s second halves ``[D:]``; for ``e = 0``
  the previous-window slots have logit -inf and value 0.

Query ``t`` sees entry ``e`` iff ``e < (t + 1) // m`` (the window is closed).

Two forms over the same parameters:
- ``__call__(x)``: every complete window of a whole sequence (the training / full-forward form);
- ``close(x, positions, ring_kv, ring_gate)``: appends ``T`` tokens to a request. The per-request state is
  a ring of the projections ``(a, W_gate x)`` of the last ``coff * m`` positions (slot ``s % (coff*m)``: the
  open window's pending tokens and, for CSA, the previous window's first halves), both in x's dtype; it
  returns the entries whose window closes during the step with their ids (the model writes them to its
  paged cache). The position bias is added when a window is pooled: ``float32(W_gate x) + B`` is the value
  DeepSeek's float32 ``score_state`` holds, and ``a`` the value its float32 ``kv_state`` holds (a projection
  in bfloat16 converts exactly), so the ring keeps the official numerics in x's dtype (half the bytes in
  bfloat16).
Both give the same entries for any split of a sequence into steps.

Axis letters: ess_jax.notation (``U`` pooling slots: m or 2m; ``Y`` projection width: coff * D).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.config import RopeConfig
from ess_jax.pallas_kernels import fp8_rows
from ess_jax.models.layers import (Linear, RMSNorm, apply_rope_interleaved, index_scores, rope_cos_sin,
                                   rope_inv_freq)


@dataclasses.dataclass(frozen=True)
class TailRope:
    """Interleaved RoPE (pairs ``(2i, 2i+1)``) on the trailing ``dim`` channels of a vector (DOMAIN 2.3)."""

    rope: RopeConfig
    dim: int

    def cos_sin(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin ``f32[..., dim/2]`` for integer positions ``[...]``."""
        inv_freq = rope_inv_freq(self.rope, self.dim)
        return rope_cos_sin(positions, inv_freq, self.rope.cos_sin_scale)

    def apply(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Rotate ``x[..., -dim:]``; cos/sin are ``[B, T, dim/2]`` and broadcast over axes between T and the last."""
        return jnp.concatenate([x[..., : -self.dim], apply_rope_interleaved(x[..., -self.dim:], cos, sin)], axis=-1)


class Compressor(nnx.Module):
    """``kv_proj``, ``gate_proj`` (``[coff*D, hidden]``), ``position_bias [m, coff*D]``, ``kv_norm [D]``."""

    def __init__(self, hidden: int, dim: int, rate: int, *, overlap: bool, rope: TailRope, eps: float, dtype,
                 rngs: nnx.Rngs):
        width = (2 if overlap else 1) * dim
        self.kv_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.position_bias = nnx.Param(jnp.zeros((rate, width), jnp.float32))
        self.kv_norm = RMSNorm(dim, eps, dtype=jnp.float32)
        self.dim, self.rate, self.overlap, self.rope = dim, rate, overlap, rope

    @property
    def ring_size(self) -> int:
        """Positions the step form keeps per request: the open window, plus the previous one for CSA."""
        return (2 if self.overlap else 1) * self.rate

    def project(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``a [B, T, Y]`` and the gate projection ``W_gate x [B, T, Y]`` (x's dtype): a ring's contents."""
        return self.kv_proj(x_BTD), self.gate_proj(x_BTD)

    def gate_logits(self, gate_BTY: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """``z = float32(W_gate x) + B[position % m]`` ``f32[B, T, Y]`` for the positions ``[B, T]``."""
        return gate_BTY.astype(jnp.float32) + self.position_bias[...][positions_BT % self.rate]

    def _slots(self, kv_BMUY: jax.Array, gate_BMUY: jax.Array) -> tuple[jax.Array, jax.Array]:
        """CSA: slots ``[:m]`` take the first halves (previous window), ``[m:]`` the second halves."""
        if not self.overlap:
            return kv_BMUY, gate_BMUY
        m, d = self.rate, self.dim
        kv = jnp.concatenate([kv_BMUY[:, :, :m, :d], kv_BMUY[:, :, m:, d:]], axis=2)
        gate = jnp.concatenate([gate_BMUY[:, :, :m, :d], gate_BMUY[:, :, m:, d:]], axis=2)
        return kv, gate

    def pool(self, kv_BMUD: jax.Array, gate_BMUD: jax.Array, entry_BM: jax.Array) -> jax.Array:
        """Softmax-pool the slots of each entry, kv_norm, RoPE at the window's first position ``[B, M, D]``."""
        weights = jax.nn.softmax(gate_BMUD, axis=2).astype(kv_BMUD.dtype)
        pooled_BMD = self.kv_norm(jnp.sum(kv_BMUD * weights, axis=2))
        cos, sin = self.rope.cos_sin(entry_BM * self.rate)
        return self.rope.apply(pooled_BMD, cos, sin)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        """Entries ``[B, T // m, D]`` of every complete window of a whole sequence."""
        b, t, _ = x_BTD.shape
        m, n = self.rate, t // self.rate
        if n == 0:
            return jnp.zeros((b, 0, self.dim), x_BTD.dtype)
        kv_BTY, gate_BTY = self.project(x_BTD)
        gate_BTY = self.gate_logits(gate_BTY, jnp.broadcast_to(jnp.arange(t), (b, t)))
        kv_BMUY = kv_BTY[:, : n * m].reshape(b, n, m, -1)
        gate_BMUY = gate_BTY[:, : n * m].reshape(b, n, m, -1)
        if self.overlap:  # prepend each window's predecessor; window -1 contributes nothing
            kv_BMUY = jnp.concatenate([jnp.pad(kv_BMUY[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))), kv_BMUY], axis=2)
            prev_gate = jnp.pad(gate_BMUY[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
            gate_BMUY = jnp.concatenate([prev_gate, gate_BMUY], axis=2)
        kv_BMUD, gate_BMUD = self._slots(kv_BMUY, gate_BMUY)
        return self.pool(kv_BMUD, gate_BMUD, jnp.broadcast_to(jnp.arange(n), (b, n)))

    def close(self, x_BTD: jax.Array, positions_BT: jax.Array, ring_kv_BUY: jax.Array, ring_gate_BUY: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        """Append ``T`` tokens at ``positions_BT`` (consecutive per request, starting at ``p0``) to the
        rings. Returns the candidate entries ``new [B, M, D]`` with their ids ``entry i32[B, M]`` and
        ``closes bool[B, M]`` (whether the window closed in this step; M = ceil(T / m)) and the rings."""
        b, t, _ = x_BTD.shape
        m, ring = self.rate, self.ring_size
        kv_BTY, gate_BTY = self.project(x_BTD)
        p0_B = positions_BT[:, 0]
        # Entries whose last token lies in [p0, p0 + T): at most ceil(T / m) of them per request.
        entry_BM = p0_B[:, None] // m + jnp.arange(-(-t // m))[None, :]
        closes_BM = (entry_BM + 1) * m <= (p0_B + t)[:, None]
        first_BM = entry_BM * m - (m if self.overlap else 0)
        src_BMU = first_BM[..., None] + jnp.arange(ring)  # source positions of each entry's slots
        flat = src_BMU.reshape(b, -1)
        from_new = flat >= p0_B[:, None]
        new_idx = jnp.clip(flat - p0_B[:, None], 0, t - 1)[..., None]
        ring_idx = (flat % ring)[..., None]
        kv = jnp.where(from_new[..., None], jnp.take_along_axis(kv_BTY, new_idx, axis=1),
                       jnp.take_along_axis(ring_kv_BUY, ring_idx, axis=1).astype(kv_BTY.dtype))
        gate = jnp.where(from_new[..., None], jnp.take_along_axis(gate_BTY, new_idx, axis=1),
                         jnp.take_along_axis(ring_gate_BUY, ring_idx, axis=1).astype(gate_BTY.dtype))
        gate = self.gate_logits(gate, jnp.maximum(flat, 0))
        before_start = (flat < 0)[..., None]  # the window before entry 0
        kv = jnp.where(before_start, jnp.zeros_like(kv), kv).reshape(src_BMU.shape + kv.shape[-1:])
        gate = jnp.where(before_start, -jnp.inf, gate).reshape(src_BMU.shape + gate.shape[-1:])
        new_BMD = self.pool(*self._slots(kv, gate), entry_BM)
        # Only the last `ring` new tokens reach the ring (earlier ones would collide on a slot).
        batch_B1 = jnp.arange(b)[:, None]
        slot_BT = jnp.where(jnp.arange(t)[None, :] >= t - ring, positions_BT % ring, ring)
        ring_kv_BUY = ring_kv_BUY.at[batch_B1, slot_BT].set(kv_BTY.astype(ring_kv_BUY.dtype), mode="drop")
        ring_gate_BUY = ring_gate_BUY.at[batch_B1, slot_BT].set(gate_BTY.astype(ring_gate_BUY.dtype), mode="drop")
        return new_BMD, entry_BM, closes_BM, ring_kv_BUY, ring_gate_BUY


class IndexerScorer(nnx.Module):
    """``weights_proj [I, hidden]``: the per-head weights of the index score."""

    def __init__(self, hidden: int, n_heads: int, *, dtype, rngs: nnx.Rngs):
        self.weights_proj = Linear(hidden, n_heads, dtype=dtype, rngs=rngs)


def hadamard(x: jax.Array) -> jax.Array:
    """The normalized Walsh-Hadamard rotation ``x H / sqrt(n)`` of the last axis (``n`` a power of two; ``H`` in
    Sylvester's order, DeepSeek's ``rotate_activation``), in float32, returned in x's dtype."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST) * n**-0.5).astype(x.dtype)


class Indexer(Compressor):
    """The CSA lightning indexer: its own overlapping compressor at ``index_head_dim`` (J) for the keys,
    ``q_b_proj [I*J, q_lora_rank]`` for the queries (from the attention's q-LoRA residual) and the scorer.

        I_t,e = sum_h w_t,h * J^-1/2 * ReLU(q_t,h . K_e) * I^-1/2,     w_t = weights_proj x_t

    With FP4 keys (``fp4=True``: the official QAT path, DeepSeek-V4's ``Indexer``) the keys are stored rotated
    (``hadamard`` after kv_norm and RoPE) and FP4 (``fp8_rows.quantize_fp4_keys``), and the queries get the same
    rotation after their RoPE and the FP4 round trip (e2m1 with a ue8m0 scale per 32, dequantized): the rotation
    is orthogonal, so it changes the scores only through the quantization it spreads.
    """

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, rate: int, top_k: int, *,
                 rope: TailRope, eps: float, dtype, rngs: nnx.Rngs):
        super().__init__(hidden, head_dim, rate, overlap=True, rope=rope, eps=eps, dtype=dtype, rngs=rngs)
        self.q_b_proj = Linear(q_lora_rank, n_heads * head_dim, dtype=dtype, rngs=rngs)
        self.scorer = IndexerScorer(hidden, n_heads, dtype=dtype, rngs=rngs)
        self.n_heads, self.top_k = n_heads, top_k

    def scores(self, x_BTD: jax.Array, q_resid_BTQ: jax.Array, keys_BMJ: jax.Array, visible_BTM: jax.Array,
               cos: jax.Array, sin: jax.Array, *, fp4: bool = False) -> jax.Array:
        """Index scores ``f32[B, T, M]`` (``layers.index_scores``); -inf where ``visible_BTM`` is False.
        cos/sin: the query positions'. ``fp4``: ``keys_BMJ`` are dequantized FP4 keys (rotated), and the queries
        take the official round trip (rotation, FP4)."""
        b, t, _ = x_BTD.shape
        q_BTIJ = self.rope.apply(self.q_b_proj(q_resid_BTQ).reshape(b, t, self.n_heads, self.dim), cos, sin)
        if fp4:
            q_BTIJ = fp8_rows.dequantize_fp4_keys(fp8_rows.quantize_fp4_keys(hadamard(q_BTIJ)), width=self.dim,
                                                  dtype=q_BTIJ.dtype)
        return index_scores(q_BTIJ, keys_BMJ, self.scorer.weights_proj(x_BTD), visible_BTM)


class CSACompressor(Compressor):
    """The CSA main compressor (D = head_dim, overlapping windows) with its ``indexer`` child."""

    def __init__(self, hidden: int, head_dim: int, rate: int, *, indexer: Indexer, rope: TailRope, eps: float,
                 dtype, rngs: nnx.Rngs):
        super().__init__(hidden, head_dim, rate, overlap=True, rope=rope, eps=eps, dtype=dtype, rngs=rngs)
        self.indexer = indexer


def visible_entries(positions_BT: jax.Array, n_entries: int, rate: int) -> jax.Array:
    """``bool[B, T, M]``: query ``t`` sees entry ``e`` iff ``e < (t + 1) // rate``."""
    return np.arange(n_entries)[None, None, :] < ((positions_BT + 1) // rate)[..., None]

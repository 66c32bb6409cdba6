"""Weights in the quantized formats of DeepSeek's releases, dequantized where a module reads them.

A parameter loaded with ``weights="release"`` holds one of these values in place of an array, in the
checkpoint's own bytes. Modules read it as any parameter, ``variable[...]``, and get the dequantized
weight in the model's dtype, computed there: inside the jitted step, one layer's weights at a time, so
the model is never held dequantized as a whole. ``.shape`` and ``.dtype`` are the dequantized weight's.

- ``Fp8Blocks``: FP8 (e4m3) values ``V [..., out, in]`` with one scale per ``(bo, bi)`` block, ``S [...,
  ceil(out / bo), ceil(in / bi)]`` (DeepSeek's 128 x 128 blocks; float32 scales in V3.2, ue8m0 in V4):
  ``W[i, j] = V[i, j] * S[i // bo, j // bi]``. ``parts`` matrices may be stacked along ``out``, each
  tiled from its own first row (a packed ``gate_up_proj``: gate and up, each with its own scales).
- ``Fp4Values``: FP4 (e2m1) values, two a byte, the low nibble first, ``P [..., out, in / 2]`` (int8 or
  uint8), with one ue8m0 scale per 32 values of a row, ``S [..., out, in / 32]`` (V4's routed experts):
  ``W[i, j] = e2m1(nibble j of row i) * S[i, j // 32]``.

The dequantization is written once, in ``dequantize_fp8_blocks`` / ``dequantize_fp4``; the checkpoint
loader uses the same values to dequantize at load (``weights="dequantized"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

FP4_GROUP = 32  # values per ue8m0 scale of a row of FP4 values


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


def dequantize_fp8_blocks(values: jax.Array, scales: jax.Array, block: tuple[int, int], parts: int = 1) -> jax.Array:
    """``W[..., i, j] = V[..., i, j] * S[..., i // bo, j // bi]`` in float32, for each of ``parts`` matrices
    stacked along ``i`` (values and scales split into ``parts`` equal row ranges)."""
    *lead, out, inp = values.shape
    values = values.reshape(*lead, parts, out // parts, inp)
    scales = scales.reshape(*lead, parts, scales.shape[-2] // parts, scales.shape[-1]).astype(jnp.float32)
    expanded = jnp.repeat(jnp.repeat(scales, block[0], axis=-2), block[1], axis=-1)[..., :out // parts, :inp]
    return (values.astype(jnp.float32) * expanded).reshape(*lead, out, inp)


def dequantize_fp4(packed: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``W[..., i, 2k] = e2m1(P[..., i, k] & 15)``, ``W[..., i, 2k + 1] = e2m1(P[..., i, k] >> 4)``, times
    ``S[..., i, j // 32]``, computed in ``dtype``: exact in bfloat16 too (two significant bits times a power of two,
    bfloat16 having float32's exponents), so a model in bfloat16 never holds its experts in float32, twice the
    bytes (XLA:TPU keeps a layer's dequantized experts live at once)."""
    *lead, out, half = packed.shape
    codes = jax.lax.bitcast_convert_type(jnp.asarray(packed), jnp.uint8)
    values = jnp.stack([e2m1(codes & 15, dtype), e2m1(codes >> 4, dtype)], axis=-1).reshape(*lead, out, 2 * half)
    return values * jnp.repeat(scales.astype(dtype), FP4_GROUP, axis=-1)


def e2m1(code: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The e2m1 value of ``code`` (< 16: sign bit 3, exponent bits 2..1, mantissa bit 0; 0, 0.5, 1, 1.5, 2, 3, 4, 6
    and their negatives) in ``dtype``, computed elementwise rather than looked up: a table lookup is a gather whose
    int32 indices XLA:TPU materializes, the pair axis of the two nibbles padded to a lane tile (128 GiB of temporaries
    for V4-Flash's experts of two layers on ``expert=8``); arithmetic fuses into the dequantization."""
    exponent, mantissa = (code >> 1) & 3, (code & 1).astype(dtype)
    power = jnp.left_shift(jnp.uint8(1), exponent).astype(dtype)  # 2 ** exponent
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa, 0.5 * power * (1 + 0.5 * mantissa))
    return jnp.where(code >= 8, -magnitude, magnitude)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """FP8 values with block scales (module docstring); ``self[...]`` is the weight in ``dtype``."""

    values: jax.Array  # float8_e4m3fn [..., out, in]
    scales: jax.Array  # [..., parts * ceil(out / parts / bo), ceil(in / bi)]
    block: tuple[int, int] = _static()
    parts: int = _static()
    dtype: Any = _static()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def __getitem__(self, index) -> jax.Array:
        return dequantize_fp8_blocks(self.values, self.scales, self.block, self.parts).astype(self.dtype)[index]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Values:
    """Packed FP4 values with per-32 scales (module docstring); ``self[...]`` is the weight in ``dtype``."""

    packed: jax.Array  # int8 / uint8 [..., out, in / 2]
    scales: jax.Array  # float8_e8m0fnu [..., out, in / 32]
    dtype: Any = _static()

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, half = self.packed.shape
        return (*lead, 2 * half)

    def __getitem__(self, index) -> jax.Array:
        return dequantize_fp4(self.packed, self.scales, self.dtype)[index]


Quantized = Fp8Blocks | Fp4Values

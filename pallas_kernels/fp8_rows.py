"""FP8 cache rows (DOMAIN.md 3.1, 3.2): the byte formats, quantize / dequantize, and the sparse
attention kernels that read them directly (dequantizing in the kernel, chunk by chunk).

Rows are stored as ``uint8 [..., row_bytes]``; multi-byte fields are little-endian.

**V3.2 latent row** (FlashMLA's "fp8_ds_mla", SGLang / vLLM), 656 bytes for C = 512, R = 64::

    [0, C)                  C x e4m3fn       latent c, quantized per block of 128 values
    [C, C + 4*nb)           nb x float32     one scale per block, scale = amax(|block|) / 448
    [C + 4*nb, + 2*R)       R x bfloat16     k_rope, unquantized
    nb = ceil(C / 128);  mla_row_bytes(512, 64) = 512 + 16 + 128 = 656

Generalised to other widths (the tiny presets) by the same rule: C e4m3 bytes, ceil(C/128) float32
scales (the last block may be partial), R bf16 values; tiny-v32 (C = 64, R = 16) gives
64 + 4 + 32 = 100 bytes. Dequantize: ``e4m3 * scale``; a block of zeros has scale 0 and decodes to 0.

**V4 row** (FlashMLA's "MODEL1", SGLang's V4 pools: 584 bytes for H = 512, R = 64), stored 16-byte aligned::

    [0, D)                  D x e4m3fn       the non-rope dims, D = H - R, quantized per 64 values
    [D, D + 2*R)            R x bfloat16     the trailing rope dims, unquantized
    [D + 2*R, + nb)         nb x ue8m0       one power-of-two scale per block: byte e means 2**(e - 127)
    then zero bytes up to a multiple of 16 for the row
    nb = ceil(D / 64);  v4_row_bytes(512, 64) = 448 + 128 + 7 + 9 = 592

DeepSeek's release pads the scale field to a multiple of 8 bytes instead (``v4_release_row_bytes``: 448 + 128 +
7 + 1 = 584). The rows here carry 8 more zero bytes so that every row of a pool starts 16-byte aligned: a TMA copy
of a row (the Hopper kernel's) faults on any other address, and a kernel handed 584-byte rows would have to copy
the pool at a 592-byte stride on each call (the whole stacked pool of every CSA layer: 13.8 GiB on an H100 for
V4-Flash at 32K). The cost is 1.4 % of the entries' bytes.

The scale is the smallest power of two with ``amax / scale <= 448`` (``2 ** ceil(log2(amax / 448))``),
its exponent clamped to [-126, 127], so the byte is in [1, 254]. tiny-v4 (H = 64, R = 16):
48 + 32 + 1 + 15 = 96 bytes (the release's 88).

**FP4 indexer key** (DeepSeek-V4's QAT format for the CSA indexer keys), 68 bytes for J = 128::

    [0, J/2)                J/2 bytes        e2m1 codes, two per byte: value 2i in the low nibble, 2i+1 in the high
    [J/2, J/2 + J/32)       J/32 x ue8m0     one power-of-two scale per block of 32 values
    fp4_key_bytes(128) = 64 + 4 = 68;  tiny-v4 (J = 32): 16 + 1 = 17

As DeepSeek's ``fp4_act_quant`` with ue8m0 scales: ``amax`` of a block floored at ``6 * 2**-126``, the
scale ``2 ** ceil(log2(amax * (1/6)))`` (the exponent from the float's bits: exact at powers of two), the
values ``clip(x / scale, -6, 6)`` rounded to nearest-even on the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}
(a code is sign bit 8 | magnitude index 0-7). Dequantize: ``e2m1 * scale``.

Round-trip error (per element, scaled units ``y = x / scale``, ``|y| <= 448``): e4m3 keeps 3 mantissa
bits, so ``|y - e4m3(y)| <= 2**-4 |y|`` for normal values and ``<= 2**-10`` below 2**-6 (subnormals);
the rope slice is exact for bf16 inputs.

**Kernels.** ``sparse_mla_fp8`` is ``sparse_mla`` over a pool of V3.2 FP8 rows,
``sparse_v4_attention_fp8`` is ``sparse_v4_attention`` over pools of V4 FP8 rows; both dequantize
each gathered chunk in the kernel (e4m3 bytes bitcast to float8, times a scale assembled from its
bytes; the bf16 rope values assembled from byte pairs). Same sentinels, returns, targets and lowering status as
their float versions. The Hopper kernel copies each row with TMA, whose global address must be 16-byte
aligned: the 656- and 592-byte rows are; a pool of other rows (tiny-v32's 100 bytes) is copied at a padded
stride first (``_gather_attention``). The TPU kernel reads the rows as 32-bit words (every format here is a
whole number of words: 656 B = 164, 592 B = 148, 100 B = 25, 96 B = 24; ``row_layout.as_words``), one
row per DMA, and decodes them with 32-bit integer arithmetic.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from ess_jax.pallas_kernels.row_layout import (KNOBS, ROW_ALIGN, Chunk, RowLayout, check_float, check_ids,
                                               check_knobs, check_mla_queries, check_rank, check_words_target,
                                               is_words)
from ess_jax.pallas_kernels.sparse_mla import sparse_mla_reference
from ess_jax.pallas_kernels.sparse_v4_attention import check_v4_inputs, sparse_v4_attention_reference
from ess_jax.pallas_kernels.target import gather_attention

if TYPE_CHECKING:
    from ess_jax.pallas_kernels.target import Interpret

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP4_BLOCK = 32  # values per ue8m0 scale (V4's FP4 indexer keys)
MLA_BLOCK = 128  # values per float32 scale (V3.2)
V4_BLOCK = 64  # values per ue8m0 scale (V4)
V4_RELEASE_SCALE_ALIGN = 8  # DeepSeek's V4 rows pad their scale field to a multiple of this many bytes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def mla_row_bytes(latent_dim: int, rope_dim: int) -> int:
    """Bytes of one V3.2 FP8 row: 656 for (512, 64)."""
    return latent_dim + 4 * _ceil_div(latent_dim, MLA_BLOCK) + 2 * rope_dim


def v4_row_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one V4 FP8 row as stored here: 592 for (512, 64)."""
    fields = head_dim - rope_dim + 2 * rope_dim + _ceil_div(head_dim - rope_dim, V4_BLOCK)
    return _ceil_div(fields, ROW_ALIGN) * ROW_ALIGN


def v4_release_row_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one V4 FP8 row in DeepSeek's release (FlashMLA's "MODEL1"): 584 for (512, 64)."""
    nope = head_dim - rope_dim
    scales = _ceil_div(nope, V4_BLOCK)
    return nope + 2 * rope_dim + _ceil_div(scales, V4_RELEASE_SCALE_ALIGN) * V4_RELEASE_SCALE_ALIGN


def fp4_key_bytes(width: int) -> int:
    """Bytes of one FP4 indexer key of ``width`` values (a multiple of 32): 68 for 128."""
    return width // 2 + width // FP4_BLOCK


def mla_fp8_layout(latent_dim: int, rope_dim: int) -> RowLayout:
    """How the kernel reads a V3.2 FP8 row: e4m3 value chunks of 128 with float32 scales, bf16 rope key."""
    c, nb = latent_dim, _ceil_div(latent_dim, MLA_BLOCK)
    values = tuple(Chunk(MLA_BLOCK * i, min(MLA_BLOCK, c - MLA_BLOCK * i), MLA_BLOCK * i, "e4m3", c + 4 * i, "f32")
                   for i in range(nb))
    keys = (Chunk(0, rope_dim, c + 4 * nb, "bf16"),) if rope_dim else ()
    return RowLayout(values, keys, mla_row_bytes(latent_dim, rope_dim), "uint8")


def v4_fp8_layout(head_dim: int, rope_dim: int) -> RowLayout:
    """How the kernel reads a V4 FP8 row: e4m3 chunks of 64 with ue8m0 scales, then the bf16 rope dims
    (all of them values: V4's K = V)."""
    nope = head_dim - rope_dim
    scale_at = nope + 2 * rope_dim
    values = tuple(Chunk(V4_BLOCK * i, min(V4_BLOCK, nope - V4_BLOCK * i), V4_BLOCK * i, "e4m3", scale_at + i, "e8m0")
                   for i in range(_ceil_div(nope, V4_BLOCK)))
    if rope_dim:
        values += (Chunk(nope, rope_dim, nope, "bf16"),)
    return RowLayout(values, (), v4_row_bytes(head_dim, rope_dim), "uint8")


# ---- quantize / dequantize ------------------------------------------------------------------------


def _blocks(x, block: int):
    """``[..., D]`` -> ``[..., ceil(D / block), block]``, zero-padded."""
    d = x.shape[-1]
    nb = _ceil_div(d, block)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - d)])
    return x.reshape(*x.shape[:-1], nb, block)


def _to_e4m3_bytes(y_blocked, d: int):
    """Scaled values ``[..., nb, block]`` (``|y| <= 448``) -> e4m3 bytes ``u8[..., d]``."""
    q = jnp.clip(y_blocked, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    q = lax.bitcast_convert_type(q, jnp.uint8)
    return q.reshape(*q.shape[:-2], -1)[..., :d]


def _from_e4m3_bytes(b, scale_nb, block: int):
    """e4m3 bytes ``u8[..., d]`` times per-block scales ``f32[..., nb]`` -> ``f32[..., d]``."""
    d = b.shape[-1]
    y = _blocks(lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32), block)
    x = y * scale_nb[..., None]
    return x.reshape(*x.shape[:-2], -1)[..., :d]


def _bf16_bytes(x):
    """``[..., R]`` -> ``u8[..., 2R]`` (bf16, little-endian)."""
    b = lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint8)
    return b.reshape(*b.shape[:-2], -1)


def _from_bf16_bytes(b):
    """``u8[..., 2R]`` -> ``bf16[..., R]``."""
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 2), jnp.bfloat16)


def _check_rows(name: str, rows, min_width: int):
    if not hasattr(rows, "ndim") or rows.ndim < 1 or rows.shape[-1] < min_width:
        raise ValueError(f"{name} must be [..., >= {min_width}], got shape {getattr(rows, 'shape', None)}")


@functools.partial(jax.jit, static_argnames=("latent_dim",))
def quantize_mla_rows(rows_W: jax.Array, *, latent_dim: int) -> jax.Array:
    """V3.2 latent rows ``[..., C + R]`` (float) -> FP8 rows ``u8[..., mla_row_bytes(C, R)]``."""
    _check_rows("rows_W", rows_W, latent_dim)
    check_float("rows_W", rows_W)
    if latent_dim < 1:
        raise ValueError(f"latent_dim={latent_dim} must be >= 1")
    c = latent_dim
    latent = _blocks(rows_W[..., :c].astype(jnp.float32), MLA_BLOCK)  # [..., nb, 128]
    scale = jnp.max(jnp.abs(latent), axis=-1) / E4M3_MAX  # f32[..., nb]
    y = jnp.where(scale[..., None] > 0, latent / jnp.where(scale > 0, scale, 1.0)[..., None], 0.0)
    scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8)  # [..., nb, 4]
    return jnp.concatenate([_to_e4m3_bytes(y, c), scale_bytes.reshape(*scale.shape[:-1], -1),
                            _bf16_bytes(rows_W[..., c:])], axis=-1)


@functools.partial(jax.jit, static_argnames=("latent_dim", "rope_dim", "dtype"))
def dequantize_mla_rows(rows_X: jax.Array, *, latent_dim: int, rope_dim: int, dtype=jnp.float32) -> jax.Array:
    """FP8 rows ``u8[..., mla_row_bytes(C, R)]`` -> ``[..., C + R]`` of ``dtype``."""
    c, nb = latent_dim, _ceil_div(latent_dim, MLA_BLOCK)
    x = mla_row_bytes(latent_dim, rope_dim)
    if not hasattr(rows_X, "ndim") or rows_X.ndim < 1 or rows_X.shape[-1] != x or rows_X.dtype != jnp.uint8:
        raise ValueError(f"rows_X must be u8[..., {x}] (V3.2 FP8 rows for C={c}, R={rope_dim}), got "
                         f"{getattr(rows_X, 'dtype', None)}{list(getattr(rows_X, 'shape', ()))}")
    scale = lax.bitcast_convert_type(rows_X[..., c:c + 4 * nb].reshape(*rows_X.shape[:-1], nb, 4), jnp.float32)
    latent = _from_e4m3_bytes(rows_X[..., :c], scale, MLA_BLOCK)
    rope = _from_bf16_bytes(rows_X[..., c + 4 * nb:])
    return jnp.concatenate([latent.astype(dtype), rope.astype(dtype)], axis=-1)


@functools.partial(jax.jit, static_argnames=("rope_dim",))
def quantize_v4_rows(rows_H: jax.Array, *, rope_dim: int) -> jax.Array:
    """V4 rows ``[..., H]`` (rope on the trailing ``rope_dim``) -> ``u8[..., v4_row_bytes(H, R)]``."""
    _check_rows("rows_H", rows_H, rope_dim + 1)
    check_float("rows_H", rows_H)
    h = rows_H.shape[-1]
    nope = h - rope_dim
    x = _blocks(rows_H[..., :nope].astype(jnp.float32), V4_BLOCK)  # [..., nb, 64]
    ratio = jnp.max(jnp.abs(x), axis=-1) / E4M3_MAX
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(ratio))
    exponent = jnp.clip(jnp.where(ratio > 0, exponent, -126), -126, 127).astype(jnp.int32)
    y = x / jnp.ldexp(jnp.float32(1.0), exponent)[..., None]
    nb = ratio.shape[-1]
    scale_bytes = (exponent + 127).astype(jnp.uint8)
    pad = v4_row_bytes(h, rope_dim) - nope - 2 * rope_dim - nb
    return jnp.concatenate([_to_e4m3_bytes(y, nope), _bf16_bytes(rows_H[..., nope:]), scale_bytes,
                            jnp.zeros((*scale_bytes.shape[:-1], pad), jnp.uint8)], axis=-1)


@functools.partial(jax.jit, static_argnames=("head_dim", "rope_dim", "dtype"))
def dequantize_v4_rows(rows_X: jax.Array, *, head_dim: int, rope_dim: int, dtype=jnp.float32) -> jax.Array:
    """V4 FP8 rows ``u8[..., v4_row_bytes(H, R)]`` -> ``[..., H]`` of ``dtype``."""
    x = v4_row_bytes(head_dim, rope_dim)
    if not hasattr(rows_X, "ndim") or rows_X.ndim < 1 or rows_X.shape[-1] != x or rows_X.dtype != jnp.uint8:
        raise ValueError(f"rows_X must be u8[..., {x}] (V4 FP8 rows for H={head_dim}, R={rope_dim}), got "
                         f"{getattr(rows_X, 'dtype', None)}{list(getattr(rows_X, 'shape', ()))}")
    nope = head_dim - rope_dim
    nb = _ceil_div(nope, V4_BLOCK)
    scale_at = nope + 2 * rope_dim
    exponent = rows_X[..., scale_at:scale_at + nb].astype(jnp.uint32)
    scale = lax.bitcast_convert_type(exponent << 23, jnp.float32)  # 2 ** (e - 127), e in [1, 254]
    values = _from_e4m3_bytes(rows_X[..., :nope], scale, V4_BLOCK)
    rope = _from_bf16_bytes(rows_X[..., nope:scale_at])
    return jnp.concatenate([values.astype(dtype), rope.astype(dtype)], axis=-1)


def _check_fp4_width(name: str, width: int):
    if width < FP4_BLOCK or width % FP4_BLOCK:
        raise ValueError(f"{name}={width} must be a positive multiple of {FP4_BLOCK} (one ue8m0 scale per block)")


@jax.jit
def quantize_fp4_keys(keys_J: jax.Array) -> jax.Array:
    """Indexer keys ``[..., J]`` (float) -> FP4 keys ``u8[..., fp4_key_bytes(J)]``."""
    _check_rows("keys_J", keys_J, 1)
    check_float("keys_J", keys_J)
    j = keys_J.shape[-1]
    _check_fp4_width("J", j)
    x = _blocks(keys_J.astype(jnp.float32), FP4_BLOCK)  # [..., nb, 32]
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), E2M1_MAX * 2.0**-126) * jnp.float32(1 / E2M1_MAX)
    bits = lax.bitcast_convert_type(amax, jnp.uint32)  # ceil(log2(.)) from the exponent and mantissa bits
    exponent = (bits >> 23).astype(jnp.int32) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    y = jnp.clip(x / jnp.ldexp(jnp.float32(1.0), exponent)[..., None], -E2M1_MAX, E2M1_MAX)
    codes = lax.bitcast_convert_type(y.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
    codes = codes.reshape(*codes.shape[:-2], j // 2, 2)
    return jnp.concatenate([codes[..., 0] | (codes[..., 1] << 4), (exponent + 127).astype(jnp.uint8)], axis=-1)


@functools.partial(jax.jit, static_argnames=("width", "dtype"))
def dequantize_fp4_keys(rows_X: jax.Array, *, width: int, dtype=jnp.float32) -> jax.Array:
    """FP4 keys ``u8[..., fp4_key_bytes(J)]`` -> ``[..., J]`` of ``dtype``."""
    _check_fp4_width("width", width)
    x = fp4_key_bytes(width)
    if not hasattr(rows_X, "ndim") or rows_X.ndim < 1 or rows_X.shape[-1] != x or rows_X.dtype != jnp.uint8:
        raise ValueError(f"rows_X must be u8[..., {x}] (FP4 indexer keys of J={width}), got "
                         f"{getattr(rows_X, 'dtype', None)}{list(getattr(rows_X, 'shape', ()))}")
    packed = rows_X[..., :width // 2]
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).astype(jnp.uint4)  # [..., J/2, 2]
    values = lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).astype(jnp.float32)
    scale = lax.bitcast_convert_type(rows_X[..., width // 2:].astype(jnp.uint32) << 23, jnp.float32)  # 2 ** (e - 127)
    values = values.reshape(*values.shape[:-2], -1, FP4_BLOCK) * scale[..., None]
    return values.reshape(*values.shape[:-2], width).astype(dtype)


# ---- kernels over FP8 rows ------------------------------------------------------------------------


def _check_mla(q_latent_BTNC, q_rope_BTNR, pool_PX, ids_BTK, target: str | None):
    """The inputs of ``target``'s kernel (``None``: the reference's); returns ``(C, R)``."""
    b, t, _, c, r = check_mla_queries(q_latent_BTNC, q_rope_BTNR)
    check_rank("pool_PX", pool_PX, 2, "u8[P, row_bytes]")
    check_words_target("pool_PX", pool_PX, target)
    x = mla_row_bytes(c, r)
    if is_words(pool_PX):
        if 4 * pool_PX.shape[1] != x or pool_PX.shape[0] < 1:
            raise ValueError(f"pool_PX as words must be u32[P >= 1, {x} / 4] (V3.2 FP8 rows for C={c}, R={r}), "
                             f"got {list(pool_PX.shape)}")
    elif pool_PX.dtype != jnp.uint8 or pool_PX.shape[1] != x or pool_PX.shape[0] < 1:
        raise ValueError(f"pool_PX must be u8[P >= 1, {x}] (V3.2 FP8 rows for C={c}, R={r}), got "
                         f"{pool_PX.dtype}{list(pool_PX.shape)}")
    check_ids("ids_BTK", ids_BTK, b, t)
    return c, r


@functools.partial(jax.jit, static_argnames=("scale", *KNOBS))
def sparse_mla_fp8(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, pool_PX: jax.Array, ids_BTK: jax.Array, *,
                   scale: float, block_k: int = 64, num_splits: int | None = None, target: str = "mosaic_gpu",
                   interpret: Interpret = False) -> tuple[jax.Array, jax.Array]:
    """``sparse_mla`` over a pool of V3.2 FP8 rows ``u8[P, mla_row_bytes(C, R)]`` (or for
    ``target="mosaic_tpu"`` those rows as words ``u32[P, mla_row_bytes(C, R) / 4]``, ``row_layout.as_words``:
    the form that kernel reads; byte rows given to it are viewed as words by a relayout copy of the whole
    pool on every call), dequantized in the kernel. Returns ``(out f32[B, T, N, C], lse f32[B, T, N])``;
    ids, sentinels and knobs as ``sparse_mla``."""
    c, r = _check_mla(q_latent_BTNC, q_rope_BTNR, pool_PX, ids_BTK, target)
    check_knobs(block_k=block_k, num_splits=num_splits, target=target)
    return gather_attention(q_latent_BTNC, q_rope_BTNR if r else None, [(pool_PX, ids_BTK)], None,
                            layout=mla_fp8_layout(c, r), scale=scale, block_k=block_k,
                            num_splits=num_splits, target=target, interpret=interpret, name="sparse_mla_fp8")


@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_mla_fp8_reference(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, pool_PX: jax.Array,
                             ids_BTK: jax.Array, *, scale: float) -> tuple[jax.Array, jax.Array]:
    """``sparse_mla_fp8`` in plain jnp: dequantize the pool, then ``sparse_mla_reference``."""
    c, r = _check_mla(q_latent_BTNC, q_rope_BTNR, pool_PX, ids_BTK, None)
    return sparse_mla_reference(q_latent_BTNC, q_rope_BTNR, dequantize_mla_rows(pool_PX, latent_dim=c, rope_dim=r),
                                ids_BTK, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale", "rope_dim", *KNOBS))
def sparse_v4_attention_fp8(q_BTNH: jax.Array, window_PX: jax.Array, window_ids_BTK: jax.Array,
                            entries_MX: jax.Array | None, entry_ids_BTK: jax.Array | None, sinks_N: jax.Array, *,
                            scale: float, rope_dim: int, block_k: int = 64, num_splits: int | None = None,
                            target: str = "mosaic_gpu",
                            interpret: Interpret = False) -> tuple[jax.Array, jax.Array]:
    """``sparse_v4_attention`` over pools of V4 FP8 rows ``u8[rows, v4_row_bytes(H, rope_dim)]`` (or for
    ``target="mosaic_tpu"`` as words ``u32[rows, v4_row_bytes(H, rope_dim) / 4]``, as ``sparse_mla_fp8``),
    dequantized in the kernel. Returns ``(out f32[B, T, N, H], lse f32[B, T, N])``."""
    h = _v4_head_dim(q_BTNH, rope_dim)
    sources = check_v4_inputs(q_BTNH, window_PX, window_ids_BTK, entries_MX, entry_ids_BTK, sinks_N,
                              row_width=v4_row_bytes(h, rope_dim), pool_names=("window_PX", "entries_MX"),
                              target=target)
    check_knobs(block_k=block_k, num_splits=num_splits, target=target)
    return gather_attention(q_BTNH, None, sources, sinks_N, layout=v4_fp8_layout(h, rope_dim), scale=scale,
                            block_k=block_k, num_splits=num_splits, target=target, interpret=interpret,
                            name="sparse_v4_attention_fp8")


def _v4_head_dim(q_BTNH, rope_dim: int) -> int:
    check_rank("q_BTNH", q_BTNH, 4, "[B, T, N, H]")
    h = q_BTNH.shape[-1]
    if not 0 <= rope_dim < h:
        raise ValueError(f"rope_dim={rope_dim} must be in [0, H = {h})")
    return h


@functools.partial(jax.jit, static_argnames=("scale", "rope_dim"))
def sparse_v4_attention_fp8_reference(q_BTNH: jax.Array, window_PX: jax.Array, window_ids_BTK: jax.Array,
                                      entries_MX: jax.Array | None, entry_ids_BTK: jax.Array | None,
                                      sinks_N: jax.Array, *, scale: float,
                                      rope_dim: int) -> tuple[jax.Array, jax.Array]:
    """``sparse_v4_attention_fp8`` in plain jnp: dequantize the pools, then ``sparse_v4_attention_reference``."""
    h = _v4_head_dim(q_BTNH, rope_dim)
    check_v4_inputs(q_BTNH, window_PX, window_ids_BTK, entries_MX, entry_ids_BTK, sinks_N,
                    row_width=v4_row_bytes(h, rope_dim), pool_names=("window_PX", "entries_MX"), target=None)
    decode = lambda pool: None if pool is None else dequantize_v4_rows(pool, head_dim=h, rope_dim=rope_dim)
    return sparse_v4_attention_reference(q_BTNH, decode(window_PX), window_ids_BTK, decode(entries_MX),
                                         entry_ids_BTK, sinks_N, scale=scale)

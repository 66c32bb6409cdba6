"""Stored-row layouts and the input checks of the gather-attention kernels.

Everything here is plain JAX / Python: a ``RowLayout`` describes how a kernel reads one stored row
(``Chunk`` by chunk), so callers describe their formats (FP8 rows, ``ess_jax.pallas_kernels.fp8_rows``)
and check inputs without loading the Mosaic GPU toolchain, which ``_gather_attention`` loads.

**Word pools.** The ``mosaic_tpu`` kernels read every pool as rows of 32-bit elements: float32 rows as
they are, bf16 and byte rows as ``u32[P, row_bytes / 4]`` words (``as_words``; byte ``k`` of word ``j`` is
the row's byte ``4j + k``, so a bf16 pair's even column is the word's low half). A TPU packs two bf16 or
four uint8 rows into each 32-bit sublane word of a tile, so a one-row DMA at an arbitrary row exists only
for 32-bit rows. The wrappers take either form for ``target="mosaic_tpu"``; the GPU targets read the
rows in their own dtype and refuse words.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
from jax import lax

from ess_jax.pallas_kernels.target import check_target

KNOBS = ("block_k", "num_splits", "target", "interpret")
VALUE_CHUNK = 128  # columns per value chunk of a plain row: one wgmma N
MAX_COPY = 256  # elements per TMA copy at most (a TMA box dimension)
COPY_BYTES = 128  # a copy moves a multiple of this: each of the warpgroup's 128 threads arrives for 1/128
ROW_ALIGN = 16  # bytes: a TMA copy's global address must be a multiple of this (else the copy faults)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One slice of a stored row as the kernel reads it.

    ``column``/``width``: the logical columns it fills (of ``q_value``/``out`` for value chunks, of
    ``q_key`` for key chunks). ``start``: its first element of the stored row. ``kind``:
    ``"plain"`` (``width`` elements of the pool's float dtype), ``"e4m3"`` (``width`` bytes, each an
    e4m3fn value, times the chunk's scale) or ``"bf16"`` (``2 * width`` bytes, little-endian pairs).
    ``scale_start``/``scale_kind`` (e4m3 only): the byte offset of the scale and its format,
    ``"f32"`` (4 bytes, little-endian) or ``"e8m0"`` (one exponent byte ``e``: ``2 ** (e - 127)``).
    """

    column: int
    width: int
    start: int
    kind: str = "plain"
    scale_start: int = -1
    scale_kind: str = ""

    @property
    def tile_width(self) -> int:
        """Columns of its operand tiles: ``width`` rounded up to 16 (one bf16 wgmma K step)."""
        return -(-self.width // 16) * 16

    @property
    def raw_end(self) -> int:
        """One past the last element of the stored row its tiles read."""
        if self.kind == "bf16":
            return self.start + 2 * self.width
        end = self.start + self.tile_width
        if self.kind == "e4m3":
            end = max(end, self.scale_start + (4 if self.scale_kind == "f32" else 1))
        return end


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How the kernel reads one stored row: ``values`` cover ``q_value``'s columns ``[0, Cv)``,
    ``keys`` cover ``q_key``'s ``[0, Rk)``; ``row_width`` is the stored row's width in pool elements
    and ``dtype`` the pool's dtype (uint8 for byte formats)."""

    values: tuple[Chunk, ...]
    keys: tuple[Chunk, ...]
    row_width: int
    dtype: str

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return self.values + self.keys

    @property
    def tile_columns(self) -> tuple[int, ...]:
        """Where each chunk starts in the operand tiles, which hold all chunks side by side (values
        first) so one wgmma scores a whole row; last, their total width."""
        return tuple(itertools.accumulate((c.tile_width for c in self.chunks), initial=0))

    @property
    def copies(self) -> tuple[int, ...]:
        """Elements of each TMA copy that brings one stored row into SMEM: ``MAX_COPY`` each but the
        last, every one a multiple of ``COPY_BYTES``."""
        item = jnp.dtype(self.dtype).itemsize
        sizes, left = [], self.row_width
        while left > 0:
            n = min(MAX_COPY, -(-left * item // COPY_BYTES) * COPY_BYTES // item)
            sizes.append(n)
            left -= n
        return tuple(sizes)

    @property
    def raw_width(self) -> int:
        """Columns of the SMEM buffer a row is copied into: the copies, and every tile's reach."""
        return max(sum(self.copies), *(c.raw_end for c in self.chunks))


def plain_layout(value_width: int, key_width: int, dtype) -> RowLayout:
    """A float row ``[values (value_width) | key-only (key_width)]`` of the pool's own dtype, values
    in chunks of ``VALUE_CHUNK`` columns."""
    values = tuple(Chunk(c, min(VALUE_CHUNK, value_width - c), c) for c in range(0, value_width, VALUE_CHUNK))
    keys = (Chunk(0, key_width, value_width),) if key_width else ()
    return RowLayout(values, keys, value_width + key_width, jnp.dtype(dtype).name)


WORD_BYTES = 4  # a TPU sublane word: the element of the pools the mosaic_tpu kernels read


def words_per_row(layout: RowLayout) -> int:
    """32-bit words of one stored row of ``layout`` (its bytes / 4): 288 for V3.2's bf16 576-wide row,
    164 for its 656-byte FP8 row, 148 for V4's 592-byte one."""
    row_bytes = layout.row_width * jnp.dtype(layout.dtype).itemsize
    if row_bytes % WORD_BYTES:
        raise ValueError(f"a {layout.dtype} row of {layout.row_width} elements is {row_bytes} bytes, not whole "
                         f"{WORD_BYTES}-byte words: the mosaic_tpu kernels read rows as 32-bit words")
    return row_bytes // WORD_BYTES


def as_words(pool):
    """Rows ``[P, X]`` of a 16- or 8-bit dtype (bf16 rows, FP8 byte rows) as ``u32[P, X * itemsize / 4]``
    words, the pool form the ``mosaic_tpu`` kernels read (word ``j`` holds the row's bytes ``4j .. 4j + 3``,
    little-endian). On a TPU this is a relayout copy of the whole pool (packed tiles to 32-bit ones), paid
    on every call that passes bf16 / uint8 rows; a cache that stores its rows as words passes them as
    they are, if it keeps them row-major (XLA:TPU's own layout for a ``u32[4096, 288]`` argument is
    column-major, which pads fewer lanes; relaying that out for the kernel is a copy too)."""
    item = jnp.dtype(pool.dtype).itemsize
    per_word = WORD_BYTES // item
    if pool.ndim != 2 or item not in (1, 2) or pool.shape[1] % per_word:
        raise ValueError(f"as_words takes rows [P, X] of a 1- or 2-byte dtype with X * itemsize a multiple of "
                         f"{WORD_BYTES}, got {pool.dtype}{list(pool.shape)}")
    return lax.bitcast_convert_type(pool.reshape(pool.shape[0], -1, per_word), jnp.uint32)


def is_words(pool) -> bool:
    return pool.dtype == jnp.uint32


def check_words_target(name: str, pool, target: str | None):
    """Word pools are the ``mosaic_tpu`` kernels' form; every other reader (``target=None``: the
    references) takes the rows themselves."""
    if is_words(pool) and target != "mosaic_tpu":
        reader = "the reference" if target is None else f"target={target!r}"
        raise ValueError(f"{name} holds 32-bit words (as_words: the mosaic_tpu kernels' pool form), but {reader} "
                         f"reads rows in their own dtype: pass the bf16 / uint8 rows")


def check_rank(name: str, x, rank: int, shape_doc: str):
    if not hasattr(x, "shape") or x.ndim != rank:
        raise ValueError(f"{name} must be {shape_doc}, got shape {getattr(x, 'shape', type(x).__name__)}")


def check_ids(name: str, ids, b: int, t: int):
    check_rank(name, ids, 3, "i32[B, T, K]")
    if ids.shape[:2] != (b, t):
        raise ValueError(f"{name} must be i32[B, T, K] with B, T = {(b, t)} of the queries, got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integer row ids (-1 = none), got dtype {ids.dtype}")


def check_float(name: str, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a float array, got dtype {x.dtype}")


def check_mla_queries(q_latent_BTNC, q_rope_BTNR) -> tuple[int, int, int, int, int]:
    """The absorbed-MLA queries of both pool formats: float ``[B, T, N, C]`` and ``[B, T, N, R]``.
    Returns ``(B, T, N, C, R)``."""
    check_rank("q_latent_BTNC", q_latent_BTNC, 4, "[B, T, N, C]")
    check_rank("q_rope_BTNR", q_rope_BTNR, 4, "[B, T, N, R]")
    b, t, n, c = q_latent_BTNC.shape
    if q_rope_BTNR.shape[:3] != (b, t, n):
        raise ValueError(f"q_rope_BTNR must be [B, T, N, R] with B, T, N = {(b, t, n)}, got {q_rope_BTNR.shape}")
    check_float("q_latent_BTNC", q_latent_BTNC)
    check_float("q_rope_BTNR", q_rope_BTNR)
    return b, t, n, c, q_rope_BTNR.shape[3]


def check_knobs(*, block_k: int, num_splits: int | None, target: str):
    check_target(target)
    if block_k < 64 or block_k > 256 or block_k % 64:
        raise ValueError(f"block_k={block_k} must be a multiple of 64 in [64, 256]")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1 (or None for the default)")


def e4m3_by_integers(b):
    """e4m3fn bytes (integers in [0, 256)) -> float32 by integer arithmetic, for the kernels whose targets have no
    FP8 conversion (TPUs; NVIDIA before sm_89, where ptxas refuses ``cvt ... e4m3x2``): sign bit 7, exponent bits
    6..3 (bias 7), mantissa bits 2..0."""
    b = b.astype(jnp.int32)
    e, m = (b >> 3) & 15, b & 7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)  # 2**(e-7) * (1 + m/8)
    magnitude = jnp.where(e == 0, m.astype(jnp.float32) * 2.0**-9, normal)
    magnitude = jnp.where((e == 15) & (m == 7), jnp.nan, magnitude)
    return jnp.where(b >= 128, -magnitude, magnitude)

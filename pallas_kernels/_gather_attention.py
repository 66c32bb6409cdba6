"""The core every gather-attention kernel here shares: read rows of a pool by id, score them against
one query block, online softmax in float32, out and log-sum-exp.

A kernel instance is one ``pallas_call`` over the grid ``(B, T, N / block_h, S)``: a program takes
one query token of one request, ``block_h`` of its heads (all heads read the same rows, as in MQA /
absorbed MLA, so the rows are gathered once per program and reused by every head of the block) and
one of ``S`` contiguous parts of its ids (split-K; the parts merge by log-sum-exp after the call).
It walks one or more *sources*, each a row pool ``[P, X]`` with ids ``i32[B, T, K]``, ``block_k``
ids at a time:

    ids  = ids_ref[j*bk : (j+1)*bk]                     i32[bk]   (-1 = no row)
    rows = pool_ref[max(ids, 0), chunk columns]         gathered straight from the pool
    s    = scale * (q_value . values + q_key . keys)    f32[bh, bk], -inf where id < 0
    m, l, acc  <- online softmax update                 f32[bh], f32[bh], f32[bh, Cv]

Rows of ids < 0 are zeroed after the gather, so whatever the pool holds at row 0 (even NaN) never
reaches the result. The epilogue folds an optional per-head sink into the denominator (V4) and
writes ``out = acc / denominator`` and ``lse = log(denominator)``; a query with no valid row and no
finite sink gets ``out = 0, lse = -inf``.

How a stored row becomes key and value columns is a ``RowLayout``: a tuple of value chunks (scored
against ``q_value`` and accumulated into ``out``) and key-only chunks (scored against ``q_key``).
Each chunk is a plain float slice of the row, ``e4m3`` bytes times a per-chunk scale (float32 or
ue8m0 bytes in the same row), or ``bf16`` values stored as byte pairs, so FP8 rows are dequantized
in the kernel, chunk by chunk, and never materialised in HBM.

The body uses only what the Pallas Triton lowering accepts (ref loads with an integer-array row
index and static column slices, 2-D ``dot_general``, elementwise math, row reductions, same-width
bitcasts, ``fori_loop``); chunk widths, ``block_h`` and ``block_k`` must be powers of two there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG_INF = float("-inf")
# The public wrappers' keyword-only tuning knobs (static under jit), documented in sparse_mla.
KNOBS = ("block_h", "block_k", "num_splits", "num_warps", "num_stages", "interpret")


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
    def value_width(self) -> int:
        return sum(c.width for c in self.values)

    @property
    def key_width(self) -> int:
        return sum(c.width for c in self.keys)


def plain_layout(value_width: int, key_width: int, dtype) -> RowLayout:
    """A float row ``[values (value_width) | key-only (key_width)]`` of the pool's own dtype."""
    keys = (Chunk(0, key_width, value_width),) if key_width else ()
    return RowLayout((Chunk(0, value_width, 0),), keys, value_width + key_width, jnp.dtype(dtype).name)


def _read_chunk(pool_ref, rows_bk, chunk: Chunk) -> jax.Array:
    """Gather one chunk of the rows ``rows_bk`` (all valid indices): ``[bk, width]``."""
    if chunk.kind == "plain":
        return pool_ref[rows_bk, pl.ds(chunk.start, chunk.width)]
    if chunk.kind == "bf16":
        lo = pool_ref[rows_bk, pl.ds(chunk.start, chunk.width, stride=2)].astype(jnp.uint16)
        hi = pool_ref[rows_bk, pl.ds(chunk.start + 1, chunk.width, stride=2)].astype(jnp.uint16)
        return lax.bitcast_convert_type(lo | (hi << 8), jnp.bfloat16)
    if chunk.kind == "e4m3":
        q8 = lax.bitcast_convert_type(pool_ref[rows_bk, pl.ds(chunk.start, chunk.width)], jnp.float8_e4m3fn)
        if chunk.scale_kind == "f32":
            bits = pool_ref[rows_bk, chunk.scale_start].astype(jnp.uint32)
            for i in range(1, 4):
                bits = bits | (pool_ref[rows_bk, chunk.scale_start + i].astype(jnp.uint32) << (8 * i))
        elif chunk.scale_kind == "e8m0":
            bits = pool_ref[rows_bk, chunk.scale_start].astype(jnp.uint32) << 23
        else:
            raise ValueError(f"{chunk.scale_kind=} is not a scale format")
        scale_bk = lax.bitcast_convert_type(bits, jnp.float32)
        return q8.astype(jnp.float32) * scale_bk[:, None]
    raise ValueError(f"{chunk.kind=} is not a chunk kind")


def _dot_nt(a, b):
    """``a [m, d] . b [n, d]^T -> f32[m, n]`` (exact float32 products when the inputs are float32)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST)


def _dot_nn(a, b):
    """``a [m, d] . b [d, n] -> f32[m, n]``."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST)


def _kernel(*refs, layouts: tuple[RowLayout, ...], has_sink: bool, scale: float, block_k: int,
            dot_dtype: str):
    """One (request, query token, head block of ``bh`` heads); the refs come in the order below,
    the optional ones only when present."""
    refs = list(refs)
    has_key = layouts[0].key_width > 0
    q_value_ref = refs.pop(0)  # [bh, Cv] query columns that meet value chunks (MLA: q_latent; V4: q)
    q_key_ref = refs.pop(0) if has_key else None  # [bh, Rk] query columns of key-only chunks (MLA: q_rope)
    sink_ref = refs.pop(0) if has_sink else None  # f32[bh] per-head sink logits
    sources = []
    for _ in layouts:
        ids_ref = refs.pop(0)  # i32[Ks] row ids into this source's pool, -1 = none; Ks % block_k == 0
        pool_ref = refs.pop(0)  # [Ps, Xs] the whole pool (Xs stored elements per row), gathered by id
        sources.append((ids_ref, pool_ref))
    out_ref, lse_ref = refs  # f32[bh, Cv], f32[bh]
    dt = jnp.dtype(dot_dtype)
    bh = q_value_ref.shape[0]

    layout0 = layouts[0]
    q_values = [q_value_ref[:, pl.ds(c.column, c.width)].astype(dt) for c in layout0.values]
    q_keys = [q_key_ref[:, pl.ds(c.column, c.width)].astype(dt) for c in layout0.keys] if has_key else []

    m = jnp.full((bh,), NEG_INF, jnp.float32)
    l = jnp.zeros((bh,), jnp.float32)
    accs = tuple(jnp.zeros((bh, c.width), jnp.float32) for c in layout0.values)

    for layout, (ids_ref, pool_ref) in zip(layouts, sources):

        def block(j, carry, layout=layout, ids_ref=ids_ref, pool_ref=pool_ref):  # ids j*bk .. (j+1)*bk - 1
            m, l, accs = carry
            ids = ids_ref[pl.ds(pl.multiple_of(j * block_k, block_k), block_k)]  # i32[bk]
            valid = ids >= 0
            rows = jnp.where(valid, ids, 0)
            values = [jnp.where(valid[:, None], _read_chunk(pool_ref, rows, c), 0).astype(dt) for c in layout.values]
            s = sum(_dot_nt(q, v) for q, v in zip(q_values, values))  # f32[bh, bk]
            for q, c in zip(q_keys, layout.keys):
                s = s + _dot_nt(q, jnp.where(valid[:, None], _read_chunk(pool_ref, rows, c), 0).astype(dt))
            s = jnp.where(valid[None, :], s * scale, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen
            p = jnp.exp(s - m_safe[:, None])  # 0 at invalid ids
            l = l * alpha + jnp.sum(p, axis=1)
            p = p.astype(dt)
            accs = tuple(a * alpha[:, None] + _dot_nn(p, v) for a, v in zip(accs, values))
            return m_new, l, accs

        n_blocks = ids_ref.shape[0] // block_k
        m, l, accs = lax.fori_loop(0, n_blocks, block, (m, l, accs))

    seen = l > 0
    m_seen = jnp.where(seen, m, 0.0)
    lse = jnp.where(seen, m_seen + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
    if has_sink:
        sink = sink_ref[...].astype(jnp.float32)
        top = jnp.maximum(lse, sink)
        top_safe = jnp.where(top == NEG_INF, 0.0, top)
        lse = top_safe + jnp.log(jnp.exp(lse - top_safe) + jnp.exp(sink - top_safe))
    weight = jnp.where(seen, jnp.exp(m_seen - jnp.where(seen, lse, 0.0)), 0.0)  # 1 / denominator, scaled
    for c, a in zip(layout0.values, accs):
        out_ref[:, pl.ds(c.column, c.width)] = a * weight[:, None]
    lse_ref[...] = lse


def _pad_axis(x, axis: int, multiple: int, value):
    size = x.shape[axis]
    pad = -size % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def compiler_params(*, num_warps: int, num_stages: int, interpret: bool):
    """Backend-specific compiler parameters: the Triton ones on GPU, none elsewhere."""
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def default_splits(*, programs: int, k_blocks: int, interpret: bool) -> int:
    """Splits of the ids per query when the caller leaves ``num_splits=None``: on a GPU, enough
    programs for about two per SM, keeping at least 4 blocks of ids per split; 1 elsewhere."""
    if interpret or jax.default_backend() != "gpu":
        return 1
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    return max(1, min(-(-2 * sms // max(programs, 1)), k_blocks // 4))


def gather_attention(q_value_BTNC, q_key_BTNR, sources, sinks_N, *, layouts: tuple[RowLayout, ...], scale: float,
                     block_h: int, block_k: int, num_splits: int | None, num_warps: int, num_stages: int,
                     interpret: bool, name: str):
    """Run the kernel. ``sources``: ``[(pool [P, X], ids i32[B, T, K]), ...]`` matching ``layouts``;
    ``q_key_BTNR`` is None when the layouts have no key chunks, ``sinks_N`` None for no sink.
    Returns ``out f32[B, T, N, Cv]`` and ``lse f32[B, T, N]``. Inputs are checked by the callers.

    With ``num_splits = S > 1`` every query's ids (of each source) are cut into S contiguous parts
    that separate programs attend to (split-K, as FlashMLA does for small batches); the partial
    (out, lse) pairs merge exactly by log-sum-exp here, and the sink joins after the merge.
    """
    b, t, n, cv = q_value_BTNC.shape
    k_blocks = max(-(-ids.shape[-1] // block_k) for _, ids in sources)
    # Pad heads to a multiple of block_h (zero queries, dropped below) and ids to a multiple of
    # S * block_k (-1 = no row), so every block the kernel loads has its static size.
    q_value = _pad_axis(q_value_BTNC, 2, block_h, 0)
    n_pad = q_value.shape[2]
    h_blocks = n_pad // block_h
    if num_splits is None:
        num_splits = default_splits(programs=b * t * h_blocks, k_blocks=k_blocks, interpret=interpret)
    splits = max(1, min(num_splits, k_blocks))
    in_kernel_sink = sinks_N is not None and splits == 1
    q_spec = lambda width: pl.BlockSpec((None, None, block_h, width), lambda i, j, h, s: (i, j, h, 0))
    args, in_specs = [q_value], [q_spec(cv)]
    if q_key_BTNR is not None:
        q_key = _pad_axis(q_key_BTNR, 2, block_h, 0)
        args.append(q_key)
        in_specs.append(q_spec(q_key.shape[-1]))
    if in_kernel_sink:
        args.append(_pad_axis(sinks_N.astype(jnp.float32), 0, block_h, 0.0))
        in_specs.append(pl.BlockSpec((block_h,), lambda i, j, h, s: (h,)))
    for pool, ids in sources:
        ids = _pad_axis(ids.astype(jnp.int32), 2, splits * block_k, -1)
        ids = ids.reshape(b, t, splits, ids.shape[-1] // splits)  # i32[B, T, S, K / S]
        args += [ids, pool]
        in_specs += [pl.BlockSpec((None, None, None, ids.shape[-1]), lambda i, j, h, s: (i, j, s, 0)),
                     pl.BlockSpec(pool.shape, lambda i, j, h, s: (0, 0))]
    float_inputs = [q_value.dtype] + ([q_key_BTNR.dtype] if q_key_BTNR is not None else [])
    pools_bf16 = all(lay.dtype in ("bfloat16", "uint8") for lay in layouts)
    dot_dtype = "bfloat16" if pools_bf16 and all(d == jnp.bfloat16 for d in float_inputs) else "float32"
    kernel = functools.partial(_kernel, layouts=tuple(layouts), has_sink=in_kernel_sink, scale=float(scale),
                               block_k=block_k, dot_dtype=dot_dtype)
    out_BTSNC, lse_BTSN = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, t, splits, n_pad, cv), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, splits, n_pad), jnp.float32)),
        grid=(b, t, h_blocks, splits),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((None, None, None, block_h, cv), lambda i, j, h, s: (i, j, s, h, 0)),
                   pl.BlockSpec((None, None, None, block_h), lambda i, j, h, s: (i, j, s, h))),
        interpret=interpret,
        name=name,
        compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages, interpret=interpret),
    )(*args)
    out_BTSNC, lse_BTSN = out_BTSNC[..., :n, :], lse_BTSN[..., :n]
    if splits == 1:
        return out_BTSNC[:, :, 0], lse_BTSN[:, :, 0]
    return _merge_splits(out_BTSNC, lse_BTSN, sinks_N)


def _merge_splits(out_BTSNC, lse_BTSN, sinks_N):
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


# ---- input checks shared by the public wrappers ---------------------------------------------------


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


def check_knobs(*, block_h: int, block_k: int, num_splits: int | None):
    for name, value in (("block_h", block_h), ("block_k", block_k)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= 1")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1 (or None for the default)")


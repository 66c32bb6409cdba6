"""The core every gather-attention kernel here shares: read rows of a pool by id, score them against
a block of query heads, online softmax in float32, out and log-sum-exp. This is its Hopper target
(``target="mosaic_gpu"``; the others: ``_gather_attention_sm80``, ``_gather_attention_tpu``), one
Mosaic GPU kernel (Pallas ``plgpu.kernel``: TMA copies and ``wgmma``); on a machine without a GPU it runs in
the Mosaic GPU interpreter, which simulates the same kernel's shared memory, copies and barriers.

A program takes one query token of one request, ``HEAD_BLOCK = 64`` of its heads (all heads read the
same rows, as in MQA / absorbed MLA, so the rows are gathered once per program and reused by every
head; 64 is the M of one warpgroup's ``wgmma``) and one of ``S`` parts of its ids (split-K; the parts
merge by log-sum-exp after the call). The grid is ``(B * T, N / 64, S)``. The wrapper sorts each
query's ids so the valid ones come first and deals them round-robin to the parts, so a program knows
from the count of valid ids which of its ids are valid and only copies and waits for those. It walks
one or more *sources*, each a row pool ``[P, X]`` with ids ``i32[B, T, K]``, ``block_k`` ids at a
time, up to the block of its last valid id:

    ids   -> SMEM                                   one TMA copy of the block's ids
    raw   <- pool rows at the valid ids             per id, TMA copies of the stored row from the
                                                    flattened pool: at most 256 elements and a
                                                    multiple of 128 bytes each, the last one may run
                                                    past the row (into the next one, or past the
                                                    pool's end, which the copy fills with zeros);
                                                    rows go 8 to a barrier, the -1 slots of the last
                                                    group copying row 0
    tiles <- every chunk of raw as float32          rows of ids < 0 and columns past the chunk zeroed,
                                                    then bf16 wgmma operands in SMEM, all chunks side
                                                    by side (queries: the same, once per program)
    s     =  scale * wgmma(q tiles, row tiles^T)    f32[64, bk], -inf where id < 0
    m, l, acc <- online softmax; acc[chunk] += wgmma(p, value chunk's row tiles)

Rows of ids < 0 are zeroed before any product, so whatever the pool holds (even NaN) never reaches
the result. The epilogue folds an optional per-head sink into the denominator (V4) and writes
``out = acc / denominator`` and ``lse = log(denominator)``; a query with no valid row and no finite
sink gets ``out = 0, lse = -inf``.

How a stored row becomes key and value columns is a ``RowLayout``: a tuple of value chunks (scored
against ``q_value`` and accumulated into ``out``) and key-only chunks (scored against ``q_key``).
Each chunk is a plain float slice of the row, ``e4m3`` bytes times a per-chunk scale (float32 or
ue8m0 bytes in the same row), or ``bf16`` values stored as byte pairs, so FP8 rows are dequantized
in the kernel, chunk by chunk, and never materialised in HBM. Byte fields are read from the raw
bytes in SMEM (a scale or a bf16 column at a time; Mosaic GPU has no strided or retyped SMEM views).

**Precision.** With bf16 queries and bf16 or FP8 rows the operands are bf16 (the softmax weights are
rounded to bf16 before the value product, as FlashMLA does). Otherwise every float32 operand ``x``
is split into three bf16 pieces ``x0 + x1 + x2`` (exact to ``2**-24 |x|``) and the six products of
pieces ``i + j <= 2`` are accumulated in float32, so float32 inputs get float32-accurate scores on
the bf16 tensor cores (TF32 would keep 10 mantissa bits); the interpreter computes the same bf16
products.

**Limits.** Chunk widths must be multiples of 8 (operand tiles are padded to 16 columns);
``block_k`` a multiple of 64 up to 256; all sources of one call share one row layout; one program's
shared memory (``smem_bytes``) must fit the 227 KiB of an H100 / H200, which DeepSeek's bf16 and
FP8 rows do but float32 rows of width 576 do not. The raw rows and the softmax weights' tiles share
memory (a ``RefUnion``: the rows are dead by the time the weights are written). A row's TMA copy starts at a
16-byte-aligned address or faults (``CUDA_ERROR_ILLEGAL_INSTRUCTION`` on an H200 with DeepSeek's 584-byte V4 FP8
rows). The V4 FP8 rows are therefore stored at 592 bytes (``fp8_rows.v4_row_bytes``); pools whose rows are still not
a multiple of 16 bytes (tiny-v32's 100-byte FP8 rows) are padded to it here, a copy of the pool per call.

**Not tuned**: one warpgroup per program holds the whole
accumulator (V3.2: 64 x 512 float32, 256 registers a thread, so it spills), and a block's row copies
are not overlapped with the previous block's math.

**Interpret mode** runs the kernel behind a ``pure_callback`` (see ``gather_attention``); each
simulated memory operation is a host callback of about a millisecond, so a program costs tens of
milliseconds there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ess_jax.pallas_kernels.row_layout import ROW_ALIGN, Chunk, RowLayout, e4m3_by_integers
from ess_jax.pallas_kernels.split_k import deal_ids, finish_softmax, merge_splits, pad_axis, round_up

if TYPE_CHECKING:
    from ess_jax.pallas_kernels.target import Interpret

NEG_INF = float("-inf")
# The public wrappers' keyword-only tuning knobs (static under jit), documented in sparse_mla.
HEAD_BLOCK = 64  # query heads per program: the M of one warpgroup's wgmma
ROW_GROUP = 8  # rows copied per barrier
SMEM_BYTES = 227 * 1024  # shared memory one block may use on an H100 / H200
SMEM_ALIGNMENT = 1024  # Pallas aligns every SMEM buffer to this many bytes
REDUCTION_SCRATCH = plgpu.CompilerParams().reduction_scratch_bytes  # Mosaic GPU's own SMEM for reductions
_WGMMA = plgpu.Layout.WGMMA  # [m, n] tiles, m % 64 == 0 == n % 8
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [m]: one value per row of a WGMMA tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # [n]: one value per column
# Products of bf16 pieces (i, j) summed for one dot: one piece for bf16 operands, three for float32.
_PAIRS = {1: ((0, 0),), 3: ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0))}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one kernel instance."""

    layout: RowLayout
    sources: int
    has_key: bool
    has_sink: bool
    scale: float
    block_k: int
    pieces: int  # bf16 pieces per operand: 1 (bf16 dots) or 3 (float32 dots)

    @property
    def swizzle(self) -> int:
        """Bytes of the SMEM swizzle all operand tiles share (a wgmma needs equal ones on both sides):
        the largest that divides every tile row (bf16)."""
        rows = [2 * c.tile_width for c in self.layout.chunks] + [2 * self.block_k]  # bytes
        return next(s for s in (128, 64, 32) if all(r % s == 0 for r in rows))

    @property
    def pair_width(self) -> int:
        """Columns of the scratch that bf16 byte-pair chunks are decoded into (0: none)."""
        return max((c.tile_width for c in self.layout.chunks if c.kind == "bf16"), default=0)

    def smem_bytes(self) -> int:
        """Shared memory of one program as Mosaic GPU lays out ``_scratch``: every buffer aligned to
        ``SMEM_ALIGNMENT`` bytes, a union as large as its larger side, then the barriers and the
        reduction scratch."""
        lay, bk = self.layout, self.block_k
        size = lambda *shape_bytes: -(-math.prod(shape_bytes) // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
        staging = size(bk, lay.raw_width, jnp.dtype(lay.dtype).itemsize) + (size(bk, self.pair_width, 2)
                                                                           if self.pair_width else 0)
        tiles = size(self.pieces, HEAD_BLOCK + bk, lay.tile_columns[-1], 2)
        return (size(bk, 4) + max(staging, size(self.pieces, HEAD_BLOCK, bk, 2)) + tiles
                + (1 + bk // ROW_GROUP) * 8 + REDUCTION_SCRATCH)


def _scratch(plan: _Plan):
    """SMEM of one program: ids; raw rows and decoded byte pairs, which are dead by the time the
    softmax weights' tiles are written, so the two share memory (a ``RefUnion``); the bf16 operand
    tiles of queries and rows; the barriers: one for the ids, one per group of rows."""
    lay, bk = plan.layout, plan.block_k
    tiled = (plgpu.TilingTransform((8, plan.swizzle // 2)), plgpu.SwizzleTransform(plan.swizzle))
    tiles = lambda rows, width: plgpu.SMEM((plan.pieces, rows, width), jnp.bfloat16, transforms=tiled)
    staging = [plgpu.SMEM((bk, lay.raw_width), jnp.dtype(lay.dtype))]
    if plan.pair_width:
        staging.append(plgpu.SMEM((bk, plan.pair_width), jnp.bfloat16))
    return dict(
        ids=plgpu.SMEM((bk,), jnp.int32),
        staging=plgpu.RefUnion(staging, tiles(HEAD_BLOCK, bk)),
        q_tiles=tiles(HEAD_BLOCK, lay.tile_columns[-1]),
        row_tiles=tiles(bk, lay.tile_columns[-1]),
        ids_ready=plgpu.Barrier(),
        rows_ready=plgpu.Barrier(num_arrivals=ROW_GROUP * len(lay.copies), num_barriers=bk // ROW_GROUP),
    )


def _load(ref, layout):
    return plgpu.load(ref, layout=layout, optimized=False)


def _bf16_pieces(x, n: int) -> list:
    """float32 ``x`` as ``n`` bf16 arrays whose float32 sum approximates it (each the rounding of
    what the previous ones leave)."""
    out = []
    for _ in range(n):
        out.append(x.astype(jnp.bfloat16))
        x = x - out[-1].astype(jnp.float32)
    return out


def _chunk_values(raw, pairs, chunk: Chunk, rows: int, *, fp8_instructions: bool = True):
    """One chunk of the raw rows in SMEM as float32 ``[rows, chunk.tile_width]`` (columns past
    ``chunk.width`` hold whatever follows it). ``fp8_instructions``: e4m3 bytes converted by the GPU's FP8
    instructions (sm_89 and later), else by ``e4m3_by_integers``."""
    w = chunk.tile_width
    if chunk.kind == "plain":
        return _load(raw.at[:, pl.ds(chunk.start, w)], _WGMMA).astype(jnp.float32)
    if chunk.kind == "bf16":

        def column(k, carry):  # little-endian byte pair -> one bf16 column
            lo = _load(raw.at[:, chunk.start + 2 * k], _ROW).astype(jnp.uint16)
            hi = _load(raw.at[:, chunk.start + 2 * k + 1], _ROW).astype(jnp.uint16)
            pairs.at[:, k][...] = lax.bitcast_convert_type(lo | (hi << 8), jnp.bfloat16)
            return carry

        lax.fori_loop(0, chunk.width, column, None)
        return _load(pairs.at[:, pl.ds(0, w)], _WGMMA).astype(jnp.float32)
    if chunk.kind == "e4m3":
        q8 = _load(raw.at[:, pl.ds(chunk.start, w)], _WGMMA)
        values = (lax.bitcast_convert_type(q8, jnp.float8_e4m3fn).astype(jnp.float32) if fp8_instructions
                  else e4m3_by_integers(q8))
        if chunk.scale_kind == "f32":
            bits = _load(raw.at[:, chunk.scale_start], _ROW).astype(jnp.uint32)
            for i in range(1, 4):
                bits = bits | (_load(raw.at[:, chunk.scale_start + i], _ROW).astype(jnp.uint32) << (8 * i))
        elif chunk.scale_kind == "e8m0":
            bits = _load(raw.at[:, chunk.scale_start], _ROW).astype(jnp.uint32) << 23
        else:
            raise ValueError(f"{chunk.scale_kind=} is not a scale format")
        scale = lax.bitcast_convert_type(bits, jnp.float32)
        return values * lax.broadcast_in_dim(scale, (rows, w), [0])
    raise ValueError(f"{chunk.kind=} is not a chunk kind")


def _store_tiles(tiles, column: int, x, valid_rows, chunk: Chunk, pieces: int):
    """``x`` f32[rows, tile_width] into columns ``[column, column + tile_width)`` of the bf16 operand
    ``tiles`` [pieces, rows, width], zero outside the rows where ``valid_rows`` (bool[rows]; None:
    all) and past ``chunk.width`` columns."""
    keep = None if valid_rows is None else lax.broadcast_in_dim(valid_rows, x.shape, [0])
    if chunk.width != chunk.tile_width:
        at_column = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=_WGMMA)
        keep = at_column < chunk.width if keep is None else keep & (at_column < chunk.width)
    if keep is not None:
        x = jnp.where(keep, x, 0.0)
    for i, piece in enumerate(_bf16_pieces(x, pieces)):
        tiles.at[i, :, pl.ds(column, chunk.tile_width)][...] = piece


def _kernel(*refs, plan: _Plan):
    """One (request and query token, head block, split); the refs come in the order below, the
    optional ones only when present, then the outputs and the scratch of ``_scratch``."""
    refs = list(refs)
    q_value_ref = refs.pop(0)  # [BT, Np, Cq] query columns that meet value chunks (MLA: q_latent; V4: q)
    q_key_ref = refs.pop(0) if plan.has_key else None  # [BT, Np, Rq] columns of key-only chunks (MLA: q_rope)
    sink_ref = refs.pop(0) if plan.has_sink else None  # f32[Np] per-head sink logits
    # per source: ids i32[BT, S, Ks] (valid ones first, dealt round-robin to the S splits), the number
    # of valid ids i32[BT], the flattened pool [Ps * X]
    sources = [(refs.pop(0), refs.pop(0), refs.pop(0)) for _ in range(plan.sources)]
    out_ref, lse_ref = refs.pop(0), refs.pop(0)  # f32[BT, S, Np, Cv], f32[BT, S, Np]
    (scratch,) = refs
    lay, bk, pieces = plan.layout, plan.block_k, plan.pieces
    bt, split = lax.axis_index("bt"), lax.axis_index("split")
    heads = pl.ds(lax.axis_index("heads") * HEAD_BLOCK, HEAD_BLOCK)

    q_refs = [q_value_ref] * len(lay.values) + [q_key_ref] * len(lay.keys)
    for chunk, q_ref, column in zip(lay.chunks, q_refs, lay.tile_columns):
        q = _load(q_ref.at[bt, heads, pl.ds(chunk.column, chunk.tile_width)], _WGMMA).astype(jnp.float32)
        _store_tiles(scratch["q_tiles"], column, q, None, chunk, pieces)

    m = plgpu.layout_cast(jnp.full((HEAD_BLOCK,), NEG_INF, jnp.float32), _ROW)
    l = plgpu.layout_cast(jnp.zeros((HEAD_BLOCK,), jnp.float32), _ROW)
    accs = tuple(plgpu.layout_cast(jnp.zeros((HEAD_BLOCK, c.tile_width), jnp.float32), _WGMMA) for c in lay.values)
    ids_smem = scratch["ids"]
    (raw, *pairs), p_tiles = scratch["staging"]
    q_tiles, row_tiles = scratch["q_tiles"], scratch["row_tiles"]

    for ids_ref, count_ref, pool_ref in sources:
        splits = ids_ref.shape[1]
        in_split = jnp.maximum((count_ref[bt] - split + splits - 1) // splits, 0)  # valid ids of this split

        def block(j, carry, ids_ref=ids_ref, pool_ref=pool_ref, in_split=in_split):  # this split's ids j*bk ...
            m, l, accs = carry
            ids_block = ids_ref.at[bt, split, pl.ds(pl.multiple_of(j * bk, bk), bk)]
            plgpu.copy_gmem_to_smem(ids_block, ids_smem, scratch["ids_ready"])
            plgpu.barrier_wait(scratch["ids_ready"])
            # The block's first ids are valid, the rest -1. Rows are copied and awaited in groups of
            # ROW_GROUP, each group on its own barrier, up to the group of the last valid id; the
            # group's -1 slots copy row 0 (masked below).
            groups = (jnp.minimum(in_split - j * bk, bk) + ROW_GROUP - 1) // ROW_GROUP

            def fetch(slot, carry):  # row ids_smem[slot] -> raw[slot]
                first = jnp.maximum(ids_smem[slot], 0) * lay.row_width
                offset = 0
                for n in lay.copies:
                    plgpu.copy_gmem_to_smem(pool_ref.at[pl.ds(first + offset, n)], raw.at[slot, pl.ds(offset, n)],
                                            scratch["rows_ready"].at[slot // ROW_GROUP])
                    offset += n
                return carry

            def wait(group, carry):
                plgpu.barrier_wait(scratch["rows_ready"].at[group])
                return carry

            lax.fori_loop(0, groups * ROW_GROUP, fetch, None)
            lax.fori_loop(0, groups, wait, None)
            valid_rows = _load(ids_smem, _ROW) >= 0
            for chunk, column in zip(lay.chunks, lay.tile_columns):
                x = _chunk_values(raw, pairs[0] if pairs else None, chunk, bk)
                _store_tiles(row_tiles, column, x, valid_rows, chunk, pieces)
            plgpu.commit_smem()

            def scores(acc):
                for a, b in _PAIRS[pieces]:
                    plgpu.wgmma(acc, q_tiles.at[a], row_tiles.at[b].T)
                return acc[...]

            s = pl.run_scoped(scores, plgpu.ACC((HEAD_BLOCK, bk), jnp.float32))  # f32[64, bk]
            valid = lax.broadcast_in_dim(_load(ids_smem, _COL) >= 0, s.shape, [1])
            s = jnp.where(valid, s * plan.scale, NEG_INF)
            m_new, l, alpha, p = _softmax_step(m, l, s)
            for i, piece in enumerate(_bf16_pieces(p, pieces)):
                p_tiles.at[i][...] = piece
            plgpu.commit_smem()
            new_accs = []
            for acc, chunk, column in zip(accs, lay.values, lay.tile_columns):

                def weighted_rows(acc_ref, columns=pl.ds(column, chunk.tile_width)):
                    for a, b in _PAIRS[pieces]:
                        plgpu.wgmma(acc_ref, p_tiles.at[a], row_tiles.at[b, :, columns])
                    return acc_ref[...]

                pv = pl.run_scoped(weighted_rows, plgpu.ACC(acc.shape, jnp.float32))
                new_accs.append(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv)
            return m_new, l, tuple(new_accs)

        m, l, accs = lax.fori_loop(0, (in_split + bk - 1) // bk, block, (m, l, accs))

    _store_out(plan, m, l, accs, sink_ref, out_ref.at[bt, split, heads], lse_ref.at[bt, split, heads], heads, _ROW)


def _softmax_step(m, l, s):
    """One block of the online softmax over scores ``s f32[64, bk]`` (-inf where invalid): the new
    running max and sum, the rescale ``alpha`` of what came before and the weights ``p``."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen
    p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))  # 0 at invalid ids
    return m_new, l * alpha + jnp.sum(p, axis=1), alpha, p


def _store_out(plan: _Plan, m, l, accs, sink_ref, out_ref, lse_ref, heads, row_layout):
    """The epilogue: ``out [64, Cv]`` and ``lse [64]`` of the program's heads (the sink, if any, read
    in ``row_layout``, the layout of ``m`` and ``l``)."""
    lse, weight = finish_softmax(m, l, _load(sink_ref.at[heads], row_layout) if plan.has_sink else None)
    for chunk, acc in zip(plan.layout.values, accs):
        out = acc * lax.broadcast_in_dim(weight, acc.shape, [0])
        out_ref.at[:, pl.ds(chunk.column, chunk.width)][...] = out[:, :chunk.width]
    lse_ref[...] = lse


def default_splits(*, programs: int, k_blocks: int, interpret: Interpret) -> int:
    """Splits of the ids per query when the caller leaves ``num_splits=None``: on a GPU, enough
    programs for about two per SM, keeping at least 4 blocks of ids per split; 1 elsewhere."""
    if interpret or jax.default_backend() != "gpu":
        return 1
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    return max(1, min(-(-2 * sms // max(programs, 1)), k_blocks // 4))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One GPU generation's kernel over the shared wrapper below: its body and scratch (functions of
    the ``_Plan``), the shared memory it needs and what one block may use on its devices."""

    kernel: Callable
    scratch: Callable
    smem_bytes: Callable[[_Plan], int]
    smem_limit: int
    devices: str


HOPPER = Variant(_kernel, _scratch, _Plan.smem_bytes, SMEM_BYTES, "an H100 / H200")


def gather_attention(q_value_BTNC, q_key_BTNR, sources, sinks_N, *, layout: RowLayout, scale: float,
                     block_k: int, num_splits: int | None, interpret: Interpret, name: str,
                     variant: Variant | None = None):
    """Run the kernel (``variant``: ``HOPPER`` when None, or ``_gather_attention_sm80.SM80``).
    ``sources``: ``[(pool [P, X], ids i32[B, T, K]), ...]``, every pool's rows read through ``layout``;
    ``q_key_BTNR`` is None when it has no key chunks, ``sinks_N`` None for no sink.
    ``interpret``: run in the Mosaic GPU interpreter (any backend) instead of compiling for the GPU,
    ``True`` or the interpreter's parameters (``plgpu.InterpretGPUParams``, e.g. ``detect_races``).
    Returns ``out f32[B, T, N, Cv]`` and ``lse f32[B, T, N]``. Inputs are checked by the callers.

    With ``num_splits = S > 1`` every query's ids (of each source) are dealt to S parts that
    separate programs attend to (split-K, as FlashMLA does for small batches); the partial
    (out, lse) pairs merge exactly by log-sum-exp here, and the sink joins after the merge.
    """
    variant = variant or HOPPER
    item = jnp.dtype(layout.dtype).itemsize
    if layout.row_width * item % ROW_ALIGN:  # rows of 100 bytes: each row's copy must start aligned
        padded = round_up(layout.row_width * item, ROW_ALIGN) // item
        sources = [(pad_axis(pool, 1, padded, 0), ids) for pool, ids in sources]  # a copy of the pools
        layout = dataclasses.replace(layout, row_width=padded)
    for chunk in layout.chunks:  # a WGMMA-layout tile holds whole groups of 8 columns
        if chunk.width % 8:
            raise ValueError(f"{name}: rows are read in chunks of a multiple of 8 columns, got {chunk}")
    b, t, n, cv = q_value_BTNC.shape
    k_blocks = max(-(-ids.shape[-1] // block_k) for _, ids in sources)
    n_pad = round_up(n, HEAD_BLOCK)
    h_blocks = n_pad // HEAD_BLOCK
    if num_splits is None:
        num_splits = default_splits(programs=b * t * h_blocks, k_blocks=k_blocks, interpret=interpret)
    splits = max(1, min(num_splits, k_blocks))
    in_kernel_sink = sinks_N is not None and splits == 1
    float_inputs = [q_value_BTNC.dtype] + ([q_key_BTNR.dtype] if q_key_BTNR is not None else [])
    bf16_dots = layout.dtype in ("bfloat16", "uint8") and all(d == jnp.bfloat16 for d in float_inputs)
    plan = _Plan(layout, len(sources), q_key_BTNR is not None, in_kernel_sink, float(scale), block_k,
                 1 if bf16_dots else 3)
    if variant.smem_bytes(plan) > variant.smem_limit:
        raise ValueError(
            f"{name}: one program needs {variant.smem_bytes(plan) / 1024:.0f} KiB of shared memory (rows of "
            f"{layout.row_width} {layout.dtype}, block_k={block_k}, {'bf16' if bf16_dots else 'float32'} operands), "
            f"more than the {variant.smem_limit // 1024} KiB of {variant.devices}; use bf16 or FP8 rows or a smaller "
            "block_k")

    # Heads padded to whole blocks (zero queries, dropped below); query columns padded so every
    # operand tile (16 columns at a time) stays inside; each query's ids sorted, valid ones first (the
    # kernel copies and waits for those only, and skips blocks without any), padded with -1 to S
    # whole parts of whole blocks and dealt round-robin to the parts; the pools flattened, so a row's
    # copies address elements, not rows.
    def queries(q_BTNX, chunks):
        q = pad_axis(q_BTNX, 2, n_pad, 0)
        q = pad_axis(q, 3, max(c.column + c.tile_width for c in chunks), 0)
        return q.reshape(b * t, n_pad, q.shape[-1])

    args = [queries(q_value_BTNC, layout.values)]
    if q_key_BTNR is not None:
        args.append(queries(q_key_BTNR, layout.keys))
    if in_kernel_sink:
        args.append(pad_axis(sinks_N.astype(jnp.float32), 0, n_pad, 0.0))
    for pool, ids in sources:
        args += [*deal_ids(ids, splits, block_k), pool.reshape(-1)]
    out_type = (jax.ShapeDtypeStruct((b * t, splits, n_pad, cv), jnp.float32),
                jax.ShapeDtypeStruct((b * t, splits, n_pad), jnp.float32))
    kernel = plgpu.kernel(
        lambda *refs: variant.kernel(*refs, plan=plan),
        out_type=out_type,
        scratch_types=(variant.scratch(plan),),
        grid=(b * t, h_blocks, splits),
        grid_names=("bt", "heads", "split"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
        kernel_name=name,
    )
    if interpret:
        # The interpreter's memory operations are ordered IO callbacks; behind a pure_callback their
        # effect stays out of the caller's jit, which jax 0.11.2 cannot lower when the jit also has
        # outputs in host memory (the engine's offloaded cache): the effect tokens are missing from
        # its list of propagated output memory kinds.
        out_BTSNC, lse_BTSN = jax.pure_callback(jax.jit(kernel), out_type, *args)
    else:
        out_BTSNC, lse_BTSN = kernel(*args)
    out_BTSNC = out_BTSNC.reshape(b, t, splits, n_pad, cv)[..., :n, :]
    lse_BTSN = lse_BTSN.reshape(b, t, splits, n_pad)[..., :n]
    if splits == 1:
        return out_BTSNC[:, :, 0], lse_BTSN[:, :, 0]
    return merge_splits(out_BTSNC, lse_BTSN, sinks_N)

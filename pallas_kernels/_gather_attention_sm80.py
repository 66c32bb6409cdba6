"""The gather-attention core for NVIDIA GPUs without TMA or ``wgmma`` (Ampere, Ada: sm_80 / 86 / 89),
``target="mosaic_gpu_sm80"``: the Hopper kernel's wrapper, grid, split-K, chunk decoding, online
softmax and epilogue (``_gather_attention``), with plain copies and Ampere MMA in place of TMA and
wgmma. One Mosaic GPU kernel (Pallas ``plgpu.kernel``, one warpgroup per program):

    rows  <- pool rows at the block's valid ids     per id, plain loads of the row from the flattened
                                                    pool (128 elements at a time, the warpgroup's
                                                    threads one each) and stores to SMEM; the ids are
                                                    read from GMEM
    per chunk of the row (values, then key-only):
      tile <- the chunk as float32, as bf16 pieces  rows past the block's valid count zeroed
      s   += q chunk . tile^T                       ``plgpu.mma`` (mma.sync m16n8k16), the queries
                                                    loaded from GMEM in the MMA operand layout
    m, l <- online softmax; p -> SMEM as bf16 pieces
    per value chunk: tile <- the chunk again; acc[chunk] += p . tile

Shared memory is the raw rows, one chunk's operand tile and the softmax weights, so DeepSeek's bf16
rows fit an Ada / consumer Ampere block's 99 KiB (each value chunk is decoded twice instead).
Rows shorter than 128 elements are copied as one 128-element window of the pool ending at most at
its end (so the pool must hold at least 128 elements); longer rows in windows starting at the row,
the last one ending at its end.

**Interpret mode.** The Mosaic GPU interpreter has no rule for ``plgpu.mma``; this module gives it
one on the CPU: ``acc + a @ b`` with float32 accumulation, which is what ``mma.sync`` computes from
bf16 operands, so the interpreter runs this same kernel. Not tuned, not compiled, not run on a GPU.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import mlir
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ess_jax.pallas_kernels import _gather_attention as hopper
from ess_jax.pallas_kernels._gather_attention import (_PAIRS, HEAD_BLOCK, NEG_INF, REDUCTION_SCRATCH, SMEM_ALIGNMENT,
                                                      _bf16_pieces, _chunk_values, _load, _Plan, _softmax_step,
                                                      _store_out)

SMEM_BYTES = 99 * 1024  # shared memory one block may use on sm_86 / sm_89 (an A100, sm_80, has 163 KiB)
WINDOW = 128  # elements per row copy: one per thread of the warpgroup
_ACC = plgpu.Layout.MMA_ACC(jnp.bfloat16)  # [m, n], m % 64 == 0 == n % 8
_LHS = plgpu.Layout.MMA_LHS(jnp.bfloat16)  # [m, k], k % 16 == 0
_RHS = plgpu.Layout.MMA_RHS(jnp.bfloat16)  # [k, n]
_ROW = _ACC.reduce(1)
_STRIDED = plgpu.Layout.WG_STRIDED((WINDOW,), vec_size=1)


def _mma_on_cpu(acc, a, b):
    return acc + lax.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=acc.dtype)


mlir.register_lowering(gpu_primitives.mma_p, mlir.lower_fun(_mma_on_cpu, multiple_results=False), platform="cpu")


def _margin(plan: _Plan) -> int:
    """Columns of the raw rows' buffer before a row's first element (rows under one window)."""
    return max(WINDOW - plan.layout.row_width, 0)


def _raw_width(plan: _Plan) -> int:
    lay = plan.layout
    return _margin(plan) + max(lay.row_width, WINDOW, *(c.raw_end for c in lay.chunks))


def _tile_width(plan: _Plan) -> int:
    return max(c.tile_width for c in plan.layout.chunks)


def _smem_bytes(plan: _Plan) -> int:
    """Shared memory of one program as Mosaic GPU lays out ``_scratch``."""
    size = lambda *shape_bytes: -(-math.prod(shape_bytes) // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
    bk = plan.block_k
    return (size(bk, _raw_width(plan), jnp.dtype(plan.layout.dtype).itemsize)
            + (size(bk, plan.pair_width, 2) if plan.pair_width else 0)
            + size(plan.pieces, bk, _tile_width(plan), 2) + size(plan.pieces, HEAD_BLOCK, bk, 2) + REDUCTION_SCRATCH)


def _scratch(plan: _Plan):
    """SMEM of one program: the raw rows, decoded byte pairs, one chunk's tile, the softmax weights."""
    bk = plan.block_k
    scratch = dict(raw=plgpu.SMEM((bk, _raw_width(plan)), jnp.dtype(plan.layout.dtype)),
                   tile=plgpu.SMEM((plan.pieces, bk, _tile_width(plan)), jnp.bfloat16),
                   p_tiles=plgpu.SMEM((plan.pieces, HEAD_BLOCK, bk), jnp.bfloat16))
    if plan.pair_width:
        scratch["pairs"] = plgpu.SMEM((bk, plan.pair_width), jnp.bfloat16)
    return scratch


def _kernel(*refs, plan: _Plan):
    """One (request and query token, head block, split); the refs as ``_gather_attention._kernel``'s."""
    refs = list(refs)
    q_value_ref = refs.pop(0)  # [BT, Np, Cq] query columns that meet value chunks
    q_key_ref = refs.pop(0) if plan.has_key else None  # [BT, Np, Rq] columns of key-only chunks
    sink_ref = refs.pop(0) if plan.has_sink else None  # f32[Np]
    sources = [(refs.pop(0), refs.pop(0), refs.pop(0)) for _ in range(plan.sources)]  # ids, count, flat pool
    out_ref, lse_ref = refs.pop(0), refs.pop(0)  # f32[BT, S, Np, Cv], f32[BT, S, Np]
    (scratch,) = refs
    lay, bk, pieces, margin = plan.layout, plan.block_k, plan.pieces, _margin(plan)
    bt, split = lax.axis_index("bt"), lax.axis_index("split")
    heads = pl.ds(lax.axis_index("heads") * HEAD_BLOCK, HEAD_BLOCK)
    raw_all, tile, p_tiles = scratch["raw"], scratch["tile"], scratch["p_tiles"]
    raw = raw_all.at[:, pl.ds(margin, raw_all.shape[1] - margin)]  # a row's first element at column 0
    pairs = scratch.get("pairs")

    def q_pieces(q_ref, chunk):  # the chunk's query columns as bf16 MMA operands
        q = _load(q_ref.at[bt, heads, pl.ds(chunk.column, chunk.tile_width)], _LHS)
        return [q] if pieces == 1 else _bf16_pieces(q.astype(jnp.float32), pieces)

    def decode(chunk, valid_rows):  # chunk -> tile[:, :, :tile_width], zero past the rows and columns
        x = _chunk_values(raw, pairs, chunk, bk, fp8_instructions=False)  # sm_80 / 86 have none
        keep = lax.broadcast_in_dim(valid_rows, x.shape, [0])
        if chunk.width != chunk.tile_width:
            keep = keep & (plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=hopper._WGMMA) < chunk.width)
        for i, piece in enumerate(_bf16_pieces(jnp.where(keep, x, 0.0), pieces)):
            tile.at[i, :, pl.ds(0, chunk.tile_width)][...] = piece
        return [tile.at[i, :, pl.ds(0, chunk.tile_width)] for i in range(pieces)]

    m = plgpu.layout_cast(jnp.full((HEAD_BLOCK,), NEG_INF, jnp.float32), _ROW)
    l = plgpu.layout_cast(jnp.zeros((HEAD_BLOCK,), jnp.float32), _ROW)
    accs = tuple(plgpu.layout_cast(jnp.zeros((HEAD_BLOCK, c.tile_width), jnp.float32), _ACC) for c in lay.values)
    q_refs = [q_value_ref] * len(lay.values) + [q_key_ref] * len(lay.keys)

    for ids_ref, count_ref, pool_ref in sources:
        splits, total = ids_ref.shape[1], pool_ref.shape[0]
        in_split = jnp.maximum((count_ref[bt] - split + splits - 1) // splits, 0)  # valid ids of this split

        def block(j, carry, ids_ref=ids_ref, pool_ref=pool_ref, total=total, in_split=in_split):
            m, l, accs = carry
            n = jnp.minimum(in_split - j * bk, bk)  # the block's first n ids are valid

            def fetch(slot, carry):  # row ids[slot] -> raw[slot]
                first = ids_ref[bt, split, j * bk + slot] * lay.row_width
                if lay.row_width >= WINDOW:
                    for offset in sorted({*range(0, lay.row_width - WINDOW, WINDOW), lay.row_width - WINDOW}):
                        raw.at[slot, pl.ds(offset, WINDOW)][...] = _load(pool_ref.at[pl.ds(first + offset, WINDOW)],
                                                                         _STRIDED)
                else:  # one window holding the row, inside the pool
                    start = jnp.minimum(first, total - WINDOW)
                    raw_all.at[slot, pl.ds(margin + start - first, WINDOW)][...] = _load(
                        pool_ref.at[pl.ds(start, WINDOW)], _STRIDED)
                return carry

            lax.fori_loop(0, n, fetch, None)
            valid_rows = plgpu.broadcasted_iota(jnp.int32, (bk,), 0, layout=hopper._ROW) < n
            s = plgpu.layout_cast(jnp.zeros((HEAD_BLOCK, bk), jnp.float32), _ACC)
            for chunk, q_ref in zip(lay.chunks, q_refs):
                qs, ts = q_pieces(q_ref, chunk), decode(chunk, valid_rows)
                for a, b in _PAIRS[pieces]:
                    s = plgpu.mma(s, qs[a], _load(ts[b].T, _RHS))
            valid = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=_ACC) < n
            s = jnp.where(valid, s * plan.scale, NEG_INF)  # f32[64, bk]
            m_new, l, alpha, p = _softmax_step(m, l, s)
            for i, piece in enumerate(_bf16_pieces(p, pieces)):
                p_tiles.at[i][...] = piece
            ps = [_load(p_tiles.at[i], _LHS) for i in range(pieces)]
            new_accs = []
            for acc, chunk in zip(accs, lay.values):
                ts = decode(chunk, valid_rows)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                for a, b in _PAIRS[pieces]:
                    acc = plgpu.mma(acc, ps[a], _load(ts[b], _RHS))
                new_accs.append(acc)
            return m_new, l, tuple(new_accs)

        m, l, accs = lax.fori_loop(0, (in_split + bk - 1) // bk, block, (m, l, accs))

    _store_out(plan, m, l, accs, sink_ref, out_ref.at[bt, split, heads], lse_ref.at[bt, split, heads], heads, _ROW)


SM80 = hopper.Variant(_kernel, _scratch, _smem_bytes, SMEM_BYTES, "an sm_86 / sm_89 GPU (Ada, consumer Ampere)")


def gather_attention(q_value_BTNC, q_key_BTNR, sources, sinks_N, **knobs):
    """``_gather_attention.gather_attention`` with this kernel; pools of at least 128 elements."""
    for pool, _ in sources:
        if pool.size < WINDOW:
            raise ValueError(f"{knobs['name']}: a pool of {pool.size} elements is under the {WINDOW} one row copy "
                             "reads on sm_80")
    return hopper.gather_attention(q_value_BTNC, q_key_BTNR, sources, sinks_N, variant=SM80, **knobs)

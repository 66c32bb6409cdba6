"""The gather-attention core (``_gather_attention``'s contract) as one Mosaic TPU kernel (Pallas
``pallas_call`` with ``pltpu.PrefetchScalarGridSpec``).

A program takes one query token of one request, all of its heads (padded to a multiple of 8: all
heads read the same rows, so the rows are gathered once per program) and one of ``S`` parts of its
ids (split-K, dealt as ``split_k`` describes). The grid is ``(B * T, S)``. Every source's ids and
valid counts are scalar-prefetched into SMEM; the pools stay in HBM (``pl.ANY``) as rows of 32-bit
words (below). A program walks each source ``block_k`` ids at a time, double-buffered:

    rows[slot] <- pool rows at the block's valid ids     one asynchronous DMA per row (HBM -> VMEM),
                                                         all on the slot's DMA semaphore; the next
                                                         block's DMAs start before this block's math
    rows_f32   <- rows[slot] decoded to float32          run by run, plane by plane (FP8 bytes
                                                         dequantized here), rows past the count zeroed
    s = scale * (q_value . values^T + q_key . keys^T)    f32[N, bk] on the MXU, -inf past the count
    m, l, acc <- online softmax in float32; acc += p . values

Rows past the valid count are never copied and are zeroed (``where``, not a product) before any
product, so whatever the pool or a stale buffer holds (even NaN) never reaches the result. The
epilogue is the Mosaic GPU kernel's: an optional per-head sink joins the denominator, ``out = acc /
denominator``, ``lse = log(denominator)``; a query with no valid row and no finite sink gets ``out =
0, lse = -inf``.

**Rows as 32-bit words.** A TPU tiles VMEM in (8 sublanes x 128 lanes) of 32-bit words and packs two
bf16 or four uint8 rows into each sublane word, so a DMA of one bf16 or byte row at an arbitrary row is
an unaligned sublane offset, which Mosaic refuses ("Offsets along tiled dimensions must be aligned to
tiles"). The kernel therefore reads pools of 32-bit rows: float32 rows as they are, bf16 and byte rows
as ``u32[P, row_bytes / 4]`` words (``row_layout.as_words``; every format is a whole number of words:
576 bf16 = 288, 656 B = 164, 592 B = 148, 100 B = 25, 96 B = 24). Pools given as bf16 / uint8 are
viewed as words by the wrapper, a relayout copy of the whole pool on a TPU; word pools pass as they are.

**Decoding** is 32-bit integer arithmetic, which every TPU generation has, over runs of contiguous
chunks (``_words``): a bf16 word's even column is ``bits(w << 16)`` and its odd one ``bits(w &
0xFFFF0000)``; an e4m3 byte ``(w >> 8k) & 255`` becomes a float32's sign, exponent and mantissa
(subnormals ``m * 2**-9``, 0x7F / 0xFF NaN) times its chunk's scale, a float32 scale being a whole word
and a ue8m0 one its byte shifted into the exponent. A run's columns come out plane-major (all even
columns, then all odd ones; all bytes 0, then 1, 2, 3), not interleaved: the wrapper puts the queries'
columns in that order and takes the output's back out of it (gathers over ``[B, T, N, C]``), so the
kernel never shuffles lanes.

**Precision.** With bf16 queries and bf16 or FP8 rows the products are bf16 with float32 accumulation
(the softmax weights rounded to bf16 before the value product, as the Mosaic GPU kernel does);
otherwise float32 at ``Precision.HIGHEST``.

**Compiled, not run.** libtpu's compiler (XLA:TPU with Mosaic, for compile-only v5e / v6e / v5p devices:
``jax.experimental.topologies``) accepts every kernel at DeepSeek's shapes and the tiny presets'
(tests/kernels/test_lowering.py, ``-m aot``): the DMAs, tilings, layouts and vector ops are legal and
the program's VMEM fits. VMEM per program is the double-buffered query blocks, the scratch (``2 *
block_k`` rows of words, ``f32[block_k, Cv + Rk]``, ``m``, ``l`` and ``f32[N, Cv]``, each padded to
whole tiles) and Mosaic's internal scratch: 1088 KiB for V3.2's 128 heads on v5e. What only a TPU
shows: the row DMAs' throughput (one row per DMA, ``4 * B * T * K`` id bytes per source in SMEM), the
MXU's bf16 numerics, and the words' byte order as XLA:TPU lays out ``as_words``' bitcast (the
interpreter checks it on the CPU).

``interpret`` runs the same kernel in the TPU interpreter (``pltpu.InterpretParams``: simulated VMEM,
SMEM, DMAs and semaphores; ``detect_races`` checks the DMAs against the reads of their buffers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ess_jax.pallas_kernels.row_layout import (WORD_BYTES, RowLayout, as_words, e4m3_by_integers, is_words,
                                               words_per_row)
from ess_jax.pallas_kernels.split_k import deal_ids, finish_softmax, merge_splits, pad_axis, round_up

NEG_INF = float("-inf")
HEAD_ALIGN = 8  # heads are padded to whole sublane tiles
# The scalar-prefetched ids and counts of one kernel call at most (bytes): SMEM is 1 MiB on v5e / v6e / v5p, and a
# batch whose ids need more is run in calls over row ranges (V4-Flash's 967 decode rows on v5p: 2.5 MB of ids, which
# Mosaic refused: "Allocation (size=1980416) would exceed memory (size=1048576)" for the CSA source alone).
PREFETCH_BYTES = 512 * 1024


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one kernel instance."""

    layout: RowLayout
    words: _Words
    sources: int
    has_key: bool
    has_sink: bool
    scale: float
    block_k: int
    splits: int
    bf16_dots: bool

    @property
    def value_width(self) -> int:
        return sum(c.width for c in self.layout.values)

    @property
    def operand(self):
        return jnp.bfloat16 if self.bf16_dots else jnp.float32

    @property
    def precision(self):
        # explicit either way: a global jax_default_matmul_precision="highest" would otherwise ask Mosaic for
        # float32 contraction of bf16 operands, which it refuses ("Bad lhs type")
        return lax.Precision.DEFAULT if self.bf16_dots else lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class _Run:
    """Consecutive chunks of one kind, contiguous in the stored row and in their logical columns:
    ``words`` words of the stored row from ``word`` (float32 rows: elements), decoded into ``per``
    planes of ``words`` columns each, side by side in the float32 rows from ``column``. ``kind``:
    ``"f32"`` (one plane: the elements), ``"bf16"`` (two: each word's low half, the pair's even column,
    then its high half) or ``"e4m3"`` (four: byte 0 of each word, then 1, 2, 3), times a scale per chunk:
    ``scales`` holds, per chunk, its first word in the run and its scale's word and byte in the row,
    of format ``scale_kind`` (``"f32"``: the whole word; ``"e8m0"``: one exponent byte)."""

    column: int
    words: int
    word: int
    kind: str
    scales: tuple[tuple[int, int, int], ...] = ()
    scale_kind: str = ""


PLANES = {"f32": 1, "bf16": 2, "e4m3": 4}  # planes of a run of each kind (columns per word)


@dataclasses.dataclass(frozen=True)
class _Words:
    """How the kernel decodes a ``RowLayout``'s rows from 32-bit words: its ``runs``, the stored row's
    ``width`` in words (float32 elements for float32 rows) and the logical column each column of the
    float32 rows holds (``value_order`` of ``q_value`` / ``out``, ``key_order`` of ``q_key``)."""

    runs: tuple[_Run, ...]
    width: int
    value_order: tuple[int, ...]
    key_order: tuple[int, ...]


def _words(layout: RowLayout) -> _Words:
    """The runs of ``layout``: its chunks joined while they are of one kind (and scale format) and
    contiguous, each decoded plane by plane (a bf16 run's even columns then its odd ones, an e4m3 run's
    byte 0 of every word, then 1, 2, 3), so the float32 rows hold each run's columns plane-major. The
    queries' columns are put in that order and the output's taken back out of it, outside the kernel,
    rather than interleaving lanes inside it; runs make the planes as wide as the format allows (256
    columns for a 512-wide bf16 latent, 128 for V3.2's FP8 one), lane-tile aligned where it allows."""
    if layout.dtype not in ("float32", "bfloat16", "uint8"):
        raise ValueError(f"the mosaic_tpu kernels read float32, bfloat16 or uint8 (FP8) rows, got {layout.dtype} "
                         f"rows: cast the pool to bfloat16 or float32")
    f32, item = layout.dtype == "float32", jnp.dtype(layout.dtype).itemsize
    runs, orders = [], ([], [])
    value_width = sum(c.width for c in layout.values)
    for part, chunks in enumerate((layout.values, layout.keys)):
        order, base = orders[part], (0, value_width)[part]
        part_runs = []  # [run fields, first logical column, next chunk's expected (start byte, column)]
        for chunk in chunks:
            kind = "f32" if f32 else "e4m3" if chunk.kind == "e4m3" else "bf16"
            per = PLANES[kind]
            start = chunk.start * item  # bytes
            if not f32 and (start % WORD_BYTES or chunk.width % per):
                raise ValueError(f"a {chunk.kind} chunk of {chunk.width} columns at byte {start} of the row is not "
                                 f"whole 32-bit words, which the mosaic_tpu kernels read")
            word, words = (chunk.start, chunk.width) if f32 else (start // WORD_BYTES, chunk.width // per)
            scale = ()
            if kind == "e4m3":
                if chunk.scale_kind == "f32" and chunk.scale_start % WORD_BYTES:
                    raise ValueError(f"a float32 scale at byte {chunk.scale_start} is not a whole 32-bit word")
                scale = (chunk.scale_start // WORD_BYTES, chunk.scale_start % WORD_BYTES)
            run = part_runs[-1] if part_runs else None
            if (run and run["kind"] == kind and run["scale_kind"] == chunk.scale_kind
                    and run["next"] == (word, chunk.column)):
                run["scales"].append((run["words"], *scale))
                run["words"] += words
            else:
                run = dict(kind=kind, word=word, words=words, scales=[(0, *scale)], scale_kind=chunk.scale_kind,
                           first=chunk.column)
                part_runs.append(run)
            run["next"] = (word + words, chunk.column + chunk.width)
        for run in part_runs:
            per = PLANES[run["kind"]]
            scales = tuple(run["scales"]) if run["kind"] == "e4m3" else ()
            runs.append(_Run(base + len(order), run["words"], run["word"], run["kind"], scales, run["scale_kind"]))
            order.extend(run["first"] + per * j + k for k in range(per) for j in range(run["words"]))
    width = layout.row_width if f32 else words_per_row(layout)
    return _Words(tuple(runs), width, tuple(orders[0]), tuple(orders[1]))


def _run_planes(raw, run: _Run):
    """A run of the stored rows ``raw [bk, words]`` (int32 words, or float32 elements) as its float32
    planes ``[bk, run.words]`` each, in order."""
    x = raw[:, run.word:run.word + run.words]
    if run.kind == "f32":
        return [x.astype(jnp.float32)]
    if run.kind == "bf16":
        return [lax.bitcast_convert_type(x << 16, jnp.float32), lax.bitcast_convert_type(x & -65536, jnp.float32)]
    if run.kind != "e4m3":
        raise ValueError(f"{run.kind=} is not a run kind")
    byte = lambda w, k: (w >> 8 * k) & 255 if k else w & 255
    lane = lax.broadcasted_iota(jnp.int32, (1, run.words), 1)
    bits = None
    for first, scale_word, scale_byte in run.scales:  # each chunk's scale over its lanes
        s = raw[:, scale_word:scale_word + 1]
        if run.scale_kind == "f32":
            chunk_bits = s
        elif run.scale_kind == "e8m0":
            chunk_bits = byte(s, scale_byte) << 23
        else:
            raise ValueError(f"{run.scale_kind=} is not a scale format")
        bits = chunk_bits if bits is None else jnp.where(lane >= first, chunk_bits, bits)
    scale = lax.bitcast_convert_type(jnp.broadcast_to(bits, x.shape), jnp.float32)
    return [e4m3_by_integers(byte(x, k)) * scale for k in range(4)]


def _permute(x, order: tuple[int, ...]):
    """``x``'s last axis in ``order`` (no copy when it is the identity)."""
    return x if order == tuple(range(x.shape[-1])) else jnp.take(x, np.asarray(order), axis=-1)


def _dot(a, b, contract_b: int, plan: _Plan):
    """``a [m, k] . b`` contracting b's axis ``contract_b``, float32 accumulation."""
    return lax.dot_general(a.astype(plan.operand), b.astype(plan.operand), (((1,), (contract_b,)), ((), ())),
                           precision=plan.precision, preferred_element_type=jnp.float32)


def _kernel(*refs, plan: _Plan):
    """One (request and query token, split). Refs: per source its ids (SMEM i32[BT * S * Ks], valid
    ones first in each part) and valid count (SMEM i32[BT]); the queries; the sinks if any; the
    pools (HBM); the outputs; the scratch."""
    refs = list(refs)
    sources = [(refs.pop(0), refs.pop(0)) for _ in range(plan.sources)]
    q_value_ref = refs.pop(0)  # [1, Np, Cv] query columns that meet value chunks (MLA: q_latent; V4: q)
    q_key_ref = refs.pop(0) if plan.has_key else None  # [1, Np, Rk] columns of key-only chunks (MLA: q_rope)
    sink_ref = refs.pop(0) if plan.has_sink else None  # f32[Np, 1] per-head sink logits
    pools = [refs.pop(0) for _ in range(plan.sources)]  # HBM [Ps, words] each (u32, or f32 rows)
    out_ref, lse_ref = refs.pop(0), refs.pop(0)  # f32[1, 1, Np, Cv], f32[1, 1, Np, 1]
    # [2, bk, words] rows (two buffers), DMA semaphores [2], f32[bk, Cv + Rk], f32[Np, 1] m and l, f32[Np, Cv]
    rows_ref, sems, rows_f32, m_ref, l_ref, acc_ref = refs
    bk, cv = plan.block_k, plan.value_width
    bt, split = pl.program_id(0), pl.program_id(1)
    q_value = q_value_ref[0]
    q_key = q_key_ref[0] if plan.has_key else None
    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for (ids_ref, count_ref), pool_ref in zip(sources, pools):
        ks = ids_ref.shape[0] // (count_ref.shape[0] * plan.splits)  # ids per part
        first = (bt * plan.splits + split) * ks  # this part's first id in ids_ref
        in_split = jnp.maximum((count_ref[bt] - split + plan.splits - 1) // plan.splits, 0)  # its valid ids
        blocks = (in_split + bk - 1) // bk

        def copies(j, slot, action, ids_ref=ids_ref, pool_ref=pool_ref, first=first, in_split=in_split):
            """Start (or wait for) the DMAs of block j's valid rows into rows_ref[slot]."""
            def one(i, carry):
                row = ids_ref[first + j * bk + i]
                copy = pltpu.make_async_copy(pool_ref.at[pl.ds(row, 1)], rows_ref.at[slot, pl.ds(i, 1)], sems.at[slot])
                copy.start() if action == "start" else copy.wait()
                return carry

            lax.fori_loop(0, jnp.minimum(in_split - j * bk, bk), one, None)

        @pl.when(blocks > 0)
        def _(copies=copies):
            copies(0, 0, "start")

        def block(j, carry, copies=copies, blocks=blocks, in_split=in_split):
            slot = j % 2

            @pl.when(j + 1 < blocks)
            def _():
                copies(j + 1, 1 - slot, "start")

            copies(j, slot, "wait")
            n = jnp.minimum(in_split - j * bk, bk)  # valid rows of this block: the first n
            raw = rows_ref[slot]
            if raw.dtype != jnp.float32:
                raw = lax.bitcast_convert_type(raw, jnp.int32)
            valid_rows = lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < n
            for run in plan.words.runs:
                for k, plane in enumerate(_run_planes(raw, run)):
                    column = run.column + k * run.words
                    rows_f32[:, column:column + run.words] = jnp.where(valid_rows, plane, 0.0)
            values = rows_f32[:, :cv]
            s = _dot(q_value, values, 1, plan)
            if plan.has_key:
                s = s + _dot(q_key, rows_f32[:, cv:], 1, plan)
            s = jnp.where(lax.broadcasted_iota(jnp.int32, (1, bk), 1) < n, s * plan.scale, NEG_INF)  # f32[Np, bk]
            m = m_ref[...]
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen
            p = jnp.exp(s - m_safe)  # 0 past the count
            l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[...] = acc_ref[...] * alpha + _dot(p, values, 0, plan)
            m_ref[...] = m_new
            return carry

        lax.fori_loop(0, blocks, block, None)

    m, l = m_ref[...], l_ref[...]
    lse, weight = finish_softmax(m, l, sink_ref[...] if plan.has_sink else None)
    out_ref[0, 0] = acc_ref[...] * weight
    lse_ref[0, 0] = lse


def gather_attention(q_value_BTNC, q_key_BTNR, sources, sinks_N, *, layout: RowLayout, scale: float,
                     block_k: int, num_splits: int | None, interpret, name: str):
    """``_gather_attention.gather_attention`` on Mosaic TPU: the same arguments and returns.
    ``interpret``: run in the TPU interpreter (``True`` or ``pltpu.InterpretParams``)."""
    b, t, n, cv = q_value_BTNC.shape
    k_blocks = max(-(-ids.shape[-1] // block_k) for _, ids in sources)
    splits = max(1, min(num_splits or 1, k_blocks))
    in_kernel_sink = sinks_N is not None and splits == 1
    float_inputs = [q_value_BTNC.dtype] + ([q_key_BTNR.dtype] if q_key_BTNR is not None else [])
    bf16_dots = layout.dtype in ("bfloat16", "uint8") and all(d == jnp.bfloat16 for d in float_inputs)
    words = _words(layout)
    plan = _Plan(layout, words, len(sources), q_key_BTNR is not None, in_kernel_sink, float(scale), block_k, splits,
                 bf16_dots)
    n_pad = round_up(n, HEAD_ALIGN)
    bt = b * t
    dealt = [deal_ids(ids, splits, block_k) for _, ids in sources]  # per source (i32[BT, S, Ks], i32[BT])
    whole = lambda shape: pl.BlockSpec(shape, lambda i, s, *_: (0,) * len(shape))
    per_query = lambda x: pl.BlockSpec((1, *x.shape[1:]), lambda i, s, *_: (i, 0, 0))
    q_value_BTNC = _permute(q_value_BTNC, words.value_order)  # in the planes' column order
    inputs = [pad_axis(q_value_BTNC, 2, n_pad, 0).reshape(bt, n_pad, cv)]
    if q_key_BTNR is not None:
        q_key_BTNR = _permute(q_key_BTNR, words.key_order)
        inputs.append(pad_axis(q_key_BTNR, 2, n_pad, 0).reshape(bt, n_pad, q_key_BTNR.shape[-1]))
    specs = [per_query(x) for x in inputs]
    queries = len(inputs)  # the inputs with a row per query (the rest go whole to every call)
    if in_kernel_sink:
        inputs.append(pad_axis(sinks_N.astype(jnp.float32), 0, n_pad, 0.0)[:, None])
        specs.append(whole((n_pad, 1)))
    f32_rows = layout.dtype == "float32"
    inputs += [pool if f32_rows or is_words(pool) else as_words(pool) for pool, _ in sources]
    specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(sources)
    row_bytes = 4 * sum(ids[0].size + 1 for ids, _ in dealt)  # one query's prefetched ids and counts
    rows = max(1, min(bt, PREFETCH_BYTES // row_bytes))
    outs = []
    for first in range(0, bt, rows):  # row ranges whose ids fit SMEM (one call unless the batch is large)
        last = min(bt, first + rows)
        prefetch = [x for ids, count in dealt for x in (ids[first:last].reshape(-1), count[first:last])]
        chunk = [x[first:last] for x in inputs[:queries]] + inputs[queries:]
        outs.append(_call(plan, chunk, specs, prefetch, last - first, n_pad, interpret, name))
    out_BTSNC, lse_BTSN1 = (jnp.concatenate(x, axis=0) if len(outs) > 1 else x[0] for x in zip(*outs))
    out_BTSNC = out_BTSNC.reshape(b, t, splits, n_pad, cv)[..., :n, :]
    lse_BTSN = lse_BTSN1.reshape(b, t, splits, n_pad)[..., :n]
    if splits == 1:
        out_BTNC, lse_BTN = out_BTSNC[:, :, 0], lse_BTSN[:, :, 0]
    else:
        out_BTNC, lse_BTN = merge_splits(out_BTSNC, lse_BTSN, sinks_N)
    return _permute(out_BTNC, tuple(np.argsort(words.value_order))), lse_BTN  # the columns back in order


def _call(plan: _Plan, inputs, specs, prefetch, bt: int, n_pad: int, interpret, name: str):
    """One kernel call over ``bt`` query rows: ``(out f32[bt, S, Np, Cv], lse f32[bt, S, Np, 1])``."""
    splits, block_k, cv = plan.splits, plan.block_k, plan.value_width
    f32_rows, key_width = plan.layout.dtype == "float32", sum(c.width for c in plan.layout.keys)
    out_shape = (jax.ShapeDtypeStruct((bt, splits, n_pad, cv), jnp.float32),
                 jax.ShapeDtypeStruct((bt, splits, n_pad, 1), jnp.float32))
    kernel = pl.pallas_call(
        lambda *refs: _kernel(*refs, plan=plan),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(bt, splits),
            in_specs=specs,
            out_specs=[pl.BlockSpec((1, 1, n_pad, cv), lambda i, s, *_: (i, s, 0, 0)),
                       pl.BlockSpec((1, 1, n_pad, 1), lambda i, s, *_: (i, s, 0, 0))],
            scratch_shapes=[pltpu.VMEM((2, block_k, plan.words.width), jnp.float32 if f32_rows else jnp.uint32),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((block_k, cv + key_width), jnp.float32),
                            pltpu.VMEM((n_pad, 1), jnp.float32), pltpu.VMEM((n_pad, 1), jnp.float32),
                            pltpu.VMEM((n_pad, cv), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=(interpret if isinstance(interpret, pltpu.InterpretParams)
                   else pltpu.InterpretParams() if interpret else False),
        name=name,
    )
    if interpret:  # behind a pure_callback, as the Mosaic GPU interpreter (see _gather_attention)
        return jax.pure_callback(jax.jit(kernel), out_shape, *prefetch, *inputs)
    return kernel(*prefetch, *inputs)

"""The Mosaic TPU kernels (``target="mosaic_tpu"``) in the TPU interpreter and the Mosaic GPU kernels
for GPUs without TMA / wgmma (``target="mosaic_gpu_sm80"``) in the Mosaic GPU interpreter, against the
references, each with its interpreter's race detector on: NaN-poisoned unused rows, -1 sentinels,
queries with 0, 1, K-1 and K valid ids, two blocks of ids (both TPU row buffers turn over), split-K,
float32 and bf16, the 656- and 592-byte FP8 rows (and the tiny presets' 100- and 96-byte ones); the
TPU kernels both on bf16 / uint8 pools and on the same rows as 32-bit words.
The Hopper kernels' interpreter tests are test_sparse_mla.py, test_sparse_v4_attention.py and
test_fp8_rows.py; every target's lowering is test_lowering.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter  # the detectors' state
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpreter
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from ess_jax.pallas_kernels import fp8_rows
from ess_jax.pallas_kernels.row_layout import as_words
from ess_jax.pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference
from ess_jax.pallas_kernels.sparse_v4_attention import sparse_v4_attention, sparse_v4_attention_reference
from kernel_testing import assert_close, permuted_ids, poison_unused, random_array, valid_counts

BLOCK_K = 64
B, T, N = 2, 2, 4
# each target's interpreter with race detection, and whether its detector has found a race
INTERPRETERS = {
    "mosaic_tpu": (pltpu.InterpretParams(detect_races=True), lambda: tpu_interpreter.races.races_found),
    "mosaic_gpu_sm80": (plgpu.InterpretGPUParams(detect_races=True), lambda: gpu_interpreter.get_races().races_found),
}
targets = pytest.mark.parametrize("target", sorted(INTERPRETERS))


def _run(target, kernel, reference, args, dtype, words=False, **kwargs):
    """The kernel in its target's interpreter vs its reference, no races; returns the kernel's (out, lse).
    ``words``: the TPU kernel gets the bf16 / uint8 pools as 32-bit words (``as_words``), the reference the rows."""
    interpret, races_found = INTERPRETERS[target]
    in_words = lambda x: as_words(x) if words and target == "mosaic_tpu" and x is not None and x.ndim == 2 else x
    out, lse = kernel(*map(in_words, args), target=target, interpret=interpret, **kwargs)
    assert not races_found()
    kwargs.pop("num_splits", None)
    ref_out, ref_lse = reference(*args, **kwargs)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    return np.asarray(out), np.asarray(lse)


def _ids(rng, k, rows):
    return permuted_ids(rng, valid_counts(B, T, k), k, rows)


@targets
@pytest.mark.parametrize("dtype, num_splits", [(jnp.float32, 1), (jnp.bfloat16, 3)])
def test_sparse_mla(target, dtype, num_splits):
    """tiny-v32's 80-wide rows (under one 128-element sm_80 row copy); float32 as three bf16 pieces on sm_80."""
    rng = np.random.default_rng(0)
    c, r, k, rows = 64, 16, BLOCK_K + 1, 2 * BLOCK_K + 8
    ids = _ids(rng, k, rows)
    pool = jnp.asarray(poison_unused(rng.standard_normal((rows, c + r)).astype(np.float32), ids), dtype)
    args = (random_array(rng, (B, T, N, c), dtype), random_array(rng, (B, T, N, r), dtype), pool, jnp.asarray(ids))
    out, lse = _run(target, sparse_mla, sparse_mla_reference, args, dtype, words=dtype == jnp.bfloat16, scale=0.3,
                    num_splits=num_splits)
    assert np.all(out[0, 0] == 0.0) and np.all(np.isneginf(lse[0, 0]))  # no valid id


@targets
@pytest.mark.parametrize("c, r, dtype", [(512, 64, jnp.bfloat16), (64, 16, jnp.float32)])
def test_sparse_mla_fp8(target, c, r, dtype):
    """The 656-byte rows (and tiny-v32's 100-byte ones); unused rows are 0xFF: NaN e4m3, scales, rope."""
    rng = np.random.default_rng(c)
    ids = _ids(rng, 9, 30)
    pool = np.asarray(fp8_rows.quantize_mla_rows(random_array(rng, (30, c + r), jnp.float32), latent_dim=c))
    args = (random_array(rng, (B, T, N, c), dtype), random_array(rng, (B, T, N, r), dtype),
            jnp.asarray(poison_unused(pool, ids)), jnp.asarray(ids))
    _run(target, fp8_rows.sparse_mla_fp8, fp8_rows.sparse_mla_fp8_reference, args, dtype, words=c == 512, scale=0.1)


def _v4_pools(rng, h, encode, k_window=9, k_entries=BLOCK_K + 1):
    window_ids, entry_ids = _ids(rng, k_window, 80), _ids(rng, k_entries, 80)
    pool = lambda ids: jnp.asarray(poison_unused(encode(rng.standard_normal((80, h)).astype(np.float32)), ids))
    return pool(window_ids), jnp.asarray(window_ids), pool(entry_ids), jnp.asarray(entry_ids)


@targets
@pytest.mark.parametrize("dtype, num_splits", [(jnp.float32, 1), (jnp.bfloat16, 2)])
def test_sparse_v4_attention(target, dtype, num_splits):
    """Window + entries with a finite sink; split-K adds the sink once, after the merge."""
    rng = np.random.default_rng(1)
    window, window_ids, entries, entry_ids = _v4_pools(rng, 64, lambda x: np.asarray(jnp.asarray(x, dtype)))
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    args = (random_array(rng, (B, T, N, 64), dtype), window, window_ids, entries, entry_ids, sinks)
    out, lse = _run(target, sparse_v4_attention, sparse_v4_attention_reference, args, dtype,
                    words=dtype == jnp.bfloat16, scale=0.125, num_splits=num_splits)
    assert np.all(out[0, 0] == 0.0)  # query (0, 0) selects nothing: the denominator is the sink alone
    np.testing.assert_allclose(lse[0, 0], np.asarray(sinks), rtol=1e-6)


@targets
def test_sparse_v4_attention_window_only_minus_inf_sink(target):
    rng = np.random.default_rng(2)
    window, window_ids, _, _ = _v4_pools(rng, 64, lambda x: x, k_window=BLOCK_K + 1)
    args = (random_array(rng, (B, T, N, 64), jnp.float32), window, window_ids, None, None, jnp.full((N,), -jnp.inf))
    out, lse = _run(target, sparse_v4_attention, sparse_v4_attention_reference, args, jnp.float32, scale=0.125)
    assert np.all(out[0, 0] == 0.0) and np.all(np.isneginf(lse[0, 0]))


@targets
@pytest.mark.parametrize("h, r, dtype, num_splits", [(512, 64, jnp.bfloat16, 1), (64, 16, jnp.float32, 2)])
def test_sparse_v4_attention_fp8(target, h, r, dtype, num_splits):
    """The 592-byte rows (and tiny-v4's 96-byte ones): e4m3 chunks with ue8m0 scales, bf16 rope pairs."""
    rng = np.random.default_rng(h)
    encode = lambda x: np.asarray(fp8_rows.quantize_v4_rows(jnp.asarray(x), rope_dim=r))
    window, window_ids, entries, entry_ids = _v4_pools(rng, h, encode, k_entries=9)
    args = (random_array(rng, (B, T, N, h), dtype), window, window_ids, entries, entry_ids,
            jnp.asarray(rng.standard_normal(N), jnp.float32))
    _run(target, fp8_rows.sparse_v4_attention_fp8, fp8_rows.sparse_v4_attention_fp8_reference, args, dtype,
         words=h == 64, scale=0.1, rope_dim=r, num_splits=num_splits)


def test_tpu_batches_whose_ids_overflow_smem_run_in_row_ranges(monkeypatch):
    """A batch whose scalar-prefetched ids pass ``PREFETCH_BYTES`` (SMEM) runs as calls over row ranges: with room
    for three query rows' ids, the 4 rows (B x T) as calls of 3 and 1 rows; the reference's output, and the same bits
    as one call's."""
    from ess_jax.pallas_kernels import _gather_attention_tpu

    rng = np.random.default_rng(5)
    window, window_ids, entries, entry_ids = _v4_pools(rng, 64, lambda x: x)
    args = (random_array(rng, (B, T, N, 64), jnp.float32), window, window_ids, entries, entry_ids,
            jnp.asarray(rng.standard_normal(N), jnp.float32))
    whole = _run("mosaic_tpu", sparse_v4_attention, sparse_v4_attention_reference, args, jnp.float32, scale=0.125)
    calls = []
    real_call = _gather_attention_tpu._call
    monkeypatch.setattr(_gather_attention_tpu, "_call", lambda *a: calls.append(a[4]) or real_call(*a))
    row_bytes = 4 * (BLOCK_K + 1 + 2 * BLOCK_K + 1)  # a query's ids (9 and 65, dealt to 1 and 2 blocks) and counts
    monkeypatch.setattr(_gather_attention_tpu, "PREFETCH_BYTES", 3 * row_bytes + 1)
    jax.clear_caches()  # traced again, under the budget
    pieces = _run("mosaic_tpu", sparse_v4_attention, sparse_v4_attention_reference, args, jnp.float32, scale=0.125)
    assert calls == [3, 1], calls
    np.testing.assert_array_equal(pieces[0], whole[0])
    np.testing.assert_array_equal(pieces[1], whole[1])


def test_tpu_race_detector_sees_an_unawaited_dma():
    """The TPU detector is live: a kernel that reads a VMEM buffer while a DMA into it is in flight is
    reported (so the kernels' clean runs above mean something)."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    jax.block_until_ready(pl.pallas_call(
        racy, out_shape=x, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=INTERPRETERS["mosaic_tpu"][0])(x))
    assert INTERPRETERS["mosaic_tpu"][1]()
    tpu_interpreter.reset_tpu_interpret_mode_state()


def test_sm80_rows_too_wide_for_shared_memory_are_refused():
    """float32 queries against 656-byte rows need three bf16 pieces per operand: more than the 99 KiB
    of an sm_86 / sm_89 block; bf16 queries fit."""
    S = jax.ShapeDtypeStruct
    args = lambda dtype: (S((1, 1, 64, 512), dtype), S((1, 1, 64, 64), dtype), S((4096, 656), jnp.uint8),
                          S((1, 1, 2048), jnp.int32))
    with pytest.raises(ValueError, match=r"sparse_mla_fp8: one program needs \d+ KiB .* 99 KiB of an sm_86"):
        fp8_rows.sparse_mla_fp8.trace(*args(jnp.float32), scale=0.1, target="mosaic_gpu_sm80")
    fp8_rows.sparse_mla_fp8.trace(*args(jnp.bfloat16), scale=0.1, target="mosaic_gpu_sm80")

"""The Mosaic GPU kernels for GPUs without TMA / wgmma (``target="mosaic_gpu_sm80"``: plain row
copies, Ampere ``mma``) in the Mosaic GPU interpreter against the references, with its race
detector (NaN-poisoned unused rows, -1 sentinels, queries with 0, 1, K-1 and K valid ids, two blocks
of ids, split-K, float32 and bf16, the 656- and 584-byte FP8 rows), and lowered for abstract
"NVIDIA A100" (sm_80) and "NVIDIA L40" (sm_89) devices at DeepSeek's real shapes and a tiny preset's
(tests/kernels/test_lowering.py's cases) to a Mosaic GPU module that issues ``mma.sync`` and neither
TMA copies nor wgmma. Compiling the module to PTX and running it needs jaxlib's CUDA plugin and a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races  # the detector's state
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh

from ess_jax.pallas_kernels import fp8_rows
from ess_jax.pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference
from ess_jax.pallas_kernels.sparse_v4_attention import sparse_v4_attention, sparse_v4_attention_reference
from kernel_testing import assert_close, permuted_ids, poison_unused, random_array, valid_counts
from test_lowering import CASES

BLOCK_K = 64
B, T, N = 2, 2, 4
RACES = plgpu.InterpretGPUParams(detect_races=True)


def _run(kernel, reference, args, dtype, **kwargs):
    out, lse = kernel(*args, target="mosaic_gpu_sm80", interpret=RACES, **kwargs)
    assert not get_races().races_found
    kwargs.pop("num_splits", None)
    ref_out, ref_lse = reference(*args, **kwargs)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    return np.asarray(out), np.asarray(lse)


def _ids(rng, k, rows):
    return permuted_ids(rng, valid_counts(B, T, k), k, rows)


@pytest.mark.parametrize("dtype, num_splits", [(jnp.float32, 1), (jnp.bfloat16, 2)])
def test_sparse_mla(dtype, num_splits):
    """float32 operands as three bf16 pieces on the MMA; 80-wide rows, under one 128-element copy."""
    rng = np.random.default_rng(0)
    c, r, k, rows = 64, 16, BLOCK_K + 1, 2 * BLOCK_K + 8
    ids = _ids(rng, k, rows)
    pool = jnp.asarray(poison_unused(rng.standard_normal((rows, c + r)).astype(np.float32), ids), dtype)
    args = (random_array(rng, (B, T, N, c), dtype), random_array(rng, (B, T, N, r), dtype), pool, jnp.asarray(ids))
    out, lse = _run(sparse_mla, sparse_mla_reference, args, dtype, scale=0.3, num_splits=num_splits)
    assert np.all(out[0, 0] == 0.0) and np.all(np.isneginf(lse[0, 0]))  # no valid id


def test_sparse_mla_fp8():
    """The 656-byte rows; unused rows are 0xFF: NaN e4m3, scales, rope."""
    rng = np.random.default_rng(1)
    c, r = 512, 64
    ids = _ids(rng, 9, 30)
    pool = np.asarray(fp8_rows.quantize_mla_rows(random_array(rng, (30, c + r), jnp.float32), latent_dim=c))
    args = (random_array(rng, (B, T, N, c), jnp.bfloat16), random_array(rng, (B, T, N, r), jnp.bfloat16),
            jnp.asarray(poison_unused(pool, ids)), jnp.asarray(ids))
    _run(fp8_rows.sparse_mla_fp8, fp8_rows.sparse_mla_fp8_reference, args, jnp.bfloat16, scale=0.1)


def _v4_pools(rng, h, encode, k_entries=BLOCK_K + 1):
    window_ids, entry_ids = _ids(rng, 9, 80), _ids(rng, k_entries, 80)
    pool = lambda ids: jnp.asarray(poison_unused(encode(rng.standard_normal((80, h)).astype(np.float32)), ids))
    return pool(window_ids), jnp.asarray(window_ids), pool(entry_ids), jnp.asarray(entry_ids)


@pytest.mark.parametrize("dtype, num_splits", [(jnp.float32, 1), (jnp.bfloat16, 2)])
def test_sparse_v4_attention(dtype, num_splits):
    """Window + entries with a finite sink; split-K adds the sink once, after the merge."""
    rng = np.random.default_rng(2)
    window, window_ids, entries, entry_ids = _v4_pools(rng, 64, lambda x: np.asarray(jnp.asarray(x, dtype)))
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    args = (random_array(rng, (B, T, N, 64), dtype), window, window_ids, entries, entry_ids, sinks)
    out, lse = _run(sparse_v4_attention, sparse_v4_attention_reference, args, dtype, scale=0.125,
                    num_splits=num_splits)
    assert np.all(out[0, 0] == 0.0)  # query (0, 0) selects nothing: the denominator is the sink alone
    np.testing.assert_allclose(lse[0, 0], np.asarray(sinks), rtol=1e-6)


def test_sparse_v4_attention_fp8():
    """The 584-byte rows: e4m3 chunks with ue8m0 scales, bf16 rope byte pairs."""
    rng = np.random.default_rng(3)
    encode = lambda x: np.asarray(fp8_rows.quantize_v4_rows(jnp.asarray(x), rope_dim=64))
    window, window_ids, entries, entry_ids = _v4_pools(rng, 512, encode, k_entries=9)
    args = (random_array(rng, (B, T, N, 512), jnp.bfloat16), window, window_ids, entries, entry_ids,
            jnp.asarray(rng.standard_normal(N), jnp.float32))
    _run(fp8_rows.sparse_v4_attention_fp8, fp8_rows.sparse_v4_attention_fp8_reference, args, jnp.bfloat16,
         scale=0.1, rope_dim=64)


@pytest.mark.parametrize("device_kind, name", [
    ("NVIDIA A100", "sparse_mla"), ("NVIDIA A100", "sparse_mla_fp8"), ("NVIDIA A100", "sparse_v4_attention"),
    ("NVIDIA A100", "sparse_v4_attention_fp8"), ("NVIDIA L40", "sparse_mla split-k"),
    ("NVIDIA L40", "sparse_v4_attention_fp8 tiny"),
])
def test_lowers_without_tma_or_wgmma(device_kind, name):
    fn, args, kwargs = CASES[name]
    gpu = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None,
                                                                      platform="gpu"))
    with jax.sharding.use_abstract_mesh(gpu):
        text = fn.trace(*args, scale=0.1, target="mosaic_gpu_sm80", **kwargs).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and f"{name.split()[0]}_mosaic_gpu" in text
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "cp.async.bulk" not in text and "wgmma" not in text


def test_rows_too_wide_for_shared_memory_are_refused():
    """float32 queries against 656-byte rows need three bf16 pieces per operand: more than the 99 KiB
    of an sm_86 / sm_89 block; bf16 queries fit."""
    S = jax.ShapeDtypeStruct
    args = lambda dtype: (S((1, 1, 64, 512), dtype), S((1, 1, 64, 64), dtype), S((4096, 656), jnp.uint8),
                          S((1, 1, 2048), jnp.int32))
    with pytest.raises(ValueError, match=r"sparse_mla_fp8: one program needs \d+ KiB .* 99 KiB of an sm_86"):
        fp8_rows.sparse_mla_fp8.trace(*args(jnp.float32), scale=0.1, target="mosaic_gpu_sm80")
    fp8_rows.sparse_mla_fp8.trace(*args(jnp.bfloat16), scale=0.1, target="mosaic_gpu_sm80")

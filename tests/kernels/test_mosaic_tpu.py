"""The Mosaic TPU kernels (``target="mosaic_tpu"``) in the TPU interpreter against the references,
with its race detector over their row DMAs and buffers (NaN-poisoned unused rows, -1 sentinels,
queries with 0, 1, K-1 and K valid ids, two blocks of ids so both buffers turn over, split-K, float32
and bf16), and lowered with ``jax.export(..., platforms=["tpu"])`` for abstract TPUs at DeepSeek's
real shapes and the tiny presets' (tests/kernels/test_lowering.py's cases): one Mosaic TPU custom
call per kernel, over the real operands. Lowering proves the kernels pass Pallas' TPU rules (block
shapes, memory spaces, scalar prefetch, DMA and semaphore types); compiling the Mosaic module to a
TPU executable needs libtpu and a TPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter  # the detector's state
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh

from ess_jax.pallas_kernels import fp8_rows
from ess_jax.pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference
from ess_jax.pallas_kernels.sparse_v4_attention import sparse_v4_attention, sparse_v4_attention_reference
from kernel_testing import assert_close, permuted_ids, poison_unused, random_array, valid_counts
from test_lowering import CASES

BLOCK_K = 64
B, T, N = 2, 2, 4
RACES = pltpu.InterpretParams(detect_races=True)


def _run(kernel, reference, args, dtype, **kwargs):
    """The kernel in the interpreter vs its reference; no races; returns the kernel's (out, lse)."""
    out, lse = kernel(*args, target="mosaic_tpu", interpret=RACES, **kwargs)
    assert not tpu_interpreter.races.races_found
    kwargs.pop("num_splits", None)
    ref_out, ref_lse = reference(*args, **kwargs)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    return np.asarray(out), np.asarray(lse)


def _ids(rng, k, rows):
    return permuted_ids(rng, valid_counts(B, T, k), k, rows)


@pytest.mark.parametrize("dtype, num_splits", [(jnp.float32, 1), (jnp.bfloat16, 1), (jnp.float32, 3)])
def test_sparse_mla(dtype, num_splits):
    rng = np.random.default_rng(0)
    c, r, k, rows = 64, 16, BLOCK_K + 1, 2 * BLOCK_K + 8
    ids = _ids(rng, k, rows)
    pool = jnp.asarray(poison_unused(rng.standard_normal((rows, c + r)).astype(np.float32), ids), dtype)
    args = (random_array(rng, (B, T, N, c), dtype), random_array(rng, (B, T, N, r), dtype), pool, jnp.asarray(ids))
    out, lse = _run(sparse_mla, sparse_mla_reference, args, dtype, scale=0.3, num_splits=num_splits)
    assert np.all(out[0, 0] == 0.0) and np.all(np.isneginf(lse[0, 0]))  # no valid id


@pytest.mark.parametrize("c, r, dtype", [(512, 64, jnp.bfloat16), (64, 16, jnp.float32)])
def test_sparse_mla_fp8(c, r, dtype):
    """The 656-byte rows (and tiny-v32's 100-byte ones); unused rows are 0xFF: NaN e4m3, scales, rope."""
    rng = np.random.default_rng(c)
    ids = _ids(rng, 9, 30)
    pool = np.asarray(fp8_rows.quantize_mla_rows(random_array(rng, (30, c + r), jnp.float32), latent_dim=c))
    args = (random_array(rng, (B, T, N, c), dtype), random_array(rng, (B, T, N, r), dtype),
            jnp.asarray(poison_unused(pool, ids)), jnp.asarray(ids))
    _run(fp8_rows.sparse_mla_fp8, fp8_rows.sparse_mla_fp8_reference, args, dtype, scale=0.1)


def _v4_pools(rng, h, encode, k_window=9, k_entries=BLOCK_K + 1):
    window_ids, entry_ids = _ids(rng, k_window, 80), _ids(rng, k_entries, 80)
    pool = lambda rows, ids: jnp.asarray(poison_unused(encode(rng.standard_normal((rows, h)).astype(np.float32)), ids))
    return pool(80, window_ids), jnp.asarray(window_ids), pool(80, entry_ids), jnp.asarray(entry_ids)


@pytest.mark.parametrize("dtype, num_splits", [(jnp.float32, 1), (jnp.bfloat16, 2)])
def test_sparse_v4_attention(dtype, num_splits):
    """Window + entries with a finite sink; split-K adds the sink once, after the merge."""
    rng = np.random.default_rng(1)
    window, window_ids, entries, entry_ids = _v4_pools(rng, 64, lambda x: np.asarray(jnp.asarray(x, dtype)))
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    args = (random_array(rng, (B, T, N, 64), dtype), window, window_ids, entries, entry_ids, sinks)
    out, lse = _run(sparse_v4_attention, sparse_v4_attention_reference, args, dtype, scale=0.125,
                    num_splits=num_splits)
    assert np.all(out[0, 0] == 0.0)  # query (0, 0) selects nothing: the denominator is the sink alone
    np.testing.assert_allclose(lse[0, 0], np.asarray(sinks), rtol=1e-6)


def test_sparse_v4_attention_window_only_minus_inf_sink():
    rng = np.random.default_rng(2)
    window, window_ids, _, _ = _v4_pools(rng, 64, lambda x: x, k_window=BLOCK_K + 1)
    args = (random_array(rng, (B, T, N, 64), jnp.float32), window, window_ids, None, None, jnp.full((N,), -jnp.inf))
    out, lse = _run(sparse_v4_attention, sparse_v4_attention_reference, args, jnp.float32, scale=0.125)
    assert np.all(out[0, 0] == 0.0) and np.all(np.isneginf(lse[0, 0]))


@pytest.mark.parametrize("h, r, dtype, num_splits", [(512, 64, jnp.bfloat16, 1), (64, 16, jnp.float32, 2)])
def test_sparse_v4_attention_fp8(h, r, dtype, num_splits):
    """The 584-byte rows (and tiny-v4's 88-byte ones): e4m3 chunks with ue8m0 scales, bf16 rope pairs."""
    rng = np.random.default_rng(h)
    encode = lambda x: np.asarray(fp8_rows.quantize_v4_rows(jnp.asarray(x), rope_dim=r))
    window, window_ids, entries, entry_ids = _v4_pools(rng, h, encode)
    args = (random_array(rng, (B, T, N, h), dtype), window, window_ids, entries, entry_ids,
            jnp.asarray(rng.standard_normal(N), jnp.float32))
    _run(fp8_rows.sparse_v4_attention_fp8, fp8_rows.sparse_v4_attention_fp8_reference, args, dtype, scale=0.1,
         rope_dim=r, num_splits=num_splits)


def test_race_detector_sees_an_unawaited_dma():
    """The detector is live: a kernel that reads a VMEM buffer while a DMA into it is in flight is
    reported (so the kernels' clean runs above mean something)."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    jax.block_until_ready(pl.pallas_call(
        racy, out_shape=x, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())], interpret=RACES)(x))
    assert tpu_interpreter.races.races_found
    tpu_interpreter.reset_tpu_interpret_mode_state()


def _lower(name, device_kind):
    fn, args, kwargs = CASES[name]
    tpu = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=device_kind, num_cores=1,
                                                                      platform="tpu"))
    with jax.sharding.use_abstract_mesh(tpu):
        exported = jax.export.export(jax.jit(lambda *a: fn(*a, scale=0.1, target="mosaic_tpu", **kwargs)),
                                     platforms=["tpu"])(*args)
    return exported.mlir_module(), args


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_to_mosaic_tpu(name, device_kind):
    text, args = _lower(name, device_kind)
    calls = re.findall(r"stablehlo\.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) ->", text)
    assert [c[0] for c in calls] == ["tpu_custom_call"], text[:2000]
    (_, _, attributes, operands), = calls
    assert f'kernel_name = "{name.split()[0]}"' in attributes
    # the pools reach the kernel whole (gathered inside it, from HBM) and the queries in their dtype
    pools = [a for a in args if a.ndim == 2]
    for pool in pools:
        dtype = {"bfloat16": "bf16", "float32": "f32", "uint8": "ui8"}[pool.dtype.name]
        assert f"tensor<{pool.shape[0]}x{pool.shape[1]}x{dtype}>" in operands

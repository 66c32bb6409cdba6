"""The kernels compiled (not interpreted) on an accelerator, the device's own (``ops.resolve_kernels``:
on a CUDA GPU Hopper's TMA / wgmma kernels on sm_90, the sm_80 variant on other NVIDIA GPUs from
sm_80; on a TPU the Mosaic TPU kernels) against their references, at DeepSeek's real shapes and with
float32 rows at a tiny preset's (on GPUs the float32 operands as bf16 pieces on the tensor cores).
Each test runs once per accelerator, marked ``gpu`` or ``tpu`` and skipped with the reason where jax
sees no such device. Run on a runner with

    JAX_PLATFORMS=cuda,cpu .venv/bin/python -m pytest -m gpu
    JAX_PLATFORMS=tpu,cpu .venv/bin/python -m pytest -m tpu

(tests/conftest.py pins JAX_PLATFORMS=cpu unless it is set)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax import ops
from ess_jax.pallas_kernels import fp8_rows
from ess_jax.pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference
from ess_jax.pallas_kernels.sparse_v4_attention import sparse_v4_attention, sparse_v4_attention_reference
from kernel_testing import RUN_ON, accelerator, assert_close, permuted_ids, poison_unused, random_array, valid_counts


B, T = 2, 2  # queries (b, t) cycle through 0, 1, K-1 and K valid ids


@pytest.fixture(scope="module", params=[pytest.param(name, marks=getattr(pytest.mark, name)) for name in RUN_ON])
def device(request):
    return accelerator(request.param)


@pytest.fixture(scope="module")
def target(device):
    """The device's own kernel target; the choice looks at the default backend, so that must be this device's."""
    if jax.default_backend() != device.platform:
        pytest.skip(f"the default backend is not the {device.platform} (set JAX_PLATFORMS={device.platform},cpu)")
    return ops.resolve_kernels("pallas")


def _put(device, *xs):
    return [None if x is None else jax.device_put(jnp.asarray(x), device) for x in xs]


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mla_real_shape(device, target, fp8):
    rng = np.random.default_rng(0)
    n, c, r, k, rows = 128, 512, 64, 2048, 4096
    ids = permuted_ids(rng, valid_counts(B, T, k), k, rows)
    pool = rng.standard_normal((rows, c + r)).astype(np.float32)
    pool = np.asarray(fp8_rows.quantize_mla_rows(pool, latent_dim=c)) if fp8 else pool.astype(jnp.bfloat16)
    q_latent, q_rope = random_array(rng, (B, T, n, c), jnp.bfloat16), random_array(rng, (B, T, n, r), jnp.bfloat16)
    args = _put(device, q_latent, q_rope, poison_unused(pool, ids), ids)
    kernel, reference = ((fp8_rows.sparse_mla_fp8, fp8_rows.sparse_mla_fp8_reference) if fp8
                         else (sparse_mla, sparse_mla_reference))
    out, lse = kernel(*args, scale=0.1, target=target)
    ref_out, ref_lse = reference(*args, scale=0.1)
    assert out.devices() == {device}
    assert_close(out, ref_out, jnp.bfloat16, "out")
    assert_close(lse, ref_lse, jnp.bfloat16, "lse")


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_v4_attention_real_shape(device, target, fp8):
    rng = np.random.default_rng(1)
    n, h, r = 64, 512, 64
    window_ids = permuted_ids(rng, valid_counts(B, T, 128), 128, 512)
    entry_ids = permuted_ids(rng, valid_counts(B, T, 512), 512, 2048)
    pools = [rng.standard_normal((rows, h)).astype(np.float32) for rows in (512, 2048)]
    pools = [np.asarray(fp8_rows.quantize_v4_rows(p, rope_dim=r)) if fp8 else p.astype(jnp.bfloat16) for p in pools]
    args = _put(device, random_array(rng, (B, T, n, h), jnp.bfloat16), poison_unused(pools[0], window_ids),
                window_ids, poison_unused(pools[1], entry_ids), entry_ids, rng.standard_normal(n).astype(np.float32))
    if fp8:
        got = fp8_rows.sparse_v4_attention_fp8(*args, scale=512**-0.5, rope_dim=r, target=target)
        want = fp8_rows.sparse_v4_attention_fp8_reference(*args, scale=512**-0.5, rope_dim=r)
    else:
        got = sparse_v4_attention(*args, scale=512**-0.5, target=target)
        want = sparse_v4_attention_reference(*args, scale=512**-0.5)
    assert_close(got[0], want[0], jnp.bfloat16, "out")
    assert_close(got[1], want[1], jnp.bfloat16, "lse")


def test_auto_dispatch_picks_pallas_and_matches_xla(device, target):
    """float32 at tiny-v32's shape (C = 64, R = 16): float32 accuracy from the bf16 tensor cores."""
    assert ops.resolve_kernels("auto") == target
    rng = np.random.default_rng(2)
    ids = permuted_ids(rng, valid_counts(B, 1, 64), 64, 256)
    q_latent, q_rope = random_array(rng, (B, 1, 16, 64), jnp.float32), random_array(rng, (B, 1, 16, 16), jnp.float32)
    pool = random_array(rng, (256, 80), jnp.float32)
    args = _put(device, q_latent, q_rope, pool, ids)
    got = jax.jit(lambda *a: ops.sparse_mla_pool(*a, scale=0.1, kernels="auto"))(*args)
    want = jax.jit(lambda *a: ops.sparse_mla_pool(*a, scale=0.1, kernels="xla"))(*args)
    assert_close(got[0], want[0], jnp.float32, "out")
    assert_close(got[1], want[1], jnp.float32, "lse")

"""Both attention kernels (interpreted) and the XLA path of ``ess_jax.ops`` at T = 2 and 4 query tokens per row,
as a speculative decoding step reads them: query t of a row selects its own ids, most of them shared with the
queries before it (the union the tier resolves once), ending one row later each (causal lengths per position,
-1 past them, a padded row with none)."""

import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax import ops
from ess_jax.cache import RowSource
from ess_jax.pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference
from ess_jax.pallas_kernels.sparse_v4_attention import sparse_v4_attention, sparse_v4_attention_reference
from kernel_testing import assert_close, poison_unused, random_array

B, K, ROWS = 3, 20, 48


def verification_ids(rng, t: int) -> np.ndarray:
    """``i32[B, T, K]``: row b's query t sees rows 0..(12 + t) of its block, K of them picked (shared across the
    queries where they fall below each one's length), -1 past its length; the last row padded (all -1)."""
    ids = np.full((B, t, K), -1, np.int32)
    for b in range(B - 1):
        order = rng.permutation(16 + t)
        for q in range(t):
            visible = order[order <= 12 + q][:K]
            ids[b, q, :visible.size] = b * 16 + visible
    return ids


@pytest.mark.parametrize("t", [2, 4])
def test_sparse_mla_at_verification_tokens(t):
    rng = np.random.default_rng(t)
    ids = verification_ids(rng, t)
    pool = jnp.asarray(poison_unused(rng.standard_normal((ROWS, 64 + 16)).astype(np.float32), ids))
    q_latent, q_rope = random_array(rng, (B, t, 4, 64), jnp.float32), random_array(rng, (B, t, 4, 16), jnp.float32)
    ref = sparse_mla_reference(q_latent, q_rope, pool, jnp.asarray(ids), scale=0.3)
    kernel = sparse_mla(q_latent, q_rope, pool, jnp.asarray(ids), scale=0.3, interpret=True)
    xla = ops.mla_attention(q_latent, q_rope, [RowSource(pool, jnp.asarray(ids))], scale=0.3, kernels="xla")
    for got in (kernel, xla):
        assert_close(got[0], ref[0], jnp.float32, "out")
        assert_close(got[1], ref[1], jnp.float32, "lse")
    assert np.all(np.isneginf(np.asarray(kernel[1])[B - 1]))  # the padded row attends nothing


@pytest.mark.parametrize("t", [2, 4])
def test_sparse_v4_attention_at_verification_tokens(t):
    rng = np.random.default_rng(10 + t)
    entry_ids = verification_ids(rng, t)
    window_ids = np.where(entry_ids >= 0, (entry_ids * 7) % ROWS, -1).astype(np.int32)  # a window row per entry
    window = jnp.asarray(poison_unused(rng.standard_normal((ROWS, 64)).astype(np.float32), window_ids))
    entries = jnp.asarray(poison_unused(rng.standard_normal((ROWS, 64)).astype(np.float32), entry_ids))
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    q = random_array(rng, (B, t, 4, 64), jnp.float32)
    args = (q, window, jnp.asarray(window_ids), entries, jnp.asarray(entry_ids))
    ref = sparse_v4_attention_reference(*args, sinks, scale=0.125)
    kernel = sparse_v4_attention(*args, sinks, scale=0.125, interpret=True)
    xla = ops.sparse_sink_attention_pool(*args, sinks, scale=0.125, kernels="xla")
    for got in (kernel, xla):
        assert_close(got[0], ref[0], jnp.float32, "out")
        assert_close(got[1], ref[1], jnp.float32, "lse")

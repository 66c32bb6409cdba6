"""sparse_mla (the Mosaic GPU kernel in the Mosaic GPU interpreter) against its reference: poisoned
pools, -1 sentinels, masked queries, ids around the block size, permuted slots, head padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax.pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference
from kernel_testing import assert_close, permuted_ids, poison_unused, random_array, valid_counts

BLOCK_K = 64


def _case(seed, *, b, t, n, c, r, k, rows, dtype):
    rng = np.random.default_rng(seed)
    ids = permuted_ids(rng, valid_counts(b, t, k), k, rows)
    pool = poison_unused(rng.standard_normal((rows, c + r)).astype(np.float32), ids)
    return (random_array(rng, (b, t, n, c), dtype), random_array(rng, (b, t, n, r), dtype),
            jnp.asarray(pool, dtype), jnp.asarray(ids))


@pytest.mark.parametrize("k, dtype", [(BLOCK_K - 1, jnp.float32), (BLOCK_K, jnp.float32), (BLOCK_K + 1, jnp.float32),
                                      (BLOCK_K - 1, jnp.bfloat16), (2 * BLOCK_K + 1, jnp.bfloat16)])
def test_matches_reference(k, dtype):
    q_latent, q_rope, pool, ids = _case(k, b=2, t=2, n=4, c=64, r=16, k=k, rows=2 * BLOCK_K + 8, dtype=dtype)
    out, lse = sparse_mla(q_latent, q_rope, pool, ids, scale=0.3, block_k=BLOCK_K, interpret=True)
    ref_out, ref_lse = sparse_mla_reference(q_latent, q_rope, pool, ids, scale=0.3)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    masked = np.asarray(ids).max(axis=-1) < 0  # queries with no valid id
    assert masked.any()
    assert np.all(np.asarray(out)[masked] == 0.0) and np.all(np.isneginf(np.asarray(lse)[masked]))


def test_head_blocks_and_padding():
    """70 heads in blocks of 64 (the last one padded), several query tokens, no rope."""
    q_latent, q_rope, pool, ids = _case(7, b=1, t=3, n=70, c=32, r=0, k=11, rows=30, dtype=jnp.float32)
    out, lse = sparse_mla(q_latent, q_rope, pool, ids, scale=0.2, interpret=True)
    ref_out, ref_lse = sparse_mla_reference(q_latent, q_rope, pool, ids, scale=0.2)
    assert_close(out, ref_out, jnp.float32, "out")
    assert_close(lse, ref_lse, jnp.float32, "lse")


def test_real_width_rows():
    """DeepSeek-V3.2's row: C = 512, R = 64."""
    q_latent, q_rope, pool, ids = _case(3, b=1, t=1, n=16, c=512, r=64, k=40, rows=64, dtype=jnp.bfloat16)
    out, lse = sparse_mla(q_latent, q_rope, pool, ids, scale=0.05, interpret=True)
    ref_out, ref_lse = sparse_mla_reference(q_latent, q_rope, pool, ids, scale=0.05)
    assert_close(out, ref_out, jnp.bfloat16, "out")
    assert_close(lse, ref_lse, jnp.bfloat16, "lse")


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_k_matches_reference(num_splits):
    """The ids dealt to parts attended by separate programs, merged by log-sum-exp."""
    q_latent, q_rope, pool, ids = _case(11, b=2, t=2, n=4, c=64, r=16, k=2 * BLOCK_K + 3, rows=2 * BLOCK_K + 8,
                                        dtype=jnp.float32)
    out, lse = sparse_mla(q_latent, q_rope, pool, ids, scale=0.3, block_k=BLOCK_K, num_splits=num_splits,
                          interpret=True)
    ref_out, ref_lse = sparse_mla_reference(q_latent, q_rope, pool, ids, scale=0.3)
    assert_close(out, ref_out, jnp.float32, "out")
    assert_close(lse, ref_lse, jnp.float32, "lse")


def test_order_of_ids_does_not_matter():
    k = BLOCK_K + 13  # two blocks of ids
    q_latent, q_rope, pool, ids = _case(5, b=2, t=1, n=4, c=64, r=16, k=k, rows=k + 8, dtype=jnp.float32)
    perm = np.random.default_rng(0).permutation(k)
    a = sparse_mla(q_latent, q_rope, pool, ids, scale=0.3, interpret=True)
    b = sparse_mla(q_latent, q_rope, pool, ids[..., perm], scale=0.3, interpret=True)
    for x, y, name in zip(a, b, ("out", "lse")):
        assert_close(x, y, jnp.float32, name)


@pytest.mark.parametrize("bad, match", [
    (dict(q_latent=jnp.zeros((2, 1, 4))), "q_latent_BTNC"),
    (dict(q_rope=jnp.zeros((2, 1, 3, 16))), "q_rope_BTNR"),
    (dict(pool=jnp.zeros((10, 81))), "pool_PW"),
    (dict(pool=jnp.zeros((10, 80), jnp.int32)), "pool_PW"),
    (dict(ids=jnp.zeros((2, 2, 5), jnp.int32)), "ids_BTK"),
    (dict(ids=jnp.zeros((2, 1, 5), jnp.float32)), "ids_BTK"),
    (dict(block_k=32), "block_k"),
    (dict(q_latent=jnp.zeros((2, 1, 4, 60)), pool=jnp.zeros((10, 76))), "multiple of 8 columns"),
    (dict(num_splits=0), "num_splits"),
    (dict(pool=jnp.zeros((10, 40), jnp.uint32)), "pool_PW holds 32-bit words .* target='mosaic_gpu'"),
    (dict(pool=jnp.zeros((10, 41), jnp.uint32), target="mosaic_tpu"), r"pool_PW as words must be u32\[P, \(C \+ R\)"),
])
def test_input_checks_name_the_argument(bad, match):
    args = dict(q_latent=jnp.zeros((2, 1, 4, 64)), q_rope=jnp.zeros((2, 1, 4, 16)), pool=jnp.zeros((10, 80)),
                ids=jnp.zeros((2, 1, 5), jnp.int32), block_k=64, num_splits=None, target="mosaic_gpu")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        sparse_mla(args["q_latent"], args["q_rope"], args["pool"], args["ids"], scale=1.0, block_k=args["block_k"],
                   num_splits=args["num_splits"], target=args["target"], interpret=True)


def test_reference_refuses_word_pools():
    """Word pools are the mosaic_tpu kernels' form; the reference reads the rows themselves."""
    with pytest.raises(ValueError, match="pool_PW holds 32-bit words .* the reference"):
        sparse_mla_reference(jnp.zeros((1, 1, 4, 64)), jnp.zeros((1, 1, 4, 16)), jnp.zeros((10, 40), jnp.uint32),
                             jnp.zeros((1, 1, 5), jnp.int32), scale=1.0)


def test_rows_too_wide_for_shared_memory_are_refused():
    """float32 rows of DeepSeek's width (576) need more than an H100 / H200 block's 227 KiB of shared
    memory (three bf16 pieces per operand); bf16 rows of that width fit."""
    S = jax.ShapeDtypeStruct
    args = lambda dtype: (S((1, 1, 64, 512), dtype), S((1, 1, 64, 64), dtype), S((4096, 576), dtype),
                          S((1, 1, 2048), jnp.int32))
    with pytest.raises(ValueError, match=r"sparse_mla: one program needs \d+ KiB of shared memory"):
        sparse_mla.trace(*args(jnp.float32), scale=0.1)
    sparse_mla.trace(*args(jnp.bfloat16), scale=0.1)

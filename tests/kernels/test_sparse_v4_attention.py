"""sparse_v4_attention (the Mosaic GPU kernel in the Mosaic GPU interpreter) against its reference:
window + selected (CSA) or all visible (HCA) entries, window-only layers, finite and -inf sinks,
poisoned pools, -1 sentinels."""

import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax.pallas_kernels.sparse_v4_attention import sparse_v4_attention, sparse_v4_attention_reference
from kernel_testing import assert_close, permuted_ids, poison_unused, random_array, valid_counts

BLOCK_K = 64
B, T, N, H = 2, 2, 4, 64


def _pools(rng, k_window, k_entries, *, window_rows=BLOCK_K + 16, entry_rows=2 * BLOCK_K + 8, dtype=jnp.float32):
    window_ids = permuted_ids(rng, valid_counts(B, T, k_window), k_window, window_rows)
    entry_ids = permuted_ids(rng, valid_counts(B, T, k_entries), k_entries, entry_rows)
    window = poison_unused(rng.standard_normal((window_rows, H)).astype(np.float32), window_ids)
    entries = poison_unused(rng.standard_normal((entry_rows, H)).astype(np.float32), entry_ids)
    return jnp.asarray(window, dtype), jnp.asarray(window_ids), jnp.asarray(entries, dtype), jnp.asarray(entry_ids)


def _check(args, dtype, *, sinks, **knobs):
    out, lse = sparse_v4_attention(*args, sinks, scale=0.125, interpret=True, **knobs)
    ref_out, ref_lse = sparse_v4_attention_reference(*args, sinks, scale=0.125)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    return np.asarray(out), np.asarray(lse)


@pytest.mark.parametrize("k_window, k_entries", [(BLOCK_K - 1, BLOCK_K), (BLOCK_K + 1, 2 * BLOCK_K + 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_plus_selected_entries(k_window, k_entries, dtype):
    rng = np.random.default_rng(k_window)
    window, window_ids, entries, entry_ids = _pools(rng, k_window, k_entries, dtype=dtype)
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    q = random_array(rng, (B, T, N, H), dtype)
    out, lse = _check((q, window, window_ids, entries, entry_ids), dtype, sinks=sinks)
    # query (0, 0) selects nothing from either source: out 0, the denominator is the sink alone
    assert np.all(out[0, 0] == 0.0)
    np.testing.assert_allclose(lse[0, 0], np.asarray(sinks), rtol=1e-6)


def test_all_visible_entries_hca():
    """HCA: every entry ``w < floor((t + 1) / 128)`` of the request, ids ``b * M + w``."""
    rng = np.random.default_rng(1)
    m, k_window = 6, 9
    window_ids = permuted_ids(rng, valid_counts(B, T, k_window), k_window, 40)
    visible_BT = np.array([[0, 3], [5, 6]])
    w = np.arange(m)
    entry_ids = np.where(w[None, None, :] < visible_BT[..., None], np.arange(B)[:, None, None] * m + w, -1)
    window = poison_unused(rng.standard_normal((40, H)).astype(np.float32), window_ids)
    entries = poison_unused(rng.standard_normal((B * m, H)).astype(np.float32), entry_ids)
    q = random_array(rng, (B, T, N, H), jnp.float32)
    _check((q, jnp.asarray(window), jnp.asarray(window_ids), jnp.asarray(entries), jnp.asarray(entry_ids, jnp.int32)),
           jnp.float32, sinks=jnp.asarray(rng.standard_normal(N), jnp.float32))


def test_window_only_and_minus_inf_sink():
    rng = np.random.default_rng(2)
    window, window_ids, _, _ = _pools(rng, BLOCK_K + 1, 1)
    q = random_array(rng, (B, T, N, H), jnp.float32)
    out, lse = _check((q, window, window_ids, None, None), jnp.float32, sinks=jnp.full((N,), -jnp.inf))
    assert np.all(out[0, 0] == 0.0) and np.all(np.isneginf(lse[0, 0]))


@pytest.mark.parametrize("sink", [0.5, -jnp.inf])
def test_split_k_adds_the_sink_once(sink):
    """Split-K: each part runs without the sink; the merge adds it to the denominator once."""
    rng = np.random.default_rng(4)
    window, window_ids, entries, entry_ids = _pools(rng, BLOCK_K + 1, 2 * BLOCK_K + 1)
    q = random_array(rng, (B, T, N, H), jnp.float32)
    out, lse = _check((q, window, window_ids, entries, entry_ids), jnp.float32, sinks=jnp.full((N,), sink),
                      num_splits=3)
    assert np.all(out[0, 0] == 0.0) and np.all(lse[0, 0] == sink)


def test_heads_in_several_blocks():
    rng = np.random.default_rng(3)
    window, window_ids, entries, entry_ids = _pools(rng, 5, 9)
    q = random_array(rng, (B, T, 70, H), jnp.float32)
    _check((q, window, window_ids, entries, entry_ids), jnp.float32,
           sinks=jnp.asarray(rng.standard_normal(70), jnp.float32))


@pytest.mark.parametrize("bad, match", [
    (dict(sinks=jnp.zeros((3,))), "sinks_N"),
    (dict(window=jnp.zeros((10, 32))), "window_PH"),
    (dict(entry_ids=None), "entry_ids_BTK"),
    (dict(entry_ids=jnp.zeros((1, 2, 3), jnp.int32)), "entry_ids_BTK"),
    (dict(q=jnp.zeros((2, 2, 64))), "q_BTNH"),
    (dict(entries=jnp.zeros((10, H), jnp.bfloat16)), "share a dtype"),
    (dict(window=jnp.zeros((10, H // 2), jnp.uint32)), "window_PH holds 32-bit words .* target='mosaic_gpu'"),
])
def test_input_checks_name_the_argument(bad, match):
    args = dict(q=jnp.zeros((B, T, N, H)), window=jnp.zeros((10, H)), window_ids=jnp.zeros((B, T, 3), jnp.int32),
                entries=jnp.zeros((10, H)), entry_ids=jnp.zeros((B, T, 3), jnp.int32), sinks=jnp.zeros((N,)))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        sparse_v4_attention(args["q"], args["window"], args["window_ids"], args["entries"], args["entry_ids"],
                            args["sinks"], scale=1.0, interpret=True)

"""FP8 row formats: byte counts, byte layouts, round-trip error bounds, and the kernels that read FP8
rows directly (the Mosaic GPU kernel in the Mosaic GPU interpreter) against their references."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races  # the detector's state
from jax.experimental.pallas import mosaic_gpu as plgpu

from ess_jax.pallas_kernels import fp8_rows, row_layout
from kernel_testing import assert_close, permuted_ids, poison_unused, random_array, valid_counts

E4M3_REL = 2.0**-4  # half an e4m3 step: 3 mantissa bits (the step itself is 2**-3 relative)
E4M3_SUBNORMAL = 2.0**-10  # half the subnormal step 2**-9, in scaled units


def test_byte_counts():
    assert fp8_rows.mla_row_bytes(512, 64) == 656  # 512 e4m3 + 4 x f32 + 64 x bf16
    assert fp8_rows.v4_row_bytes(512, 64) == 592  # 448 e4m3 + 64 x bf16 + 7 ue8m0 + 9 pad: 16-byte aligned
    assert fp8_rows.v4_release_row_bytes(512, 64) == 584  # DeepSeek's: the scales padded to 8 bytes
    assert fp8_rows.mla_row_bytes(64, 16) == 100  # tiny-v32: 64 + 4 + 32
    assert fp8_rows.v4_row_bytes(64, 16) == 96  # tiny-v4: 48 + 32 + 1 + 15
    assert fp8_rows.v4_release_row_bytes(64, 16) == 88  # 48 + 32 + 1 + 7
    assert fp8_rows.mla_row_bytes(192, 16) == 192 + 8 + 32  # a partial second block still has its scale
    x = jnp.ones((3, 576))
    assert fp8_rows.quantize_mla_rows(x, latent_dim=512).shape == (3, 656)
    assert fp8_rows.quantize_v4_rows(x[:, :512], rope_dim=64).shape == (3, 592)
    assert fp8_rows.quantize_mla_rows(x, latent_dim=512).dtype == jnp.uint8


def _rows(seed, n, width):
    """Rows whose blocks span magnitudes 1e-6..1e3 (subnormals included), one all-zero block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, width)).astype(np.float32)
    x *= 10.0 ** rng.integers(-6, 4, size=(n, 1)).astype(np.float32)
    x[0, :64] = 0.0
    x[1, 5] = 1e4  # one outlier forces the rest of its block toward subnormals
    return x


def _check_round_trip(x, back, scale_per_elem, name):
    err = np.abs(back - x)
    bound = np.maximum(E4M3_REL * np.abs(x), E4M3_SUBNORMAL * scale_per_elem) * (1 + 1e-6) + 1e-30
    worst = np.unravel_index(np.argmax(err - bound), x.shape)
    assert np.all(err <= bound), f"{name}: worst at {worst}: x {x[worst]}, back {back[worst]}, bound {bound[worst]}"


@pytest.mark.parametrize("c, r", [(512, 64), (64, 16), (192, 16)])
def test_mla_layout_and_round_trip(c, r):
    x = _rows(c, 6, c + r)
    x[:, c:] = x[:, c:].astype(ml_dtypes.bfloat16).astype(np.float32)  # bf16 rope: must survive exactly
    q = np.asarray(fp8_rows.quantize_mla_rows(jnp.asarray(x), latent_dim=c))
    nb = -(-c // 128)
    assert q.shape == (6, fp8_rows.mla_row_bytes(c, r))
    padded = np.pad(np.abs(x[:, :c]), ((0, 0), (0, nb * 128 - c))).reshape(6, nb, 128)
    expected_scale = padded.max(-1) / np.float32(448.0)
    scale = q[:, c:c + 4 * nb].copy().view("<f4")  # little-endian float32, one per 128 values
    np.testing.assert_allclose(scale, expected_scale, rtol=2.5e-7)  # amax / 448, to the last bit or so
    np.testing.assert_array_equal(q[:, c + 4 * nb:].copy().view("<u2"),
                                  x[:, c:].astype(ml_dtypes.bfloat16).view(np.uint16))
    back = np.asarray(fp8_rows.dequantize_mla_rows(jnp.asarray(q), latent_dim=c, rope_dim=r))
    np.testing.assert_array_equal(back[:, c:], x[:, c:])  # rope exact
    scale_elem = np.repeat(scale, 128, axis=1)[:, :c]
    _check_round_trip(x[:, :c], back[:, :c], scale_elem, "latent")
    block_err = np.pad(np.abs(back[:, :c] - x[:, :c]), ((0, 0), (0, nb * 128 - c))).reshape(6, nb, 128).max(-1)
    assert np.all(block_err <= E4M3_REL * padded.max(-1) * (1 + 1e-6))  # within e4m3's relative step 2**-3 too
    assert np.all(back[0, :64] == 0.0)


def test_mla_e4m3_bytes_match_ml_dtypes():
    x = _rows(9, 4, 80)
    q = np.asarray(fp8_rows.quantize_mla_rows(jnp.asarray(x), latent_dim=64))
    scale = q[:, 64:68].copy().view("<f4")
    safe = np.where(scale > 0, scale, 1)
    y = np.clip(np.where(scale > 0, x[:, :64] / safe, 0), -448, 448)
    np.testing.assert_array_equal(q[:, :64], y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("h, r", [(512, 64), (64, 16)])
def test_v4_layout_and_round_trip(h, r):
    x = _rows(h, 6, h)
    x[:, h - r:] = x[:, h - r:].astype(ml_dtypes.bfloat16).astype(np.float32)
    q = np.asarray(fp8_rows.quantize_v4_rows(jnp.asarray(x), rope_dim=r))
    nope, nb = h - r, -(-(h - r) // 64)
    assert q.shape == (6, fp8_rows.v4_row_bytes(h, r))
    np.testing.assert_array_equal(q[:, nope:nope + 2 * r].copy().view("<u2"),
                                  x[:, nope:].astype(ml_dtypes.bfloat16).view(np.uint16))
    exponent = q[:, nope + 2 * r:nope + 2 * r + nb].astype(np.int32)
    assert np.all((exponent >= 1) & (exponent <= 254))
    assert np.all(q[:, nope + 2 * r + nb:] == 0)  # pad bytes
    scale = np.ldexp(np.float32(1), exponent - 127)
    amax = np.pad(np.abs(x[:, :nope]), ((0, 0), (0, nb * 64 - nope))).reshape(6, nb, 64).max(-1)
    nonzero = amax > 0
    # the smallest power of two that brings the block's amax within e4m3's 448
    assert np.all(amax[nonzero] / scale[nonzero] <= 448) and np.all(amax[nonzero] / scale[nonzero] > 224)
    back = np.asarray(fp8_rows.dequantize_v4_rows(jnp.asarray(q), head_dim=h, rope_dim=r))
    np.testing.assert_array_equal(back[:, nope:], x[:, nope:])
    _check_round_trip(x[:, :nope], back[:, :nope], np.repeat(scale, 64, axis=1)[:, :nope], "nope")


def test_dequantize_rejects_wrong_widths():
    with pytest.raises(ValueError, match="rows_X"):
        fp8_rows.dequantize_mla_rows(jnp.zeros((2, 657), jnp.uint8), latent_dim=512, rope_dim=64)
    with pytest.raises(ValueError, match="rows_X"):
        fp8_rows.dequantize_mla_rows(jnp.zeros((2, 656), jnp.float32), latent_dim=512, rope_dim=64)
    with pytest.raises(ValueError, match="rows_X"):
        fp8_rows.dequantize_v4_rows(jnp.zeros((2, 585), jnp.uint8), head_dim=512, rope_dim=64)


# ---- kernels over FP8 rows ------------------------------------------------------------------------


@pytest.mark.parametrize("c, r, k, dtype", [
    (64, 16, 9, jnp.float32),  # tiny-v32's 100-byte row
    (192, 16, 7, jnp.bfloat16),  # two scale blocks, the second partial
    (512, 64, 17, jnp.bfloat16),  # the 656-byte row
])
def test_sparse_mla_fp8_matches_reference(c, r, k, dtype):
    rng = np.random.default_rng(c + k)
    b, t, n, rows = 2, 2, 4, 40
    ids = permuted_ids(rng, valid_counts(b, t, k), k, rows)
    pool = np.asarray(fp8_rows.quantize_mla_rows(random_array(rng, (rows, c + r), jnp.float32), latent_dim=c))
    pool = jnp.asarray(poison_unused(pool, ids))  # unused rows are 0xFF: NaN e4m3, NaN scales, NaN rope
    q_latent, q_rope = random_array(rng, (b, t, n, c), dtype), random_array(rng, (b, t, n, r), dtype)
    out, lse = fp8_rows.sparse_mla_fp8(q_latent, q_rope, pool, jnp.asarray(ids), scale=0.1, interpret=True)
    ref_out, ref_lse = fp8_rows.sparse_mla_fp8_reference(q_latent, q_rope, pool, jnp.asarray(ids), scale=0.1)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    assert np.all(np.asarray(out)[0, 0] == 0) and np.all(np.isneginf(np.asarray(lse)[0, 0]))


@pytest.mark.parametrize("h, r, with_entries, dtype", [
    (64, 16, True, jnp.float32),  # tiny-v4's 96-byte row: one partial scale block
    (512, 64, False, jnp.bfloat16),  # the 584-byte row, window only
])
def test_sparse_v4_attention_fp8_matches_reference(h, r, with_entries, dtype):
    rng = np.random.default_rng(h)
    b, t, n = 2, 2, 4
    window_ids = permuted_ids(rng, valid_counts(b, t, 9), 9, 30)
    entry_ids = permuted_ids(rng, valid_counts(b, t, 8), 8, 20)
    quantize = lambda rows, ids: jnp.asarray(poison_unused(np.asarray(fp8_rows.quantize_v4_rows(
        random_array(rng, (rows, h), jnp.float32), rope_dim=r)), ids))
    window, entries = quantize(30, window_ids), quantize(20, entry_ids)
    q = random_array(rng, (b, t, n, h), dtype)
    sinks = jnp.asarray(rng.standard_normal(n), jnp.float32)
    entries, entry_ids = (entries, jnp.asarray(entry_ids)) if with_entries else (None, None)
    args = (q, window, jnp.asarray(window_ids), entries, entry_ids, sinks)
    out, lse = fp8_rows.sparse_v4_attention_fp8(*args, scale=0.1, rope_dim=r, interpret=True)
    ref_out, ref_lse = fp8_rows.sparse_v4_attention_fp8_reference(*args, scale=0.1, rope_dim=r)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")


def test_kernel_has_no_data_races():
    """The interpreter's happens-before race detector over the kernel's TMA copies, barriers, SMEM
    reads and writes and wgmma operands (V4 FP8 rows: e4m3 chunks, decoded bf16 byte pairs, the raw
    rows and the softmax weights sharing memory; two sources, two blocks of window rows) finds none."""
    rng = np.random.default_rng(7)
    b, t, n, h, r = 1, 2, 4, 64, 16
    window_ids = permuted_ids(rng, np.array([[70, 3]]), 70, 80)
    entry_ids = permuted_ids(rng, np.array([[5, 0]]), 8, 20)
    quantize = lambda rows, ids: jnp.asarray(poison_unused(np.asarray(fp8_rows.quantize_v4_rows(
        random_array(rng, (rows, h), jnp.float32), rope_dim=r)), ids))
    args = (random_array(rng, (b, t, n, h), jnp.bfloat16), quantize(80, window_ids), jnp.asarray(window_ids),
            quantize(20, entry_ids), jnp.asarray(entry_ids), jnp.asarray(rng.standard_normal(n), jnp.float32))
    out, lse = fp8_rows.sparse_v4_attention_fp8(*args, scale=0.1, rope_dim=r,
                                                interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not get_races().races_found
    ref_out, ref_lse = fp8_rows.sparse_v4_attention_fp8_reference(*args, scale=0.1, rope_dim=r)
    assert_close(out, ref_out, jnp.bfloat16, "out")
    assert_close(lse, ref_lse, jnp.bfloat16, "lse")


def test_fp8_kernel_checks_row_width():
    q = jnp.zeros((1, 1, 4, 64))
    with pytest.raises(ValueError, match="pool_PX"):
        fp8_rows.sparse_mla_fp8(q, jnp.zeros((1, 1, 4, 16)), jnp.zeros((8, 101), jnp.uint8),
                                jnp.zeros((1, 1, 3), jnp.int32), scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="window_PX"):
        fp8_rows.sparse_v4_attention_fp8(q, jnp.zeros((8, 87), jnp.uint8), jnp.zeros((1, 1, 3), jnp.int32), None,
                                         None, jnp.zeros((4,)), scale=1.0, rope_dim=16, interpret=True)
    # rows as 32-bit words: a whole row's words (100 / 4 and 96 / 4), and only for the TPU kernels
    with pytest.raises(ValueError, match=r"pool_PX as words must be u32\[P >= 1, 100 / 4\]"):
        fp8_rows.sparse_mla_fp8(q, jnp.zeros((1, 1, 4, 16)), jnp.zeros((8, 26), jnp.uint32),
                                jnp.zeros((1, 1, 3), jnp.int32), scale=1.0, target="mosaic_tpu", interpret=True)
    with pytest.raises(ValueError, match="window_PX holds 32-bit words .* target='mosaic_gpu_sm80'"):
        fp8_rows.sparse_v4_attention_fp8(q, jnp.zeros((8, 24), jnp.uint32), jnp.zeros((1, 1, 3), jnp.int32), None,
                                         None, jnp.zeros((4,)), scale=1.0, rope_dim=16, target="mosaic_gpu_sm80",
                                         interpret=True)


@pytest.mark.parametrize("dtype", [np.uint8, ml_dtypes.bfloat16])
def test_as_words_is_the_little_endian_view(dtype):
    """Word j of a row holds its bytes 4j .. 4j + 3, little-endian (numpy's view on this little-endian
    machine is the golden): what the TPU kernels decode."""
    rows = np.random.default_rng(5).integers(0, 256, (3, 88), np.uint8).view(dtype)
    np.testing.assert_array_equal(np.asarray(row_layout.as_words(jnp.asarray(rows))), rows.view("<u4"))
    with pytest.raises(ValueError, match="as_words takes rows"):
        row_layout.as_words(jnp.zeros((3, 6), jnp.uint8))


def test_e4m3_by_integers_is_every_codes_value():
    """The e4m3 decoding of the kernels without FP8 instructions (TPU, sm_80): every byte to ml_dtypes'
    ``float8_e4m3fn`` value, bit for bit (subnormals, -0.0 and +-448 included), the two NaN codes to NaN."""
    from ess_jax.pallas_kernels.row_layout import e4m3_by_integers

    codes = np.arange(256).astype(np.uint8)
    got = np.asarray(e4m3_by_integers(jnp.asarray(codes)))
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    numbers = codes & 0x7F != 0x7F
    np.testing.assert_array_equal(got[numbers].view(np.uint32), want[numbers].view(np.uint32))
    assert np.isnan(got[~numbers]).all()

"""FP4 indexer keys (``--index-dtype fp4``): the codec and DeepSeek-V4's QAT round trip against a plain
reference written from the official ``fp4_act_quant`` / ``rotate_activation``, and the engine with them.

The reference works in NumPy float64 on the e2m1 grid (nearest value, ties to the even code), takes the scale's
exponent from ``frexp`` (not from the float's bits), packs nibbles by hand, and builds the Hadamard matrix by
Kronecker products: none of it shares code with ``fp8_rows`` or ``models.deepseek_v4.compressor``."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from flax import nnx

import ess_jax
from ess_jax import families, ops
from ess_jax.config import preset_dict
from ess_jax.engine import Engine, EngineConfig, RequestSpec, cache_layout
from ess_jax.families import load_config
from ess_jax.models.deepseek_v4.compressor import Indexer, TailRope, hadamard
from ess_jax.models.layers import index_scores
from ess_jax.pallas_kernels import fp8_rows

ROOT = Path(__file__).resolve().parents[1]
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ref_quantize(x: np.ndarray) -> np.ndarray:
    """The official FP4 act-quant with ue8m0 scales, packed: ``[..., J]`` -> ``u8[..., J/2 + J/32]``."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
    amax = np.maximum(np.abs(blocks).max(-1), 6 * 2.0**-126).astype(np.float32)
    ratio = (amax * np.float32(1 / 6)).astype(np.float64)  # the kernel's float32 product
    mantissa, exponent = np.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(ratio))
    y = np.clip(blocks / 2.0 ** exponent[..., None], -6, 6)
    dist = np.abs(np.abs(y)[..., None] - GRID)
    best = dist.min(-1, keepdims=True)
    ties = dist == best
    even = ties & (np.arange(8) % 2 == 0)  # of two nearest grid values, the even code
    magnitude = np.where(even.any(-1), even.argmax(-1), ties.argmax(-1))
    codes = (magnitude | (np.signbit(y) << 3)).astype(np.uint8).reshape(*x.shape[:-1], -1)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.concatenate([packed, (exponent + 127).astype(np.uint8)], axis=-1)


def ref_dequantize(rows: np.ndarray, width: int) -> np.ndarray:
    packed, scales = rows[..., :width // 2], rows[..., width // 2:]
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*rows.shape[:-1], width)
    values = GRID[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    scale = 2.0 ** (scales.astype(np.float64) - 127)
    return (values.reshape(*rows.shape[:-1], -1, 32) * scale[..., None]).reshape(values.shape).astype(np.float32)


def ref_rotate(x, dtype):
    """``rotate_activation``: x @ H / sqrt(n), H by Kronecker products of [[1, 1], [1, -1]], rounded to ``dtype``."""
    n = x.shape[-1]
    h = np.ones((1, 1), np.float32)
    for _ in range(int(np.log2(n))):
        h = np.kron(np.array([[1, 1], [1, -1]], np.float32), h)
    out = jnp.matmul(jnp.asarray(x, jnp.float32), h, precision=jax.lax.Precision.HIGHEST) * n**-0.5
    return np.asarray(out.astype(dtype))


def keys(shape, seed=0) -> np.ndarray:
    """Normal keys at several magnitudes, and blocks at the codec's edges: zeros, ties between grid values, an amax
    at an exact power of two times 6, negative zero, a subnormal and a huge block."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape[:-1] + (1,))).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[0, :32] = 0
    flat[1, :32] = np.resize([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -2.5, -5, -0.75], 32)
    flat[2, :32] = np.resize([12.0, -9.0, 3.0, 1.0], 32)  # amax 12 = 6 * 2: scale 2, 9 / 2 = 4.5 -> 4
    flat[3, :32] = np.resize([-0.0, 1e-40, -3e-41], 32)
    flat[4, :32] = np.resize([3e35, -1e35, 7e34], 32)
    return x


def test_fp4_key_layout_by_hand():
    """A block with amax 6 (scale 1, byte 127): the nibbles of the grid's ties, rounded to the even code."""
    x = np.zeros(32, np.float32)
    x[:8] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, -3.5, -5]  # codes 7, 0, 2, 2, 4, 4, 8|6, 8|6
    row = np.asarray(fp8_rows.quantize_fp4_keys(jnp.asarray(x)))
    assert row.shape == (17,) and fp8_rows.fp4_key_bytes(128) == 68
    assert row[:4].tolist() == [0x07, 0x22, 0x44, 0xEE] and row[4:16].tolist() == [0] * 12 and row[16] == 127
    np.testing.assert_array_equal(np.asarray(fp8_rows.dequantize_fp4_keys(jnp.asarray(row), width=32))[:8],
                                  [6, 0, 1, 1, 2, 2, -4, -4])


@pytest.mark.parametrize("width", [32, 128])
def test_codec_is_the_official_act_quant_bit_for_bit(width):
    x = keys((6, 5, width))
    got = np.asarray(fp8_rows.quantize_fp4_keys(jnp.asarray(x)))
    want = ref_quantize(x)
    assert got.shape == (6, 5, width // 2 + width // 32) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(fp8_rows.dequantize_fp4_keys(jnp.asarray(got), width=width)),
                                  ref_dequantize(want, width))


def test_codec_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8_rows.quantize_fp4_keys(jnp.zeros((2, 48)))
    with pytest.raises(ValueError, match=r"u8\[\.\.\., 68\]"):
        fp8_rows.dequantize_fp4_keys(jnp.zeros((2, 132), jnp.uint8), width=128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_key_path_is_rotate_then_quantize(dtype):
    """What the engine stores for a CSA indexer key (68 bytes at the real J = 128), and what it scores."""
    x = np.asarray(jnp.asarray(keys((4, 9, 128), seed=1)).astype(dtype).astype(jnp.float32))
    rotated = np.asarray(hadamard(jnp.asarray(x, dtype)).astype(jnp.float32))
    exact = x.astype(np.float64) @ scipy.linalg.hadamard(128) / np.sqrt(128)  # Sylvester's order, in float64
    tolerance = 1e-2 if dtype == jnp.bfloat16 else 1e-6  # relative to each key's largest value
    assert (np.abs(rotated - exact) <= tolerance * np.abs(exact).max(-1, keepdims=True)).all()
    stored = np.asarray(ops.encode_index_keys(hadamard(jnp.asarray(x, dtype)), "fp4"))
    want = ref_quantize(ref_rotate(x, dtype).astype(np.float32))
    assert stored.shape[-1] == 68
    np.testing.assert_array_equal(stored, want)
    np.testing.assert_array_equal(np.asarray(ops.decode_index_keys(jnp.asarray(stored), "fp4", jnp.float32,
                                                                   width=128)), ref_dequantize(want, 128))


def test_the_query_side_takes_the_same_round_trip():
    """``Indexer.scores(fp4=True)``: the queries after RoPE rotated and FP4-round-tripped, as the official code."""
    cfg = load_config(preset_dict("tiny-v4"))
    rope = TailRope(cfg.compress_rope, cfg.qk_rope_head_dim)
    indexer = Indexer(32, 16, 2, 32, 4, 4, rope=rope, eps=1e-6, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    x, q_resid = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 3, 32), (1, 3, 16)))
    key_rows = ref_quantize(ref_rotate(keys((1, 5, 32), seed=3), jnp.float32))
    keys_BMJ = jnp.asarray(ref_dequantize(key_rows, 32))
    positions = jnp.arange(3)[None] + 20
    cos, sin = rope.cos_sin(positions)
    visible = jnp.ones((1, 3, 5), bool)
    q = rope.apply(indexer.q_b_proj(q_resid).reshape(1, 3, 2, 32), cos, sin)
    q = ref_dequantize(ref_quantize(ref_rotate(np.asarray(q), jnp.float32)), 32)
    want = index_scores(jnp.asarray(q), keys_BMJ, indexer.scorer.weights_proj(x), visible)
    got = indexer.scores(x, q_resid, keys_BMJ, visible, cos, sin, fp4=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(indexer.scores(x, q_resid, keys_BMJ, visible, cos, sin)), np.asarray(want))


@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model("tiny-v4-code")


def _serve(model, **config):
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=160, prefill_chunk=128, index_dtype="fp4", **config))
    text = model.tokenizer.encode((ROOT / "checkpoints" / "heldout_code.txt").read_text())
    for start, n, new in ((0, 128, 12), (2000, 128, 24)):  # one prefill piece each; 32 entries > top-k 16
        engine.add_request(RequestSpec(text[start:start + n], new))
    return engine, engine.run()


def test_resident_and_ess_give_the_same_tokens_with_fp4_keys(model):
    resident, want = _serve(model, offload="none")
    ess, got = _serve(model, offload="ess", pool_size=model.cfg.index_topk + 1)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert ess.offload_metrics()["misses"] > 0
    csa = resident.runner.cache.csa
    per_page = csa.entries.page_size // model.cfg.compress_rate_csa
    assert csa.index_keys.dtype == jnp.uint8 and csa.index_keys.shape[-1] == per_page * 17 and csa.index_format == "fp4"
    # the device bytes the engine reports fall by what its layout (the planner's parts) counts
    default = cache_layout(model.cfg, EngineConfig(max_batch=2, max_seq_len=160, offload="none"), "float32")
    csa_layers, keys_per_page = 2, 64 // 4
    assert default.device_bytes - resident.layout.device_bytes == (
        resident.layout.size.pages * csa_layers * keys_per_page * (4 * 32 - 17))
    assert resident.cache_bytes()["device_bytes"] == resident.layout.device_bytes


def test_v32_refuses_fp4_keys_and_v4_parts_count_them():
    v32 = load_config(preset_dict("deepseek-v3.2"))
    with pytest.raises(ValueError, match="trained for FP8"):
        cache_layout(v32, EngineConfig(index_dtype="fp4", max_seq_len=1024), "bfloat16")
    with pytest.raises(ValueError, match="--index-dtype 'fp2'"):
        EngineConfig(index_dtype="fp2")
    flash = load_config(preset_dict("deepseek-v4-flash"))
    parts = {p.name: p.row_bytes for p in families.get("deepseek_v4").cache_parts(
        flash, families.get("deepseek_v4").stored_formats("fp8", "bfloat16", "fp4"))}
    assert parts["CSA indexer keys"] == 68 and parts["CSA main rows"] == 592  # the engine's 16-byte-aligned row

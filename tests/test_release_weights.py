"""Release-format weights (``load_model(..., weights="release")``): FP8 with block scales and V4's FP4
routed experts stay in their stored bytes on the device and are read dequantized inside the step.

Synthetic checkpoints in the release layouts, two shards with an index: V3.2 with transformers names,
per-expert tensors and FP8 e4m3 with float32 ``weight_scale_inv``; V4 with the original release names,
FP8 with ue8m0 ``.scale`` and FP4 e2m1 routed experts (int8, two values a byte) with a ue8m0 scale per 32.
The references are NumPy's dequantization of the stored bytes (ml_dtypes decoding e2m1), independent of
``ess_jax.models.quant``.
"""

import argparse
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from safetensors.numpy import save_file

import ess_jax
from ess_jax import cli, families, mesh, plan
from ess_jax.checkpoint import CheckpointError, hf_names, stacked
from ess_jax.config import ModelConfig, preset_dict
from ess_jax.families import load_config
from ess_jax.models.quant import Fp4Values, Fp8Blocks
from helpers import small_v32_json, v4_release_name

V4_FIXTURE = Path(__file__).parent / "fixtures" / "hf-v4-a"
FINE = (24, 16)  # blocks that tile the small matrices several times, unevenly (32 expert rows are no multiple of 24)
RELEASE = (128, 128)  # the releases' blocks: the planner's byte rule assumes them
TOKENS = np.random.default_rng(0).integers(0, 256, (1, 40))  # past V4's 16-token window and 16:1 compression


def _expand(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scale.astype(np.float32), block[0], 0), block[1], 1)[:shape[0], :shape[1]]


def _fp8(w: np.ndarray, block: tuple[int, int], ue8m0: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block FP8 as the releases store it: e4m3 values and scales amax / 448 per block (float32, or rounded
    up to a power of two in ue8m0); also the dequantized weight."""
    (out, inp), (bo, bi) = w.shape, block
    so, si = -(-out // bo), -(-inp // bi)
    padded = np.zeros((so * bo, si * bi), np.float32)
    padded[:out, :inp] = np.abs(w)
    scale = np.maximum(padded.reshape(so, bo, si, bi).max(axis=(1, 3)), 1e-30) / 448
    scale = (np.exp2(np.ceil(np.log2(scale))).astype(ml_dtypes.float8_e8m0fnu) if ue8m0 else scale.astype(np.float32))
    w8 = (w / _expand(scale, block, w.shape)).astype(ml_dtypes.float8_e4m3fn)
    return w8, scale, w8.astype(np.float32) * _expand(scale, block, w.shape)


def _fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FP4 as V4 stores its routed experts: int8 [out, in / 2], two e2m1 codes a byte (the low nibble first),
    ue8m0 scales [out, in / 32] (amax / 6 rounded up to a power of two); also the dequantized weight."""
    out, inp = w.shape
    amax = np.abs(w).reshape(out, inp // 32, 32).max(-1)
    scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6))).astype(ml_dtypes.float8_e8m0fnu)
    expanded = np.repeat(scale.astype(np.float32), 32, 1)
    codes = (w / expanded).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8)
    unpacked = np.stack([packed.view(np.uint8) & 15, packed.view(np.uint8) >> 4], -1).reshape(out, inp)
    return packed, scale, unpacked.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * expanded


_V4_FP8 = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$")
_V4_FP4 = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")

# How each family's release stores its tensors (DOMAIN.md 1.5 and 2.8): names, expert parts (gate, up,
# down), the scale's name and format, and which tensors are quantized. V3.2 quantizes every matrix of a
# layer but the router's and the indexer's weights_proj; V4 its attention projections and shared experts
# (FP8) and routed experts (FP4), not its compressors or indexer.
LAYOUTS = {
    "deepseek_v32": dict(rename=lambda n: n, parts=("gate_proj", "up_proj", "down_proj"), scale="weight_scale_inv",
                         ue8m0=False, format=lambda n, w: "fp8" if n.startswith("model.layers.") and w.ndim == 2
                         and not n.endswith(("mlp.gate.weight", "weights_proj.weight")) else None),
    "deepseek_v4": dict(rename=v4_release_name, parts=("w1", "w3", "w2"), scale="scale", ue8m0=True,
                        format=lambda n, w: "fp8" if _V4_FP8.match(n) else "fp4" if _V4_FP4.match(n) else None),
}


def _write_release(weights: dict[str, np.ndarray], raw: dict, directory: Path, block: tuple[int, int]):
    """``weights`` as their family's release stores them, in two shards with an index; returns the
    stored tensors, the weights the loader must produce (dequantized, by transformers name) and the
    format of each quantized parameter."""
    layout = LAYOUTS[raw["model_type"]]
    stored, expected, formats = {}, {}, {}

    def put(name: str, w: np.ndarray) -> np.ndarray:
        fmt = layout["format"](name, w)
        if fmt is None:
            stored[name] = w
            return w
        scale = name.removesuffix("weight") + layout["scale"]
        stored[name], stored[scale], dequantized = _fp8(w, block, layout["ue8m0"]) if fmt == "fp8" else _fp4(w)
        return dequantized

    for name, value in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = layout["rename"](name).rsplit(".", 1)[0]  # ... .experts
            gate, up, down = layout["parts"]
            rows = []
            for e, w in enumerate(value):
                parts = [(gate, w[: len(w) // 2]), (up, w[len(w) // 2:])] if "gate_up" in name else [(down, w)]
                rows.append(np.concatenate([put(f"{prefix}.{e}.{part}.weight", m) for part, m in parts]))
            expected[name] = np.stack(rows)
            formats[name] = layout["format"](f"{prefix}.0.{parts[0][0]}.weight", value[0])
        else:
            expected[name] = put(layout["rename"](name), value)
            formats[name] = layout["format"](layout["rename"](name), value)
    directory.mkdir(parents=True)
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: np.ascontiguousarray(stored[k]) for k in keys}, str(directory / file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    if layout["ue8m0"]:
        quantization["scale_fmt"] = "ue8m0"
    (directory / "config.json").write_text(json.dumps(dict(raw, quantization_config=quantization)))
    return stored, expected, {n: f for n, f in formats.items() if f}


def _weights(family: str) -> tuple[dict[str, np.ndarray], dict]:
    """Lively random weights of a small model of ``family`` by transformers name (NumPy, drawn as
    ``helpers.randomize`` draws them: matrices N(0, 1.5^2 / fan_in), vectors 1 + 0.1 N or biases 0.1 N;
    each token's hash experts distinct), and its config.json."""
    if family == "deepseek_v32":
        raw = small_v32_json()
    else:
        raw = dict(json.loads((V4_FIXTURE / "config.json").read_text()), moe_intermediate_size=32)  # FP4: 32 a scale
    cfg = load_config(raw)
    cls = families.get(family).module_cls
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rng, weights = np.random.default_rng(3), {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        shape = tuple(variable.shape)[stacked(path):]  # one layer's
        for name in hf_names(path, variable.shape):
            if path[-1] == "tid2eid":
                value = np.argsort(rng.random((shape[0], cfg.n_routed_experts)), -1)[:, :shape[1]].astype(np.int32)
            elif len(shape) >= 2:
                value = rng.normal(size=shape) * 1.5 / np.sqrt(shape[-1])
            else:
                value = rng.normal(size=shape) * 0.1 + (path[-1] not in ("bias", "e_score_correction_bias"))
            weights[name] = value.astype(variable.dtype)
    return weights, raw


@pytest.fixture(scope="module", params=["deepseek_v32", "deepseek_v4"])
def release(request, tmp_path_factory):
    """A family's checkpoints in the release layout: one in FINE blocks loaded both ways (float32), and one
    in the release's 128 x 128 blocks."""
    weights, raw = _weights(request.param)
    fine, released = tmp_path_factory.mktemp("fine") / "ckpt", tmp_path_factory.mktemp("release") / "ckpt"
    stored, expected, formats = _write_release(weights, raw, fine, FINE)
    _write_release(weights, raw, released, RELEASE)
    return dict(family=request.param, fine=fine, released=released, stored=stored, expected=expected,
                formats=formats, kept=ess_jax.load_model(fine, weights="release"), dequantized=ess_jax.load_model(fine))


def _params(model) -> dict:
    """Each parameter's value by transformers name (a stacked run's: each layer's slice)."""
    out = {}
    for path, variable in nnx.to_flat_state(model.params):
        value = variable.get_value()
        for i, name in enumerate(hf_names(path, variable.shape)):
            out[name] = jax.tree.map(lambda x: x[i], value) if stacked(path) else value
    return out


def test_release_weights_keep_the_stored_bytes_and_read_as_the_reference(release):
    kept, expected, formats = _params(release["kept"]), release["expected"], release["formats"]
    assert kept.keys() == expected.keys()
    leaves = {"fp8": {"float8_e4m3fn", "float8_e8m0fnu" if release["family"] == "deepseek_v4" else "float32"},
              "fp4": {"int8", "float8_e8m0fnu"}}
    for name, value in kept.items():
        if name in formats:
            assert isinstance(value, Fp8Blocks if formats[name] == "fp8" else Fp4Values), name
            assert {str(leaf.dtype) for leaf in jax.tree.leaves(value)} == leaves[formats[name]], name
        else:
            assert isinstance(value, jax.Array), name
        assert value.shape == expected[name].shape and value.dtype == expected[name].dtype, name
        np.testing.assert_array_equal(np.asarray(value[...]), expected[name], err_msg=name)
    assert {"fp8", "fp4"} & set(formats.values()) == ({"fp8", "fp4"} if release["family"] == "deepseek_v4" else {"fp8"})
    for name, value in _params(release["dequantized"]).items():
        assert isinstance(value, jax.Array), name
        np.testing.assert_array_equal(np.asarray(value[...]), expected[name], err_msg=name)


def test_release_logits_equal_the_dequantized_models(release):
    kept, dequantized = release["kept"].logits(TOKENS), release["dequantized"].logits(TOKENS)
    assert np.all(np.isfinite(dequantized)) and np.ptp(dequantized) > 1
    np.testing.assert_allclose(kept, dequantized, rtol=0, atol=1e-5 * np.abs(dequantized).max())


def test_device_bytes_equal_the_planners(release):
    """bfloat16, as the planner counts unquantized weights in the model's dtype: routed experts and the rest."""
    model = ess_jax.load_model(release["released"], "bfloat16", weights="release")
    device = {"routed": 0, "other": 0}
    for path, variable in nnx.to_flat_state(model.params):
        kind, _ = plan.param_bytes(model.cfg, path, tuple(variable.shape), 2)
        device[kind] += sum(leaf.nbytes for leaf in jax.tree.leaves(variable))
    assert device == plan.weight_bytes(model.cfg)
    dequantized = ess_jax.load_model(release["released"], "bfloat16")
    assert sum(device.values()) < sum(x.nbytes for x in jax.tree.leaves(dequantized.params))


def _bytes_per_device(flat, expert: int) -> int:
    """Bytes of parameters ``flat`` ((state path, value: an array, its shape or a quantized tensor of them) pairs)
    on each device of an abstract ``expert``-way mesh, each leaf sharded by the engine's rule (``mesh.param_spec``
    at its path)."""
    abstract = AbstractMesh((1, expert), mesh.AXES, axis_types=(AxisType.Auto,) * 2)
    total = 0
    for path, value in flat:
        for leaf_path, x in jax.tree_util.tree_leaves_with_path(value):
            names = [str(p) for p in path] + mesh.path_names(leaf_path)
            sharding = NamedSharding(abstract, mesh.param_spec(names, tuple(x.shape)))
            total += math.prod(sharding.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
    return total


def test_device_bytes_on_a_mesh_equal_the_planners(release):
    """The loaded release-format parameters, each leaf (values, scales) sharded by the engine's rule over the
    routed experts: bytes per device equal the planner's on that mesh."""
    model = ess_jax.load_model(release["released"], "bfloat16", weights="release")
    flat = [(path, variable.get_value()) for path, variable in nnx.to_flat_state(model.params)]
    for expert in (1, 2, model.cfg.n_routed_experts):
        assert _bytes_per_device(flat, expert) == sum(
            plan.weight_bytes(model.cfg, mesh.MeshShape(expert=expert)).values())


def _release_shapes(cfg: ModelConfig):
    """The parameters of ``cfg`` as its release stores them (LAYOUTS), as (state path, shapes) pairs: the abstract
    bfloat16 model's, each quantized weight as its values and scales (``quant.Fp8Blocks`` with 128 x 128 blocks,
    gate and up each with their own; ``quant.Fp4Values``)."""
    layout = LAYOUTS[cfg.family]
    scale_dtype = ml_dtypes.float8_e8m0fnu if layout["ue8m0"] else np.float32
    cls = families.get(cfg.family).module_cls
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    shapes = []
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        shape, name = tuple(variable.shape), hf_names(path, variable.shape)[0]
        layer = jax.ShapeDtypeStruct(shape[stacked(path):], variable.dtype)  # one layer's
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            part = layout["parts"][0 if "gate_up" in name else 2]
            one = jax.ShapeDtypeStruct(shape[-2:], variable.dtype)  # one expert's
            fmt = layout["format"](f"{layout['rename'](name).rsplit('.', 1)[0]}.0.{part}.weight", one)
        else:
            fmt = layout["format"](layout["rename"](name), layer)
        *lead, out, inp = shape if fmt else (None, None)
        if fmt == "fp8":
            parts = 2 if name.endswith("gate_up_proj") else 1
            scales = (*lead, parts * -(-out // parts // 128), -(-inp // 128))
            value = Fp8Blocks(jax.ShapeDtypeStruct(shape, ml_dtypes.float8_e4m3fn),
                              jax.ShapeDtypeStruct(scales, scale_dtype), RELEASE, parts, jnp.bfloat16)
        elif fmt == "fp4":
            value = Fp4Values(jax.ShapeDtypeStruct((*lead, out, inp // 2), np.int8),
                              jax.ShapeDtypeStruct((*lead, out, inp // 32), ml_dtypes.float8_e8m0fnu), jnp.bfloat16)
        else:
            value = jax.ShapeDtypeStruct(shape, variable.dtype)
        shapes.append((path, value))
    return shapes


@pytest.mark.parametrize("preset, expert", [("deepseek-v3.2", 32), ("deepseek-v4-flash", 8), ("deepseek-v4-pro", 64)])
def test_real_configs_bytes_per_device_equal_the_planners(preset, expert):
    """The real configs in their release formats, sharded over an abstract mesh by the engine's rule: bytes per
    device equal the planner's figure."""
    cfg = load_config(preset_dict(preset))
    shapes = _release_shapes(cfg)
    assert {type(v).__name__ for _, v in shapes} == (
        {"ShapeDtypeStruct", "Fp8Blocks"} | ({"Fp4Values"} if cfg.family == "deepseek_v4" else set()))
    assert _bytes_per_device(shapes, expert) == sum(plan.weight_bytes(cfg, mesh.MeshShape(expert=expert)).values())


def test_checkpoints_the_release_formats_cannot_be_read_from(release, tmp_path):
    if release["family"] != "deepseek_v4":
        pytest.skip("the FP4 experts are V4's")
    stored, fine = release["stored"], release["fine"]
    expert = "layers.2.ffn.experts.1.w1"

    def write(directory: Path, tensors: dict) -> Path:
        directory.mkdir()
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text((fine / "config.json").read_text())
        return directory

    narrow = dict(stored, **{f"{expert}.scale": stored[f"{expert}.scale"][:16]})
    with pytest.raises(CheckpointError,
                       match=r"experts\.1\.w1\.weight: packed FP4 .* weight_scale_inv shape \[16, 1\]"):
        ess_jax.load_model(write(tmp_path / "narrow", narrow), weights="release")
    mixed = {k: v for k, v in stored.items() if k != f"{expert}.scale"}
    mixed[f"{expert}.weight"] = release["expected"]["model.layers.2.mlp.experts.gate_up_proj"][1, :32]
    with pytest.raises(CheckpointError, match=r"stored in different formats \(packed FP4 with float8_e8m0fnu scales, "
                                              r"unquantized\)"):
        ess_jax.load_model(write(tmp_path / "mixed", mixed))


def test_release_weights_need_a_checkpoint():
    with pytest.raises(ValueError, match="preset 'tiny-v32' has random weights"):
        ess_jax.load_model("tiny-v32", weights="release")
    with pytest.raises(ValueError, match="weights='fp8' is not supported"):
        ess_jax.load_model("tiny-v32", weights="fp8")
    parser = argparse.ArgumentParser()
    cli.add_model_flag(parser)
    cli.add_engine_flags(parser)
    with pytest.raises(ValueError, match="--weights release .* the preset tiny-v32"):
        cli.engine_config(parser.parse_args(["--model", "tiny-v32", "--weights", "release"]))


def test_e2m1_codes_decode_as_ml_dtypes_float4():
    """Every e2m1 code (the low nibble of a packed FP4 byte) decodes to ml_dtypes' ``float4_e2m1fn`` value, bit for
    bit (-0.0 included)."""
    from ess_jax.models.quant import e2m1

    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1(jnp.asarray(codes))).view(np.uint32), want.view(np.uint32))


def test_fp4_dequantized_in_bfloat16_is_exact():
    """FP4 weights dequantized in bfloat16 (as a bfloat16 model reads its experts) equal ml_dtypes' e2m1 value
    times the e8m0 scale computed in float64, bit for bit: every byte (both nibbles) under scales 2^-60 .. 2^60."""
    from ess_jax.models.quant import dequantize_fp4

    packed = np.tile(np.arange(256, dtype=np.uint8), (7, 1))  # [7 rows, 256 bytes]: 512 values, 16 scale groups
    exponents = np.arange(-60, 61, 20)[:, None] + np.arange(16)[None, :] - 8  # a scale per 32 values
    scales = np.exp2(exponents.astype(np.float64)).astype(ml_dtypes.float8_e8m0fnu)
    got = np.asarray(dequantize_fp4(jnp.asarray(packed.view(np.int8)), jnp.asarray(scales), jnp.bfloat16))
    nibbles = np.stack([packed & 15, packed >> 4], -1).reshape(7, 512)
    want = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.repeat(np.exp2(exponents), 32, -1)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.astype(np.float64), want)

"""Checkpoint loading: round trip, release-format names, FP8 blocks, and errors that name the problem."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import ess_jax
from ess_jax.checkpoint import CheckpointError, fp8_blocks, hf_tensors
from ess_jax.config import ConfigError
from helpers import lively_v32, small_v32, small_v32_json

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small lively model written as a transformers-named checkpoint, and its tensors."""
    cfg = small_v32()
    model = lively_v32(cfg, seed=4)
    tensors = hf_tensors(nnx.state(model))
    directory = tmp_path_factory.mktemp("ckpt")
    (directory / "config.json").write_text(json.dumps(small_v32_json()))
    save_file(tensors, str(directory / "model.safetensors"))
    tokens = np.random.default_rng(0).integers(0, 256, (1, 20))
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(tokens))
    return directory, tensors, logits, tokens


def _write(directory: Path, config: dict, tensors: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_round_trip_logits(saved):
    directory, _, logits, tokens = saved
    model = ess_jax.load_model(directory)
    np.testing.assert_allclose(model.logits(tokens), np.asarray(logits), atol=1e-5)


def test_release_names_sharded_with_mtp_layer(saved, tmp_path):
    """Per-expert names, two shards with an index, and an MTP layer that must be skipped."""
    directory, tensors, logits, tokens = saved
    config = json.loads((directory / "config.json").read_text())
    released = {}
    for name, value in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for e, w in enumerate(value):
                half = w.shape[0] // 2
                released[f"{prefix}.{e}.gate_proj.weight"] = w[:half]
                released[f"{prefix}.{e}.up_proj.weight"] = w[half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e, w in enumerate(value):
                released[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            released[name] = value
    mtp = config["num_hidden_layers"]
    released[f"model.layers.{mtp}.eh_proj.weight"] = np.zeros((4, 4), np.float32)
    names = sorted(released)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: np.ascontiguousarray(released[k]) for k in keys}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    np.testing.assert_allclose(ess_jax.load_model(tmp_path).logits(tokens), np.asarray(logits), atol=1e-5)


def test_fp8_block_dequantization_exact():
    rng = np.random.default_rng(0)
    w8 = rng.normal(size=(200, 300)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, size=(2, 3)).astype(np.float32)
    w = np.asarray(fp8_blocks(w8, scale, "w")[...])
    rows, cols = np.meshgrid(np.arange(200), np.arange(300), indexing="ij")
    np.testing.assert_array_equal(w, np.asarray(w8, np.float32) * scale[rows // 128, cols // 128])
    with pytest.raises(CheckpointError, match="does not tile"):
        fp8_blocks(w8, scale[:, :2], "w")


def test_bad_checkpoints_name_the_problem(saved, tmp_path):
    directory, tensors, _, _ = saved
    config = json.loads((directory / "config.json").read_text())
    some = "model.layers.1.self_attn.kv_b_proj.weight"

    missing = {k: v for k, v in tensors.items() if k != some}
    with pytest.raises(CheckpointError, match=f"missing tensor {some}"):
        ess_jax.load_model(_write(tmp_path / "missing", config, missing))

    wrong = dict(tensors, **{some: np.zeros((3, 3), np.float32)})
    with pytest.raises(CheckpointError, match=rf"{some} has shape \[3, 3\]"):
        ess_jax.load_model(_write(tmp_path / "wrong", config, wrong))

    extra = dict(tensors, **{"model.layers.0.self_attn.q_a_proj.bias": np.zeros(32, np.float32)})
    with pytest.raises(CheckpointError, match="q_a_proj.bias"):
        ess_jax.load_model(_write(tmp_path / "extra", config, extra))

    fp8 = dict(tensors, **{some: tensors[some].astype(ml_dtypes.float8_e4m3fn)})
    target = tmp_path / "fp8"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    from safetensors.flax import save_file as save_jax  # NumPy cannot write float8
    save_jax({k: jnp.asarray(v) for k, v in fp8.items()}, str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        ess_jax.load_model(target)

    with pytest.raises(ConfigError, match="model_type='mistral'"):
        ess_jax.load_model(_write(tmp_path / "type", dict(config, model_type="mistral"), tensors))

    shard = tmp_path / "shard"
    shutil.copytree(directory, shard)
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {some: "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        ess_jax.load_model(shard)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        ess_jax.load_model(empty)

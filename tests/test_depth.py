"""DeepSeek-V3.2's cached step scans over its layers, held stacked: the traced program does not grow with
depth, resident or offloaded (both fetch backends), the layer runs split where the layers differ (dense MLP /
MoE), and a checkpoint's per-layer tensors load into their run's slices.
Compile times and step times against depth are measured by ``python -m ess_jax.bench --depth-sweep``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ess_jax import families
from ess_jax.cache import StepMeta
from ess_jax.config import ModelConfig, preset_dict
from ess_jax.models.deepseek_v32 import DeepseekV32


def _model(layers: int, dense: int = 1) -> DeepseekV32:
    cfg = ModelConfig.from_hf_dict(dict(preset_dict("tiny-v32"), num_hidden_layers=layers, first_k_dense_replace=dense))
    return DeepseekV32(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layers, dense, runs", [(5, 1, [(0, 1), (1, 5)]), (4, 0, [(0, 4)]), (3, 3, [(0, 3)]),
                                                 (6, 2, [(0, 2), (2, 6)])])
def test_layer_runs_split_dense_from_moe_layers(layers, dense, runs):
    module = _model(layers, dense)
    held = sorted((int(start), int(start) + jax.tree.leaves(nnx.state(run))[0].shape[0])
                  for start, run in module.runs.items())
    assert held == runs


def _program(layers: int, offload: str, fetch: str = "inline"):
    """The traced decode step (one token for each of 2 rows) at ``layers`` layers: the number of its top-level
    equations and the number of equations in each scan's body."""
    module = _model(layers)
    family = families.get(module.cfg.family)
    size = families.CacheSize(rows=2, pages=5, page_size=64, max_seq_len=128)
    if offload == "ess":
        part = next(p for p in family.cache_parts(module.cfg, family.stored_formats("float32", "float32"))
                    if p.where == "offloaded")
        cache = family.offloaded_cache(module, size, part, jnp.float32, slots=module.cfg.index_topk + 1, fetch=fetch)
    else:
        cache = family.resident_cache(module, size, jnp.float32)
    graphdef, params = nnx.split(module)
    meta = StepMeta(jnp.full((2, 1), 3, jnp.int32), jnp.ones((2, 1), bool), jnp.asarray([[1, 2], [3, 4]], jnp.int32),
                    jnp.arange(2, dtype=jnp.int32))

    def step(params, cache):
        return nnx.merge(graphdef, params).step(jnp.zeros((2, 1), jnp.int32), meta, cache.begin_step())

    eqns = jax.make_jaxpr(step)(params, cache).eqns
    return len(eqns), [len(e.params["jaxpr"].jaxpr.eqns) for e in eqns if e.primitive.name == "scan"]


@pytest.mark.parametrize("offload, fetch", [("none", "inline"), ("ess", "inline"), ("ess", "split")])
def test_the_traced_step_does_not_grow_with_depth(offload, fetch):
    shallow, deep = _program(3, offload, fetch), _program(9, offload, fetch)
    assert len(shallow[1]) == 2  # the dense layer, then the MoE layers
    assert shallow == deep


def test_the_scanned_step_returns_every_layers_ids():
    module = _model(4)
    cache = module.init_cache(1, 3, 64)
    meta = StepMeta(jnp.arange(8, dtype=jnp.int32)[None], jnp.ones((1, 8), bool), jnp.asarray([[1, 2]], jnp.int32),
                    jnp.zeros((1,), jnp.int32))
    _, ids_LBTK, cache = module.step(jnp.arange(8, dtype=jnp.int32)[None], meta, cache)
    assert ids_LBTK.shape == (4, 1, 8, min(module.cfg.index_topk, 128))
    # every layer wrote its own latent rows and indexer keys (page 1: positions 0..7)
    assert all(np.abs(np.asarray(cache.latent.pages[layer, 1, :8])).sum() > 0 for layer in range(4))
    assert all(np.abs(np.asarray(cache.index_keys[layer, 1, :8])).sum() > 0 for layer in range(4))


def test_a_checkpoint_holds_each_layer_and_loads_into_the_runs(tmp_path):
    """``checkpoint.save`` writes every layer of a stacked run under its transformers name, layer i's tensor its
    run's slice; loading that checkpoint fills the runs back bitwise."""
    from safetensors.numpy import load_file

    from ess_jax import checkpoint
    module = _model(5, dense=2)
    raw = dict(preset_dict("tiny-v32"), num_hidden_layers=5, first_k_dense_replace=2)
    directory = checkpoint.save(nnx.state(module), raw, tmp_path / "ckpt")
    tensors = load_file(str(directory / "model.safetensors"))
    for i in range(5):
        run, offset = ("0", i) if i < 2 else ("2", i - 2)
        np.testing.assert_array_equal(tensors[f"model.layers.{i}.self_attn.q_a_proj.weight"],
                                      np.asarray(module.runs[run].self_attn.q_a_proj.weight[...][offset]))
    assert "model.layers.4.mlp.experts.gate_up_proj" in tensors and "model.layers.1.mlp.gate_proj.weight" in tensors
    loaded = checkpoint.load_into(lambda: DeepseekV32(module.cfg, rngs=nnx.Rngs(1)), module.cfg, directory, jnp.float32)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(module)), nnx.to_flat_state(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))

"""DeepSeek-V3.2's cached step scans over its layers: the traced program does not grow with depth, resident
or offloaded (both fetch backends), and the layer runs split where the layers differ (dense MLP / MoE).
Compile times and step times against depth are measured by ``python -m ess_jax.bench --depth-sweep``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ess_jax import families
from ess_jax.cache import StepMeta
from ess_jax.config import ModelConfig, preset_dict
from ess_jax.models.deepseek_v32 import DeepseekV32, layer_runs


def _model(layers: int, dense: int = 1) -> DeepseekV32:
    cfg = ModelConfig.from_hf_dict(dict(preset_dict("tiny-v32"), num_hidden_layers=layers, first_k_dense_replace=dense))
    return DeepseekV32(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layers, dense, runs", [(5, 1, [(0, 1), (1, 5)]), (4, 0, [(0, 4)]), (3, 3, [(0, 3)]),
                                                 (6, 2, [(0, 2), (2, 6)])])
def test_layer_runs_split_dense_from_moe_layers(layers, dense, runs):
    assert layer_runs(_model(layers, dense).layers) == runs


def _program(layers: int, offload: str, fetch: str = "inline"):
    """The traced decode step (one token for each of 2 rows) at ``layers`` layers: the number of its top-level
    equations besides the stacking of the layers' parameters (one broadcast per parameter and layer, one
    concatenate per parameter), and the number of equations in each scan's body."""
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
    stacking = {"broadcast_in_dim", "reshape", "concatenate"}
    top = sum(e.primitive.name not in stacking for e in eqns)
    return top, [len(e.params["jaxpr"].jaxpr.eqns) for e in eqns if e.primitive.name == "scan"]


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

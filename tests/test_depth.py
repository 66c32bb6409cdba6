"""The models' layers, held stacked, are scanned. DeepSeek-V3.2: the traced step does not grow with depth,
resident or offloaded (both fetch backends), the layer runs split where the layers differ (dense MLP / MoE),
and a checkpoint's per-layer tensors load into their run's slices. DeepSeek-V4: its CSA / HCA pairs are
blocks of two layers scanned together; the scanned forward and cached step equal the layers applied one by
one, the traced step does not grow with depth, and a checkpoint names each layer of a block.
Compile times and step times against depth are measured by ``python -m ess_jax.bench --depth-sweep``."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ess_jax import families
from ess_jax.cache import StepMeta
from ess_jax.config import preset_dict
from ess_jax.families import load_config
from ess_jax.models.deepseek_v32 import DeepseekV32
from ess_jax.models.deepseek_v4 import DeepseekV4
from ess_jax.models.layers import run_layers
from helpers import randomize


def _model(layers: int, dense: int = 1) -> DeepseekV32:
    cfg = load_config(dict(preset_dict("tiny-v32"), num_hidden_layers=layers, first_k_dense_replace=dense))
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
    keys = cache.index_keys.reshape(4, 3, 64, -1)  # [L, G, Z, J]: a page's keys are one run
    assert all(np.abs(np.asarray(keys[layer, 1, :8])).sum(-1).min() > 0 for layer in range(4))


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
    loaded = checkpoint.load_into(DeepseekV32, module.cfg, directory, jnp.float32)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(module)), nnx.to_flat_state(nnx.state(loaded)),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


# ---- DeepSeek-V4: sliding / hash-routed layers, then CSA / HCA pairs scanned as blocks of two ------------------

def _v4(layers: int) -> DeepseekV4:
    """tiny-v4's widths at ``layers`` layers in transformers' default pattern (HCA x 2, then HCA / CSA
    alternating; 3 hash-routed layers), with lively weights."""
    raw = {k: v for k, v in preset_dict("tiny-v4").items() if k not in ("layer_types", "compress_ratios",
                                                                         "mlp_layer_types")}
    cfg = load_config(dict(raw, num_hidden_layers=layers))
    return randomize(DeepseekV4(cfg, rngs=nnx.Rngs(0)), seed=1)


def _v4_layers(module: DeepseekV4) -> list:
    """Each decoder layer of ``module`` on its own, in layer order, sliced out of the stacked runs."""
    layers = {}
    for key, run in module.runs.items():
        graphdef, state = nnx.split(run)
        for i, layer in enumerate(run_layers(key, jax.tree.leaves(state)[0].shape[0])):
            layers[layer] = nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state))
    return [layers[i] for i in range(len(layers))]


def test_v4_runs_pair_the_csa_and_hca_layers():
    module = _v4(9)
    assert [t[0] for t in module.cfg.layer_types] == list("hhhchchch")  # heavily / compressed
    # layers 0-2: HCA with hash routing, alike; then (CSA, HCA) blocks
    assert sorted(module.runs, key=lambda k: int(k.split(":")[0])) == ["0", "3:2", "4:2"]
    assert [run_layers(k, 3) for k in ("3:2", "4:2")] == [[3, 5, 7], [4, 6, 8]]
    assert [layer.self_attn.layer_type for layer in _v4_layers(module)] == list(module.cfg.layer_types)


def test_v4_scanned_forward_and_step_equal_the_layers_one_by_one():
    """At 9 layers (two CSA / HCA blocks scanned twice): the full forward equals the layers applied one after
    the other, and the cached step, one prompt then a decode token per step, equals the full forward."""
    module = _v4(9)
    graphdef, params = nnx.split(module)
    tokens = np.random.default_rng(0).integers(0, module.cfg.vocab_size, (1, 40))  # past the window and 16:1
    streams = module._embed(jnp.asarray(tokens[:, :36]))
    for layer in _v4_layers(module):
        streams, *_ = layer(streams, jnp.asarray(tokens[:, :36]), None)
    one_by_one = np.asarray(module.head(streams))
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    full = np.asarray(forward(params, jnp.asarray(tokens)))
    scale = np.abs(full).max()
    assert np.ptp(full) > 1
    np.testing.assert_allclose(np.asarray(forward(params, jnp.asarray(tokens[:, :36]))), one_by_one, atol=1e-5 * scale)
    cache = module.init_cache(1, 4, 16)
    table = jnp.asarray([[1, 2, 3]], jnp.int32)
    cached = jax.jit(lambda params, tokens, meta, cache: nnx.merge(graphdef, params).step(tokens, meta, cache))

    def step(start, t, cache):
        meta = StepMeta(jnp.arange(start, start + t, dtype=jnp.int32)[None], jnp.ones((1, t), bool), table,
                        jnp.zeros(1, jnp.int32))
        logits, ids, cache = cached(params, jnp.asarray(tokens[:, start:start + t]), meta, cache)
        return np.asarray(logits), ids, cache

    logits, ids, cache = step(0, 36, cache)
    assert ids.shape[0] == module.cfg.layer_types.count("compressed_sparse_attention") == 3
    np.testing.assert_allclose(logits, full[:, :36], atol=1e-5 * scale)
    for position in range(36, 40):
        logits, _, cache = step(position, 1, cache)
        np.testing.assert_allclose(logits[:, 0], full[:, position], atol=1e-5 * scale)


def test_v4_traced_step_does_not_grow_with_depth():
    def program(layers):
        module = _v4(layers)
        graphdef, params = nnx.split(module)
        meta = StepMeta(jnp.full((2, 1), 3, jnp.int32), jnp.ones((2, 1), bool),
                        jnp.asarray([[1, 2], [3, 0]], jnp.int32), jnp.arange(2, dtype=jnp.int32))
        step = lambda params, cache: nnx.merge(graphdef, params).step(jnp.zeros((2, 1), jnp.int32), meta, cache)  # noqa: E731
        eqns = jax.make_jaxpr(step)(params, module.init_cache(2, 5, 16)).eqns
        return len(eqns), [len(e.params["jaxpr"].jaxpr.eqns) for e in eqns if e.primitive.name == "scan"]

    shallow, deep = program(7), program(13)
    assert len(shallow[1]) == 2  # the three hash-routed HCA layers, then the blocks
    assert shallow == deep


def test_v4_checkpoint_names_each_layer_of_a_block(tmp_path):
    """``checkpoint.save`` writes each layer of a block run under its own transformers name (layer 3 + 2i
    and 4 + 2i: slice i of runs "3:2" and "4:2"); loading the checkpoint fills the runs back bitwise."""
    from safetensors.numpy import load_file

    from ess_jax import checkpoint
    module = _v4(9)
    raw = dict({k: v for k, v in preset_dict("tiny-v4").items() if k not in ("layer_types", "compress_ratios",
                                                                              "mlp_layer_types")}, num_hidden_layers=9)
    directory = checkpoint.save(nnx.state(module), raw, tmp_path / "ckpt")
    tensors = load_file(str(directory / "model.safetensors"))
    for layer, (run, i) in {3: ("3:2", 0), 4: ("4:2", 0), 7: ("3:2", 2), 8: ("4:2", 2)}.items():
        np.testing.assert_array_equal(tensors[f"model.layers.{layer}.self_attn.kv_proj.weight"],
                                      np.asarray(module.runs[run].self_attn.kv_proj.weight[...][i]))
    assert any(name.startswith("model.layers.7.self_attn.compressor.indexer.") for name in tensors)  # 7: CSA
    assert not any(name.startswith("model.layers.8.self_attn.compressor.indexer.") for name in tensors)  # 8: HCA
    loaded = checkpoint.load_into(DeepseekV4, module.cfg, directory, jnp.float32)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(module)), nnx.to_flat_state(nnx.state(loaded)),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def _window_moves(module: DeepseekV4, batch: int, rows: int) -> int:
    """The gathers and scatters in the traced step of ``batch`` of a cache's ``rows`` batch rows (scan bodies and
    nested jaxprs included) that move rows of every layer of the window stack ``[L, rows, S, H]`` at once (not one
    layer's slice)."""
    graphdef, params = nnx.split(module)
    meta = StepMeta(jnp.full((batch, 1), 3, jnp.int32), jnp.ones((batch, 1), bool),
                    jnp.ones((batch, 2), jnp.int32), jnp.arange(batch, dtype=jnp.int32))
    cache = module.init_cache(rows, 2 * rows + 1, 16)
    window = cache.window.shape
    step = lambda params, cache: nnx.merge(graphdef, params).step(jnp.zeros((batch, 1), jnp.int32), meta, cache)  # noqa: E731

    def count(jaxpr) -> int:
        found = 0
        for e in jaxpr.eqns:
            if e.primitive.name in ("gather", "scatter") and e.invars[0].aval.shape == window:
                moved = e.outvars[0] if e.primitive.name == "gather" else e.invars[2]  # the rows taken or put
                found += moved.aval.shape[::2] == window[::2]
            found += sum(count(sub) for sub in jax.extend.core.jaxprs_in_params(e.params))
        return found

    return count(jax.make_jaxpr(step)(params, cache).jaxpr)


def test_v4_decode_over_every_row_updates_the_window_in_place():
    """A step over every batch row (the decode) neither gathers its rows' window stack nor scatters it back (at
    DeepSeek-V4-Flash's 43 layers and 1624 requests those two copies were 15 GiB of the step's temporaries on an
    H200); a step over some rows (a prefill piece) gathers its rows' window, and to put it back gathers the old
    rows and scatters."""
    module = _v4(5)
    assert _window_moves(module, batch=2, rows=2) == 0
    assert _window_moves(module, batch=1, rows=2) == 3

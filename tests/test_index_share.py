"""Index Share (DOMAIN.md 1.7): the schedule's config keys, shared layers without an indexer or indexer keys, the
cached step against the training form, resident against ESS (both fetch backends), checkpoints and the planner."""

import json

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from flax import nnx

from ess_jax import checkpoint, train
from ess_jax.api import generate, load_model
from ess_jax.cache import StepMeta
from ess_jax.checkpoint import CheckpointError
from ess_jax.config import ConfigError, ModelConfig, preset_dict, resolve_model
from ess_jax.engine import EngineConfig
from ess_jax.plan import main as plan_main

# the shipped models with a shared pattern: V3.2's four DSA layers, V4's two CSA layers (layers 1 and 3)
PATTERNS = {"tiny-v32-code": "FSSF", "tiny-v4-code": "FS"}
PROMPTS = [list(range(5, 150)), list(range(40, 90))]
NEW = 10


def _v32(**raw) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(model_type="deepseek_v32", **raw))


# ---- the schedule ----------------------------------------------------------------------------------


def test_freq_and_offset_follow_the_reference_formula():
    # vLLM's max(layer - 1, 0) % freq: layers 0 AND 1 full, then every freq-th
    assert _v32(num_hidden_layers=9, index_topk_freq=4).indexer_types == (
        "full", "full", "shared", "shared", "shared", "full", "shared", "shared", "shared")
    # GLM-5.2: freq 4, offset 3 over 78 layers runs 21 indexers (layers 0, 1, 2, 6, 10, ..., 74)
    glm = _v32(num_hidden_layers=78, first_k_dense_replace=3, index_topk_freq=4, index_skip_topk_offset=3)
    full = [i for i, kind in enumerate(glm.indexer_types) if kind == "full"]
    assert len(full) == 21 and full[:5] == [0, 1, 2, 6, 10] and full[-1] == 74
    # V4-Flash, freq 2 over its 21 CSA layers: 11 indexers
    flash = ModelConfig.from_hf_dict(dict(preset_dict("deepseek-v4-flash"), index_topk_freq=2))
    assert len(flash.index_layers) == 21 and flash.indexer_types.count("full") == 11


def test_explicit_schedules_and_overrides():
    assert _v32(num_hidden_layers=4, index_topk_pattern="FSFS").index_pattern == "FSFS"
    types = ["full", "shared", "shared", "full"]
    assert _v32(num_hidden_layers=4, indexer_types=types, index_topk_pattern="FSSF").indexer_types == tuple(types)
    cfg = ModelConfig.from_preset("tiny-v32")
    assert cfg.index_pattern == "FFFF"  # no key: every layer full
    assert cfg.with_index_share("every-2").index_pattern == "FSFS"
    mtp = ModelConfig.from_hf_dict(dict(preset_dict("tiny-v32"), num_nextn_predict_layers=1))
    assert mtp.with_index_share("FSSS").mtp_block().index_pattern == "F"  # the MTP block keeps its own indexer
    v4 = ModelConfig.from_preset("tiny-v4")
    assert v4.index_layers == [1, 3] and v4.with_index_share("FS").indexer_full(1)
    assert not v4.with_index_share("FS").indexer_full(3) and not v4.indexer_full(2)


@pytest.mark.parametrize("raw, needle", [
    (dict(num_hidden_layers=4, index_topk_pattern="FSXS"), "letter 'X' at indexed layer 2"),
    (dict(num_hidden_layers=4, index_topk_pattern="SFFF"), "first indexed layer must be full"),
    (dict(num_hidden_layers=4, index_topk_pattern="FSF"), "3 letters for the model's 4 indexed layers"),
    (dict(num_hidden_layers=2, indexer_types=["full", "sometimes"]), "indexer_types[1]='sometimes'"),
    (dict(num_hidden_layers=2, indexer_types=["full", "shared"], index_topk_pattern="FF"), "disagree"),
    (dict(num_hidden_layers=2, index_topk_freq=0), "index_topk_freq"),
])
def test_bad_schedules_are_refused_by_name(raw, needle):
    with pytest.raises(ConfigError) as e:
        _v32(**raw)
    assert needle in str(e.value)


def test_bad_override_is_refused_by_name():
    cfg = ModelConfig.from_preset("tiny-v4")
    for spec, needle in (("every-x", "every-N"), ("FFF", "2 indexed layers"), ("F?", "'?'")):
        with pytest.raises(ConfigError, match="--index-share") as e:
            cfg.with_index_share(spec)
        assert needle in str(e.value)


# ---- models, caches and engines --------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def shared(request):
    """A shipped model served with a shared pattern (its shared layers' indexers not read) and its tokens on the
    resident engine."""
    model = load_model(request.param, index_share=PATTERNS[request.param])
    result = generate(model, PROMPTS, NEW, engine=EngineConfig(offload="none", max_batch=2))
    return model, result.output_ids


def _indexers(module) -> list[str]:
    """The checkpoint names of a model's indexer parameters."""
    return [n for n in checkpoint.hf_tensors(nnx.state(module)) if ".indexer." in n]


def test_shared_layers_have_no_indexer_and_store_no_keys(shared):
    model, _ = shared
    cfg = model.cfg
    layers = {int(n.split(".")[2]) for n in _indexers(model.module)} - {cfg.num_hidden_layers}  # the MTP block's own
    full = PATTERNS[model.name].count("F")
    assert layers == {i for i in cfg.index_layers if cfg.indexer_full(i)} and len(layers) == full
    cache = model.module.init_cache(2, 9, 64)
    keys = cache.index_keys if cfg.family == "deepseek_v32" else cache.csa.index_keys
    assert keys.shape[0] == full  # the full layers' keys only
    if cfg.family == "deepseek_v4":  # and only the full CSA layers keep the indexer's compressor rings
        assert cache.csa.index_kv_ring.shape[0] == 1 and cache.csa.kv_ring.shape[0] == 2


def test_shared_layers_attend_at_their_full_layers_picks(shared):
    """The cached step's top-k of each shared layer is its full layer's; the training form's greedy tokens equal
    the engine's."""
    model, tokens = shared
    cfg, module = model.cfg, model.module
    t = 96
    cache = module.init_cache(1, 3, 64)
    meta = StepMeta(jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), bool), jnp.asarray([[1, 2]], jnp.int32),
                    jnp.zeros((1,), jnp.int32))
    _, ids, _ = module.step(jnp.asarray([PROMPTS[0][:t]], jnp.int32), meta, cache)
    ids = np.asarray(ids)
    source = 0
    for place, kind in enumerate(cfg.indexer_types):
        source = place if kind == "full" else source
        np.testing.assert_array_equal(ids[place], ids[source])
    if cfg.family == "deepseek_v32":  # its last layer is full again: its own picks
        assert not np.array_equal(ids[0], ids[3])
    # teacher-forced on the engine's tokens, the training form's greedy choice at each position is the next one
    seq = PROMPTS[1] + tokens[1]
    greedy = np.argmax(np.asarray(module(jnp.asarray([seq[:-1]], jnp.int32)))[0], -1)
    assert greedy[len(PROMPTS[1]) - 1:].tolist() == tokens[1]


@pytest.mark.parametrize("fetch", ["inline", "split"])
def test_ess_equals_resident_with_a_shared_pattern(shared, fetch):
    model, tokens = shared
    pool = model.cfg.index_topk + 4  # a pool far below the context: misses every step
    result = generate(model, PROMPTS, NEW, engine=EngineConfig(offload="ess", max_batch=2, fetch=fetch,
                                                               pool_size=pool))
    assert result.output_ids == tokens
    assert result.metrics["offload"]["misses"] > 0


def test_the_pattern_changes_the_model():
    """A shared pattern is not the all-full model (the shared layers' own indexers would pick other entries)."""
    full = load_model("tiny-v32-code")
    shared = load_model("tiny-v32-code", index_share="FSSS")
    tokens = jnp.asarray([PROMPTS[0]], jnp.int32)
    assert not np.array_equal(np.asarray(full.module(tokens)), np.asarray(shared.module(tokens)))


# ---- checkpoints -----------------------------------------------------------------------------------


def test_checkpoint_with_indexers_on_full_layers_only(tmp_path):
    model = load_model("tiny-v32-code", index_share="FSFS")
    raw = dict(resolve_model("tiny-v32-code").raw_config(), index_topk_pattern="FSFS")
    checkpoint.save(nnx.state(model.module), raw, tmp_path / "shared")
    names = checkpoint.hf_tensors(nnx.state(model.module))
    assert {int(n.split(".")[2]) for n in names if ".indexer." in n} == {0, 2, 4}  # 4: the MTP block's own
    loaded = load_model(tmp_path / "shared")  # its config's pattern: loads
    tokens = jnp.asarray([PROMPTS[1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded.module(tokens)), np.asarray(model.module(tokens)))
    with pytest.raises(CheckpointError, match="no indexer for layer 1"):  # layer 1 full in this pattern
        load_model(tmp_path / "shared", index_share="FFFS")


# ---- the planner -----------------------------------------------------------------------------------


def test_planner_drops_the_shared_layers_indexer_keys(capsys):
    """DeepSeek-V3.2 in FP8 (DOMAIN.md 3.1): 61 layers of 656-byte latent rows and 132-byte indexer keys per token;
    every-4 keeps the keys of 16 layers (0, 4, ..., 60)."""
    assert plan_main(["--model", "deepseek-v3.2", "--cache-dtype", "fp8", "--context", "32768", "--pool-ratio",
                      "0.2", "--index-share", "none", "--index-share", "every-4", "--json"]) == 0
    layouts = [m["layouts"][0] for m in json.loads(capsys.readouterr().out)["models"]]
    assert [lay["bytes_per_token"] for lay in layouts] == [61 * (656 + 132), 61 * 656 + 16 * 132]


# ---- train.py: the greedy search and the distillation -------------------------------------------------

from test_train import corpus, start  # noqa: E402,F401 (the small V3.2 checkpoint and corpus, as fixtures)


def _heldout_lm(model, corpus_dir, context: int = 32, count: int = 2) -> float:
    """The held-out LM loss of ``model`` on the windows train.py evaluates (``--eval-batches 1 --batch 2``)."""
    data = train.load_corpus(corpus_dir, context)
    windows = train.batch_at(data.heldout, train.heldout_offsets(len(data.heldout), count, context), context)
    logits = np.asarray(model.logits(windows[:, :-1]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    return float(-np.take_along_axis(logp, windows[:, 1:, None], -1).mean())


def test_greedy_search_drops_indexers_by_heldout_loss(corpus, start, tmp_path):  # noqa: F811
    out = tmp_path / "search"
    flags = ["--model", str(start), "--data", str(corpus), "--out", str(out), "--context", "32", "--batch", "2",
             "--eval-batches", "1"]
    assert train.main(flags + ["--index-share-search", "--keep", "0.5"]) == 0
    result = json.loads((out / "index_share.json").read_text())
    assert [s["pattern"] for s in result["steps"]] == ["FF", "FS"] and result["pattern"] == "FS"
    model = load_model(out)  # its config carries the pattern, its checkpoint layer 0's indexer only
    assert model.cfg.index_pattern == "FS" and {int(n.split(".")[2]) for n in _indexers(model.module)} == {0}
    assert result["heldout_lm"] == pytest.approx(_heldout_lm(model, corpus), rel=1e-4)
    assert result["full_heldout_lm"] == pytest.approx(_heldout_lm(load_model(start), corpus), rel=1e-4)


def test_distillation_trains_the_kept_indexer_for_the_layers_it_serves(corpus, start, tmp_path):  # noqa: F811
    out = tmp_path / "distilled"
    assert train.main(["--model", str(start), "--data", str(corpus), "--out", str(out), "--steps", "2", "--context",
                       "32", "--batch", "2", "--eval-every", "2", "--eval-batches", "1", "--stage", "warmup",
                       "--index-share", "every-2", "--no-progress"]) == 0
    before, after = load_model(start, index_share="FS"), load_model(out)
    assert after.cfg.index_pattern == "FS"
    old, new = (checkpoint.hf_tensors(nnx.state(m.module)) for m in (before, after))
    assert old.keys() == new.keys()
    changed = {n for n in old if not np.array_equal(old[n], new[n])}
    assert changed and all(".indexer." in n and n.startswith("model.layers.0.") for n in changed)


def test_a_kept_indexer_learns_from_the_shared_layers_attention(start):  # noqa: F811
    """In the warmup stage layer 0's indexer gets the gradient of its own KL alone when layer 1 runs its own
    indexer, and also that of layer 1's attention when layer 1 shares layer 0's picks."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 300, (2, 33)), jnp.int32)

    def grads(pattern):
        module = load_model(start, index_share=pattern).module
        graphdef, indexers, rest = nnx.split(module, train.trainable("warmup"), ...)
        g = jax.grad(lambda p: nnx.merge(graphdef, p, rest).train_forward(tokens, "warmup")[1])(indexers)
        return {n: v for n, v in checkpoint.hf_tensors(g).items() if n.startswith("model.layers.0.")}

    own, shared = grads("FF"), grads("FS")
    assert own.keys() == shared.keys() and own
    assert any(not np.allclose(own[n], shared[n]) for n in own)

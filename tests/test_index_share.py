"""Index Share (DOMAIN.md 1.7): the schedule's config keys, shared layers without an indexer or indexer keys, the
cached step against the training form, resident against ESS (both fetch backends) with requests joining and aborted,
shared layers' misses fetched at their full layer, checkpoints and the planner."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from flax import nnx

from ess_jax import checkpoint, families, tier, train
from ess_jax.api import load_model
from ess_jax.bench.__main__ import main as bench_main
from ess_jax.cache import StepMeta
from ess_jax.checkpoint import CheckpointError
from ess_jax.config import ConfigError, ModelConfig, preset_dict, resolve_model
from ess_jax.engine import Engine, EngineConfig, RequestSpec
from ess_jax.families import load_config
from ess_jax.plan import main as plan_main

# the shipped models with a shared pattern: V3.2's four DSA layers, V4's two CSA layers (layers 1 and 3)
PATTERNS = {"tiny-v32-code": "FSSF", "tiny-v4-code": "FS"}


def _v32(**raw) -> ModelConfig:
    return load_config(dict(model_type="deepseek_v32", **raw))


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
    flash = load_config(dict(preset_dict("deepseek-v4-flash"), index_topk_freq=2))
    assert len(flash.index_layers) == 21 and flash.indexer_types.count("full") == 11


def test_explicit_schedules_and_overrides():
    assert _v32(num_hidden_layers=4, index_topk_pattern="FSFS").index_pattern == "FSFS"
    types = ["full", "shared", "shared", "full"]
    assert _v32(num_hidden_layers=4, indexer_types=types, index_topk_pattern="FSSF").indexer_types == tuple(types)
    cfg = load_config(preset_dict("tiny-v32"))
    assert cfg.index_pattern == "FFFF"  # no key: every layer full
    assert cfg.with_index_share("every-2").index_pattern == "FSFS"
    mtp = load_config(dict(preset_dict("tiny-v32"), num_nextn_predict_layers=1))
    assert mtp.with_index_share("FSSS").mtp_block().index_pattern == "F"  # the MTP block keeps its own indexer
    v4 = load_config(preset_dict("tiny-v4"))
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
    cfg = load_config(preset_dict("tiny-v4"))
    for spec, needle in (("every-x", "every-N"), ("FFF", "2 indexed layers"), ("F?", "'?'")):
        with pytest.raises(ConfigError, match="--index-share") as e:
            cfg.with_index_share(spec)
        assert needle in str(e.value)


# ---- models, caches and engines --------------------------------------------------------------------

# four requests on two batch rows, prompts of whole 64-token prefill pieces (one prefill shape): 0 and 1 start, 2
# waits; 1 is aborted mid-run and 2 joins in its row; 3 arrives later and joins when 0 leaves
LENGTHS, NEW = (128, 64, 64, 128), 8
ARRIVALS, ABORTS = {0: [0, 1, 2], 5: [3]}, {3: [1]}
PROMPTS = [np.random.default_rng(i).integers(3, 4000, n).tolist() for i, n in enumerate(LENGTHS)]


def _engine(model, **offload) -> Engine:
    return Engine(model, EngineConfig(max_batch=2, page_size=16, prefill_chunk=64, max_seq_len=max(LENGTHS) + NEW,
                                      **offload))


def _drive(engine) -> dict[int, list[int]]:
    """The workload on ``engine``: each request's tokens (an aborted one's, up to its abort)."""
    ids, tokens = {}, {}
    for step in range(100):
        for key in ARRIVALS.get(step, []):
            ids[key] = engine.add_request(RequestSpec(PROMPTS[key], NEW))
        for key in ABORTS.get(step, []):
            engine.abort(ids[key])
        if step > max(ARRIVALS) and not engine.has_unfinished():
            by_id = {i: k for k, i in ids.items()}
            return {by_id[i]: tokens[i] for i in sorted(tokens)}
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, []) + out.new_token_ids
    raise AssertionError("not idle after 100 steps")


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def shared(request):
    """A shipped model served with a shared pattern (its shared layers' indexers not read): each request's tokens
    alone on the resident engine, and ``served(offload, fetch)``: the workload's tokens and engine on an engine of
    that mode, each served once (the resident one after the requests alone)."""
    model = load_model(request.param, index_share=PATTERNS[request.param])
    resident = _engine(model)
    alone = []
    for prompt in PROMPTS:
        resident.add_request(RequestSpec(prompt, NEW))
        alone.append(resident.run()[0].output_ids)
    runs = {("none", None): (_drive(resident), resident)}

    def served(offload, fetch=None):
        if (offload, fetch) not in runs:
            # a pool far below the context: misses every step
            engine = _engine(model, offload=offload, fetch=fetch, pool_size=model.cfg.index_topk + 4)
            runs[offload, fetch] = _drive(engine), engine
        return runs[offload, fetch]
    return model, alone, served


def _indexers(module) -> list[str]:
    """The checkpoint names of a model's indexer parameters."""
    return [n for n in checkpoint.hf_tensors(nnx.state(module)) if ".indexer." in n]


def test_shared_layers_have_no_indexer_and_store_no_keys(shared):
    model, _, _ = shared
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
    model, alone, _ = shared
    cfg, module = model.cfg, model.module
    t = 96
    cache = module.init_cache(1, 3, 64)
    meta = StepMeta(jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), bool), jnp.asarray([[1, 2]], jnp.int32),
                    jnp.zeros((1,), jnp.int32))
    _, ids, _ = jax.jit(module.step)(jnp.asarray([PROMPTS[0][:t]], jnp.int32), meta, cache)
    ids = np.asarray(ids)
    source = 0
    for place, kind in enumerate(cfg.indexer_types):
        source = place if kind == "full" else source
        np.testing.assert_array_equal(ids[place], ids[source])
    if cfg.family == "deepseek_v32":  # its last layer is full again: its own picks
        assert not np.array_equal(ids[0], ids[3])
    # teacher-forced on the engine's tokens, the training form's greedy choice at each position is the next one
    seq = PROMPTS[1] + alone[1]
    greedy = np.argmax(np.asarray(jax.jit(module)(jnp.asarray([seq[:-1]], jnp.int32)))[0], -1)
    assert greedy[len(PROMPTS[1]) - 1:].tolist() == alone[1]


@pytest.mark.parametrize("offload, fetch", [("none", None), ("ess", "inline"), ("ess", "split")])
def test_joins_and_aborts_give_each_request_its_tokens_alone(shared, offload, fetch):
    """Resident and ESS (both fetch backends) alike: a request joining mid-run, the one aborted and the others give
    the tokens each gives alone (the aborted one's, up to its abort), so ESS's equal the resident engine's."""
    _, alone, served = shared
    tokens, engine = served(offload, fetch)
    assert sorted(tokens) == list(range(len(PROMPTS)))
    for key, got in tokens.items():
        if any(key in keys for keys in ABORTS.values()):
            assert 0 < len(got) < len(alone[key]) and got == alone[key][:len(got)]
        else:
            assert got == alone[key]
    assert engine.usage()["pages_in_use"] == 0
    if offload == "ess":
        assert engine.offload_metrics()["misses"] > 0


@pytest.mark.parametrize("fetch", ["inline", "split"])
def test_shared_layers_misses_are_fetched_at_their_full_layer(shared, fetch):
    """Per layer: a full layer fetches its own misses (lead 0); a shared layer's are all fetched at its full layer's
    step, ``lead`` layers before it runs."""
    model, _, served = shared
    cfg, engine = model.cfg, served("ess", fetch)[1]
    per_layer = engine.offload_metrics()["per_layer"]
    assert [c["layer"] for c in per_layer] == cfg.index_layers
    full = 0
    for c, kind in zip(per_layer, cfg.indexer_types):
        full = c["layer"] if kind == "full" else full
        assert c["misses"] > 0 and c["lead"] == c["layer"] - full
        assert c["fetched_ahead"] == (c["misses"] if kind == "shared" else 0)
    # the tier's device arrays, the rows fetched ahead included, as the engine sized them
    store, layout = families.get(cfg.family).store_of(engine.runner.cache), engine.layout
    assert sum(x.nbytes for x in jax.tree.leaves(dataclasses.replace(store, host=None))) == tier.device_bytes(
        layers=len(cfg.index_layers), rows=2, slots=layout.pool_slots, row_bytes=layout.offloaded.row_bytes,
        entries=layout.offloaded.row_entries(layout.size), topk=cfg.index_topk,
        sources=tier.share_sources(cfg.indexer_types)) > 0 < store.ahead.nbytes


def test_a_shared_layers_rows_are_fetched_before_it_runs():
    """Tier level, split store: after the full layer's step the shared layer's host rows are overwritten; the
    shared layer still attends its misses' true rows (fetched at the full layer's step), a full layer the new ones."""
    rows_LGZW = np.arange(3 * 3 * 4 * 2, dtype=np.float32).reshape(3, 3, 4, 2) + 1  # layers 0 F, 1 S, 2 F
    tiered = tier.init_tier(layers=3, rows=1, slots=4, pages=3, page_size=4, rate=1, width=2, dtype=jnp.float32,
                            fetch="split", entries=8, topk=3, sources=tier.share_sources(("full", "shared", "full")))
    tiered.host.array[:] = rows_LGZW
    meta = StepMeta(jnp.asarray([[7]]), jnp.ones((1, 1), bool), jnp.asarray([[1, 2]]), jnp.zeros((1,), jnp.int32))
    ids_BTK = jnp.asarray([[[0, 5, 2]]])  # pages 1, 2, 1 at offsets 0, 1, 2

    def attended(layer):
        nonlocal tiered
        sources = tiered.read(layer, meta, jnp.asarray([[7]]), jnp.zeros((1, 1, 2)), ids_BTK)
        tiered = sources.settle(sources.ready)
        (fetched,) = sources.inflight
        return np.asarray(fetched.rows_PW[fetched.ids_BTK[0, 0]])

    want = lambda layer: rows_LGZW[layer][[1, 2, 1], [0, 1, 2]]  # noqa: E731
    np.testing.assert_array_equal(attended(0), want(0))
    tiered.host.array[1:] = -1  # every later layer's host rows, after the full layer's step
    np.testing.assert_array_equal(attended(1), want(1))  # fetched before
    np.testing.assert_array_equal(attended(2), -1)  # a full layer fetches at its own step
    assert tiered.ahead_counters[:, 0, 0].tolist() == [0, 3, 0]
    assert tiered.counters[:, 0, 2].tolist() == [3, 3, 3]


@pytest.mark.parametrize("fixture", ["hf-v32-a", "hf-v4-a"])
def test_an_all_full_pattern_is_the_model_transformers_runs(fixture):
    """Every indexed layer given as full (``--index-share FF...``) is the model without Index Share: the training
    form's logits and the resident and ESS engines' greedy tokens are transformers' (the golden fixtures)."""
    import ess_jax
    from helpers import ONLINE

    path = Path(__file__).parent / "fixtures" / fixture
    plain = load_model(path)
    layers = len(plain.cfg.index_layers)
    model = load_model(path, index_share="F" * layers)
    assert model.cfg.indexer_types == ("full",) * layers
    ref = np.load(path / "reference.npz")
    for i in range(len([k for k in ref.files if k.startswith("prompt_")])):
        prompt, logits, full = ref[f"prompt_{i}"], ref[f"logits_{i}"], ref[f"generate_{i}"]
        got = model.logits(prompt[None])[0]
        np.testing.assert_array_equal(got, plain.logits(prompt[None])[0])  # bit for bit the model without a pattern
        assert np.abs(got - logits).max() <= 1e-4 * np.abs(logits).max(), (fixture, i)
        for engine in ONLINE.values():
            result = ess_jax.generate(model, [prompt.tolist()], max_new_tokens=len(full) - len(prompt), engine=engine)
            assert result.output_ids[0] == full[len(prompt):].tolist(), (fixture, i, engine.offload)


def test_the_pattern_changes_the_model():
    """A shared pattern is not the all-full model (the shared layers' own indexers would pick other entries)."""
    full = load_model("tiny-v32-code")
    shared = load_model("tiny-v32-code", index_share="FSSS")
    assert not np.array_equal(full.logits([PROMPTS[0]]), shared.logits([PROMPTS[0]]))


# ---- checkpoints -----------------------------------------------------------------------------------


def test_checkpoint_with_indexers_on_full_layers_only(tmp_path):
    model = load_model("tiny-v32-code", index_share="FSFS")
    raw = dict(resolve_model("tiny-v32-code").raw_config(), index_topk_pattern="FSFS")
    checkpoint.save(nnx.state(model.module), raw, tmp_path / "shared")
    names = checkpoint.hf_tensors(nnx.state(model.module))
    assert {int(n.split(".")[2]) for n in names if ".indexer." in n} == {0, 2, 4}  # 4: the MTP block's own
    loaded = load_model(tmp_path / "shared")  # its config's pattern: loads
    np.testing.assert_array_equal(loaded.logits([PROMPTS[1]]), model.logits([PROMPTS[1]]))
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


@pytest.fixture(scope="module")
def searched(corpus, start, tmp_path_factory) -> Path:  # noqa: F811
    """The greedy search of ``start``'s two indexers down to one: its checkpoint."""
    out = tmp_path_factory.mktemp("search")
    flags = ["--model", str(start), "--data", str(corpus), "--out", str(out), "--context", "32", "--batch", "2",
             "--eval-batches", "1"]
    assert train.main(flags + ["--index-share-search", "--keep", "0.5"]) == 0
    return out


def test_greedy_search_drops_indexers_by_heldout_loss(corpus, start, searched):  # noqa: F811
    out = searched
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
        loss = lambda p, r: nnx.merge(graphdef, p, r).train_forward(tokens, "warmup")[1]  # noqa: E731
        g = jax.jit(jax.grad(loss))(indexers, rest)
        return {n: v for n, v in checkpoint.hf_tensors(g).items() if n.startswith("model.layers.0.")}

    own, shared = grads("FF"), grads("FS")
    assert own.keys() == shared.keys() and own
    assert any(not np.allclose(own[n], shared[n]) for n in own)


def test_bench_records_each_patterns_heldout_nll(start, searched, tmp_path, capsys):  # noqa: F811
    """``bench --index-share DIR --record``: a searched checkpoint of the model, resident and with ESS; its held-out
    NLL (the model's train.json held-out text, the full forward) and how it was made written into that train.json;
    its shared layer's misses fetched a layer ahead."""
    model = shutil.copytree(start, tmp_path / "model")
    text = tmp_path / "heldout.py"
    text.write_text("".join(f"def wrap{j}(text):\n    return text[:{j}] * {j}\n" for j in range(40)))
    heldout = {"text": str(text), "tokens": 64, "context": 32}
    (model / "train.json").write_text(json.dumps({"heldout": heldout}))
    assert bench_main(["--model", str(model), "--index-share", str(searched), "--context", "40", "--batch", "1",
                       "--new-tokens", "4", "--repeats", "1", "--warmup-steps", "0", "--record", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    recorded = json.loads((model / "train.json").read_text())
    (entry,) = recorded["index_share"]
    assert recorded["heldout"] == heldout and entry["pattern"] == "FS" and entry["search"]["keep"] == 0.5
    shared = load_model(start, index_share="FS")  # two windows of 32 tokens, each scored from its start
    ids = np.asarray(shared.tokenizer.encode(text.read_text())[:64]).reshape(2, 32)
    logits = np.asarray(shared.logits(ids[:, :-1]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    assert entry["heldout_nll"] == pytest.approx(-np.take_along_axis(logp, ids[:, 1:, None], -1).mean(), rel=1e-5)
    resident, ess = rows
    assert ess["offload"] == "ess" and [c["lead"] for c in ess["per_layer"]] == [0, 1]
    assert ess["tokens_match_resident"] and resident["heldout_nll"] == ess["heldout_nll"] == entry["heldout_nll"]

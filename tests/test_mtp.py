"""DeepSeek's MTP module (models/mtp.py): the training form against a plain-jnp reference of its definition
(DeepSeek-V3 2.2 for V3.2, DeepSeek's V4 ``MTPBlock``), the cached form against the training form (chunked
prefill, decode, a row that skips steps, fragmented pages), its loading (transformers and release names, the
release's copies, partial and absent layers), the planner's parts, the MTP loss in ess_jax.train and the
shipped checkpoints' modules.

The reference writes the module's own math (norms, the embedding / hidden combination, V4's per-stream
projection and hc head, the shared head, which positions and tokens pair up) in jnp from the formulas; its
decoder block is the family's ``DecoderLayer`` given the MTP layer's weights by name, the layer
tests/test_hf_parity_v32.py and tests/test_deepseek_v4.py check against transformers."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from ess_jax import checkpoint, families, train
from ess_jax.api import load_model
from ess_jax.cache import StepMeta
from ess_jax.checkpoint import CheckpointError
from ess_jax.config import ConfigError, ModelConfig, preset_dict
from ess_jax.families import load_config
from ess_jax.models.deepseek_v32 import model as deepseek_v32
from ess_jax.models.deepseek_v4 import model as deepseek_v4
from ess_jax.models.layers import rope_cos_sin, rope_inv_freq
from helpers import small_v32_json, v4_release_name

ROOT = Path(__file__).resolve().parents[1]


def small_raw(family: str, **extra) -> dict:
    """Small configs with an MTP module; V4's block is a CSA layer (its own compressors and indexer, top-k 2
    of its entries), V3.2's indexer picks 8 positions: both select sparsely within 24 tokens."""
    if family == "v32":
        return dict(small_v32_json(), num_nextn_predict_layers=1, **extra)
    raw = json.loads((ROOT / "configs" / "tiny-v4.json").read_text())
    return dict(raw, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                q_lora_rank=32, n_routed_experts=4, index_n_heads=2, index_head_dim=16, head_dim=32, o_lora_rank=16,
                sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, index_topk=2, mlp_layer_types=["hash_moe", "moe"],
                layer_types=["sliding_attention", "compressed_sparse_attention", "compressed_sparse_attention"],
                num_nextn_predict_layers=1, **extra)


def lively(raw: dict, seed: int = 0):
    """A model of ``raw`` with lively weights drawn in NumPy as ``helpers.randomize`` draws them (matrices
    N(0, 1.5^2 / fan_in), vectors 1 + 0.1 N, biases 0.1 N; hash routes kept), without compiling a draw per shape."""
    cfg = load_config(raw)
    module = nnx.eval_shape(lambda: families.get(cfg.family).module_cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(module)
    rng, filled = np.random.default_rng(seed), []
    for path, v in nnx.to_flat_state(state):
        shape, name = tuple(v.shape), path[-1]
        if path[-1] == "tid2eid":
            value = np.argsort(rng.random((shape[-2], cfg.n_routed_experts)), -1)[..., :shape[-1]]
            value = np.broadcast_to(value, shape).astype(np.int32)
        elif len(shape) - checkpoint.stacked(path) >= 2:
            value = rng.normal(size=shape) * 1.5 / np.sqrt(shape[-1])
        else:
            value = rng.normal(size=shape) * 0.1 + (name not in ("bias", "e_score_correction_bias"))
        filled.append((path, v.replace(jnp.asarray(value, v.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


@pytest.fixture(scope="module", params=["v32", "v4"])
def model(request):
    return lively(small_raw(request.param))


@functools.partial(jax.jit, static_argnums=0)
def _forms(graphdef, params, tokens, scale_BT):
    """The training forms over the positions of ``tokens[:, :-1]``: the main hidden states (times ``scale_BT``
    before the MTP module reads them) and logits, the MTP module's logits, hidden states and indexer loss."""
    module = nnx.merge(graphdef, params)
    hidden, _ = module.hidden_states(tokens[:, :-1], None)
    mtp, mtp_hidden, kl = module.mtp_forward(hidden * scale_BT.reshape(scale_BT.shape + (1,) * (hidden.ndim - 2)),
                                             tokens[:, 1:])
    return dict(hidden=hidden, main=module.head(hidden), mtp=mtp, mtp_hidden=mtp_hidden, kl=kl)


@pytest.fixture(scope="module")
def full(model):
    tokens = sequences(model.cfg)
    return dict(_forms(*nnx.split(model), tokens, jnp.ones(tokens[:, 1:].shape)), tokens=tokens)


def sequences(cfg: ModelConfig, length: int = 25, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (2, length), 3, cfg.vocab_size)


# ---- the reference -----------------------------------------------------------------------------------

def rms(x, weight, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def block_of(cfg: ModelConfig, tensors: dict):
    """The family's decoder layer with the MTP layer's weights, read by transformers name."""
    cls = deepseek_v32.DecoderLayer if cfg.family == "deepseek_v32" else deepseek_v4.DecoderLayer
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg.mtp_block(), 0, dtype=jnp.float32, rngs=nnx.Rngs(9))))
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    filled = [(path, v.replace(jnp.asarray(tensors[prefix + checkpoint.hf_name(path).removeprefix("model.")])))
              for path, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def reference_mtp(module, hidden, next_tokens):
    """The MTP logits at positions 0..T-1 from the definition (DOMAIN.md 1.6; models/mtp.py's formulas)."""
    cfg = module.cfg
    tensors = checkpoint.hf_tensors(nnx.state(module))
    graphdef, block = nnx.split(block_of(cfg, tensors))
    return jax.jit(lambda tensors, block, hidden, next_tokens: _reference(
        cfg, tensors, nnx.merge(graphdef, block), hidden, next_tokens))(tensors, block, hidden, next_tokens)


def _reference(cfg, tensors, block, hidden, next_tokens):
    mtp = lambda name: tensors[f"model.layers.{cfg.num_hidden_layers}.{name}"]  # noqa: E731
    eps = cfg.rms_norm_eps
    e = rms(tensors["model.embed_tokens.weight"][next_tokens], mtp("enorm.weight"), eps)
    if cfg.family == "deepseek_v32":
        x = jnp.concatenate([e, rms(hidden, mtp("hnorm.weight"), eps)], axis=-1) @ mtp("eh_proj.weight").T
        b, t = next_tokens.shape
        cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(t), (b, t)), rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim),
                                cfg.rope.cos_sin_scale)
        out, *_ = block(x, cos, sin)  # the output, the indexer KL, the picks
    else:  # the embedding's projection added to every stream, each stream normed and projected alone
        x = (e @ mtp("e_proj.weight").T)[:, :, None, :] + rms(hidden, mtp("hnorm.weight"), eps) @ mtp("h_proj.weight").T
        streams, *_ = block(x, next_tokens)
        b, t, o, d = streams.shape
        flat = streams.reshape(b, t, o * d)
        mix = rms(flat, 1.0, eps) @ mtp("hc_head.hc_fn").T
        pre = jax.nn.sigmoid(mix * mtp("hc_head.hc_scale") + mtp("hc_head.hc_base")) + cfg.hc_eps
        out = jnp.einsum("bto,btod->btd", pre, streams)
    return rms(out, mtp("shared_head.norm.weight"), eps) @ tensors["lm_head.weight"].T


def test_the_training_form_is_the_definition(model, full):
    tokens, hidden, logits = full["tokens"], full["hidden"], full["mtp"]
    assert logits.shape == (2, 24, model.cfg.vocab_size) and full["mtp_hidden"].shape == hidden.shape
    assert float(full["kl"]) == 0
    want = reference_mtp(model, hidden, tokens[:, 1:])
    assert float(jnp.std(want)) > 0.5  # lively, not near ties
    np.testing.assert_allclose(logits, want, atol=2e-4, rtol=2e-4)
    # the hidden state and the next token both reach the logits, and only their own position's (causal)
    graphdef, params = nnx.split(model)
    ones = jnp.ones(tokens[:, 1:].shape)
    other = _forms(graphdef, params, tokens.at[:, 11].set(5), ones)["mtp"]  # t_11 is position 10's next token
    assert not np.allclose(other[:, 10], logits[:, 10]) and np.allclose(other[:, :10], logits[:, :10], atol=1e-5)
    other = _forms(graphdef, params, tokens, ones.at[:, 10].set(-1.0))["mtp"]
    assert not np.allclose(other[:, 10], logits[:, 10]) and np.allclose(other[:, :10], logits[:, :10], atol=1e-5)


# ---- the cached form ---------------------------------------------------------------------------------

_BOTH = jax.jit(lambda graphdef, p, tokens, next_tokens, meta, cache, mtp_cache: _both(
    nnx.merge(graphdef, p), tokens, next_tokens, meta, cache, mtp_cache), static_argnums=0)


def _both(module, tokens, next_tokens, meta, cache, mtp_cache):
    """One engine-like step: the main model's cached step, then the MTP module's on its hidden states."""
    logits, hidden, _, cache = module.step_hidden(tokens, meta, cache)
    mtp_logits, mtp_hidden, mtp_cache = module.mtp_step(hidden, next_tokens, meta, mtp_cache)
    return logits, hidden, mtp_logits, mtp_hidden, cache, mtp_cache


def test_the_cached_form_matches_the_training_form(model, full):
    """Two requests on interleaved, reversed pages, in steps of 4 tokens (one compile): a first chunk each, a
    second that only request 0 runs (request 1's rows must survive it), then request 1's, then both, the MTP
    step at each step's positions with the next tokens. Logits and hidden states of both the main
    model and the MTP module equal the training forms'."""
    page_size, pages = 4, 7
    seqs = full["tokens"]
    table = jnp.asarray(np.stack([np.arange(b + 1, 2 * pages + 1, 2)[::-1] for b in range(2)]).astype(np.int32))
    cache = model.init_cache(2, 2 * pages + 1, page_size)
    mtp_cache = model.init_mtp_cache(2, 2 * pages + 1, page_size)
    graphdef, params = nnx.split(model)
    lengths, seen = np.zeros(2, int), {0: {}, 1: {}}
    plan = [(4, (1, 1)), (4, (1, 0)), (4, (0, 1))] + [(4, (1, 1))] * 4
    for t, runs in plan:
        positions = np.stack([np.arange(n, n + t) for n in lengths]).astype(np.int32)
        valid = np.broadcast_to(np.asarray(runs, bool)[:, None], (2, t))
        rows = np.arange(2)[:, None]
        meta = StepMeta(jnp.asarray(positions), jnp.asarray(valid), table, jnp.arange(2, dtype=jnp.int32))
        out = _BOTH(graphdef, params, seqs[rows, positions], seqs[rows, positions + 1], meta, cache, mtp_cache)
        *values, cache, mtp_cache = out
        for b in range(2):
            if runs[b]:
                for i, p in enumerate(positions[b]):
                    seen[b][int(p)] = [np.asarray(v[b, i]) for v in values]
        lengths += np.asarray(runs) * t
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(24))
    for b in range(2):
        for p in range(24):
            for got, want in zip(seen[b][p], (full["main"], full["hidden"], full["mtp"], full["mtp_hidden"])):
                np.testing.assert_allclose(got, np.asarray(want[b, p]), atol=2e-4, rtol=2e-4, err_msg=f"{b} {p}")


def test_the_mtp_cache_is_the_blocks_and_the_planner_counts_it(model):
    cfg, family = model.cfg, families.get(model.cfg.family)
    mtp_cache = model.init_mtp_cache(3, 9, 4)
    parts = family.mtp_cache_parts(cfg, family.stored_formats("float32", "float32"))
    block = families.get(cfg.family).cache_parts(cfg.mtp_block(), family.stored_formats("float32", "float32"))
    assert [p.name for p in parts] == [f"MTP {p.name}" for p in block]
    assert all(p.layers <= 1 for p in parts) and any(p.layers for p in parts)
    main = model.init_cache(3, 9, 4)
    # one layer of the main cache's kind (same page geometry: the main page table serves it)
    for mine, theirs in zip(jax.tree.leaves(mtp_cache), jax.tree.leaves(main)):
        assert mine.shape[1:] == theirs.shape[1:] and mine.dtype == theirs.dtype and mine.shape[0] <= 1
    paged = sum(p.page_bytes(4) for p in parts)
    fixed = sum(p.bytes(0) for p in parts if not p.tokens_per_row)
    assert 9 * paged + 3 * fixed == sum(x.nbytes for x in jax.tree.leaves(mtp_cache))
    assert family.mtp_cache_parts(cfg.without_mtp(), family.stored_formats("float32", "float32")) == []


# ---- config and loading ------------------------------------------------------------------------------

def test_config_fields():
    assert load_config(small_v32_json()).num_nextn_predict_layers == 0
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=2: ess_jax builds one MTP module"):
        load_config(small_raw("v32") | {"num_nextn_predict_layers": 2})
    flash = load_config(preset_dict("deepseek-v4-flash"))  # compress_ratios' last entry: the MTP block's
    assert flash.num_nextn_predict_layers == 1 and flash.mtp_layer_types == ("sliding_attention",)
    raw = small_raw("v4")
    assert load_config(raw).mtp_layer_types == ("compressed_sparse_attention",)
    raw["layer_types"] = raw["layer_types"][:2]  # no entry past the layers: sliding, as both releases
    assert load_config(raw).mtp_layer_types == ("sliding_attention",)
    raw = dict(raw, layer_types=None, compress_ratios=[0, 4, 128])
    block = load_config(raw).mtp_block()
    assert block.num_hidden_layers == 1 and block.layer_types == ("heavily_compressed_attention",)
    assert block.mlp_layer_types == ("moe",) and block.num_nextn_predict_layers == 0


def _write(directory: Path, tensors: dict, raw: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def _same_params(a, b, keep=lambda path: True):
    """``a``'s parameters are ``b``'s (those at the paths ``keep`` keeps)."""
    fa, fb = nnx.to_flat_state(nnx.state(a)), [(p, v) for p, v in nnx.to_flat_state(nnx.state(b)) if keep(p)]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


def test_loading_the_mtp_layer(tmp_path):
    """transformers names with the release's copies of the embedding and head beside the MTP layer (not read:
    tied); a partial MTP layer refused naming a missing tensor; a checkpoint without it: the model without it."""
    raw = small_raw("v32")
    module = lively(raw)
    tensors = checkpoint.hf_tensors(nnx.state(module))
    mtp = f"model.layers.{module.cfg.num_hidden_layers}."
    copies = {mtp + "embed_tokens.weight": np.zeros_like(tensors["model.embed_tokens.weight"]),
              mtp + "shared_head.head.weight": np.zeros_like(tensors["lm_head.weight"])}
    _same_params(load_model(_write(tmp_path / "full", tensors | copies, raw)).module, module)

    partial = {k: v for k, v in tensors.items() if k != mtp + "eh_proj.weight"}
    with pytest.raises(CheckpointError, match=f"holds part of the MTP module .* but not {mtp}eh_proj.weight"):
        load_model(_write(tmp_path / "partial", partial, raw))

    main = {k: v for k, v in tensors.items() if not k.startswith(mtp)}
    loaded = load_model(_write(tmp_path / "main", main, raw))
    assert loaded.cfg.num_nextn_predict_layers == 0 and not hasattr(loaded.module, "mtp")
    assert loaded.cfg == module.cfg.without_mtp()
    _same_params(loaded.module, module, keep=lambda path: path[0] != "mtp")


def test_loading_the_v4_release_mtp_block(tmp_path):
    """The V4 release's ``mtp.0.*`` names (its ``norm`` and ``hc_head_*``, the block in release names) load as
    layer num_hidden_layers."""
    raw = small_raw("v4")
    module = lively(raw)
    n = module.cfg.num_hidden_layers
    extras = {"shared_head.norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn",
              "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
    release = {}
    for name, value in checkpoint.hf_tensors(nnx.state(module)).items():
        if name.startswith(f"model.layers.{n}."):
            rest = name.removeprefix(f"model.layers.{n}.")
            name = "mtp.0." + extras.get(rest, v4_release_name(f"model.layers.0.{rest}").removeprefix("layers.0."))
        else:
            name = v4_release_name(name)
        release[name] = value
    assert "mtp.0.e_proj.weight" in release and "mtp.0.attn.wq_a.weight" in release and "mtp.0.norm.weight" in release
    _same_params(load_model(_write(tmp_path / "release", release, raw)).module, module)


# ---- training ----------------------------------------------------------------------------------------

class Args:
    lr, warmup_steps, steps, weight_decay = 3e-3, 2, 20, 0.1


def _train(family: str, stage: str, train_scope: str, mtp_weight: float, n: int):
    module = lively(small_raw(family))
    learns = train.trainable(stage, train_scope, mtp_weight > 0)
    graphdef, trained, frozen = nnx.split(module, learns, ...)
    dtypes = tuple(jax.tree.map(lambda a: a.dtype, s) for s in (trained, frozen))
    optimizer, _ = train.make_optimizer(Args)
    step = train.make_train_step(train.loss_fn(graphdef, stage, dtypes, mtp_weight, train_scope), optimizer)
    batch = sequences(module.cfg, 33)
    before, opt_state, history = dict(nnx.to_flat_state(nnx.state(module))), optimizer.init(trained), []
    for _ in range(n):
        trained, opt_state, sums, _ = step(trained, opt_state, frozen, batch[None])
        history.append(np.asarray(sums))
    after = dict(nnx.to_flat_state(nnx.state(nnx.merge(graphdef, trained, frozen))))
    changed = {p for p in before if not np.array_equal(before[p][...], after[p][...])}
    return module, batch, changed, np.asarray(history)


def test_the_mtp_loss_is_the_cross_entropy_of_the_token_two_ahead(model, full):
    """The training loss at ``sparse`` (the inference form plus the indexers' KL) on the 25 tokens of ``full``:
    its MTP term is the cross-entropy of ``t_{i+2}`` from the MTP logits at ``i`` (its first 23 positions, the
    module being causal), its acceptance and top-1 those of the greedy drafts."""
    graphdef, trained, frozen = nnx.split(model, train.trainable("sparse", "all", True), ...)
    dtypes = tuple(jax.tree.map(lambda a: a.dtype, s) for s in (trained, frozen))
    loss = jax.jit(train.loss_fn(graphdef, "sparse", dtypes, 0.3))
    total, (lm, kl, mtp, accept, top1) = loss(trained, frozen, full["tokens"])
    logits = np.asarray(full["mtp"][:, :23], np.float64)
    labels = np.asarray(full["tokens"][:, 2:])
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    assert float(mtp) == pytest.approx(-np.take_along_axis(logp, labels[..., None], -1).mean(), rel=1e-4)
    assert float(total) == pytest.approx(float(lm + 0.3 * mtp + kl), rel=1e-5)
    drafts = logits.argmax(-1)
    assert float(accept) == pytest.approx((drafts == np.asarray(full["main"][:, 1:24]).argmax(-1)).mean())
    assert float(top1) == pytest.approx((drafts == labels).mean())


def test_train_mtp_learns_only_the_mtp_module():
    _, _, changed, history = _train("v32", "dense", "mtp", 0.3, 12)
    assert changed and all(train.is_mtp(p) for p in changed)
    assert not any(train.is_indexer(p) for p in changed)  # dense: the MTP block's indexer waits for warmup
    assert history[-1, 3] < 0.7 * history[0, 3], history[:, 3]
    assert np.allclose(history[:, 1], history[0, 1])  # the main model's loss does not move


@pytest.mark.parametrize("family", ["v32", "v4"])
def test_what_learns(family):
    """With the MTP loss the whole model learns; ``--train mtp`` only the MTP module's parameters of the stage;
    without the loss the MTP module stays as it is."""
    module = nnx.eval_shape(lambda: lively(small_raw(family)))
    learns = lambda *args: {p for p, _ in nnx.to_flat_state(nnx.split(module, train.trainable(*args), ...)[1])}  # noqa
    every = {p for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    mtp = {p for p in every if train.is_mtp(p)}
    assert learns("sparse", "all", True) == every and learns("sparse", "all", False) == every - mtp
    assert learns("sparse", "mtp", True) == mtp
    assert learns("warmup", "mtp", True) == {p for p in mtp if train.is_indexer(p)} != set()
    assert learns("dense", "mtp", True) == {p for p in mtp if not train.is_indexer(p)}


def test_the_cli_adds_and_trains_an_mtp_module_on_frozen_weights(tmp_path, capsys):
    """``--train mtp`` on a checkpoint without an MTP module: the export has one, its main tensors are the
    start's bytes; a resumed run must repeat the MTP flags; ``--train mtp`` needs a weight."""
    corpus, start = tmp_path / "corpus", tmp_path / "start"
    corpus.mkdir()
    tok = (ROOT / "checkpoints" / "tiny-v32-code" / "tokenizer.json").read_bytes()
    (corpus / "tokenizer.json").write_bytes(tok)
    ids = np.asarray(jax.random.randint(jax.random.key(1), (3000,), 3, 4096), np.uint16)
    np.save(corpus / "train.npy", ids)
    np.save(corpus / "heldout.npy", ids[:500])
    raw = dict(small_v32_json(), vocab_size=4096)
    checkpoint.save(nnx.state(lively(raw)), raw, start)
    (start / "tokenizer.json").write_bytes(tok)

    def run(out, steps, *extra):
        return train.main(["--model", str(start), "--data", str(corpus), "--out", str(out), "--steps", str(steps),
                           "--context", "32", "--batch", "2", "--eval-every", "2", "--eval-batches", "1",
                           "--checkpoint-every", "2", "--no-progress", "--train", "mtp", "--mtp-weight", "0.3",
                           *extra])

    assert run(tmp_path / "a", 4) == 0
    shipped, exported = load_file(start / "model.safetensors"), load_file(tmp_path / "a" / "model.safetensors")
    assert all(exported[k].tobytes() == v.tobytes() for k, v in shipped.items())
    assert {k for k in exported if k not in shipped} and all(k.startswith("model.layers.2.") for k in exported
                                                              if k not in shipped)
    model = load_model(tmp_path / "a")
    assert model.cfg.num_nextn_predict_layers == 1
    log = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert {"heldout_mtp", "heldout_acceptance", "heldout_mtp_top1"} <= set(log[-1])
    assert run(tmp_path / "a", 4, "--mtp-weight", "0.1") == 2  # a resumed run repeats the MTP flags
    assert "other flags (mtp_weight: [0.3])" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "m", "--data", "d", "--out", "o", "--steps", "1", "--train", "mtp"])


# ---- the shipped checkpoints -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-v32-code", "tiny-v4-code"])
def test_the_shipped_mtp_modules_draft_the_main_models_next_token(name):
    """The shipped checkpoints' MTP modules reproduce the held-out acceptance and draft top-1 train.json
    recorded (the same windows of the held-out text), far above an untrained module's (about 0)."""
    model = load_model(name)
    record = json.loads((ROOT / "checkpoints" / name / "train.json").read_text())["mtp"]
    ids = model.tokenizer.encode((ROOT / record["text"]).read_text())[: record["tokens"]]
    context = record["context"]
    assert len(ids) % context == 0

    @jax.jit
    def agreement(params, window):
        module = nnx.merge(model.graphdef, params)
        hidden, _ = module.hidden_states(window, None)
        return train.mtp_agreement(module.head(hidden), module.mtp_forward(hidden[:, :-2], window[:, 1:-1])[0],
                                   window)

    accept, top1 = np.mean([agreement(model.params, jnp.asarray([ids[i:i + context]]))
                            for i in range(0, len(ids), context)], axis=0)
    assert accept == pytest.approx(record["acceptance"], abs=0.01) and accept > 0.3
    assert top1 == pytest.approx(record["mtp_top1"], abs=0.01)

"""ess_jax.train: the stages' losses and what each lets learn, the optimizer step, the CLI's checkpoints
and resumption, on two-layer models with a top-k that selects at 32 tokens."""

import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ess_jax import checkpoint, train
from ess_jax.api import load_model
from ess_jax.families import load_config
from ess_jax.models.deepseek_v32 import DeepseekV32
from ess_jax.models.deepseek_v4 import DeepseekV4
from helpers import randomize

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def small_raw(family: str) -> dict:
    """The tiny presets cut down (fewer layers, narrower, fewer experts): fast to compile."""
    narrow = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  q_lora_rank=32, n_routed_experts=4, index_n_heads=2, index_head_dim=16)
    if family == "v32":
        raw = json.loads((CONFIGS / "tiny-v32.json").read_text())
        return dict(raw, **narrow, intermediate_size=128, num_key_value_heads=2, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1, index_topk=8)
    raw = json.loads((CONFIGS / "tiny-v4.json").read_text())
    return dict(raw, **narrow, head_dim=32, o_lora_rank=16, sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3,
                layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"],
                index_topk=2)


def small_model(family: str, seed: int = 0):
    cfg = load_config(small_raw(family))
    cls = DeepseekV32 if family == "v32" else DeepseekV4
    return randomize(cls(cfg, rngs=nnx.Rngs(seed)), seed)


def tokens(batch: int = 2, length: int = 33, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 256)


def flat(state) -> dict:
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(state)}


class Args:
    lr, warmup_steps, steps, weight_decay = 3e-3, 2, 20, 0.0


def steps(family: str, stage: str, n: int, batch):
    """``n`` optimizer steps of ``stage`` on one fixed batch: (params before, after, per-step (loss, lm, kl))."""
    module = small_model(family)
    graphdef, trained, frozen = nnx.split(module, train.trainable(stage), ...)
    dtypes = tuple(jax.tree.map(lambda a: a.dtype, s) for s in (trained, frozen))
    optimizer, _ = train.make_optimizer(Args)
    step = train.make_train_step(train.loss_fn(graphdef, stage, dtypes), optimizer)
    before, opt_state, history = nnx.split(module)[1], optimizer.init(trained), []
    for _ in range(n):
        trained, opt_state, sums, _ = step(trained, opt_state, frozen, batch[None])
        history.append(np.asarray(sums))
    after = nnx.split(nnx.merge(graphdef, trained, frozen))[1]
    return flat(before), flat(after), np.asarray(history)


def test_dense_steps_lower_the_loss_on_a_fixed_batch():
    before, after, history = steps("v32", "dense", 20, tokens())
    assert history[-1, 0] < 0.7 * history[0, 0], history[:, 0]
    changed = {p for p in before if not np.array_equal(before[p], after[p])}
    assert changed and not any(train.is_indexer(p) for p in changed)  # the indexer does not learn densely


@pytest.mark.parametrize("family", ["v32", "v4"])
def test_warmup_changes_only_the_indexer_and_lowers_its_kl(family):
    before, after, history = steps(family, "warmup", 12, tokens())
    changed = {p for p in before if not np.array_equal(before[p], after[p])}
    assert changed and all(train.is_indexer(p) for p in changed), sorted(changed)[:4]
    assert history[0, 2] > 0.01 and history[-1, 2] < 0.8 * history[0, 2], history[:, 2]
    np.testing.assert_array_equal(history[:, 0], history[:, 2])  # the warm-up loss is the KL alone


@pytest.mark.parametrize("family", ["v32", "v4"])
def test_sparse_stage_losses_reach_disjoint_parameters(family):
    module = small_model(family)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    batch = tokens()

    def parts(params):
        logits, kl = nnx.merge(graphdef, params, rest).train_forward(batch[:, :-1], "sparse")
        lm = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], -1).mean()
        return lm, kl

    grads = jax.jit(lambda p: (jax.grad(lambda q: parts(q)[1])(p), jax.grad(lambda q: parts(q)[0])(p)))
    grad_kl, grad_lm = (flat(g) for g in grads(params))
    indexer = {p for p in grad_kl if train.is_indexer(p)}
    assert indexer and len(indexer) < len(grad_kl)
    for path in grad_kl:
        if path in indexer:  # the LM loss passes no gradient through the top-k selection
            assert not np.any(grad_lm[path]), path
        else:  # the indexer reads detached inputs
            assert not np.any(grad_kl[path]), path
    assert any(np.any(grad_kl[p]) for p in indexer) and any(np.any(grad_lm[p]) for p in grad_lm if p not in indexer)
    # inference is the sparse stage without the KL
    logits, kl = jax.jit(lambda p: nnx.merge(graphdef, p, rest).train_forward(batch, "sparse"))(params)
    np.testing.assert_allclose(logits, jax.jit(lambda p: nnx.merge(graphdef, p, rest)(batch))(params), atol=1e-6)
    assert float(kl) > 0


def test_stage_dense_is_dense_attention():
    graphdef, state = nnx.split(small_model("v32"))
    batch = tokens(1, 32)
    forward = jax.jit(lambda state, stage: nnx.merge(graphdef, state).train_forward(batch, stage)[0],
                      static_argnums=1)
    dense, warm, sparse = (forward(state, stage) for stage in ("dense", "warmup", None))
    np.testing.assert_array_equal(dense, warm)  # both attend to every causal position
    assert not np.allclose(dense, sparse, atol=1e-3)  # top-8 of 32 positions is a real selection
    module = nnx.merge(graphdef, state)
    with pytest.raises(ValueError, match="stage='full'"):
        module.train_forward(batch, "full")


# ---- the CLI: a corpus, checkpoints, resumption ------------------------------------------------------

def _build_corpus():
    spec = importlib.util.spec_from_file_location("build_corpus", CONFIGS.parent / "tools" / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    lib = tmp_path_factory.mktemp("lib")
    for i in range(12):
        (lib / f"mod{i}.py").write_text("".join(f"def f{j}(x, y={i}):\n    return x * y + {j}\n\n" for j in range(40)))
    (lib / "textwrap.py").write_text("".join(f"def wrap{j}(text):\n    return text[:{j}]\n" for j in range(60)))
    out = tmp_path_factory.mktemp("corpus")
    _build_corpus().build(lib, out, 300)
    return out


@pytest.fixture(scope="module")
def start(corpus, tmp_path_factory) -> Path:
    """A small V3.2 checkpoint on the corpus' vocabulary to continue (a preset would compile slower)."""
    raw = dict(small_raw("v32"), vocab_size=300, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    module = DeepseekV32(load_config(raw), rngs=nnx.Rngs(0))
    out = checkpoint.save(nnx.state(module), raw, tmp_path_factory.mktemp("start"))
    (out / "tokenizer.json").write_bytes((corpus / "tokenizer.json").read_bytes())
    return out


def test_from_scratch_takes_the_tokenizers_vocabulary(corpus, tmp_path):
    raw, scratch = train.raw_config("tiny-v32", corpus / "tokenizer.json")
    assert scratch and raw["vocab_size"] == 300 and (raw["bos_token_id"], raw["eos_token_id"]) == (0, 1)
    assert raw["hidden_size"] == json.loads((CONFIGS / "tiny-v32.json").read_text())["hidden_size"]
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    (bigger / "config.json").write_text(json.dumps(dict(raw, vocab_size=320)))
    with pytest.raises(ValueError, match="vocab_size=320, the corpus tokenizer 300"):
        train.raw_config(str(bigger), corpus / "tokenizer.json")


def cli(start: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(start), "--data", str(corpus), "--out", str(out), "--steps", "4", "--context", "32",
            "--batch", "2", "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every", "2", "--no-progress",
            *extra]


@pytest.fixture(scope="module")
def straight(start, corpus, tmp_path_factory) -> Path:
    """A four-step run that nothing interrupted; ``snapshot/`` beside it: its directory as the step-2
    checkpoint left it (what a run killed after that checkpoint leaves)."""
    out = tmp_path_factory.mktemp("straight")
    real_export = train.export

    def keep_snapshot(directory, *args):
        real_export(directory, *args)
        if json.loads((directory / "state.json").read_text())["step"] == 2:
            shutil.copytree(directory, directory.parent / "snapshot")

    train.export = keep_snapshot
    try:
        assert train.main(cli(start, corpus, out)) == 0
    finally:
        train.export = real_export
    return out


def test_cli_checkpoint_loads_with_equal_logits_and_resumes_exactly(start, corpus, straight, tmp_path):
    log = [json.loads(line) for line in (straight / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4] and all("heldout_lm" in r for r in log)
    assert json.loads((straight / "state.json").read_text())["step"] == 4

    # the exported checkpoint, loaded by load_model with the corpus tokenizer
    model = load_model(straight)
    assert model.cfg.vocab_size == 300 and model.cfg.bos_token_id == 0
    ids = model.tokenizer.encode("def f(x):\n    return x")
    assert ids[0] == 0 and model.tokenizer.decode(ids) == "def f(x):\n    return x"
    graphdef, trained, frozen = nnx.split(nnx.merge(model.graphdef, model.params), train.trainable("dense"), ...)
    with np.load(straight / "state.npz") as saved:
        for i, leaf in enumerate(jax.tree.leaves(trained)):
            np.testing.assert_array_equal(np.asarray(leaf), saved[f"p{i}"])
    direct = nnx.merge(graphdef, trained, frozen)(jnp.asarray([ids]))
    np.testing.assert_allclose(model.logits([ids]), direct, atol=1e-6)

    # killed after the step-2 checkpoint, then run again with the same flags: the same parameters
    resumed = tmp_path / "resumed"
    shutil.copytree(straight.parent / "snapshot", resumed)
    assert json.loads((resumed / "state.json").read_text())["step"] == 2
    assert train.main(cli(start, corpus, resumed)) == 0
    with np.load(straight / "state.npz") as a, np.load(resumed / "state.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_cli_refuses_changed_flags_and_bad_input(start, corpus, straight, tmp_path, capsys):
    assert train.main(cli(start, corpus, straight, "--lr", "1e-2")) == 2
    assert "other flags (lr" in capsys.readouterr().err
    assert train.main(cli(start, tmp_path / "nowhere", tmp_path / "x")) == 2
    assert "build it with tools/build_corpus.py" in capsys.readouterr().err
    assert train.main(cli(start, corpus, tmp_path / "y", "--context", "100000")) == 2
    assert "--context" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(cli(start, corpus, straight, "--batch", "0"))
    assert exit_info.value.code == 2

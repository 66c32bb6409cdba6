"""``python -m ess_jax.train``: train a model from scratch or continue a checkpoint, one stage per run.

Stages (``--stage``; DeepSeek-V3.2's indexer training, ``models.layers.STAGES``):
- ``dense``: language-model loss with dense causal attention; every parameter but the indexers' learns
  (pre-training a model from scratch);
- ``warmup``: only the indexers learn: the KL divergence between the main attention (summed over heads,
  L1-normalized over positions / V4's CSA entries) and the softmax of the index scores, dense attention;
- ``sparse``: the model learns the language-model loss with top-k attention, as it runs at inference,
  and the indexers the KL on their selected positions only, their inputs detached from the main loss.

Multi-token prediction (``models.mtp``, DeepSeek-V3 2.2 with depth 1): ``--mtp-weight L`` (> 0) adds the MTP
module's cross-entropy of the token two ahead, ``L * CE(MTP logits at i, t_{i+2})``, to the language-model
loss of the dense and sparse stages (DeepSeek-V3 used 0.3, then 0.1); the MTP block's indexer learns in the
warmup and sparse stages as the main indexers do. A model without an MTP module gets one, drawn from
``--seed`` (``num_nextn_predict_layers`` 1 in the exported config.json). ``--train mtp`` freezes the main
model: only the MTP module's parameters of the stage learn, the main model runs as at inference (top-k
attention, no indexer loss) and its weights are exported unchanged. With ``--mtp-weight 0`` (the default) a
model's MTP module stays as it is. The held-out evaluation then also reports the MTP loss, the acceptance
(the fraction of positions where the MTP module's greedy draft equals the main model's greedy next token,
teacher-forced: ``argmax mtp_i == argmax main_{i+1}``) and the draft's top-1 accuracy against ``t_{i+2}``.

Index Share (DOMAIN.md 1.7) of a trained checkpoint: ``--index-share PATTERN|every-N`` trains it with that pattern
of full (F) and shared (S) indexed layers, the shared layers' indexers dropped: in the warmup and sparse stages
each kept indexer learns against the attention of every layer it serves (its own and the shared ones after it:
the multi-layer distillation), and the exported config.json carries the pattern (``index_topk_pattern``).
``--index-share-search --keep F`` is the training-free variant, no optimizer step: starting from every indexer,
it drops one at a time the indexer whose loss raises the held-out language-model loss least, until a fraction
``F`` of them is left, and exports the checkpoint with that pattern (``index_share.json``: each step's pattern and
held-out loss).

Data: ``--data DIR`` as ``tools/build_corpus.py`` writes it: ``train.npy`` / ``heldout.npy`` (uint16 token
ids) and ``tokenizer.json``. A training example is ``--context + 1`` consecutive tokens at an offset
drawn from ``--seed``, the step and the micro-batch, so the data order is fixed by the seed and a
resumed run reads what an uninterrupted one would. The held-out loss is measured every
``--eval-every`` steps on ``--eval-batches`` fixed windows of heldout.npy, evenly spaced.

Optimizer: optax AdamW (b1 0.9, b2 0.95, ``--weight-decay``), gradient norm clipped at 1, learning rate
warmed up linearly over ``--warmup-steps`` then cosine-decayed to 10 % at ``--steps``; ``--accum``
micro-batches of ``--batch`` examples per step. ``--dtype bfloat16`` computes in bfloat16 (the model's
bfloat16 parameters, float32 ones stay float32) on float32 master weights.

``--model`` is a preset (``tiny-v32``, ``tiny-v4``: trained from scratch; vocabulary size and the
bos / eos / pad ids are taken from the data's tokenizer) or a checkpoint directory (continued; its
vocabulary must be the tokenizer's). ``--out DIR`` receives, every ``--checkpoint-every`` steps and at
the end, the training state (``state.npz`` + ``state.json``: parameters, optimizer state, step) and a
transformers checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``) that ``load_model``
loads; ``train_log.jsonl`` has one line per logged step. Running the same command again resumes from
the state (a run killed at any point loses at most the steps since the last checkpoint); the flags
must match the state's. A run whose state is at ``--steps`` exports and exits.

Errors print one line starting with "error:" and exit with 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from ess_jax.cli import Parser

# Flags that define the run: a resumed run must repeat them.
_RUN_FLAGS = ("model", "data", "stage", "steps", "context", "batch", "accum", "lr", "warmup_steps",
              "weight_decay", "seed", "dtype", "mtp_weight", "train", "index_share")


def parse_args(argv=None):
    p = Parser("python -m ess_jax.train", __doc__)
    p.add_argument("--model", required=True, help="preset (from scratch) or checkpoint directory (continued)")
    p.add_argument("--data", required=True, help="corpus directory (train.npy, heldout.npy, tokenizer.json)")
    p.add_argument("--out", required=True, help="output directory: training state and the exported checkpoint")
    p.add_argument("--stage", choices=["dense", "warmup", "sparse"], default="dense", help="training stage")
    p.add_argument("--mtp-weight", type=float, default=0.0,
                   help="weight L of the MTP module's loss (L_main + L * CE of t_{i+2}); 0: no MTP loss (default)")
    p.add_argument("--train", choices=["all", "mtp"], default="all",
                   help="all: the model (default); mtp: only the MTP module, the main weights frozen")
    p.add_argument("--index-share", default=None, metavar="PATTERN|every-N",
                   help="train with this Index Share pattern (F / S per indexed layer, or every-N), the shared layers' "
                        "indexers dropped, each kept one distilled for the layers it serves (warmup / sparse stages)")
    p.add_argument("--index-share-search", action="store_true",
                   help="no training: greedily drop indexers by held-out loss down to --keep of them, export that")
    p.add_argument("--keep", type=float, default=0.25, help="--index-share-search: fraction of indexers kept")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps of this run (required but for the search)")
    p.add_argument("--context", type=int, default=512, help="tokens per example (default 512)")
    p.add_argument("--batch", type=int, default=8, help="examples per micro-batch (default 8)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps (default 100)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    p.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (default 100)")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out micro-batches per evaluation (default 4)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="save every N steps (default 50)")
    p.add_argument("--log-every", type=int, default=10, help="train_log.jsonl line every N steps (default 10)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.steps is None:
        if not args.index_share_search:
            p.error("--steps is required")
        args.steps = 1
    if not 0 < args.keep <= 1:
        p.error(f"--keep {args.keep} must be in (0, 1]")
    for name in ("steps", "context", "batch", "accum", "eval_every", "eval_batches", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_steps < 0 or args.lr <= 0 or args.weight_decay < 0 or args.mtp_weight < 0:
        p.error("--warmup-steps, --weight-decay and --mtp-weight must be >= 0 and --lr > 0")
    if args.train == "mtp" and args.mtp_weight == 0:
        p.error("--train mtp trains the MTP module on its loss: give it a weight, --mtp-weight L > 0")
    return args


# ---- data ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint16 token ids
    heldout: np.ndarray
    tokenizer: Path


def load_corpus(directory: str | Path, context: int) -> Corpus:
    directory = Path(directory)
    files = [directory / n for n in ("train.npy", "heldout.npy", "tokenizer.json")]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"corpus {directory} lacks {', '.join(missing)}; build it with tools/build_corpus.py")
    train, heldout = (np.load(f, mmap_mode="r") for f in files[:2])
    for name, ids in (("train", train), ("heldout", heldout)):
        if len(ids) < context + 1:
            raise ValueError(f"{name}.npy has {len(ids)} tokens, fewer than --context + 1 = {context + 1}")
    return Corpus(train, heldout, files[2])


def batch_at(ids: np.ndarray, offsets: np.ndarray, context: int) -> np.ndarray:
    """Examples ``i32[len(offsets), context + 1]`` starting at ``offsets``."""
    return np.stack([np.asarray(ids[o:o + context + 1], np.int32) for o in offsets])


def train_offsets(n_tokens: int, seed: int, step: int, accum: int, batch: int, context: int) -> np.ndarray:
    """The example offsets ``[accum, batch]`` of optimizer step ``step``: a function of the seed and step."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - context, size=(accum, batch))


def heldout_offsets(n_tokens: int, count: int, context: int) -> np.ndarray:
    """``count`` evenly spaced offsets of held-out windows (overlapping when the text is short)."""
    return np.linspace(0, n_tokens - context - 1, count).astype(np.int64)


# ---- model and optimizer -----------------------------------------------------------------------------

def is_indexer(path: tuple) -> bool:
    """Whether a state path belongs to an indexer (V3.2 ``self_attn.indexer``, V4 ``compressor.indexer``)."""
    return "indexer" in (str(p) for p in path)


def is_mtp(path: tuple) -> bool:
    """Whether a state path belongs to the MTP module (``models.mtp``, the models' ``mtp``)."""
    return str(path[0]) == "mtp"


def trainable(stage: str, train: str = "all", mtp: bool = False):
    """The nnx filter of the parameters that learn at ``stage``: of the whole model (``train`` "all") or of the
    MTP module alone ("mtp"); the MTP module's only with its loss on (``mtp``)."""
    from flax import nnx

    indexer = lambda path, value: is_indexer(path)  # noqa: E731
    in_mtp = lambda path, value: is_mtp(path)  # noqa: E731
    learns = {"dense": nnx.All(nnx.Param, nnx.Not(indexer)),
              "warmup": nnx.All(nnx.Param, indexer)}.get(stage, nnx.Param)
    if train == "mtp":
        return nnx.All(learns, in_mtp)
    return learns if mtp else nnx.All(learns, nnx.Not(in_mtp))


# what the loss reports besides itself, in order (each a mean over the micro-batch)
AUX = ("lm", "kl", "mtp", "acceptance", "mtp_top1")


def mtp_agreement(logits_BTV, mtp_logits_BTV, tokens_BT):
    """``(acceptance, top-1)`` of the MTP module's greedy drafts over teacher-forced positions: with the main
    logits at positions ``0..`` of ``tokens`` and the MTP logits at ``0..M-1`` (``tokens`` reaching ``M + 1``), the
    fraction of positions ``i`` whose draft ``argmax mtp_i`` equals the main model's greedy token
    ``argmax main_{i+1}`` (what greedy speculation accepts), and the fraction equal to the true ``t_{i+2}``."""
    import jax.numpy as jnp

    draft_BT = jnp.argmax(mtp_logits_BTV, axis=-1)
    m = draft_BT.shape[1]
    return (jnp.mean(draft_BT == jnp.argmax(logits_BTV[:, 1:m + 1], axis=-1)),
            jnp.mean(draft_BT == tokens_BT[:, 2:m + 2]))


def loss_fn(graphdef, stage: str, dtypes: tuple, mtp_weight: float = 0.0, train: str = "all"):
    """``(trained, frozen, tokens) -> (loss, AUX values)`` for the stage: "dense" the LM loss, "warmup" the
    indexer KL, "sparse" their sum (disjoint parameters: the indexer reads detached inputs and the top-k
    selection passes no gradient); with ``mtp_weight`` > 0 the LM loss gains ``mtp_weight`` times the MTP
    module's cross-entropy of ``t_{i+2}`` and the KL its block's indexer loss. ``train`` "mtp": the main model
    runs at inference (its weights are frozen). ``dtypes``: the compute dtype trees of the trained and the
    frozen state; the states are cast to them inside (gradients reach the float32 masters)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    def cast(state, dtypes):
        return jax.tree.map(lambda x, dt: x.astype(dt), state, dtypes)

    def loss(trained, frozen, tokens_BT):
        module = nnx.merge(graphdef, cast(trained, dtypes[0]), cast(frozen, dtypes[1]))
        hidden, kl = module.hidden_states(tokens_BT[:, :-1], None if train == "mtp" else stage)
        logits_BTV = module.head(hidden)
        lm = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:]).mean()
        zero = jnp.zeros((), jnp.float32)
        mtp, accept, top1 = zero, zero, zero
        if mtp_weight:  # position i: h_i and t_{i+1} predict t_{i+2}
            mtp_logits_BTV, _, mtp_kl = module.mtp_forward(hidden[:, :-1], tokens_BT[:, 1:-1], stage)
            mtp = optax.softmax_cross_entropy_with_integer_labels(mtp_logits_BTV, tokens_BT[:, 2:]).mean()
            accept, top1 = mtp_agreement(logits_BTV, mtp_logits_BTV, tokens_BT)
            lm_total, kl = lm + mtp_weight * mtp, kl + mtp_kl
        else:
            lm_total = lm
        total = {"dense": lm_total, "warmup": kl, "sparse": lm_total + kl}[stage]
        return total.astype(jnp.float32), (lm, kl, mtp, accept, top1)

    return loss


def make_train_step(loss, optimizer):
    """The jitted optimizer step ``(trained, opt_state, frozen, micro_batches i32[accum, B, T+1]) -> (trained,
    opt_state, mean (loss, *AUX) over the micro-batches, gradient norm)``: gradients averaged over the
    micro-batches (a scan, so memory holds one micro-batch's activations)."""
    import jax
    import jax.numpy as jnp
    import optax

    grad_fn = jax.value_and_grad(loss, has_aux=True)

    @jax.jit
    def train_step(trained, opt_state, frozen, micro_batches):
        def micro(carry, tokens_BT):
            (total, aux), grads = grad_fn(trained, frozen, tokens_BT)
            return jax.tree.map(jnp.add, carry, (grads, jnp.stack([total, *aux]))), None

        zeros = (jax.tree.map(jnp.zeros_like, trained), jnp.zeros(1 + len(AUX), jnp.float32))
        (grads, sums), _ = jax.lax.scan(micro, zeros, micro_batches)
        n = micro_batches.shape[0]
        grads = jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state, sums / n, optax.tree.norm(grads)

    return train_step


def make_optimizer(args):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(args.warmup_steps, 1),
                                                  max(args.steps, args.warmup_steps + 1), end_value=0.1 * args.lr)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay)), schedule


def raw_config(model: str, tokenizer_path: Path) -> tuple[dict, bool]:
    """The config.json dict to train and whether the model starts from scratch (a preset: the
    tokenizer's vocabulary size and bos / eos / pad ids replace the preset's)."""
    from ess_jax.config import ConfigError, resolve_model
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    source = resolve_model(model)
    raw = source.raw_config()
    if source.checkpoint is not None:
        if raw.get("vocab_size") != vocab:
            raise ConfigError(f"{source.checkpoint} has vocab_size={raw.get('vocab_size')}, the corpus tokenizer "
                              f"{vocab}; continue a checkpoint on a corpus built with its tokenizer")
        return raw, False
    special = {name: tok.token_to_id(f"<{name}>") for name in ("bos", "eos", "pad")}
    if None in special.values():
        raise ConfigError(f"{tokenizer_path} lacks a <bos>, <eos> or <pad> token; build it with tools/build_corpus.py")
    raw.update(vocab_size=vocab, **{f"{k}_token_id": v for k, v in special.items()})
    return raw, True


def with_index_share(raw: dict, pattern: str) -> dict:
    """A config.json dict serving the Index Share ``pattern`` (one F / S letter per indexed layer): its
    ``index_topk_pattern``, the other schedule keys dropped."""
    raw = {k: v for k, v in raw.items() if k not in ("indexer_types", "index_topk_freq", "index_skip_topk_offset")}
    return dict(raw, index_topk_pattern=pattern)


def index_share_search(args) -> dict:
    """The training-free Index Share search (``--index-share-search``): from every indexer of the checkpoint, drop
    the one whose removal raises the held-out LM loss least, again, until ``ceil(keep * indexed layers)`` are left
    (the first indexed layer always keeps its own); export the checkpoint with that pattern into ``--out``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from ess_jax import checkpoint, families
    from ess_jax.config import resolve_model

    corpus = load_corpus(args.data, args.context)
    raw, scratch = raw_config(args.model, corpus.tokenizer)
    if scratch:
        raise ValueError("--index-share-search drops indexers of a trained model: --model must be a checkpoint")
    full = families.load_config(raw)
    cls, directory = families.get(full.family).module_cls, resolve_model(args.model).checkpoint
    heldout = batch_at(corpus.heldout, heldout_offsets(len(corpus.heldout), args.eval_batches * args.batch,
                                                       args.context), args.context)

    def load(pattern: str):
        cfg = full.with_index_share(pattern)
        return checkpoint.load_into(cls, cfg, directory, jnp.float32)

    def heldout_lm(pattern: str) -> float:
        graphdef, state = nnx.split(load(pattern))

        @jax.jit
        def lm(state, tokens_BT):
            logits_BTV = nnx.merge(graphdef, state)(tokens_BT[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:]).mean()

        return float(np.mean([lm(state, jnp.asarray(heldout[i:i + args.batch]))
                              for i in range(0, len(heldout), args.batch)]))

    pattern = full.index_pattern
    keep = math.ceil(args.keep * len(pattern))
    steps = [{"pattern": pattern, "heldout_lm": heldout_lm(pattern)}]
    while pattern.count("F") > max(keep, 1):
        tried = {}
        for i in [i for i, letter in enumerate(pattern) if letter == "F" and i > 0]:
            tried[i] = heldout_lm(pattern[:i] + "S" + pattern[i + 1:])
        drop = min(tried, key=tried.get)
        pattern = pattern[:drop] + "S" + pattern[drop + 1:]
        steps.append({"pattern": pattern, "heldout_lm": tried[drop]})
    out = Path(args.out)
    checkpoint.save(nnx.state(load(pattern)), with_index_share(raw, pattern), out)
    shutil.copyfile(corpus.tokenizer, out / "tokenizer.json")
    result = {"pattern": pattern, "keep": args.keep, "heldout_lm": steps[-1]["heldout_lm"],
              "full_heldout_lm": steps[0]["heldout_lm"], "steps": steps}
    (out / "index_share.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def build(raw: dict, scratch: bool, model: str, seed: int):
    """The NNX module: fresh weights from ``seed`` or the checkpoint's (an MTP module the config has and the
    checkpoint lacks: fresh from ``seed``)."""
    from flax import nnx
    from ess_jax import checkpoint, families
    from ess_jax.config import resolve_model
    import jax.numpy as jnp

    cfg = families.load_config(raw)
    cls = families.get(cfg.family).module_cls
    factory = lambda: cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))  # noqa: E731
    if scratch:
        return factory(), cls, cfg
    module = checkpoint.load_into(cls, cfg, resolve_model(model).checkpoint, jnp.float32)
    if module.cfg != cfg:  # the checkpoint holds no MTP module: a fresh one beside its weights
        fresh = factory()
        nnx.update(fresh, nnx.state(module))
        module = fresh
    return module, cls, cfg


# ---- state on disk ---------------------------------------------------------------------------------

def _leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def save_state(out: Path, trained, opt_state, step: int, flags: dict) -> None:
    """Atomically write the training state (parameters being trained, optimizer state, step)."""
    arrays = {f"p{i}": a for i, a in enumerate(_leaves(trained))}
    arrays.update({f"o{i}": a for i, a in enumerate(_leaves(opt_state))})
    np.savez(out / "state.tmp.npz", **arrays)
    (out / "state.tmp.json").write_text(json.dumps({"step": step, "flags": flags}, indent=1))
    os.replace(out / "state.tmp.npz", out / "state.npz")
    os.replace(out / "state.tmp.json", out / "state.json")


def load_state(out: Path, trained, opt_state):
    import jax
    import jax.numpy as jnp

    meta = json.loads((out / "state.json").read_text())
    with np.load(out / "state.npz") as data:
        def fill(tree, prefix):
            leaves, treedef = jax.tree.flatten(tree)
            return jax.tree.unflatten(treedef, [jnp.asarray(data[f"{prefix}{i}"], leaf.dtype)
                                                for i, leaf in enumerate(leaves)])
        return fill(trained, "p"), fill(opt_state, "o"), meta


def export(out: Path, graphdef, trained, frozen, raw: dict, tokenizer: Path) -> None:
    """The transformers checkpoint of the current parameters, with the corpus tokenizer."""
    from flax import nnx
    from ess_jax import checkpoint

    _, state = nnx.split(nnx.merge(graphdef, trained, frozen))
    checkpoint.save(state, raw, out)
    shutil.copyfile(tokenizer, out / "tokenizer.json")


# ---- the loop --------------------------------------------------------------------------------------

def train(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    corpus = load_corpus(args.data, args.context)
    raw, scratch = raw_config(args.model, corpus.tokenizer)
    if args.mtp_weight:
        raw = dict(raw, num_nextn_predict_layers=1)
    if args.index_share:
        from ess_jax.families import load_config

        raw = with_index_share(raw, load_config(raw).with_index_share(args.index_share).index_pattern)
    module, cls, cfg = build(raw, scratch, args.model, args.seed)
    if args.context > cfg.max_position_embeddings:
        raise ValueError(f"--context {args.context} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    learns = trainable(args.stage, args.train, args.mtp_weight > 0)
    graphdef, trained, frozen = nnx.split(module, learns, ...)
    if not jax.tree.leaves(trained):
        raise ValueError(f"--stage {args.stage} --train {args.train} leaves nothing to train (an MTP block without "
                         "an indexer has none to warm up)")
    del module
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    # compute dtypes: those of the same model built in --dtype (its float32 parameters stay float32)
    abstract = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    dtypes = tuple(jax.tree.map(lambda a: a.dtype, part) for part in nnx.split(abstract, learns, ...)[1:])
    optimizer, schedule = make_optimizer(args)
    opt_state = optimizer.init(trained)
    loss = loss_fn(graphdef, args.stage, dtypes, args.mtp_weight, args.train)
    train_step = make_train_step(loss, optimizer)

    @jax.jit
    def eval_step(trained, frozen, tokens_BT):
        return loss(trained, frozen, tokens_BT)[1]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = {k: getattr(args, k) for k in _RUN_FLAGS}
    step = 0
    if (out / "state.json").is_file():
        trained, opt_state, meta = load_state(out, trained, opt_state)
        if meta["flags"] != flags:
            changed = sorted(k for k in flags if meta["flags"].get(k) != flags[k])
            raise ValueError(f"{out} holds a run with other flags ({', '.join(changed)}: "
                             f"{[meta['flags'].get(k) for k in changed]}); repeat them or use another --out")
        step = meta["step"]
    heldout = batch_at(corpus.heldout, heldout_offsets(len(corpus.heldout), args.eval_batches * args.batch,
                                                       args.context), args.context)

    def evaluate() -> dict:
        values = np.mean([eval_step(trained, frozen, jnp.asarray(heldout[i:i + args.batch]))
                          for i in range(0, len(heldout), args.batch)], axis=0)
        return {f"heldout_{k}": float(v) for k, v in zip(AUX, values) if args.mtp_weight or k in ("lm", "kl")}

    log = open(out / "train_log.jsonl", "a")
    tokens_per_step = args.accum * args.batch * args.context
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=step, desc=f"train {args.stage}", unit="step", file=sys.stderr)
    result = {}
    start, start_step = time.perf_counter(), step
    while step < args.steps:
        offsets = train_offsets(len(corpus.train), args.seed, step, args.accum, args.batch, args.context)
        tokens = np.stack([batch_at(corpus.train, o, args.context) for o in offsets])
        trained, opt_state, sums, norm = train_step(trained, opt_state, frozen, jnp.asarray(tokens))
        step += 1
        total, *aux = (float(x) for x in sums)
        if not math.isfinite(total):
            raise FloatingPointError(f"step {step}: loss is {total}; lower --lr or check the data")
        rate = (step - start_step) * tokens_per_step / (time.perf_counter() - start)
        record = {"step": step, "loss": total,
                  **{k: v for k, v in zip(AUX, aux) if args.mtp_weight or k in ("lm", "kl")},
                  "grad_norm": float(norm), "lr": float(schedule(step - 1)), "tokens_per_s": rate}
        if step % args.eval_every == 0 or step == args.steps:
            record.update(evaluate())
        if step % args.log_every == 0 or "heldout_lm" in record:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if bar is not None:
            bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{rate:.0f}")
            bar.update(1)
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_state(out, trained, opt_state, step, flags)
            export(out, graphdef, trained, frozen, raw, corpus.tokenizer)
        result = record
    if bar is not None:
        bar.close()
    if not result:  # resumed at --steps: export what the state holds
        export(out, graphdef, trained, frozen, raw, corpus.tokenizer)
        result = {"step": step, **evaluate()}
    log.close()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    from ess_jax.config import ConfigError

    try:
        result = index_share_search(args) if args.index_share_search else train(args)
    except (ValueError, ConfigError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

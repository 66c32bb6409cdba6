"""DeepSeek-V3.2 model: cached absorbed form vs full forward, indexer semantics, MoE routing, training."""

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from ess_jax import ops
from ess_jax.models.layers import Router, index_topk
from helpers import PagedRun, lively_v32, small_v32


@pytest.fixture(scope="module")
def model():
    return lively_v32(small_v32(), seed=1)


@pytest.fixture(scope="module")
def full(model):
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    return lambda tokens: np.asarray(forward(params, jnp.asarray(tokens)))


@pytest.mark.parametrize("prompt_len", [5, 8, 9, 30])  # index_topk = 8: below, at, just past, far past
def test_greedy_decode_equals_full_forward_every_step(model, full, prompt_len):
    """Greedy decode with the paged cache; the full causal forward over the final sequence must give,
    at every position, the same logits (so the same greedy token) as the cached step did."""
    new_tokens = 12
    seq = list(np.random.default_rng(prompt_len).integers(0, 256, prompt_len))
    run = PagedRun(model, batch=1, capacity=30 + new_tokens)  # one cache shape: the decode steps compile once
    decoded = [run([seq])[0]]
    for _ in range(new_tokens):
        seq.append(int(np.argmax(decoded[-1][-1])))
        decoded.append(run([[seq[-1]]])[0])
    cached = np.concatenate(decoded)  # logits at positions 0 .. len(seq) - 1
    ref = full([seq])[0]
    np.testing.assert_allclose(cached, ref, atol=2e-4 * np.abs(ref).max())
    np.testing.assert_array_equal(ref[prompt_len - 1:-1].argmax(-1), seq[prompt_len:])


def test_chunked_prefill_equals_one_shot_with_padding_and_batching(model):
    """Chunks of 1, 3, 7, 8, 4 (crossing index_topk and page boundaries) give the one-shot logits and
    rows; padded (invalid) tokens change nothing; two requests of different lengths share a step."""
    tokens = np.random.default_rng(0).integers(0, 256, (2, 23))
    one = PagedRun(model, batch=2, capacity=32)
    one_logits = one(tokens)
    chunked, pieces, start = PagedRun(model, batch=2, capacity=32), [], 0
    for size in (1, 3, 7, 8, 4):
        pieces.append(chunked(tokens[:, start:start + size]))
        start += size
    np.testing.assert_allclose(np.concatenate(pieces, 1), one_logits, rtol=1e-5, atol=1e-4)
    for layer in range(2):
        np.testing.assert_allclose(chunked.rows(layer, 1), one.rows(layer, 1), rtol=1e-5, atol=1e-5)
    # request 1 padded to 23 with 6 invalid tokens: its real logits and rows match a 17-token run
    padded = PagedRun(model, batch=2, capacity=32)
    valid = np.ones((2, 23), bool)
    valid[1, 17:] = False
    padded_logits = padded(tokens, valid)
    alone = PagedRun(model, batch=1, capacity=32)
    np.testing.assert_allclose(padded_logits[1, :17], alone(tokens[1:, :17])[0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(padded.rows(0, 1), alone.rows(0, 0), rtol=1e-5, atol=1e-5)
    assert padded.lengths.tolist() == [23, 17]


def test_indexer_topk_marks_invisible_slots():
    cfg = small_v32()
    scores = jnp.where(jnp.arange(20)[None, None, :] <= jnp.arange(20)[None, :, None],
                       jax.random.normal(jax.random.key(0), (1, 20, 20)), -jnp.inf)
    ids = np.asarray(index_topk(scores, cfg.index_topk))[0]
    assert ids.shape == (20, cfg.index_topk)
    for t in range(20):
        valid = ids[t][ids[t] >= 0]
        if t + 1 <= cfg.index_topk:
            assert sorted(valid) == list(range(t + 1))  # dense: every visible position, rest -1
            assert (ids[t] == -1).sum() == cfg.index_topk - t - 1
        else:
            assert len(valid) == cfg.index_topk and valid.max() <= t
            expected = np.argsort(-np.asarray(scores[0, t, : t + 1]))[: cfg.index_topk]
            assert set(valid) == set(expected)


def _route_reference(x, weight, bias, top_k, n_group, topk_group, norm, scaling):
    """Group-limited sigmoid routing written out per token."""
    scores = 1 / (1 + np.exp(-(x @ weight.T)))
    weights, experts = [], []
    for s in scores:
        choice = s + bias
        groups = choice.reshape(n_group, -1)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-group_score)[:topk_group]
        masked = np.full_like(choice, -np.inf)
        for g in keep:
            masked.reshape(n_group, -1)[g] = groups[g]
        chosen = np.argsort(-masked)[:top_k]
        w = s[chosen]
        if norm:
            w = w / (w.sum() + 1e-20)
        weights.append(w * scaling)
        experts.append(chosen)
    return np.array(weights), np.array(experts)


@pytest.mark.parametrize("n_group, topk_group, norm", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_router_matches_written_out_reference(n_group, topk_group, norm):
    router = Router(16, 16, top_k=3, scoring="sigmoid", norm_topk_prob=norm, scaling=2.5, n_group=n_group,
                    topk_group=topk_group, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(n_group)
    weight = rng.normal(size=(16, 16)).astype(np.float32)
    bias = (0.5 * rng.normal(size=16)).astype(np.float32)  # large enough to change the selection
    router.weight[...] = jnp.asarray(weight)
    router.e_score_correction_bias[...] = jnp.asarray(bias)
    x = rng.normal(size=(40, 16)).astype(np.float32)
    w, e = router(jnp.asarray(x))
    w_ref, e_ref = _route_reference(x, weight, bias, 3, n_group, topk_group, norm, 2.5)
    order, order_ref = np.argsort(np.asarray(e), 1), np.argsort(e_ref, 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), order, 1), np.take_along_axis(e_ref, order_ref, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1), np.take_along_axis(w_ref, order_ref, 1),
                               rtol=1e-5)
    # the bias selects but does not weight: without it, some token picks a different expert set
    router.e_score_correction_bias[...] = jnp.zeros(16)
    assert not np.array_equal(np.sort(np.asarray(router(jnp.asarray(x))[1]), 1), np.sort(e_ref, 1))


def test_training_steps_reduce_next_token_loss():
    model = lively_v32(small_v32(), seed=3)
    graphdef, params, buffers = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 24)))

    def loss_fn(p):
        logits = nnx.merge(graphdef, p, buffers)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads

    losses = []
    for _ in range(8):
        params, opt_state, loss, grads = train_step(params, opt_state)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses
    attn = grads["runs"]["1"]["self_attn"]  # layer 1 (the MoE run)
    assert float(jnp.abs(attn["q_a_proj"]["weight"][...]).max()) > 0
    # selection is non-differentiable (transformers runs the indexer under no_grad): its keys get no gradient
    assert float(jnp.abs(attn["indexer"]["wk"]["weight"][...]).max()) == 0


def test_a_tpus_layer_slices_give_the_in_place_steps_values(model):
    """Traced for a TPU (``ops.kernels_for``, XLA kernels), the indexer's keys are written and read through their
    layer's slice (``cache.write_then_gather``): the same logits and top-k ids, bit for bit, as in place."""
    seq = list(np.random.default_rng(3).integers(0, 256, 21))

    def decode(run):
        logits = [run([seq])[0][-1]]
        for _ in range(4):
            logits.append(run([[int(np.argmax(logits[-1]))]])[0][-1])
        return np.stack(logits), np.asarray(run.ids)

    in_place = decode(PagedRun(model, batch=1, capacity=30))
    tpu = PagedRun(model, batch=1, capacity=30)
    graphdef, _ = nnx.split(model)
    step = jax.jit(lambda p, x, m, c: nnx.merge(graphdef, p).step(x, m, c, kernels="xla"), donate_argnums=3)
    tpu._step = step  # a jit of its own: traced under the TPU target, not read from PagedRun's cache
    with ops.kernels_for(ops.Device("tpu", "TPU v5p")):
        sliced = decode(tpu)
    np.testing.assert_array_equal(sliced[0], in_place[0])
    np.testing.assert_array_equal(sliced[1], in_place[1])

"""Per-request sampling: greedy rows, seeded reproducibility independent of the batch, and the
distribution of the draws restricted to the top-k / top-p set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax.sampling import SamplingParams, sample

sample_jit = jax.jit(sample)


def run(logits_BV, temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0) -> np.ndarray:
    """``sample`` with every per-row argument given as a scalar (broadcast) or a sequence."""
    batch = np.asarray(logits_BV).shape[0]

    def column(value, dtype):
        return jnp.asarray(np.broadcast_to(np.asarray(value, dtype), (batch,)))

    return np.asarray(sample_jit(jnp.asarray(logits_BV, jnp.float32), column(temperature, np.float32),
                                 column(top_k, np.int32), column(top_p, np.float32), column(seed, np.uint32),
                                 column(step, np.int32)))


def random_logits(batch, vocab, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32) * 2


def test_greedy_rows_take_the_argmax():
    logits = random_logits(8, 40)
    temperature = np.array([0, 1, 0, 1, 0, 0, 2, 0])
    tokens = run(logits, temperature, top_k=[0, 0, 3, 0, 0, 1, 0, 7], top_p=[1, 1, 0.5, 1, 0.1, 1, 1, 0.3])
    assert tokens.dtype == np.int32
    greedy = temperature == 0
    np.testing.assert_array_equal(tokens[greedy], np.argmax(logits, axis=-1)[greedy])


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(64, 40)
    greedy = np.argmax(logits, axis=-1)
    seeds = np.arange(64)
    np.testing.assert_array_equal(run(logits, temperature=1.5, top_k=1, seed=seeds), greedy)
    np.testing.assert_array_equal(run(logits, temperature=1.5, top_p=1e-6, seed=seeds), greedy)


def test_a_draw_depends_only_on_its_own_row_seed_and_step():
    logits = random_logits(8, 40)
    params = dict(temperature=np.linspace(0.5, 2.0, 8), top_k=np.array([0, 5, 0, 10, 3, 0, 20, 0]),
                  top_p=np.array([1, 1, 0.9, 0.8, 1, 0.5, 1, 0.95]), seed=np.arange(100, 108), step=np.arange(8))
    full = run(logits, **params)
    for row in range(8):  # each request alone, in a batch of one
        assert run(logits[row:row + 1], **{k: v[row:row + 1] for k, v in params.items()})[0] == full[row]
    # Rows reversed, then five other requests appended.
    rows = np.arange(7, -1, -1)
    other = dict(params, seed=params["seed"] + 1000)
    mixed = run(np.concatenate([logits[rows], random_logits(5, 40, seed=1)]),
                **{k: np.concatenate([params[k][rows], other[k][:5]]) for k in params})
    np.testing.assert_array_equal(mixed[:8], full[rows])


def test_seeds_and_steps_change_the_draw():
    logits = np.zeros((1, 1000), np.float32)  # uniform: two independent draws agree 1 time in 1000
    by_seed = run(np.repeat(logits, 200, 0), temperature=1.0, seed=np.arange(200))
    by_step = run(np.repeat(logits, 200, 0), temperature=1.0, step=np.arange(200))
    assert len(set(by_seed.tolist())) > 150 and len(set(by_step.tolist())) > 150
    np.testing.assert_array_equal(run(np.repeat(logits, 200, 0), temperature=1.0, seed=np.arange(200)), by_seed)


def expected_probs(logits_V, temperature, top_k, top_p) -> np.ndarray:
    """softmax(logits / T) restricted to the top-k, then top-p set, in float64."""
    scaled = logits_V.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones_like(scaled, bool) if top_k == 0 else np.isin(np.arange(scaled.size), order[:top_k])
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    keep[order[before >= top_p]] = top_p >= 1.0
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (2.0, 4, 1.0), (1.0, 0, 0.6), (1.3, 6, 0.8), (0.5, 3, 0.95),
])
def test_draw_frequencies_match_the_filtered_softmax(temperature, top_k, top_p):
    draws = 40_000
    logits_V = np.array([2.0, 1.5, 1.2, 1.0, 0.6, 0.5, 0.0, -0.3, -1.0, -2.0], np.float32)
    probs = expected_probs(logits_V, temperature, top_k, top_p)
    tokens = run(np.broadcast_to(logits_V, (draws, logits_V.size)), temperature, top_k, top_p,
                 seed=np.arange(draws) * 7919, step=np.arange(draws) % 5)
    counts = np.bincount(tokens, minlength=logits_V.size)
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was drawn"
    kept = probs > 0
    chi2 = (((counts - draws * probs) ** 2)[kept] / (draws * probs[kept])).sum()
    dof = kept.sum() - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof) + 5, (chi2, counts, draws * probs)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)[None].repeat(500, 0)
    # Cumulative mass 0.5, 0.8, 0.95, 1: a token is kept while the mass before it is below top_p.
    for top_p, allowed in [(0.45, {0}), (0.55, {0, 1}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (0.96, {0, 1, 2, 3})]:
        tokens = set(run(logits, temperature=1.0, top_p=top_p, seed=np.arange(500)).tolist())
        assert tokens == allowed, (top_p, tokens)


def test_top_k_ties_keep_the_lower_ids():
    logits = np.array([[0.5, 1.0, 1.0, 1.0]]).repeat(500, 0)
    tokens = set(run(logits, temperature=1.0, top_k=2, seed=np.arange(500)).tolist())
    assert tokens == {1, 2}


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature=-0.1 must be >= 0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=-1), "top_k=-1 must be >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(seed=-1), r"seed=-1 must be in \[0, 2\*\*32\)"),
    (dict(seed=2**32), "seed=4294967296"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("inf")), "temperature=inf must be a finite number"),
    (dict(top_p=True), "top_p=True must be a finite number"),
    (dict(top_k=1.5), r"top_k=1.5 must be an integer in \[0, 2147483648\)"),
    (dict(top_k=2**31), "top_k=2147483648"),
])
def test_sampling_params_check_what_the_sampler_needs(kwargs, match):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=match):
        params.check()


def test_sampling_params_defaults_are_greedy():
    assert SamplingParams() == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)

"""The models' cached steps with ``kernels="pallas"`` (their attention ops on the Pallas kernels, interpret
mode) give the logits and greedy tokens of the XLA path, from the same prefilled cache."""

from pathlib import Path

import jax
import numpy as np

import ess_jax
from helpers import PagedRun, lively_v32, small_v32

V4_FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf-v4-a"


def _decode(module, prefilled: PagedRun, token_B, steps: int, kernels: str):
    """``steps`` greedy decode steps from a copy of ``prefilled``'s cache with the ``kernels`` step."""
    run = PagedRun(module, batch=len(token_B), capacity=prefilled.page_table.shape[1] * prefilled.page_size,
                   page_size=prefilled.page_size, kernels=kernels)
    run.cache, run.lengths = jax.tree.map(lambda x: x.copy(), prefilled.cache), prefilled.lengths.copy()
    logits, tokens = [], [token_B]
    for _ in range(steps):
        logits.append(run(tokens[-1][:, None]))
        tokens.append(logits[-1][:, -1].argmax(-1))
    return logits, tokens


def _assert_same(pallas, xla):
    for got, want in zip(pallas[1], xla[1]):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(pallas[0], xla[0]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_v32_decode_pallas_equals_xla():
    cfg = small_v32()
    module = lively_v32(cfg, seed=1)
    run = PagedRun(module, batch=2, capacity=32)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 23))
    first = run(prompt)[:, -1].argmax(-1)  # 23 positions > index_topk 8: the selection is sparse
    _assert_same(_decode(module, run, first, 2, "pallas"), _decode(module, run, first, 2, "xla"))


def test_v4_decode_pallas_equals_xla():
    """The fixture's sliding, CSA (4:1, top-8) and HCA (16:1; an entry per four 4-token pages) layers after a
    40-token prefill (10 CSA entries, 2 HCA entries): two greedy decode steps."""
    model = ess_jax.load_model(V4_FIXTURE)
    run = PagedRun(model.module, batch=1, capacity=64)
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, 40))
    first = run(prompt)[:, -1].argmax(-1)
    _assert_same(_decode(model.module, run, first, 2, "pallas"), _decode(model.module, run, first, 2, "xla"))

"""The models' cached steps with their attention op routed to the Pallas kernels (interpret mode)
give the logits and greedy tokens of the XLA path. The call sites do not take a kernel choice yet,
so each test swaps the op in ``ess_jax.ops`` for one that always runs ``kernels="pallas"``."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ess_jax
from ess_jax import ops
from helpers import PagedRun, lively_v32, small_v32

V4_FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf-v4-a"


def _force_pallas(monkeypatch, name: str):
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *args, kernels=None, **kwargs: real(*args, kernels="pallas", **kwargs))


def _decode(run: PagedRun, module, cache, token_B, steps: int):
    """``steps`` greedy decode steps from ``cache`` with a freshly traced step (so a patched op is used)."""
    graphdef, _ = nnx.split(module)
    run._step = jax.jit(lambda p, x, m, c: nnx.merge(graphdef, p).step(x, m, c), donate_argnums=3)
    run.cache, lengths = jax.tree.map(lambda x: x.copy(), cache), run.lengths.copy()
    logits, tokens = [], [token_B]
    for _ in range(steps):
        logits.append(run(tokens[-1][:, None]))
        tokens.append(logits[-1][:, -1].argmax(-1))
    run.lengths = lengths
    return logits, tokens


def test_v32_decode_pallas_equals_xla(monkeypatch):
    cfg = small_v32()
    module = lively_v32(cfg, seed=1)
    run = PagedRun(module, batch=2, capacity=32)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 23))
    first = run(prompt)[:, -1].argmax(-1)  # 23 positions > index_topk 8: the selection is sparse
    cache = jax.tree.map(lambda x: x.copy(), run.cache)
    xla_logits, xla_tokens = _decode(run, module, cache, first, steps=2)
    _force_pallas(monkeypatch, "sparse_mla")
    pallas_logits, pallas_tokens = _decode(run, module, cache, first, steps=2)
    for got, want in zip(pallas_tokens, xla_tokens):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(pallas_logits, xla_logits):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_v4_decode_pallas_equals_xla(monkeypatch):
    """The fixture's sliding, CSA (4:1, top-8) and HCA (16:1) layers after a 40-token prefill
    (10 CSA entries, 2 HCA entries): two greedy decode steps."""
    model = ess_jax.load_model(V4_FIXTURE)
    graphdef = model.graphdef
    prompt = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, 40)).astype(np.int32)
    step = jax.jit(lambda p, tokens, cache: nnx.merge(graphdef, p).step_contiguous(tokens, cache))
    logits, prefilled = step(model.params, jnp.asarray(prompt), model.module.init_cache(1, 64))
    first = np.asarray(logits)[:, -1:].argmax(-1).astype(np.int32)

    def decode():  # traced afresh, so a patched op is used
        step = jax.jit(lambda p, tokens, cache: nnx.merge(graphdef, p).step_contiguous(tokens, cache))
        cache, logits_out, tokens = prefilled, [], [first]
        for _ in range(2):
            logits, cache = step(model.params, jnp.asarray(tokens[-1], jnp.int32), cache)
            logits_out.append(np.asarray(logits))
            tokens.append(logits_out[-1][:, -1:].argmax(-1))
        return logits_out, tokens

    xla_logits, xla_tokens = decode()
    _force_pallas(monkeypatch, "sparse_sink_attention")
    pallas_logits, pallas_tokens = decode()
    for got, want in zip(pallas_tokens, xla_tokens):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(pallas_logits, xla_logits):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())

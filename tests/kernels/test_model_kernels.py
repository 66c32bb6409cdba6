"""The models' cached steps with ``kernels="pallas"`` (their attention ops on the Pallas kernels, interpret
mode) give the logits and greedy tokens of the XLA path, from the same prefilled cache; with
``kernels="auto"`` the decode step lowers, for abstract TPUs and NVIDIA GPUs, to their kernels."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ess_jax
from ess_jax.cache import StepMeta
from helpers import PagedRun, lively_v32, small_v32
from kernel_testing import abstract_device

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


def _decode_step_text(module, platform: str, kind: str, batch: int = 2, page_size: int = 4, pages: int = 8) -> str:
    """A model's paged decode step with kernels="auto", lowered for an abstract device of ``kind``."""
    graphdef, params = nnx.split(module)
    shapes = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages) + 1
    meta = StepMeta(jnp.full((batch, 1), 9, jnp.int32), jnp.ones((batch, 1), bool), table,
                    jnp.arange(batch, dtype=jnp.int32))
    step = jax.jit(lambda p, x, m, c: nnx.merge(graphdef, p).step(x, m, c, kernels="auto"))
    with abstract_device(platform, kind):
        return step.trace(shapes(params), jax.ShapeDtypeStruct((batch, 1), jnp.int32), shapes(meta),
                          shapes(module.init_cache(batch, batch * pages + 1, page_size))).lower(
            lowering_platforms=("tpu" if platform == "tpu" else "cuda",)).as_text()


@pytest.mark.parametrize("family, platform, kind, call, kernel, mark", [
    ("v32", "tpu", "TPU v6 lite", "tpu_custom_call", 'kernel_name = "sparse_mla"', ""),
    ("v4", "gpu", "NVIDIA A100", "mosaic_gpu_v2", "sparse_v4_attention_mosaic_gpu", "mma.sync"),
])
def test_decode_step_lowers_to_the_chosen_kernels(family, platform, kind, call, kernel, mark):
    """The whole decode step, lowered for a TPU or an A100 without one, attends through that device's
    Pallas kernel (one custom call per sparse attention layer: small V3.2's one, the V4
    fixture's sliding, CSA and HCA layers), not the XLA gather."""
    module = lively_v32(small_v32(), seed=1) if family == "v32" else ess_jax.load_model(V4_FIXTURE).module
    text = _decode_step_text(module, platform, kind)
    assert re.findall(r"stablehlo\.custom_call @(\w+)", text) == [call] * (1 if family == "v32" else 3)
    assert text.count(kernel) >= (1 if family == "v32" else 3) and mark in text

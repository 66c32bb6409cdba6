"""``--cache-dtype fp8`` with the kernel choices, both families, resident and ESS: greedy tokens through the engine
equal XLA's (the kernels in their interpreters on the CPU). V3.2's latent rows and V4's CSA entries are FP8 rows; V4's
window stays in the model's dtype, so its CSA layers attend through a float kernel call and an FP8 one, merged by
log-sum-exp (``ops.sink_attention``). Every kernel target runs, each family resident and with ESS, the TPU kernel
with both families; the interpreters are slow (minutes a case here), so the matrix is that cover, not the product."""

import functools
from pathlib import Path

import numpy as np
import pytest

import ess_jax
from ess_jax.engine import Engine, EngineConfig, RequestSpec

FIXTURES = Path(__file__).parents[1] / "fixtures"
CASES = [("hf-v32-a", "none", "mosaic_tpu"), ("hf-v32-a", "ess", "pallas"), ("hf-v4-a", "none", "mosaic_gpu_sm80"),
         ("hf-v4-a", "ess", "mosaic_tpu")]


@functools.cache
def _model(name: str):
    return ess_jax.load_model(FIXTURES / name)


@functools.cache
def _run(name: str, offload: str, kernels: str) -> tuple[tuple[int, ...], int]:
    """Greedy tokens of a 32-token prompt, 48 with ESS (prefill pieces of 16, the later ones reading the earlier
    ones' FP8 rows: one compiled piece size; the interpreters take about a second a token), and 2 more (one decode
    step); the tier's misses (0 resident). ESS: the smallest pool (top-k + 1), below the prompt's latent rows (V3.2)
    or its 12 CSA entries (V4)."""
    pool = {"hf-v32-a": 17, "hf-v4-a": 9}[name] if offload == "ess" else None
    engine = Engine(_model(name), EngineConfig(max_batch=1, page_size=8, prefill_chunk=16, max_seq_len=56,
                                               kernels=kernels, cache_dtype="fp8", offload=offload, pool_size=pool))
    prompt = np.random.default_rng(0).integers(0, 256, 48 if offload == "ess" else 32).tolist()
    engine.add_request(RequestSpec(prompt, 2))
    tokens = tuple(engine.run()[0].output_ids)
    return tokens, engine.offload_metrics()["misses"] if offload == "ess" else 0


@pytest.mark.parametrize("name, offload, kernels", CASES)
def test_fp8_cache_kernels_equal_xla(name, offload, kernels):
    want, misses = _run(name, offload, "xla")
    assert offload == "none" or misses > 0  # the tier's fetched half ran
    assert _run(name, offload, kernels)[0] == want

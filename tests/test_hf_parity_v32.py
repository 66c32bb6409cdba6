"""Parity with transformers' DeepseekV32ForCausalLM on golden fixtures (tools/make_hf_fixtures.py)."""

from pathlib import Path

import numpy as np
import pytest

import ess_jax
from helpers import ENGINE

FIXTURES = Path(__file__).parent / "fixtures"
CASES = ["hf-v32-a", "hf-v32-b", "hf-v32-fp8"]
LOADS = [(name, "dequantized") for name in CASES] + [("hf-v32-fp8", "release")]  # release: FP8 kept on the device


def _reference(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    n = len([k for k in ref.files if k.startswith("prompt_")])
    return [(ref[f"prompt_{i}"], ref[f"logits_{i}"], ref[f"generate_{i}"]) for i in range(n)]


@pytest.fixture(scope="module", params=LOADS, ids="-".join)
def case(request):
    name, weights = request.param
    return name, ess_jax.load_model(FIXTURES / name, weights=weights), _reference(name)


def test_logits_match_transformers(case):
    name, model, refs = case
    for prompt, logits, _ in refs:
        got = model.logits(prompt[None])[0]
        scale = np.abs(logits).max()
        err = np.abs(got - logits).max()
        assert err <= 1e-4 * scale, f"{name} T={len(prompt)}: max abs err {err:.3g} vs logit scale {scale:.3g}"
        np.testing.assert_array_equal(got.argmax(-1), logits.argmax(-1))


def test_greedy_tokens_match_transformers_generate(case):
    name, model, refs = case
    for prompt, _, full in refs:
        new = len(full) - len(prompt)
        result = ess_jax.generate(model, [prompt.tolist()], max_new_tokens=new, engine=ENGINE)
        assert result.output_ids[0] == full[len(prompt):].tolist(), f"{name} T={len(prompt)}"


def test_fixtures_exercise_sparse_selection():
    """The long prompts are longer than index_topk, so transformers' top-k mask was really active."""
    for name in CASES:
        topk = ess_jax.load_model(FIXTURES / name).cfg.index_topk
        assert max(len(p) for p, _, _ in _reference(name)) > topk

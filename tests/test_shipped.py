"""The shipped trained checkpoints: a real-weights regression gate for the loader and the numerics.

Each checkpoint's held-out perplexity (checkpoints/heldout_code.txt, code the corpus held out) is
within 1 % of the figure train.json recorded when it was trained (tools/ship_checkpoint.py), and the
engine's cached ESS path (with a pool small enough to miss) scores the same tokens as
the full forward, to float32 rounding (the resident path is tests/test_eval.py's)."""

import json
from pathlib import Path

import pytest

from ess_jax.api import load_model
from ess_jax.config import CHECKPOINTS, shipped_checkpoint
from ess_jax.engine import EngineConfig
from ess_jax.eval import evaluate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_heldout_perplexity_matches_the_record(name):
    record = json.loads((shipped_checkpoint(name) / "train.json").read_text())["heldout"]
    model = load_model(name)
    ids = model.tokenizer.encode((ROOT / record["text"]).read_text())[: record["tokens"]]
    assert len(ids) == record["tokens"]
    ppl = evaluate(model, ids, context=record["context"], paths=["full"])["paths"]["full"]["ppl"]
    assert abs(ppl / record["ppl"] - 1) < 0.01, (ppl, record["ppl"])
    assert ppl < 0.1 * model.cfg.vocab_size  # trained: far below a uniform guess


def test_cached_paths_score_like_the_full_forward():
    model = load_model("tiny-v32-code")
    ids = model.tokenizer.encode((ROOT / "checkpoints" / "heldout_code.txt").read_text())[:160]
    engine = EngineConfig(page_size=16, prefill_chunk=64, prefill_piece_ratio=64, pool_size=model.cfg.index_topk + 8)
    result = evaluate(model, ids, context=160, paths=["full", "ess"], engine=engine)
    assert max(result["max_abs_diff"].values()) < 1e-4, result["max_abs_diff"]
    assert result["offload"]["misses"] > 0  # the tier fetched rows

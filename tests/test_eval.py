"""``python -m ess_jax.eval``: per-token NLL through the full forward, the resident cached path and the ESS
tier agree; a teacher-forced request (``RequestSpec(..., forced_ids=...)``) leaves the other
requests of its batch alone; the CLI's errors.

The models are the hf-v32-a / hf-v4-a fixtures (random weights with lively logits, byte tokenizer), the
engine shapes helpers.ONLINE's, so the compiled steps are test_online's and test_server's. Context 192:
two windows (192 tokens and a partial one), 40 ESS pool slots against 192 V3.2 latent rows / 48 V4 CSA
entries per window, so the tier misses."""

import functools
import json
from pathlib import Path

import numpy as np
import pytest

import ess_jax
from ess_jax import eval as ess_eval
from ess_jax.engine import Engine, RequestSpec
from ess_jax.sampling import SamplingParams
from helpers import ONLINE

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = {"v32": FIXTURES / "hf-v32-a", "v4": FIXTURES / "hf-v4-a"}
CONTEXT = 192
# 280 bytes -> 281 tokens with bos: windows of 192 and 89 tokens; "é" and "→" are multi-byte
TEXT = ("The cache outgrew the device, so its rows moved to the host: each decode step reads the top-k rows "
        "the indexer picks, fetches the misses and merges the two attention halves by log-sum-exp. Café → "
        "résumé. Perplexity is exp of the mean negative log-likelihood per token, nats.\n")
ENGINE = ONLINE["ess"]  # the resident path runs the same shapes with offload "none"
CLI_SHAPE = ["--context", str(CONTEXT), "--max-batch", str(ENGINE.max_batch), "--page-size", str(ENGINE.page_size),
             "--prefill-chunk", str(ENGINE.prefill_chunk), "--prefill-piece-ratio", str(ENGINE.prefill_piece_ratio),
             "--max-seq-len", str(ENGINE.max_seq_len),
             "--pool-size", str(ENGINE.pool_size)]


@functools.cache
def model(family: str):
    return ess_jax.load_model(FAMILIES[family])


@functools.cache
def scored(family: str) -> dict:
    m = model(family)
    return ess_eval.evaluate(m, m.tokenizer.encode(TEXT), context=CONTEXT, engine=ENGINE)


def reference_nll(m, window: list[int]) -> np.ndarray:
    """-log_softmax(Model.logits)[t, window[t + 1]], in float64 NumPy. The window is padded to CONTEXT tokens
    (one compiled shape; the forward is causal): the cached paths, which never pad, check that."""
    logits = m.logits([window + [0] * (CONTEXT - len(window))])[0][: len(window)].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -logp[np.arange(len(window) - 1), window[1:]]


@pytest.mark.parametrize("family", FAMILIES)
def test_three_paths_agree_and_full_matches_the_logits(family):
    m, result = model(family), scored(family)
    ids = m.tokenizer.encode(TEXT)
    windows = [ids[:CONTEXT], ids[CONTEXT:]]
    assert len(ids) == len(TEXT.encode()) + 1 and result["windows"] == 2 and 1 < len(windows[1]) < CONTEXT
    scored_tokens = len(ids) - 2  # each window's first token is context only
    for path in ess_eval.PATHS:
        r = result["paths"][path]
        assert r["tokens"] == scored_tokens == result["per_token"][path].size
        assert r["nll"] == pytest.approx(result["per_token"][path].mean(), rel=1e-12)
        assert r["ppl"] == pytest.approx(np.exp(r["nll"]), rel=1e-12)
    assert set(result["max_abs_diff"]) == {"full-resident", "full-ess", "resident-ess"}
    assert max(result["max_abs_diff"].values()) < 1e-4, result["max_abs_diff"]
    ref = np.concatenate([reference_nll(m, w) for w in windows])
    np.testing.assert_allclose(result["per_token"]["full"], ref, rtol=0, atol=1e-4)
    assert result["paths"]["full"]["nll"] == pytest.approx(ref.mean(), abs=1e-6)
    assert ref.std() > 0.3  # lively logits: a wrong cached path could not pass by near-uniform predictions
    offload = result["offload"]
    assert offload["pool_size"] == ENGINE.pool_size and offload["misses"] > 0 and offload["hits"] > 0


def test_forced_request_leaves_its_batch_alone_and_scores_like_eval():
    m = model("v32")
    window = m.tokenizer.encode(TEXT)[:CONTEXT]
    eos = next(iter(m.cfg.eos_token_id))
    forced = window[1:30] + [eos] + window[31:40]  # an eos among the forced ids does not end the request
    engine = Engine(m, ENGINE)
    other = ([window[0]], 24, SamplingParams(temperature=0.8, seed=5))
    engine.add_request(RequestSpec(*other))
    alone = engine.run()[0].output_ids

    tokens, logprobs, reasons, ids = {}, {}, {}, {}
    ids["other"] = engine.add_request(RequestSpec(*other))
    for step in range(200):
        if step == 3:  # joins the running batch
            ids["forced"] = engine.add_request(RequestSpec(window[:1], len(forced),
                                                           SamplingParams(temperature=1.0, seed=1), forced_ids=forced))
        if step > 3 and not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert tokens[ids["other"]] == alone and not logprobs[ids["other"]]
    assert tokens[ids["forced"]] == forced and reasons[ids["forced"]] == "length"
    got = [lp.logprob for lp in logprobs[ids["forced"]]]
    assert [lp.token_id for lp in logprobs[ids["forced"]]] == forced and len(got) == len(forced)
    # the same window's first 29 tokens through eval's ess path (another batch, another row)
    np.testing.assert_allclose(-np.asarray(got[:29]), scored("v32")["per_token"]["ess"][:29], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(max_new_tokens=3, forced_ids=[1, 2]), "2 forced ids for max_new_tokens=3"),
    (dict(max_new_tokens=2, forced_ids=[1, 320]), "forced token id 320 is outside the vocabulary"),
    (dict(max_new_tokens=2, forced_ids=[1, 2], stop_token_ids=[5]), "stop_token_ids with forced_ids"),
])
def test_forced_ids_are_checked(kwargs, needle):
    engine = Engine(model("v32"), ENGINE)
    max_new = kwargs.pop("max_new_tokens")
    with pytest.raises(ValueError, match=needle):
        engine.add_request(RequestSpec([1], max_new, **kwargs))
    assert not engine.has_unfinished()


def test_cli_json(tmp_path, capsys):
    """--context 96 --max-tokens 192: two windows of 96 tokens, the engine in helpers.ONLINE's shapes
    (--max-seq-len 606, two rows), the cached paths only (the CLI's model is a new Model, whose full
    forward would compile again)."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    shape = dict(zip(CLI_SHAPE[::2], CLI_SHAPE[1::2]), **{"--context": "96"})
    argv = ["--model", str(FAMILIES["v32"]), "--text", str(text), *(x for kv in shape.items() for x in kv),
            "--max-tokens", "192", "--paths", "resident,ess", "--json"]
    assert ess_eval.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["windows"], out["tokens_read"], out["context"], out["family"]) == (2, 192, 96, "deepseek_v32")
    assert list(out["paths"]) == ["resident", "ess"] and list(out["max_abs_diff"]) == ["resident-ess"]
    for path in ("resident", "ess"):
        assert out["paths"][path]["tokens"] == 190
        assert out["paths"][path]["ppl"] == pytest.approx(np.exp(out["paths"][path]["nll"]))
    assert out["paths"]["ess"]["nll"] == pytest.approx(out["paths"]["resident"]["nll"], abs=1e-5)
    assert out["max_abs_diff"]["resident-ess"] < 1e-4
    assert out["offload"]["pool_size"] == ENGINE.pool_size and out["offload"]["misses"] > 0


@pytest.mark.parametrize("content,args,needle", [
    (None, [], "missing.txt: cannot read it"),
    ("", [], "empty.txt is empty"),
    (b"\xff\xfe", [], "not UTF-8"),
    ("abc", ["--max-tokens", "1"], "--max-tokens 1 must be >= 2"),
    ("abc", ["--paths", "full,cached"], "choose among full, resident, ess"),
    ("abc", ["--paths", "ess", "--offload", "none"], "contradicts --offload none"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, content, args, needle):
    name = {None: "missing.txt", "": "empty.txt"}.get(content, "text.txt")
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert ess_eval.main(["--text", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    if content is None or content == "":
        assert str(path) in err

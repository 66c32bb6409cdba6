"""The serving engine: batch invariance, chunk invariance, stopping, sampling, admission under pressure."""

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest

import ess_jax
from ess_jax.engine import Engine, EngineConfig, RequestSpec
from ess_jax.sampling import SamplingParams
from helpers import ENGINE

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v32-a"


@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model(FIXTURE)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def test_batch_invariance_mixed_lengths_joining_and_leaving(model):
    """Each request alone vs. all together with max_batch 3 (so some wait, join late, and others
    leave early): identical greedy tokens."""
    prompts = _prompts([7, 40, 16, 23, 3])
    new = [12, 5, 20, 9, 15]
    together = Engine(model, ENGINE)
    for p, n in zip(prompts, new):
        together.add_request(RequestSpec(p, n))
    batched = [r.output_ids for r in together.run()]
    for p, n, got in zip(prompts, new, batched):
        alone = Engine(model, dataclasses.replace(ENGINE, max_batch=1))
        alone.add_request(RequestSpec(p, n))
        assert alone.run()[0].output_ids == got
        assert len(got) == n
    # every page came back
    assert together.scheduler.allocators[0].num_free == together.scheduler.allocators[0].capacity


def test_prefill_chunk_size_does_not_change_tokens(model):
    prompts = _prompts([45, 17])
    outputs = []
    for chunk in (16, 64):  # 45 = 16 + 16 + 8 + 4 + 1 vs. 32 + 8 + 4 + 1
        engine = Engine(model, dataclasses.replace(ENGINE, prefill_chunk=chunk))
        for p in prompts:
            engine.add_request(RequestSpec(p, 10))
        outputs.append([r.output_ids for r in engine.run()])
    assert outputs[0] == outputs[1]


def test_stop_token_ends_a_request(model):
    prompt = _prompts([12])[0]
    free_run = ess_jax.generate(model, [prompt], 16, engine=ENGINE)
    eos = free_run.output_ids[0][5]
    first = free_run.output_ids[0].index(eos)
    result = ess_jax.generate(model, [prompt, prompt], 16, stop_token_ids=(eos,), engine=ENGINE)
    for out, reason in zip(result.output_ids, result.finish_reasons):
        assert out == free_run.output_ids[0][: first + 1] and reason == "stop"
    assert free_run.finish_reasons == ["length"]


def test_config_eos_stops_unless_ignored(model, tmp_path):
    """The checkpoint's eos_token_id ends a request ("stop"); ignore_eos=True decodes past it."""
    prompt = _prompts([12])[0]
    free_run = ess_jax.generate(model, [prompt], 16, engine=ENGINE).output_ids[0]
    eos = next(t for t in free_run[3:] if t != model.cfg.eos_token_id[0])
    first = free_run.index(eos)
    never = next(t for t in range(model.cfg.vocab_size) if t not in free_run)  # an eos id this run never emits
    for f in FIXTURE.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    raw = json.loads((FIXTURE / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, eos_token_id=[never, eos])))
    stopping = ess_jax.load_model(tmp_path)
    stopped = ess_jax.generate(stopping, [prompt], 16, engine=ENGINE)
    assert stopped.output_ids[0] == free_run[: first + 1] and stopped.finish_reasons == ["stop"]
    ignoring = ess_jax.generate(stopping, [prompt], 16, ignore_eos=True, engine=ENGINE)
    assert ignoring.output_ids[0] == free_run and ignoring.finish_reasons == ["length"]


def test_seeded_sampling_reproducible_and_seed_dependent(model):
    prompts = _prompts([9, 30])
    generate = functools.partial(ess_jax.generate, model, max_new_tokens=12, engine=ENGINE)
    hot = [SamplingParams(temperature=1.5, seed=s) for s in (11, 12)]
    a = generate(prompts, sampling=hot)
    b = generate(prompts[::-1], sampling=hot[::-1])  # other order, other rows
    assert a.output_ids == b.output_ids[::-1]
    c = generate(prompts, sampling=[SamplingParams(temperature=1.5, seed=s) for s in (13, 14)])
    assert a.output_ids != c.output_ids
    greedy = generate(prompts)
    assert a.output_ids != greedy.output_ids
    top1 = generate(prompts, sampling=SamplingParams(temperature=1.5, top_k=1, seed=3))
    assert top1.output_ids == greedy.output_ids


def test_small_pool_queues_requests_instead_of_failing(model):
    """A pool that holds one request at a time still serves all of them, in order, identically."""
    prompts = _prompts([20, 20, 20])
    tight = Engine(model, dataclasses.replace(ENGINE, num_pages=1 + 4))  # 4 pages = 32 tokens
    roomy = Engine(model, ENGINE)
    for engine in (tight, roomy):
        for p in prompts:
            engine.add_request(RequestSpec(p, 8))
    assert [r.output_ids for r in tight.run()] == [r.output_ids for r in roomy.run()]


def test_requests_that_can_never_fit_are_refused(model):
    engine = Engine(model, dataclasses.replace(ENGINE, num_pages=1 + 4))
    with pytest.raises(ValueError, match="--num-pages"):
        engine.add_request(RequestSpec(list(range(30)), 10))  # 40 tokens > 4 pages of 8
    with pytest.raises(ValueError, match="exceeds"):
        engine.add_request(RequestSpec(list(range(20)), 50))  # 70 tokens > max_seq_len 64
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request(RequestSpec([], 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(RequestSpec([1, 2, 1000], 4))
    engine.add_request(RequestSpec([1, 2, 3, 4], 4))  # the refusals left no trace: a good request still runs
    assert len(engine.run()[0].output_ids) == 4


V4_FIXTURE = Path(__file__).parent / "fixtures" / "hf-v4-a"


def test_v4_engine_matches_transformers_and_is_batch_invariant():
    """DeepSeek-V4 through the engine, max_batch 2: the 300-token fixture prompt decodes beside a short
    request, then the 21-token fixture prompt joins late in the row that request left; both give
    transformers' greedy tokens, computed by transformers one request at a time."""
    model = ess_jax.load_model(V4_FIXTURE)
    ref = np.load(V4_FIXTURE / "reference.npz")
    engine = Engine(model, EngineConfig(max_batch=2, prefill_chunk=3))  # 300, 45 and 21 tokens: one piece shape
    long_id = engine.add_request(RequestSpec(ref["prompt_1"].tolist(), 24))
    engine.add_request(RequestSpec(_prompts([45])[0], 6))
    late_id = engine.add_request(RequestSpec(ref["prompt_0"].tolist(), 24))
    out = engine.run()
    assert out[long_id].output_ids == ref["generate_1"][len(ref["prompt_1"]):].tolist()
    assert out[late_id].output_ids == ref["generate_0"][len(ref["prompt_0"]):].tolist()


def test_pallas_kernels_match_xla_through_the_engine(model):
    """--kernels pallas (interpret mode on CPU) gives the XLA path's greedy tokens and logits through an
    ESS engine: its prefill scratch attends over resident pages, its decode over the tier's two halves
    (the resident decode step is tests/kernels/test_model_kernels.py's)."""
    prompt = _prompts([32])[0]
    runs = []
    for kernels in ("xla", "pallas"):
        engine = Engine(model, EngineConfig(max_batch=1, page_size=8, prefill_chunk=32, max_seq_len=64,
                                            keep_logits=True, kernels=kernels, offload="ess", pool_size=17))
        engine.add_request(RequestSpec(prompt, 5))
        runs.append(engine.run()[0])
        assert engine.offload_metrics()["misses"] > 0  # both halves ran
    assert runs[0].output_ids == runs[1].output_ids
    np.testing.assert_allclose(np.stack(runs[1].logits), np.stack(runs[0].logits), atol=1e-4)

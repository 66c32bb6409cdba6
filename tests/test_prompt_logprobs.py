"""Prompt log-probabilities (``RequestSpec(..., prompt_logprobs=N)``): computed in the prefill pieces, equal to
the full forward's log-softmax for both families, resident and ESS, on prompts of several pieces; a request
of no new tokens ends after its prefill."""

import dataclasses
import functools

import numpy as np
import pytest

import ess_jax
from ess_jax.engine import MAX_PROMPT_LOGPROBS, Engine, RequestSpec
from ess_jax.engine.request import Request
from ess_jax.engine.plan import EngineStats, PrefillResult
from ess_jax.engine.prefix import NoPrefixCache
from ess_jax.engine.speculate import NoDrafts
from ess_jax.engine.scheduler import Scheduler
from helpers import FIXTURES, ONLINE

FAMILIES = {"v32": FIXTURES / "hf-v32-a", "v4": FIXTURES / "hf-v4-a"}
LONG, SHORT = 128, 64  # prefill_chunk 64: two pieces and one, of the one size the suite's warm-ups compile first


@functools.cache
def model(family: str):
    return ess_jax.load_model(FAMILIES[family])


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, length).tolist()


def full_logprobs(m, ids: list[int]) -> np.ndarray:
    """float64 log-softmax ``[T, V]`` of the full causal forward (no cache) over ``ids``, padded to ``LONG``
    tokens so every call has one shape (the forward is causal: what follows a position changes nothing there)."""
    logits = m.logits([ids + [0] * (LONG - len(ids))])[0, :len(ids)].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def check_against_full(scores: list, ids: list[int], full_TV: np.ndarray, top: int) -> None:
    assert len(scores) == len(ids) and scores[0] is None
    for t, lp in enumerate(scores[1:], start=1):  # token t, predicted at position t - 1
        row = full_TV[t - 1]
        assert lp.token_id == ids[t]
        np.testing.assert_allclose(lp.logprob, row[ids[t]], atol=1e-4, err_msg=f"token {t}")
        assert (row > row[ids[t]] + 1e-4).sum() + 1 <= lp.rank <= (row > row[ids[t]] - 1e-4).sum() + 1, t
        assert len(lp.top) == top
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(row)[::-1][:top], atol=1e-4)
        np.testing.assert_allclose([row[i] for i, _ in lp.top], [v for _, v in lp.top], atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["resident", "ess"])
def test_prompt_logprobs_equal_the_full_forward(family, mode):
    """Two requests at once: one scoring a two-piece prompt and ending after its prefill (no decode, reason
    "length"), one scoring a one-piece prompt and then generating; each one's prompt scores arrive in its
    first output only, equal to the full forward's log-softmax (values, ranks, top N), and the engine ends idle."""
    m = model(family)
    eng = Engine(m, ONLINE[mode])
    before = eng.usage()
    long, short = prompt(LONG, 1), prompt(SHORT, 2)
    scored = eng.add_request(RequestSpec(long, 0, prompt_logprobs=3))
    generating = eng.add_request(RequestSpec(short, 2, prompt_logprobs=MAX_PROMPT_LOGPROBS, logprobs=1,
                                             ignore_eos=True))
    outputs = {scored: [], generating: []}
    for _ in range(20):
        for out in eng.step():
            outputs[out.request_id].append(out)
        if not eng.has_unfinished():
            break
    assert [(o.new_token_ids, o.finish_reason) for o in outputs[scored]] == [([], "length")]
    firsts = [o.prompt_logprobs is not None for o in outputs[generating]]
    assert firsts == [True] + [False] * (len(firsts) - 1)
    assert sum(len(o.new_token_ids) for o in outputs[generating]) == 2
    check_against_full(outputs[scored][0].prompt_logprobs, long, full_logprobs(m, long), 3)
    check_against_full(outputs[generating][0].prompt_logprobs, short, full_logprobs(m, short), MAX_PROMPT_LOGPROBS)
    assert eng.stats.decode_tokens == 1  # the generating request's second token; the scoring one never decoded
    # idle: nothing held (the prompts' full pages stay in the prefix cache, evictable, counted free; V4: with the
    # snapshots at their boundaries)
    def uncached(u):
        cleared = lambda d: {k: 0 if k.startswith("prefix_cache_") else v for k, v in d.items()}  # noqa: E731
        return {**cleared(u), "per_shard": [cleared(s) for s in u["per_shard"]]}
    assert uncached(eng.usage()) == uncached(before)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be an integer >= 1 \(0 only with prompt_logprobs"),
    (dict(max_new_tokens=1, prompt_logprobs=MAX_PROMPT_LOGPROBS + 1),
     r"prompt_logprobs=21 must be an integer in \[0, 20\]"),
    (dict(max_new_tokens=1, prompt_logprobs=-1), r"prompt_logprobs=-1 must be"),
    (dict(max_new_tokens=1, prompt_logprobs=True), r"prompt_logprobs=True must be"),
    (dict(max_new_tokens=-1, prompt_logprobs=0), r"max_new_tokens=-1 must be an integer >= 1"),
])
def test_bad_prompt_logprobs_requests_are_refused_naming_the_field(kwargs, match):
    eng = Engine(model("v32"), ONLINE["resident"])
    with pytest.raises(ValueError, match=match):
        eng.add_request(RequestSpec([1, 2, 3], **kwargs))
    assert not eng.has_unfinished()


def test_loglikelihood_scores_continuations_as_the_full_forward():
    """``ess_jax.loglikelihood`` (lm-eval's contract, no server): each continuation's summed log-probability after
    its context and whether it is greedy, against the full forward; the greedy continuation found greedy."""
    m = model("v32")
    context = prompt(63, 3)  # with its continuations: pieces of 64, the size the tests above compiled
    full = full_logprobs(m, context)
    greedy = [int(np.argmax(full[-1]))]
    pairs = [(context, greedy), (prompt(100, 4), prompt(28, 5))]
    got = ess_jax.loglikelihood(m, pairs, engine=ONLINE["resident"])
    for (ctx, cont), (logprob, is_greedy) in zip(pairs, got):
        full = full_logprobs(m, ctx + cont)
        rows = full[np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)]
        np.testing.assert_allclose(logprob, rows[np.arange(len(cont)), cont].sum(), atol=1e-4)
        assert is_greedy == bool((rows.argmax(-1) == cont).all())
    assert [g for _, g in got] == [True, False]
    with pytest.raises(ValueError, match="request 1: the continuation is empty"):
        ess_jax.loglikelihood(m, [(context, greedy), (context, [])])


def test_the_scheduler_scores_each_piece_against_the_next_prompt_tokens():
    """Host only: each piece's targets are the prompt tokens after its positions (the last piece one fewer), a
    request of no new tokens ends after its last piece with no token and its prompt's scores in its output."""
    config = dataclasses.replace(ONLINE["resident"], prefill_piece_ratio=4)
    s = Scheduler(config, shards=1, pages=40, pages_per_row=38, max_seq_len=606, stats=EngineStats(),
                  prefix=NoPrefixCache(config.page_size), proposer=NoDrafts(config.max_batch))
    ids = prompt(70, 9)  # pieces 64, 4, 1, 1
    s.inbox.add(Request.from_spec(RequestSpec(ids, 0, prompt_logprobs=1), model("v32").tokenizer, []), s.check(70, 0))
    s.take_inbox()
    pieces = []
    for _ in range(3):
        for group in s.schedule_prefill():
            [piece] = group.slices.values()
            pieces.append((piece.start, piece.targets))
            n = len(piece.targets)  # scores: logprob -t, rank 1, top the target itself
            scores = (-np.asarray(piece.targets, np.float32), np.ones(n, np.int32),
                      np.asarray(piece.targets, np.int32)[:, None], -np.asarray(piece.targets, np.float32)[:, None])
            released = s.update_prefill(group, PrefillResult(np.zeros(1, np.int32), {}, {0: scores}))
            assert len(released) == piece.last  # its row and pages, after its last piece
    assert pieces == [(0, tuple(ids[1:65])), (64, tuple(ids[65:69])), (68, tuple(ids[69:70])), (69, ())]
    [out] = s.outputs()
    assert (out.new_token_ids, out.finished, out.finish_reason) == ([], True, "length")
    assert out.prompt_logprobs[0] is None
    assert [(lp.token_id, lp.logprob, lp.top) for lp in out.prompt_logprobs[1:]] == [(t, -t, ((t, -t),))
                                                                                     for t in ids[1:]]
    assert not s.inbox.has_unfinished()

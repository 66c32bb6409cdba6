"""lm-evaluation-harness's ``local-completions`` loglikelihood requests, sent as it sends them over real HTTP
(uvicorn on a free 127.0.0.1 port) to an ESS server, read back as it reads them, against the engine's own
scoring (``ess_jax.eval``'s teacher-forced path on a resident engine)."""

import httpx
import numpy as np
import pytest

import ess_jax
from ess_jax.engine import Engine, RequestSpec
from helpers import ONLINE, checkpoint
from test_server import DEADLINE, ThreadServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = ess_jax.load_model(checkpoint("v32", tmp_path_factory.mktemp("checkpoints")))
    started = ThreadServer(Engine(model, ONLINE["ess"]))
    yield started
    started.close()


def engine_scores(model, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """Each continuation's log-likelihood after its context and whether it is the greedy one, as ``ess_jax.eval``
    scores: the context as the prompt, the continuation forced token by token."""
    eng = Engine(model, ONLINE["resident"])
    ids = [eng.add_request(RequestSpec(context, len(cont), forced_ids=cont, logprobs=1)) for context, cont in pairs]
    lps = {i: [] for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            lps[out.request_id] += out.logprobs
    return [(sum(lp.logprob for lp in lps[i]), all(lp.top[0][0] == lp.token_id for lp in lps[i])) for i in ids]


def lm_eval_parse(reply: dict, ctxlens: list[int], generated: int) -> list[tuple[float, bool]]:
    """lm-evaluation-harness 0.4's ``LocalCompletionsAPI.parse_logprobs``: the continuation's token logprobs
    (after the context, before the ``generated`` tokens) summed, greedy if each is its top entry's maximum."""
    out = []
    for choice, ctxlen in zip(sorted(reply["choices"], key=lambda c: c["index"]), ctxlens):
        end = len(choice["logprobs"]["token_logprobs"]) - generated
        values = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        out.append((sum(values), all(v == max(top.values()) for v, top in zip(values, tops))))
    return out


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_requests_score_as_the_engine(server, max_tokens):
    """The body lm-eval sends for a batch of loglikelihood requests (``max_tokens`` 1 as 0.4 sends, and 0):
    one choice per context + continuation, the continuation's summed log-probability equal to the engine's
    teacher-forced one, and the greedy continuation (the server's own greedy reply) found greedy."""
    rng = np.random.default_rng(3)
    contexts = [rng.integers(0, 300, n).tolist() for n in (5, 70, 130)]
    greedy = httpx.post(server.url + "/v1/completions", timeout=DEADLINE, json={
        "model": "m", "prompt": contexts[1], "max_tokens": 3, "temperature": 0, "ignore_eos": True}).json()
    pairs = [(contexts[0], rng.integers(0, 300, 4).tolist()),
             (contexts[1], server.engine.model.tokenizer.encode(greedy["choices"][0]["text"])),
             (contexts[2], rng.integers(0, 300, 1).tolist())]
    assert len(pairs[1][1]) == 3  # the greedy text encodes back to its three tokens
    body = {"model": "m", "prompt": [c + cont for c, cont in pairs], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}  # lm_eval.models.openai_completions._create_payload
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=DEADLINE)
    assert reply.status_code == 200, reply.text
    got = lm_eval_parse(reply.json(), [len(c) for c, _ in pairs], max_tokens)
    expected = engine_scores(server.engine.model, pairs)
    np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], atol=1e-4)
    assert [g[1] for g in got] == [e[1] for e in expected] == [False, True, False]

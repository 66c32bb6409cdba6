"""The server's guards over HTTP: the API key on every endpoint but ``/health``, a request body past the bound
refused with a 413, a 12 MB prompt tokenized off the event loop (``/health`` answers meanwhile), and ``cache_salt``
keeping one client's cached prefix from another's."""

import statistics
import threading
import time

import httpx
import numpy as np
import pytest

import ess_jax
from ess_jax.engine import Engine
from helpers import ONLINE, checkpoint
from test_server import DEADLINE, ThreadServer

AUTH = {"Authorization": "Bearer key"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = ess_jax.load_model(checkpoint("v32", tmp_path_factory.mktemp("checkpoints")))
    server = ThreadServer(Engine(model, ONLINE["resident"]), api_key="key", max_body_bytes=16 << 20)
    yield server
    server.close()


def test_every_endpoint_but_health_needs_the_key(server):
    get, post = [("GET", p) for p in ("/v1/models", "/metrics", "/tokenizer_info")], [
        ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("POST", "/v1/completions", {"model": "m", "prompt": [1, 2], "max_tokens": 1})]
    for method, path, *body in get + post:
        kwargs = dict(json=body[0]) if body else {}
        assert httpx.request(method, server.url + path, **kwargs).status_code == 401, path
        wrong = httpx.request(method, server.url + path, headers={"Authorization": "Bearer nope"}, **kwargs)
        assert wrong.status_code == 401, path
        assert httpx.request(method, server.url + path, headers=AUTH, timeout=DEADLINE, **kwargs).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_body_past_the_bound_gets_413_and_a_huge_prompt_leaves_health_answering(server):
    big = {"model": "m", "prompt": "x" * (17 << 20), "max_tokens": 1}
    reply = httpx.post(server.url + "/v1/completions", json=big, headers=AUTH, timeout=DEADLINE)
    assert reply.status_code == 413 and "bound" in reply.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "m", "max_tokens": 1, "prompt": "'
        for _ in range(17):
            yield b"x" * (1 << 20)
        yield b'"}'
    reply = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=DEADLINE,
                       headers=dict(AUTH, **{"Content-Type": "application/json"}))
    assert reply.status_code == 413
    # a 12 MB prompt: tokenized on a worker thread (then refused: longer than the context), /health answers meanwhile
    words = " ".join(np.random.default_rng(0).choice(["def", "return", "self", "x", "(", ")"], 2_000_000))
    result = {}
    sender = threading.Thread(target=lambda: result.update(reply=httpx.post(
        server.url + "/v1/completions", headers=AUTH, timeout=DEADLINE,
        json={"model": "m", "prompt": words[:12 << 20], "max_tokens": 1})))
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=DEADLINE).status_code == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.02)
    sender.join()
    assert result["reply"].status_code == 400 and "more than" in result["reply"].json()["error"]["message"]
    # the event loop is never held for the tokenization (on a loaded machine single waits still reach a second)
    assert len(waits) >= 10 and statistics.median(waits) < 0.5 and max(waits) < 5, waits


def test_cache_salt_keeps_one_clients_prefix_from_another(server):
    prompt = np.random.default_rng(4).integers(0, 300, 80).tolist()
    engine = server.engine

    def send(salt):
        hits = engine.prefix_cache_metrics()["hit_tokens"]
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        reply = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=DEADLINE,
                           json=body if salt is None else dict(body, cache_salt=salt))
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"], engine.prefix_cache_metrics()["hit_tokens"] - hits

    text, hits = send("alice")
    assert hits == 0
    assert send("bob") == (text, 0) and send(None) == (text, 0)  # other salts, and none: nothing shared
    assert send("alice") == (text, 64)  # the same salt: its pages ((80 - 1) // 16 * 16 tokens)
    assert httpx.post(server.url + "/v1/completions", headers=AUTH, json={
        "model": "m", "prompt": prompt, "max_tokens": 1, "cache_salt": ""}).status_code == 400

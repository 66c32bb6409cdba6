"""The OpenAI-compatible server: real uvicorn servers on free 127.0.0.1 ports (threads of this process,
and one `python -m ess_jax.serve` subprocess), driven with the `openai` client and raw HTTP."""

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import uvicorn
import yaml

import ess_jax
from ess_jax.engine import Engine, EngineConfig, RequestSpec
from ess_jax.server import create_app
from helpers import FIXTURES, ONLINE, checkpoint, free_port

# The greedy-equality servers use the online tests' engine shapes (compiled once per session); the rest run on
# one V3.2 ESS server of 8 rows for prompts up to 2000 tokens.
CONFIGS = ONLINE
WIDE = EngineConfig(max_batch=8, page_size=16, prefill_chunk=64, max_seq_len=2064, offload="ess", pool_size=64)
DEADLINE = 300  # seconds any wait below may take



class ThreadServer:
    """uvicorn serving ``create_app(engine)`` on a thread; ``url`` once it accepts connections."""

    def __init__(self, engine: Engine, **app_kwargs):
        self.engine = engine
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name="m", **app_kwargs), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + DEADLINE
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def servers(root):
    """Servers by (family, mode: "wide" = WIDE), started on first use; closed at the end of the module."""
    started = {}

    def get(family: str, mode: str) -> ThreadServer:
        if (family, mode) not in started:
            model = ess_jax.load_model(checkpoint(family, root))
            started[family, mode] = ThreadServer(Engine(model, WIDE if mode == "wide" else CONFIGS[mode]))
        return started[family, mode]

    yield get
    for s in started.values():
        s.close()


def client(server: ThreadServer, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                         timeout=DEADLINE, **kwargs)


def offline(server: ThreadServer, batch: list[list[int]], new: int) -> list[list[int]]:
    """Greedy tokens of ``batch`` from a fresh engine of the server's configuration (eos ignored)."""
    engine = Engine(server.engine.model, server.engine.config)
    for prompt in batch:
        engine.add_request(RequestSpec(prompt, new, ignore_eos=True))
    return [r.output_ids for r in engine.run()]


def prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in lengths]


def metric(server: ThreadServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


@pytest.mark.parametrize("family,mode", [("v32", "resident"), ("v32", "ess"), ("v4", "resident"), ("v4", "ess")])
def test_greedy_completions_equal_generate(root, family, mode):
    server = ThreadServer(Engine(ess_jax.load_model(checkpoint(family, root)), CONFIGS[mode]))
    batch = prompts([5, 70, 300])
    try:
        reply = client(server).completions.create(model="m", prompt=batch, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True})
    finally:
        server.close()
    model = server.engine.model
    expected = offline(server, batch, 6)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice, ids in zip(reply.choices, expected):
        assert choice.text == model.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == 375 and reply.usage.completion_tokens == 18


def test_stream_concatenates_to_the_non_streamed_text(servers):
    server = servers("v32", "wide")
    c = client(server)
    kwargs = dict(model="m", prompt="the cache outgrew the device", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = c.completions.create(**kwargs)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_the_openai_clients_plain_stream_loop_reads_choices_0(servers):
    """Without stream_options no chunk has empty choices, so the openai client's documented loop
    (``for chunk in stream: chunk.choices[0]``) runs to the end on both endpoints; every reply names its kind."""
    server = servers("v32", "wide")
    c = client(server)
    kwargs = dict(model="m", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(prompt="héllo wörld", **kwargs)
    assert (whole.object, whole.system_fingerprint) == ("text_completion", "ess_jax-ess-b8-p16-s2064")
    text = ""
    for chunk in c.completions.create(prompt="héllo wörld", stream=True, **kwargs):
        text += chunk.choices[0].text
        assert chunk.usage is None and chunk.object == "text_completion"
    assert text == whole.choices[0].text
    messages = [{"role": "user", "content": "héllo"}]
    chat_whole = c.chat.completions.create(messages=messages, **kwargs)
    content = ""
    for chunk in c.chat.completions.create(messages=messages, stream=True, **kwargs):
        content += chunk.choices[0].delta.content or ""
        assert chunk.object == "chat.completion.chunk" and chunk.system_fingerprint == chat_whole.system_fingerprint
    assert content == chat_whole.choices[0].message.content and chat_whole.object == "chat.completion"


def test_tokenizer_endpoints_over_http(servers):
    server = servers("v32", "wide")
    tokenizer, text = server.engine.model.tokenizer, "the cache outgrew the device"
    tokens = httpx.post(server.url + "/tokenize", json={"model": "m", "prompt": text}, timeout=DEADLINE)
    assert tokens.status_code == 200 and tokens.json() == {"count": len(tokenizer.encode(text)), "max_model_len": 2064,
                                                           "tokens": tokenizer.encode(text), "token_strs": None}
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=DEADLINE)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    info = httpx.get(server.url + "/tokenizer_info", timeout=DEADLINE)
    assert info.status_code == 200 and info.json()["tokenizer_class"] == "HFTokenizer"
    refused = httpx.post(server.url + "/tokenize", json=["not", "an", "object"], timeout=DEADLINE)
    assert refused.status_code == 400 and "valid dictionary" in refused.json()["error"]["message"], refused.text


def test_32_concurrent_streams_get_their_offline_tokens(servers, root):
    """32 streaming clients at once, prompts of 1 to 2000 tokens: each gets exactly its own offline text and
    token count, as generate() computes them one request at a time."""
    server = servers("v32", "wide")
    lengths = np.unique(np.geomspace(1, 2000, 32).astype(int)).tolist()
    lengths += [2000 - i for i in range(32 - len(lengths))]
    batch = prompts(lengths, seed=1)
    news = [3 + i % 5 for i in range(32)]

    async def one(c, prompt, new):
        text, usage = "", None
        async for chunk in await c.completions.create(model="m", prompt=prompt, max_tokens=new, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text if chunk.choices else ""
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=DEADLINE) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(batch, news)))

    got = asyncio.run(asyncio.wait_for(all_of_them(), DEADLINE))
    tokenizer = server.engine.model.tokenizer
    expected = offline(server, batch, max(news))
    for (text, count), ids, new in zip(got, expected, news):
        assert count == new and text == tokenizer.decode(ids[:new])


def test_stop_strings_trim_the_text_even_across_tokens(servers):
    server = servers("v32", "wide")
    c = client(server)
    prompt = prompts([40], seed=2)[0]
    full = c.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    ids = offline(server, [prompt], 24)[0]
    tokenizer = server.engine.model.tokenizer
    bounds = [len(tokenizer.decode(ids[:k])) for k in range(1, len(ids))]
    # a two-character stop string across a token boundary, without replacement characters
    at = next(b for b in bounds[3:] if 0 < b < len(full) and "\ufffd" not in full[b - 1:b + 1])
    stop = full[at - 1:at + 1]
    expected = full[: full.find(stop)]
    kwargs = dict(model="m", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never-there"],
                  extra_body={"ignore_eos": True})
    reply = c.completions.create(**kwargs).choices[0]
    assert (reply.text, reply.finish_reason) == (expected, "stop")
    chunks = [ch for ch in c.completions.create(stream=True, **kwargs) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_renders_the_checkpoint_template(servers):
    server = servers("v32", "wide")
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    rendered = "<bos><|system|>be brief\n<|user|>héllo\n<|assistant|>"  # TEMPLATE by hand
    ids = server.engine.model.tokenizer.encode(rendered, add_special_tokens=False)
    expected = c.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    reply = c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
    assert chunks[-1].usage.completion_tokens == 8


def test_client_disconnect_frees_its_pages(servers, root):
    """A streaming client goes away after two chunks: its request is aborted and its pages freed, while a
    request beside it still gets its offline tokens."""
    server = servers("v32", "wide")
    c = client(server)
    other = prompts([90], seed=3)[0]
    result = {}
    thread = threading.Thread(target=lambda: result.update(text=c.completions.create(
        model="m", prompt=other, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}).choices[0].text))
    with httpx.stream("POST", server.url + "/v1/completions", timeout=DEADLINE,
                      json={"model": "m", "prompt": prompts([500], seed=4)[0], "max_tokens": 1500, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        thread.start()
        assert next(l for l in lines if l).startswith("data: ")
        assert metric(server, "ess_jax_kv_pages_in_use") > 0
    thread.join(DEADLINE)
    ids = offline(server, [other], 40)[0]
    assert result["text"] == server.engine.model.tokenizer.decode(ids)
    deadline = time.monotonic() + DEADLINE
    while metric(server, "ess_jax_kv_pages_in_use") != 0:
        assert time.monotonic() < deadline, "the disconnected request kept its pages"
        time.sleep(0.1)
    assert metric(server, 'ess_jax_requests_total{outcome="abort"}') >= 1


@pytest.fixture(scope="module")
def limited(root):
    """One batch row, nobody may wait, an API key, and a pool of 40 pages (640 tokens) under a 2064-token context."""
    model = ess_jax.load_model(checkpoint("v32", root))
    server = ThreadServer(Engine(model, EngineConfig(max_batch=1, page_size=16, num_pages=41, max_seq_len=2064,
                                                     prefill_chunk=16)), api_key="key", max_waiting=0)
    yield server
    server.close()


def test_errors_get_their_status_and_the_server_keeps_serving(limited):
    url, auth = limited.url, {"Authorization": "Bearer key"}
    post = functools.partial(httpx.post, url + "/v1/completions", timeout=DEADLINE)
    good = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    cases = [
        (dict(content=b"{not json", headers=dict(auth, **{"Content-Type": "application/json"})), 400,
         "not valid JSON"),
        (dict(json=dict(good, max_tokens="many")), 400, "max_tokens"),
        (dict(json=dict(good, temperature=-1)), 400, "temperature"),
        (dict(json=dict(good, prompt=[1, 2, 999])), 400, "outside the vocabulary"),
        (dict(json=dict(good, model="other")), 400, "not served here"),
        (dict(json=dict(good, n=2)), 400, "n=2 is not supported"),
        (dict(json=dict(good, max_tokens=3000)), 400, "exceeds the 2064 tokens"),
        (dict(json=dict(good, prompt=list(range(100)), max_tokens=1000)), 400, "needs 69 pages"),
        (dict(json=dict(good, prompt="")), 400, "empty"),
    ]
    for kwargs, status, message in cases:
        reply = post(**dict(dict(headers=auth), **kwargs))
        assert reply.status_code == status, (kwargs, reply.text)
        assert message in reply.json()["error"]["message"], reply.text
    assert httpx.post(url + "/v1/completions", json=good).status_code == 401
    assert httpx.post(url + "/v1/completions", json=good, headers={"Authorization": "Bearer nope"}).status_code == 401
    chat = httpx.post(url + "/v1/chat/completions", headers=auth, json={"model": "m", "messages": []})
    assert chat.status_code == 400 and "messages" in chat.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        client(limited, api_key="wrong").models.list()
    assert client(limited, api_key="key").models.list().data[0].id == "m"
    # a second request while the one row is busy and --max-waiting 0: 503 with Retry-After
    with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=DEADLINE,
                      json=dict(good, max_tokens=600, stream=True, ignore_eos=True)) as busy:
        lines = busy.iter_lines()  # kept: a dropped iterator closes the connection, which aborts the request
        assert busy.status_code == 200 and next(lines).startswith("data: ")
        refused = post(json=good, headers=auth)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    # the closed stream's abort reaches the engine loop asynchronously: a client honours Retry-After until it has
    deadline = time.monotonic() + 60
    while (after := post(json=good, headers=auth)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(float(after.headers["retry-after"]))
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_sigterm_lets_running_requests_finish_and_exits_0(root):
    """The real CLI in a subprocess: SIGTERM while a stream runs; the stream completes and the process
    exits 0 within --shutdown-timeout. The engine has CONFIGS["ess"]'s shapes, so the subprocess reads the
    steps this process compiled from the session's compilation cache."""
    port, shape = free_port(), CONFIGS["ess"]
    proc = subprocess.Popen([sys.executable, "-m", "ess_jax.serve", "--model", str(checkpoint("v32", root)),
                             "--port", str(port), "--max-seq-len", str(shape.max_seq_len), "--max-batch",
                             str(shape.max_batch), "--page-size", str(shape.page_size), "--prefill-chunk",
                             str(shape.prefill_chunk), "--prefill-piece-ratio", str(shape.prefill_piece_ratio),
                             "--pool-size", str(shape.pool_size),
                             "--served-model-name", "m", "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            time.sleep(0.2)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=DEADLINE,
                          json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 64, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": 0,
                                "ignore_eos": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["usage"]["completion_tokens"] == 64
        assert proc.wait(timeout=DEADLINE) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_refuses_an_unreadable_chat_template_before_it_builds_the_engine(tmp_path, capsys):
    from ess_jax import serve

    missing = tmp_path / "chat.jinja"
    assert serve.main(["--model", str(FIXTURES / "hf-v32-a"), "--chat-template", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --chat-template {missing}: cannot read it")


def test_bench_load_generator_against_a_running_server(servers, tmp_path, capsys):
    from ess_jax import bench

    server = servers("v32", "wide")

    def hits() -> float:  # the prefix cache's hits so far (the engine is read once idle)
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("ess_jax_prefix_cache_hits_total{"))

    before = hits()
    # every prompt after one shared 64-token prefix: the prefix cache's workload
    code = bench.main(["--serve", server.url, "--concurrency", "1,4", "--requests", "4", "--prompt-lengths", "8,64",
                       "--shared-prefix", "64", "--max-tokens", "5", "--out", str(tmp_path), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["setup"]["shared_prefix"] == 64
    assert [(r["concurrency"], r["model"]) for r in result["runs"]] == [(1, "m"), (4, "m")]
    deadline = time.monotonic() + DEADLINE
    while hits() <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hits() > before
    for r in result["runs"]:
        assert r["output_tokens_per_s"] * r["wall_s"] == pytest.approx(4 * 5)  # every request's usage
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["itl_ms_p50"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.png", "serve_results.json"]


def test_the_dashboard_queries_only_what_the_server_exports(servers):
    """Every metric a panel of docs/monitoring/grafana-dashboard.json queries is on a running ESS server's
    /metrics (the tier's families appear once the engine was read: it is read when it goes idle), and the
    scrape config beside it scrapes /metrics."""
    server = servers("v32", "wide")
    client(server).completions.create(model="m", prompt=prompts([40], seed=9)[0], max_tokens=4, temperature=0)
    monitoring = Path(__file__).parents[1] / "docs" / "monitoring"
    dashboard = json.loads((monitoring / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"ess_jax_\w+", target["expr"])}
    assert {"ess_jax_tier_hits_total", "ess_jax_time_to_first_token_seconds_bucket"} <= queried
    deadline = time.monotonic() + DEADLINE
    while True:
        text = httpx.get(server.url + "/metrics").text
        exported = {re.split(r"[{ ]", line)[0] for line in text.splitlines() if line and not line.startswith("#")}
        if queried <= exported or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert queried - exported == set()
    scrape = yaml.safe_load((monitoring / "prometheus.yml").read_text())
    assert [job["metrics_path"] for job in scrape["scrape_configs"]] == ["/metrics"]

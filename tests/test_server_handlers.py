"""The server's handlers as plain functions of a ``ServeContext`` and a body, without uvicorn or HTTP: a real
engine behind a real ``EngineLoop`` thread (the online tests' ESS shape on the BPE fixture checkpoint), the
replies compared with the offline engine's greedy tokens; the stop-string cutter on its own."""

import asyncio
import dataclasses
import json
import re
import time

import numpy as np
import pytest

import ess_jax
from ess_jax.config import ConfigError
from ess_jax.engine import Engine
from ess_jax.engine.loop import EngineLoop, ready
from ess_jax.server.chat import chat
from ess_jax.server.completions import completions
from ess_jax.server.context import ServeContext
from ess_jax.server.metrics import Metrics
from ess_jax.server.protocol import APIError, ChatBody, CompletionBody, parse
from ess_jax.server.stream import StopStrings
from ess_jax.server.tokenization import detokenize, tokenize, tokenizer_info
from ess_jax.tokenizer import read_chat_template
from helpers import FIXTURES, ONLINE, TEMPLATE, checkpoint

CONFIG = ONLINE["ess"]
DEADLINE = 300


def serve(model) -> ServeContext:
    """A started engine loop over a fresh engine of ``CONFIG``, the model's chat template (stop it with
    ``ctx.loop.stop()``)."""
    engine = Engine(model, CONFIG)
    metrics = Metrics()
    ready(engine, metrics)
    loop = EngineLoop(engine, metrics)
    loop.start()
    return ServeContext(loop, "m", model.chat_template)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def ctx(root):
    ctx = serve(ess_jax.load_model(checkpoint("v32", root)))
    yield ctx
    ctx.loop.stop()


async def never_disconnected() -> bool:
    return False


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE))


def reply(ctx, handler, **fields) -> dict:
    body = parse(CompletionBody if handler is completions else ChatBody, {"model": "m", **fields})
    return run(handler(ctx, body, never_disconnected))


def streamed(ctx, handler, **fields) -> list:
    """The events of a streamed reply: each chunk as a dict, the end as "[DONE]"."""
    async def read():
        body = parse(CompletionBody if handler is completions else ChatBody, {"model": "m", "stream": True, **fields})
        events = []
        async for event in await handler(ctx, body, never_disconnected):
            payload = event.removeprefix("data: ").strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events

    return run(read())


def offline(model, batch: list[list[int]], new: int) -> list[list[int]]:
    """Greedy tokens of ``batch`` from ``generate`` on an engine of ``CONFIG`` (eos ignored)."""
    return ess_jax.generate(model, batch, new, ignore_eos=True, engine=CONFIG).output_ids


def sample_value(ctx, name: str, **labels) -> float | None:
    return ctx.loop.metrics.registry.get_sample_value(name, labels)


def test_every_prompt_form_gets_one_choice_per_prompt_in_order(ctx):
    tokenizer = ctx.tokenizer
    texts = ["the cache outgrew the device", "héllo wörld"]
    rng = np.random.default_rng(5)
    id_lists = [rng.integers(0, 300, n).tolist() for n in (3, 40, 9)]
    encoded_texts = [tokenizer.encode(t) for t in texts]
    batch = encoded_texts + id_lists
    expected = {tuple(p): tokenizer.decode(ids) for p, ids in zip(batch, offline(ctx.engine.model, batch, 5))}
    forms = [(texts[0], encoded_texts[:1]), (texts, encoded_texts), (id_lists[1], id_lists[1:2]), (id_lists, id_lists)]
    for prompt, prompts in forms:
        fields = dict(prompt=prompt, max_tokens=5, temperature=0, ignore_eos=True)
        whole = reply(ctx, completions, **fields)
        assert [c["index"] for c in whole["choices"]] == list(range(len(prompts))), prompt
        assert [c["text"] for c in whole["choices"]] == [expected[tuple(p)] for p in prompts], prompt
        assert whole["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 5 * len(prompts),
                                  "total_tokens": sum(map(len, prompts)) + 5 * len(prompts)}
        chunks = streamed(ctx, completions, **fields)[:-1]
        for index, p in enumerate(prompts):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
            assert "".join(c["text"] for c in mine) == expected[tuple(p)] and mine[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("handler", [completions, chat], ids=["completions", "chat"])
def test_the_usage_chunk_comes_only_with_include_usage(ctx, handler):
    fields = dict(max_tokens=4, temperature=0, ignore_eos=True)
    if handler is completions:
        fields["prompt"] = [[7, 8, 9], [1, 2]]
    else:
        fields["messages"] = [{"role": "user", "content": "héllo"}]
    plain = streamed(ctx, handler, **fields)
    assert plain[-1] == "[DONE]" and all(c["choices"] and "usage" not in c for c in plain[:-1])
    asked = streamed(ctx, handler, stream_options={"include_usage": True}, **fields)
    *chunks, last, done = asked
    choices = 2 if handler is completions else 1
    prompt_tokens = 5 if handler is completions else reply(ctx, handler, **fields)["usage"]["prompt_tokens"]
    assert done == "[DONE]" and last["choices"] == [] and all(c["usage"] is None for c in chunks)
    assert last["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4 * choices,
                             "total_tokens": prompt_tokens + 4 * choices}
    continuous = streamed(ctx, handler, stream_options={"include_usage": True, "continuous_usage_stats": True},
                          **fields)
    so_far = {}
    for c in continuous[:-2]:
        index = c["choices"][0]["index"]
        so_far[index] = c["usage"]["completion_tokens"]
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + so_far[index]
    assert so_far == {i: 4 for i in range(choices)}
    assert continuous[-2]["usage"] == last["usage"]
    with pytest.raises(APIError, match="stream_options is only allowed with stream: true") as refused:
        reply(ctx, handler, stream_options={"include_usage": True}, **fields)
    assert (refused.value.status, refused.value.param) == (400, "stream_options")


def test_replies_carry_object_created_and_system_fingerprint(ctx):
    start = int(time.time())
    fields = dict(prompt=[3, 4, 5], max_tokens=3, temperature=0, ignore_eos=True)
    whole = reply(ctx, completions, **fields)
    chat_whole = reply(ctx, chat, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    chunks = streamed(ctx, completions, stream_options={"include_usage": True}, **fields)[:-1]
    chat_chunks = streamed(ctx, chat, messages=[{"role": "user", "content": "hi"}], max_tokens=3)[:-1]
    end = int(time.time())
    for r, kind, prefix in [(whole, "text_completion", "cmpl-"), (chat_whole, "chat.completion", "chatcmpl-")]:
        assert r["object"] == kind and r["id"].startswith(prefix) and start <= r["created"] <= end
        assert r["system_fingerprint"] == ctx.fingerprint and r["model"] == "m"
    for events, kind in [(chunks, "text_completion"), (chat_chunks, "chat.completion.chunk")]:
        assert {(c["id"], c["object"], c["created"], c["system_fingerprint"]) for c in events} == \
            {(events[0]["id"], kind, events[0]["created"], ctx.fingerprint)}
    assert chat_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_refusals_name_the_field_before_anything_is_queued(ctx):
    cases = [(dict(prompt=[1, 2], n=2), "n", "n=2 is not supported"),
             (dict(prompt=[1, 2], model="other"), "model", "is not served here"),
             (dict(prompt=[]), "prompt", "the prompt is empty"),
             (dict(prompt=["fine", ""]), "prompt", "the prompt is empty"),
             (dict(prompt=[1, 2], stop=["ok", ""]), "stop", "stop strings must be non-empty"),
             (dict(prompt=[1, 2], max_tokens=0), "max_tokens", "max_tokens=0 generates nothing: send echo"),
             (dict(prompt=[1, 2], prompt_logprobs=21), "prompt_logprobs", "less than or equal to 20"),
             (dict(prompt=[1, 2], top_k=2**31), "top_k", "less than 2147483648")]
    for fields, param, message in cases:
        with pytest.raises(APIError, match=message) as refused:
            reply(ctx, completions, **fields)
        assert (refused.value.status, refused.value.param) == (400, param), fields
    assert ctx.loop.waiting == 0 and not ctx.engine.has_unfinished()


def test_ignore_eos_decodes_past_the_checkpoints_eos(ctx, root, tmp_path):
    """A checkpoint whose eos is a token its greedy reply emits: the reply stops there ("stop") unless ignore_eos."""
    prompt = [11, 22, 33, 44]
    free = offline(ctx.engine.model, [prompt], 12)[0]
    eos = free[4]
    first = free.index(eos)
    for f in checkpoint("v32", root).iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    raw = json.loads((checkpoint("v32", root) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, eos_token_id=[eos])))
    stopping = serve(ess_jax.load_model(tmp_path))
    try:
        stopped = reply(stopping, completions, prompt=prompt, max_tokens=12, temperature=0)
        ignoring = reply(stopping, completions, prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True)
    finally:
        stopping.loop.stop()
    tokenizer = ctx.tokenizer
    assert (stopped["choices"][0]["finish_reason"], stopped["usage"]["completion_tokens"]) == ("stop", first + 1)
    assert stopped["choices"][0]["text"] == tokenizer.decode(free[:first + 1])
    assert (ignoring["choices"][0]["finish_reason"], ignoring["usage"]["completion_tokens"]) == ("length", 12)
    assert ignoring["choices"][0]["text"] == tokenizer.decode(free)


def test_tokenize_detokenize_and_tokenizer_info(ctx):
    tokenizer, text = ctx.tokenizer, "the cache outgrew the device"
    ids = tokenizer.encode(text)
    assert tokenize(ctx, {"prompt": text}) == {"count": len(ids), "max_model_len": ctx.engine.max_seq_len,
                                               "tokens": ids, "token_strs": None}
    strs = tokenize(ctx, {"model": "m", "prompt": text, "return_token_strs": True})["token_strs"]
    assert len(strs) == len(ids) and "".join(strs) == text
    messages = [{"role": "user", "content": "héllo"}]
    rendered = "<bos><|user|>héllo\n"  # TEMPLATE by hand
    with_prompt = tokenize(ctx, {"messages": messages})["tokens"]
    assert with_prompt == tokenizer.encode(rendered + "<|assistant|>", add_special_tokens=False)
    assert tokenize(ctx, {"messages": messages, "add_generation_prompt": False})["tokens"] == \
        tokenizer.encode(rendered, add_special_tokens=False)
    assert detokenize(ctx, {"tokens": ids}) == {"prompt": text}
    vocab = ctx.engine.model.cfg.vocab_size
    for call, data, param, message in [
            (tokenize, {"text": text}, "prompt", "prompt: Field required"),
            (tokenize, {"prompt": text, "model": "other"}, "model", "is not served here"),
            (tokenize, {"messages": messages, "continue_final_message": True}, "continue_final_message",
             "not supported"),
            (detokenize, {"tokens": [1, vocab]}, "tokens", "outside the vocabulary"),
            (detokenize, {"tokens": [1, -1]}, "tokens.1", "greater than or equal to 0")]:
        with pytest.raises(APIError, match=message) as refused:
            call(ctx, data)
        assert (refused.value.status, refused.value.param) == (400, param), data
    cfg = ctx.engine.model.cfg
    info = tokenizer_info(ctx)
    assert info == {"tokenizer_class": "HFTokenizer", "model_max_length": ctx.engine.max_seq_len,
                    "vocab_size": vocab, "chat_template": TEMPLATE,
                    "bos_token": tokenizer.token_text(cfg.bos_token_id), "bos_token_id": cfg.bos_token_id,
                    "eos_token": tokenizer.token_text(cfg.eos_token_id[0]), "eos_token_id": cfg.eos_token_id[0],
                    "pad_token": tokenizer.token_text(cfg.pad_token_id), "pad_token_id": cfg.pad_token_id}


def test_a_chat_template_file_serves_a_checkpoint_without_one(tmp_path):
    """``--chat-template FILE``'s template on the byte-level fixture (no tokenizer_config.json): chat is refused
    without it, and with it replies as completions do on the rendered prompt."""
    model = ess_jax.load_model(FIXTURES / "hf-v32-a")
    tokenizer, cfg = model.tokenizer, model.cfg
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    template = read_chat_template(tmp_path / "chat.jinja", tokenizer, cfg, model.chat_template)
    assert model.chat_template is None and template.special_tokens == {
        "bos_token": tokenizer.token_text(cfg.bos_token_id), "eos_token": tokenizer.token_text(cfg.eos_token_id[0])}
    without = serve(model)
    templated = dataclasses.replace(without, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    try:
        with pytest.raises(APIError, match="start the server with --chat-template FILE"):
            reply(without, chat, messages=messages, max_tokens=3)
        ids = tokenizer.encode(template.special_tokens["bos_token"] + "<|user|>hi\n<|assistant|>",
                               add_special_tokens=False)
        fields = dict(max_tokens=4, temperature=0, ignore_eos=True)
        expected = reply(templated, completions, prompt=ids, **fields)["choices"][0]["text"]
        got = reply(templated, chat, messages=messages, **fields)
    finally:
        without.loop.stop()
    assert got["choices"][0]["message"]["content"] == expected and got["usage"]["prompt_tokens"] == len(ids)
    assert tokenizer_info(templated)["chat_template"] == TEMPLATE and "chat_template" not in tokenizer_info(without)
    (tmp_path / "empty.jinja").write_text(" \n")
    (tmp_path / "broken.jinja").write_text("{% for %}")
    for name, message in [("missing.jinja", "cannot read it"), ("empty.jinja", "is empty"),
                          ("broken.jinja", "does not parse")]:
        with pytest.raises(ConfigError, match=re.escape(f"--chat-template {tmp_path / name}") + f".*{message}"):
            read_chat_template(tmp_path / name, tokenizer, cfg, None)


def test_gauges_follow_an_abort_and_the_tier_counters_match_the_engine(ctx):
    """A stream whose consumer leaves after two chunks: the gauges show its batch row and pages while it runs,
    and none once the engine is idle after the abort; the tier's gauges and counters are the engine's own."""
    aborts = sample_value(ctx, "ess_jax_requests_total", outcome="abort") or 0

    async def two_chunks():
        body = parse(CompletionBody, dict(model="m", prompt=list(range(1, 200)), max_tokens=300, stream=True,
                                          ignore_eos=True))
        events = await completions(ctx, body, never_disconnected)
        for _ in range(2):
            await anext(events)
        busy = sample_value(ctx, "ess_jax_requests_running"), sample_value(ctx, "ess_jax_kv_pages_in_use")
        await events.aclose()
        return busy

    running, pages = run(two_chunks())
    assert running == 1 and pages > 0
    deadline = time.monotonic() + DEADLINE
    while sample_value(ctx, "ess_jax_requests_running") or sample_value(ctx, "ess_jax_kv_pages_in_use"):
        assert time.monotonic() < deadline, "the gauges kept the aborted request"
        time.sleep(0.05)
    while sample_value(ctx, "ess_jax_requests_total", outcome="abort") != aborts + 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)
    time.sleep(2 * ctx.loop.ticks.idle_s)  # the engine thread is idle: the engine is safe to read here
    engine, usage, offload = ctx.engine, ctx.engine.usage(), ctx.engine.offload_metrics()
    assert sample_value(ctx, "ess_jax_tier_host_store_bytes_capacity") == engine.cache_bytes()["host_bytes"] > 0
    for name in ("pool_slots_in_use", "pool_slots_total"):
        assert sample_value(ctx, f"ess_jax_tier_{name}") == usage[name]
    assert sample_value(ctx, "ess_jax_kv_pages_total") == usage["pages_total"] > 0
    for layer in offload["per_layer"]:
        assert sample_value(ctx, "ess_jax_tier_lookups_total", layer=str(layer["layer"])) == layer["lookups"] > 0


def test_stop_strings_hold_back_what_could_start_one():
    cut = StopStrings(["ab", "xyz"])
    assert cut.push("12a", False) == ("1", False)  # "2a" could start "xyz" / "ab"
    assert cut.push("b3", False) == ("2", True)
    loose = StopStrings(["zz"])
    assert [loose.push(d, f) for d, f in [("abc", False), ("z", False), ("q", False), ("", True)]] == \
        [("ab", False), ("c", False), ("z", False), ("q", False)]
    assert StopStrings([]).push("all of it", False) == ("all of it", False)
    across = StopStrings(["stop"])
    assert [across.push(d, False) for d in ["go st", "o", "p now"]] == [("go", False), (" ", False), ("", True)]


def test_echo_with_logprobs_leads_with_the_prompts_tokens(ctx):
    """``echo`` + ``logprobs`` (as OpenAI's legacy API and vLLM): the prompt's tokens, then the generated ones,
    the first prompt token ``null``, the others the full forward's log-softmax; ``text_offset`` counts the
    tokens' texts; streamed, the first chunk carries the prompt's rows; ``max_tokens`` 0 scores and generates
    nothing; vLLM's ``prompt_logprobs`` has each token, its rank and the top N by id."""
    tokenizer, ids = ctx.tokenizer, np.random.default_rng(7).integers(0, 300, 40).tolist()
    logits = ctx.engine.model.logits([ids])[0].astype(np.float64)
    full = logits - logits.max(-1, keepdims=True)
    full -= np.log(np.exp(full).sum(-1, keepdims=True))
    fields = dict(prompt=ids, echo=True, logprobs=2, max_tokens=2, temperature=0, ignore_eos=True)
    [choice] = reply(ctx, completions, **fields)["choices"]
    block = choice["logprobs"]
    assert block["tokens"][:40] == [tokenizer.token_text(t) for t in ids] and len(block["tokens"]) == 42
    assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
    np.testing.assert_allclose(block["token_logprobs"][1:40], full[np.arange(39), ids[1:]], atol=1e-4)
    assert {len(top) for top in block["top_logprobs"][1:]} <= {1, 2}  # keyed by text: tokens of one text collide
    np.testing.assert_allclose([max(top.values()) for top in block["top_logprobs"][1:40]], full[:39].max(-1),
                               atol=1e-4)
    assert block["text_offset"] == list(np.cumsum([0] + [len(t) for t in block["tokens"][:-1]]))
    assert choice["text"].startswith(tokenizer.decode(ids)) and "prompt_logprobs" not in choice

    chunks = [e for e in streamed(ctx, completions, **fields) if e != "[DONE]"]
    merged = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), []) for k in block}
    assert merged == block and "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]

    [only] = reply(ctx, completions, **dict(fields, max_tokens=0, prompt_logprobs=1))["choices"]
    assert only["text"] == tokenizer.decode(ids) and only["finish_reason"] == "length"
    assert only["logprobs"] == {k: v[:40] for k, v in block.items()}
    vllm = only["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == 40
    for t, row in enumerate(vllm[1:], start=1):
        assert str(ids[t]) in row and len(row) in (1, 2)
        better = full[t - 1] - full[t - 1, ids[t]]
        assert (better > 1e-4).sum() + 1 <= row[str(ids[t])]["rank"] <= (better > -1e-4).sum() + 1
        assert any(v["rank"] == 1 for v in row.values())
    assert ctx.loop.waiting == 0 and not ctx.engine.has_unfinished()

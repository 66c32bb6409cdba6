"""The online engine: requests added while it runs (also from another thread), aborted mid-flight,
streamed as text deltas; chunked prefill interleaved with decode."""

import collections
import dataclasses
import functools
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src import dispatch
from tokenizers import decoders, models, pre_tokenizers, trainers

import ess_jax
from ess_jax.engine import Engine, RequestSpec
from ess_jax.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer
from helpers import ONLINE, ONLINE_LONGEST, ONLINE_NEW

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = {"v32": FIXTURES / "hf-v32-a", "v4": FIXTURES / "hf-v4-a"}  # index_topk 16 / 8, vocab 320
LONGEST, NEW = ONLINE_LONGEST, ONLINE_NEW  # prompt tokens, most new tokens per request
# without the prefix cache: the arrivals' timing and the idle usage are the point here (tests/test_prefix_cache.py
# serves with it; the warm-up test below too)
MODES = {mode: dataclasses.replace(config, prefix_cache=False) for mode, config in ONLINE.items()}
BASE = MODES["resident"]
COMBOS = [(f, m) for f in FAMILIES for m in MODES]
MAX_STEPS = 2000  # every loop below is bounded


@functools.cache
def model(family: str):
    return ess_jax.load_model(FAMILIES[family])


@functools.cache
def engine(family: str, mode: str, role: str) -> Engine:
    """One engine per (family, mode, role), reused across examples (idle between them): ``alone`` serves
    one request at a time, ``mixed`` the arrivals under test."""
    return Engine(model(family), MODES[mode])


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, length).tolist()


@functools.cache
def alone(family: str, mode: str, length: int, seed: int, new: int) -> tuple[int, ...]:
    """The tokens of one request served alone in its batch."""
    ref = engine(family, mode, "alone")
    ref.add_request(RequestSpec(prompt(length, seed), new))
    return tuple(ref.run()[0].output_ids)


def drive(eng: Engine, arrivals: dict[int, list], on_step=None) -> tuple[dict, dict]:
    """Step ``eng`` until idle, adding ``arrivals[step]`` (lists of add_request args) before each step.
    Returns tokens and finish reasons by request id; ``on_step(step, ids)`` runs before each step."""
    ids, tokens, reasons = {}, collections.defaultdict(list), {}
    for step in range(MAX_STEPS):
        for key, args in arrivals.get(step, []):
            ids[key] = eng.add_request(RequestSpec(*args))
        if on_step is not None:
            on_step(step, ids)
        if step > max(arrivals, default=0) and not eng.has_unfinished():
            break
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in reasons, "a request finished twice"
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError(f"not idle after {MAX_STEPS} steps")
    return {k: tokens[i] for k, i in ids.items()}, {k: reasons.get(i) for k, i in ids.items()}


def idle_usage(eng: Engine) -> dict:
    offloaded = ({"pool_slots_in_use": 0, "host_pages_in_use": 0, "host_bytes_in_use": 0} if eng.config.offload == "ess"
                 else {})
    shards = [dict(s, pages_in_use=0, rows_in_use=0) for s in eng.usage()["per_shard"]]
    return dict(eng.usage(), pages_in_use=0, rows_in_use=0, requests_waiting=0, per_shard=shards, **offloaded)


REQUEST = st.tuples(st.integers(0, 8), st.integers(1, LONGEST), st.integers(1, NEW))  # arrival step, length, new


@pytest.mark.parametrize("family,mode", COMBOS)
@settings(max_examples=2, deadline=None, derandomize=True)
@given(requests=st.lists(REQUEST, min_size=2, max_size=3))
def test_requests_arriving_mid_run_get_their_alone_tokens(family, mode, requests):
    """Requests added at arbitrary steps of a running batch (two rows, so some wait for a row and
    some join while others decode or prefill) each get exactly the tokens they get alone."""
    eng = engine(family, mode, "mixed")
    arrivals = collections.defaultdict(list)
    for key, (step, length, new) in enumerate(requests):
        arrivals[step].append((key, (prompt(length, key), new)))
    got, reasons = drive(eng, arrivals)
    for key, (_, length, new) in enumerate(requests):
        assert tuple(got[key]) == alone(family, mode, length, key, new), f"request {key} ({length} tokens)"
        assert reasons[key] == ("length" if len(got[key]) == new else "stop")
    assert eng.usage() == idle_usage(eng)


@pytest.mark.parametrize("family,mode", [("v32", "resident"), ("v32", "ess"), ("v4", "ess")])
@settings(max_examples=2, deadline=None, derandomize=True)
@given(abort_step=st.integers(0, 12), victim=st.sampled_from(["a", "b", "c"]))
def test_abort_frees_everything_at_once_and_disturbs_nobody(family, mode, abort_step, victim):
    """a and b run, c (a long prompt) waits for a row; one of them is aborted at a random step (waiting,
    mid-prefill or decoding). Its pages, row and pool slots are free when ``abort`` returns, its output
    is a prefix of its alone tokens ending with reason "abort", the request admitted into its row and
    every other request get their alone tokens, and the engine ends as idle as it began."""
    eng = engine(family, mode, "mixed")
    specs = {"a": (90, 11, NEW), "b": (30, 12, NEW), "c": (300, 13, 4), "d": (50, 14, 5)}
    arrivals = {0: [(k, (prompt(n, s), new)) for k, (n, s, new) in specs.items() if k != "d"]}
    before, seen = eng.usage(), {}

    def on_step(step, ids):
        if step != abort_step:
            return
        held = eng.usage()
        eng.abort(ids[victim])
        after = eng.usage()
        seen["rows_freed"] = held["rows_in_use"] - after["rows_in_use"]
        assert after["pages_in_use"] <= held["pages_in_use"]
        if seen["rows_freed"]:  # it was admitted: all its pages and pool slots went with its row
            assert held["pages_in_use"] - after["pages_in_use"] == -(-(specs[victim][0] + specs[victim][2]) // 16)
            if "pool_slots_in_use" in after:
                assert after["pool_slots_in_use"] < held["pool_slots_in_use"] or held["pool_slots_in_use"] == 0
                host = -(-(specs[victim][0] + specs[victim][2]) // 16)  # the host store has the cache's pages
                assert held["host_pages_in_use"] - after["host_pages_in_use"] == host
        ids["d"] = eng.add_request(RequestSpec(prompt(*specs["d"][:2]), specs["d"][2]))  # takes the freed row if one is

    got, reasons = drive(eng, arrivals, on_step)
    assert "rows_freed" in seen
    assert reasons[victim] in ("abort", "length")  # it may have finished before the abort
    expected = alone(family, mode, *specs[victim])
    assert tuple(got[victim]) == expected[: len(got[victim])]
    if reasons[victim] == "abort":
        assert len(got[victim]) < len(expected)
    for key in set(specs) - {victim}:
        assert tuple(got[key]) == alone(family, mode, *specs[key]), key
    assert eng.usage() == before == idle_usage(eng)


def test_abort_of_unknown_or_finished_requests():
    eng = engine("v32", "resident", "mixed")
    with pytest.raises(KeyError, match="never added"):
        eng.abort(10**6)
    rid = eng.add_request(RequestSpec(prompt(5, 0), 2))
    eng.run()
    eng.abort(rid)  # finished: nothing to do
    assert not eng.has_unfinished() and eng.step() == []


def test_add_request_from_another_thread_while_stepping():
    """A client thread adds requests while the engine thread steps; each gets its alone tokens."""
    eng = engine("v32", "ess", "mixed")
    lengths = [33, 7, 120]
    ids: dict[int, int] = {}

    def client():
        for i, n in enumerate(lengths):
            ids[i] = eng.add_request(RequestSpec(prompt(n, 20 + i), NEW))
            time.sleep(0.05)

    thread = threading.Thread(target=client)
    thread.start()
    tokens = collections.defaultdict(list)
    deadline = time.monotonic() + 120
    while thread.is_alive() or eng.has_unfinished():
        assert time.monotonic() < deadline
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        time.sleep(0.001)
    thread.join()
    for i, n in enumerate(lengths):
        assert tuple(tokens[ids[i]]) == alone("v32", "ess", n, 20 + i, NEW)


def test_long_prompt_stalls_running_requests_by_at_most_one_chunk():
    """While a long prompt prefills, every step still decodes the running request and prefills at most
    ``prefill_chunk`` tokens."""
    eng = engine("v32", "resident", "mixed")
    running = eng.add_request(RequestSpec(prompt(10, 30), 40))
    eng.step()  # its prefill
    long = eng.add_request(RequestSpec(prompt(LONGEST - 40, 31), 1))
    prefilled, steps = eng.stats.prefill_tokens, 0
    while long in eng.requests and eng.requests[long].prefilled < LONGEST - 40:
        outs = {o.request_id: o for o in eng.step()}
        steps += 1
        assert len(outs[running].new_token_ids) == 1
        assert eng.stats.prefill_tokens - prefilled <= BASE.prefill_chunk
        prefilled = eng.stats.prefill_tokens
    assert steps >= (LONGEST - 40) // BASE.prefill_chunk
    eng.run()


# ---- streamed text -----------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\ufffd<｜"), max_size=30)


@functools.cache
def bpe_dir(tmp: Path) -> Path:
    """The V3.2 fixture with a byte-level BPE tokenizer.json (300 ids, within its vocab of 320)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["héllo wörld ünïcödé", "你好，世界，你好", "naïve café — ∑ 🙂🙂"] * 5, trainer)
    for f in FAMILIES["v32"].iterdir():
        (tmp / f.name).symlink_to(f)
    tok.save(str(tmp / "tokenizer.json"))
    return tmp


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer(bpe_dir(tmp_path_factory.mktemp("bpe")) / "tokenizer.json", vocab_size=320)


def _stream(tokenizer, ids, cuts) -> list[str]:
    detok, deltas, start = IncrementalDetokenizer(tokenizer), [], 0
    for cut in sorted(set(cuts)) + [len(ids)]:
        deltas.append(detok.push(ids[start:cut], final=cut == len(ids)))
        start = cut
    return deltas


@settings(max_examples=60, deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 200)))
def test_byte_deltas_never_split_a_character(text, cuts):
    ids = list(text.encode("utf-8"))
    deltas = _stream(ByteTokenizer(model("v32").cfg), ids, [c for c in cuts if c < len(ids)])
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 60)))
def test_bpe_deltas_never_split_a_character(bpe, text, cuts):
    ids = bpe.encode(text)
    deltas = _stream(bpe, ids, [c for c in cuts if c < len(ids)])
    assert "".join(deltas) == bpe.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_engine_streams_deltas_that_concatenate_to_the_decode(tmp_path):
    """Random-weight outputs (arbitrary bytes, broken UTF-8 included) with the byte-level tokenizer and
    a BPE tokenizer.json: per request the streamed deltas concatenate to decode(all output ids)."""
    for m in (model("v32"), ess_jax.load_model(bpe_dir(tmp_path))):
        eng = Engine(m, BASE)
        ids = [eng.add_request(RequestSpec(prompt(n, 40 + n), 24)) for n in (5, 17, 64)]
        text, tokens = collections.defaultdict(str), collections.defaultdict(list)
        for _ in range(MAX_STEPS):
            if not eng.has_unfinished():
                break
            for out in eng.step():
                text[out.request_id] += out.text_delta
                tokens[out.request_id] += out.new_token_ids
        for i in ids:
            assert text[i] == m.tokenizer.decode(tokens[i]) and len(tokens[i]) > 0


def test_logprobs_follow_the_logits():
    """logprobs=N: the chosen token's log-softmax value and the N most likely tokens, the greedy token first."""
    m = model("v32")
    eng = engine("v32", "resident", "mixed")
    rid = eng.add_request(RequestSpec(prompt(12, 50), 4, logprobs=3))
    outs = [o for _ in range(20) for o in eng.step() if o.request_id == rid]
    lps = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in lps] == [t for o in outs for t in o.new_token_ids]
    full = m.logits([prompt(12, 50) + [lp.token_id for lp in lps][:-1]])[0, 11:]
    for lp, logits in zip(lps, full):
        ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64) - logits.max()).sum()) - logits.max()
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id == int(np.argmax(logits))
        np.testing.assert_allclose(lp.logprob, ref[lp.token_id], atol=1e-4)
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref)[::-1][:3], atol=1e-4)


@pytest.mark.parametrize("family,mode", COMBOS)
def test_nothing_compiles_after_warm_up(family, mode):
    """After ``warm_up`` a mixed workload lowers no program: prompts of several lengths (every piece size),
    one scoring its prompt and ending after its prefill, two finishing their prefill in one step, two waiting for a
    row, an abort mid-decode, requests leaving
    while others decode. Every compiled program is dropped first (``jax.clear_caches``), so the warm-up
    alone must have made what the workload runs (the earlier tests' compiles come back from the persistent
    cache, so it stays cheap)."""
    jax.clear_caches()
    eng = Engine(model(family), ONLINE[mode])  # with the prefix cache (V3.2): its steps are warmed up too
    eng.warm_up()
    lowered = []

    def listen(event: str, seconds: float, **_):
        if event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
            lowered.append(event)

    def on_step(step, ids):
        if step == 1:  # prompt log-probabilities over several pieces, no new tokens: the scored prefill steps
            ids["e"] = eng.add_request(RequestSpec(prompt(70, 5), 0, prompt_logprobs=2))
        if step == 3:
            eng.abort(ids["b"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        arrivals = {0: [("a", (prompt(10, 1), 6)), ("b", (prompt(20, 2), 8))],  # both prefilled in step 0
                    1: [("c", (prompt(150, 3), 4)), ("d", (prompt(37, 4), 3))]}  # waiting for rows
        got, reasons = drive(eng, arrivals, on_step)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert reasons == {"a": "length", "b": "abort", "c": "length", "d": "length", "e": "length"}
    assert lowered == []

"""The prefix cache (ess_jax.allocator): page keys, shared reference-counted pages, least-recently-used eviction,
routing to the data shard holding a prompt's longest cached prefix; and on the engine, every output with prefix
hits equal to the output without the prefix cache, token for token, with requests joining, finishing and
aborting while they share pages."""

import collections
import dataclasses
import hashlib
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ess_jax
from ess_jax.allocator import NULL_PAGE, Admission, PageAllocator, page_keys
from ess_jax.engine import Engine, RequestSpec
from helpers import ENGINE, MTP_ENGINE, mtp_v32

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v32-a"
SALT = b"test"

# ---- keys, sharing and eviction, host only ---------------------------------------------------------------


def test_page_keys_chain_every_earlier_token_and_the_salt():
    tokens = list(range(20))
    keys = page_keys(tokens, 4, SALT)
    assert len(keys) == 5 and len(set(keys)) == 5
    # an independent chain: blake2b over the parent key and the page's int64 token bytes
    parent = hashlib.blake2b(SALT, digest_size=16).digest()
    for i, key in enumerate(keys):
        parent = hashlib.blake2b(parent + np.asarray(tokens[4 * i:4 * i + 4], np.int64).tobytes(),
                                 digest_size=16).digest()
        assert key == parent
    assert page_keys(tokens[:11], 4, SALT) == keys[:2]  # a partial page has no key
    changed = page_keys([99] + tokens[1:], 4, SALT)
    assert not set(changed) & set(keys)  # a change in the first page changes every later key
    assert not set(page_keys(tokens, 4, b"other")) & set(keys)  # so does the salt
    # with a lookahead a page's key names the token after it too: only pages some token follows have one
    ahead = page_keys(tokens, 4, SALT, lookahead=1)
    assert len(ahead) == 4 and not set(ahead) & set(keys)
    moved = page_keys(tokens[:8] + [99] + tokens[9:], 4, SALT, lookahead=1)
    assert moved[0] == ahead[0] and moved[1] != ahead[1]


def test_shared_pages_are_counted_once_and_stay_cached_until_evicted_lru():
    pool = PageAllocator(num_pages=7, page_size=2)  # 6 pages
    a = pool.allocate(3)
    keys = [b"k0", b"k1", b"k2"]
    for page, key in zip(a, keys):
        pool.cache(int(page), key)
    assert pool.match(keys + [b"k3"]).tolist() == a.tolist()
    assert pool.cost(pool.match(keys[:2]), 4) == 2  # held pages cost nothing more: 2 own pages
    pool.share(a[:2])
    assert pool.num_free == 3
    pool.free(a)  # the first request ends: pages 1, 2 still shared, page 3 evictable
    assert pool.num_free == 4 and pool.num_cached == 1
    assert pool.cost(pool.match(keys), 4) == 1 + 1  # one own page, and page 3 leaves the evictable ones
    pool.free(a[:2])  # the second ends: all three cached, released in the order a[2], a[0], a[1]
    assert pool.num_cached == 3 and pool.num_free == 6 and pool.num_held == 0
    taken = pool.allocate(4)  # 3 free pages first, then the least recently released cached page
    assert int(a[2]) in taken.tolist() and pool.match(keys).tolist() == a[:2].tolist()
    assert pool.match(keys[2:]).size == 0
    pool.free(taken)
    with pytest.raises(ValueError, match="double free"):
        pool.free(taken[:1])
    with pytest.raises(ValueError, match="not cached"):
        pool.share(taken[:1])


def test_eviction_takes_a_prefix_from_its_tail():
    """Evicting 2 pages of a cached 16-page prefix leaves its first 14 usable (pages are released in reverse token
    order, so its last pages are the least recently released)."""
    pool = PageAllocator(num_pages=17, page_size=2)
    keys = page_keys(list(range(32)), 2, SALT)
    pages = pool.allocate(16)
    for page, key in zip(pages.tolist(), keys):
        pool.cache(page, key)
    pool.free(pages)
    taken = pool.allocate(2)
    assert sorted(taken.tolist()) == sorted(pages[14:].tolist())
    assert pool.match(keys).tolist() == pages[:14].tolist()


def test_eviction_never_takes_a_page_a_running_request_reads():
    """Requests whose prompts share prefixes, on a pool filled past its size many times over: every page a
    running request holds is its own or a cached page of its own prompt, and no page is in two requests
    unless both share it under one key; after all finish, no page is held."""
    rng = np.random.default_rng(0)
    size = 4
    admission = Admission([PageAllocator(13, size)], max_batch=3, max_position_embeddings=48)
    pool = admission.allocators[0]
    stems = [rng.integers(0, 4, 40).tolist() for _ in range(3)]
    keys, prompts, evictions = {}, {}, 0
    for i in range(150):
        prompt = stems[rng.integers(3)][:rng.integers(1, 40)]
        prompts[i], keys[i] = prompt, page_keys(prompt, size, SALT)
        admission.submit(i, len(prompt), int(rng.integers(1, 8)), keys[i][:(len(prompt) - 1) // size])
        keys_before = len(pool._page_of)
        admitted = admission.admit(2)
        evictions += keys_before - len(pool._page_of)  # keys forgotten: their pages taken by allocate
        for entry in admitted:
            admission.cache_pages(entry.request_id, keys[entry.request_id])  # as if prefilled at once
        running = admission.running
        owner = collections.defaultdict(set)
        for rid, entry in running.items():
            assert (pool._refs[entry.pages] > 0).all()
            assert entry.shared <= len(keys[rid])
            for j, page in enumerate(entry.pages.tolist()):
                owner[page].add((rid, j))
        for page, holders in owner.items():
            assert page != NULL_PAGE
            if len(holders) > 1:  # a shared page: the same cached prompt page of each holder
                assert len({keys[rid][j] for rid, j in holders}) == 1
                assert pool._refs[page] == len(holders)
        for rid in list(running)[: int(rng.integers(0, len(running) + 1))]:
            admission.finish(rid)
    for rid in list(admission.running):
        admission.finish(rid)
    while admission.waiting:
        for entry in admission.admit(3):
            admission.cache_pages(entry.request_id, keys[entry.request_id])
            admission.finish(entry.request_id)
    assert pool.num_held == 0 and pool.num_free == pool.capacity and pool.num_cached > 0
    assert evictions > 0  # the workload did evict


def test_admission_routes_to_the_shard_with_the_longest_cached_prefix():
    admission = Admission([PageAllocator(9, 4), PageAllocator(9, 4)], max_batch=4, max_position_embeddings=32)
    prompt = list(range(12))
    keys = page_keys(prompt, 4, SALT)
    admission.submit("first", 12, 4, keys[:2])
    (first,) = admission.admit(1)
    assert admission.shard_of(first.row) == 0 and first.shared == 0
    admission.cache_pages("first", keys)
    admission.submit("other", 8, 4)  # no prefix: to the least loaded shard
    admission.submit("again", 12, 4, keys[:2])  # shard 0 is more loaded but holds its prefix
    other, again = admission.admit(2)
    assert admission.shard_of(other.row) == 1
    assert admission.shard_of(again.row) == 0 and again.shared == 2
    assert again.pages[:2].tolist() == first.pages[:2].tolist()
    assert admission.allocators[0].num_free == 8 - 4 - 2  # the shared pages counted once


def test_a_request_must_leave_its_last_prompt_token_to_compute():
    admission = Admission([PageAllocator(9, 4)], max_batch=1, max_position_embeddings=32)
    with pytest.raises(ValueError, match="no prompt token to compute"):
        admission.submit(0, 8, 1, page_keys(list(range(8)), 4, SALT))


# ---- the engine: outputs with and without the prefix cache ---------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model(FIXTURE)


MODES = {"resident": {}, "ess inline": dict(offload="ess", fetch="inline", pool_size=20),
         "ess split": dict(offload="ess", fetch="split", pool_size=20)}  # ESS pools smaller than a request


@pytest.fixture(scope="module")
def engines(model):
    """One engine per mode with the prefix cache (built when first asked for), and the resident engine without it
    (``False``): the reference (ESS gives the resident tokens)."""
    built = {False: Engine(model, dataclasses.replace(ENGINE, prefix_cache=False))}

    class Engines(dict):
        def __missing__(self, mode):
            mode = "resident" if mode is True else mode
            if mode not in built:
                built[mode] = Engine(model, dataclasses.replace(ENGINE, **MODES[mode]))
            return built[mode]
    return Engines()


_REFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {(prompt, new): tokens}


def reference(engines, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each request's greedy tokens without the prefix cache, from ``engines[False]`` (requests are batch-invariant:
    run together)."""
    off = engines[False]
    known = _REFERENCE.setdefault(off, {})
    missing = [(p, n) for p, n in requests if (tuple(p), n) not in known]
    ids = [off.add_request(RequestSpec(p, n)) for p, n in missing]
    done = {r_id: r.output_ids for r_id, r in zip(sorted(ids), off.run())}
    for (p, n), r_id in zip(missing, ids):
        known[tuple(p), n] = done[r_id]
    assert off.scheduler.allocators[0].num_cached == 0 and off.usage()["pages_in_use"] == 0
    return [known[tuple(p), n] for p, n in requests]


def drive(engine, arrivals: dict[int, list], aborts: dict[int, list]) -> dict:
    """Add ``arrivals[step]`` (key, prompt, new) and abort ``aborts[step]`` (keys) before each step until idle;
    each key's tokens."""
    ids, tokens = {}, collections.defaultdict(list)
    for step in range(200):
        for key, prompt, new in arrivals.get(step, []):
            ids[key] = engine.add_request(RequestSpec(prompt, new))
        for key in aborts.get(step, []):
            engine.abort(ids[key])
        if step > max(arrivals) and not engine.has_unfinished():
            return {k: tokens[i] for k, i in ids.items()}
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    raise AssertionError("not idle after 200 steps")


def assert_idle_holds_only_cached_pages(engine) -> None:
    for pool in engine.scheduler.allocators:
        assert pool.num_held == 0 and pool.num_free == pool.capacity
    usage = engine.usage()
    assert usage["pages_in_use"] == 0 and usage["prefix_cache_pages"] == engine.scheduler.allocators[0].num_cached
    assert usage.get("pool_slots_in_use", 0) == 0


def serve_workload(engines, on, prefix: int, seed: int, requests: list[tuple]) -> None:
    """Serve on ``on`` requests of a random ``prefix``-token stem and their ``REQUEST`` suffixes, arrivals and aborts:
    each finished request's tokens equal its tokens without the prefix cache (``reference``), an aborted one's a
    prefix of them; afterwards only cached pages are held."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(0, 256, prefix).tolist()
    arrivals, aborts, expected = collections.defaultdict(list), collections.defaultdict(list), {}
    for key, (suffix, new, step, abort) in enumerate(requests):
        prompt = stem + rng.integers(0, 256, max(suffix, 1 - prefix)).tolist()
        arrivals[step].append((key, prompt, new))
        if abort is not None:
            aborts[step + abort].append(key)
        expected[key] = (prompt, new)
    got = drive(on, arrivals, aborts)
    want = dict(zip(expected, reference(engines, list(expected.values()))))
    for key, tokens in got.items():
        if any(key in keys for keys in aborts.values()):
            assert tokens == want[key][:len(tokens)]
        else:
            assert tokens == want[key]
    assert_idle_holds_only_cached_pages(on)


REQUEST = st.tuples(st.integers(0, 16), st.integers(1, 8), st.integers(0, 5), st.sampled_from([None, 0, 1, 3]))
# (suffix length, new tokens, arrival step, abort this many steps after arriving or None)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=2, deadline=None, derandomize=True)
@given(prefix=st.integers(0, 40), seed=st.integers(0, 3), requests=st.lists(REQUEST, min_size=2, max_size=5))
def test_shared_prefix_workloads_give_the_tokens_of_no_prefix_cache(engines, mode, prefix, seed, requests):
    """Requests sharing a prefix (one of a few, so examples share cached pages too) with distinct suffixes, joining
    at arbitrary steps of three batch rows (some wait, some join while others prefill or decode), some aborted:
    each finished request's tokens equal its tokens without the prefix cache, an aborted one's a prefix of them.
    Resident, and ESS with either fetch backend (its hits read the host store; the last 32 prompt tokens are
    always prefilled, so the pool warms as without the cache)."""
    on = engines[mode]
    hits_before = on.prefix_cache_metrics()["hit_tokens"]
    serve_workload(engines, on, prefix, seed, requests)
    metrics = on.prefix_cache_metrics()
    tier = "device" if mode == "resident" else "host"
    assert metrics["per_tier"][tier] == metrics["hit_tokens"] >= hits_before


@pytest.mark.parametrize("mode, tail", [("resident", 1), ("ess inline", 32)])
def test_prompts_submitted_together_share_their_prefix(engines, mode, tail):
    """Four prompts of one 48-token stem and 8 tokens of their own, submitted at once to three batch rows: the first
    prefills the stem, the others wait for its pages instead of computing them too (in-batch prefix sharing), each
    then reading the stem's pages before its boundary; identical prompts likewise. Tokens as without the cache."""
    on = engines[mode]
    rng = np.random.default_rng(17)
    stem = rng.integers(0, 256, 48).tolist()
    prompts = [stem + rng.integers(0, 256, 8).tolist() for _ in range(3)]
    prompts.append(prompts[0])
    want = reference(engines, [(p, 4) for p in prompts])
    before, prefilled = on.prefix_cache_metrics()["hit_tokens"], on.stats.prefill_tokens
    ids = [on.add_request(RequestSpec(p, 4)) for p in prompts]
    assert [r.output_ids for r in on.run()] == want and ids == sorted(ids)
    shared = (56 - tail) // 8 * 8
    assert on.prefix_cache_metrics()["hit_tokens"] - before == 3 * shared
    assert on.stats.prefill_tokens - prefilled == 4 * 56 - 3 * shared
    assert_idle_holds_only_cached_pages(on)


@pytest.mark.parametrize("mode, tail", [("resident", 1), ("ess inline", 32)])
def test_identical_resent_request_hits_all_but_its_last_tokens(engines, mode, tail):
    """Re-sent, a prompt reads its whole pages from the cache but those holding its last ``tail`` tokens (the last
    one's logits give the first token; ESS: the last 32 queries' top-k warm the pool)."""
    on = engines[mode]
    for length in (40, 37):  # a prompt of whole pages (page size 8) and one with a partial page
        prompt = np.random.default_rng(length).integers(0, 256, length).tolist()
        (want,) = reference(engines, [(prompt, 6)])
        counts, prefilled = on.prefix_cache_metrics(), on.stats.prefill_tokens
        outputs = []
        for _ in range(2):
            on.add_request(RequestSpec(prompt, 6))
            outputs.append(on.run()[0].output_ids)
        assert outputs == [want, want]
        hit = (length - tail) // 8 * 8
        assert on.prefix_cache_metrics()["query_tokens"] - counts["query_tokens"] == 2 * length
        assert on.prefix_cache_metrics()["hit_tokens"] - counts["hit_tokens"] == hit
        assert on.stats.prefill_tokens - prefilled == length + (length - hit)
    assert_idle_holds_only_cached_pages(on)


@pytest.mark.parametrize("mode", ["resident", "ess inline"])
def test_a_prompt_aborted_mid_prefill_leaves_nothing_cached(engines, mode):
    """Pages are cached when their prompt is all prefilled (with ESS: handed off to the host store): a prompt
    aborted after its first piece leaves none, and the same prompt sent again prefills whole and is exact."""
    on = engines[mode]
    # pieces 32 | 16 + 8 + 4: two steps; a seed no other test here uses, so nothing of it is cached
    prompt = np.random.default_rng(31).integers(0, 256, 60).tolist()
    victim = on.add_request(RequestSpec(prompt, 4))
    on.step()
    assert on.requests[victim].prefilled == 32
    on.abort(victim)
    on.step()
    hits = on.prefix_cache_metrics()["hit_tokens"]
    on.add_request(RequestSpec(prompt, 4))
    assert on.run()[0].output_ids == reference(engines, [(prompt, 4)])[0]
    assert on.prefix_cache_metrics()["hit_tokens"] == hits
    assert_idle_holds_only_cached_pages(on)


def test_prompt_logprobs_requests_read_no_cached_pages(engines):
    """A request scoring its prompt computes every position (no hit counted) and scores it as without the cache;
    the pages it writes are cached for others."""
    prompt = np.random.default_rng(7).integers(0, 256, 16).tolist()  # one piece
    scores = {}
    for on in (True, False):
        engine = engines[on]
        engine.add_request(RequestSpec(prompt, 2))
        engine.run()
        before = engine.prefix_cache_metrics()
        engine.add_request(RequestSpec(prompt, 2, prompt_logprobs=2))
        (request,) = engine.run()
        scores[on] = (request.output_ids, request.prompt_scores)
        if on:
            assert engine.prefix_cache_metrics() == before
        else:
            assert before is None
    assert scores[True] == scores[False]


def test_pool_filled_past_its_size_evicts_only_pages_no_running_request_reads(engines):
    """A long request shares a cached prefix while distinct prompts fill the 24-page pool several times over:
    cached pages are evicted for them, never the ones the long request reads, and every output is exact."""
    on = engines[True]
    rng = np.random.default_rng(11)
    stem = rng.integers(0, 256, 32).tolist()
    on.add_request(RequestSpec(stem + [1], 2))
    on.run()
    pool = on.scheduler.allocators[0]
    keys = page_keys(stem, 8, on.scheduler.prefix.salt)
    shared = pool.match(keys)
    assert shared.size == 4
    requests = [(stem + rng.integers(0, 256, 4).tolist(), 24)]  # 4 shared pages, 3 own
    requests += [(rng.integers(0, 256, 40).tolist(), 1) for _ in range(16)]  # 6 pages each, 96 in all
    every = [key for prompt, _ in requests for key in page_keys(prompt, 8, on.scheduler.prefix.salt)]
    ids = [on.add_request(RequestSpec(prompt, new)) for prompt, new in requests]
    tokens, seen, evicted = collections.defaultdict(list), set(), set()
    while on.has_unfinished():
        for out in on.step():
            tokens[out.request_id] += out.new_token_ids
        cached = {key for key in every if pool.has(key)}
        if ids[0] in on.requests:  # while the long request runs: its shared pages stay, others go
            assert pool.match(keys).tolist() == shared.tolist()
            evicted |= seen - cached
        seen |= cached
    assert evicted
    assert [tokens[i] for i in ids] == reference(engines, requests)
    assert_idle_holds_only_cached_pages(on)


# Runs with 2 simulated CPU devices: argv = checkpoint, then the prompts as JSON. With ESS, a data=2 mesh of one
# batch row per shard: the first two prompts together (one on each shard), then the other two together; prints
# every request's tokens and shard, and the prefix cache's counters per shard.
MESH_SCRIPT = r"""
import dataclasses, json, sys
import ess_jax
from ess_jax.engine import Engine, EngineConfig, RequestSpec

model = ess_jax.load_model(sys.argv[1])
prompts = json.loads(sys.argv[2])
base = EngineConfig(max_batch=2, page_size=8, num_pages=17, prefill_chunk=32, prefill_piece_ratio=32, max_seq_len=64,
                    mesh="data=2")
out = {}
for mode, extra in (("ess", dict(offload="ess", pool_size=20)),):  # (admission is the resident path's too)
    engine = Engine(model, dataclasses.replace(base, **extra))
    tokens, shards = [], []
    for pair in (prompts[:2], prompts[2:]):
        ids = [engine.add_request(RequestSpec(p, 6)) for p in pair]
        engine.step()  # admits both
        running = engine.scheduler.admission.running
        shards += [engine.scheduler.admission.shard_of(running[i].row) for i in ids]
        tokens += [r.output_ids for r in engine.run()]
    out[mode] = {"tokens": tokens, "shards": shards, "prefix": engine.prefix_cache_metrics()}
print(json.dumps(out))
"""


def test_data_shards_route_to_the_shard_holding_the_prefix_and_give_the_same_tokens(engines):
    """Two prompts served on a data=2 mesh, one per shard; then a prompt sharing the second's prefix and one sharing
    the first's, sent in that order: each goes to the shard holding its prefix (not the lowest idle one), reads it
    from there, and every output equals the single-device output without the prefix cache."""
    import json
    import sys

    from helpers import outputs, spawn

    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 256, 48).tolist(), rng.integers(0, 256, 48).tolist()
    prompts = [a + [1, 2], b + [3], b + [4, 5, 6], a + [7]]
    (out,) = outputs(spawn([[sys.executable, "-c", MESH_SCRIPT, str(FIXTURE), json.dumps(prompts)]], devices=2),
                     timeout=900)
    want = reference(engines, [(p, 6) for p in prompts])
    for mode, tail in (("ess", 32),):
        got = json.loads(out.splitlines()[-1])[mode]
        assert got["tokens"] == want
        assert got["shards"] == [0, 1, 1, 0]
        per_shard = {s["shard"]: s for s in got["prefix"]["per_shard"]}
        for shard, (first, again) in ((0, (prompts[0], prompts[3])), (1, (prompts[1], prompts[2]))):
            assert per_shard[shard]["query_tokens"] == len(first) + len(again)
            assert per_shard[shard]["hit_tokens"] == (len(again) - tail) // 8 * 8 > 0


# Runs with 2 simulated CPU devices: argv = checkpoint, then the prompts as JSON. On a data=2 mesh of two batch rows
# per shard, resident and ESS, every prompt submitted at once; prints the tokens and the prefix cache's counters, and
# the reference: the tokens of the same mesh without the prefix cache (the resident mode's compiled steps).
IN_BATCH_SCRIPT = r"""
import dataclasses, json, sys
import ess_jax
from ess_jax.engine import Engine, EngineConfig, RequestSpec

model = ess_jax.load_model(sys.argv[1])
prompts = json.loads(sys.argv[2])
base = EngineConfig(max_batch=4, page_size=8, prefill_chunk=32, prefill_piece_ratio=32, max_seq_len=96, mesh="data=2")
out = {}
for mode, extra in (("resident", {}), ("ess", dict(offload="ess", pool_size=24))):
    engine = Engine(model, dataclasses.replace(base, **extra))
    for p in prompts:
        engine.add_request(RequestSpec(p, 6))
    out[mode] = {"tokens": [r.output_ids for r in engine.run()], "prefix": engine.prefix_cache_metrics()}
alone = Engine(model, dataclasses.replace(base, prefix_cache=False))  # the resident mode's compiled steps
for p in prompts:
    alone.add_request(RequestSpec(p, 6))
reference = [r.output_ids for r in alone.run()]
print(json.dumps({"reference": reference, "modes": out}))
"""


def in_batch_on_a_mesh(fixture: Path) -> dict[str, tuple[int, ...]]:
    """Five prompts of one 50-token system prompt and distinct 30-token messages, submitted at once on a data=2
    mesh (``IN_BATCH_SCRIPT``): the tokens of each mode asserted equal to the same mesh's run without the prefix
    cache (tests/test_mesh.py: a mesh's tokens are one device's); each mode's hit tokens per data shard."""
    import json
    import sys

    from helpers import outputs, spawn

    rng = np.random.default_rng(17)
    stem = rng.integers(0, 256, 50).tolist()
    prompts = [stem + rng.integers(0, 256, 30).tolist() for _ in range(5)]
    (out,) = outputs(spawn([[sys.executable, "-c", IN_BATCH_SCRIPT, str(fixture), json.dumps(prompts)]], devices=2),
                     timeout=900)
    ran = json.loads(out.splitlines()[-1])
    hits = {}
    for mode, got in ran["modes"].items():
        assert got["tokens"] == ran["reference"], mode
        hits[mode] = tuple(s["hit_tokens"] for s in got["prefix"]["per_shard"])
    return hits


def test_prompts_submitted_together_on_a_mesh_share_their_prefix():
    """V3.2 (pages of 8): the prompts wait for the first one's prefill and the next one on its shard shares its six
    pages (resident and ESS alike: 48 tokens before the last 32)."""
    for mode, hits in in_batch_on_a_mesh(FIXTURE).items():
        assert hits[0] >= 2 * 48, mode


def test_metrics_export_the_prefix_cache_counters(engines):
    """The server's /metrics registry fed an engine's ``usage()``: queries and hits per tier, as the engine counts."""
    from prometheus_client import generate_latest

    from ess_jax.server.metrics import Metrics

    on = engines["resident"]
    prompt = np.random.default_rng(3).integers(0, 256, 30).tolist()
    for _ in range(2):
        on.add_request(RequestSpec(prompt, 1))
        on.run()
    metrics = Metrics()
    metrics.usage(on.usage())
    text = generate_latest(metrics.registry).decode()
    counts = on.prefix_cache_metrics()
    assert counts["hit_tokens"] >= 24
    assert f"ess_jax_prefix_cache_queries_total {float(counts['query_tokens'])}" in text
    assert f'ess_jax_prefix_cache_hits_total{{tier="device"}} {float(counts["hit_tokens"])}' in text
    assert 'ess_jax_prefix_cache_hits_total{tier="host"} 0.0' in text
    off = Metrics()
    off.usage(engines[False].usage())
    assert "prefix_cache" not in generate_latest(off.registry).decode()


# ---- with speculative decoding ----------------------------------------------------------------------------------


def serve_alone(engine, prompt: list[int], new: int) -> tuple[list[int], list[list[int]]]:
    """One request served alone to its end: its tokens and the drafts its row holds after each decode step."""
    request_id, tokens, drafts = engine.add_request(RequestSpec(prompt, new)), [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        batch = engine.scheduler.schedule_decode()  # the next step's plan: each row's drafts
        if batch is not None and request_id in batch.request_ids:
            drafts.append(batch.drafts_BK[batch.request_ids.index(request_id)].tolist())
    return tokens, drafts


@pytest.fixture(scope="module")
def mtp_model():
    return mtp_v32()


@pytest.mark.parametrize("offload, k, shared", [("none", 2, (8, 40)), ("ess", 3, (8, 16))])
def test_prefix_hits_decode_with_mtp_speculation_as_without_either(mtp_model, offload, k, shared):
    """The MTP module drafting (test_speculative's engine shapes): its cache is in the request's pages, its row at a
    position made of the token after it, so a page is shared only with the token past it (``page_keys``'
    lookahead). A prompt sharing a cached prefix but not the token after it, then the first prompt sent again:
    the greedy tokens of decoding without speculation or the prefix cache, every step's drafts those of the same
    engine without the prefix cache, and the hits ``shared`` (resident: the pages before the last token; ESS:
    before the last 32)."""
    rng = np.random.default_rng(9)
    stem = rng.integers(0, 256, 16).tolist()
    first, second = (stem + rng.integers(0, 256, 32).tolist() for _ in range(2))
    assert first[16] != second[16]
    prompts = [first, second, first]
    plain = Engine(mtp_model, dataclasses.replace(MTP_ENGINE, prefix_cache=False))
    want = [serve_alone(plain, p, 8)[0] for p in prompts]
    extra = dict(offload="ess", pool_size=9) if offload == "ess" else {}
    spec = dataclasses.replace(MTP_ENGINE, speculative="mtp", num_speculative_tokens=k, **extra)
    runs = {}
    for cached in (False, True):
        engine = Engine(mtp_model, dataclasses.replace(spec, prefix_cache=cached))
        runs[cached] = [serve_alone(engine, p, 8) for p in prompts]
    assert [tokens for tokens, _ in runs[True]] == want
    assert runs[True] == runs[False]
    assert engine.prefix_cache_metrics()["hit_tokens"] == sum(shared)
    assert_idle_holds_only_cached_pages(engine)

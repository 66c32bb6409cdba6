"""The prefix cache on DeepSeek-V4 (hf-v4-a: page size 16, compress rates 4 and 16, a 16-token window): prefixes of
whole compressed windows shared, each prompt's window and compressor rings snapshotted at its cacheable boundary and
a request sharing the pages before it resumed from the snapshot; every output with prefix hits equal to the output
without the prefix cache, token for token, resident and ESS with either fetch backend, with speculative decoding."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ess_jax
from ess_jax import families
from ess_jax.allocator import PageAllocator
from ess_jax.engine import Engine, EngineConfig, RequestSpec
from helpers import ONLINE
from test_prefix_cache import assert_idle_holds_only_cached_pages, reference, serve_alone, serve_workload

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v4-a"
BLOCK = 16  # lcm(page size 16, CSA rate 4, HCA rate 16)
MODES = {"resident": ONLINE["resident"], "ess inline": ONLINE["ess"],
         "ess split": dataclasses.replace(ONLINE["ess"], fetch="split")}
TAIL = {"resident": 1, "ess inline": 32, "ess split": 32}  # prompt tokens always prefilled


def test_a_pool_with_row_states_shares_a_prefix_only_up_to_a_snapshot_and_evicts_them_with_their_pages():
    pool = PageAllocator(6, 4, states=2)
    keys = [bytes([i]) * 16 for i in range(4)]
    pages = pool.allocate(4)
    for page, key in zip(pages.tolist(), keys):
        pool.cache(page, key)
    assert pool.match(keys).size == 0  # pages cached, no snapshot: nothing usable
    pool.keep_state(keys[1], "at 8", 10)
    assert pool.match(keys).tolist() == pages[:2].tolist()
    pool.keep_state(keys[3], "at 16", 20)
    assert pool.match(keys).tolist() == pages.tolist() and pool.state(keys[1]) == "at 8"
    pool.keep_state(keys[2], "at 12", 30)  # a third: the least recently used (keys[3]) goes
    assert (pool.num_states, pool.state_bytes) == (2, 40)
    assert pool.match(keys).tolist() == pages[:3].tolist()
    pool.free(pages)
    pool.allocate(2)  # one free page, then the least recently released cached one (the tail, pages[3]) evicted
    assert pool.match(keys).tolist() == pages[:3].tolist()
    with pytest.raises(ValueError, match="only with its cached page"):
        pool.keep_state(keys[3], "orphan", 1)
    with pytest.raises(ValueError, match="states=0"):
        PageAllocator(6, 4, states=0)


def test_the_prefix_block_is_a_whole_compressed_window_of_every_layer():
    cfg = ess_jax.load_model(FIXTURE).cfg
    family = families.get("deepseek_v4")
    assert [family.prefix_block(cfg, p) for p in (4, 8, 16, 32)] == [16, 16, 16, 32]
    assert families.get("deepseek_v32").prefix_block(cfg, 8) == 8


@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model(FIXTURE)


@pytest.fixture(scope="module")
def engines(model):
    """One engine per mode with the prefix cache (built when first asked for), and the resident engine without it
    (``False``), the reference."""
    built = {False: Engine(model, dataclasses.replace(MODES["resident"], prefix_cache=False))}

    class Engines(dict):
        def __missing__(self, mode):
            if mode not in built:
                built[mode] = Engine(model, MODES[mode])
            return built[mode]
    return Engines()


REQUEST = st.tuples(st.integers(0, 40), st.integers(1, 6), st.integers(0, 4), st.sampled_from([None, 0, 2]))
# (suffix length, new tokens, arrival step, abort this many steps after arriving or None)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=2, deadline=None, derandomize=True)
@given(prefix=st.sampled_from([20, 50, 90]), seed=st.integers(0, 2), requests=st.lists(REQUEST, min_size=2, max_size=4))
def test_v4_shared_prefix_workloads_give_the_tokens_of_no_prefix_cache(engines, mode, prefix, seed, requests):
    """Requests sharing a prefix with distinct suffixes, joining at arbitrary steps of two batch rows (some wait, some
    join while others prefill or decode), some aborted: each finished request's tokens equal its tokens without the
    prefix cache, an aborted one's a prefix of them; after them only cached pages are held."""
    on = engines[mode]
    serve_workload(engines, on, prefix, seed, requests)
    assert on.usage()["prefix_cache_states"] <= on.config.prefix_cache_states


@pytest.mark.parametrize("mode", ["resident", "ess inline"])
def test_v4_identical_resent_request_and_a_longer_turn_hit_at_the_last_window_boundary(engines, mode):
    """A prompt (far under 4096 tokens) sent again reads every whole window before its last ``tail`` tokens from the
    cache and resumes from the snapshot there; a next turn (the prompt, its answer and a new message) hits the same
    boundary. Tokens as without the cache; one snapshot kept per prompt."""
    on, tail = engines[mode], TAIL[mode]
    prompt = np.random.default_rng(41).integers(0, 256, 75).tolist()
    (want,) = reference(engines, [(prompt, 6)])
    turn = prompt + want + np.random.default_rng(42).integers(0, 256, 9).tolist()
    (want_turn,) = reference(engines, [(turn, 6)])
    hits, prefilled = on.prefix_cache_metrics()["hit_tokens"], on.stats.prefill_tokens
    outputs = []
    for p in (prompt, prompt, turn):
        on.add_request(RequestSpec(p, 6))
        outputs.append(on.run()[0].output_ids)
    assert outputs == [want, want, want_turn]
    boundary = (len(prompt) - tail) // BLOCK * BLOCK
    assert boundary > 0
    assert on.prefix_cache_metrics()["hit_tokens"] - hits == 2 * boundary
    assert on.stats.prefill_tokens - prefilled == 3 * len(prompt) + len(want) + 9 - 2 * boundary
    assert_idle_holds_only_cached_pages(on)


def test_v4_prompts_sharing_a_system_prompt_one_at_a_time_hit_from_the_second(engines):
    """A 50-token system prompt and three distinct 40-token messages, one at a time: the first prompt snapshots at the
    landmarks in the second half of its prefix (48 and 64) and at its boundary 80; the second and the third resume at
    48 and each snapshot at their own 64 and 80. Tokens as without the cache."""
    on = engines["resident"]
    rng = np.random.default_rng(31)
    stem = rng.integers(0, 256, 50).tolist()
    prompts = [stem + rng.integers(0, 256, 40).tolist() for _ in range(3)]
    want = reference(engines, [(p, 4) for p in prompts])
    states, hits = on.usage()["prefix_cache_states"], []
    for p, tokens in zip(prompts, want):
        before = on.prefix_cache_metrics()["hit_tokens"]
        on.add_request(RequestSpec(p, 4))
        assert on.run()[0].output_ids == tokens
        hits.append(on.prefix_cache_metrics()["hit_tokens"] - before)
    assert hits == [0, 48, 48]
    assert on.usage()["prefix_cache_states"] == states + 7  # 48, 64 and 80 (first), 64 and 80 (second, third)
    assert_idle_holds_only_cached_pages(on)


@pytest.mark.parametrize("mode", ["resident", "ess inline"])
def test_v4_prompts_submitted_together_share_a_system_prompt(engines, mode):
    """A 50-token system prompt and four distinct 40-token messages submitted at once (two batch rows): the first
    prompt, admitted while the others wait, takes a snapshot where their pages part from its own (48) besides its
    boundary; the others wait for its prefill and resume there (all but the first hit 48 tokens, more than one at a
    time, where the second only marks the branch point). Tokens as without the cache."""
    on = engines[mode]
    rng = np.random.default_rng(37)
    stem = rng.integers(0, 256, 50).tolist()
    prompts = [stem + rng.integers(0, 256, 40).tolist() for _ in range(4)]
    want = reference(engines, [(p, 4) for p in prompts])
    before = on.prefix_cache_metrics()["hit_tokens"]
    for p in prompts:
        on.add_request(RequestSpec(p, 4))
    assert [r.output_ids for r in on.run()] == want
    assert on.prefix_cache_metrics()["hit_tokens"] - before == 3 * 48
    assert_idle_holds_only_cached_pages(on)


def test_v4_prompts_submitted_together_on_a_mesh_share_their_system_prompt():
    """``test_prefix_cache``'s in-batch run on a data=2 mesh on DeepSeek-V4 (blocks of 16 tokens): the first prompt
    snapshots where the waiting ones part from it (48) and the next one on its shard resumes there; tokens as on the
    same mesh without the prefix cache."""
    from test_prefix_cache import in_batch_on_a_mesh

    for mode, hits in in_batch_on_a_mesh(FIXTURE).items():
        assert hits[0] >= 2 * 48, mode


def test_v4_a_prompt_aborted_before_its_prompt_ends_keeps_no_snapshot(engines):
    """The snapshot is taken at the boundary mid-prompt but kept only once the prompt is all prefilled: a prompt
    aborted after its boundary piece leaves no cached prefix, and the same prompt sent again prefills whole."""
    on = engines["resident"]
    prompt = np.random.default_rng(23).integers(0, 256, 140).tolist()  # boundary 128: a piece of 64 per step, 8 + 4
    states = on.usage()["prefix_cache_states"]
    victim = on.add_request(RequestSpec(prompt, 4))
    on.step()
    on.step()
    assert on.requests[victim].prefilled == 128 and on.usage()["prefix_cache_states"] == states  # taken, not kept
    on.abort(victim)
    on.step()
    assert on.usage()["prefix_cache_states"] == states
    hits = on.prefix_cache_metrics()["hit_tokens"]
    on.add_request(RequestSpec(prompt, 4))
    assert on.run()[0].output_ids == reference(engines, [(prompt, 4)])[0]
    assert on.prefix_cache_metrics()["hit_tokens"] == hits
    assert on.usage()["prefix_cache_states"] == min(states + 3, on.config.prefix_cache_states)  # 64, 96 and 128
    assert_idle_holds_only_cached_pages(on)


def test_v4_snapshots_beyond_the_budget_are_evicted_least_recently_used_first(model, engines):
    """With room for four snapshots, three prompts cached in turn (two snapshots each: the landmark 16 and the boundary
    32) keep the last two's: the first misses when sent again, the third hits; outputs exact either way."""
    on = Engine(model, dataclasses.replace(MODES["resident"], prefix_cache_states=4))
    prompts = [np.random.default_rng(60 + i).integers(0, 256, 40).tolist() for i in range(3)]
    for p in prompts:
        on.add_request(RequestSpec(p, 2))
        on.run()
    assert on.usage()["prefix_cache_states"] == 4
    for p, hit in ((prompts[0], 0), (prompts[2], 32)):
        before = on.prefix_cache_metrics()["hit_tokens"]
        on.add_request(RequestSpec(p, 2))
        assert on.run()[0].output_ids == reference(engines, [(p, 2)])[0]
        assert on.prefix_cache_metrics()["hit_tokens"] - before == hit


def test_v4_prefix_hits_decode_with_mtp_speculation_as_without_the_prefix_cache():
    """tiny-v4-code's MTP module drafting (K = 2; its block a CSA layer, the HCA rate 128: prefixes of 128 tokens):
    its window and rings snapshotted with the model's, its rows in the shared pages named by the token past them
    (``page_keys``' lookahead). A prompt sharing the first's 128-token prefix, then the first sent again: every
    step's tokens and drafts those of the same engine without the prefix cache."""
    model = ess_jax.load_model("tiny-v4-code")
    config = EngineConfig(max_batch=1, page_size=64, prefill_chunk=128, prefill_piece_ratio=128, max_seq_len=176,
                          speculative="mtp", num_speculative_tokens=2)
    assert families.get("deepseek_v4").prefix_block(model.cfg, config.page_size) == 128
    rng = np.random.default_rng(9)
    stem = rng.integers(0, 4096, 140).tolist()
    prompts = [stem + rng.integers(0, 4096, 10).tolist(), stem + rng.integers(0, 4096, 5).tolist()]
    prompts.append(prompts[0])
    runs = {}
    for cached in (False, True):
        engine = Engine(model, dataclasses.replace(config, prefix_cache=cached))
        runs[cached] = [serve_alone(engine, p, 12) for p in prompts]
    assert runs[True] == runs[False]
    assert engine.prefix_cache_metrics()["hit_tokens"] == 2 * 128
    assert_idle_holds_only_cached_pages(engine)


def test_v4_data_shards_route_to_the_shard_holding_the_prefix_and_give_the_same_tokens(engines):
    """``test_prefix_cache``'s mesh run on DeepSeek-V4 (ESS, data=2, page size 8: blocks of 16 tokens): each prompt
    goes to the shard holding its prefix's pages and snapshot, resumes there, and every output equals the
    single-device output without the prefix cache."""
    import json
    import sys

    from helpers import outputs, spawn
    from test_prefix_cache import MESH_SCRIPT

    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 256, 48).tolist(), rng.integers(0, 256, 48).tolist()
    prompts = [a + [1, 2], b + [3], b + [4, 5, 6], a + [7]]
    (out,) = outputs(spawn([[sys.executable, "-c", MESH_SCRIPT, str(FIXTURE), json.dumps(prompts)]], devices=2),
                     timeout=900)
    got = json.loads(out.splitlines()[-1])["ess"]
    assert got["tokens"] == reference(engines, [(p, 6) for p in prompts])
    assert got["shards"] == [0, 1, 1, 0]
    per_shard = {s["shard"]: s for s in got["prefix"]["per_shard"]}
    for shard, (first, again) in ((0, (prompts[0], prompts[3])), (1, (prompts[1], prompts[2]))):
        assert per_shard[shard]["query_tokens"] == len(first) + len(again)
        assert per_shard[shard]["hit_tokens"] == (len(again) - 32) // BLOCK * BLOCK > 0

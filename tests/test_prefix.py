"""The prefix cache's scheduler half (``ess_jax.engine.prefix.PrefixCache``) without a model, as
``test_scheduler``: a scheduler over it fed hand-made prefill results (row states named by their position), the
pieces it cuts, the snapshots it asks for, keeps and resumes from, and its counters; and the null object."""

import numpy as np

from ess_jax.config import preset_dict
from ess_jax.engine import EngineConfig, EngineStats
from ess_jax.engine.plan import PrefillResult, PrefixWork
from ess_jax.engine.prefix import NoPrefixCache, PrefixCache, landmark
from ess_jax.engine.request import Request, RequestSpec
from ess_jax.engine.scheduler import Scheduler
from ess_jax.engine.speculate import NoDrafts
from ess_jax.families import load_config
from ess_jax.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(load_config(preset_dict("tiny-v32")))
CONFIG = EngineConfig(max_batch=1, page_size=16, prefill_chunk=64)


def scheduler(prefix) -> Scheduler:
    return Scheduler(CONFIG, shards=1, pages=33, pages_per_row=16, max_seq_len=256, stats=EngineStats(),
                     prefix=prefix, proposer=NoDrafts(1))


def row_state_cache() -> PrefixCache:
    """DeepSeek-V4's shape of it: blocks of one page, the last prompt token always computed."""
    return PrefixCache(CONFIG, salt=b"salt", tail=1, block=16, row_state=True, lookahead=0, disk=None, tier="device",
                       shards=1)


def serve(s: Scheduler, prompt: list[int]) -> list[tuple[int, int, bool, object]]:
    """Prefill ``prompt`` (one new token) to its end, each piece's row state (when asked for) named by where it ends;
    each piece's (start, size, snapshot, resumed state)."""
    s.inbox.add(Request.from_spec(RequestSpec(prompt, 1), TOKENIZER, []), s.check(len(prompt), 1))
    s.take_inbox()
    pieces = []
    while groups := s.schedule_prefill():
        for group in groups:
            piece = group.slices[0]
            end = piece.start + group.size
            state = (f"at {end}", 8) if piece.prefix.snapshot else None
            pieces.append((piece.start, group.size, piece.prefix.snapshot, piece.prefix.resume))
            s.update_prefill(group, PrefillResult(np.array([5], np.int32), {}, {}, states={0: state}, saved={0: None}))
    assert s.outputs()[0].finished
    return pieces


def test_landmarks_are_block_counts_of_at_most_two_significant_bits():
    assert [n for n in range(1, 50) if landmark(n)] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]
    assert not landmark(0)


def test_a_second_prompt_sharing_a_system_prompt_resumes_from_the_first_ones_landmark():
    """A 50-token system prompt and two distinct 40-token messages, one at a time: the first prompt (boundary 80) is cut
    and snapshots at the landmarks of its prefix's second half (48, 64) and at its boundary; the second shares the
    three pages before 48 and resumes from the snapshot there, past which it snapshots at 64 and 80 again."""
    prefix = row_state_cache()
    s = scheduler(prefix)
    rng = np.random.default_rng(0)
    stem = rng.integers(0, 256, 50).tolist()
    first = serve(s, stem + rng.integers(0, 256, 40).tolist())
    assert first == [(0, 16, False, None), (16, 16, False, None), (32, 16, True, None), (48, 16, True, None),
                     (64, 16, True, None), (80, 4, False, None), (84, 4, False, None), (88, 1, False, None),
                     (89, 1, False, None)]
    assert s.usage()["prefix_cache_states"] == 3 and s.usage()["prefix_cache_state_bytes"] == 24
    second = serve(s, stem + rng.integers(0, 256, 40).tolist())
    assert second[0] == (48, 16, True, "at 48") and [p[0] for p in second] == [48, 64, 80, 84, 88, 89]
    assert s.usage()["prefix_cache_states"] == 5
    metrics = prefix.metrics()
    assert (metrics["query_tokens"], metrics["hit_tokens"]) == (180, 48)
    prefix.stats.reset()
    assert prefix.metrics()["query_tokens"] == 0


def test_a_prompt_that_ends_unfinished_keeps_nothing():
    """Snapshots are kept with their pages when the prompt is all prefilled: one aborted after its boundary piece
    leaves no state and no cached page."""
    s = scheduler(row_state_cache())
    prompt = np.random.default_rng(1).integers(0, 256, 90).tolist()
    s.inbox.add(Request.from_spec(RequestSpec(prompt, 1), TOKENIZER, []), s.check(90, 1))
    s.take_inbox()
    for group in s.schedule_prefill():  # one step: 64 tokens, snapshots at 32 + 16 = 48 and 64
        end = group.slices[0].start + group.size
        s.update_prefill(group, PrefillResult(np.array([5], np.int32), {}, {}, states={0: (f"at {end}", 8)},
                                              saved={0: None}))
    (request_id,) = s.inbox.unfinished()
    s.inbox.abort(request_id)
    s.take_inbox()
    assert s.usage()["prefix_cache_states"] == 0 and s.usage()["prefix_cache_pages"] == 0


def test_the_null_prefix_cache_shares_and_keeps_nothing():
    s = scheduler(NoPrefixCache(CONFIG.page_size))
    stem = list(range(10, 60))
    for _ in range(2):
        assert all(not snapshot and resume is None for _, _, snapshot, resume in serve(s, stem + [1] * 40))
    assert s.usage()["prefix_cache_pages"] == 0 and "prefix_cache_states" not in s.usage()
    assert s.prefix.metrics() is None and s.prefix.usage() == {}
    assert s.prefix.work(None, None, 0, 8) == PrefixWork()

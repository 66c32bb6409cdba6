"""The scheduler without a model: hand-made device results fed to ``update_prefill`` / ``update_decode``;
admission, the prefill-piece plan, per-shard routing, the stop rules, aborts and the reservation counters."""

import numpy as np
import pytest

from ess_jax.config import preset_dict
from ess_jax.engine import EngineConfig, EngineStats
from ess_jax.engine.request import Request, RequestSpec
from ess_jax.engine.plan import DecodeResult, PrefillResult, piece_sizes, prefill_pieces
from ess_jax.engine.prefix import NoPrefixCache
from ess_jax.engine.speculate import NoDrafts
from ess_jax.engine.scheduler import Scheduler
from ess_jax.families import load_config
from ess_jax.sampling import SamplingParams
from ess_jax.tokenizer import ByteTokenizer

CFG = load_config(preset_dict("tiny-v32"))
TOKENIZER = ByteTokenizer(CFG)
EOS = 7
UNIFORM_V = np.zeros(CFG.vocab_size, np.float32)  # logits for the requests that read them back


def scheduler(*, shards=1, rows=2, pages=33, chunk=64, page_size=16, max_seq_len=256, keep_logits=False, ratio=4):
    config = EngineConfig(max_batch=rows, page_size=page_size, prefill_chunk=chunk, keep_logits=keep_logits,
                          prefill_piece_ratio=ratio)
    return Scheduler(config, shards=shards, pages=pages, pages_per_row=max_seq_len // page_size,
                     max_seq_len=max_seq_len, stats=EngineStats(), prefix=NoPrefixCache(page_size),
                     proposer=NoDrafts(rows))


def add(s: Scheduler, prompt_len: int, new: int, *, forced=None, logprobs=None, stop=()) -> int:
    prompt = [(i % 200) + 10 for i in range(prompt_len)]
    request = Request.from_spec(RequestSpec(prompt, new, SamplingParams(), stop, logprobs=logprobs, forced_ids=forced),
                                TOKENIZER, [EOS])
    return s.inbox.add(request, s.check(prompt_len, new))


def sampled(s: Scheduler, group, token: int, logits=None) -> PrefillResult:
    """A prefill call's result: ``token`` sampled on every shard, ``logits`` for the finishing slices."""
    wanted = {shard: logits for shard, piece in group.slices.items() if piece.last and logits is not None}
    return PrefillResult(np.full(len(s.allocators), token, np.int32), wanted, {})


def decoded(tokens_B: np.ndarray) -> DecodeResult:
    """A decode step's result without drafts: each row's token, uniform logits."""
    rows = tokens_B.shape[0]
    return DecodeResult(tokens_B[:, None], np.zeros(rows, np.int32), np.tile(UNIFORM_V, (rows, 1, 1)))


def prefill_all(s: Scheduler, token: int = 50) -> list:
    """Run every prefill call of one step with ``token`` sampled; the groups."""
    groups = s.schedule_prefill()
    for group in groups:
        s.update_prefill(group, sampled(s, group, token, UNIFORM_V))
    return groups


def test_a_prompt_is_cut_into_the_engines_pieces_within_each_steps_chunk():
    s = scheduler(chunk=64)
    rid = add(s, 150, 4)
    s.take_inbox()
    assert prefill_pieces(150, 64, 4) == [64, 64, 16, 4, 1, 1]
    planned = []
    for _ in range(3):
        groups = prefill_all(s)
        assert sum(g.size for g in groups) <= 64  # the chunk budget of one step
        planned.append([(g.size, g.slices[0].start, g.slices[0].last) for g in groups])
        if s.schedule_decode() is not None:
            break
    assert planned == [[(64, 0, False)], [(64, 64, False)],
                       [(16, 128, False), (4, 144, False), (1, 148, False), (1, 149, True)]]
    piece = s.schedule_prefill()  # nothing left to prefill
    assert piece == []
    batch = s.schedule_decode()
    assert batch.request_ids == (rid, None) and batch.tokens_B[0] == 50 and batch.lengths_B[0] == 150
    assert list(batch.page_table_BX[0, :10]) == list(range(1, 11))  # 154 tokens: 10 pages of 16, in order


def test_the_piece_ratio_sets_the_piece_sizes():
    """--prefill-piece-ratio R: sizes 1, R, R^2, ... below the chunk, and the chunk; a ratio of the chunk or more
    leaves 1 and the chunk (two compiled steps, a prompt's tail token by token); below 2 is refused."""
    assert piece_sizes(64, 2) == (1, 2, 4, 8, 16, 32, 64) and piece_sizes(64, 8) == (1, 8, 64)
    assert piece_sizes(64, 64) == piece_sizes(64, 100) == (1, 64) and piece_sizes(300, 4) == (1, 4, 16, 64, 256, 300)
    assert prefill_pieces(150, 64, 64) == [64, 64] + [1] * 22
    s = scheduler(chunk=64, ratio=8)
    add(s, 90, 4)
    s.take_inbox()
    assert [[g.size for g in prefill_all(s)] for _ in range(2)] == [[64], [8, 8, 8, 1, 1]]
    with pytest.raises(ValueError, match="--prefill-piece-ratio 1 must be an integer >= 2"):
        EngineConfig(prefill_piece_ratio=1)


def test_pieces_carry_the_prompts_tokens_and_page_table():
    s = scheduler(chunk=8)
    add(s, 12, 1)
    s.take_inbox()
    (group,) = s.schedule_prefill()
    piece = group.slices[0]
    assert piece.tokens == tuple(range(10, 18)) and piece.start == 0 and piece.prompt_len == 12
    s.update_prefill(group, sampled(s, group, 3))
    (rest,) = s.schedule_prefill()
    assert rest.size == 4 and rest.slices[0].tokens == tuple(range(18, 22)) and rest.slices[0].last
    assert rest.slices[0].pages_X.tolist() == piece.pages_X.tolist()


def test_stop_rules_and_what_a_finished_request_releases():
    s = scheduler(rows=3)
    eos, length, forced = add(s, 20, 5), add(s, 20, 2), add(s, 20, 3, forced=[EOS, 1, 2])
    s.take_inbox()
    prefill_all(s, token=60)
    outs = {o.request_id: o for o in s.outputs()}
    assert [outs[i].new_token_ids for i in (eos, length, forced)] == [[60], [60], [EOS]]  # forced: its id, not 60
    assert not any(o.finished for o in outs.values())
    batch = s.schedule_decode()
    rows = {rid: row for row, rid in enumerate(batch.request_ids)}
    assert batch.wants_logits  # the forced request reports its tokens' log-probabilities
    tokens_B = np.full(3, EOS, np.int32)
    tokens_B[rows[length]] = 61  # its second token: max_new_tokens reached
    released = s.update_decode(batch, decoded(tokens_B))
    outs = {o.request_id: o for o in s.outputs()}
    assert (outs[eos].finish_reason, outs[length].finish_reason, outs[forced].finished) == ("stop", "length", False)
    assert outs[forced].new_token_ids == [1]  # eos sampled, the forced id taken; a forced request ignores eos
    assert sorted(r.row for r in released) == sorted([rows[eos], rows[length]])
    assert s.schedule_decode().request_ids.count(None) == 2  # only the forced request decodes on
    released = s.update_decode(s.schedule_decode(), decoded(np.zeros(3, np.int32)))
    (out,) = s.outputs()
    assert out.finish_reason == "length" and out.new_token_ids == [2] and [r.row for r in released] == [rows[forced]]
    assert not s.inbox.has_unfinished() and s.stats.reserved_pages == 0 and s.usage()["pages_in_use"] == 0


def test_a_stop_token_at_the_prefill_ends_the_request_before_it_decodes():
    s = scheduler()
    rid = add(s, 16, 8, stop=[99])
    s.take_inbox()
    (group,) = s.schedule_prefill()
    released = s.update_prefill(group, sampled(s, group, 99))
    assert [r.row for r in released] == [0] and s.schedule_decode() is None
    (out,) = s.outputs()
    assert (out.request_id, out.new_token_ids, out.finish_reason) == (rid, [99], "stop")


def test_abort_of_a_waiting_and_of_a_running_request():
    s = scheduler(rows=1)
    running, waiting = add(s, 10, 4), add(s, 10, 4)
    s.take_inbox()
    prefill_all(s)
    assert s.usage()["requests_waiting"] == 1  # one batch row
    s.outputs()
    s.inbox.abort(waiting)
    s.inbox.abort(running)
    released = s.take_inbox()
    assert [r.row for r in released] == [0]  # the waiting one held nothing
    assert sorted((o.request_id, o.finish_reason, o.finished) for o in s.outputs()) == [
        (running, "abort", True), (waiting, "abort", True)]
    assert not s.inbox.has_unfinished() and s.schedule_decode() is None and s.schedule_prefill() == []
    with pytest.raises(KeyError, match="never added"):
        s.inbox.abort(5)
    s.inbox.abort(running)  # already finished: left alone
    assert s.take_inbox() == [] and s.outputs() == []


def test_each_data_shard_prefills_its_own_prompt_and_equal_pieces_share_a_call():
    s = scheduler(shards=2, rows=4, pages=17, chunk=32)
    a, b, c = add(s, 32, 2), add(s, 32, 2), add(s, 16, 2)
    s.take_inbox()
    groups = s.schedule_prefill()
    # a and b on the two shards (least loaded first), one call of 32 for both; c behind a on shard 0, next step
    assert [(g.size, sorted((sh, p.request_id) for sh, p in g.slices.items())) for g in groups] == [
        (32, [(0, a), (1, b)])]
    rows = {p.request_id: p.row for g in groups for p in g.slices.values()}
    assert (s.admission.shard_of(rows[a]), s.admission.shard_of(rows[b])) == (0, 1)
    for g in groups:
        s.update_prefill(g, sampled(s, g, 1))
    (group,) = s.schedule_prefill()
    assert group.size == 16 and [p.request_id for p in group.slices.values()] == [c]
    per_shard = s.usage()["per_shard"]
    assert [p["rows_in_use"] for p in per_shard] == [2, 1]


def test_pieces_of_different_sizes_run_largest_first():
    s = scheduler(shards=2, rows=2, pages=17, chunk=32)
    add(s, 32, 1), add(s, 20, 1)
    s.take_inbox()
    assert [(g.size, list(g.slices)) for g in s.schedule_prefill()] == [(32, [0]), (16, [1]), (4, [1])]


def test_admission_is_fifo_and_reservations_are_counted():
    s = scheduler(rows=4, pages=9, page_size=16)  # 8 allocatable pages
    big, small = add(s, 100, 12), add(s, 10, 4)  # 7 pages, 1 page
    third = add(s, 40, 8)  # 3 pages: waits for big
    assert s.stats.reserved_pages == s.stats.peak_reserved_pages == 11
    s.take_inbox()
    groups = prefill_all(s)
    assert {p.request_id for g in groups for p in g.slices.values()} <= {big, small}
    assert s.usage()["requests_waiting"] == 1 and s.admission.waiting == (third,)
    with pytest.raises(ValueError, match="pages"):
        s.check(150, 10)  # 10 pages, more than the pool: never servable
    s.inbox.abort(big)
    s.take_inbox()
    assert s.stats.reserved_pages == 4 and s.stats.peak_reserved_pages == 11
    s.schedule_prefill()
    assert s.usage()["requests_waiting"] == 0


def test_logits_are_kept_only_where_asked():
    s = scheduler(rows=2, keep_logits=False)
    plain, scored = add(s, 8, 2), add(s, 8, 2, logprobs=2)
    s.take_inbox()
    for group in s.schedule_prefill():
        assert all(p.wants_logits == (p.request_id == scored) for p in group.slices.values())
        s.update_prefill(group, sampled(s, group, 5, UNIFORM_V))
    outs = {o.request_id: o for o in s.outputs()}
    assert outs[plain].logprobs is None
    (lp,) = outs[scored].logprobs
    assert lp.token_id == 5 and lp.logprob == pytest.approx(-np.log(CFG.vocab_size)) and len(lp.top) == 2
    batch = s.schedule_decode()
    assert batch.wants_logits

"""Speculative decoding's proposers (``ess_jax.engine.speculate``) without a model: the drafts each proposes (a
caller's, checked; teacher-forced ids; the MTP module's from the last step), what they record from hand-made
results, their counters and the room a request reserves."""

import numpy as np
import pytest

from ess_jax.config import preset_dict
from ess_jax.engine.plan import DecodeBatch, DecodeResult
from ess_jax.engine.request import Request, RequestSpec
from ess_jax.engine.speculate import CallerDrafts, MtpDrafts, NoDrafts
from ess_jax.families import load_config
from ess_jax.sampling import SamplingParams
from ess_jax.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(load_config(preset_dict("tiny-v32")))
VOCAB = 300


def request(forced=None):
    new = 4 if forced is None else len(forced)
    return Request.from_spec(RequestSpec([10, 11, 12], new, forced_ids=forced), TOKENIZER, [])


def batch(proposer, requests) -> DecodeBatch:
    drafts_BK, forced_B = proposer.propose(requests)
    rows = len(requests)
    ids = tuple(i if r is not None else None for i, r in enumerate(requests))
    return DecodeBatch(ids, np.zeros(rows, np.int32), drafts_BK, forced_B, np.zeros(rows, np.int32),
                       np.zeros((rows, 4), np.int32), (SamplingParams(),) * rows, np.zeros(rows, np.int32), False)


def test_no_drafts_proposes_nothing_reserves_nothing_and_reports_nothing():
    proposer = NoDrafts(2)
    drafts_BK, forced_B = proposer.propose([request(), None])
    assert drafts_BK.shape == (2, 0) and not forced_B.any()
    assert (proposer.reserve, proposer.lookahead, proposer.metrics(None), proposer.usage(None)) == (0, 0, None, {})


def test_a_callers_drafts_are_checked_and_a_forced_requests_ids_are_its_drafts():
    proposer = CallerDrafts(3, 2, VOCAB, lambda r: [len(r.output_ids) + 1, 7])
    b = batch(proposer, [request(), None, request(forced=(4, 5, 6))])
    assert b.drafts_BK.tolist() == [[1, 7], [0, 0], [4, 5]] and b.forced_B.tolist() == [False, False, True]
    assert proposer.reserve == 4  # the verified drafts' positions, and the MTP chain's past them
    proposer.decoded(b, DecodeResult(np.zeros((3, 3), np.int32), np.array([1, 0, 2], np.int32), None))
    report = proposer.metrics(None)  # the forced row does not count
    assert (report["num_drafts"], report["accepted_tokens"], report["acceptance_rate"]) == (1, 1, [1.0, 0.0])
    assert proposer.usage(None) == {"speculative": report}
    for bad in ([1], [1, VOCAB], [1.5, 2]):
        with pytest.raises(ValueError, match="the drafter must give 2 token ids"):
            CallerDrafts(1, 2, VOCAB, lambda r, bad=bad: bad).propose([request()])


def test_the_mtp_modules_drafts_are_those_of_the_last_prefill_or_decode_step():
    proposer = MtpDrafts(2, 2, VOCAB, cache=lambda size: None)
    assert proposer.lookahead == 1
    proposer.prefilled(1, np.array([8, 9], np.int32))
    b = batch(proposer, [None, request()])
    assert b.drafts_BK.tolist() == [[0, 0], [8, 9]]
    proposer.decoded(b, DecodeResult(np.zeros((2, 3), np.int32), np.array([0, 2], np.int32), None,
                                     np.array([[1, 2], [3, 4]], np.int32)))
    assert batch(proposer, [request(), request()]).drafts_BK.tolist() == [[1, 2], [3, 4]]
    assert proposer.metrics(None)["accepted_per_position"] == [1, 1]

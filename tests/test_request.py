"""``RequestSpec`` without a model: what ``Ticks`` send (its JSON round trip), its checks, and the ``Request`` it
makes (``Request.from_spec``: the stop ids and a forced request's logprobs)."""

import json

import numpy as np
import pytest

from ess_jax.config import preset_dict
from ess_jax.engine.request import Request, RequestSpec
from ess_jax.families import load_config
from ess_jax.sampling import SamplingParams
from ess_jax.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(load_config(preset_dict("tiny-v32")))


def test_a_spec_survives_json_as_ticks_send_it():
    spec = RequestSpec(np.arange(3, 6), 4, SamplingParams(0.7, 5, 0.9, 11), [np.int64(9)], True, 2, 1,
                       cache_salt="a")
    assert spec.prompt_ids == (3, 4, 5) and type(spec.prompt_ids[0]) is int and spec.stop_token_ids == (9,)
    assert RequestSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    forced = RequestSpec([1], 2, forced_ids=[5, 6])
    assert RequestSpec.from_dict(json.loads(json.dumps(forced.to_dict()))) == forced


@pytest.mark.parametrize("spec, needle", [
    (RequestSpec([1], 2, forced_ids=[5]), "1 forced ids for max_new_tokens=2"),
    (RequestSpec([1], 1, stop_token_ids=[3], forced_ids=[5]), "stop_token_ids with forced_ids"),
    (RequestSpec([1], 0), "max_new_tokens=0 must be an integer >= 1"),
    (RequestSpec([1], 1, prompt_logprobs=21), r"prompt_logprobs=21 must be an integer in \[0, 20\]"),
    (RequestSpec([1], 1, cache_salt=""), "cache_salt must be a non-empty string"),
])
def test_the_checks_name_the_problem(spec, needle):
    with pytest.raises(ValueError, match=needle):
        spec.check(300)
    RequestSpec([1], 0, prompt_logprobs=0).check(300)  # a prefill that only scores its prompt


def test_a_request_stops_at_eos_and_stop_ids_unless_forced():
    assert Request.from_spec(RequestSpec([1], 2, stop_token_ids=[3]), TOKENIZER, [7]).stop_ids == {3, 7}
    assert Request.from_spec(RequestSpec([1], 2, ignore_eos=True), TOKENIZER, [7]).stop_ids == set()
    forced = Request.from_spec(RequestSpec([1], 2, forced_ids=[4, 5]), TOKENIZER, [7])
    assert (forced.stop_ids, forced.logprobs, forced.forced_ids) == (set(), 0, (4, 5))
    scored = Request.from_spec(RequestSpec([1, 2], 0, prompt_logprobs=1), TOKENIZER, [7])
    assert scored.prompt_scores == [None] and scored.prompt_ids == [1, 2]

"""Speculative decoding: the verifier, rollback and rejection sampling.

Greedy tokens with drafts verified equal those without, token for token: both families, the resident cache and
the tier (pools of top_k + 1 slots, 2 top_k, about half the entries and every entry; both fetch backends), K = 1 and
3, with requests joining, ending inside an accepted run (a stop id, max_new_tokens) and aborting. The drafts come
through the engine's drafter entry from a run without speculation, corrupted at chosen positions, so every step
accepts a known prefix (all, none, or some). After every step the tier holds nothing a rejected draft wrote, its slot
table and residency
map are inverse, and after the last request every page, batch row and slot is free. Rejection sampling keeps the
target's distribution: a chi-square test on a small vocabulary that a sampler without the correction fails.
"""

import dataclasses
import functools
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy import stats

import ess_jax
from ess_jax import sampling
from ess_jax.cache import entries_per_page
from ess_jax.engine import Engine, EngineConfig, RequestSpec
from helpers import MTP_ENGINE, mtp_v32

FIXTURES = Path(__file__).parent / "fixtures"
NEW = 12  # new tokens of every reference request
PROMPTS = {"v32": (33, 65, 96, 34), "v4": (33, 65, 96, 34)}  # prompt lengths (pieces of 32 and 1: two compiled sizes);
# the tier pools hold fewer entries
# (max_seq_len: the longest prompt, its new tokens and the 2K positions K = 3 drafts reserve)
BASE = {"v32": EngineConfig(max_batch=2, page_size=16, prefill_chunk=32, max_seq_len=96 + NEW + 6),
        "v4": EngineConfig(max_batch=2, page_size=16, prefill_chunk=32, max_seq_len=96 + NEW + 6)}


@pytest.fixture(scope="module")
def models():
    return {"v32": ess_jax.load_model(FIXTURES / "hf-v32-a"), "v4": ess_jax.load_model(FIXTURES / "hf-v4-a")}


@pytest.fixture(scope="module")
def reference(models):
    """Per family: each prompt and its greedy tokens without speculation (resident cache)."""
    out = {}
    for family, model in models.items():
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, 256, n).tolist() for n in PROMPTS[family]]
        engine = Engine(model, BASE[family])
        for prompt in prompts:
            engine.add_request(RequestSpec(prompt, NEW))
        out[family] = {tuple(r.prompt_ids): r.output_ids for r in engine.run()}
    return out


class OracleDrafter:
    """Drafts a request's reference continuation, one draft corrupted where ``pattern(prompt length, tokens so
    far)`` says (a position >= K: none), so each step's accepted prefix is known."""

    def __init__(self, reference: dict, k: int, vocab: int, salt: int = 0):
        self.reference, self.k, self.vocab, self.salt = reference, k, vocab, salt

    def corrupted(self, prompt_len: int, n: int) -> int:
        return (prompt_len * 7 + n * 3 + self.salt) % (self.k + 2)

    def __call__(self, request) -> list[int]:
        out, n = self.reference[tuple(request.prompt_ids)], len(request.output_ids)
        drafts = (list(out[n:n + self.k]) + [0] * self.k)[:self.k]
        bad = self.corrupted(len(request.prompt_ids), n)
        if bad < self.k:
            drafts[bad] = (drafts[bad] + 1) % self.vocab
        return drafts


def tier_invariants(engine: Engine) -> None:
    """The tier holds no entry past a running request's entries (nothing a rejected draft wrote), no entry of a
    free batch row, its slot table and residency map are inverse, and no staged row lies past a request's
    entries."""
    store = engine.offload.store(engine.runner.cache)
    part, page_size = engine.layout.offloaded, engine.config.page_size
    per_page = entries_per_page(page_size, part.tokens_per_row)
    entry_LBP = np.asarray(store.lru.slot_entry)
    resident = np.asarray(store.lru.resident_slot)
    table = engine.scheduler.admission.page_table(engine.layout.pages_per_row)
    batch = engine.scheduler.schedule_decode()  # the next step's plan: the rows decoding and their lengths
    lengths = np.zeros(engine.config.max_batch, np.int32) if batch is None else batch.lengths_B
    decoding = set() if batch is None else {row for row, r in enumerate(batch.request_ids) if r is not None}
    for row in range(engine.config.max_batch):
        limit = part.entries(int(lengths[row])) if row in decoding else 0
        held = entry_LBP[:, row]
        assert (held < limit).all(), (row, limit, held.max())
        for layer, slot in zip(*np.nonzero(held >= 0)):
            assert resident[layer, row, held[layer, slot]] == slot
    assert (resident >= 0).sum() == (entry_LBP >= 0).sum()  # no residency without its slot
    staged_page, staged_offset = np.asarray(store.staged_page), np.asarray(store.staged_offset)
    for row, m in zip(*np.nonzero(staged_page > 0)):
        if row not in decoding:  # an ended request's last rows, backed up before its pages are used again
            continue
        entry = list(table[row]).index(staged_page[row, m]) * per_page + staged_offset[row, m]
        assert entry < part.entries(int(lengths[row]))


def all_free(engine: Engine) -> None:
    """Every page and batch row back, and with the tier every slot and residency empty."""
    usage = engine.usage()
    assert usage["pages_in_use"] == 0 and usage["rows_in_use"] == 0
    if engine.config.offload == "ess":
        store = engine.offload.store(engine.runner.cache)
        assert (np.asarray(store.lru.slot_entry) < 0).all() and (np.asarray(store.lru.resident_slot) < 0).all()


def serve(engine: Engine, requests: list[dict], check) -> dict[int, tuple[list[int], str]]:
    """Step ``engine`` with ``requests`` (``prompt``, ``new``, ``stop``, ``arrive``: the step it is added at,
    ``abort``: the step it is aborted at or None) until all end, ``check(engine)`` after every step; each
    request's output tokens and finish reason by its index."""
    ids, tokens, reasons, step = {}, {}, {}, 0
    while len(ids) < len(requests) or engine.has_unfinished():
        for i, r in enumerate(requests):
            if r["arrive"] == step:
                ids[i] = engine.add_request(RequestSpec(r["prompt"], r["new"], stop_token_ids=r["stop"]))
            if r["abort"] == step and i in ids:
                engine.abort(ids[i])
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            reasons[out.request_id] = out.finish_reason
        check(engine)
        step += 1
        assert step < 200
    return {i: (tokens.get(ids[i], []), reasons[ids[i]]) for i in ids}


def expected(reference: dict, r: dict) -> list[int]:
    """A request's tokens without speculation: the reference's first ``new``, up to its stop id."""
    out = list(reference[tuple(r["prompt"])][:r["new"]])
    for i, t in enumerate(out):
        if t in r["stop"]:
            return out[:i + 1]
    return out


def check_outputs(reference: dict, requests: list[dict], got: dict) -> None:
    for i, r in enumerate(requests):
        tokens, reason = got[i]
        want = expected(reference, r)
        if reason == "abort":
            assert tokens == want[:len(tokens)]
        else:
            assert tokens == want, (i, r["stop"], r["new"])
            assert reason == ("stop" if want[-1] in r["stop"] else "length")


def workload(reference: dict, family: str) -> list[dict]:
    """The fixed workload: four prompts over two batch rows (two join later), one ending at a stop id inside an
    accepted run, one with a length that is no multiple of 1 + K, one aborted while it decodes."""
    prompts = list(reference)
    stop_at = reference[prompts[1]][6]
    return [dict(prompt=list(prompts[0]), new=NEW, stop=[], arrive=0, abort=None),
            dict(prompt=list(prompts[1]), new=NEW, stop=[stop_at], arrive=0, abort=None),
            dict(prompt=list(prompts[2]), new=7, stop=[], arrive=1, abort=None),
            dict(prompt=list(prompts[3]), new=NEW, stop=[], arrive=2, abort=9)]


EVERY = BASE["v32"].max_seq_len  # a pool of every entry (the pool size is capped at a request's entries)
SPEC = {  # family, offload, fetch, pool (slots), K: the tier tests' pool sizes (a ratio of 0.1 is top_k + 1 here)
    "v32 resident K=1": ("v32", "none", "inline", None, 1),
    "v32 tier top_k+1 split K=3": ("v32", "ess", "split", 17, 3),
    "v32 tier 2*top_k inline K=3": ("v32", "ess", "inline", 32, 3),
    "v32 tier ratio 0.5 inline K=1": ("v32", "ess", "inline", 55, 1),
    "v32 tier every entry split K=1": ("v32", "ess", "split", EVERY, 1),
    "v4 resident K=3": ("v4", "none", "inline", None, 3),
    "v4 tier top_k+1 inline K=3": ("v4", "ess", "inline", 9, 3),
    "v4 tier top_k+1 split K=1": ("v4", "ess", "split", 9, 1),
    "v4 tier 2*top_k split K=3": ("v4", "ess", "split", 16, 3),
    "v4 tier every entry inline K=1": ("v4", "ess", "inline", EVERY, 1),
}


def spec_engine(models, reference, name: str) -> tuple[Engine, OracleDrafter]:
    family, offload, fetch, pool, k = SPEC[name]
    config = dataclasses.replace(BASE[family], offload=offload, fetch=fetch, pool_size=pool, speculative="mtp",
                                 num_speculative_tokens=k)  # V4's HCA rings: on the device, the default with drafts
    model = models[family]
    oracle = OracleDrafter(reference[family], k, model.cfg.vocab_size)
    return Engine(model, config, drafter=oracle), oracle


@pytest.mark.parametrize("name", SPEC)
def test_greedy_speculation_equals_greedy_decoding(models, reference, name):
    """Token for token, with joins, a stop inside an accepted run, an odd length and an abort; the tier's
    invariants after every step; everything free at the end; drafts accepted and rejected at every position."""
    family = SPEC[name][0]
    engine, _ = spec_engine(models, reference, name)
    check = tier_invariants if engine.config.offload == "ess" else (lambda e: None)
    requests = workload(reference[family], family)
    got = serve(engine, requests, check)
    check_outputs(reference[family], requests, got)
    assert got[3][1] == "abort" and got[1][1] == "stop"
    all_free(engine)
    spec = engine.speculative_metrics()
    k = SPEC[name][4]
    assert len(spec["acceptance_rate"]) == k and 0 < spec["acceptance_rate"][0] < 1
    assert spec["draft_tokens"] == k * spec["num_drafts"]
    assert 1 < spec["mean_accepted_length"] < k + 1
    if engine.config.offload == "ess":
        metrics = engine.offload_metrics()
        every = engine.layout.pool_slots == engine.layout.offloaded.entries(engine.config.max_seq_len)
        assert (metrics["misses"] > 0) != every  # a pool of every entry never misses
        assert metrics["hits"] + metrics["misses"] == metrics["lookups"]
        # each query position's own ids: the last token's, then each draft's; the union counts an id once
        positions = metrics["per_position"]
        assert [c["position"] for c in positions] == list(range(k + 1))
        for c in positions:
            assert c["hits"] + c["misses"] == c["lookups"] > 0
        for kind in ("lookups", "misses"):
            assert max(c[kind] for c in positions) <= metrics[kind] <= sum(c[kind] for c in positions)
        assert metrics["lookups"] < sum(c["lookups"] for c in positions)  # the queries share ids


@pytest.fixture(scope="module")
def hypothesis_engine(models, reference):
    return spec_engine(models, reference, "v32 tier top_k+1 split K=3")


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_arrivals_lengths_and_aborts(hypothesis_engine, reference, data):
    """One compiled engine (the tier, a pool of top_k + 1, K = 3) over drawn arrival steps, lengths, stop ids,
    aborts and corruption patterns: the greedy tokens of decoding without speculation, the tier's invariants
    after every step, everything free at the end."""
    (engine, oracle), ref = hypothesis_engine, reference["v32"]
    oracle.salt = data.draw(st.integers(0, 4))
    prompts = list(ref)
    requests = []
    for _ in range(data.draw(st.integers(1, 4))):
        prompt = data.draw(st.sampled_from(prompts))
        new = data.draw(st.integers(1, NEW))
        stop = [ref[prompt][data.draw(st.integers(0, NEW - 1))]] if data.draw(st.booleans()) else []
        abort = data.draw(st.one_of(st.none(), st.integers(0, 8)))
        requests.append(dict(prompt=list(prompt), new=new, stop=stop, arrive=data.draw(st.integers(0, 6)),
                             abort=abort))
    got = serve(engine, requests, tier_invariants)
    check_outputs(ref, requests, got)
    all_free(engine)


def test_sampled_requests_are_reproducible_per_seed(models, reference):
    """A sampled request's tokens with drafts verified by rejection sampling depend on its seed only: alone, or
    beside another request in the other batch row, the same; another seed, others (temperature 1). At
    temperature 0.05 the greedy drafts are accepted, and the tokens are again the seed's."""
    from ess_jax.sampling import SamplingParams

    engine, _ = spec_engine(models, reference, "v32 resident K=1")
    prompt, other = (list(p) for p in list(reference["v32"])[:2])

    def run(pairs, temperature):
        for p, seed in pairs:
            engine.add_request(RequestSpec(p, NEW, SamplingParams(temperature=temperature, top_k=40, seed=seed)))
        return [r.output_ids for r in engine.run()]  # in the order added

    for temperature in (1.0, 0.05):
        alone = run([(prompt, 11)], temperature)[0]
        assert run([(other, 5), (prompt, 11)], temperature)[1] == alone
        if temperature == 1.0:
            assert run([(prompt, 12)], temperature)[0] != alone
    assert engine.speculative_metrics()["accepted_tokens"] > 0


def test_refusals(models):
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(speculative="mtp")
    with pytest.raises(ValueError, match="not a drafter"):
        EngineConfig(speculative="eagle", num_speculative_tokens=1)
    v32 = models["v32"]
    config = dataclasses.replace(BASE["v32"], speculative="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="no MTP layer"):
        Engine(v32, config)
    # V4's HCA rings default to host memory, and to the device with speculative decoding (host rings take one
    # token per request and step): asked for in host memory with drafts, a refusal naming the fix
    v4_ess = dataclasses.replace(BASE["v4"], offload="ess")
    spec = dataclasses.replace(v4_ess, speculative="mtp", num_speculative_tokens=1)
    assert (v4_ess.ring_placement, spec.ring_placement) == ("host", "device")
    with pytest.raises(ValueError, match="leave --rings unset or use --rings device"):
        Engine(models["v4"], dataclasses.replace(spec, rings="host"), drafter=lambda r: [0])
    with pytest.raises(ValueError, match="smallest ring"):  # hf-v4-a: CSA rings of 2 x 4 positions
        Engine(models["v4"], dataclasses.replace(BASE["v4"], speculative="mtp", num_speculative_tokens=8),
               drafter=lambda r: [0] * 8)
    # admission reserves the drafts' positions: a request that fills max_seq_len without them does not fit
    engine = Engine(v32, config, drafter=lambda r: [0, 0])
    with pytest.raises(ValueError, match="exceeds"):
        engine.add_request(RequestSpec([1] * 100, BASE["v32"].max_seq_len - 100))
    # a drafter's wrong count: refused by name (K = 1 and a 33-token prompt: "v32 resident K=1"'s compiled steps)
    bad = Engine(v32, dataclasses.replace(config, num_speculative_tokens=1), drafter=lambda r: [0, -1])
    bad.add_request(RequestSpec([1] * 33, 4))
    with pytest.raises(ValueError, match="drafter must give 1 token ids"):
        bad.run()


# ---- rejection sampling ---------------------------------------------------------------------------------

VOCAB, DRAWS = 6, 20000
TARGET_V = np.log(np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10]))
DRAFT_V = np.array([0.40, 0.05, 0.25, 0.05, 0.05, 0.20])


def first_token_counts(params: dict, drafts: int) -> tuple[np.ndarray, np.ndarray]:
    """The first output token of ``DRAWS`` verification steps (one per seed) of drafts drawn from ``DRAFT_V``
    against the fixed target logits, counted per token, and the target's distribution after the sampling
    filters (``sampling.sample``'s own, from a large sample of it)."""
    rng = np.random.default_rng(0)
    b, t = DRAWS, drafts + 1
    logits = jnp.asarray(np.broadcast_to(TARGET_V, (b, t, VOCAB)), jnp.float32)
    drafts_BK = jnp.asarray(rng.choice(VOCAB, size=(b, drafts), p=DRAFT_V), jnp.int32)
    q = jnp.asarray(np.broadcast_to(DRAFT_V, (b, drafts, VOCAB)), jnp.float32)
    column = lambda v, dt: jnp.full(b, v, dt)  # noqa: E731
    args = (column(params["temperature"], jnp.float32), column(params["top_k"], jnp.int32),
            column(params["top_p"], jnp.float32), jnp.arange(b, dtype=jnp.uint32), column(0, jnp.int32))
    verify = jax.jit(lambda *a: sampling.verify(*a))  # traced here: a patched ``residual`` is the one it uses
    tokens, _ = verify(logits, drafts_BK, q, *args, jnp.zeros(b, bool))
    direct = jax.jit(sampling.sample)(logits[:, 0], *args[:3], jnp.arange(b, dtype=jnp.uint32) + b, args[4])
    return np.bincount(np.asarray(tokens[:, 0]), minlength=VOCAB), np.bincount(np.asarray(direct), minlength=VOCAB)


SAMPLED = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=4, top_p=1.0),
           dict(temperature=1.3, top_k=0, top_p=0.8)]


@pytest.mark.parametrize("corrected", [True, False], ids=["rejection sampling", "without the correction"])
@pytest.mark.parametrize("params", SAMPLED, ids=["plain", "top_k", "top_p"])
def test_rejection_sampling_keeps_the_target_distribution(monkeypatch, params, corrected):
    """Chi-square (two samples, p > 1e-4) of the first token with one and with three drafts against the
    target's own sampler; with the residual replaced by the target's distribution (a rejected draft redrawn
    from p, not norm(max(0, p - q))) the same test fails."""
    if not corrected:
        monkeypatch.setattr(sampling, "residual", lambda p_V, q_V: p_V)
    for drafts in (1, 3):
        spec, direct = first_token_counts(params, drafts)
        support = (spec + direct) > 0
        _, p_value, _, _ = stats.chi2_contingency(np.stack([spec[support], direct[support]]))
        assert (p_value > 1e-4) == corrected, (drafts, spec, direct, p_value)


def test_greedy_rows_and_forced_rows_verify_exactly():
    """Temperature 0 accepts while the draft is the argmax and then takes the argmax; a forced row accepts
    every draft."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, VOCAB)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = best[:, :3].copy()
    drafts[0, 1] = (drafts[0, 1] + 1) % VOCAB  # row 0: the second draft wrong; row 1: all right
    drafts[2, 0] = (drafts[2, 0] + 1) % VOCAB  # row 2 forced: its wrong draft accepted
    q = jax.nn.one_hot(drafts, VOCAB)
    zeros = jnp.zeros(3)
    tokens, accepted = sampling.verify(logits, jnp.asarray(drafts), q, zeros, zeros.astype(jnp.int32), zeros + 1,
                                       zeros.astype(jnp.uint32), zeros.astype(jnp.int32), jnp.asarray([0, 0, 1], bool))
    assert np.asarray(accepted).tolist() == [1, 3, 3]
    assert np.asarray(tokens)[0, :2].tolist() == best[0, :2].tolist()
    assert np.asarray(tokens)[1].tolist() == best[1].tolist()
    assert np.asarray(tokens)[2, :3].tolist() == drafts[2].tolist()


# ---- the MTP module as the drafter ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_model():
    return mtp_v32()


MTP_PROMPTS = (20, 33, 9)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _reference_drafts(graphdef, params, tokens_1S, k: int, n):
    module = nnx.merge(graphdef, params)
    hidden, _ = module.hidden_states(tokens_1S, None)  # causal: the padding past n changes nothing before it
    next_1S = jnp.concatenate([tokens_1S[:, 1:], tokens_1S[:, :1]], axis=1)
    drafts = []
    for j in range(k):  # position n - 2 + j: the pair (hidden, next token) there, the draft after it
        logits, out, _ = module.mtp_forward(hidden, next_1S)
        drafts.append(jnp.argmax(logits[0, n - 2 + j]).astype(jnp.int32))
        hidden = hidden.at[:, n - 1 + j].set(out[:, n - 2 + j])
        next_1S = next_1S.at[:, n - 1 + j].set(drafts[-1])
    return jnp.stack(drafts)


def reference_drafts(model, tokens: list[int], k: int) -> list[int]:
    """The MTP module's greedy drafts after ``tokens`` (the last one not yet in the cache) from its full forward
    (``mtp_forward`` over the main model's ``hidden_states``): the first from the pair (h at the second-to-last
    position, the last token), each next one chained on the module's own output and the draft before it."""
    graphdef, params = nnx.split(model.module)
    padded = np.zeros((1, MTP_ENGINE.max_seq_len), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(_reference_drafts(graphdef, params, jnp.asarray(padded), k, len(tokens))).tolist()


@pytest.mark.parametrize("offload, k", [("none", 2), ("ess", 3)])
def test_mtp_drafts_verified_give_greedy_tokens(mtp_model, offload, k):
    """The MTP module drafting (random weights: few drafts accepted): greedy tokens equal decoding without
    speculation, and every step's drafts are those of the module's full forward after the tokens so far (its
    cache holds the verified positions only: nothing a rejected draft or the chain wrote)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in MTP_PROMPTS]
    plain = Engine(mtp_model, MTP_ENGINE)
    for p in prompts:
        plain.add_request(RequestSpec(p, 10))
    want = [r.output_ids for r in plain.run()]
    extra = dict(offload="ess", pool_size=9) if offload == "ess" else {}
    engine = Engine(mtp_model, dataclasses.replace(MTP_ENGINE, speculative="mtp", num_speculative_tokens=k, **extra),
                    record_steps=True)
    ids = [engine.add_request(RequestSpec(p, 10)) for p in prompts]
    tokens, checked = {i: [] for i in ids}, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        batch = engine.scheduler.schedule_decode()  # the next step's plan: each row's drafts
        for row, request_id in enumerate(batch.request_ids if batch is not None else ()):
            if request_id is None:
                continue
            request = engine.requests[request_id]
            if checked < 6:
                so_far = request.prompt_ids + request.output_ids
                assert batch.drafts_BK[row].tolist() == reference_drafts(mtp_model, so_far, k)
                checked += 1
    assert [tokens[i] for i in ids] == want
    assert checked == 6
    spec = engine.speculative_metrics()
    assert spec["draft_tokens"] == k * spec["num_drafts"] > 0
    # the recorded steps time verifying and drafting apart, each within the decode step's time
    timed = [s for s in engine.stats.steps if s.draft_s is not None]
    assert len(timed) == sum(s.decode_s is not None for s in engine.stats.steps) > 0
    assert all(0 < s.verify_s and 0 < s.draft_s and s.verify_s + s.draft_s <= s.decode_s for s in timed)
    assert (spec["verify_s"], spec["draft_s"]) == tuple(statistics.median(getattr(s, f) for s in timed)
                                                       for f in ("verify_s", "draft_s"))
    all_free(engine)


def test_prometheus_counters_named_as_vllm():
    """``/metrics``'s speculative counters from a usage read: vLLM's spec_decode names, per position too."""
    from prometheus_client import generate_latest

    from ess_jax.engine.speculate import SpecStats
    from ess_jax.server.metrics import Metrics

    stats = SpecStats(accepted_per_position=[0, 0])
    for accepted in (2, 1, 0, 2):
        stats.record(2, accepted)
    report = stats.report()
    assert report["acceptance_rate"] == [0.75, 0.5] and report["mean_accepted_length"] == 2.25
    metrics = Metrics()
    metrics.usage({"rows_in_use": 1, "requests_waiting": 0, "pages_in_use": 2, "pages_total": 9,
                   "speculative": report})
    text = generate_latest(metrics.registry).decode()
    for line in ("ess_jax_spec_decode_num_drafts_total 4.0", "ess_jax_spec_decode_num_draft_tokens_total 8.0",
                 "ess_jax_spec_decode_num_accepted_tokens_total 5.0",
                 'ess_jax_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3.0',
                 'ess_jax_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0'):
        assert line in text

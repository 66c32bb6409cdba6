"""The ESS tier: exact against the resident cache for every pool size and fetch backend, honest
accounting, LRU invariants, and clear errors."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ess_jax
from ess_jax import ops, tier
from ess_jax.tier import lru_reference
from ess_jax.engine import Engine, EngineConfig, RequestSpec

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v32-a"  # index_topk 16
LENGTHS, NEW = (264, 136, 72), 16  # prefill pieces of 64 and 8: each prompt ends in one < tier.WARMUP_QUERIES
MAX_SEQ = max(LENGTHS) + NEW


def close(got, ref):
    """float32 agreement: 1e-5 of the logits' scale (the hit / miss halves merge by log-sum-exp, so
    sums are taken in another order than the single-pass softmax)."""
    got, ref = np.stack(got), np.stack(ref)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, np.abs(ref).max()))


@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model(FIXTURE)


def serve(model, **offload):
    engine = Engine(model, EngineConfig(max_batch=2, page_size=16, prefill_chunk=64, max_seq_len=MAX_SEQ,
                                        keep_logits=True, **offload))
    rng = np.random.default_rng(0)
    for n in LENGTHS:  # three requests, two rows: the third joins when the first leaves
        engine.add_request(RequestSpec(rng.integers(0, 256, n).tolist(), NEW))
    return engine, engine.run()


@pytest.fixture(scope="module")
def resident(model):
    return serve(model)[1]


POOLS = {"top_k+1": dict(pool_size=17), "2*top_k": dict(pool_size=32), "ratio 0.1": dict(pool_ratio=0.1),
         "ratio 0.5": dict(pool_ratio=0.5), "every entry": dict(pool_size=MAX_SEQ)}
# every pool size with one fetch backend, the smallest pool with both
RUNS = [("top_k+1", "inline"), ("top_k+1", "split"), ("2*top_k", "split"), ("ratio 0.1", "inline"),
        ("ratio 0.5", "split"), ("every entry", "inline")]


@pytest.fixture(scope="module")
def offloaded(model):
    """``offloaded(pool, fetch)``: the engine and requests of ``serve`` with ESS offload, each served once."""
    runs = {}

    def get(pool, fetch):
        if (pool, fetch) not in runs:
            runs[pool, fetch] = serve(model, offload="ess", fetch=fetch, **POOLS[pool])
        return runs[pool, fetch]
    return get


def test_runs_cover_every_pool_and_fetch_backend():
    assert {pool for pool, _ in RUNS} == set(POOLS)
    assert {fetch for _, fetch in RUNS} == set(tier.FETCH_BACKENDS)


@pytest.mark.parametrize("pool, fetch", RUNS)
def test_offload_is_exact(model, resident, offloaded, pool, fetch):
    engine, requests = offloaded(pool, fetch)
    for got, ref in zip(requests, resident):
        assert got.output_ids == ref.output_ids
        close(got.logits, ref.logits)
    metrics = engine.offload_metrics()
    row_bytes = model.cfg.latent_dim * 4
    for layer in metrics["per_layer"]:
        assert layer["hits"] + layer["misses"] == layer["lookups"] > 0
    assert metrics["h2d_bytes"] == metrics["misses"] * row_bytes
    decode_rows = sum(NEW - 1 for _ in LENGTHS)  # the first token of each request comes from prefill
    assert metrics["d2h_bytes"] == (sum(LENGTHS) + decode_rows) * model.cfg.num_hidden_layers * row_bytes
    assert metrics["decode_d2h_bytes"] == decode_rows * model.cfg.num_hidden_layers * row_bytes
    if pool == "top_k+1":
        assert metrics["misses"] > 0 and engine.layout.pool_slots == 17
    if pool == "every entry":
        assert metrics["misses"] == 0  # warm-up put every prompt entry in the pool; nothing is evicted


def test_split_and_inline_move_the_same_rows(offloaded):
    counts = [offloaded("top_k+1", f)[0].offload_metrics() for f in tier.FETCH_BACKENDS]
    assert counts[0] == counts[1]


def test_a_tpus_layer_slices_move_the_same_rows(model, offloaded):
    """Traced for a TPU (``ops.kernels_for``; XLA kernels), the pool is read and written through its layer's slice
    (``cache.layer_view``): the same tokens, logits bit for bit and counters as in place. The steps' traces are
    dropped before and after (the engine's jitted steps would otherwise be reused whatever the target)."""
    in_place, reference = offloaded("top_k+1", "inline")
    jax.clear_caches()
    with ops.kernels_for(ops.Device("tpu", "TPU v5p")):
        engine, requests = serve(model, offload="ess", fetch="inline", **POOLS["top_k+1"])
    jax.clear_caches()
    for got, ref in zip(requests, reference):
        assert got.output_ids == ref.output_ids
        np.testing.assert_array_equal(np.stack(got.logits), np.stack(ref.logits))
    assert engine.offload_metrics() == in_place.offload_metrics()


def test_device_bytes_are_the_real_arrays(model, offloaded):
    engine, _ = offloaded("ratio 0.1", "inline")
    cache, cfg = engine.runner.cache, model.cfg
    latent = cache.latent
    lru = latent.lru
    expected = (cache.index_keys.nbytes + latent.pool.nbytes + lru.slot_entry.nbytes + lru.slot_order.nbytes
                + lru.resident_slot.nbytes + latent.staged.nbytes + latent.staged_page.nbytes
                + latent.staged_offset.nbytes + latent.counters.nbytes + latent.query_counters.nbytes)
    report = engine.cache_bytes()
    assert report["device_bytes"] == expected
    assert report["host_bytes"] == latent.host.array.nbytes == \
        cfg.num_hidden_layers * engine.scheduler.allocators[0].num_pages * 16 * cfg.latent_dim * 4
    assert latent.host.array.sharding.memory_kind == "pinned_host"
    # the pool holds a fraction of what the resident latent pages would
    assert latent.pool.nbytes < 0.5 * report["resident_device_bytes"]


@pytest.mark.parametrize("dtype, width, step", [(jnp.float32, 24, {}), (jnp.uint8, 100, {}),
                                               (jnp.float32, 24, dict(new_entries=2, queries=4))])
def test_device_bytes_formula_is_the_tier_arrays(dtype, width, step):
    """``tier.device_bytes`` (the planner's and the engine's figure) against an ``init_tier`` tier's arrays (a
    verification step's tier: several new entries and query positions a step)."""
    shape = dict(layers=3, rows=2, slots=9, pages=7, page_size=16, rate=4, entries=11)
    tiered = tier.init_tier(**shape, width=width, dtype=dtype, fetch="split", **step)
    arrays = sum(x.nbytes for x in jax.tree.leaves(dataclasses.replace(tiered, host=None)))
    assert tier.device_bytes(layers=3, rows=2, slots=9, row_bytes=width * jnp.dtype(dtype).itemsize,
                             entries=11, **step) == arrays


@pytest.fixture(scope="module")
def tiny():
    return ess_jax.load_model("tiny-v32")


def test_long_prompt_far_beyond_the_pool(tiny):
    """tiny-v32 (index_topk 64), a 2048-token prompt, P = 65: inline equals resident."""
    prompt = np.random.default_rng(1).integers(0, 256, 2048).tolist()
    runs = []
    for offload in (dict(), dict(offload="ess", pool_size=65)):
        engine = Engine(tiny, EngineConfig(max_batch=1, page_size=64, prefill_chunk=512, keep_logits=True,
                                           max_seq_len=2048 + 6, **offload))
        engine.add_request(RequestSpec(prompt, 6))
        runs.append((engine, engine.run()[0]))
    (_, ref), (engine, got) = runs
    assert got.output_ids == ref.output_ids
    close(got.logits, ref.logits)
    assert engine.offload_metrics()["misses"] > 0


def test_bad_offload_settings_are_refused(model):
    with pytest.raises(ValueError, match="below the minimum 17"):
        Engine(model, EngineConfig(offload="ess", pool_size=16, max_seq_len=200))
    with pytest.raises(ValueError, match="--host-cache-mb"):
        Engine(model, EngineConfig(offload="ess", host_cache_mb=0.01, max_seq_len=200))
    with pytest.raises(ValueError, match="fetch backend"):
        EngineConfig(offload="ess", fetch="uva")
    with pytest.raises(ValueError, match="not a mode"):
        EngineConfig(offload="disk")
    with pytest.raises(ValueError, match=r"pool-ratio"):
        Engine(model, EngineConfig(offload="ess", pool_ratio=1.5, max_seq_len=200))


# ---- LRU resolution invariants --------------------------------------------------------------

RESOLVE = jax.jit(tier.resolve)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_lru_resolution_invariants(data):
    """Drive one (layer, request) pool through random top-k sequences against the reference LRU
    (``tier.lru_reference``, which keeps last-use stamps), and check every step: a hit keeps its slot and is
    never evicted, the new entry and then each miss (in id order) take the least recently used free slots by
    (stamp, slot), no slot holds two entries, the residency map and slot table are inverse, and the recency
    order equals the slots sorted by (stamp, slot). A step may write no new entry (V4's CSA layers add one
    only when a 4-token window closes)."""
    k = data.draw(st.integers(1, 6))
    slots = data.draw(st.integers(k + 1, k + 6))
    steps = data.draw(st.integers(1, 12))
    entry = np.full(slots, -1, np.int32)
    order = np.arange(slots, dtype=np.int32)
    newest = 2  # entries 0..2 exist before decoding starts
    reference = lru_reference.Pool(slots, entries=newest + 1 + steps)
    for _ in range(steps):
        has_new = data.draw(st.booleans())
        newest += has_new
        chosen = data.draw(st.lists(st.integers(0, newest), min_size=1, max_size=min(k, newest + 1), unique=True))
        ids = np.array(chosen + [-1] * (k - len(chosen)), np.int32)
        known = np.where(ids >= 0, reference.slot_of[ids], -1).astype(np.int32)
        new_id = np.int32(newest if has_new else -1)
        res = jax.tree.map(np.asarray, RESOLVE(ids, known, new_id[None], True, entry, order))
        hits = known >= 0
        assert (res.slot_K[hits] == known[hits]).all()  # a hit keeps its slot
        assert res.is_new_K.any() == (has_new and newest in chosen)
        misses = (ids >= 0) & ~hits & ~res.is_new_K
        assert (res.miss_K == misses).all()
        # the takers are the least recently used slots no hit holds: the new entry first, then the misses
        step = reference.step(ids, int(new_id))
        assert (step.miss_K == misses).all() and len(step.takers) == has_new + misses.sum()
        assert ([int(res.new_slot[0])] if has_new else []) + res.slot_K[misses].tolist() == step.takers
        assert res.taker_K1.tolist() == step.takers + [slots] * (k + 1 - len(step.takers))  # so no hit is evicted
        entry, order = res.slot_entry_P, res.order_P
        held = entry[entry >= 0]
        assert len(set(held.tolist())) == len(held)  # no entry in two slots
        resident = {int(e): int(s) for e, s in enumerate(reference.slot_of) if s >= 0}
        assert resident == {int(e): s for s, e in enumerate(entry) if e >= 0}  # inverse maps
        assert order.tolist() == reference.order_P.tolist()


WARM = jax.jit(tier.warm_layer, static_argnums=(2, 3))


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_warm_up_equals_the_reference(data):
    """``lru.warm_layer`` against ``lru_reference.Pool.warmed``: the slot table and the recency order after
    the warm-up queries' ids (4 queries of top-3 over 16 entries, 5 slots), for prompts that fit the pool or
    not."""
    ids_TK = np.array(data.draw(st.lists(st.lists(st.integers(-1, 15), min_size=3, max_size=3), min_size=4,
                                         max_size=4)), np.int32)
    count = data.draw(st.integers(1, 16))
    ids_TK = np.where(ids_TK < count, ids_TK, -1)  # ids of the prompt's entries
    entry_P, order_P = (np.asarray(x) for x in WARM(ids_TK, count, 5, 16))
    reference = lru_reference.Pool.warmed(ids_TK, count, 5, 16)
    assert entry_P.tolist() == reference.entry_P.tolist() and order_P.tolist() == reference.order_P.tolist()


# ---- FP8 rows ---------------------------------------------------------------------------------

def test_fp8_cache_error_is_bounded_and_bytes_shrink(tiny):
    """tiny-v32 (C 64, R 16): FP8 rows are 64 e4m3 + one f32 scale + 16 bf16 = 100 bytes against 160
    in bf16, and the indexer keys become 36-byte FP8 rows. First-token logits with FP8 rows stay within
    5e-3 of the logits' scale of the bf16 cache (measured: 2.2e-3; the keys' rounding can swap near-tied
    top-k picks, on top of the latent rows' rounding), and every byte count follows the row sizes."""
    prompt = np.random.default_rng(0).integers(0, 256, 300).tolist()
    runs = {}
    for cache_dtype in ("bfloat16", "fp8"):
        engine = Engine(tiny, EngineConfig(max_batch=1, keep_logits=True, offload="ess", pool_size=65,
                                           cache_dtype=cache_dtype, prefill_chunk=300, max_seq_len=306))
        engine.add_request(RequestSpec(prompt, 6))
        runs[cache_dtype] = (engine, engine.run()[0])
    (bf16, bf16_req), (fp8, fp8_req) = runs["bfloat16"], runs["fp8"]
    assert (bf16.layout.offloaded.row_bytes, fp8.layout.offloaded.row_bytes) == (160, 100)
    ref = bf16_req.logits[0]
    assert 0 < np.abs(fp8_req.logits[0] - ref).max() <= 5e-3 * np.abs(ref).max()
    assert fp8.runner.cache.latent.pool.dtype == jnp.uint8 and fp8.runner.cache.latent.width == 100
    # indexer keys (J 32): float32 in the bf16 run (the model's dtype), 32 e4m3 + one f32 scale in FP8
    keys = lambda engine: engine.runner.cache.index_keys.reshape(*engine.runner.cache.index_keys.shape[:2], 64, -1)  # noqa: E731
    assert keys(bf16).shape[-1] * keys(bf16).itemsize == 128
    assert keys(fp8).dtype == jnp.uint8 and keys(fp8).shape[-1] == 36
    # resident bytes per token and layer: 160 + 128 against 100 + 36
    assert fp8.cache_bytes()["resident_device_bytes"] * 288 == bf16.cache_bytes()["resident_device_bytes"] * 136
    for engine in (bf16, fp8):
        metrics, cache = engine.offload_metrics(), engine.cache_bytes()
        assert metrics["h2d_bytes"] == metrics["misses"] * engine.layout.offloaded.row_bytes
        assert cache["host_bytes"] == engine.runner.cache.latent.host.array.nbytes
    assert fp8.cache_bytes()["host_bytes"] * 160 == bf16.cache_bytes()["host_bytes"] * 100


def test_fp8_offload_is_exact_against_fp8_resident(model):
    """Offload stays exact in FP8: the tier moves the same bytes the resident FP8 cache holds."""
    runs = []
    for offload in (dict(), dict(offload="ess", pool_size=17)):
        engine = Engine(model, EngineConfig(max_batch=1, keep_logits=True, cache_dtype="fp8", prefill_chunk=64,
                                            max_seq_len=MAX_SEQ, **offload))
        engine.add_request(RequestSpec(np.random.default_rng(2).integers(0, 256, 192).tolist(), 10))
        runs.append(engine.run()[0])
    assert runs[0].output_ids == runs[1].output_ids
    close(runs[1].logits, runs[0].logits)
    assert engine.offload_metrics()["misses"] > 0

"""HiSparse: DeepSeek-V4's CSA entries in the host tier behind an LRU device pool (ess_jax.tier).

tiny-v4: layers (sliding, CSA, HCA, CSA), CSA rate 4, index_topk 16, head_dim 32, float32. Three
requests of 1024 / 512 / 512 prompt tokens (256 / 128 / 128 CSA entries) share two batch rows: the
third joins when the first leaves. Every offloaded run must give the resident run's tokens and
logits, and its counters must add up.
"""

from pathlib import Path

import jax
import numpy as np
import pytest

import ess_jax
from ess_jax import tier
from ess_jax.engine import Engine, EngineConfig, RequestSpec

PROMPTS = (1024, 512, 512)
NEW_TOKENS = (24, 40, 16)
MAX_SEQ_LEN = 1064  # 266 CSA entries per batch row
CSA_LAYERS = (1, 3)
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model("tiny-v4")


def _engine(model, **config) -> Engine:
    """The module's engine shapes: two batch rows of MAX_SEQ_LEN tokens, prefill pieces up to 1024 tokens."""
    return Engine(model, EngineConfig(max_batch=2, max_seq_len=MAX_SEQ_LEN, prefill_chunk=1024, keep_logits=True,
                                      **config))


def _serve(model, **config):
    engine = _engine(model, **config)
    rng = np.random.default_rng(0)
    for n, new in zip(PROMPTS, NEW_TOKENS):
        engine.add_request(RequestSpec(rng.integers(0, model.cfg.vocab_size, n).tolist(), new))
    return engine, engine.run()


@pytest.fixture(scope="module")
def resident(model):
    return _serve(model, offload="none")


@pytest.mark.parametrize("pool,fetch", [
    ("top_k + 1", "inline"), ("top_k + 1", "split"), ("ratio 0.1", "inline"),
    ("ratio 0.5", "split"), ("every entry", "inline"), ("every entry", "split"),
])
def test_offloaded_equals_resident_and_counts_add_up(model, resident, pool, fetch):
    cfg = model.cfg
    k, entries = cfg.index_topk, MAX_SEQ_LEN // cfg.compress_rate_csa
    size = {"top_k + 1": dict(pool_size=k + 1),
            "ratio 0.1": dict(pool_ratio=0.1), "ratio 0.5": dict(pool_ratio=0.5),
            "every entry": dict(pool_size=entries)}[pool]
    engine, requests = _serve(model, offload="ess", fetch=fetch, **size)
    ref_engine, ref = resident
    slots = {"ratio 0.1": 27, "ratio 0.5": 133}.get(pool, next(iter(size.values())))
    assert engine.layout.pool_slots == slots
    for got, want in zip(requests, ref):
        assert got.output_ids == want.output_ids
        scale = np.abs(np.asarray(want.logits)).max()
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=0, atol=1e-5 * scale)

    metrics = engine.offload_metrics()
    assert [c["layer"] for c in metrics["per_layer"]] == list(CSA_LAYERS)
    for c in metrics["per_layer"]:
        assert c["hits"] + c["misses"] == c["lookups"] > 0
    assert metrics["lookups"] == sum(c["lookups"] for c in metrics["per_layer"])
    # one query a step: its own ids are the union
    assert metrics["per_position"] == [{"position": 0, **{k: metrics[k] for k in ("lookups", "hits", "misses")}}]
    row_bytes = cfg.head_dim * 4
    assert metrics["h2d_bytes"] == metrics["misses"] * row_bytes
    # backed up: every prompt entry, then one entry per closed window of decode, per CSA layer
    closed = sum((n + new - 1) // 4 - n // 4 for n, new in zip(PROMPTS, NEW_TOKENS))
    assert metrics["d2h_bytes"] == (sum(PROMPTS) // 4 + closed) * len(CSA_LAYERS) * row_bytes
    assert metrics["decode_d2h_bytes"] == closed * len(CSA_LAYERS) * row_bytes
    if pool == "top_k + 1":
        assert metrics["misses"] > 0
    if pool == "every entry":
        assert metrics["misses"] == 0

    # the CSA entries left the device: host = the cache's pages (17 per row and the null page) of 16 entries,
    # device = resident - the entries' pages + pool; and the HCA layer's rings (--rings host: 128 float32 inputs
    # and gate logits of head_dim per batch row), but for each ring's newest row and its int32 slot
    got_bytes, ref_bytes = engine.cache_bytes(), ref_engine.cache_bytes()
    lc, b, pages, per_page = len(CSA_LAYERS), 2, 2 * 17 + 1, 64 // 4
    rings, kept = b * 128 * cfg.head_dim * 8, b * (cfg.head_dim * 8 + 4)
    assert got_bytes["host_bytes"] == lc * pages * per_page * row_bytes + rings
    assert got_bytes["resident_device_bytes"] == ref_bytes["device_bytes"]  # the three requests reserve every page
    tier_device = tier.device_bytes(layers=lc, rows=b, slots=slots, row_bytes=row_bytes, entries=17 * per_page)
    assert got_bytes["device_bytes"] == (ref_bytes["device_bytes"] - lc * pages * per_page * row_bytes + tier_device
                                         - rings + kept)


def test_bad_pool_and_host_budget_are_named(model):
    k = model.cfg.index_topk
    with pytest.raises(ValueError, match=rf"--pool-size {k} is below the minimum {k + 1}"):
        Engine(model, EngineConfig(max_batch=2, max_seq_len=MAX_SEQ_LEN, offload="ess", pool_size=k))
    page_mib = len(CSA_LAYERS) * 16 * model.cfg.head_dim * 4 / 2**20  # a page: 16 entries per CSA layer
    with pytest.raises(ValueError, match=rf"--host-cache-mb 0.01 holds 0 pages of {page_mib:.3f} MiB; the longest "
                                         "request needs 17: raise it to at least 1"):
        Engine(model, EngineConfig(max_batch=2, max_seq_len=MAX_SEQ_LEN, offload="ess", host_cache_mb=0.01))
    with pytest.raises(ValueError, match="too short for one entry"):
        Engine(model, EngineConfig(max_batch=2, max_seq_len=3, offload="ess"))


def test_pallas_kernels_match_xla():
    """--kernels pallas (interpret mode on CPU, about a second a token) through a HiSparse engine on the hf-v4-a
    fixture (top-k 8): the prefill's resident V4 attention and the tier's hit / miss halves run the Pallas kernel;
    tokens and logits match XLA."""
    model = ess_jax.load_model(FIXTURES / "hf-v4-a")
    prompt = np.random.default_rng(1).integers(0, model.cfg.vocab_size, 32).tolist()  # one prefill piece
    runs = []
    for kernels in ("xla", "pallas"):  # 32 + 12 tokens: 11 entries > 9 slots
        engine = Engine(model, EngineConfig(max_batch=1, max_seq_len=44, prefill_chunk=32, keep_logits=True,
                                            kernels=kernels, offload="ess", pool_size=model.cfg.index_topk + 1))
        engine.add_request(RequestSpec(prompt, 12))
        runs.append(engine.run()[0])
        assert engine.offload_metrics()["misses"] > 0
    assert runs[0].output_ids == runs[1].output_ids
    np.testing.assert_allclose(np.stack(runs[1].logits), np.stack(runs[0].logits), atol=1e-4)


def test_fp8_entries_bounded_exact_through_the_tier_and_counted(model):
    """--cache-dtype fp8 on V4: CSA entries as FP8 rows (tiny-v4: 48 e4m3 + 32 bf16 rope bytes + 1 ue8m0
    scale + 15 pad = 96 bytes, 16-byte aligned, against 256 in float32). Logits stay within 2e-3 of their scale of
    the float32 cache (measured 3.5e-4); the tier over FP8 rows equals the resident FP8 cache; byte
    counts follow the 96-byte row. The module's engine shapes: the float32 run is the resident fixture's steps."""
    prompt = np.random.default_rng(2).integers(0, model.cfg.vocab_size, 512).tolist()
    runs = {}
    for name, config in {"f32": dict(offload="none"), "fp8": dict(offload="none", cache_dtype="fp8"),
                         "fp8 tier": dict(offload="ess", cache_dtype="fp8",
                                          pool_size=model.cfg.index_topk + 1)}.items():
        engine = _engine(model, **config)
        engine.add_request(RequestSpec(prompt, 12))
        runs[name] = (engine, np.stack(engine.run()[0].logits))
    scale = np.abs(runs["f32"][1]).max()
    assert 0 < np.abs(runs["fp8"][1] - runs["f32"][1]).max() <= 2e-3 * scale
    np.testing.assert_allclose(runs["fp8 tier"][1], runs["fp8"][1], rtol=0, atol=1e-5 * scale)
    engine = runs["fp8 tier"][0]
    metrics = engine.offload_metrics()
    assert engine.layout.offloaded.row_bytes == 96 and metrics["misses"] > 0
    assert metrics["h2d_bytes"] == metrics["misses"] * 96
    pages = 2 * 17 + 1  # 17 pages of 16 entries per batch row and the null page; and the HCA layer's two rings
    assert engine.cache_bytes()["host_bytes"] == len(CSA_LAYERS) * pages * 16 * 96 + 2 * 128 * model.cfg.head_dim * 8
    resident_fp8, resident_f32 = runs["fp8"][0].cache_bytes(), runs["f32"][0].cache_bytes()
    assert resident_f32["device_bytes"] - resident_fp8["device_bytes"] == len(CSA_LAYERS) * pages * 16 * (256 - 96)


@pytest.mark.parametrize("offload", ["none", "ess"])
def test_a_short_request_occupies_its_pages_not_a_whole_row(model, offload):
    """An engine built for 16K-token requests; a 256-token request with 40 new tokens reserves the pages of
    296 tokens (5 pages of 64) and occupies that share of every paged array: the resident parts on the
    device (offload none) and the CSA entries in the host store (ess), measured from the arrays, are the
    cache parts' bytes for 296 tokens up to the last page's rounding, not those of a 16K-token row."""
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=16384, prefill_chunk=256, offload=offload,
                                        pool_size=model.cfg.index_topk + 1))
    engine.add_request(RequestSpec(np.random.default_rng(3).integers(0, model.cfg.vocab_size, 256).tolist(), 40))
    engine.step()  # admitted, prefilled in one piece
    pages, total = engine.usage()["pages_in_use"], engine.layout.size.pages
    assert pages == 5
    if offload == "none":  # every paged part on the device: CSA entries and indexer keys, HCA entries
        paged = [p for p in engine.layout.parts if p.tokens_per_row]
        arrays = [x for x in jax.tree.leaves(engine.runner.cache) if x.ndim >= 3 and x.shape[1] == total]
    else:  # the CSA entries in the host store
        paged = [engine.layout.offloaded]
        arrays = [engine.runner.cache.csa.entries.host.array]
    assert len(arrays) == len(paged)
    occupied = sum(x.nbytes * pages // total for x in arrays)  # the request's pages of each paged array
    assert occupied == sum(p.page_bytes(64) * pages for p in paged)
    wanted = sum(p.bytes(296) for p in paged)
    assert wanted <= occupied <= 1.25 * wanted < 0.05 * sum(p.bytes(16384) for p in paged)

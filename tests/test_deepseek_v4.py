"""DeepSeek-V4: parity with transformers' golden fixture, cached decode and chunked prefill against the
full forward, the compressors' step form, gradients, config parsing and checkpoint loading.

The fixture ``hf-v4-a`` (tools/make_hf_fixtures.py) has all three layer types (sliding window 16,
CSA 4:1 with index_topk 8, HCA 16:1), hash and routed MoE layers and every tensor random. Compiles
dominate the run time, so the step tests share a few jitted shapes (module-scoped fixtures).
"""

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx
from safetensors.numpy import save_file

import ess_jax
from ess_jax import ops
from ess_jax.cache import StepMeta, entries_per_page, entry_pages, locate
from ess_jax.checkpoint import CheckpointError, SafetensorsFile, hf_tensors
from ess_jax.config import ConfigError, RopeConfig, preset_dict
from ess_jax.families import load_config
from ess_jax.models.deepseek_v4.compressor import Compressor, TailRope
from ess_jax.models.deepseek_v4 import DeepseekV4
from ess_jax.models.deepseek_v4.names import release_to_hf_name
from ess_jax.models.layers import Buffer
from helpers import v4_release_name

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v4-a"
CAPACITY = 336  # >= 300-token prompt + 24 new tokens; one cache shape for every step test
PAGE = 16  # tokens per page: 4 CSA entries (4:1), 1 HCA entry (16:1)
PAGES = CAPACITY // PAGE
TABLE = np.arange(PAGES, 0, -1, dtype=np.int32)[None]  # the request's pages, reversed: page arithmetic must hold


def _close(got, want, what, rel=1e-4):
    got, want = np.asarray(got), np.asarray(want)
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(got - want).max()
    assert err <= rel * scale, f"{what}: max abs err {err:.3g} vs scale {scale:.3g}"


def _empty_cache(model):
    return model.module.init_cache(1, PAGES + 1, PAGE)


@pytest.fixture(scope="module")
def hf():
    """The fixture model and ``step(tokens, cache, start) -> (logits, cache)``: one request in batch row 0
    with the pages of ``TABLE``, its tokens from position ``start`` (params as arguments, cache donated)."""
    model = ess_jax.load_model(FIXTURE)
    graphdef = model.graphdef
    jitted = jax.jit(lambda p, tokens, meta, cache: nnx.merge(graphdef, p).step(tokens, meta, cache),
                     donate_argnums=3)

    def step(tokens, cache, start):
        tokens = np.asarray(tokens, np.int32)
        t = tokens.shape[1]
        meta = StepMeta(jnp.arange(start, start + t, dtype=jnp.int32)[None], jnp.ones((1, t), bool),
                        jnp.asarray(TABLE), jnp.zeros(1, jnp.int32))
        logits, _, cache = jitted(model.params, jnp.asarray(tokens, jnp.int32), meta, cache)
        return logits, cache

    ref = np.load(FIXTURE / "reference.npz")
    refs = [(ref[f"prompt_{i}"], ref[f"logits_{i}"], ref[f"generate_{i}"]) for i in range(2)]
    return model, step, refs


@pytest.fixture(scope="module")
def one_shot(hf):
    """The 300-token prompt prefilled in one step (batch 1): its logits and cache."""
    model, step, refs = hf
    prompt = refs[1][0]
    logits, cache = step(prompt[None], _empty_cache(model), 0)
    return np.asarray(logits[0]), jax.tree.map(np.asarray, cache)


# ---- parity with transformers ------------------------------------------------------------------


def test_logits_match_transformers(hf):
    model, _, refs = hf
    for prompt, logits, _ in refs:
        got = model.logits(prompt[None])[0]
        _close(got, logits, f"T={len(prompt)} full forward")
        np.testing.assert_array_equal(got.argmax(-1), logits.argmax(-1))


def _greedy(step, logits_BTV, cache, start, new_tokens):
    out = [int(jnp.argmax(logits_BTV[0, -1]))]
    for i in range(new_tokens - 1):
        logits_BTV, cache = step([[out[-1]]], cache, start + i)
        out.append(int(jnp.argmax(logits_BTV[0, -1])))
    return out


def test_token_by_token_decode_matches_full_forward_and_generate(hf):
    """Short prompt fed one token per step: every row equals transformers' no-cache logits, then greedy."""
    model, step, refs = hf
    prompt, logits, full = refs[0]
    cache = _empty_cache(model)
    rows = []
    for start, token in enumerate(prompt):
        row, cache = step([[token]], cache, start)
        rows.append(np.asarray(row[0, 0]))
    _close(np.stack(rows), logits, "decode rows vs transformers' full forward")
    assert _greedy(step, row, cache, len(prompt), len(full) - len(prompt)) == full[len(prompt):].tolist()


def test_one_shot_prefill_then_greedy_matches_generate(hf, one_shot):
    model, step, refs = hf
    prompt, logits, full = refs[1]
    got, cache = one_shot
    _close(got, logits, "T=300 one-shot prefill vs transformers")
    cache = jax.tree.map(jnp.asarray, cache)
    assert _greedy(step, jnp.asarray(got[None]), cache, len(prompt),
                   len(full) - len(prompt)) == full[len(prompt):].tolist()


def test_a_tpus_layer_slices_give_the_in_place_steps_values(hf, one_shot):
    """Traced for a TPU (``ops.kernels_for``, XLA kernels), the CSA entries and indexer keys and the HCA entries are
    written and read through their layer's slice (``cache.layer_view``): the 300-token prefill's logits and cache
    and three greedy decode steps after it equal the in-place steps' bit for bit (a jit of its own, so the trace is
    the TPU one)."""
    model, in_place, refs = hf
    graphdef = model.graphdef
    jitted = jax.jit(lambda p, tokens, meta, cache: nnx.merge(graphdef, p).step(tokens, meta, cache),
                     donate_argnums=3)

    def step(tokens, cache, start):
        t = len(tokens[0])
        meta = StepMeta(jnp.arange(start, start + t, dtype=jnp.int32)[None], jnp.ones((1, t), bool),
                        jnp.asarray(TABLE), jnp.zeros(1, jnp.int32))
        with ops.kernels_for(ops.Device("tpu", "TPU v5p")):
            logits, _, cache = jitted(model.params, jnp.asarray(tokens, jnp.int32), meta, cache)
        return logits, cache

    prompt = refs[1][0]
    logits, cache = step(prompt[None], _empty_cache(model), 0)
    np.testing.assert_array_equal(np.asarray(logits[0]), one_shot[0])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache), one_shot[1])
    reference = jax.tree.map(jnp.asarray, one_shot[1])
    for i in range(3):
        token = [[int(np.argmax(logits[0, -1]))]]
        logits, cache = step(token, cache, len(prompt) + i)
        want, reference = in_place(token, reference, len(prompt) + i)
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))


def test_chunked_prefill_matches_one_shot(hf, one_shot):
    """Chunks of 1, 3, 7 tokens (crossing every compression, window and top-k boundary) give the
    one-shot prefill's logits and exactly its cache (window ring, compressor rings, the entries in the
    request's pages; the null page takes the writes of windows still open, so it is left out)."""
    model, step, refs = hf
    prompt = refs[1][0]
    want_logits, want_cache = one_shot
    cache = _empty_cache(model)
    rows, start, sizes = [], 0, [1, 3, 7]
    while start < len(prompt):
        size = min(sizes[len(rows) % 3], len(prompt) - start)
        if size not in sizes:  # keep to the three compiled chunk shapes
            size = max(s for s in sizes if s <= size)
        chunk, cache = step(prompt[None, start:start + size], cache, start)
        rows.append(np.asarray(chunk[0]))
        start += size
    _close(np.concatenate(rows), want_logits, "chunked vs one-shot logits", rel=1e-5)
    paged = {id(x) for x in (cache.csa.entries.pages, cache.csa.index_keys, cache.hca.entries)}
    for path, got in jax.tree_util.tree_leaves_with_path(cache):
        want = dict(jax.tree_util.tree_leaves_with_path(want_cache))[path]
        if id(got) in paged:
            got, want = got[:, 1:], want[:, 1:]
        if np.issubdtype(np.asarray(want).dtype, np.floating):
            _close(np.where(np.isfinite(want), got, 0), np.where(np.isfinite(want), want, 0),
                   f"cache field {jax.tree_util.keystr(path)}", rel=1e-5)
        else:
            np.testing.assert_array_equal(got, want)


def test_cache_layout(hf, one_shot):
    """Window and rings are fixed-size per batch row; entries and indexer keys live in the request's pages,
    in entry order through its page table; every closed window was written, and no entry past them."""
    model, _, refs = hf
    cfg = model.cfg
    _, cache = one_shot
    h, j = cfg.head_dim, cfg.index_head_dim
    assert cache.window.shape == (4, 1, cfg.sliding_window, h)
    assert cache.csa.kv_ring.shape == (2, 1, 2 * 4, 2 * h) and cache.hca.kv_ring.shape == (1, 1, 16, h)
    assert cache.csa.index_kv_ring.shape == (2, 1, 8, 2 * j)
    assert cache.csa.entries.pages.shape == (2, PAGES + 1, PAGE // 4, h)
    assert cache.csa.index_keys.shape == (2, PAGES + 1, PAGE // 4 * j)  # a page's keys as one run
    assert cache.hca.entries.shape == (1, PAGES + 1, 1, h)
    for pages, written, width in ((cache.csa.entries.pages, 300 // 4, h), (cache.csa.index_keys, 300 // 4, j),
                                  (cache.hca.entries, 300 // 16, h)):
        in_order = pages[:, TABLE[0]].reshape(pages.shape[0], -1, width)  # entry e at e
        assert np.all(np.abs(in_order[:, :written]).sum(-1) > 0) and np.all(in_order[:, written:] == 0)
    bigger = model.module.init_cache(1, 2 * PAGES + 1, PAGE)
    rows = lambda c: [c.window.shape, c.csa.kv_ring.shape, c.csa.index_gate_ring.shape, c.hca.gate_ring.shape]  # noqa: E731
    assert rows(bigger) == rows(cache)


@pytest.mark.parametrize("page_size", [64, 4, 2, 1])
def test_entry_pages_hold_the_entries_locate_finds_in_order(page_size):
    """The indexer keys are read as whole pages (``cache.entry_pages``): per page size, with entries of 4 tokens,
    those pages in order hold exactly the entries the page table reaches where ``locate`` puts them, also where an
    entry spans pages and the table ends inside one."""
    table = jnp.asarray([[3, 9, 4, 1, 7, 2, 8]], jnp.int32)
    count = table.shape[1] * page_size // 4
    page, offset = locate(table, jnp.arange(count)[None], page_size=page_size, rate=4)
    pages, per_page = entry_pages(table, page_size=page_size, rate=4), entries_per_page(page_size, 4)
    assert pages.shape[1] * per_page == count
    np.testing.assert_array_equal(np.repeat(pages, per_page, axis=1), page)
    np.testing.assert_array_equal(np.tile(np.arange(per_page), pages.shape[1])[None], offset)


# ---- compressor step form ----------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False])
def test_compressor_step_matches_whole_sequence(overlap):
    """Entries from chunked steps (sizes 1, 2, 3, 9 > ring, ...) equal the whole-sequence entries."""
    rope = TailRope(RopeConfig(rope_type="yarn", theta=160000.0, factor=4.0, original_max_position_embeddings=64), 4)
    comp = Compressor(8, 6, 4, overlap=overlap, rope=rope, eps=1e-6, dtype=jnp.float32, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(1), 4)
    comp.position_bias[...] = jax.random.normal(keys[0], comp.position_bias.shape)
    comp.kv_norm.weight[...] = 1 + 0.1 * jax.random.normal(keys[1], comp.kv_norm.weight.shape)
    x = jax.random.normal(keys[2], (2, 31, 8))
    graphdef, state = nnx.split(comp)

    @jax.jit
    def run(state, x):
        comp = nnx.merge(graphdef, state)
        width = comp.kv_proj.weight.shape[0]
        ring_kv = ring_gate = jnp.zeros((2, comp.ring_size, width))
        entries, start = jnp.zeros((2, 8, 6)), 0
        for size in [1, 2, 3, 9, 1, 4, 5, 6]:  # boundaries m-1, m, m+1, chunks longer than the ring
            positions = jnp.broadcast_to(jnp.arange(start, start + size), (2, size))
            new, ids, closes, ring_kv, ring_gate = comp.close(x[:, start:start + size], positions, ring_kv, ring_gate)
            entries = entries.at[jnp.arange(2)[:, None], jnp.where(closes, ids, 8)].set(new, mode="drop")
            start += size
        assert start == 31
        return comp(x), entries

    want, entries = run(state, x)  # want: [2, 7, 6]
    _close(entries[:, :7], want, "step entries", rel=1e-5)
    assert np.all(np.asarray(entries[:, 7]) == 0)  # window 7 (tokens 28..31) is still open


def test_sink_attention_op():
    """The sink only enlarges the denominator; no valid row gives 0; lse merges partials exactly."""
    q = jax.random.normal(jax.random.key(0), (1, 2, 3, 4))
    rows = jax.random.normal(jax.random.key(1), (1, 2, 5, 4))
    valid = jnp.array([[[True, True, False, True, True], [False] * 5]])
    sinks = jnp.array([0.5, -1.0, 2.0])
    out, lse = ops.sparse_sink_attention(q, rows, valid, sinks, scale=0.5)
    logits = jnp.einsum("btnh,btkh->btnk", q, rows)[0, 0] * 0.5
    logits = jnp.where(valid[0, 0], logits, -jnp.inf)
    denom = jnp.exp(logits).sum(-1) + jnp.exp(sinks)
    np.testing.assert_allclose(out[0, 0], (jnp.exp(logits) / denom[:, None]) @ rows[0, 0], rtol=1e-5)
    np.testing.assert_allclose(out[0, 1], 0.0)
    # two halves with sinks = -inf merged by lse, then the sink, equal the whole
    half = jnp.array([True, True, False, False, False])
    o1, l1 = ops.sparse_sink_attention(q, rows, valid & half, jnp.full(3, -jnp.inf), scale=0.5)
    o2, l2 = ops.sparse_sink_attention(q, rows, valid & ~half, jnp.full(3, -jnp.inf), scale=0.5)
    lse12 = jnp.logaddexp(l1, l2)
    merged = (o1 * jnp.exp(l1 - lse12)[..., None] + o2 * jnp.exp(l2 - lse12)[..., None])
    merged = merged * jax.nn.sigmoid(lse12 - sinks)[..., None]
    np.testing.assert_allclose(merged[0, 0], out[0, 0], rtol=1e-5)


# ---- training form -----------------------------------------------------------------------------


def test_grad_of_loss(hf):
    """jax.grad through the full forward (indexer top-k, hash / top-k routing, mHC Sinkhorn)."""
    model, _, _ = hf
    graphdef, params, rest = nnx.split(model.module, nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 48)), jnp.int32)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))  # one compile serves the differences below too
    loss, grads = value_and_grad(params)
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(grads)}
    assert np.isfinite(float(loss)) and all(np.all(np.isfinite(g)) for g in flat.values())
    for needle in ["sinks", "compressor']['position_bias", "attn_hc']['fn", "hc_head']['hc_scale",
                   "experts']['gate_up_proj", "o_a_proj", "runs']['2']['self_attn']['compressor"]:
        assert any(needle in k and np.abs(g).max() > 0 for k, g in flat.items()), f"no gradient reaches {needle}"
    # The indexer only selects entries (top-k): no gradient reaches it, as in transformers.
    assert all(np.all(g == 0) for k, g in flat.items() if "indexer" in k)
    # A central difference along the head's parameters (after every discrete choice, so the loss is
    # smooth there; a direction through the whole model flips top-k / routing choices within any usable eps).
    tail = lambda k: any(n in k for n in ("hc_head", "'norm'", "lm_head"))
    draw = lambda k, p: jax.random.normal(jax.random.key(3), p.shape, p.dtype) * tail(jax.tree_util.keystr(k))
    direction = jax.jit(lambda params: jax.tree_util.tree_map_with_path(draw, params))(params)
    eps = 1e-2
    shift = jax.jit(lambda params, direction, s: jax.tree.map(lambda p, d: p + s * eps * d, params, direction),
                    static_argnums=2)
    shifted = lambda s: float(value_and_grad(shift(params, direction, s))[0])
    numeric = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
    dots = jax.jit(lambda g, d: [jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(d))])
    analytic = sum(float(x) for x in dots(grads, direction))
    assert abs(analytic) > 1e-3 and abs(numeric - analytic) <= 1e-2 * abs(analytic), (numeric, analytic)


# ---- config ------------------------------------------------------------------------------------


def test_real_presets_match_domain_schedules():
    flash, pro = load_config(preset_dict("deepseek-v4-flash")), load_config(preset_dict("deepseek-v4-pro"))
    csa, hca, swa = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
    assert (flash.layer_types[:2] == (swa, swa) and flash.layer_types.count(csa) == 21
            and flash.layer_types.count(hca) == 20)
    assert [i for i, t in enumerate(flash.layer_types) if t == csa] == list(range(2, 43, 2))
    assert pro.layer_types[:2] == (hca, hca) and pro.layer_types.count(csa) == 30 and pro.layer_types.count(hca) == 31
    for cfg, topk in [(flash, 512), (pro, 1024)]:
        assert cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",) and cfg.index_topk == topk
        assert cfg.qk_rope_head_dim == 64 and cfg.head_dim == 512 and cfg.sliding_window == 128
        assert cfg.rope.rope_type == "default" and cfg.rope.theta == 10000.0
        c = cfg.compress_rope
        assert (c.rope_type, c.theta, c.factor, c.original_max_position_embeddings) == ("yarn", 160000.0, 16.0, 65536)
        assert c.cos_sin_scale == 1.0  # no YaRN mscale on cos / sin (DOMAIN 2.3)
    assert ((flash.hidden_size, flash.o_groups, flash.n_routed_experts, flash.routed_scaling_factor)
            == (4096, 8, 256, 1.5))
    assert (pro.hidden_size, pro.o_groups, pro.n_routed_experts, pro.routed_scaling_factor) == (7168, 16, 384, 2.5)


def test_v4_defaults_legacy_keys_and_fallbacks():
    cfg = load_config({"model_type": "deepseek_v4", "num_hidden_layers": 5})
    hca, csa = "heavily_compressed_attention", "compressed_sparse_attention"
    assert cfg.layer_types == (hca, hca, hca, csa, hca)  # transformers' fallback: HCA at layer 2
    assert cfg.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 2
    assert (cfg.hidden_size, cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_topk, cfg.scoring_func) == (
        4096, 512, 64, 512, "sqrtsoftplus")
    assert cfg.compress_rope.rope_type == "default" and cfg.compress_rope.theta == 160000.0
    legacy = load_config({
        "model_type": "deepseek_v4", "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0],
        "num_hash_layers": 1, "qk_rope_head_dim": 32, "compress_rate_hca": 64,
        "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024}})
    assert (legacy.layer_types == ("sliding_attention", csa, hca)
            and legacy.mlp_layer_types == ("hash_moe", "moe", "moe"))
    assert legacy.qk_rope_head_dim == 32 and legacy.compress_rate_hca == 64 and legacy.compress_rate_csa == 4
    assert legacy.compress_rope.factor == 4 and legacy.compress_rope.attention_factor == 1.0
    assert legacy.n_group == 1  # V3.2's grouped-routing checks do not apply


def test_fixture_config_parses_like_transformers():
    raw = json.loads((FIXTURE / "config.json").read_text())
    cfg = load_config(raw)
    assert cfg.layer_types == tuple(raw["layer_types"]) and cfg.mlp_layer_types == tuple(raw["mlp_layer_types"])
    assert (cfg.compress_rate_csa, cfg.compress_rate_hca) == (4, 16) and cfg.qk_rope_head_dim == raw["qk_rope_head_dim"]
    assert cfg.compress_rope.original_max_position_embeddings == 8192 and cfg.compress_rope.cos_sin_scale == 1.0


@pytest.mark.parametrize("overrides, needle", [
    ({"layer_types": ["sliding_attention"]}, "layer_types has 1 entries"),
    ({"layer_types": ["full_attention"] * 2}, "layer_types="),
    ({"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types="),
    ({"compress_ratios": [0, 8]}, "compress_ratios"),
    ({"num_attention_heads": 6, "o_groups": 4}, "o_groups"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"index_head_dim": 32, "partial_rotary_factor": 0.125}, "index_head_dim"),
    ({"num_experts_per_tok": 9, "n_routed_experts": 8}, "num_experts_per_tok"),
    ({"hidden_size": "big"}, "hidden_size"),
])
def test_bad_v4_configs_name_the_field(overrides, needle):
    raw = {"model_type": "deepseek_v4", "num_hidden_layers": 2, **overrides}
    with pytest.raises(ConfigError, match=needle):
        load_config(raw)


def test_tiny_v4_preset_runs():
    model = ess_jax.load_model("tiny-v4")
    assert isinstance(model.module, DeepseekV4) and model.cfg.family == "deepseek_v4"
    assert set(model.cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"}
    assert set(model.cfg.mlp_layer_types) == {"hash_moe", "moe"} and model.cfg.vocab_size >= 258
    logits = model.logits(np.arange(40)[None])
    assert logits.shape == (1, 40, 320) and np.all(np.isfinite(logits))
    tid2eid = [np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model.module, Buffer)) if p[-1] == "tid2eid"]
    assert len(tid2eid) == 2 and all(t.min() >= 0 and t.max() < 8 for t in tid2eid)


# ---- checkpoints -------------------------------------------------------------------------------


def _stored_tensors() -> dict[str, np.ndarray]:
    f = SafetensorsFile(FIXTURE / "model.safetensors")
    return {k: np.array(f.get(k)) for k in f.keys()}


def _write(directory: Path, tensors: dict, config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    raw = json.loads((FIXTURE / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config or raw))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _params(module) -> dict[str, np.ndarray]:
    return hf_tensors(nnx.state(module))


def test_transformers_names_are_fixed_points_of_the_release_rename(hf):
    model, _, _ = hf
    names = _params(model.module)
    assert all(release_to_hf_name(n) == n for n in names)
    assert release_to_hf_name("layers.3.attn.indexer.compressor.norm.weight") == \
        "model.layers.3.self_attn.compressor.indexer.kv_norm.weight"
    assert release_to_hf_name("layers.0.hc_ffn_scale") == "model.layers.0.ffn_hc.scale"
    assert release_to_hf_name("layers.0.attn.wo_b.scale") == "model.layers.0.self_attn.o_b_proj.weight_scale_inv"


def _fp8_e8m0(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block FP8 with power-of-two (ue8m0) scales: (w8, scale e8m0, dequantized float32)."""
    out, inp = w.shape
    so, si = -(-out // block), -(-inp // block)
    padded = np.zeros((so * block, si * block), np.float32)
    padded[:out, :inp] = np.abs(w)
    amax = padded.reshape(so, block, si, block).max(axis=(1, 3))
    scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0))).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, block, 0), block, 1)[:out, :inp]
    w8 = (w / expanded).astype(ml_dtypes.float8_e4m3fn)
    return w8, scale.astype(ml_dtypes.float8_e8m0fnu), w8.astype(np.float32) * expanded


def _write_raw_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    codes = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
             np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0"}
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": codes[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_release_format_fp8_e8m0_sharded_with_mtp(hf, tmp_path):
    """Original release names, FP8 linears with ue8m0 block scales (16x16 blocks), per-expert w1/w2/w3,
    two shards + index and an ``mtp.*`` block: loads to exactly the dequantized weights."""
    model, _, _ = hf
    params = _params(model.module)
    release, expected = {}, dict(params)
    fp8 = (".wq_a.", ".wq_b.", ".wkv.", ".wo_a.", ".wo_b.", ".w1.", ".w2.", ".w3.")
    for name, value in params.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = v4_release_name(name).rsplit(".", 1)[0]  # layers.N.ffn.experts
            for e, w in enumerate(value):
                parts = {"w1": w[: w.shape[0] // 2], "w3": w[w.shape[0] // 2:]} if "gate_up" in name else {"w2": w}
                for part, weight in parts.items():
                    release[f"{prefix}.{e}.{part}.weight"] = weight.astype(np.float32)
        else:
            release[v4_release_name(name)] = value.astype(np.int64 if name.endswith("tid2eid") else value.dtype)
    quantized = {}
    for name, value in release.items():
        if name.startswith("layers.") and name.endswith(".weight") and any(p in name for p in fp8) \
                and "compressor" not in name:
            w8, scale, dequant = _fp8_e8m0(value, 16)
            quantized[name], quantized[name.removesuffix("weight") + "scale"] = w8, scale
            release[name] = dequant
        else:
            quantized[name] = value
    for name, value in release.items():  # what the loader must produce, back in transformers' layout
        hf_key = release_to_hf_name(name)
        if hf_key in expected:
            expected[hf_key] = value
    for layer in range(model.cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        r = f"layers.{layer}.ffn.experts."
        e = model.cfg.n_routed_experts
        expected[p + "gate_up_proj"] = np.stack([np.concatenate([release[f"{r}{i}.w1.weight"],
                                                                 release[f"{r}{i}.w3.weight"]])
                                                 for i in range(e)])
        expected[p + "down_proj"] = np.stack([release[f"{r}{i}.w2.weight"] for i in range(e)])
    quantized["mtp.0.emb.weight"] = np.ones((4, 4), np.float32)
    quantized["mtp.0.attn.wq_a.weight"], quantized["mtp.0.attn.wq_a.scale"] = _fp8_e8m0(
        np.ones((32, 32), np.float32), 16)[:2]
    names = list(quantized)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        _write_raw_safetensors(tmp_path / fname, {k: quantized[k] for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    raw = json.loads((FIXTURE / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": [16, 16]}
    raw["num_nextn_predict_layers"] = 0  # a model without the MTP module skips the block (tests/test_mtp.py loads it)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert any(k.endswith(".scale") and quantized[k].size > 1 for k in quantized)  # blocks really tile
    loaded = _params(ess_jax.load_model(tmp_path).module)
    assert loaded.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(loaded[name], expected[name], err_msg=name)


def test_bad_checkpoints_name_the_problem(tmp_path):
    tensors = _stored_tensors()
    missing = dict(tensors)
    del missing["model.layers.1.attn.compressor.ape"]
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.compressor\.position_bias "
                                              r"\(expected shape \[4, 64\]\)"):
        ess_jax.load_model(_write(tmp_path / "missing", missing))
    wrong = dict(tensors, **{"model.layers.2.attn.attn_sink": np.zeros((5,), np.float32)})
    with pytest.raises(CheckpointError, match=r"self_attn\.sinks has shape \[5\], config expects \[4\]"):
        ess_jax.load_model(_write(tmp_path / "shape", wrong))
    bad_ids = dict(tensors, **{"model.layers.0.ffn.gate.tid2eid": np.full((320, 2), 4, np.int64)})
    with pytest.raises(CheckpointError, match=r"tid2eid has expert ids in \[4, 4\], outside \[0, n_routed_experts=4\)"):
        ess_jax.load_model(_write(tmp_path / "ids", bad_ids))
    extra = dict(tensors, **{"model.layers.0.attn.bogus.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(CheckpointError, match=r"does not use: \['model\.layers\.0\.attn\.bogus\.weight'\]"):
        ess_jax.load_model(_write(tmp_path / "extra", extra))
    config = json.loads((FIXTURE / "config.json").read_text())
    config["num_hidden_layers"] = 5
    config["layer_types"] = config["layer_types"] + ["sliding_attention"]
    config["mlp_layer_types"] = config["mlp_layer_types"] + ["moe"]
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.4\."):
        ess_jax.load_model(_write(tmp_path / "layers", tensors, config))

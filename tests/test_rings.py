"""DeepSeek-V4's HCA compressor rings in the host tier (``ess_jax.tier.rings``, ``--rings host``).

- ``HostRings`` against a NumPy model of a ring per batch row, both fetch backends: a prompt's ring stored whole,
  tokens appended through the start-of-step backup, reads of no / some / every row whose window closes;
- engines on the hf-v4-a fixture (HCA windows of 16 tokens, so decode closes many of them): four requests on two
  batch rows (two wait and join as rows free) give with host rings exactly the tokens and logits of the rings on
  the device, the resident run's tokens; the arrays' bytes move from device to host by what the cache parts say;
- on meshes of data shards (tests/test_mesh.py: V4's ESS runs keep the rings in host memory, the default): the
  single-device tokens and logits;
- the planner: V4-Flash at 32K, FP8 entries, FP4 indexer keys, pool ratio 0.2 reaches 3x the KV capacity with the
  rings in host memory.
"""

import json

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import ess_jax
from ess_jax import families, plan, tier
from ess_jax.config import preset_dict
from ess_jax.engine import Engine, EngineConfig, RequestSpec
from ess_jax.families import load_config
from tests.helpers import FIXTURES

CHECKPOINT = str(FIXTURES / "hf-v4-a")
REQUESTS = ((16, 30), (32, 25), (16, 40), (48, 17))  # (prompt tokens, new tokens): prefill pieces of 16 only


# ---- HostRings against a NumPy model ------------------------------------------------------------

@pytest.mark.parametrize("fetch", ["inline", "split"])
def test_host_rings_store_append_and_read(fetch):
    layers, rows, slots, width = 2, 4, 8, 3
    rng = np.random.default_rng(0)
    want = np.zeros((2, layers, rows, slots, width), np.float32)  # kv, gate of every ring
    newest = np.zeros((2, layers, rows, width), np.float32)  # what the device holds
    rings = tier.init_host_rings(layers=layers, rows=rows, slots=slots, width=width, dtype=jnp.float32, fetch=fetch)
    store = jax.jit(lambda r, row, kv, gate: r.store_prompt(row, kv, gate))
    begin = jax.jit(lambda r, kv, gate: r.begin_step(kv, gate))
    read = jax.jit(lambda r, layer, closes, kv, gate: r.read(layer, closes, kv, gate))
    appended = jax.jit(lambda r, slot, ran: r.appended(slot, ran))
    for row in (0, 2, 3, rows):  # a row past the last stores nothing
        prompt = rng.standard_normal((2, layers, slots, width)).astype(np.float32)
        rings, kv0, gate0 = store(rings, row, prompt[0], prompt[1])
        if row < rows:
            want[:, :, row] = prompt
            newest[:, :, row] = prompt[:, :, 0]
        np.testing.assert_array_equal(np.stack([kv0, gate0]), prompt[:, :, 0])
    np.testing.assert_array_equal(np.asarray(rings.slot), 0)
    slot = np.zeros(rows, np.int32)
    # a few steps: rows 0, 2 (and on the last step 3) append a token at their next slot, then rings are read for
    # no row, one row (a compacted fetch: the budget of 4 rows is 1) and three rows (every row fetched)
    for step, (ran, closes) in enumerate([((1, 0, 1, 0), ()), ((1, 0, 1, 0), (2,)), ((1, 0, 1, 1), (0, 2, 3))]):
        rings = begin(rings, newest[0], newest[1])
        for layer in range(layers):
            got = read(rings, layer, np.isin(np.arange(rows), closes), newest[0, layer], newest[1, layer])
            for b in range(rows):
                expect = want[:, layer, b].copy() if b in closes else np.zeros((2, slots, width), np.float32)
                expect[:, slot[b]] = newest[:, layer, b]
                np.testing.assert_array_equal(np.stack(got)[:, b], expect, err_msg=f"step {step} row {b}")
        ran = np.asarray(ran, bool)
        slot = np.where(ran, (slot + 1) % slots, slot).astype(np.int32)
        token = rng.standard_normal((2, layers, rows, width)).astype(np.float32)
        newest = np.where(ran[None, None, :, None], token, newest)
        for b in np.flatnonzero(ran):
            want[:, :, b, slot[b]] = token[:, :, b]
        rings = appended(rings, slot, ran)
    rings = begin(rings, newest[0], newest[1])
    np.testing.assert_array_equal(np.stack([rings.kv.rows(), rings.gate.rows()]), want)


# ---- engines ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model(CHECKPOINT)


def _serve(model, **config):
    engine = Engine(model, EngineConfig(max_batch=2, page_size=8, max_seq_len=72, prefill_chunk=16, keep_logits=True,
                                        **config))
    rng = np.random.default_rng(0)
    for n, new in REQUESTS:
        engine.add_request(RequestSpec(rng.integers(0, model.cfg.vocab_size, n).tolist(), new))
    return engine, engine.run()


@pytest.fixture(scope="module")
def runs(model):
    return {name: _serve(model, **config) for name, config in {
        "resident": dict(offload="none"), "device": dict(offload="ess", rings="device"),
        "inline": dict(offload="ess", fetch="inline")}.items()}


def test_host_rings_equal_device_rings_and_the_resident_tokens(model, runs):
    m = model.cfg.compress_rate_hca
    # decode (positions n .. n + new - 2) closes HCA windows in every request
    assert all(any((p + 1) % m == 0 for p in range(n, n + new - 1)) for n, new in REQUESTS)
    _, device = runs["device"]
    for g, d in zip(runs["inline"][1], device):
        assert g.output_ids == d.output_ids
        np.testing.assert_array_equal(np.stack(g.logits), np.stack(d.logits))
    _, resident = runs["resident"]
    for g, r in zip(device, resident):
        assert g.output_ids == r.output_ids
        scale = np.abs(np.stack(r.logits)).max()
        np.testing.assert_allclose(np.stack(g.logits), np.stack(r.logits), rtol=0, atol=1e-5 * scale)


def test_ring_bytes_move_from_the_device_to_the_host_as_the_parts_say(model, runs):
    engine, _ = runs["inline"]
    device_engine, _ = runs["device"]
    got, ref = engine.cache_bytes(), device_engine.cache_bytes()
    rows = engine.layout.size.rows
    host_parts = [p for p in engine.layout.placed if p.where == "host"]
    kept = [p for p in engine.layout.placed if p.where == "fixed" and p not in engine.layout.parts]  # newest rows, slot
    assert [p.name for p in host_parts] == ["HCA compressor tails (fp32) in host"]
    moved = rows * sum(p.bytes(0) for p in host_parts)
    cfg = model.cfg
    assert moved == rows * cfg.layer_types.count("heavily_compressed_attention") * cfg.compress_rate_hca * \
        cfg.head_dim * 8  # float32 inputs and gate logits
    assert got["host_bytes"] - ref["host_bytes"] == moved
    assert ref["device_bytes"] - got["device_bytes"] == moved - rows * sum(p.bytes(0) for p in kept)
    assert engine.layout.device_bytes == got["device_bytes"] + got["prefill_scratch_bytes"]
    assert engine.layout.host_bytes == got["host_bytes"]
    assert device_engine.layout.device_bytes - engine.layout.device_bytes == ref["device_bytes"] - got["device_bytes"]


# ---- the planner --------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", [[], ["--mesh", "expert=8"]])
def test_planner_v4_flash_32k_reaches_3x_with_host_rings(mesh, capsys):
    """In KV bytes (a KV budget: the decode step's temporaries, which every request needs, left out)."""
    argv = ["--model", "deepseek-v4-flash", "--context", "32768", "--cache-dtype", "fp8", "--index-dtype", "fp4",
            "--pool-ratio", "0.2", "--rings", "host", "--rings", "device", "--formats", "release", "--kv-budget-gb",
            "112.9", "--json", *mesh]
    assert plan.main(argv) == 0
    rows = {r["rings"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["host"]["capacity_gain"] >= 3.0 > rows["device"]["capacity_gain"]
    # the HCA tails (20 layers of 128 x 512 float32 inputs and gate logits) leave the device but for each
    # ring's newest row and the int32 slot
    cfg = load_config(preset_dict("deepseek-v4-flash"))
    hca = cfg.layer_types.count("heavily_compressed_attention")
    tails = hca * 128 * 512 * 8
    assert rows["device"]["device_bytes_per_request"] - rows["host"]["device_bytes_per_request"] == \
        tails - hca * 512 * 8 - 4
    assert rows["host"]["host_bytes_per_request"] - rows["device"]["host_bytes_per_request"] == tails
    parts = families.host_rings(plan.cache_parts(cfg, "fp8", "fp4"))
    assert [p.where for p in parts if "HCA compressor" in p.name] == ["host", "fixed"]

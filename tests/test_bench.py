"""A tiny benchmark run: the JSON schema, consistent counters, locality in [0, 1], plots; argument errors."""

import json

import numpy as np
import pytest
from flax import nnx

from ess_jax import bench
from ess_jax.api import Model, load_model
from ess_jax.models.deepseek_v32 import DeepseekV32
from ess_jax.tokenizer import load_tokenizer
from helpers import small_v32, small_v32_json

RUN_KEYS = {"offload": str, "decode_tokens_per_s": float, "step_ms_p50": float, "step_ms_p99": float,
            "h2d_bytes_per_step": float, "device_bytes": int, "host_bytes": int}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The 2-layer test shape as a transformers checkpoint (through the bench's own writer), so the
    bench compiles little; loading it back also checks the writer."""
    cfg = small_v32()
    model = Model("small", DeepseekV32(cfg, rngs=nnx.Rngs(0)), load_tokenizer(None, cfg))
    directory = bench.save_hf_checkpoint(model, tmp_path_factory.mktemp("small-v32"), small_v32_json())
    loaded = load_model(directory)
    for (_, a), (_, b) in zip(nnx.to_flat_state(model.params), nnx.to_flat_state(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    return directory


def test_tiny_bench_json_follows_the_schema(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    code = bench.main(["--model", str(checkpoint), "--context", "256", "--new-tokens", "8", "--ratios", "0.5",
                       "--fetch", "inline", "--repeats", "1", "--warmup-steps", "2", "--locality-steps", "6",
                       "--stall-steps", "6", "--out", str(out), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    stall = result["stall"]  # the 256-token prompt admitted mid-run: one piece (prefill chunk 1024)
    assert stall["pieces"] == 1 and stall["prefill_chunk"] == 1024
    runs = result["runs"]
    assert [(r["offload"], r["pool_ratio"], r["fetch"]) for r in runs] == [("none", None, None), ("ess", 0.5, "inline")]
    for r in runs:
        for key, kind in RUN_KEYS.items():
            assert isinstance(r[key], kind), key
        assert r["decode_tokens_per_s"] > 0 and 0 < r["step_ms_p50"] <= r["step_ms_p99"]
        assert r["decode_steps"] == 7 and r["measured_steps"] == 5  # the first token comes from prefill; 2 dropped
    resident, ess = runs
    assert resident["hit_rate"] is None and resident["host_bytes"] == 0 and resident["h2d_bytes_per_step"] == 0
    assert resident["capacity_gain"] == 1.0
    assert 0 <= ess["hit_rate"] <= 1 and ess["host_bytes"] > 0 and ess["pool_slots"] == 132  # ceil(0.5 * 264)
    # per-layer counters add up, and the overall hit rate and bytes per step follow from them
    layers = ess["per_layer"]
    assert len(layers) == 2
    for c in layers:
        assert c["hits"] + c["misses"] == c["lookups"] > 0 and 0 <= c["hit_rate"] <= 1
    lookups, hits, misses = (sum(c[k] for c in layers) for k in ("lookups", "hits", "misses"))
    assert ess["hit_rate"] == pytest.approx(hits / lookups)
    row_bytes = (32 + 8) * 4  # float32 latent rows [c | k_rope]
    assert ess["h2d_bytes_per_step"] == pytest.approx(misses * row_bytes / ess["decode_steps"])
    assert ess["d2h_bytes_per_step"] == pytest.approx(2 * 2 * row_bytes)  # batch 2 x 2 layers, one row each
    # offload is exact: the same greedy tokens
    assert ess["tokens_match_resident"]
    assert ess["device_bytes"] < resident["device_bytes"] and ess["capacity_gain"] > 1
    locality = np.asarray(result["locality"])
    assert locality.shape == (2, 6) and ((0 <= locality) & (locality <= 1)).all()
    assert sorted(p.name for p in out.iterdir()) == ["hit_rate_per_layer.png", "locality_heatmap.png", "results.json",
                                                      "throughput_vs_ratio.png"]
    assert json.loads((out / "results.json").read_text())["runs"][1]["hit_rate"] == ess["hit_rate"]


@pytest.mark.parametrize("argv,needle", [
    (["--ratios", "0.5,2"], "--ratios 2"),
    (["--ratios", "x"], "--ratios"),
    (["--fetch", "inline,uva"], "--fetch"),
    (["--new-tokens", "3", "--warmup-steps", "2"], "--new-tokens 3"),
    (["--context", "0"], "--context 0"),
    (["--context", "16380", "--new-tokens", "8", "--prefill-chunk", "16384"], "max_position_embeddings"),
    (["--context", "8192", "--new-tokens", "8"], "no decode step of the whole batch"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--peer", "vllm"], "--peer"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(bench.main(argv + ["--out", str(tmp_path)]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and needle in err and err.count("\n") == 1


def test_topk_overlap_counts_valid_ids_of_the_current_set():
    current_LK = np.array([[5, 6, 7, -1], [1, 2, 3, 4], [-1, -1, -1, -1]])
    previous_LK = np.array([[6, 7, 8, 9], [1, 2, 3, 4], [1, 2, -1, -1]])
    np.testing.assert_allclose(bench.topk_overlap(current_LK, previous_LK), [2 / 3, 1.0, 0.0])


def test_peer_without_torch_says_so(tmp_path):
    from importlib.util import find_spec
    if find_spec("torch") and find_spec("transformers"):
        pytest.skip("torch and transformers are importable here: the peer would really run")
    args = bench.parse_args(["--peer", "hf", "--out", str(tmp_path)])
    peer = bench.run_peer(None, "tiny-v32", [[1, 2, 3]], args, log=print)
    assert peer["available"] is False and "--peer-python" in peer["reason"]


def test_prefill_stall_pass_interleaves_one_chunk_per_step(checkpoint):
    """The stall pass: a 256-token prompt admitted while two requests decode, prefill chunk 64: four steps
    carry one 64-token piece each, and every step still decodes the running requests."""
    import argparse

    args = argparse.Namespace(batch=2, context=256, stall_steps=6, prefill_chunk=64, kernels="xla", cache_dtype=None)
    rng = np.random.default_rng(0)
    stall = bench.prefill_stall(load_model(checkpoint), [rng.integers(0, 256, 256).tolist() for _ in range(2)], args,
                                log=lambda msg: None)
    assert stall["pieces"] == 4 and stall["prefill_chunk"] == 64
    assert 0 < stall["decode_step_ms"] and 0 < stall["prefill_piece_ms"] <= stall["prefill_step_ms_max"]

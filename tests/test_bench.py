"""A tiny benchmark run: the JSON schema, consistent counters, locality in [0, 1], plots; argument errors;
the locality pass's overlaps and its LRU replay, equal to the tier's own counters (V3.2 and V4)."""

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ess_jax import bench
from ess_jax.bench.args import parse_args
from ess_jax.bench.locality import Trace, topk_overlap, topk_trace, trace_overlaps
from ess_jax.bench.peer import run_peer
from ess_jax.bench.prompts import prompt_source
from ess_jax.bench.stall import prefill_stall
from ess_jax import checkpoint as checkpoints
from ess_jax.api import Model, load_model
from ess_jax.config import resolve_model
from ess_jax.engine import Engine, EngineConfig, RequestSpec
from ess_jax.families import load_config, source_config
from ess_jax.tier import lru_reference
from ess_jax.models.deepseek_v32 import DeepseekV32
from ess_jax.models.deepseek_v4 import DeepseekV4
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
    directory = checkpoints.save(model.params, small_v32_json(), tmp_path_factory.mktemp("small-v32"))
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
    locality = result["locality"]
    assert (locality["steps"], locality["layers"], locality["top_k"], locality["ids"]) == (6, [0, 1], 8, "positions")
    [at_256] = locality["contexts"]  # --locality-contexts defaults to --context
    assert (at_256["context"], at_256["prompt_entries"], at_256["entries"]) == (256, 256, 263)  # 256 + 6 steps + 1
    for key in ("raw_overlap", "shifted_overlap"):
        overlap = np.asarray(at_256[key])
        assert overlap.shape == (2, 6) and ((0 <= overlap) & (overlap <= 1)).all()
        np.testing.assert_allclose(at_256[f"{key}_mean"], overlap.mean(1), rtol=1e-6)
    # k + 1, 2k, 4k, then the default --pool-sweep ratios of 263 entries (never below k + 1)
    sweep = at_256["lru"]
    assert [(r["pool"], r["slots"]) for r in sweep] == [("k+1", 9), ("2k", 16), ("4k", 32), ("r=0.05", 14),
                                                        ("r=0.1", 27), ("r=0.2", 53), ("r=0.3", 79), ("r=0.5", 132)]
    for r in sweep:
        assert [c["lookups"] for c in r["per_layer"]] == [6 * 8, 6 * 8] and r["lookups"] == 2 * 6 * 8
        assert all(c["hits"] + c["misses"] == c["lookups"] for c in r["per_layer"]) and 0 <= r["hit_rate"] <= 1
    assert result["setup"]["prompt_source"] == {"kind": "random", "seed": 0, "tokens": 512, "stride": 256}
    assert sorted(p.name for p in out.iterdir()) == ["hit_rate_per_layer.png", "hit_rate_vs_pool.png",
                                                      "locality_heatmap.png", "results.json", "throughput_vs_ratio.png"]
    assert json.loads((out / "results.json").read_text())["runs"][1]["hit_rate"] == ess["hit_rate"]


@pytest.mark.parametrize("argv,needle", [
    (["--ratios", "0.5,2"], "--ratios 2"),
    (["--ratios", "x"], "--ratios"),
    (["--fetch", "inline,uva"], "--fetch"),
    (["--rings", "host,disk"], "--rings"),
    (["--index-dtype", "fp2"], "--index-dtype"),
    (["--new-tokens", "3", "--warmup-steps", "2"], "--new-tokens 3"),
    (["--context", "0"], "--context 0"),
    (["--context", "16380", "--new-tokens", "8", "--prefill-chunk", "16384"], "max_position_embeddings"),
    (["--context", "8192", "--new-tokens", "8"], "no decode step of the whole batch"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--peer", "vllm"], "--peer"),
    (["--pool-sweep", "0.1,0"], "--pool-sweep 0"),
    (["--locality-contexts", "16380", "--locality-steps", "8"], "--locality-contexts 16380"),
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
    np.testing.assert_allclose(topk_overlap(current_LK, previous_LK), [2 / 3, 1.0, 0.0])


def test_shifted_overlap_follows_a_set_that_moves_on_by_one():
    """Layer 0 reads the ids after last step's (a copying head): raw 0, shifted 1. Layer 1 stays: raw 1,
    shifted 0. Layer 2: a previous -1 (none) does not shift onto id 0."""
    previous_LK = np.array([[10, 20, 30, 40], [1, 5, 9, 13], [-1, 5, -1, -1]])
    current_LK = np.array([[11, 21, 31, 41], [1, 5, 9, 13], [0, 6, -1, -1]])
    np.testing.assert_allclose(topk_overlap(current_LK, previous_LK), [0.0, 1.0, 0.0])
    np.testing.assert_allclose(topk_overlap(current_LK, previous_LK, shift=1), [1.0, 0.0, 0.5])
    trace = Trace([0, 1, 2], 4, np.stack([previous_LK] * 32, axis=1), current_LK[:, None], np.array([-1]), 50, 52)
    raw_LS, shifted_LS = trace_overlaps(trace)  # step 0 against the last prompt position
    np.testing.assert_allclose(raw_LS[:, 0], [0.0, 1.0, 0.0])
    np.testing.assert_allclose(shifted_LS[:, 0], [1.0, 0.0, 0.5])


def _source_args(**overrides) -> argparse.Namespace:
    args = dict(batch=2, context=256, locality_steps=4, locality_contexts=[256], text=None, seed=0)
    return argparse.Namespace(**dict(args, **overrides))


def test_prompt_source_random_and_text_windows(tmp_path):
    cfg = small_v32()
    prompts, locality, source = prompt_source(_source_args(locality_contexts=[128, 600]), cfg, None)
    stream = np.random.default_rng(0).integers(0, cfg.vocab_size, 600).tolist()
    assert prompts == [stream[:256], stream[256:512]] and locality == {128: stream[:128], 600: stream}
    assert source == {"kind": "random", "seed": 0, "tokens": 600, "stride": 256}
    assert prompts[0] == np.random.default_rng(0).integers(0, cfg.vocab_size, 256).tolist()  # the prompts of before
    text = tmp_path / "code.py"
    text.write_text("def f(x):\n    return x + 1\n" * 16)  # 432 bytes
    tokenizer = load_tokenizer(None, cfg)
    prompts, locality, source = prompt_source(_source_args(text=str(text)), cfg, tokenizer)
    tokens = tokenizer.encode(text.read_text())  # bos + the bytes
    assert prompts == [tokens[:256], tokens[128:384]] and locality == {256: tokens[:256]}
    assert source == {"kind": "text", "file": str(text), "tokens": 433, "stride": 128} and len(tokens) == 433


def test_text_too_short_exits_2_naming_the_sizes(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("x" * 300)  # 301 tokens with the bos
    code = bench.main(["--model", "tiny-v32", "--text", str(text), "--context", "256", "--new-tokens", "8",
                       "--locality-contexts", "128", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --text {text} holds 301 tokens") and "384 needed" in err
    assert "--batch 2 prompts of --context 256 starting every 128 tokens end at token 384" in err


def test_a_shipped_checkpoints_text_is_cut_by_its_own_tokenizer(tmp_path, capsys):
    """tiny-v32-code's prompts are tokens of its BPE, not bytes: a text too short counts them so."""
    text = tmp_path / "code.py"
    text.write_text("def f(x):\n    return x + 1\n" * 16)  # 432 bytes
    source = resolve_model("tiny-v32-code")
    tokens = load_tokenizer(source.checkpoint, source_config(source)).encode(text.read_text())
    code = bench.main(["--model", "tiny-v32-code", "--text", str(text), "--context", "256", "--new-tokens", "8",
                       "--locality-contexts", "128", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --text {text} holds {len(tokens)} tokens") and len(tokens) < 432


def _counters(engine) -> list[list[int]]:
    return [[c["lookups"], c["hits"], c["misses"]] for c in engine.offload_metrics()["per_layer"]]


def lru_replay(trace, slots: int) -> np.ndarray:
    return lru_reference.replay(trace.warm_LTK, trace.ids_LSK, trace.new_S, trace.prompt_entries, trace.entries, slots)


def test_lru_replay_equals_the_tier_counters(checkpoint):
    """The locality pass's traces of the schema run's two prompts, replayed at the pool size of an ESS
    engine serving them for the same 6 decode steps, give the engine's device counters exactly: 132 slots
    (ratio 0.5 of 264) for 256-token prompts, so the pool evicts on every step. The engine and the traces
    have the schema run's shapes, so they reuse its compiled steps."""
    model = load_model(checkpoint)
    stream = np.random.default_rng(0).integers(0, model.cfg.vocab_size, 512).tolist()
    prompts, steps = [stream[:256], stream[256:]], 6
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=264, prefill_chunk=1024, offload="ess",
                                        pool_ratio=0.5))
    for prompt in prompts:
        engine.add_request(RequestSpec(prompt, steps + 1, ignore_eos=True))
    engine.run()
    traces = [topk_trace(model, prompt, steps, chunk=1024) for prompt in prompts]
    replay = sum(lru_replay(trace, engine.layout.pool_slots) for trace in traces)
    assert replay.tolist() == _counters(engine)
    assert 0 < replay[:, 1].sum() < replay[:, 0].sum()  # hits and misses both


def test_lru_replay_equals_the_hisparse_counters():
    """V4 (HiSparse): the replay over CSA entries (one new entry every 4th step) equals the tier's counters.
    One CSA layer of the hf-v4-a fixture's shape (top-k 8), so the compiles stay small; 128 prompt tokens
    (32 entries), top_k + 1 = 9 pool slots, 10 decode steps."""
    raw = json.loads((Path(__file__).parent / "fixtures" / "hf-v4-a" / "config.json").read_text())
    raw.update(num_hidden_layers=1, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"],
               hc_sinkhorn_iters=2)
    cfg = load_config(raw)
    # random weights drawn in NumPy into the abstract module (nnx's own init compiles an op per shape)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0))))
    rng, params = np.random.default_rng(0), []
    for path, variable in nnx.to_flat_state(state):
        shape = variable.get_value().shape
        value = (rng.normal(0, shape[-1] ** -0.5, shape) if len(shape) >= 2
                 else (path[-1] == "weight") + 0.1 * rng.normal(size=shape))  # norm weights near 1, the rest near 0
        params.append((path, variable.replace(jnp.asarray(value, jnp.float32))))
    model = Model("csa-v4", nnx.merge(graphdef, nnx.from_flat_state(params)), load_tokenizer(None, cfg))
    prompt, steps = np.random.default_rng(1).integers(0, cfg.vocab_size, 128).tolist(), 10
    engine = Engine(model, EngineConfig(max_batch=1, max_seq_len=128 + steps + 1, prefill_chunk=128, offload="ess",
                                        pool_size=cfg.index_topk + 1))
    engine.add_request(RequestSpec(prompt, steps + 1, ignore_eos=True))
    engine.run()
    trace = topk_trace(model, prompt, steps, chunk=128)
    assert trace.layers == [0] and (trace.prompt_entries, trace.entries) == (32, 34)
    assert trace.new_S.tolist() == [-1, -1, -1, 32, -1, -1, -1, 33, -1, -1]  # windows close at positions 131, 135
    replay = lru_replay(trace, engine.layout.pool_slots)
    assert replay.tolist() == _counters(engine)
    assert 0 < replay[:, 1].sum() < replay[:, 0].sum()


def test_peer_without_torch_says_so(tmp_path):
    from importlib.util import find_spec
    if find_spec("torch") and find_spec("transformers"):
        pytest.skip("torch and transformers are importable here: the peer would really run")
    args = parse_args(["--peer", "hf", "--out", str(tmp_path)])
    peer = run_peer(None, "tiny-v32", [[1, 2, 3]], args, log=print)
    assert peer["available"] is False and "--peer-python" in peer["reason"]


def test_prefill_stall_pass_interleaves_one_chunk_per_step(checkpoint):
    """The stall pass: a 256-token prompt admitted while two requests decode, prefill chunk 64: four steps
    carry one 64-token piece each, and every step still decodes the running requests."""
    args = parse_args(["--batch", "2", "--context", "256", "--stall-steps", "6", "--prefill-chunk", "64"])
    rng = np.random.default_rng(0)
    stall = prefill_stall(load_model(checkpoint), [rng.integers(0, 256, 256).tolist() for _ in range(2)], args,
                                log=lambda msg: None)
    assert stall["pieces"] == 4 and stall["prefill_chunk"] == 64
    assert 0 < stall["decode_step_ms"] and 0 < stall["prefill_piece_ms"] <= stall["prefill_step_ms_max"]

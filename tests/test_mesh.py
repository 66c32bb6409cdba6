"""The device mesh (ess_jax.mesh): ``--mesh`` parsing and its errors, and on 8 simulated CPU devices (a
subprocess: the device count is fixed before jax starts) greedy tokens identical to the single-device
engine for both families, resident and ESS, with requests joining and leaving."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ess_jax import mesh

FIXTURES = Path(__file__).parent / "fixtures"

# Runs in a subprocess with 8 CPU devices: argv = checkpoint, then runs as OFFLOAD:FETCH:MESH. Serves the same
# requests (three prompts on two batch rows per data shard: one waits and joins when a row frees, and they leave
# at different steps) on one device, resident (the reference) and ESS (the tier counters' reference), and in each
# run; prints the tokens, logits, shardings, tier counters (total and per data shard: lookups, hits, misses) and
# whether the compressor rings are in host memory (V4 with ESS, the default: split over the data shards too).
SCRIPT = r"""
import dataclasses, json, sys
import jax, numpy as np
import ess_jax
from ess_jax import families
from ess_jax.engine import Engine, EngineConfig, RequestSpec

model = ess_jax.load_model(sys.argv[1])
rng = np.random.default_rng(0)
requests = [(rng.integers(0, 256, n).tolist(), new) for n, new in ((16, 6), (32, 10), (16, 4))]
base = EngineConfig(max_batch=2, page_size=8, prefill_chunk=16, max_seq_len=72, keep_logits=True)  # test_rings' shapes


def config(run):
    offload, fetch, spec = run.split(":")
    rows = 2 * (int(spec.split("data=")[1].split(",")[0]) if "data=" in spec else 1)
    return dataclasses.replace(base, offload=offload, fetch=fetch, mesh=spec or None, max_batch=rows)


out = {}
for run in ["none:inline:", "ess:inline:", *sys.argv[2:]]:
    engine = Engine(model, config(run))
    for prompt, new in requests:
        engine.add_request(RequestSpec(prompt, new))
    first = sorted(out.request_id for out in engine.step())  # the requests whose prefill ended in the first step
    served = engine.run()
    tokens = [r.output_ids for r in served]
    experts = next(x for p, x in jax.tree_util.tree_leaves_with_path(engine.runner.params)
                   if "['experts']" in jax.tree_util.keystr(p))
    offload = engine.offload_metrics()
    counts = lambda c: [c["lookups"], c["hits"], c["misses"]]
    out[run] = {"tokens": tokens, "logits": [np.stack(r.logits).tolist() for r in served],
                "pool_slots": engine.layout.pool_slots, "first_step": first,
                "host_rings": any(p.where == "host" for p in engine.layout.placed),
                "counters": offload and {"total": counts(offload),
                                         "per_shard": [counts(c) for c in offload["per_shard"]]},
                "expert_shard": list(experts.addressable_shards[0].data.shape), "expert_shape": list(experts.shape),
                "cache_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(engine.runner.cache)
                                       if hasattr(x.sharding, "spec")}),
                "host_pages": engine.layout.size.pages, "host_shard": None}
    store = engine.config.offload == "ess" and families.get(model.cfg.family).store_of(engine.runner.cache).host
    if store and hasattr(store.array, "sharding"):  # the pinned store [G, Z * L * W]: each device its shard's pages
        out[run]["host_shard"] = store.array.addressable_shards[0].data.shape[0]
    elif store:  # the split backend's NumPy store: every shard's pages, each shard's callbacks reach its own
        out[run]["host_shard"] = store.array.shape[1] // engine.layout.size.shards
# a model loaded onto the mesh: the engine takes its parameters as they are, no second copy
placed = ess_jax.load_model(sys.argv[1], mesh=config(sys.argv[2]).mesh)
engine = Engine(placed, config(sys.argv[2]))
out["placed once"] = all(a is b for a, b in zip(jax.tree.leaves(placed.params), jax.tree.leaves(engine.runner.params)))
print(json.dumps(out))
"""


def _run(checkpoint: str, runs: list[str]) -> dict:
    # 8 CPU devices; LLVM's cheaper passes halve the compile time (the reference compiles with them too)
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 " \
            "--xla_llvm_disable_expensive_passes=true"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SCRIPT, checkpoint, *runs], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("family, runs, experts, entries", [
    # one latent row per token; 8 routed experts
    ("v32", ["none:inline:expert=8", "ess:inline:data=2,expert=4", "ess:split:data=2,expert=4", "ess:split:expert=8",
             "ess:inline:data=8"], 8, 72),
    # one CSA entry per 4 tokens; 4 routed experts
    ("v4", ["none:inline:data=2,expert=4", "ess:split:data=8", "ess:inline:data=2,expert=4"], 4, 18),
])
def test_mesh_tokens_equal_one_device(family, runs, experts, entries):
    """Resident and ESS (both fetch backends; V4's compressor rings in host memory) on meshes sharding the
    experts, the batch rows or both: the single-device resident engine's greedy tokens and logits, and ESS's
    per-shard tier counters adding up to the single-device tier's."""
    out = _run(str(FIXTURES / f"hf-{family}-a"), runs)
    alone = out["none:inline:"]
    assert out["placed once"]
    assert [len(t) for t in alone["tokens"]] == [6, 10, 4]
    assert alone["expert_shard"] == alone["expert_shape"] and alone["cache_specs"] == []  # one device
    for run in runs:
        offload, _, spec = run.split(":")
        got = out[run]
        assert got["tokens"] == alone["tokens"], run
        for logits, want in zip(got["logits"], alone["logits"]):
            scale = np.abs(np.asarray(want)).max()
            np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=0, atol=1e-5 * scale, err_msg=run)
        assert got["host_rings"] == (family == "v4" and offload == "ess"), run  # V4's HCA rings, the default
        shape = mesh.parse(spec)
        # each data shard prefills its own requests (its own prefill_chunk of 16 tokens a step): on one device the
        # first 16-token prompt alone ends its prefill in the first step; on data=8 both 16-token prompts, each on
        # its own shard (the 32-token one on a third)
        assert got["first_step"] == {1: [0], 2: [0], 8: [0, 2]}[shape.data], run
        assert got["expert_shard"][-3] == experts // shape.expert  # the routed experts are sharded ([(L,) E, out, in])
        if offload == "ess":
            assert got["pool_slots"] < entries  # the pools evict: the tier is exercised, not a resident copy
            # each data shard counts its own rows; together they are the single-device tier's counts
            counters, alone_counters = got["counters"], out["ess:inline:"]["counters"]
            assert len(counters["per_shard"]) == shape.data
            assert [sum(c) for c in zip(*counters["per_shard"])] == counters["total"] == alone_counters["total"]
            assert alone_counters["total"][0] > 0 and (
                shape.data == 1 or sum(c[0] > 0 for c in counters["per_shard"]) >= 2)
        # every cache array is split over the data shards: on its batch-row axis or its page axis (each shard's
        # own pool, residency map and host store)
        assert all("'data'" in s for s in got["cache_specs"]) == (shape.data > 1), got["cache_specs"]
        assert got["host_shard"] == (None if offload == "none" else got["host_pages"] // shape.data)


@pytest.mark.parametrize("flag, message", [
    ("expert={more}", "error: --mesh data=1,expert={more} has {more} devices but jax sees {n}"),
    ("data=2,expert=x", "error: --mesh 'data=2,expert=x': expert='x' must be a positive integer"),
])
def test_bad_mesh_flags_are_refused_before_the_model_loads(monkeypatch, capsys, flag, message):
    """A mesh of more devices than jax sees, or one that does not parse: one error line naming the numbers and
    the fix (the simulated device count), before any load."""
    import importlib
    import jax

    generate_cli = importlib.import_module("ess_jax.generate")  # ess_jax.generate is also the API function

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(generate_cli, "load_model", not_loaded)
    n = jax.device_count()
    flag, message = flag.format(more=n + 1), message.format(more=n + 1, n=n)
    assert generate_cli.main(["--model", "tiny-v32", "--prompt", "a", "--mesh", flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1, err
    if "devices" in message:
        assert f"XLA_FLAGS=--xla_force_host_platform_device_count={n + 1}" in err


def test_param_rules_shard_the_routed_experts_on_their_expert_axis():
    """Release-format weights (FP8 values and block scales): each routed expert tensor over ``expert`` on its
    axis of n_routed_experts, every other parameter replicated."""
    import jax
    from jax.sharding import PartitionSpec

    import ess_jax

    model = ess_jax.load_model(FIXTURES / "hf-v32-fp8", weights="release")
    routed = 0
    for path, x in jax.tree_util.tree_leaves_with_path(model.params):
        names, spec = mesh.path_names(path), mesh.param_spec(mesh.path_names(path), x.shape)
        if "experts" in names:  # values and scales of gate_up_proj and down_proj in the MoE run (layers 1, 2 stacked)
            routed += 1
            assert spec.index("expert") == x.ndim - 3 and x.shape[x.ndim - 3] == model.cfg.n_routed_experts
        else:
            assert spec == PartitionSpec(), names
    assert routed == 4


def test_parse():
    assert mesh.parse("data=2,expert=4") == mesh.MeshShape(data=2, expert=4)
    assert mesh.parse(" expert=8 ") == mesh.MeshShape(expert=8)
    assert str(mesh.parse("data=8")) == "data=8,expert=1"


@pytest.mark.parametrize("text, message", [
    ("data=2,expert", "is not AXIS=SIZE"),
    ("data=0", "must be a positive integer"),
    ("data=-1", "must be a positive integer"),
    ("data=two", "must be a positive integer"),
    ("data=1.5", "must be a positive integer"),
    ("pipeline=2", "unknown axis 'pipeline'; the axes are data, expert"),
    ("data=2,data=2", "given twice"),
    ("tensor=2", "tensor parallelism is not served yet"),
])
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        mesh.parse(text)


def test_engine_config_checks_the_mesh():
    from ess_jax.engine import EngineConfig

    with pytest.raises(ValueError, match="unknown axis"):
        EngineConfig(mesh="model=2")
    with pytest.raises(ValueError, match="--max-batch 3 does not divide over --mesh data=2"):
        EngineConfig(max_batch=3, mesh="data=2")
    with pytest.raises(ValueError, match="must be a string"):
        EngineConfig(mesh=8)


def test_bench_on_a_mesh_decodes_one_devices_tokens(tmp_path, capsys):
    """``python -m ess_jax.bench --mesh data=2,expert=2`` on 4 simulated CPU devices (a subprocess): the setup
    names the mesh and the devices, and every engine (resident, ESS) decodes the tokens the same bench gives on
    one device (this process)."""
    from ess_jax import bench

    argv = ["--model", str(FIXTURES / "hf-v32-a"), "--context", "24", "--new-tokens", "6", "--ratios", "0.5",
            "--fetch", "inline", "--repeats", "1", "--warmup-steps", "0", "--locality-steps", "0", "--stall-steps",
            "0", "--json"]
    assert bench.main([*argv, "--out", str(tmp_path / "one")]) == 0
    alone = json.loads(capsys.readouterr().out)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4 "
               "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    done = subprocess.run([sys.executable, "-m", "ess_jax.bench", *argv, "--mesh", "data=2,expert=2", "--out",
                           str(tmp_path / "mesh")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    meshed = json.loads(done.stdout)
    assert meshed["setup"]["mesh"] == "data=2,expert=2" and "(4 devices)" in meshed["setup"]["machine"]
    assert alone["setup"]["mesh"] is None
    assert [r["output_ids"] for r in meshed["runs"]] == [r["output_ids"] for r in alone["runs"]]
    assert len(meshed["runs"]) == 2

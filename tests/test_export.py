"""``python -m ess_jax.export`` lowers the engine's steps for abstract TPUs and NVIDIA GPUs at DeepSeek's real
shapes (the first layers of each model: ``--num-layers``), the ESS host store in pinned host memory, and writes
artifacts that deserialize; the decode step attends through the target's Pallas kernels, not the XLA gather; a
step that cannot lower for the target exits 2 with the lowering's message; what is exported takes the arguments
the engine's runner builds."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ess_jax import export, families, mesh
from ess_jax.api import Model
from ess_jax.engine import Engine, EngineConfig, cache_layout, plan, steps
from ess_jax.engine.plan import DecodeBatch
from ess_jax.tokenizer import load_tokenizer

SMALL = ["--offload", "ess", "--kernels", "auto", "--dtype", "bfloat16", "--max-batch", "2", "--max-seq-len", "4096"]
# family -> (layers, the kernel's name in the lowered module): V4-Flash's first CSA layer is its third, its first
# HCA layer (whose compressor rings the host tier holds) its fourth
MODELS = {"deepseek-v3.2": (1, "sparse_mla"), "deepseek-v4-flash": (4, "sparse_v4_attention")}
TARGETS = {  # (--platform, --device-kind) -> the kernels auto chooses, their custom call, a mark of their code
    ("tpu", "TPU v6 lite"): ("mosaic_tpu", "tpu_custom_call", "kernel_name = \"{name}\""),
    ("cuda", "NVIDIA H200"): ("mosaic_gpu", "mosaic_gpu_v2", "wgmma.mma_async"),
    ("cuda", "NVIDIA A100"): ("mosaic_gpu_sm80", "mosaic_gpu_v2", "mma.sync.aligned"),
}


def _export(out, model: str, layers: int, *flags: str) -> dict:
    """Run the CLI; its summary, having checked that every step the engine compiles was written."""
    export.main(["--model", model, "--num-layers", str(layers), *SMALL, *flags, "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    engine = summary["engine"]
    pieces = [f"prefill_{t}" for t in plan.piece_sizes(engine["prefill_chunk"], engine["prefill_piece_ratio"])]
    rows = ["row_state", "resume"] if model.startswith("deepseek-v4") else []  # the prefix cache's row-state snapshots
    assert list(summary["steps"]) == ["decode", *pieces, *rows, "handoff", "release", "flush", "load_prefix"]
    assert all((out / step["file"]).stat().st_size > 0 for step in summary["steps"].values())
    return summary


def _exported(out, step: str) -> jax.export.Exported:
    return jax.export.deserialize(bytearray((out / f"{step}.jax_export").read_bytes()))


def _host_bytes(model: str, layers: int, **config) -> int:
    """The host store's bytes on each device (one data shard's), from the configs alone."""
    config = EngineConfig(max_batch=2, max_seq_len=4096, offload="ess", **config)
    layout = cache_layout(export.model_config(model, layers), config, "bfloat16")
    return layout.host_bytes // layout.size.shards


@pytest.mark.parametrize("model, platform, kind, chunk", [
    ("deepseek-v3.2", "tpu", "TPU v6 lite", 2), ("deepseek-v3.2", "cuda", "NVIDIA A100", 1),
    ("deepseek-v4-flash", "tpu", "TPU v6 lite", 1), ("deepseek-v4-flash", "cuda", "NVIDIA H200", 1)])
def test_decode_runs_the_targets_kernels_over_the_host_tier(tmp_path, model, platform, kind, chunk):
    """Every step exports; the decode step's only kernel custom call is the chosen kernels' (one per attention
    source: the ready rows and the fetched misses; V4's sliding layers), and the host store reaches it and
    leaves it in pinned host memory, all of it on the one device."""
    layers, name = MODELS[model]
    summary = _export(tmp_path, model, layers, "--platform", platform, "--device-kind", kind,
                      "--prefill-chunk", str(chunk))
    kernels, call, mark = TARGETS[platform, kind]
    assert summary["kernels"] == kernels
    decode = summary["steps"]["decode"]
    assert set(decode["custom_calls"]) == {call, "annotate_device_placement"}
    exported = _exported(tmp_path, "decode")
    text = exported.mlir_module()
    assert exported.platforms == (platform,) and text.count(f"@{call}(") == decode["custom_calls"][call] >= 1
    # two sources attended by the kernel: two custom calls, or one kernel function called twice (sources of one shape)
    assert max(text.count(f"@{call}("), text.count(f"call @{name}(")) >= 2
    assert mark.format(name=name) in text
    host = _host_bytes(model, layers, prefill_chunk=chunk)
    assert (decode["argument_bytes_per_device"]["pinned_host"] == decode["output_bytes_per_device"]["pinned_host"]
            == host)
    assert text.count('mhlo.memory_kind = "pinned_host"') >= 2  # the store in and out


def test_on_a_mesh_each_device_holds_its_shard(tmp_path):
    """``--mesh data=2,expert=4`` of abstract TPUs: an 8-device program of the chosen kernels whose host store is
    split over the data shards and whose routed experts (V3.2's fourth layer is its first MoE layer) over
    ``expert``."""
    summary = _export(tmp_path, "deepseek-v3.2", 4, "--platform", "tpu", "--prefill-chunk", "1",
                      "--mesh", "data=2,expert=4")
    decode = summary["steps"]["decode"]
    assert _exported(tmp_path, "decode").nr_devices == 8 and summary["target"]["devices"] == 8
    assert set(decode["custom_calls"]) == {"tpu_custom_call", "annotate_device_placement"}
    assert decode["argument_bytes_per_device"]["pinned_host"] == _host_bytes("deepseek-v3.2", 4, mesh="data=2")
    cfg = export.model_config("deepseek-v3.2", 4)
    whole = export.abstract_engine(cfg, EngineConfig(max_batch=2, max_seq_len=4096), "bfloat16", 0,
                                   export.Target("tpu", "TPU v6 lite", mesh.MeshShape())).params
    experts = 3 * cfg.n_routed_experts * cfg.moe_intermediate_size * cfg.hidden_size * 2  # the MoE layer's, bf16
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(whole))
    caches = decode["argument_bytes_per_device"]["device"] - (params - experts * 3 // 4)  # and the step metadata
    assert 0 < caches < 2**26



@pytest.mark.parametrize("step", ["decode", "handoff"])
def test_the_steps_program_does_not_grow_with_the_batch(step):
    """V4-Flash's first four layers (a CSA layer's host tier and an HCA layer's host rings), ESS, lowered for a TPU at
    2 and at 64 requests: the same program (its operations within 1 %). The host store takes a step's rows (and a
    prompt's pages) in a loop, not one update per row unrolled, which at DeepSeek's batches (1906 for V4-Flash on 8
    H200s) made a program XLA:GPU did not compile in 10 minutes."""
    cfg, target = export.model_config("deepseek-v4-flash", 4), export.Target("tpu", "TPU v6 lite", mesh.MeshShape())
    sizes = []
    for batch in (2, 64):
        config = EngineConfig(max_batch=batch, max_seq_len=4096, offload="ess", kernels="xla")
        found = steps.catalog(families.get(cfg.family), config,
                              export.abstract_engine(cfg, config, "bfloat16", 0, target))
        text = export.export_step(step, found[step], target).mlir_module()
        sizes.append(sum(" = stablehlo." in line for line in text.splitlines()))
    assert abs(sizes[1] - sizes[0]) <= sizes[0] // 100, sizes  # (unrolled: 5101 -> 7708 decode, 921 -> 1788 handoff)

def test_a_step_the_target_cannot_run_exits_2_with_the_lowerings_message(tmp_path):
    """The split fetch backend's host callbacks need this process at run time, so its steps do not export."""
    run = subprocess.run([sys.executable, "-m", "ess_jax.export", "--platform", "tpu", "--model", "deepseek-v3.2",
                          "--num-layers", "1", *SMALL, "--fetch", "split", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    error = next(line for line in run.stderr.splitlines() if line.startswith("error: "))  # past plugins' logs
    assert error.startswith("error: the decode step does not lower for TPU v6 lite (tpu, mesh data=1,expert=1): "
                            "ValueError: AbstractMesh cannot be used when jaxpr contains primitives that require "
                            "devices"), run.stderr
    assert not (tmp_path / "summary.json").exists()


def test_kernels_the_target_cannot_run_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export.main(["--platform", "cuda", "--device-kind", "NVIDIA A100", "--model", "deepseek-v3.2", *SMALL,
                     "--kernels", "mosaic_gpu", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--kernels mosaic_gpu: mosaic_gpu needs TMA and wgmma" in capsys.readouterr().err


def test_the_export_takes_the_arguments_the_runner_builds():
    """The shapes the export lowers for are the arrays a real engine builds (tiny V3.2 with ESS on this CPU): the
    decode cache and the prefill scratch (each array's memory kind included: the host store in pinned host
    memory), the window and the decode step's arguments."""
    cfg = export.model_config("tiny-v32", None)
    module = nnx.eval_shape(lambda: families.get(cfg.family).module_cls(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(module)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)  # the weights' values do not matter here
    config = EngineConfig(max_batch=2, max_seq_len=64, page_size=16, offload="ess")
    engine = Engine(Model("tiny-v32", nnx.merge(graphdef, zeros), load_tokenizer(None, cfg)), config)
    target = export.Target("tpu", "TPU v6 lite", mesh.MeshShape())
    abstract = export.abstract_engine(cfg, config, "bfloat16", 0, target)
    runner = engine.runner
    decode = steps.catalog(families.get(cfg.family), config, abstract)["decode"]
    runs = runner.decode_args(DecodeBatch.idle(2, 4))
    pairs = [(abstract.params, runner.params), (abstract.cache, runner.cache),
             (abstract.scratch, engine.offload.scratch),
             (abstract.window, runner.window),
             ((*decode.args[1:3], decode.args[4]), (*runs[1:3], runs[4]))]  # tokens, step metadata, sampling
    for shapes, arrays in pairs:
        assert jax.tree.structure(shapes) == jax.tree.structure(arrays)
        for s, a in zip(jax.tree.leaves(shapes), jax.tree.leaves(arrays), strict=True):
            assert (s.shape, s.dtype) == (a.shape, a.dtype)
            assert ((s.sharding and s.sharding.memory_kind) or "device") == a.sharding.memory_kind
    assert any(a.sharding.memory_kind == "pinned_host" for a in jax.tree.leaves(runner.cache))

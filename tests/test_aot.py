"""``python -m ess_jax.export --compile``: the engine's steps compiled by libtpu (Mosaic TPU included) for compile-only
TPU devices, no TPU needed (skipped without libtpu, the ``aot`` / ``test`` extras' ``jax[tpu]``), at DeepSeek's shapes
cut to a few layers; and reading a compiled program (``ess_jax.aot``) on hand-written HLO."""

import json
import subprocess
import sys

import pytest

from ess_jax import aot

pytestmark = pytest.mark.aot
needs_libtpu = pytest.mark.skipif(not aot.available("tpu"), reason="compiling for TPUs needs jax[tpu] (libtpu)")

HLO = """HloModule step, entry_computation_layout={(bf16[4,8]{1,0})->bf16[4,8]{1,0}}

%body (carry: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %carry = (s32[], bf16[4,8]{1,0}) parameter(0)
  %x = bf16[4,8]{1,0} get-tuple-element(%carry), index=1
  %gathered = bf16[32,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %host = bf16[32,8]{1,0:S(5)} copy(%gathered)
  %back = bf16[4,8]{1,0} dynamic-slice(%host, %i, %i), dynamic_slice_sizes={4,8}
  %i = s32[] get-tuple-element(%carry), index=0
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%i, %back)
}

%cond (carry.1: (s32[], bf16[4,8])) -> pred[] {
  %carry.1 = (s32[], bf16[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p: bf16[4,8]) -> bf16[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,8]{1,0}) tuple(%zero, %p)
  %loop = (s32[], bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"61"}}
  %sum = bf16[4,8]{1,0} all-reduce(%p), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  %call = bf16[4,8]{1,0} custom-call(%sum), custom_call_target="tpu_custom_call"
  ROOT %out = bf16[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


class _Memory:
    argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes, temp_size_in_bytes = 100, 10, 0, 50
    generated_code_size_in_bytes = host_argument_size_in_bytes = host_output_size_in_bytes = 0
    host_temp_size_in_bytes = 0


class _Compiled:
    def memory_analysis(self):
        return _Memory()

    def as_text(self):
        return HLO

    def cost_analysis(self):
        return {"flops": 2e12, "bytes accessed": 1e9}


def test_analyze_counts_each_instruction_as_often_as_its_loops_run():
    """The loop body's all-gather and host copies run 61 times (the while loop's known trip count), the entry's
    all-reduce and custom call once; a copy into host memory (S(5)) moves its device operand out, a slice of it back
    moves its result in; the roofline is the slower of FLOPs and bytes."""
    report = aot.analyze(_Compiled(), aot.SPECS["v5p"])
    assert report["collectives"] == {"all-gather bf16[32,8]": {"count": 61, "bytes": 61 * 32 * 8 * 2},
                                     "all-reduce bf16[4,8]": {"count": 1, "bytes": 4 * 8 * 2}}
    assert report["custom_calls"] == {"tpu_custom_call": 1}
    assert report["device_to_host_bytes"] == 61 * 32 * 8 * 2 and report["host_to_device_bytes"] == 61 * 4 * 8 * 2
    assert report["bytes_per_device"]["total"] == 160 and report["fits"]
    assert report["roofline_s"] == pytest.approx(max(2e12 / 459e12, 1e9 / 2765e9))


def test_a_loop_without_a_known_trip_count_runs_its_conditions_bound():
    """XLA:TPU's scheduled HLO gives no known_trip_count: the condition ``i < 61`` bounds the loop; a condition
    bounded by data counts once."""
    bounded = HLO.replace(', backend_config={"known_trip_count":{"n":"61"}}', "").replace(
        "  ROOT %c = pred[] constant(true)",
        "  %i.1 = s32[] get-tuple-element(%carry.1), index=0\n  %n = s32[] constant(61)\n"
        "  ROOT %c = pred[] compare(%i.1, %n), direction=LT")
    assert "known_trip_count" not in bounded and "direction=LT" in bounded

    class Bounded(_Compiled):
        def as_text(self):
            return bounded

    assert aot.analyze(Bounded(), aot.SPECS["v5p"])["collectives"]["all-gather bf16[32,8]"]["count"] == 61
    unbounded = bounded.replace("%n = s32[] constant(61)", "%n = s32[] get-tuple-element(%carry.1), index=0")

    class Unbounded(_Compiled):
        def as_text(self):
            return unbounded

    assert aot.analyze(Unbounded(), aot.SPECS["v5p"])["collectives"]["all-gather bf16[32,8]"]["count"] == 1


def test_counted_flops_run_each_loop_body_as_often_as_its_loop():
    """XLA:GPU compile-only reports no cost; ``counted_flops`` runs XLA's own analysis over the optimized program,
    each loop body as often as its loop: here 10 matmuls of [64, 256] x [256, 256] in a loop over 5 x 2, where
    the analysis alone counts one (a program compiled for this CPU, whose compiler reports its FLOPs)."""
    import jax
    import jax.numpy as jnp

    def layers(x, w):
        def outer(i, x):
            return jax.lax.fori_loop(0, 2, lambda j, x: jnp.tanh(x @ w[2 * i + j]), x)
        return jax.lax.fori_loop(0, 5, outer, x)

    compiled = jax.jit(layers).lower(jax.ShapeDtypeStruct((64, 256), jnp.float32),
                                     jax.ShapeDtypeStruct((10, 256, 256), jnp.float32)).compile()
    matmul = 2 * 64 * 256 * 256
    assert compiled.cost_analysis()["flops"] == pytest.approx(matmul, rel=1e-3)  # the loops counted once
    assert aot.counted_flops(compiled.as_text()) == pytest.approx(10 * matmul, rel=1e-3)


def test_gpu_target_config_names_the_device():
    text = aot.gpu_target_config(aot.SPECS["H200"])
    assert "core_count: 132" in text and "major: 9" in text and 'device_description_str: "NVIDIA H200"' in text


def test_unknown_target_names_the_choices():
    with pytest.raises(ValueError, match="is not a compile target; use one of v5e, v6e, v5p, H100"):
        aot.spec("v4")


def _export(*args, out=None):
    return subprocess.run([sys.executable, "-m", "ess_jax.export", "--compile", *args,
                           *(["--out", str(out)] if out else [])], capture_output=True, text=True, timeout=900)


@needs_libtpu
def test_v32_ess_fp8_with_tpu_kernels_compiles_and_reports(tmp_path):
    """tiny-v32's shapes, ESS with FP8 rows (100 bytes), the TPU kernels: the decode and a prefill piece compile for
    a v6e chip and fit; the decode attends through the Mosaic TPU kernel and moves rows between host and device
    memory, far less than the host store."""
    run = _export("--target", "v6e", "--model", "tiny-v32", "--offload", "ess", "--cache-dtype", "fp8",
                  "--kernels", "auto", "--max-batch", "4", "--max-seq-len", "4096", "--prefill-chunk", "64",
                  "--steps", "decode,prefill_64", out=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["target"]["name"] == "v6e" and summary["kernels"] == "mosaic_tpu"
    decode, prefill = summary["steps"]["decode"], summary["steps"]["prefill_64"]
    assert decode["compiled"] and decode["fits"] and prefill["compiled"] and prefill["fits"]
    assert decode["custom_calls"]["tpu_custom_call"] >= 1
    store = 4 * 4 * 4096 * 100  # the host store: 4 layers, 4 requests, 4K tokens, 100-byte rows
    assert 0 < decode["host_to_device_bytes"] < store / 8, decode
    assert decode["flops"] > 0 and decode["roofline_s"] > 0
    assert "decode: arguments" in run.stdout and "2 of 2 steps compile and fit for v6e" in run.stdout


@needs_libtpu
def test_a_program_the_chip_cannot_hold_exits_2_naming_the_step(tmp_path):
    """tiny-v32 resident with caches for 4096 requests of 16K tokens (float32 latent rows, about 86 GB: far past a
    v5e's 15.75 GiB): the command exits 2 naming the decode, and the summary says why."""
    run = _export("--target", "v5e", "--model", "tiny-v32", "--offload", "none", "--max-batch", "4096",
                  "--max-seq-len", "16384", "--steps", "decode", out=tmp_path)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "decode: does not" in run.stderr or "decode: needs" in run.stderr, run.stderr[-2000:]
    assert not json.loads((tmp_path / "summary.json").read_text())["steps"]["decode"].get("fits", False)


@pytest.mark.skipif(not aot.available("cuda"), reason="compiling for NVIDIA GPUs needs jax's CUDA plugin")
def test_a_pinned_host_store_stays_in_host_memory_on_a_compile_only_gpu():
    """ESS's host store written in place with a step's new rows, compiled for an H200 (``compile_with_host_memory``):
    the store is an argument and the result in host memory (``S(5)``), aliased, and only the rows leave the device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    cpu = Mesh(np.array(jax.devices("cpu")[:1]), ("data",), axis_types=(AxisType.Auto,))
    host, device = NamedSharding(cpu, P(), memory_kind="pinned_host"), NamedSharding(cpu, P())
    write = jax.jit(lambda store, rows, at: jax.lax.dynamic_update_slice(
        store, jax.device_put(rows, jax.memory.Space.Host), (at, 0)), out_shardings=host, donate_argnums=0)
    store = jax.ShapeDtypeStruct((1 << 19, 576), jnp.bfloat16, sharding=host)  # 604 MB: 8192 pages of 64 rows
    rows = jax.ShapeDtypeStruct((16, 576), jnp.bfloat16, sharding=device)
    compiled = aot.compile_with_host_memory(write, (store, rows, jax.ShapeDtypeStruct((), jnp.int32, sharding=device)),
                                            aot.spec("H200"))
    head = compiled.as_text().splitlines()[0]
    assert "->bf16[524288,576]{1,0:S(5)}" in head and "(bf16[524288,576]{1,0:S(5)}," in head
    assert "input_output_alias={ {}: (0, {}" in head
    report = aot.analyze(compiled, aot.spec("H200"))
    sizes = report["bytes_per_device"]
    assert sizes["host_arguments"] == sizes["host_outputs"] == store.size * 2
    assert sizes["arguments"] < 32 << 10 and report["host_to_device_bytes"] == 0
    assert 0 < report["device_to_host_bytes"] <= 4 * rows.size * 2  # the rows (each copy stage counted), no store


@pytest.mark.skipif(not aot.available("cuda"), reason="compiling for NVIDIA GPUs needs jax's CUDA plugin")
def test_v32_ess_decode_compiles_for_an_h200_with_its_store_in_host_memory(tmp_path):
    """tiny-v32's shapes with ESS through the Hopper kernels, compiled for an H200 (traced on a CPU mesh, which has
    the pinned host memory kind compile-only GPUs lack): the host store is in host memory, in and out aliased, and a
    decode step moves far less than it between host and device."""
    run = _export("--target", "H200", "--model", "tiny-v32", "--offload", "ess", "--kernels", "auto",
                  "--max-batch", "4", "--max-seq-len", "4096", "--steps", "decode", out=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kernels"] == "mosaic_gpu"
    decode = summary["steps"]["decode"]
    assert decode["compiled"] and decode["fits"] and decode["custom_calls"]["mosaic_gpu_v2"] >= 1
    sizes = decode["bytes_per_device"]
    store = sizes["host_arguments"]  # the host store (and nothing else in host memory)
    assert store == sizes["host_outputs"] > 4 * 4 * 4096 * 64  # updated in place: 4 layers, 4 x 4K rows of 64+ bytes
    assert 0 < decode["host_to_device_bytes"] < store / 8, decode


@pytest.mark.skipif(not aot.available("cuda"), reason="compiling for NVIDIA GPUs needs jax's CUDA plugin")
@pytest.mark.parametrize("model", ["tiny-v32", "tiny-v4"])
@pytest.mark.parametrize("cache_dtype", [None, "fp8"])
def test_sm80_kernels_compile_for_an_a100(tmp_path, model, cache_dtype):
    """The ESS decode through the sm_80 kernels, compiled for an A100, float and FP8 rows: Mosaic GPU lowers them
    for sm_80, the target's, not for the sm_90 it assumes of the CPU devices the step is traced on (whose
    ``elect.sync`` the A100's LLVM cannot select: the compiler aborts), and decodes e4m3 bytes without FP8
    instructions, which sm_80 lacks (ptxas refuses ``cvt ... e4m3x2``: "Pass pipeline failed")."""
    run = _export("--target", "A100", "--model", model, "--offload", "ess", "--kernels", "auto", "--max-batch", "4",
                  "--max-seq-len", "4096", *(["--cache-dtype", cache_dtype] if cache_dtype else []),
                  "--steps", "decode", out=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kernels"] == "mosaic_gpu_sm80"
    decode = summary["steps"]["decode"]
    assert decode["compiled"] and decode["fits"] and decode["custom_calls"]["mosaic_gpu_v2"] >= 1


@needs_libtpu
def test_v4_flash_release_experts_dequantize_without_weight_sized_temporaries(tmp_path):
    """V4-Flash's first two layers with the release's FP4 experts on ``expert=8`` (32 experts a chip), 256 requests
    (past the dense-experts path: the grouped matmuls dequantize a layer's held experts), compiled for v5p: the step's
    temporaries stay near the dequantized experts' own (2 GiB of bfloat16 a layer); decoding e2m1 by a table lookup
    made them 133 GiB (its gather's int32 indices, the nibble pair padded to a lane tile)."""
    run = _export("--target", "v5p", "--model", "deepseek-v4-flash", "--num-layers", "2", "--weights", "release",
                  "--dtype", "bfloat16", "--offload", "none", "--cache-dtype", "fp8", "--max-batch", "256",
                  "--max-seq-len", "32768", "--mesh", "expert=8", "--steps", "decode", out=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    decode = json.loads((tmp_path / "summary.json").read_text())["steps"]["decode"]
    assert decode["compiled"] and decode["fits"]
    assert decode["bytes_per_device"]["temporaries"] < 8 * aot.GIB, decode["bytes_per_device"]


@needs_libtpu
@pytest.mark.parametrize("model,layers", [("deepseek-v3.2", 2), ("deepseek-v4-flash", 4)])
def test_an_ess_decode_moves_rows_not_the_store_within_1_5x_the_resident_flops(tmp_path, model, layers):
    """DeepSeek's first layers (V4-Flash: through its first CSA layers), FP8 entries, 16 requests of 32K, compiled
    for a v5p chip: the ESS decode's FLOPs stay within 1.5x the resident decode's, and its host traffic is the
    misses and the new rows, not the host store (under 5 % of it each way: about 1.6 % here, the miss buffers).
    Bringing the store through the device and re-laying it out made V3.2's 397 GFLOP against the resident step's
    68."""
    decodes = {}
    for offload in ("none", "ess"):
        run = _export("--target", "v5p", "--model", model, "--num-layers", str(layers), "--dtype", "bfloat16",
                      "--offload", offload, "--cache-dtype", "fp8", "--max-batch", "16", "--max-seq-len", "32768",
                      "--steps", "decode", out=tmp_path / offload)
        assert run.returncode == 0, run.stderr[-3000:]
        decodes[offload] = json.loads((tmp_path / offload / "summary.json").read_text())["steps"]["decode"]
    ess, resident = decodes["ess"], decodes["none"]
    assert 0 < resident["flops"] <= ess["flops"] <= 1.5 * resident["flops"], (ess["flops"], resident["flops"])
    store = ess["bytes_per_device"]["host_arguments"]  # the host store: every entry of every request
    assert store > 16 * 8192 * 584  # at least one layer's 16 x 8K FP8 V4 entries (V3.2: 2 x 16 x 32K latent rows)
    assert 0 < ess["host_to_device_bytes"] < store / 20 and 0 < ess["device_to_host_bytes"] < store / 20, ess
    assert resident["host_to_device_bytes"] == resident["device_to_host_bytes"] == 0

"""Expert parallelism (``mesh.over_experts``, ``layers.Experts``): on a mesh with an ``expert`` axis each device runs
the routed experts it holds over the tokens routed to them and the partial sums are added over the axis.

- No mesh: the sums over each device's share of the experts (``layers.routed_experts`` with ``first``) add up to a
  NumPy reference of DeepSeek's MoE (``sum_k w_k W2_k(silu(W1_k x) * W3_k x)``), for plain and release-format
  (FP8 block-scaled, FP4) expert weights, dense (a decode step's few tokens) and grouped (more tokens).
- Four simulated CPU devices (a subprocess): an MoE with top-k and with hash routing, plain and release-format weights,
  on ``expert=4`` and ``data=2,expert=2``, equal to one device's, its compiled program without an all-gather.
- Compile-only TPU devices (``aot``; needs libtpu): the MoE on a v5p 2x2x1 topology with ``expert=4`` moves no
  collective larger than the tokens' float32 activations and holds no temporary the size of a device's experts.
- Hopper's grouped matmul (``layers.hopper_grouped_matmul``, JAX's Mosaic GPU ragged dot) in the Mosaic GPU
  interpreter equals a NumPy reference; compiled for an H100 (``aot``; needs jax's CUDA plugin) the grouped form's
  work follows its rows, where XLA:GPU's ``ragged_dot`` (an A100's) multiplies every row by every expert.
"""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from ess_jax import aot
from ess_jax.models import layers
from ess_jax.models.layers import routed_experts
from ess_jax.models.quant import Fp4Values, Fp8Blocks

E, F, D, K, A = 8, 32, 64, 3, 10  # experts, expert width, hidden, experts per token, tokens


def _silu(x):
    return x / (1 + np.exp(-x))


def _reference(x, weights, experts, gate_up, down):
    """DeepSeek's routed MoE in NumPy, token by token: ``sum_k w_k W2_k(silu(W1_k x) * W3_k x)``."""
    out = np.zeros((len(x), down.shape[1]), np.float64)
    for a in range(len(x)):
        for w, e in zip(weights[a], experts[a]):
            gate, up = gate_up[e, :F] @ x[a], gate_up[e, F:] @ x[a]
            out[a] += w * (down[e] @ (_silu(gate) * up))
    return out


def _routing(rng):
    experts = np.stack([rng.permutation(E)[:K] for _ in range(A)]).astype(np.int32)  # distinct experts per token
    return rng.normal(size=(A, D)).astype(np.float32), rng.uniform(0.1, 1, (A, K)).astype(np.float32), experts


def _fp8(w):
    """Block FP8 (e4m3, float32 scales per 16 x 16 block) of ``w [E, out, in]``, and its dequantized value."""
    e, out, inp = w.shape
    blocks = np.abs(w).reshape(e, out // 16, 16, inp // 16, 16).max(axis=(2, 4)) / 448
    expanded = np.repeat(np.repeat(blocks, 16, 1), 16, 2)
    values = (w / expanded).astype(ml_dtypes.float8_e4m3fn)
    return Fp8Blocks(jnp.asarray(values), jnp.asarray(blocks.astype(np.float32)), (16, 16), 1, jnp.float32), \
        values.astype(np.float32) * expanded


def _fp4(w):
    """FP4 (e2m1 codes two a byte, the low nibble first; a power-of-two scale per 32 values) of ``w``, and its
    dequantized value."""
    e, out, inp = w.shape
    scale = np.exp2(np.ceil(np.log2(np.abs(w).reshape(e, out, inp // 32, 32).max(-1) / 6)))
    expanded = np.repeat(scale, 32, -1)
    codes = (w / expanded).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(np.int8)
    values = Fp4Values(jnp.asarray(packed), jnp.asarray(scale.astype(ml_dtypes.float8_e8m0fnu)), jnp.float32)
    return values, (w / expanded).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * expanded


@pytest.mark.parametrize("fmt", ["float32", "fp8", "fp4"])
@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("dense", [True, False])
def test_each_devices_experts_add_up_to_the_reference(fmt, devices, dense, monkeypatch):
    """The weighted sums over each device's experts (experts ``first .. first + E / devices - 1``), added, equal
    the reference over all experts, in both forms (every expert over every token; grouped matmuls over the tokens
    routed); tokens routed only elsewhere get nothing from a device."""
    monkeypatch.setattr(layers, "DENSE_TOKENS", A if dense else A - 1)
    rng = np.random.default_rng(0)
    x, weights, experts = _routing(rng)
    gate_up, down = rng.normal(size=(E, 2 * F, D)) / 8, rng.normal(size=(E, D, F)) / 6
    if fmt == "float32":
        stored = (jnp.asarray(gate_up, jnp.float32), jnp.asarray(down, jnp.float32))
    else:
        (stored_gate_up, gate_up), (stored_down, down) = (_fp8 if fmt == "fp8" else _fp4)(gate_up), \
            (_fp8 if fmt == "fp8" else _fp4)(down)
        stored = (stored_gate_up, stored_down)
    held = E // devices
    total = np.zeros((A, D))
    for device in range(devices):
        part = jax.tree.map(lambda w: w[device * held:(device + 1) * held], stored)
        got = np.asarray(routed_experts(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), *part,
                                        limit=None, first=device * held))
        untouched = ~((experts >= device * held) & (experts < (device + 1) * held)).any(-1)
        assert (got[untouched] == 0).all()
        total += got
    want = _reference(x, weights, experts, gate_up, down)
    np.testing.assert_allclose(total, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


# Runs with 4 simulated CPU devices: an MoE (top-k routed or hash routed, V4's clamped SwiGLU), its routed experts in
# float32 or in release formats, jitted on one device and on two meshes; prints the largest difference from one
# device's output, the output's scale and the compiled program's all-gathers on each mesh.
SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from ess_jax import mesh
from ess_jax.models.layers import MoE, Router
from ess_jax.models.quant import Fp4Values, Fp8Blocks


def case(hashed, fmt):
    rngs = nnx.Rngs(0)
    router = Router(64, 8, top_k=3, scoring="sqrtsoftplus" if hashed else "sigmoid", norm_topk_prob=True,
                    scaling=1.5, n_group=1 if hashed else 4, topk_group=1 if hashed else 2,
                    hash_vocab=300 if hashed else None, rngs=rngs)
    moe = MoE(64, 32, 8, 1, router=router, limit=10.0 if hashed else None, dtype=jnp.float32, rngs=rngs)
    for name in ("gate_up_proj", "down_proj"):  # lively weights, quantized as the releases store them
        param = getattr(moe.experts, name)
        w = np.asarray(param.get_value()) * 40
        if fmt == "fp8":
            param.set_value(Fp8Blocks(jnp.asarray(w.astype(jnp.float8_e4m3fn)), jnp.full(
                (8, w.shape[1] // 16, w.shape[2] // 16), 0.5, jnp.float32), (16, 16), 1, jnp.float32))
        elif fmt == "fp4":
            codes = np.random.default_rng(1).integers(0, 256, (*w.shape[:2], w.shape[2] // 2), np.uint8)
            param.set_value(Fp4Values(jnp.asarray(codes.view(np.int8)), jnp.full(
                (*w.shape[:2], w.shape[2] // 32), 0.25, jnp.float8_e8m0fnu), jnp.float32))
        else:
            param.set_value(jnp.asarray(w))
    graphdef, params = nnx.split(moe)
    x = jax.random.normal(jax.random.key(1), (4, 5, 64))
    tokens = jax.random.randint(jax.random.key(2), (4, 5), 0, 300)
    step = jax.jit(lambda params, x, tokens: nnx.merge(graphdef, params)(x, tokens if hashed else None))
    alone = np.asarray(step(params, x, tokens))
    out = {"scale": float(np.abs(alone).max())}
    for spec in ("expert=4", "data=2,expert=2"):
        devices = mesh.make(mesh.parse(spec))
        with jax.set_mesh(devices):
            placed = mesh.place_params(params, devices)
            got = np.asarray(step(placed, x, tokens))
            text = step.lower(placed, x, tokens).compile().as_text()
        out[spec] = {"diff": float(np.abs(got - alone).max()), "all_gathers": text.count("all-gather")}
    return out


print(json.dumps({run: case(run.split(":")[0] == "hash", run.split(":")[1]) for run in sys.argv[1:]}))
"""


def _subprocess(code: str, args: list[str], env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_moe_on_a_mesh_equals_one_device():
    """Top-k and hash routing, float32 and release-format experts: on ``expert=4`` and ``data=2,expert=2`` the
    MoE's output equals one device's (float32 sums in another order: within 1e-6 of its scale), and the compiled
    program gathers nothing (the tokens are on every device of the expert group already)."""
    runs = ["topk:float32", "hash:float32", "topk:fp8", "hash:fp4"]
    out = _subprocess(SCRIPT, runs, {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
                                     + " --xla_force_host_platform_device_count=4"})
    for run in runs:
        assert out[run]["scale"] > 0.1, (run, out)
        for spec in ("expert=4", "data=2,expert=2"):
            assert out[run][spec]["diff"] <= 1e-6 * out[run]["scale"], (run, spec, out)
            assert out[run][spec]["all_gathers"] == 0, (run, spec, out)


# Runs with compile-only TPU devices (v5p 2x2x1, four chips): the MoE of a V3.2-like layer (hidden 1024, 64 experts
# of width 512, top 8) jitted on ``expert=4`` for a decode step's tokens (dense form) and a prefill piece's (grouped:
# the Pallas grouped matmul), compiled; prints per form every collective (kind and bytes), the temporaries and the
# bytes of the experts one device holds.
AOT = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from ess_jax import mesh
from ess_jax.models.layers import MoE, Router

devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
tpu = Mesh(np.array(devices).reshape(1, 4), mesh.AXES, axis_types=(AxisType.Auto,) * 2)
hidden, width, experts = 1024, 512, 64
router = Router(hidden, experts, top_k=8, scoring="sigmoid", norm_topk_prob=True, scaling=2.5, n_group=8,
                topk_group=4, rngs=nnx.Rngs(0))
graphdef, params = nnx.split(nnx.eval_shape(lambda: MoE(hidden, width, experts, 1, router=router,
                                                        dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
sizes = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1}
out = {}
with jax.set_mesh(tpu):
    shapes = jax.tree_util.tree_map_with_path(lambda path, x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=mesh.param_sharding(tpu, mesh.path_names(path), x.shape)), params)
    for form, tokens in (("decode", 16), ("prefill", 256)):
        x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16, sharding=NamedSharding(tpu, PartitionSpec()))
        compiled = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x)).lower(shapes, x).compile()
        found = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* (all-gather|all-to-all|reduce-scatter|all-reduce|"
                           r"collective-permute|ragged-all-to-all)(?:-start)?\(", compiled.as_text())
        out[form] = {"tokens": tokens, "temp": compiled.memory_analysis().temp_size_in_bytes,
                     "collectives": [(kind, sizes[dtype] * int(np.prod([int(d) for d in dims.split(",") if d])))
                                     for dtype, dims, kind in found]}
out["experts_per_device"] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["experts"])) // 4
out["hidden"] = hidden
print(json.dumps(out))
"""


@pytest.mark.aot
@pytest.mark.skipif(not aot.available("tpu"), reason="compiling for TPUs needs jax[tpu] (libtpu)")
def test_tpu_expert_parallel_moves_tokens_not_weights():
    """Compiled for a v5p 2x2x1 topology on ``expert=4`` (compile-only devices: nothing runs), a decode step's
    MoE (dense form) and a prefill piece's (grouped, the Pallas grouped matmul reading the weights as stored): one
    all-reduce, no larger than the tokens' float32 activations (``f32[A, D]``), and no other collective; no
    temporary half the size of the experts one device holds (their ``gate_up_proj`` alone is two thirds: no
    weights gathered or re-laid out)."""
    out = _subprocess(AOT, [], {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    for form in ("decode", "prefill"):
        got = out[form]
        assert [kind for kind, _ in got["collectives"]] == ["all-reduce"], (form, got)
        assert all(size <= got["tokens"] * out["hidden"] * 4 for _, size in got["collectives"]), (form, got)
        assert got["temp"] < out["experts_per_device"] / 2, (form, got, out["experts_per_device"])


def test_hopper_grouped_matmul_in_its_interpreter_equals_the_reference():
    """Hopper's grouped matmul, run in the Mosaic GPU interpreter over bfloat16 rows in groups of 30, 0 and 50 (a
    partial row tile, an empty group, rows past the groups) and weights stored ``[G, N, K]``: each row in a group
    times its group's weights transposed, within bfloat16's rounding of the output."""
    rng = np.random.default_rng(0)
    sizes = np.array([30, 0, 50], np.int32)
    x = rng.normal(size=(100, 64)).astype(ml_dtypes.bfloat16)
    w = rng.normal(size=(3, 128, 64)).astype(ml_dtypes.bfloat16)
    assert layers.hopper_tiles(x.shape, w.shape, jnp.bfloat16, jnp.bfloat16)
    with plgpu.force_gpu_interpret_mode():
        got = np.asarray(jax.jit(layers.hopper_grouped_matmul)(x, w, sizes), np.float32)
    group = np.repeat(np.arange(3), sizes)
    want = np.einsum("mk,mnk->mn", x[:80].astype(np.float64), w[group].astype(np.float64))
    np.testing.assert_allclose(got[:80], want, rtol=0, atol=np.abs(want).max() * 2 ** -8)


# Runs with compile-only NVIDIA devices (XLA:GPU from a spec): the routed experts of a V4-like layer on one device
# (hidden 1024, 32 experts of width 512 held, top 6, bfloat16) in the grouped form (255 tokens: 1530 token copies, not
# a whole number of 8-row tiles), traced on the CPU and compiled for each target given; prints per target the grouped
# matmul kernels (custom calls in the grouped_matmul scope), the FLOPs counted and those of each token copy times its
# own expert.
CUDA = r"""
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_platforms", "cpu")
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ess_jax import aot, export, ops
from ess_jax.models.layers import routed_experts

tokens, hidden, width, held, k = 255, 1024, 512, 32, 6
cpu = NamedSharding(Mesh(np.array(jax.devices("cpu")[:1]), ("x",)), PartitionSpec())
args = [jax.ShapeDtypeStruct(shape, dtype, sharding=cpu) for shape, dtype in (
    ((tokens, hidden), jnp.bfloat16), ((tokens, k), jnp.float32), ((tokens, k), jnp.int32),
    ((held, 2 * width, hidden), jnp.bfloat16), ((held, hidden, width), jnp.bfloat16))]
out = {"own": 2.0 * tokens * k * 3 * hidden * width}
for target in sys.argv[1:]:  # a jit of its own each: the kernels are chosen at trace time
    step = jax.jit(lambda x, w, e, gate_up, down: routed_experts(x, w, e, gate_up, down, limit=None, first=0))
    s = aot.spec(target)
    capability = ops.compute_capability("", s.kind)
    with export.mosaic_gpu_arch(capability), ops.kernels_for(ops.Device("cuda", s.kind, capability)):
        compiled = aot.compile_with_host_memory(step, args, s)
    text = compiled.as_text()
    out[target] = {"kernels": len(re.findall(r'custom-call\(.*op_name="[^"]*/grouped_matmul/', text)),
                   "flops": compiled.cost_analysis()["flops"]}
print(json.dumps(out))
"""


@pytest.mark.aot
@pytest.mark.skipif(not aot.available("cuda"), reason="compiling for NVIDIA GPUs needs jax's CUDA plugin")
def test_hopper_grouped_form_works_on_the_rows_routed():
    """Compiled for an H100, the grouped form's two matmuls are Hopper's grouped matmul kernels and the step's
    FLOPs (the kernels' counted as every token copy in a group) are within 1.5 x each copy times its own expert's
    weights; for an A100, XLA:GPU's ``ragged_dot`` is a dense matmul over all 32 experts: 16 x that at least."""
    out = _subprocess(CUDA, ["H100", "A100"], {"JAX_PLATFORMS": "cpu"})
    assert out["H100"]["kernels"] == 2, out
    assert out["own"] <= out["H100"]["flops"] <= 1.5 * out["own"], out
    assert out["A100"]["kernels"] == 0 and out["A100"]["flops"] >= 16 * out["own"], out

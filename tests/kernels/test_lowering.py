"""Every kernel lowers for each of its targets on a machine without a device, at DeepSeek's real
shapes and at the tiny presets' (float32 operands, narrow chunks, 96- and 100-byte FP8 rows):

- ``mosaic_gpu``, through Pallas' Mosaic GPU backend, to a Mosaic GPU module for an abstract H200
  (sm_90) that gathers with TMA copies and multiplies with wgmma, in the shared memory the wrappers
  budget for;
- ``mosaic_gpu_sm80``, to a Mosaic GPU module for an abstract A100 (sm_80) and L40 (sm_89) that
  multiplies with Ampere's ``mma.sync`` and uses neither TMA nor wgmma;
- ``mosaic_tpu``, with ``jax.export(..., platforms=["tpu"])`` for an abstract TPU v5e and v6e, to one
  ``tpu_custom_call`` (the serialized Mosaic TPU kernel) over the pools whole, as 32-bit words
  (gathered inside it).

This proves the kernel bodies use only what each lowering accepts (Mosaic GPU: register layouts,
copies, MMA shapes, swizzles; Pallas TPU: block shapes, memory spaces, scalar prefetch, DMA and
semaphore types). The ``aot`` tests go further for TPUs: libtpu's compiler (XLA:TPU with Mosaic)
compiles every TPU kernel for compile-only v5e, v6e and v5p devices (``jax.experimental.topologies``),
which checks the DMAs' alignment, the vector layouts and that a program's VMEM fits. Nothing here runs
a kernel: that is the ``gpu`` / ``tpu`` tests' (DMA throughput, the MXU's numerics)."""

import dataclasses
import functools
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.layout import Format, Layout
from jax.experimental.mosaic.gpu import core as mgpu_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ess_jax.pallas_kernels import _gather_attention, fp8_rows, sparse_mla, sparse_v4_attention
from kernel_testing import abstract_device

S = jax.ShapeDtypeStruct
BF16, I32, U8, F32 = jnp.bfloat16, jnp.int32, jnp.uint8, jnp.float32
B, N, K, P = 2, 128, 2048, 4096  # decode batch, V3.2 heads, top-k, pool rows
V4_HEADS, WINDOW, CSA_K = 64, 128, 512

CASES = {
    "sparse_mla": (sparse_mla.sparse_mla, (S((B, 1, N, 512), BF16), S((B, 1, N, 64), BF16), S((P, 576), BF16),
                                           S((B, 1, K), I32)), {}),
    "sparse_mla_fp8": (fp8_rows.sparse_mla_fp8, (S((B, 1, N, 512), BF16), S((B, 1, N, 64), BF16), S((P, 656), U8),
                                                 S((B, 1, K), I32)), {}),
    "sparse_v4_attention": (sparse_v4_attention.sparse_v4_attention,
                            (S((B, 1, V4_HEADS, 512), BF16), S((P, 512), BF16), S((B, 1, WINDOW), I32),
                             S((P, 512), BF16), S((B, 1, CSA_K), I32), S((V4_HEADS,), F32)), {}),
    "sparse_v4_attention_fp8": (fp8_rows.sparse_v4_attention_fp8,
                                (S((B, 1, V4_HEADS, 512), BF16), S((P, 592), U8), S((B, 1, WINDOW), I32),
                                 S((P, 592), U8), S((B, 1, CSA_K), I32), S((V4_HEADS,), F32)), {"rope_dim": 64}),
    # the tiny presets: float32 rows (C = 64, R = 16; C = 32, R = 8), FP8 rows of 100 and 96 bytes
    "sparse_mla tiny": (sparse_mla.sparse_mla, (S((B, 1, 16, 64), F32), S((B, 1, 16, 16), F32), S((P, 80), F32),
                                                S((B, 1, 64), I32)), {}),
    "sparse_mla small": (sparse_mla.sparse_mla, (S((B, 1, 4, 32), F32), S((B, 1, 4, 8), F32), S((P, 40), F32),
                                                 S((B, 1, 8), I32)), {}),
    "sparse_mla_fp8 tiny": (fp8_rows.sparse_mla_fp8, (S((B, 1, 16, 64), F32), S((B, 1, 16, 16), F32),
                                                      S((P, 100), U8), S((B, 1, 64), I32)), {}),
    "sparse_v4_attention_fp8 tiny": (fp8_rows.sparse_v4_attention_fp8,
                                     (S((B, 1, 8, 64), F32), S((P, 96), U8), S((B, 1, 16), I32), S((P, 96), U8),
                                      S((B, 1, 8), I32), S((8,), F32)), {"rope_dim": 16}),
}
CASES["sparse_mla split-k"] = (*CASES["sparse_mla"][:2], {"num_splits": 8})


def _lower(name):
    fn, args, kwargs = CASES[name]
    with abstract_device("gpu", "NVIDIA H200"):
        return fn.trace(*args, scale=0.1, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_to_mosaic_gpu(name):
    text = _lower(name)
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and f"{name.split()[0]}_mosaic_gpu" in text
    # the serialized module gathers rows with TMA copies and multiplies with wgmma
    assert "cp.async.bulk.tensor" in text and "wgmma.mma_async" in text
    # a row's TMA copy starts 16-byte aligned: the FP8 rows stored so (656 and 592 bytes, tiny-v4's 96) reach the
    # kernel as they are, tiny-v32's 100-byte ones are copied at a padded stride first
    padded_rows = [line for line in text.splitlines() if "stablehlo.pad" in line and "xui8>" in line]
    assert bool(padded_rows) == (name == "sparse_mla_fp8 tiny"), padded_rows


@pytest.mark.parametrize("name", ["sparse_mla", "sparse_mla_fp8", "sparse_v4_attention_fp8 tiny"])
def test_budgeted_shared_memory_is_what_mosaic_allocates(monkeypatch, name):
    plans = []
    hopper = _gather_attention.HOPPER
    monkeypatch.setattr(_gather_attention, "HOPPER", dataclasses.replace(
        hopper, scratch=lambda plan: plans.append(plan) or hopper.scratch(plan)))
    jax.clear_caches()  # trace and lower afresh, under the limit
    with mgpu_core.artificial_shared_memory_limit(1), pytest.raises(ValueError, match="exceeds available shared") as e:
        _lower(name)
    assert f"smem_bytes={hopper.smem_bytes(plans[-1])} " in str(e.value)


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA A100", "sparse_mla"), ("NVIDIA A100", "sparse_mla_fp8"), ("NVIDIA A100", "sparse_v4_attention_fp8"),
    ("NVIDIA L40", "sparse_v4_attention"), ("NVIDIA L40", "sparse_v4_attention_fp8 tiny"),
])
def test_sm80_lowers_to_mosaic_gpu_without_tma_or_wgmma(kind, name):
    fn, args, kwargs = CASES[name]
    with abstract_device("gpu", kind):
        text = fn.trace(*args, scale=0.1, target="mosaic_gpu_sm80", **kwargs).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.custom_call @mosaic_gpu_v2" in text and f"{name.split()[0]}_mosaic_gpu" in text
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "cp.async.bulk" not in text and "wgmma" not in text


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_to_mosaic_tpu(name, kind):
    fn, args, kwargs = CASES[name]
    with abstract_device("tpu", kind):
        exported = jax.export.export(jax.jit(lambda *a: fn(*a, scale=0.1, target="mosaic_tpu", **kwargs)),
                                     platforms=["tpu"])(*args)
    calls = re.findall(r"stablehlo\.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) ->", exported.mlir_module())
    assert [c[0] for c in calls] == ["tpu_custom_call"]
    ((_, _, attributes, operands),) = calls
    assert f'kernel_name = "{name.split()[0]}"' in attributes
    for pool in (a for a in args if a.ndim == 2):  # the pools reach the kernel whole, as 32-bit rows
        assert f"tensor<{_tpu_pool(pool)}>".replace(",", "x") in operands


def _tpu_pool(pool):
    """The pool the TPU kernel reads: float32 rows as they are, bf16 / byte rows as 32-bit words."""
    if pool.dtype == jnp.float32:
        return f"{pool.shape[0]},{pool.shape[1]}xf32"
    return f"{pool.shape[0]},{pool.shape[1] * pool.dtype.itemsize // 4}xui32"


# ---- compiled for TPUs by libtpu (pytest -m aot) --------------------------------------------------

TPU_TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}
DEEPSEEK = ("sparse_mla", "sparse_mla_fp8", "sparse_v4_attention", "sparse_v4_attention_fp8")
# each case compiled once: DeepSeek's shapes for every generation; the tiny presets' (and split-K) for v5e;
# the pools as 32-bit words (the form a cache can store) for v6e
AOT_CASES = ([(gen, name, False) for gen in TPU_TOPOLOGIES for name in DEEPSEEK]
             + [("v5e", name, False) for name in sorted(CASES) if name not in DEEPSEEK]
             + [("v6e", name, True) for name in (*DEEPSEEK, "sparse_mla_fp8 tiny", "sparse_v4_attention_fp8 tiny")])


@functools.cache
def _tpu_device(gen: str):
    """A compile-only TPU device of generation ``gen`` (libtpu's compiler, no TPU needed)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: pip install -e '.[tpu]' (jax[tpu]) compiles for TPUs without one")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock
    from jax.experimental import topologies
    return topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[gen], platform="tpu").devices[0]


def _as_words(arg):
    """A bf16 / uint8 pool's shape as 32-bit words (``row_layout.as_words``); anything else as it is."""
    if arg.ndim != 2 or arg.dtype.itemsize == 4:
        return arg
    return S((arg.shape[0], arg.shape[1] * arg.dtype.itemsize // 4), jnp.uint32)


@pytest.mark.aot
@pytest.mark.parametrize("gen, name, words", AOT_CASES,
                         ids=[f"{g}-{n}{'-words' if w else ''}" for g, n, w in AOT_CASES])
def test_compiles_for_tpu(gen, name, words):
    """libtpu compiles the kernel (Mosaic accepts the one-row DMAs of 32-bit rows, every vector op and
    the VMEM) into one ``tpu_custom_call`` over the pools as 32-bit rows. Pools passed row-major as words
    (or float32 rows) reach the kernel as they are; bf16 / uint8 rows are relaid as words first, a copy
    of the pool. (The compiler's own default layout for a ``u32[4096, 288]`` argument is column-major,
    which would cost a copy too: a cache that stores words keeps them row-major.)"""
    device = _tpu_device(gen)
    fn, args, kwargs = CASES[name]
    args = tuple(map(_as_words, args)) if words else args
    mesh = Mesh([device], ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    row_major = Format(Layout(major_to_minor=(0, 1)), replicated)
    pools = [i for i, a in enumerate(args) if a.ndim == 2]
    shardings = tuple(row_major if i in pools else replicated for i in range(len(args)))
    with jax.set_mesh(mesh):  # the kernel is traced for this device's TPU generation
        compiled = jax.jit(lambda *a: fn(*a, scale=0.1, target="mosaic_tpu", **kwargs),
                           in_shardings=shardings).lower(*args).compile()
    hlo = compiled.as_text()
    entry = hlo[hlo.index("\nENTRY "):]
    (kernel,) = [line for line in entry.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert kernel.lstrip().startswith(f"%{name.split()[0]}.")
    operands = re.search(r" custom-call\((.*?)\), custom_call_target", kernel).group(1).split(", ")
    parameters = dict(re.findall(r"%(\S+) = \S+ parameter\((\d+)\)", entry))
    for i in pools:
        pool = args[i]
        shape = _tpu_pool(pool).split("x")[0]
        assert f"{'f32' if pool.dtype == jnp.float32 else 'u32'}[{shape}]{{1,0}}" in kernel  # 32-bit, row-major
        zero_copy = words or pool.dtype == jnp.float32
        fed = [parameters.get(re.sub(r"/\*.*?\*/", "", op).lstrip("%")) for op in operands]
        assert (str(i) in fed) == zero_copy, kernel  # the argument itself is the kernel's operand


@pytest.mark.aot
def test_a_decode_batch_whose_ids_overflow_smem_compiles_for_tpu():
    """V4-Flash's FP8 attention at the decode batch the planner gives v5p (967 rows, 128 window and 512 CSA ids
    each: 2.5 MB scalar-prefetched, against 1 MiB of SMEM) compiles, as one kernel call per row range
    (``_gather_attention_tpu.PREFETCH_BYTES``): Mosaic refused the single call ("Allocation (size=1980416) would
    exceed memory (size=1048576)")."""
    device = _tpu_device("v5p")
    mesh = Mesh([device], ("x",))
    b, entries = 967, 967 * 1639
    args = (S((b, 1, V4_HEADS, 512), BF16), S((b * WINDOW, 592), U8), S((b, 1, WINDOW), I32),
            S((entries, 592), U8), S((b, 1, CSA_K), I32), S((V4_HEADS,), F32))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda *a: fp8_rows.sparse_v4_attention_fp8(*a, scale=0.1, rope_dim=64,
                                                                       target="mosaic_tpu")).lower(*args).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 5  # 204 rows' ids a call

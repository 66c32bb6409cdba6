"""Every kernel lowers for each of its targets on a machine without a device, at DeepSeek's real
shapes and at the tiny presets' (float32 operands, narrow chunks, 88- and 100-byte FP8 rows):

- ``mosaic_gpu``, through Pallas' Mosaic GPU backend, to a Mosaic GPU module for an abstract H200
  (sm_90) that gathers with TMA copies and multiplies with wgmma, in the shared memory the wrappers
  budget for;
- ``mosaic_gpu_sm80``, to a Mosaic GPU module for an abstract A100 (sm_80) and L40 (sm_89) that
  multiplies with Ampere's ``mma.sync`` and uses neither TMA nor wgmma;
- ``mosaic_tpu``, with ``jax.export(..., platforms=["tpu"])`` for an abstract TPU v5e and v6e, to one
  ``tpu_custom_call`` (the serialized Mosaic TPU kernel) over the pools whole (gathered inside it).

This proves the kernel bodies use only what each lowering accepts (Mosaic GPU: register layouts,
copies, MMA shapes, swizzles; Pallas TPU: block shapes, memory spaces, scalar prefetch, DMA and
semaphore types). It does not compile the modules (ptxas in jaxlib's CUDA plugin, libtpu) or run
them, which only the ``gpu`` / ``tpu`` tests do."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core

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
                                (S((B, 1, V4_HEADS, 512), BF16), S((P, 584), U8), S((B, 1, WINDOW), I32),
                                 S((P, 584), U8), S((B, 1, CSA_K), I32), S((V4_HEADS,), F32)), {"rope_dim": 64}),
    # the tiny presets: float32 rows (C = 64, R = 16; C = 32, R = 8), FP8 rows of 100 and 88 bytes
    "sparse_mla tiny": (sparse_mla.sparse_mla, (S((B, 1, 16, 64), F32), S((B, 1, 16, 16), F32), S((P, 80), F32),
                                                S((B, 1, 64), I32)), {}),
    "sparse_mla small": (sparse_mla.sparse_mla, (S((B, 1, 4, 32), F32), S((B, 1, 4, 8), F32), S((P, 40), F32),
                                                 S((B, 1, 8), I32)), {}),
    "sparse_mla_fp8 tiny": (fp8_rows.sparse_mla_fp8, (S((B, 1, 16, 64), F32), S((B, 1, 16, 16), F32),
                                                      S((P, 100), U8), S((B, 1, 64), I32)), {}),
    "sparse_v4_attention_fp8 tiny": (fp8_rows.sparse_v4_attention_fp8,
                                     (S((B, 1, 8, 64), F32), S((P, 88), U8), S((B, 1, 16), I32), S((P, 88), U8),
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
    for pool in (a for a in args if a.ndim == 2):  # the pools reach the kernel whole, in their dtype
        dtype = {"bfloat16": "bf16", "float32": "f32", "uint8": "ui8"}[pool.dtype.name]
        assert f"tensor<{pool.shape[0]}x{pool.shape[1]}x{dtype}>" in operands

"""Every kernel lowers, through Pallas' Mosaic GPU backend, to a Mosaic GPU module for an abstract
H200 (sm_90) on a machine without a GPU, at DeepSeek's real shapes and at the tiny presets' (float32
operands as bf16 pieces, narrow chunks, 88- and 100-byte FP8 rows). This proves the kernel bodies use
only what the Mosaic GPU lowering accepts (register layouts, TMA copies, wgmma shapes and swizzles)
and that the shared memory the wrappers budget for is what Mosaic GPU allocates. It does not compile
the module to PTX or run it (the rest of that pipeline runs in jaxlib's CUDA plugin), which only the
``gpu`` tests do."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core
from jax.sharding import AbstractDevice, AbstractMesh

from ess_jax.pallas_kernels import _gather_attention, fp8_rows, sparse_mla, sparse_v4_attention

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
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                       platform="gpu"))
    with jax.sharding.use_abstract_mesh(h200):
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

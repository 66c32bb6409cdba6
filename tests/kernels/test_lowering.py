"""Every kernel lowers to Triton IR for an abstract H200 at DeepSeek's real shapes, on a machine
without a GPU. This proves the kernel bodies use only constructs Pallas' Triton lowering accepts
(the power-of-two blocks, gathers, bitcasts and dots); it does not compile the IR to PTX or run it,
which only the ``gpu`` tests do."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from ess_jax.pallas_kernels import fp8_rows, sparse_mla, sparse_v4_attention

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
}
CASES["sparse_mla split-k"] = (*CASES["sparse_mla"][:2], {"num_splits": 8})


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")  # known: DOMAIN.md 7
@pytest.mark.parametrize("name", sorted(CASES))
def test_lowers_to_triton_ir(name):
    fn, args, kwargs = CASES[name]
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                       platform="gpu"))
    with jax.sharding.use_abstract_mesh(h200):
        text = fn.trace(*args, scale=0.1, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and f'name = "{name.split()[0]}"' in text

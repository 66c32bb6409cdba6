"""ess_jax.ops dispatch: kernels="pallas" (interpret mode on CPU) equals kernels="xla" for every op,
float and FP8 rows, pooled and pre-gathered forms; the halves of a split merge to the whole."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax import ops
from ess_jax.cache import flat_ids
from ess_jax.pallas_kernels.target import TARGETS
from ess_jax.pallas_kernels.sparse_v4_attention import sparse_v4_attention_reference
from kernel_testing import abstract_device, assert_close, permuted_ids, random_array, valid_counts

B, T, N, C, R, K = 2, 2, 4, 32, 8, 9
ROWS = B * T * K  # the pooled and pre-gathered forms then share one compiled kernel


def test_resolve_kernels_on_cpu():
    assert jax.default_backend() == "cpu"
    assert ops.resolve_kernels("xla") == "xla"
    assert ops.resolve_kernels("auto") == "xla"
    assert ops.resolve_kernels("pallas") == "mosaic_gpu:interpret"
    for target in ("mosaic_gpu", "mosaic_gpu_sm80", "mosaic_tpu"):  # every target runs in its interpreter
        assert ops.resolve_kernels(target) == f"{target}:interpret"
    with pytest.raises(ValueError, match="--kernels 'triton'"):
        ops.resolve_kernels("triton")


# (platform, device kind): what auto picks, and the named kernels that run there
DEVICES = {
    ("gpu", "NVIDIA H200"): ("mosaic_gpu", {"mosaic_gpu", "mosaic_gpu_sm80"}),
    ("gpu", "NVIDIA H100 80GB HBM3"): ("mosaic_gpu", {"mosaic_gpu", "mosaic_gpu_sm80"}),
    ("gpu", "NVIDIA B200"): ("mosaic_gpu_sm80", {"mosaic_gpu_sm80"}),  # no wgmma on Blackwell
    ("gpu", "NVIDIA GeForce RTX 5090"): ("mosaic_gpu_sm80", {"mosaic_gpu_sm80"}),
    ("gpu", "NVIDIA A100-SXM4-80GB"): ("mosaic_gpu_sm80", {"mosaic_gpu_sm80"}),
    ("gpu", "NVIDIA A10G"): ("mosaic_gpu_sm80", {"mosaic_gpu_sm80"}),
    ("gpu", "NVIDIA L40"): ("mosaic_gpu_sm80", {"mosaic_gpu_sm80"}),
    ("gpu", "NVIDIA GeForce RTX 4090"): ("mosaic_gpu_sm80", {"mosaic_gpu_sm80"}),
    ("gpu", "Tesla T4"): ("xla", set()),
    ("gpu", "AMD Instinct MI300X"): ("xla", set()),
    ("tpu", "TPU v5 lite"): ("mosaic_tpu", {"mosaic_tpu"}),
    ("tpu", "TPU v6 lite"): ("mosaic_tpu", {"mosaic_tpu"}),
}


@pytest.mark.parametrize("platform, kind", sorted(DEVICES))
def test_kernel_choice_by_device(platform, kind):
    """auto takes the device's own kernels (XLA where there are none), pallas the same or a refusal,
    and each kernel by name runs where it can and is refused by name, with the device, elsewhere."""
    auto, runs = DEVICES[platform, kind]
    with abstract_device(platform, kind):
        assert ops.resolve_kernels("auto") == auto
        assert ops.resolve_kernels("xla") == "xla"
        if auto == "xla":
            with pytest.raises(ValueError, match=rf"--kernels pallas: no Pallas kernels here run on {kind}"):
                ops.resolve_kernels("pallas")
        else:
            assert ops.resolve_kernels("pallas") == auto
        for target in TARGETS:
            if target in runs:
                assert ops.resolve_kernels(target) == target
            else:
                with pytest.raises(ValueError, match=rf"--kernels {target}: {target} .*this device is {kind}"):
                    ops.resolve_kernels(target)


def test_a_real_device_reports_its_capability(monkeypatch):
    """A real device decides by its compute capability, not its kind (unknown to the table here)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    device = type("CudaDevice", (), {"compute_capability": "9.0", "device_kind": "NVIDIA unreleased"})()
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    assert ops.target_device() == ops.Device("cuda", "NVIDIA unreleased", (9, 0))
    assert ops.resolve_kernels("auto") == "mosaic_gpu"
    with abstract_device("gpu", "NVIDIA unreleased"):  # a mesh over this machine's devices: they still report
        assert ops.resolve_kernels("auto") == "mosaic_gpu"
    device.compute_capability = "gfx942"  # a ROCm device
    device.device_kind = "AMD Instinct MI300X"
    assert ops.target_device().platform == "rocm" and ops.resolve_kernels("auto") == "xla"


def _mla_inputs(seed, fp8: bool):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(permuted_ids(rng, valid_counts(B, T, K), K, ROWS))
    pool = random_array(rng, (ROWS, C + R), jnp.float32)
    if fp8:
        pool = ops.encode_mla_rows(pool, jnp.uint8, latent_dim=C)
    return random_array(rng, (B, T, N, C), jnp.float32), random_array(rng, (B, T, N, R), jnp.float32), pool, ids


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mla_pallas_equals_xla(fp8):
    q_latent, q_rope, pool, ids = _mla_inputs(1, fp8)
    rows = pool[jnp.maximum(ids, 0)]  # pre-gathered, as the callers pass them today
    runs = {kernels: (ops.sparse_mla(q_latent, q_rope, rows, ids >= 0, scale=0.3, kernels=kernels),
                      ops.sparse_mla_pool(q_latent, q_rope, pool, ids, scale=0.3, kernels=kernels))
            for kernels in ("xla", "pallas")}
    for form in (0, 1):
        for i, name in enumerate(("out", "lse")):
            assert_close(runs["pallas"][form][i], runs["xla"][form][i], jnp.float32, f"{name} form {form}")
    assert_close(runs["xla"][1][0], runs["xla"][0][0], jnp.float32, "pooled vs gathered")


def test_split_halves_merge_to_the_whole():
    """ESS dual attention: hits and misses attended separately and merged equal one pass."""
    q_latent, q_rope, pool, ids = _mla_inputs(2, False)
    half = jnp.asarray(np.random.default_rng(0).random(ids.shape) < 0.5)
    run = functools.partial(ops.sparse_mla_pool, q_latent, q_rope, pool, scale=0.3, kernels="pallas")
    (out_a, lse_a), (out_b, lse_b) = run(jnp.where(half, ids, -1)), run(jnp.where(half, -1, ids))
    out, lse = run(ids)
    merged, merged_lse = ops.merge_attention(out_a, lse_a, out_b, lse_b)
    assert_close(merged, out, jnp.float32, "merged out")
    assert_close(merged_lse, lse, jnp.float32, "merged lse")


def test_sparse_sink_attention_pallas_equals_xla():
    rng = np.random.default_rng(3)
    h = 32
    window_ids = jnp.asarray(permuted_ids(rng, valid_counts(B, T, 7), 7, 20))
    entry_ids = jnp.asarray(permuted_ids(rng, valid_counts(B, T, 5), 5, 12))
    window, entries = random_array(rng, (20, h), jnp.float32), random_array(rng, (12, h), jnp.float32)
    q, sinks = random_array(rng, (B, T, N, h), jnp.float32), random_array(rng, (N,), jnp.float32)
    rows = jnp.concatenate([window[jnp.maximum(window_ids, 0)], entries[jnp.maximum(entry_ids, 0)]], axis=2)
    valid = jnp.concatenate([window_ids >= 0, entry_ids >= 0], axis=2)
    xla = ops.sparse_sink_attention(q, rows, valid, sinks, scale=0.2, kernels="xla")
    for got, name in ((ops.sparse_sink_attention(q, rows, valid, sinks, scale=0.2, kernels="pallas"), "gathered"),
                      (ops.sparse_sink_attention_pool(q, window, window_ids, entries, entry_ids, sinks, scale=0.2,
                                                      kernels="pallas"), "pooled pallas"),
                      (ops.sparse_sink_attention_pool(q, window, window_ids, entries, entry_ids, sinks, scale=0.2,
                                                      kernels="xla"), "pooled xla"),
                      (sparse_v4_attention_reference(q, window, window_ids, entries, entry_ids, sinks, scale=0.2),
                       "kernel reference")):
        assert_close(got[0], xla[0], jnp.float32, f"out ({name})")
        assert_close(got[1], xla[1], jnp.float32, f"lse ({name})")


@pytest.mark.parametrize("page_size,rate", [(4, 1), (16, 4), (4, 16)])
def test_flat_ids_address_the_flattened_pages(page_size, rate):
    """Entry e of a part with one entry per ``rate`` tokens lives in the page holding token e * rate, in
    pages of max(1, page_size / rate) entries: the flat ids read exactly the rows a per-entry NumPy walk of
    the page table finds."""
    rng = np.random.default_rng(4)
    per_page, g, w = max(1, page_size // rate), 17, 6
    pages = random_array(rng, (g, per_page, w), jnp.float32)
    table = np.stack([rng.permutation(np.arange(1, g))[:8] for _ in range(2)]).astype(np.int32)
    entries = table.shape[1] * page_size // rate  # what a request's table reaches
    ids = rng.integers(-1, entries, size=(2, 3, 5)).astype(np.int32)  # -1: none
    got = np.asarray(pages.reshape(g * per_page, w)[jnp.maximum(flat_ids(jnp.asarray(table), jnp.asarray(ids),
                                                                         page_size=page_size, rate=rate), 0)])
    for b, t, k in zip(*np.nonzero(ids >= 0)):
        token = ids[b, t, k] * rate
        want = np.asarray(pages)[table[b, token // page_size], (token % page_size) // rate if rate <= page_size else 0]
        np.testing.assert_array_equal(got[b, t, k], want)
    row_ids = np.asarray(flat_ids(jnp.asarray(table), jnp.asarray(ids), page_size=page_size, rate=rate))
    assert np.all((row_ids < 0) == (ids < 0))


@pytest.mark.parametrize("platform, kind, call, marks", [
    ("tpu", "TPU v6 lite", "tpu_custom_call", ['kernel_name = "sparse_mla"']),
    ("gpu", "NVIDIA A100", "mosaic_gpu_v2", ["mma.sync.aligned"]),
    ("gpu", "NVIDIA H200", "mosaic_gpu_v2", ["wgmma.mma_async", "cp.async.bulk.tensor"]),
])
def test_auto_lowers_to_the_chosen_kernel(platform, kind, call, marks):
    """ops.sparse_mla_pool with kernels="auto", lowered for an abstract device: one custom call, that
    device's kernel (not the XLA gather)."""
    S = jax.ShapeDtypeStruct
    args = (S((B, 1, 64, C), jnp.bfloat16), S((B, 1, 64, R), jnp.bfloat16), S((256, C + R), jnp.bfloat16),
            S((B, 1, 64), jnp.int32))
    step = jax.jit(functools.partial(ops.sparse_mla_pool, scale=0.1, kernels="auto"))
    with abstract_device(platform, kind):
        lowered = step.trace(*args).lower(lowering_platforms=("tpu" if platform == "tpu" else "cuda",))
    text = lowered.as_text()
    assert re.findall(r"stablehlo\.custom_call @(\w+)", text) == [call]
    assert all(mark in text for mark in marks)


def test_interpreted_tpu_kernel_lowers_beside_host_memory_outputs():
    """The engine's steps return the host tier (pinned_host): the TPU kernel run in its interpreter
    inside such a jit (``--kernels mosaic_tpu`` on CPU) still lowers (the interpreter's callbacks run
    behind a pure_callback, as the Mosaic GPU one's do) and matches the XLA path."""
    q_latent, q_rope, pool, ids = _mla_inputs(5, False)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    step = lambda kernels: jax.jit(lambda *a: (ops.sparse_mla_pool(*a, scale=0.3, kernels=kernels), a[2] * 2),
                                   out_shardings=(None, host))
    (out, lse), on_host = step("mosaic_tpu")(q_latent, q_rope, pool, ids)
    assert on_host.sharding.memory_kind == "pinned_host"
    want = ops.sparse_mla_pool(q_latent, q_rope, pool, ids, scale=0.3, kernels="xla")
    assert_close(out, want[0], jnp.float32, "out")
    assert_close(lse, want[1], jnp.float32, "lse")

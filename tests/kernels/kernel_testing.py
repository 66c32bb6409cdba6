"""Shared pieces of the kernel tests: one tolerance table, a strict comparison, poisoned pools and
permuted ids with -1 sentinels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

# Kernel vs reference, keyed by the dtype of the kernel's inputs. The kernel accumulates in float32
# either way; with bf16 inputs it rounds the softmax weights to bf16 before the value product (as
# FlashMLA does), hence the looser bound. ``cos`` bounds FlashMLA's cosine difference
# 1 - 2<a, e> / (|a|^2 + |e|^2) over the finite elements.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5, cos=1e-9),
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2, cos=1e-5),
}


def assert_close(actual, expected, dtype, name: str = "value"):
    """``actual`` matches ``expected`` elementwise within ``TOLERANCES[dtype]``: the same shape, NaN
    and +-inf at exactly the same positions, every finite element within atol + rtol |expected|, and
    a small cosine difference. Failures name the worst element."""
    tol = TOLERANCES[jnp.dtype(dtype)]
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    for what, fa, fe in (("NaN", np.isnan(a), np.isnan(e)), ("+inf", np.isposinf(a), np.isposinf(e)),
                         ("-inf", np.isneginf(a), np.isneginf(e))):
        if (fa != fe).any():
            idx = tuple(int(i) for i in np.argwhere(fa != fe)[0])
            raise AssertionError(f"{name}: {what} positions differ ({int((fa != fe).sum())} elements); first at "
                                 f"{idx}: actual {a[idx]}, expected {e[idx]}")
    finite = np.isfinite(e)
    if not finite.any():
        return
    err = np.abs(np.where(finite, a, 0.0) - np.where(finite, e, 0.0))
    excess = err - (tol["atol"] + tol["rtol"] * np.abs(e))
    worst = np.unravel_index(np.argmax(np.where(finite, excess, -np.inf)), e.shape)
    if excess[worst] > 0:
        raise AssertionError(
            f"{name}: {int((finite & (excess > 0)).sum())} of {int(finite.sum())} elements out of tolerance "
            f"(atol {tol['atol']}, rtol {tol['rtol']}); worst at {tuple(int(i) for i in worst)}: actual {a[worst]!r}, "
            f"expected {e[worst]!r}, |diff| {err[worst]:.3g}")
    af, ef = a[finite], e[finite]
    denom = (af * af + ef * ef).sum()
    cos_diff = 1 - 2 * (af * ef).sum() / denom if denom > 0 else 0.0
    assert cos_diff <= tol["cos"], f"{name}: cosine difference {cos_diff:.3g} > {tol['cos']}"


def valid_counts(b: int, t: int, k: int) -> np.ndarray:
    """Valid ids per query, cycling through the boundary cases 0 (fully masked), 1, k-1 and k."""
    cases = [0, 1, max(k - 1, 0), k]
    return np.array([cases[i % len(cases)] for i in range(b * t)]).reshape(b, t)


def permuted_ids(rng: np.random.Generator, counts_BT: np.ndarray, k: int, rows: int, *, offset_B=None) -> np.ndarray:
    """``i32[B, T, K]``: per query, ``counts_BT[b, t]`` distinct rows drawn from ``[1, rows)`` (plus
    ``offset_B[b]``) at random positions, -1 elsewhere. Row 0 is never chosen, so a kernel that
    clamps -1 to row 0 without masking reads a poisoned row."""
    b, t = counts_BT.shape
    ids = np.full((b, t, k), -1, np.int32)
    for i in range(b):
        for j in range(t):
            n = int(counts_BT[i, j])
            chosen = rng.choice(np.arange(1, rows), size=n, replace=False)
            ids[i, j, rng.permutation(k)[:n]] = chosen + (0 if offset_B is None else offset_B[i])
    return ids


def poison_unused(pool: np.ndarray, *id_arrays: np.ndarray) -> np.ndarray:
    """A copy of ``pool`` whose rows no valid id names hold NaN (float) or 0xFF bytes (FP8: e4m3 NaN,
    NaN scales and rope)."""
    pool = np.array(pool)
    used = np.zeros(pool.shape[0], bool)
    for ids in id_arrays:
        used[ids[ids >= 0]] = True
    pool[~used] = 0xFF if pool.dtype == np.uint8 else np.nan
    return pool


def random_array(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale, dtype)


def abstract_device(platform: str, kind: str):
    """A context of one abstract device of ``kind`` on ``platform`` ("gpu" or "tpu"): what lowering for
    such a machine, and the kernel choice, see without one (an Auto axis: the models' ops carry no
    explicit shardings)."""
    device = AbstractDevice(device_kind=kind, num_cores=None if platform == "gpu" else 1, platform=platform)
    return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                                                       abstract_device=device))


# Each accelerator's name, and how to run its tests where jax sees one
RUN_ON = {"gpu": ("CUDA GPU", "on a GPU runner with the jax CUDA plugin: JAX_PLATFORMS=cuda,cpu"),
          "tpu": ("TPU", "on a TPU runner with libtpu: JAX_PLATFORMS=tpu,cpu")}


def accelerator(platform: str):
    """The first device of ``platform`` ("gpu" or "tpu"), or skip with the reason none is visible."""
    try:
        return jax.devices(platform)[0]
    except (RuntimeError, IndexError):
        platforms = sorted({d.platform for d in jax.devices()})
        what, how = RUN_ON[platform]
        pytest.skip(f"no {what} visible to jax (platforms: {', '.join(platforms)}); {how} "
                    f".venv/bin/python -m pytest -m {platform}")

import os

# Tests run on the CPU unless a GPU test asks otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Parity tests compare float32 logits at 1e-4 of their scale: no TF32 / bf16 passes in matmuls on GPUs.
jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_code():
    """XLA:CPU maps every executable's code into memory regions of its own, so a suite that keeps all its
    compiled steps alive passes the kernel's vm.max_map_count (65530 by default) and the compiler then
    crashes. When a test module ends with the process past half of that, the compiled code of the
    modules so far is dropped (the next modules recompile what they need)."""
    yield
    maps = Path("/proc/self/maps")
    if maps.exists() and len(maps.read_text().splitlines()) > 65530 // 2:
        gc.collect()
        jax.clear_caches()
        gc.collect()

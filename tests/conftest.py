import os

# Tests run on the CPU unless a GPU test asks otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Parity tests compare float32 logits at 1e-4 of their scale: no TF32 / bf16 passes in matmuls on GPUs.
jax.config.update("jax_default_matmul_precision", "highest")

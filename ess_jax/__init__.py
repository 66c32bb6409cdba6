"""ess_jax: DeepSeek-V3.2 / V4 sparse-attention serving in JAX with an exact host-offloaded KV tier.

The public names are imported on first access (PEP 562), so importing a submodule
(``ess_jax.config``, ``ess_jax.plan``, ``ess_jax.pallas_kernels.fp8_rows``, a model) loads only what
that submodule imports, not the runtime (flax, the engine, the API).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Model": "ess_jax.api",
    "Result": "ess_jax.api",
    "generate": "ess_jax.api",
    "load_model": "ess_jax.api",
    "loglikelihood": "ess_jax.api",
    "Engine": "ess_jax.engine",
    "EngineConfig": "ess_jax.engine",
    "RequestOutput": "ess_jax.engine",
    "RequestSpec": "ess_jax.engine",
    "SamplingParams": "ess_jax.sampling",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ess_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

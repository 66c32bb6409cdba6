"""ess_jax: DeepSeek-V3.2 / V4 sparse-attention serving in JAX with an exact host-offloaded KV tier."""

from ess_jax.api import Model, Result, generate, load_model

__all__ = ["Model", "Result", "generate", "load_model"]

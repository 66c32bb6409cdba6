"""Flax NNX model definitions (imported as ess_jax.models)."""

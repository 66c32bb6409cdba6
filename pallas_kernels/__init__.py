"""Pallas kernels with their pure-jnp references (imported as ess_jax.pallas_kernels)."""

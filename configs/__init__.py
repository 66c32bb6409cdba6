"""Model presets as HuggingFace-style config.json files (loaded with ess_jax.config.ModelConfig.from_preset)."""

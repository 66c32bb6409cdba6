"""Model presets as HuggingFace-style config.json files (loaded with ess_jax.families.load_config)."""

"""DeepSeek-V3.2 (``model_type`` deepseek_v32): MLA, the DSA lightning indexer, DeepSeek MoE.

``model`` (``DeepseekV32``), ``mtp`` (its MTP module), ``cache`` (its cache record), ``config``
(``DeepseekV32Config``) and ``family`` (its entry in ``ess_jax.families``' registry)."""

from ess_jax.models import lazy_exports

__all__ = ["DeepseekV32", "DeepseekV32Config"]
__getattr__ = lazy_exports(__name__, {"DeepseekV32": "model", "DeepseekV32Config": "config"})

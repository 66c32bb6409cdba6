"""DeepSeek-V4 (``model_type`` deepseek_v4): sliding-window / compressed-sparse / heavily-compressed attention,
mHC, hash-routed MoE.

``model`` (``DeepseekV4``), ``compressor`` (the KV compressors and the CSA indexer), ``mhc`` (the hyper-connected
residual), ``mtp`` (its MTP module), ``cache`` (its cache records), ``config`` (``DeepseekV4Config``), ``names``
(the release's tensor names) and ``family`` (its entry in ``ess_jax.families``' registry)."""

from ess_jax.models import lazy_exports

__all__ = ["DeepseekV4", "DeepseekV4Config"]
__getattr__ = lazy_exports(__name__, {"DeepseekV4": "model", "DeepseekV4Config": "config"})

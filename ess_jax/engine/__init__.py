"""The serving engine (``Engine``) and its parts: ``config`` (EngineConfig), ``request`` (RequestSpec and its
checks, Request, RequestOutput, TokenLogprob), ``plan`` (the hand-off types and the piece rule, no jax),
``layout`` (cache sizes and bytes), ``steps`` (the pure jitted device steps), ``scheduler`` (host-only admission
and step plans), ``runner`` (parameters, mesh, caches, compiled steps), ``offload`` (Resident or Ess, chosen
once), ``engine`` (the public API), ``loop`` (the engine thread and multi-process lockstep).

The public names are imported on first access (PEP 562), as the root's are: ``from ess_jax.engine import
cache_layout`` loads the layout's imports, not the runner or the models."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CACHE_DTYPES": "ess_jax.engine.config",
    "EngineConfig": "ess_jax.engine.config",
    "Fetch": "ess_jax.engine.config",
    "Offload": "ess_jax.engine.config",
    "Engine": "ess_jax.engine.engine",
    "CacheLayout": "ess_jax.engine.layout",
    "cache_layout": "ess_jax.engine.layout",
    "check_memory": "ess_jax.engine.layout",
    "MAX_PROMPT_LOGPROBS": "ess_jax.engine.request",
    "Request": "ess_jax.engine.request",
    "RequestOutput": "ess_jax.engine.request",
    "RequestSpec": "ess_jax.engine.request",
    "TokenLogprob": "ess_jax.engine.request",
    "EngineStats": "ess_jax.engine.plan",
    "StepTimes": "ess_jax.engine.plan",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ess_jax.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

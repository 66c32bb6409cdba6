"""Flax NNX model definitions (imported as ess_jax.models): the shared layers, and one package per model family
(``deepseek_v32/``, ``deepseek_v4/``), each reached by the runtime through the registry, ``ess_jax.families``."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A family package's module ``__getattr__`` (PEP 562): each public name of ``exports`` (name -> its module in
    the package) imported on first access, so importing the package's config or family entry loads no flax."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__

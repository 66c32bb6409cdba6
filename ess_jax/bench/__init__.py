"""``python -m ess_jax.bench``: resident vs ESS offload, side by side, on long prompts (``main``). What each figure
means is the command's ``--help``, the docstring of ``ess_jax.bench.args``.

Modules: ``args`` (the flags and their checks), ``prompts`` (random ids or a text), ``runs`` (the engine runs: tok/s,
step times, the tier's counters, capacity), ``stall`` (the prefill stall), ``depth`` (``--depth-sweep``),
``locality`` (top-k traces, their overlaps, the LRU replayed over them: ``tier.lru_reference``), ``peer``
(transformers' ``generate``), ``report`` (the printed tables), ``plots`` (the PNGs), ``__main__`` (``main``: which of
them the flags ask for).

``main`` is imported on first access (PEP 562), so that ``python -m ess_jax.bench`` runs ``__main__`` once."""

from __future__ import annotations

import importlib

__all__ = ["main"]


def __getattr__(name: str):
    if name != "main":
        raise AttributeError(f"module 'ess_jax.bench' has no attribute {name!r}")
    return importlib.import_module("ess_jax.bench.__main__").main

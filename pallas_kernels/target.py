"""Which compiler a gather-attention kernel is built for: the public kernels' ``target`` knob.

- ``"mosaic_gpu"``: NVIDIA Hopper and Blackwell datacenter GPUs (sm_90+: TMA copies, ``wgmma``),
  ``_gather_attention``;
- ``"mosaic_gpu_sm80"``: NVIDIA GPUs without TMA / wgmma (Ampere, Ada: sm_80 / 86 / 89; plain copies,
  Ampere ``mma``), ``_gather_attention_sm80``;
- ``"mosaic_tpu"``: TPUs (scalar-prefetched ids, asynchronous row DMAs), ``_gather_attention_tpu``.

Every target has the same arguments, returns, sentinels and references; ``interpret`` runs the
target's kernel in its own interpreter (the Mosaic GPU or the TPU one) on any backend. Each core is
imported only when a kernel is traced for it, so describing rows and checking inputs loads neither
toolchain.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas import tpu as pltpu

    # False: compile for the target; True or the interpreter's parameters: run in its interpreter
    Interpret = bool | plgpu.InterpretGPUParams | pltpu.InterpretParams

TARGETS = ("mosaic_gpu", "mosaic_gpu_sm80", "mosaic_tpu")
_CORES = {"mosaic_gpu": "_gather_attention", "mosaic_gpu_sm80": "_gather_attention_sm80",
          "mosaic_tpu": "_gather_attention_tpu"}


def check_target(target: str):
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not a kernel target; use one of {', '.join(TARGETS)}")


def gather_attention(q_value_BTNC, q_key_BTNR, sources, sinks_N, *, target: str, **knobs):
    """The gather-attention core of ``target`` (see ``_gather_attention.gather_attention``)."""
    core = importlib.import_module(f"ess_jax.pallas_kernels.{_CORES[target]}")
    return core.gather_attention(q_value_BTNC, q_key_BTNR, sources, sinks_N, **knobs)

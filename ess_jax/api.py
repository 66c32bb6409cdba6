"""The Python API: ``load_model``, ``Model.logits`` and ``generate``."""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax import checkpoint
from ess_jax.config import PRESETS, ConfigError, ModelConfig
from ess_jax.models.deepseek_v32 import DeepseekV32, DenseCache
from ess_jax.tokenizer import ByteTokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Model:
    """A loaded model: config, parameters and the jitted functions over them.

    The NNX module is split once into a static graph definition and a parameter pytree; every
    jitted function merges them inside the trace, so each call pays no Python object-graph walk.
    """

    def __init__(self, name: str, module: DeepseekV32, tokenizer: ByteTokenizer):
        self.name = name
        self.cfg: ModelConfig = module.cfg
        self.tokenizer = tokenizer
        self.graphdef, self.params = nnx.split(module)

    @property
    def module(self) -> DeepseekV32:
        return nnx.merge(self.graphdef, self.params)

    @functools.cached_property
    def _forward(self):
        return jax.jit(lambda params, tokens: nnx.merge(self.graphdef, params)(tokens))

    @functools.cached_property
    def _step(self):
        def step(params, tokens, cache):
            return nnx.merge(self.graphdef, params).step(tokens, cache)

        return jax.jit(step, donate_argnums=2)

    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """Full causal forward, no cache: float32 logits ``[B, T, V]`` (HF ``logits`` semantics)."""
        tokens = self._check_tokens(token_ids)
        return np.asarray(self._forward(self.params, jnp.asarray(tokens)))

    def init_cache(self, batch: int, capacity: int) -> DenseCache:
        return self.module.init_cache(batch, capacity)

    def step(self, tokens_BT: np.ndarray, cache: DenseCache) -> tuple[jax.Array, DenseCache]:
        """Append tokens to a cache (donated) and return their logits ``f32[B, T, V]``."""
        return self._step(self.params, jnp.asarray(tokens_BT, jnp.int32), cache)

    def _check_tokens(self, token_ids) -> np.ndarray:
        if isinstance(token_ids, np.ndarray):
            tokens = token_ids
        else:
            rows = [list(r) for r in token_ids]
            if len({len(r) for r in rows}) > 1:
                raise ValueError("token_ids rows have different lengths; pass one row per call or pad them yourself")
            tokens = np.asarray(rows)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"token_ids must be a non-empty [batch, tokens] array, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got {tokens.dtype}")
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}); got [{tokens.min()}, {tokens.max()}]")
        if tokens.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"{tokens.shape[1]} tokens exceed max_position_embeddings={self.cfg.max_position_embeddings}")
        return tokens.astype(np.int32)


def load_model(name_or_dir: str | Path, dtype: str = "float32", *, seed: int = 0) -> Model:
    """A preset name (random weights from ``seed``) or a HuggingFace checkpoint directory."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    jdtype = DTYPES[dtype]
    path = Path(name_or_dir)
    if path.is_dir():
        cfg = ModelConfig.from_json(path / "config.json")
        module = checkpoint.load_into(lambda: DeepseekV32(cfg, dtype=jdtype, rngs=nnx.Rngs(seed)), cfg, path, jdtype)
        return Model(str(path), module, ByteTokenizer(cfg))
    if str(name_or_dir) in PRESETS:
        cfg = ModelConfig.from_preset(str(name_or_dir))
        return Model(str(name_or_dir), DeepseekV32(cfg, dtype=jdtype, rngs=nnx.Rngs(seed)), ByteTokenizer(cfg))
    raise ConfigError(f"{name_or_dir!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")


@dataclasses.dataclass
class Result:
    output_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    metrics: dict[str, Any]


def generate(model: Model, prompts: Sequence[Sequence[int] | str], max_new_tokens: int) -> Result:
    """Greedy generation with the cached step, one request at a time.

    Stops at ``max_new_tokens`` or on one of the config's ``eos_token_id``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    outputs, reasons = [], []
    prefill_tokens = decode_tokens = 0
    decode_s = 0.0
    start = time.perf_counter()
    for prompt in prompts:
        ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        tokens = model._check_tokens([ids])
        total = tokens.shape[1] + max_new_tokens
        if total > model.cfg.max_position_embeddings:
            raise ValueError(f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_position_embeddings={model.cfg.max_position_embeddings}")
        cache = model.init_cache(1, total)
        logits, cache = model.step(tokens, cache)
        prefill_tokens += tokens.shape[1]
        out, reason = [], "length"
        t0 = time.perf_counter()
        for _ in range(max_new_tokens):
            next_id = int(jnp.argmax(logits[0, -1]))
            out.append(next_id)
            if next_id in model.cfg.eos_token_id:
                reason = "stop"
                break
            if len(out) == max_new_tokens:
                break
            logits, cache = model.step(np.array([[next_id]], np.int32), cache)
            decode_tokens += 1
        decode_s += time.perf_counter() - t0
        outputs.append(out)
        reasons.append(reason)
    wall = time.perf_counter() - start
    metrics = {"prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens, "wall_s": wall,
               "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0}
    return Result(outputs, [model.tokenizer.decode(o) for o in outputs], reasons, metrics)

"""The Python API: ``load_model``, ``Model.logits``, ``generate`` and ``loglikelihood``."""

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

from ess_jax import checkpoint, families
from ess_jax import mesh as device_mesh
from ess_jax.config import ModelConfig, resolve_model
from ess_jax.engine import Engine, EngineConfig, RequestSpec, steps
from ess_jax.sampling import SamplingParams
from ess_jax.tokenizer import ChatTemplate, Tokenizer, load_chat_template, load_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@functools.partial(jax.jit, static_argnums=0)
def _forward(graph: steps.Graph, params, tokens_BT):
    """``Model.logits``' forward: traced once for every loaded model of one graph (not once per ``Model``)."""
    return nnx.merge(graph.graphdef, params)(tokens_BT)


class Model:
    """A loaded model: config, parameters and the jitted functions over them.

    The NNX module is split once into a static graph definition and a parameter pytree; every
    jitted function merges them inside the trace, so each call pays no Python object-graph walk.
    """

    def __init__(self, name: str, module: nnx.Module, tokenizer: Tokenizer,
                 chat_template: ChatTemplate | None = None):
        self.name = name
        self.cfg: ModelConfig = module.cfg
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # the checkpoint's, if it has one
        self.graphdef, self.params = nnx.split(module)

    @property
    def module(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params)

    @functools.cached_property
    def _graph(self) -> steps.Graph:
        return steps.Graph(self.graphdef, "xla")

    def logits(self, token_ids: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
        """Full causal forward, no cache: float32 logits ``[B, T, V]`` (HF ``logits`` semantics)."""
        tokens = self._check_tokens(token_ids)
        return np.asarray(_forward(self._graph, self.params, jnp.asarray(tokens)))

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
            raise ValueError(f"{tokens.shape[1]} tokens exceed "
                             f"max_position_embeddings={self.cfg.max_position_embeddings}")
        return tokens.astype(np.int32)


def load_model(name_or_dir: str | Path, dtype: str = "float32", *, seed: int = 0,
               weights: str = "dequantized", mesh: str | None = None, index_share: str | None = None) -> Model:
    """A shipped checkpoint (``config.CHECKPOINTS``: trained tiny models), a preset name (random weights
    from ``seed``) or a HuggingFace checkpoint directory.

    A checkpoint's quantized weights (FP8 with block scales, V4's packed FP4 experts) are dequantized to
    ``dtype`` at load (``weights="dequantized"``), or kept on the device in their stored bytes and
    dequantized inside each step where a layer reads them (``weights="release"``: the device holds the
    release's bytes, not the dequantized model's). ``mesh`` (``"data=D,expert=E"``): the parameters made on
    that device mesh by ``ess_jax.mesh``'s rules, so an engine on the same mesh uses them as they are: a
    checkpoint's read part by part, each process reading only what its devices hold
    (``checkpoint.load_into``); a preset's placed there once made. ``index_share``: an Index Share pattern
    ("every-N" or F / S letters per indexed layer, ``config.index_share_types``) served instead of the config's:
    its shared layers' indexers are not read."""
    return _load(name_or_dir, dtype, seed, weights, device_mesh.make(device_mesh.parse(mesh)) if mesh else None,
                 index_share)


def _load(name_or_dir: str | Path, dtype: str, seed: int, weights: str, mesh: jax.sharding.Mesh | None,
          index_share: str | None = None) -> Model:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if weights not in checkpoint.WEIGHTS:
        raise ValueError(f"weights={weights!r} is not supported; use one of {', '.join(checkpoint.WEIGHTS)}")
    jdtype = DTYPES[dtype]
    source = resolve_model(name_or_dir, index_share)
    if source.checkpoint is None and weights == "release":
        raise ValueError(f"weights='release' keeps a checkpoint's quantized tensors as stored; preset "
                         f"{source.name!r} has random weights and no checkpoint: load it dequantized")
    cfg = families.source_config(source)
    cls = families.get(cfg.family).module_cls
    if source.checkpoint is not None:
        module = checkpoint.load_into(cls, cfg, source.checkpoint, jdtype, weights, mesh)
        return Model(source.name, module, load_tokenizer(source.checkpoint, cfg), load_chat_template(source.checkpoint))
    model = Model(source.name, cls(cfg, dtype=jdtype, rngs=nnx.Rngs(seed)), load_tokenizer(None, cfg))
    if mesh is not None:
        model.params = device_mesh.place_params(model.params, mesh)
    return model


@dataclasses.dataclass
class Result:
    output_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    metrics: dict[str, Any]
    pool_size: int | None = None  # device pool slots per (layer, request) with --offload ess


def generate(model: Model, prompts: Sequence[Sequence[int] | str], max_new_tokens: int, *,
             sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
             engine: EngineConfig = EngineConfig(), progress: bool = False) -> Result:
    """Serve ``prompts`` (text or token ids) with continuous batching; greedy unless ``sampling`` says
    otherwise (one SamplingParams for all prompts, or one per prompt). Stops at ``max_new_tokens``,
    on one of ``stop_token_ids`` or on one of the config's ``eos_token_id`` (unless ``ignore_eos``)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    encoded = [model.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    if not encoded:
        raise ValueError("no prompts given")
    per_prompt = [sampling] * len(encoded) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(per_prompt) != len(encoded):
        raise ValueError(f"{len(per_prompt)} sampling parameter sets for {len(encoded)} prompts")
    # Size the engine to this workload: no batch rows or page-table columns beyond what it can use (the rows a
    # multiple of the mesh's data shards).
    longest = max(len(p) for p in encoded) + max_new_tokens + 2 * engine.num_speculative_tokens  # + the drafts
    engine = dataclasses.replace(engine, max_batch=device_mesh.batch_rows(len(encoded), engine.max_batch, engine.mesh),
                                 max_seq_len=engine.max_seq_len or min(longest, model.cfg.max_position_embeddings))
    start = time.perf_counter()
    server = Engine(model, engine, progress=progress)
    for i, (prompt, params) in enumerate(zip(encoded, per_prompt)):
        try:
            server.add_request(RequestSpec(prompt, max_new_tokens, params, stop_token_ids, ignore_eos=ignore_eos))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    requests = server.run()
    stats = server.stats
    metrics = {"prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens,
               "wall_s": time.perf_counter() - start,
               "decode_tokens_per_s": stats.decode_tokens / stats.decode_s if stats.decode_s > 0 else 0.0,
               "cache": server.cache_bytes(), "offload": server.offload_metrics(),
               "speculative": server.speculative_metrics(), "prefix_cache": server.prefix_cache_metrics()}
    outputs = [r.output_ids for r in requests]
    return Result(outputs, [model.tokenizer.decode(o) for o in outputs], [r.finish_reason for r in requests], metrics,
                  server.layout.pool_slots)


def loglikelihood(model: Model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                  engine: EngineConfig | Engine = EngineConfig()) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``loglikelihood`` contract on token ids, without a server: for each ``(context,
    continuation)`` the continuation's log-probability after the context (natural log, summed over its tokens)
    and whether it is the greedy one (each of its tokens the most likely, the lower id first on ties). Scored
    by the engine's prompt log-probabilities (``RequestSpec(..., prompt_logprobs=1)``: context and
    continuation as one prompt, prefilled in pieces, nothing generated), every request batched: on an engine
    sized to the workload as ``generate`` sizes it (``engine`` an EngineConfig; ``offload="ess"`` for the host
    tier), or on ``engine`` itself, an idle ``Engine`` of this model (its compiled steps reused from call to
    call, as ``ess_jax.lm_eval`` does)."""
    pairs = [([int(t) for t in context], [int(t) for t in continuation]) for context, continuation in requests]
    if not pairs:
        raise ValueError("no requests given")
    for i, (context, continuation) in enumerate(pairs):
        if not context or not continuation:
            what = "context" if not context else "continuation"
            raise ValueError(f"request {i}: the {what} is empty; a context needs one token at least (lm-eval "
                             "puts the eot token there) and a continuation one to score")
    if isinstance(engine, Engine):
        if engine.model is not model or engine.has_unfinished():
            raise ValueError("engine must be an idle Engine of this model (no unfinished requests)")
        server = engine
    else:
        longest = max(len(c) + len(x) for c, x in pairs)
        server = Engine(model, dataclasses.replace(
            engine, max_batch=device_mesh.batch_rows(len(pairs), engine.max_batch, engine.mesh),
            max_seq_len=engine.max_seq_len or min(longest, model.cfg.max_position_embeddings)))
    specs = [RequestSpec(context + continuation, 0, prompt_logprobs=1) for context, continuation in pairs]
    for i, spec in enumerate(specs):  # every request checked before any is queued
        try:
            server.check_request(spec)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    for spec in specs:
        server.add_request(spec)
    out = []
    for (context, _), request in zip(pairs, server.run()):
        scored = request.prompt_scores[len(context):]
        out.append((sum(lp.logprob for lp in scored), all(lp.top[0][0] == lp.token_id for lp in scored)))
    return out

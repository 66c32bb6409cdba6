"""Temporal locality (ESS Fig. 2): the indexer's top-k ids of one request (``topk_trace``), their overlap from
step to step (``trace_overlaps``) and the tier's LRU replayed over them at several pool sizes (``pool_sweep``,
through ``tier.lru_reference``). Axis letters: ess_jax.notation (L layers, S decode steps, T warm-up queries,
K top-k)."""

from __future__ import annotations

import dataclasses

import numpy as np


def topk_overlap(current_LK: np.ndarray, previous_LK: np.ndarray, shift: int = 0) -> np.ndarray:
    """``|K_t & (K_t-1 + shift)| / |K_t|`` per layer ``f32[L]`` over the valid (>= 0) ids; 0 for an empty
    ``K_t``. ``shift`` 0 is the raw overlap, 1 the shifted one (every previous id moved one id on)."""
    overlap_L = np.zeros(current_LK.shape[0], np.float32)
    for layer, (cur, prev) in enumerate(zip(current_LK, previous_LK)):
        cur = cur[cur >= 0]
        overlap_L[layer] = np.isin(cur, prev[prev >= 0] + shift).sum() / max(cur.size, 1)
    return overlap_L


@dataclasses.dataclass
class Trace:
    """The indexer's top-k ids of one request, as the tier sees them (L: the layers with an indexer,
    ``layers``; V3.2: every layer, ids are positions; V4: the CSA layers, ids are CSA entries; -1 = none)."""

    layers: list[int]
    top_k: int
    warm_LTK: np.ndarray  # i32[L, T, K] the last prompt positions' ids, as the engine's warm-up reads them
    ids_LSK: np.ndarray  # i32[L, S, K] each decode step's ids
    new_S: np.ndarray  # i32[S] the entry each decode step writes (V4: the CSA window it closes; -1: none)
    prompt_entries: int  # entries the prompt holds (V3.2: its tokens; V4: its closed CSA windows)
    entries: int  # entries of the whole request, prompt + S + 1 tokens (the pool ratio's base)
    ids: str = "positions"  # what the ids name: "positions" (one entry per token) or "compressed entries"

    @property
    def last_LK(self) -> np.ndarray:
        """The last prompt position's ids (the last warm-up query)."""
        return self.warm_LTK[:, -1]


def greedy_row():
    """One row's greedy sampling (``steps.SamplingBatch``)."""
    from ess_jax.engine import steps
    from ess_jax.sampling import SamplingParams

    return steps.SamplingBatch.of([SamplingParams()], [0])


def scratch(model, max_seq_len: int, page_size: int, cache_dtype: str | None, graph):
    """A one-row cache as an offloaded engine's prefill scratch for ``max_seq_len`` tokens (``layout.prefill_scratch``),
    its page table ``i32[1, X]`` (the pages 1..X; 0 is the null page) and an empty window of top-k ids
    ``i32[L, 1, Q, K]`` (-1; ``layout.window_shape``), L the model's layers that select."""
    import jax.numpy as jnp
    from ess_jax import families
    from ess_jax.engine import layout

    size = families.CacheSize(rows=1, pages=1, page_size=page_size, max_seq_len=max_seq_len)  # one request's engine
    make, scratch_size = layout.prefill_scratch(model.module, size, cache_dtype)
    table_BX = jnp.arange(1, scratch_size.pages, dtype=jnp.int32)[None]
    window = jnp.full(layout.window_shape(graph, model.params, size), -1, jnp.int32)
    return make(scratch_size), table_BX, window


def run_piece(model, graph, tokens: list[int], start: int, table_BX, cache, window):
    """The request's ``tokens`` at positions ``start...`` through the engine's prefill step (``steps.prefill``):
    the greedy token after them, the window of the last positions' top-k ids and the cache."""
    import jax.numpy as jnp
    from ess_jax.cache import StepMeta
    from ess_jax.engine import steps

    meta = StepMeta(jnp.asarray(start + np.arange(len(tokens), dtype=np.int32))[None], jnp.ones((1, len(tokens)), bool),
                    table_BX, jnp.zeros((1,), jnp.int32))
    tokens_BT = jnp.asarray([tokens], jnp.int32)
    token, _, _, window, cache, _, _ = steps.prefill(graph, model.params, tokens_BT, meta, cache, greedy_row(), window,
                                                     jnp.zeros_like(tokens_BT))
    return int(token[0]), window, cache


def topk_trace(model, prompt: list[int], steps: int, *, chunk: int, page_size: int = 64, cache_dtype: str | None = None,
               kernels: str = "xla") -> Trace:
    """The top-k ids of one request of ``prompt`` and ``steps + 1`` greedy new tokens (``steps`` decode
    steps), from a resident pass on the cache an offloaded engine prefills on (its one-row scratch, sized
    for this request): the prompt runs through the engine's own prefill step in the engine's pieces
    (``--prefill-chunk``, the rest in powers of the default piece ratio: ``plan.prefill_pieces``), so the warm-up
    ids are those an ESS engine's warm-up reads; then ``steps`` decode steps, each a one-token piece of the same
    step (its ids the last of the window)."""
    import jax.numpy as jnp
    from ess_jax import families
    from ess_jax.engine import EngineConfig
    from ess_jax.engine.plan import prefill_pieces
    from ess_jax.engine.steps import Graph

    family = families.get(model.cfg.family)
    model_format = jnp.dtype(model.module.dtype).name
    formats = family.stored_formats(cache_dtype or model_format, model_format)
    part = next(p for p in family.cache_parts(model.cfg, formats) if p.where == "offloaded")
    max_seq_len = len(prompt) + steps + 1
    graph = Graph(model.graphdef, kernels)  # the prefill step's static argument, made once
    cache, table_BX, window = scratch(model, max_seq_len, page_size, cache_dtype, graph)
    start = 0
    for real in prefill_pieces(len(prompt), chunk, EngineConfig.prefill_piece_ratio):  # the engine's pieces
        token, window, cache = run_piece(model, graph, prompt[start:start + real], start, table_BX, cache, window)
        start += real
    warm_LTK = np.asarray(window[:, 0])
    ids, new, m = [], [], part.tokens_per_row
    for position in range(len(prompt), len(prompt) + steps):
        token, window, cache = run_piece(model, graph, [token], position, table_BX, cache, window)
        ids.append(np.asarray(window[:, 0, -1]))
        new.append((position + 1) // m - 1 if (position + 1) % m == 0 else -1)  # the entry this token completes
    ids_LSK = np.stack(ids, axis=1) if ids else np.zeros(warm_LTK.shape[:1] + (0,) + warm_LTK.shape[2:], np.int32)
    return Trace(family.sparse_layers(model.cfg), part.topk, warm_LTK, ids_LSK, np.asarray(new, np.int32),
                 part.entries(len(prompt)), part.entries(max_seq_len),
                 "positions" if part.tokens_per_row == 1 else "compressed entries")


def trace_overlaps(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Raw and shifted overlap ``f32[L, S]`` of each decode step's top-k set with the previous step's (step
    0: with the last prompt position's)."""
    steps = trace.ids_LSK.shape[1]
    raw_LS, shifted_LS = (np.zeros((trace.ids_LSK.shape[0], steps), np.float32) for _ in range(2))
    previous_LK = trace.last_LK
    for t in range(steps):
        current_LK = trace.ids_LSK[:, t]
        raw_LS[:, t], shifted_LS[:, t] = topk_overlap(current_LK, previous_LK), topk_overlap(current_LK, previous_LK, 1)
        previous_LK = current_LK
    return raw_LS, shifted_LS


def pool_sweep(trace: Trace, ratios: list[float]) -> list[dict]:
    """The LRU simulation at pool sizes top_k + 1, 2 x top_k, 4 x top_k and each pool ratio of the
    request's entries (``tier.pool_slots``, as an engine serving this request sizes its pools)."""
    from ess_jax.tier import lru_reference, pool_slots

    k = trace.top_k
    sizes = [("k+1", k + 1, None), ("2k", 2 * k, None), ("4k", 4 * k, None)] + [(f"r={r:g}", None, r) for r in ratios]
    rows = []
    for label, size, ratio in sizes:
        slots = pool_slots(trace.entries, k, pool_size=size, pool_ratio=ratio)
        counts = lru_reference.replay(trace.warm_LTK, trace.ids_LSK, trace.new_S, trace.prompt_entries, trace.entries,
                                      slots)
        lookups, hits, misses = (int(x) for x in counts.sum(0))
        rows.append({"pool": label, "pool_size": size, "pool_ratio": ratio, "slots": slots, "lookups": lookups,
                     "hits": hits, "misses": misses, "hit_rate": hits / lookups if lookups else 0.0,
                     "per_layer": [{"layer": layer, "lookups": int(c[0]), "hits": int(c[1]), "misses": int(c[2]),
                                    "hit_rate": int(c[1]) / int(c[0]) if c[0] else 0.0}
                                   for layer, c in zip(trace.layers, counts)]})
    return rows


def locality_pass(model, prompts: dict[int, list[int]], args, log) -> dict:
    """The locality pass at each context: overlaps and the pool-size sweep per layer."""
    contexts = []
    for context, prompt in prompts.items():
        log(f"locality: resident pass, {context} prompt tokens + {args.locality_steps} decode steps")
        trace = topk_trace(model, prompt, args.locality_steps, chunk=args.prefill_chunk, cache_dtype=args.cache_dtype,
                           kernels=args.kernels)
        raw_LS, shifted_LS = trace_overlaps(trace)
        contexts.append({"context": context, "prompt_entries": trace.prompt_entries, "entries": trace.entries,
                         "raw_overlap": raw_LS.tolist(), "shifted_overlap": shifted_LS.tolist(),
                         "raw_overlap_mean": raw_LS.mean(1).tolist(),
                         "shifted_overlap_mean": shifted_LS.mean(1).tolist(),
                         "lru": pool_sweep(trace, args.pool_sweep)})
    return {"steps": args.locality_steps, "layers": trace.layers, "top_k": trace.top_k,
            "ids": trace.ids, "contexts": contexts}

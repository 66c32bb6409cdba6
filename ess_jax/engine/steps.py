"""The engine's device steps: pure functions of parameters, step metadata and caches, jitted at module level
so that engines over the same model and shapes share their executables, each donating the cache it returns.

- ``prefill``: one exact piece of one prompt per data shard ``[D, T]`` (the shards without one do not run);
- ``score``: a prefill piece's prompt log-probabilities, each position's of the prompt's next token and its top-N
  (``PromptScores``), reduced on the device from the piece's final hidden states through the head;
- ``decode``: every batch row's last token and its drafts ``[B, 1 + K]`` (speculative decoding; K = 0 without),
  verified, the rejected drafts' writes undone, inactive rows masked;
- ``draft``: the MTP module's next drafts after a decode step (the prefill drafts within its own call);
- ``handoff``, ``release``, ``flush``, ``load_prefix``: the offloaded tier's moves (``ess_jax.engine.offload``);
- ``row_state``, ``resume``: a batch row's state (V4's window and rings) out to a prefix-cache snapshot and back;
  ``read_pages``, ``write_pages``: a prompt's pages out to the prefix cache's disk store and back.

``shardings`` (static): the cache's ``mesh.Layout`` on the engine's mesh; the steps then run per data shard
(``mesh.per_shard``), their batch-row-major arguments split over ``data``. None: one device.

``catalog`` declares the steps a configuration compiles, each once (``StepSpec``: the step, its static arguments,
its arguments' shapes, its results' shardings) over an engine's arrays or their shapes (``EngineArrays``): the runner
compiles its decode step from it, ``ess_jax.export`` lowers and compiles them all."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ess_jax import families, mesh, tier
from ess_jax.cache import StepMeta
from ess_jax.engine.config import EngineConfig
from ess_jax.engine.layout import MODE_SPECS, CacheLayout, meta_shapes
from ess_jax.engine.plan import piece_sizes
from ess_jax.sampling import SamplingParams, sample, verify

ROWS, ALL = PartitionSpec("data"), PartitionSpec()  # a batch-row-major argument split over the shards; replicated
LAYER_ROWS = PartitionSpec(None, "data")  # a [L, rows, ...] argument split over the shards


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Each row's sampling parameters (``ess_jax.sampling.sample``'s arguments)."""

    temperature_B: jax.Array  # f32[B]
    top_k_B: jax.Array  # i32[B]
    top_p_B: jax.Array  # f32[B]
    seed_B: jax.Array  # u32[B]
    step_B: jax.Array  # i32[B] tokens the row's request has generated so far

    @classmethod
    def of(cls, params: Sequence[SamplingParams], steps_B) -> SamplingBatch:
        """The batch of one row per ``params``, each row's request having generated ``steps_B`` tokens."""
        return cls(jnp.asarray([p.temperature for p in params], jnp.float32),
                   jnp.asarray([p.top_k for p in params], jnp.int32),
                   jnp.asarray([p.top_p for p in params], jnp.float32),
                   jnp.asarray([p.seed for p in params], jnp.uint32), jnp.asarray(steps_B, jnp.int32))

    @classmethod
    def shapes(cls, rows: int) -> SamplingBatch:
        """The shapes and dtypes (``jax.ShapeDtypeStruct``) of a batch of ``rows`` rows, to lower a step ahead."""
        return jax.eval_shape(lambda: cls.of([SamplingParams()] * rows, np.zeros(rows, np.int32)))

    def sample(self, logits_BV: jax.Array) -> jax.Array:
        return sample(logits_BV, self.temperature_B, self.top_k_B, self.top_p_B, self.seed_B, self.step_B)

    def verify(self, logits_BTV: jax.Array, drafts_BK: jax.Array, forced_B: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``ess_jax.sampling.verify`` of deterministic drafts (each a one-hot draft distribution)."""
        q_BKV = jax.nn.one_hot(drafts_BK, logits_BTV.shape[-1], dtype=jnp.float32)
        return verify(logits_BTV, drafts_BK, q_BKV, self.temperature_B, self.top_k_B, self.top_p_B, self.seed_B,
                      self.step_B, forced_B)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptScores:
    """A prefill piece's log-softmax at each position, reduced to what prompt log-probabilities report."""

    logprob_BT: jax.Array  # f32[B, T] of the target (the prompt's next token) at each position
    rank_BT: jax.Array  # i32[B, T] 1 + the number of tokens more likely than the target
    top_ids_BTK: jax.Array  # i32[B, T, K] the K most likely tokens, most likely first (lower id first on ties)
    top_BTK: jax.Array  # f32[B, T, K] their log-probabilities


def prompt_scores(logits_BTV: jax.Array, targets_BT: jax.Array, top: int) -> PromptScores:
    """``PromptScores`` of the ``top`` best from a piece's logits (float32 log-softmax)."""
    logprobs_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    target_BT = jnp.take_along_axis(logprobs_BTV, targets_BT[..., None], axis=-1)[..., 0]
    rank_BT = (logprobs_BTV > target_BT[..., None]).sum(-1, dtype=jnp.int32) + 1
    top_BTK, ids_BTK = jax.lax.top_k(logprobs_BTV, top)
    return PromptScores(target_BT, rank_BT, ids_BTK.astype(jnp.int32), top_BTK)


def placement(device_mesh, spec: PartitionSpec) -> jax.sharding.Sharding:
    """``spec`` on the engine's mesh (concrete or abstract); without one (None) the one device."""
    return (NamedSharding(device_mesh, spec) if device_mesh is not None
            else jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def placed(shardings: mesh.Layout | None, cache):
    """``cache`` in ``shardings`` (the engine's mesh; None: one device, as it is)."""
    return shardings.constrain(cache) if shardings else cache


def on_shards(fn, shardings: mesh.Layout | None, in_specs, out_specs):
    """``fn`` per data shard on the engine's mesh (``mesh.per_shard``); on one device (None) ``fn`` itself."""
    return mesh.per_shard(fn, shardings.mesh, in_specs, out_specs) if shardings else fn


def next_window(prev_LBQK: jax.Array, ids_LBTK: jax.Array, meta: StepMeta) -> jax.Array:
    """The top-k ids ``i32[L, B, Q, K]`` of each row's last ``Q = WARMUP_QUERIES`` prompt positions so far
    (-1 before the prompt), after the piece whose ids are ``ids_LBTK`` (every position real): the piece's last
    ``Q`` positions, preceded by ``prev_LBQK``'s last ones when the piece is shorter. A row whose piece starts
    the prompt (position 0) forgets its previous window; a row that does not run keeps it."""
    q, t = tier.WARMUP_QUERIES, ids_LBTK.shape[2]
    window_T = t - q + jnp.arange(q)
    ids_LBQK = jnp.where((window_T >= 0)[None, None, :, None],
                         jnp.take(ids_LBTK, jnp.maximum(window_T, 0), axis=2), -1)
    prev_LBQK = jnp.where((meta.positions[:, 0] == 0)[None, :, None, None], -1, prev_LBQK)
    if t < q:
        ids_LBQK = jnp.concatenate([prev_LBQK[:, :, t:], ids_LBQK[:, :, q - t:]], axis=2)
    return jnp.where(meta.valid[:, 0][None, :, None, None], ids_LBQK, prev_LBQK)


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """The model as every step's static argument: its graph and the kernel choice, hashed once. jit hashes its static
    arguments at every call, and a graph's own hash walks all its nodes (milliseconds, each prefill piece)."""

    graphdef: nnx.GraphDef
    kernels: str
    key: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "key", hash((self.graphdef, self.kernels)))

    def __hash__(self) -> int:
        return self.key

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Graph) and self.key == other.key
                                 and (self.graphdef, self.kernels) == (other.graphdef, other.kernels))


def _prefill(graph: Graph, params, tokens_BT, meta: StepMeta, cache, sampling: SamplingBatch, window_LBQK,
             targets_BT, mtp_cache=None, mtp_meta=None, last_B=None, shardings=None, mtp_shardings=None,
             drafts: int = 0):
    """One prefill piece, a row per data shard (rows not valid: nothing written). Returns the token sampled after
    each row's last token ``i32[B]``, its logits ``f32[B, V]``, the piece's final hidden states (what ``score``
    reads for prompt log-probabilities; unused otherwise), each row's window of top-k ids (``next_window``) and
    the cache; then, with ``mtp_cache`` (speculative decoding with the MTP module, whose cache is the request's
    own pages and batch row: ``mtp_meta``), the drafts after the piece (``drafts`` of them, static;
    ``mtp_drafts``: meaningful where the piece ends the prompt, ``last_B``: there the pair at its last position
    has the sampled token; ``targets_BT``: each position's next prompt token) and the MTP cache, else None and
    None."""
    def run(params, tokens_BT, meta, cache, sampling, window_LBQK, targets_BT, mtp_cache, mtp_meta, last_B):
        module, kernels = nnx.merge(graph.graphdef, params), graph.kernels
        logits_BTV, hidden, ids_LBTK, cache = module.step_hidden(tokens_BT, meta, cache, kernels=kernels)
        logits_BV = logits_BTV[:, -1]
        window_LBQK = next_window(window_LBQK, ids_LBTK, meta).astype(window_LBQK.dtype)
        token_B = sampling.sample(logits_BV)
        drafts_BK = None
        if mtp_cache is not None:
            next_BT = targets_BT.at[:, -1].set(jnp.where(last_B, token_B, targets_BT[:, -1]))
            t = tokens_BT.shape[1]
            drafts_BK, mtp_cache = mtp_drafts(module, hidden, next_BT, mtp_meta, mtp_cache,
                                              jnp.where(mtp_meta.valid[:, 0], t, 0), drafts, kernels)
        return token_B, logits_BV, hidden, window_LBQK, cache, drafts_BK, mtp_cache

    specs, mtp_specs = shardings and shardings.specs, mtp_shardings and mtp_shardings.specs
    drafted = ROWS if mtp_cache is not None else None
    token, logits_BV, hidden, window_LBQK, cache, drafts_BK, mtp_cache = on_shards(
        run, shardings, (ALL, ROWS, ROWS, specs, ROWS, LAYER_ROWS, ROWS, mtp_specs, drafted, drafted),
        (ROWS, ROWS, ROWS, LAYER_ROWS, specs, drafted, mtp_specs))(
        params, tokens_BT, meta, cache, sampling, window_LBQK, targets_BT, mtp_cache, mtp_meta, last_B)
    if shardings:  # the window in the shardings it was built with, whatever the partitioner chose
        window_LBQK = jax.lax.with_sharding_constraint(window_LBQK, NamedSharding(shardings.mesh, LAYER_ROWS))
    return (token, logits_BV, hidden, window_LBQK, placed(shardings, cache), drafts_BK,
            placed(mtp_shardings, mtp_cache))


def _score(graph: Graph, params, hidden, targets_BT, top: int, shardings=None):
    """A prefill piece's ``PromptScores`` of ``targets_BT`` (``i32[B, T]``, each position's next prompt token),
    the ``top`` best kept (static), from its final hidden states ``hidden`` (``prefill``'s) through the model's
    head: a step of its own, so the prefill compiles once per piece size whether or not a prompt is scored.
    ``shardings``: the prefill's (its rows split over the data shards; None: one device)."""
    def run(params, hidden, targets_BT):
        return prompt_scores(nnx.merge(graph.graphdef, params).head(hidden), targets_BT, top)

    return on_shards(run, shardings, (ALL, ROWS, ROWS), ROWS)(params, hidden, targets_BT)


def mtp_drafts(module, hidden, next_BT, meta: StepMeta, mtp_cache, kept_B, drafts: int, kernels: str):
    """The MTP module's ``drafts`` tokens after each row's last kept position, and its cache (``models.mtp``).

    The module runs over the step's positions (the pairs of the main model's hidden state ``hidden`` and the
    token after it, ``next_BT``), keeps the first ``kept_B`` of them (a verification step's accepted run;
    ``rollback`` undoes the rest), and its logits at the last kept position give the first draft (greedy: the
    argmax, a deterministic drafter). Each further draft chains the module on its own output hidden state and
    the draft before it, one position on; what the chain wrote is undone, so the cache holds verified
    positions only. Returns ``i32[B, drafts]`` and the cache."""
    before = mtp_cache
    logits_BTV, out, mtp_cache = module.mtp_step(hidden, next_BT, meta, mtp_cache, kernels=kernels)
    mtp_cache = mtp_cache.rollback(before, meta, kept_B)
    last_B = jnp.maximum(kept_B - 1, 0)
    at_last = lambda x: jnp.take_along_axis(  # noqa: E731 - each row's last kept position, T kept as 1
        x, last_B.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)
    token_B = jnp.argmax(at_last(logits_BTV)[:, 0], axis=-1).astype(jnp.int32)
    hidden, tokens = at_last(out), [token_B]
    chain = StepMeta(at_last(meta.positions) + 1 + jnp.arange(drafts - 1), jnp.broadcast_to(
        meta.valid[:, :1], (meta.valid.shape[0], drafts - 1)), meta.page_table, meta.rows)
    chained = mtp_cache
    for j in range(drafts - 1):
        one = StepMeta(chain.positions[:, j:j + 1], chain.valid[:, j:j + 1], meta.page_table, meta.rows)
        logits_BTV, hidden, chained = module.mtp_step(hidden, tokens[-1][:, None], one, chained, kernels=kernels)
        tokens.append(jnp.argmax(logits_BTV[:, 0], axis=-1).astype(jnp.int32))
    if drafts > 1:
        mtp_cache = chained.rollback(mtp_cache, chain, jnp.zeros_like(kept_B))
    return jnp.stack(tokens, axis=1), mtp_cache


def _decode(graph: Graph, params, tokens_BT, meta: StepMeta, cache, sampling: SamplingBatch, forced_B,
            shardings=None):
    """One decode step for every batch row: each row's last token and its ``K = T - 1`` drafts (speculative
    decoding; ``K = 0`` without), verified in one pass of the model. Returns the tokens ``i32[B, T]`` and the
    drafts each row accepted ``i32[B]`` (``sampling.verify``; without drafts the sampled token and 0), every
    position's logits ``f32[B, T, V]``, the cache, in which what the rejected drafts wrote is undone
    (``rollback``): each row holds its cache as if it had decoded its accepted tokens one at a time; with drafts
    also the main model's hidden states and each row's kept positions ``i32[B]`` (the accepted run, 0 for a row
    that does not run), the next step's drafting's input (``draft``), else None and None. ``forced_B``: rows that
    accept every draft (teacher forcing)."""
    def run(params, tokens_BT, meta, cache, sampling, forced_B):
        module = nnx.merge(graph.graphdef, params)
        before = cache.begin_step()
        logits_BTV, hidden, _, cache = module.step_hidden(tokens_BT, meta, before, kernels=graph.kernels)
        if tokens_BT.shape[1] == 1:
            return sampling.sample(logits_BTV[:, 0])[:, None], jnp.zeros_like(forced_B, jnp.int32), logits_BTV, \
                cache, None, None
        tokens_BT, accepted_B = sampling.verify(logits_BTV, tokens_BT[:, 1:], forced_B)
        kept_B = jnp.where(meta.valid[:, 0], accepted_B + 1, 0)
        return tokens_BT, accepted_B, logits_BTV, cache.rollback(before, meta, kept_B), hidden, kept_B

    specs = shardings and shardings.specs
    verified = ROWS if tokens_BT.shape[1] > 1 else None
    tokens_BT, accepted_B, logits_BTV, cache, hidden, kept_B = on_shards(
        run, shardings, (ALL, ROWS, ROWS, specs, ROWS, ROWS), (ROWS, ROWS, ROWS, specs, verified, verified))(
        params, tokens_BT, meta, cache, sampling, forced_B)
    return tokens_BT, accepted_B, logits_BTV, placed(shardings, cache), hidden, kept_B


def _draft(graph: Graph, params, hidden, tokens_BT, meta: StepMeta, kept_B, mtp_cache, mtp_shardings=None):
    """The MTP module's next ``K = T - 1`` drafts per row after a decode step (``mtp_drafts`` over the step's
    hidden states ``hidden``, its verified tokens ``tokens_BT``, its ``meta`` and kept positions ``kept_B``):
    ``i32[B, K]`` and the MTP cache. A step of its own, so the engine can time drafting apart from verifying."""
    def run(params, hidden, tokens_BT, meta, kept_B, mtp_cache):
        module = nnx.merge(graph.graphdef, params)
        return mtp_drafts(module, hidden, tokens_BT, meta, mtp_cache, kept_B, tokens_BT.shape[1] - 1, graph.kernels)

    specs = mtp_shardings and mtp_shardings.specs
    drafts_BK, mtp_cache = on_shards(run, mtp_shardings, (ALL, ROWS, ROWS, ROWS, ROWS, specs), (ROWS, specs))(
        params, hidden, tokens_BT, meta, kept_B, mtp_cache)
    return drafts_BK, placed(mtp_shardings, mtp_cache)


def _handoff(family: families.Family, cache, scratch, table_DX, pages_DX, row_D, entries_D, window_LDQK, shared_D,
             shardings=None, scratch_shardings=None):
    """The prompt prefilled on each data shard's scratch row into that shard's decode cache (``Family.handoff``):
    per shard its scratch pages ``table_DX``, its pages ``pages_DX``, its batch row ``row_D`` (past the last:
    none, the shards without a finished prompt), its entries, the top-k ids of its last prompt queries and its
    leading pages shared from the prefix cache (not written)."""
    def run(cache, scratch, table_X, pages_X, row, entries, window_LQK, shared):
        return family.handoff(cache, scratch, table_X[0], pages_X[0], row[0], entries[0], window_LQK[:, 0], shared[0])

    specs = shardings and shardings.specs
    cache = on_shards(run, shardings, (specs, scratch_shardings and scratch_shardings.specs, ROWS, ROWS, ROWS, ROWS,
                                       LAYER_ROWS, ROWS), specs)(
        cache, scratch, table_DX, pages_DX, row_D, entries_D, window_LDQK, shared_D)
    return placed(shardings, cache)


def _flush(family: families.Family, cache, shardings=None):
    """The tier's last step's rows written to the host store."""
    def run(cache):
        return family.with_store(cache, family.store_of(cache).begin_step())

    specs = shardings and shardings.specs
    return placed(shardings, on_shards(run, shardings, (specs,), specs)(cache))


def _release(family: families.Family, cache, row_D, shardings=None):
    """Empty each data shard's batch row ``row_D`` (past the last: none): its pools and their residency."""
    def run(cache, row):
        return family.with_store(cache, family.store_of(cache).release(row[0]))

    specs = shardings and shardings.specs
    return placed(shardings, on_shards(run, shardings, (specs, ROWS), specs)(cache, row_D))


def _load_prefix(family: families.Family, cache, scratch, table_DX, pages_DX, shardings=None,
                 scratch_shardings=None):
    """Each data shard's cached prompt prefix, its pages ``pages_DX`` of the decode cache and the host store (the
    null page past them), into its scratch pages ``table_DX`` (``Family.load_prefix``), for its prefill to
    continue; the scratch."""
    def run(cache, scratch, table_X, pages_X):
        return family.load_prefix(cache, scratch, table_X[0], pages_X[0])

    specs, scratch_specs = shardings and shardings.specs, scratch_shardings and scratch_shardings.specs
    scratch = on_shards(run, shardings, (specs, scratch_specs, ROWS, ROWS), scratch_specs)(
        cache, scratch, table_DX, pages_DX)
    return placed(scratch_shardings, scratch)


def _row_state(cache, row):
    """Batch row ``row``'s state (``row_arrays``: V4's window and compressor rings) of a cache whose rows are all on
    the device (the resident decode cache, the prefill scratch, the MTP module's): the prefix cache's snapshot."""
    return jax.tree.map(lambda x: x[:, row], cache.row_arrays())


def _resume(cache, row, state, shardings=None):
    """``cache`` with batch row ``row``'s state set to ``state`` (a ``row_state`` snapshot): a prefill continuing a
    cached prefix starts from it."""
    arrays = jax.tree.map(lambda x, s: x.at[:, row].set(s.astype(x.dtype)), cache.row_arrays(), state)
    return placed(shardings, cache.with_row_arrays(arrays))


def _read_pages(cache, pages_X):
    """The paged arrays (``paged_arrays``) of a cache whose rows are all on the device at pages ``pages_X``
    (``i32[X]``, global ids): ``[L, X, Z, ...]`` each, a cached prompt's pages for the prefix cache's disk store."""
    return jax.tree.map(lambda x: x[:, pages_X], cache.paged_arrays())


def _write_pages(cache, pages_X, arrays, shardings=None):
    """``cache`` with ``arrays`` (``read_pages``' form) written at pages ``pages_X`` (the null page absorbs the
    unused columns): pages read back from the disk store."""
    new = jax.tree.map(lambda x, a: x.at[:, pages_X].set(a.astype(x.dtype)), cache.paged_arrays(), arrays)
    return placed(shardings, cache.with_paged_arrays(new))


# The split backend's NumPy store is part of a step's static identity (its engine's own).
prefill = jax.jit(_prefill, static_argnums=0, static_argnames=("shardings", "mtp_shardings", "drafts"),
                  donate_argnums=(4, 6, 8))
score = jax.jit(_score, static_argnums=0, static_argnames=("top", "shardings"))
decode = jax.jit(_decode, static_argnums=0, static_argnames="shardings", donate_argnums=4)
draft = jax.jit(_draft, static_argnums=0, static_argnames="mtp_shardings", donate_argnums=6)
handoff = jax.jit(_handoff, static_argnums=0, static_argnames=("shardings", "scratch_shardings"), donate_argnums=1)
flush = jax.jit(_flush, static_argnums=0, static_argnames="shardings", donate_argnums=1)
release = jax.jit(_release, static_argnums=0, static_argnames="shardings", donate_argnums=1)
row_state = jax.jit(_row_state)
resume = jax.jit(_resume, static_argnames="shardings", donate_argnums=0)
read_pages = jax.jit(_read_pages)
write_pages = jax.jit(_write_pages, static_argnames="shardings", donate_argnums=0)
load_prefix = jax.jit(_load_prefix, static_argnums=0, static_argnames=("shardings", "scratch_shardings"),
                      donate_argnums=2)


@dataclasses.dataclass(frozen=True)
class EngineArrays:
    """What an engine's steps run on: its arrays (``Runner.arrays``) or their shapes (``export.abstract_engine``:
    ``jax.ShapeDtypeStruct``s in its shardings and memory kinds)."""

    layout: CacheLayout
    device_mesh: Any  # the engine's mesh, concrete or abstract (None: one device)
    graphdef: nnx.GraphDef
    params: nnx.State
    cache: Any  # the decode cache
    shardings: mesh.Layout | None  # the decode cache's (None: no --mesh)
    scratch: Any  # what prefill pieces run on: the decode cache, or with ESS the prefill scratch
    scratch_shardings: mesh.Layout | None
    window: Any  # i32[L, D, Q, K] the running window of prompt top-k ids


class StepSpec(NamedTuple):
    """One compiled step as the engine calls it: ``fn(*static, *args, **kwargs)``."""

    fn: Callable  # the jitted step
    static: tuple  # its static positional arguments
    args: tuple  # its arguments: arrays, or shapes (``jax.ShapeDtypeStruct``s) of the same shardings
    kwargs: dict  # its static keyword arguments: the caches' shardings
    out: Any  # its results' shardings, as the step returns them (a pytree prefix of its results)

    def lower(self) -> jax.stages.Lowered:
        return self.fn.lower(*self.static, *self.args, **self.kwargs)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def catalog(family: families.Family, config: EngineConfig, engine: EngineArrays) -> dict[str, StepSpec]:
    """Every step an engine of ``config`` compiles, by name, with its arguments as the runner and the offload mode pass
    them: ``decode``; ``prefill_T`` for each piece size T (``plan.piece_sizes``); with the prefix cache on a family with
    row state ``row_state`` and ``resume`` (a prompt's window and rings to a snapshot and back); the offload mode's
    own (``layout.ModeSpec.steps``; ``load_prefix`` with the prefix cache)."""
    b, d, x = config.max_batch, engine.layout.size.shards, engine.layout.pages_per_row
    t = 1 + config.num_speculative_tokens  # each row's last token and its drafts
    model = (Graph(engine.graphdef, config.kernels),)
    rows = placement(engine.device_mesh, ROWS if config.mesh else ALL)
    cache_out, scratch_out = (jax.tree.map(lambda a: a.sharding, c) for c in (engine.cache, engine.scratch))
    on_cache, on_scratch = dict(shardings=engine.shardings), dict(shardings=engine.scratch_shardings)
    on_both = dict(shardings=engine.shardings, scratch_shardings=engine.scratch_shardings)
    found = {"decode": StepSpec(decode, model, (engine.params, _i32(b, t), meta_shapes(b, t, x), engine.cache,
                                                SamplingBatch.shapes(b), jax.ShapeDtypeStruct((b,), bool)), on_cache,
                                # with drafts also the hidden states and kept lengths (``draft``'s input)
                                (rows, rows, rows, cache_out) + ((rows, rows) if t > 1 else ()))}
    for n in piece_sizes(config.prefill_chunk, config.prefill_piece_ratio):
        found[f"prefill_{n}"] = StepSpec(
            prefill, model, (engine.params, _i32(d, n), meta_shapes(d, n, x), engine.scratch, SamplingBatch.shapes(d),
                             engine.window, _i32(d, n)),
            on_scratch, (rows, rows, rows, engine.window.sharding, scratch_out))
    if config.prefix_cache and family.row_state:
        row0 = _i32()
        state = jax.eval_shape(row_state, engine.scratch, row0)
        replicated = jax.tree.map(lambda _: placement(engine.device_mesh, ALL), state)
        found |= {"row_state": StepSpec(row_state, (), (engine.scratch, row0), {}, replicated),
                  "resume": StepSpec(resume, (), (engine.scratch, row0, state), on_scratch, scratch_out)}
    table, row = _i32(d, x), _i32(d)
    moves = {"handoff": StepSpec(handoff, (family,), (engine.cache, engine.scratch, table, table, row, row,
                                                      engine.window, row), on_both, cache_out),
             "release": StepSpec(release, (family,), (engine.cache, row), on_cache, cache_out),
             "flush": StepSpec(flush, (family,), (engine.cache,), on_cache, cache_out),
             "load_prefix": StepSpec(load_prefix, (family,), (engine.cache, engine.scratch, table, table), on_both,
                                     scratch_out)}
    return found | {name: moves[name] for name in MODE_SPECS[config.offload].steps
                    if name != "load_prefix" or config.prefix_cache}

"""The runner owns what lives on the devices: the parameters (placed on the mesh), the decode cache and its
shardings, the running window of prompt top-k ids, and the compiled steps. It turns the scheduler's plans
into device calls (``prefill``, through the offload mode; ``decode``; ``release`` and ``flush``, the mode's) and
their results back into host data.

Every array a step takes is made the same way in warm-up and in serving: caches and windows committed to
their shardings when they are built (a step's outputs are committed too), host arguments made by
``jnp.asarray``. A jitted step therefore sees one signature per shape, and nothing compiles after
``Engine.warm_up``."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

from ess_jax import families, mesh, ops
from ess_jax.cache import StepMeta
from ess_jax.engine import steps
from ess_jax.engine.config import EngineConfig
from ess_jax.engine.layout import CacheLayout, window_shape
from ess_jax.engine.offload import Mode
from ess_jax.engine.request import MAX_PROMPT_LOGPROBS
from ess_jax.engine.plan import (DecodeBatch, DecodeResult, EngineStats, PrefillGroup, PrefillResult, PrefillSlice,
                                 Released, StepTimes)
from ess_jax.engine.prefix import NoPrefixIO, PrefixIO, Target
from ess_jax.engine.speculate import CallerDrafts, NoDrafts
from ess_jax.sampling import SamplingParams


class Runner:
    def __init__(self, model, config: EngineConfig, layout: CacheLayout, stats: EngineStats, mode: Mode,
                 prefix: PrefixIO | NoPrefixIO, proposer: NoDrafts | CallerDrafts):
        """``mode``: the offload mode (``offload``), whose decode cache the runner builds and owns and which runs
        the prefill groups and the releases on it; ``prefix``: the prefix cache's runner half; ``proposer``:
        speculative decoding's (``speculate``), whose device part (the MTP module's cache and drafting) runs within
        the steps."""
        self.model, self.config, self.layout, self.stats = model, config, layout, stats
        self.mode, self.prefix, self.proposer = mode, prefix, proposer
        ops.resolve_kernels(config.kernels)  # Pallas where this backend has no kernels for it: refused here
        self.graph = steps.Graph(model.graphdef, config.kernels)  # the steps' static argument: the model, the kernels
        self.mesh = mesh.make(mesh.parse(config.mesh)) if config.mesh else None
        self.params = mesh.place_params(model.params, self.mesh) if self.mesh else model.params
        self.shards = layout.size.shards
        self.rows_per_shard = config.max_batch // self.shards
        self.prompt_top = min(MAX_PROMPT_LOGPROBS, model.cfg.vocab_size)  # the top-N a scored prefill piece keeps
        self._compiled_decode = None
        with self.on_mesh():
            self.cache, self.shardings = self.build(mode.decode_cache, layout.size)
            mode.place(self.build, self.shardings)
            proposer.place(self.build, layout.size)
            self.window = self._empty_window()

    def on_mesh(self):
        """The context the engine's arrays are made and its steps run in: ``jax.set_mesh`` of its mesh."""
        return jax.set_mesh(self.mesh) if self.mesh else contextlib.nullcontext()

    def build(self, make: Callable[[families.CacheSize], object], size: families.CacheSize):
        """The cache ``make(size)`` committed to its shardings, and those shardings (``mesh.Layout``; None: one
        device): on a mesh each array over ``data`` on its batch-row or page axis (``mesh.cache_shardings``), made
        by one compiled program straight into its shards, so no device ever holds more of it than its shard."""
        if not self.mesh:
            return jax.tree.map(lambda x: jax.device_put(x, x.sharding), make(size)), None
        made = []

        def leaves():  # the cache made anew in the trace (a fresh host store: NumPy's is leafless), its structure kept
            leaves, treedef = jax.tree.flatten(make(size))
            made.append(treedef)
            return leaves

        shardings = jax.tree.leaves(mesh.cache_shardings(make, size, self.mesh)[1])
        out = jax.jit(leaves, out_shardings=shardings)()
        return jax.tree.unflatten(made[0], out), mesh.Layout.of(jax.tree.unflatten(made[0], shardings))

    def _empty_window(self) -> jax.Array:
        """No prompt positions yet on any shard: ``i32[L, D, Q, K]`` of -1, placed as ``steps.prefill`` returns it."""
        window = jnp.full(window_shape(self.graph, self.model.params, self.layout.size), -1, jnp.int32)
        return jax.device_put(window, steps.placement(self.mesh, steps.LAYER_ROWS))

    def arrays(self) -> steps.EngineArrays:
        """What the steps run on now (``steps.catalog``'s arguments): the parameters, the decode cache, what prefill
        pieces run on (the offload mode's ``prefill_on``) and the window."""
        scratch, scratch_shardings = self.mode.prefill_on(self.cache, self.shardings)
        return steps.EngineArrays(self.layout, self.mesh, self.model.graphdef, self.params, self.cache, self.shardings,
                                  scratch, scratch_shardings, self.window)

    # ---- prefill and release -------------------------------------------------------------------
    def prefill(self, group: PrefillGroup) -> PrefillResult:
        """Run ``group`` through the offload mode (on the decode cache, or the mode's scratch); its result."""
        self.cache, self.window, result = self.mode.prefill(self.cache, self.window, group, run=self._run)
        return result

    def release(self, released: list[Released]) -> None:
        """Empty what the ended requests held on the devices (the offload mode's ``release``)."""
        self.cache = self.mode.release(self.cache, released)

    def flush(self) -> None:
        """The last step's rows to the host store (the offload mode's ``flush``)."""
        with self.on_mesh():
            self.cache = self.mode.flush(self.cache)

    def _run(self, cache, shardings, window, group: PrefillGroup, table_DX: np.ndarray, row_D: np.ndarray, rows: int):
        """Run ``group`` on ``cache`` (the decode cache, or the offload mode's scratch; ``rows`` batch rows per data
        shard) with each shard's page table ``table_DX`` and batch row ``row_D`` (in its shard); the cache, the
        window and the result. A piece past a cached prefix first resumes its row's state (and its MTP cache's) from
        the prefix's snapshot; a piece the prefix cache snapshots after takes it (``prefix.PrefixIO``)."""
        for shard, piece in group.slices.items():
            cache, *rest = self.prefix.before(self._targets(cache, shardings, shard, piece, table_DX, row_D, rows),
                                              shard, piece)
            self.proposer.resumed(rest)
        cache, window, result = self._prefill(cache, shardings, window, group, table_DX, row_D)
        states, saved = {}, {}
        for shard, piece in group.slices.items():
            states[shard], saved[shard] = self.prefix.after(
                self._targets(cache, shardings, shard, piece, table_DX, row_D, rows), shard, piece)
        return cache, window, dataclasses.replace(result, states=states, saved=saved)

    def _targets(self, cache, shardings, shard: int, piece: PrefillSlice, table_DX: np.ndarray, row_D: np.ndarray,
                 rows: int) -> list[Target]:
        """The caches a piece writes, with its row and pages in each: ``cache`` (``rows`` per data shard), then the
        MTP module's (the request's own batch row and pages)."""
        return [(cache, shardings, shard * rows + int(row_D[shard]), table_DX[shard]), *self.proposer.targets(piece)]

    def _prefill(self, cache, shardings, window, group: PrefillGroup, table_DX: np.ndarray, row_D: np.ndarray):
        d, t = self.shards, group.size
        tokens, positions = np.zeros((d, t), np.int32), np.zeros((d, t), np.int32)
        valid, targets = np.zeros((d, t), bool), np.zeros((d, t), np.int32)
        params, steps_D = [SamplingParams()] * d, np.zeros(d, np.int32)
        pages_DX, rows_D, last_D = np.zeros_like(table_DX), np.zeros(d, np.int32), np.zeros(d, bool)
        for shard, piece in group.slices.items():
            tokens[shard], positions[shard], valid[shard] = piece.tokens, piece.start + np.arange(t), True
            targets[shard, :len(piece.targets)] = piece.targets
            params[shard] = piece.sampling
            pages_DX[shard], rows_D[shard], last_D[shard] = piece.pages_X, piece.row % self.rows_per_shard, piece.last
        meta = StepMeta(*(jnp.asarray(x) for x in (positions, valid, table_DX, row_D)))
        mtp = self.proposer.prefill_args(positions, valid, pages_DX, rows_D, last_D)
        targets = jnp.asarray(targets)
        token, logits_DV, hidden, window, cache, drafts_DK, mtp_cache = steps.prefill(
            self.graph, self.params, jnp.asarray(tokens), meta, cache,
            steps.SamplingBatch.of(params, steps_D), window, targets, shardings=shardings, **mtp)
        scores = steps.score(self.graph, self.params, hidden, targets, top=self.prompt_top,
                             shardings=shardings) if group.scored else None
        drafts = self.proposer.prefill_done(mtp_cache, drafts_DK, group)
        sampled = mesh.host_array(token)
        wanted = [s for s, piece in group.slices.items() if piece.last and piece.wants_logits]
        logits = mesh.host_array(logits_DV) if wanted else None
        scored = {}
        if scores is not None:
            fields = [mesh.host_array(x) for x in jax.tree.leaves(scores)]  # in PromptScores' field order
            scored = {s: tuple(x[s, :len(piece.targets)] for x in fields) for s, piece in group.slices.items()
                      if piece.prompt_logprobs is not None}
        return cache, window, PrefillResult(sampled, {s: logits[s] for s in wanted}, scored, drafts)

    # ---- decode --------------------------------------------------------------------------------
    def decode_args(self, batch: DecodeBatch):
        """The decode step's arguments: each row's last token and its drafts ``[B, T]`` at positions ``length +
        t`` (a row that does not run: positions from 0, nothing written)."""
        tokens_BT = np.concatenate([batch.tokens_B[:, None], batch.drafts_BK], axis=1)
        t = tokens_BT.shape[1]
        rows = np.arange(self.config.max_batch, dtype=np.int32) % self.rows_per_shard
        active_BT = np.broadcast_to(batch.active_B[:, None], (self.config.max_batch, t))
        meta = StepMeta(jnp.asarray(batch.lengths_B[:, None] + np.arange(t, dtype=np.int32)), jnp.asarray(active_BT),
                        jnp.asarray(batch.page_table_BX), jnp.asarray(rows))
        return (self.params, jnp.asarray(tokens_BT), meta, self.cache,
                steps.SamplingBatch.of(batch.sampling, batch.steps_B), jnp.asarray(batch.forced_B))

    def compile_decode(self) -> None:
        """Compile the decode step (``steps.catalog``'s; with the MTP module its drafting too) ahead (one shape), so
        no decode timing includes compilation."""
        if self._compiled_decode is not None:
            return
        start = time.perf_counter()
        decode = steps.catalog(families.get(self.model.cfg.family), self.config, self.arrays())["decode"]
        idle = DecodeBatch.idle(self.config.max_batch, self.layout.pages_per_row, self.config.num_speculative_tokens)
        args = self.decode_args(idle)  # made as serving makes them (the host-made ones uncommitted: replicated)
        self._compiled_decode = decode._replace(args=args).lower().compile()
        self.proposer.compile(self.graph, self.params, self._compiled_decode, args[2])
        self.stats.compile_s = time.perf_counter() - start

    def decode(self, batch: DecodeBatch, times: StepTimes | None) -> DecodeResult:
        """One decode step (with the MTP module, then its next drafts); ``times`` (recorded steps): how long the
        calls took to return and, with drafting, until the verified tokens were on the host (``verify_s``) and
        then until the drafts were (``draft_s``): both steps are launched at once and the device runs them in
        order, so timing them apart waits for nothing the step would not."""
        self.compile_decode()
        start = time.perf_counter()
        args = self.decode_args(batch)
        tokens_BT, accepted_B, logits_BTV, self.cache, hidden, kept_B = self._compiled_decode(*args)
        drafts_BK = self.proposer.draft(self.params, hidden, tokens_BT, args[2], kept_B)  # None: it drafts no more
        if times is not None:
            times.decode_dispatch_s = time.perf_counter() - start
        tokens_BT, accepted_B = mesh.host_array(tokens_BT), mesh.host_array(accepted_B)
        if drafts_BK is not None:
            verified = time.perf_counter()
            drafts_BK = mesh.host_array(drafts_BK)
            if times is not None:
                times.verify_s, times.draft_s = verified - start, time.perf_counter() - verified
        self.stats.decode_s += time.perf_counter() - start
        return DecodeResult(tokens_BT, accepted_B, mesh.host_array(logits_BTV) if batch.wants_logits else None,
                            drafts_BK)

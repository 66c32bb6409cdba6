"""The serving engine's public API: paged cache, admission, chunked prefill interleaved with continuous batched
decode, over the parts of ``ess_jax.engine``:

- ``Scheduler`` (host only): requests, admission, what each step runs, the stop rules;
- ``Runner``: parameters, mesh, decode cache and the compiled steps (``steps``);
- the offload mode (``offload.Resident`` or ``offload.Ess``, chosen once here; the runner calls it on its cache):
  where prompts prefill and what moves between the device and the host store.

Online: ``add_request`` (any thread, while the engine runs), ``step`` (admission, prefill pieces of at most
``prefill_chunk`` tokens per data shard, one decode step; each request's new tokens and text), ``abort``,
``has_unfinished``; ``run`` steps until every added request is finished. A request's tokens do not depend on
what else is in the batch or when it arrived: every row is computed independently, its prompt is cut into the
same pieces (``plan.piece_size``), and it samples from its own seed."""

from __future__ import annotations

import sys
import threading

import jax.numpy as jnp
from tqdm import tqdm

from ess_jax import families, mesh
from ess_jax.engine import offload
from ess_jax.engine.config import EngineConfig
from ess_jax.engine.layout import MODE_SPECS, cache_layout, check_memory, entry_dtype
from ess_jax.engine.request import Request, RequestOutput, RequestSpec
from ess_jax.engine.runner import Runner
from ess_jax.engine.plan import EngineStats, StepTimer
from ess_jax.engine.prefix import prefix_cache_for
from ess_jax.engine.scheduler import Scheduler
from ess_jax.engine.speculate import Drafter, proposer_for


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig(), *, progress: bool = False,
                 record_steps: bool = False, drafter: Drafter | None = None):
        """Sizes from the configs, checked against the machine before any cache array exists
        (``layout.check_memory``). ``record_steps``: every step's times in ``stats.steps``. ``drafter`` (with
        ``config.speculative``): a caller's drafts in place of the MTP module's, ``drafter(request)`` -> the
        ``num_speculative_tokens`` tokens to verify after the request's last (its ``output_ids`` so far)."""
        self.model, self.config, self.progress = model, config, progress
        self.proposer = proposer_for(model, config, drafter, entry_dtype(model.module, config.cache_dtype))
        self.layout = cache_layout(model.cfg, config, jnp.dtype(model.module.dtype).name)
        shape = mesh.parse(config.mesh) if config.mesh else mesh.MeshShape()
        check_memory(self.layout, mesh.param_bytes_per_device(model.params, shape))
        self.max_seq_len = self.layout.max_seq_len
        self.stats = EngineStats(steps=[] if record_steps else None)
        self.prefix_cache = config.prefix_cache
        prefix, prefix_io = prefix_cache_for(model, config, self.layout, MODE_SPECS[config.offload], self.proposer)
        self.offload: offload.Mode = offload.MODES[config.offload](model.module, config, self.layout, self.stats)
        self.runner = Runner(model, config, self.layout, self.stats, self.offload, prefix_io, self.proposer)
        size = self.layout.size
        self.scheduler = Scheduler(config, shards=size.shards, pages=size.pages // size.shards,
                                   pages_per_row=self.layout.pages_per_row, max_seq_len=self.max_seq_len,
                                   stats=self.stats, prefix=prefix, proposer=self.proposer)
        self._step_lock = threading.Lock()  # held while the engine's state changes (step, abort)

    # ---- any thread ----------------------------------------------------------------------------
    def add_request(self, spec: RequestSpec) -> int:
        """Queue a request (``RequestSpec``); its id. Safe to call from any thread, also while another thread
        steps. Raises ValueError naming the problem if the request can never be served (``check_request``)."""
        pages = self.check_request(spec)
        request = Request.from_spec(spec, self.model.tokenizer, self.model.cfg.eos_token_id)
        return self.scheduler.inbox.add(request, pages)

    def check_request(self, spec: RequestSpec) -> int:
        """The pages a request would reserve; raises ValueError naming the problem (and the numbers) if it can
        never be served: what ``RequestSpec.check`` refuses (ids outside the vocabulary, forced ids that are not
        ``max_new_tokens`` of them or come with stop ids, ...), an empty prompt, more tokens than the engine
        serves, more pages than the pool has. ``add_request`` runs it; callers may run it first to refuse
        early."""
        spec.check(self.model.cfg.vocab_size)
        return self.scheduler.check(len(spec.prompt_ids), spec.max_new_tokens)

    def abort(self, request_id: int) -> None:
        """Stop a request: its pages, batch row, host pages and pool slots are free when this returns if
        no step is running, else when the running step ends; the next ``step`` reports it finished with
        reason "abort". A request that already finished is left alone. Safe from any thread."""
        self.scheduler.inbox.abort(request_id)
        if self._step_lock.acquire(blocking=False):
            try:
                with self.runner.on_mesh():
                    self.runner.release(self.scheduler.take_inbox())
            finally:
                self._step_lock.release()

    def has_unfinished(self) -> bool:
        return self.scheduler.inbox.has_unfinished()

    @property
    def requests(self) -> dict[int, Request]:
        """The unfinished requests by id (a snapshot)."""
        return self.scheduler.inbox.unfinished()

    # ---- the engine's thread -------------------------------------------------------------------
    def compile(self) -> None:
        """Compile the decode step ahead (one shape; with the MTP module its drafting too), its seconds in
        ``stats.compile_s``, so no decode timing includes compilation. ``step`` does it first; once per engine."""
        with self.runner.on_mesh():
            self.runner.compile_decode()

    def step(self) -> list[RequestOutput]:
        """Admit what fits, run prefill pieces of up to ``prefill_chunk`` tokens per data shard (the running
        requests wait for at most one chunk), then one decode step for every request past its prefill.
        One output per request that produced tokens, finished or was aborted."""
        with self._step_lock, self.runner.on_mesh(), StepTimer(self.stats) as timer:
            self.runner.compile_decode()  # one shape, compiled ahead: no decode timing includes compilation
            self.runner.release(self.scheduler.take_inbox())
            for group in self.scheduler.schedule_prefill():
                with timer.prefill():
                    result = self.runner.prefill(group)
                self.runner.release(self.scheduler.update_prefill(group, result))
            if (batch := self.scheduler.schedule_decode()) is not None:
                with timer.decode(batch):
                    self.runner.release(self.scheduler.update_decode(batch, self.runner.decode(batch, timer.times)))
            return self.scheduler.outputs()

    def speculative_metrics(self) -> dict | None:
        """Speculative decoding's counters as the ``--json`` ``metrics.speculative`` object (``speculate``); None
        without."""
        return self.proposer.metrics(self.stats.steps)

    def run(self) -> list[Request]:
        """Step until every request added so far is finished; those requests in id order."""
        requests = self.scheduler.inbox.unfinished()
        bar = tqdm(total=sum(r.max_new_tokens for r in requests.values()), desc="generate", unit="tok",
                   file=sys.stderr, disable=not self.progress, leave=False)
        while self.has_unfinished():
            bar.update(sum(len(out.new_token_ids) for out in self.step()))
        self.runner.flush()  # the last step's rows reach the host store too
        self.scheduler.prefix.flush()  # and the prompts' pages the disk store
        bar.close()
        return [requests[i] for i in sorted(requests)]

    def warm_up(self) -> None:
        """Compile ahead on the calling thread: the decode step, every prefill piece size and its prompt
        log-probabilities (``steps.score``) and the offload mode's steps, through two requests of
        ``2 x prefill_chunk - 1`` tokens (one piece of each size): one served to the end, one scoring its prompt
        and ending after its prefill (never cut at the prefix cache's snapshot points, so every size runs); with the
        prefix cache the first again, which reads its prompt's cached pages (ESS: ``load_prefix``).
        Every step's arguments are placed as in serving (``Runner``), so nothing compiles afterwards. Call it on
        an idle engine, before serving."""
        if self.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine: requests are unfinished")
        room = (min(self.max_seq_len, self.scheduler.allocators[0].capacity * self.config.page_size) - 1
                - self.proposer.reserve)  # and the drafts' positions
        prompt = [0] * min(2 * self.config.prefill_chunk - 1, room)
        served = RequestSpec(prompt, 1, ignore_eos=True)
        self.add_request(served)
        self.add_request(RequestSpec(prompt, 0, prompt_logprobs=0))
        self.run()
        if self.prefix_cache:
            self.add_request(served)
            self.run()
        self.stats.peak_reserved_pages = self.stats.reserved_pages  # the warm-up request is no workload
        self.scheduler.prefix.stats.reset()
        if self.stats.steps is not None:
            self.stats.steps.clear()

    # ---- reports -------------------------------------------------------------------------------
    def usage(self) -> dict:
        """What the admitted requests hold now: pages (of the device cache, or the host store with offload),
        batch rows, in all and per data shard (``per_shard``), the requests waiting, with offload the device
        pool slots in use (read from the device) and the host store's pages and bytes, with speculative decoding
        its counters so far (``speculative``: ``speculative_metrics``), and with the prefix cache its pages no
        request holds (``prefix_cache_pages``, free to admission) and its counters (``prefix_cache``)."""
        scheduled = self.scheduler.usage()
        return {**scheduled, **self.offload.usage(self.runner.cache, scheduled),
                **self.proposer.usage(self.stats.steps), **self.scheduler.prefix.usage()}

    def cache_bytes(self) -> dict[str, int]:
        """Bytes of the real cache arrays: device (the decode-time cache), host (the offload store), and
        what the requests would occupy on the device without offload (from the cache parts: their reserved
        pages of every paged part and every batch row's fixed parts): at the peak of the requests reserved at
        once (``resident_device_bytes``; for a batch added at once, all of it) and for the unfinished requests
        now (``resident_device_bytes_now``). Finished requests count in neither once gone, so a long-lived
        engine's figures stay bounded. With offload also the prefill scratch's bytes. ``prefix_snapshot_bytes``: the
        prefix cache's row-state snapshots kept now, in host memory (DeepSeek-V4's; at most
        ``layout.snapshot_bytes``)."""
        parts, size = self.layout.parts, self.layout.size
        return {**self.offload.cache_bytes(self.runner.cache),
                "prefix_snapshot_bytes": sum(pool.state_bytes for pool in self.scheduler.allocators),
                "resident_device_bytes": int(families.resident_bytes(parts, size, self.stats.peak_reserved_pages)),
                "resident_device_bytes_now": int(families.resident_bytes(parts, size, self.stats.reserved_pages))}

    def prefix_cache_metrics(self) -> dict | None:
        """The prefix cache's counters as the ``--json`` ``metrics.prefix_cache`` object (``PrefixCache.metrics``);
        None with the prefix cache off."""
        return self.scheduler.prefix.metrics()

    def offload_metrics(self) -> dict | None:
        """Tier counters (read from the device once) as the ``--json`` ``metrics.offload`` object; None
        without offload."""
        return self.offload.metrics(self.runner.cache)

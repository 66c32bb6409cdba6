"""The engine runs: every setting (resident, ESS at each pool ratio and fetch backend) on the same prompts,
repeated side by side; decode tok/s and step times from the engine's own per-step times
(``record_steps=True``: ``EngineStats.steps``), the tier's counters, the cache bytes and the capacity."""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np


@dataclasses.dataclass(frozen=True)
class Setting:
    offload: str  # "none" | "ess"
    pool_ratio: float | None = None
    fetch: str | None = None
    rings: str | None = None  # ess: where DeepSeek-V4's HCA compressor rings live (None: the engine's default)
    speculative: int = 0  # K: the MTP module's drafts per request and step (0: no speculative decoding)

    @property
    def label(self) -> str:
        base = "resident" if self.offload == "none" else f"ess r={self.pool_ratio:g} {self.fetch}" + (
            "" if self.rings in (None, "host") else f" rings {self.rings}")
        return base + (f" mtp K={self.speculative}" if self.speculative else "")


@dataclasses.dataclass
class Samples:
    """What the repetitions of one setting measured."""

    tok_s: list[float] = dataclasses.field(default_factory=list)  # decode tokens/s, per repetition
    steps_ms: list[float] = dataclasses.field(default_factory=list)  # every measured step of every repetition
    prefill_tok_s: list[float] = dataclasses.field(default_factory=list)  # per repetition
    cache_bytes: dict | None = None  # Engine.cache_bytes after the first repetition
    output_ids: list[list[int]] | None = None  # the first repetition's tokens, per request


def decode_steps(engine) -> list[tuple[float, int, int]]:
    """(seconds, rows decoded, tokens they produced) of each decode step an engine built with
    ``record_steps=True`` ran."""
    return [(t.decode_s, t.decode_rows, t.decode_tokens) for t in engine.stats.steps if t.decode_s is not None]


def engine_for(model, setting: Setting, batch: int, args):
    from ess_jax.engine import Engine, EngineConfig

    config = EngineConfig(max_batch=batch, max_seq_len=args.context + args.new_tokens + 2 * setting.speculative,
                          prefill_chunk=args.prefill_chunk, offload=setting.offload,
                          pool_ratio=setting.pool_ratio if setting.pool_ratio is not None else 0.2,
                          fetch=setting.fetch or "inline", kernels=args.kernels, cache_dtype=args.cache_dtype,
                          index_dtype=args.index_dtype, rings=setting.rings, mesh=args.mesh,
                          speculative="mtp" if setting.speculative else None,
                          num_speculative_tokens=setting.speculative,
                          prefix_cache=False)  # every repetition prefills its prompts
    return Engine(model, config, record_steps=True)


def repeat(engine, samples: Samples, prompts: list[list[int]], args) -> None:
    """One repetition: every prompt submitted, the engine run to the end, its measurements into ``samples``."""
    from ess_jax.engine import RequestSpec

    for prompt in prompts:
        engine.add_request(RequestSpec(prompt, args.new_tokens, ignore_eos=True))  # decode every --new-tokens step
    first, prefill = len(decode_steps(engine)), (engine.stats.prefill_tokens, engine.stats.prefill_s)
    requests = engine.run()[-len(prompts):]
    samples.prefill_tok_s.append((engine.stats.prefill_tokens - prefill[0]) / (engine.stats.prefill_s - prefill[1]))
    if samples.output_ids is None:
        samples.output_ids = [r.output_ids for r in requests]
    if samples.cache_bytes is None:  # resident_device_bytes sums every request submitted so far: read it once
        samples.cache_bytes = engine.cache_bytes()
    # full-batch steps only: a later prompt's prefill interleaves with the first requests' decode
    measured = [(t, tokens) for t, rows, tokens in decode_steps(engine)[first:]
                if rows == len(prompts)][args.warmup_steps:]
    samples.tok_s.append(sum(n for _, n in measured) / sum(t for t, _ in measured))
    samples.steps_ms += [1e3 * t for t, _ in measured]


def summary(setting: Setting, engine, samples: Samples, batch: int, first: Samples,
            resident_tok_s: float | None, plain_tok_s: float | None = None) -> dict:
    """One setting's result: its tokens compared with those of ``first`` (the first setting's), its decode rate
    with ``resident_tok_s`` (None: no resident setting ran) and, with speculative decoding, with ``plain_tok_s``
    (the same setting without it) and the acceptance per draft position."""
    rates, ms, cb = samples.tok_s, samples.steps_ms, samples.cache_bytes
    full_steps = engine.stats.decode_tokens / batch  # decode steps of the whole batch, equivalently
    metrics = engine.offload_metrics()
    return {
        "offload": setting.offload, "pool_ratio": setting.pool_ratio, "fetch": setting.fetch,
        "speculative": setting.speculative, "speculative_metrics": engine.speculative_metrics(),
        "relative_to_plain": statistics.median(rates) / plain_tok_s if plain_tok_s else None,
        "rings": engine.config.ring_placement if setting.offload == "ess" and any(
            p.ring for p in engine.layout.parts) else None,  # a model with compressor rings (V4)
        "pool_slots": engine.layout.pool_slots,
        "decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_runs": rates,
        "relative_to_resident": statistics.median(rates) / resident_tok_s if resident_tok_s else None,
        "step_ms_p50": float(np.percentile(ms, 50)), "step_ms_p99": float(np.percentile(ms, 99)),
        "step_ms_mean": float(np.mean(ms)), "measured_steps": len(ms), "decode_steps": len(decode_steps(engine)),
        "hit_rate": metrics["hit_rate"] if metrics else None,
        "h2d_bytes_per_step": metrics["h2d_bytes"] / full_steps if metrics else 0.0,
        "d2h_bytes_per_step": metrics["decode_d2h_bytes"] / full_steps if metrics else 0.0,
        "per_layer": ([dict(c, hit_rate=c["hits"] / c["lookups"] if c["lookups"] else 0.0)
                       for c in metrics["per_layer"]] if metrics else None),
        "device_bytes": cb["device_bytes"], "host_bytes": cb["host_bytes"],
        "resident_device_bytes": cb["resident_device_bytes"],
        "prefill_scratch_bytes": cb.get("prefill_scratch_bytes", 0),
        "prefill_tokens_per_s": statistics.median(samples.prefill_tok_s), "compile_s": engine.stats.compile_s,
        "tokens_match_resident": samples.output_ids == first.output_ids,
        "output_ids": samples.output_ids,
    }


def capacity(results: list[dict], budget: float, batch: int) -> None:
    """Each result's requests in a device ``budget`` (bytes) of ``batch``-request runs, with and without offload,
    and their ratio; without offload the requests hold ``resident_device_bytes`` (the resident row: by
    definition)."""
    for r in results:
        per_request = (r["device_bytes"] if r["offload"] == "ess" else r["resident_device_bytes"]) / batch
        resident_per_request = r["resident_device_bytes"] / batch
        r["device_bytes_per_request"] = per_request
        r["requests_in_budget"] = int(budget // per_request)
        r["requests_in_budget_resident"] = int(budget // resident_per_request)
        r["capacity_gain"] = (r["requests_in_budget"] / r["requests_in_budget_resident"]
                              if r["requests_in_budget_resident"] else None)


def run_settings(model, settings: list[Setting], prompts: list[list[int]], args, log) -> list[dict]:
    """Run every setting ``args.repeats`` times side by side (the order reversed every other repetition); one
    result dict per setting."""
    engines = [engine_for(model, s, len(prompts), args) for s in settings]
    samples = [Samples() for _ in settings]
    for rep in range(args.repeats):
        order = list(range(len(settings)))
        if rep % 2:
            order.reverse()
        for i in order:
            repeat(engines[i], samples[i], prompts, args)
            log(f"repeat {rep + 1}/{args.repeats}  {settings[i].label:<22} {samples[i].tok_s[-1]:8.1f} tok/s")
    resident_tok_s = statistics.median(samples[0].tok_s) if settings[0].offload == "none" else None
    plain = {dataclasses.replace(s, speculative=0): statistics.median(x.tok_s) for s, x in zip(settings, samples)
             if not s.speculative}
    results = [summary(s, e, x, len(prompts), samples[0], resident_tok_s,
                       plain.get(dataclasses.replace(s, speculative=0)) if s.speculative else None)
               for s, e, x in zip(settings, engines, samples)]
    capacity(results, args.device_budget_mb * 2**20, len(prompts))
    return results

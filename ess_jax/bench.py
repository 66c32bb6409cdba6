"""``python -m ess_jax.bench``: resident vs ESS offload, side by side, on long prompts.

One process builds one engine per configuration: resident (``--offload none``) and ESS at each pool
ratio (``--ratios``) with each fetch backend (``--fetch``). Every repetition submits the same
``--batch`` prompts of ``--context`` tokens to every engine in turn (the order alternates
between repetitions, so slow drift of a shared machine hits all configurations alike) and decodes
``--new-tokens`` tokens per request (eos ignored, as serving benchmarks do, so every run decodes
the same number of steps).

What is measured, per configuration:
- decode tokens/s: batch x measured steps / their summed latency, per repetition; the median is
  reported. Measured steps are the decode steps in which every request decodes (a later prompt's
  prefill pieces interleave with the first requests' decode, so the first steps may serve fewer
  rows), less the first ``--warmup-steps`` of them; decode is compiled before the first step.
- step latency p50 / p99: every measured step of every repetition. A step is the engine's decode step
  (the compiled step, reading the sampled tokens back, the host bookkeeping, and for ``split`` the host
  backup), timed with ``time.perf_counter`` by the engine itself (``record_steps=True``:
  ``EngineStats.steps``).
- hit rate, overall and per layer, and h2d bytes per step: the tier's device counters
  (Engine.offload_metrics) over every decode step of every repetition; h2d = misses x row bytes;
  per step = per decoded token x batch.
- device / host bytes: Engine.cache_bytes (the decode-time cache arrays; the prefill scratch, a
  prefill node's memory, is reported apart).
- capacity gain: requests that fit in a device budget M (``--device-budget-mb``):
      with offload    floor(M / (device_bytes / batch))
      without         floor(M / (resident_device_bytes / batch))   (the resident row's own count)
  resident_device_bytes being what the same requests hold on the device without offload.

Prompts (``prompt_source``): without ``--text`` (a shipped checkpoint's default is the held-out code
it ships with, checkpoints/heldout_code.txt), one stream of random token ids from ``--seed``,
request i its tokens ``[i C, (i + 1) C)`` (C = ``--context``); with ``--text FILE``, FILE's text
tokenized once by the model's tokenizer, request i its tokens ``[i (C // 2), i (C // 2) + C)``
(windows overlapping by half). A locality prompt of N tokens is the stream's first N either way. A
text too short for all of them is an error naming the sizes.

Temporal locality (ESS Fig. 2), per context N of ``--locality-contexts`` (default ``--context``): a
separate, resident pass (``topk_trace``) prefills one request of the first N prompt tokens as an ESS
engine does (the engine's prefill function and pieces, on a one-row cache shaped like its prefill
scratch, for N + S + 1 tokens) and decodes S = ``--locality-steps`` greedy steps, recording the
indexer's top-k ids K_t of every step: per layer on V3.2 (ids are positions), per CSA layer on V4
(ids are CSA entries, each the compression of m = ``compress_rate_csa`` tokens). Per layer and
context, mean over the steps (step 0 compares the first decode step with the last prompt position):
- raw overlap ``|K_t & K_t-1| / |K_t|``. The new position, when picked, is never in ``K_t-1``, so with
  ``k`` picks the raw overlap is then at most ``(k - 1) / k``;
- shifted overlap ``|K_t & (K_t-1 + 1)| / |K_t|``, the previous set moved on by one id: what a head
  that reads the token after the one it read the step before (copying, induction) keeps. On V3.2 that
  is one token on, and the new position counts when the previous one was picked. On V4 it is one CSA
  entry, m tokens, on: a head advancing one token per step stays in its entry for m - 1 steps of m
  (raw overlap) and moves to the next entry on the m-th (shifted overlap);
- LRU hit rate vs pool size: the tier's policy replayed exactly over the trace (``simulate_lru``,
  mirroring ``tier.warm_layer`` and ``tier.resolve``) at top_k + 1, 2 x top_k and 4 x top_k slots and
  at each ``--pool-sweep`` ratio of the request's entries (``tier.pool_slots`` for N + S + 1 tokens, as
  an engine serving this one request sizes its pools), per layer and overall, counted as the tier's
  device counters count (``Engine.offload_metrics``): after prefill the pool holds the whole prompt if
  it fits, else the entries last picked by the top-k of the last 32 prompt positions (as the engine
  gathers them from its last two prefill pieces; the most recent in slot 0); per step every valid id is
  a lookup, the new entry a hit when picked, an id in the pool a hit, the rest misses; the new entry
  (written whether picked or not), then the misses in pick order, take the least recently used slots no
  hit of the step holds; the slots used in a step become the most recent, ordered by slot number.
  tests/test_bench.py checks the replay equals the tier's counters for the same prompt, pool size and
  steps (V3.2 and V4). An offloaded engine picks the same ids as this resident pass unless the float
  rounding of its split attention flips a near-tie of index scores.

``--depth-sweep 4,16,61``: instead of the above, the decode and prefill steps' compile time and the decode
step's time and dispatch against depth (``depth_sweep``): the model's config at each layer count, random
weights, resident and ESS, without the persistent compilation cache.

``--peer hf`` times transformers' ``generate`` on the same weights (saved as a HuggingFace
checkpoint under ``--out``) and prompts, greedy, on this machine, in this Python if torch and
transformers import, else with ``--peer-python`` (another interpreter that has them).

Outputs: a table on stdout, its locality section last (raw and shifted overlap per layer and
context, then the simulated hit rate per context and pool size) (or ``--json``: the same as one JSON
object), and in ``--out`` results.json and PNG plots: hit rate per layer, throughput vs pool ratio,
locality heatmap (raw overlap per layer x step, one panel per context), simulated hit rate vs pool size.

Errors print one line starting with "error:" and exit with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ess_jax.cli import Parser



def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("python -m ess_jax.bench", __doc__)
    p.add_argument("--model", default="tiny-v32-code",
                   help="shipped checkpoint (tiny-v32-code, tiny-v4-code: trained), preset name (random weights "
                        "from --weights-seed) or HuggingFace checkpoint directory (default tiny-v32-code; the V4 "
                        "models run HiSparse over their CSA entries)")
    p.add_argument("--context", type=int, default=8192, help="prompt tokens per request (default 8192)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per request and run (default 64)")
    p.add_argument("--batch", type=int, default=2, help="requests decoded together (default 2)")
    p.add_argument("--ratios", type=_floats, default=[0.5, 0.2, 0.1],
                   help="ESS pool ratios, comma-separated (default 0.5,0.2,0.1)")
    p.add_argument("--fetch", type=_names, default=["inline", "split"],
                   help="fetch backends to run, comma-separated subset of inline,split (default both)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions per configuration; medians reported (default 3)")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="decode steps dropped at the start of every run (default 4)")
    p.add_argument("--locality-steps", type=int, default=64,
                   help="greedy decode steps of the locality pass; 0 skips it (default 64)")
    p.add_argument("--locality-contexts", type=_ints, default=None,
                   help="prompt lengths of the locality pass, comma-separated, e.g. 4096,8192 (default: --context)")
    p.add_argument("--pool-sweep", type=_floats, default=[0.05, 0.1, 0.2, 0.3, 0.5],
                   help="pool ratios of the locality pass's LRU simulation, besides top_k + 1, 2 x top_k and "
                        "4 x top_k slots (default 0.05,0.1,0.2,0.3,0.5)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="cut the prompts from FILE's text (tokenized by the model's tokenizer): request i from "
                        "token i x (--context // 2), the locality prompts from token 0 (default: for a shipped "
                        "checkpoint the held-out code it ships with, checkpoints/heldout_code.txt; else random "
                        "token ids)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="engine prefill chunk in tokens (default 1024)")
    p.add_argument("--device-budget-mb", type=float, default=1024.0,
                   help="device memory budget (MiB) for the capacity comparison (default 1024)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter and cache dtype")
    p.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="xla",
                   help="attention kernels of every engine (default xla; pallas runs interpreted on CPU)")
    p.add_argument("--cache-dtype", choices=["bfloat16", "float32", "fp8"], default=None,
                   help="latent cache / tier row format (default: --dtype)")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    p.add_argument("--mesh", default=None, metavar="data=D,expert=E",
                   help="run every engine on a device mesh over every device jax sees (ess_jax.mesh; --batch a "
                        "multiple of D; the parameters placed once); default one device")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts (default 0)")
    p.add_argument("--out", default="bench_out", help="folder for results.json and the PNG plots (default bench_out/)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of the table")
    p.add_argument("--peer", choices=["hf"], default=None,
                   help="also time transformers' generate on the same weights and prompts (needs torch + transformers)")
    p.add_argument("--peer-python", default=None,
                   help="a Python interpreter with torch + transformers, for --peer hf when this one lacks them")
    p.add_argument("--stall-steps", type=int, default=24,
                   help="decode steps of the prefill-stall pass (a --context-token prompt admitted while --batch "
                        "requests decode, resident); 0 skips it (default 24)")
    p.add_argument("--depth-sweep", type=_ints, default=None, metavar="L,L,...",
                   help="instead of the runs above: the decode and prefill steps' compile time and the decode step's "
                        "time against depth, the model's config (random weights) at each layer count, resident "
                        "and ESS (the first --ratios and --fetch), compiled without the persistent cache "
                        "(e.g. 4,16,61)")
    serve = p.add_argument_group("HTTP load test (ess_jax.loadgen): instead of the engines above, load running servers")
    serve.add_argument("--serve", action="append", default=None, metavar="URL",
                       help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (repeat for side-by-side)")
    serve.add_argument("--concurrency", type=_ints, default=[1, 8, 32],
                       help="requests in flight, comma-separated levels (default 1,8,32)")
    serve.add_argument("--prompt-lengths", type=_ints, default=[16, 256, 1024],
                       help="prompt lengths in tokens (random byte ids), cycled over the requests (default 16,256,1024)")
    serve.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    serve.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    serve.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    args = p.parse_args(argv)
    from ess_jax.config import CHECKPOINTS, shipped_checkpoint

    if args.text is None and args.model in CHECKPOINTS:  # a trained model reads text, not random ids
        args.text = str(shipped_checkpoint(args.model).parent / "heldout_code.txt")
    return args


def _check(args: argparse.Namespace) -> None:
    from ess_jax.tier import FETCH_BACKENDS

    for name in ("context", "batch", "repeats", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.warmup_steps < 0 or args.locality_steps < 0:
        raise ValueError("--warmup-steps and --locality-steps must be >= 0")
    if args.new_tokens < args.warmup_steps + 2:
        raise ValueError(f"--new-tokens {args.new_tokens} leaves no measured decode step after --warmup-steps "
                         f"{args.warmup_steps} (the first token comes from prefill); use at least "
                         f"{args.warmup_steps + 2}")
    staggered = (args.batch - 1) * math.ceil(args.context / args.prefill_chunk)  # decoded while the rest prefill
    if args.new_tokens < args.warmup_steps + 2 + staggered:
        raise ValueError(f"--new-tokens {args.new_tokens} leaves no decode step of the whole batch after --warmup-steps "
                         f"{args.warmup_steps}: the first request decodes {staggered} tokens while the other prompts "
                         f"prefill ({math.ceil(args.context / args.prefill_chunk)} steps each at --prefill-chunk "
                         f"{args.prefill_chunk}); use at least {args.warmup_steps + 2 + staggered} or a larger chunk")
    for flag, ratios in (("--ratios", args.ratios), ("--pool-sweep", args.pool_sweep)):
        if not ratios:
            raise ValueError(f"{flag} is empty")
        for r in ratios:
            if not 0 < r <= 1:
                raise ValueError(f"{flag} {r} must be in (0, 1]")
    bad = [f for f in args.fetch if f not in FETCH_BACKENDS]
    if bad or not args.fetch:
        raise ValueError(f"--fetch {','.join(args.fetch)!r} must be a subset of {','.join(FETCH_BACKENDS)}")
    if args.device_budget_mb <= 0:
        raise ValueError(f"--device-budget-mb {args.device_budget_mb} must be > 0")


def _config_of(name: str):
    from ess_jax.config import CHECKPOINTS, PRESETS, ConfigError, ModelConfig, shipped_checkpoint

    if name in PRESETS:
        return ModelConfig.from_preset(name)
    path = shipped_checkpoint(name) if name in CHECKPOINTS else Path(name)
    if path.is_dir():
        return ModelConfig.from_json(path / "config.json")
    raise ConfigError(f"--model {name!r} is neither a shipped checkpoint ({', '.join(CHECKPOINTS)}), a preset "
                      f"({', '.join(PRESETS)}) nor a checkpoint directory")


# ---- timing ------------------------------------------------------------------------------------

def decode_steps(engine) -> list[tuple[float, int]]:
    """(seconds, rows decoded) of each decode step an engine built with ``record_steps=True`` ran."""
    return [(t.decode_s, t.decode_rows) for t in engine.stats.steps if t.decode_s is not None]


@dataclasses.dataclass(frozen=True)
class Setting:
    offload: str  # "none" | "ess"
    pool_ratio: float | None = None
    fetch: str | None = None

    @property
    def label(self) -> str:
        return "resident" if self.offload == "none" else f"ess r={self.pool_ratio:g} {self.fetch}"


def run_settings(model, settings: list[Setting], prompts: list[list[int]], args, log) -> list[dict]:
    """Run every setting ``args.repeats`` times side by side; one result dict per setting."""
    from ess_jax.engine import Engine, EngineConfig

    engines = []
    for s in settings:
        config = EngineConfig(max_batch=len(prompts), max_seq_len=args.context + args.new_tokens,
                              prefill_chunk=args.prefill_chunk, offload=s.offload,
                              pool_ratio=s.pool_ratio if s.pool_ratio is not None else 0.2, fetch=s.fetch or "inline",
                              kernels=args.kernels, cache_dtype=args.cache_dtype, mesh=args.mesh)
        engines.append(Engine(model, config, record_steps=True))
    tok_s = [[] for _ in settings]
    steps_ms = [[] for _ in settings]
    prefill_tok_s = [[] for _ in settings]
    cache_bytes: list[dict | None] = [None] * len(settings)
    outputs: list[list[list[int]] | None] = [None] * len(settings)
    for rep in range(args.repeats):
        order = list(range(len(settings)))
        if rep % 2:
            order.reverse()
        for i in order:
            engine = engines[i]
            for prompt in prompts:
                engine.add_request(prompt, args.new_tokens, ignore_eos=True)  # decode every --new-tokens step
            first, prefill = len(decode_steps(engine)), (engine.stats.prefill_tokens, engine.stats.prefill_s)
            requests = engine.run()[-len(prompts):]
            prefill_tok_s[i].append((engine.stats.prefill_tokens - prefill[0]) / (engine.stats.prefill_s - prefill[1]))
            if outputs[i] is None:
                outputs[i] = [r.output_ids for r in requests]
            if cache_bytes[i] is None:  # resident_device_bytes sums every request submitted so far: read it once
                cache_bytes[i] = engine.cache_bytes()
            # full-batch steps only: a later prompt's prefill interleaves with the first requests' decode
            measured = [t for t, rows in decode_steps(engine)[first:] if rows == len(prompts)][args.warmup_steps:]
            tok_s[i].append(len(prompts) * len(measured) / sum(measured))
            steps_ms[i] += [1e3 * t for t in measured]
            log(f"repeat {rep + 1}/{args.repeats}  {settings[i].label:<22} {tok_s[i][-1]:8.1f} tok/s")
    resident_tok_s = statistics.median(tok_s[0]) if settings[0].offload == "none" else None
    results = []
    for s, engine, rates, ms, cb, prefill, output in zip(settings, engines, tok_s, steps_ms, cache_bytes, prefill_tok_s,
                                                         outputs):
        steps = len(decode_steps(engine))
        full_steps = engine.stats.decode_tokens / len(prompts)  # decode steps of the whole batch, equivalently
        metrics = engine.offload_metrics()
        result = {
            "offload": s.offload, "pool_ratio": s.pool_ratio, "fetch": s.fetch, "pool_slots": engine.layout.pool_slots,
            "decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_runs": rates,
            "relative_to_resident": statistics.median(rates) / resident_tok_s if resident_tok_s else None,
            "step_ms_p50": float(np.percentile(ms, 50)), "step_ms_p99": float(np.percentile(ms, 99)),
            "step_ms_mean": float(np.mean(ms)), "measured_steps": len(ms), "decode_steps": steps,
            "hit_rate": metrics["hit_rate"] if metrics else None,
            "h2d_bytes_per_step": metrics["h2d_bytes"] / full_steps if metrics else 0.0,
            "d2h_bytes_per_step": metrics["decode_d2h_bytes"] / full_steps if metrics else 0.0,
            "per_layer": ([dict(c, hit_rate=c["hits"] / c["lookups"] if c["lookups"] else 0.0)
                           for c in metrics["per_layer"]] if metrics else None),
            "device_bytes": cb["device_bytes"], "host_bytes": cb["host_bytes"],
            "resident_device_bytes": cb["resident_device_bytes"],
            "prefill_scratch_bytes": cb.get("prefill_scratch_bytes", 0),
            "prefill_tokens_per_s": statistics.median(prefill), "compile_s": engine.stats.compile_s,
            "tokens_match_resident": output == outputs[0], "output_ids": output,
        }
        results.append(result)
    budget = args.device_budget_mb * 2**20
    for r in results:  # without offload, the requests hold resident_device_bytes (the resident row: by definition)
        per_request = (r["device_bytes"] if r["offload"] == "ess" else r["resident_device_bytes"]) / len(prompts)
        resident_per_request = r["resident_device_bytes"] / len(prompts)
        r["device_bytes_per_request"] = per_request
        r["requests_in_budget"] = int(budget // per_request)
        r["requests_in_budget_resident"] = int(budget // resident_per_request)
        r["capacity_gain"] = (r["requests_in_budget"] / r["requests_in_budget_resident"]
                              if r["requests_in_budget_resident"] else None)
    return results


def prefill_stall(model, prompts: list[list[int]], args, log) -> dict:
    """How much a long prompt admitted mid-run slows the running requests (resident engine): ``--batch``
    requests of 64 prompt tokens decode; after a few steps one more request of ``--context`` tokens arrives.
    Every ``Engine.step`` is timed; a step with a prefill piece runs at most ``--prefill-chunk`` prompt
    tokens. Reports the median decode-only step, the median and largest step with a prefill piece, the
    median time of one prefill piece alone (``stats``), and how many pieces the long prompt took."""
    from ess_jax.engine import Engine, EngineConfig

    log(f"stall: {args.batch} decoding + one {args.context}-token prompt, chunk {args.prefill_chunk}")
    from ess_jax import mesh as device_mesh

    # a row more for the long prompt: a data shard more on a mesh (its shards divide --batch)
    rows = args.batch + (device_mesh.parse(args.mesh).data if args.mesh else 1)
    config = EngineConfig(max_batch=rows, max_seq_len=args.context + args.stall_steps + 64,
                          prefill_chunk=args.prefill_chunk, kernels=args.kernels, cache_dtype=args.cache_dtype,
                          mesh=args.mesh)
    engine = Engine(model, config)
    engine.warm_up()  # every piece size compiled: the steps below time no compile
    for prompt in prompts:
        engine.add_request(prompt[:64], args.stall_steps + 16, ignore_eos=True)
    decode_ms, prefill_ms, piece_ms = [], [], []
    for step in range(args.stall_steps + 16):
        if step == 8:
            engine.add_request(prompts[0], 1, ignore_eos=True)
        tokens, seconds = engine.stats.prefill_tokens, engine.stats.prefill_s
        start = time.perf_counter()
        engine.step()
        ms = 1e3 * (time.perf_counter() - start)
        if engine.stats.prefill_tokens > tokens and step >= 8:
            prefill_ms.append(ms)
            piece_ms.append(1e3 * (engine.stats.prefill_s - seconds))
        elif step >= 2:
            decode_ms.append(ms)
    engine.run()
    return {"decode_step_ms": statistics.median(decode_ms), "prefill_step_ms": statistics.median(prefill_ms),
            "prefill_step_ms_max": max(prefill_ms), "prefill_piece_ms": statistics.median(piece_ms),
            "pieces": len(prefill_ms), "prefill_chunk": args.prefill_chunk, "context": args.context}


def depth_sweep(args, log) -> dict:
    """``--depth-sweep``: the model's config with ``num_hidden_layers`` set to each given count (random weights
    from ``--weights-seed``), served resident and with ESS (the first ``--ratios`` and ``--fetch``): ``--batch``
    prompts of ``--context`` tokens (``prompt_source``), ``--new-tokens`` each. Per depth and mode:
    - decode compile s: ``Runner.compile_decode`` (lowering and compiling the decode step);
    - prefill compile s: the first prefill piece's time less the median of the later ones of the same size
      (every prompt is cut into the same pieces; with ESS the first handoff's compile is in it too);
    - ms per decode step: the median decode step of the whole batch (``EngineStats.steps``), the first one dropped;
    - dispatch ms: the median time a call of the compiled decode step takes to return (the host's part).
    The persistent compilation cache is off for the sweep, so every compile is measured."""
    import jax.numpy as jnp
    from flax import nnx

    from ess_jax.api import Model
    from ess_jax.cli import use_compile_cache
    from ess_jax.config import CHECKPOINTS, PRESETS, ModelConfig, preset_dict, shipped_checkpoint
    from ess_jax.engine import Engine, EngineConfig
    from ess_jax.families import get as family_of
    from ess_jax.tokenizer import load_tokenizer

    use_compile_cache("none")
    if args.model in PRESETS:
        raw = preset_dict(args.model)
    else:
        path = shipped_checkpoint(args.model) if args.model in CHECKPOINTS else Path(args.model)
        raw = json.loads((path / "config.json").read_text())
    rows = []
    # a V4 config's per-layer lists give way to transformers' default pattern at every depth (HCA x 2, then HCA /
    # CSA alternating; 3 hash-routed layers)
    raw = {k: v for k, v in raw.items() if k not in ("layer_types", "compress_ratios", "mlp_layer_types")}
    for layers in args.depth_sweep:
        cfg = ModelConfig.from_hf_dict(dict(raw, num_hidden_layers=layers))
        module = family_of(cfg.family).module_cls(cfg, dtype=getattr(jnp, args.dtype), rngs=nnx.Rngs(args.weights_seed))
        model = Model(f"{args.model} x {layers} layers", module, load_tokenizer(None, cfg))
        prompts = prompt_source(argparse.Namespace(**dict(vars(args), locality_steps=0)), cfg, model.tokenizer)[0]
        for offload in ("none", "ess"):
            config = EngineConfig(max_batch=len(prompts), max_seq_len=args.context + args.new_tokens,
                                  prefill_chunk=args.prefill_chunk, offload=offload, pool_ratio=args.ratios[0],
                                  fetch=args.fetch[0], kernels=args.kernels, cache_dtype=args.cache_dtype,
                                  mesh=args.mesh)
            engine = Engine(model, config, record_steps=True)
            engine.runner.compile_decode()
            for prompt in prompts:
                engine.add_request(prompt, args.new_tokens, ignore_eos=True)
            engine.run()
            pieces_s = [t for step in engine.stats.steps for t in step.prefill_s]
            pieces = len(pieces_s) // len(prompts)  # each prompt's pieces, the same sizes in the same order
            later = [pieces_s[i * pieces] for i in range(1, len(prompts))]
            full = [t for t in engine.stats.steps if t.decode_s is not None and t.decode_rows == len(prompts)][1:]
            steps, dispatch = [t.decode_s for t in full], [t.decode_dispatch_s for t in full]
            row = {"layers": layers, "offload": offload, "decode_compile_s": engine.stats.compile_s,
                   "prefill_compile_s": pieces_s[0] - statistics.median(later) if later else None,
                   "decode_step_ms": 1e3 * statistics.median(steps) if steps else None,
                   "dispatch_ms": 1e3 * statistics.median(dispatch) if dispatch else None,
                   "measured_steps": len(steps)}
            rows.append(row)
            log(f"depth {layers:3d} {offload:<4}: decode compile {row['decode_compile_s']:.1f} s, "
                f"step {row['decode_step_ms'] or 0:.1f} ms")
            del engine
    return {"setup": {"model": args.model, "batch": args.batch, "context": args.context, "new_tokens": args.new_tokens,
                      "prefill_chunk": args.prefill_chunk, "pool_ratio": args.ratios[0], "fetch": args.fetch[0],
                      "dtype": args.dtype, "machine": _machine()},
            "depth": rows}


def render_depth(result: dict) -> str:
    s = result["setup"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    rows = [[str(r["layers"]), "resident" if r["offload"] == "none" else f"ess {s['pool_ratio']:g} {s['fetch']}",
             fmt(r["decode_compile_s"], ".1f"), fmt(r["prefill_compile_s"], ".1f"), fmt(r["decode_step_ms"], ".1f"),
             fmt(r["dispatch_ms"], ".2f")] for r in result["depth"]]
    return "\n".join([f"{s['model']} at each depth (random weights): {s['batch']} x {s['context']}-token prompts, "
                      f"{s['new_tokens']} new tokens, prefill chunk {s['prefill_chunk']}, no persistent compilation "
                      f"cache; {s['machine']}",
                      _table(["layers", "mode", "decode compile s", "prefill compile s", "ms/step", "dispatch ms"],
                             rows)])


# ---- temporal locality -------------------------------------------------------------------------

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


@functools.cache
def _trace_step():
    import jax
    from flax import nnx

    return jax.jit(lambda graphdef, kernels, params, tokens, meta, cache: nnx.merge(graphdef, params).step(
        tokens, meta, cache, kernels=kernels), static_argnums=(0, 1), donate_argnums=5)


def topk_trace(model, prompt: list[int], steps: int, *, chunk: int, page_size: int = 64, cache_dtype: str | None = None,
               kernels: str = "xla") -> Trace:
    """The top-k ids of one request of ``prompt`` and ``steps + 1`` greedy new tokens (``steps`` decode
    steps), from a resident pass on the cache an offloaded engine prefills on (its one-row scratch, sized
    for this request): the prompt runs through the engine's own prefill function in the engine's pieces
    (``--prefill-chunk``, the rest in powers of two), so the warm-up ids are those an ESS engine's
    warm-up reads; then ``steps`` decode steps of the model's step."""
    import jax
    import jax.numpy as jnp
    from ess_jax import families, tier
    from ess_jax.engine import CACHE_DTYPES, steps as engine_steps
    from ess_jax.cache import StepMeta

    cfg, module = model.cfg, model.module
    family = families.get(cfg.family)
    model_format = jnp.dtype(module.dtype).name
    part = next(p for p in family.cache_parts(cfg, family.stored_formats(cache_dtype or model_format, model_format))
                if p.where == "offloaded")
    max_seq_len = len(prompt) + steps + 1
    pages = math.ceil(max_seq_len / page_size)
    dtype = CACHE_DTYPES[cache_dtype] if cache_dtype else module.dtype
    cache = family.resident_cache(module, families.CacheSize(rows=1, pages=pages + 1, page_size=page_size,
                                                             max_seq_len=max_seq_len), dtype)
    table_BX = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]  # the scratch's pages 1..X (0 is the null page)
    row_B = jnp.zeros((1,), jnp.int32)
    greedy = engine_steps.SamplingBatch(jnp.zeros(1, jnp.float32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.float32),
                                        jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32))
    window, start = None, 0
    for real in engine_steps.prefill_pieces(len(prompt), chunk):  # the engine's pieces
        meta = StepMeta(jnp.asarray(start + np.arange(real, dtype=np.int32))[None], jnp.ones((1, real), bool),
                        table_BX, row_B)
        tokens = jnp.asarray([prompt[start:start + real]], jnp.int32)
        if window is None:  # the window's shape: the top-k ids of the model's layers that select
            ids_LBTK = jax.eval_shape(lambda t, m, c: module.step(t, m, c, kernels=kernels)[1], tokens, meta, cache)
            window = jnp.full((ids_LBTK.shape[0], 1, tier.WARMUP_QUERIES, ids_LBTK.shape[3]), -1, jnp.int32)
        token, _, _, window, cache = engine_steps.prefill(model.graphdef, kernels, model.params, tokens, meta, cache,
                                                          greedy, window, jnp.zeros_like(tokens))
        start += real
    warm_LTK = np.asarray(window[:, 0])
    token, m = int(token[0]), part.tokens_per_row
    ids, new = [], []
    for t in range(steps):
        position = len(prompt) + t
        meta = StepMeta(jnp.asarray([[position]], jnp.int32), jnp.ones((1, 1), bool), table_BX, row_B)
        logits_BTV, ids_LBTK, cache = _trace_step()(model.graphdef, kernels, model.params,
                                                    jnp.asarray([[token]], jnp.int32), meta, cache)
        ids.append(np.asarray(ids_LBTK[:, 0, 0]))
        new.append((position + 1) // m - 1 if (position + 1) % m == 0 else -1)  # the entry this token completes
        token = int(jnp.argmax(logits_BTV[0, 0]))
    ids_LSK = np.stack(ids, axis=1) if ids else np.zeros(warm_LTK.shape[:1] + (0,) + warm_LTK.shape[2:], np.int32)
    return Trace(family.sparse_layers(cfg), part.topk, warm_LTK, ids_LSK, np.asarray(new, np.int32),
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


def warm_pool(warm_TK: np.ndarray, prompt_entries: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's pool after the warm-up (``tier.warm_layer``): the whole prompt if it fits, else the
    ``slots`` ids last selected by the warm-up queries (stamp: the last index in their flattened ids).
    Slot i holds the i-th most recent; the recency order lists the empty slots first (by slot), then the
    held ones from the oldest stamp. Returns slot -> entry ``[P]`` (-1 empty) and the order ``[P]``."""
    if prompt_entries <= slots:
        stamps = {e: e for e in range(prompt_entries)}
    else:
        stamps = {int(e): i for i, e in enumerate(warm_TK.reshape(-1)) if e >= 0}  # the last occurrence wins
    held = sorted(stamps, key=stamps.get, reverse=True)[:slots]
    entry_P = np.full(slots, -1, np.int64)
    entry_P[:len(held)] = held
    return entry_P, np.concatenate([np.arange(len(held), slots), np.arange(len(held))[::-1]])


def simulate_lru(trace: Trace, slots: int) -> np.ndarray:
    """Lookups, hits and misses ``i64[L, 3]`` of the tier's LRU (``tier.resolve``) over ``trace`` with
    ``slots`` pool slots per layer, as its device counters count them, from the pool ``warm_pool`` fills.
    Per decode step: every valid id is a lookup; the step's new entry counts as a hit when selected, an id
    whose entry is in the pool as a hit, the others as misses. The new entry (inserted whether selected
    or not), then the misses in the order of the step's ids, take the least recently used slots that no
    hit of the step holds, evicting their entries; every slot used in the step (hits and takers) then
    becomes the most recent, in slot order, the others keeping their order. (The tier looks for the
    takers among the first top-k + 1 slots of its order only; they always lie there.)"""
    counts = np.zeros((trace.ids_LSK.shape[0], 3), np.int64)
    for layer, (warm_TK, ids_SK) in enumerate(zip(trace.warm_LTK, trace.ids_LSK)):
        entry_P, order_P = warm_pool(warm_TK, trace.prompt_entries, slots)
        slot_of = np.full(trace.entries, -1, np.int64)  # the residency map: entry -> slot
        held = entry_P >= 0
        slot_of[entry_P[held]] = np.flatnonzero(held)
        for ids_K, new_id in zip(ids_SK, trace.new_S):
            ids = ids_K[ids_K >= 0]
            is_new = ids == new_id if new_id >= 0 else np.zeros(ids.size, bool)
            hit = ~is_new & (slot_of[ids] >= 0)
            miss_ids = ids[~is_new & ~hit]
            hit_slots = slot_of[ids[hit]]
            arrivals = np.concatenate([[new_id] if new_id >= 0 else [], miss_ids]).astype(np.int64)
            takers = order_P[~np.isin(order_P, hit_slots)][:arrivals.size]
            leaving = entry_P[takers]
            slot_of[leaving[leaving >= 0]] = -1
            entry_P[takers], slot_of[arrivals] = arrivals, takers
            used = np.sort(np.concatenate([hit_slots, takers]))
            order_P = np.concatenate([order_P[~np.isin(order_P, used)], used])
            counts[layer] += (ids.size, hit.sum() + is_new.sum(), miss_ids.size)
    return counts


def pool_sweep(trace: Trace, ratios: list[float]) -> list[dict]:
    """The LRU simulation at pool sizes top_k + 1, 2 x top_k, 4 x top_k and each pool ratio of the
    request's entries (``tier.pool_slots``, as an engine serving this request sizes its pools)."""
    from ess_jax.tier import pool_slots

    k = trace.top_k
    sizes = [("k+1", k + 1, None), ("2k", 2 * k, None), ("4k", 4 * k, None)] + [(f"r={r:g}", None, r) for r in ratios]
    rows = []
    for label, size, ratio in sizes:
        slots = pool_slots(trace.entries, k, pool_size=size, pool_ratio=ratio)
        counts = simulate_lru(trace, slots)
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


# ---- the transformers peer ---------------------------------------------------------------------

def hf_generate_timing(checkpoint: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Time transformers' greedy ``generate`` (no eos) on ``prompts`` from ``checkpoint``, per token: a
    streamer stamps the prompt's hand-over and every new token, so prefill is the time to the first new
    token and decode the time from it to the last, per repetition (medians over ``repeats``). A rate
    whose interval is not positive, or whose repetitions spread wider than their median, is reported
    as unmeasured (None) with the reason. Self-contained: it imports only torch / transformers, so it
    also runs as a script in another interpreter."""
    import statistics
    import time

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)

    class Stamps:  # transformers' streamer protocol: put() per hand-over, end() once
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    prefill, decode, outputs = [], [], None
    for _ in range(repeats):
        stamps, start = Stamps(), time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, streamer=stamps)
        outputs = out[:, ids.shape[1]:].tolist()
        first, last = stamps.times[1], stamps.times[-1]  # times[0]: the prompt handed over
        prefill.append(first - start)
        decode.append(last - first)

    def rate(tokens: int, seconds: list[float]) -> tuple[float | None, str | None]:
        median = statistics.median(seconds)
        if tokens < 1 or min(seconds) <= 0:
            return None, f"an interval of {min(seconds):.3g} s for {tokens} tokens"
        if max(seconds) - min(seconds) > median:
            return None, f"repetitions spread {min(seconds):.3g}-{max(seconds):.3g} s around a median of {median:.3g} s"
        return tokens / median, None

    decode_rate, decode_why = rate(ids.shape[0] * (new_tokens - 1), decode)
    prefill_rate, prefill_why = rate(ids.numel(), prefill)
    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "prefill_s": prefill, "decode_s": decode, "prefill_tokens_per_s": prefill_rate,
            "decode_tokens_per_s": decode_rate, "unmeasured": {k: v for k, v in
                                                                (("decode", decode_why), ("prefill", prefill_why)) if v},
            "output_ids": outputs}


def run_peer(model, model_name: str, prompts: list[list[int]], args, log) -> dict:
    """``--peer hf``: the transformers timing, in this Python or through ``--peer-python``."""
    from importlib.util import find_spec

    in_process = find_spec("torch") is not None and find_spec("transformers") is not None
    if not in_process and args.peer_python is None:
        return {"available": False, "reason": "torch and transformers are not importable in this Python; pass "
                                              "--peer-python /path/to/python that has them"}
    from ess_jax.config import CHECKPOINTS, shipped_checkpoint

    if model_name in CHECKPOINTS or Path(model_name).is_dir():
        checkpoint = shipped_checkpoint(model_name) if model_name in CHECKPOINTS else Path(model_name)
    else:  # a preset's random weights, saved for transformers
        from ess_jax import checkpoint as checkpoints
        from ess_jax.config import preset_dict

        raw = preset_dict(model_name)
        checkpoint = checkpoints.save(model.params, raw, Path(args.out) / f"hf-{model_name}")
    log(f"peer: transformers generate on {checkpoint} ({'in process' if in_process else args.peer_python})")
    call = dict(checkpoint=str(checkpoint), prompts=prompts, new_tokens=args.new_tokens, repeats=args.repeats)
    if in_process:
        result = hf_generate_timing(**call)
    else:
        script = (inspect.getsource(hf_generate_timing) + "\nimport json, sys\n"
                  "print(json.dumps(hf_generate_timing(**json.loads(sys.stdin.read()))))\n")
        proc = subprocess.run([args.peer_python, "-c", script], input=json.dumps(call), capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"available": False, "reason": f"{args.peer_python} failed: {tail}"}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(result, available=True, checkpoint=str(checkpoint), python=args.peer_python or sys.executable)


# ---- report ------------------------------------------------------------------------------------

def _table(headers: list[str], rows: list[list[str]]) -> str:
    cells = [headers] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def render(result: dict) -> str:
    mib = 2**20
    rows = []
    for r in result["runs"]:
        label = "resident" if r["offload"] == "none" else f"ess {r['pool_ratio']:g} {r['fetch']}"
        rows.append([label, f"{r['decode_tokens_per_s']:.1f}",
                     f"{r['relative_to_resident']:.2f}" if r["relative_to_resident"] is not None else "-",
                     f"{r['step_ms_p50']:.2f}", f"{r['step_ms_p99']:.2f}",
                     f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-",
                     f"{r['h2d_bytes_per_step'] / 1024:.1f}", f"{r['device_bytes'] / mib:.1f}",
                     f"{r['host_bytes'] / mib:.1f}", str(r["requests_in_budget"]),
                     f"{r['capacity_gain']:.2f}x" if r["capacity_gain"] is not None else "-"])
    s = result["setup"]
    out = [f"{s['model']}: {s['batch']} x {s['context']}-token prompts, {s['new_tokens']} new tokens, "
           f"{s['repeats']} repeats (medians), first {s['warmup_steps']} decode steps of each run dropped; "
           f"{s['machine']}",
           _table(["config", "tok/s", "vs res", "p50 ms", "p99 ms", "hit rate", "h2d KiB/step", "device MiB",
                   "host MiB", f"req/{s['device_budget_mb']:g}MiB", "gain"], rows),
           f"capacity: {result['capacity_formula']}"]
    for r in result["runs"]:
        if r["per_layer"]:
            per_layer = " ".join(f"{c['hit_rate']:.2f}" for c in r["per_layer"])
            out.append(f"hit rate per layer, ess {r['pool_ratio']:g} {r['fetch']}: {per_layer}")
    stall = result.get("stall")
    if stall:
        out.append(f"prefill stall (resident): a {stall['context']}-token prompt admitted mid-run took {stall['pieces']} "
                   f"steps with a prefill piece of <= {stall['prefill_chunk']} tokens; the running requests' step "
                   f"{stall['decode_step_ms']:.2f} ms without one, {stall['prefill_step_ms']:.2f} ms median / "
                   f"{stall['prefill_step_ms_max']:.2f} ms max with one (one piece alone: "
                   f"{stall['prefill_piece_ms']:.2f} ms median)")
    peer = result.get("peer")
    if peer is not None:
        if peer["available"]:
            def figure(kind: str, digits: int) -> str:
                if peer[f"{kind}_tokens_per_s"] is None:
                    return f"{kind} unmeasured ({peer['unmeasured'][kind]})"
                return (f"{kind} {peer[f'{kind}_tokens_per_s']:.{digits}f} tok/s (ess_jax resident "
                        f"{peer[f'{kind}_ratio']:.2f}x)")

            out.append(f"peer: transformers {peer['transformers']} (torch {peer['torch']}, {peer['threads']} threads) "
                       f"{figure('decode', 1)}, {figure('prefill', 0)}; greedy tokens agree (leading, per request) "
                       f"on {peer['tokens_agree']} of {peer['tokens_compared']}")
        else:
            out.append(f"peer: unavailable ({peer['reason']})")
    if result["locality"]:
        out += render_locality(result["locality"])
    return "\n".join(out)


def render_locality(loc: dict) -> list[str]:
    """The locality section: overlaps per layer and context, then the simulated hit rate per pool size."""
    contexts = loc["contexts"]
    headers = ["layer"] + [f"{kind} {c['context']}" for c in contexts for kind in ("raw", "shifted")]
    means = ("raw_overlap_mean", "shifted_overlap_mean")
    rows = [[str(layer)] + [f"{c[key][i]:.3f}" for c in contexts for key in means]
            for i, layer in enumerate(loc["layers"])]
    sweep = [[str(c["context"]), r["pool"], str(r["slots"]), f"{r['hit_rate']:.3f}",
              " ".join(f"{x['hit_rate']:.2f}" for x in r["per_layer"])] for c in contexts for r in c["lru"]]
    return [f"locality (resident pass, {loc['steps']} greedy decode steps after each prompt; ids: {loc['ids']}, top-k "
            f"{loc['top_k']}): mean over steps of raw |K_t & K_t-1| / |K_t| and shifted |K_t & (K_t-1 + 1)| / |K_t|",
            _table(headers, rows),
            "LRU hit rate vs pool size: the tier's policy simulated over the same top-k ids (warm-up from the last "
            "prompt positions' top-k; r = pool ratio of the request's entries)",
            _table(["context", "pool", "slots", "hit rate", f"per layer ({' '.join(map(str, loc['layers']))})"], sweep)]


def write_plots(result: dict, out: Path) -> list[str]:
    """PNG plots into ``out``: hit rate per layer, throughput vs pool ratio, locality heatmap (one panel per
    context), simulated hit rate vs pool size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ess = [r for r in result["runs"] if r["offload"] == "ess"]
    if ess:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in ess:
            rates = [c["hit_rate"] for c in r["per_layer"]]
            ax.plot(range(len(rates)), rates, marker="o", linestyle="-" if r["fetch"] == "inline" else "--",
                    label=f"ratio {r['pool_ratio']:g}, {r['fetch']}")
        ax.set(xlabel="layer", ylabel="pool hit rate", ylim=(0, 1.02), title="ESS pool hit rate per layer")
        ax.set_xticks(range(len(ess[0]["per_layer"])))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "hit_rate_per_layer.png", dpi=120)
        plt.close(fig)
        written.append("hit_rate_per_layer.png")

        fig, ax = plt.subplots(figsize=(6, 4))
        for fetch in sorted({r["fetch"] for r in ess}):
            runs = sorted((r for r in ess if r["fetch"] == fetch), key=lambda r: r["pool_ratio"])
            x = [r["pool_ratio"] for r in runs]
            y = [r["decode_tokens_per_s"] for r in runs]
            lo = [y_ - min(r["decode_tokens_per_s_runs"]) for y_, r in zip(y, runs)]
            hi = [max(r["decode_tokens_per_s_runs"]) - y_ for y_, r in zip(y, runs)]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=f"ess {fetch}")
        for r in result["runs"]:
            if r["offload"] == "none":
                ax.axhline(r["decode_tokens_per_s"], color="k", linestyle=":", label="resident")
        ax.set(xlabel="pool ratio", ylabel="decode tokens/s (median, min-max)", title="decode throughput vs pool ratio")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_ratio.png", dpi=120)
        plt.close(fig)
        written.append("throughput_vs_ratio.png")
    loc = result["locality"]
    if loc:
        contexts, layers = loc["contexts"], loc["layers"]
        fig, axes = plt.subplots(len(contexts), 1, squeeze=False, sharex=True,
                                 figsize=(7, len(contexts) * (0.4 * len(layers) + 1.2) + 0.6))
        for ax, c in zip(axes[:, 0], contexts):
            image = ax.imshow(np.asarray(c["raw_overlap"]), aspect="auto", vmin=0, vmax=1, cmap="viridis",
                              interpolation="nearest")
            ax.set(ylabel="layer", title=f"raw top-k overlap with the previous step, {c['context']}-token prompt")
            ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
            fig.colorbar(image, ax=ax)
        axes[-1, 0].set_xlabel("decode step")
        fig.tight_layout()
        fig.savefig(out / "locality_heatmap.png", dpi=120)
        plt.close(fig)
        written.append("locality_heatmap.png")

        fig, ax = plt.subplots(figsize=(6, 4))
        for i, c in enumerate(contexts):
            color = f"C{i}"
            slots = [r["slots"] for r in c["lru"]]
            order = np.argsort(slots, kind="stable")
            ax.plot(np.asarray(slots)[order], np.asarray([r["hit_rate"] for r in c["lru"]])[order], marker="o",
                    color=color, label=f"{c['context']} tokens, all layers")
            for j, layer in enumerate(layers):
                ax.plot(np.asarray(slots)[order], np.asarray([r["per_layer"][j]["hit_rate"] for r in c["lru"]])[order],
                        color=color, alpha=0.35, linewidth=0.8, label=f"{c['context']}: per layer" if j == 0 else None)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="pool slots per (layer, request)", ylabel="simulated LRU hit rate", ylim=(0, 1.02),
               title=f"hit rate vs pool size ({loc['steps']} decode steps, top-k {loc['top_k']})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "hit_rate_vs_pool.png", dpi=120)
        plt.close(fig)
        written.append("hit_rate_vs_pool.png")
    return written


def _machine() -> str:
    import jax

    devices = jax.devices()
    return (f"{platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} on {devices[0].platform} "
            f"({len(devices)} device{'s' if len(devices) > 1 else ''})")


def prompt_source(args: argparse.Namespace, cfg, tokenizer) -> tuple[list[list[int]], dict[int, list[int]], dict]:
    """The engine runs' prompts, the locality pass's prompt per context, and how they were made.

    Without ``--text``: one stream of random token ids from ``--seed``; request i is its tokens
    ``[i C, (i + 1) C)`` (C = ``--context``), the locality prompt of context N its first N tokens.
    ``--text FILE``: FILE's text tokenized once by the model's tokenizer (a bos it adds starts request
    0 only); request i is its tokens ``[i S, i S + C)`` with stride ``S = C // 2`` (windows overlapping
    by half), the locality prompt of context N its first N tokens. A text shorter than the longest of
    these is a ValueError naming the sizes."""
    contexts = args.locality_contexts if args.locality_steps else []
    if args.text is None:
        stride, need = args.context, max([args.batch * args.context] + contexts)
        tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, need).tolist()
        source = {"kind": "random", "seed": args.seed}
    else:
        stride = args.context // 2
        tokens = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
        need = max([(args.batch - 1) * stride + args.context] + contexts)
        if len(tokens) < need:
            longest = f", the longest --locality-contexts {max(contexts)}" if contexts else ""
            raise ValueError(f"--text {args.text} holds {len(tokens)} tokens (the model's tokenizer), fewer than the "
                             f"{need} needed: --batch {args.batch} prompts of --context {args.context} starting every "
                             f"{stride} tokens end at token {(args.batch - 1) * stride + args.context}{longest}")
        source = {"kind": "text", "file": str(args.text)}
    source.update(tokens=len(tokens), stride=stride)
    prompts = [tokens[i * stride:i * stride + args.context] for i in range(args.batch)]
    return prompts, {n: tokens[:n] for n in contexts}, source


def bench(args: argparse.Namespace, log) -> dict:
    from ess_jax import mesh as device_mesh
    from ess_jax.api import load_model
    from ess_jax.tokenizer import load_tokenizer

    cfg = _config_of(args.model)
    if args.mesh:  # before anything loads: the mesh's devices, and batch rows that divide over its data shards
        shape = device_mesh.parse(args.mesh)
        device_mesh.check_devices(shape)
        device_mesh.check_rows(shape, args.batch)
    args.locality_contexts = args.locality_contexts or [args.context]
    if args.context + args.new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"--context {args.context} + --new-tokens {args.new_tokens} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    longest = max(args.locality_contexts)
    if args.locality_steps and longest + args.locality_steps + 1 > cfg.max_position_embeddings:
        raise ValueError(f"--locality-contexts {longest} + --locality-steps {args.locality_steps} + 1 exceeds "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    prompts, locality_prompts, source = prompt_source(
        args, cfg, load_tokenizer(args.model if Path(args.model).is_dir() else None, cfg))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model, args.dtype, seed=args.weights_seed, mesh=args.mesh)
    settings = [Setting("none")] + [Setting("ess", r, f) for r in args.ratios for f in args.fetch]
    runs = run_settings(model, settings, prompts, args, log)
    stall = prefill_stall(model, prompts, args, log) if args.stall_steps else None
    locality = locality_pass(model, locality_prompts, args, log) if args.locality_steps else None
    result = {
        "setup": {"model": args.model, "family": cfg.family, "context": args.context, "new_tokens": args.new_tokens,
                  "batch": args.batch, "repeats": args.repeats, "warmup_steps": args.warmup_steps,
                  "index_topk": cfg.index_topk, "layers": cfg.num_hidden_layers, "dtype": args.dtype,
                  "device_budget_mb": args.device_budget_mb, "prompt_source": source, "machine": _machine(),
                  "mesh": str(device_mesh.parse(args.mesh)) if args.mesh else None},
        "capacity_formula": "requests in budget = floor(budget / (device_bytes / batch)); without offload "
                            "floor(budget / (resident_device_bytes / batch)); gain = their ratio",
        "runs": runs, "locality": locality, "stall": stall,
    }
    if args.peer:
        peer = run_peer(model, args.model, prompts, args, log)
        if peer["available"]:
            resident = runs[0]
            for kind in ("decode", "prefill"):
                rate = peer[f"{kind}_tokens_per_s"]
                peer[f"{kind}_ratio"] = None if rate is None else resident[f"{kind}_tokens_per_s"] / rate
            peer.update(tokens_agree=sum(_agreeing_prefix(a, b) for a, b in zip(resident["output_ids"],
                                                                                 peer["output_ids"])),
                        tokens_compared=sum(len(o) for o in peer["output_ids"]))
        result["peer"] = peer
    (out / "results.json").write_text(json.dumps(result, indent=1))
    result["plots"] = [str(out / name) for name in write_plots(result, out)]
    return result


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    try:
        if args.serve:
            from ess_jax import loadgen

            if args.requests < 1 or args.max_tokens < 1:
                raise ValueError("--requests and --max-tokens must be >= 1")
            result = loadgen.load_test([u.rstrip("/") for u in args.serve], concurrency=args.concurrency,
                                       prompt_lengths=args.prompt_lengths, requests=args.requests,
                                       max_tokens=args.max_tokens, vocab=256, seed=args.seed, api_key=args.api_key,
                                       timeout=args.timeout, log=log)
            result["files"] = loadgen.write_outputs(result, Path(args.out))
            print(json.dumps(result) if args.json else loadgen.render(result))
            return 0
        _check(args)
        result = depth_sweep(args, log) if args.depth_sweep else bench(args, log)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else render_depth(result) if args.depth_sweep else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

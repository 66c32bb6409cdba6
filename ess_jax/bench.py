"""``python -m ess_jax.bench``: resident vs ESS offload, side by side, on a synthetic long context.

One process builds one engine per configuration: resident (``--offload none``) and ESS at each pool
ratio (``--ratios``) with each fetch backend (``--fetch``). Every repetition submits the same
``--batch`` random prompts of ``--context`` tokens to every engine in turn (the order alternates
between repetitions, so slow drift of a shared machine hits all configurations alike) and decodes
``--new-tokens`` tokens per request (eos ignored, as serving benchmarks do, so every run decodes
the same number of steps).

What is measured, per configuration:
- decode tokens/s: batch x measured steps / their summed latency, per repetition; the median is
  reported. Measured steps are the decode steps in which every request decodes (a later prompt's
  prefill pieces interleave with the first requests' decode, so the first steps may serve fewer
  rows), less the first ``--warmup-steps`` of them; decode is compiled before the first step.
- step latency p50 / p99: every measured step of every repetition. A step is one call of
  ``Engine._decode_step`` (host bookkeeping, the compiled step, reading the sampled tokens back, and
  for ``split`` the host backup), timed with ``time.perf_counter`` by ``TimedEngine``, a subclass
  that wraps that method and changes nothing else.
- hit rate, overall and per layer, and h2d bytes per step: the tier's device counters
  (Engine.offload_metrics) over every decode step of every repetition; h2d = misses x row bytes;
  per step = per decoded token x batch.
- device / host bytes: Engine.cache_bytes (the decode-time cache arrays; the prefill scratch, a
  prefill node's memory, is reported apart).
- capacity gain: requests that fit in a device budget M (``--device-budget-mb``):
      with offload    floor(M / (device_bytes / batch))
      without         floor(M / (resident_device_bytes / batch))   (the resident row's own count)
  resident_device_bytes being what the same requests hold on the device without offload.

Temporal locality (ESS Fig. 2): a separate, resident pass drives the model's paged step for one
request (the first prompt), prefills it and decodes ``--locality-steps`` greedy steps, and reports
per layer the overlap ``|K_t & K_t-1| / |K_t|`` of the indexer's top-k sets of adjacent steps (step
0 compares the first decode step with the last prompt position). The new position is always among
``K_t`` and never in ``K_t-1``, so with ``k`` picks the overlap is at most ``(k - 1) / k``.

``--peer hf`` times transformers' ``generate`` on the same weights (saved as a HuggingFace
checkpoint under ``--out``) and prompts, greedy, on this machine, in this Python if torch and
transformers import, else with ``--peer-python`` (another interpreter that has them).

Outputs: a table on stdout (or ``--json``: one JSON object), and in ``--out`` results.json and PNG
plots: hit rate per layer, throughput vs pool ratio, locality heatmap.

Errors print one line starting with "error:" and exit with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    p.add_argument("--model", default="tiny-v32",
                   help="preset name (random weights from --weights-seed) or HuggingFace checkpoint directory "
                        "(default tiny-v32; tiny-v4 runs HiSparse over its CSA entries)")
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
    p.add_argument("--prefill-chunk", type=int, default=1024, help="engine prefill chunk in tokens (default 1024)")
    p.add_argument("--device-budget-mb", type=float, default=1024.0,
                   help="device memory budget (MiB) for the capacity comparison (default 1024)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter and cache dtype")
    p.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="xla",
                   help="attention kernels of every engine (default xla; pallas runs interpreted on CPU)")
    p.add_argument("--cache-dtype", choices=["bfloat16", "float32", "fp8"], default=None,
                   help="latent cache / tier row format (default: --dtype)")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
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
    return p.parse_args(argv)


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
    if not args.ratios:
        raise ValueError("--ratios is empty")
    for r in args.ratios:
        if not 0 < r <= 1:
            raise ValueError(f"--ratios {r} must be in (0, 1]")
    bad = [f for f in args.fetch if f not in FETCH_BACKENDS]
    if bad or not args.fetch:
        raise ValueError(f"--fetch {','.join(args.fetch)!r} must be a subset of {','.join(FETCH_BACKENDS)}")
    if args.device_budget_mb <= 0:
        raise ValueError(f"--device-budget-mb {args.device_budget_mb} must be > 0")


def _config_of(name: str):
    from ess_jax.config import PRESETS, ConfigError, ModelConfig

    if name in PRESETS:
        return ModelConfig.from_preset(name)
    if Path(name).is_dir():
        return ModelConfig.from_json(Path(name) / "config.json")
    raise ConfigError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")


# ---- timing ------------------------------------------------------------------------------------

def _timed_engine_class():
    from ess_jax.engine import Engine

    class TimedEngine(Engine):
        """An Engine whose decode steps are timed one by one; ``steps`` holds (seconds, rows decoded) of each."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps: list[tuple[float, int]] = []

        def _decode_step(self, new) -> int:
            start = time.perf_counter()
            served = super()._decode_step(new)
            self.steps.append((time.perf_counter() - start, served))
            return served

    return TimedEngine


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
    from ess_jax.engine import EngineConfig

    TimedEngine = _timed_engine_class()
    engines = []
    for s in settings:
        config = EngineConfig(max_batch=len(prompts), max_seq_len=args.context + args.new_tokens,
                              prefill_chunk=args.prefill_chunk, offload=s.offload,
                              pool_ratio=s.pool_ratio if s.pool_ratio is not None else 0.2, fetch=s.fetch or "inline",
                              kernels=args.kernels, cache_dtype=args.cache_dtype)
        engines.append(TimedEngine(model, config))
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
            first, prefill = len(engine.steps), (engine.stats["prefill_tokens"], engine.stats["prefill_s"])
            requests = engine.run()[-len(prompts):]
            prefill_tok_s[i].append((engine.stats["prefill_tokens"] - prefill[0])
                                    / (engine.stats["prefill_s"] - prefill[1]))
            if outputs[i] is None:
                outputs[i] = [r.output_ids for r in requests]
            if cache_bytes[i] is None:  # resident_device_bytes sums every request submitted so far: read it once
                cache_bytes[i] = engine.cache_bytes()
            # full-batch steps only: a later prompt's prefill interleaves with the first requests' decode
            measured = [t for t, rows in engine.steps[first:] if rows == len(prompts)][args.warmup_steps:]
            tok_s[i].append(len(prompts) * len(measured) / sum(measured))
            steps_ms[i] += [1e3 * t for t in measured]
            log(f"repeat {rep + 1}/{args.repeats}  {settings[i].label:<22} {tok_s[i][-1]:8.1f} tok/s")
    resident_tok_s = statistics.median(tok_s[0]) if settings[0].offload == "none" else None
    results = []
    for s, engine, rates, ms, cb, prefill, output in zip(settings, engines, tok_s, steps_ms, cache_bytes, prefill_tok_s,
                                                         outputs):
        steps = len(engine.steps)
        full_steps = engine.stats["decode_tokens"] / len(prompts)  # decode steps of the whole batch, equivalently
        metrics = engine.offload_metrics()
        result = {
            "offload": s.offload, "pool_ratio": s.pool_ratio, "fetch": s.fetch, "pool_slots": engine.pool_slots,
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
            "prefill_tokens_per_s": statistics.median(prefill), "compile_s": engine.stats.get("compile_s"),
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


# ---- temporal locality -------------------------------------------------------------------------

def topk_overlap(current_LK: np.ndarray, previous_LK: np.ndarray) -> np.ndarray:
    """``|K_t & K_t-1| / |K_t|`` per layer ``f32[L]`` over the valid (>= 0) ids; 0 for an empty ``K_t``."""
    overlap_L = np.zeros(current_LK.shape[0], np.float32)
    for layer, (cur, prev) in enumerate(zip(current_LK, previous_LK)):
        cur = cur[cur >= 0]
        overlap_L[layer] = np.isin(cur, prev[prev >= 0]).sum() / max(cur.size, 1)
    return overlap_L


def prefill_stall(model, prompts: list[list[int]], args, log) -> dict:
    """How much a long prompt admitted mid-run slows the running requests (resident engine): ``--batch``
    requests of 64 prompt tokens decode; after a few steps one more request of ``--context`` tokens arrives.
    Every ``Engine.step`` is timed; a step with a prefill piece runs at most ``--prefill-chunk`` prompt
    tokens. Reports the median decode-only step, the median and largest step with a prefill piece, the
    median time of one prefill piece alone (``stats``), and how many pieces the long prompt took."""
    from ess_jax.engine import Engine, EngineConfig

    log(f"stall: {args.batch} decoding + one {args.context}-token prompt, chunk {args.prefill_chunk}")
    config = EngineConfig(max_batch=args.batch + 1, max_seq_len=args.context + args.stall_steps + 64,
                          prefill_chunk=args.prefill_chunk, kernels=args.kernels, cache_dtype=args.cache_dtype)
    engine = Engine(model, config)
    engine.warm_up()  # every piece size compiled: the steps below time no compile
    for prompt in prompts:
        engine.add_request(prompt[:64], args.stall_steps + 16, ignore_eos=True)
    decode_ms, prefill_ms, piece_ms = [], [], []
    for step in range(args.stall_steps + 16):
        if step == 8:
            engine.add_request(prompts[0], 1, ignore_eos=True)
        tokens, seconds = engine.stats["prefill_tokens"], engine.stats["prefill_s"]
        start = time.perf_counter()
        engine.step()
        ms = 1e3 * (time.perf_counter() - start)
        if engine.stats["prefill_tokens"] > tokens and step >= 8:
            prefill_ms.append(ms)
            piece_ms.append(1e3 * (engine.stats["prefill_s"] - seconds))
        elif step >= 2:
            decode_ms.append(ms)
    engine.run()
    return {"decode_step_ms": statistics.median(decode_ms), "prefill_step_ms": statistics.median(prefill_ms),
            "prefill_step_ms_max": max(prefill_ms), "prefill_piece_ms": statistics.median(piece_ms),
            "pieces": len(prefill_ms), "prefill_chunk": args.prefill_chunk, "context": args.context}


def topk_locality(model, prompt: list[int], steps: int, *, page_size: int = 64, chunk: int = 1024) -> np.ndarray:
    """Overlap ``|K_t & K_t-1| / |K_t|`` of adjacent top-k sets ``f32[L, steps]`` for one request, from a
    resident pass of the model's step: prompt in chunks, then ``steps`` greedy decode steps. L: the
    layers with an indexer (V3.2: every layer, ids are positions; V4: the CSA layers, ids are entries)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from ess_jax import families
    from ess_jax.cache import StepMeta

    graphdef = model.graphdef
    step = jax.jit(lambda params, tokens, meta, cache: nnx.merge(graphdef, params).step(tokens, meta, cache),
                   donate_argnums=3)
    module, pages = model.module, math.ceil((len(prompt) + steps) / page_size)
    size = families.CacheSize(rows=1, pages=pages + 1, page_size=page_size, max_seq_len=len(prompt) + steps)
    cache = families.get(model.cfg.family).resident_cache(module, size, module.dtype, "xla")
    table_BX = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]  # contiguous pages 1..X (0 is the null page)
    row_B = jnp.zeros((1,), jnp.int32)
    for start in range(0, len(prompt), chunk):  # exact pieces: V4's compressors take no padding
        real = min(chunk, len(prompt) - start)
        meta = StepMeta(jnp.asarray(start + np.arange(real, dtype=np.int32))[None], jnp.ones((1, real), bool),
                        table_BX, row_B)
        logits_BTV, ids_LBTK, cache = step(model.params, jnp.asarray([prompt[start:start + real]], jnp.int32), meta,
                                           cache)
    previous_LK = np.asarray(ids_LBTK[:, 0, real - 1])
    token = int(jnp.argmax(logits_BTV[0, real - 1]))
    overlap_LS = np.zeros((previous_LK.shape[0], steps), np.float32)
    for t in range(steps):
        meta = StepMeta(jnp.asarray([[len(prompt) + t]], jnp.int32), jnp.ones((1, 1), bool), table_BX, row_B)
        logits_BTV, ids_LBTK, cache = step(model.params, jnp.asarray([[token]], jnp.int32), meta, cache)
        current_LK = np.asarray(ids_LBTK[:, 0, 0])
        overlap_LS[:, t] = topk_overlap(current_LK, previous_LK)
        previous_LK, token = current_LK, int(jnp.argmax(logits_BTV[0, 0]))
    return overlap_LS


# ---- the transformers peer ---------------------------------------------------------------------

def save_hf_checkpoint(model, directory: Path, raw_config: dict) -> Path:
    """Write ``model``'s parameters as a transformers checkpoint (per-expert names, as save_pretrained does)."""
    from flax import nnx
    from safetensors.numpy import save_file
    from ess_jax.checkpoint import hf_name

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, variable in nnx.to_flat_state(model.params):
        name, value = hf_name(path), np.asarray(variable[...], np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D]: gate rows first
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :half])
                tensors[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = np.ascontiguousarray(value[e, half:])
        elif name.endswith("mlp.experts.down_proj"):  # [E, D, F]
            for e in range(value.shape[0]):
                tensors[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
        else:
            tensors[name] = np.ascontiguousarray(value)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = dict(raw_config, architectures=["DeepseekV32ForCausalLM"], dtype="float32")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def hf_generate_timing(checkpoint: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Time transformers' greedy ``generate`` (no eos) on ``prompts`` from ``checkpoint``. Self-contained:
    it imports only torch / transformers, so it also runs as a script in another interpreter."""
    import statistics
    import time

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)

    def timed(n: int):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()

    prefill, full, outputs = [], [], None
    for _ in range(repeats):
        prefill.append(timed(1)[0])
        seconds, outputs = timed(new_tokens)
        full.append(seconds)
    prefill_s, full_s = statistics.median(prefill), statistics.median(full)
    decode_s = max(full_s - prefill_s, 1e-9)
    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "prefill_s": prefill_s, "generate_s": full_s,
            "prefill_tokens_per_s": ids.numel() / prefill_s,
            "decode_tokens_per_s": ids.shape[0] * (new_tokens - 1) / decode_s, "output_ids": outputs}


def run_peer(model, model_name: str, prompts: list[list[int]], args, log) -> dict:
    """``--peer hf``: the transformers timing, in this Python or through ``--peer-python``."""
    from importlib.util import find_spec

    in_process = find_spec("torch") is not None and find_spec("transformers") is not None
    if not in_process and args.peer_python is None:
        return {"available": False, "reason": "torch and transformers are not importable in this Python; pass "
                                              "--peer-python /path/to/python that has them"}
    if Path(model_name).is_dir():
        checkpoint = Path(model_name)
    else:
        from importlib import resources
        raw = json.loads(resources.files("ess_jax.configs").joinpath(f"{model_name}.json").read_text())
        checkpoint = save_hf_checkpoint(model, Path(args.out) / f"hf-{model_name}", raw)
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
    if result["locality"]:
        means = " ".join(f"{np.mean(x):.2f}" for x in result["locality"])
        out.append(f"top-k overlap of adjacent steps, mean per layer ({len(result['locality'][0])} steps): {means}")
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
            out.append(f"peer: transformers {peer['transformers']} (torch {peer['torch']}, {peer['threads']} threads) "
                       f"decode {peer['decode_tokens_per_s']:.1f} tok/s, prefill {peer['prefill_tokens_per_s']:.0f} "
                       f"tok/s; ess_jax resident / transformers: decode {peer['decode_ratio']:.2f}x, prefill "
                       f"{peer['prefill_ratio']:.2f}x; greedy tokens agree (leading, per request) on "
                       f"{peer['tokens_agree']} of {peer['tokens_compared']}")
        else:
            out.append(f"peer: unavailable ({peer['reason']})")
    return "\n".join(out)


def write_plots(result: dict, out: Path) -> list[str]:
    """PNG plots into ``out``: hit rate per layer, throughput vs pool ratio, locality heatmap."""
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
    if result["locality"]:
        locality = np.asarray(result["locality"])
        fig, ax = plt.subplots(figsize=(7, 0.5 * locality.shape[0] + 1.5))
        image = ax.imshow(locality, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        ax.set(xlabel="decode step", ylabel="layer", title="top-k overlap with the previous step")
        ax.set_yticks(range(locality.shape[0]))
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        fig.savefig(out / "locality_heatmap.png", dpi=120)
        plt.close(fig)
        written.append("locality_heatmap.png")
    return written


def _machine() -> str:
    import jax

    devices = jax.devices()
    return (f"{platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} on {devices[0].platform} "
            f"({len(devices)} device)")


def bench(args: argparse.Namespace, log) -> dict:
    from ess_jax.api import load_model

    cfg = _config_of(args.model)
    if args.context + args.new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"--context {args.context} + --new-tokens {args.new_tokens} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model, args.dtype, seed=args.weights_seed)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, args.context).tolist() for _ in range(args.batch)]
    settings = [Setting("none")] + [Setting("ess", r, f) for r in args.ratios for f in args.fetch]
    runs = run_settings(model, settings, prompts, args, log)
    stall = prefill_stall(model, prompts, args, log) if args.stall_steps else None
    locality = []
    if args.locality_steps:
        log(f"locality: resident pass, {args.context} prompt tokens + {args.locality_steps} decode steps")
        locality = topk_locality(model, prompts[0], args.locality_steps).tolist()
    result = {
        "setup": {"model": args.model, "family": cfg.family, "context": args.context, "new_tokens": args.new_tokens,
                  "batch": args.batch, "repeats": args.repeats, "warmup_steps": args.warmup_steps,
                  "index_topk": cfg.index_topk, "layers": cfg.num_hidden_layers, "dtype": args.dtype,
                  "device_budget_mb": args.device_budget_mb, "machine": _machine()},
        "capacity_formula": "requests in budget = floor(budget / (device_bytes / batch)); without offload "
                            "floor(budget / (resident_device_bytes / batch)); gain = their ratio",
        "runs": runs, "locality": locality, "stall": stall,
    }
    if args.peer:
        peer = run_peer(model, args.model, prompts, args, log)
        if peer["available"]:
            resident = runs[0]
            peer.update(decode_ratio=resident["decode_tokens_per_s"] / peer["decode_tokens_per_s"],
                        prefill_ratio=resident["prefill_tokens_per_s"] / peer["prefill_tokens_per_s"],
                        tokens_agree=sum(_agreeing_prefix(a, b) for a, b in zip(resident["output_ids"],
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
        result = bench(args, log)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

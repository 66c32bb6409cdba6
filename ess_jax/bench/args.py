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
- LRU hit rate vs pool size: the tier's policy replayed exactly over the trace (``tier.lru_reference``,
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

``--shared-prefix N``: instead of the above, the prefix cache's workloads (``ess_jax.bench.prefix``): requests
sharing an N-token prefix and a multi-turn chat replay, each served resident and with ESS, with and without the
prefix cache in the same run: time to first token, tokens per second, hit rate. The engine runs above serve
without the prefix cache (every repetition resends the same prompts and prefills them whole), as does the stall
pass.

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
import math

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


def _run_flags(p: argparse.ArgumentParser) -> None:
    """The model and the engine runs."""
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
    p.add_argument("--speculative", choices=["mtp"], default=None,
                   help="'mtp': also run every configuration with the checkpoint's MTP module drafting, once per "
                        "--num-speculative-tokens (rows beside the plain ones, compared with them)")
    p.add_argument("--num-speculative-tokens", type=_ints, default=None, metavar="K,K,...",
                   help="drafts per request and step of the --speculative rows, comma-separated (default 1)")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="decode steps dropped at the start of every run (default 4)")


def _locality_flags(p: argparse.ArgumentParser) -> None:
    """The locality pass and the prompts."""
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


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """Every engine's settings, the weights and the synthetic prompts' seeds."""
    p.add_argument("--prefill-chunk", type=int, default=1024, help="engine prefill chunk in tokens (default 1024)")
    p.add_argument("--device-budget-mb", type=float, default=1024.0,
                   help="device memory budget (MiB) for the capacity comparison (default 1024)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter and cache dtype")
    p.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="xla",
                   help="attention kernels of every engine (default xla; pallas runs interpreted on CPU)")
    p.add_argument("--cache-dtype", choices=["bfloat16", "float32", "fp8"], default=None,
                   help="latent cache / tier row format (default: --dtype)")
    p.add_argument("--index-dtype", choices=["fp4", "fp8", "bfloat16"], default=None,  # engine.config.INDEX_DTYPES
                   help="indexer key format of every engine (fp4: DeepSeek-V4's QAT keys; default as the engine's "
                        "--index-dtype)")
    p.add_argument("--rings", type=_names, default=[None],
                   help="ESS settings' placements of DeepSeek-V4's HCA compressor rings, comma-separated subset of "
                        "host,device: each ESS setting runs with each (default: the engine's, host, or device "
                        "with speculative decoding)")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    p.add_argument("--mesh", default=None, metavar="data=D,expert=E",
                   help="run every engine on a device mesh over every device jax sees (ess_jax.mesh; --batch a "
                        "multiple of D; the parameters placed once); default one device")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts (default 0)")


def _output_flags(p: argparse.ArgumentParser) -> None:
    """The outputs, the peer, the stall pass and the depth sweep."""
    p.add_argument("--out", default="bench_out", help="folder for results.json and the PNG plots (default bench_out/)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of the table")
    p.add_argument("--peer", choices=["hf"], default=None,
                   help="also time transformers' generate on the same weights and prompts (needs torch + transformers)")
    p.add_argument("--peer-python", default=None,
                   help="a Python interpreter with torch + transformers, for --peer hf when this one lacks them")
    p.add_argument("--stall-steps", type=int, default=24,
                   help="decode steps of the prefill-stall pass (a --context-token prompt admitted while --batch "
                        "requests decode, resident); 0 skips it (default 24)")
    p.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                   help="instead of the runs above: the prefix cache's workloads (ess_jax.bench.prefix), 2 x --batch "
                        "requests sharing an N-token prefix with distinct --suffix-tokens suffixes and a chat of "
                        "--chat-turns turns, each resent whole, resident and ESS (the first --ratios and --fetch), "
                        "each with and without the prefix cache: TTFT, tokens/s, hit rate; with --serve: every "
                        "load-test prompt after one shared N-token prefix")
    p.add_argument("--suffix-tokens", type=int, default=64,
                   help="--shared-prefix: each request's own tokens after the prefix, each chat turn's new tokens "
                        "(default 64)")
    p.add_argument("--chat-turns", type=int, default=4, help="--shared-prefix: the chat's turns (default 4)")
    p.add_argument("--index-share", type=_names, default=None, metavar="none,every-N,PATTERN,DIR,...",
                   help="instead of the runs above: Index Share (ess_jax.bench.index_share), the model served with "
                        "each pattern (none: its config's; DIR: a checkpoint python -m ess_jax.train searched or "
                        "distilled, its config's pattern), resident and ESS (the first --ratios and --fetch): "
                        "held-out NLL (the model's train.json held-out text), decode and prefill tokens/s, the hit "
                        "rate and the fetch lead per layer, tokens against resident")
    p.add_argument("--record", action="store_true",
                   help="--index-share: write each entry's pattern and held-out NLL into the model's train.json "
                        "(its index_share entry)")
    p.add_argument("--depth-sweep", type=_ints, default=None, metavar="L,L,...",
                   help="instead of the runs above: the decode and prefill steps' compile time and the decode step's "
                        "time against depth, the model's config (random weights) at each layer count, resident "
                        "and ESS (the first --ratios and --fetch), compiled without the persistent cache "
                        "(e.g. 4,16,61)")


def _serve_flags(serve) -> None:
    """``--serve``: the HTTP load test."""
    serve.add_argument("--serve", action="append", default=None, metavar="URL",
                       help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (repeat for side-by-side)")
    serve.add_argument("--concurrency", type=_ints, default=[1, 8, 32],
                       help="requests in flight, comma-separated levels (default 1,8,32)")
    serve.add_argument("--prompt-lengths", type=_ints, default=[16, 256, 1024],
                       help="prompt lengths in tokens (random byte ids), cycled over the requests "
                            "(default 16,256,1024)")
    serve.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    serve.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    serve.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("python -m ess_jax.bench", __doc__)
    for add in (_run_flags, _locality_flags, _engine_flags, _output_flags):
        add(p)
    _serve_flags(p.add_argument_group("HTTP load test (ess_jax.loadgen): instead of the engines above, load running "
                                      "servers"))
    args = p.parse_args(argv)
    from ess_jax.config import CHECKPOINTS, shipped_checkpoint

    if args.text is None and args.model in CHECKPOINTS:  # a trained model reads text, not random ids
        args.text = str(shipped_checkpoint(args.model).parent / "heldout_code.txt")
    return args


def check_args(args: argparse.Namespace) -> None:
    """The flags' own bounds, before any model loads (ValueError naming the flag)."""
    from ess_jax.tier import FETCH_BACKENDS

    for name in ("context", "batch", "repeats", "prefill_chunk", "suffix_tokens", "chat_turns"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.shared_prefix is not None and args.shared_prefix < 1:
        raise ValueError(f"--shared-prefix {args.shared_prefix} must be >= 1")
    if args.warmup_steps < 0 or args.locality_steps < 0:
        raise ValueError("--warmup-steps and --locality-steps must be >= 0")
    if args.shared_prefix is None:  # the engine runs' measured decode steps
        if args.new_tokens < args.warmup_steps + 2:
            raise ValueError(f"--new-tokens {args.new_tokens} leaves no measured decode step after --warmup-steps "
                             f"{args.warmup_steps} (the first token comes from prefill); use at least "
                             f"{args.warmup_steps + 2}")
        staggered = (args.batch - 1) * math.ceil(args.context / args.prefill_chunk)  # decoded while the rest prefill
        if args.new_tokens < args.warmup_steps + 2 + staggered:
            raise ValueError(f"--new-tokens {args.new_tokens} leaves no decode step of the whole batch after "
                             f"--warmup-steps {args.warmup_steps}: the first request decodes {staggered} tokens while "
                             f"the other prompts prefill ({math.ceil(args.context / args.prefill_chunk)} steps each at "
                             f"--prefill-chunk {args.prefill_chunk}); use at least "
                             f"{args.warmup_steps + 2 + staggered} or a larger chunk")
    for flag, ratios in (("--ratios", args.ratios), ("--pool-sweep", args.pool_sweep)):
        if not ratios:
            raise ValueError(f"{flag} is empty")
        for r in ratios:
            if not 0 < r <= 1:
                raise ValueError(f"{flag} {r} must be in (0, 1]")
    from ess_jax.engine.config import RINGS

    bad = [r for r in args.rings if r not in (None, *RINGS)]
    if bad or not args.rings:
        raise ValueError(f"--rings {','.join(args.rings)!r} must be a subset of {','.join(RINGS)}")
    bad = [f for f in args.fetch if f not in FETCH_BACKENDS]
    if bad or not args.fetch:
        raise ValueError(f"--fetch {','.join(args.fetch)!r} must be a subset of {','.join(FETCH_BACKENDS)}")
    if args.device_budget_mb <= 0:
        raise ValueError(f"--device-budget-mb {args.device_budget_mb} must be > 0")
    if args.num_speculative_tokens is not None and not args.speculative:
        raise ValueError("--num-speculative-tokens needs --speculative mtp")
    args.num_speculative_tokens = (args.num_speculative_tokens or [1]) if args.speculative else []
    if any(k < 1 for k in args.num_speculative_tokens):
        raise ValueError(f"--num-speculative-tokens {args.num_speculative_tokens} must be >= 1 each")


def check_model(args: argparse.Namespace, cfg) -> None:
    """The flags against the model's config ``cfg``: the longest request within ``max_position_embeddings``."""
    if args.num_speculative_tokens and not cfg.num_nextn_predict_layers:
        raise ValueError(f"--speculative mtp: {args.model} has no MTP layer (num_nextn_predict_layers = 0) to draft "
                         "with; use a checkpoint with one")
    if args.context + args.new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"--context {args.context} + --new-tokens {args.new_tokens} exceeds max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    longest = max(args.locality_contexts)
    if args.locality_steps and longest + args.locality_steps + 1 > cfg.max_position_embeddings:
        raise ValueError(f"--locality-contexts {longest} + --locality-steps {args.locality_steps} + 1 exceeds "
                         f"max_position_embeddings {cfg.max_position_embeddings}")

"""``python -m ess_jax.generate``: prompts in, text out, with continuous batching.

Examples:
    python -m ess_jax.generate --prompt "Hello"                      # the shipped tiny-v32-code checkpoint
    python -m ess_jax.generate --model path/to/hf_checkpoint --prompt-ids 1,2,3 --json
    python -m ess_jax.generate --prompt a --prompt b --temperature 0.8 --top-p 0.9 --seed 7
    # two processes of 4 devices each (the same command in both, --process-id 0 and 1); process 0 prints
    python -m ess_jax.generate --prompt a --mesh data=2,expert=4 --num-processes 2 --process-id 0 \
        --coordinator 127.0.0.1:1234

Errors (bad flags, prompts, checkpoints) print one line starting with "error:" and exit with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import types

from ess_jax.api import generate, load_model
from ess_jax.cli import (Parser, add_engine_flags, add_index_share_flag, add_model_flag, add_process_flags,
                         engine_config, start_processes)
from ess_jax.sampling import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("python -m ess_jax.generate", __doc__)
    add_model_flag(p)
    add_index_share_flag(p)
    # All prompt flags append to one list, so requests keep their command-line order.
    p.add_argument("--prompt", dest="prompts", action="append", type=lambda s: ("text", s),
                   help="a text prompt (repeatable); tokenized with the checkpoint's tokenizer.json, or byte-level")
    p.add_argument("--prompt-file", dest="prompts", action="append", type=lambda s: ("file", s),
                   help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--prompt-ids", dest="prompts", action="append", type=lambda s: ("ids", s),
                   help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens to generate per prompt; a request also stops at an eos token (default 32)")
    sampling = p.add_argument_group("sampling (greedy by default)")
    sampling.add_argument("--greedy", action="store_true", help="always take the most likely token (the default)")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="softmax temperature; 0 is greedy (default 0)")
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    sampling.add_argument("--top-p", type=float, default=1.0,
                          help="sample from the smallest set of tokens whose probability reaches p (default 1)")
    sampling.add_argument("--seed", type=int, default=0,
                          help="sampling seed; prompt i uses seed + i, so runs are reproducible (default 0)")
    add_engine_flags(p)
    add_process_flags(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: model, family, offload, requests, metrics (see README)")
    return p.parse_args(argv)


def _prompts(args: argparse.Namespace) -> list[list[int] | str]:
    prompts: list[list[int] | str] = []
    for kind, value in args.prompts or []:
        if kind == "text":
            prompts.append(value)
        elif kind == "file":
            with open(value) as f:
                prompts.append(f.read())
        else:
            try:
                prompts.append([int(x) for x in value.split(",") if x.strip()])
            except ValueError:
                raise ValueError(f"--prompt-ids {value!r} is not a comma-separated list of integers") from None
    if not prompts:
        raise ValueError("no prompt given; use --prompt TEXT, --prompt-file F or --prompt-ids 1,2,3")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt is empty")
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        processes = start_processes(args)
        prompts = _prompts(args)
        if args.greedy and args.temperature > 0:
            raise ValueError("--greedy contradicts --temperature > 0; pass one of them")
        sampling = [SamplingParams(args.temperature, args.top_k, args.top_p, args.seed + i)
                    for i in range(len(prompts))]
        engine = engine_config(args)
        model = load_model(args.model, args.dtype, seed=args.weights_seed, weights=args.weights,
                           mesh=args.mesh, index_share=args.index_share)
        result = generate(model, prompts, args.max_new_tokens, sampling=sampling, engine=engine,
                          progress=not args.json and processes.index == 0)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if processes.index:
        return 0  # process 0 prints
    encoded = [model.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    if args.json:
        print(json.dumps({
            "model": model.name, "family": model.cfg.family,
            "offload": {"mode": args.offload, "pool_size": result.pool_size,
                        "fetch": args.fetch if args.offload == "ess" else "none"},
            "requests": [{"prompt_ids": ids, "output_ids": out, "text": text, "finish_reason": reason}
                         for ids, out, text, reason in zip(encoded, result.output_ids, result.texts,
                                                           result.finish_reasons)],
            "metrics": result.metrics,
        }))
    else:
        for ids, out, text in zip(encoded, result.output_ids, result.texts):
            print(f"[{len(ids)} prompt tokens -> {len(out)} new] {text!r}")
        m = result.metrics
        print(f"prefill {m['prefill_tokens']} tokens, decode {m['decode_tokens']} tokens at "
              f"{m['decode_tokens_per_s']:.1f} tokens/s, wall {m['wall_s']:.2f} s, "
              f"cache {m['cache']['device_bytes'] / 2**20:.1f} MiB on the device", file=sys.stderr)
        if m["speculative"]:
            s = m["speculative"]
            print(f"speculative: {s['accepted_tokens']} of {s['draft_tokens']} drafts accepted, acceptance per "
                  f"position {', '.join(f'{a:.3f}' for a in s['acceptance_rate'])}, mean accepted length "
                  f"{s['mean_accepted_length']:.2f}", file=sys.stderr)
        if m["offload"]:
            o = m["offload"]
            print(f"offload: {result.pool_size} pool slots, hit rate {o['hit_rate']:.3f} ({o['misses']} misses of "
                  f"{o['lookups']} lookups), {o['h2d_bytes'] / 2**20:.2f} MiB fetched, host store "
                  f"{m['cache']['host_bytes'] / 2**20:.1f} MiB, resident would be "
                  f"{m['cache']['resident_device_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
    return 0


class _CallableModule(types.ModuleType):
    """Importing this module makes it the package's ``generate`` attribute (the import system binds a
    submodule to its parent), shadowing the API function ``ess_jax.generate``; calling the module calls
    that function, so ``ess_jax.generate(model, prompts, ...)`` works whichever was loaded first."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())

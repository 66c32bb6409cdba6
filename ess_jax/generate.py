"""``python -m ess_jax.generate``: prompts in, greedy text out.

Examples:
    python -m ess_jax.generate --prompt "Hello"                      # the embedded tiny-v32 preset
    python -m ess_jax.generate --model path/to/hf_checkpoint --prompt-ids 1,2,3 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from ess_jax.api import DTYPES, generate, load_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ess_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-v32",
                   help="preset name (tiny-v32, random weights) or a HuggingFace checkpoint directory "
                        "(config.json + *.safetensors). Default: tiny-v32")
    # All prompt flags append to one list, so requests keep their command-line order.
    p.add_argument("--prompt", dest="prompts", action="append", type=lambda s: ("text", s),
                   help="a text prompt (repeatable; byte-level tokenizer for presets)")
    p.add_argument("--prompt-file", dest="prompts", action="append", type=lambda s: ("file", s),
                   help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--prompt-ids", dest="prompts", action="append", type=lambda s: ("ids", s),
                   help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and cache dtype")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
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
        prompts = _prompts(args)
        model = load_model(args.model, args.dtype, seed=args.seed)
        result = generate(model, prompts, args.max_new_tokens)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    encoded = [model.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    if args.json:
        print(json.dumps({
            "model": model.name, "family": model.cfg.family,
            "offload": {"mode": "none", "pool_size": None, "fetch": "none"},
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
              f"{m['decode_tokens_per_s']:.1f} tokens/s, wall {m['wall_s']:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

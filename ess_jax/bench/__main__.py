"""``python -m ess_jax.bench``: ``--serve`` loads running servers (``ess_jax.loadgen``), ``--depth-sweep`` runs
the depth sweep, else the engine runs, the stall pass, the locality pass and the peer (``bench``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

from ess_jax.bench.args import check_args, check_model, parse_args


def bench(args, log) -> dict:
    """The engine runs (``runs``), then the prefill stall (``stall``), the locality pass (``locality``) and the
    peer (``peer``), each unless turned off; results.json and the plots into ``--out``."""
    from ess_jax import mesh as device_mesh
    from ess_jax.api import load_model
    from ess_jax.bench import locality, peer, plots, prompts, report, runs, stall
    from ess_jax.config import resolve_model
    from ess_jax.families import source_config
    from ess_jax.tokenizer import load_tokenizer

    source = resolve_model(args.model)
    cfg = source_config(source)
    if args.mesh:  # before anything loads: the mesh's devices, and batch rows that divide over its data shards
        shape = device_mesh.parse(args.mesh)
        device_mesh.check_devices(shape)
        device_mesh.check_rows(shape, args.batch)
    args.locality_contexts = args.locality_contexts or [args.context]
    check_model(args, cfg)
    engine_prompts, locality_prompts, origin = prompts.prompt_source(args, cfg, load_tokenizer(source.checkpoint, cfg))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model, args.dtype, seed=args.weights_seed, mesh=args.mesh)
    plain = [runs.Setting("none")] + [runs.Setting("ess", r, f, rings) for r in args.ratios for f in args.fetch
                                      for rings in args.rings]
    settings = plain + [dataclasses.replace(s, speculative=k) for k in args.num_speculative_tokens for s in plain]
    run_results = runs.run_settings(model, settings, engine_prompts, args, log)
    stall_result = stall.prefill_stall(model, engine_prompts, args, log) if args.stall_steps else None
    result = {
        "setup": {"model": args.model, "family": cfg.family, "context": args.context, "new_tokens": args.new_tokens,
                  "batch": args.batch, "repeats": args.repeats, "warmup_steps": args.warmup_steps,
                  "index_topk": cfg.index_topk, "layers": cfg.num_hidden_layers, "dtype": args.dtype,
                  "device_budget_mb": args.device_budget_mb, "prompt_source": origin,
                  "machine": report.machine(), "mesh": str(device_mesh.parse(args.mesh)) if args.mesh else None},
        "capacity_formula": "requests in budget = floor(budget / (device_bytes / batch)); without offload "
                            "floor(budget / (resident_device_bytes / batch)); gain = their ratio",
        "runs": run_results,
        "locality": locality.locality_pass(model, locality_prompts, args, log) if args.locality_steps else None,
        "stall": stall_result,
    }
    if args.peer:
        result["peer"] = peer.run_peer(model, args.model, engine_prompts, args, log)
        if result["peer"]["available"]:
            peer.compare(result["peer"], run_results[0])
    (out / "results.json").write_text(json.dumps(result, indent=1))
    result["plots"] = [str(out / name) for name in plots.write_plots(result, out)]
    return result


def load_test(args, log) -> dict:
    """``--serve``: the HTTP load test of the running servers; its outputs into ``--out``."""
    from ess_jax import loadgen

    if args.requests < 1 or args.max_tokens < 1:
        raise ValueError("--requests and --max-tokens must be >= 1")
    if args.shared_prefix is not None and args.shared_prefix < 1:
        raise ValueError(f"--shared-prefix {args.shared_prefix} must be >= 1")
    result = loadgen.load_test([u.rstrip("/") for u in args.serve], concurrency=args.concurrency,
                               prompt_lengths=args.prompt_lengths, requests=args.requests, max_tokens=args.max_tokens,
                               vocab=256, seed=args.seed, api_key=args.api_key, timeout=args.timeout, log=log,
                               shared_prefix=args.shared_prefix or 0)
    result["files"] = loadgen.write_outputs(result, Path(args.out))
    return result


def run(args, log) -> tuple[dict, Callable[[dict], str]]:
    """The result of what the flags ask for, and its renderer."""
    from ess_jax.bench import depth, report

    if args.serve:
        from ess_jax import loadgen

        return load_test(args, log), loadgen.render
    check_args(args)
    if args.shared_prefix:
        from ess_jax.bench import prefix

        return prefix.prefix_bench(args, log), prefix.render
    if args.depth_sweep:
        return depth.depth_sweep(args, log), depth.render_depth
    if args.index_share:
        from ess_jax.bench import index_share

        return index_share.index_share_bench(args, log), index_share.render
    return bench(args, log), report.render


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    try:
        result, render = run(args, log)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

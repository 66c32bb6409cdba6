"""``--depth-sweep``: compile and step times against depth (``depth_sweep``) and their table (``render_depth``)."""

from __future__ import annotations

import argparse
import statistics

from ess_jax.cli import table


def depth_model(args, raw: dict, layers: int):
    """The model of config.json ``raw`` at ``layers`` layers, with random weights from ``--weights-seed``. A V4
    config's per-layer lists give way to transformers' default pattern at every depth (HCA x 2, then HCA / CSA
    alternating; 3 hash-routed layers)."""
    import jax.numpy as jnp
    from flax import nnx

    from ess_jax.api import Model
    from ess_jax.families import get as family_of, load_config
    from ess_jax.tokenizer import load_tokenizer

    raw = {k: v for k, v in raw.items() if k not in ("layer_types", "compress_ratios", "mlp_layer_types")}
    cfg = load_config(dict(raw, num_hidden_layers=layers))
    module = family_of(cfg.family).module_cls(cfg, dtype=getattr(jnp, args.dtype), rngs=nnx.Rngs(args.weights_seed))
    return Model(f"{args.model} x {layers} layers", module, load_tokenizer(None, cfg))


def depth_row(model, prompts: list[list[int]], layers: int, offload: str, args) -> dict:
    """One depth and mode: compile times, the decode step's time and dispatch (``depth_sweep``)."""
    from ess_jax.engine import Engine, EngineConfig, RequestSpec

    config = EngineConfig(max_batch=len(prompts), max_seq_len=args.context + args.new_tokens,
                          prefill_chunk=args.prefill_chunk, offload=offload, pool_ratio=args.ratios[0],
                          fetch=args.fetch[0], kernels=args.kernels, cache_dtype=args.cache_dtype,
                          index_dtype=args.index_dtype, mesh=args.mesh)
    engine = Engine(model, config, record_steps=True)
    engine.compile()
    for prompt in prompts:
        engine.add_request(RequestSpec(prompt, args.new_tokens, ignore_eos=True))
    engine.run()
    pieces_s = [t for step in engine.stats.steps for t in step.prefill_s]
    pieces = len(pieces_s) // len(prompts)  # each prompt's pieces, the same sizes in the same order
    later = [pieces_s[i * pieces] for i in range(1, len(prompts))]
    full = [t for t in engine.stats.steps if t.decode_s is not None and t.decode_rows == len(prompts)][1:]
    steps, dispatch = [t.decode_s for t in full], [t.decode_dispatch_s for t in full]
    return {"layers": layers, "offload": offload, "decode_compile_s": engine.stats.compile_s,
            "prefill_compile_s": pieces_s[0] - statistics.median(later) if later else None,
            "decode_step_ms": 1e3 * statistics.median(steps) if steps else None,
            "dispatch_ms": 1e3 * statistics.median(dispatch) if dispatch else None,
            "measured_steps": len(steps)}


def depth_sweep(args, log) -> dict:
    """``--depth-sweep``: the model's config with ``num_hidden_layers`` set to each given count (random weights
    from ``--weights-seed``), served resident and with ESS (the first ``--ratios`` and ``--fetch``): ``--batch``
    prompts of ``--context`` tokens (``prompt_source``), ``--new-tokens`` each. Per depth and mode:
    - decode compile s: ``Engine.compile`` (lowering and compiling the decode step);
    - prefill compile s: the first prefill piece's time less the median of the later ones of the same size
      (every prompt is cut into the same pieces; with ESS the first handoff's compile is in it too);
    - ms per decode step: the median decode step of the whole batch (``EngineStats.steps``), the first one dropped;
    - dispatch ms: the median time a call of the compiled decode step takes to return (the host's part).
    The persistent compilation cache is off for the sweep, so every compile is measured."""
    from ess_jax.bench.prompts import prompt_source
    from ess_jax.bench.report import machine
    from ess_jax.cli import use_compile_cache
    from ess_jax.config import resolve_model

    use_compile_cache("none")
    raw = resolve_model(args.model).raw_config()
    rows = []
    for layers in args.depth_sweep:
        model = depth_model(args, raw, layers)
        prompts = prompt_source(argparse.Namespace(**dict(vars(args), locality_steps=0)), model.cfg,
                                model.tokenizer)[0]
        for offload in ("none", "ess"):
            row = depth_row(model, prompts, layers, offload, args)
            rows.append(row)
            log(f"depth {layers:3d} {offload:<4}: decode compile {row['decode_compile_s']:.1f} s, "
                f"step {row['decode_step_ms'] or 0:.1f} ms")
    return {"setup": {"model": args.model, "batch": args.batch, "context": args.context, "new_tokens": args.new_tokens,
                      "prefill_chunk": args.prefill_chunk, "pool_ratio": args.ratios[0], "fetch": args.fetch[0],
                      "dtype": args.dtype, "machine": machine()},
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
                      table(["layers", "mode", "decode compile s", "prefill compile s", "ms/step", "dispatch ms"],
                            rows, right=range(1, 6))])

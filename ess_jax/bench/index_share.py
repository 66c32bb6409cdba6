"""Index Share in one run (``--index-share none,every-2,...``; DOMAIN.md 1.7): the model served with each pattern
(``none``: its config's own), each resident and with ESS (the first ``--ratios`` and ``--fetch``), the engine runs'
measurements (``ess_jax.bench.runs``: decode and prefill tokens/s, the tier's hit rate per layer) side by side, each
pattern's tokens compared resident against ESS, and the bytes per token its cache keeps (``Family.cache_parts`` in the formats the engine stores)."""

from __future__ import annotations


def index_share_bench(args, log) -> dict:
    """The engine runs of every ``--index-share`` pattern on the same prompts (random from ``--seed``, ``--batch``
    of ``--context`` tokens)."""
    import numpy as np

    from ess_jax.api import load_model
    from ess_jax.bench import runs
    from ess_jax import families

    rows = []
    for share in args.index_share:
        model = load_model(args.model, args.dtype, seed=args.weights_seed,
                           index_share=None if share == "none" else share)
        prompts = np.random.default_rng(args.seed).integers(0, model.cfg.vocab_size, (args.batch, args.context))
        settings = [runs.Setting("none"), runs.Setting("ess", args.ratios[0], args.fetch[0])]
        log(f"index share {share}: pattern {model.cfg.index_pattern}")
        family = families.get(model.cfg.family)
        parts = family.cache_parts(model.cfg, family.stored_formats(args.cache_dtype or args.dtype, args.dtype,
                                                                    args.index_dtype))
        for result in runs.run_settings(model, settings, prompts.tolist(), args, log):
            result.pop("output_ids")
            rows.append(dict(result, index_share=share, pattern=model.cfg.index_pattern,
                             resident_bytes_per_token=sum(p.bytes_per_token() for p in parts if p.where == "resident")))
    return {"setup": {"model": args.model, "context": args.context, "new_tokens": args.new_tokens,
                      "batch": args.batch, "repeats": args.repeats}, "rows": rows}


def render(result: dict) -> str:
    from ess_jax.cli import table

    s = result["setup"]
    rows = [[r["index_share"], r["pattern"], "resident" if r["offload"] == "none" else f"ess r={r['pool_ratio']:g} "
             f"{r['fetch']}", f"{r['decode_tokens_per_s']:.1f}", f"{r['prefill_tokens_per_s']:.0f}",
             "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}",
             "-" if r["per_layer"] is None else " ".join(f"{c['hit_rate']:.2f}" for c in r["per_layer"]),
             f"{r['resident_bytes_per_token']:,.0f}", "yes" if r["tokens_match_resident"] else "NO"]
            for r in result["rows"]]
    head = (f"{s['model']}: {s['batch']} x {s['context']} prompt tokens, {s['new_tokens']} decoded, medians of "
            f"{s['repeats']}")
    return head + "\n" + table(["index share", "pattern", "engine", "decode tok/s", "prefill tok/s", "hit rate",
                                "hit rate per layer", "resident B/token", "tokens = resident"], rows, {3, 4, 5, 7})

"""Index Share in one run (``--index-share none,every-2,DIR,...``; DOMAIN.md 1.7): the model served with each
pattern (``none``: its config's own; a directory: a searched or distilled checkpoint), its held-out NLL, each resident
and with ESS (the first ``--ratios`` and ``--fetch``), the engine runs' measurements (``ess_jax.bench.runs``: decode
and prefill tokens/s, the tier's hit rate and fetch lead per layer) side by side, each pattern's tokens compared
resident against ESS, and the bytes per token its cache keeps (``Family.cache_parts`` in the formats the engine
stores)."""

from __future__ import annotations

import json
from pathlib import Path


def index_share_bench(args, log) -> dict:
    """The engine runs of every ``--index-share`` entry on the same prompts (random from ``--seed``, ``--batch``
    of ``--context`` tokens): ``none`` (the model's config), a pattern or ``every-N`` over the model's weights, or a
    checkpoint directory (a pattern searched or distilled by ``ess_jax.train``: its config carries it). With the
    held-out text of the model's ``train.json`` (its ``heldout`` entry), each entry's held-out NLL there too;
    ``--record``: the entries' patterns and NLL written into that ``train.json`` (its ``index_share`` entry)."""
    import numpy as np

    from ess_jax import families
    from ess_jax.api import load_model
    from ess_jax.bench import runs

    log_path = _train_json(args.model)
    heldout = json.loads(log_path.read_text()).get("heldout") if log_path else None
    if args.record and heldout is None:
        raise ValueError(f"--record writes into a checkpoint's train.json with a held-out text; {args.model} has none")
    rows, variants = [], []
    for share in args.index_share:
        variant = Path(share).is_dir()
        model = load_model(share if variant else args.model, args.dtype, seed=args.weights_seed,
                           index_share=None if variant or share == "none" else share)
        nll = heldout_nll(model, heldout) if heldout else None
        log(f"index share {share}: pattern {model.cfg.index_pattern}"
            + (f", held-out NLL {nll:.4f}" if heldout else ""))
        variants.append({"index_share": share, "pattern": model.cfg.index_pattern, "heldout_nll": nll,
                         **(_made_by(Path(share)) if variant else {})})
        prompts = np.random.default_rng(args.seed).integers(0, model.cfg.vocab_size, (args.batch, args.context))
        settings = [runs.Setting("none"), runs.Setting("ess", args.ratios[0], args.fetch[0])]
        family = families.get(model.cfg.family)
        parts = family.cache_parts(model.cfg, family.stored_formats(args.cache_dtype or args.dtype, args.dtype,
                                                                    args.index_dtype))
        for result in runs.run_settings(model, settings, prompts.tolist(), args, log):
            result.pop("output_ids")
            rows.append(dict(result, index_share=share, pattern=model.cfg.index_pattern, heldout_nll=nll,
                             resident_bytes_per_token=sum(p.bytes_per_token() for p in parts if p.where == "resident")))
    if args.record:
        log_path.write_text(json.dumps(dict(json.loads(log_path.read_text()), index_share=variants), indent=1) + "\n")
    return {"setup": {"model": args.model, "context": args.context, "new_tokens": args.new_tokens,
                      "batch": args.batch, "repeats": args.repeats, "heldout": heldout}, "rows": rows}


def heldout_nll(model, heldout: dict) -> float:
    """The mean NLL of the full causal forward on a ``train.json`` ``heldout`` entry's text: its first ``tokens``
    tokens in windows of ``context`` (``ess_jax.eval``), as the checkpoint's own held-out NLL was measured."""
    from ess_jax.eval import evaluate, read_text

    ids = model.tokenizer.encode(read_text(heldout["text"]))[: heldout["tokens"]]
    return evaluate(model, ids, context=heldout["context"], paths=["full"])["paths"]["full"]["nll"]


def _train_json(model: str) -> Path | None:
    """The ``train.json`` of the checkpoint ``model`` names (None: a preset, or a checkpoint without one)."""
    from ess_jax.config import resolve_model

    directory = resolve_model(model).checkpoint
    return directory / "train.json" if directory is not None and (directory / "train.json").is_file() else None


def _made_by(directory: Path) -> dict:
    """How ``ess_jax.train`` made a checkpoint's pattern: the greedy search's kept fraction and steps
    (``index_share.json``), or the distillation's flags and steps (``state.json``)."""
    if (directory / "index_share.json").is_file():
        search = json.loads((directory / "index_share.json").read_text())
        return {"search": {"keep": search["keep"], "steps": search["steps"]}}
    state = json.loads((directory / "state.json").read_text())
    return {"distillation": {"step": state["step"], "flags": state["flags"]}}


def render(result: dict) -> str:
    from ess_jax.cli import table

    s = result["setup"]
    rows = [[Path(r["index_share"]).name, r["pattern"], "-" if r["heldout_nll"] is None else f"{r['heldout_nll']:.4f}",
             "resident" if r["offload"] == "none" else f"ess r={r['pool_ratio']:g} {r['fetch']}",
             f"{r['decode_tokens_per_s']:.1f}", f"{r['prefill_tokens_per_s']:.0f}",
             "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}",
             "-" if r["per_layer"] is None else " ".join(f"{c['hit_rate']:.2f}" for c in r["per_layer"]),
             "-" if r["per_layer"] is None else " ".join(str(c["lead"]) for c in r["per_layer"]),
             f"{r['resident_bytes_per_token']:,.0f}", "yes" if r["tokens_match_resident"] else "NO"]
            for r in result["rows"]]
    head = (f"{s['model']}: {s['batch']} x {s['context']} prompt tokens, {s['new_tokens']} decoded, medians of "
            f"{s['repeats']}")
    return head + "\n" + table(["index share", "pattern", "held-out NLL", "engine", "decode tok/s", "prefill tok/s",
                                "hit rate", "hit rate per layer", "lead per layer", "resident B/token",
                                "tokens = resident"], rows, {2, 4, 5, 6, 9})

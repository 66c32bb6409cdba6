"""Copy a trained checkpoint into the package (checkpoints/NAME) with its train.json record.

    python tools/ship_checkpoint.py RUN_DIR NAME [--text checkpoints/heldout_code.txt] [--tokens 2048]

RUN_DIR is what tools/train_tiny.sh wrote (its dense / warmup / sparse stage directories, then its MTP
stages'); the last stage's config.json, model.safetensors and tokenizer.json are copied. A run that
continued a shipped checkpoint (``tools/train_tiny.sh --mtp NAME``) has only its MTP stages: the records
of the others are kept from the checkpoint's train.json. train.json records, per stage, the flags, steps,
tokens trained on, wall time (tokens / the last logged tokens-per-second, which spans the stage's
process), the last train and held-out losses (and the MTP loss, acceptance and draft top-1 of the MTP
stages); the held-out perplexity of the shipped weights on the first --tokens tokens of --text through
the full forward in windows of 1024 tokens (``ess_jax.eval.evaluate``), the figure tests/test_shipped.py
checks the packaged model against; and, for a model with an MTP module, its held-out acceptance and
draft top-1 on the same windows (``ess_jax.train.mtp_agreement``: the fraction of positions where the
MTP module's greedy draft equals the main model's greedy next token, and the true token two ahead).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

STAGES = ("dense", "warmup", "sparse", "mtp-dense", "mtp-warmup", "mtp-sparse")
ROOT = Path(__file__).resolve().parents[1]


def stage_record(directory: Path) -> dict:
    flags = json.loads((directory / "state.json").read_text())["flags"]
    log = [json.loads(line) for line in (directory / "train_log.jsonl").read_text().splitlines()]
    last, evaluated = log[-1], [r for r in log if "heldout_lm" in r]
    tokens = flags["steps"] * flags["accum"] * flags["batch"] * flags["context"]
    record = {"flags": flags, "tokens": tokens, "wall_s": round(tokens / last["tokens_per_s"], 1),
              "train_loss": last["loss"], "train_lm": last["lm"], "train_kl": last["kl"],
              "heldout_lm": evaluated[-1]["heldout_lm"], "heldout_kl": evaluated[-1]["heldout_kl"]}
    if "mtp" in last:
        record.update(train_mtp=last["mtp"], **{k: evaluated[-1][k] for k in
                                                ("heldout_mtp", "heldout_acceptance", "heldout_mtp_top1")})
    return record


def mtp_heldout(model, ids: list[int], context: int) -> dict:
    """The MTP module's acceptance and draft top-1 over windows of ``context`` tokens of ``ids`` (every position
    with a token two ahead in its window), through the full forward."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from ess_jax.train import mtp_agreement

    @jax.jit
    def agreement(params, window):
        module = nnx.merge(model.graphdef, params)
        hidden, _ = module.hidden_states(window, None)
        return mtp_agreement(module.head(hidden), module.mtp_forward(hidden[:, :-2], window[:, 1:-1])[0], window)

    totals = np.zeros(2)
    positions = 0
    for start in range(0, len(ids), context):
        window = ids[start:start + context]
        if len(window) < 3:
            continue
        totals += (len(window) - 2) * np.asarray(agreement(model.params, jnp.asarray([window])))
        positions += len(window) - 2
    return {"acceptance": totals[0] / positions, "mtp_top1": totals[1] / positions, "positions": positions}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("name")
    p.add_argument("--text", type=Path, default=ROOT / "checkpoints" / "heldout_code.txt")
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args(argv)
    from ess_jax.api import load_model
    from ess_jax.eval import evaluate

    ran = [s for s in STAGES if (args.run_dir / s / "state.json").is_file()]
    if not ran:
        raise SystemExit(f"error: {args.run_dir} holds no stage directory ({', '.join(STAGES)})")
    final = args.run_dir / ran[-1]
    out = ROOT / "checkpoints" / args.name
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads((out / "train.json").read_text())["stages"] if (out / "train.json").is_file() else {}
    stages = {s: stage_record(args.run_dir / s) if s in ran else previous[s] for s in STAGES
              if s in ran or s in previous}
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(final / name, out / name)
    model = load_model(out)
    ids = model.tokenizer.encode(args.text.read_text())[: args.tokens]
    result = evaluate(model, ids, context=1024, paths=["full"])
    record = {
        "corpus": "tools/build_corpus.py (CPython 3.13.0 standard library, 4096-token byte-level BPE)",
        "recipe": "tools/train_tiny.sh", "stages": stages,
        "heldout": {"text": str(args.text.relative_to(ROOT)), "tokens": args.tokens, "context": 1024,
                    "nll": result["paths"]["full"]["nll"], "ppl": result["paths"]["full"]["ppl"]},
    }
    if model.cfg.num_nextn_predict_layers:
        record["mtp"] = {"text": record["heldout"]["text"], "tokens": args.tokens, "context": 1024,
                         **mtp_heldout(model, ids, 1024)}
    record["tokens"] = sum(s["tokens"] for s in record["stages"].values())
    record["wall_s"] = round(sum(s["wall_s"] for s in record["stages"].values()), 1)
    (out / "train.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("heldout", "mtp") if k in record}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

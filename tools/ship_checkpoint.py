"""Copy a trained checkpoint into the package (checkpoints/NAME) with its train.json record.

    python tools/ship_checkpoint.py RUN_DIR NAME [--text checkpoints/heldout_code.txt] [--tokens 2048]

RUN_DIR is what tools/train_tiny.sh wrote (its dense / warmup / sparse stage directories); the final
stage's config.json, model.safetensors and tokenizer.json are copied. train.json records, per stage, the
flags, steps, tokens trained on, wall time (tokens / the last logged tokens-per-second, which spans the
stage's process), the last train and held-out losses; and the held-out perplexity of the shipped
weights on the first --tokens tokens of --text through the full forward in windows of 1024 tokens
(``ess_jax.eval.evaluate``), the figure tests/test_shipped.py checks the packaged model against.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

STAGES = ("dense", "warmup", "sparse")
ROOT = Path(__file__).resolve().parents[1]


def stage_record(directory: Path) -> dict:
    flags = json.loads((directory / "state.json").read_text())["flags"]
    log = [json.loads(line) for line in (directory / "train_log.jsonl").read_text().splitlines()]
    last, evaluated = log[-1], [r for r in log if "heldout_lm" in r]
    tokens = flags["steps"] * flags["accum"] * flags["batch"] * flags["context"]
    return {"flags": flags, "tokens": tokens, "wall_s": round(tokens / last["tokens_per_s"], 1),
            "train_loss": last["loss"], "train_lm": last["lm"], "train_kl": last["kl"],
            "heldout_lm": evaluated[-1]["heldout_lm"], "heldout_kl": evaluated[-1]["heldout_kl"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("name")
    p.add_argument("--text", type=Path, default=ROOT / "checkpoints" / "heldout_code.txt")
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args(argv)
    from ess_jax.api import load_model
    from ess_jax.eval import evaluate

    final = args.run_dir / STAGES[-1]
    out = ROOT / "checkpoints" / args.name
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(final / name, out / name)
    model = load_model(out)
    ids = model.tokenizer.encode(args.text.read_text())[: args.tokens]
    result = evaluate(model, ids, context=1024, paths=["full"])
    record = {
        "corpus": "tools/build_corpus.py (CPython 3.13.0 standard library, 4096-token byte-level BPE)",
        "recipe": "tools/train_tiny.sh", "stages": {s: stage_record(args.run_dir / s) for s in STAGES},
        "heldout": {"text": str(args.text.relative_to(ROOT)), "tokens": args.tokens, "context": 1024,
                    "nll": result["paths"]["full"]["nll"], "ppl": result["paths"]["full"]["ppl"]},
    }
    record["tokens"] = sum(s["tokens"] for s in record["stages"].values())
    record["wall_s"] = round(sum(s["wall_s"] for s in record["stages"].values()), 1)
    (out / "train.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["heldout"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

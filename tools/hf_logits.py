"""transformers' logits for a checkpoint directory, to cross-check what ess_jax loads (and what
``python -m ess_jax.train`` exports) against the reference implementation.

Run in the fixtures environment (torch + transformers; see tools/requirements-fixtures.txt):

    .fixtures-venv/bin/python tools/hf_logits.py CKPT_DIR --text FILE --tokens 256 --out hf.npz

It tokenizes the first --tokens tokens of FILE with the checkpoint's tokenizer.json (through the
``tokenizers`` library that transformers uses), runs ``AutoModelForCausalLM`` in float32 without a
cache, and writes ``ids`` and ``logits`` to --out. Then, in ess_jax's environment:

    python -c "import numpy as np; from ess_jax.api import load_model; r = np.load('hf.npz');
      print(abs(load_model('CKPT_DIR').logits(r['ids'][None])[0] - r['logits']).max())"
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    tokenizer = tokenizers.Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    ids = tokenizer.encode(args.text.read_text()).ids[: args.tokens]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    np.savez(args.out, ids=np.asarray(ids, np.int32), logits=logits.astype(np.float32))
    print(f"{args.checkpoint}: {len(ids)} tokens, logits {logits.shape}, written to {args.out}")


if __name__ == "__main__":
    main()

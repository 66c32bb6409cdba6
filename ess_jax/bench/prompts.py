"""The prompts: the engine runs' and the locality pass's, from random ids or a text (``prompt_source``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def prompt_source(args: argparse.Namespace, cfg, tokenizer) -> tuple[list[list[int]], dict[int, list[int]], dict]:
    """The engine runs' prompts, the locality pass's prompt per context, and how they were made.

    Without ``--text``: one stream of random token ids from ``--seed``; request i is its tokens
    ``[i C, (i + 1) C)`` (C = ``--context``), the locality prompt of context N its first N tokens.
    ``--text FILE``: FILE's text tokenized once by the model's tokenizer (a bos it adds starts request
    0 only); request i is its tokens ``[i S, i S + C)`` with stride ``S = C // 2`` (windows overlapping
    by half), the locality prompt of context N its first N tokens. A text shorter than the longest of
    these is a ValueError naming the sizes."""
    contexts = args.locality_contexts if args.locality_steps else []
    if args.text is None:
        stride, need = args.context, max([args.batch * args.context] + contexts)
        tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, need).tolist()
        source = {"kind": "random", "seed": args.seed}
    else:
        stride = args.context // 2
        tokens = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
        need = max([(args.batch - 1) * stride + args.context] + contexts)
        if len(tokens) < need:
            longest = f", the longest --locality-contexts {max(contexts)}" if contexts else ""
            raise ValueError(f"--text {args.text} holds {len(tokens)} tokens (the model's tokenizer), fewer than the "
                             f"{need} needed: --batch {args.batch} prompts of --context {args.context} starting every "
                             f"{stride} tokens end at token {(args.batch - 1) * stride + args.context}{longest}")
        source = {"kind": "text", "file": str(args.text)}
    source.update(tokens=len(tokens), stride=stride)
    prompts = [tokens[i * stride:i * stride + args.context] for i in range(args.batch)]
    return prompts, {n: tokens[:n] for n in contexts}, source

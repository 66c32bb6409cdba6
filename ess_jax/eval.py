"""``python -m ess_jax.eval``: loss and perplexity of a text, through three paths that must agree.

The text of --text FILE is tokenized with the model's tokenizer (bos included: DeepSeek's tokenizer.json
and the byte-level tokenizer add it), at most --max-tokens tokens of it are read (default: all), and the
tokens are cut into consecutive windows of --context tokens (the last may be shorter; a last window
of one token is dropped). Each window is scored on its own from its start: its first token is context
only, every later token is scored by its negative log-likelihood given the window's tokens before it,
so tokens scored = tokens read - number of windows.

Paths (--paths, default all three; --offload none drops ess from the default):
  full      the full causal forward (Model.logits, the training form): log-softmax at each position,
            the NLL of the next token.
  resident  the engine's cached sparse path, --offload none: each window is one request whose prompt
            is the window's first token (a prefill of one token) and whose output is teacher-forced
            to the window's other tokens (RequestSpec(..., forced_ids=...)): every step feeds
            the true token instead of the sampled one and reports log p(true token), so every scored
            token after the first of its window is predicted by a decode step of the cached path.
  ess       the same with --offload ess: the host-offloaded tier (pool from --pool-size / --pool-ratio,
            --fetch inline|split).
The windows decode together, one request each, max_batch = min(number of windows, --max-batch);
--max-seq-len defaults to the longest window (--context, or the whole text when shorter).
Reported per path: tokens scored, mean NLL in nats per token and perplexity = exp(mean NLL); and
the largest absolute difference of per-token NLL between every two paths. In float32 the three
agree to rounding (per-token NLL within ~1e-4).

Examples:
    python -m ess_jax.eval --model tiny-v32 --text README.md --context 512
    python -m ess_jax.eval --model path/to/ckpt --text corpus.txt --paths full,ess --pool-ratio 0.1 --json

Errors (a missing or empty file, a text under 2 tokens, bad flags) print one line starting with
"error:" and exit with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from typing import Sequence

import numpy as np

from ess_jax.api import load_model
from ess_jax.cli import Parser, add_engine_flags, add_index_share_flag, add_model_flag, engine_config
from ess_jax.engine import Engine, EngineConfig, RequestSpec

PATHS = ("full", "resident", "ess")
DEFAULT_CONTEXT = 4096


def split_windows(ids: Sequence[int], context: int) -> list[list[int]]:
    """Consecutive windows of ``context`` tokens (the last may be shorter); a one-token last window
    scores nothing and is dropped."""
    if context < 2:
        raise ValueError(f"--context {context} must be >= 2 (a window's first token is context only)")
    windows = [list(ids[i:i + context]) for i in range(0, len(ids), context)]
    return [w for w in windows if len(w) >= 2]


def _nll_from_logits(logits_TV: np.ndarray, targets_T: np.ndarray, rows: int = 256) -> np.ndarray:
    """-log_softmax(logits)[t, targets[t]] per position, float64 on the host, ``rows`` positions at a time."""
    out = np.empty(len(targets_T), np.float64)
    for start in range(0, len(targets_T), rows):
        x = logits_TV[start:start + rows].astype(np.float64)
        top = x.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
        out[start:start + rows] = lse - x[np.arange(len(x)), targets_T[start:start + rows]]
    return out


def full_nll(model, windows: list[list[int]]) -> list[np.ndarray]:
    """Per-token NLL of each window from the full causal forward, one window per ``Model.logits`` call.
    A shorter (last) window is padded with token 0 to the longest one's length, so every call has one
    shape (one compile): the forward is causal, so what follows a position changes nothing at it."""
    longest = max(len(w) for w in windows)
    out = []
    for window in windows:
        logits_TV = model.logits([window + [0] * (longest - len(window))])[0]
        out.append(_nll_from_logits(logits_TV[: len(window) - 1], np.asarray(window[1:])))
    return out


def cached_nll(model, windows: list[list[int]], engine: EngineConfig) -> tuple[list[np.ndarray], Engine]:
    """Per-token NLL of each window through the engine's cached path (``engine.offload`` chooses the
    tier): one teacher-forced request per window, prompt = its first token, forced ids = the rest.
    ``max_batch`` is cut to the number of windows; ``max_seq_len`` defaults to the longest window.
    The engine (for its metrics) comes back too."""
    longest = max(len(w) for w in windows)
    if engine.max_seq_len is not None and engine.max_seq_len < longest:
        raise ValueError(f"--max-seq-len {engine.max_seq_len} is below the longest window ({longest} tokens); "
                         "raise it or lower --context")
    config = dataclasses.replace(engine, max_batch=min(len(windows), engine.max_batch),
                                 max_seq_len=engine.max_seq_len or longest + 2 * engine.num_speculative_tokens)
    server = Engine(model, config)
    ids = [server.add_request(RequestSpec(w[:1], len(w) - 1, forced_ids=w[1:])) for w in windows]
    logprobs: dict[int, list[float]] = {i: [] for i in ids}
    while server.has_unfinished():
        for out in server.step():
            logprobs[out.request_id] += [-lp.logprob for lp in out.logprobs or ()]
    for rid, w in zip(ids, windows):
        if len(logprobs[rid]) != len(w) - 1:  # the forced request must report every token it scored
            raise RuntimeError(f"request {rid} reported {len(logprobs[rid])} log-probabilities for {len(w) - 1} tokens")
    return [np.asarray(logprobs[i], np.float64) for i in ids], server


def evaluate(model, ids: Sequence[int], *, context: int, paths: Sequence[str] = PATHS,
             engine: EngineConfig = EngineConfig()) -> dict:
    """Score ``ids`` (token ids, at least 2) in windows of ``context`` through ``paths``. Returns
    ``{"windows": int, "tokens_read": int, "paths": {path: {"tokens", "nll", "ppl", "wall_s"}},
    "per_token": {path: f64[tokens] NLL in window order}, "max_abs_diff": {"a-b": float},
    "offload": None | {...}}`` (``offload``: the ess path's pool slots and tier counters)."""
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"--paths {','.join(paths)!r}: choose among {', '.join(PATHS)}")
    if len(ids) < 2:
        raise ValueError(f"{len(ids)} token(s) to score; a window needs at least 2 (its first is context only)")
    if context > model.cfg.max_position_embeddings:
        raise ValueError(f"--context {context} exceeds the model's max_position_embeddings "
                         f"({model.cfg.max_position_embeddings})")
    windows = split_windows(ids, context)
    per_token, summary, offload = {}, {}, None
    for path in paths:
        start = time.perf_counter()
        if path == "full":
            nll = full_nll(model, windows)
        else:
            nll, server = cached_nll(model, windows, dataclasses.replace(
                engine, offload="ess" if path == "ess" else "none"))
            if path == "ess":
                metrics = server.offload_metrics()
                offload = {"pool_size": server.layout.pool_slots, "fetch": engine.fetch,
                           **{k: metrics[k] for k in ("lookups", "hits", "misses", "hit_rate", "h2d_bytes")}}
        wall = time.perf_counter() - start
        flat = np.concatenate(nll)
        per_token[path] = flat
        mean = float(flat.mean())
        summary[path] = {"tokens": int(flat.size), "nll": mean, "ppl": math.exp(mean), "wall_s": wall}
    diffs = {f"{a}-{b}": float(np.abs(per_token[a] - per_token[b]).max())
             for a, b in itertools.combinations(paths, 2)}
    return {"windows": len(windows), "tokens_read": len(ids), "paths": summary, "per_token": per_token,
            "max_abs_diff": diffs, "offload": offload}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("python -m ess_jax.eval", __doc__)
    add_model_flag(p)
    add_index_share_flag(p)
    p.add_argument("--text", required=True, metavar="FILE", help="the UTF-8 text file to score")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per window; each window is scored independently from its own start, its first "
                        "token being context only (default: min(4096, max_position_embeddings))")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="read at most this many tokens of the text (default: all)")
    p.add_argument("--paths", default=None,
                   help="comma-separated paths to run among full, resident, ess (default: all three; full,resident "
                        "with --offload none)")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: model, family, context, windows, tokens_read, paths {path: {tokens, "
                        "nll, ppl, wall_s}}, max_abs_diff {\"a-b\": float}, offload (the ess path's tier counters)")
    return p.parse_args(argv)


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"--text {path}: cannot read it ({e.strerror or e})") from None
    if not text:
        raise ValueError(f"--text {path} is empty; nothing to score")
    return text


def _paths(args: argparse.Namespace) -> list[str]:
    if args.paths is None:
        return list(PATHS) if args.offload == "ess" else ["full", "resident"]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"--paths {args.paths!r}: choose among {', '.join(PATHS)} (comma-separated)")
    if len(set(paths)) != len(paths):
        raise ValueError(f"--paths {args.paths!r} names a path twice")
    if "ess" in paths and args.offload == "none":
        raise ValueError("--paths ess contradicts --offload none; drop one of them")
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.max_tokens is not None and args.max_tokens < 2:
            raise ValueError(f"--max-tokens {args.max_tokens} must be >= 2 (a window's first token is context only)")
        paths = _paths(args)
        text = read_text(args.text)
        engine = engine_config(args)
        model = load_model(args.model, args.dtype, seed=args.weights_seed, weights=args.weights,
                           index_share=args.index_share)
        ids = model.tokenizer.encode(text)[: args.max_tokens]
        if len(ids) < 2:
            raise ValueError(f"--text {args.text} has {len(ids)} token(s); scoring needs at least 2")
        context = args.context or min(DEFAULT_CONTEXT, model.cfg.max_position_embeddings)
        result = evaluate(model, ids, context=context, paths=paths, engine=engine)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head = {"model": model.name, "family": model.cfg.family, "context": context, "windows": result["windows"],
            "tokens_read": result["tokens_read"]}
    if args.json:
        print(json.dumps(dict(head, paths=result["paths"], max_abs_diff=result["max_abs_diff"],
                              offload=result["offload"])))
        return 0
    print(f"{model.name}: {result['tokens_read']} tokens read, {result['windows']} windows of <= {context}")
    print(f"{'path':<9} {'tokens':>7} {'nll':>9} {'ppl':>10} {'wall s':>7}")
    for path, r in result["paths"].items():
        print(f"{path:<9} {r['tokens']:>7} {r['nll']:>9.5f} {r['ppl']:>10.3f} {r['wall_s']:>7.2f}")
    if result["max_abs_diff"]:
        print("max |per-token NLL difference|: " + ", ".join(
            f"{pair} {d:.2e}" for pair, d in result["max_abs_diff"].items()))
    if result["offload"]:
        o = result["offload"]
        print(f"ess: {o['pool_size']} pool slots, {o['fetch']} fetch, hit rate {o['hit_rate']:.3f} "
              f"({o['misses']} misses of {o['lookups']} lookups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

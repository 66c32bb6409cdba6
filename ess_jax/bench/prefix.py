"""The prefix cache's workloads (``--shared-prefix N``), each served with and without the prefix cache in one run,
resident and with ESS (the first ``--ratios`` and ``--fetch``):

- shared prefix: ``--batch`` x 2 requests, each the same N-token prefix and a distinct ``--suffix-tokens`` suffix,
  sent one after the other (each when the one before has finished: what a cache can give each one);
- all at once: the same requests added together to ``--batch`` batch rows (a few-shot eval, one system prompt over a
  file of questions: what in-batch prefix sharing gives);
- chat replay: ``--chat-turns`` turns of one conversation, each turn's prompt the conversation so far (the
  previous prompt, its reply and ``--suffix-tokens`` new user tokens), as a chat client resends it.

Per engine and workload: time to first token (from ``add_request`` to the step that returns the request's first
token; every step size compiled first, ``Engine.warm_up``), the tokens per second over the workload (prompt and
generated tokens over its wall time), the prefix cache's hit rate, and whether its tokens equal those without
the cache."""

from __future__ import annotations

import dataclasses
import statistics
import time


def _serve(engine, prompt: list[int], new: int) -> tuple[list[int], float]:
    """One request alone to its end: its tokens and its time to first token in seconds."""
    from ess_jax.engine import RequestSpec

    start, first, tokens = time.perf_counter(), None, []
    request_id = engine.add_request(RequestSpec(prompt, new, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                first = first or time.perf_counter() - start
                tokens += out.new_token_ids
    return tokens, first


def _workload(engine, kind: str, stream: list[int], args) -> dict:
    from ess_jax.engine import RequestSpec

    n, suffix, new = args.shared_prefix, args.suffix_tokens, args.new_tokens
    prefix, at = stream[:n], n
    ttft, outputs, tokens = [], [], 0
    start = time.perf_counter()
    if kind == "all at once":
        prompts = [prefix + stream[n + i * suffix:n + (i + 1) * suffix] for i in range(2 * args.batch)]
        added = {engine.add_request(RequestSpec(p, new, ignore_eos=True)): i for i, p in enumerate(prompts)}
        firsts, outs = {}, {i: [] for i in added}
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    firsts.setdefault(out.request_id, time.perf_counter() - start)
                    outs[out.request_id] += out.new_token_ids
        outputs, ttft = [outs[i] for i in sorted(added)], [firsts[i] for i in sorted(added)]
        tokens = sum(map(len, prompts)) + sum(map(len, outputs))
    elif kind == "shared prefix":
        for _ in range(2 * args.batch):
            prompt = prefix + stream[at:at + suffix]
            at += suffix
            out, first = _serve(engine, prompt, new)
            outputs.append(out), ttft.append(first)
            tokens += len(prompt) + len(out)
    else:
        prompt = prefix
        for _ in range(args.chat_turns):
            prompt = prompt + stream[at:at + suffix]
            at += suffix
            out, first = _serve(engine, prompt, new)
            outputs.append(out), ttft.append(first)
            tokens += len(prompt) + len(out)
            prompt = prompt + out
    wall = time.perf_counter() - start
    cache = engine.prefix_cache_metrics()
    return {"ttft_ms_p50": 1e3 * statistics.median(ttft), "ttft_ms_mean": 1e3 * statistics.mean(ttft),
            "ttft_ms": [1e3 * t for t in ttft], "tokens_per_s": tokens / wall, "wall_s": wall,
            "hit_rate": cache["hit_rate"] if cache else 0.0, "hit_tokens": cache["hit_tokens"] if cache else 0,
            "output_ids": outputs}


def longest(args) -> int:
    """The longest request of the workloads: the chat's last turn."""
    turns = max(args.chat_turns, 1)
    return args.shared_prefix + turns * (args.suffix_tokens + args.new_tokens)


def prefix_runs(model, stream: list[int], args, log) -> list[dict]:
    """Both workloads on every engine (resident and ESS, each with and without the prefix cache); a row each."""
    from ess_jax.engine import Engine, EngineConfig

    base = EngineConfig(max_batch=1, max_seq_len=longest(args), prefill_chunk=args.prefill_chunk,
                        kernels=args.kernels, cache_dtype=args.cache_dtype, pool_ratio=args.ratios[0],
                        fetch=args.fetch[0])
    rows = []
    for offload in ("none", "ess"):
        for cached in (False, True):
            label = f"{'resident' if offload == 'none' else 'ess'} {'with' if cached else 'without'} prefix cache"
            for kind in ("shared prefix", "all at once", "chat"):
                log(f"prefix: {kind}, {label}")
                # an engine of its own (an empty cache); engines of one shape share their compiled steps
                batch = args.batch if kind == "all at once" else 1
                engine = Engine(model, dataclasses.replace(base, offload=offload, prefix_cache=cached, max_batch=batch))
                engine.warm_up()
                run = _workload(engine, kind, stream, args)
                rows.append(dict(run, workload=kind, offload=offload, prefix_cache=cached,
                                 prefix_cache_active=engine.prefix_cache))
    for row in rows:
        plain = next(r for r in rows if r["workload"] == row["workload"] and r["offload"] == "none"
                     and not r["prefix_cache"])
        row["tokens_match"] = row["output_ids"] == plain["output_ids"]
    return rows


def prefix_bench(args, log) -> dict:
    """``--shared-prefix N``: the model, a stream of token ids (random from ``--seed``, or ``--text`` tokenized),
    ``prefix_runs``."""
    from pathlib import Path

    import numpy as np

    from ess_jax.api import load_model

    model = load_model(args.model, args.dtype, seed=args.weights_seed)
    need = args.shared_prefix + (2 * args.batch + args.chat_turns) * args.suffix_tokens
    if longest(args) > model.cfg.max_position_embeddings:
        raise ValueError(f"--shared-prefix {args.shared_prefix} + --chat-turns {args.chat_turns} x (--suffix-tokens "
                         f"{args.suffix_tokens} + --new-tokens {args.new_tokens}) exceeds max_position_embeddings "
                         f"{model.cfg.max_position_embeddings}")
    if args.text is None:
        stream = np.random.default_rng(args.seed).integers(0, model.cfg.vocab_size, need).tolist()
    else:
        stream = model.tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
        if len(stream) < need:
            raise ValueError(f"--text {args.text} holds {len(stream)} tokens, fewer than the {need} the prefix "
                             "workloads read")
    setup = {"model": args.model, "shared_prefix": args.shared_prefix, "suffix_tokens": args.suffix_tokens,
             "new_tokens": args.new_tokens, "requests": 2 * args.batch, "chat_turns": args.chat_turns,
             "prompt_source": "random" if args.text is None else args.text}
    return {"setup": setup, "prefix": prefix_runs(model, stream[:need], args, log)}


def render(result: dict) -> str:
    """The table."""
    from ess_jax.cli import table

    s = result["setup"]
    body = [[r["workload"], "resident" if r["offload"] == "none" else "ess", "on" if r["prefix_cache"] else "off",
             f"{r['ttft_ms_p50']:.1f}", f"{r['ttft_ms_mean']:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['hit_rate']:.2f}",
             "yes" if r["tokens_match"] else "NO"] for r in result["prefix"]]
    head = (f"prefix cache: {s['requests']} requests of a {s['shared_prefix']}-token prefix + {s['suffix_tokens']} "
            f"tokens; a chat of {s['chat_turns']} turns (+{s['suffix_tokens']} tokens each); {s['new_tokens']} new "
            f"tokens a request ({s['model']})")
    return head + "\n" + table(["workload", "cache", "prefix cache", "TTFT p50 ms", "TTFT mean ms", "tok/s",
                                 "hit rate", "same tokens"], body, right=(3, 4, 5, 6))

"""The prefill stall: how much a long prompt admitted mid-run slows the running requests (``prefill_stall``)."""

from __future__ import annotations

import statistics
import time


def prefill_stall(model, prompts: list[list[int]], args, log) -> dict:
    """How much a long prompt admitted mid-run slows the running requests (resident engine): ``--batch``
    requests of 64 prompt tokens decode; after a few steps one more request of ``--context`` tokens arrives.
    Every ``Engine.step`` is timed; a step with a prefill piece runs at most ``--prefill-chunk`` prompt
    tokens. Reports the median decode-only step, the median and largest step with a prefill piece, the
    median time of one prefill piece alone (``stats``), and how many pieces the long prompt took."""
    from ess_jax import mesh as device_mesh
    from ess_jax.engine import Engine, EngineConfig, RequestSpec

    log(f"stall: {args.batch} decoding + one {args.context}-token prompt, chunk {args.prefill_chunk}")
    # a row more for the long prompt: a data shard more on a mesh (its shards divide --batch)
    rows = args.batch + (device_mesh.parse(args.mesh).data if args.mesh else 1)
    config = EngineConfig(max_batch=rows, max_seq_len=args.context + args.stall_steps + 64,
                          prefill_chunk=args.prefill_chunk, kernels=args.kernels, cache_dtype=args.cache_dtype,
                          index_dtype=args.index_dtype, mesh=args.mesh, prefix_cache=False)  # the long prompt whole
    engine = Engine(model, config)
    engine.warm_up()  # every piece size compiled: the steps below time no compile
    for prompt in prompts:
        engine.add_request(RequestSpec(prompt[:64], args.stall_steps + 16, ignore_eos=True))
    decode_ms, prefill_ms, piece_ms = [], [], []
    for step in range(args.stall_steps + 16):
        if step == 8:
            engine.add_request(RequestSpec(prompts[0], 1, ignore_eos=True))
        tokens, seconds = engine.stats.prefill_tokens, engine.stats.prefill_s
        start = time.perf_counter()
        engine.step()
        ms = 1e3 * (time.perf_counter() - start)
        if engine.stats.prefill_tokens > tokens and step >= 8:
            prefill_ms.append(ms)
            piece_ms.append(1e3 * (engine.stats.prefill_s - seconds))
        elif step >= 2:
            decode_ms.append(ms)
    engine.run()
    return {"decode_step_ms": statistics.median(decode_ms), "prefill_step_ms": statistics.median(prefill_ms),
            "prefill_step_ms_max": max(prefill_ms), "prefill_piece_ms": statistics.median(piece_ms),
            "pieces": len(prefill_ms), "prefill_chunk": args.prefill_chunk, "context": args.context}

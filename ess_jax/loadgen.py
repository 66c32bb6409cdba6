"""An HTTP load generator for OpenAI-compatible servers (``python -m ess_jax.bench --serve URL ...``).

For each server and each concurrency level ``c`` it sends ``--requests`` streamed completions with
at most ``c`` in flight: random token-id prompts whose lengths cycle through ``--prompt-lengths`` (with
``--shared-prefix N``, each after one shared N-token prefix: the prefix cache's workload),
``--max-tokens`` new tokens each, greedy, eos ignored (so every request decodes the same number of
tokens). The servers run one level after another, alternating, so drift of a shared machine hits
them alike. Per (server, level):
- request throughput: requests / wall time of the level; output tok/s: completion tokens (the
  servers' ``usage``, asked for with ``stream_options.include_usage``) / wall time;
- TTFT: from sending a request to its first streamed chunk with text or tokens;
- inter-token latency: (last chunk - first chunk) / (completion tokens - 1), per request;
p50 / p99 over the level's requests. Outputs: a table, ``serve_results.json`` and ``serve.png`` in ``--out``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import numpy as np


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    first = last = None
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    tokens = usage["completion_tokens"] if usage else 0
    return {"ttft_s": first - start, "itl_s": (last - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens, "latency_s": time.perf_counter() - start}


async def _level(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                 headers: dict, timeout: float) -> dict:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def bounded(prompt):
            async with limit:
                return await _one(client, url, model, prompt, max_tokens, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
    ttft = [r["ttft_s"] * 1e3 for r in results]
    itl = [r["itl_s"] * 1e3 for r in results if r["itl_s"] is not None]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall, "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_ms_p50": _percentile(ttft, 50), "ttft_ms_p99": _percentile(ttft, 99),
            "itl_ms_p50": _percentile(itl, 50), "itl_ms_p99": _percentile(itl, 99),
            "latency_s_median": statistics.median(r["latency_s"] for r in results)}


def _served_model(url: str, headers: dict) -> str:
    import httpx

    reply = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def load_test(urls: list[str], *, concurrency: list[int], prompt_lengths: list[int], requests: int, max_tokens: int,
              vocab: int, seed: int, api_key: str | None, timeout: float, log, shared_prefix: int = 0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = [_served_model(url, headers) for url in urls]
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, shared_prefix).tolist()
    prompts = [prefix + rng.integers(0, vocab, prompt_lengths[i % len(prompt_lengths)]).tolist()
               for i in range(requests)]
    runs: list[dict] = []
    for c in concurrency:
        for url, model in zip(urls, models):
            level = asyncio.run(_level(url, model, prompts, c, max_tokens, headers, timeout))
            runs.append(dict(level, url=url, model=model))
            log(f"{model} @ {url}  c={c:<3} {level['output_tokens_per_s']:8.1f} tok/s  "
                f"TTFT p50 {level['ttft_ms_p50']:.0f} ms")
    return {"setup": {"urls": urls, "models": models, "concurrency": concurrency, "prompt_lengths": prompt_lengths,
                      "shared_prefix": shared_prefix, "requests": requests, "max_tokens": max_tokens, "seed": seed},
            "runs": runs}


def render(result: dict) -> str:
    header = ("server", "c", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms")
    rows = [(f"{r['model']} {r['url']}", str(r["concurrency"]), f"{r['requests_per_s']:.2f}",
             f"{r['output_tokens_per_s']:.1f}", f"{r['ttft_ms_p50']:.0f}", f"{r['ttft_ms_p99']:.0f}",
             f"{r['itl_ms_p50']:.1f}", f"{r['itl_ms_p99']:.1f}") for r in result["runs"]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    setup = result["setup"]
    shared = f"a shared {setup['shared_prefix']}-token prefix + " if setup["shared_prefix"] else ""
    return "\n".join([f"{setup['requests']} requests per level, prompt lengths {shared}{setup['prompt_lengths']}, "
                      f"{setup['max_tokens']} new tokens each, greedy, eos ignored",
                      line(header), line(["-" * w for w in widths]), *map(line, rows)])


def write_outputs(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_results.json").write_text(json.dumps(result, indent=1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for url, model in zip(result["setup"]["urls"], result["setup"]["models"]):
        runs = [r for r in result["runs"] if r["url"] == url]
        c = [r["concurrency"] for r in runs]
        left.plot(c, [r["output_tokens_per_s"] for r in runs], marker="o", label=f"{model} {url}")
        right.plot(c, [r["ttft_ms_p50"] for r in runs], marker="o", label=f"{model} {url}")
    left.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", title="throughput")
    right.set(xlabel="concurrency", ylabel="TTFT p50 (ms)", xscale="log", title="time to first token")
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "serve.png", dpi=120)
    plt.close(fig)
    return [str(out / "serve_results.json"), str(out / "serve.png")]

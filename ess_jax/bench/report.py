"""The printed report (``render``): the runs' table, per-layer hit rates, the stall and peer lines, the locality
section last (``render_locality``); and the machine line of the setup (``machine``)."""

from __future__ import annotations

import os
import platform

from ess_jax.cli import table


def machine() -> str:
    import jax

    devices = jax.devices()
    return (f"{platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} on {devices[0].platform} "
            f"({len(devices)} device{'s' if len(devices) > 1 else ''})")


def run_row(r: dict) -> list[str]:
    mib = 2**20
    label = "resident" if r["offload"] == "none" else f"ess {r['pool_ratio']:g} {r['fetch']}" + (
        "" if r.get("rings") in (None, "host") else f" rings {r['rings']}")
    spec = r.get("speculative_metrics")
    label += f" mtp K={r['speculative']}" if r.get("speculative") else ""
    return [label, f"{r['decode_tokens_per_s']:.1f}",
            f"{r['relative_to_resident']:.2f}" if r["relative_to_resident"] is not None else "-",
            f"{r['relative_to_plain']:.2f}" if r.get("relative_to_plain") is not None else "-",
            "/".join(f"{a:.2f}" for a in spec["acceptance_rate"]) if spec else "-",
            f"{spec['draft_s'] * 1e3:.2f}/{spec['verify_s'] * 1e3:.2f}" if spec and "draft_s" in spec else "-",
            f"{r['step_ms_p50']:.2f}", f"{r['step_ms_p99']:.2f}",
            f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-",
            f"{r['h2d_bytes_per_step'] / 1024:.1f}", f"{r['device_bytes'] / mib:.1f}",
            f"{r['host_bytes'] / mib:.1f}", str(r["requests_in_budget"]),
            f"{r['capacity_gain']:.2f}x" if r["capacity_gain"] is not None else "-"]


def render_stall(stall: dict) -> str:
    return (f"prefill stall (resident): a {stall['context']}-token prompt admitted mid-run took {stall['pieces']} "
            f"steps with a prefill piece of <= {stall['prefill_chunk']} tokens; the running requests' step "
            f"{stall['decode_step_ms']:.2f} ms without one, {stall['prefill_step_ms']:.2f} ms median / "
            f"{stall['prefill_step_ms_max']:.2f} ms max with one (one piece alone: "
            f"{stall['prefill_piece_ms']:.2f} ms median)")


def render_peer(peer: dict) -> str:
    if not peer["available"]:
        return f"peer: unavailable ({peer['reason']})"

    def figure(kind: str, digits: int) -> str:
        if peer[f"{kind}_tokens_per_s"] is None:
            return f"{kind} unmeasured ({peer['unmeasured'][kind]})"
        return f"{kind} {peer[f'{kind}_tokens_per_s']:.{digits}f} tok/s (ess_jax resident {peer[f'{kind}_ratio']:.2f}x)"

    return (f"peer: transformers {peer['transformers']} (torch {peer['torch']}, {peer['threads']} threads) "
            f"{figure('decode', 1)}, {figure('prefill', 0)}; greedy tokens agree (leading, per request) "
            f"on {peer['tokens_agree']} of {peer['tokens_compared']}")


def render(result: dict) -> str:
    s = result["setup"]
    headers = ["config", "tok/s", "vs res", "vs plain", "accept/pos", "draft/verify ms", "p50 ms", "p99 ms",
               "hit rate", "h2d KiB/step", "device MiB", "host MiB", f"req/{s['device_budget_mb']:g}MiB", "gain"]
    out = [f"{s['model']}: {s['batch']} x {s['context']}-token prompts, {s['new_tokens']} new tokens, "
           f"{s['repeats']} repeats (medians), first {s['warmup_steps']} decode steps of each run dropped; "
           f"{s['machine']}",
           table(headers, [run_row(r) for r in result["runs"]], right=range(1, len(headers))),
           f"capacity: {result['capacity_formula']}"]
    for r in result["runs"]:
        if r["per_layer"]:
            per_layer = " ".join(f"{c['hit_rate']:.2f}" for c in r["per_layer"])
            out.append(f"hit rate per layer, ess {r['pool_ratio']:g} {r['fetch']}: {per_layer}")
    if result.get("stall"):
        out.append(render_stall(result["stall"]))
    if result.get("peer") is not None:
        out.append(render_peer(result["peer"]))
    if result["locality"]:
        out += render_locality(result["locality"])
    return "\n".join(out)


def render_locality(loc: dict) -> list[str]:
    """The locality section: overlaps per layer and context, then the simulated hit rate per pool size."""
    contexts = loc["contexts"]
    headers = ["layer"] + [f"{kind} {c['context']}" for c in contexts for kind in ("raw", "shifted")]
    means = ("raw_overlap_mean", "shifted_overlap_mean")
    rows = [[str(layer)] + [f"{c[key][i]:.3f}" for c in contexts for key in means]
            for i, layer in enumerate(loc["layers"])]
    sweep_headers = ["context", "pool", "slots", "hit rate", f"per layer ({' '.join(map(str, loc['layers']))})"]
    sweep = [[str(c["context"]), r["pool"], str(r["slots"]), f"{r['hit_rate']:.3f}",
              " ".join(f"{x['hit_rate']:.2f}" for x in r["per_layer"])] for c in contexts for r in c["lru"]]
    return [f"locality (resident pass, {loc['steps']} greedy decode steps after each prompt; ids: {loc['ids']}, top-k "
            f"{loc['top_k']}): mean over steps of raw |K_t & K_t-1| / |K_t| and shifted |K_t & (K_t-1 + 1)| / |K_t|",
            table(headers, rows, right=range(1, len(headers))),
            "LRU hit rate vs pool size: the tier's policy simulated over the same top-k ids (warm-up from the last "
            "prompt positions' top-k; r = pool ratio of the request's entries)",
            table(sweep_headers, sweep, right=range(1, len(sweep_headers)))]

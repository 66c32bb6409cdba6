"""``python -m ess_jax.compiled_for``: the "compiled for" table: each model served on 8 devices of each target
(``--mesh expert=8``, release weights, ESS at pool ratio 0.2, FP8 entries, 32K context) at the planner's batch,
compiled by the target's own compiler, as ``python -m ess_jax.export --compile`` does (the aot extra: run it with
``.venv-aot/bin/python``).

    python -m ess_jax.compiled_for [--target NAME ...] [--model NAME ...] [--steps decode] [--kernels auto] --out DIR

For each target and model, ``python -m ess_jax.plan`` gives the batch for the target's memory
(``--gpu-mem-gb`` its HBM, ``--tpu`` on a TPU, the engine's formats; V4's indexer keys in FP8), and
``python -m ess_jax.export --compile`` compiles the model at that batch in a process of its own (8 CPU devices to
trace on) and writes ``DIR/TARGET_MODEL/summary.json``; a model whose weights leave no request room is a row that
says so, with the compiler's verdict at one request. The table
(``DIR/compiled_for.md``, also printed) gives per row the steps that compile and fit, the arguments and
temporaries per device (GiB) against the planner's, the collectives per step, the roofline time (the slower of
FLOPs over the peak and bytes over the bandwidth: XLA:TPU's own count; for XLA:GPU, whose compile-only client reports
none, ``aot.HostKindsCompiled.cost_analysis``) and the kernels. Exit 2 when a compile fails to run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ess_jax import aot, cli, plan

DEVICES = 8
MODELS = ("deepseek-v3.2", "deepseek-v4-flash")
CONTEXT, POOL_RATIO = 32768, 0.2


def served(model: str) -> list[str]:
    """The flags the planner and the engine share: FP8 entries (V4: and FP8 indexer keys), experts over 8 devices."""
    return ["--cache-dtype", "fp8", "--mesh", f"expert={DEVICES}"] + (["--index-dtype", "fp8"] if "v4" in model else [])


def planned(target: aot.Spec, model: str) -> dict:
    """The planner's row for ``model`` on 8 of ``target`` (its batch and bytes per device), or its refusal."""
    args = plan.parse_args(["--model", model, "--context", str(CONTEXT), "--pool-ratio", str(POOL_RATIO), "--rings",
                            "host", "--gpu-mem-gb", str(target.hbm_bytes / plan.GB)] + served(model)
                           + (["--tpu"] if target.platform == "tpu" else []))
    try:
        result = plan.plan(args)
    except ValueError as e:  # the weights alone fill the device
        return {"refused": str(e).removeprefix(f"{model}: ")}
    row, budget = result["rows"][0], result["models"][0]["budget"]
    return {"batch": row["max_batch_offload"], "weights": budget["weights_bytes_per_device"],
            "cache": row["max_batch_offload"] * row["device_bytes_per_request"],
            "temporaries": row["temporaries_bytes_per_device"]}


def compile_row(target: aot.Spec, model: str, batch: int, steps: str, kernels: str, out: Path) -> dict:
    """``python -m ess_jax.export --compile`` of ``model`` at ``batch`` for 8 of ``target``: its summary."""
    argv = [sys.executable, "-m", "ess_jax.export", "--compile", "--target", target.name, "--model", model,
            "--weights", "release", "--dtype", "bfloat16", "--offload", "ess", "--pool-ratio", str(POOL_RATIO),
            "--kernels", kernels, "--max-batch", str(batch), "--max-seq-len", str(CONTEXT), "--steps", steps,
            "--out", str(out)] + served(model)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    summary = out / "summary.json"
    summary.unlink(missing_ok=True)
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if not summary.exists():  # it did not run to a summary (a step that does not compile writes none)
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(summary.read_text())


def reason(error: str) -> str:
    """The compiler's message without the exception's name and the module's (``RESOURCE_EXHAUSTED: ...``)."""
    return error.split(": ", 1)[-1].split(". HLO module")[0][:200]


def batch_of(plan_row: dict) -> int:
    """The batch compiled: the planner's, or one request where the weights leave it none (the compiler's verdict)."""
    return plan_row.get("batch") or 1


def row(target: aot.Spec, model: str, plan_row: dict, summary: dict) -> list[str]:
    gib = aot.GIB
    name = f"{target.name} x {DEVICES}"
    if "refused" in plan_row:
        batch, planned_bytes, verdict = "- (compiled: 1)", "-", f"no: {plan_row['refused']}"
    else:
        planned_bytes = f"{(plan_row['weights'] + plan_row['cache']) / gib:.2f} / {plan_row['temporaries'] / gib:.2f}"
        batch, verdict = str(plan_row["batch"]), ""
        if plan_row["batch"] == 0:
            batch, verdict = "0 (compiled: 1)", "no: no request fits beside the weights"
    if "error" in summary:
        return [name, model, batch, f"no: {summary['error']}", "-", planned_bytes, "-", "-"]
    steps = summary["steps"]
    ok = [n for n, s in steps.items() if s["compiled"] and s["fits"]]
    compiled_verdict = ", ".join(ok) if len(ok) == len(steps) else (
        f"{', '.join(ok) or 'none'} of {len(steps)}: " + "; ".join(
            f"{n} does not fit" if s["compiled"] else f"{n} does not compile ({reason(s['error'])})"
            for n, s in steps.items() if n not in ok))
    verdict = f"{verdict}; the compiler at 1 request: {compiled_verdict}" if verdict else compiled_verdict
    decode = steps.get("decode") or next(iter(steps.values()))
    if not decode["compiled"]:
        return [name, model, batch, verdict, "-", planned_bytes, "-", "-"]
    memory = decode.get("bytes_per_device")
    compiled = f"{memory['arguments'] / gib:.2f} / {memory['temporaries'] / gib:.2f}" if memory else "-"
    collectives = ", ".join(f"{k} x{v['count']}" for k, v in decode.get("collectives", {}).items()) or "none"
    roofline = f"{decode['roofline_s'] * 1e3:.1f} ms" if decode.get("roofline_s") else "-"
    calls = ", ".join(decode.get("custom_calls", {})) or "none"
    return [name, model, batch, verdict, compiled, planned_bytes, collectives,
            f"{roofline}; kernels {summary['kernels']} ({calls})"]


HEADER = ["target", "model", "batch (plan)", "compiles and fits", "decode GiB/device: arguments / temporaries",
          "planned", "collectives per decode step", "roofline; kernels (custom calls)"]


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def parse_args(argv: list[str] | None):
    p = cli.Parser("python -m ess_jax.compiled_for", __doc__, compile_cache=False)
    p.add_argument("--target", action="append", choices=list(aot.SPECS),
                   help=f"repeatable; default every target ({', '.join(aot.SPECS)})")
    p.add_argument("--model", action="append", help=f"repeatable; default {', '.join(MODELS)}")
    p.add_argument("--steps", default="decode", metavar="NAME,...", help="the steps compiled (default decode)")
    p.add_argument("--kernels", default="auto", help="the engine's --kernels (default auto: the target's own)")
    p.add_argument("--out", type=Path, required=True, help="directory for the summaries and compiled_for.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, failed = [], False
    for name in args.target or list(aot.SPECS):
        target = aot.spec(name)
        for model in args.model or list(MODELS):
            plan_row = planned(target, model)
            summary = compile_row(target, model, batch_of(plan_row), args.steps, args.kernels,
                                  args.out / f"{name}_{model}")
            failed |= "error" in summary
            rows.append(row(target, model, plan_row, summary))
            print(" | ".join(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compiled_for.md").write_text(markdown(rows))
    print(markdown(rows))
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

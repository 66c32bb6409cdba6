"""``--peer hf``: transformers' ``generate`` timed on the same weights and prompts (``run_peer``), in this Python
or in another interpreter (``--peer-python``), and compared with the resident run (``compare``).

``Stamps``, ``rate`` and ``hf_generate_timing`` use only torch / transformers and the standard library modules
imported here: their source is what runs in the other interpreter."""

from __future__ import annotations

import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


class Stamps:
    """transformers' streamer protocol: ``put()`` per hand-over (the prompt, then each new token), ``end()`` once;
    the time of each hand-over."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def rate(tokens: int, seconds: list[float]) -> tuple[float | None, str | None]:
    """``tokens`` per second of the median of ``seconds``, or None and why: an interval that is not positive, or
    repetitions spread wider than their median."""
    median = statistics.median(seconds)
    if tokens < 1 or min(seconds) <= 0:
        return None, f"an interval of {min(seconds):.3g} s for {tokens} tokens"
    if max(seconds) - min(seconds) > median:
        return None, f"repetitions spread {min(seconds):.3g}-{max(seconds):.3g} s around a median of {median:.3g} s"
    return tokens / median, None


def hf_generate_timing(checkpoint: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Time transformers' greedy ``generate`` (no eos) on ``prompts`` from ``checkpoint``, per token: a
    streamer stamps the prompt's hand-over and every new token, so prefill is the time to the first new
    token and decode the time from it to the last, per repetition (medians over ``repeats``). A rate
    whose interval is not positive, or whose repetitions spread wider than their median, is reported
    as unmeasured (None) with the reason (``rate``)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)
    prefill, decode, outputs = [], [], None
    for _ in range(repeats):
        stamps, start = Stamps(), time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, streamer=stamps)
        outputs = out[:, ids.shape[1]:].tolist()
        first, last = stamps.times[1], stamps.times[-1]  # times[0]: the prompt handed over
        prefill.append(first - start)
        decode.append(last - first)
    decode_rate, decode_why = rate(ids.shape[0] * (new_tokens - 1), decode)
    prefill_rate, prefill_why = rate(ids.numel(), prefill)
    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "prefill_s": prefill, "decode_s": decode, "prefill_tokens_per_s": prefill_rate,
            "decode_tokens_per_s": decode_rate,
            "unmeasured": {k: v for k, v in (("decode", decode_why), ("prefill", prefill_why)) if v},
            "output_ids": outputs}


def in_other_python(python: str, call: dict) -> dict:
    """``hf_generate_timing(**call)`` run by the interpreter ``python``; on failure ``available`` False and why."""
    script = "\n".join(["import json, statistics, sys, time"]
                       + [inspect.getsource(f) for f in (Stamps, rate, hf_generate_timing)]
                       + ["print(json.dumps(hf_generate_timing(**json.loads(sys.stdin.read()))))"])
    proc = subprocess.run([python, "-c", script], input=json.dumps(call), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"available": False, "reason": f"{python} failed: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_peer(model, model_name: str, prompts: list[list[int]], args, log) -> dict:
    """``--peer hf``: the transformers timing, in this Python or through ``--peer-python``; a preset's random
    weights are saved for transformers under ``--out`` first."""
    from importlib.util import find_spec

    in_process = find_spec("torch") is not None and find_spec("transformers") is not None
    if not in_process and args.peer_python is None:
        return {"available": False, "reason": "torch and transformers are not importable in this Python; pass "
                                              "--peer-python /path/to/python that has them"}
    from ess_jax import checkpoint as checkpoints
    from ess_jax.config import resolve_model

    source = resolve_model(model_name)
    checkpoint = source.checkpoint or checkpoints.save(model.params, source.raw_config(),
                                                       Path(args.out) / f"hf-{model_name}")
    log(f"peer: transformers generate on {checkpoint} ({'in process' if in_process else args.peer_python})")
    call = dict(checkpoint=str(checkpoint), prompts=prompts, new_tokens=args.new_tokens, repeats=args.repeats)
    result = hf_generate_timing(**call) if in_process else in_other_python(args.peer_python, call)
    if result.get("available") is False:
        return result
    return dict(result, available=True, checkpoint=str(checkpoint), python=args.peer_python or sys.executable)


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(peer: dict, resident: dict) -> None:
    """The resident run's rates as multiples of the peer's, and how many of the peer's greedy tokens it agrees
    on (the leading ones, per request), into ``peer``."""
    for kind in ("decode", "prefill"):
        per_s = peer[f"{kind}_tokens_per_s"]
        peer[f"{kind}_ratio"] = None if per_s is None else resident[f"{kind}_tokens_per_s"] / per_s
    peer.update(tokens_agree=sum(agreeing_prefix(a, b) for a, b in zip(resident["output_ids"], peer["output_ids"])),
                tokens_compared=sum(len(o) for o in peer["output_ids"]))

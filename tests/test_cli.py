"""``python -m ess_jax.generate``: JSON output and one-line errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v32-a"


def run(*args):
    return subprocess.run([sys.executable, "-m", "ess_jax.generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_json_output_follows_schema_and_matches_transformers():
    ref = np.load(FIXTURE / "reference.npz")
    prompt = ref["prompt_0"].tolist()
    proc = run("--model", str(FIXTURE), "--prompt-ids", ",".join(map(str, prompt)), "--prompt", "hi",
               "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["family"] == "deepseek_v32"
    assert out["offload"] == {"mode": "ess", "pool_size": 17, "fetch": "inline"}  # default: ratio 0.2 -> top_k + 1
    first, second = out["requests"]
    assert first["prompt_ids"] == prompt
    assert first["output_ids"] == ref["generate_0"][len(prompt):len(prompt) + 8].tolist()
    assert first["finish_reason"] in ("length", "stop") and isinstance(first["text"], str)
    assert second["prompt_ids"] == [256, ord("h"), ord("i")]  # byte-level tokens after bos
    metrics = out["metrics"]
    assert metrics["prefill_tokens"] == len(prompt) + 3
    assert metrics["decode_tokens"] >= 0 and metrics["wall_s"] > 0 and metrics["decode_tokens_per_s"] >= 0
    assert set(metrics["cache"]) >= {"device_bytes", "host_bytes", "resident_device_bytes"}
    offload = metrics["offload"]
    assert set(offload) >= {"lookups", "hits", "misses", "hit_rate", "h2d_bytes", "d2h_bytes", "per_layer"}
    assert [layer["layer"] for layer in offload["per_layer"]] == [0, 1, 2]
    assert offload["hits"] + offload["misses"] == offload["lookups"] > 0


def test_offload_none_matches_ess_tokens():
    args = ["--model", str(FIXTURE), "--prompt-ids", ",".join(map(str, range(60))), "--max-new-tokens", "6", "--json"]
    ess = json.loads(run(*args, "--pool-size", "17", "--fetch", "split").stdout)
    none = json.loads(run(*args, "--offload", "none").stdout)
    assert ess["requests"][0]["output_ids"] == none["requests"][0]["output_ids"]
    assert none["offload"] == {"mode": "none", "pool_size": None, "fetch": "none"} and none["metrics"]["offload"] is None


@pytest.mark.parametrize("args, needle", [
    (["--prompt", ""], "empty"),
    (["--prompt-ids", "1,2,x"], "not a comma-separated list"),
    (["--model", "no-such-model", "--prompt", "a"], "neither a preset"),
    (["--prompt-ids", "1,2,99999"], "outside the vocabulary"),
    (["--prompt-ids", ",".join(["1"] * 17000)], "max_position_embeddings"),
    ([], "no prompt"),
    (["--prompt", "a", "--pool-size", "3"], "below the minimum"),
    (["--prompt", "a", "--fetch", "uva"], "invalid choice"),
    (["--prompt", "a", "--host-cache-mb", "0.001"], "--host-cache-mb"),
])
def test_bad_input_exits_with_one_line_error(args, needle):
    proc = run(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr

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
    assert out["family"] == "deepseek_v32" and out["offload"]["mode"] == "none"
    first, second = out["requests"]
    assert first["prompt_ids"] == prompt
    assert first["output_ids"] == ref["generate_0"][len(prompt):len(prompt) + 8].tolist()
    assert first["finish_reason"] in ("length", "stop") and isinstance(first["text"], str)
    assert second["prompt_ids"] == [256, ord("h"), ord("i")]  # byte-level tokens after bos
    metrics = out["metrics"]
    assert metrics["prefill_tokens"] == len(prompt) + 3
    assert metrics["decode_tokens"] >= 0 and metrics["wall_s"] > 0


@pytest.mark.parametrize("args, needle", [
    (["--prompt", ""], "empty"),
    (["--prompt-ids", "1,2,x"], "not a comma-separated list"),
    (["--model", "no-such-model", "--prompt", "a"], "neither a preset"),
    (["--prompt-ids", "1,2,99999"], "outside the vocabulary"),
    (["--prompt-ids", ",".join(["1"] * 17000)], "max_position_embeddings"),
    ([], "no prompt"),
])
def test_bad_input_exits_with_one_line_error(args, needle):
    proc = run(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr

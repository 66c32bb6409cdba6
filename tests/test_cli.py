"""``python -m ess_jax.generate``: JSON output and one-line errors for bad input; the engine flags made from
``EngineConfig``'s fields."""

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ess_jax import cli as engine_cli
from ess_jax.engine import EngineConfig

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v32-a"
REF = np.load(FIXTURE / "reference.npz")
PROMPT = REF["prompt_0"].tolist()

JSON_ARGS = ["--model", str(FIXTURE), "--prompt-ids", ",".join(map(str, PROMPT)), "--prompt", "hi",
             "--max-new-tokens", "8", "--json"]
SAME_ARGS = ["--model", str(FIXTURE), "--prompt-ids", ",".join(map(str, range(64))), "--max-new-tokens", "6", "--json"]
ESS_ARGS, NONE_ARGS = SAME_ARGS + ["--pool-size", "17", "--fetch", "split"], SAME_ARGS + ["--offload", "none"]
BAD_INPUT = [
    (["--prompt", ""], "empty"),
    (["--prompt-ids", "1,2,x"], "not a comma-separated list"),
    (["--model", "no-such-model", "--prompt", "a"], "neither a shipped checkpoint"),
    (["--prompt-ids", "1,2,99999"], "outside the vocabulary"),
    (["--prompt-ids", ",".join(["1"] * 17000)], "max_position_embeddings"),
    ([], "no prompt"),
    (["--prompt", "a", "--pool-size", "3"], "below the minimum"),
    (["--prompt", "a", "--fetch", "uva"], "invalid choice"),
    (["--prompt", "a", "--host-cache-mb", "0.001"], "--host-cache-mb"),
]

# Runs ``python -m ess_jax.generate`` once per argument list (read as JSON from stdin) in one interpreter,
# each with its own file descriptors 1 and 2, and prints their exit status, stdout and stderr as JSON.
DRIVER = r"""
import json, os, runpy, sys, tempfile, traceback

def run(argv):
    sys.argv = ["ess_jax.generate", *argv]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            runpy.run_module("ess_jax.generate", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out.seek(0), err.seek(0)
        return {"returncode": code or 0, "stdout": out.read().decode(), "stderr": err.read().decode()}

cases = json.loads(sys.stdin.read())
print(json.dumps([run(argv) for argv in cases]))
"""


@pytest.fixture(scope="module")
def cli():
    """``cli(*args)``: the exit status, stdout and stderr of ``python -m ess_jax.generate *args``; every
    invocation of this module runs in one subprocess (one jax import)."""
    cases = [JSON_ARGS, ESS_ARGS, NONE_ARGS] + [args for args, _ in BAD_INPUT]
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert len(results) == len(cases)
    return lambda *args: SimpleNamespace(**results[cases.index(list(args))])


def test_json_output_follows_schema_and_matches_transformers(cli):
    proc = cli(*JSON_ARGS)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["family"] == "deepseek_v32"
    assert out["offload"] == {"mode": "ess", "pool_size": 17, "fetch": "inline"}  # default: ratio 0.2 -> top_k + 1
    first, second = out["requests"]
    assert first["prompt_ids"] == PROMPT
    assert first["output_ids"] == REF["generate_0"][len(PROMPT):len(PROMPT) + 8].tolist()
    assert first["finish_reason"] in ("length", "stop") and isinstance(first["text"], str)
    assert second["prompt_ids"] == [256, ord("h"), ord("i")]  # byte-level tokens after bos
    metrics = out["metrics"]
    assert metrics["prefill_tokens"] == len(PROMPT) + 3
    assert metrics["decode_tokens"] >= 0 and metrics["wall_s"] > 0 and metrics["decode_tokens_per_s"] >= 0
    assert set(metrics["cache"]) >= {"device_bytes", "host_bytes", "resident_device_bytes"}
    offload = metrics["offload"]
    assert set(offload) >= {"lookups", "hits", "misses", "hit_rate", "h2d_bytes", "d2h_bytes", "per_layer"}
    assert [layer["layer"] for layer in offload["per_layer"]] == [0, 1, 2]
    assert offload["hits"] + offload["misses"] == offload["lookups"] > 0


def test_offload_none_matches_ess_tokens(cli):
    ess, none = (json.loads(cli(*args).stdout) for args in (ESS_ARGS, NONE_ARGS))
    assert ess["requests"][0]["output_ids"] == none["requests"][0]["output_ids"]
    assert ess["offload"] == {"mode": "ess", "pool_size": 17, "fetch": "split"}
    assert ess["metrics"]["offload"]["misses"] > 0
    assert none["offload"] == {"mode": "none", "pool_size": None, "fetch": "none"}
    assert none["metrics"]["offload"] is None


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input_exits_with_one_line_error(cli, args, needle):
    proc = cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_engine_config_field_has_a_flag_that_reaches_it():
    """One flag per EngineConfig field (``keep_logits``, the API's alone, has none), beside the model's three; a
    value other than the default for each flag lands in its field through ``flags_config``."""
    parser = argparse.ArgumentParser()
    engine_cli.add_engine_flags(parser)
    dests = {action.dest for action in parser._actions} - {"help"}
    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    assert fields - dests == {"keep_logits"}
    assert dests - fields == {"dtype", "weights", "weights_seed"}
    values = dict(offload="ess", pool_size=33, pool_ratio=0.5, fetch="split", miss_budget=0.5, host_cache_mb=64.0,
                  rings="device", max_batch=4, page_size=16, num_pages=40, max_seq_len=128, prefix_cache=True,
                  prefix_cache_dir="dir", prefix_cache_disk_gb=2.0, prefix_cache_states=3, prefill_chunk=64,
                  speculative="mtp", num_speculative_tokens=2, kernels="pallas", cache_dtype="fp8",
                  index_dtype="fp4", mesh="data=2")
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in values.items() if name != "prefix_cache"]
    config = engine_cli.flags_config(parser.parse_args(argv))
    assert config == EngineConfig(**values)
    other = engine_cli.flags_config(parser.parse_args(["--offload", "none", "--no-prefix-cache"]))
    assert (other.offload, other.prefix_cache) == ("none", False)
    default = engine_cli.flags_config(parser.parse_args([]))
    assert [name for name in values if getattr(config, name) == getattr(default, name)] == ["offload",
                                                                                             "prefix_cache"]

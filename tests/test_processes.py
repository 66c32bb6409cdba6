"""Several processes (ess_jax.mesh.Processes): two real processes of 4 simulated CPU devices each, joined
through jax.distributed on 127.0.0.1 (gloo collectives), run the same ``python -m ess_jax.generate`` command on
a data=2,expert=4 mesh over all 8 devices and print the tokens one process gives; the flags' errors."""

import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
generate_cli = importlib.import_module("ess_jax.generate")  # ess_jax.generate is also the API function

# three prompts on two batch rows (one per data shard): the third waits and joins when a row frees, and they
# leave at different steps; ESS with a pool smaller than a request, so the tier fetches from the host store
PROMPTS = ["--prompt-ids", "3,1,4,1,5,9,2,6,5,3,5,8,9,7,9,3", "--prompt-ids", ",".join(str(7 * i % 256) for i in range(32)),
           "--prompt-ids", "2,7,1,8,2,8,1,8"]
FLAGS = ["--model", str(FIXTURES / "hf-v32-a"), *PROMPTS, "--max-new-tokens", "8", "--max-batch", "2",
         "--page-size", "8", "--prefill-chunk", "16", "--max-seq-len", "48", "--offload", "ess", "--pool-size", "17",
         "--json", "--compile-cache", "none"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_one_process_tokens(capsys):
    assert generate_cli.main(FLAGS) == 0
    alone = json.loads(capsys.readouterr().out)
    # 4 CPU devices a process; LLVM's cheaper passes halve the compile time
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4 "
               "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    command = [sys.executable, "-m", "ess_jax.generate", *FLAGS, "--mesh", "data=2,expert=4", "--num-processes", "2",
               "--coordinator", f"127.0.0.1:{_free_port()}"]
    procs = [subprocess.Popen([*command, "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert outs[1][0] == ""  # process 0 alone prints
    both = json.loads(outs[0][0])
    assert [r["output_ids"] for r in both["requests"]] == [r["output_ids"] for r in alone["requests"]]
    assert [len(r["output_ids"]) for r in alone["requests"]] == [8, 8, 8]
    # the tier served misses from the host store in both runs, and counted them alike
    assert both["metrics"]["offload"]["misses"] == alone["metrics"]["offload"]["misses"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "2", "--process-id", "0"], "--num-processes 2 needs --coordinator HOST:PORT"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"], r"--process-id 2 must be an integer in \[0, 2\)"),
    (["--num-processes", "0"], "--num-processes 0 must be an integer >= 1"),
    (["--num-processes", "2", "--process-id", "1", "--coordinator", "127.0.0.1:1"], "--num-processes 2 needs --mesh"),
    (["--num-processes", "2", "--coordinator", "127.0.0.1:1", "--mesh", "data=2", "--offload", "ess", "--fetch", "split"],
     "--fetch split keeps the host store in one process's NumPy memory"),
])
def test_bad_process_flags_are_refused_before_anything_starts(capsys, flags, message):
    import re

    assert generate_cli.main(["--model", "tiny-v32", "--prompt", "a", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert re.match(f"error: {message}", err) and len(err.splitlines()) == 1, err

"""Several processes (ess_jax.mesh.Processes): two real processes of 4 simulated CPU devices each, joined
through jax.distributed on 127.0.0.1 (gloo collectives), on an expert=8 mesh over all 8 devices: each reads
from the checkpoint only the routed experts its devices hold, and both decode the tokens one process gives;
the flags' errors. (``serve`` over two processes, ESS on data=2,expert=4 through the CLI:
tests/test_serve_processes.py.)"""

import importlib
import json
import sys
from pathlib import Path

import pytest

from helpers import free_port, outputs, spawn

FIXTURES = Path(__file__).parent / "fixtures"
generate_cli = importlib.import_module("ess_jax.generate")  # ess_jax.generate is also the API function

# Each of two processes: joins the run (argv: coordinator, process id), loads the checkpoint (argv[3]) onto an
# expert=8 mesh over the 8 devices of both, recording the routed experts it reads (SafetensorsFile.get wrapped)
# and those its 4 devices hold, and decodes the prompts (argv[4]) on that mesh.
SHARDED_LOAD = r"""
import json, re, sys
from ess_jax import mesh

mesh.start(mesh.Processes(2, int(sys.argv[2]), sys.argv[1]))
import jax
import ess_jax
from ess_jax.checkpoint import SafetensorsFile
from ess_jax.engine import EngineConfig

read = set()
get = SafetensorsFile.get


def recording(self, name, rows=None):
    expert = re.search(r"\.experts\.(\d+)\.", name)
    if expert:
        read.add(int(expert.group(1)))
    return get(self, name, rows)


SafetensorsFile.get = recording
model = ess_jax.load_model(sys.argv[3], mesh="expert=8")
held = set()
for path, x in jax.tree_util.tree_leaves_with_path(model.params):
    if "['experts']" in jax.tree_util.keystr(path):
        held |= {e for shard in x.addressable_shards for e in range(*shard.index[x.ndim - 3].indices(8)[:2])}
result = ess_jax.generate(model, json.loads(sys.argv[4]), 4, ignore_eos=True,
                          engine=EngineConfig(max_batch=2, page_size=8, prefill_chunk=16, mesh="expert=8"))
print(json.dumps({"read": sorted(read), "held": sorted(held), "tokens": result.output_ids}))
"""


def test_each_process_reads_only_the_experts_it_holds():
    """On an expert=8 mesh spanning both processes, each process reads from the checkpoint (the release's
    per-expert tensors) only the routed experts its devices hold, half of them, the two halves all of them;
    and both decode the tokens one process gives on one device."""
    import ess_jax
    from ess_jax.engine import EngineConfig

    fixture = FIXTURES / "hf-v32-a"
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [7 * i % 256 for i in range(16)]]
    alone = ess_jax.generate(ess_jax.load_model(fixture), prompts, 4, ignore_eos=True,
                             engine=EngineConfig(max_batch=2, page_size=8, prefill_chunk=16)).output_ids
    command = [sys.executable, "-c", SHARDED_LOAD, f"127.0.0.1:{free_port()}"]
    outs = outputs(spawn([[*command, str(i), str(fixture), json.dumps(prompts)] for i in range(2)]))
    got = [json.loads(out.splitlines()[-1]) for out in outs]
    for g in got:
        assert g["read"] == g["held"] and len(g["held"]) == 4, g
        assert g["tokens"] == alone
    assert sorted(got[0]["held"] + got[1]["held"]) == list(range(8))
    assert [len(t) for t in alone] == [4, 4] and alone[0] != alone[1]


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "2", "--process-id", "0"], "--num-processes 2 needs --coordinator HOST:PORT"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"],
     r"--process-id 2 must be an integer in \[0, 2\)"),
    (["--num-processes", "0"], "--num-processes 0 must be an integer >= 1"),
    (["--num-processes", "2", "--process-id", "1", "--coordinator", "127.0.0.1:1"], "--num-processes 2 needs --mesh"),
    (["--num-processes", "2", "--coordinator", "127.0.0.1:1", "--mesh", "data=2", "--offload", "ess",
      "--fetch", "split"],
     "--fetch split keeps the host store in one process's NumPy memory"),
])
def test_bad_process_flags_are_refused_before_anything_starts(capsys, flags, message):
    import re

    assert generate_cli.main(["--model", "tiny-v32", "--prompt", "a", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert re.match(f"error: {message}", err) and len(err.splitlines()) == 1, err

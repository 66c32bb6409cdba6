"""Sharded loading (``load_model(..., mesh=...)``: ``checkpoint.load_into`` with a mesh) on 8 simulated CPU
devices (a subprocess: the device count is fixed before jax starts). Each parameter is made in its
``param_spec`` sharding and equals the one-device load bitwise; the reads, recorded by wrapping
``SafetensorsFile.get``, take every routed expert range once (a packed tensor's rows, or the experts' own
tensors), never a packed experts tensor whole, even where ``data`` replicas hold the same range, and every
other tensor once. Checkpoints: the fixtures' per-expert names, transformers 5's packed experts
(``checkpoint.save``) and the releases' formats (FP8 with block scales, V4's FP4 experts;
test_release_weights' writer)."""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import ess_jax
from ess_jax import checkpoint, mesh
from test_release_weights import FINE, _weights, _write_release

FIXTURES = Path(__file__).parent / "fixtures"
PACKED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")  # transformers 5: all experts in one [E, ...] tensor
PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # the releases: one tensor (and its scales) per expert

# argv[1]: JSON list of [checkpoint, weights, mesh]. Loads each on one device and on the mesh, and prints per
# case the reads of the mesh's load ([tensor, [r0, r1] or None]), the leaves that differ from the one-device
# load or are not in param_spec's sharding, and whether place_params (the engine's) keeps them as they are.
SCRIPT = r"""
import json, sys
import jax, numpy as np
from jax.sharding import NamedSharding
import ess_jax
from ess_jax import mesh
from ess_jax.checkpoint import SafetensorsFile

reads = []
get = SafetensorsFile.get


def recording(self, name, rows=None):
    reads.append([name, None if rows is None else [rows.start, rows.stop]])
    return get(self, name, rows)


SafetensorsFile.get = recording
out = []
for directory, weights, spec in json.loads(sys.argv[1]):
    alone = ess_jax.load_model(directory, weights=weights)
    reads.clear()
    try:
        model = ess_jax.load_model(directory, weights=weights, mesh=spec)
    except ValueError as e:
        out.append({"error": str(e), "reads": reads[:]})
        continue
    on = mesh.make(mesh.parse(spec))
    got = {"reads": reads[:], "differ": [], "misplaced": [], "sharded": 0,
           "structure": jax.tree.structure(model.params) == jax.tree.structure(alone.params)}
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(model.params),
                                 jax.tree_util.tree_leaves_with_path(alone.params)):
        names = mesh.path_names(path)
        a, b = np.asarray(x), np.asarray(y)
        if (a.dtype, a.shape, a.tobytes()) != (b.dtype, b.shape, b.tobytes()):
            got["differ"].append(".".join(names))
        if x.sharding != NamedSharding(on, mesh.param_spec(names, x.shape)):
            got["misplaced"].append(".".join(names))
        got["sharded"] += not x.is_fully_replicated
    placed = mesh.place_params(model.params, on)
    got["kept"] = all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(model.params), strict=True))
    out.append(got)
print(json.dumps(out))
"""

CASES = [  # checkpoint (a fixture, or one written below), weights, mesh
    ("hf-v32-a", "dequantized", "expert=8"),  # per-expert float32 tensors; a stacked run of two MoE layers
    ("packed-v32", "dequantized", "data=2,expert=4"),  # rows of packed tensors, each range held by two devices
    ("packed-v4", "dequantized", "data=4,expert=2"),  # V4: one layer a parameter
    ("release-v32", "release", "expert=8"),  # FP8 values with float32 block scales, per expert
    ("release-v4", "release", "data=2,expert=4"),  # FP4 experts with ue8m0 scales, FP8 attention
    ("release-v4", "dequantized", "data=2,expert=4"),  # the same dequantized on the mesh
]
REFUSED = ("hf-v4-a", "dequantized", "expert=8")  # 4 routed experts do not divide over 8


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """Each case's (and REFUSED's) report from one 8-device subprocess, with its checkpoint directory."""
    root = tmp_path_factory.mktemp("sharded")
    directories = {f"hf-{family}-a": FIXTURES / f"hf-{family}-a" for family in ("v32", "v4")}
    for family in ("v32", "v4"):
        fixture = directories[f"hf-{family}-a"]
        raw = json.loads((fixture / "config.json").read_text())
        directories[f"packed-{family}"] = checkpoint.save(ess_jax.load_model(fixture).params, raw,
                                                          root / f"packed-{family}")
        model_type = {"v32": "deepseek_v32", "v4": "deepseek_v4"}[family]
        _write_release(*_weights(model_type), root / f"release-{family}", FINE)
        directories[f"release-{family}"] = root / f"release-{family}"
    cases = [(str(directories[name]), weights, spec) for name, weights, spec in [*CASES, REFUSED]]
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 " \
            "--xla_llvm_disable_expensive_passes=true"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [dict(report, directory=Path(directory))
            for report, (directory, _, _) in zip(json.loads(done.stdout.splitlines()[-1]), cases, strict=True)]


def _stored(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint directory by its stored name, with its shape."""
    files = [checkpoint.SafetensorsFile(path) for path in sorted(directory.glob("*.safetensors"))]
    return {name: f.shape(name) for f in files for name in f.keys()}


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(c) for c in CASES])
def test_sharded_load_equals_one_device_and_reads_each_expert_range_once(loads, case):
    report, spec = loads[case], mesh.parse(CASES[case][2])
    assert report["structure"] and report["differ"] == [] and report["misplaced"] == []
    assert report["sharded"] >= 2 and report["kept"]  # the routed experts are sharded; the engine keeps them
    stored = _stored(report["directory"])
    reads = Counter((name, rows and tuple(rows)) for name, rows in report["reads"])
    assert max(reads.values()) == 1, reads.most_common(1)  # no range read twice: replicas share what was read
    assert {name for name, _ in reads} == set(stored)  # every tensor read
    packed = per_expert = 0
    for name, shape in stored.items():
        ranges = sorted(rows for n, rows in reads if n == name)
        if PACKED.search(name):
            packed += 1
            step = shape[0] // spec.expert  # E / expert shards experts a read
            assert ranges == [(k * step, (k + 1) * step) for k in range(spec.expert)], name
        else:
            per_expert += bool(PER_EXPERT.search(name))
            assert ranges == [None], name  # a replicated tensor, or one expert's own: read whole, once
    assert packed if CASES[case][0].startswith("packed") else per_expert
    # a stacked run (V3.2's MoE layers) of per-expert tensors is read range by range: every layer's experts
    # of one device's range, then the next range's
    order = [tuple(map(int, m.groups())) for name, _ in report["reads"]
             if (m := re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight$", name))]
    if order:
        layers, step = sorted({layer for layer, _ in order}), len({e for _, e in order}) // spec.expert
        assert order == [(layer, e) for k in range(spec.expert) for layer in layers
                         for e in range(k * step, (k + 1) * step)]


def test_experts_that_do_not_divide_over_the_mesh_are_refused_before_any_read(loads):
    report = loads[-1]
    assert report["error"].startswith("--mesh expert=8 does not divide the model's 4 routed experts")
    assert report["reads"] == []

"""``python -m ess_jax.compiled_for``: the planner's batch per target, the rows of targets whose memory the weights
fill (compiled at one request for the compiler's verdict), and a compiled row read from a summary
``python -m ess_jax.export --compile`` wrote."""

import json
from pathlib import Path

from ess_jax import aot, compiled_for, plan

COMPILED = Path(__file__).parents[1] / "docs" / "results" / "compiled"


def test_targets_the_weights_fill_are_rows_that_say_so_with_the_compilers_verdict_at_one_request():
    planned = compiled_for.planned(aot.spec("v5e"), "deepseek-v3.2")
    assert planned == {"refused": "weights take 102.0 GB per device, more than 0.9 x 16.9 GB; raise --mesh "
                                  "expert=... or --gpu-mem-gb"}
    assert compiled_for.batch_of(planned) == 1
    summary = {"kernels": "auto", "steps": {"decode": {
        "compiled": False, "error": "JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. "
                                    "Used 95.51G of 15.75G hbm. HLO module: jit__decode."}}}
    cells = compiled_for.row(aot.spec("v5e"), "deepseek-v3.2", planned, summary)
    assert cells[:5] == ["v5e x 8", "deepseek-v3.2", "- (compiled: 1)",
                         "no: weights take 102.0 GB per device, more than 0.9 x 16.9 GB; raise --mesh expert=... or "
                         "--gpu-mem-gb; the compiler at 1 request: none of 1: decode does not compile "
                         "(RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 95.51G of 15.75G hbm)", "-"]
    assert cells[5:] == ["-", "-", "-"]  # nothing planned, nothing compiled
    # a batch of 0 (weights fit, no request beside them) is compiled at one request too
    empty = {"batch": 0, "weights": 90e9, "cache": 0, "temporaries": 1e9}
    assert compiled_for.batch_of(empty) == 1
    assert compiled_for.row(aot.spec("v5e"), "deepseek-v3.2", empty, summary)[2:4] == [
        "0 (compiled: 1)", "no: no request fits beside the weights; the compiler at 1 request: none of 1: decode "
        "does not compile (RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 95.51G of 15.75G hbm)"]


def test_the_batch_is_the_planners_for_the_targets_memory(capsys):
    h200 = aot.spec("H200")
    got = compiled_for.planned(h200, "deepseek-v4-flash")
    assert plan.main(["--model", "deepseek-v4-flash", "--cache-dtype", "fp8", "--index-dtype", "fp8", "--context",
                      "32768", "--pool-ratio", "0.2", "--mesh", "expert=8", "--gpu-mem-gb", str(h200.hbm_bytes / 1e9),
                      "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert got["batch"] == row["max_batch_offload"] > 0
    assert got["temporaries"] == row["temporaries_bytes_per_device"]


def test_a_compiled_row_reads_the_summary():
    summary = json.loads((COMPILED / "h200x8_v4flash_43_ess_fp8_index_fp8_release_bf16_b1489_decode.json").read_text())
    planned = {"batch": 1489, "weights": 28e9, "cache": 90e9, "temporaries": 8e9}
    cells = compiled_for.row(aot.spec("H200"), "deepseek-v4-flash", planned, summary)
    assert cells[:4] == ["H200 x 8", "deepseek-v4-flash", "1489", "decode"]
    assert cells[4] == "109.94 / 7.72" and cells[5] == f"{118e9 / 2**30:.2f} / {8e9 / 2**30:.2f}"
    assert cells[6] == "all-reduce f32[1489,4096] x43"
    summary["steps"]["decode"]["fits"] = False
    assert compiled_for.row(aot.spec("H200"), "deepseek-v4-flash", planned, summary)[3] == (
        "none of 1: decode does not fit")
    summary["steps"]["decode"] = {"compiled": False, "error": "JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory "
                                  "on HBM (130.49G). HLO module: jit__decode."}
    assert compiled_for.row(aot.spec("H200"), "deepseek-v4-flash", planned, summary)[3:5] == [
        "none of 1: decode does not compile (RESOURCE_EXHAUSTED: Ran out of memory on HBM (130.49G))", "-"]

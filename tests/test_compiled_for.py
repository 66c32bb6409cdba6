"""``python -m ess_jax.compiled_for``: the planner's batch per target, the rows of targets whose memory the weights
fill (nothing compiled), and a compiled row read from a summary ``python -m ess_jax.export --compile`` wrote."""

import json
from pathlib import Path

from ess_jax import aot, compiled_for, plan

COMPILED = Path(__file__).parents[1] / "docs" / "results" / "compiled"


def test_targets_the_weights_fill_are_rows_that_say_so(tmp_path, capsys):
    assert compiled_for.main(["--target", "v5e", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "compiled_for.md").read_text().splitlines()
    assert table[0].startswith("| target | model | batch (plan) |") and len(table) == 4
    refused = "no: weights take 102.0 GB per device, more than 0.9 x 16.9 GB"
    assert f"| v5e x 8 | deepseek-v3.2 | - | {refused}" in table[2]
    assert "| v5e x 8 | deepseek-v4-flash | - | no: weights take 28.1 GB" in table[3]
    assert [p.name for p in tmp_path.iterdir()] == ["compiled_for.md"]  # nothing compiled


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

"""The capacity planner's arithmetic against hand-computed values (DOMAIN.md 3-4) and its argument errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ess_jax import mesh, plan, tier
from ess_jax.config import preset_dict
from ess_jax.families import load_config

V32 = load_config(preset_dict("deepseek-v3.2"))
ESS = ["--model", "deepseek-v3.2", "--cache-dtype", "fp8", "--kv-budget-gb", "82", "--accounting", "paper"]


def run_json(argv, capsys) -> dict:
    assert plan.main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def rows_by(result, **key):
    return [r for r in result["rows"] if all(r[k] == v for k, v in key.items())]


def test_v32_rows_are_the_flashmla_formats():
    fp8 = {p.name: p for p in plan.cache_parts(V32, "fp8")}
    assert fp8["latent [c | k_rope]"].row_bytes == 512 + 4 * 4 + 64 * 2 == 656
    assert fp8["indexer key"].row_bytes == 128 + 4 == 132
    bf16 = {p.name: p.row_bytes for p in plan.cache_parts(V32, "bfloat16")}
    assert bf16 == {"latent [c | k_rope]": 1152, "indexer key": 256}
    assert {p.where for p in fp8.values()} == {"offloaded", "resident"}
    assert fp8["latent [c | k_rope]"].where == "offloaded"


def test_v32_fp8_bytes_per_token_and_the_ess_split(capsys):
    layout = run_json(ESS + ["--context", "32768", "--pool-ratio", "0.2"], capsys)["models"][0]["layouts"][0]
    assert layout["bytes_per_token"] == 61 * 788 == 48_068
    assert layout["offloaded_bytes_per_token"] == 40_016 and layout["resident_bytes_per_token"] == 8_052
    assert round(100 * layout["offloaded_fraction"], 1) == 83.2
    assert round(100 * (1 - layout["offloaded_fraction"]), 1) == 16.8


def test_ess_table2_baselines_and_offload_batches(capsys):
    # GB = 1e9: 52 x 32768 x 48068 B = 81.9e9 <= 82e9 < 53 x ...; 13 x 131072 x 48068 B = 81.9e9 likewise
    assert 52 * 32768 * 48068 == 81_904_795_648
    assert 53 * 32768 * 48068 > 82e9 and 14 * 131072 * 48068 > 82e9
    result = run_json(ESS + ["--context", "32768", "--context", "131072", "--pool-ratio", "0.21",
                             "--pool-ratio", "0.1"], capsys)
    by = {(r["context"], r["pool_ratio"]): r for r in result["rows"]}
    assert by[32768, 0.21]["max_batch_resident"] == 52
    assert by[131072, 0.1]["max_batch_resident"] == 13
    # 32K at ratio 0.21 (paper: 160): P = ceil(0.21 * 32768) = 6882 slots of 656 B in each of 61 layers,
    # plus every position's 132-byte indexer key
    device = 32768 * 8052 + 61 * 6882 * 656
    assert device == 539_238_048
    assert by[32768, 0.21]["pool_slots"] == 6882 and by[32768, 0.21]["device_bytes_per_request"] == device
    assert by[32768, 0.21]["max_batch_offload"] == 82_000_000_000 // device == 152
    # the same from DOMAIN's ratio formula B = B0 / (f + (1 - f) r) with the unfloored B0 and f = 8052 / 48068
    b0, f = 82e9 / (32768 * 48068), 8052 / 48068
    assert math.floor(b0 / (f + (1 - f) * 0.21)) == 152
    # 128K at ratio 0.1 (paper: 54): P = ceil(13107.2) = 13108
    device = 131072 * 8052 + 61 * 13108 * 656
    assert by[131072, 0.1]["max_batch_offload"] == 82_000_000_000 // device == 51
    # the host holds every latent row of every admitted request
    assert by[131072, 0.1]["host_bytes_per_device"] == 51 * 131072 * 40016


def test_ess_jax_accounting_adds_the_residency_map_and_slot_tables(capsys):
    argv = ["--model", "deepseek-v3.2", "--cache-dtype", "fp8", "--kv-budget-gb", "82", "--context", "32768",
            "--pool-ratio", "0.21"]
    row = run_json(argv, capsys)["rows"][0]
    # per layer: the map (4 B per entry), the slot tables (8 B per slot), the staged row, 4 int32 counters and 3
    # of the one query position; per request the staged row's page and offset
    device = 32768 * 8052 + 61 * 6882 * 656 + 61 * (32768 * 4 + 6882 * 8 + 656 + 16 + 12) + 8
    assert row["accounting"] == "ess_jax" and row["device_bytes_per_request"] == device
    assert row["max_batch_offload"] == 82_000_000_000 // device


def test_v4_bytes_per_token_match_domain(capsys):
    result = run_json(["--model", "deepseek-v4-flash", "--model", "deepseek-v4-pro", "--cache-dtype", "fp8",
                       "--kv-budget-gb", "80", "--context", "131072", "--pool-ratio", "0.2", "--formats", "release"],
                      capsys)
    flash, pro = (m["layouts"][0] for m in result["models"])
    # Flash: 21 CSA layers x (584 + 132) / 4 + 20 HCA layers x 584 / 128; Pro: 30 CSA + 31 HCA
    assert flash["bytes_per_token"] == 21 * (584 + 132) / 4 + 20 * 584 / 128 == 3850.25
    assert pro["bytes_per_token"] == 30 * (584 + 132) / 4 + 31 * 584 / 128 == 5511.4375
    assert flash["offloaded_bytes_per_token"] == 21 * 146
    parts = {p["name"]: p for p in flash["parts"]}
    assert parts["SWA window"]["layers"] * parts["SWA window"]["row_bytes"] == 43 * 128 * 584  # 3.07 MiB
    assert flash["fixed_bytes_per_request"] == 43 * 128 * 584 + 21 * (64 + 16) * 1024 + 20 * 512 * 1024
    fp4 = plan.cache_parts(load_config(preset_dict("deepseek-v4-flash")), "fp8", "fp4")
    assert sum(p.bytes_per_token() for p in fp4) == 21 * (146 + 17) + 20 * 584 / 128 == 3514.25
    # a 131072-token request: 32768 CSA entries per CSA layer, pool 0.2 of them
    row = result["rows"][0]
    assert row["pool_slots"] == math.ceil(0.2 * 32768)


def test_weights_per_device_from_the_release_formats():
    weights = plan.weight_bytes(V32)
    # 256 experts x 3 x 2048 x 7168 in 58 MoE layers, e4m3 plus one fp32 scale per 128 x 128 block
    routed = 58 * 256 * 3 * 2048 * 7168
    assert weights["routed"] == routed + 4 * routed // (128 * 128)
    assert 17e9 < weights["other"] < 21e9  # attention, dense / shared MLPs (FP8), embeddings (bf16)
    # on a mesh the routed experts split over expert; every other weight is on each device (data shards too)
    per_device = plan.weight_bytes(V32, mesh.MeshShape(data=2, expert=32))
    assert per_device == {"routed": weights["routed"] / 32, "other": weights["other"]}
    with pytest.raises(ValueError, match="--mesh expert=3 does not divide the model's 256 routed experts"):
        plan.weight_bytes(V32, mesh.MeshShape(expert=3))


def test_the_default_mesh_is_ess_ep32_or_what_divides_a_smaller_models_experts(capsys):
    result = run_json(["--model", "deepseek-v3.2", "--model", "tiny-v32", "--context", "1024", "--pool-ratio", "0.5",
                       "--cache-dtype", "fp8"], capsys)
    tiny = load_config(preset_dict("tiny-v32")).n_routed_experts
    assert tiny < 32 and 32 % tiny == 0
    assert [m["mesh"] for m in result["models"]] == ["data=1,expert=32", f"data=1,expert={tiny}"]
    assert result["models"][0]["budget"]["weights_bytes_per_device"] == sum(
        plan.weight_bytes(V32, mesh.MeshShape(expert=32)).values())
    # V4 routed experts are FP4: half a byte plus one ue8m0 per 32 values
    v4 = load_config(preset_dict("deepseek-v4-flash"))
    assert plan.param_bytes(v4, ("layers", 5, "mlp", "experts", "down_proj"), (256, 4096, 2048), 2) == (
        "routed", 256 * 4096 * 2048 * (0.5 + 1 / 32))


def test_data_shards_hold_their_own_requests(capsys):
    """ESS's setting on data=2: each data shard holds its own requests' whole cache (pages, pools, host store),
    so each shard serves one device's batch."""
    argv = ESS + ["--context", "32768", "--pool-ratio", "0.21", "--mesh", "data=2,expert=8"]
    result = run_json(argv, capsys)
    row = result["rows"][0]
    assert result["models"][0]["mesh"] == row["mesh"] == "data=2,expert=8"
    # resident: a shard's devices hold its requests' 32768 x 48068 bytes each
    assert row["max_batch_resident"] == 2 * (82_000_000_000 // (32768 * 48068)) == 2 * 52
    # offloaded: 32768 x 8052 B of indexer keys and 61 x 6882 x 656 B of pools per request of the shard
    assert row["max_batch_offload"] == 2 * (82_000_000_000 // (32768 * 8052 + 61 * 6882 * 656)) == 2 * 152
    # a shard's host store holds every offloaded row of its requests
    assert row["host_bytes_per_device"] == 152 * 32768 * 40016
    assert plan.bytes_per_device(1000, 4, 2) == 2 * 1000
    with pytest.raises(ValueError, match="3 requests do not divide over 2 data shards"):
        plan.bytes_per_device(1000, 3, 2)


COMPILED = Path(__file__).parents[1] / "docs" / "results" / "compiled"
# The memory analysis of the decode by XLA:GPU (8 x H200) and XLA:TPU (8 x v5p) (python -m ess_jax.export --compile,
# expert=8, release weights, ESS 0.2, FP8 entries, 32K; the summaries it wrote): the planner's temporaries within 7 %
# of the compiler's
STEP_COMPILES = ("h200x8_v4flash_5_ess_fp8_index_fp8_release_bf16_b812_decode.json",
                 "h200x8_v4flash_5_ess_fp8_index_fp8_release_bf16_b1624_decode.json",
                 "h200x8_v4flash_43_ess_fp8_index_fp8_release_bf16_b1489_decode.json",
                 "h200x8_v32_5_ess_fp8_release_bf16_b46_decode.json",
                 "h200x8_v32_5_ess_fp8_release_bf16_b184_decode.json",
                 "h200x8_v32_61_ess_fp8_release_bf16_b43_decode.json",
                 "v5px8_v4flash_43_ess_fp8_index_fp8_release_bf16_b901_decode.json")


@pytest.mark.parametrize("summary", STEP_COMPILES)
def test_step_temporaries_match_the_compilers(summary):
    compiled = json.loads((COMPILED / summary).read_text())
    engine, model = compiled["engine"], compiled["model"]
    name = {"deepseek_v32": "deepseek-v3.2", "deepseek_v4": "deepseek-v4-flash"}[model["family"]]
    cfg = load_config(preset_dict(name))
    parts = plan.cache_parts(cfg, engine["cache_dtype"], engine["index_dtype"] or "auto", "engine", model["dtype"])
    offloaded = next(p for p in parts if p.where == "offloaded")
    slots = tier.pool_slots(offloaded.entries(engine["max_seq_len"]), offloaded.topk, pool_ratio=engine["pool_ratio"])
    step = plan.step_bytes(cfg, parts, engine["max_seq_len"], model["dtype"], mesh.parse(engine["mesh"]),
                           compiled["target"]["platform"] == "tpu", slots)  # (on a TPU: the pool rows, as laid out)
    got = compiled["steps"]["decode"]["bytes_per_device"]["temporaries"]
    assert step.temporaries(engine["max_batch"]) == pytest.approx(got, rel=0.07)


def test_the_planners_batch_fits_the_compiled_v5p_decode_within_5_percent():
    """The planner's batch for V4-Flash on 8 x v5p (--tpu) is the batch the compiled decode was built at, and its
    bytes per device (weights, cache, temporaries) are within 5 % of XLA:TPU's arguments and temporaries."""
    compiled = json.loads((COMPILED / STEP_COMPILES[-1]).read_text())
    args = plan.parse_args(["--model", "deepseek-v4-flash", "--context", "32768", "--pool-ratio", "0.2", "--rings",
                            "host", "--cache-dtype", "fp8", "--index-dtype", "fp8", "--mesh", "expert=8", "--tpu",
                            "--gpu-mem-gb", str(compiled["target"]["hbm_bytes"] / plan.GB)])
    result = plan.plan(args)
    row, budget = result["rows"][0], result["models"][0]["budget"]
    assert row["max_batch_offload"] == compiled["engine"]["max_batch"]
    planned = (budget["weights_bytes_per_device"] + row["max_batch_offload"] * row["device_bytes_per_request"]
               + row["temporaries_bytes_per_device"])
    got = compiled["steps"]["decode"]["bytes_per_device"]
    assert planned == pytest.approx(got["arguments"] + got["temporaries"], rel=0.05)


def test_the_device_batch_leaves_room_for_the_steps_temporaries(capsys):
    """On a device's memory (no --kv-budget-gb) a batch's cache, the weights and its decode step's temporaries fit
    in --gpu-mem-gb x --mem-fraction, and one more data shard's requests would not."""
    result = run_json(["--model", "deepseek-v4-flash", "--cache-dtype", "fp8", "--index-dtype", "fp8", "--context",
                       "32768", "--pool-ratio", "0.2", "--mesh", "data=2,expert=4"], capsys)
    budget, row = result["models"][0]["budget"], result["rows"][0]
    v4 = load_config(preset_dict("deepseek-v4-flash"))
    step = plan.step_bytes(v4, plan.cache_parts(v4, "fp8", "fp8", "engine"), 32768, shape=mesh.MeshShape(2, 4))
    assert step.per_request == 8192 * (4 * 64 + 2 * 128) + 129280 * 10  # scores and keys of 8192 entries, logits
    assert step.experts == 64 * 3 * 2048 * 4096 * 2  # a layer's 64 held FP4 experts in bfloat16
    room = 141e9 * 0.9 - budget["weights_bytes_per_device"]
    for key, per_request in (("max_batch_offload", "device_bytes_per_request"),
                             ("max_batch_resident", "resident_bytes_per_request")):
        rows = row[key] // 2
        assert rows * row[per_request] + step.temporaries(rows) <= room
        assert (rows + 1) * row[per_request] + step.temporaries(rows + 1) > room
    assert row["temporaries_bytes_per_device"] == step.temporaries(row["max_batch_offload"] // 2)
    # a --kv-budget-gb is the cache's alone
    row = run_json(["--model", "deepseek-v4-flash", "--kv-budget-gb", "80", "--cache-dtype", "fp8", "--context",
                    "32768", "--pool-ratio", "0.2"], capsys)["rows"][0]
    assert row["temporaries_bytes_per_device"] is None
    assert row["max_batch_offload"] == 80_000_000_000 // row["device_bytes_per_request"]


def test_on_a_tpu_a_layers_keys_and_pool_rows_count_padded_to_lanes(capsys):
    """--tpu: per request the step also holds one layer's keys and pool rows padded to 128-byte lanes (an FP8 key
    132 -> 256 bytes; V4's 592-byte row 640, and 148 32-bit words 256), so the batch is smaller."""
    argv = ["--model", "deepseek-v4-flash", "--cache-dtype", "fp8", "--index-dtype", "fp8", "--context", "32768",
            "--pool-ratio", "0.2", "--mesh", "expert=8", "--gpu-mem-gb", "102.8"]
    gpu, tpu = run_json(argv, capsys)["rows"][0], run_json(argv + ["--tpu"], capsys)["rows"][0]
    v4 = load_config(preset_dict("deepseek-v4-flash"))
    parts = plan.cache_parts(v4, "fp8", "fp8", "engine")
    step = plan.step_bytes(v4, parts, 32768, shape=mesh.MeshShape(1, 8))
    assert plan.step_bytes(v4, parts, 32768, shape=mesh.MeshShape(1, 8), tpu=True).per_request \
        == step.per_request + 8192 * 256  # the CSA layers' 8192 keys of 132 bytes
    assert tpu["pool_slots"] == gpu["pool_slots"] == 1639
    assert plan.tpu_pool_bytes(parts, 1639) == 1639 * (640 + 4 * 256)
    assert tpu["temporaries_bytes_per_device"] == tpu["max_batch_offload"] * (
        step.per_request + 8192 * 256 + 1639 * (640 + 4 * 256))
    assert gpu["temporaries_bytes_per_device"] == step.temporaries(gpu["max_batch_offload"])
    assert tpu["max_batch_offload"] < gpu["max_batch_offload"]
    assert tpu["device_bytes_per_request"] == gpu["device_bytes_per_request"]  # the cache is the same


def test_text_output_names_the_budget_and_the_batches(capsys):
    assert plan.main(ESS + ["--context", "32768", "--pool-ratio", "0.21"]) == 0
    out = capsys.readouterr().out
    assert "KV budget 82.00 GB" in out and "48,068.00" in out and "83.25 %" in out
    assert out.rstrip().splitlines()[-1].split()[9:11] == ["52", "152"]


@pytest.mark.parametrize("argv,needle", [
    (["--context", "0"], "--context 0"),
    (["--pool-ratio", "1.5"], "--pool-ratio 1.5"),
    (["--kv-budget-gb", "-1"], "--kv-budget-gb"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--cache-dtype", "fp16"], "--cache-dtype"),
    (["--model", "deepseek-v3.2", "--context", "200000"], "max_position_embeddings"),
    (["--model", "deepseek-v3.2", "--gpu-mem-gb", "40", "--mesh", "expert=1"], "weights take"),
    (["--model", "deepseek-v3.2", "--gpu-mem-gb", "141", "--mesh", "expert=7"], "--mesh expert=7 does not divide"),
    (["--mesh", "tensor=2"], "tensor parallelism is not served"),
    (["--context", "abc"], "--context"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        code = plan.main(argv + (["--kv-budget-gb", "80"] if "--gpu-mem-gb" not in argv and "--kv-budget-gb" not in argv
                                 else []))
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and needle in err and err.count("\n") == 1


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "ess_jax.plan", "--pool-ratio", "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1
    assert proc.stdout == ""


@pytest.mark.parametrize("preset, cache_dtype, index_dtype, offload, spec, page", [
    ("deepseek-v3.2", "fp8", None, "ess", "data=4,expert=8", 128),
    ("deepseek-v3.2", "bfloat16", None, "none", "data=2,expert=16", 128),
    ("deepseek-v3.2", "bfloat16", "fp8", "ess", "data=4,expert=8", 64),
    ("deepseek-v4-flash", "bfloat16", None, "ess", "data=8,expert=4", 128),
    ("deepseek-v4-flash", "fp8", None, "ess", "data=8,expert=4", 64),  # a page of its own per 128-token HCA row
    ("deepseek-v4-flash", "fp8", "fp4", "ess", "data=8,expert=4", 128),
    ("deepseek-v4-pro", "fp8", None, "none", "data=4,expert=8", 128),
    ("deepseek-v4-pro", "bfloat16", "fp4", "none", "data=4,expert=8", 64),
])
def test_bytes_per_device_equal_the_sharded_engine_cache(preset, cache_dtype, index_dtype, offload, spec, page):
    """The real configs: the engine's decode cache built abstractly (jax.eval_shape) at 8 requests of 8192 tokens,
    sharded by the engine's rule (mesh.cache_shardings) over an abstract 32-device mesh, holds on each device the
    planner's bytes for its data shard's requests, in the formats the engine stores (``--formats engine``, the
    default: the engine's Parts) and whole pages of ``page`` tokens, plus its shard's null page."""

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AbstractMesh, AxisType

    from ess_jax import engine, families
    from ess_jax.engine.layout import MODE_SPECS

    cfg, shape = load_config(preset_dict(preset)), mesh.parse(spec)
    family = families.get(cfg.family)
    module = nnx.eval_shape(lambda: family.module_cls(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    batch, context = 8, 8192
    config = engine.EngineConfig(max_batch=batch, page_size=page, max_seq_len=context, offload=offload,
                                 pool_ratio=0.2, cache_dtype=cache_dtype, index_dtype=index_dtype, mesh=spec)
    layout = engine.cache_layout(cfg, config, "bfloat16")
    if index_dtype:  # the indexer keys at the planner's bytes for --index-dtype (68 / 132 at J = 128)
        key = next(p for p in layout.parts if "indexer key" in p.name)
        planned = next(p for p in plan.cache_parts(cfg, cache_dtype, index_dtype) if p.name == key.name)
        assert key.row_bytes == planned.row_bytes == {"fp4": 68, "fp8": 132}[index_dtype]
    assert layout.size.pages == shape.data * (1 + batch // shape.data * context // page)  # a pool per data shard
    decode_cache = MODE_SPECS[config.offload].decode_cache
    abstract = AbstractMesh((shape.data, shape.expert), mesh.AXES, axis_types=(AxisType.Auto,) * 2)
    cache, shardings = mesh.cache_shardings(lambda size: decode_cache(module, size, config, layout), layout.size,
                                            abstract)
    on_device = lambda x, s: math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize  # noqa: E731
    total = sum(jax.tree.leaves(jax.tree.map(on_device, cache, shardings)))
    # the host stores: the tier's and (V4, --rings host by default) the HCA rings'
    is_store = lambda x: isinstance(x, tier.HOST_STORES)  # noqa: E731
    stores = [x for x in jax.tree.leaves(cache, is_leaf=is_store) if is_store(x)]
    store_shardings = [x for x in jax.tree.leaves(shardings, is_leaf=is_store) if is_store(x)]
    host = sum(jax.tree.leaves(jax.tree.map(on_device, stores, store_shardings)))
    assert len(stores) == (0 if offload == "none" else 3 if cfg.family == "deepseek_v4" else 1)
    assert plan.cache_parts(cfg, cache_dtype, index_dtype or "auto", "engine") == layout.parts
    assert plan.PAGE_SIZE == engine.EngineConfig.page_size  # --page-size's default, the engine's
    request = plan.request_bytes(layout.parts, context, 0.2, page_size=page)
    # page 0 of each shard, its null page, is in every paged array: a page of each resident paged part and
    # (offloaded) of the host store
    paged = [p for p in layout.parts if p.tokens_per_row]
    part = layout.offloaded
    null = sum(p.page_bytes(page) for p in paged if offload == "none" or p is not part)
    if offload == "ess":
        assert host == batch // shape.data * request.host + part.page_bytes(page)
        assert layout.host_bytes == shape.data * host  # every data shard's store
        assert total - host == plan.bytes_per_device(request.device, batch, shape.data) + null
    else:
        assert total == plan.bytes_per_device(request.resident, batch, shape.data) + null

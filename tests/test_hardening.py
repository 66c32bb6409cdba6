"""Hardening (issue 16): malformed checkpoints, configs, flags and API calls are refused with one line that
names the file / tensor / field / flag, exit status 2 and no traceback, before anything compiles.

Corrupted copies of the fixtures go through ``python -m ess_jax.generate``'s ``main`` in this process (stderr
captured) and through the Python API. Flag errors are checked to come before the model loads (``load_model``
is replaced by a function that fails the test). No test here compiles a step.
"""

import contextlib
import importlib
import io
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import ess_jax
from ess_jax import families
from ess_jax.checkpoint import CheckpointError
from ess_jax.config import ConfigError, preset_dict, read_json
from ess_jax.engine import Engine, EngineConfig, RequestSpec, cache_layout
from ess_jax.families import load_config
from ess_jax.sampling import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
V32, V4, FP8 = FIXTURES / "hf-v32-a", FIXTURES / "hf-v4-a", FIXTURES / "hf-v32-fp8"
generate_cli = importlib.import_module("ess_jax.generate")  # ess_jax.generate is also the API function


def run_cli(*args: str) -> tuple[int, str]:
    """``python -m ess_jax.generate ARGS`` in this process: its exit status and stderr."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = generate_cli.main(list(args))
        except SystemExit as e:  # argparse
            code = e.code
    return code, err.getvalue()


def assert_refused(code: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def generate_args(model: Path | str, *flags: str) -> list[str]:
    return ["--model", str(model), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", *flags]


# ---- corrupted safetensors files ------------------------------------------------------------------------

def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_file(path: Path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def set_value(header: dict, data: bytes, name: str, value: float) -> bytes:
    start = header[name]["data_offsets"][0]
    return data[:start + 4] + np.float32(value).tobytes() + data[start + 8:]  # the tensor's second value


EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"
KV_B = "model.layers.1.self_attn.kv_b_proj.weight"


def _edit(edit):
    """A case that rewrites model.safetensors' header and data with ``edit(header, data) -> data``."""
    def apply(path: Path) -> None:
        header, data = read_header(path)
        write_file(path, header, edit(header, data))
    return apply


def _reverse(h, d):
    h[EMBED]["data_offsets"] = h[EMBED]["data_offsets"][::-1]
    return d


def _overlap(h, d):
    first, second = tensors_by_offset(h)[3:5]
    start = h[first]["data_offsets"][0]
    h[second]["data_offsets"] = [start, start + h[second]["data_offsets"][1] - h[second]["data_offsets"][0]]
    return d


def _set(name, field, value):
    def edit(h, d):
        h[name][field] = value
        return d
    return edit


def _entry(h, d):
    h[NORM] = [1, 2]
    return d


FILE_CASES = {  # case -> (corrupt model.safetensors in place, what the error names)
    "shorter than 8 bytes": (lambda p: p.write_bytes(b"\x01\x02\x03"), ["model.safetensors", "8-byte"]),
    "absurd header length": (lambda p: p.write_bytes(struct.pack("<Q", 2**60) + b"{}"),
                             ["model.safetensors", "header"]),
    "header not JSON": (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{no}"),
                        ["model.safetensors", "not valid JSON"]),
    "header a list": (lambda p: write_file(p, [1, 2], b""), ["model.safetensors", "JSON list"]),
    "entry not an object": (_edit(_entry), ["model.safetensors", NORM, "not an object"]),
    "offsets reversed": (_edit(_reverse), ["model.safetensors", EMBED, "reversed"]),
    "offsets outside the file": (_edit(lambda h, d: d[:-100]), ["model.safetensors", NORM, "outside"]),
    "offsets overlapping": (_edit(_overlap), ["model.safetensors", "overlap"]),
    "unknown dtype": (_edit(_set(EMBED, "dtype", "Q7")), ["model.safetensors", EMBED, "'Q7'"]),
    "shape x dtype != span": (_edit(_set(EMBED, "shape", [1])), ["model.safetensors", EMBED, "span"]),
    "I32 where F32 belongs": (_edit(_set(KV_B, "dtype", "I32")), ["model.safetensors", KV_B, "I32", "floating-point"]),
    "NaN weight": (_edit(lambda h, d: set_value(h, d, KV_B, math.nan)), ["model.safetensors", KV_B, "1 NaN"]),
    "Inf weight": (_edit(lambda h, d: set_value(h, d, NORM, math.inf)), ["model.safetensors", NORM, "1 infinite"]),
}


@pytest.fixture
def v32_copy(tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(V32, target, ignore=shutil.ignore_patterns("reference.npz"))
    return target


@pytest.mark.parametrize("case", FILE_CASES)
def test_corrupt_safetensors_are_refused_naming_file_and_tensor(v32_copy, case):
    corrupt, needles = FILE_CASES[case]
    corrupt(v32_copy / "model.safetensors")
    line = assert_refused(*run_cli(*generate_args(v32_copy)), *needles)
    assert str(v32_copy) in line


def test_corrupt_safetensors_through_the_api(v32_copy):
    header, data = read_header(v32_copy / "model.safetensors")
    write_file(v32_copy / "model.safetensors", header, set_value(header, data, KV_B, -math.inf))
    with pytest.raises(CheckpointError, match=f"{KV_B} has 0 NaN and 1 infinite"):
        ess_jax.load_model(v32_copy)


# ---- shards, indexes and stored dtypes ------------------------------------------------------------------

@pytest.fixture
def fp8_copy(tmp_path) -> Path:
    target = tmp_path / "fp8"
    shutil.copytree(FP8, target, ignore=shutil.ignore_patterns("reference.npz"))
    return target


INDEX = "model.safetensors.index.json"


def _index(edit):
    def apply(directory: Path) -> None:
        raw = json.loads((directory / INDEX).read_text())
        (directory / INDEX).write_text(json.dumps(edit(raw)))
    return apply


def _first_shard(name: str):
    def edit(raw):
        key = next(iter(raw["weight_map"]))
        raw["weight_map"][key] = name
        return raw
    return edit


def _wrong_shard(raw):
    shards = sorted(set(raw["weight_map"].values()))
    key = next(k for k, v in raw["weight_map"].items() if v == shards[0])
    raw["weight_map"][key] = shards[1]
    return raw


def _scales_as_int(directory: Path) -> None:
    shard = directory / "model-00001-of-00002.safetensors"
    header, data = read_header(shard)
    scale = next(k for k in tensors_by_offset(header) if k.endswith("weight_scale_inv"))
    header[scale]["dtype"] = "I32"
    write_file(shard, header, data)


INDEX_CASES = {
    "absolute shard path": (_index(_first_shard("/etc/passwd")), [INDEX, "'/etc/passwd'", "inside"]),
    "shard path with ..": (_index(_first_shard("../hf-v32-a/model.safetensors")), [INDEX, "'../hf-v32-a", "'..'"]),
    "index without weight_map": (_index(lambda raw: {"metadata": {}}), [INDEX, "weight_map"]),
    "index not JSON": (lambda d: (d / INDEX).write_text("{nope"), [INDEX]),
    "missing shard": (_index(_first_shard("model-00009-of-00009.safetensors")), ["model-00009-of-00009"]),
    "tensor in the wrong shard": (_index(_wrong_shard), [INDEX, "whose header has no such tensor"]),
    "FP8 scales stored as I32": (_scales_as_int, ["model-00001-of-00002.safetensors", "weight_scale_inv", "I32"]),
}


@pytest.mark.parametrize("case", INDEX_CASES)
def test_bad_indexes_and_shards_are_refused(fp8_copy, case):
    corrupt, needles = INDEX_CASES[case]
    corrupt(fp8_copy)
    assert_refused(*run_cli(*generate_args(fp8_copy)), *needles)


def test_v4_integer_buffer_as_float_and_duplicate_names_are_refused(tmp_path):
    target = tmp_path / "v4"
    shutil.copytree(V4, target, ignore=shutil.ignore_patterns("reference.npz"))
    path = target / "model.safetensors"
    header, data = read_header(path)
    tid2eid = "model.layers.0.ffn.gate.tid2eid"  # the release name of model.layers.0.mlp.gate.tid2eid
    pristine = json.loads(json.dumps(header))
    header[tid2eid]["dtype"] = "F64"  # same byte span as I64
    write_file(path, header, data)
    assert_refused(*run_cli(*generate_args(target)), str(path), tid2eid, "F64", "integer ids")

    header = pristine
    start, end = header[tid2eid]["data_offsets"]  # a second tensor loading as the same name, with its own bytes
    header["model.layers.0.mlp.gate.tid2eid"] = dict(header[tid2eid], data_offsets=[len(data), len(data) + end - start])
    write_file(path, header, data + data[start:end])
    with pytest.raises(CheckpointError, match="both load as model.layers.0.mlp.gate.tid2eid"):
        ess_jax.load_model(target)


def _not_loaded(*args, **kwargs):
    raise AssertionError("the model loaded before its input was checked")


# ---- configs --------------------------------------------------------------------------------------------

V32_RAW = json.loads((V32 / "config.json").read_text())
V4_RAW = json.loads((V4 / "config.json").read_text())

CONFIG_CASES = {  # case -> (config.json text, what the error names)
    "null": ("null", ["NoneType"]),
    "a number": ("3", ["int 3"]),
    "a list": ("[1, 2]", ["list"]),
    "not JSON": ("{model_type", ["not valid JSON"]),
    "int given as 64.5": (dict(V32_RAW, hidden_size=64.5), ["hidden_size=64.5", "integer"]),
    "n_group 0": (dict(V32_RAW, n_group=0), ["n_group=0"]),
    "n_group not dividing": (dict(V32_RAW, n_group=3, topk_group=1), ["n_group=3"]),
    "topk_group > n_group": (dict(V32_RAW, topk_group=5), ["topk_group=5"]),
    "list field a number": (dict(V32_RAW, mlp_layer_types=3), ["mlp_layer_types=3", "a list"]),
    "list field too short": (dict(V32_RAW, mlp_layer_types=["dense"]), ["mlp_layer_types has 1 entries"]),
    "list field bad value": (dict(V32_RAW, mlp_layer_types=["dense", "sparse", "huge"]), ["mlp_layer_types="]),
    "bool a string": (dict(V32_RAW, tie_word_embeddings="no"), ["tie_word_embeddings='no'"]),
    "NaN epsilon": (dict(V32_RAW, rms_norm_eps=math.nan), ["rms_norm_eps=nan"]),
    "quantization_config a string": (dict(V32_RAW, quantization_config="fp8"), ["quantization_config='fp8'"]),
    "block size 0": (dict(V32_RAW, quantization_config={"weight_block_size": [0, 128]}),
                     ["quantization_config.weight_block_size[0]=0"]),
    "eos outside the vocabulary": (dict(V32_RAW, eos_token_id=[257, 999]), ["eos_token_id=999", "vocab_size=320"]),
    "bos outside the vocabulary": (dict(V32_RAW, bos_token_id=320), ["bos_token_id=320"]),
    "pad negative": (dict(V32_RAW, pad_token_id=-1), ["pad_token_id=-1"]),
    "rope factor a string": (dict(V32_RAW, rope_parameters=dict(V32_RAW["rope_parameters"], factor="x")),
                             ["rope_parameters.factor='x'"]),
    "rope parameters a list": (dict(V32_RAW, rope_parameters=[1]), ["rope_parameters=[1]"]),
    "model_type a list": (dict(V32_RAW, model_type=["deepseek_v32"]), ["model_type="]),
    "v4 layer_types a number": (dict(V4_RAW, layer_types=4), ["layer_types=4"]),
    "v4 compress_ratios of lists": (dict(V4_RAW, layer_types=None, compress_ratios=[[0]] * 4),
                                    ["compress_ratios[0]=[0]"]),
    "v4 partial_rotary_factor 2": (dict(V4_RAW, partial_rotary_factor=2), ["partial_rotary_factor=2"]),
    "v4 rope main not an object": (dict(V4_RAW, rope_parameters={"main": 1, "compress": {}}),
                                   ["rope_parameters.main=1"]),
    "v4 compress rate 0": (dict(V4_RAW, compress_rates={"compressed_sparse_attention": 0}),
                           ["compress_rates.compressed_sparse_attention=0"]),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_configs_are_refused_before_any_weight(tmp_path, monkeypatch, case):
    raw, needles = CONFIG_CASES[case]
    (tmp_path / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    monkeypatch.setattr(generate_cli, "load_model", _not_loaded)  # refused by the flag checks' config read
    assert_refused(*run_cli(*generate_args(tmp_path)), str(tmp_path / "config.json"), *needles)
    if not isinstance(raw, str):
        with pytest.raises(ConfigError, match=needles[0].replace("[", r"\[").replace("(", r"\(")):
            load_config(raw)


def test_every_shipped_config_passes_validation():
    for name in ("tiny-v32", "tiny-v4", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4-pro"):
        load_config(preset_dict(name))
    for fixture in FIXTURES.glob("hf-*"):
        load_config(read_json(fixture / "config.json"), fixture / "config.json")


def test_tokenizer_json_that_is_a_directory_is_an_error(v32_copy):
    (v32_copy / "tokenizer.json").mkdir()
    assert_refused(*run_cli(*generate_args(v32_copy)), str(v32_copy / "tokenizer.json"), "not a file")


# ---- flags: refused before the model loads ---------------------------------------------------------------

FLAG_CASES = {
    "--host-cache-mb nan": (["--host-cache-mb", "nan"], ["--host-cache-mb nan"]),
    "--temperature inf": (["--temperature", "inf"], ["--temperature inf"]),
    "--top-p nan": (["--top-p", "nan"], ["top_p=nan"]),
    "--top-k 99999999999": (["--top-k", "99999999999"], ["--top-k 99999999999"]),
    "--num-pages 0": (["--num-pages", "0"], ["--num-pages 0"]),
    "--max-batch 0": (["--max-batch", "0"], ["--max-batch 0"]),
    "--page-size 0": (["--page-size", "0"], ["--page-size 0"]),
    "--prefill-chunk -1": (["--prefill-chunk", "-1"], ["--prefill-chunk -1"]),
    "--max-seq-len 0": (["--max-seq-len", "0"], ["--max-seq-len 0"]),
    "--pool-ratio nan": (["--pool-ratio", "nan"], ["--pool-ratio nan"]),
    "--pool-ratio 2": (["--pool-ratio", "2"], ["--pool-ratio 2.0"]),
    "--pool-size 3": (["--pool-size", "3"], ["--pool-size 3", "below the minimum"]),
    "--host-cache-mb -5": (["--host-cache-mb", "-5"], ["--host-cache-mb -5"]),
    "--max-new-tokens 0": (["--max-new-tokens", "0"], ["--max-new-tokens 0"]),
    "--weights-seed -1": (["--weights-seed", "-1"], ["--weights-seed -1"]),
    "--max-batch 2.5": (["--max-batch", "2.5"], ["--max-batch", "invalid int"]),
    "--pool-size with --offload none": (["--offload", "none", "--pool-size", "20"],
                                        ["--pool-size", "--offload ess only"]),
    "--pool-ratio and --fetch with --offload none": (["--offload", "none", "--pool-ratio", "0.5", "--fetch", "split"],
                                                     ["--fetch and --pool-ratio", "--offload ess only"]),
    "--host-cache-mb with --offload none": (["--offload", "none", "--host-cache-mb", "64"], ["--host-cache-mb"]),
    "--rings with --offload none": (["--offload", "none", "--rings", "device"], ["--rings", "--offload ess only"]),
    "--num-pages 100000000": (["--num-pages", "100000000"], ["100000000 pages", "GiB"]),
    "--page-size 100000000": (["--page-size", "100000000"], ["of 100000000 tokens", "GiB"]),
    "--num-pages 100000000 --offload none": (["--offload", "none", "--num-pages", "100000000"], ["GiB"]),
    "--prompt-ids outside the vocabulary": (["--prompt-ids", "5,320"], ["token id 320", "outside the vocabulary"]),
    "--prompt-ids too long": (["--max-new-tokens", "4000", "--prompt-ids", ",".join(["1"] * 100)],
                              ["max_position_embeddings"]),
    "--prompt too long": (["--max-new-tokens", "4000", "--prompt", "x" * 100], ["--prompt: 101 prompt tokens"]),
    "--max-seq-len beyond the positions": (["--max-seq-len", "100000"],
                                           ["--max-seq-len 100000", "max_position_embeddings"]),
    "--compile-cache not writable": (["--compile-cache", "/dev/null/jax"],
                                     ["--compile-cache /dev/null/jax: cannot write there", "--compile-cache none"]),
}


@pytest.mark.parametrize("case", FLAG_CASES)
def test_bad_flags_are_refused_before_the_model_loads(monkeypatch, case):
    flags, needles = FLAG_CASES[case]
    monkeypatch.setattr(generate_cli, "load_model", _not_loaded)
    assert_refused(*run_cli(*generate_args(V32, *flags)), *needles)


def test_good_flags_pass_the_checks(monkeypatch):
    """The checks refuse nothing a normal run asks for (the model load is where this run stops)."""
    def stop_here(*args, **kwargs):
        raise ValueError("stop here")

    monkeypatch.setattr(generate_cli, "load_model", stop_here)
    for flags in ([], ["--offload", "none"], ["--pool-size", "17", "--fetch", "split"], ["--host-cache-mb", "64"],
                  ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]):
        assert_refused(*run_cli(*generate_args(V32, *flags)), "stop here")


# ---- the Python API ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return ess_jax.load_model(V32)


@pytest.mark.parametrize("config, needle", [
    (dict(num_pages=0), "--num-pages 0"),
    (dict(max_batch=2.5), "--max-batch 2.5"),
    (dict(max_batch=True), "--max-batch True"),
    (dict(page_size=-1), "--page-size -1"),
    (dict(pool_ratio=math.nan), "--pool-ratio nan"),
    (dict(offload="ess", host_cache_mb=math.inf), "--host-cache-mb inf"),
    (dict(keep_logits="yes"), "keep_logits"),
])
def test_bad_engine_configs_are_refused(config, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        EngineConfig(**config)


@pytest.mark.parametrize("config, needle", [
    (dict(max_batch=10**6), "1000000 batch rows"),
    (dict(page_size=10**8, offload="ess"), "of 100000000 tokens"),
    (dict(num_pages=10**8), "100000000 pages"),
])
def test_impossible_sizes_are_refused_before_any_cache_exists(model, config, needle):
    with pytest.raises(ValueError, match=rf"{needle}.* GiB\) but this machine has|{needle}.* the device has"):
        Engine(model, EngineConfig(**config))


def test_memory_estimate_matches_the_real_cache(model):
    """The estimate the checks use is the cache the engine builds: exact without offload and for the host
    store; with ESS the device figure (decode cache + prefill scratch) leaves out only the tier's small
    bookkeeping arrays (slot tables, staged rows, counters)."""
    resident = EngineConfig(max_batch=2, max_seq_len=64, page_size=16)
    layout, report = cache_layout(model.cfg, resident, "float32"), Engine(model, resident).cache_bytes()
    assert (layout.device_bytes, layout.host_bytes) == (report["device_bytes"], 0)
    ess = EngineConfig(max_batch=2, max_seq_len=64, page_size=16, offload="ess", pool_size=20)
    layout, report = cache_layout(model.cfg, ess, "float32"), Engine(model, ess).cache_bytes()
    assert layout.host_bytes == report["host_bytes"] > 0
    device = report["device_bytes"] + report["prefill_scratch_bytes"]
    assert 0.8 * device <= layout.device_bytes <= device


@pytest.mark.parametrize("args, kwargs, needle", [
    (([1.5, 2], 4), {}, "prompt token id 1.5 is not an integer"),
    ((["7"], 4), {}, "prompt token id '7' is not an integer"),
    (("abc", 4), {}, "must be a sequence of integers"),
    (([1, 2], 2.0), {}, "max_new_tokens=2.0"),
    (([1, 2], 4), dict(stop_token_ids=[999]), "stop token id 999 is outside the vocabulary"),
    (([1, 2], 4), dict(logprobs=-1), "logprobs=-1"),
    (([1, 2], 4, SamplingParams(temperature=math.inf)), {}, "temperature=inf"),
    (([1, 2], 4, SamplingParams(top_k=2**40)), {}, "top_k=1099511627776"),
])
def test_bad_requests_are_refused(model, args, kwargs, needle):
    engine = Engine(model, EngineConfig(max_batch=1, max_seq_len=64, page_size=16))
    with pytest.raises(ValueError, match=needle):
        engine.add_request(RequestSpec(*args, **kwargs))
    assert not engine.has_unfinished()


def test_engine_forgets_finished_requests_and_its_figures_stay_bounded(model):
    """Aborted (finished) requests leave nothing behind; resident_device_bytes is the peak, _now what the
    unfinished requests reserve (both from the engine's own bookkeeping, no step runs)."""
    engine = Engine(model, EngineConfig(max_batch=2, max_seq_len=64, page_size=16))
    fresh = engine.cache_bytes()
    assert fresh["resident_device_bytes"] == fresh["resident_device_bytes_now"] == 0
    for _ in range(3):
        ids = [engine.add_request(RequestSpec([1, 2, 3], 10)) for _ in range(40)]  # 13 tokens: one page each
        assert engine.stats.reserved_pages == 40
        for i in ids:
            engine.abort(i)
        assert not engine.requests and engine.stats.reserved_pages == 0
        assert sorted(out.request_id for out in engine.step()) == ids  # the aborts, reported by the next step
    report = engine.cache_bytes()
    page = families.resident_bytes(engine.layout.parts, engine.layout.size, 1)  # one page of latent rows and keys
    assert report["resident_device_bytes_now"] == 0
    assert report["resident_device_bytes"] == 40 * page  # the peak of one wave, not the sum of three

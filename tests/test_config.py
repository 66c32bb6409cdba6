import json
import math

import numpy as np
import pytest

from ess_jax.config import (ConfigError, ModelSource, RopeConfig, preset_dict, read_json, resolve_model,
                            shipped_checkpoint)
from ess_jax.engine import EngineConfig
from ess_jax.families import load_config, source_config
from ess_jax.models.layers import rope_inv_freq


def test_real_v32_preset_shape_and_yarn_scale():
    cfg = load_config(preset_dict("deepseek-v3.2"))
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 58
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192
    # DOMAIN 1.2: tau = 192^-1/2 * m^2, m = 0.1 ln 40 + 1
    m = 0.1 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    assert cfg.rope.cos_sin_scale == 1.0  # mscale == mscale_all_dim


def test_yarn_ramp_matches_hand_computed_bounds():
    # DOMAIN 1.2: low = 10, high = 23 for theta 10000, dim 64, original 4096, factor 40.
    rope = load_config(preset_dict("deepseek-v3.2")).rope
    f = rope_inv_freq(rope, 64)
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(f[:10], base[:10], rtol=1e-6)  # below low: extrapolation (unchanged)
    np.testing.assert_allclose(f[23:], base[23:] / 40, rtol=1e-6)  # past high: interpolated by the factor
    gamma = (16 - 10) / 13  # inside the ramp
    np.testing.assert_allclose(f[16], base[16] * (1 - gamma) + base[16] / 40 * gamma, rtol=1e-5)


def test_hf_defaults_and_aliases():
    cfg = load_config({"model_type": "deepseek_v32", "num_hidden_layers": 5, "first_k_dense_replace": 2,
                       "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024},
                       "eos_token_id": [1, 7], "num_experts": 64})
    assert cfg.mlp_layer_types == ("dense", "dense", "sparse", "sparse", "sparse")
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 2.0
    assert cfg.rope.cos_sin_scale == pytest.approx(0.1 * math.log(2) + 1)  # no mscale pair: plain YaRN factor
    assert cfg.softmax_scale == pytest.approx(192**-0.5)  # no mscale_all_dim: no softmax mscale
    assert cfg.eos_token_id == (1, 7) and cfg.n_routed_experts == 64
    assert cfg.hidden_size == 7168 and cfg.index_topk == 2048  # transformers' defaults


def test_explicit_mlp_layer_types_win():
    cfg = load_config({"model_type": "deepseek_v32", "num_hidden_layers": 2, "mlp_layer_types": ["sparse", "dense"]})
    assert cfg.mlp_layer_types == ("sparse", "dense")


@pytest.mark.parametrize("raw, needle", [
    ({"model_type": "llama"}, "model_type='llama'"),
    ({}, "model_type"),
    ({"model_type": "deepseek_v32", "n_routed_experts": 10, "n_group": 4}, "n_group"),
    ({"model_type": "deepseek_v32", "n_group": 2, "topk_group": 3}, "topk_group"),
    ({"model_type": "deepseek_v32", "num_hidden_layers": 2, "mlp_layer_types": ["dense"]}, "mlp_layer_types"),
    ({"model_type": "deepseek_v32", "rope_parameters": {"rope_type": "longrope"}}, "longrope"),
    ({"model_type": "deepseek_v32", "hidden_size": "big"}, "hidden_size"),
])
def test_bad_configs_name_the_field(raw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load_config(raw)


def test_unknown_preset_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(preset_dict("tiny-v9"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(read_json(tmp_path / "config.json"), tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(read_json(tmp_path / "missing" / "config.json"), tmp_path / "missing" / "config.json")


def test_presets_parse_from_their_json():
    raw = json.loads((__import__("pathlib").Path(__file__).parents[1] / "configs" / "tiny-v32.json").read_text())
    cfg = load_config(preset_dict("tiny-v32"))
    assert cfg.index_topk == raw["index_topk"] == 64 and cfg.vocab_size >= 256
    assert isinstance(cfg.rope, RopeConfig)


def test_model_names_resolve_in_one_place(tmp_path):
    """A shipped checkpoint's name, a checkpoint directory, a preset's name; one error naming the three."""
    shipped = resolve_model("tiny-v32-code")
    assert shipped == ModelSource("tiny-v32-code", shipped_checkpoint("tiny-v32-code"))
    assert source_config(shipped).family == "deepseek_v32"
    preset = resolve_model("tiny-v4")
    assert preset.checkpoint is None and preset.raw_config() == preset_dict("tiny-v4")
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("tiny-v32")))
    directory = resolve_model(tmp_path)
    assert directory == ModelSource(str(tmp_path), tmp_path)
    assert source_config(directory) == load_config(preset_dict("tiny-v32"))
    with pytest.raises(ConfigError, match=r"'no-such' is neither a shipped checkpoint \(tiny-v32-code, tiny-v4-code\), "
                                          r"a preset \(tiny-v32, .*\) nor a checkpoint directory"):
        resolve_model("no-such")


@pytest.mark.parametrize("field, value, message", [
    ("max_batch", 0, "--max-batch 0 must be an integer >= 1"),
    ("page_size", 2.0, "--page-size 2.0 must be an integer >= 1"),
    ("prefill_chunk", True, "--prefill-chunk True must be an integer >= 1"),
    ("num_pages", 1, "--num-pages 1 must be an integer >= 2 (page 0 is the reserved null page)"),
    ("max_seq_len", np.int64(0), "--max-seq-len np.int64(0) must be an integer >= 1"),
    ("pool_size", "8", "--pool-size '8' must be an integer >= 1"),
    ("prefix_cache_states", None, "--prefix-cache-states None must be an integer >= 1"),
    ("pool_ratio", 1.5, "--pool-ratio 1.5 must be a number in (0, 1]"),
    ("miss_budget", math.nan, "--miss-budget nan must be a number in (0, 1]"),
    ("host_cache_mb", math.inf, "--host-cache-mb inf must be a finite number of MiB > 0"),
    ("prefix_cache_disk_gb", 0, "--prefix-cache-disk-gb 0 must be a finite number of GiB > 0"),
    ("num_speculative_tokens", -1, "--num-speculative-tokens -1 must be an integer >= 0"),
])
def test_engine_config_numbers_are_refused_naming_the_flag(field, value, message):
    with pytest.raises(ValueError) as refused:
        EngineConfig(**{field: value})
    assert str(refused.value) == message


def test_engine_config_takes_numpy_integers_and_none_where_that_is_the_default():
    config = EngineConfig(max_batch=np.int64(2), num_pages=None, max_seq_len=None, pool_size=None, host_cache_mb=None,
                          pool_ratio=1, miss_budget=1, prefix_cache_disk_gb=0.5)
    assert config.max_batch == 2 and config.pool_ratio == 1

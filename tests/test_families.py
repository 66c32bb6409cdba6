"""The family registry: each family's cache parts against the byte sizes of DOMAIN.md 3 at the real
DeepSeek shapes, the parts against the arrays the models' ``init_cache`` allocates, the sparse layers,
and the lookups (module class, checkpoint renames, unknown model types)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ess_jax import families
from ess_jax.config import ConfigError, preset_dict
from ess_jax.families import Formats, load_config
from ess_jax.models.deepseek_v32 import DeepseekV32
from ess_jax.models.deepseek_v4 import DeepseekV4
from ess_jax.models.deepseek_v4.names import release_to_hf_name

V32 = load_config(preset_dict("deepseek-v3.2"))
FLASH = load_config(preset_dict("deepseek-v4-flash"))


@functools.cache
def abstract_module(cfg):
    return nnx.eval_shape(lambda: families.get(cfg.family).module_cls(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))


def parts(cfg, formats):
    return {p.name: p for p in families.get(cfg.family).cache_parts(cfg, formats)}


def test_v32_parts_are_flashmla_rows():
    fp8 = parts(V32, Formats("fp8", "fp8", "fp8", "float32"))
    latent, key = fp8["latent [c | k_rope]"], fp8["indexer key"]
    assert (latent.where, latent.layers, latent.tokens_per_row, latent.topk) == ("offloaded", 61, 1, 2048)
    assert latent.row_bytes == 512 + 4 * 4 + 2 * 64 == 656  # e4m3 + one fp32 scale per 128 + bf16 rope
    assert key.row_bytes == 128 + 4 == 132 and key.where == "resident"
    bf16 = parts(V32, Formats("bfloat16", "bfloat16", "bfloat16", "float32"))
    assert bf16["latent [c | k_rope]"].row_bytes == (512 + 64) * 2 == 1152
    assert bf16["indexer key"].row_bytes == 128 * 2
    # 61 layers x (656 + 132) = 48,068 bytes per token in FP8, 83.25 % of it offloaded
    assert sum(p.bytes_per_token() for p in fp8.values()) == 48_068
    assert latent.bytes(32768) == 32768 * 61 * 656


def test_v4_flash_parts_match_domain():
    fp8 = parts(FLASH, Formats("fp8", "fp8", "fp8", "float32", release=True))
    main = fp8["CSA main rows"]
    assert (main.where, main.layers, main.tokens_per_row, main.topk) == ("offloaded", 21, 4, 512)
    assert main.row_bytes == 448 + 64 * 2 + 7 + 1 == 584  # e4m3 + bf16 rope + ue8m0 per 64 + pad
    engine = parts(FLASH, Formats("fp8", "fp8", "fp8", "float32"))  # the engine's rows: 16-byte aligned
    assert engine["CSA main rows"].row_bytes == engine["HCA rows"].row_bytes == 592
    assert fp8["CSA indexer keys"].row_bytes == 132 and fp8["HCA rows"].layers == 20
    assert fp8["SWA window"].bytes(0) == 43 * 128 * 584
    assert fp8["CSA compressor tails (fp32)"].row_bytes == 64 * 1024  # kv + gate rings
    tails = fp8["CSA indexer compressor tails (fp32)"]  # the indexer's, on every CSA layer without Index Share
    assert (tails.row_bytes, tails.layers) == (16 * 1024, 21)
    assert fp8["HCA compressor tails (fp32)"].row_bytes == 512 * 1024
    assert "token count" not in fp8  # the release keeps no length in the cache
    assert main.entries(131072) == 32768
    fp4 = parts(FLASH, Formats("fp8", "fp4", "fp8", "float32", release=True))
    assert fp4["CSA indexer keys"].row_bytes == 64 + 4 == 68
    bf16 = parts(FLASH, Formats("bfloat16", "bfloat16", "bfloat16", "float32"))
    assert bf16["CSA main rows"].row_bytes == 1024 and bf16["CSA indexer keys"].row_bytes == 256


def test_sparse_layers_and_stored_formats():
    v32, v4 = families.get("deepseek_v32"), families.get("deepseek_v4")
    assert v32.sparse_layers(V32) == list(range(61))
    csa = v4.sparse_layers(FLASH)
    assert len(csa) == 21 and all(FLASH.layer_types[i] == "compressed_sparse_attention" for i in csa)
    # V3.2 keeps FP8 indexer keys beside FP8 latent rows; V4 keeps its keys in the model's dtype
    assert v32.stored_formats("fp8", "bfloat16").index == "fp8"
    assert v32.stored_formats("float32", "bfloat16").index == "bfloat16"
    assert v4.stored_formats("fp8", "bfloat16") == Formats("fp8", "bfloat16", "bfloat16", "bfloat16")


@pytest.mark.parametrize("cache", ["fp8", "bfloat16", "float32"])
@pytest.mark.parametrize("cfg", [V32, FLASH], ids=["deepseek-v3.2", "deepseek-v4-flash"])
def test_stored_parts_are_the_init_cache_arrays(cfg, cache):
    """At the real shapes (abstractly): the bytes the parts give for a cache equal its arrays' bytes."""
    family = families.get(cfg.family)
    module = abstract_module(cfg)
    dtype = {"fp8": jnp.uint8, "bfloat16": jnp.bfloat16, "float32": jnp.float32}[cache]
    size = families.CacheSize(rows=3, pages=9, page_size=64, max_seq_len=520)
    shapes = jax.eval_shape(lambda: family.resident_cache(module, size, dtype))
    arrays = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    stored = family.cache_parts(cfg, family.stored_formats(cache, "bfloat16"))
    # every page of the pool, every batch row's fixed parts
    assert families.resident_bytes(stored, size, 9) == arrays
    offloaded = next(p for p in stored if p.where == "offloaded")
    rows = family.store_of(shapes).pages
    assert rows.shape[0] == offloaded.layers and rows.shape[-1] * rows.dtype.itemsize == offloaded.row_bytes
    assert (rows.shape[1] * rows.shape[2] * rows.shape[3] * rows.dtype.itemsize * rows.shape[0]
            == 9 * offloaded.page_bytes(64))


def test_lookups():
    v32, v4 = families.get("deepseek_v32"), families.get("deepseek_v4")
    assert v32.module_cls is DeepseekV32 and v4.module_cls is DeepseekV4
    assert v32.hf_rename is None and v4.hf_rename is release_to_hf_name
    assert set(families.FAMILIES) == {"deepseek_v32", "deepseek_v4"}
    with pytest.raises(ConfigError, match="model_type='llama' is not served"):
        families.get("llama")

"""Load HuggingFace DeepSeek checkpoints into the NNX models, one tensor at a time.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when sharded). Accepted names:
- transformers 5.x names, including packed experts ``mlp.experts.gate_up_proj [E, 2F, D]`` /
  ``mlp.experts.down_proj [E, D, F]``;
- the original DeepSeek release names with one module per expert
  (``mlp.experts.E.{gate,up,down}_proj.weight``), stacked at load.
FP8 (e4m3) weights with a ``weight_scale_inv`` of 128x128 block scales are dequantized at load.
Layers at index >= num_hidden_layers (the MTP layer) are skipped.

DeepSeek-V4's original release names (no ``model.`` prefix, ``layers.N.{attn,ffn}.*``, FP8 scales as
``.scale`` in float32 or ue8m0, MTP under ``mtp.*``) are renamed to transformers' names when the
checkpoint is opened (``release_to_hf_name``), so one lookup by transformers name serves both.

Files are memory-mapped and read tensor by tensor (our own safetensors reader, because NumPy has
no float8 dtype); the model is built abstractly first, so host memory never holds two copies.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import jax.numpy as jnp
from flax import nnx

from ess_jax import families
from ess_jax.config import ModelConfig

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, misshapen or unreadable tensors."""


class SafetensorsFile:
    """Lazy reader of one .safetensors file: header parsed once, tensors memory-mapped on demand."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self.header = header
        self.data_start = 8 + header_len

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"tensor {name} in {self.path.name} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        data = np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + start, shape=(count,))
        return data.reshape(info["shape"])


class Checkpoint:
    """All tensors of a checkpoint directory by (transformers) name.

    ``rename`` maps a stored tensor name to the transformers name it is looked up by (identity by default).
    """

    def __init__(self, directory: Path, rename=None):
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (directory / f).exists()]
            if missing:
                raise CheckpointError(f"{index} names shard(s) {missing} that are not in {directory}")
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {directory}")
        self.files = {name: SafetensorsFile(directory / name) for name in files}
        self.where: dict[str, SafetensorsFile] = {}
        self.stored: dict[str, str] = {}  # transformers name -> name in the file
        for f in self.files.values():
            for key in f.keys():
                name = rename(key) if rename else key
                self.where[name] = f
                self.stored[name] = key
        self.directory = directory
        raw_config = json.loads((directory / "config.json").read_text())
        quant = raw_config.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size") or (128, 128))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str) -> np.ndarray:
        """A tensor as float32 (or its integer dtype), FP8 block scales applied."""
        tensor = self.where[name].get(self.stored[name])
        if tensor.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
            scale_name = name.removesuffix("weight") + "weight_scale_inv"
            if scale_name not in self.where:
                raise CheckpointError(f"FP8 tensor {self.stored[name]} has no "
                                      f"{self.stored.get(scale_name, scale_name)} block scales")
            scale = self.where[scale_name].get(self.stored[scale_name])
            return dequantize_fp8_blocks(tensor, scale, name, self.block)
        if np.issubdtype(tensor.dtype, np.integer) or tensor.dtype == np.bool_:
            return np.asarray(tensor)
        return np.asarray(tensor, dtype=np.float32)


def dequantize_fp8_blocks(w8: np.ndarray, scale: np.ndarray, name: str,
                          block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """``W[i, j] = W8[i, j] * S[i // bo, j // bi]`` for FP8 ``[out, in]`` weights and ``(bo, bi)`` block scales."""
    (out, inp), (block_o, block_i) = w8.shape, block
    if scale.shape != (-(-out // block_o), -(-inp // block_i)):
        raise CheckpointError(f"{name}: weight_scale_inv shape {list(scale.shape)} does not tile weight shape "
                              f"{list(w8.shape)} in {block_o}x{block_i} blocks")
    expanded = np.repeat(np.repeat(np.asarray(scale, np.float32), block_o, axis=0), block_i, axis=1)[:out, :inp]
    return np.asarray(w8, dtype=np.float32) * expanded


def hf_name(path: tuple) -> str:
    """transformers' parameter name of an NNX state path."""
    name = ".".join(str(p) for p in path)
    return name if name.startswith("lm_head.") else "model." + name + (".weight" if path == ("embed_tokens",) else "")


def _read_param(ckpt: Checkpoint, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name in ckpt:
        return ckpt.read(name)
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return ckpt.read("model.embed_tokens.weight")
    per_expert = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    if per_expert:
        prefix, packed = per_expert.groups()
        parts = ("gate_proj", "up_proj") if packed == "gate_up_proj" else ("down_proj",)
        experts = []
        for e in range(shape[0]):
            names = [f"{prefix}.{e}.{part}.weight" for part in parts]
            for n in names:
                if n not in ckpt:
                    raise CheckpointError(f"checkpoint {ckpt.directory} has neither {name} nor {n}")
            experts.append(np.concatenate([ckpt.read(n) for n in names], axis=0))
        return np.stack(experts)
    raise CheckpointError(f"checkpoint {ckpt.directory} is missing tensor {name} (expected shape {list(shape)})")


# DeepSeek-V4 release names -> transformers names (transformers' conversion_mapping for deepseek_v4,
# DOMAIN.md 2.8), applied in order to the name without its "model." prefix. transformers'
# save_pretrained writes these release-style names back (with the prefix, and the attention's kv_norm
# as "attn.norm"), so every V4 checkpoint goes through them; transformers names are fixed points.
_V4_RELEASE_RULES = [(re.compile(p), r) for p, r in [
    (r"(?<!_hc)\.scale$", ".weight_scale_inv"),  # FP8 block scales; attn_hc.scale / ffn_hc.scale are parameters
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.", "lm_head."),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.ape$", ".position_bias"),
    (r"\.self_attn\.(compressor\.(?:indexer\.)?)?norm\.", r".self_attn.\1kv_norm."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.", ".gate_proj."),
    (r"\.w3\.", ".up_proj."),
    (r"\.w2\.", ".down_proj."),
]]


def release_to_hf_name(key: str) -> str:
    """A DeepSeek-V4 tensor name (release, transformers-saved or transformers) as transformers names it."""
    if key.startswith("mtp."):
        return key  # the release's MTP block, ignored
    name = key.removeprefix("model.")
    for pattern, replacement in _V4_RELEASE_RULES:
        name = pattern.sub(replacement, name)
    return name if name.startswith("lm_head.") else "model." + name


def load_into(model_fn, cfg: ModelConfig, directory: Path, dtype) -> nnx.Module:
    """Build ``model_fn()`` abstractly, then fill every parameter from the checkpoint in ``directory``."""
    ckpt = Checkpoint(directory, families.get(cfg.family).hf_rename)
    abstract = nnx.eval_shape(model_fn)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    loaded = []
    for path, variable in flat:
        name = hf_name(path)
        expected = tuple(variable.shape)
        array = _read_param(ckpt, cfg, name, expected)
        if tuple(array.shape) != expected:
            raise CheckpointError(f"tensor {name} has shape {list(array.shape)}, config expects {list(expected)}")
        if name.endswith(".tid2eid") and array.size and (array.min() < 0 or array.max() >= cfg.n_routed_experts):
            raise CheckpointError(f"tensor {name} has expert ids in [{array.min()}, {array.max()}], "
                                  f"outside [0, n_routed_experts={cfg.n_routed_experts})")
        loaded.append((path, variable.replace(jnp.asarray(array, dtype=variable.dtype))))
        del array
    expected_names = {hf_name(p) for p, _ in flat}
    unknown = [ckpt.stored[k] for k in ckpt.where if not _ignorable(k, cfg, expected_names)]
    if unknown:
        raise CheckpointError(f"checkpoint {directory} has tensors this model does not use: {unknown[:5]}"
                              f"{' ...' if len(unknown) > 5 else ''}")
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def save(params: nnx.State, raw_config: dict, directory: Path) -> Path:
    """Write a model's parameter state as a transformers checkpoint in ``directory``: ``model.safetensors``
    (float32, one module per expert as ``save_pretrained`` writes them; buffers such as ``tid2eid`` as
    stored) and ``config.json`` (``raw_config`` with its family's ``architectures``)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, variable in nnx.to_flat_state(params):
        value = np.asarray(variable[...])
        name, value = hf_name(path), value if value.dtype.kind in "iub" else value.astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D]: gate rows first
            prefix, half = name[:-len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :half])
                tensors[f"{prefix}{e}.up_proj.weight"] = np.ascontiguousarray(value[e, half:])
        elif name.endswith("mlp.experts.down_proj"):  # [E, D, F]
            for e in range(value.shape[0]):
                tensors[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
        else:
            tensors[name] = np.ascontiguousarray(value)
    tmp = directory / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(directory / "model.safetensors")
    family = families.get(raw_config["model_type"])
    config = dict(raw_config, architectures=[family.architecture], dtype="float32")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _ignorable(key: str, cfg: ModelConfig, expected: set[str]) -> bool:
    if key in expected or key.endswith("weight_scale_inv"):
        return True
    layer = _LAYER.match(key)
    if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
        return True  # MTP layer
    if key.startswith("mtp."):
        return True  # DeepSeek-V4 release MTP block
    if re.match(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", key):
        return True  # per-expert release names, stacked at load
    return key == "model.embed_tokens.weight" or key.endswith("rotary_emb.inv_freq")

"""Load HuggingFace DeepSeek checkpoints into the NNX models, one tensor at a time.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when sharded). Accepted names:
- transformers 5.x names, including packed experts ``mlp.experts.gate_up_proj [E, 2F, D]`` /
  ``mlp.experts.down_proj [E, D, F]``;
- the original DeepSeek release names with one module per expert
  (``mlp.experts.E.{gate,up,down}_proj.weight``), stacked at load.
Quantized weights, each with its scales beside it as ``weight_scale_inv``: FP8 (e4m3) with 128x128 block
scales, and FP4 (e2m1, two a byte in int8 / uint8) with a ue8m0 scale per 32 values of a row (V4's
routed experts). ``load_into`` dequantizes them at load (``weights="dequantized"``) or keeps them in their
bytes on the device (``weights="release"``, ``ess_jax.models.quant``), dequantized inside the step.
The MTP module (``models.mtp``; config ``num_nextn_predict_layers``) is layer ``num_hidden_layers``
(``model.layers.61.*`` in V3.2, ``mtp.0.*`` in the V4 release): loaded when the model has one and the checkpoint
holds it, every tensor of it (a partial one is refused, naming a missing tensor); a checkpoint without any of it
loads the model without it (``ModelConfig.without_mtp``). The embedding and output head are the main model's
(tied, as DeepSeek-V3 2.2 shares them): the release's copies under the MTP layer (``embed_tokens``,
``shared_head.head``) are not read. Other layers at index >= num_hidden_layers are skipped.

DeepSeek-V4's original release names (no ``model.`` prefix, ``layers.N.{attn,ffn}.*``, FP8 scales as
``.scale`` in float32 or ue8m0, MTP under ``mtp.*``) are renamed to transformers' names when the
checkpoint is opened (``models.deepseek_v4.names``; the MTP block as layer ``num_hidden_layers``), so one lookup by
transformers name serves both.

Files are memory-mapped and read tensor by tensor (our own safetensors reader, because NumPy has
no float8 dtype); the model is built abstractly first, so host memory never holds two copies.

On a device mesh (``load_into``'s ``mesh``) each parameter is made directly in its sharding
(``ess_jax.mesh.param_sharding``), and only the parts this process's devices hold are read: a routed
experts tensor's expert range as rows of the packed tensor (``SafetensorsFile.get`` maps only those
bytes) or as those experts' own tensors, each range once however many devices hold it. So each process
of a run of several reads only its own experts, and the replicated rest once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax import config, families
from ess_jax import mesh as device_mesh
from ess_jax.config import ModelConfig
from ess_jax.models import quant
from ess_jax.models.layers import run_layers

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
    "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")  # what a floating-point parameter may be stored as
_FP8_CODES = ("F8_E4M3", "F8_E5M2")  # ... or these, with weight_scale_inv block scales
_FP4_CODES = ("I8", "U8")  # ... or packed FP4 in these, with weight_scale_inv scales per 32 values
_SCALE_CODES = _FLOAT_CODES + ("F8_E8M0",)  # what block scales may be stored as
_INT_CODES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")  # what an integer buffer may be stored as
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")  # the release's copies of the shared tensors
_REEXPORT = "the file is truncated or corrupt: re-download or re-export it"
WEIGHTS = ("dequantized", "release")  # load_into's weights=: dequantized at load, or kept quantized on the device


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, misshapen or unreadable tensors."""


class SafetensorsFile:
    """Lazy reader of one .safetensors file: header parsed once, tensors memory-mapped on demand.

    The header is checked as it is parsed, so a tensor read later cannot fail: the file holds the 8-byte
    length and a JSON object of that length (at most 100 MiB), each entry (``__metadata__`` aside) an
    object with a known ``dtype``, a ``shape`` of integers >= 0 and ``data_offsets`` [start, end] inside
    the data, spanning exactly shape x dtype bytes, and no two entries overlap."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path} has {size} bytes, fewer than the 8-byte header length every "
                                          f"safetensors file starts with: {_REEXPORT}")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > min(size - 8, _MAX_HEADER):
                    raise CheckpointError(f"{path} declares a {header_len}-byte header, but {size - 8} bytes follow "
                                          f"the length (and headers are at most {_MAX_HEADER} bytes): {_REEXPORT}")
                text = f.read(header_len)
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            header = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e}): {_REEXPORT}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object "
                                  f"of tensors: {_REEXPORT}")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not isinstance(metadata, dict):
            raise CheckpointError(f"{path}: the safetensors __metadata__ is not an object: {_REEXPORT}")
        self.header = header
        self.data_start = 8 + header_len
        self.data_size = size - self.data_start
        for name, info in header.items():
            self._check_entry(name, info)
        spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name) for name, info in header.items()
                       if info["data_offsets"][1] > info["data_offsets"][0])
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise CheckpointError(f"{path}: the data of tensors {first} and {second} overlap (bytes {start} to "
                                      f"{end}): {_REEXPORT}")

    def _check_entry(self, name: str, info) -> None:
        where = f"{self.path}: tensor {name}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: its header entry is {type(info).__name__} {repr(info)[:40]}, not an "
                                  f"object with dtype, shape and data_offsets: {_REEXPORT}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise CheckpointError(f"{where} has dtype {dtype!r}, not a safetensors dtype this reader knows "
                                  f"({', '.join(_DTYPES)}): {_REEXPORT}, or convert the tensor")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise CheckpointError(f"{where} has shape {shape!r}, not a list of sizes >= 0: {_REEXPORT}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{where} has data_offsets {offsets!r}, not [start, end]: {_REEXPORT}")
        start, end = offsets
        if not 0 <= start <= end <= self.data_size:
            why = "reversed (start > end)" if start > end else f"outside the file's {self.data_size} data bytes"
            raise CheckpointError(f"{where} has data_offsets [{start}, {end}], {why}: {_REEXPORT}")
        nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
        if end - start != nbytes:
            raise CheckpointError(f"{where}: shape {shape} of {dtype} is {nbytes} bytes, but its data_offsets span "
                                  f"{end - start}: {_REEXPORT}")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype code ("F32", "BF16", "F8_E4M3", "I64", ...)."""
        return self.header[name]["dtype"]

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Tensor ``name`` memory-mapped from the file: whole, or only ``rows`` (``slice(r0, r1)``, ``0 <= r0 <=
        r1 <=`` its first axis) of its first axis, the map starting at row ``r0`` (so only those bytes are read);
        ValueError for rows that are not such a range."""
        info = self.header[name]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape, start = list(info["shape"]), info["data_offsets"][0]
        if rows is not None:
            if (not shape or rows.step not in (None, 1) or not isinstance(rows.start, int)
                    or not isinstance(rows.stop, int) or not 0 <= rows.start <= rows.stop <= shape[0]):
                raise ValueError(f"{self.path}: rows {rows} are not a range of the first axis of tensor {name} "
                                 f"(shape {shape})")
            start += rows.start * math.prod(shape[1:]) * dtype.itemsize
            shape[0] = rows.stop - rows.start
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, dtype)
        data = np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + start, shape=(count,))
        return data.reshape(shape)


INDEX = "model.safetensors.index.json"


class Checkpoint:
    """All tensors of a checkpoint directory by (transformers) name.

    ``rename`` maps a stored tensor name to the transformers name it is looked up by (identity by default).
    Opening checks every file's header (``SafetensorsFile``), the index (a ``weight_map`` object of tensor
    -> shard, shard names inside the directory, every tensor where it says) and that no two stored tensors
    load as one name. ``read`` checks each tensor's dtype against what its parameter holds and that its
    values are finite.
    """

    def __init__(self, directory: Path, rename=None):
        index = directory / INDEX
        if index.exists():
            weight_map = _read_index(index, directory)
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (directory / f).is_file()]
            if missing:
                raise CheckpointError(f"{index} names shard(s) {missing} that are not in {directory}: "
                                      "download them, or fix or remove the index")
        else:
            weight_map = None
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {directory}")
        self.files = {name: SafetensorsFile(directory / name) for name in files}
        self.where: dict[str, SafetensorsFile] = {}
        self.stored: dict[str, str] = {}  # transformers name -> name in the file
        for f in self.files.values():
            for key in f.keys():
                name = rename(key) if rename else key
                if name in self.where:
                    other = self.where[name]
                    raise CheckpointError(f"tensor {self.stored[name]} in {other.path.name} and tensor {key} in "
                                          f"{f.path.name} both load as {name} ({directory}): remove one of them")
                self.where[name] = f
                self.stored[name] = key
        if weight_map is not None:
            for key, shard in weight_map.items():
                if key not in self.files[shard].header:
                    raise CheckpointError(f"{index} puts tensor {key} in {shard}, whose header has no such tensor: "
                                          "the index does not belong to these shards; fix or re-download it")
        self.directory = directory
        path = directory / "config.json"
        try:
            raw_config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        self.block = config.weight_block_size(raw_config if isinstance(raw_config, dict) else {})

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def describe(self, name: str) -> str:
        """"FILE: tensor STORED" for error messages."""
        return f"{self.where[name].path}: tensor {self.stored[name]}"

    def quantized(self, name: str) -> bool:
        """Whether ``name`` is stored quantized: FP8, or int8 / uint8 (packed FP4) with scales beside it."""
        code = self.where[name].dtype(self.stored[name])
        return code in _FP8_CODES or (code in _FP4_CODES and _scale_name(name) in self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the parameter ``name`` holds: the stored shape, two values a byte for packed FP4."""
        shape = self.where[name].shape(self.stored[name])
        fp4 = self.quantized(name) and self.where[name].dtype(self.stored[name]) in _FP4_CODES
        return (*shape[:-1], 2 * shape[-1]) if fp4 and shape else shape

    def check_dtype(self, name: str, kind: str) -> str:
        """The stored dtype code of ``name`` if a parameter of ``kind`` ("float" or "int") can be loaded from
        it (FP8 or packed FP4 only with float scales beside it); CheckpointError naming the file and the
        tensor."""
        f, stored = self.where[name], self.stored[name]
        code = f.dtype(stored)
        if kind == "int":
            if code not in _INT_CODES:
                raise CheckpointError(f"{self.describe(name)} is stored as {code}, but {name} holds integer ids "
                                      f"({', '.join(_INT_CODES)}): the checkpoint does not match this model; "
                                      "re-export it")
            return code
        if self.quantized(name):
            scale_name = _scale_name(name)
            if scale_name not in self.where:
                raise CheckpointError(f"FP8 tensor {stored} ({f.path}) has no "
                                      f"{self.stored.get(scale_name, scale_name)} block scales: add them or "
                                      "store the weight dequantized")
            scale_code = self.where[scale_name].dtype(self.stored[scale_name])
            if scale_code not in _SCALE_CODES:
                raise CheckpointError(f"{self.describe(scale_name)} is stored as {scale_code}, but block scales "
                                      f"are floats ({', '.join(_SCALE_CODES)}): re-export the checkpoint")
        elif code not in _FLOAT_CODES:
            raise CheckpointError(f"{self.describe(name)} is stored as {code}, but {name} is a floating-point "
                                  f"weight ({', '.join(_FLOAT_CODES)}, {' / '.join(_FP8_CODES)} with "
                                  f"weight_scale_inv block scales, or packed FP4 in {' / '.join(_FP4_CODES)} with "
                                  "weight_scale_inv scales): the checkpoint does not match this model or is corrupt; "
                                  "re-export it")
        return code

    def read(self, name: str, kind: str = "float", rows: slice | None = None) -> np.ndarray | quant.Quantized:
        """A tensor in its integer dtype (``kind`` "int"), as float32 (``kind`` "float", stored as a float
        dtype) or, stored quantized, as a ``quant.Fp8Blocks`` / ``quant.Fp4Values`` of the stored arrays
        (``[...]`` dequantizes it to float32); CheckpointError naming the file and the tensor for another
        dtype, scales that do not fit the values, or non-finite values. ``rows``: only that range of the
        first axis is read (``SafetensorsFile.get``; of a quantized tensor's values and scales alike), and
        checked."""
        f, stored = self.where[name], self.stored[name]
        code = self.check_dtype(name, kind)
        if kind == "int":
            return np.asarray(f.get(stored, rows))
        if not self.quantized(name):
            array = np.asarray(f.get(stored, rows), dtype=np.float32)
            _check_finite(array, self.describe(name))
            return array
        scale_name = _scale_name(name)
        values, scales = f.get(stored, rows), self.where[scale_name].get(self.stored[scale_name], rows)
        _check_finite(np.asarray(scales, np.float32), self.describe(scale_name))
        if code in _FP4_CODES:
            return fp4_values(values, scales, self.describe(name))  # e2m1 has no NaN or Inf
        _check_finite(np.asarray(values, np.float32), self.describe(name))
        return fp8_blocks(values, scales, self.describe(name), self.block)


def _read_index(index: Path, directory: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index: tensor name -> shard file name inside ``directory``."""
    try:
        raw = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {index}: {e}; fix or re-download it (a single-file checkpoint "
                              "needs no index)") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no 'weight_map' object (tensor name -> shard file); fix or "
                              "re-download it (a single-file checkpoint needs no index)")
    for key, shard in weight_map.items():
        parts = PurePosixPath(shard).parts if isinstance(shard, str) else ()
        if (not isinstance(shard, str) or not shard or "\\" in shard or ".." in parts or shard.startswith("/")
                or PureWindowsPath(shard).drive):
            raise CheckpointError(f"{index} maps tensor {key} to shard {shard!r}, which is not a file name inside "
                                  f"{directory}: shard names must be relative to the checkpoint directory, "
                                  "without '..'; fix the index")
    return weight_map


def _check_finite(array: np.ndarray, where: str) -> None:
    """Refuse NaN / Inf values. One float64 sum per tensor: finite float32 values cannot overflow it, and a
    NaN or Inf anywhere makes it non-finite."""
    if array.size and not np.isfinite(array.sum(dtype=np.float64)):
        nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
        first = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise CheckpointError(f"{where} has {nan} NaN and {inf} infinite values (the first at index "
                              f"{list(first)}); a model with them computes NaN logits: the checkpoint is corrupt or "
                              "from a diverged run; re-export it from good weights")


def _scale_name(name: str) -> str:
    return name.removesuffix("weight") + "weight_scale_inv"


def fp8_blocks(w8: np.ndarray, scale: np.ndarray, name: str, block: tuple[int, int] = (128, 128)) -> quant.Fp8Blocks:
    """FP8 ``[out, in]`` weights with ``(bo, bi)`` block scales ``[ceil(out / bo), ceil(in / bi)]``, checked
    (``name`` says where they are), as a float32 ``quant.Fp8Blocks``."""
    if w8.ndim != 2 or scale.ndim != 2:
        raise CheckpointError(f"{name}: FP8 weights with block scales must be 2-d [out, in] with 2-d scales; got "
                              f"weight shape {list(w8.shape)} and weight_scale_inv shape {list(scale.shape)}")
    (out, inp), (block_o, block_i) = w8.shape, block
    if scale.shape != (-(-out // block_o), -(-inp // block_i)):
        raise CheckpointError(f"{name}: weight_scale_inv shape {list(scale.shape)} does not tile weight shape "
                              f"{list(w8.shape)} in {block_o}x{block_i} blocks")
    return quant.Fp8Blocks(w8, scale, block, parts=1, dtype=np.dtype(np.float32))


def fp4_values(packed: np.ndarray, scale: np.ndarray, name: str) -> quant.Fp4Values:
    """Packed FP4 ``[out, in / 2]`` with scales ``[out, in / 32]``, checked (``name`` says where they are),
    as a float32 ``quant.Fp4Values``."""
    if packed.ndim != 2 or (2 * packed.shape[1]) % quant.FP4_GROUP or \
            scale.shape != (packed.shape[0], 2 * packed.shape[1] // quant.FP4_GROUP):
        raise CheckpointError(f"{name}: packed FP4 weights [out, in / 2] need weight_scale_inv [out, in / "
                              f"{quant.FP4_GROUP}] (one per {quant.FP4_GROUP} values of a row); got weight shape "
                              f"{list(packed.shape)} and weight_scale_inv shape {list(scale.shape)}")
    return quant.Fp4Values(packed, scale, dtype=np.dtype(np.float32))


def hf_name(path: tuple) -> str:
    """transformers' parameter name of an NNX state path of one layer's (or no layer's) parameter."""
    if path[0] == "mtp":  # the MTP module is layer num_hidden_layers (its key in ``model.mtp``)
        path = ("layers", *path[1:])
    name = ".".join(str(p) for p in path)
    return name if name.startswith("lm_head.") else "model." + name + (".weight" if path == ("embed_tokens",) else "")


def stacked(path: tuple) -> bool:
    """Whether the parameter at NNX state path ``path`` is a run of layers stacked on a leading axis
    (``models.layers.stack_runs``: path ``("runs", <run_key>, ...)``)."""
    return path[0] == "runs"


def hf_names(path: tuple, shape: tuple[int, ...]) -> list[str]:
    """transformers' names of the parameter at NNX state path ``path`` of ``shape``: its one name, or for a
    stacked run (``stacked``) the name of each layer in it, in the order of the leading axis."""
    if stacked(path):
        return [hf_name(("layers", layer, *path[2:])) for layer in run_layers(path[1], shape[0])]
    return [hf_name(path)]


def _read_param(ckpt: Checkpoint, cfg: ModelConfig, name: str, shape: tuple[int, ...], kind: str,
                experts: slice | None = None) -> np.ndarray | quant.Quantized:
    """The tensor ``name`` (one layer's ``shape``) on the host: stored under that name, tied to the
    embeddings, or stacked from per-expert tensors. ``experts`` (``slice(e0, e1)``): only those routed
    experts, the first axis's rows of a stored tensor or only those experts' own tensors."""
    if name in ckpt:
        return ckpt.read(name, kind, rows=experts)
    if name == "lm_head.weight" and cfg.tie_word_embeddings and "model.embed_tokens.weight" in ckpt:
        return ckpt.read("model.embed_tokens.weight", kind)
    per_expert = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    if per_expert:
        prefix, packed = per_expert.groups()
        parts = ("gate_proj", "up_proj") if packed == "gate_up_proj" else ("down_proj",)
        ids = range(shape[0]) if experts is None else range(experts.start, experts.stop)
        matrices = []
        for e in ids:
            names = [f"{prefix}.{e}.{part}.weight" for part in parts]
            for n in names:
                if n not in ckpt:
                    raise CheckpointError(f"checkpoint {ckpt.directory} has neither {name} nor {n}")
            arrays = [ckpt.read(n, kind) for n in names]
            # expert e's rows: [2F, D] (gate then up) or [D, F]
            want = (shape[1] // len(names), shape[2])
            for n, a in zip(names, arrays):
                if tuple(a.shape) != want:
                    raise CheckpointError(f"{ckpt.describe(n)} has shape {list(a.shape)}, config expects "
                                          f"{list(want)}: the checkpoint does not match its config.json")
            matrices.append(_join(arrays, np.concatenate, [ckpt.describe(n) for n in names]))
        return _join(matrices, np.stack, [f"{prefix}.{e}" for e in ids])
    raise CheckpointError(f"checkpoint {ckpt.directory} is missing tensor {name} (expected shape {list(shape)})")


def _join(arrays: list, combine, where: list[str]):
    """``combine`` (np.concatenate: rows one below the other; np.stack: a new leading axis) of tensors in
    one storage format, quantized ones with their scales (concatenated FP8 matrices become ``parts``)."""
    formats = {_format(a) for a in arrays}
    if len(formats) > 1:
        raise CheckpointError(f"{where[0]} ... {where[-1]} are stored in different formats "
                              f"({', '.join(sorted(formats))}) "
                              "but load as one tensor: store them alike")
    if isinstance(arrays[0], np.ndarray):
        return combine(arrays)
    joined = jax.tree.map(lambda *xs: combine(xs), *arrays)
    if isinstance(joined, quant.Fp8Blocks) and combine is np.concatenate:
        joined = dataclasses.replace(joined, parts=sum(a.parts for a in arrays))
    return joined


def _format(array: np.ndarray | quant.Quantized) -> str:
    if isinstance(array, np.ndarray):
        return "unquantized"
    kind = "FP8" if isinstance(array, quant.Fp8Blocks) else "packed FP4"
    return f"{kind} with {array.scales.dtype} scales"


def load_into(cls, cfg: ModelConfig, directory: Path, dtype, weights: str = "dequantized",
              mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """Build ``cls(cfg, dtype=dtype)`` abstractly (``abstract_module``), then fill every parameter from the checkpoint
    in ``directory``.

    Quantized tensors (FP8 with block scales, packed FP4 with per-32 scales) are dequantized to the
    parameter's dtype with ``weights="dequantized"``; with ``weights="release"`` the parameter holds them
    as stored (``quant.Fp8Blocks`` / ``quant.Fp4Values``), dequantized where the model reads it.
    A stacked run of layers (``stacked``) is read layer by layer under each layer's name and stacked on the
    host before it moves to the device. Everything the headers tell is checked before any tensor is read
    (files, index, unused tensors, each stored parameter's shape and dtype); each tensor's values are checked
    finite as it loads.

    Without ``mesh`` the parameters go to the default device. With it, each is made in its sharding there
    (``ess_jax.mesh.param_sharding``: the routed experts over ``expert``, the rest replicated) from only
    the parts this process's devices hold (``_sharded``): each expert range read once from the files (the
    rows of a packed tensor, or those experts' own tensors; a stacked run's layers each, then stacked), and
    put on every device holding it, so a process of a run of several reads only its experts. ValueError,
    before any tensor is read, when the routed experts do not divide over ``expert``."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not one of {', '.join(WEIGHTS)}")
    abstract = nnx.merge(*abstract_module(cls, cfg, dtype))
    rename = families.get(cfg.family).hf_rename
    ckpt = Checkpoint(directory, rename and functools.partial(rename, layers=cfg.num_hidden_layers))
    if cfg.num_nextn_predict_layers and not _holds_mtp(ckpt, abstract):
        abstract.cfg = cfg = cfg.without_mtp()  # a checkpoint without the MTP module: the model without it
        del abstract.mtp
    graphdef, state = nnx.split(abstract)
    # (path, variable, its names, one name's shape): a stacked run's tensors are each one layer's
    flat = [(path, variable, hf_names(path, variable.shape), tuple(variable.shape)[stacked(path):])
            for path, variable in nnx.to_flat_state(state)]
    # each parameter's sharding on the mesh, so experts that do not divide over it are refused before any read
    shardings = [None if mesh is None else device_mesh.param_sharding(mesh, [str(p) for p in path],
                                                                        tuple(variable.shape))
                 for path, variable, _, _ in flat]
    expected_names = {name for _, _, names, _ in flat for name in names}
    unknown = [ckpt.stored[k] for k in ckpt.where if not _ignorable(k, cfg, expected_names)]
    if unknown:
        raise CheckpointError(f"checkpoint {directory} has tensors this model does not use: {unknown[:5]}"
                              f"{' ...' if len(unknown) > 5 else ''} (a checkpoint of another model or config.json?)")
    _check_indexers(ckpt, cfg, expected_names)
    kinds = {}
    for _, variable, names, expected in flat:
        for name in names:
            kinds[name] = "int" if jnp.issubdtype(variable.dtype, jnp.integer) else "float"
            if name in ckpt:
                ckpt.check_dtype(name, kinds[name])
                _check_shape(ckpt, name, ckpt.shape(name), expected)
    loaded = []
    for (path, variable, names, expected), sharding in zip(flat, shardings):
        read = functools.partial(_read_host, ckpt, cfg, kinds, path, names, expected)
        if sharding is None:
            value = _weights(jax.tree.map(jnp.asarray, _host_value(read(None), variable.dtype)), variable.dtype,
                             weights, _dequantized)
        else:
            value = _weights(_sharded(read, tuple(variable.shape), variable.dtype, sharding), variable.dtype,
                             weights, jax.jit(_dequantized, out_shardings=sharding))
        loaded.append((path, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


@functools.lru_cache(maxsize=16)
def abstract_module(cls, cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph and parameter shapes of ``cls(cfg, dtype=dtype)``, traced once per class, config and dtype (a
    model's construction traces every initializer: seconds)."""
    return nnx.split(nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0))))


def _read_host(ckpt: Checkpoint, cfg: ModelConfig, kinds: dict[str, str], path: tuple, names: list[str],
               expected: tuple[int, ...], experts: slice | None) -> np.ndarray | quant.Quantized:
    """The parameter at ``path`` (transformers ``names``, one name's shape ``expected``) on the host, checked:
    whole (``experts`` None) or only the routed experts ``experts`` of each layer's tensor (its first axis)."""
    shape = expected if experts is None else (experts.stop - experts.start, *expected[1:])
    arrays = []
    for name in names:
        array = _read_param(ckpt, cfg, name, expected, kinds[name], experts)
        _check_shape(ckpt, name, array.shape, shape)
        if name.endswith(".tid2eid") and array.size and (array.min() < 0 or array.max() >= cfg.n_routed_experts):
            raise CheckpointError(f"{ckpt.describe(name)} has expert ids in [{array.min()}, {array.max()}], "
                                  f"outside [0, n_routed_experts={cfg.n_routed_experts})")
        arrays.append(array)
    return _join(arrays, np.stack, names) if stacked(path) else arrays[0]


def _host_value(array: np.ndarray | quant.Quantized, dtype) -> np.ndarray | quant.Quantized:
    """A parameter's host value as it goes to the device: an array in ``dtype`` (converted as
    ``jnp.asarray`` converts host arrays), a quantized tensor in its stored dtypes (as jax holds them)."""
    if isinstance(array, np.ndarray):
        return np.asarray(array, dtype)
    return jax.tree.map(lambda x: np.asarray(x, jax.dtypes.canonicalize_dtype(x.dtype)), array)


def _sharded(read, shape: tuple[int, ...], dtype, sharding: jax.sharding.NamedSharding):
    """The parameter of ``shape`` made in ``sharding`` (an array, or a quantized tensor with each of its
    arrays made so) from the host parts that this process's devices hold, ``read(experts)``: the expert
    range (first axis of each layer's tensor) of the sharding's ``expert`` axis, or None (a replicated
    parameter: the whole). Each range is read once; devices holding the same one (replicas over ``data``)
    get the same host part, and the parts are dropped once the parameter is made."""
    axis = sharding.spec.index("expert") if "expert" in sharding.spec else None
    parts = {}

    def part(index: tuple[slice, ...]):
        experts = None if axis is None else slice(*index[axis].indices(shape[axis])[:2])
        key = None if experts is None else (experts.start, experts.stop)
        if key not in parts:
            parts[key] = _host_value(read(experts), dtype)
        return parts[key]

    first = part(next(iter(sharding.addressable_devices_indices_map(shape).values())))
    leaves, treedef = jax.tree.flatten(first)
    whole = [leaf.shape if axis is None else (*leaf.shape[:axis], shape[axis], *leaf.shape[axis + 1:])
             for leaf in leaves]
    return jax.tree.unflatten(treedef, [
        jax.make_array_from_callback(leaf_shape, sharding, lambda index, i=i: jax.tree.leaves(part(index))[i])
        for i, leaf_shape in enumerate(whole)])


def _weights(value, dtype, weights: str, dequantize):
    """A parameter's device value as the parameter holds it: an array as it is; a quantized tensor (its
    stored arrays) kept, read as ``dtype`` (``weights="release"``), or ``dequantize``d to ``dtype``."""
    if not isinstance(value, quant.Quantized):
        return value
    kept = dataclasses.replace(value, dtype=dtype)
    return kept if weights == "release" else dequantize(kept)


def _dequantized(value: quant.Quantized) -> jax.Array:
    return value[...]


def _check_shape(ckpt: Checkpoint, name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != expected:
        where = ""
        if name in ckpt:
            stored = ckpt.stored[name]
            where = f" (in {ckpt.where[name].path}{'' if stored == name else f', stored as {stored}'})"
        raise CheckpointError(f"tensor {name} has shape {list(shape)}, config expects {list(expected)}{where}: the "
                              "checkpoint does not match its config.json")


def hf_tensors(params: nnx.State) -> dict[str, np.ndarray]:
    """A parameter state's values (dequantized) by transformers name, each stacked run's layers apart."""
    tensors = {}
    for path, variable in nnx.to_flat_state(params):
        value = np.asarray(variable[...])
        for i, name in enumerate(hf_names(path, value.shape)):
            tensors[name] = np.ascontiguousarray(value[i] if stacked(path) else value)
    return tensors


def save(params: nnx.State, raw_config: dict, directory: Path) -> Path:
    """Write a model's parameter state as a transformers 5 checkpoint in ``directory``:
    ``model.safetensors`` (transformers' names, experts packed as ``gate_up_proj`` / ``down_proj``,
    which both families' transformers classes load as they are; floats as float32, buffers such as
    ``tid2eid`` in their own dtype) and ``config.json`` (``raw_config`` with its family's
    ``architectures``)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: value if value.dtype.kind in "iub" else value.astype(np.float32)
               for name, value in hf_tensors(params).items()}
    tmp = directory / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(directory / "model.safetensors")
    family = families.get(raw_config["model_type"])
    config = dict(raw_config, architectures=[family.architecture], dtype="float32")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _stored(ckpt: Checkpoint, name: str) -> bool:
    """Whether the checkpoint holds parameter ``name``: under its name, or as per-expert tensors."""
    packed = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    return name in ckpt or bool(packed and f"{packed.group(1)}.0.{packed.group(2).split('_')[0]}_proj.weight" in ckpt)


def _holds_mtp(ckpt: Checkpoint, abstract: nnx.Module) -> bool:
    """Whether the checkpoint holds the model's MTP module: False if none of its tensors; CheckpointError naming
    a missing one if some."""
    names = [name for path, variable in nnx.to_flat_state(nnx.state(abstract.mtp))
             for name in hf_names(("mtp", *path), tuple(variable.shape))]
    held = [name for name in names if _stored(ckpt, name)]
    if held and len(held) < len(names):
        missing = next(name for name in names if name not in held)
        raise CheckpointError(f"checkpoint {ckpt.directory} holds part of the MTP module ({ckpt.describe(held[0])}, "
                              f"{len(held)} of its {len(names)} tensors) but not {missing}: add the missing tensors, "
                              "or remove the MTP layer's tensors to load the model without it")
    return bool(held)


_INDEXER = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(compressor\.)?indexer\.")


def _check_indexers(ckpt: Checkpoint, cfg: ModelConfig, expected: set[str]) -> None:
    """Every full layer's indexer (Index Share, ``ModelConfig.indexer_types``) is in the checkpoint: CheckpointError
    naming the first layer whose indexer is missing (a checkpoint of a shared layout, or another pattern)."""
    for name in sorted(expected, key=lambda n: int(_INDEXER.match(n).group(1)) if _INDEXER.match(n) else -1):
        match = _INDEXER.match(name)
        if match and int(match.group(1)) < cfg.num_hidden_layers and not _stored(ckpt, name):
            raise CheckpointError(
                f"checkpoint {ckpt.directory} has no indexer for layer {match.group(1)} ({name} is missing), a full "
                f"layer of the Index Share pattern {cfg.index_pattern}: serve it with the checkpoint's own pattern "
                "(its config.json's indexer_types / index_topk_pattern), or a --index-share whose full layers have "
                "indexers")


def _ignorable(key: str, cfg: ModelConfig, expected: set[str]) -> bool:
    if key in expected or key.endswith("weight_scale_inv"):
        return True
    indexer = _INDEXER.match(key)
    if indexer and int(indexer.group(1)) < cfg.num_hidden_layers:
        return not cfg.indexer_full(int(indexer.group(1)))  # a shared layer's (Index Share): not read
    if re.match(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", key):
        return True  # per-expert release names, stacked at load
    layer = _LAYER.match(key)
    if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
        # the MTP layer of a model without it; the release's copies of the shared embedding and head
        return int(layer.group(1)) >= cfg.num_hidden_layers + cfg.num_nextn_predict_layers or key.endswith(_MTP_COPIES)
    return key == "model.embed_tokens.weight" or key.endswith("rotary_emb.inv_freq")

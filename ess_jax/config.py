"""One frozen model configuration, read from a HuggingFace ``config.json`` or a preset.

Field names and defaults follow transformers' ``DeepseekV32Config`` / ``DeepseekV4Config`` so a
checkpoint's config.json maps onto it without translation; each family gets its own transformers
defaults for the keys a config.json leaves out (``from_hf_dict``). Unknown keys in config.json are
ignored (HF writes many that do not affect the forward pass); a missing ``model_type`` or one we do
not serve is an error. Each family's parser and checks are here, by ``model_type``: this module imports
nothing of ess_jax (``ess_jax.families`` imports it).

``resolve_model`` says what a model name is (a shipped checkpoint, a checkpoint directory or a preset),
for every entry point that takes one.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, Callable, NamedTuple

PRESETS = ("tiny-v32", "deepseek-v3.2", "tiny-v4", "deepseek-v4-flash", "deepseek-v4-pro")
# Trained checkpoints shipped as package data (ess_jax.checkpoints; tools/train_tiny.sh made them):
# the tiny presets' shapes with a 4096-token BPE, trained on the Python standard library's sources.
CHECKPOINTS = ("tiny-v32-code", "tiny-v4-code")


def shipped_checkpoint(name: str) -> Path:
    """The directory of a shipped checkpoint (``CHECKPOINTS``)."""
    if name not in CHECKPOINTS:
        raise ConfigError(f"unknown shipped checkpoint {name!r}; shipped: {', '.join(CHECKPOINTS)}")
    return Path(str(resources.files("ess_jax.checkpoints").joinpath(name)))


class ConfigError(ValueError):
    """A config.json or preset that cannot describe a model we serve."""


# ---- validation --------------------------------------------------------------------------------
# Every field the families read, by kind, in one table: ``check_raw`` checks a config.json's values before
# the parsers convert anything, ``check_fields`` the constructed ModelConfig (also one built directly), so a
# bad value is refused with its name and value before any array exists. The families' checks (``check_v32``,
# ``check_v4``) then relate fields to each other. Kinds: ("int", lo): an integer (not a bool) >= lo;
# ("num", lo, strict): a finite number > lo (strict) or >= lo; "frac": a number in (0, 1]; "bool"; "str";
# ("list", kind): a list (a tuple once constructed) whose items have that kind; "dict"; "eos": an id or a list.

_KINDS: dict[str, Any] = {
    **{k: ("int", 1) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "num_attention_heads",
        "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
        "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts", "num_local_experts",
        "num_experts_per_tok", "n_group", "topk_group", "head_dim", "compress_rate_csa", "compress_rate_hca",
        "sliding_window", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters")},
    **{k: ("int", 0) for k in ("q_lora_rank", "qk_rope_head_dim", "n_shared_experts", "first_k_dense_replace",
                               "num_hash_layers", "bos_token_id", "pad_token_id", "num_nextn_predict_layers")},
    **{k: ("num", 0, True) for k in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta",
                                     "routed_scaling_factor")},
    "swiglu_limit": ("num", 0, False),
    "partial_rotary_factor": "frac",
    "tie_word_embeddings": "bool", "norm_topk_prob": "bool",
    "model_type": "str", "scoring_func": "str",
    "mlp_layer_types": ("list", "str"), "layer_types": ("list", "str"), "compress_ratios": ("list", ("int", 0)),
    "mtp_layer_types": ("list", "str"), "indexer_types": ("list", "str"),
    "index_topk_freq": ("int", 1), "index_skip_topk_offset": ("int", 0), "index_topk_pattern": "str",
    "compress_rates": "dict", "quantization_config": "dict", "rope_parameters": "dict", "rope_scaling": "dict",
    "eos_token_id": "eos",
}
# keys only one family reads (the other ignores them, whatever they hold)
_V32_ONLY_KEYS = frozenset({"kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
                            "first_k_dense_replace"})
_V4_ONLY_KEYS = frozenset({"compress_rates", "compress_ratios", "num_hash_layers", "partial_rotary_factor",
                           "compress_rope_theta"})  # and V4_ONLY_FIELDS
_ROPE_KINDS: dict[str, Any] = {
    "rope_type": "str", "type": "str", "rope_theta": ("num", 0, True), "factor": ("num", 0, True),
    "original_max_position_embeddings": ("int", 1), "beta_fast": ("num", None, False),
    "beta_slow": ("num", None, False), "mscale": ("num", None, False), "mscale_all_dim": ("num", None, False),
    "attention_factor": ("num", 0, True), "truncate": "bool",
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_value(name: str, value: Any, kind: Any) -> None:
    """Raise ConfigError naming ``name`` and ``value`` unless ``value`` has ``kind`` (see ``_KINDS``)."""
    def bad(want: str):
        raise ConfigError(f"config field {name}={_short(value)} must be {want}")

    if kind == "bool":
        if not isinstance(value, bool):
            bad("true or false")
    elif kind == "str":
        if not isinstance(value, str):
            bad("a string")
    elif kind == "dict":
        if not isinstance(value, dict):
            bad("a JSON object")
    elif kind == "frac":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            bad("a number in (0, 1]")
    elif kind == "eos":
        ids = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            bad("a token id (an integer >= 0) or a list of them")
    elif kind[0] == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            bad(f"an integer >= {kind[1]}")
        if value < kind[1]:
            bad(f">= {kind[1]}")
    elif kind[0] == "num":
        lo, strict = kind[1], kind[2]
        want = "a finite number" + ("" if lo is None else f" {'>' if strict else '>='} {lo}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            bad(want)
        if lo is not None and (value <= lo if strict else value < lo):
            bad(want)
    elif kind[0] == "list":
        if not isinstance(value, (list, tuple)):
            bad("a list")
        for i, item in enumerate(value):
            check_value(f"{name}[{i}]", item, kind[1])
    else:  # pragma: no cover - a kind missing from this function
        raise AssertionError(kind)


def check_raw(raw: dict[str, Any], skip: frozenset[str]) -> None:
    """The values of a config.json that a family's parser reads (those present and not null, but the
    other family's keys ``skip``), by kind."""
    for key, kind in _KINDS.items():
        if key not in skip and raw.get(key) is not None:
            check_value(key, raw[key], kind)
    weight_block_size(raw)


def weight_block_size(raw: dict[str, Any]) -> tuple[int, int]:
    """The FP8 block shape of a config.json's ``quantization_config`` (default 128 x 128)."""
    quant = raw.get("quantization_config")
    if quant is None:
        return (128, 128)
    check_value("quantization_config", quant, "dict")
    block = quant.get("weight_block_size")
    if block is None:
        return (128, 128)
    check_value("quantization_config.weight_block_size", block, ("list", ("int", 1)))
    if len(block) != 2:
        raise ConfigError(f"config field quantization_config.weight_block_size={_short(block)} must be two "
                          "block dimensions [out, in]")
    return (block[0], block[1])


def check_fields(cfg: ModelConfig) -> None:
    """Every field of a constructed config by kind (the same table as config.json's values)."""
    for field in dataclasses.fields(cfg):
        kind = _KINDS.get(field.name)
        value = getattr(cfg, field.name)
        if field.name in ("bos_token_id", "pad_token_id") and value is None:
            continue
        if field.name in ("rope", "compress_rope"):
            if not isinstance(value, RopeConfig):
                raise ConfigError(f"config field {field.name}={_short(value)} must be a RopeConfig")
            continue
        if field.name == "eos_token_id" and not isinstance(value, tuple):
            raise ConfigError(f"config field eos_token_id={_short(value)} must be a tuple of token ids")
        if field.name in ("mlp_layer_types", "layer_types", "mtp_layer_types", "indexer_types") and not isinstance(
                value, tuple):
            raise ConfigError(f"config field {field.name}={_short(value)} must be a tuple of strings")
        if kind is not None:
            check_value(field.name, value, kind)


def check_tokens(cfg: ModelConfig) -> None:
    """The special token ids lie inside the vocabulary."""
    named = [("bos_token_id", cfg.bos_token_id), ("pad_token_id", cfg.pad_token_id)]
    named += [("eos_token_id", t) for t in cfg.eos_token_id]
    for name, token in named:
        if token is not None and not 0 <= token < cfg.vocab_size:
            raise ConfigError(f"config field {name}={token} is outside the vocabulary [0, vocab_size={cfg.vocab_size})")


def check_rope(rope: RopeConfig) -> None:
    kinds = {"rope_type": "str", "theta": ("num", 0, True), "factor": ("num", 0, True),
             "beta_fast": ("num", None, False), "beta_slow": ("num", None, False), "truncate": "bool"}
    for name, kind in kinds.items():
        check_value(f"rope.{name}", getattr(rope, name), kind)
    if rope.original_max_position_embeddings is not None:
        check_value("rope.original_max_position_embeddings", rope.original_max_position_embeddings, ("int", 1))
    for name in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(rope, name) is not None:
            check_value(f"rope.{name}", getattr(rope, name), ("num", None, False))


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters``), rope_type 'default' or 'yarn'."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        check_rope(self)

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, rope_theta: float, max_position_embeddings: int,
                where: str = "rope_parameters") -> RopeConfig:
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"config field {where}={params!r} must be a JSON object")
        params = dict(params or {})
        for key, kind in _ROPE_KINDS.items():
            if params.get(key) is not None:
                check_value(f"{where}.{key}", params[key], kind)
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", rope_theta))
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type != "yarn":
            raise ConfigError(f"{where}.rope_type={rope_type!r} is not supported (use 'default' or 'yarn')")
        if params.get("factor") is None:
            raise ConfigError(f"{where}.factor is required for rope_type 'yarn'")
        return cls(
            rope_type="yarn",
            theta=theta,
            factor=float(params["factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or max_position_embeddings
            ),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    @property
    def cos_sin_scale(self) -> float:
        """The factor YaRN multiplies cos / sin by (HF's ``attention_scaling``)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor, 1.0)

    @property
    def softmax_mscale(self) -> float:
        """The factor the MLA softmax scale is multiplied by (mscale_all_dim squared; 1 without YaRN)."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek sparse-attention model. Defaults are DeepSeek-V3.2's 671B shape."""

    model_type: str = "deepseek_v32"
    vocab_size: int = 129280
    hidden_size: int = 7168
    num_hidden_layers: int = 61
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    # multi-token prediction (DOMAIN.md 1.6): MTP modules after the decoder layers, 0 or 1 (models/mtp.py)
    num_nextn_predict_layers: int = 0
    # mla
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope: RopeConfig = RopeConfig()
    # index
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    # Index Share (DOMAIN.md 1.7): per indexed layer (``index_layers``: V3.2 every layer, V4 the CSA layers)
    # "full" (runs its indexer) or "shared" (reuses the nearest preceding full layer's top-k); () = all full
    indexer_types: tuple[str, ...] = ()
    # mlp / moe
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    mlp_layer_types: tuple[str, ...] = ()
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    scoring_func: str = "sigmoid"
    # deepseek_v4 only (DOMAIN.md 2): attention types, compressors, grouped output, mHC, clamped SwiGLU
    head_dim: int = 512
    layer_types: tuple[str, ...] = ()
    mtp_layer_types: tuple[str, ...] = ()  # the MTP blocks' attention (the schedule's entries past the layers)
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    sliding_window: int = 128
    compress_rope: RopeConfig = RopeConfig()
    o_groups: int = 8
    o_lora_rank: int = 1024
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0

    def __post_init__(self):
        check_fields(self)
        _family(self.model_type).check(self)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.model_type

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width W of one cached latent row: kv_lora_rank (C) + qk_rope_head_dim (R)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale

    @property
    def index_layers(self) -> list[int]:
        """The layers with a lightning indexer (V3.2: every layer; V4: the CSA layers), in order."""
        if self.family == "deepseek_v4":
            return [i for i, kind in enumerate(self.layer_types) if kind == V4Layer.CSA]
        return list(range(self.num_hidden_layers))

    def indexer_full(self, layer: int) -> bool:
        """Whether ``layer`` runs its own indexer (a full layer of ``indexer_types``; False for a layer without one)."""
        layers = self.index_layers
        return layer in layers and self.indexer_types[layers.index(layer)] == "full"

    @property
    def index_pattern(self) -> str:
        """``indexer_types`` as a pattern string, one letter per indexed layer: F (full) or S (shared)."""
        return "".join("F" if kind == "full" else "S" for kind in self.indexer_types)

    def with_index_share(self, spec: str | None) -> ModelConfig:
        """This config with the Index Share pattern ``spec`` (``index_share_types``); None: unchanged."""
        if spec is None:
            return self
        return dataclasses.replace(self, indexer_types=index_share_types(spec, len(self.index_layers)))

    def without_mtp(self) -> ModelConfig:
        """This config without its MTP module (a checkpoint that does not hold it)."""
        return dataclasses.replace(self, num_nextn_predict_layers=0, mtp_layer_types=())

    def mtp_block(self) -> ModelConfig:
        """The config of a one-layer model whose layer is the MTP module's decoder block: its attention
        (V4: ``mtp_layer_types[0]``) and a routed MoE (the block sits past the dense / hash-routed layers),
        so the family's decoder layer, cache and cache parts serve the block as they serve layer 0."""
        if not self.num_nextn_predict_layers:
            raise ValueError("this config has no MTP module (num_nextn_predict_layers=0)")
        if self.family == "deepseek_v4":
            return dataclasses.replace(self.without_mtp(), num_hidden_layers=1, layer_types=self.mtp_layer_types[:1],
                                       mlp_layer_types=("moe",), indexer_types=())
        # the MTP block keeps its own indexer (DOMAIN.md 1.6, 1.7)
        return dataclasses.replace(self.without_mtp(), num_hidden_layers=1, mlp_layer_types=("sparse",),
                                   indexer_types=())

    # ---- construction --------------------------------------------------------------------------
    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of a deepseek_v4 layer (0 for sliding-window-only layers)."""
        return {V4Layer.SLIDING: 0, V4Layer.CSA: self.compress_rate_csa,
                V4Layer.HCA: self.compress_rate_hca}[self.layer_types[layer]]

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"a config must be a JSON object of fields, got {type(raw).__name__} {_short(raw)}")
        if "model_type" not in raw:
            raise ConfigError("config.json has no 'model_type' (expected 'deepseek_v32' or 'deepseek_v4')")
        if not isinstance(raw["model_type"], str):
            raise ConfigError(f"config field model_type={_short(raw['model_type'])} must be a string "
                              "('deepseek_v32' or 'deepseek_v4')")
        cfg = _family(raw["model_type"]).parse(cls, raw)
        check_tokens(cfg)  # a config.json's special ids (a config built in code may leave them out of range)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        raw = read_json(path)
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        return cls.from_hf_dict(preset_dict(name))


def read_json(path: str | Path) -> Any:
    """A config.json file's contents; ConfigError naming the path when it is missing, a directory or not JSON."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a config.json file")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def preset_dict(name: str) -> dict[str, Any]:
    """A preset's config.json as a dict (``configs/NAME.json``)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (or pass a checkpoint directory)")
    return json.loads(resources.files("ess_jax.configs").joinpath(f"{name}.json").read_text())


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a model name resolves to (``resolve_model``): a checkpoint directory (config.json, *.safetensors,
    perhaps tokenizer.json; a shipped checkpoint's lies in the package) or a preset (a config, no weights)."""

    name: str  # a shipped checkpoint's or a preset's name, or the checkpoint directory
    checkpoint: Path | None  # the checkpoint directory; None: the preset ``name``
    index_share: str | None = None  # an Index Share pattern overriding the config's (``index_share_types``)

    def raw_config(self) -> dict[str, Any]:
        """The config.json as a dict."""
        return preset_dict(self.name) if self.checkpoint is None else read_json(self.checkpoint / "config.json")

    def config(self) -> ModelConfig:
        if self.checkpoint is None:
            return ModelConfig.from_preset(self.name).with_index_share(self.index_share)
        return ModelConfig.from_json(self.checkpoint / "config.json").with_index_share(self.index_share)


def resolve_model(name: str | Path, index_share: str | None = None) -> ModelSource:
    """A shipped checkpoint's name (``CHECKPOINTS``), a checkpoint directory or a preset's name (``PRESETS``),
    looked for in that order; ConfigError naming the three for anything else. ``index_share``: an Index Share
    pattern served instead of the config's (``--index-share``: "every-N" or F / S letters)."""
    name = str(name)
    if name in CHECKPOINTS:
        return ModelSource(name, shipped_checkpoint(name), index_share)
    if Path(name).is_dir():
        return ModelSource(str(Path(name)), Path(name), index_share)
    if name in PRESETS:
        return ModelSource(name, None, index_share)
    raise ConfigError(f"{name!r} is neither a shipped checkpoint ({', '.join(CHECKPOINTS)}), a preset "
                      f"({', '.join(PRESETS)}) nor a checkpoint directory")


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's ``eos_token_id`` (an id, a list or null; default 1) as a tuple."""
    eos = raw.get("eos_token_id", 1)
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)


def _require(checks: list[tuple[bool, str]]) -> None:
    """ConfigError with the message of the first check that fails."""
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


# ---- Index Share (DOMAIN.md 1.7) ---------------------------------------------------------------

INDEXER_TYPES = ("full", "shared")
_LETTERS = {"F": "full", "S": "shared"}


def index_share_types(spec: str, layers: int, where: str = "--index-share") -> tuple[str, ...]:
    """The ``indexer_types`` of ``layers`` indexed layers that ``spec`` names: a pattern of one letter per
    indexed layer, F (full: runs its indexer) or S (shared: reuses the nearest preceding full layer's top-k), or
    "every-N" (layers 0, N, 2N, ... full: the uniform pattern a distilled model serves)."""
    if not isinstance(spec, str):
        raise ConfigError(f"{where}={_short(spec)} must be a pattern string of F / S letters or 'every-N'")
    if spec.startswith("every-"):
        every = spec.removeprefix("every-")
        if not every.isdigit() or int(every) < 1:
            raise ConfigError(f"{where}={spec!r}: 'every-N' needs an integer N >= 1 (every-1: no sharing)")
        return tuple("full" if i % int(every) == 0 else "shared" for i in range(layers))
    for i, letter in enumerate(spec):
        if letter not in _LETTERS:
            raise ConfigError(f"{where}={_short(spec)}: letter {letter!r} at indexed layer {i} is neither F (full) "
                              "nor S (shared)")
    if len(spec) != layers:
        raise ConfigError(f"{where}={_short(spec)} has {len(spec)} letters for the model's {layers} indexed "
                          "layers (DeepSeek-V3.2: every layer; DeepSeek-V4: the CSA layers)")
    return tuple(_LETTERS[letter] for letter in spec)


def raw_indexer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    """A config.json's Index Share schedule for its ``layers`` indexed layers, from the keys the peers read: GLM-5.2's
    ``indexer_types`` list, else vLLM's ``index_topk_pattern`` string, else ``index_topk_freq`` with
    ``index_skip_topk_offset`` (default 2), by the reference formula: layer ``i`` is full iff
    ``max(i - offset + 1, 0) % freq == 0`` -- with the default offset layers 0 *and* 1 are full, and GLM-5.2's
    freq 4, offset 3 makes 21 of its 78 layers full. An explicit list or pattern is authoritative; given both,
    they must agree. None of them: () (every layer full)."""
    types, pattern = raw.get("indexer_types"), raw.get("index_topk_pattern")
    if types is not None:
        bad = [(i, t) for i, t in enumerate(types) if t not in INDEXER_TYPES]
        if bad:
            raise ConfigError(f"config field indexer_types[{bad[0][0]}]={bad[0][1]!r} is neither 'full' nor 'shared'")
        if len(types) != layers:
            raise ConfigError(f"config field indexer_types has {len(types)} entries for the model's {layers} indexed "
                              "layers (DeepSeek-V3.2: every layer; DeepSeek-V4: the CSA layers)")
        if pattern is not None and index_share_types(pattern, layers, "index_topk_pattern") != tuple(types):
            raise ConfigError(f"config fields indexer_types and index_topk_pattern={_short(pattern)} disagree: "
                              "keep one of them")
        return tuple(types)
    if pattern is not None:
        return index_share_types(pattern, layers, "index_topk_pattern")
    freq, offset = raw.get("index_topk_freq"), raw.get("index_skip_topk_offset")
    if freq is None or freq == 1:
        return ()
    offset = 2 if offset is None else offset
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))


def check_index_share(cfg: ModelConfig) -> None:
    """Fills the default ``indexer_types`` (every indexed layer full), then checks it: one entry per indexed layer,
    each "full" or "shared", the first full (a shared layer reuses a preceding full layer's top-k)."""
    layers = len(cfg.index_layers)
    if not cfg.indexer_types:
        object.__setattr__(cfg, "indexer_types", ("full",) * layers)
    for i, kind in enumerate(cfg.indexer_types):
        _require([(kind in INDEXER_TYPES, f"indexer_types[{i}]={_short(kind)} is neither 'full' nor 'shared'")])
    _require([
        (len(cfg.indexer_types) == layers,
         f"indexer_types has {len(cfg.indexer_types)} entries for the model's {layers} indexed layers (DeepSeek-V3.2: "
         "every layer; DeepSeek-V4: the CSA layers)"),
        (not layers or cfg.indexer_types[0] == "full",
         "indexer_types starts with a shared layer: the first indexed layer must be full (a shared layer reuses the "
         "nearest preceding full layer's top-k)"),
    ])


# ---- deepseek_v32 ------------------------------------------------------------------------------

def v32_from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
    """A ``DeepseekV32Config`` config.json -> ModelConfig."""
    check_raw(raw, _V4_ONLY_KEYS | V4_ONLY_FIELDS)
    names = ({f.name for f in dataclasses.fields(cls)} - {"rope", "eos_token_id", "mlp_layer_types", "indexer_types"}
             - V4_ONLY_FIELDS)
    kwargs = {k: raw[k] for k in names if raw.get(k) is not None}
    if raw.get("num_experts") is not None:
        kwargs["n_routed_experts"] = raw["num_experts"]
    if raw.get("num_local_experts") is not None:
        kwargs["n_routed_experts"] = raw["num_local_experts"]
    kwargs["eos_token_id"] = _eos_ids(raw)
    layers = int(raw.get("num_hidden_layers", cls.num_hidden_layers))
    if raw.get("mlp_layer_types"):
        kwargs["mlp_layer_types"] = tuple(raw["mlp_layer_types"])
    else:
        dense = min(int(raw.get("first_k_dense_replace", 3)), layers)
        kwargs["mlp_layer_types"] = ("dense",) * dense + ("sparse",) * (layers - dense)
    kwargs["indexer_types"] = raw_indexer_types(raw, layers)
    rope_params = raw.get("rope_parameters") or raw.get("rope_scaling")
    kwargs["rope"] = RopeConfig.from_hf(
        rope_params, float(raw.get("rope_theta", 10000.0)), int(raw.get("max_position_embeddings", 163840))
    )
    return cls(**kwargs)


def check_mtp(cfg: ModelConfig) -> None:
    """At most one MTP module (DeepSeek's releases have one; a second depth would chain on the first's hidden
    states at training time, which ``models.mtp`` does not build)."""
    _require([(cfg.num_nextn_predict_layers <= 1,
               f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: ess_jax builds one MTP module (DeepSeek's "
               "releases have 1); set it to 1 or 0")])


def check_v32(cfg: ModelConfig) -> None:
    """Fills the default ``mlp_layer_types`` (3 dense layers, then MoE), then checks the config."""
    check_mtp(cfg)
    check_index_share(cfg)
    if not cfg.mlp_layer_types:
        dense = min(3, cfg.num_hidden_layers)
        object.__setattr__(cfg, "mlp_layer_types", ("dense",) * dense + ("sparse",) * (cfg.num_hidden_layers - dense))
    checks = [
        (len(cfg.mlp_layer_types) == cfg.num_hidden_layers,
         f"mlp_layer_types has {len(cfg.mlp_layer_types)} entries for num_hidden_layers={cfg.num_hidden_layers}"),
        (set(cfg.mlp_layer_types) <= {"dense", "sparse"},
         f"mlp_layer_types={cfg.mlp_layer_types} must be 'dense' or 'sparse'"),
        (cfg.n_group >= 1 and cfg.n_routed_experts % cfg.n_group == 0,
         f"n_routed_experts={cfg.n_routed_experts} is not divisible by n_group={cfg.n_group}"),
        (1 <= cfg.topk_group <= cfg.n_group, f"topk_group={cfg.topk_group} must be in [1, n_group={cfg.n_group}]"),
        (cfg.n_group == 1 or cfg.n_routed_experts // cfg.n_group >= 2,
         "group-limited routing needs at least 2 experts per group (n_routed_experts / n_group >= 2)"),
        (cfg.num_experts_per_tok <= cfg.topk_group * (cfg.n_routed_experts // cfg.n_group),
         f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts in topk_group={cfg.topk_group} groups"),
        (cfg.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even"),
        (cfg.qk_rope_head_dim <= cfg.index_head_dim,
         f"index_head_dim={cfg.index_head_dim} must be >= qk_rope_head_dim={cfg.qk_rope_head_dim}"),
        (cfg.index_topk >= 1, f"index_topk={cfg.index_topk} must be >= 1"),
        (cfg.q_lora_rank > 0, "q_lora_rank must be set (DeepSeek-V3.2 always uses the q LoRA)"),
    ]
    _require(checks)


# ---- deepseek_v4 -------------------------------------------------------------------------------

V4_ONLY_FIELDS = frozenset({"head_dim", "layer_types", "mtp_layer_types", "compress_rate_csa", "compress_rate_hca",
                            "sliding_window", "compress_rope", "o_groups", "o_lora_rank", "hc_mult",
                            "hc_sinkhorn_iters", "hc_eps", "swiglu_limit"})


class V4Layer(enum.StrEnum):
    """A DeepSeek-V4 layer's attention: config.json's ``layer_types`` values (strings compare equal)."""

    SLIDING = "sliding_attention"
    CSA = "compressed_sparse_attention"
    HCA = "heavily_compressed_attention"


V4_LAYER_TYPES = tuple(kind.value for kind in V4Layer)
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")
V4_SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_V4_RATIO_TO_LAYER_TYPE = {0: V4Layer.SLIDING, 4: V4Layer.CSA, 128: V4Layer.HCA}

# transformers' DeepseekV4Config defaults (V4-Flash shapes) for keys a config.json leaves out.
_V4_HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=1048576,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8,
    o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6, bos_token_id=0,
    pad_token_id=None, tie_word_embeddings=False,
)


def v4_from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
    """A ``DeepseekV4Config`` config.json (modern or legacy keys) -> ModelConfig, as transformers 5.23 reads it."""
    check_raw(raw, _V32_ONLY_KEYS)
    for key, value in (raw.get("compress_rates") or {}).items():
        check_value(f"compress_rates.{key}", value, ("int", 1))
    kwargs = dict(_V4_HF_DEFAULTS)
    kwargs.update({k: raw[k] for k in _V4_HF_DEFAULTS if raw.get(k) is not None})
    if raw.get("moe_intermediate_size") is None and raw.get("intermediate_size") is not None:
        kwargs["moe_intermediate_size"] = raw["intermediate_size"]  # HF attribute_map alias
    for alias in ("num_local_experts", "num_experts"):
        if raw.get(alias) is not None and raw.get("n_routed_experts") is None:
            kwargs["n_routed_experts"] = raw[alias]
    kwargs["intermediate_size"] = kwargs["moe_intermediate_size"]  # the shared expert's width
    kwargs["n_group"] = kwargs["topk_group"] = 1  # V4 routes without expert groups
    kwargs["eos_token_id"] = _eos_ids(raw)
    n = int(kwargs["num_hidden_layers"])

    rates = dict(raw.get("compress_rates") or {})
    csa = raw.get("compress_rate_csa", rates.get(V4Layer.CSA, 4))
    hca = raw.get("compress_rate_hca", rates.get(V4Layer.HCA, 128))
    kwargs["compress_rate_csa"], kwargs["compress_rate_hca"] = csa, hca

    if raw.get("layer_types") is not None:
        layer_types = list(raw["layer_types"])
    elif raw.get("compress_ratios") is not None:
        bad = [r for r in raw["compress_ratios"] if r not in _V4_RATIO_TO_LAYER_TYPE]
        if bad:
            raise ConfigError(f"compress_ratios entries must be 0, 4 or 128; got {bad}")
        layer_types = [_V4_RATIO_TO_LAYER_TYPE[r] for r in raw["compress_ratios"]]
    else:  # transformers' fallback: 2 x HCA, then HCA / CSA alternating (HCA at layer 2)
        layer_types = [V4Layer.HCA] * min(n, 2) + [V4Layer.CSA if i % 2 else V4Layer.HCA for i in range(max(n - 2, 0))]
    kwargs["layer_types"] = tuple(str(kind) for kind in layer_types[:n])  # plain strings, as config.json has them
    # the MTP blocks' attention: the schedule's entries past the layers (both releases: sliding); default sliding
    mtp = int(raw.get("num_nextn_predict_layers") or 0)
    kwargs["num_nextn_predict_layers"] = mtp
    kwargs["mtp_layer_types"] = tuple(str(kind) for kind in (layer_types[n:] + [V4Layer.SLIDING] * mtp)[:mtp])
    if raw.get("mlp_layer_types") is not None:
        mlp_types = list(raw["mlp_layer_types"])
    else:
        n_hash = raw.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    kwargs["mlp_layer_types"] = tuple(mlp_types[:n])
    kwargs["indexer_types"] = raw_indexer_types(raw, kwargs["layer_types"].count(V4Layer.CSA))

    head_dim = int(kwargs["head_dim"])
    if raw.get("partial_rotary_factor") is not None:
        partial = float(raw["partial_rotary_factor"])
    elif raw.get("qk_rope_head_dim") is not None:
        partial = int(raw["qk_rope_head_dim"]) / head_dim
    else:
        partial = 64 / 512
    kwargs["qk_rope_head_dim"] = int(head_dim * partial)

    max_pos = int(kwargs["max_position_embeddings"])
    rope_theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if "main" in params or "compress" in params:
        for key in ("main", "compress"):
            if not isinstance(params.get(key), dict):
                raise ConfigError(f"config field rope_parameters.{key}={_short(params.get(key))} must be a JSON "
                                  "object (rope_parameters has 'main' and 'compress', or neither)")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:  # one flat dict: it describes the compress rope (YaRN), whose theta is compress_rope_theta
        main = {"rope_type": "default", "rope_theta": rope_theta}
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
        compress["rope_theta"] = compress_theta
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)  # the V4 reference never scales cos/sin
    kwargs["rope"] = RopeConfig.from_hf(main, rope_theta, max_pos, "rope_parameters.main")
    kwargs["compress_rope"] = RopeConfig.from_hf(compress, compress_theta, max_pos, "rope_parameters.compress")
    return cls(model_type="deepseek_v4", **kwargs)


def check_v4(cfg: ModelConfig) -> None:
    """Fills the default ``mtp_layer_types`` (sliding, as both releases), then checks the config."""
    check_mtp(cfg)
    n = cfg.num_hidden_layers
    if cfg.num_nextn_predict_layers and not cfg.mtp_layer_types:
        object.__setattr__(cfg, "mtp_layer_types", (str(V4Layer.SLIDING),) * cfg.num_nextn_predict_layers)
    _require([(len(cfg.layer_types) == n, f"layer_types has {len(cfg.layer_types)} entries for num_hidden_layers={n}")])
    check_index_share(cfg)
    checks = [
        (len(cfg.mtp_layer_types) == cfg.num_nextn_predict_layers,
         f"mtp_layer_types has {len(cfg.mtp_layer_types)} entries for num_nextn_predict_layers="
         f"{cfg.num_nextn_predict_layers}"),
        (set(cfg.mtp_layer_types) <= set(V4_LAYER_TYPES),
         f"mtp_layer_types={cfg.mtp_layer_types} must be among {V4_LAYER_TYPES}"),
        (len(cfg.layer_types) == n, f"layer_types has {len(cfg.layer_types)} entries for num_hidden_layers={n}"),
        (set(cfg.layer_types) <= set(V4_LAYER_TYPES), f"layer_types={cfg.layer_types} must be among {V4_LAYER_TYPES}"),
        (len(cfg.mlp_layer_types) == n,
         f"mlp_layer_types has {len(cfg.mlp_layer_types)} entries for num_hidden_layers={n}"),
        (set(cfg.mlp_layer_types) <= set(V4_MLP_LAYER_TYPES),
         f"mlp_layer_types={cfg.mlp_layer_types} must be among {V4_MLP_LAYER_TYPES}"),
        (cfg.compress_rate_csa >= 1 and cfg.compress_rate_hca >= 1,
         f"compress rates must be >= 1 (csa={cfg.compress_rate_csa}, hca={cfg.compress_rate_hca})"),
        (cfg.sliding_window >= 1, f"sliding_window={cfg.sliding_window} must be >= 1"),
        (cfg.qk_rope_head_dim % 2 == 0 and 0 < cfg.qk_rope_head_dim <= cfg.head_dim,
         f"rope dims head_dim * partial_rotary_factor = {cfg.qk_rope_head_dim} must be even and in "
         f"(0, head_dim={cfg.head_dim}]"),
        (cfg.qk_rope_head_dim <= cfg.index_head_dim,
         f"index_head_dim={cfg.index_head_dim} must be >= the rope dims ({cfg.qk_rope_head_dim})"),
        (cfg.o_groups >= 1 and cfg.num_attention_heads % cfg.o_groups == 0,
         f"num_attention_heads={cfg.num_attention_heads} is not divisible by o_groups={cfg.o_groups}"),
        (cfg.index_topk >= 1, f"index_topk={cfg.index_topk} must be >= 1"),
        (1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts,
         f"num_experts_per_tok={cfg.num_experts_per_tok} must be in [1, n_routed_experts={cfg.n_routed_experts}]"),
        (cfg.scoring_func in V4_SCORING_FUNCS, f"scoring_func={cfg.scoring_func!r} must be one of {V4_SCORING_FUNCS}"),
        (cfg.hc_mult >= 1 and cfg.hc_sinkhorn_iters >= 1,
         f"hc_mult={cfg.hc_mult} and hc_sinkhorn_iters={cfg.hc_sinkhorn_iters} must be >= 1"),
        (cfg.q_lora_rank > 0, "q_lora_rank must be set (DeepSeek-V4 always uses the q LoRA)"),
    ]
    _require(checks)


# ---- the families' parsers and checks ----------------------------------------------------------

class _Family(NamedTuple):
    parse: Callable[[type, dict[str, Any]], ModelConfig]  # a config.json dict -> the config
    check: Callable[[ModelConfig], None]  # fills the family's derived fields; raises ConfigError


_FAMILIES = {"deepseek_v32": _Family(v32_from_hf_dict, check_v32), "deepseek_v4": _Family(v4_from_hf_dict, check_v4)}


def check_model_type(model_type: str) -> None:
    """ConfigError unless ``model_type`` is a family we serve."""
    if model_type not in _FAMILIES:
        raise ConfigError(f"model_type={model_type!r} is not served; supported: {', '.join(_FAMILIES)}")


def _family(model_type: str) -> _Family:
    check_model_type(model_type)
    return _FAMILIES[model_type]

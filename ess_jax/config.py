"""The base of every family's frozen model configuration, read from a HuggingFace ``config.json`` or a preset.

``ModelConfig`` holds the fields every family reads; each family's config (``models/<family>/config.py``)
subclasses it with its own fields, its parser (``from_hf_dict``: transformers' defaults for the keys a
config.json leaves out) and its checks (``check``). Field names follow transformers' ``DeepseekV32Config`` /
``DeepseekV4Config`` so a checkpoint's config.json maps onto them without translation. Unknown keys in
config.json are ignored (HF writes many that do not affect the forward pass). ``ess_jax.families.load_config``
picks the family by ``model_type``: this module imports nothing of ess_jax (the families import it).

``resolve_model`` says what a model name is (a shipped checkpoint, a checkpoint directory or a preset),
for every entry point that takes one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

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
# Every key and field a family reads, by kind, in one table per family (``ModelConfig.KINDS``: this base's,
# extended by each family's config with its own): ``check_raw`` checks a config.json's values before the parser
# converts anything, ``check_fields`` the constructed config (also one built directly), so a bad value is refused
# with its name and value before any array exists; a key another family reads is ignored, whatever it holds. The
# family's ``check`` then relates fields to each other. Kinds: ("int", lo): an integer (not a bool) >= lo;
# ("num", lo, strict): a finite number > lo (strict) or >= lo; "frac": a number in (0, 1]; "bool"; "str";
# ("list", kind): a list (a tuple once constructed) whose items have that kind; "dict"; "eos": an id or a list.

_KINDS: dict[str, Any] = {
    **{k: ("int", 1) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "num_attention_heads",
        "index_n_heads", "index_head_dim", "index_topk", "intermediate_size", "moe_intermediate_size",
        "n_routed_experts", "num_experts", "num_local_experts", "num_experts_per_tok", "n_group", "topk_group")},
    **{k: ("int", 0) for k in ("q_lora_rank", "qk_rope_head_dim", "n_shared_experts", "bos_token_id", "pad_token_id",
                               "num_nextn_predict_layers")},
    **{k: ("num", 0, True) for k in ("rms_norm_eps", "rope_theta", "routed_scaling_factor")},
    "tie_word_embeddings": "bool", "norm_topk_prob": "bool",
    "model_type": "str", "scoring_func": "str",
    "mlp_layer_types": ("list", "str"), "indexer_types": ("list", "str"),
    "index_topk_freq": ("int", 1), "index_skip_topk_offset": ("int", 0), "index_topk_pattern": "str",
    "quantization_config": "dict", "rope_parameters": "dict", "rope_scaling": "dict",
    "eos_token_id": "eos",
}
_ROPE_KINDS: dict[str, Any] = {
    "rope_type": "str", "type": "str", "rope_theta": ("num", 0, True), "factor": ("num", 0, True),
    "original_max_position_embeddings": ("int", 1), "beta_fast": ("num", None, False),
    "beta_slow": ("num", None, False), "mscale": ("num", None, False), "mscale_all_dim": ("num", None, False),
    "attention_factor": ("num", 0, True), "truncate": "bool",
}


def short(value: Any) -> str:
    """``value``'s repr, cut to 60 characters, for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_value(name: str, value: Any, kind: Any) -> None:
    """Raise ConfigError naming ``name`` and ``value`` unless ``value`` has ``kind`` (see ``ModelConfig.KINDS``)."""
    def bad(want: str):
        raise ConfigError(f"config field {name}={short(value)} must be {want}")

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


def check_raw(raw: dict[str, Any], kinds: dict[str, Any]) -> None:
    """The values of a config.json that a family's parser reads (those present and not null of its ``kinds``), by
    kind."""
    for key, kind in kinds.items():
        if raw.get(key) is not None:
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
        raise ConfigError(f"config field quantization_config.weight_block_size={short(block)} must be two "
                          "block dimensions [out, in]")
    return (block[0], block[1])


def check_fields(cfg: ModelConfig) -> None:
    """Every field of a constructed config by its type and kind (``cfg.KINDS``, the table of config.json's values):
    a field typed ``int | None`` may be None, one typed ``RopeConfig`` must be one, one typed a tuple must be a
    tuple."""
    for field in dataclasses.fields(cfg):
        kind = cfg.KINDS.get(field.name)
        value = getattr(cfg, field.name)
        if field.type == "int | None" and value is None:
            continue
        if field.type == "RopeConfig":
            if not isinstance(value, RopeConfig):
                raise ConfigError(f"config field {field.name}={short(value)} must be a RopeConfig")
            continue
        if field.type == "tuple[int, ...]" and not isinstance(value, tuple):
            raise ConfigError(f"config field {field.name}={short(value)} must be a tuple of token ids")
        if field.type == "tuple[str, ...]" and not isinstance(value, tuple):
            raise ConfigError(f"config field {field.name}={short(value)} must be a tuple of strings")
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
    """A DeepSeek sparse-attention model: the fields every family reads and what they derive. Each family's config
    subclasses it (``models/<family>/config.py``) with its ``model_type``, its own fields and ``KINDS``, its parser
    ``from_hf_dict`` and its checks ``check``. Defaults are DeepSeek-V3.2's 671B shape."""

    model_type: ClassVar[str]  # config.json's model_type: the family (``ess_jax.families``)
    KINDS: ClassVar[dict[str, Any]] = _KINDS  # the config.json keys and fields the family reads, by kind

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
    # attention
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 64
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

    def __post_init__(self):
        check_fields(self)
        check_mtp(self)
        self.check()

    def check(self) -> None:
        """Fills the family's derived fields, then relates the fields to each other; ConfigError naming the first
        that does not hold."""
        raise NotImplementedError

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """A config.json of the family (a dict with its ``model_type``) -> its config, with transformers' defaults
        for the keys it leaves out; its values checked by kind first (``check_raw``)."""
        raise NotImplementedError

    # ---- derived -------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.model_type

    @property
    def index_layers(self) -> list[int]:
        """The layers with a lightning indexer, in order: every layer (a family whose layers differ overrides it)."""
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
        return dataclasses.replace(self, num_nextn_predict_layers=0)

    def mtp_block(self) -> ModelConfig:
        """The config of a one-layer model whose layer is the MTP module's decoder block (its layer types:
        ``mtp_block_fields``), so the family's decoder layer, cache and cache parts serve the block as they serve
        layer 0."""
        if not self.num_nextn_predict_layers:
            raise ValueError("this config has no MTP module (num_nextn_predict_layers=0)")
        # the block keeps its own indexer (DOMAIN.md 1.6, 1.7)
        return dataclasses.replace(self.without_mtp(), num_hidden_layers=1, indexer_types=(),
                                   **self.mtp_block_fields())

    def mtp_block_fields(self) -> dict[str, Any]:
        """The layer-type fields of ``mtp_block``'s one layer: its attention and a routed MoE (the block sits past
        the dense / hash-routed layers)."""
        raise NotImplementedError


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
        return preset_dict(self.name) if self.config_json is None else read_json(self.config_json)

    @property
    def config_json(self) -> Path | None:
        """The checkpoint's config.json (None: a preset's), named in a ConfigError about it."""
        return None if self.checkpoint is None else self.checkpoint / "config.json"


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


def eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's ``eos_token_id`` (an id, a list or null; default 1) as a tuple."""
    eos = raw.get("eos_token_id", 1)
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)


def require(checks: list[tuple[bool, str]]) -> None:
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
        raise ConfigError(f"{where}={short(spec)} must be a pattern string of F / S letters or 'every-N'")
    if spec.startswith("every-"):
        every = spec.removeprefix("every-")
        if not every.isdigit() or int(every) < 1:
            raise ConfigError(f"{where}={spec!r}: 'every-N' needs an integer N >= 1 (every-1: no sharing)")
        return tuple("full" if i % int(every) == 0 else "shared" for i in range(layers))
    for i, letter in enumerate(spec):
        if letter not in _LETTERS:
            raise ConfigError(f"{where}={short(spec)}: letter {letter!r} at indexed layer {i} is neither F (full) "
                              "nor S (shared)")
    if len(spec) != layers:
        raise ConfigError(f"{where}={short(spec)} has {len(spec)} letters for the model's {layers} indexed "
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
            raise ConfigError(f"config fields indexer_types and index_topk_pattern={short(pattern)} disagree: "
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
        require([(kind in INDEXER_TYPES, f"indexer_types[{i}]={short(kind)} is neither 'full' nor 'shared'")])
    require([
        (len(cfg.indexer_types) == layers,
         f"indexer_types has {len(cfg.indexer_types)} entries for the model's {layers} indexed layers (DeepSeek-V3.2: "
         "every layer; DeepSeek-V4: the CSA layers)"),
        (not layers or cfg.indexer_types[0] == "full",
         "indexer_types starts with a shared layer: the first indexed layer must be full (a shared layer reuses the "
         "nearest preceding full layer's top-k)"),
    ])


def check_mtp(cfg: ModelConfig) -> None:
    """At most one MTP module (DeepSeek's releases have one; a second depth would chain on the first's hidden
    states at training time, which ``models.mtp`` does not build)."""
    require([(cfg.num_nextn_predict_layers <= 1,
               f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: ess_jax builds one MTP module (DeepSeek's "
               "releases have 1); set it to 1 or 0")])

"""One frozen model configuration, read from a HuggingFace ``config.json`` or a preset.

Field names and defaults follow transformers' ``DeepseekV32Config`` so a checkpoint's config.json
maps onto it without translation. Unknown keys in config.json are ignored (HF writes many that
do not affect the forward pass); a missing ``model_type`` or one we do not serve is an error.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

FAMILIES = ("deepseek_v32",)
PRESETS = ("tiny-v32", "deepseek-v3.2")


class ConfigError(ValueError):
    """A config.json or preset that cannot describe a model we serve."""


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

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, rope_theta: float, max_position_embeddings: int) -> RopeConfig:
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", rope_theta))
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type != "yarn":
            raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (use 'default' or 'yarn')")
        if params.get("factor") is None:
            raise ConfigError("rope_parameters.factor is required for rope_type 'yarn'")
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

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type={self.model_type!r} is not served; supported: {', '.join(FAMILIES)}")
        if not self.mlp_layer_types:
            dense = min(3, self.num_hidden_layers)
            object.__setattr__(self, "mlp_layer_types", ("dense",) * dense + ("sparse",) * (self.num_hidden_layers - dense))
        checks = [
            (len(self.mlp_layer_types) == self.num_hidden_layers,
             f"mlp_layer_types has {len(self.mlp_layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"),
            (set(self.mlp_layer_types) <= {"dense", "sparse"}, f"mlp_layer_types={self.mlp_layer_types} must be 'dense' or 'sparse'"),
            (self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
             f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}"),
            (1 <= self.topk_group <= self.n_group, f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"),
            (self.n_group == 1 or self.n_routed_experts // self.n_group >= 2,
             "group-limited routing needs at least 2 experts per group (n_routed_experts / n_group >= 2)"),
            (self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
             f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in topk_group={self.topk_group} groups"),
            (self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim={self.qk_rope_head_dim} must be even"),
            (self.qk_rope_head_dim <= self.index_head_dim,
             f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}"),
            (self.index_topk >= 1, f"index_topk={self.index_topk} must be >= 1"),
            (self.q_lora_rank > 0, "q_lora_rank must be set (DeepSeek-V3.2 always uses the q LoRA)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

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

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if "model_type" not in raw:
            raise ConfigError("config.json has no 'model_type' (expected 'deepseek_v32')")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope", "eos_token_id", "mlp_layer_types"}
        kwargs = {k: raw[k] for k in names if raw.get(k) is not None}
        if raw.get("num_experts") is not None:
            kwargs["n_routed_experts"] = raw["num_experts"]
        if raw.get("num_local_experts") is not None:
            kwargs["n_routed_experts"] = raw["num_local_experts"]
        eos = raw.get("eos_token_id", 1)
        kwargs["eos_token_id"] = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        layers = int(raw.get("num_hidden_layers", cls.num_hidden_layers))
        if raw.get("mlp_layer_types"):
            kwargs["mlp_layer_types"] = tuple(raw["mlp_layer_types"])
        else:
            dense = min(int(raw.get("first_k_dense_replace", 3)), layers)
            kwargs["mlp_layer_types"] = ("dense",) * dense + ("sparse",) * (layers - dense)
        rope_params = raw.get("rope_parameters") or raw.get("rope_scaling")
        kwargs["rope"] = RopeConfig.from_hf(
            rope_params, float(raw.get("rope_theta", 10000.0)), int(raw.get("max_position_embeddings", 163840))
        )
        for key, value in kwargs.items():
            field_type = {f.name: f.type for f in dataclasses.fields(cls)}.get(key)
            if field_type in ("int", "float") and not isinstance(value, (int, float)):
                raise ConfigError(f"config field {key}={value!r} must be a number")
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(raw)

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (or pass a checkpoint directory)")
        text = resources.files("ess_jax.configs").joinpath(f"{name}.json").read_text()
        return cls.from_hf_dict(json.loads(text))

"""DeepSeek-V3.2's config: the base (``ess_jax.config.ModelConfig``) with MLA's latent and head widths, read from a
``DeepseekV32Config`` config.json."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ess_jax.config import (ModelConfig, RopeConfig, check_index_share, check_raw, eos_ids, raw_indexer_types,
                            require)


@dataclasses.dataclass(frozen=True)
class DeepseekV32Config(ModelConfig):
    """A DeepSeek-V3.2 model (``DeepseekV32ForCausalLM``). Defaults are its 671B shape."""

    model_type: ClassVar[str] = "deepseek_v32"
    KINDS: ClassVar[dict[str, Any]] = {
        **ModelConfig.KINDS,
        **{k: ("int", 1) for k in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim")},
        "first_k_dense_replace": ("int", 0),
    }

    # mla
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128

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

    def mtp_block_fields(self) -> dict[str, Any]:
        return dict(mlp_layer_types=("sparse",))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DeepseekV32Config:
        """A ``DeepseekV32Config`` config.json -> its config."""
        check_raw(raw, cls.KINDS)
        names = {f.name for f in dataclasses.fields(cls)} - {"rope", "eos_token_id", "mlp_layer_types", "indexer_types"}
        kwargs = {k: raw[k] for k in names if raw.get(k) is not None}
        if raw.get("num_experts") is not None:
            kwargs["n_routed_experts"] = raw["num_experts"]
        if raw.get("num_local_experts") is not None:
            kwargs["n_routed_experts"] = raw["num_local_experts"]
        kwargs["eos_token_id"] = eos_ids(raw)
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

    def check(self) -> None:
        """Fills the default ``mlp_layer_types`` (3 dense layers, then MoE), then checks the config."""
        check_index_share(self)
        n = self.num_hidden_layers
        if not self.mlp_layer_types:
            dense = min(3, n)
            object.__setattr__(self, "mlp_layer_types", ("dense",) * dense + ("sparse",) * (n - dense))
        require([
            (len(self.mlp_layer_types) == n, f"mlp_layer_types has {len(self.mlp_layer_types)} entries for "
                                             f"num_hidden_layers={n}"),
            (set(self.mlp_layer_types) <= {"dense", "sparse"},
             f"mlp_layer_types={self.mlp_layer_types} must be 'dense' or 'sparse'"),
            (self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
             f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}"),
            (1 <= self.topk_group <= self.n_group,
             f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"),
            (self.n_group == 1 or self.n_routed_experts // self.n_group >= 2,
             "group-limited routing needs at least 2 experts per group (n_routed_experts / n_group >= 2)"),
            (self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
             f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in topk_group={self.topk_group} "
             "groups"),
            (self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim={self.qk_rope_head_dim} must be even"),
            (self.qk_rope_head_dim <= self.index_head_dim,
             f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}"),
            (self.index_topk >= 1, f"index_topk={self.index_topk} must be >= 1"),
            (self.q_lora_rank > 0, "q_lora_rank must be set (DeepSeek-V3.2 always uses the q LoRA)"),
        ])

"""DeepSeek-V4's config: the base (``ess_jax.config.ModelConfig``) with its attention schedule (sliding window,
CSA, HCA), compressors, grouped output, mHC and clamped SwiGLU (DOMAIN.md 2), read from a ``DeepseekV4Config``
config.json (modern or legacy keys)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

from ess_jax.config import (ConfigError, ModelConfig, RopeConfig, check_index_share, check_raw, check_value, eos_ids,
                            raw_indexer_types, require, short)


class V4Layer(enum.StrEnum):
    """A DeepSeek-V4 layer's attention: config.json's ``layer_types`` values (strings compare equal)."""

    SLIDING = "sliding_attention"
    CSA = "compressed_sparse_attention"
    HCA = "heavily_compressed_attention"


V4_LAYER_TYPES = tuple(kind.value for kind in V4Layer)
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")
V4_SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_V4_RATIO_TO_LAYER_TYPE = {0: V4Layer.SLIDING, 4: V4Layer.CSA, 128: V4Layer.HCA}
# V4 routes without expert groups: config.json's n_group / topk_group are not read (the config's are 1)
_UNREAD_KEYS = frozenset({"n_group", "topk_group"})

# transformers' DeepseekV4Config defaults (V4-Flash shapes) for keys a config.json leaves out.
_V4_HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=1048576,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8,
    o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6, bos_token_id=0,
    pad_token_id=None, tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config(ModelConfig):
    """A DeepSeek-V4 model (``DeepseekV4ForCausalLM``). Defaults of the base's fields are DeepSeek-V3.2's 671B
    shape; a config.json's missing keys take transformers' (``_V4_HF_DEFAULTS``: V4-Flash's)."""

    model_type: ClassVar[str] = "deepseek_v4"
    KINDS: ClassVar[dict[str, Any]] = {
        **ModelConfig.KINDS,
        **{k: ("int", 1) for k in ("head_dim", "compress_rate_csa", "compress_rate_hca", "sliding_window", "o_groups",
                                   "o_lora_rank", "hc_mult", "hc_sinkhorn_iters")},
        "num_hash_layers": ("int", 0),
        **{k: ("num", 0, True) for k in ("hc_eps", "compress_rope_theta")},
        "swiglu_limit": ("num", 0, False),
        "partial_rotary_factor": "frac",
        "layer_types": ("list", "str"), "compress_ratios": ("list", ("int", 0)), "mtp_layer_types": ("list", "str"),
        "compress_rates": "dict",
    }

    # attention types, compressors, grouped output, mHC, clamped SwiGLU
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

    @property
    def index_layers(self) -> list[int]:
        """The layers with a lightning indexer: the CSA layers, in order."""
        return [i for i, kind in enumerate(self.layer_types) if kind == V4Layer.CSA]

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of a layer (0 for sliding-window-only layers)."""
        return {V4Layer.SLIDING: 0, V4Layer.CSA: self.compress_rate_csa,
                V4Layer.HCA: self.compress_rate_hca}[self.layer_types[layer]]

    def without_mtp(self) -> DeepseekV4Config:
        return dataclasses.replace(self, num_nextn_predict_layers=0, mtp_layer_types=())

    def mtp_block_fields(self) -> dict[str, Any]:
        return dict(layer_types=self.mtp_layer_types[:1], mlp_layer_types=("moe",))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        """A ``DeepseekV4Config`` config.json (modern or legacy keys) -> its config, as transformers 5.23 reads it."""
        check_raw(raw, {key: kind for key, kind in cls.KINDS.items() if key not in _UNREAD_KEYS})
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
        kwargs["eos_token_id"] = eos_ids(raw)
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
            layer_types = [V4Layer.HCA] * min(n, 2) + [V4Layer.CSA if i % 2 else V4Layer.HCA
                                                       for i in range(max(n - 2, 0))]
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
                    raise ConfigError(f"config field rope_parameters.{key}={short(params.get(key))} must be a JSON "
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
        return cls(**kwargs)

    def check(self) -> None:
        """Fills the default ``mtp_layer_types`` (sliding, as both releases), then checks the config."""
        n = self.num_hidden_layers
        if self.num_nextn_predict_layers and not self.mtp_layer_types:
            object.__setattr__(self, "mtp_layer_types", (str(V4Layer.SLIDING),) * self.num_nextn_predict_layers)
        require([(len(self.layer_types) == n,
                  f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={n}")])
        check_index_share(self)
        checks = [
            (len(self.mtp_layer_types) == self.num_nextn_predict_layers,
             f"mtp_layer_types has {len(self.mtp_layer_types)} entries for num_nextn_predict_layers="
             f"{self.num_nextn_predict_layers}"),
            (set(self.mtp_layer_types) <= set(V4_LAYER_TYPES),
             f"mtp_layer_types={self.mtp_layer_types} must be among {V4_LAYER_TYPES}"),
            (len(self.layer_types) == n, f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={n}"),
            (set(self.layer_types) <= set(V4_LAYER_TYPES),
             f"layer_types={self.layer_types} must be among {V4_LAYER_TYPES}"),
            (len(self.mlp_layer_types) == n,
             f"mlp_layer_types has {len(self.mlp_layer_types)} entries for num_hidden_layers={n}"),
            (set(self.mlp_layer_types) <= set(V4_MLP_LAYER_TYPES),
             f"mlp_layer_types={self.mlp_layer_types} must be among {V4_MLP_LAYER_TYPES}"),
            (self.compress_rate_csa >= 1 and self.compress_rate_hca >= 1,
             f"compress rates must be >= 1 (csa={self.compress_rate_csa}, hca={self.compress_rate_hca})"),
            (self.sliding_window >= 1, f"sliding_window={self.sliding_window} must be >= 1"),
            (self.qk_rope_head_dim % 2 == 0 and 0 < self.qk_rope_head_dim <= self.head_dim,
             f"rope dims head_dim * partial_rotary_factor = {self.qk_rope_head_dim} must be even and in "
             f"(0, head_dim={self.head_dim}]"),
            (self.qk_rope_head_dim <= self.index_head_dim,
             f"index_head_dim={self.index_head_dim} must be >= the rope dims ({self.qk_rope_head_dim})"),
            (self.o_groups >= 1 and self.num_attention_heads % self.o_groups == 0,
             f"num_attention_heads={self.num_attention_heads} is not divisible by o_groups={self.o_groups}"),
            (self.index_topk >= 1, f"index_topk={self.index_topk} must be >= 1"),
            (1 <= self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, n_routed_experts="
             f"{self.n_routed_experts}]"),
            (self.scoring_func in V4_SCORING_FUNCS,
             f"scoring_func={self.scoring_func!r} must be one of {V4_SCORING_FUNCS}"),
            (self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1,
             f"hc_mult={self.hc_mult} and hc_sinkhorn_iters={self.hc_sinkhorn_iters} must be >= 1"),
            (self.q_lora_rank > 0, "q_lora_rank must be set (DeepSeek-V4 always uses the q LoRA)"),
        ]
        require(checks)

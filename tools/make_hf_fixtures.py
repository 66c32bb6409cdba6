"""Generate the golden fixtures under ``tests/fixtures/`` from the HuggingFace reference.

The JAX implementation in ``ess_jax`` is tested against outputs of the real
``transformers`` models.  This script builds tiny, randomly initialised
reference models, saves their checkpoints and records their outputs.  It is
the only place that needs torch/transformers; the test suite only reads the
files written here.

How to run (from the repository root)::

    python -m venv .fixtures-venv
    .fixtures-venv/bin/pip install -r tools/requirements-fixtures.txt
    .fixtures-venv/bin/python tools/make_hf_fixtures.py          # writes tests/fixtures/

If ``accelerate`` is also installed, the FP8 fixture is additionally checked
against transformers' own FP8 checkpoint loader.

Options: ``--out DIR`` writes somewhere else, ``--family NAME`` (repeatable)
regenerates only some families (see ``FAMILIES``).  The output is deterministic
(fixed torch seeds, float32, CPU) for a given torch/transformers version.

Fixture families
----------------
``deepseek_v32`` (``transformers.models.deepseek_v32``) writes:

* ``hf-v32-a/``   tiny ``DeepseekV32ForCausalLM`` (yarn RoPE, 1 dense + 2 MoE
  layers, grouped routing), saved with ``save_pretrained`` + ``reference.npz``.
  Note: transformers 5 ``save_pretrained`` reverts its weight conversions, so
  ``model.safetensors`` holds per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``
  tensors, not the in-memory packed ``gate_up_proj`` / ``down_proj``.
* ``hf-v32-b/``   a differently shaped model (default RoPE, all-MoE layers,
  a single routing group, ``norm_topk_prob=False``), same contents.
* ``hf-v32-fp8/`` the hf-v32-a weights in the layout of the original DeepSeek
  release (per-expert tensors, block-wise FP8 e4m3 weights with
  ``weight_scale_inv``, two shards + index, a fake MTP layer to be skipped);
  its ``reference.npz`` is computed from the *dequantized* weights.

``deepseek_v4`` (``transformers.models.deepseek_v4``) writes:

* ``hf-v4-a/``    tiny ``DeepseekV4ForCausalLM`` with all three attention types
  (sliding window, CSA with the lightning indexer, HCA at rate 16), hash-routed
  and top-k-routed MoE layers, mHC and a YaRN compress rope; every parameter and
  buffer is random (sinks, position biases, mHC weights, ``tid2eid``,
  ``e_score_correction_bias``).  ``save_pretrained`` + ``reference.npz``; prompts
  of 21 and 300 tokens.

Every ``reference.npz`` holds, for each prompt ``i``:

* ``prompt_{i}``   int64 ``[T]``      token ids in ``[0, 256)``
* ``logits_{i}``   float32 ``[T, V]`` ``model(prompt, use_cache=False).logits[0]``
* ``generate_{i}`` int64 ``[T + 24]`` greedy ``model.generate`` output (prompt
  included), EOS disabled so exactly 24 tokens are appended.

Prompts are drawn from a seeded generator; a candidate prompt is only accepted
when every discrete decision the model takes on it (greedy token choice,
indexer top-k selection, MoE group/expert selection) has a clear margin, so
that an implementation that is correct up to float32 rounding reproduces the
fixture exactly.  Rejected candidates are reported on stdout.  For the same
reason the indexer's query heads are built in antipodal pairs (see
``make_indexer_heads_antipodal_``): with independent random heads many index
scores are exactly 0 and tie at the top-k boundary.

To add a family write a ``make_<family>_fixtures(root)``
function that writes its directories under ``root`` and register it in
``FAMILIES``; the helpers below (randomisation, FP8 block quantisation,
reference recording, decision margins) are model-agnostic or easy to extend.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import safetensors
import safetensors.torch
import torch
import transformers
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Indexer,
    DeepseekV32TopkRouter,
    apply_rotary_pos_emb,
)
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Indexer,
    DeepseekV4IndexerScorer,
    DeepseekV4TopKRouter,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"

NEW_TOKENS = 24  # tokens appended by greedy generation
PROMPT_VOCAB = 256  # prompt token ids are drawn from [0, PROMPT_VOCAB)
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258

# Standard deviation multiplier for linear weights (std = WEIGHT_GAIN / sqrt(fan_in)).
WEIGHT_GAIN = 1.5

# Minimum margins required of every discrete decision on an accepted prompt.
MIN_LOGIT_GAP = 1e-2  # top-1 minus top-2 logit, at every prompt row and greedy step
MIN_ROUTER_GAP = 1e-4  # k-th minus (k+1)-th biased router score (groups and experts)
MIN_INDEXER_REL_GAP = 1e-4  # (k-th minus (k+1)-th index score) / max |index score| of the row
MAX_PROMPT_ATTEMPTS = 200

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = (128, 128)


# ---------------------------------------------------------------------------
# Model construction and randomisation
# ---------------------------------------------------------------------------


def build_model(config: DeepseekV32Config, seed: int) -> DeepseekV32ForCausalLM:
    """A float32, eager-attention, eager-experts model with every persisted tensor randomised."""
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    randomize_persistent_tensors_(model, seed)
    make_indexer_heads_antipodal_(model)
    return model.eval()


def random_tensor(name: str, shape: torch.Size, normal: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """Random value for the persisted tensor ``name``; raises on names it does not know.

    * embeddings: N(0, 1)
    * linear weights ``[out, in]`` and packed expert weights ``[E, out, in]``:
      N(0, 1) * WEIGHT_GAIN / sqrt(in), so activations keep an O(1) scale
    * RMSNorm / LayerNorm weights: 1 + 0.1 N(0, 1); LayerNorm bias: 0.1 N(0, 1)
    * router ``e_score_correction_bias``: 0.1 N(0, 1) (comparable to the spread
      of the sigmoid scores, so it changes some expert choices)
    """
    shape = tuple(shape)
    if name.endswith("embed_tokens.weight"):
        return normal(shape)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * normal(shape)
    if name.endswith("norm.bias"):
        return 0.1 * normal(shape)
    if name.endswith("norm.weight") and len(shape) == 1:
        return 1.0 + 0.1 * normal(shape)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and len(shape) == 3:
        return normal(shape) * (WEIGHT_GAIN / math.sqrt(shape[2]))
    if name.endswith(".weight") and len(shape) == 2:
        return normal(shape) * (WEIGHT_GAIN / math.sqrt(shape[1]))
    raise ValueError(f"no randomisation rule for persisted tensor {name} {shape}")


@torch.no_grad()
def randomize_persistent_tensors_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every tensor of ``model.state_dict()`` (parameters and persistent buffers)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, tensor in model.state_dict().items():  # state_dict tensors share storage with the model
        tensor.copy_(random_tensor(name, tensor.shape, normal))


@torch.no_grad()
def make_indexer_heads_antipodal_(model: torch.nn.Module) -> None:
    """Make indexer query heads come in pairs ``q_{2j+1} = -q_{2j}`` (negated ``wq_b`` rows).

    The index score of a key is ``sum_h w_h * relu(q_h . k)``.  With independent
    random heads a key gets an exactly-zero score whenever all ``q_h . k < 0``;
    such zeros are common, tie with each other at the top-k boundary, and then
    the selection depends on ``torch.topk``'s tie-breaking (transformers' own
    cached and no-cache paths disagree on it).  With antipodal pairs one of
    ``relu(a)``, ``relu(-a)`` is positive, so no score is exactly zero and all
    remaining ties are measure-zero (near-ties are screened in ``check_prompt``).
    The per-head weights ``w_h`` still differ, so the fixture still checks the
    head layout, the ReLU and the weighting.
    """
    for module in model.modules():
        if isinstance(module, DeepseekV32Indexer):
            w = module.wq_b.weight.view(module.n_heads, module.head_dim, -1)
            pairs = module.n_heads // 2
            w[1 : 2 * pairs : 2] = -w[0 : 2 * pairs : 2]
        elif isinstance(module, DeepseekV4Indexer):  # q_b_proj rows, then RoPE: still antipodal after it
            w = module.q_b_proj.weight.view(module.num_heads, module.head_dim, -1)
            pairs = module.num_heads // 2
            w[1 : 2 * pairs : 2] = -w[0 : 2 * pairs : 2]


# ---------------------------------------------------------------------------
# DeepSeek release checkpoint layout and block-wise FP8
# ---------------------------------------------------------------------------

# Linear weights that the DeepSeek release stores as FP8 (everything else stays high precision).
FP8_LINEAR_SUFFIXES = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "gate_proj.weight",  # dense MLP, shared experts and routed experts
    "up_proj.weight",
    "down_proj.weight",
)


def is_fp8_linear(name: str) -> bool:
    return name.endswith(FP8_LINEAR_SUFFIXES)


def quantize_fp8_blockwise(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 e4m3 quantisation as in the DeepSeek release.

    Returns ``(w8, scale_inv)`` with ``w8`` float8_e4m3fn ``[out, in]`` and
    ``scale_inv`` float32 ``[ceil(out/bo), ceil(in/bi)]`` such that
    ``w ~= w8 * scale_inv[i // bo, j // bi]``; ``scale_inv = amax(block) / 448``.
    """
    out_f, in_f = w.shape
    bo, bi = block
    nbo, nbi = -(-out_f // bo), -(-in_f // bi)
    padded = torch.zeros(nbo * bo, nbi * bi, dtype=torch.float32)
    padded[:out_f, :in_f] = w.float()
    amax = padded.abs().view(nbo, bo, nbi, bi).amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = w.float() / expand_block_scale(scale_inv, w.shape, block)
    w8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, scale_inv


def expand_block_scale(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    out_f, in_f = shape
    return scale_inv.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:out_f, :in_f]


def dequantize_fp8_blockwise(
    w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """float32 ``w8 * scale_inv[i // bo, j // bi]``: what a correct dequantizing loader computes."""
    return w8.float() * expand_block_scale(scale_inv, tuple(w8.shape), block)


def unpack_experts(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' packed expert tensors -> the release's per-expert linears.

    ``mlp.experts.gate_up_proj [E, 2I, D]`` -> ``mlp.experts.{e}.gate_proj.weight`` (rows ``:I``)
    and ``mlp.experts.{e}.up_proj.weight`` (rows ``I:``); ``mlp.experts.down_proj [E, D, I]``
    -> ``mlp.experts.{e}.down_proj.weight``.  Other tensors are passed through.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def pack_experts(release_state: dict[str, torch.Tensor], config: DeepseekV32Config) -> dict[str, torch.Tensor]:
    """Inverse of ``unpack_experts`` for layers ``< num_hidden_layers`` (MTP layers are dropped)."""
    out: dict[str, torch.Tensor] = {}
    n_experts = config.n_routed_experts
    for name, t in release_state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and int(layer) >= config.num_hidden_layers:
            continue  # MTP layer(s): not part of the causal LM
        if ".mlp.experts." in name:
            continue  # packed below
        out[name] = t
    for i, kind in enumerate(config.mlp_layer_types):
        if kind != "sparse":
            continue
        p = f"model.layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack(
            [
                torch.cat([release_state[f"{p}{e}.gate_proj.weight"], release_state[f"{p}{e}.up_proj.weight"]], 0)
                for e in range(n_experts)
            ]
        )
        out[p + "down_proj"] = torch.stack([release_state[f"{p}{e}.down_proj.weight"] for e in range(n_experts)])
    return out


def fake_mtp_layer(config: DeepseekV32Config, seed: int) -> dict[str, torch.Tensor]:
    """A few float32 tensors of a multi-token-prediction layer at index ``num_hidden_layers``.

    The release ships its MTP module as ``model.layers.{num_hidden_layers}.*``; a loader
    for the causal LM must ignore it.  Shapes follow the release; values are random.
    """
    gen = torch.Generator().manual_seed(seed)
    d = config.hidden_size
    p = f"model.layers.{config.num_hidden_layers}."

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])

    return {
        p + "embed_tokens.weight": rand(config.vocab_size, d),
        p + "enorm.weight": 1.0 + 0.1 * rand(d),
        p + "hnorm.weight": 1.0 + 0.1 * rand(d),
        p + "eh_proj.weight": rand(d, 2 * d),
        p + "input_layernorm.weight": 1.0 + 0.1 * rand(d),
        p + "self_attn.q_a_proj.weight": rand(config.q_lora_rank, d),
        p + "self_attn.kv_a_proj_with_mqa.weight": rand(config.kv_lora_rank + config.qk_rope_head_dim, d),
        p + "mlp.experts.0.gate_proj.weight": rand(config.moe_intermediate_size, d),
        p + "shared_head.norm.weight": 1.0 + 0.1 * rand(d),
        p + "shared_head.head.weight": rand(config.vocab_size, d),
    }


def release_fp8_state(
    model: DeepseekV32ForCausalLM, mtp_seed: int, block: tuple[int, int] = FP8_BLOCK
) -> dict[str, torch.Tensor]:
    """The model's weights in the DeepSeek release layout, FP8 (``block``-wise scales) where the release is FP8.

    Ordered as the release orders them: ``name`` then ``name_scale_inv`` for quantised weights.
    """
    release = unpack_experts(model.state_dict())
    release.update(fake_mtp_layer(model.config, mtp_seed))
    out: dict[str, torch.Tensor] = {}
    for name, t in release.items():
        if is_fp8_linear(name):
            w8, scale_inv = quantize_fp8_blockwise(t, block)
            out[name] = w8
            out[name + "_scale_inv"] = scale_inv
        else:
            out[name] = t.float().contiguous()
    return out


def dequantized_model(
    config: DeepseekV32Config, fp8_state: dict[str, torch.Tensor], block: tuple[int, int] = FP8_BLOCK
) -> DeepseekV32ForCausalLM:
    """A float32 HF model holding exactly the dequantized release weights (what a loader must produce)."""
    dense: dict[str, torch.Tensor] = {}
    for name, t in fp8_state.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            dense[name] = dequantize_fp8_blockwise(t, fp8_state[name + "_scale_inv"], block)
        else:
            dense[name] = t
    model = DeepseekV32ForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    model.load_state_dict(pack_experts(dense, config), strict=True)
    return model.eval()


def write_sharded_safetensors(out_dir: Path, state: dict[str, torch.Tensor], n_shards: int) -> dict[str, str]:
    """Write ``state`` (in order) as ``model-0000k-of-0000n.safetensors`` shards of ~equal bytes + index."""
    nbytes = {k: v.numel() * v.element_size() for k, v in state.items()}
    total = sum(nbytes.values())
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n_shards)]
    seen = 0
    for name, t in state.items():
        shard = min(n_shards - 1, seen * n_shards // total)
        shards[shard][name] = t.contiguous()
        seen += nbytes[name]
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        safetensors.torch.save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


# ---------------------------------------------------------------------------
# Decision margins (so that the fixtures are reproducible up to float rounding)
# ---------------------------------------------------------------------------


@dataclass
class Margins:
    """Smallest margins of the discrete decisions seen by a ``DecisionProbe``."""

    indexer_rel_gap: float = math.inf
    indexer_sparse_rows: int = 0  # query rows with more causal keys than index_topk
    router_group_gap: float = math.inf
    router_expert_gap: float = math.inf
    router_tokens: int = 0
    bias_changed_tokens: int = 0  # tokens whose expert set differs without e_score_correction_bias
    logit_gap: float = math.inf
    problems: list[str] = field(default_factory=list)

    def merge(self, other: "Margins") -> None:
        self.indexer_rel_gap = min(self.indexer_rel_gap, other.indexer_rel_gap)
        self.indexer_sparse_rows += other.indexer_sparse_rows
        self.router_group_gap = min(self.router_group_gap, other.router_group_gap)
        self.router_expert_gap = min(self.router_expert_gap, other.router_expert_gap)
        self.router_tokens += other.router_tokens
        self.bias_changed_tokens += other.bias_changed_tokens
        self.logit_gap = min(self.logit_gap, other.logit_gap)
        self.problems += other.problems

    def failures(self, min_indexer_rel_gap: float = MIN_INDEXER_REL_GAP) -> list[str]:
        out = sorted(set(self.problems))
        if self.indexer_rel_gap < min_indexer_rel_gap:
            out.append(f"indexer top-k relative gap {self.indexer_rel_gap:.2e}")
        if min(self.router_group_gap, self.router_expert_gap) < MIN_ROUTER_GAP:
            out.append(f"router gap group={self.router_group_gap:.2e} expert={self.router_expert_gap:.2e}")
        if self.logit_gap < MIN_LOGIT_GAP:
            out.append(f"greedy logit gap {self.logit_gap:.2e}")
        return out

    def summary(self) -> str:
        return (
            f"min gaps: logit {self.logit_gap:.3g}, indexer(rel) {self.indexer_rel_gap:.3g} "
            f"over {self.indexer_sparse_rows} sparse rows, router group {self.router_group_gap:.3g} "
            f"expert {self.router_expert_gap:.3g}; e_score_correction_bias changes the expert set of "
            f"{self.bias_changed_tokens}/{self.router_tokens} token-layers"
        )


def kth_gap(sorted_desc: torch.Tensor, k: int) -> torch.Tensor:
    """``sorted[..., k-1] - sorted[..., k]`` (inf where the (k+1)-th entry is -inf)."""
    gap = sorted_desc[..., k - 1] - sorted_desc[..., k]
    return torch.where(torch.isinf(sorted_desc[..., k]), torch.full_like(gap, math.inf), gap)


def route(scores: torch.Tensor, bias: torch.Tensor, router: DeepseekV32TopkRouter):
    """Re-implementation of the router's selection; returns (expert sets, group gaps, expert gaps)."""
    n_tok, n_exp = scores.shape
    choice = scores + bias
    group_scores = choice.view(n_tok, router.num_group, n_exp // router.num_group).topk(2, dim=-1)[0].sum(-1)
    g_sorted = group_scores.sort(dim=-1, descending=True).values
    if router.topk_group < router.num_group:
        group_gap = kth_gap(g_sorted, router.topk_group)
    else:
        group_gap = torch.full((n_tok,), math.inf)
    group_idx = group_scores.topk(router.topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
    expert_mask = group_mask.repeat_interleave(n_exp // router.num_group, dim=1)
    masked = choice.masked_fill(~expert_mask, -math.inf)
    e_sorted = masked.sort(dim=-1, descending=True).values
    expert_gap = kth_gap(e_sorted, router.top_k) if router.top_k < n_exp else torch.full((n_tok,), math.inf)
    experts = masked.topk(router.top_k, dim=-1).indices.sort(dim=-1).values
    return experts, group_gap, expert_gap


def indexer_scores(indexer: DeepseekV32Indexer, hidden_states, q_resid, position_embeddings) -> torch.Tensor:
    """Unmasked index scores ``[B, S, T]`` exactly as ``DeepseekV32Indexer.forward`` computes them."""
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden_states).float() * (indexer.n_heads**-0.5)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


class DecisionProbe:
    """Forward hooks recording the margins of the indexer and router decisions of a no-cache forward.

    The hooks recompute each decision independently and check that it matches the
    module's own output, so a change of the reference implementation is noticed.
    """

    def __init__(self, model: DeepseekV32ForCausalLM):
        self.margins = Margins()
        self.handles = []
        for module in model.modules():
            if isinstance(module, DeepseekV32Indexer):
                self.handles.append(module.register_forward_hook(self._indexer_hook, with_kwargs=True))
            elif isinstance(module, DeepseekV32TopkRouter):
                self.handles.append(module.register_forward_hook(self._router_hook))
            elif isinstance(module, DeepseekV4IndexerScorer):
                self.handles.append(module.register_forward_hook(self._v4_scorer_hook))
            elif isinstance(module, DeepseekV4Indexer):
                self.handles.append(module.register_forward_hook(self._v4_indexer_hook))
            elif isinstance(module, DeepseekV4TopKRouter):
                self.handles.append(module.register_forward_hook(self._v4_router_hook))
        self._v4_scores: torch.Tensor | None = None

    def __enter__(self) -> "DecisionProbe":
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _indexer_hook(self, module: DeepseekV32Indexer, args, kwargs, output) -> None:
        hidden_states, q_resid, position_embeddings, mask = args[:4]
        assert kwargs.get("past_key_values") is None, "probe expects a no-cache forward"
        scores = indexer_scores(module, hidden_states, q_resid, position_embeddings)
        valid = mask if mask.dtype == torch.bool else mask == 0  # [B, S, T]
        k = module.index_topk
        for b in range(scores.shape[0]):
            for s in range(scores.shape[1]):
                row = scores[b, s][valid[b, s]]
                if row.numel() <= k:
                    continue  # every causal key is selected: no decision
                self.margins.indexer_sparse_rows += 1
                top = row.sort(descending=True).values
                rel = float((top[k - 1] - top[k]) / top.abs().max().clamp_min(1e-30))
                self.margins.indexer_rel_gap = min(self.margins.indexer_rel_gap, rel)
                keys = torch.nonzero(valid[b, s]).squeeze(-1)
                expected = set(keys[row.topk(k).indices].tolist())
                if expected != set(output[b, s].tolist()):
                    self.margins.problems.append("indexer re-implementation mismatch")

    def _router_hook(self, module: DeepseekV32TopkRouter, args, output) -> None:
        hidden = args[0].reshape(-1, module.hidden_dim).float()
        scores = torch.sigmoid(hidden @ module.weight.float().T)
        experts, group_gap, expert_gap = route(scores, module.e_score_correction_bias, module)
        unbiased, _, _ = route(scores, torch.zeros_like(module.e_score_correction_bias), module)
        if not torch.equal(experts, output[2].sort(dim=-1).values):
            self.margins.problems.append("router re-implementation mismatch")
        self.margins.router_group_gap = min(self.margins.router_group_gap, float(group_gap.min()))
        self.margins.router_expert_gap = min(self.margins.router_expert_gap, float(expert_gap.min()))
        self.margins.router_tokens += experts.shape[0]
        self.margins.bias_changed_tokens += int((experts != unbiased).any(dim=-1).sum())

    def _v4_scorer_hook(self, module: DeepseekV4IndexerScorer, args, output) -> None:
        self._v4_scores = output  # unmasked index scores [B, S, entries]; read by the indexer hook below

    def _v4_indexer_hook(self, module: DeepseekV4Indexer, args, output) -> None:
        position_ids, past_key_values = args[2], args[3]
        assert past_key_values is None, "probe expects a no-cache forward"
        scores, k = self._v4_scores, module.index_topk
        visible = (position_ids + 1) // module.compress_rate  # [1 or B, S] entries a query may see
        for b in range(scores.shape[0]):
            for s in range(scores.shape[1]):
                row = scores[b, s, : int(visible[b % visible.shape[0], s])]
                if row.numel() <= k:
                    continue  # every visible entry is selected: no decision
                self.margins.indexer_sparse_rows += 1
                top = row.sort(descending=True).values
                rel = float((top[k - 1] - top[k]) / top.abs().max().clamp_min(1e-30))
                self.margins.indexer_rel_gap = min(self.margins.indexer_rel_gap, rel)
                if set(row.topk(k).indices.tolist()) != set(output[b, s].tolist()):
                    self.margins.problems.append("indexer re-implementation mismatch")

    def _v4_router_hook(self, module: DeepseekV4TopKRouter, args, output) -> None:
        hidden = args[0].reshape(-1, module.hidden_dim).float()
        scores = module.score_fn(hidden @ module.weight.float().T)
        n_experts = scores.shape[-1]

        def select(choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gap = kth_gap(choice.sort(dim=-1, descending=True).values, module.top_k) if module.top_k < n_experts \
                else torch.full((choice.shape[0],), math.inf)
            return choice.topk(module.top_k, dim=-1).indices.sort(dim=-1).values, gap

        experts, expert_gap = select(scores + module.e_score_correction_bias)
        unbiased, _ = select(scores)
        if not torch.equal(experts, output[2].sort(dim=-1).values):
            self.margins.problems.append("router re-implementation mismatch")
        self.margins.router_expert_gap = min(self.margins.router_expert_gap, float(expert_gap.min()))
        self.margins.router_tokens += experts.shape[0]
        self.margins.bias_changed_tokens += int((experts != unbiased).any(dim=-1).sum())


# ---------------------------------------------------------------------------
# Reference outputs
# ---------------------------------------------------------------------------


@torch.no_grad()
def full_logits(model: DeepseekV32ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """``model(ids, use_cache=False).logits`` for a 1-D ``ids``; returns ``[T, V]``."""
    return model(ids[None], use_cache=False).logits[0]


@torch.no_grad()
def greedy_generate(model: DeepseekV32ForCausalLM, prompt: torch.Tensor) -> torch.Tensor:
    """``model.generate`` greedy, exactly NEW_TOKENS new tokens, no EOS; returns prompt + new tokens."""
    # generate() fills unset options from model.generation_config (eos 257), so clear EOS there.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(
            prompt[None],
            attention_mask=torch.ones_like(prompt)[None],
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )[0]
    finally:
        model.generation_config.eos_token_id = saved_eos
    if out.shape[0] != prompt.shape[0] + NEW_TOKENS:
        raise RuntimeError(f"generate returned {out.shape[0] - prompt.shape[0]} new tokens")
    return out


@torch.no_grad()
def check_prompt(
    model: DeepseekV32ForCausalLM, prompt: torch.Tensor, logit_rows: str = "all"
) -> tuple[torch.Tensor, Margins]:
    """Generate, then probe a no-cache forward over the whole generated sequence.

    Checks that each generated token is the argmax of the no-cache logits (cache
    path == no-cache path, pure greedy) and that no EOS/PAD token is generated,
    and returns the generated sequence with the decision margins. The logit gap
    is taken over every row but the last (``logit_rows="all"``) or only over the
    rows that chose the generated tokens (``"generated"``).
    """
    seq = greedy_generate(model, prompt)
    with DecisionProbe(model) as probe:
        logits = full_logits(model, seq)
    margins = probe.margins
    t = prompt.shape[0]
    # Every row but the last: the stored prompt rows and the rows that chose the generated tokens.
    top2 = (logits[:-1] if logit_rows == "all" else logits[t - 1 : -1]).topk(2, dim=-1).values
    margins.logit_gap = float((top2[:, 0] - top2[:, 1]).min())
    if not torch.equal(logits[t - 1 : -1].argmax(-1), seq[t:]):
        margins.problems.append("generate() disagrees with argmax of the no-cache logits")
    if bool(torch.isin(seq[t:], torch.tensor([EOS_ID, PAD_ID])).any()):
        margins.problems.append("EOS/PAD among generated tokens")
    return seq, margins


def choose_prompts(
    models: list[DeepseekV32ForCausalLM],
    lengths: tuple[int, ...],
    seed: int,
    *,
    logit_rows: str = "all",
    min_indexer_rel_gap: float = MIN_INDEXER_REL_GAP,
) -> tuple[list[torch.Tensor], list[Margins]]:
    """For each length, the first seeded random prompt on which every model decides with clear margins."""
    prompts, all_margins = [], []
    for i, length in enumerate(lengths):
        for attempt in range(MAX_PROMPT_ATTEMPTS):
            gen = torch.Generator().manual_seed(seed + 1000 * i + attempt)
            prompt = torch.randint(0, PROMPT_VOCAB, (length,), generator=gen, dtype=torch.int64)
            margins = Margins()
            for model in models:
                margins.merge(check_prompt(model, prompt, logit_rows)[1])
            failures = margins.failures(min_indexer_rel_gap)
            if not failures:
                break
            print(f"    prompt {i} (T={length}) attempt {attempt} rejected: {'; '.join(failures)}")
        else:
            raise RuntimeError(f"no acceptable prompt of length {length} in {MAX_PROMPT_ATTEMPTS} attempts")
        print(f"    prompt {i} (T={length}) accepted at attempt {attempt}: {margins.summary()}")
        prompts.append(prompt)
        all_margins.append(margins)
    return prompts, all_margins


@torch.no_grad()
def sparsity_effect(model: DeepseekV32ForCausalLM, prompt: torch.Tensor) -> tuple[float, float | None]:
    """Max |logits(sparse) - logits(dense indexer)| for rows with <= topk and > topk causal keys.

    Shows that the indexer's top-k mask actually changes the output on long prompts.
    """
    indexers = [m for m in model.modules() if isinstance(m, (DeepseekV32Indexer, DeepseekV4Indexer))]
    topk = indexers[0].index_topk
    # First query row with more candidates than topk: t + 1 tokens (V3.2), (t + 1) // m entries (V4).
    first = topk if isinstance(indexers[0], DeepseekV32Indexer) else indexers[0].compress_rate * (topk + 1) - 1
    sparse = full_logits(model, prompt)
    for m in indexers:
        m.index_topk = 10**9
    try:
        dense = full_logits(model, prompt)
    finally:
        for m in indexers:
            m.index_topk = topk
    diff = (sparse - dense).abs().amax(dim=-1)
    short = float(diff[:first].max())
    long = float(diff[first:].max()) if prompt.shape[0] > first else None
    return short, long


@torch.no_grad()
def write_reference(out_dir: Path, model: DeepseekV32ForCausalLM, prompts: list[torch.Tensor]) -> dict:
    """Write ``reference.npz`` (prompt_i, logits_i, generate_i) and return it."""
    ref: dict[str, np.ndarray] = {}
    for i, prompt in enumerate(prompts):
        logits = full_logits(model, prompt)
        seq = greedy_generate(model, prompt)
        ref[f"prompt_{i}"] = prompt.numpy().astype(np.int64)
        ref[f"logits_{i}"] = logits.numpy().astype(np.float32)
        ref[f"generate_{i}"] = seq.numpy().astype(np.int64)
        first_new, argmax_last = int(seq[prompt.shape[0]]), int(logits[-1].argmax())
        short, long = sparsity_effect(model, prompt)
        long_txt = "n/a (T <= index_topk)" if long is None else f"{long:.3f}"
        print(
            f"    prompt {i}: T={prompt.shape[0]} logits std {logits.std():.3f} max|.| {logits.abs().max():.3f}; "
            f"first new token {first_new} == argmax(last logits row) {argmax_last}: {first_new == argmax_last}; "
            f"sparse-vs-dense indexer max|dlogit| rows<topk {short:.2e}, rows>=topk {long_txt}"
        )
        if first_new != argmax_last:
            raise RuntimeError("first generated token is not the argmax of the last logits row")
    np.savez(out_dir / "reference.npz", **ref)
    return ref


def print_safetensors(out_dir: Path) -> None:
    for path in sorted(out_dir.glob("*.safetensors")):
        print(f"    {path.name}:")
        with safetensors.safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                print(f"      {name} {sl.get_dtype()} {list(sl.get_shape())}")


def activation_report(model: DeepseekV32ForCausalLM, prompt: torch.Tensor) -> str:
    """RMS of the residual stream after each layer (sanity check of the randomisation scale)."""
    with torch.no_grad():
        out = model(prompt[None], use_cache=False, output_hidden_states=True)
    rms = [f"{float(h.pow(2).mean().sqrt()):.2f}" for h in out.hidden_states]
    return "residual RMS per layer: " + " ".join(rms)


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# ---------------------------------------------------------------------------
# Family: DeepSeek-V3.2 (transformers.models.deepseek_v32)
# ---------------------------------------------------------------------------


def v32_a_config() -> DeepseekV32Config:
    """Yarn RoPE, 1 dense + 2 MoE layers, 8 experts in 4 groups (2 chosen), top-2."""
    return DeepseekV32Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=16,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )


def v32_b_config() -> DeepseekV32Config:
    """Default RoPE, 2 MoE layers, 4 experts in a single group, top-3, no top-k renormalisation."""
    return DeepseekV32Config(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        first_k_dense_replace=0,
        num_attention_heads=2,
        # Must be given: the default (128) would make num_key_value_groups = 2 // 128 = 0.
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=4,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        max_position_embeddings=2048,
        # rope_parameters left unset: saved as {"rope_theta": 10000.0, "rope_type": "default"}.
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )


V32_SEED_A, V32_SEED_B = 3201, 3202
V32_PROMPT_SEED_A, V32_PROMPT_SEED_B = 10_000, 20_000
V32_MTP_SEED = 3299


def fp8_quantization_config(block: tuple[int, int] = FP8_BLOCK) -> dict:
    """``quantization_config`` of the DeepSeek-V3.2-Exp release, for ``block``-wise weight scales."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(block),
    }


def write_hf_checkpoint_fixture(out_dir: Path, model: DeepseekV32ForCausalLM, prompts: list[torch.Tensor]) -> None:
    """``save_pretrained`` (float32 safetensors) + reference.npz; checks the checkpoint reloads identically."""
    fresh_dir(out_dir)
    model.save_pretrained(out_dir)  # safetensors is the only format in transformers 5
    ref = write_reference(out_dir, model, prompts)
    reloaded = type(model).from_pretrained(
        out_dir, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    for i, prompt in enumerate(prompts):
        if not np.array_equal(full_logits(reloaded, prompt).numpy(), ref[f"logits_{i}"]):
            raise RuntimeError(f"{out_dir.name}: reloaded checkpoint gives different logits")
    print(f"    {out_dir.name}: from_pretrained round trip reproduces the logits bit-exactly")


def write_fp8_release_fixture(
    out_dir: Path,
    fp8_state: dict[str, torch.Tensor],
    base_config_json: Path,
    dequant_model: DeepseekV32ForCausalLM,
    prompts: list[torch.Tensor],
    block: tuple[int, int] = FP8_BLOCK,
) -> None:
    """Release-layout FP8 checkpoint (2 shards + index), config with quantization_config, reference."""
    fresh_dir(out_dir)
    config = json.loads(base_config_json.read_text())
    config["quantization_config"] = fp8_quantization_config(block)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weight_map = write_sharded_safetensors(out_dir, fp8_state, n_shards=2)
    split = [n for n in weight_map if n.endswith("_scale_inv") and weight_map[n] != weight_map[n[: -len("_scale_inv")]]]
    print(f"    {out_dir.name}: {len(fp8_state)} tensors; weight/scale pairs split across shards: {split}")
    ref = write_reference(out_dir, dequant_model, prompts)
    check_with_transformers_fp8_loader(out_dir, ref, len(prompts))


def check_with_transformers_fp8_loader(out_dir: Path, ref: dict, n_prompts: int) -> None:
    """Optional cross-check: transformers' own FP8 loader must reproduce the reference exactly.

    On a machine without GPU transformers dequantizes FP8 checkpoints while loading; that
    path needs ``accelerate``, which is not a requirement of this script, so the check is
    skipped when it is missing.
    """
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print(f"    {out_dir.name}: accelerate not installed, skipping the transformers FP8-loader cross-check")
        return
    model = DeepseekV32ForCausalLM.from_pretrained(
        out_dir, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    for i in range(n_prompts):
        logits = full_logits(model, torch.from_numpy(ref[f"prompt_{i}"]))
        if not np.array_equal(logits.float().numpy(), ref[f"logits_{i}"]):
            raise RuntimeError(f"{out_dir.name}: transformers' FP8 loader disagrees with the dequantized reference")
    print(f"    {out_dir.name}: transformers' FP8 loader (CPU dequantization) reproduces the logits bit-exactly")


def make_deepseek_v32_fixtures(root: Path) -> None:
    """hf-v32-a, hf-v32-fp8 (same weights as a, FP8 release layout) and hf-v32-b."""
    print("[deepseek_v32] hf-v32-a / hf-v32-fp8")
    model_a = build_model(v32_a_config(), V32_SEED_A)
    fp8_state = release_fp8_state(model_a, V32_MTP_SEED)
    model_fp8 = dequantized_model(model_a.config, fp8_state)
    # One prompt set for both: it must give clear decisions on the float and the dequantized weights.
    prompts_a, _ = choose_prompts([model_a, model_fp8], (10, 40), V32_PROMPT_SEED_A)
    print("    " + activation_report(model_a, prompts_a[1]))
    write_hf_checkpoint_fixture(root / "hf-v32-a", model_a, prompts_a)
    write_fp8_release_fixture(root / "hf-v32-fp8", fp8_state, root / "hf-v32-a" / "config.json", model_fp8, prompts_a)

    print("[deepseek_v32] hf-v32-b")
    model_b = build_model(v32_b_config(), V32_SEED_B)
    prompts_b, _ = choose_prompts([model_b], (6, 30), V32_PROMPT_SEED_B)
    print("    " + activation_report(model_b, prompts_b[1]))
    write_hf_checkpoint_fixture(root / "hf-v32-b", model_b, prompts_b)


# ---------------------------------------------------------------------------
# Family: DeepSeek-V4 (transformers.models.deepseek_v4)
# ---------------------------------------------------------------------------


def v4_a_config() -> DeepseekV4Config:
    """SWA, CSA (4:1 + indexer top-8) and HCA (16:1) layers, 2 hash + 2 routed MoE layers, mHC, YaRN.

    The HCA rate is 16 instead of 128 (``compress_rates`` allows any) so that a 300-token prompt has
    18 HCA entries; the window (16) and index_topk (8 entries = 32 tokens) are far below it.
    """
    return DeepseekV4Config(
        vocab_size=320,
        hidden_size=32,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.25,  # 8 rope dims at the end of each head
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=16,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=16,
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=8,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        # YaRN on the compress rope; with 8 rope dims the ramp spans dims 1..3 (low 1, high 3).
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        max_position_embeddings=16 * 8192,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )


V4_SEED_A = 4101
V4_PROMPT_SEED_A = 40_000
V4_MIN_INDEXER_REL_GAP = 1e-5


def v4_random_tensor(name: str, shape: torch.Size, normal: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """``random_tensor`` plus DeepSeek-V4's own tensors.

    * attention ``sinks``: N(0, 1), comparable to the attention logits
    * compressor / indexer ``position_bias``: 0.5 N(0, 1)
    * mHC ``fn`` / ``hc_fn``: like linear weights; ``base`` / ``hc_base``: 0.5 N(0, 1);
      ``scale`` / ``hc_scale``: 1 + 0.3 N(0, 1)
    """
    shape = tuple(shape)
    if name.endswith(".sinks"):
        return normal(shape)
    if name.endswith(".position_bias"):
        return 0.5 * normal(shape)
    if name.endswith(("_hc.fn", "hc_head.hc_fn")):
        return normal(shape) * (WEIGHT_GAIN / math.sqrt(shape[1]))
    if name.endswith(("_hc.base", "hc_head.hc_base")):
        return 0.5 * normal(shape)
    if name.endswith(("_hc.scale", "hc_head.hc_scale")):
        return 1.0 + 0.3 * normal(shape)
    return random_tensor(name, shape, normal)


@torch.no_grad()
def build_v4_model(config: DeepseekV4Config, seed: int) -> DeepseekV4ForCausalLM:
    """A float32, eager model with every persisted tensor randomised; ``tid2eid`` gets distinct valid ids."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    for name, tensor in model.state_dict().items():
        if name.endswith(".tid2eid"):  # [vocab, top_k] int64: top_k distinct experts per token id
            order = torch.rand((tensor.shape[0], config.n_routed_experts), generator=gen).argsort(dim=-1)
            tensor.copy_(order[:, : tensor.shape[1]])
        else:
            tensor.copy_(v4_random_tensor(name, tensor.shape, normal))
    make_indexer_heads_antipodal_(model)
    return model.eval()


def make_deepseek_v4_fixtures(root: Path) -> None:
    """hf-v4-a."""
    print("[deepseek_v4] hf-v4-a")
    model = build_v4_model(v4_a_config(), V4_SEED_A)
    # Short prompt: crosses CSA and HCA boundaries, the indexer turns sparse while generating;
    # long prompt: far past the window, index_topk and 18 HCA windows. With ~600 sparse indexer rows
    # and ~320 logit rows per prompt the V3.2 margins are out of reach, so only the rows that choose
    # generated tokens need a clear logit gap (the parity test compares the other rows numerically)
    # and the indexer's relative gap may go down to 1e-5 (float32 score error ~1e-7 relative).
    prompts, _ = choose_prompts(
        [model], (21, 300), V4_PROMPT_SEED_A, logit_rows="generated", min_indexer_rel_gap=V4_MIN_INDEXER_REL_GAP
    )
    print("    " + activation_report(model, prompts[1]))
    write_hf_checkpoint_fixture(root / "hf-v4-a", model, prompts)


FAMILIES: dict[str, Callable[[Path], None]] = {
    "deepseek_v32": make_deepseek_v32_fixtures,
    "deepseek_v4": make_deepseek_v4_fixtures,
}


def write_readme(root: Path) -> None:
    fixtures = sorted(p.name for p in root.iterdir() if p.is_dir())
    lines = [
        "# Golden fixtures from the HuggingFace reference",
        "",
        "Generated by `tools/make_hf_fixtures.py` (see its docstring for what each file holds); do not edit by hand.",
        "Regenerate from the repository root with `python tools/make_hf_fixtures.py` in a venv made from",
        "`tools/requirements-fixtures.txt`.",
        "",
        "Versions used:",
        "",
        f"- python {sys.version.split()[0]}",
        f"- torch {torch.__version__}",
        f"- transformers {transformers.__version__}",
        f"- safetensors {safetensors.__version__}",
        f"- numpy {np.__version__}",
        "",
        "Fixtures:",
        "",
    ]
    descriptions = {
        "hf-v32-a": "tiny DeepseekV32ForCausalLM (yarn RoPE, 1 dense + 2 MoE layers, 4 routing groups), "
        "`save_pretrained` float32 checkpoint + `reference.npz`",
        "hf-v32-b": "second DeepseekV32ForCausalLM shape (default RoPE, all-MoE, 1 routing group, "
        "norm_topk_prob=False) + `reference.npz`",
        "hf-v32-fp8": "hf-v32-a weights in the original DeepSeek release layout: per-expert tensors, "
        "block-wise float8_e4m3fn + `weight_scale_inv`, 2 shards + index, fake MTP layer 3; "
        "`reference.npz` from the dequantized weights",
        "hf-v4-a": "tiny DeepseekV4ForCausalLM (SWA / CSA 4:1 + indexer / HCA 16:1 layers, hash + routed MoE, "
        "mHC, YaRN compress rope; every parameter and buffer random), `save_pretrained` float32 checkpoint + "
        "`reference.npz`",
    }
    for name in fixtures:
        lines.append(f"- `{name}/`: {descriptions.get(name, '')}")
    lines += [
        "",
        "`reference.npz` keys, per prompt i: `prompt_i` int64 [T], `logits_i` float32 [T, vocab] "
        "(no-cache forward), `generate_i` int64 [T + 24] (greedy `generate`, EOS disabled).",
        "",
    ]
    (root / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: tests/fixtures)")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="families to (re)generate")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.family or sorted(FAMILIES):
        FAMILIES[name](args.out)
    write_readme(args.out)
    for path in sorted(args.out.rglob("*")):
        if path.is_file():
            print(f"  {path.relative_to(args.out)}  {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()

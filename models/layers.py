"""Building blocks shared by the DeepSeek models: linear, norms, rotary embeddings, SwiGLU MLP, MoE
(DeepSeek's gate with each model's scoring), the lightning indexer's scores and top-k.

Weights keep HuggingFace's layout (``Linear.weight`` is ``[out, in]``, packed experts are
``gate_up_proj [E, 2F, D]`` and ``down_proj [E, D, F]``), so checkpoint loading is a name mapping with
no transposes. Axis letters: ess_jax.notation.

Decoder layers of one kind are held stacked (``stack_runs``): each run of consecutive layers with the same
module graph and parameter shapes is one module whose parameters carry a leading layer axis, and the
forward passes scan over it (``scan_runs``), so a compiled step does not grow with depth and never stacks
parameters itself. A model holds them as ``self.runs``, a run's parameters at state path
``("runs", "<first layer>", ...)``; the checkpoint names of its slice i are layer ``first + i``'s
(``ess_jax.checkpoint.hf_names``).
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu import megablox

from ess_jax import ops
from ess_jax.config import RopeConfig
from ess_jax.mesh import over_experts
from ess_jax.models import quant


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """``y = x W^T`` with ``W [out, in]`` (no bias)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, std: float = 0.02):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), std, dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...])


class Buffer(nnx.Variable):
    """A persistent, non-trained tensor (a transformers buffer: ``tid2eid``, ``e_score_correction_bias``)."""


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps)`` over the last axis, in float32 (returns float32)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMSNorm with a ``weight`` of ``dtype``: normalised in float32, cast to the weight's dtype, scaled,
    returned in x's dtype. A weight in the model dtype scales after the cast (V3.2, as transformers'
    DeepseekV3RMSNorm); a float32 weight scales in float32 and the result is cast once (DeepSeek-V4)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.weight[...]
        return (weight * rms_normalize(x, self.eps).astype(weight.dtype)).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


# ---- rotary embeddings ------------------------------------------------------------------------


def rope_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """Inverse frequencies ``[dim // 2]`` (float32) for plain RoPE or YaRN, as HF computes them."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(rope.theta) ** exponents
    extrapolation = np.float32(1.0) / pos_freqs
    if rope.rope_type == "default":
        return extrapolation.astype(np.float32)
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return dim * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_factor = np.float32(1.0) - ramp
    return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``[..., R/2]`` float32 for integer positions ``[...]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs ``(2i, 2i+1)`` of the last axis (DeepSeek's MLA layout; output stays interleaved).

    ``cos``/``sin`` are ``[B, T, R/2]`` and broadcast over any axes between T and the last one.
    """
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs ``(i, i + R/2)`` of the last axis (the non-interleaved layout of the V3.2 indexer)."""
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ---- feed-forward -----------------------------------------------------------------------------


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None) -> jax.Array:
    """``silu(gate) * up``; with a ``limit`` (V4's swiglu_limit) ``silu(min(gate, limit)) * clip(up, +-limit)``."""
    if limit is None:
        return jax.nn.silu(gate) * up
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


class MLP(nnx.Module):
    """SwiGLU: ``down(swiglu(gate x, up x))``."""

    def __init__(self, hidden: int, intermediate: int, *, limit: float | None = None, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)
        self.limit = limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def _score(logits_AE: jax.Array, scoring: str) -> jax.Array:
    if scoring == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits_AE))
    if scoring == "sigmoid":
        return jax.nn.sigmoid(logits_AE)
    return jax.nn.softmax(logits_AE, axis=-1)


class Router(nnx.Module):
    """DeepSeek's gate: ``weight [E, D]`` scores each token's experts by ``scoring`` (``"sigmoid"``,
    ``"sqrtsoftplus"`` or ``"softmax"``) of ``x W^T``, in float32.

    Selection: with ``hash_vocab`` (V4's hash layers) the fixed experts ``tid2eid[token] [V, k]``;
    otherwise the top-k of ``score + e_score_correction_bias`` (the bias selects, it does not weight),
    limited for ``n_group > 1`` to the ``topk_group`` groups whose two best biased scores sum highest
    (DeepSeek ``noaux_tc``). Weights: the chosen experts' scores, renormalised to sum 1 when
    ``norm_topk_prob``, times ``scaling``.
    """

    def __init__(self, hidden: int, n_experts: int, *, top_k: int, scoring: str, norm_topk_prob: bool,
                 scaling: float, n_group: int = 1, topk_group: int = 1, hash_vocab: int | None = None,
                 rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (n_experts, hidden), 0.02, jnp.float32))
        if hash_vocab is None:
            self.e_score_correction_bias = Buffer(jnp.zeros((n_experts,), jnp.float32))
        else:  # random distinct experts per token id until a checkpoint overrides them
            ids = jnp.argsort(jax.random.uniform(rngs.params(), (hash_vocab, n_experts)), axis=-1)[:, :top_k]
            self.tid2eid = Buffer(ids.astype(jnp.int32))
        self.hashed = hash_vocab is not None
        self.top_k, self.scoring, self.n_group, self.topk_group = top_k, scoring, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling

    def _select(self, scores_AE: jax.Array) -> jax.Array:
        """Top-k of the biased scores within the best expert groups: expert ids ``i32[A, k]``."""
        choice = scores_AE + self.e_score_correction_bias[...]
        n_experts = choice.shape[-1]
        if self.n_group > 1:
            grouped = choice.reshape(-1, self.n_group, n_experts // self.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
            _, keep = jax.lax.top_k(group_scores, self.topk_group)
            group_mask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(keep.shape[0])[:, None], keep].set(True)
            expert_mask = jnp.repeat(group_mask, n_experts // self.n_group, axis=-1)
            choice = jnp.where(expert_mask, choice, -jnp.inf)
        return jax.lax.top_k(choice, self.top_k)[1]

    def __call__(self, x_AD: jax.Array, tokens_A: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Routing weights ``f32[A, k]`` and expert ids ``i32[A, k]`` for tokens ``[A, D]`` (their ids
        ``tokens_A`` are needed by a hash router only)."""
        logits_AE = jnp.einsum("ad,ed->ae", x_AD.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        scores_AE = _score(logits_AE, self.scoring)
        experts_AK = self.tid2eid[...][tokens_A] if self.hashed else self._select(scores_AE)
        weights_AK = jnp.take_along_axis(scores_AE, experts_AK, axis=-1)
        if self.norm_topk_prob:
            weights_AK = weights_AK / (weights_AK.sum(-1, keepdims=True) + 1e-20)
        return weights_AK * self.scaling, experts_AK.astype(jnp.int32)


class Experts(nnx.Module):
    """Routed SwiGLU experts, packed: ``gate_up_proj [E, 2F, D]`` (gate rows first), ``down_proj [E, D, F]``.

    On a mesh whose ``expert`` axis splits them, expert parallelism: each device runs the experts it holds
    over the tokens routed to them and the partial sums are added over the axis (``mesh.over_experts``), so
    the tokens move (one all-reduce of ``f32[A, D]`` per MoE layer) and the weights stay where they are."""

    def __init__(self, hidden: int, intermediate: int, n_experts: int, *, limit: float | None = None, dtype,
                 rngs: nnx.Rngs):
        self.gate_up_proj = nnx.Param(_normal(rngs, (n_experts, 2 * intermediate, hidden), 0.02, dtype))
        self.down_proj = nnx.Param(_normal(rngs, (n_experts, hidden, intermediate), 0.02, dtype))
        self.limit = limit

    def __call__(self, x_AD: jax.Array, weights_AK: jax.Array, experts_AK: jax.Array) -> jax.Array:
        """The weighted sum ``f32[A, D]`` of each token's routed experts."""
        def held(routing, weights, first):
            return routed_experts(*routing, *weights, limit=self.limit, first=first)

        weights = (self.gate_up_proj.get_value(), self.down_proj.get_value())  # arrays, or quant's release values
        return over_experts(held, (x_AD, weights_AK, experts_AK), weights)


# Up to this many tokens (a decode step's rows and drafts) the experts held run densely, each over every token: the
# step reads each expert's weights once whatever it computes, and at up to ~128 tokens a matmul is still bound by
# those reads (H200, TPU v5p: ~200 / ~170 flops a byte), so the dense form costs no time. XLA fuses the layer's slice
# of the stacked weights into the matmul, so nothing weight-sized is copied. Past it, grouped matmuls over the tokens
# routed (compute in proportion to the tokens, not to the experts held).
DENSE_TOKENS = 128


def routed_experts(x_AD: jax.Array, weights_AK: jax.Array, experts_AK: jax.Array, gate_up, down, *,
                   limit: float | None, first: jax.Array | int) -> jax.Array:
    """The weighted sum ``f32[A, D]`` over each token's routed experts among those held here: ``gate_up [G, 2F, D]``
    and ``down [G, D, F]`` (arrays or ``quant`` values, read dequantized) are experts ``first .. first + G - 1``;
    the others contribute nothing. Up to ``DENSE_TOKENS`` tokens every expert held runs over every token and each
    token keeps its own experts' outputs; past it grouped matmuls (``grouped_matmul``) over the token copies sorted
    by expert, the copies for experts held elsewhere last and outside every group."""
    tokens, k = experts_AK.shape
    held = gate_up.shape[0]
    local_AK = experts_AK - first
    mine_AK = (local_AK >= 0) & (local_AK < held)
    if tokens <= DENSE_TOKENS:
        routed_GA = jnp.zeros((held + 1, tokens), jnp.float32).at[jnp.where(mine_AK, local_AK, held),
                                                                  jnp.arange(tokens)[:, None]].set(weights_AK)[:held]
        chosen_GA = jnp.zeros((held + 1, tokens), bool).at[jnp.where(mine_AK, local_AK, held),
                                                           jnp.arange(tokens)[:, None]].set(True)[:held]
        y_GAD = dense_experts(x_AD, gate_up, down, limit)
        return jnp.where(chosen_GA[..., None], y_GAD.astype(jnp.float32) * routed_GA[..., None], 0).sum(0)
    local, mine = local_AK.reshape(-1), mine_AK.reshape(-1)
    key = jnp.where(mine, local, held)
    order = jnp.argsort(key, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
    h = grouped_matmul(x_AD[token_of], gate_up[...], group_sizes)
    gate, up = jnp.split(h, 2, axis=-1)
    y = grouped_matmul(swiglu(gate, up, limit), down[...], group_sizes)
    y = jnp.where(mine[order][:, None], y.astype(jnp.float32) * weights_AK.reshape(-1)[order][:, None], 0)
    return jnp.zeros((tokens, x_AD.shape[-1]), jnp.float32).at[token_of].add(y)


def dense_experts(x_AD: jax.Array, gate_up, down, limit: float | None) -> jax.Array:
    """Every held expert over every token, ``[G, A, D]``. Weights held as arrays go through one batched matmul,
    read as stored. Quantized ones are dequantized one expert at a time: a layer's held experts dequantized at
    once are a weight-sized float32 temporary (3.76 GB for V3.2's 32 experts a device on ``expert=8``), which
    XLA:TPU keeps whole."""
    def expert(weights):
        gate_up_ND, down_DF = weights
        gate, up = jnp.split(jnp.einsum("ad,nd->an", x_AD, gate_up_ND[...]), 2, axis=-1)
        return jnp.einsum("af,df->ad", swiglu(gate, up, limit), down_DF[...])

    if isinstance(gate_up, quant.Quantized):
        return jax.lax.map(expert, (gate_up, down))
    gate, up = jnp.split(jnp.einsum("ad,gnd->gan", x_AD, gate_up), 2, axis=-1)
    return jnp.einsum("gaf,gdf->gad", swiglu(gate, up, limit), down)


def grouped_matmul(lhs_MK: jax.Array, rhs_GNK: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """``lhs_MK``'s rows in consecutive groups of ``group_sizes_G``, each times its group's ``rhs_GNK`` transposed:
    ``[M, N]`` (rows past the groups: undefined). The weights are read in their stored ``[G, N, K]`` layout, by a
    grouped matmul whose work follows the rows:

    - TPU: the Pallas grouped matmul (megablox ``gmm``, ``transpose_rhs``), not ``ragged_dot``, whose TPU kernel
      wants ``[G, K, N]`` and would copy every expert's weights into that layout each step;
    - Hopper: JAX's Mosaic GPU ragged dot (``hopper_grouped_matmul``). XLA:GPU compiles ``ragged_dot`` to one
      dense matmul over every group's weights concatenated, G times the work (32 x for a device's experts of
      V4-Flash on ``expert=8``);
    - elsewhere ``lax.ragged_dot_general``."""
    def tpu(lhs, rhs, sizes):
        (m, k), n = lhs.shape, rhs.shape[1]
        tm = 128 if m >= 128 else -(-m // 16) * 16  # row tiles: a multiple of 16 rows (bf16 packs two a sublane)
        padded = jnp.pad(lhs, ((0, -m % tm), (0, 0)))
        tile = lambda size: next((t for t in (512, 256, 128) if size % t == 0), size)  # noqa: E731
        with jax.default_matmul_precision("default"):  # Mosaic takes no "highest" for bfloat16 operands
            return megablox.gmm(padded, rhs, sizes, lhs.dtype, (tm, tile(k), tile(n)), None, None, True)[:m]

    def xla(lhs, rhs, sizes):
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)

    def cuda(lhs, rhs, sizes):
        hopper = ops.target_device().capability == (9, 0) and hopper_tiles(lhs.shape, rhs.shape, lhs.dtype, rhs.dtype)
        return hopper_grouped_matmul(lhs, rhs, sizes) if hopper else xla(lhs, rhs, sizes)

    return jax.lax.platform_dependent(lhs_MK, rhs_GNK, group_sizes_G, tpu=tpu, cuda=cuda, default=xla)


# Hopper's grouped matmul tiles: rows, output columns, the contraction; weight tiles in flight; output column tiles a
# program instance takes. From the kernel's own sweep (64 / 128 / 192 rows and columns, 64 deep); untuned on a device.
HOPPER_TILES = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def hopper_tiles(lhs_shape, rhs_shape, lhs_dtype, rhs_dtype) -> bool:
    """Whether Hopper's grouped matmul takes these operands: 16-bit floats of one dtype (its wgmma), ``K`` and
    ``N`` whole tiles."""
    (_, k), n = lhs_shape, rhs_shape[1]
    return (lhs_dtype == rhs_dtype and jnp.dtype(lhs_dtype) in (jnp.bfloat16, jnp.float16)
            and k % HOPPER_TILES["block_k"] == 0 and n % (HOPPER_TILES["block_n"] * HOPPER_TILES["grid_block_n"]) == 0)


def hopper_grouped_matmul(lhs_MK: jax.Array, rhs_GNK: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """``grouped_matmul`` by JAX's Mosaic GPU ragged dot for Hopper (TMA and wgmma): one kernel over the rows'
    tiles that reads the weights as stored (``transpose_rhs``), each row tile times its group's weights only."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m = lhs_MK.shape[0]
    padded = jnp.pad(lhs_MK, ((0, -m % 8), (0, 0)))  # its row copies take whole 8-row tiles
    with jax.default_matmul_precision("default"), jax.named_scope("grouped_matmul"):  # aot.counted_flops's name
        return ragged_dot_mgpu.ragged_dot(padded, rhs_GNK, group_sizes=group_sizes_G, transpose_rhs=True,
                                          **HOPPER_TILES)[:m]


class MoE(nnx.Module):
    """DeepSeek MoE: routed experts plus always-on shared experts (``n_shared`` of them, fused into one
    MLP), SwiGLU clamped at ``limit`` when given (V4's swiglu_limit)."""

    def __init__(self, hidden: int, intermediate: int, n_experts: int, n_shared: int, *, router: Router,
                 limit: float | None = None, dtype, rngs: nnx.Rngs):
        self.gate = router
        self.experts = Experts(hidden, intermediate, n_experts, limit=limit, dtype=dtype, rngs=rngs)
        self.shared_experts = MLP(hidden, intermediate * n_shared, limit=limit, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, tokens: jax.Array | None = None) -> jax.Array:
        """``x [..., D]`` with its token ids ``tokens [...]`` (for a hash router) -> ``[..., D]``."""
        x_AD = x.reshape(-1, x.shape[-1])
        weights_AK, experts_AK = self.gate(x_AD, None if tokens is None else tokens.reshape(-1))
        routed_AD = self.experts(x_AD, weights_AK, experts_AK)
        return (routed_AD.astype(x.dtype) + self.shared_experts(x_AD)).reshape(x.shape)


# ---- the MTP module's entry points (models.mtp) ------------------------------------------------


class MTPHost:
    """A model's MTP module methods (both families; the module itself is the family's ``mtp.py`` layer, the
    model's ``mtp[str(num_hidden_layers)]``, and each family adds ``init_mtp_cache``)."""

    def mtp_layer(self):
        """The MTP module; ValueError for a model without one."""
        if self.cfg.num_nextn_predict_layers == 0:
            raise ValueError("this model has no MTP module (num_nextn_predict_layers=0)")
        return self.mtp[str(self.cfg.num_hidden_layers)]

    def mtp_forward(self, hidden: jax.Array, next_tokens_BT: jax.Array, stage: str | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The MTP module's full causal form over positions 0..T-1: the main model's final hidden states
        (V3.2 ``[B, T, D]``, V4 ``[B, T, O, D]``) and the next tokens -> ``(logits f32[B, T, V], its hidden
        states, its indexer loss at ``stage``)``."""
        check_stage(stage)
        return self.mtp_layer().predict(self, hidden, next_tokens_BT, stage)

    def mtp_step(self, hidden: jax.Array, next_tokens_BT: jax.Array, meta, cache, *, kernels: str = "xla"):
        """The MTP module's cached step at ``meta``'s positions over its own cache (``init_mtp_cache``) ->
        ``(logits f32[B, T, V], its hidden states, cache)``. ``kernels``: the ops kernel choice (static)."""
        return self.mtp_layer().predict_step(self, hidden, next_tokens_BT, meta, cache, kernels)


# ---- lightning indexer ------------------------------------------------------------------------


def index_scores(q_BTIJ: jax.Array, keys_BSJ: jax.Array, weights_BTI: jax.Array, visible_BTS: jax.Array) -> jax.Array:
    """The lightning indexer's scores ``f32[B, T, S]`` of queries ``[B, T, I, J]`` against keys ``[B, S, J]``
    (V3.2: positions, V4: compressed entries), -inf where ``visible_BTS`` is False:

        I_t,s = sum_i w_t,i * I^-1/2 * ReLU(q_t,i . k_s * J^-1/2)        w = weights_BTI
    """
    n_heads, head_dim = q_BTIJ.shape[-2:]
    logits_BTIS = jnp.einsum("btij,bsj->btis", q_BTIJ.astype(jnp.float32), keys_BSJ.astype(jnp.float32))
    relu_BTIS = jax.nn.relu(logits_BTIS * head_dim**-0.5)
    scores_BTS = jnp.einsum("bti,btis->bts", weights_BTI.astype(jnp.float32) * n_heads**-0.5, relu_BTIS)
    return jnp.where(visible_BTS, scores_BTS, -jnp.inf)


def index_topk(scores_BTS: jax.Array, top_k: int) -> jax.Array:
    """Top-k ids ``i32[B, T, K]`` of index scores, ``K = min(top_k, S)``; -1 where fewer are visible."""
    values, ids = jax.lax.top_k(scores_BTS, min(top_k, scores_BTS.shape[-1]))
    return jnp.where(values > -jnp.inf, ids, -1).astype(jnp.int32)


# ---- indexer training (DeepSeek-V3.2 2.1.1) ------------------------------------------------------

# The full forward's training stages; None is inference (sparse attention, no indexer loss).
#   "dense":  dense causal attention, no indexer (language-model pre-training from scratch);
#   "warmup": dense attention; the indexer learns to match it over every visible position;
#   "sparse": top-k attention, as at inference; the indexer matches it over the selected positions.
# In "warmup" and "sparse" the indexer reads detached inputs, so its loss reaches no other parameter.
STAGES = ("dense", "warmup", "sparse")


def check_stage(stage: str | None) -> None:
    if stage is not None and stage not in STAGES:
        raise ValueError(f"stage={stage!r}: use one of {', '.join(STAGES)} (or None for inference)")


def indexer_kl(attention_BTS: jax.Array, scores_BTS: jax.Array, support_BTS: jax.Array) -> jax.Array:
    """The indexer's loss: mean over queries of ``KL(p_t || softmax(I_t))`` on each query's support.

    ``attention_BTS`` is the main attention's probability mass per position summed over heads; ``p_t``
    is that mass on the support, L1-normalized (a constant: gradients stop there). ``scores_BTS`` are the
    indexer's scores. Queries with an empty support or no attention mass on it do not count.
    """
    mass_BTS = jnp.where(support_BTS, jax.lax.stop_gradient(attention_BTS).astype(jnp.float32), 0.0)
    total_BT1 = mass_BTS.sum(-1, keepdims=True)
    p_BTS = mass_BTS / jnp.maximum(total_BT1, 1e-30)
    log_q_BTS = jax.nn.log_softmax(jnp.where(support_BTS, scores_BTS, -1e30), axis=-1)
    kl_BT = jnp.sum(jnp.where(p_BTS > 0, p_BTS * (jnp.log(jnp.maximum(p_BTS, 1e-30)) - log_q_BTS), 0.0), axis=-1)
    counted_BT = total_BT1[..., 0] > 0
    return jnp.sum(jnp.where(counted_BT, kl_BT, 0.0)) / jnp.maximum(counted_BT.sum(), 1)


def layer_runs(layers: list[nnx.Module]) -> list[tuple[int, int, int]]:
    """``(start, stop, period)`` of each run of consecutive layers one scan body serves: a block of ``period``
    layers repeated, each layer the same module graph with parameters of the same shapes and dtypes as the
    one ``period`` layers before it. A block repeats at least twice (else each of its layers is a run of its
    own), the shorter period first. V3.2: period 1, the first_k_dense_replace dense-MLP layers, then the MoE
    ones; V4: its leading sliding / hash-routed layers, then CSA / HCA pairs (period 2)."""
    def kind(layer):
        graphdef, state = nnx.split(layer)
        return graphdef, jax.tree.structure(state), [(x.shape, x.dtype) for x in jax.tree.leaves(state)]

    kinds = [kind(layer) for layer in layers]
    runs, start = [], 0
    while start < len(kinds):
        for period in (1, 2):
            stop = start + period
            while stop < len(kinds) and kinds[stop] == kinds[stop - period]:
                stop += 1
            stop -= (stop - start) % period  # whole blocks
            if (stop - start) // period >= 2:
                break
        else:
            period, stop = 1, start + 1
        runs.append((start, stop, period))
        start = stop
    return runs


def run_key(first: int, period: int) -> str:
    """The ``stack_runs`` key of the run of layers ``first``, ``first + period``, ...: ``"first"``, or
    ``"first:period"`` for a member of a block of ``period`` layers."""
    return str(first) if period == 1 else f"{first}:{period}"


def _parse_key(key: str) -> tuple[int, int]:
    """(first layer, period) of a ``run_key``."""
    first, _, period = key.partition(":")
    return int(first), int(period or 1)


def run_layers(key: str, count: int) -> list[int]:
    """The layer indices, in order, of the ``count`` stacked layers under ``stack_runs`` key ``key``."""
    first, period = _parse_key(key)
    return [first + period * i for i in range(count)]


def stack_runs(layers: list[nnx.Module]) -> nnx.Dict:
    """``layers`` as their runs (``layer_runs``), each of a run's block members one module of its graph whose
    every parameter is that member's layers' stacked on a leading axis; keyed by ``run_key`` of the member's
    first layer."""
    runs = {}
    for start, stop, period in layer_runs(layers):
        for first in range(start, start + period):
            graphdef = nnx.graphdef(layers[first])
            states = [nnx.state(layer) for layer in layers[first:stop:period]]
            runs[run_key(first, period)] = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
    return nnx.Dict(runs)


def scan_runs(runs: nnx.Dict, body, carry):
    """``body(layer, index, carry) -> (carry, out)`` over every layer of ``runs`` (``stack_runs``) in order,
    one ``jax.lax.scan`` per run, its step a block's layers one after the other, the layer index ``i32[]``
    traced; the final carry and the outs stacked on a leading layer axis, in layer order."""
    keys = sorted(runs, key=lambda k: _parse_key(k)[0])
    outs = []
    while keys:
        first, period = _parse_key(keys[0])
        block, keys = keys[:period], keys[period:]
        members = [nnx.split(runs[k]) for k in block]
        count = jax.tree.leaves(members[0][1])[0].shape[0]

        def step(carry, xs, graphdefs=[g for g, _ in members], first=first, period=period):
            params, i = xs
            block_outs = []
            for j, (graphdef, layer_params) in enumerate(zip(graphdefs, params)):
                carry, out = body(nnx.merge(graphdef, layer_params), first + period * i + j, carry)
                block_outs.append(out)
            return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *block_outs)

        carry, out = jax.lax.scan(step, carry, ([p for _, p in members], jnp.arange(count, dtype=jnp.int32)))
        outs.append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out))  # [count * period, ...]
    return carry, jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)

"""Per-request token sampling: greedy, temperature, top-k and top-p (nucleus), inside jit.

Every row of a batch carries its own parameters, so requests with different settings share one
compiled step. A row's draw uses the key ``fold_in(key(seed), step)``, where ``step`` counts the tokens
that request has generated before this one: the same request with the same seed produces the same
tokens whatever else is in the batch and whichever batch row it occupies.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    temperature: 0 is greedy (argmax; top_k / top_p / seed are then irrelevant), otherwise logits are
        divided by it before the filters and the draw.
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: then keep the smallest set of most likely tokens whose probability (renormalised over the
        top-k set) reaches top_p, always at least the most likely token; 1.0 keeps all.
    seed: the request's random stream, in [0, 2**32).

    Each range is checked when made (ValueError naming the parameter); what the sampler's arrays need besides,
    when a request is checked (``check``).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 keeps every token)")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed} must be in [0, 2**32)")

    def check(self) -> None:
        """ValueError naming the parameter unless the numbers are finite and the integers integers that fit the
        int32 / uint32 arrays the sampler reads (``steps.SamplingBatch``); ``RequestSpec.check`` runs it."""
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
        for name, value, high in (("top_k", self.top_k, 2**31), ("seed", self.seed, 2**32)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < high:
                raise ValueError(f"{name}={value!r} must be an integer in [0, {high})")


def sample(logits_BV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
           seed_B: jax.Array, step_B: jax.Array) -> jax.Array:
    """Pick one token per row: ``i32[B]``.

    logits_BV: f32[B, V] next-token logits.
    temperature_B: f32[B]; rows with 0 take the argmax of the logits.
    top_k_B: i32[B]; 0 keeps every token. Ties at the k-th value keep the lower token ids.
    top_p_B: f32[B] in (0, 1]; 1 keeps every token (exactly, whatever the float rounding of the mass).
    seed_B: u32[B] (or i32) per-request seed.
    step_B: i32[B] tokens this request has generated so far (0 for its first token).

    Pure and shape-static: jit it, or call it inside a jitted step. The draw of a row depends only on
    its own logits and parameters, never on the other rows or on its position in the batch.
    """
    return jax.vmap(_sample_row)(logits_BV, temperature_B, top_k_B, top_p_B, seed_B, step_B)


def _filtered(logits_V, temperature, top_k, top_p):
    """A row's logits divided by the temperature, -inf outside its top-k / top-p set (vocabulary order)."""
    vocab = logits_V.shape[0]
    scaled_V = logits_V.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)

    sorted_V, order_V = jax.lax.top_k(scaled_V, vocab)  # descending; ties keep the lower id first
    rank_V = jnp.arange(vocab)
    keep_V = (top_k == 0) | (rank_V < top_k)
    probs_V = jax.nn.softmax(jnp.where(keep_V, sorted_V, -jnp.inf))
    mass_before_V = jnp.concatenate([jnp.zeros(1), jnp.cumsum(probs_V)[:-1]])  # exactly 0 for the top token
    keep_V &= (top_p >= 1.0) | (mass_before_V < top_p)

    kept_V = jnp.zeros(vocab, bool).at[order_V].set(keep_V)  # back to vocabulary order
    return jnp.where(kept_V, scaled_V, -jnp.inf)


def _sample_row(logits_V, temperature, top_k, top_p, seed, step):
    """One row of ``sample``: filters in sorted order, the draw in vocabulary order."""
    greedy = jnp.argmax(logits_V).astype(jnp.int32)
    key = jax.random.fold_in(jax.random.key(seed), step)
    drawn = jax.random.categorical(key, _filtered(logits_V, temperature, top_k, top_p)).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


# ---- speculative decoding: verification of drafted tokens ----------------------------------------


def residual(p_V: jax.Array, q_V: jax.Array) -> jax.Array:
    """What a rejected draft samples from: ``max(0, p - q)`` (unnormalized), Leviathan et al. 2023's correction
    that makes the accepted-or-resampled token distributed as ``p``."""
    return jnp.maximum(p_V - q_V, 0.0)


def verify(logits_BTV: jax.Array, drafts_BK: jax.Array, draft_probs_BKV: jax.Array, temperature_B: jax.Array,
           top_k_B: jax.Array, top_p_B: jax.Array, seed_B: jax.Array, step_B: jax.Array, forced_B: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of each row's ``K`` drafted tokens and pick the token after it: ``(tokens i32[B, T],
    accepted i32[B])``, ``T = K + 1``. The row's output this step is ``tokens[:accepted + 1]``: the accepted
    drafts, then a corrected or bonus token (the rest of ``tokens`` is unused).

    logits_BTV: f32[B, T, V] the target's logits after the row's last token (t = 0) and after each draft.
    drafts_BK: i32[B, K] the drafted tokens; draft_probs_BKV: f32[B, K, V] the distribution each was drawn
    from (a one-hot row for a deterministic drafter).
    forced_B: bool[B] rows that accept every draft (teacher forcing: the drafts are the forced tokens).
    The rest as ``sample``; token ``n`` of a request (``step + t``) draws from ``fold_in(key(seed), n)``.

    Greedy rows (temperature 0) accept while the draft equals the argmax, and take the argmax after: the
    tokens of greedy decoding. Sampled rows use rejection sampling (Leviathan et al. 2023, Chen et al.
    2023): draft ``x`` at position t is accepted with probability ``min(1, p_t(x) / q_t(x))`` (``p``: the
    target's distribution after temperature, top-k and top-p; ``q``: the draft's), the first rejected one
    replaced by a draw from ``norm(max(0, p_t - q_t))``, and a bonus token drawn from ``p_K`` when every draft
    is accepted: each output token is distributed as the target's ``p``."""
    return jax.vmap(_verify_row)(logits_BTV, drafts_BK, draft_probs_BKV, temperature_B, top_k_B, top_p_B, seed_B,
                                 step_B, forced_B)


def _verify_row(logits_TV, drafts_K, q_KV, temperature, top_k, top_p, seed, step, forced):
    t = logits_TV.shape[0]
    k = t - 1
    greedy_T = jnp.argmax(logits_TV, axis=-1).astype(jnp.int32)
    masked_TV = jax.vmap(_filtered, (0, None, None, None))(logits_TV, temperature, top_k, top_p)
    p_TV = jax.nn.softmax(masked_TV, axis=-1)
    keys_T = jax.vmap(lambda n: jax.random.fold_in(jax.random.key(seed), step + n))(jnp.arange(t))
    u_K = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1)))(keys_T[:k])
    p_draft_K = jnp.take_along_axis(p_TV[:k], drafts_K[:, None], axis=1)[:, 0]
    q_draft_K = jnp.take_along_axis(q_KV, drafts_K[:, None], axis=1)[:, 0]
    sampled_ok_K = u_K * q_draft_K < p_draft_K  # u < p / q: accepted with probability min(1, p / q)
    residual_KV = residual(p_TV[:k], q_KV)
    # where p = q a rejection never happens; the draw is then unused
    logits_KV = jnp.where(residual_KV.sum(-1, keepdims=True) > 0, jnp.log(residual_KV), masked_TV[:k])
    redrawn_K = jax.vmap(jax.random.categorical)(keys_T[:k], logits_KV)
    bonus = jax.random.categorical(keys_T[k], masked_TV[k])
    sampled_T = jnp.concatenate([redrawn_K, bonus[None]]).astype(jnp.int32)
    ok_K = jnp.where(temperature > 0, sampled_ok_K, drafts_K == greedy_T[:k]) | forced
    accepted = jnp.cumprod(ok_K.astype(jnp.int32)).sum().astype(jnp.int32)
    picked_T = jnp.where(temperature > 0, sampled_T, greedy_T)
    drafted_T = jnp.concatenate([drafts_K, jnp.zeros(1, jnp.int32)])
    return jnp.where(jnp.arange(t) < accepted, drafted_T, picked_T), accepted

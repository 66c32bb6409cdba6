"""Per-request token sampling: greedy, temperature, top-k and top-p (nucleus), inside jit.

Every row of a batch carries its own parameters, so requests with different settings share one
compiled step. A row's draw uses the key ``fold_in(key(seed), step)``, where ``step`` counts the tokens
that request has generated before this one: the same request with the same seed produces the same
tokens whatever else is in the batch and whichever batch row it occupies.
"""

from __future__ import annotations

import dataclasses

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


def _sample_row(logits_V, temperature, top_k, top_p, seed, step):
    """One row of ``sample``: filters in sorted order, the draw in vocabulary order."""
    vocab = logits_V.shape[0]
    greedy = jnp.argmax(logits_V).astype(jnp.int32)
    scaled_V = logits_V.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)

    sorted_V, order_V = jax.lax.top_k(scaled_V, vocab)  # descending; ties keep the lower id first
    rank_V = jnp.arange(vocab)
    keep_V = (top_k == 0) | (rank_V < top_k)
    probs_V = jax.nn.softmax(jnp.where(keep_V, sorted_V, -jnp.inf))
    mass_before_V = jnp.concatenate([jnp.zeros(1), jnp.cumsum(probs_V)[:-1]])  # exactly 0 for the top token
    keep_V &= (top_p >= 1.0) | (mass_before_V < top_p)

    kept_V = jnp.zeros(vocab, bool).at[order_V].set(keep_V)  # back to vocabulary order
    key = jax.random.fold_in(jax.random.key(seed), step)
    drawn = jax.random.categorical(key, jnp.where(kept_V, scaled_V, -jnp.inf)).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)

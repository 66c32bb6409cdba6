"""DeepSeek's multi-token-prediction (MTP) module, one per family (DOMAIN.md 1.6): each family's package has its
own (``models.deepseek_v32.mtp``, ``models.deepseek_v4.mtp``); this module holds what they share.

The module (DeepSeek-V3 report 2.2, depth D = 1) predicts the token two ahead: at position ``i`` it combines
the main model's final hidden state ``h_i`` with the embedding of the next token ``t_{i+1}``, runs one
decoder block of the family over the combined sequence (causal, its own attention cache) and reads the
shared output head; its logits at ``i`` predict ``t_{i+2}``. It shares the embedding and the output head
with the main model: they are the main model's ``embed_tokens`` and ``lm_head`` (tied). The releases also
store copies of both under the MTP layer; the loader does not read them (``ess_jax.checkpoint``).

**Chaining.** The module's output hidden (``h'`` / ``Y``, before its head) is what the next draft reads in
place of the main model's: vLLM's chaining of the one module for K > 1 drafts.

**Forms** (the models' methods, ``DeepseekV32`` / ``DeepseekV4``):

- ``mtp_forward(hidden [B, T, ...], next_tokens [B, T], stage)`` -> ``(logits f32[B, T, V], hidden_out, kl)``:
  the training form, differentiable, causal over positions ``0..T-1`` (``stage`` as the main model's:
  ``models.layers.STAGES``; ``kl`` the block's indexer loss). Training pairs ``hidden_states(t[:, :-1])[:, :-1]``
  with ``next_tokens = t[:, 1:-1]`` and the labels ``t[:, 2:]``.
- ``step_hidden(tokens, meta, cache)`` -> ``(logits, hidden, ids, cache)``: the main model's cached step with
  its final hidden states (``step`` is it without them).
- ``init_mtp_cache(rows, num_pages, page_size, ...)``: the module's own cache, the family's cache type for its
  one block (``L = 1``: V3.2 latent rows and indexer keys; V4 its window, and a CSA / HCA block's rings,
  entries and indexer keys) in pages of the same geometry as the main cache, so the main model's page table
  serves it (``ess_jax.families.Family.mtp_cache_parts`` sizes it for the planner).
- ``mtp_step(hidden [B, T, ...], next_tokens [B, T], meta, mtp_cache)`` -> ``(logits f32[B, T, V],
  hidden_out, mtp_cache)``: the cached form. The token at MTP position ``i`` is the pair ``(h_i, t_{i+1})``,
  written at position ``i`` of the MTP cache (``meta.positions``, ``meta.page_table``: the main step's). So:
  (a) in prefill, after the main step over prompt positions ``p..q`` (their ``h``), run it at positions
  ``p..q-1`` with ``next_tokens = t_{p+1..q}`` and at ``q`` once ``t_{q+1}`` is sampled; (b) in decode, run it
  on the verified positions with the accepted next tokens (its last logits draft the first token), then chain:
  position ``+1`` with its own ``hidden_out`` and the draft, K times. Positions written by chained drafts are
  rewritten when the verified ``h`` reaches them; V4 rows start fresh at position 0 and rows that do not run
  (``meta.valid``) keep their state, as in the main step. Next tokens must be real ids (padding rows: any id).
"""

from __future__ import annotations

from flax import nnx

from ess_jax.models.layers import RMSNorm


class SharedHead(nnx.Module):
    """The norm before the shared output head (``shared_head.norm``; the release's ``shared_head.head`` is a
    copy of ``lm_head``, not read)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.norm = RMSNorm(dim, eps, dtype=dtype)

"""Shared test utilities."""

import dataclasses
import functools
import json
from pathlib import Path

import jax
# Pallas' fuser registers a trace-context flag when first imported, which changes the key of every jit cache
# entry; imported here, at collection, it leaves executables compiled before the first Pallas call valid after it.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from tokenizers import decoders, models, pre_tokenizers, trainers

from ess_jax.cache import StepMeta
from ess_jax.checkpoint import stacked
from ess_jax.config import ModelConfig
from ess_jax.engine import EngineConfig
from ess_jax.families import load_config
from ess_jax.models.deepseek_v32 import DeepseekV32


def randomize(module: nnx.Module, seed: int) -> nnx.Module:
    """Re-draw every parameter at magnitudes that give lively activations (unlike the 0.02 init).

    Matrices get std 1.5/sqrt(fan_in), vectors 1 + 0.1 N (norm weights) or 0.1 N (biases), so logits
    have O(1) spread and greedy choices are not near-ties. Integer buffers (V4's hash routing table) stay.
    """
    graphdef, state = nnx.split(module)
    flat = nnx.to_flat_state(state)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = []
    for key, (path, var) in zip(keys, flat):
        value = var[...]
        if jnp.issubdtype(value.dtype, jnp.integer):
            out.append((path, var))
            continue
        noise = jax.random.normal(key, value.shape, jnp.float32)
        name = path[-1]
        if value.ndim - stacked(path) >= 2:  # a matrix (of every layer in a stacked run)
            new = noise * (1.5 / np.sqrt(value.shape[-1]))
        elif name == "bias" or name == "e_score_correction_bias":
            new = 0.1 * noise
        else:
            new = 1.0 + 0.1 * noise
        out.append((path, var.replace(new.astype(value.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(out))


# tiny-v32 shrunk further for fast tests (index_topk 8 so sparsity starts early), as config.json fields.
SMALL_V32 = dict(hidden_size=64, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], q_lora_rank=32,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2,
                 index_head_dim=16, index_topk=8, intermediate_size=96, moe_intermediate_size=32)


# The test engines' prefill pieces: the chunk and single tokens (--prefill-piece-ratio of the chunk), two compiled
# prefill steps per cache shape instead of one per power of four: a compile (seconds on XLA:CPU) costs what
# hundreds of one-token pieces (milliseconds each on these models) do.

# One small engine shape for the V3.2 engine tests (prompt + new tokens <= 64), so they reuse each other's
# compiled prefill pieces and decode steps.
ENGINE = EngineConfig(max_batch=3, page_size=8, num_pages=25, prefill_chunk=32, prefill_piece_ratio=32, max_seq_len=64)

# One shape pair (resident, ESS) for the online-engine and server tests on the hf-v32-a / hf-v4-a fixtures
# (prompts up to 600 tokens), so the servers reuse the engines' compiled steps.
ONLINE_LONGEST, ONLINE_NEW = 600, 6
ONLINE = {"resident": EngineConfig(max_batch=2, page_size=16, prefill_chunk=64, prefill_piece_ratio=64,
                                   max_seq_len=ONLINE_LONGEST + ONLINE_NEW)}
ONLINE["ess"] = dataclasses.replace(ONLINE["resident"], offload="ess", pool_size=40)


def small_v32_json() -> dict:
    raw = json.loads((Path(__file__).parents[1] / "configs" / "tiny-v32.json").read_text())
    raw.pop("first_k_dense_replace")
    return dict(raw, **SMALL_V32)


def small_v32() -> ModelConfig:
    return load_config(small_v32_json())


def lively_v32(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> DeepseekV32:
    return randomize(DeepseekV32(cfg, dtype=dtype, rngs=nnx.Rngs(seed)), seed)


# One engine shape for the MTP module drafting on ``mtp_v32`` (tests/test_speculative.py, tests/test_prefix_cache.py),
# so they reuse each other's compiled steps.
MTP_ENGINE = EngineConfig(max_batch=2, page_size=8, prefill_chunk=16, prefill_piece_ratio=16, max_seq_len=64)


def mtp_v32():
    """The small V3.2 above with an MTP module, every weight random and lively, as a loaded model."""
    from ess_jax.api import Model
    from ess_jax.tokenizer import load_tokenizer

    cfg = load_config(dict(small_v32_json(), num_nextn_predict_layers=1))
    return Model("small-v32-mtp", lively_v32(cfg, seed=3), load_tokenizer(None, cfg))


# One jitted step for every PagedRun: runs over equal modules and shapes share the compiled executable.
_STEP = jax.jit(lambda graphdef, kernels, p, x, m, c: nnx.merge(graphdef, p).step(x, m, c, kernels=kernels),
                static_argnums=(0, 1), donate_argnums=5)


class PagedRun:
    """Drive a model's paged ``step`` directly (either family): ``batch`` requests in batch rows 0..B-1 with
    fragmented (interleaved, reversed) page tables, so page arithmetic errors cannot hide behind contiguous
    layouts. ``kernels``: the ops kernel choice of the step."""

    def __init__(self, module, batch: int, capacity: int, page_size: int = 4, kernels: str = "xla"):
        self.page_size = page_size
        pages = -(-capacity // page_size)
        self.cache = module.init_cache(batch, batch * pages + 1, page_size)
        # request b owns pages b+1, b+1+batch, ... in reverse order
        self.page_table = np.stack([np.arange(b + 1, batch * pages + 1, batch)[::-1] for b in range(batch)])
        self.page_table = self.page_table.astype(np.int32)
        self.lengths = np.zeros(batch, np.int32)
        graphdef, self.params = nnx.split(module)
        self._step = functools.partial(_STEP, graphdef, kernels)

    def __call__(self, tokens_BT, valid_BT=None) -> np.ndarray:
        tokens_BT = np.asarray(tokens_BT, np.int32)
        b, t = tokens_BT.shape
        valid_BT = np.ones((b, t), bool) if valid_BT is None else np.asarray(valid_BT)
        positions = self.lengths[:, None] + np.arange(t, dtype=np.int32)[None]
        meta = StepMeta(jnp.asarray(positions), jnp.asarray(valid_BT), jnp.asarray(self.page_table),
                        jnp.arange(b, dtype=jnp.int32))
        logits, self.ids, self.cache = self._step(self.params, jnp.asarray(tokens_BT), meta, self.cache)
        self.lengths += valid_BT.sum(1).astype(np.int32)
        return np.asarray(logits)

    def rows(self, layer: int, request: int) -> np.ndarray:
        """The request's cached latent rows in position order."""
        latent = np.asarray(self.cache.latent.pages[layer])[self.page_table[request]]
        return latent.reshape(-1, latent.shape[-1])[: self.lengths[request]]


def v4_release_name(name: str) -> str:
    """A DeepSeek-V4 transformers parameter name as the original release names it (DOMAIN.md 2.8), written
    independently of the loader's ``release_to_hf_name``; packed experts keep their transformers leaf
    (``layers.N.ffn.experts.gate_up_proj``), for the caller to split into ``experts.E.w1 / w3 / w2``."""
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    name = name.removeprefix("model.")
    for old, new in [
        (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
        (".attn_hc.", ".hc_attn_"), (".ffn_hc.", ".hc_ffn_"),
        (".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
        (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
        (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
        (".self_attn.compressor.", ".attn.compressor."), (".self_attn.", ".attn."), (".mlp.", ".ffn."),
        ("compressor.kv_proj.", "compressor.wkv."), ("compressor.gate_proj.", "compressor.wgate."),
        ("compressor.position_bias", "compressor.ape"), ("compressor.kv_norm.", "compressor.norm."),
        (".q_a_proj.", ".wq_a."), (".q_a_norm.", ".q_norm."), (".q_b_proj.", ".wq_b."), (".kv_proj.", ".wkv."),
        (".o_a_proj.", ".wo_a."), (".o_b_proj.", ".wo_b."), (".sinks", ".attn_sink"),
        (".gate.e_score_correction_bias", ".gate.bias"),
        (".shared_experts.gate_proj.", ".shared_experts.w1."), (".shared_experts.up_proj.", ".shared_experts.w3."),
        (".shared_experts.down_proj.", ".shared_experts.w2."),
    ]:
        name = name.replace(old, new)
    return name


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(commands: list[list[str]], devices: int = 4) -> list:
    """The processes of a run of several, ``commands`` each with ``devices`` simulated CPU devices (and LLVM's
    cheaper passes, which halve the compile time), their output piped."""
    import os
    import subprocess

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
               "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    return [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]


def outputs(procs: list, timeout: float = 300) -> list[str]:
    """Each process's standard output once all have exited, each with 0 (asserted, with its standard error's
    tail); all are killed if one is not done within ``timeout`` seconds."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def checkpoint(family: str, root: Path) -> Path:
    """A fixture checkpoint with a byte-level BPE tokenizer.json (300 ids, vocab 320) and a chat template."""
    directory = root / f"{family}-bpe"
    if directory.exists():
        return directory
    directory.mkdir()
    for f in (FIXTURES / f"hf-{family}-a").iterdir():
        (directory / f.name).symlink_to(f)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cache outgrew the device", "héllo wörld", "你好，世界", "<|user|> <|assistant|>"] * 4,
                            trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<bos>"}))
    return directory

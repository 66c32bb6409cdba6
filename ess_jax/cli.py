"""What the command-line entry points share: an argument parser whose errors are one line."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """``argparse`` with the module docstring kept as written and errors printed as one line starting
    with ``error:`` (no usage dump), exit status 2, like every other bad-input error of the CLIs."""

    def __init__(self, prog: str, description: str | None):
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-v32",
                   help="preset name (tiny-v32, random weights from --weights-seed) or a HuggingFace checkpoint "
                        "directory (config.json + *.safetensors [+ tokenizer.json]). Default: tiny-v32")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The cache, batching, kernel and dtype flags that generate, serve and bench share, one meaning each."""
    cache = p.add_argument_group("cache and batching")
    cache.add_argument("--offload", choices=["ess", "none"], default="ess",
                       help="'ess' (default): V3.2 latent rows live in pinned host memory behind an LRU device pool "
                            "of --pool-size / --pool-ratio slots per layer and request, misses fetched each step; "
                            "'none': the whole cache on the device. Both give the same tokens")
    cache.add_argument("--pool-size", type=int, default=None,
                       help="ess: device pool slots per (layer, request); at least index_topk + 1")
    cache.add_argument("--pool-ratio", type=float, default=0.2,
                       help="ess: pool slots as a fraction of the longest request's tokens, raised to "
                            "index_topk + 1 (default 0.2; --pool-size wins)")
    cache.add_argument("--fetch", choices=["inline", "split"], default="inline",
                       help="ess: how missed rows reach the device: 'inline' gathers them host-side inside the "
                            "compiled step and moves them with an in-step device_put; 'split' calls back to the "
                            "host at each layer's fetch point and gathers from a NumPy store (default inline)")
    cache.add_argument("--host-cache-mb", type=float, default=None,
                       help="ess: host store budget in MiB; sets the page count (default: enough for "
                            "--max-batch requests of --max-seq-len tokens)")
    cache.add_argument("--max-batch", type=int, default=8, help="decode batch rows (default 8)")
    cache.add_argument("--page-size", type=int, default=64, help="tokens per cache page (default 64)")
    cache.add_argument("--num-pages", type=int, default=None,
                       help="pages in the device pool, page 0 included; default: enough for --max-batch requests "
                            "of --max-seq-len tokens")
    cache.add_argument("--max-seq-len", type=int, default=None,
                       help="longest prompt + new tokens of one request (at most the model's "
                            "max_position_embeddings); default: generate sizes it to its prompts, serve uses 4096")
    cache.add_argument("--prefill-chunk", type=int, default=256,
                       help="longest prefill piece in tokens; a shorter remainder runs as power-of-two pieces "
                            "(default 256)")
    p.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="xla",
                   help="attention kernels: 'xla' (default: the Pallas kernels, Mosaic GPU kernels for Hopper, have "
                        "not yet run on a GPU), 'auto' = Pallas on a Hopper GPU and XLA elsewhere, 'pallas' (on CPU: "
                        "the Mosaic GPU interpreter, slow, for checking)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32", help="parameter and compute dtype")
    p.add_argument("--cache-dtype", choices=["bfloat16", "float32", "fp8"], default=None,
                   help="V3.2 latent rows / V4 CSA entries in the cache, host store and pool: default the --dtype; "
                        "'fp8' = FlashMLA-style rows (V3.2: e4m3 latent + one float32 scale per 128 values + bf16 "
                        "rope, 656 bytes, and the indexer keys as 128 e4m3 + one float32 scale, 132 bytes; V4: e4m3 + "
                        "ue8m0 scale per 64 values + bf16 rope, 584 bytes); V4's indexer keys, window and HCA "
                        "entries stay in --dtype")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")


def engine_config(args: argparse.Namespace, **overrides):
    """The EngineConfig the shared flags describe."""
    from ess_jax.engine import EngineConfig

    return EngineConfig(**dict(dict(
        max_batch=args.max_batch, page_size=args.page_size, num_pages=args.num_pages, max_seq_len=args.max_seq_len,
        prefill_chunk=args.prefill_chunk, offload=args.offload, pool_size=args.pool_size, pool_ratio=args.pool_ratio,
        fetch=args.fetch, host_cache_mb=args.host_cache_mb, kernels=args.kernels, cache_dtype=args.cache_dtype),
        **overrides))

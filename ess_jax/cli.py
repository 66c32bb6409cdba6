"""What the command-line entry points share: an argument parser whose errors are one line, the
persistent compilation cache, and plain-text tables."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from collections.abc import Collection
from pathlib import Path

from ess_jax.pallas_kernels.target import TARGETS


def default_compile_cache() -> str:
    """``$JAX_COMPILATION_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/ess_jax/jax`` (``~/.cache/ess_jax/jax``)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path(xdg) / "ess_jax" / "jax")


def use_compile_cache(directory: str) -> None:
    """Point jax's persistent compilation cache at ``directory`` (created if missing), every executable
    included however fast it compiled, so a second run of the same model and shapes compiles nothing;
    ``"none"`` turns the cache off. OSError when the directory cannot be written."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if directory != "none":
        path = Path(directory).expanduser().absolute()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)  # executables in it run as code: keep it private
        tempfile.TemporaryFile(dir=path).close()
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_enable_compilation_cache", directory != "none")
    compilation_cache.reset_cache()  # a cache this process already opened follows the new setting


class Parser(argparse.ArgumentParser):
    """``argparse`` with the module docstring kept as written and errors printed as one line starting
    with ``error:`` (no usage dump), exit status 2, like every other bad-input error of the CLIs. With
    ``compile_cache`` (the entry points that compile) it has ``--compile-cache`` and applies it when the
    arguments parse, before anything compiles."""

    def __init__(self, prog: str, description: str | None, compile_cache: bool = True):
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.compile_cache = compile_cache
        if compile_cache:
            self.add_argument("--compile-cache", metavar="DIR", default=default_compile_cache(),
                              help="directory where compiled steps persist between runs, so a rerun with the same "
                                   "model and shapes skips compiling; 'none' turns it off (default: "
                                   "$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/ess_jax/jax, i.e. "
                                   "~/.cache/ess_jax/jax)")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if self.compile_cache:
            try:
                use_compile_cache(parsed.compile_cache)
            except OSError as e:
                self.error(f"--compile-cache {parsed.compile_cache}: cannot write there ({e.strerror or e}); "
                           f"pass a writable directory, or --compile-cache none to compile without a cache")
        return parsed

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def table(headers: list[str], rows: list[list], right: Collection[int] = ()) -> str:
    """A plain-text table: the header, a ruler, then one line per row; cells as ``str`` gives them, padded to
    their column's width, the columns in ``right`` right-aligned, the others left-aligned."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-v32-code",
                   help="a shipped checkpoint (tiny-v32-code, tiny-v4-code: trained on Python code), a preset "
                        "(tiny-v32, tiny-v4: random weights from --weights-seed) or a HuggingFace checkpoint "
                        "directory (config.json + *.safetensors [+ tokenizer.json]). Default: tiny-v32-code")


def add_index_share_flag(p: argparse.ArgumentParser) -> None:
    """``--index-share``: the Index Share pattern a loaded model serves (``api.load_model``'s ``index_share``)."""
    p.add_argument("--index-share", default=None, metavar="PATTERN|every-N",
                   help="Index Share (DOMAIN.md 1.7): serve with this pattern instead of the config's: one letter per "
                        "indexed layer (DeepSeek-V3.2: every layer, DeepSeek-V4: the CSA layers), F runs its indexer, "
                        "S reuses the nearest preceding F layer's top-k and keeps no indexer keys; every-N: every "
                        "N-th full")


class _EssOnly(argparse.Action):
    """Store the value and remember the flag was given: these apply to ``--offload ess`` only, and
    ``engine_config`` refuses them with ``--offload none``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.ess_only_flags = sorted({*getattr(namespace, "ess_only_flags", ()), option_string})


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The cache, batching, kernel and dtype flags that generate, serve and bench share, one meaning each."""
    cache = p.add_argument_group("cache and batching")
    cache.add_argument("--offload", choices=["ess", "none"], default="ess",
                       help="'ess' (default): V3.2 latent rows live in pinned host memory behind an LRU device pool "
                            "of --pool-size / --pool-ratio slots per layer and request, misses fetched each step; "
                            "'none': the whole cache on the device. Both give the same tokens")
    cache.add_argument("--pool-size", action=_EssOnly, type=int, default=None,
                       help="ess: device pool slots per (layer, request); at least index_topk + 1")
    cache.add_argument("--pool-ratio", action=_EssOnly, type=float, default=0.2,
                       help="ess: pool slots as a fraction of the longest request's tokens, raised to "
                            "index_topk + 1 (default 0.2; --pool-size wins)")
    cache.add_argument("--fetch", action=_EssOnly, choices=["inline", "split"], default="inline",
                       help="ess: how missed rows reach the device: 'inline' gathers them host-side inside the "
                            "compiled step and moves them with an in-step device_put; 'split' calls back to the "
                            "host at each layer's fetch point and gathers from a NumPy store (default inline)")
    cache.add_argument("--miss-budget", action=_EssOnly, type=float, default=0.25,
                       help="ess: rows a decode step fetches per request and layer, as a fraction of the top-k ids "
                            "it looks up (every request's misses share one buffer); a step that misses more fetches "
                            "every id's row, so tokens stay exact (default 0.25; 1: always every id)")
    cache.add_argument("--host-cache-mb", action=_EssOnly, type=float, default=None,
                       help="ess: host store budget in MiB per --mesh data shard; sets the page count (default: "
                            "enough for the shard's --max-batch / D requests of --max-seq-len tokens)")
    cache.add_argument("--rings", action=_EssOnly, choices=["host", "device"], default=None,  # engine.config.RINGS
                       help="ess: DeepSeek-V4's HCA compressor rings (each request's open 128-token window of "
                            "projected inputs and gate logits) in host memory, the device keeping each ring's "
                            "newest row and reading a ring when its window closes ('host'), or on the device "
                            "('device'). Same tokens. Default: host, or device with --speculative (the host rings "
                            "take one token per request and step)")
    cache.add_argument("--max-batch", type=int, default=8, help="decode batch rows (default 8)")
    cache.add_argument("--page-size", type=int, default=64, help="tokens per cache page (default 64)")
    cache.add_argument("--num-pages", type=int, default=None,
                       help="pages in each --mesh data shard's pool, its page 0 included; default: enough for "
                            "the shard's --max-batch / D requests of --max-seq-len tokens")
    cache.add_argument("--max-seq-len", type=int, default=None,
                       help="longest prompt + new tokens of one request (at most the model's "
                            "max_position_embeddings); default: generate sizes it to its prompts, serve uses 4096")
    cache.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                       help="share the cached pages of prompt prefixes between requests and keep them after their "
                            "requests finish (evictable, least recently used first), so a prompt that starts like an "
                            "earlier one skips that part's prefill; same tokens either way. DeepSeek-V4 shares "
                            "prefixes of whole compressed windows (lcm of the page size and its compress rates) and "
                            "resumes from a snapshot of the window and compressor rings kept there (default on; "
                            "--no-prefix-cache turns it off)")
    cache.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                       help="the prefix cache's disk store: each cached prompt page (and DeepSeek-V4's window / ring "
                            "snapshot) is written to DIR when its prompt is prefilled (one file per page, named by its "
                            "key, written atomically, checksummed) and read back on a hit the memory cache misses, "
                            "also after a restart; a missing, truncated or corrupted file is logged and recomputed. "
                            "Several processes of one mesh use DIR/process-N")
    cache.add_argument("--prefix-cache-disk-gb", type=float, default=16.0,
                       help="the bound on --prefix-cache-dir in GiB, least recently used files out first (default 16)")
    cache.add_argument("--prefix-cache-states", type=int, default=16,
                       help="DeepSeek-V4 with the prefix cache: window and compressor-ring snapshots kept per --mesh "
                            "data shard, one per cached prompt, least recently used out first (default 16)")
    cache.add_argument("--prefill-chunk", type=int, default=256,
                       help="longest prefill piece in tokens; a shorter remainder runs as power-of-two pieces "
                            "(default 256)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", choices=["mtp"], default=None,
                      help="'mtp': the checkpoint's multi-token-prediction module drafts --num-speculative-tokens "
                           "tokens per request and step, the model verifies them in one step (greedy: the same "
                           "tokens as without; sampled: rejection sampling, the same distribution); refused for a "
                           "checkpoint without an MTP layer (default: off)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                      help="drafts per request and step with --speculative (K = 1 is DeepSeek's MTP = 2; default 1); "
                           "a request reserves 2K positions more (the verified drafts and the MTP's chain)")
    p.add_argument("--kernels", choices=("auto", "xla", "pallas", *TARGETS), default="xla",  # ess_jax.ops.KERNELS
                   help="attention kernels: 'xla' (default: the Pallas kernels have not yet run on a device), "
                        "'auto' = the device's Pallas kernels (Hopper: mosaic_gpu, other NVIDIA from sm_80: "
                        "mosaic_gpu_sm80, TPU: mosaic_tpu) and XLA elsewhere, 'pallas' = the device's (on CPU: the "
                        "Mosaic GPU interpreter, slow, for checking), or a kernel target by name (refused where "
                        "it cannot run; interpreted on CPU)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32", help="parameter and compute dtype")
    p.add_argument("--weights", choices=["dequantized", "release"], default="dequantized",
                   help="a checkpoint's quantized weights (FP8 e4m3 with 128x128 block scales; V4's FP4 experts): "
                        "'dequantized' (default) to --dtype at load; 'release': kept in their stored bytes on the "
                        "device and dequantized inside each step, layer by layer (the device holds the release's "
                        "bytes). Same logits to float32 rounding")
    p.add_argument("--cache-dtype", choices=["bfloat16", "float32", "fp8"], default=None,
                   help="V3.2 latent rows / V4 CSA entries in the cache, host store and pool: default the --dtype; "
                        "'fp8' = FlashMLA-style rows (V3.2: e4m3 latent + one float32 scale per 128 values + bf16 "
                        "rope, 656 bytes, and the indexer keys as 128 e4m3 + one float32 scale, 132 bytes; V4: e4m3 + "
                        "ue8m0 scale per 64 values + bf16 rope, 584 bytes); V4's indexer keys, window and HCA "
                        "entries stay in --dtype")
    p.add_argument("--index-dtype", choices=["fp4", "fp8", "bfloat16"], default=None,  # engine.config.INDEX_DTYPES
                   help="the indexer keys in the cache: 'fp4' = DeepSeek-V4's official QAT format (a Hadamard "
                        "rotation, e2m1 values with a ue8m0 scale per 32: 68 bytes a key; the queries get the same "
                        "round trip), refused for V3.2; 'fp8' = 128 e4m3 + one float32 scale (132 bytes; V3.2's "
                        "official format); 'bfloat16'. Default: V3.2 fp8 with --cache-dtype fp8, else --dtype")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    p.add_argument("--mesh", default=None, metavar="data=D,expert=E",
                   help="a device mesh over every device jax sees (D x E of them): the routed experts sharded over "
                        "'expert', the batch rows' cache state (ESS pools and slot tables, V4's window and rings) "
                        "over 'data' (--max-batch a multiple of D); attention weights, page pools and the host "
                        "store replicated. Same tokens as one device (default: one device)")


def add_process_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "several processes", "run the same command in every process (each with its own devices); --mesh spans all "
        "their devices and process 0 alone prints")
    g.add_argument("--num-processes", type=int, default=os.environ.get("JAX_NUM_PROCESSES", "1"),
                   help="processes the run spans (default $JAX_NUM_PROCESSES, else 1)")
    g.add_argument("--process-id", type=int, default=os.environ.get("JAX_PROCESS_ID", "0"),
                   help="this process's index in [0, --num-processes) (default $JAX_PROCESS_ID, else 0)")
    g.add_argument("--coordinator", metavar="HOST:PORT", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="process 0's address, where the processes meet (default $JAX_COORDINATOR_ADDRESS)")


def start_processes(args: argparse.Namespace):
    """Join the processes ``add_process_flags`` describes (``mesh.start``), first checking that a run of several
    has a mesh over their devices and the inline fetch backend; the Processes. In a run of several, what native
    code writes to file descriptor 1 (gloo's connection lines) goes to standard error, and ``sys.stdout`` keeps
    the original standard output, so it carries only what the run prints (``--json`` stays one object)."""
    from ess_jax import mesh

    processes = mesh.Processes(args.num_processes, args.process_id, args.coordinator)
    if processes.count > 1:
        if not args.mesh:
            raise ValueError(f"--num-processes {processes.count} needs --mesh over every process's devices, e.g. "
                             f"--mesh data={processes.count}")
        if args.offload == "ess" and args.fetch == "split":
            raise ValueError("--fetch split keeps the host store in one process's NumPy memory; with "
                             "--num-processes > 1 use --fetch inline")
        sys.stdout.flush()
        sys.stdout = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    mesh.start(processes)
    return processes


def engine_config(args: argparse.Namespace, **overrides):
    """The EngineConfig the shared flags describe, every flag checked before a model loads: ``flags_config``'s
    checks, and the memory the cache needs at least (when ``--model`` names a config this can read without
    loading weights) against the machine's."""
    config = flags_config(args, **overrides)
    check_before_load(args, config)
    return config


def flags_config(args: argparse.Namespace, **overrides):
    """The EngineConfig the shared flags describe, checked without asking this machine: the engine's checks
    (``EngineConfig`` checks types, ranges and NaN / inf), ESS-only flags given with ``--offload none``, the
    sampling and length flags of the entry points that have them."""
    from ess_jax.engine import EngineConfig

    given = getattr(args, "ess_only_flags", [])
    if args.offload == "none" and given:
        raise ValueError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --offload ess only; "
                         f"drop {'it' if len(given) == 1 else 'them'} or use --offload ess")
    check_run_flags(args)
    return EngineConfig(**dict(dict(
        max_batch=args.max_batch, page_size=args.page_size, num_pages=args.num_pages, max_seq_len=args.max_seq_len,
        prefill_chunk=args.prefill_chunk, offload=args.offload, pool_size=args.pool_size, pool_ratio=args.pool_ratio,
        fetch=args.fetch, miss_budget=args.miss_budget, host_cache_mb=args.host_cache_mb, rings=args.rings,
        kernels=args.kernels,
        cache_dtype=args.cache_dtype, index_dtype=args.index_dtype, mesh=args.mesh, prefix_cache=args.prefix_cache,
        prefix_cache_states=args.prefix_cache_states, prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_gb=args.prefix_cache_disk_gb,
        **speculative(args)), **overrides))


def speculative(args: argparse.Namespace) -> dict:
    """``--speculative`` / ``--num-speculative-tokens`` as EngineConfig fields (K defaults to 1; K without
    --speculative is refused by the config)."""
    k = getattr(args, "num_speculative_tokens", None)
    mode = getattr(args, "speculative", None)
    return dict(speculative=mode, num_speculative_tokens=k if k is not None else 1 if mode else 0)


def check_run_flags(args: argparse.Namespace) -> None:
    """The sampling and length flags an entry point has (``generate``'s ``--temperature``, ``--top-k``, ...):
    finite, in range, integers that fit the sampler's arrays; ValueError naming the flag."""
    for name in ("temperature", "top_p"):
        value = getattr(args, name, None)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} {value} must be a finite number")
    for name, low, high in (("top_k", 0, 2**31), ("seed", 0, 2**32), ("weights_seed", 0, 2**32),
                            ("max_new_tokens", 1, 2**31)):
        value = getattr(args, name, None)
        if value is not None and not low <= value < high:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be in [{low}, {high})")


def _check_prompts(prompts: list, source, cfg, config, max_new_tokens: int) -> None:
    """``generate``'s prompts against the model's vocabulary and positions, before it loads: ``--prompt-ids``
    as given, ``--prompt`` / ``--prompt-file`` through the checkpoint's tokenizer (read alone, no weights).
    A list that does not parse or a file that cannot be read is ``generate``'s to report."""
    from ess_jax.tokenizer import load_tokenizer

    longest = min(config.max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    tokenizer = None
    for kind, value in prompts:
        flag = {"ids": "--prompt-ids", "text": "--prompt", "file": "--prompt-file"}[kind]
        try:
            if kind == "ids":
                ids = [int(x) for x in value.split(",") if x.strip()]
            else:
                if tokenizer is None:
                    tokenizer = load_tokenizer(source.checkpoint, cfg)
                ids = tokenizer.encode(value if kind == "text" else Path(value).read_text())
        except (ValueError, OSError):
            continue
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"{flag}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        reserve = 2 * config.num_speculative_tokens  # the drafts' positions (``Scheduler.reserve``)
        if len(ids) + max_new_tokens + reserve > longest:
            raise ValueError(f"{flag}: {len(ids)} prompt tokens + --max-new-tokens {max_new_tokens}"
                             + (f" + {reserve} for the drafts" if reserve else "") + f" exceed the {longest} tokens "
                             "a request may have (max_position_embeddings, or --max-seq-len)")


def check_before_load(args: argparse.Namespace, config) -> None:
    """Refuse, before the model loads, ``--prompt-ids`` the model cannot take and a cache the machine cannot
    hold: the sizes the engine gets at least, through ``engine.cache_layout`` and ``engine.check_memory``
    (``generate`` cuts the batch to its prompts and ``eval`` to its windows, and both size requests to them:
    so the rows of the prompts, or one, and ``--max-seq-len``, or the new tokens + 1). ``Engine`` checks the
    sizes it gets again, exactly, before it allocates."""
    from ess_jax import mesh, ops
    from ess_jax.config import resolve_model
    from ess_jax.engine import cache_layout, check_memory
    from ess_jax.families import source_config

    if config.mesh:
        mesh.check_devices(mesh.parse(config.mesh))
    ops.resolve_kernels(config.kernels)  # Pallas where the backend has no kernels for it

    model = getattr(args, "model", None)
    if model is None:
        return
    source = resolve_model(model, getattr(args, "index_share", None))
    if getattr(args, "weights", None) == "release" and source.checkpoint is None:
        raise ValueError(f"--weights release keeps a checkpoint's quantized tensors as stored; the preset {model} "
                         "has random weights and no checkpoint: drop --weights release or pass a checkpoint")
    cfg = source_config(source)
    prompts = getattr(args, "prompts", None)
    if config.max_seq_len is not None and config.max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-seq-len {config.max_seq_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings}); lower it")
    _check_prompts(prompts or [], source, cfg, config, getattr(args, "max_new_tokens", 1))
    rows = mesh.batch_rows(len(prompts) if prompts else 1, config.max_batch, config.mesh)
    tokens = config.max_seq_len or min(getattr(args, "max_new_tokens", 0) + 1, cfg.max_position_embeddings)
    least = dataclasses.replace(config, max_batch=rows, max_seq_len=tokens)
    check_memory(cache_layout(cfg, least, getattr(args, "dtype", "float32"), lower_bound=True))

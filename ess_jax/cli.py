"""What the command-line entry points share: an argument parser whose errors are one line, the
persistent compilation cache, and plain-text tables."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import sys
import tempfile
import typing
from collections.abc import Collection
from pathlib import Path


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


class _ModeOnly(argparse.Action):
    """Store the value and remember the flag was given: it applies to one ``--offload`` mode only (its field's
    ``only``), and ``flags_config`` refuses it with the other."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.mode_only_flags = sorted({*getattr(namespace, "mode_only_flags", ()), option_string})


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags that generate, serve, eval, export and lm-eval share, one meaning each: the model's dtype and
    weights, then one flag per ``EngineConfig`` field with a ``help`` (``engine.config``'s docstring): an int or
    float field's type, an enum field's values as choices, a bool field as ``--x`` / ``--no-x``."""
    from ess_jax.engine.config import EngineConfig, flag

    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32", help="parameter and compute dtype")
    p.add_argument("--weights", choices=["dequantized", "release"], default="dequantized",
                   help="a checkpoint's quantized weights (FP8 e4m3 with 128x128 block scales; V4's FP4 experts): "
                        "'dequantized' (default) to --dtype at load; 'release': kept in their stored bytes on the "
                        "device and dequantized inside each step, layer by layer (the device holds the release's "
                        "bytes). Same logits to float32 rounding")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    groups = {}
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        meta = field.metadata
        if "help" not in meta:
            continue
        kind = next(t for t in typing.get_args(hints[field.name]) or (hints[field.name],) if t is not type(None))
        kwargs = {key: meta[key] for key in ("choices", "metavar") if key in meta}
        default = meta.get("cli_default", field.default)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif issubclass(kind, enum.Enum):
            kwargs["choices"] = [member.value for member in kind]
            default = None if default is None else kind(default).value
        elif kind in (int, float):
            kwargs["type"] = kind
        if "only" in meta:
            kwargs["action"] = _ModeOnly
        group = meta.get("group")
        if group is not None and group not in groups:
            groups[group] = p.add_argument_group(group)
        (groups[group] if group else p).add_argument(flag(field.name), default=default, help=meta["help"], **kwargs)


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
    (``EngineConfig`` checks types, ranges and NaN / inf), flags of one offload mode given with the other, the
    sampling and length flags of the entry points that have them. ``--num-speculative-tokens`` defaults to 1 with
    ``--speculative``, else to 0 (K without ``--speculative`` is refused by the config)."""
    from ess_jax.engine.config import EngineConfig, flag

    flagged = [field for field in dataclasses.fields(EngineConfig) if "help" in field.metadata]
    only = {flag(field.name): field.metadata["only"] for field in flagged if "only" in field.metadata}
    given = [name for name in getattr(args, "mode_only_flags", []) if only[name] != args.offload]
    if given:
        raise ValueError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --offload "
                         f"{only[given[0]]} only; drop {'it' if len(given) == 1 else 'them'} or use --offload "
                         f"{only[given[0]]}")
    check_run_flags(args)
    values = {field.name: getattr(args, field.name) for field in flagged}
    if values["num_speculative_tokens"] is None:
        values["num_speculative_tokens"] = 1 if args.speculative else 0
    return EngineConfig(**{**values, **overrides})


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

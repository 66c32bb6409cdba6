"""The engine's configuration: ``EngineConfig`` and the enums of its modes (they compare equal to the CLI
strings, so ``config.offload == "ess"`` reads as the flag does).

A field's metadata describes its flag (``cli.add_engine_flags``, ``--`` and the name with ``-`` for ``_``):
``help``, the flag's help text (a field without one has no flag); ``group``, its help section; ``choices``, a
string field's values (an enum field's are its members); ``metavar``; ``cli_default``, the flag's default where
it is not the field's; ``only``, the offload mode the flag applies to (``cli.flags_config`` refuses it with the
other)."""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np
import jax.numpy as jnp

from ess_jax import mesh, ops, tier

CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "fp8": jnp.uint8}  # fp8: 656-byte-style rows
RINGS = ("host", "device")  # ess: where DeepSeek-V4's HCA compressor rings live (ess_jax.tier.rings)
INDEX_DTYPES = ("fp4", "fp8", "bfloat16")  # indexer keys: 68 / 132 / 256 bytes at J = 128 (ops.index_key_storage)
_CACHE = "cache and batching"  # the flags' help sections
_SPECULATIVE = "speculative decoding"


class Offload(enum.StrEnum):
    ESS = "ess"  # the offloaded part (V3.2 latent rows, V4 CSA entries) in host memory behind an LRU device pool
    NONE = "none"  # every cache part on the device


class Fetch(enum.StrEnum):
    INLINE = "inline"  # misses gathered from the pinned-host store inside the step
    SPLIT = "split"  # misses through host callbacks into a NumPy store


assert tuple(Fetch) == tier.FETCH_BACKENDS


class Speculative(enum.StrEnum):
    MTP = "mtp"  # the checkpoint's multi-token-prediction module drafts, the model verifies


def _flag(default, help: str, **cli):
    """A field with a flag: ``help`` and the other ``cli`` keys (the module docstring's) as its metadata."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine serves a model: cache placement and sizes, batching, speculative decoding, kernels, cache
    dtypes, the device mesh. The fields are in their flags' order; their help texts speak of the CLIs, whose
    defaults differ in two: ``offload`` (the API: ``none``) and ``num_speculative_tokens`` (the API: 0; the CLI:
    1 with ``--speculative``)."""

    offload: Offload = _flag(
        Offload.NONE, group=_CACHE, cli_default=Offload.ESS,
        help="'ess' (default): V3.2 latent rows live in pinned host memory behind an LRU device pool of --pool-size / "
             "--pool-ratio slots per layer and request, misses fetched each step; 'none': the whole cache on the "
             "device. Both give the same tokens")
    pool_size: int | None = _flag(
        None, group=_CACHE, only=Offload.ESS,
        help="ess: device pool slots per (layer, request); at least index_topk + 1")
    pool_ratio: float = _flag(
        0.2, group=_CACHE, only=Offload.ESS,
        help="ess: pool slots as a fraction of the longest request's tokens, raised to index_topk + 1 (default 0.2; "
             "--pool-size wins)")
    fetch: Fetch = _flag(
        Fetch.INLINE, group=_CACHE, only=Offload.ESS,
        help="ess: how missed rows reach the device: 'inline' gathers them host-side inside the compiled step and "
             "moves them with an in-step device_put; 'split' calls back to the host at each layer's fetch point and "
             "gathers from a NumPy store (default inline)")
    miss_budget: float = _flag(
        0.25, group=_CACHE, only=Offload.ESS,
        help="ess: rows a decode step fetches per request and layer, as a fraction of the top-k ids it looks up "
             "(every request's misses share one buffer); a step that misses more fetches every id's row, so tokens "
             "stay exact (default 0.25; 1: always every id)")
    host_cache_mb: float | None = _flag(
        None, group=_CACHE, only=Offload.ESS,
        help="ess: host store budget in MiB per --mesh data shard; sets the page count (default: enough for the "
             "shard's --max-batch / D requests of --max-seq-len tokens)")
    rings: str | None = _flag(
        None, group=_CACHE, only=Offload.ESS, choices=RINGS,
        help="ess: DeepSeek-V4's HCA compressor rings (each request's open 128-token window of projected inputs and "
             "gate logits) in host memory, the device keeping each ring's newest row and reading a ring when its "
             "window closes ('host'), or on the device ('device'). Same tokens. Default: host, or device with "
             "--speculative (the host rings take one token per request and step)")
    max_batch: int = _flag(8, group=_CACHE, help="decode batch rows (default 8)")
    page_size: int = _flag(64, group=_CACHE, help="tokens per cache page (default 64)")
    num_pages: int | None = _flag(
        None, group=_CACHE,
        help="pages in each --mesh data shard's pool, its page 0 included; default: enough for the shard's "
             "--max-batch / D requests of --max-seq-len tokens")
    max_seq_len: int | None = _flag(  # the API's None: max_position_embeddings
        None, group=_CACHE,
        help="longest prompt + new tokens of one request (at most the model's max_position_embeddings); default: "
             "generate sizes it to its prompts, serve uses 4096")
    prefix_cache: bool = _flag(
        True, group=_CACHE,
        help="share the cached pages of prompt prefixes between requests and keep them after their requests finish "
             "(evictable, least recently used first), so a prompt that starts like an earlier one skips that part's "
             "prefill; same tokens either way. DeepSeek-V4 shares prefixes of whole compressed windows (lcm of the "
             "page size and its compress rates) and resumes from a snapshot of the window and compressor rings kept "
             "there (default on; --no-prefix-cache turns it off)")
    prefix_cache_dir: str | None = _flag(
        None, group=_CACHE, metavar="DIR",
        help="the prefix cache's disk store: each cached prompt page (and DeepSeek-V4's window / ring snapshot) is "
             "written to DIR when its prompt is prefilled (one file per page, named by its key, written atomically, "
             "checksummed) and read back on a hit the memory cache misses, also after a restart; a missing, "
             "truncated or corrupted file is logged and recomputed. Several processes of one mesh use "
             "DIR/process-N")
    prefix_cache_disk_gb: float = _flag(
        16.0, group=_CACHE,
        help="the bound on --prefix-cache-dir in GiB, least recently used files out first (default 16)")
    prefix_cache_states: int = _flag(
        16, group=_CACHE,
        help="DeepSeek-V4 with the prefix cache: window and compressor-ring snapshots kept per --mesh data shard, "
             "one per cached prompt, least recently used out first (default 16)")
    prefill_chunk: int = _flag(
        256, group=_CACHE,
        help="longest prefill piece in tokens; a shorter remainder runs in pieces of the powers of "
             "--prefill-piece-ratio (default 256)")
    prefill_piece_ratio: int = _flag(
        4, group=_CACHE, metavar="R",
        help="prefill piece sizes: 1, R, R^2, ... below --prefill-chunk, and the chunk; each size is a compiled "
             "prefill step, and a prompt's tail runs as up to R - 1 pieces of each (exact pieces, no padding). A "
             "larger R compiles fewer steps and runs more of them (R >= the chunk: sizes 1 and the chunk alone; "
             "default 4)")
    speculative: Speculative | None = _flag(
        None, group=_SPECULATIVE,
        help="'mtp': the checkpoint's multi-token-prediction module drafts --num-speculative-tokens tokens per "
             "request and step, the model verifies them in one step (greedy: the same tokens as without; sampled: "
             "rejection sampling, the same distribution); refused for a checkpoint without an MTP layer (default: "
             "off)")
    num_speculative_tokens: int = _flag(
        0, group=_SPECULATIVE, cli_default=None, metavar="K",
        help="drafts per request and step with --speculative (K = 1 is DeepSeek's MTP = 2; default 1); a request "
             "reserves 2K positions more (the verified drafts and the MTP's chain)")
    kernels: str = _flag(
        "xla", choices=ops.KERNELS,
        help="attention kernels: 'xla' (default: the Pallas kernels have not yet run on a device), 'auto' = the "
             "device's Pallas kernels (Hopper: mosaic_gpu, other NVIDIA from sm_80: mosaic_gpu_sm80, TPU: "
             "mosaic_tpu) and XLA elsewhere, 'pallas' = the device's (on CPU: the Mosaic GPU interpreter, slow, for "
             "checking), or a kernel target by name (refused where it cannot run; interpreted on CPU)")
    cache_dtype: str | None = _flag(
        None, choices=tuple(CACHE_DTYPES),
        help="V3.2 latent rows / V4 CSA entries in the cache, host store and pool: default the --dtype; 'fp8' = "
             "FlashMLA-style rows (V3.2: e4m3 latent + one float32 scale per 128 values + bf16 rope, 656 bytes, and "
             "the indexer keys as 128 e4m3 + one float32 scale, 132 bytes; V4: e4m3 + ue8m0 scale per 64 values + "
             "bf16 rope, 584 bytes); V4's indexer keys, window and HCA entries stay in --dtype")
    index_dtype: str | None = _flag(
        None, choices=INDEX_DTYPES,
        help="the indexer keys in the cache: 'fp4' = DeepSeek-V4's official QAT format (a Hadamard rotation, e2m1 "
             "values with a ue8m0 scale per 32: 68 bytes a key; the queries get the same round trip), refused for "
             "V3.2; 'fp8' = 128 e4m3 + one float32 scale (132 bytes; V3.2's official format); 'bfloat16'. Default: "
             "V3.2 fp8 with --cache-dtype fp8, else --dtype")
    mesh: str | None = _flag(
        None, metavar="data=D,expert=E",
        help="a device mesh over every device jax sees (D x E of them): the routed experts sharded over 'expert', "
             "the batch rows' cache state (ESS pools and slot tables, V4's window and rings) over 'data' "
             "(--max-batch a multiple of D); attention weights, page pools and the host store replicated. Same "
             "tokens as one device (default: one device)")
    keep_logits: bool = False  # keep each output token's float32 logits in Request.logits (the API's alone)

    def __post_init__(self):
        for name in ("max_batch", "page_size", "prefill_chunk"):
            self._check_number(name, 1, integer=True)
        self._check_number("prefill_piece_ratio", 2, integer=True)
        self._check_number("num_pages", 2, integer=True, why=" (page 0 is the reserved null page)")
        for name in ("max_seq_len", "pool_size", "prefix_cache_states"):
            self._check_number(name, 1, integer=True)
        self._check_number("pool_ratio", 0, high=1)
        self._check_number("miss_budget", 0, high=1)
        self._check_number("host_cache_mb", 0, unit="MiB")
        self._check_number("prefix_cache_disk_gb", 0, unit="GiB")
        if self.prefix_cache_dir is not None and not self.prefix_cache:
            raise ValueError("--prefix-cache-dir is the prefix cache's disk store: drop it or the --no-prefix-cache")
        for name in ("keep_logits", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.offload not in tuple(Offload):
            raise ValueError(f"--offload {self.offload!r} is not a mode; use 'ess' or 'none'")
        ops.check_kernels(self.kernels)  # the backend is asked when the engine is built (a config starts no backend)
        if self.cache_dtype not in (None, *CACHE_DTYPES):
            raise ValueError(f"--cache-dtype {self.cache_dtype!r} is not a cache dtype; use one of "
                             f"{', '.join(CACHE_DTYPES)}")
        if self.index_dtype not in (None, *INDEX_DTYPES):
            raise ValueError(f"--index-dtype {self.index_dtype!r} is not an indexer key format; use one of "
                             f"{', '.join(INDEX_DTYPES)}")
        if self.rings not in (None, *RINGS):
            raise ValueError(f"--rings {self.rings!r} is not a ring placement; use one of {', '.join(RINGS)}")
        if self.fetch not in tuple(Fetch):
            raise ValueError(f"--fetch {self.fetch!r} is not a fetch backend; use one of {', '.join(Fetch)}")
        if self.speculative is not None and self.speculative not in tuple(Speculative):
            raise ValueError(f"--speculative {self.speculative!r} is not a drafter; use one of "
                             f"{', '.join(Speculative)}")
        self._check_number("num_speculative_tokens", 0, integer=True)
        if (self.speculative is None) != (self.num_speculative_tokens == 0):
            raise ValueError("--speculative and --num-speculative-tokens go together: --speculative mtp "
                             "--num-speculative-tokens K (K >= 1), or neither")
        if self.speculative is not None:
            object.__setattr__(self, "speculative", Speculative(self.speculative))
        object.__setattr__(self, "offload", Offload(self.offload))
        object.__setattr__(self, "fetch", Fetch(self.fetch))
        if self.mesh is not None:
            mesh.check_rows(mesh.parse(self.mesh), self.max_batch)
        # The ESS-only fields are ignored with offload "none" (one config serves both paths through
        # dataclasses.replace); the CLIs refuse ESS-only flags given with --offload none (cli.flags_config).

    def _check_number(self, name: str, low: int, high: int | None = None, integer: bool = False, unit: str = "",
                      why: str = "") -> None:
        """ValueError naming the flag unless the field ``name`` is None where that is its default, or: with
        ``integer`` an integer >= ``low``; with ``high`` a number in (``low``, ``high``]; else a finite number of
        ``unit`` > ``low``. A bool is no number; ``why`` ends the message."""
        value = getattr(self, name)
        if value is None and self.__dataclass_fields__[name].default is None:
            return
        if integer:
            ok, what = isinstance(value, (int, np.integer)) and value >= low, f"an integer >= {low}"
        elif high is not None:
            ok, what = isinstance(value, (int, float)) and low < value <= high, f"a number in ({low}, {high}]"
        else:
            ok = isinstance(value, (int, float)) and math.isfinite(value) and value > low
            what = f"a finite number of {unit} > {low}"
        if isinstance(value, bool) or not ok:
            raise ValueError(f"{flag(name)} {value!r} must be {what}{why}")

    @property
    def ring_placement(self) -> str:
        """Where DeepSeek-V4's HCA compressor rings live under ESS: ``rings`` when given, else in host memory, or
        on the device with speculative decoding (the host rings take one token per request and step). Resolved
        here, not in ``__post_init__``, so a config ``dataclasses.replace``-d to speculate gets the device's."""
        return self.rings or ("device" if self.speculative is not None else "host")


def flag(name: str) -> str:
    """The CLI flag of an ``EngineConfig`` field."""
    return "--" + name.replace("_", "-")

"""The engine's configuration: ``EngineConfig`` and the enums of its modes (they compare equal to the CLI
strings, so ``config.offload == "ess"`` reads as the flag does)."""

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


class Offload(enum.StrEnum):
    NONE = "none"  # every cache part on the device
    ESS = "ess"  # the offloaded part (V3.2 latent rows, V4 CSA entries) in host memory behind an LRU device pool


class Fetch(enum.StrEnum):
    INLINE = "inline"  # misses gathered from the pinned-host store inside the step
    SPLIT = "split"  # misses through host callbacks into a NumPy store


assert tuple(Fetch) == tier.FETCH_BACKENDS


class Speculative(enum.StrEnum):
    MTP = "mtp"  # the checkpoint's multi-token-prediction module drafts, the model verifies


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # decode batch rows
    page_size: int = 64  # tokens per cache page
    num_pages: int | None = None  # pages in each data shard's pool incl. its null page; default: its rows' requests
    # at full length
    max_seq_len: int | None = None  # longest prompt + max_new_tokens served; default: max_position_embeddings
    prefill_chunk: int = 256  # longest prefill piece; a shorter remainder is cut into power-of-two pieces
    offload: Offload = Offload.NONE  # "ess": the offloaded part in host memory behind an LRU device pool
    pool_size: int | None = None  # ess: pool slots per (layer, request); wins over pool_ratio
    pool_ratio: float = 0.2  # ess: pool slots as a fraction of the longest request's entries
    fetch: Fetch = Fetch.INLINE  # ess: how misses reach the device (ess_jax.tier)
    miss_budget: float = 0.25  # ess: rows a decode step fetches per batch row and layer, a fraction of the ids it
    # looks up (every row's misses in one buffer); a step that misses more fetches every id's row (exact)
    host_cache_mb: float | None = None  # ess: host store budget per data shard; sets the page count when given
    rings: str | None = None  # ess: DeepSeek-V4's HCA compressor rings in host memory ("host") or on the device;
    # None: ring_placement's default
    keep_logits: bool = False  # keep each output token's float32 logits in Request.logits
    kernels: str = "xla"  # attention kernels: "xla", "pallas", "auto" (Pallas on GPU, XLA elsewhere)
    cache_dtype: str | None = None  # offloaded part's rows: None = the model's dtype, or a CACHE_DTYPES key
    index_dtype: str | None = None  # indexer keys, an INDEX_DTYPES entry ("fp4": DeepSeek-V4 only); None: V3.2 fp8
    # with --cache-dtype fp8, else the model's dtype
    mesh: str | None = None  # "data=D,expert=E": a device mesh over every device (ess_jax.mesh); None: one device
    speculative: Speculative | None = None  # "mtp": speculative decoding, drafts from the MTP module
    num_speculative_tokens: int = 0  # K: drafts verified per request per decode step (with --speculative)
    prefix_cache: bool = True  # full prompt pages shared between requests whose prompts start alike, kept cached
    # (evictable) after their requests finish (ess_jax.allocator)
    prefix_cache_dir: str | None = None  # the prefix cache's disk store: cached prompt pages (and V4 snapshots)
    # written there, read back on a hit, also after a restart (ess_jax.prefix_store); None: none
    prefix_cache_disk_gb: float = 16.0  # the disk store's bound in GiB, least recently used files out first
    prefix_cache_states: int = 16  # DeepSeek-V4: snapshots of a request's window and compressor rings the prefix
    # cache keeps per data shard (one per cached prompt, at its last cacheable boundary), least recently used out

    def __post_init__(self):
        for name in ("max_batch", "page_size", "prefill_chunk", "num_pages", "max_seq_len", "pool_size",
                     "prefix_cache_states"):
            value = getattr(self, name)
            if value is None and name in ("num_pages", "max_seq_len", "pool_size"):
                continue
            low = 2 if name == "num_pages" else 1
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                why = " (page 0 is the reserved null page)" if name == "num_pages" else ""
                raise ValueError(f"{flag(name)} {value!r} must be an integer >= {low}{why}")
        if (isinstance(self.pool_ratio, bool) or not isinstance(self.pool_ratio, (int, float))
                or not 0 < self.pool_ratio <= 1):
            raise ValueError(f"--pool-ratio {self.pool_ratio!r} must be a number in (0, 1]")
        if (isinstance(self.miss_budget, bool) or not isinstance(self.miss_budget, (int, float))
                or not 0 < self.miss_budget <= 1):
            raise ValueError(f"--miss-budget {self.miss_budget!r} must be a number in (0, 1]")
        if self.host_cache_mb is not None and (
                isinstance(self.host_cache_mb, bool) or not isinstance(self.host_cache_mb, (int, float))
                or not math.isfinite(self.host_cache_mb) or self.host_cache_mb <= 0):
            raise ValueError(f"--host-cache-mb {self.host_cache_mb!r} must be a finite number of MiB > 0")
        if (isinstance(self.prefix_cache_disk_gb, bool) or not isinstance(self.prefix_cache_disk_gb, (int, float))
                or not math.isfinite(self.prefix_cache_disk_gb) or self.prefix_cache_disk_gb <= 0):
            raise ValueError(f"--prefix-cache-disk-gb {self.prefix_cache_disk_gb!r} must be a finite number of GiB > 0")
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
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"--num-speculative-tokens {k!r} must be an integer >= 0")
        if (self.speculative is None) != (k == 0):
            raise ValueError("--speculative and --num-speculative-tokens go together: --speculative mtp "
                             "--num-speculative-tokens K (K >= 1), or neither")
        if self.speculative is not None:
            object.__setattr__(self, "speculative", Speculative(self.speculative))
        object.__setattr__(self, "offload", Offload(self.offload))
        object.__setattr__(self, "fetch", Fetch(self.fetch))
        if self.mesh is not None:
            mesh.check_rows(mesh.parse(self.mesh), self.max_batch)
        # The ESS-only fields are ignored with offload "none" (one config serves both paths through
        # dataclasses.replace); the CLIs refuse ESS-only flags given with --offload none (cli.engine_config).

    @property
    def ring_placement(self) -> str:
        """Where DeepSeek-V4's HCA compressor rings live under ESS: ``rings`` when given, else in host memory, or
        on the device with speculative decoding (the host rings take one token per request and step). Resolved
        here, not in ``__post_init__``, so a config ``dataclasses.replace``-d to speculate gets the device's."""
        return self.rings or ("device" if self.speculative is not None else "host")


def flag(name: str) -> str:
    """The CLI flag of an ``EngineConfig`` field."""
    return "--" + name.replace("_", "-")

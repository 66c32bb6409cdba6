"""``python -m ess_jax.plan``: KV bytes per token and concurrent requests on a device mesh, with and without offload.

For the real presets (deepseek-v3.2, deepseek-v4-flash, deepseek-v4-pro) the planner splits the
KV cache into its parts (DOMAIN.md 3), each of them *offloaded* (host store + device pool),
*resident* (on the device, read densely every step) or *fixed* (a per-request state that does not
grow with the context):

    deepseek_v32, per layer and token: latent row [c | k_rope]   offloaded   bf16 1152 B, FP8 656 B
                                       indexer key               resident    bf16  256 B, FP8 132 B
    deepseek_v4, per CSA layer:        main row per 4 tokens     offloaded   bf16 1024 B, FP8 584 B
                                       indexer key per 4 tokens  resident    bf16 256 B, FP8 132 B, FP4 68 B
                 per HCA layer:        main row per 128 tokens   resident
                 per layer:            SWA window of 128 rows    fixed
                 per CSA / HCA layer:  compressor tails (fp32)   fixed       64 + 16 KiB / 512 KiB
                                       (offloaded, ``--rings host``: the HCA tails in host memory, the device
                                       keeping each ring's newest row, 4 KiB a layer, and an int32 slot)

Formats (``--formats``): ``engine`` (the default) counts each part as ess_jax's engine stores it
(``Family.stored_formats``: ``--cache-dtype fp8`` makes V3.2's latent rows and indexer keys and V4's CSA
entries FP8; V4's indexer keys, HCA rows, SWA window and compressor tails stay in the model's ``--dtype``) in
whole pages of ``--page-size`` tokens (``Part.page_bytes``: V4's 128-token HCA rows on 64-token pages take a page
each), so its bytes per device are the compiled decode's arguments; ``release`` counts DeepSeek's release formats
(the table above, float32 tails) row by row.

Row formats: FP8 V3.2 latent = C e4m3 + C/128 fp32 scales + R bf16 rope (FlashMLA's 656-byte row);
FP8 V4 main row = (H - R) e4m3 + R bf16 + (H - R)/64 ue8m0 scales, padded to 8 bytes (584);
FP8 indexer key = J e4m3 + one fp32 scale (132); FP4 = J/2 e2m1 + J/32 ue8m0 (68); bf16 = 2 bytes a value.

Capacity, for a context of ``S`` tokens and a pool ratio ``r`` (GB = 1e9 bytes throughout):

    resident request   = S * (a + i) + s                 a / i: offloaded / resident bytes per token
    offloaded request  = S * i + s + sum over offloaded layers of P * row  [+ overheads, below]
    P                  = min(max(ceil(r * E), min(k, E) + 1), E)   E: entries of the layer, k: index_topk
                         (ess_jax.tier.pool_slots: the top-k hits plus the entry written this step)
    host bytes         = every offloaded row of every admitted request (the host store), and with
                         ``--rings host`` (the default) their HCA compressor rings (ess_jax.tier.rings)

On a device mesh (``--mesh data=D,expert=E``, ess_jax.mesh; default expert=32, ESS's EP 32, or fewer for
a model whose routed experts 32 does not divide: the largest divisor of 32 that divides them) the bytes
per device follow the engine's sharding rules: the routed experts split over ``expert`` (whole experts:
E must divide them), every other weight replicated; a request's whole cache (its pages of the resident
parts and of the host store in each data shard's own pool; its batch-row state: V4's SWA window and
compressor tails, the tier's pools, slot tables, residency map, staged rows and counters) on its data
shard's devices only:

    bytes per device   = B / D * request                  B requests in all, a multiple of D
    max batch          = D * floor(KV budget / request)   with --kv-budget-gb: KV bytes only
                       = D * the most rows b with b * request + temporaries(b) <= KV budget   otherwise
    KV budget          = --kv-budget-gb, or --gpu-mem-gb * --mem-fraction - weights per device
                         (release formats: V3.2 FP8 with fp32 128x128 block scales; V4 FP4 experts,
                         FP8 attention and shared experts, bf16 compressors / indexers / embeddings)
    temporaries(b)     = max(experts, b * (E * (4 H_idx + J * s) + V * (8 + s)))   the decode step's (``step_bytes``)
                         experts: one MoE layer's routed experts on a device (FP4 dequantized to the model dtype);
                         per batch row the indexer's f32 scores of H_idx heads and its keys of J values (s bytes,
                         the model dtype) over the E entries an indexed layer holds, and the head's logits (two
                         float32 and one model-dtype copy of V); within 7 % of XLA's memory analysis for V3.2
                         and V4-Flash on H200 (``docs/results/compiled.md``)
                         --tpu adds per batch row one layer's stored rows as XLA:TPU lays them out, each padded to
                         whole 128-byte lanes: the E keys (an FP8 key's 132 bytes take 256) and, offloaded, the P pool
                         rows as bytes and as the attention kernel's 32-bit words (V4's 592-byte row: 640 + 1024)

Each data shard serves ``floor(KV budget / request)`` requests; its host store holds theirs (each of its
devices' host memory holds a copy of the shard's store). ESS's figures are per GPU, each GPU attending for
its own requests: data shards of one device each.

``--accounting ess_jax`` (the default) adds what ess_jax's tier keeps on the device besides rows: the
residency map (4 bytes per entry of each offloaded layer), two int32 slot tables (8 bytes per pool
slot), the staged row of each offloaded layer (one row) with its int32 page and offset (8 bytes), and
the int32 counters (16 bytes per offloaded layer); ``--accounting paper`` counts KV rows only, as ESS's
Table 2 does. With paper accounting and ``f = i / (a + i)`` the offloaded batch is ``B(r) = B0 / (f + (1 - f) r)``
(DOMAIN.md 4.2; for deepseek-v3.2 FP8, f = 8052 / 48068 = 0.1675), up to floors and the pool minimum.

Example (ESS's setting: 82 GB of FP8 KV per GPU; Table 2's baselines 52 at 32K and 13 at 128K):
    python -m ess_jax.plan --model deepseek-v3.2 --cache-dtype fp8 --kv-budget-gb 82 \\
        --context 32768 --context 131072 --pool-ratio 0.21 --pool-ratio 0.1 --accounting paper

Errors print one line starting with "error:" and exit with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

from ess_jax import families, mesh, tier
from ess_jax.cli import Parser, table
from ess_jax.config import PRESETS, ModelConfig, read_json, resolve_model
from ess_jax.families import Part, load_config, source_config

GB = 1e9
REAL_PRESETS = ("deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4-pro")
CACHE_DTYPES = ("bfloat16", "fp8")
INDEX_DTYPES = ("auto", "bfloat16", "fp8", "fp4")
ACCOUNTINGS = ("ess_jax", "paper")
RINGS = ("host", "device")
FORMATS = ("engine", "release")
PAGE_SIZE = 64  # the engine's default page (``EngineConfig.page_size``; the planner imports no engine)


def stored_formats(cfg: ModelConfig, cache_dtype: str, index_dtype: str = "auto", formats: str = "release",
                   dtype: str = "bfloat16") -> families.Formats:
    """How a request of ``cfg`` is stored: as DeepSeek's release does (``formats`` "release": every row in
    ``cache_dtype``, the compressor tails in float32), or as ess_jax's engine of ``--cache-dtype cache_dtype`` does
    for a ``dtype`` model ("engine": ``Family.stored_formats``, its ``init_cache``'s: ``cache_dtype`` where the
    engine takes it, V3.2's latent rows and indexer keys and V4's CSA entries; V4's indexer keys, HCA rows, SWA
    window and compressor tails in ``dtype``). ``index_dtype`` "auto": the formats' own indexer keys."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"--cache-dtype {cache_dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
    if formats not in FORMATS:
        raise ValueError(f"--formats {formats!r} is not one of {', '.join(FORMATS)}")
    if formats == "engine":
        return families.get(cfg.family).stored_formats(cache_dtype, dtype,
                                                       None if index_dtype == "auto" else index_dtype)
    return families.Formats(entries=cache_dtype, index=cache_dtype if index_dtype == "auto" else index_dtype,
                            rows=cache_dtype, ring="float32", release=True)


def cache_parts(cfg: ModelConfig, cache_dtype: str, index_dtype: str = "auto", formats: str = "release",
                dtype: str = "bfloat16") -> list[Part]:
    """The KV cache of one request of ``cfg``, part by part, in ``stored_formats``."""
    stored = stored_formats(cfg, cache_dtype, index_dtype, formats, dtype)
    return [p for p in families.get(cfg.family).cache_parts(cfg, stored) if p.layers]


def snapshot_bytes(parts: list[Part]) -> int:
    """Bytes of one prefix-cache snapshot: a request's row state (DeepSeek-V4's window and compressor rings, every
    layer, as the device holds them; 0 for a family without one), which the prefix cache copies to host memory at
    a prompt's block boundaries and keeps with its cached pages."""
    return sum(p.bytes(0) for p in parts if p.where == "fixed")


@dataclasses.dataclass(frozen=True)
class RequestBytes:
    """One request's bytes."""

    resident: int  # the whole cache on the device
    device: int  # with offload: resident + fixed parts, pools and (ess_jax) tier tables
    host: int  # with offload: the host store (every offloaded row)
    pool_slots: int | None  # per offloaded layer


def request_bytes(parts: list[Part], context: int, ratio: float, accounting: str = "ess_jax",
                  rings: str = "host", page_size: int | None = None) -> RequestBytes:
    """Bytes of one request of ``context`` tokens, resident and offloaded at pool ratio ``ratio``; offloaded, the
    compressor rings in host memory (``rings`` "host": ``families.host_rings``) or on the device. ``page_size``: the
    engine's pages of that many tokens, whole pages of each paged part (``Part.page_bytes``: a page holds at least
    one row, so V4's 128-token HCA rows on 64-token pages take a page each); None: its rows alone."""
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"--accounting {accounting!r} is not one of {', '.join(ACCOUNTINGS)}")
    if rings not in RINGS:
        raise ValueError(f"--rings {rings!r} is not one of {', '.join(RINGS)}")

    def held(p: Part) -> int:  # the request's bytes of part ``p``
        if page_size is None or not p.tokens_per_row:
            return p.bytes(context)
        return -(-context // page_size) * p.page_bytes(page_size)

    resident = sum(held(p) for p in parts)
    placed = families.host_rings(parts) if rings == "host" else parts
    device = sum(held(p) for p in placed if p.where not in ("offloaded", "host"))
    host, slots = sum(held(p) for p in placed if p.where == "host"), None
    for p in parts:
        if p.where != "offloaded":
            continue
        entries = p.entries(context)
        slots = tier.pool_slots(entries, p.topk, pool_ratio=ratio)
        if accounting == "ess_jax":  # the tier's arrays, its residency map over the request's entries
            device += tier.device_bytes(layers=p.layers, rows=1, slots=slots, row_bytes=p.row_bytes, entries=entries)
        else:  # the pools' rows
            device += p.layers * slots * p.row_bytes
        host += held(p)
    return RequestBytes(resident, device, host, slots)


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """A decode step's temporaries on one device, which peak at one of two points: one MoE layer's routed experts
    as the step holds them (``experts``), or the batch rows' indexer scores, gathered keys and logits
    (``per_request`` each). ``temporaries(rows)`` is the larger: what XLA's memory analysis reports within a few
    per cent for V3.2 and V4-Flash on 8 x H200 (``docs/results/compiled.md``)."""

    per_request: int  # the indexer's f32 scores and its keys in the model dtype over the context, the logits
    experts: int  # one MoE layer's routed experts on the device: FP4 ones dequantized to the model dtype

    def temporaries(self, rows: int) -> int:
        return max(self.experts, rows * self.per_request)


TPU_LANES = 128  # a TPU's vector lanes: an array's minor dimension is laid out in whole multiples of them


def lanes(n: int) -> int:
    """``n`` bytes of a TPU array's minor dimension as laid out: whole multiples of ``TPU_LANES``."""
    return -(-n // TPU_LANES) * TPU_LANES


def step_bytes(cfg: ModelConfig, parts: list[Part], context: int, dtype: str = "bfloat16",
               shape: mesh.MeshShape = mesh.MeshShape(), tpu: bool = False, pool_slots: int = 0) -> StepBytes:
    """The decode step's temporaries per device for requests of ``context`` tokens (``parts``: their cache) on a
    mesh of ``shape``, release-format experts: the indexer scores ``f32[H_idx, E]`` and keys ``[E, J]`` (``E`` the
    entries an indexed layer holds) and the head's logits (two float32 and one ``dtype`` copy) per request; one
    layer's held routed experts, as stored or, below a byte a value (V4's FP4), dequantized to ``dtype``. On a TPU
    (``tpu``) a request also has its layer's stored keys as rows, each padded to whole lanes (``lanes``: an FP8
    key's 132 bytes take 256): XLA:TPU copies the layer's key pages to that layout to write and read them; and,
    offloaded with pools of ``pool_slots``, its layer's pool rows (``tpu_pool_bytes``)."""
    itemsize = 2 if dtype == "bfloat16" else 4
    indexed = [p for p in parts if "indexer" in p.name]
    entries = max((p.entries(context) for p in indexed), default=0)
    per_request = entries * (4 * cfg.index_n_heads + itemsize * cfg.index_head_dim) + cfg.vocab_size * (8 + itemsize)
    if tpu:
        per_request += max((p.entries(context) * lanes(p.row_bytes) for p in indexed), default=0)
        per_request += tpu_pool_bytes(parts, pool_slots)
    held = (cfg.n_routed_experts // shape.expert, 3 * cfg.moe_intermediate_size, cfg.hidden_size)
    stored = families.get(cfg.family).release_bytes(["mlp", "experts", "weight"], True, held)
    experts = math.prod(held) * itemsize if stored < math.prod(held) else stored
    return StepBytes(per_request, int(experts))


def tpu_pool_bytes(parts: list[Part], slots: int) -> int:
    """A TPU decode step's copies of one offloaded layer's pool of ``slots`` rows per request, besides
    ``step_bytes``: its rows as bytes and as the attention kernel's 32-bit words, each row padded to whole lanes
    (``lanes``: V4's 592-byte FP8 row takes 640 bytes, and 1024 as 148 words)."""
    return max((slots * (lanes(p.row_bytes) + 4 * lanes(p.row_bytes // 4)) for p in parts if p.where == "offloaded"),
               default=0)


def bytes_per_device(request: int, batch: int, data: int) -> int:
    """Bytes on each device of a mesh of ``data`` data shards serving ``batch`` requests (a multiple of
    ``data``: each shard ``batch / data`` of them, on its own devices) of ``request`` bytes each."""
    if batch % data:
        raise ValueError(f"{batch} requests do not divide over {data} data shards")
    return batch // data * request


def max_batch(request: int, budget: float, data: int, step: StepBytes | None = None) -> int:
    """The most requests (a multiple of ``data``) whose ``bytes_per_device``, with ``step``'s temporaries for their
    rows on each device (None: none), fit in ``budget``."""
    rows = int(budget // request)
    if step is not None:
        rows = max(0, min(int((budget - step.experts) // request), int(budget // (request + step.per_request))))
    return data * rows


# ---- weights per device ------------------------------------------------------------------------

def param_bytes(cfg: ModelConfig, path: tuple[str, ...], shape: tuple[int, ...], itemsize: int) -> tuple[str, float]:
    """(``"routed"`` | ``"other"``, bytes) of one parameter as the official release stores it; parameters
    kept unquantized count at the model's own dtype (``itemsize``)."""
    names = [str(p) for p in path]
    routed = "experts" in names and "shared_experts" not in names
    stored = families.get(cfg.family).release_bytes(names, routed, shape)
    return ("routed" if routed else "other"), (math.prod(shape) * itemsize if stored is None else stored)


def weight_bytes(cfg: ModelConfig, shape: mesh.MeshShape = mesh.MeshShape()) -> dict[str, float]:
    """Routed-expert and other weight bytes in the release formats on each device of a mesh of ``shape``
    (the default, one device: the whole model), by the engine's rule (``mesh.param_spec``); ValueError when
    the experts do not divide over the ``expert`` axis. Shapes from the NNX model, built abstractly (the only
    part of the planner that imports flax and the model)."""
    import jax.numpy as jnp
    from flax import nnx

    mesh.check_experts(cfg.n_routed_experts, shape.expert)
    model_cls = families.get(cfg.family).module_cls
    abstract = nnx.eval_shape(lambda: model_cls(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    totals = {"routed": 0.0, "other": 0.0}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        kind, size = param_bytes(cfg, path, tuple(variable.shape), variable.dtype.itemsize)
        split = "expert" in mesh.param_spec(mesh.path_names(path), tuple(variable.shape))
        totals[kind] += size / shape.expert if split else size
    return totals


# ---- CLI ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("python -m ess_jax.plan", __doc__, compile_cache=False)
    p.add_argument("--model", action="append",
                   help=f"preset ({', '.join(PRESETS)}) or a config.json / checkpoint directory (repeatable; "
                        f"default: {', '.join(REAL_PRESETS)})")
    p.add_argument("--cache-dtype", action="append", choices=CACHE_DTYPES,
                   help="KV row format (repeatable; default: both)")
    p.add_argument("--index-dtype", choices=INDEX_DTYPES, default="auto",
                   help="indexer key format (fp4: V4's 68-byte keys); auto: the --formats' own (engine: V3.2's keys in "
                        "--cache-dtype, V4's in --dtype; release: --cache-dtype)")
    p.add_argument("--formats", choices=FORMATS, default="engine",
                   help="engine (default): the rows as ess_jax's engine stores them (--cache-dtype fp8: V3.2's latent "
                        "rows and keys, V4's CSA entries; V4's other rows in --dtype); release: every row as "
                        "DeepSeek's release stores it (--cache-dtype rows, float32 compressor tails)")
    p.add_argument("--page-size", type=int, default=PAGE_SIZE,
                   help=f"the engine's tokens per cache page (default {PAGE_SIZE}): with --formats engine "
                        "and --accounting ess_jax each paged part in whole pages")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the model's dtype, the engine's format for the rows it does not store in --cache-dtype "
                        "(default bfloat16)")
    p.add_argument("--context", action="append", type=int,
                   help="tokens per request (repeatable; default 32768, 131072)")
    p.add_argument("--pool-ratio", action="append", type=float,
                   help="device pool slots / entries of the request (repeatable; default 0.5, 0.2, 0.1)")
    budget = p.add_argument_group("KV budget per device (GB = 1e9 bytes)")
    budget.add_argument("--kv-budget-gb", type=float, default=None,
                        help="KV-cache memory per device; wins over the device memory / weights estimate")
    budget.add_argument("--gpu-mem-gb", type=float, default=141.0, help="device memory (default 141, an H200)")
    budget.add_argument("--mem-fraction", type=float, default=0.9,
                        help="share of device memory for the weights, the KV cache and the decode step's "
                             "temporaries, the rest for the runtime (default 0.9)")
    budget.add_argument("--tpu", action="store_true",
                        help="the devices are TPUs: the decode step's temporaries also hold one layer's 8-bit rows "
                             "padded to 128-byte lanes (the indexer keys; with offload the pool's rows, as bytes and "
                             "as 32-bit words)")
    budget.add_argument("--weights-gb", type=float, default=None,
                        help="weight bytes per device, instead of the release formats' on the --mesh")
    p.add_argument("--mesh", default=None, metavar="data=D,expert=E",
                   help="the device mesh (ess_jax.mesh): routed experts split over expert, batch rows over data, "
                        "everything else on every device (default expert=32, ESS's EP 32, or for a model of fewer "
                        "routed experts the largest expert size under 32 that divides them)")
    p.add_argument("--rings", action="append", choices=RINGS,
                   help="with offload, DeepSeek-V4's HCA compressor rings in host memory (the device keeps each "
                        "ring's newest row) or on the device (repeatable; default: host)")
    p.add_argument("--accounting", choices=ACCOUNTINGS, default="ess_jax",
                   help="ess_jax (default): KV rows + the tier's residency map and slot tables; paper: KV rows only")
    p.add_argument("--index-share", action="append", metavar="PATTERN|every-N|none",
                   help="Index Share (DOMAIN.md 1.7): plan the model with this pattern of full (F) / shared (S) "
                        "indexed layers, or every N-th full; shared layers keep no indexer keys (repeatable; "
                        "default: the config's own)")
    p.add_argument("--json", action="store_true", help='print {"models": [...], "rows": [...]} as one JSON object')
    return p.parse_args(argv)


def _load_config(name: str) -> ModelConfig:
    """``--model``: a config.json file, or a model name ``config.resolve_model`` knows."""
    if name.endswith(".json") and Path(name).is_file():
        return load_config(read_json(name), name)
    return source_config(resolve_model(name))


def _check(args: argparse.Namespace) -> None:
    for c in args.context:
        if c < 1:
            raise ValueError(f"--context {c} must be >= 1")
    for r in args.pool_ratio:
        if not 0 < r <= 1:
            raise ValueError(f"--pool-ratio {r} must be in (0, 1]")
    if args.kv_budget_gb is not None and args.kv_budget_gb <= 0:
        raise ValueError(f"--kv-budget-gb {args.kv_budget_gb} must be > 0")
    if args.page_size < 1:
        raise ValueError(f"--page-size {args.page_size} must be >= 1")
    if args.gpu_mem_gb <= 0:
        raise ValueError(f"--gpu-mem-gb {args.gpu_mem_gb} must be > 0")
    if not 0 < args.mem_fraction <= 1:
        raise ValueError(f"--mem-fraction {args.mem_fraction} must be in (0, 1]")
    if args.weights_gb is not None and args.weights_gb < 0:
        raise ValueError(f"--weights-gb {args.weights_gb} must be >= 0")


def plan(args: argparse.Namespace) -> dict:
    """The planner's result: ``{"models": [...], "rows": [...]}`` (the ``--json`` object)."""
    models, rows = [], []
    shares = getattr(args, "index_share", None) or [None]
    for name, share in itertools.product(args.model, shares):
        cfg = _load_config(name).with_index_share(None if share == "none" else share)
        if share is not None:  # the model as planned with this Index Share pattern
            name = f"{name} [index-share {share}]"
        # ESS's EP 32 by default, or the most experts per device under it that divide a smaller model's
        shape = mesh.parse(args.mesh) if args.mesh else mesh.MeshShape(expert=math.gcd(32, cfg.n_routed_experts))
        too_long = [c for c in args.context if c > cfg.max_position_embeddings]
        if too_long:
            raise ValueError(f"--context {too_long[0]} exceeds {name}'s max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        budget = {"source": "kv-budget-gb"}
        if args.kv_budget_gb is not None:
            kv_budget = args.kv_budget_gb * GB
        else:
            weights = args.weights_gb * GB if args.weights_gb is not None else sum(weight_bytes(cfg, shape).values())
            kv_budget = args.gpu_mem_gb * GB * args.mem_fraction - weights
            budget = {"source": "gpu-mem-gb", "gpu_mem_bytes": args.gpu_mem_gb * GB, "mem_fraction": args.mem_fraction,
                      "weights_bytes_per_device": weights}
            if kv_budget <= 0:
                raise ValueError(f"{name}: weights take {weights / GB:.1f} GB per device, more than "
                                 f"{args.mem_fraction:g} x {args.gpu_mem_gb:.1f} GB; raise --mesh expert=... or "
                                 "--gpu-mem-gb")
        budget["kv_budget_bytes"] = kv_budget
        layouts = []
        for dtype in args.cache_dtype:
            parts = cache_parts(cfg, dtype, args.index_dtype, args.formats, args.dtype)
            index = stored_formats(cfg, dtype, args.index_dtype, args.formats, args.dtype).index
            per_token = {w: sum(p.bytes_per_token() for p in parts if p.where == w) for w in ("offloaded", "resident")}
            total = per_token["offloaded"] + per_token["resident"]
            layouts.append({"cache_dtype": dtype,
                            "parts": [dataclasses.asdict(p) | {"bytes_per_token": p.bytes_per_token()} for p in parts],
                            "offloaded_bytes_per_token": per_token["offloaded"],
                            "resident_bytes_per_token": per_token["resident"],
                            "bytes_per_token": total, "offloaded_fraction": per_token["offloaded"] / total,
                            "fixed_bytes_per_request": snapshot_bytes(parts)})  # (a snapshot holds them)
            for context, ratio, rings in itertools.product(args.context, args.pool_ratio, args.rings):
                paged = args.formats == "engine" and args.accounting == "ess_jax"  # the engine's whole pages
                req = request_bytes(parts, context, ratio, args.accounting, rings, args.page_size if paged else None)
                # the step's temporaries come out of a device's memory, not out of a --kv-budget-gb
                step = offload_step = None
                if args.kv_budget_gb is None:
                    step = step_bytes(cfg, parts, context, args.dtype, shape, args.tpu)
                    offload_step = step_bytes(cfg, parts, context, args.dtype, shape, args.tpu, req.pool_slots or 0)
                resident_batch = max_batch(req.resident, kv_budget, shape.data, step)
                offload_batch = max_batch(req.device, kv_budget, shape.data, offload_step)
                rows.append({
                    "model": name, "mesh": str(shape), "context": context, "pool_ratio": ratio, "cache_dtype": dtype,
                    "formats": args.formats, "index_dtype": index,
                    "rings": rings if any(p.ring for p in parts) else None,
                    "accounting": args.accounting, "kv_budget_bytes": kv_budget,
                    "max_batch_resident": resident_batch, "max_batch_offload": offload_batch,
                    "capacity_gain": offload_batch / resident_batch if resident_batch else None,
                    "host_bytes_per_device": offload_batch // shape.data * req.host, "pool_slots": req.pool_slots,
                    "resident_bytes_per_request": req.resident, "device_bytes_per_request": req.device,
                    "host_bytes_per_request": req.host,
                    "temporaries_bytes_per_device": (offload_step.temporaries(offload_batch // shape.data)
                                                     if offload_step else None),
                })
        models.append({"model": name, "family": cfg.family, "mesh": str(shape), "budget": budget, "layouts": layouts})
    return {"models": models, "rows": rows}


def render(result: dict) -> str:
    out = []
    for m in result["models"]:
        b = m["budget"]
        source = ("--kv-budget-gb" if b["source"] == "kv-budget-gb" else
                  f"{b['gpu_mem_bytes'] / GB:g} GB x {b['mem_fraction']:g} - weights "
                  f"{b['weights_bytes_per_device'] / GB:.1f} GB")
        out.append(f"{m['model']} ({m['family']}) on a {m['mesh']} mesh: KV budget {b['kv_budget_bytes'] / GB:.2f} GB "
                   f"per device [{source}]")
        rows = []
        for lay in m["layouts"]:
            for p in lay["parts"]:
                per_row = f"{p['tokens_per_row']}" if p["tokens_per_row"] else "fixed"
                per_token = (f"{p['bytes_per_token']:,.2f}" if p["tokens_per_row"]
                             else f"{p['layers'] * p['row_bytes']:,} / req")
                rows.append([lay["cache_dtype"], p["name"], p["where"], p["layers"], p["row_bytes"], per_row,
                             per_token])
            rows.append([lay["cache_dtype"], "total per token", f"offloaded {100 * lay['offloaded_fraction']:.2f} %",
                         "", "", "", f"{lay['bytes_per_token']:,.2f}"])
        out.append(table(["dtype", "part", "where", "layers", "row B", "tokens/row", "B/token"], rows, {3, 4, 5, 6}))
        out.append("")
    rows = [[r["model"], r["cache_dtype"], r["index_dtype"], r["rings"] or "-", r["context"], f"{r['pool_ratio']:g}",
             r["pool_slots"],
             f"{r['resident_bytes_per_request'] / GB:.3f}", f"{r['device_bytes_per_request'] / GB:.3f}",
             r["max_batch_resident"], r["max_batch_offload"],
             f"{r['capacity_gain']:.2f}x" if r["capacity_gain"] is not None else "-",
             f"{r['host_bytes_per_device'] / GB:.1f}"] for r in result["rows"]]
    accounting = result["rows"][0]["accounting"] if result["rows"] else ""
    out.append(f"Max concurrent requests on each model's mesh ({accounting} accounting; GB = 1e9 bytes)")
    out.append(table(["model", "dtype", "index", "rings", "context", "ratio", "pool slots", "GB/req resident",
                      "GB/req offload", "batch resident", "batch offload", "gain", "host GB/device"], rows,
                     set(range(4, 13))))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = args.model or list(REAL_PRESETS)
    args.cache_dtype = args.cache_dtype or list(CACHE_DTYPES)
    args.context = args.context or [32768, 131072]
    args.pool_ratio = args.pool_ratio or [0.5, 0.2, 0.1]
    args.rings = args.rings or ["host"]
    try:
        _check(args)
        result = plan(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one place models reach compute kernels through.

Each op has a pure-XLA implementation and a Pallas kernel (pallas_kernels/) behind the same
signature, chosen per call by the keyword-only ``kernels`` argument (the CLI's ``--kernels``):

- ``"xla"`` (the default): the kernels' jnp references (``absorbed_mla_reference``,
  ``attention_with_sink_reference``) over rows gathered by XLA, at JAX's default matmul precision, on
  any backend;
- a kernel target by name (ess_jax.pallas_kernels.target): ``"mosaic_gpu"`` (Hopper, sm_90: TMA and
  wgmma), ``"mosaic_gpu_sm80"`` (NVIDIA from sm_80: plain copies, Ampere mma), ``"mosaic_tpu"`` (TPU);
  refused by name on a device it cannot run on, run in its interpreter on a CPU (slow, for tests);
- ``"pallas"``: the device's own kernels (as ``auto``), refused where there are none (AMD GPUs); on a
  CPU the Hopper kernels interpreted;
- ``"auto"``: the device's own kernels: Hopper: mosaic_gpu; Ampere, Ada and Blackwell: mosaic_gpu_sm80
  (wgmma is Hopper-only); TPU: mosaic_tpu; XLA on AMD GPUs, NVIDIA before sm_80 and CPUs.

The device is the abstract mesh's abstract device when one is in use (lowering for another machine),
else the default backend's (``target_device``), at trace time. The kernels lower for their devices
without one (tests/kernels/test_lowering.py, test_mosaic_gpu_sm80.py, test_mosaic_tpu.py); running
them on a device is unverified (see pallas_kernels/sparse_mla.py).

Latent rows are float ``[..., C + R]`` or, for ``--cache-dtype fp8``, V3.2 FP8 rows
``uint8 [..., mla_row_bytes(C, R)]`` (656 bytes for C = 512, R = 64; ess_jax.pallas_kernels.fp8_rows):
the dtype of the rows is the cache format, and every MLA op here accepts both.
Axis letters: ess_jax.notation.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp

from ess_jax import mesh as device_mesh
from ess_jax.pallas_kernels import fp8_rows
from ess_jax.pallas_kernels import sparse_mla as sparse_mla_kernel
from ess_jax.pallas_kernels import sparse_v4_attention as v4_kernel
from ess_jax.pallas_kernels.target import TARGETS

if TYPE_CHECKING:
    from ess_jax.cache import RowSource, Sources

KERNELS = ("auto", "xla", "pallas", *TARGETS)
# NVIDIA device kinds -> compute capability, for abstract devices (a real device reports its own); first match wins
_CAPABILITIES = ((r"GH200|H100|H200|H800|H20\b", (9, 0)), (r"GB200|GB300|B100|B200|B300", (10, 0)),
                 (r"RTX 50|RTX PRO \d+ Blackwell", (12, 0)), (r"\bL4\b|L40|RTX 40|Ada", (8, 9)),
                 (r"A100|A800|A30\b", (8, 0)), (r"A10\b|A10G|A16\b|A2\b|A40|RTX 30|RTX A\d", (8, 6)),
                 (r"T4\b|RTX 20", (7, 5)), (r"V100", (7, 0)))


@dataclasses.dataclass(frozen=True)
class Device:
    """What the kernel choice looks at: ``platform`` ``"cpu"``, ``"tpu"``, ``"cuda"`` or ``"rocm"``, the
    device kind, and an NVIDIA GPU's compute capability ``(major, minor)`` (None elsewhere or unknown)."""

    platform: str
    kind: str
    capability: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        cc = f", compute capability {self.capability[0]}.{self.capability[1]}" if self.capability else ""
        return f"{self.kind or self.platform}{cc}"


def compute_capability(text: str, kind: str) -> tuple[int, int] | None:
    if m := re.fullmatch(r"(\d+)\.(\d+)", text.strip()):
        return int(m[1]), int(m[2])
    return next((cc for pattern, cc in _CAPABILITIES if re.search(pattern, kind)), None)


# The device kernels are chosen for while a program for one is traced from another's mesh (``kernels_for``)
_KERNELS_FOR: contextvars.ContextVar[Device | None] = contextvars.ContextVar("kernels_for", default=None)


@contextlib.contextmanager
def kernels_for(device: Device):
    """Choose kernels for ``device`` whatever mesh is in use (``export --compile`` for NVIDIA GPUs traces their
    programs on a CPU mesh, whose devices have the host memory kind that compile-only GPUs lack)."""
    token = _KERNELS_FOR.set(device)
    try:
        yield
    finally:
        _KERNELS_FOR.reset(token)


def target_device() -> Device:
    """The device kernels are chosen for: ``kernels_for``'s, else the abstract device of the mesh in use
    (``jax.set_mesh``, or ``jax.sharding.use_abstract_mesh`` when lowering for another machine; a local device of
    its kind reports its compute capability, else the kind decides), else the default backend's first device."""
    if (chosen := _KERNELS_FOR.get()) is not None:
        return chosen
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:  # a mesh in use (abstract, or this machine's own devices: then they report)
        platform, kind = abstract.platform, abstract.device_kind
        local = next((d for d in jax.devices() if d.device_kind == kind), None)
        reported = str(getattr(local, "compute_capability", ""))
    else:
        platform, device = jax.default_backend(), jax.devices()[0]
        kind, reported = str(getattr(device, "device_kind", "")), str(getattr(device, "compute_capability", ""))
    capability = compute_capability(reported, kind) if platform in ("gpu", "cuda") else None
    if platform in ("gpu", "cuda", "rocm"):  # ROCm devices report a gfx architecture, not an NVIDIA capability
        platform = "cuda" if capability or "NVIDIA" in kind else "rocm"
    return Device(platform, kind, capability)


def _native(device: Device) -> str | None:
    """The Pallas kernels built for ``device``'s accelerator, or None (AMD GPUs, CPUs, NVIDIA before sm_80)."""
    if device.platform == "tpu":
        return "mosaic_tpu"
    if device.platform != "cuda" or device.capability is None or device.capability < (8, 0):
        return None
    return "mosaic_gpu" if device.capability[0] == 9 else "mosaic_gpu_sm80"


def _refusal(target: str, device: Device) -> str | None:
    """Why ``target``'s kernels cannot run on ``device`` (None: they can; on a CPU, interpreted)."""
    if device.platform == "cpu":
        return None
    if target == "mosaic_tpu":
        return None if device.platform == "tpu" else "is the Mosaic TPU kernels, for TPUs"
    if device.platform != "cuda":
        return "is Mosaic GPU kernels, for NVIDIA GPUs"
    if target == "mosaic_gpu" and (device.capability or (0, 0))[0] != 9:
        return ("needs TMA and wgmma, which only Hopper (sm_90) has (Blackwell's tensor cores take tcgen05); "
                "mosaic_gpu_sm80 runs on sm_80 and later")
    if target == "mosaic_gpu_sm80" and (device.capability or (0, 0)) < (8, 0):
        return "needs Ampere's mma (sm_80 or later)"
    return None


def check_kernels(kernels: str) -> None:
    """ValueError unless ``kernels`` names a kernel choice (the backend is not consulted)."""
    if kernels not in KERNELS:
        raise ValueError(f"--kernels {kernels!r} is not a kernel choice; use one of {', '.join(KERNELS)}")


def resolve_kernels(kernels: str) -> str:
    """What ``kernels`` runs as on ``target_device()``: ``"xla"``, a kernel target of
    ``ess_jax.pallas_kernels.target`` (``"mosaic_gpu"``, ``"mosaic_gpu_sm80"``, ``"mosaic_tpu"``), or
    ``"<target>:interpret"`` on a CPU (the target's kernels in its interpreter). ``auto``: the
    accelerator's own kernels (Hopper: mosaic_gpu; other NVIDIA from sm_80: mosaic_gpu_sm80; TPU:
    mosaic_tpu), XLA on AMD GPUs, older NVIDIA GPUs and CPUs; ``pallas``: the accelerator's own
    kernels, and on a CPU the Hopper kernels interpreted. Raises ValueError for an unknown choice, or
    kernels that cannot run on this device, naming both."""
    check_kernels(kernels)
    if kernels == "xla":
        return "xla"
    device = target_device()
    native = _native(device)
    if kernels == "auto":
        return native or "xla"
    if kernels == "pallas":
        target = native or ("mosaic_gpu" if device.platform == "cpu" else None)
    else:
        target = kernels
    if target is None:
        raise ValueError(f"--kernels pallas: no Pallas kernels here run on {device.name} ({device.platform}); "
                         "use --kernels xla or auto")
    if (why := _refusal(target, device)) is not None:
        raise ValueError(f"--kernels {kernels}: {target} {why}; this device is {device.name}: use "
                         f"--kernels {native or 'xla'} or auto")
    return f"{target}:interpret" if device.platform == "cpu" else target


def _kernel_knobs(mode: str) -> dict:
    """The kernel keywords of a ``resolve_kernels`` result other than ``"xla"``."""
    target, _, interpret = mode.partition(":")
    return dict(target=target, interpret=bool(interpret))


def _unpartitioned(kernel: Callable) -> Callable:
    """A Pallas kernel call where every mesh axis is manual (``mesh.all_manual``): the partitioner cannot split a
    Mosaic custom call, so on a mesh (``--mesh``: inside ``mesh.per_shard``, the ``expert`` axis still its own)
    each device runs the whole call on its data shard's operands. No mesh: the call itself."""
    return device_mesh.all_manual(kernel)


def _identity_ids(valid_BTK: jax.Array) -> jax.Array:
    """Ids of gathered rows flattened to ``[B * T * K, W]``: row (b, t, k) is ``(b * T + t) * K + k``, -1 if invalid."""
    ids_BTK = jnp.arange(valid_BTK.size, dtype=jnp.int32).reshape(valid_BTK.shape)
    return jnp.where(valid_BTK, ids_BTK, -1)


def _empty(q_BTNX: jax.Array, lse_fill: jax.Array | float = -jnp.inf) -> tuple[jax.Array, jax.Array]:
    out = jnp.zeros(q_BTNX.shape, jnp.float32)
    return out, jnp.broadcast_to(jnp.asarray(lse_fill, jnp.float32), q_BTNX.shape[:-1])


# ---- V3.2: absorbed MLA ------------------------------------------------------------------------


def sparse_mla(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, rows_BTKW: jax.Array, valid_BTK: jax.Array, *,
               scale: float, kernels: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Absorbed-form MLA over gathered latent rows.

    Each query head scores the ``K`` rows ``[c | k_rope]`` by ``q_latent . c + q_rope . k_rope``
    (times ``scale``), softmaxes in float32 over the valid rows and returns the weighted latent
    ``out f32[B, T, N, C]`` and the log-sum-exp ``lse f32[B, T, N]`` of the scaled scores, so
    partial results over disjoint row sets merge exactly. A query with no valid row returns
    ``out = 0`` and ``lse = -inf``. ``rows_BTKW`` may be FP8 rows (uint8, see the module docstring).
    """
    c = q_latent_BTNC.shape[-1]
    mode = resolve_kernels(kernels)
    if mode != "xla":
        b, t, k, w = rows_BTKW.shape
        return sparse_mla_pool(q_latent_BTNC, q_rope_BTNR, rows_BTKW.reshape(b * t * k, w), _identity_ids(valid_BTK),
                               scale=scale, kernels=kernels)
    if rows_BTKW.dtype == jnp.uint8:
        rows_BTKW = fp8_rows.dequantize_mla_rows(rows_BTKW, latent_dim=c, rope_dim=q_rope_BTNR.shape[-1])
    rows_BTKW = jnp.where(valid_BTK[..., None], rows_BTKW.astype(jnp.float32), 0.0)
    return sparse_mla_kernel.absorbed_mla_reference(q_latent_BTNC, q_rope_BTNR, rows_BTKW, valid_BTK, scale,
                                                    precision=None)


def sparse_mla_pool(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, pool_PW: jax.Array, ids_BTK: jax.Array, *,
                    scale: float, kernels: str = "xla") -> tuple[jax.Array, jax.Array]:
    """``sparse_mla`` over the rows of a flat pool ``[P, W]`` named by global row ids ``i32[B, T, K]``
    (-1 = none), gathered inside the Pallas kernel (``pallas``) or by XLA first (``xla``).

    The pool is the tier's pool ``[L, B, P, W]`` reshaped to ``[L * B * P, W]`` or a layer's resident pages
    ``[G, Z, W]`` reshaped to ``[G * Z, W]`` (ids from ``ess_jax.cache.flat_ids``); float rows or FP8 rows
    (uint8).
    """
    mode = resolve_kernels(kernels)
    if mode == "xla":
        valid_BTK = ids_BTK >= 0
        rows_BTKW = pool_PW[jnp.where(valid_BTK, ids_BTK, 0)]
        return sparse_mla(q_latent_BTNC, q_rope_BTNR, rows_BTKW, valid_BTK, scale=scale, kernels="xla")
    if ids_BTK.shape[-1] == 0 or pool_PW.shape[0] == 0:
        return _empty(q_latent_BTNC)
    kernel = fp8_rows.sparse_mla_fp8 if pool_PW.dtype == jnp.uint8 else sparse_mla_kernel.sparse_mla
    return _unpartitioned(lambda *args: kernel(*args, scale=scale, **_kernel_knobs(mode)))(
        q_latent_BTNC, q_rope_BTNR, pool_PW, ids_BTK.astype(jnp.int32))


def mla_attention(q_latent_BTNC: jax.Array, q_rope_BTNR: jax.Array, sources: list[RowSource], *, scale: float,
                  kernels: str = "xla") -> tuple[jax.Array, jax.Array]:
    """``sparse_mla_pool`` over each row source (``ess_jax.cache.RowSource``), merged: ``out f32[B, T, N, C]``
    and ``lse f32[B, T, N]`` over the union of their rows."""
    results = [sparse_mla_pool(q_latent_BTNC, q_rope_BTNR, s.rows_PW, s.ids_BTK, scale=scale, kernels=kernels)
               for s in sources]
    return _merge_all(results)


def mla_row_width(latent_dim: int, rope_dim: int, dtype) -> int:
    """Width of one stored latent row: ``C + R`` values, or FP8 bytes when ``dtype`` is uint8."""
    if jnp.dtype(dtype) == jnp.uint8:
        return fp8_rows.mla_row_bytes(latent_dim, rope_dim)
    return latent_dim + rope_dim


def encode_mla_rows(rows_W: jax.Array, dtype, *, latent_dim: int) -> jax.Array:
    """Latent rows ``[..., C + R]`` in the cache's storage format: FP8 rows when ``dtype`` is uint8
    (``fp8_rows.quantize_mla_rows``), else a cast."""
    if jnp.dtype(dtype) == jnp.uint8:
        return fp8_rows.quantize_mla_rows(rows_W, latent_dim=latent_dim)
    return rows_W.astype(dtype)


def decode_mla_rows(rows_X: jax.Array, dtype, *, latent_dim: int, rope_dim: int) -> jax.Array:
    """Stored latent rows -> ``[..., C + R]`` of ``dtype`` (dequantizes FP8 rows)."""
    if rows_X.dtype == jnp.uint8:
        return fp8_rows.dequantize_mla_rows(rows_X, latent_dim=latent_dim, rope_dim=rope_dim, dtype=dtype)
    return rows_X.astype(dtype)


# ---- indexer keys in a named format ---------------------------------------------------------------
# "fp4": FP4 keys (fp8_rows.quantize_fp4_keys); "fp8": V3.2 FP8 rows without a rope part (J e4m3 + a float32
# scale per 128); a float dtype's name: the keys cast to it.


def index_key_storage(width: int, fmt: str) -> tuple[int, Any]:
    """``(row width, dtype)`` of one stored indexer key of ``width`` values in format ``fmt``."""
    if fmt == "fp4":
        return fp8_rows.fp4_key_bytes(width), jnp.uint8
    if fmt == "fp8":
        return fp8_rows.mla_row_bytes(width, 0), jnp.uint8
    return width, jnp.dtype(fmt)


def encode_index_keys(keys_J: jax.Array, fmt: str) -> jax.Array:
    """Indexer keys ``[..., J]`` in format ``fmt``."""
    if fmt == "fp4":
        return fp8_rows.quantize_fp4_keys(keys_J)
    if fmt == "fp8":
        return fp8_rows.quantize_mla_rows(keys_J, latent_dim=keys_J.shape[-1])
    return keys_J.astype(fmt)


def decode_index_keys(rows_X: jax.Array, fmt: str, dtype, *, width: int) -> jax.Array:
    """Stored indexer keys of ``width`` values in format ``fmt`` -> ``[..., width]`` of ``dtype``."""
    if fmt == "fp4":
        return fp8_rows.dequantize_fp4_keys(rows_X, width=width, dtype=dtype)
    if fmt == "fp8":
        return fp8_rows.dequantize_mla_rows(rows_X, latent_dim=width, rope_dim=0, dtype=dtype)
    return rows_X.astype(dtype)


# ---- V4: attention with a sink -----------------------------------------------------------------


def v4_row_width(head_dim: int, rope_dim: int, dtype) -> int:
    """Width of one stored V4 entry: ``H`` values, or FP8 bytes (584 for H = 512, R = 64) when ``dtype``
    is uint8."""
    if jnp.dtype(dtype) == jnp.uint8:
        return fp8_rows.v4_row_bytes(head_dim, rope_dim)
    return head_dim


def encode_v4_rows(rows_H: jax.Array, dtype, *, rope_dim: int) -> jax.Array:
    """V4 entries ``[..., H]`` in the cache's storage format: FP8 rows when ``dtype`` is uint8, else a cast."""
    if jnp.dtype(dtype) == jnp.uint8:
        return fp8_rows.quantize_v4_rows(rows_H, rope_dim=rope_dim)
    return rows_H.astype(dtype)


def decode_v4_rows(rows_X: jax.Array, dtype, *, head_dim: int, rope_dim: int) -> jax.Array:
    """Stored V4 entries -> ``[..., H]`` of ``dtype`` (dequantizes FP8 rows)."""
    if rows_X.dtype == jnp.uint8:
        return fp8_rows.dequantize_v4_rows(rows_X, head_dim=head_dim, rope_dim=rope_dim, dtype=dtype)
    return rows_X.astype(dtype)


def sparse_sink_attention(q_BTNH: jax.Array, rows_BTKH: jax.Array, valid_BTK: jax.Array, sinks_N: jax.Array, *,
                          scale: float, kernels: str = "xla") -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V4 attention over gathered rows with a learned per-head sink (DOMAIN.md 2.5).

    Every row is both key and value (V4 shares one K = V head). Each query head scores its ``K``
    rows by ``q . row * scale``; the sink ``sinks_N[n]`` is one more logit in the softmax
    denominator only: ``p_j = exp(s_j) / (sum_j' exp(s_j') + exp(sink))``. Returns
    ``out f32[B, T, N, H] = sum_j p_j row_j`` and ``lse f32[B, T, N]``, the log of that denominator.
    A query with no valid row returns ``out = 0``. Pass ``sinks_N = -inf`` for a plain partial result
    over a subset of rows: such ``(out, lse)`` pairs merge exactly by log-sum-exp.
    """
    mode = resolve_kernels(kernels)
    if mode != "xla":
        b, t, k, h = rows_BTKH.shape
        return sparse_sink_attention_pool(q_BTNH, rows_BTKH.reshape(b * t * k, h), _identity_ids(valid_BTK), None,
                                          None, sinks_N, scale=scale, rope_dim=0, kernels=kernels)
    rows_BTKH = jnp.where(valid_BTK[..., None], rows_BTKH.astype(jnp.float32), 0.0)
    return v4_kernel.attention_with_sink_reference(q_BTNH, rows_BTKH, valid_BTK, sinks_N, scale, precision=None)


def sparse_sink_attention_pool(q_BTNH: jax.Array, window_PX: jax.Array, window_ids_BTK: jax.Array,
                               entries_MX: jax.Array | None, entry_ids_BTK: jax.Array | None, sinks_N: jax.Array, *,
                               scale: float, rope_dim: int = 0, kernels: str = "xla") -> tuple[jax.Array, jax.Array]:
    """``sparse_sink_attention`` over window rows ``[P, X]`` plus compressed entries ``[M, X]``
    (``None, None`` for window-only layers), each named by global row ids ``i32[B, T, K]``
    (-1 = none); gathered inside the Pallas kernel or by XLA first. Both pools hold float rows ``[., H]`` of one
    dtype, or both V4 FP8 rows (uint8, decoded with ``rope_dim``, their rope dims; ``sparse_v4_attention_fp8``). See
    pallas_kernels/sparse_v4_attention.py for how the model's arrays map to pools and ids."""
    mode = resolve_kernels(kernels)
    sources = [(window_PX, window_ids_BTK)] + ([(entries_MX, entry_ids_BTK)] if entries_MX is not None else [])
    if mode == "xla":
        rows, valid = [], []
        for pool, ids in sources:
            ok = ids >= 0
            rows.append(decode_v4_rows(pool[jnp.where(ok, ids, 0)], q_BTNH.dtype, head_dim=q_BTNH.shape[-1],
                                       rope_dim=rope_dim))
            valid.append(ok)
        return sparse_sink_attention(q_BTNH, jnp.concatenate(rows, axis=2), jnp.concatenate(valid, axis=2), sinks_N,
                                     scale=scale, kernels="xla")
    sources = [(pool, ids) for pool, ids in sources if ids.shape[-1] > 0 and pool.shape[0] > 0]
    if not sources:
        return _empty(q_BTNH, sinks_N.astype(jnp.float32))
    (window, window_ids), *rest = sources
    entries, entry_ids = rest[0] if rest else (None, None)
    if window.dtype == jnp.uint8:
        kernel = functools.partial(fp8_rows.sparse_v4_attention_fp8, rope_dim=rope_dim)
    else:
        kernel = v4_kernel.sparse_v4_attention
    return _unpartitioned(lambda *args: kernel(*args, scale=scale, **_kernel_knobs(mode)))(
        q_BTNH, window, window_ids.astype(jnp.int32), entries,
        None if entry_ids is None else entry_ids.astype(jnp.int32), sinks_N)


def sink_attention(q_BTNH: jax.Array, window: RowSource | None, entries: list[RowSource], sinks_N: jax.Array, *,
                   scale: float, rope_dim: int, kernels: str = "xla") -> tuple[jax.Array, jax.Array]:
    """``sparse_sink_attention`` over the window rows (or None) and entry sources in the store's format (float or
    V4 FP8 rows, decoded with ``rope_dim``): one softmax over all of them with the sink. With kernels, sources of
    one format share a fused kernel call (two pools at most; FP8 rows: ``sparse_v4_attention_fp8``) and the calls'
    partial results merge exactly by log-sum-exp, the sink in the first call's denominator; with XLA the rows are
    gathered and decoded first."""
    sources = ([window] if window is not None else []) + list(entries)
    if resolve_kernels(kernels) == "xla":
        head_dim = q_BTNH.shape[-1]
        rows, valid = [], []
        for s in sources:
            ok = s.ids_BTK >= 0
            picked = s.rows_PW[jnp.where(ok, s.ids_BTK, 0)]
            rows.append(decode_v4_rows(picked, q_BTNH.dtype, head_dim=head_dim, rope_dim=rope_dim))
            valid.append(ok)
        return sparse_sink_attention(q_BTNH, jnp.concatenate(rows, axis=2), jnp.concatenate(valid, axis=2), sinks_N,
                                     scale=scale, kernels="xla")
    calls: list[list[RowSource]] = []  # consecutive sources of one format, two to a kernel call
    for s in sources:
        if calls and len(calls[-1]) < 2 and calls[-1][0].rows_PW.dtype == s.rows_PW.dtype:
            calls[-1].append(s)
        else:
            calls.append([s])
    no_sink_N = jnp.full(sinks_N.shape, -jnp.inf, jnp.float32)
    results = []
    for i, (first, *rest) in enumerate(calls):
        second = rest[0] if rest else None
        results.append(sparse_sink_attention_pool(
            q_BTNH, first.rows_PW, first.ids_BTK, None if second is None else second.rows_PW,
            None if second is None else second.ids_BTK, sinks_N if i == 0 else no_sink_N, scale=scale,
            rope_dim=rope_dim, kernels=kernels))
    return _merge_all(results)


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """Combine attention over two disjoint row sets: ``out [..., C]`` with ``lse [...]`` each; the union's
    ``(out, lse)``.

    Exact up to float rounding: the softmax over the union weighs each half by
    ``exp(lse_half - lse_union)``. Halves with no rows (``lse = -inf``) contribute nothing; if both
    are empty the result is 0.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
    weight_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
    return out_a * weight_a[..., None] + out_b * weight_b[..., None], lse


def _merge_all(results: list[tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
    out, lse = results[0]
    for out_b, lse_b in results[1:]:
        out, lse = merge_attention(out, lse, out_b, lse_b)
    return out, lse


def dual_attention(attend: Callable[[list[RowSource], bool], tuple[jax.Array, jax.Array]], sources: Sources
                   ) -> tuple[jax.Array, Any]:
    """Attention over a store's sources (``ess_jax.cache.Sources``): ``attend(sources, ready)`` over the ready
    ones, then over those in flight, merged exactly (ESS Dual-Attention: the ready half does not wait for
    the transfer, and reads its rows before the store's writes after it). Returns the output and the
    store ``sources.settle`` gives back."""
    out, lse = attend(sources.ready, True)
    ready = sources.ready
    if sources.inflight:
        with jax.named_scope("dual_attention"):
            out, lse, ready = jax.lax.optimization_barrier((out, lse, ready))  # read before the misses land
            out, lse = merge_attention(out, lse, *attend(sources.inflight, False))
    return out, sources.settle(ready)

"""Micro-benchmarks for a CUDA machine (tools/gpu_check.sh runs them; ``--smoke`` runs tiny sizes
anywhere, to check the script itself).

1. Sparse MLA decode, one layer, absorbed form: batch {1, 32, 128}, top-k 2048, 128 heads, C 512,
   R 64, bf16 queries, over bf16 rows (1152 B) and FP8 rows (656 B), XLA vs Pallas
   (``ess_jax.ops.sparse_mla_pool``). Reports the median time and the bytes the op must move
   (gathered rows + queries + f32 outputs) per second, against the device's HBM bandwidth.
2. Host -> device fetch of scattered 656-byte FP8 latent rows through the tier's two fetch backends
   (``inline``: host-side gather + in-step device_put; ``split``: NumPy gather in a host callback +
   one transfer), against a contiguous pinned-host transfer of the same bytes and ESS's FlashTrans
   (37 GB/s H2D, DOMAIN.md 4.1).

Usage: ``JAX_PLATFORMS=cuda,cpu .venv/bin/python tools/microbench.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ess_jax import ops, tier
from ess_jax.pallas_kernels import fp8_rows

HBM_BYTES_PER_S = {"H200": 4.8e12, "GH200": 4.0e12, "H100": 3.35e12, "H800": 3.35e12, "H20": 4.0e12,
                   "A100": 2.0e12, "B200": 8.0e12, "B300": 8.0e12}
FLASHTRANS_H2D = 37e9  # ESS's UVA fetch of scattered 656-byte rows (DOMAIN.md 4.1)


def _median_time(fn, *args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _hbm_bandwidth(override_gbps: float | None) -> float | None:
    if override_gbps:
        return override_gbps * 1e9
    kind = jax.devices()[0].device_kind
    for name, bw in sorted(HBM_BYTES_PER_S.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return bw
    return None


def bench_sparse_mla(*, batches, k: int, heads: int, c: int, r: int, warmup: int, iters: int, hbm: float | None):
    rows = []
    scale = (c + r) ** -0.5
    for b in batches:
        rng = np.random.default_rng(b)
        slots = 2 * k  # each request owns a block of 2k pool rows, k of them selected
        ids = np.stack([b_ * slots + rng.permutation(slots)[:k] for b_ in range(b)])[:, None].astype(np.int32)
        q_latent = jnp.asarray(rng.standard_normal((b, 1, heads, c)), jnp.bfloat16)
        q_rope = jnp.asarray(rng.standard_normal((b, 1, heads, r)), jnp.bfloat16)
        pool_f = jnp.asarray(rng.standard_normal((b * slots, c + r)), jnp.bfloat16)
        pools = {"bf16": pool_f, "fp8": fp8_rows.quantize_mla_rows(pool_f, latent_dim=c)}
        ids = jnp.asarray(ids)
        for row_format, pool in pools.items():
            row_bytes = pool.shape[1] * pool.dtype.itemsize
            moved = b * k * row_bytes + (q_latent.size + q_rope.size) * 2 + b * heads * (c + 1) * 4
            for kernels in ("xla", "pallas"):
                fn = jax.jit(functools.partial(ops.sparse_mla_pool, scale=scale, kernels=kernels))
                try:
                    seconds = _median_time(fn, q_latent, q_rope, pool, ids, warmup=warmup, iters=iters)
                except Exception as e:  # report and go on: one failing variant must not hide the others
                    rows.append(dict(op="sparse_mla", rows=row_format, kernels=kernels, batch=b, error=repr(e)[:200]))
                    continue
                rows.append(dict(op="sparse_mla", rows=row_format, kernels=kernels, batch=b, k=k, heads=heads,
                                 us=seconds * 1e6, bytes=moved, gbps=moved / seconds / 1e9,
                                 roofline_pct=None if hbm is None else 100 * moved / seconds / hbm))
    return rows


def bench_fetch(*, sizes, host_rows: int, warmup: int, iters: int):
    page_size, width = 64, fp8_rows.mla_row_bytes(512, 64)
    num_pages = host_rows // page_size
    rows = []
    for backend in tier.FETCH_BACKENDS:
        store = tier.host.host_store(backend, (1, num_pages, page_size, width), jnp.uint8)
        # the host store's fetch: exactly what a decode step runs
        fetch = jax.jit(lambda t, p, o: t.fetch(0, p, o))
        for n in sizes:
            rng = np.random.default_rng(n)
            flat = rng.choice(host_rows, size=n, replace=False)
            page = jnp.asarray((flat // page_size).reshape(-1, 512 if n >= 512 else n), jnp.int32)
            offset = jnp.asarray((flat % page_size).reshape(page.shape), jnp.int32)
            try:
                seconds = _median_time(fetch, store, page, offset, warmup=warmup, iters=iters)
            except Exception as e:
                rows.append(dict(op="fetch", backend=backend, rows=n, error=repr(e)[:200]))
                continue
            moved = n * width
            rows.append(dict(op="fetch", backend=backend, rows=n, bytes=moved, mb=moved / 1e6, us=seconds * 1e6,
                             gbps=moved / seconds / 1e9, flashtrans_pct=100 * moved / seconds / FLASHTRANS_H2D))
    for n in sizes:  # the same bytes, contiguous, pinned host -> device: the link's practical peak
        host = jax.device_put(np.zeros((n, width), np.uint8), jax.memory.Space.Host)
        seconds = _median_time(lambda x: jax.device_put(x, jax.memory.Space.Device), host, warmup=warmup,
                               iters=iters)
        moved = n * width
        rows.append(dict(op="fetch", backend="contiguous", rows=n, bytes=moved, mb=moved / 1e6, us=seconds * 1e6,
                         gbps=moved / seconds / 1e9, flashtrans_pct=100 * moved / seconds / FLASHTRANS_H2D))
    return rows


def _table(rows, columns):
    lines = ["  ".join(f"{name:>{width}}" for name, width, _ in columns)]
    for row in rows:
        if "error" in row:
            lines.append("  ".join(f"{str(row.get(key, '')):>{width}}" for _, width, (key, _) in columns[:4])
                         + f"  ERROR {row['error']}")
            continue
        cells = []
        for _, width, (key, fmt) in columns:
            value = row.get(key)
            cells.append(f"{'n/a' if value is None else format(value, fmt):>{width}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer iterations and fetch sizes (for gpu_check.sh)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes that run anywhere, CPU included (checks the script)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="HBM bandwidth for the roofline if the device is unknown")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        print(f"microbench: the default backend is {jax.default_backend()}, not a GPU; use --smoke to check the "
              "script on CPU", file=sys.stderr)
        return 2
    warmup, iters = (1, 3) if args.quick or args.smoke else (3, 20)
    hbm = _hbm_bandwidth(args.hbm_gbps)
    if args.smoke:
        mla = dict(batches=(1, 2), k=64, heads=16, c=128, r=64)
        fetch = dict(sizes=(512,), host_rows=8192)
    else:
        mla = dict(batches=(1, 32, 128), k=2048, heads=128, c=512, r=64)
        fetch = dict(sizes=(16384,) if args.quick else (2048, 16384, 65536), host_rows=1 << 20)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}); HBM roofline "
          f"{'unknown' if hbm is None else f'{hbm / 1e12:.2f} TB/s'}; jax {jax.__version__}")
    mla_rows = bench_sparse_mla(**mla, warmup=warmup, iters=iters, hbm=hbm)
    print(f"\nsparse MLA decode (one layer, top-k {mla['k']}, {mla['heads']} heads, C {mla['c']}, R {mla['r']})")
    print(_table(mla_rows, [("batch", 5, ("batch", "d")), ("rows", 4, ("rows", "s")), ("kernels", 7, ("kernels", "s")),
                            ("time_us", 10, ("us", ".1f")), ("GB/s", 8, ("gbps", ".1f")),
                            ("%HBM", 6, ("roofline_pct", ".1f"))]))
    fetch_rows = bench_fetch(**fetch, warmup=warmup, iters=iters)
    print("\nhost -> device fetch of scattered 656-byte rows (FlashTrans reference: 37 GB/s)")
    print(_table(fetch_rows, [("backend", 10, ("backend", "s")), ("rows", 6, ("rows", "d")),
                              ("MB", 7, ("mb", ".2f")), ("time_us", 10, ("us", ".1f")),
                              ("GB/s", 7, ("gbps", ".2f")), ("%FlashTrans", 11, ("flashtrans_pct", ".1f"))]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "sparse_mla": mla_rows, "fetch": fetch_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

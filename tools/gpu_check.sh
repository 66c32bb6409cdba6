#!/usr/bin/env bash
# GPU check for a CUDA machine, under 5 minutes: (1) the Mosaic GPU kernels compiled and checked
# against their references (pytest -m gpu; the device's own: Hopper's TMA / wgmma kernels on sm_90, the sm_80
# variant (plain copies, mma.sync) on other NVIDIA GPUs from sm_80),
# (2) greedy equality of the model with --kernels pallas vs xla, (3) micro-benchmarks (sparse MLA
# decode vs the HBM roofline; scattered 656-byte row fetch, inline vs split, vs FlashTrans 37 GB/s),
# (4) the end-to-end bench on the GPU (tiny-v32, 8192-token context, resident vs ESS).
# Python: .venv if present, else python3 with jax's CUDA plugin (ess_jax is then installed editable,
# offline, with no dependencies: they must be there). Exit status: 0 all passed, 1 a check failed, 2 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
  PY=python3
  (cd / && "$PY" -c 'import ess_jax.pallas_kernels') 2>/dev/null \
    || "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || { echo "cannot install ess_jax"; exit 1; }
fi
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu}  # tests/conftest.py pins cpu unless this is set
status=0
started=$SECONDS

section() { printf '\n==== %s (%ds elapsed)\n' "$1" "$((SECONDS - started))"; }
fail() { echo "FAIL: $1"; status=1; }

section "device"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if ! "$PY" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' 2>/dev/null; then
  echo "no CUDA GPU visible to jax (JAX_PLATFORMS=$JAX_PLATFORMS); nothing to check"
  exit 2
fi
"$PY" -c 'import jax, jaxlib, flax; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__, jax.devices(), "compute capability", jax.devices()[0].compute_capability)'

# each test in its own process: a faulting kernel poisons its CUDA context for whatever runs after it
section "1. compiled Mosaic GPU kernels vs references (pytest -m gpu)"
for test in $("$PY" -m pytest -q -m gpu --collect-only tests/kernels 2>/dev/null | grep '::'); do
  timeout 120 "$PY" -m pytest -q -m gpu -rs "$test" 2>&1 | tail -1 | sed "s|^|$test: |" | cut -c1-300
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "$test"
done

section "2. greedy equality, --kernels pallas vs xla"
compare_runs() {  # $1: run number, $2: label; the two JSON outputs hold the same greedy tokens
  "$PY" -c '
import json, sys
ids = {k: [r["output_ids"] for r in json.load(open(f"/tmp/gpu_check_{sys.argv[1]}_{k}.json"))["requests"]]
       for k in ("xla", "pallas")}
same, n = ids["xla"] == ids["pallas"], sum(map(len, ids["xla"]))
print(("ok   " if same else "DIFF ") + sys.argv[2] + f": {n} tokens")
sys.exit(0 if same else 1)' "$1" "$2"
}
# model|flags. The long prompt (~340 byte-level tokens) outgrows the 66-slot pool, so the tier's hit and
# miss halves both run (tiny-v4: ~85 CSA entries against 17 slots). A run is compile-bound (one program per
# power-of-two prefill piece, ~60-90 s on an H200 host), so all eight start at once, sharing the GPU (no
# preallocation) and the host's cores.
runs=("tiny-v32|--offload ess --pool-size 66 --fetch inline" "tiny-v4|--offload none"
      "tiny-v32|--offload ess --pool-size 66 --fetch inline --cache-dtype fp8"
      "tiny-v4|--offload ess --pool-size 17 --fetch inline --cache-dtype fp8")
long=$(printf 'offload the latent rows %.0s' {1..14})
pids=()
for i in "${!runs[@]}"; do
  model=${runs[$i]%%|*}; flags=${runs[$i]#*|}
  for kernels in xla pallas; do
    # shellcheck disable=SC2086
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 "$PY" -m ess_jax.generate --model "$model" $flags \
      --kernels "$kernels" --greedy --json --max-new-tokens 24 --prompt "The cache outgrew the device." \
      --prompt "$long" > "/tmp/gpu_check_${i}_$kernels.json" 2> "/tmp/gpu_check_${i}_$kernels.err" &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid" || fail "a generate run (see /tmp/gpu_check_*.err)"; done
for i in "${!runs[@]}"; do
  compare_runs "$i" "${runs[$i]/|/ }" || fail "greedy tokens differ: ${runs[$i]/|/ }"
done

section "3. micro-benchmarks"
timeout 90 "$PY" tools/microbench.py --quick --json /tmp/gpu_check_microbench.json || fail "microbench"

section "4. end-to-end bench on the GPU (tiny-v32, 8192-token context, xla kernels)"
timeout 150 "$PY" -m ess_jax.bench --context 8192 --new-tokens 32 --batch 2 --ratios 0.2,0.1 --repeats 2 \
  --locality-steps 0 --out /tmp/gpu_check_bench || fail "bench"

section "done: $([ $status -eq 0 ] && echo all checks passed || echo some checks FAILED)"
exit $status

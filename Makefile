# Every target bootstraps .venv (Python >= 3.12 from PATH or pyenv) when it is missing.
PY := .venv/bin/python
# Bytecode is written (whatever the environment says): the suite's dozens of Python processes (xdist workers, CLI and
# multi-device subprocesses) then compile each module once, not each at every import (the venv is installed without
# compiling: tools/bootstrap.sh).
unexport PYTHONDONTWRITEBYTECODE
# Whole modules per xdist worker, in collection order (tests/conftest.py puts the longest first)
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-fast aot venv fixtures
venv:
	@bash tools/bootstrap.sh

demo: venv
	$(PY) -m ess_jax.generate --model tiny-v32-code --prompt-file checkpoints/demo_prompt.txt --max-new-tokens 64 \
		--temperature 0.7 --top-p 0.9 --seed 0

test: venv
	$(PY) -m ruff check .
	$(PYTEST) --durations=15

# The inner loop: everything but the multi-device, multi-process and Pallas-interpreter tests (CI runs `test`).
test-fast: venv
	$(PYTEST) --ignore=tests/test_mesh.py --ignore=tests/test_processes.py \
		--ignore=tests/test_serve_processes.py --ignore=tests/test_sharded_load.py --ignore=tests/kernels

# Compiled for TPUs and NVIDIA GPUs without one, in .venv-aot (the aot extra: libtpu and jax's CUDA plugin, ~1 GB,
# kept out of `test`, whose suite budget their compiles would exceed): the aot tests.
aot:
	@VENV=.venv-aot EXTRAS=test,aot bash tools/bootstrap.sh
	.venv-aot/bin/python -m pytest -q -m aot -rs

# Regenerates tests/fixtures/ from transformers (needs torch + transformers, see tools/requirements-fixtures.txt).
fixtures:
	python3 tools/make_hf_fixtures.py

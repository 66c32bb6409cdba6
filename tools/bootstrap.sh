#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 (found on PATH or through pyenv) and installs ess_jax[test] (ess_jax[eval]
# included: lm-evaluation-harness and transformers' tokenizers, no torch). A .venv that has ess_jax but not the
# eval extra gets it added. VENV and EXTRAS choose another environment (make aot: .venv-aot with test,aot).
# --no-compile: a module is compiled to bytecode when first imported (and kept in __pycache__), not every file of
# every installed package at install time (about 50 of the install's 75 seconds here, mostly modules never imported).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import ess_jax' 2>/dev/null; then
  "$VENV/bin/python" -c 'import lm_eval, transformers, pytest_timeout, ruff' 2>/dev/null || "$VENV/bin/python" -m pip install --quiet --no-compile -e ".[$EXTRAS]"
  exit 0
fi

ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
python=""
for candidate in python3.13 python3.12 python3 python; do
  if command -v "$candidate" >/dev/null && ok "$candidate"; then python=$(command -v "$candidate"); break; fi
done
if [ -z "$python" ]; then
  roots=()
  command -v pyenv >/dev/null && roots+=("$(pyenv root)/versions")
  roots+=("$HOME/.pyenv/versions")
  for root in "${roots[@]}"; do
    for candidate in $(ls -d "$root"/3.* 2>/dev/null | sort -rV); do
      if ok "$candidate/bin/python"; then python="$candidate/bin/python"; break 2; fi
    done
  done
fi
if [ -z "$python" ]; then
  echo "error: no Python >= 3.12 found on PATH or under pyenv; install one (e.g. 'pyenv install 3.12')" >&2
  exit 1
fi
echo "bootstrapping $VENV with $python" >&2
rm -rf "$VENV"
"$python" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet --no-compile -e ".[$EXTRAS]"

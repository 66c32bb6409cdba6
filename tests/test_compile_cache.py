"""The CLIs' persistent compilation cache: a first ``python -m ess_jax.generate`` fills the ``--compile-cache``
directory, a second one reads every executable back from it (no entry added, the engine's steps logged as
cache hits) and gives the same tokens; the default directory and ``--compile-cache none``."""

import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v32-a"
ARGS = ["-m", "ess_jax.generate", "--model", str(FIXTURE), "--prompt-ids", ",".join(map(str, range(1, 33))),
        "--max-new-tokens", "2", "--max-batch", "1", "--prefill-chunk", "32", "--json"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_LOG_COMPILES="1", **(env or {})))
    assert proc.returncode == 0, proc.stderr
    return proc


def test_second_run_reads_every_executable_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = run(*ARGS, "--compile-cache", str(cache))
    entries = {p.name for p in cache.iterdir()}
    steps = {name.split("-")[0] for name in entries}
    assert {"jit__prefill", "jit__decode"} <= steps, sorted(entries)  # the engine's steps, however fast they compiled
    assert "cache hit" not in first.stderr

    second = run(*ARGS, "--compile-cache", str(cache))
    assert {p.name for p in cache.iterdir()} == entries  # a miss would have written an entry
    hits = {line.split("'")[1] for line in second.stderr.splitlines() if "Persistent compilation cache hit" in line}
    assert hits == steps
    assert json.loads(second.stdout)["requests"] == json.loads(first.stdout)["requests"]


def test_default_directory_and_none(tmp_path):
    """The default is $XDG_CACHE_HOME/ess_jax/jax ($JAX_COMPILATION_CACHE_DIR unset); 'none' turns the cache off."""
    script = ("import importlib, sys, jax; importlib.import_module('ess_jax.generate').parse_args(sys.argv[1:]); "
              "print(jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    default = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert default.stdout.split() == ["True", str(tmp_path / "xdg" / "ess_jax" / "jax")], default.stderr
    assert (tmp_path / "xdg" / "ess_jax" / "jax").is_dir()
    off = subprocess.run([sys.executable, "-c", script, "--compile-cache", "none"], capture_output=True, text=True,
                         env=dict(env, XDG_CACHE_HOME=str(tmp_path / "other")), timeout=300)
    assert off.stdout.split() == ["False", "None"], off.stderr
    assert not (tmp_path / "other").exists()

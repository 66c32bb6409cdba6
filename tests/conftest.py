import collections
import gc
import os
import shutil
import tempfile
from pathlib import Path

# Tests run on the CPU unless a GPU test asks otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the CPU, LLVM's cheaper passes: the suite's time is mostly compiling tiny models, and this cuts it by about a
# quarter (set in the environment, so the CLI subprocesses compile alike and share the cache below).
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                        "--xla_llvm_disable_expensive_passes=true"]).strip()
# Every executable the session compiles goes to a persistent compilation cache of its own (removed when the
# session ends), so one compiled again, after pytest_runtest_setup drops it, in a CLI subprocess or in another xdist
# worker (all inherit the session's directory through the environment), is read back instead of compiled.
_OWNS_CACHE = "ESS_JAX_TEST_COMPILE_CACHE" not in os.environ  # the session's first process (the xdist controller)
if _OWNS_CACHE:
    os.environ["ESS_JAX_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="ess_jax-tests-jax-")
COMPILE_CACHE = os.environ["ESS_JAX_TEST_COMPILE_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILE_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# Parity tests compare float32 logits at 1e-4 of their scale: no TF32 / bf16 passes in matmuls on GPUs (set in
# the environment, so the CLI subprocesses compile this process's executables and read them from the cache).
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"

import jax  # noqa: E402
import pytest  # noqa: E402

# Tracing a step allocates millions of short-lived objects, and CPython's default thresholds (2000, 10, 10) then run
# a collection every few thousand of them, over a heap of long-lived jaxprs and executables: about 4 % of a worker's
# time. Fewer, larger collections (measured on test_hisparse: 2.7 s of collections -> 1.2 s), same garbage freed.
gc.set_threshold(50_000, 20, 100)


_MAP_LIMIT = Path("/proc/sys/vm/max_map_count")
MAX_MAP_COUNT = int(_MAP_LIMIT.read_text()) if _MAP_LIMIT.exists() else 65530  # the kernel's default


def _mapped_regions() -> int:
    maps = Path("/proc/self/maps")
    return len(maps.read_text().splitlines()) if maps.exists() else 0


def _drop_executables() -> None:
    """Every compiled executable this process holds through jax's caches, and only those: the traced jaxprs stay, so
    a step needed again is lowered and read back from the compilation cache without being traced again (about a
    sixth of the time ``jax.clear_caches`` costs it, which drops the traces too). ``jax.clear_caches`` where these
    caches are not where jax 0.11 keeps them, or where dropping them freed too little."""
    from jax._src import pjit
    from jax._src.interpreters import pxla
    from jax._src.lib import _jax

    gc.collect()
    try:
        pjit._pjit_lower.cache_clear()  # a lowered computation keeps the executable compiled from it
        pxla._cached_compilation.cache_clear()
        pjit._cpp_pjit_cache_fun_only.clear()  # the jitted functions' own executables
        pjit._cpp_pjit_cache_explicit_attributes.clear()
        _jax.PjitFunctionCache.clear_all()
    except AttributeError:
        jax.clear_caches()
    gc.collect()
    if _mapped_regions() > MAX_MAP_COUNT // 4:
        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """XLA:CPU maps every executable's code into memory regions of its own, so a process that keeps all its
    compiled steps alive passes the kernel's vm.max_map_count (65530 by default) and segfaults in the compiler
    (and pytest-xdist then waits forever on the dead worker). Before each test (its fixtures included) in a
    process past a third of that, every compiled executable is dropped (``_drop_executables``): what is needed
    again is read back from the compilation cache. One module's engines can add tens of thousands of regions, so
    the check is per test, not per module."""
    if _mapped_regions() > MAX_MAP_COUNT // 3:
        _drop_executables()


@pytest.fixture(autouse=True)
def _compile_cache_kept():
    """Every test leaves the session's compilation cache on and where it was: a CLI run in this process with
    ``--compile-cache none`` (or another directory) would turn it off (or move it) for every later module of this
    worker, which would then compile every step again."""
    yield
    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir == COMPILE_CACHE, \
        "this test changed the session's compilation cache (a CLI's --compile-cache, run in this process)"


def pytest_terminal_summary(terminalreporter):
    """The slowest 15 modules by the time of their tests (setup, call and teardown summed over every worker), beside
    ``--durations``' slowest tests: where the suite's time budget goes, module by module."""
    spent = collections.Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                spent[report.nodeid.split("::")[0]] += report.duration
    if spent:
        total = sum(spent.values())
        terminalreporter.write_sep("=", f"slowest 15 modules ({total:.0f} s of tests in all)")
        for module, seconds in spent.most_common(15):
            terminalreporter.write_line(f"{seconds:8.2f}s {100 * seconds / total:5.1f} %  {module}")


def pytest_sessionfinish(session, exitstatus):
    if _OWNS_CACHE:  # the controller ends after its workers
        shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


# The modules that take longest (mostly compiling their engines), scheduled first: ``--dist loadfile
# --no-loadscope-reorder`` hands each worker whole modules in collection order (xdist's default reorders them by their
# number of tests), so the short ones fill in at the end instead of a long one trailing.
LONGEST_FIRST = ("test_hisparse.py", "test_speculative.py", "test_mesh.py", "test_index_share.py", "test_lm_eval.py",
                 "test_fp8_matrix.py", "test_prefix_cache_v4.py", "test_tier.py", "test_online.py", "test_server.py",
                 "test_engine.py", "test_prefix_cache.py", "test_deepseek_v4.py", "test_train.py",
                 "test_prefix_store.py", "test_mtp.py", "test_bench.py", "test_depth.py", "test_rings.py",
                 "test_fp4_index.py", "test_export.py", "test_serve_processes.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept

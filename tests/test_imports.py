"""What each entry point imports, in a fresh interpreter: the package root is lazy (PEP 562), so the
planner and the kernels load without flax, the engine or the API, and the public names still resolve."""

import json
import subprocess
import sys
import textwrap

import pytest

RUNTIME = {"flax", "ess_jax.api", "ess_jax.engine"}


def loaded(code: str) -> set[str]:
    """The modules in ``sys.modules`` after running ``code`` in a fresh interpreter (a ``SystemExit``,
    such as ``--help``'s, ends the code, not the check)."""
    script = textwrap.dedent("""
        import json, sys
        try:
        {code}
        except SystemExit:
            pass
        print(json.dumps(sorted(sys.modules)))
    """).format(code=textwrap.indent(textwrap.dedent(code), "    "))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


def plan_run(*argv: str) -> str:
    """``python -m ess_jax.plan *argv``, as ``-m`` runs it (the package first, then the module as __main__)."""
    return f"""
        import runpy
        sys.argv = ["ess_jax.plan", *{list(argv)!r}]
        runpy.run_module("ess_jax.plan", run_name="__main__", alter_sys=True)
    """


def test_package_root_imports_nothing_else():
    mods = loaded("import ess_jax")
    assert not {m for m in mods if m.startswith("ess_jax.")}
    assert not mods & (RUNTIME | {"jax"})


def test_config_imports_nothing_of_ess_jax():
    """One import direction: the families import the config, never the reverse."""
    mods = loaded("import ess_jax.config")
    assert {m for m in mods if m.startswith("ess_jax.")} == {"ess_jax.config"}


def test_a_family_is_reached_only_through_the_one_registry():
    """Each family is one package, ``models/<model_type>/``, named only by its line of the registry
    (``families.FAMILIES``): no library module outside the package imports it, and none but the registry and the
    package names its ``model_type`` (no family test by name elsewhere)."""
    import ast
    from pathlib import Path

    from ess_jax import families

    root = Path(__file__).parent.parent
    packages = {f"ess_jax.models.{model_type}": model_type for model_type in families.FAMILIES}
    sources = {"ess_jax": root / "ess_jax", "ess_jax.models": root / "models",
               "ess_jax.pallas_kernels": root / "pallas_kernels"}
    offences = []
    for package, directory in sources.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            module = ".".join((package, *parts[:-1], *([] if parts[-1] == "__init__" else parts[-1:])))
            home = next((p for p in packages if module == p or module.startswith(p + ".")), None)
            if module == "ess_jax.families" or home:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Constant) and node.value in families.FAMILIES.keys():
                    offences.append(f"{module} names {node.value!r}")
                offences += [f"{module} imports {name}" for name in names
                             if any(name == p or name.startswith(p + ".") for p in packages)]
    assert not offences, offences
    for model_type, entry in families.FAMILIES.items():
        assert entry.startswith(f"ess_jax.models.{model_type}.family:"), entry
        assert families.get(model_type).model_type == model_type


@pytest.mark.parametrize("argv", [("--help",),
                                  ("--model", "deepseek-v3.2", "--kv-budget-gb", "82", "--context", "32768")],
                         ids=["help", "kv-budget"])
def test_plan_loads_no_flax_engine_or_api(argv):
    mods = loaded(plan_run(*argv))
    assert {"ess_jax.cli", "ess_jax.config"} <= mods
    assert not mods & RUNTIME


def test_plan_weight_estimate_builds_the_model_without_the_runtime():
    mods = loaded(plan_run("--model", "tiny-v32", "--context", "1024", "--json"))
    assert {"flax", "ess_jax.models.deepseek_v32.model"} <= mods
    assert not mods & {"ess_jax.api", "ess_jax.engine", "ess_jax.models.deepseek_v4"}


def test_fp8_rows_loads_no_flax_engine_api_or_mosaic_gpu():
    mods = loaded("import ess_jax.pallas_kernels.fp8_rows")
    assert "ess_jax.pallas_kernels.fp8_rows" in mods
    assert not mods & RUNTIME
    toolchain = {m for m in mods if m.startswith(("jax.experimental.mosaic", "jax._src.pallas.mosaic_gpu",
                                                  "jax.experimental.pallas.mosaic_gpu"))}
    assert not toolchain and "ess_jax.pallas_kernels._gather_attention" not in mods


def test_public_names_resolve_through_the_lazy_root():
    code = """
        import ess_jax
        assert "ess_jax.api" not in sys.modules
        for name, module in [("Model", "ess_jax.api"), ("Result", "ess_jax.api"), ("generate", "ess_jax.api"),
                             ("load_model", "ess_jax.api"), ("loglikelihood", "ess_jax.api"),
                             ("Engine", "ess_jax.engine"), ("EngineConfig", "ess_jax.engine"),
                             ("RequestOutput", "ess_jax.engine"), ("RequestSpec", "ess_jax.engine"),
                             ("SamplingParams", "ess_jax.sampling")]:
            assert getattr(ess_jax, name) is getattr(sys.modules[module], name), name
        from ess_jax import load_model
        assert load_model is sys.modules["ess_jax.api"].load_model
        assert set(ess_jax.__all__) == {"Model", "Result", "generate", "load_model", "loglikelihood", "Engine",
                                        "EngineConfig", "RequestOutput", "RequestSpec", "SamplingParams"}
        assert set(ess_jax.__all__) <= set(dir(ess_jax))
        try:
            ess_jax.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("ess_jax.no_such_name resolved")
    """
    assert "ess_jax.api" in loaded(code)


def test_public_name_access_imports_the_api():
    mods = loaded("import ess_jax\ness_jax.load_model")
    assert {"ess_jax.api", "ess_jax.engine", "flax"} <= mods


def test_the_generate_cli_module_leaves_ess_jax_generate_callable():
    """Importing ``ess_jax.generate`` (the CLI) binds it over the package's ``generate``; it still calls the API."""
    import ess_jax
    import ess_jax.api
    import ess_jax.generate as cli

    calls = []
    real = ess_jax.api.generate
    try:
        cli.generate = lambda *args, **kwargs: calls.append((args, kwargs)) or "result"
        assert ess_jax.generate("model", ["prompt"], 3) == "result" and calls == [(("model", ["prompt"], 3), {})]
    finally:
        cli.generate = real


def test_the_scheduler_and_the_hand_off_types_import_no_device_code():
    """The scheduler is host bookkeeping: neither it nor the types it hands the runner import jax themselves, and
    importing it loads no model, no jitted step and no runner (the prefix cache and the proposer are handed to it)."""
    import ast
    from pathlib import Path

    root = Path(__file__).parent.parent / "ess_jax" / "engine"
    for name in ("scheduler.py", "plan.py"):
        tree = ast.parse((root / name).read_text())
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] in ("jax", "flax")}, name
    mods = loaded("import ess_jax.engine.scheduler")
    device = {f"ess_jax.engine.{m}" for m in ("steps", "runner", "offload", "layout", "engine")}
    assert not mods & ({"flax", "ess_jax.families"} | device)


def test_the_engine_modules_import_each_other_one_way():
    """No import cycle among ``ess_jax/engine``'s modules, counting every import (function-level and
    ``TYPE_CHECKING`` ones too): each module's imports stand below it."""
    import ast
    from pathlib import Path

    root = Path(__file__).parent.parent / "ess_jax" / "engine"
    names = {p.stem for p in root.glob("*.py")} - {"__init__"}
    imports = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "ess_jax.engine":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module.removeprefix("ess_jax.engine."))
            elif isinstance(node, ast.Import):
                found |= {a.name.removeprefix("ess_jax.engine.") for a in node.names}
        imports[name] = found & names
    done, path = set(), []

    def visit(name):
        assert name not in path, " -> ".join(path[path.index(name):] + [name])
        if name not in done:
            path.append(name)
            for imported in sorted(imports[name]):
                visit(imported)
            path.pop()
            done.add(name)

    for name in sorted(names):
        visit(name)

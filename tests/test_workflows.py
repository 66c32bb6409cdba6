"""The accelerator workflows (.github/workflows/gpu.yml, tpu.yml) parse, run on self-hosted runners of
their kind, and every command they run exists: programs on PATH, scripts and test paths in the repo,
Python modules importable, pytest markers declared, pip extras defined (pinning jax's plugin to the
project's jax), and the artifact they upload is the folder they write."""

import importlib.util
import re
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MARKERS = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
ACTIONS = {"actions/checkout", "actions/upload-artifact"}


def _commands(script: str):
    """Each simple command of a ``run`` script as its words (pipes, ``&&`` and ``;`` split; no redirections)."""
    for line in script.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\|\||&&|;|\|", line):
            words = [w for w in shlex.split(part) if not re.fullmatch(r"\d*[<>]+&?\d*", w)]  # redirections
            while words and re.fullmatch(r"\w+=.*", words[0]):  # VAR=value prefixes
                words.pop(0)
            if words:
                yield words


def _check_python(args: list[str]):
    assert args[0] == "-m", f"python runs a module here: {args}"
    module, rest = args[1], args[2:]
    assert importlib.util.find_spec(module), f"python -m {module}: no such module"
    if module == "pytest":
        for flag, value in zip(rest, rest[1:] + [""]):
            if flag == "-m":
                assert set(re.findall(r"\w+", value)) - {"and", "or", "not"} <= MARKERS, f"undeclared marker: {value}"
        for word in rest:
            if not word.startswith("-") and "/" in word and "=" not in word:
                assert (ROOT / word).exists(), f"pytest path {word} does not exist"
    if module == "pip" and "-e" in rest:
        spec = rest[rest.index("-e") + 1]
        extras = re.fullmatch(r"\.\[([\w,]+)\]", spec)
        assert extras, spec
        assert set(extras[1].split(",")) <= set(EXTRAS), f"undefined extras in {spec}"


def _check(words: list[str], venv_made: bool):
    program, args = words[0], words[1:]
    if program.startswith(".venv/"):
        assert venv_made, f"{program} before tools/bootstrap.sh made .venv"
        assert program == ".venv/bin/python", program
        return _check_python(args)
    assert shutil.which(program), f"{program} is not on PATH"
    if program == "bash":
        assert (ROOT / args[0]).is_file(), f"bash {args[0]}: no such script"


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_workflow_commands_exist(kind):
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / f"{kind}.yml").read_text())
    assert set(workflow[True]) == {"workflow_dispatch", "push"}  # YAML 1.1 reads the key "on" as True
    (job,) = workflow["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "linux", kind]
    venv_made, written, uploaded, ran = False, set(), [], []
    for step in job["steps"]:
        if "uses" in step:
            action, _, version = step["uses"].partition("@")
            assert action in ACTIONS and version, step["uses"]
            if action == "actions/upload-artifact":
                uploaded.append(step["with"]["path"].rstrip("/"))
            continue
        for words in _commands(step["run"]):
            _check(words, venv_made)
            ran.append(" ".join(words))
            venv_made |= words[:2] == ["bash", "tools/bootstrap.sh"]
            if words[:2] == ["mkdir", "-p"]:
                written.update(words[2:])
    assert f".venv/bin/python -m pip install --quiet -e .[{kind},test]" in ran
    assert any(c.startswith(f".venv/bin/python -m pytest -m {kind} ") for c in ran)
    assert (kind == "gpu") == ("bash tools/gpu_check.sh" in ran)
    assert uploaded and set(uploaded) <= written, (uploaded, written)
    bootstrap = (ROOT / "tools" / "bootstrap.sh").read_text()
    assert "VENV=${VENV:-.venv}" in bootstrap and '-m venv "$VENV"' in bootstrap  # .venv unless told otherwise


def test_extras_pin_the_plugins_to_the_project_jax():
    jax_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("jax=="))
    version = jax_pin.removeprefix("jax==")
    assert EXTRAS["gpu"] == [f"jax[cuda12]=={version}"]
    assert EXTRAS["tpu"] == [f"jax[tpu]=={version}"]


def test_every_package_of_the_tree_is_installed():
    """A wheel (not only an editable install) carries every package: each folder with an ``__init__.py`` below a
    mapped package folder (ess_jax/, models/, pallas_kernels/, ...) is listed in pyproject's packages."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    found = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
             for name, folder in setuptools["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert found - set(setuptools["packages"]) == set()

"""What a fresh machine installs: pyproject's ranges, the pinned constraints CI uses, the
README's commands, and an import path that needs no optional package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Majors that have broken us, or whose APIs we lean on, must be bounded above.
MUST_BE_BOUNDED = {"torch", "transformers", "onnx", "onnxruntime", "fastapi", "pytest", "hypothesis",
                   "schemathesis", "matplotlib"}


def requirements() -> dict[str, Requirement]:
    lines = [*PYPROJECT["dependencies"], *(r for extra in PYPROJECT["optional-dependencies"].values() for r in extra)]
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_breaking_majors_are_bounded_above():
    reqs = requirements()
    unbounded = [name for name in MUST_BE_BOUNDED if not any(s.operator in ("<", "<=", "==", "~=")
                                                              for s in reqs[name].specifier)]
    assert not unbounded, f"no upper bound for {unbounded} in pyproject.toml"


def test_constraints_pin_every_requirement_inside_its_range():
    pins = constraints()
    for name, req in requirements().items():
        if name == "tensorrt":
            continue  # the optional GPU extra: no wheel for CI's CPU machine
        assert name in pins, f"constraints.txt pins no version of {name}"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {req}"


def test_ci_and_readme_install_the_pinned_torch_with_the_constraints():
    torch = constraints()["torch"]
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert f'"torch=={torch}"' in ci and "-c constraints.txt" in ci
    assert f"pip install torch=={torch}" in readme
    assert 'pip install -c constraints.txt -e ".[dev]"' in readme
    assert re.search(rf"CPU CI[^\n]*torch {re.escape(torch)}", readme), "README's tested-versions table"


def test_no_package_module_imports_matplotlib():
    """matplotlib is the `plot` extra: importing any module of the package must not need it."""
    script = ("import importlib, pkgutil, sys, edgeinfer\n"
              "for m in pkgutil.walk_packages(edgeinfer.__path__, 'edgeinfer.'):\n"
              "    importlib.import_module(m.name)\n"
              "print(sorted(k for k in sys.modules if k.split('.')[0] == 'matplotlib'))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_command_line_answers_help_without_importing_torch():
    """``edgeinfer --help`` (and every command's) waits for no torch import: on a Jetson's cores
    that import takes seconds. A command imports what it needs when it runs."""
    script = "import sys, edgeinfer.cli.main\nprint(sorted(k for k in ('torch', 'transformers') if k in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_built_engines_are_ignored_but_their_readme_is_not():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: .gitignore does not apply")

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0

    assert (REPO / "engines" / "README.md").is_file()
    assert not ignored("engines/README.md")
    assert ignored("engines/demo/cpu/decoder.onnx") and ignored("engines/demo/cpu/manifest.json")

"""Install metadata stays consistent: pyproject ⇄ environment.yml ⇄ constraints ⇄ Makefile ⇄ CI."""

import json
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONDA_NAMES = {"torch": "pytorch"}  # PyPI name -> conda-forge name where they differ


def _split(req: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", req)
    return m[1].lower().replace("_", "-"), m[2].replace(" ", "")


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _installed(project) -> list[str]:
    """What `make test`, `make test-ui` and `make site` install: the dependencies, the test, ui
    and site extras."""
    extras = project["optional-dependencies"]
    return project["dependencies"] + extras["test"] + extras["ui"] + extras["site"]


def test_environment_yml_matches_pyproject():
    project = _pyproject()
    wanted = dict(_split(r) for r in _installed(project))
    wanted = {CONDA_NAMES.get(k, k): v for k, v in wanted.items()}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda = {}
    pip_section = None
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip_section = dep["pip"]
            continue
        name, spec = _split(dep)
        if name not in ("python", "pip"):
            conda[name] = spec
    assert conda == wanted, (
        f"only in environment.yml: {sorted(set(conda) - set(wanted))}; "
        f"only in pyproject.toml: {sorted(set(wanted) - set(conda))}; "
        f"different bounds: {sorted(k for k in set(conda) & set(wanted) if conda[k] != wanted[k])}")
    assert pip_section == ["-e ."]
    assert _split(next(d for d in env["dependencies"] if str(d).startswith("python")))[1] == \
        project["requires-python"]


def test_constraints_pin_every_dependency_exactly():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, spec = _split(line)
            pins[name] = spec
    assert pins["torch"] == "==2.14.1" and pins["torchvision"] == "==0.29.1"
    project = _pyproject()
    for req in _installed(project):
        name, _ = _split(req)
        assert pins.get(name, "").startswith("=="), f"{name} has no exact pin in constraints.txt"


def test_makefile_and_ci_use_the_pins_and_make_test():
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints.txt" in makefile
    assert re.search(r"^lab:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "$(LAB_ARGS)" in makefile and "/lab/tree/notebooks/00_setup.ipynb" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "set -euo pipefail" in ci
    assert re.search(r"^test-ui:", makefile, re.M) and "make test-ui" in ci
    assert re.search(r"^make test\n(.*\n)*exec make test-ui$", ci, re.M), "CI runs make test, then make test-ui"
    assert "|| true" not in ci and "; true" not in ci


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    first_block = readme[: readme.index("\n## ", readme.index("make test"))]
    assert "make lab" in first_block and "make test" in first_block


def test_site_gets_mathjax_3_pinned_from_npm():
    """`make site` bundles MathJax 3 from the npm registry: an exact version, checked by its hash."""
    folder = ROOT / "website" / "mathjax"
    version = json.loads((folder / "package.json").read_text())["dependencies"]["mathjax"]
    assert re.fullmatch(r"3\.\d+\.\d+", version), f"MathJax must be pinned to one 3.x release, got {version}"
    entry = json.loads((folder / "package-lock.json").read_text())["packages"]["node_modules/mathjax"]
    assert entry["version"] == version and entry["integrity"].startswith("sha512-")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^site:", makefile, re.M) and re.search(r"^serve-site:", makefile, re.M)
    assert "--bind 127.0.0.1" in makefile
    assert "npm" in (ROOT / ".ci" / "run").read_text(), "CI installs npm when it is missing"

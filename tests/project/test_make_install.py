"""What `make lab` installs and how it starts JupyterLab, read from `make -n` (nothing is downloaded).

* default (`TORCH=pypi`, what CI uses): torch from PyPI with the pins of constraints.txt, and pip's
  progress visible for that big step (no `-q`);
* `TORCH=cpu`: the same torch/torchvision versions from PyTorch's CPU-only wheel index, the rest from
  PyPI with the pins;
* the lab runs with the course's application settings (lab/settings/overrides.json), which turn off
  JupyterLab's news pop-up and update check.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    # -B: print every recipe even when this checkout's .venv is already installed. A make that runs
    # these tests (make test TORCH=cpu) passes its own flags and variables down: drop them.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "TORCH", "TORCH_CPU_INDEX", "VENV")}
    return subprocess.run(["make", "-n", "-B", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env)


def _pip_installs(out: str) -> list[list[str]]:
    return [shlex.split(line) for line in out.splitlines() if re.search(r"-m pip install\b", line)]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.match(r"^(torch|torchvision)==(\S+)$", line)
        if m:
            pins[m[1]] = m[2]
    return pins


def test_default_install_is_pypi_with_pins_and_shows_progress():
    res = _dry_run("lab")
    assert res.returncode == 0, res.stderr
    first, *rest = _pip_installs(res.stdout)
    assert CPU_INDEX not in res.stdout and "--index-url" not in res.stdout
    # the big step: torch + torchvision, pinned, with pip's progress bars (no -q)
    assert "torch" in first and "torchvision" in first
    assert first[first.index("-c") + 1] == "constraints.txt"
    assert "-q" not in first and "--quiet" not in first
    assert re.search(r"downloading|download", res.stdout, re.I) and "3 GB" in res.stdout
    # then the package itself, also pinned
    assert rest and all(cmd[cmd.index("-c") + 1] == "constraints.txt" for cmd in rest)
    assert any("-e" in cmd and ".[test]" in cmd for cmd in rest)


def test_torch_cpu_uses_pytorch_cpu_index_with_the_same_versions():
    res = _dry_run("lab", "TORCH=cpu")
    assert res.returncode == 0, res.stderr
    first, *rest = _pip_installs(res.stdout)
    assert first[first.index("--index-url") + 1] == CPU_INDEX
    pins = _pins()
    assert set(pins) == {"torch", "torchvision"}
    wanted = {f"{name}=={version}" for name, version in pins.items()}
    assert wanted <= set(first), first
    # only torch and torchvision come from that index; their dependencies and everything else are
    # resolved from PyPI with the pins in the next step
    assert {a for a in first if "==" in a} == wanted
    assert "--no-deps" in first and "-q" not in first
    assert rest and all("--index-url" not in cmd for cmd in rest)
    assert any("-e" in cmd and ".[test]" in cmd and cmd[cmd.index("-c") + 1] == "constraints.txt"
               for cmd in rest)
    # a CPU install is remembered apart from the default one, so switching re-runs the install
    assert ".gpucourse-installed-cpu" in res.stdout


def test_test_target_honours_torch_cpu_too():
    res = _dry_run("test", "TORCH=cpu")
    assert res.returncode == 0, res.stderr
    assert CPU_INDEX in res.stdout


def test_unknown_torch_choice_is_refused():
    res = _dry_run("lab", "TORCH=cuda")
    assert res.returncode != 0
    assert "TORCH must be pypi (the default) or cpu, got 'cuda'" in res.stderr


def test_lab_uses_the_course_settings_dir():
    res = _dry_run("lab")
    lab_cmd = next(shlex.split(line) for line in res.stdout.splitlines() if "jupyter lab" in line)
    setting = next(a for a in lab_cmd if a.startswith("--LabApp.app_settings_dir="))
    assert Path(setting.split("=", 1)[1]) == ROOT / "lab" / "settings"
    assert not any("JUPYTERLAB_SETTINGS_DIR" in a or "user_settings_dir" in a for a in lab_cmd), \
        "the learner's own settings directory must stay theirs"


def test_settings_turn_off_news_and_update_check():
    overrides = json.loads((ROOT / "lab" / "settings" / "overrides.json").read_text())
    notification = overrides["@jupyterlab/apputils-extension:notification"]
    assert notification["fetchNews"] == "false"          # a string in the schema: "true"/"false"/"none"
    assert notification["checkForUpdates"] is False


def test_settings_match_jupyterlab_schema():
    """The override names a real plugin and real values (a typo would be ignored silently)."""
    jupyterlab = pytest.importorskip("jupyterlab")
    from jupyterlab.commands import get_app_dir

    schema_file = Path(get_app_dir()) / "schemas" / "@jupyterlab" / "apputils-extension" / "notification.json"
    if not schema_file.exists():
        pytest.skip(f"JupyterLab {jupyterlab.__version__} has no {schema_file}")
    props = json.loads(schema_file.read_text())["properties"]
    overrides = json.loads((ROOT / "lab" / "settings" / "overrides.json").read_text())
    for key, value in overrides["@jupyterlab/apputils-extension:notification"].items():
        assert key in props
        allowed = [c["const"] for c in props[key].get("oneOf", [])] or None
        if allowed:
            assert value in allowed
        else:
            assert isinstance(value, bool) and props[key]["type"] == "boolean"


def test_test_ui_installs_the_ui_extra_pinned_then_runs_only_the_browser_tests():
    res = _dry_run("test-ui")
    assert res.returncode == 0, res.stderr
    ui = next(cmd for cmd in _pip_installs(res.stdout) if ".[test,ui,site]" in cmd)   # the site is tested too
    assert ui[ui.index("-c") + 1] == "constraints.txt"
    pytest_cmd = next(shlex.split(line) for line in res.stdout.splitlines() if "-m pytest" in line)
    assert pytest_cmd[pytest_cmd.index("-m", pytest_cmd.index("pytest")) + 1] == "ui"
    assert pytest_cmd[-1] == "tests/ui"
    # `make test` itself never runs them: pyproject's addopts deselect the ui marker
    assert "-m ui" not in _dry_run("test").stdout

"""The README's install and remote-access advice: sizes stated, a CPU-only path, no bare 0.0.0.0."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def test_remote_access_is_an_ssh_tunnel():
    assert re.search(r"ssh (-N )?-L 8888:localhost:8888 \S+", README)
    assert "--no-browser" in README


def test_every_0000_mention_carries_a_warning_and_a_password_tls_pointer():
    mentions = [p for p in _paragraphs(README) if "0.0.0.0" in p]
    assert mentions, "keep the 0.0.0.0 case documented, with its warning"
    for paragraph in mentions:
        flat = " ".join(paragraph.split())
        assert "plain HTTP" in flat and "password" in flat and "TLS" in flat, flat
        assert re.search(r"https://jupyter-server\.readthedocs\.io/\S*public-server", flat), flat
        assert not re.search(r"add `--ip=0\.0\.0\.0`", flat)


def test_install_size_time_and_cpu_only_path_are_stated():
    flat = " ".join(README.split())
    assert "5.8 GB" in flat and re.search(r"~?3 GB to download|about 3 GB to download", flat)
    assert re.search(r"\d+ minutes", flat)
    assert "make lab TORCH=cpu" in flat and "https://download.pytorch.org/whl/cpu" in flat
    assert "make clean" in flat                     # how to switch an existing .venv


def test_lab_settings_are_mentioned():
    assert "lab/settings/overrides.json" in README


def test_the_readme_states_each_chapters_exercises_and_mutations_as_measured():
    """The README's table of check strength is what scripts/exercise_stats.py reads today."""
    import subprocess
    import sys

    table = subprocess.run([sys.executable, str(ROOT / "scripts" / "exercise_stats.py")], capture_output=True,
                           text=True, check=True, timeout=120).stdout.strip()
    assert table.count("\n") >= 14, table
    assert table in (ROOT / "README.md").read_text(), "README's table is stale: python scripts/exercise_stats.py"

import subprocess
import sys
from pathlib import Path

from gpucourse.runtime.doctor import doctor


def test_doctor_reports_and_passes_smoke_test(capsys):
    assert doctor() is True
    out = capsys.readouterr().out
    for label in ("torch", "CUDA devices", "backends", "CPU cores", "CPU bf16", "2-process all-reduce"):
        assert label in out
    assert "gloo=yes" in out and "ok in" in out and out.strip().splitlines()[-1].startswith("verdict: READY")


def test_doctor_cli_exit_status():
    r = subprocess.run([sys.executable, "-m", "gpucourse", "doctor"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "verdict: READY" in r.stdout


def test_doctor_flags_malformed_visible_devices(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,zero")
    assert doctor(smoke_test=False) is False
    assert "NOT READY" in capsys.readouterr().out


ROOT = Path(__file__).resolve().parents[2]


def test_exercises_cli_check_mode():
    r = subprocess.run([sys.executable, "-m", "gpucourse", "exercises", "--check"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_exercises_cli_outside_the_course_folder_fails_and_deletes_nothing(tmp_path):
    (tmp_path / "exercises").mkdir()
    kept = tmp_path / "exercises" / "00_setup_exercises.ipynb"
    kept.write_text("{}")
    for extra in ([], ["--check"]):
        r = subprocess.run([sys.executable, "-m", "gpucourse", "exercises", *extra],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 2 and "no solutions notebooks" in r.stderr, r.stdout + r.stderr
    assert kept.exists()

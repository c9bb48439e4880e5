"""scripts/gpu_check.py (``make gpu-check``): one line and exit 0 without CUDA; with CUDA (pretended
here, on a tiny fake course) one report of tests, lessons and benchmarks under one time limit."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _run(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_without_cuda_says_so_in_one_line_and_exits_0(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    r = _run("--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("\n") == 1 and "no CUDA GPU on this machine" in r.stdout, r.stdout
    assert list(tmp_path.iterdir()) == []        # nothing checked, no report


def _notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def _fake_course(root: Path) -> None:
    (root / "notebooks").mkdir()
    _notebook(root / "notebooks" / "01_ok.ipynb", "x = 1 + 1", "print(x)")
    _notebook(root / "notebooks" / "02_broken.ipynb", "y = 2",
              "raise ValueError('the lesson broke here\\nsecond line')", "print('never')")
    _notebook(root / "notebooks" / "03_new_api.ipynb",
              "raise ImportError(\"cannot import name 'fully_shard' from 'torch.distributed.fsdp'\")")
    tests = root / "tests" / "precision"
    tests.mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: c\n    multigpu: m\n")
    (root / "tests" / "conftest.py").write_text(
        "import pytest\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    for item in items:\n"
        "        if 'multigpu' in item.keywords:\n"
        "            item.add_marker(pytest.mark.skip(reason='needs >= 2 CUDA GPUs; this machine has 1'))\n")
    (tests / "test_fake_gpu.py").write_text(
        "import pytest\n"
        "@pytest.mark.cuda\n"
        "def test_on_gpu():\n    assert 1 + 1 == 2\n"
        "@pytest.mark.cuda\n"
        "def test_on_gpu_fails():\n    assert [1] == [2], 'gpu result differs'\n"
        "@pytest.mark.multigpu\n"
        "def test_two_gpus():\n    pass\n"
        "def test_not_marked():\n    raise AssertionError('must not run')\n")
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "gpu_bench.py").write_text("print('on cuda: 2.0x')\n")
    (root / "benchmarks" / "cpu_bench.py").write_text("raise SystemExit('must not run')\n")


def _check_fake_course(tmp_path: Path, *args: str):
    """gpu_check on the fake course, CUDA pretended, 2 lessons at once: (result, report, report.md)."""
    root = tmp_path / "course"
    root.mkdir()
    _fake_course(root)
    out = tmp_path / "out"
    r = _run("--pretend-cuda", "1", "--root", str(root), "--out", str(out), "--workers", "2", *args)
    report = out / "gpu_check_report.json"
    return (r, json.loads(report.read_text()) if report.exists() else None,
            (out / "gpu_check_report.md").read_text() if report.exists() else None)


@pytest.mark.slow
def test_pretended_cuda_report(tmp_path):
    r, report, md = _check_fake_course(tmp_path, "--time-limit", "150")
    assert r.returncode == 1, r.stdout + r.stderr           # a lesson and a test failed
    assert {"started", "time_limit_s", "elapsed_s", "machine", "chapters", "items", "counts",
            "needs_newer_torch", "skipped_multigpu"} <= set(report)
    assert report["machine"]["gpus"][0]["name"] == "pretend GPU" and "python" in report["machine"]
    assert report["elapsed_s"] < 150
    items = {it["name"]: it for it in report["items"]}
    for it in report["items"]:
        assert {"kind", "name", "chapter", "status", "seconds", "detail"} <= set(it)

    assert items["01_ok.ipynb"]["status"] == "ran"
    broken = items["02_broken.ipynb"]
    assert broken["status"] == "failed" and broken["chapter"] == "02"
    assert broken["detail"] == "ValueError: the lesson broke here" and broken["cell"] == 1
    assert "second line" in "\n".join(broken["output"])       # the error's text, not just its first line
    assert "the lesson broke here" in md.split("## 02_broken.ipynb")[1]
    new_api = items["03_new_api.ipynb"]
    assert new_api["status"] == "needs newer torch" and new_api["requirement"] == "needs torch >= 2.6"
    assert [n["name"] for n in report["needs_newer_torch"]] == ["03_new_api.ipynb"]

    tests = {name.split("::")[-1]: it for name, it in items.items() if it["kind"] == "test"}
    assert set(tests) == {"test_on_gpu", "test_on_gpu_fails", "test_two_gpus"}
    assert tests["test_on_gpu"]["status"] == "ran" and tests["test_on_gpu"]["chapter"] == "06"
    assert tests["test_on_gpu_fails"]["status"] == "failed"
    assert "gpu result differs" in tests["test_on_gpu_fails"]["detail"]
    assert tests["test_two_gpus"]["status"] == "skipped"
    assert [s["detail"] for s in report["skipped_multigpu"]] == ["needs >= 2 CUDA GPUs; this machine has 1"]

    assert [it["name"] for it in report["items"] if it["kind"] == "benchmark"] == ["gpu_bench.py"]
    assert items["gpu_bench.py"]["status"] == "ran" and items["gpu_bench.py"]["output"] == ["on cuda: 2.0x"]
    assert report["chapters"]["02"]["status"] == "failed" and report["chapters"]["01"]["status"] == "ran"
    assert "| 02 | failed |" in md and "test_two_gpus" in md and "needs torch >= 2.6" in md


@pytest.mark.slow
def test_a_second_call_can_re_check_only_the_lessons_that_failed(tmp_path):
    r, report, _ = _check_fake_course(tmp_path, "--time-limit", "100", "--parts", "notebooks",
                                      "--chapters", "01,03")
    assert r.returncode == 0, r.stdout + r.stderr         # 02 (broken) and the failing test not run
    assert [it["name"] for it in report["items"]] == ["01_ok.ipynb", "03_new_api.ipynb"]
    bad = _run("--pretend-cuda", "1", "--root", str(tmp_path / "course"), "--out", str(tmp_path / "out"),
               "--parts", "lessons")
    assert bad.returncode == 2 and "--parts takes tests, benchmarks and notebooks, not lessons" in bad.stderr


@pytest.mark.slow
def test_a_lesson_that_runs_out_of_time_names_its_slowest_cells_and_the_one_still_running(tmp_path):
    # lessons 04 and 08 ran out of time on a GPU and the report named only the cell they stopped at:
    # it must say whether that cell hung or the cells before it used up the time
    root = tmp_path / "course"
    (root / "notebooks").mkdir(parents=True)
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import time"),
        nbformat.v4.new_code_cell("time.sleep(2)  # a slow cell"),
        nbformat.v4.new_markdown_cell("## then one that hangs"),
        nbformat.v4.new_code_cell("time.sleep(600)"),
        nbformat.v4.new_markdown_cell("never reached")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "notebooks" / "04_slow.ipynb")
    _notebook(root / "notebooks" / "01_quick.ipynb", "import time", "time.sleep(1)", "x = 1")
    out = tmp_path / "out"
    # 60 s: in a loaded CI the notebook started with 17 s of 40 left, and its 9 s ran out in
    # cell 1 (2026-11-29); the hung cell waits out whatever is left, so a longer limit costs its time
    r = _run("--pretend-cuda", "1", "--root", str(root), "--out", str(out), "--time-limit", "60",
             "--parts", "notebooks", env={"GPU_CHECK_GRACE_S": "8"})
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads((out / "gpu_check_report.json").read_text())
    items = {it["name"]: it for it in report["items"]}
    slow = items["04_slow.ipynb"]
    assert slow["status"] == "failed" and slow["detail"].startswith("timeout: cell 3"), slow
    # how long the hung cell ran depends on how long the kernel took to start (a loaded machine
    # leaves it seconds): the report must name it, not rank it first
    cells = {c["cell"]: c for c in slow["slowest"]}
    assert set(cells) == {0, 1, 3}, slow["slowest"]            # the code cells; markdown is not timed
    assert [c["seconds"] for c in slow["slowest"]] == sorted((c["seconds"] for c in slow["slowest"]), reverse=True)
    hung, before = cells[3], cells[1]
    assert hung["running"] is True and hung["seconds"] > 0 and hung["first_line"] == "time.sleep(600)", hung
    assert before == {"cell": 1, "seconds": before["seconds"], "first_line": "time.sleep(2)  # a slow cell"}
    assert 1.9 <= before["seconds"] < 10, before
    assert "running" not in cells[0]
    quick = items["01_quick.ipynb"]
    sleep = {c["cell"]: c for c in quick["slowest"]}[1]
    assert quick["status"] == "ran" and 0.9 <= sleep["seconds"] < 10, quick
    assert not any(c.get("running") for c in quick["slowest"])
    md = (out / "gpu_check_report.md").read_text()
    assert "## The slowest cells of each lesson" in md
    assert "| 04_slow.ipynb | failed | 3 (still running) |" in md and "`time.sleep(600)`" in md


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the process sweep reads /proc (Linux)")
@pytest.mark.slow
def test_the_overall_deadline_kills_a_hanging_lesson_and_what_it_started(tmp_path):
    root = tmp_path / "course"
    (root / "notebooks").mkdir(parents=True)
    pids = tmp_path / "pids"
    _notebook(root / "notebooks" / "05_hangs.ipynb",
              "import os, subprocess, time\n"
              "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
              "time.sleep(600)")
    out = tmp_path / "out"
    start = time.monotonic()
    # the worker would stop the cell itself GRACE_S before the end; a negative grace leaves it to the
    # overall deadline, which kills the worker, its kernel and the kernel's own child
    r = _run("--pretend-cuda", "1", "--root", str(root), "--out", str(out), "--time-limit", "35",
             env={"GPU_CHECK_GRACE_S": "-60"})
    assert time.monotonic() - start < 60, "the time limit was not kept"
    report = json.loads((out / "gpu_check_report.json").read_text())
    (hung,) = [it for it in report["items"] if it["kind"] == "notebook"]
    assert hung["status"] == "failed" and hung["detail"].startswith("timeout"), hung
    kernel, child = map(int, pids.read_text().split())
    time.sleep(0.5)
    assert not _alive(kernel) and not _alive(child), "a process outlived the check"
    assert r.returncode == 1

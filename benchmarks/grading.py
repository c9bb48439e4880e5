"""Grading a class: throughput with 2 workers vs 1, peak grader memory, mis-graded submissions.

40 submissions of chapter 00 and 40 of chapter 03, built from the shipped exercises: half solved,
a quarter cheating (edited checks, a no-op assert_close, a hidden error display, an input
transformer), a quarter broken (unsolved, truncated, not a notebook) — and one solved submission
that prints 300 MB. Each class is graded by `python -m gpucourse grade --workers W` in a
subprocess whose memory (the grader and its sandbox shepherds, not the student kernels) is sampled
from /proc every 0.1 s. The grader never imports torch (`import gpucourse` is lazy; only the
students' kernels load it); the breakdown printed shows the grader's baseline and its growth, and
where a notebook's wall time goes (shepherd start, kernel start, cells).

    python benchmarks/grading.py                 # targets: ratio >= 1.6x, peak <= 500 MB, 0 mis-graded
    python benchmarks/grading.py --per-chapter 8 # a quicker, smaller class
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "grading"))

from make_corpus import CH00, CH03, _insert_after_imports, exercises, solved

CHEATS = [
    lambda nb: [c.update(source=c.source.splitlines()[0] + "\nprint('passed ✓')") for c in nb.cells
                if "check" in c.metadata.get("tags", [])] and nb,
    lambda nb: _insert_after_imports(nb, "import torch\ntorch.testing.assert_close = lambda *a, **k: None"),
    lambda nb: _insert_after_imports(nb, "get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)"),
    lambda nb: _insert_after_imports(nb, "get_ipython().input_transformers_cleanup.append(\n"
                                         "    lambda ls: ['pass\\n'] if ls and ls[0].startswith('# Check') else ls)"),
]
BROKEN = [
    lambda name: nbformat.writes(exercises(name)).encode(),                  # unsolved
    lambda name: nbformat.writes(solved(name)).encode()[:3000],              # truncated
    lambda name: b'{"not": "a notebook"}',
]


def make_class(dest: Path, per_chapter: int) -> dict[str, float]:
    """Write dest/<student>/<chapter notebook>; return each student's expected fraction of points."""
    expected = {}
    for name in (CH00, CH03):
        for i in range(per_chapter):
            student = f"{name[:2]}-{i:03d}"
            folder = dest / student
            folder.mkdir(parents=True)
            kind = i % 4
            if kind in (0, 1):
                nb = solved(name)
                if i == 0 and name == CH00:       # the loud one: prints 300 MB, still solved
                    nb.cells.insert(2, nbformat.v4.new_code_cell("print('x' * 300_000_000)"))
                data, exp = nbformat.writes(nb).encode(), 1.0
            elif kind == 2:
                data, exp = nbformat.writes(CHEATS[(i // 4) % len(CHEATS)](exercises(name))).encode(), 0.0
            else:
                data, exp = BROKEN[(i // 4) % len(BROKEN)](name), 0.0
            (folder / name).write_bytes(data)
            expected[student] = exp
    return expected


def _memory(pid: int) -> tuple[int, int]:
    """(resident, anonymous resident) bytes of one process (VmRSS, RssAnon)."""
    rss = anon = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) << 10
        elif line.startswith("RssAnon:"):
            anon = int(line.split()[1]) << 10
    return rss, anon


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (any of its threads), from /proc/<pid>/task/*/children: the
    sampler reads the grader's own tree only, not all of /proc (it shares the 2 cores it measures)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree(root_pid: int) -> dict[str, int]:
    """Memory of the grader and its sandbox shepherds (student kernels and their ranks excluded):
    the grader's RSS, and RSS / anonymous RSS summed over grader + shepherds."""
    out = {"main": 0, "tree": 0, "anon": 0}
    todo = [root_pid]
    while todo:
        p = todo.pop()
        try:
            if b"ipykernel" in Path(f"/proc/{p}/cmdline").read_bytes():
                continue                                # a student's kernel: limited, not the grader
            rss, anon = _memory(p)
        except (OSError, ValueError):
            continue
        out["main"] = out["main"] or rss
        out["tree"] += rss
        out["anon"] += anon
        todo += _children(p)
    return out


def run(folder: Path, workers: int, out: Path) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "gpucourse", "grade", str(folder), "--release",
                             str(ROOT / "exercises"), "--workers", str(workers), "--json", str(out),
                             "--notebook-timeout", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=ROOT)
    peak = {"main": 0, "tree": 0, "anon": 0}
    baseline = []

    def sample():
        while proc.poll() is None:
            now = _tree(proc.pid)
            if not baseline and now["tree"] > now["main"]:
                baseline.append(now["main"])            # imports done, first notebook starting
            for k, v in now.items():
                peak[k] = max(peak[k], v)
            time.sleep(0.1)

    started = time.monotonic()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    proc.wait()
    elapsed = time.monotonic() - started
    t.join()
    return {"seconds": elapsed, "main_mb": peak["main"] / 2**20,
            "baseline_mb": (baseline[0] if baseline else 0) / 2**20, "tree_mb": peak["tree"] / 2**20,
            "anon_mb": peak["anon"] / 2**20,
            "rows": json.loads(out.read_text())["rows"], "code": proc.returncode,
            "notebooks": json.loads(out.read_text())["notebooks"]}


def phases(notebooks: list[dict]) -> str:
    """Mean seconds per graded notebook in each phase (as the shepherds measured them)."""
    graded = [nb["phases"] for nb in notebooks if nb.get("phases")]
    if not graded:
        return "no notebook ran"
    mean = {k: sum(p.get(k, 0.0) for p in graded) / len(graded)
            for k in ("shepherd_start", "kernel_start", "cells", "kernel_stop")}
    wall = sum(nb["wall_seconds"] for nb in notebooks if nb.get("phases")) / len(graded)
    return (f"per notebook run ({len(graded)}): {wall:.1f} s wall = shepherd start {mean['shepherd_start']:.1f} + "
            f"kernel start (with torch) {mean['kernel_start']:.1f} + cells {mean['cells']:.1f} + kernel stop "
            f"{mean['kernel_stop']:.1f} + rest {wall - sum(mean.values()):.1f}")


def misgraded(rows: list[dict], expected: dict[str, float]) -> list[str]:
    got: dict[str, list[float]] = {}
    for r in rows:
        g = got.setdefault(r["student"], [0.0, 0.0])
        g[0] += r["points"]
        g[1] += r["max"]
    bad = []
    for student, exp in expected.items():
        pts, mx = got.get(student, [0.0, 0.0])
        frac = pts / mx if mx else 0.0
        if abs(frac - exp) > 1e-9:
            bad.append(f"{student}: {pts:g}/{mx:g}, expected {exp:.0%}")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-chapter", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grading-bench-") as tmp:
        folder = Path(tmp) / "subs"
        expected = make_class(folder, args.per_chapter)
        n = len(expected)
        results = {}
        for workers in (1, 2):
            r = run(folder, workers, Path(tmp) / f"w{workers}.json")
            results[workers] = r
            bad = misgraded(r["rows"], expected)
            print(f"--workers {workers}: {n} notebooks in {r['seconds']:.0f} s = {60 * n / r['seconds']:.1f} "
                  f"notebooks/min; peak memory: grader {r['main_mb']:.0f} MB RSS ({r['baseline_mb']:.0f} MB "
                  f"after importing gpucourse, before the first notebook), grader + shepherds "
                  f"{r['tree_mb']:.0f} MB RSS of which {r['anon_mb']:.0f} MB anonymous (heap); "
                  f"mis-graded {len(bad)}", flush=True)
            print("   ", phases(r["notebooks"]))
            for line in bad[:10]:
                print("   ", line)
    ratio = results[1]["seconds"] / results[2]["seconds"]
    peak = max(r["tree_mb"] for r in results.values())
    wrong = sum(len(misgraded(r["rows"], expected)) for r in results.values())
    ok = ratio >= 1.6 and peak <= 500 and wrong == 0
    print(f"throughput ratio 2 workers / 1 worker: {ratio:.2f}x (target >= 1.6x); peak grader memory "
          f"{peak:.0f} MB RSS, grader + shepherds (target <= 500 MB); mis-graded {wrong} (target 0): {'MET' if ok else 'NOT MET'}")
    print("(2 cores shared with everything else on the machine: the ratio is noisy)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

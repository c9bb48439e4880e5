"""Grading a class: 2 workers vs 1, mis-graded submissions, peak memory — and nbgrader on the same class.

A class of 30 submissions across three chapters (10 each), built from the shipped exercises and
solutions: 4 honest (every answer right), 3 cheating (faked passes, a patched harness, forged
values — each must score 0), 3 broken (unsolved, truncated, not a notebook). Each class is graded
by `python -m gpucourse grade --hidden --workers W` in a subprocess whose memory is sampled from
/proc every 0.1 s: the grader itself, its sandbox shepherds, and the judges (one per chapter: the
course's solutions, with torch; forked from one host that imported torch once) — RSS, and for the
judges also PSS, which counts a page they share once — the students' kernels are limited by the
sandbox and not counted.

    python benchmarks/grading.py                    # targets: ratio >= 1.8x (issue 41), 0 mis-graded
    python benchmarks/grading.py --nbgrader         # also time `nbgrader autograde` on the same class
    python benchmarks/grading.py --chapters 00 03   # another selection (10 notebooks per chapter)

The seed is fixed (--seed), so the two runs grade the same inputs.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.8          # 2 workers' throughput / 1 worker's (issue 41; 1.6 before)
JUDGE_MB = 400        # peak RSS per judge (issue 41), printed beside the target above
sys.path.insert(0, str(ROOT / "tests" / "grading"))

from make_corpus import exercises, solved                               # noqa: E402
from test_attacks import FORGE_VALUES, PATCH_HARNESS                     # noqa: E402


def _print_pass(nb):
    for c in nb.cells:
        if "check" in c.metadata.get("tags", []):
            cid = c.source.split()[2]
            c.source = f'# Check {cid}\nprint("{cid} passed ✓")'
    return nb


def _with(source):
    def attack(nb):
        nb.cells.insert(2, new_code_cell(source))
        return nb
    return attack


CHEATS = [_print_pass, _with(PATCH_HARNESS), _with(FORGE_VALUES)]
BROKEN = [
    lambda name: nbformat.writes(exercises(name)).encode(),                  # unsolved
    lambda name: nbformat.writes(solved(name)).encode()[:3000],              # truncated
    lambda name: b'{"not": "a notebook"}',
]


def notebook_name(chapter: str) -> str:
    return next((ROOT / "solutions").glob(f"{chapter}_*.ipynb")).name


def make_class(dest: Path, chapters: list[str]) -> dict[str, float]:
    """dest/<student>/<chapter notebook>; returns each student's expected fraction of the points."""
    expected = {}
    for chapter in chapters:
        name = notebook_name(chapter)
        for i in range(10):
            student = f"{chapter}-{i:02d}"
            folder = dest / student
            folder.mkdir(parents=True)
            if i < 4:
                data, frac = nbformat.writes(solved(name)).encode(), 1.0
            elif i < 7:
                data, frac = nbformat.writes(CHEATS[i - 4](exercises(name))).encode(), 0.0
            else:
                data, frac = BROKEN[i - 7](name), 0.0
            (folder / name).write_bytes(data)
            expected[student] = frac
    return expected


def _memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in bytes. RSS counts every page it maps, also those it shares with
    others (torch's libraries, the pages a fork shares with its host); PSS divides each shared page
    among the processes that map it, so PSS adds up to the memory the processes hold together."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:          # it has just ended
        return 0, 0
    got = {}
    for line in text.splitlines()[1:]:
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss"):
            got[key] = int(value.split()[0]) << 10
    return got.get("Rss", 0), got.get("Pss", 0)


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree(root_pid: int) -> dict[str, int]:
    """RSS of the grader, its shepherds (and their bwrap), and its judges (not the students' kernels
    and ranks, nor the judges' own ranks); the judges' PSS and how many there are."""
    out = {"grader": 0, "shepherds": 0, "judges": 0, "judges_pss": 0, "judge_count": 0}
    todo = [(root_pid, "grader")]
    while todo:
        pid, role = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ipykernel" in cmd:
            continue
        if b"gpucourse.grading.judge" in cmd:
            # the judges' host runs under bwrap (its own network) and forks one judge per chapter,
            # which keeps its command line: count bwrap, the host and the judges, not the ranks the
            # judges' reference runs start (their children)
            rss, pss = _memory(pid)
            out["judges"] += rss
            out["judges_pss"] += pss
            if cmd.split(b"\0")[0].endswith(b"bwrap"):
                todo += [(c, "judge host") for c in _children(pid)]
            elif role != "judge" and b"--host" in cmd:          # the host (a fork keeps its command line)
                todo += [(c, "judge") for c in _children(pid)]
            else:                                  # a judge: forked, or started on its own (no host)
                out["judge_count"] += 1
            continue
        if role not in out:                    # a judge's process as it ends (its command line is gone)
            continue
        out[role] += _memory(pid)[0]
        todo += [(c, "shepherds") for c in _children(pid)]
    return out


def run(folder: Path, workers: int, out: Path, seed: int) -> dict:
    argv = [sys.executable, "-m", "gpucourse", "grade", str(folder), "--hidden", "--workers", str(workers),
            "--json", str(out), "--seed", str(seed), "--notebook-timeout", "900"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    peak = {"grader": 0, "shepherds": 0, "judges": 0, "judges_pss": 0, "judge_count": 0, "total": 0}

    def sample():
        while proc.poll() is None:
            now = _tree(proc.pid)
            now["total"] = sum(now[k] for k in ("grader", "shepherds", "judges"))
            for k, v in now.items():
                peak[k] = max(peak[k], v)
            time.sleep(0.1)

    started = time.monotonic()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, err = proc.communicate()
    elapsed = time.monotonic() - started
    t.join()
    data = json.loads(out.read_text())
    peak_mb = {k: v / 2**20 for k, v in peak.items() if k != "judge_count"}
    peak_mb["judge_count"] = peak["judge_count"]
    return {"seconds": elapsed, "peak_mb": peak_mb, "rows": data["rows"],
            "notebooks": data["notebooks"], "code": proc.returncode, "stderr": err.decode()[-2000:]}


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


def nbgrader_class(tmp: Path, folder: Path, chapters: list[str]) -> dict:
    """The same class through real nbgrader: export, generate_assignment, autograde (per chapter)."""
    nbgrader = shutil.which("nbgrader", path=str(Path(sys.executable).parent))
    if nbgrader is None:
        return {"skipped": "nbgrader is not installed (test extra)"}
    course = tmp / "nbgrader"
    subprocess.run([sys.executable, "-m", "gpucourse", "export-nbgrader", str(course),
                    *[a for c in chapters for a in ("--chapter", c)]], check=True, capture_output=True)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    seconds, graded = {}, 0
    for chapter in chapters:
        name = notebook_name(chapter)
        assignment = name.removesuffix("_exercises.ipynb")
        subprocess.run([nbgrader, "generate_assignment", assignment, "--force"], cwd=course, env=env,
                       check=True, capture_output=True)
        # the same class, made from nbgrader's own notebooks (they carry its grade ids): the source
        # (answers in) for honest work, the release for the cheats and the unsolved one
        source = nbformat.read(course / "source" / assignment / name, as_version=4)
        release = course / "release" / assignment / name
        for student_dir in sorted(folder.glob(f"{chapter}-*")):
            i = int(student_dir.name[-2:])
            dest = course / "submitted" / student_dir.name / assignment
            dest.mkdir(parents=True)
            if i < 4:
                data = nbformat.writes(source).encode()
            elif i < 7:
                data = nbformat.writes(CHEATS[i - 4](nbformat.read(release, as_version=4))).encode()
            elif i == 7:
                data = release.read_bytes()
            elif i == 8:
                data = nbformat.writes(source).encode()[:3000]
            else:
                data = b'{"not": "a notebook"}'
            (dest / name).write_bytes(data)
            graded += 1
        started = time.monotonic()
        r = subprocess.run([nbgrader, "autograde", assignment, "--create", "--force"], cwd=course, env=env,
                           capture_output=True, text=True)
        seconds[chapter] = time.monotonic() - started
        if r.returncode != 0:            # the truncated and the not-a-notebook submissions fail there
            failed = r.stderr.count("There was an error processing")
            print(f"nbgrader autograde {assignment}: exit {r.returncode}, {failed} submission(s) not graded",
                  flush=True)
    scores = {}
    r = subprocess.run([nbgrader, "export", "--to", str(tmp / "nbgrader.csv")], cwd=course, env=env,
                       capture_output=True, text=True)
    if r.returncode == 0:
        import csv

        with open(tmp / "nbgrader.csv", newline="") as f:
            for row in csv.DictReader(f):          # a row per student × assignment: keep each one's own
                if row["assignment"].startswith(row["student_id"][:2] + "_"):
                    scores[row["student_id"]] = (float(row["score"] or 0), float(row["max_score"] or 0))
    return {"seconds": seconds, "notebooks": graded, "scores": scores}


def breakdown(r: dict) -> str:
    """Where a grading run's time goes: the notebooks' own runs (sandbox, kernel, cells — a notebook
    may be run more than once: a passing exercise that forbids a helper is checked in a run without
    it) and the rest (the grader, and the judges: starting, drawing cases, running the course's
    answers, comparing), from the gradebook's per-notebook records."""
    books = r["notebooks"]
    runs = sum(n.get("runs", 1) for n in books)
    walls = sum(n.get("wall_seconds", 0.0) for n in books)
    phase = {k: sum(n.get("phases", {}).get(k, 0.0) for n in books)
             for k in ("shepherd_start", "kernel_start", "cells", "kernel_stop")}
    by_runs = {}
    for n in books:
        by_runs[n.get("runs", 1)] = by_runs.get(n.get("runs", 1), 0) + 1
    return (f"where the time goes: {len(books)} notebooks in {runs} runs "
            f"({', '.join(f'{v} in {k}' for k, v in sorted(by_runs.items()))}), {walls:.0f} s of notebook runs "
            f"(first runs: sandbox start {phase['shepherd_start']:.0f} s, kernel start {phase['kernel_start']:.0f} s, "
            f"cells {phase['cells']:.0f} s, kernel stop {phase['kernel_stop']:.0f} s); the grader and the judges "
            f"the rest of {r['seconds']:.0f} s (with 2 workers the runs overlap)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chapters", nargs="+", default=["00", "03", "12"])
    ap.add_argument("--seed", type=int, default=20261125)
    ap.add_argument("--nbgrader", action="store_true", help="also time nbgrader autograde on the class")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grading-bench-") as tmp:
        tmp = Path(tmp)
        folder = tmp / "subs"
        expected = make_class(folder, args.chapters)
        n = len(expected)
        results = {}
        for workers in (1, 2):
            r = run(folder, workers, tmp / f"w{workers}.json", args.seed)
            results[workers] = r
            bad = misgraded(r["rows"], expected)
            m = r["peak_mb"]
            print(f"grade --hidden --workers {workers}: {n} notebooks ({', '.join(args.chapters)}) in "
                  f"{r['seconds']:.0f} s = {60 * n / r['seconds']:.1f} notebooks/min; peak RSS: grader "
                  f"{m['grader']:.0f} MB, shepherds {m['shepherds']:.0f} MB, judges {m['judges']:.0f} MB "
                  f"(all together {m['total']:.0f} MB); mis-graded {len(bad)}", flush=True)
            count = max(1, m["judge_count"])
            print(f"    judges: {m['judge_count']}; peak RSS {m['judges'] / count:.0f} MB per judge, host included "
                  f"(target <= {JUDGE_MB} MB: {'MET' if m['judges'] / count <= JUDGE_MB else 'NOT MET'}; RSS counts "
                  f"the pages they share — torch, the host's — again in every process); what they hold together "
                  f"(peak PSS, a shared page counted once): {m['judges_pss']:.0f} MB, "
                  f"{m['judges_pss'] / count:.0f} MB per judge", flush=True)
            for line in bad[:10]:
                print("   ", line)
            print("   ", breakdown(r), flush=True)
        if args.nbgrader:
            nb = nbgrader_class(tmp, folder, args.chapters)
            if "skipped" in nb:
                print("nbgrader:", nb["skipped"])
            else:
                total = sum(v for v in nb["seconds"].values() if isinstance(v, float))
                per = ", ".join(f"{c} {v:.0f} s" if isinstance(v, float) else f"{c} {v}"
                                for c, v in nb["seconds"].items())
                print(f"nbgrader autograde (one notebook at a time, in the students' kernels, no sandbox): "
                      f"{nb['notebooks']} notebooks in {total:.0f} s ({per})")
                if nb["scores"]:
                    nb_bad = [f"{s}: {p:g}/{m:g}" for s, (p, m) in sorted(nb["scores"].items())
                              if s in expected and abs((p / m if m else 0.0) - expected[s]) > 1e-9]
                    print(f"nbgrader's grades differ from the expected ones for {len(nb_bad)} of "
                          f"{len(nb['scores'])} students (it decides inside the student's kernel): "
                          f"{', '.join(nb_bad[:12])}")
    ratio = results[1]["seconds"] / results[2]["seconds"]
    wrong = sum(len(misgraded(r["rows"], expected)) for r in results.values())
    ok = ratio >= TARGET and wrong == 0
    print(f"throughput ratio 2 workers / 1 worker: {ratio:.2f}x (target >= {TARGET}x); mis-graded {wrong} "
          f"(target 0): {'MET' if ok else 'NOT MET'}")
    print("(2 cores shared with everything else on the machine: the ratio is noisy)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

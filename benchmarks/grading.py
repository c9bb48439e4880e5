"""Grading a class: 2 workers vs 1, mis-graded submissions, peak memory — and nbgrader on the same class.

A class of 30 submissions across three chapters (10 each), built from the shipped exercises and
solutions: 4 honest (every answer right), 3 cheating (faked passes, a patched harness, forged
values — each must score 0), 3 broken (unsolved, truncated, not a notebook). Each class is graded
by `python -m gpucourse grade --hidden --workers W` in a subprocess whose memory is sampled from
/proc every 0.1 s: the grader itself, its sandbox shepherds, and the judges (one per chapter: the
course's solutions, with torch; forked from one host that imported torch once) — RSS, and for the
judges also PSS, which counts a page they share once — the students' kernels are limited by the
sandbox and not counted. The judges' target is on what they hold (PSS summed, divided by the number
of judges, the host's share included): RSS would count the torch that the host's forks share once
in every fork, and a fork's RSS includes every page it shares with the host.

    python benchmarks/grading.py                    # targets (issue 41): ratio >= 1.8x, judges <= 400 MB, 0 mis-graded
    python benchmarks/grading.py --nbgrader         # also time `nbgrader autograde` on the same class
    python benchmarks/grading.py --chapters 00 03   # another selection (10 notebooks per chapter)

The seed is fixed (--seed), so the two runs grade the same inputs. The same-run ceiling printed
beside the ratio: the CPU time the class took with 1 worker (the machine's busy time during the
run, from /proc/stat: run it on an idle machine), spread over 2 cores — a notebook that launches
ranks already keeps more than one core busy with 1 worker, and that part cannot run twice as fast
with 2.
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
SAMPLE_S = 0.1        # RSS sampling interval (s)
PSS_S = 2.0           # the judges' PSS, which costs the kernel a page-table walk, at most this often (s)
JUDGE_MB = 400        # memory each judge holds (issue 41): the judges' peak PSS (host included) / judges
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


def _memory(pid: int, pss: bool = True) -> tuple[int, int]:
    """(RSS, PSS) of a process in bytes. RSS counts every page it maps, also those it shares with
    others (torch's libraries, the pages a fork shares with its host); PSS divides each shared page
    among the processes that map it, so PSS adds up to the memory the processes hold together.
    ``pss=False``: RSS alone, from /proc/PID/statm (a counter; PSS makes the kernel walk the page
    tables, several ms for a process that imported torch), PSS 0."""
    if not pss:
        try:
            resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0, 0
        return resident * os.sysconf("SC_PAGE_SIZE"), 0
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


def _tree(root_pid: int, pss: bool = True) -> dict[str, int]:
    """RSS of the grader, its shepherds (and their bwrap), and its judges (not the students' kernels
    and ranks, nor the judges' own ranks); the judges' PSS (when ``pss``) and how many there are."""
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
            rss, held = _memory(pid, pss)
            out["judges"] += rss
            out["judges_pss"] += held
            if cmd.split(b"\0")[0].endswith(b"bwrap"):
                todo += [(c, "judge host") for c in _children(pid)]
            elif role != "judge" and b"--host" in cmd:          # the host (a fork keeps its command line)
                todo += [(c, "judge") for c in _children(pid)]
            else:                                  # a judge: forked, or started on its own (no host)
                out["judge_count"] += 1
            continue
        if role not in out:                    # a judge's process as it ends (its command line is gone)
            continue
        out[role] += _memory(pid, pss=False)[0]
        todo += [(c, "shepherds") for c in _children(pid)]
    return out


def _busy_cpu_seconds() -> float:
    """CPU-seconds the whole machine has been busy (user, nice, system, irq, softirq; /proc/stat). The
    grader's sandboxed processes are not all reaped by processes this benchmark waits for, so their
    CPU time does not reach ``getrusage``; on an idle machine the machine's busy time is theirs."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:8]
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def run(folder: Path, workers: int, out: Path, seed: int) -> dict:
    argv = [sys.executable, "-m", "gpucourse", "grade", str(folder), "--hidden", "--workers", str(workers),
            "--json", str(out), "--seed", str(seed), "--notebook-timeout", "900"]
    before = _busy_cpu_seconds()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    peak = {"grader": 0, "shepherds": 0, "judges": 0, "judges_pss": 0, "judge_count": 0, "total": 0}

    sampler_cpu = [0.0]

    def sample():
        pss_at = 0.0
        while proc.poll() is None:
            with_pss = time.monotonic() >= pss_at            # PSS every PSS_S, RSS every SAMPLE_S
            if with_pss:
                pss_at = time.monotonic() + PSS_S
            now = _tree(proc.pid, with_pss)
            now["total"] = sum(now[k] for k in ("grader", "shepherds", "judges"))
            for k, v in now.items():
                peak[k] = max(peak[k], v)
            sampler_cpu[0] = time.thread_time()      # reading smaps_rollup walks page tables: not free
            time.sleep(SAMPLE_S)

    started = time.monotonic()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _, err = proc.communicate()
    elapsed = time.monotonic() - started
    cpu = _busy_cpu_seconds() - before
    t.join()
    if not out.exists():        # the grader refused (no sandbox, a bad argument) or died: say why
        raise SystemExit(f"grade --workers {workers} wrote no gradebook (exit status {proc.returncode}); "
                         f"it said: {err.decode().strip()[-2000:] or '(nothing)'}")
    data = json.loads(out.read_text())
    peak_mb = {k: v / 2**20 for k, v in peak.items() if k != "judge_count"}
    peak_mb["judge_count"] = peak["judge_count"]
    return {"seconds": elapsed, "cpu_seconds": cpu, "sampler_cpu": sampler_cpu[0], "peak_mb": peak_mb,
            "rows": data["rows"], "notebooks": data["notebooks"], "code": proc.returncode,
            "stderr": err.decode()[-2000:]}


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
                  f"{r['seconds']:.0f} s = {60 * n / r['seconds']:.1f} notebooks/min, {r['cpu_seconds']:.0f} "
                  f"CPU-seconds (of them the memory sampling {r['sampler_cpu']:.1f}); peak RSS: grader "
                  f"{m['grader']:.0f} MB, shepherds {m['shepherds']:.0f} MB, judges {m['judges']:.0f} MB "
                  f"(all together {m['total']:.0f} MB); mis-graded {len(bad)}", flush=True)
            count = max(1, m["judge_count"])
            held = m["judges_pss"] / count
            r["judge_mb"] = held
            print(f"    judges: {m['judge_count']}; what they hold together (peak PSS: a page they share, torch's, "
                  f"counted once): {m['judges_pss']:.0f} MB, {held:.0f} MB per judge, host included (target <= "
                  f"{JUDGE_MB} MB: {'MET' if held <= JUDGE_MB else 'NOT MET'}); peak RSS {m['judges'] / count:.0f} MB "
                  f"per judge (RSS counts every shared page again in every process that maps it)", flush=True)
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
    # the ceiling, from this run: the class's CPU time with 1 worker spread over both cores. A notebook
    # that launches ranks already keeps more than one core busy with 1 worker; that part cannot double.
    ceiling = 2 * results[1]["seconds"] / results[1]["cpu_seconds"]
    busy = results[2]["cpu_seconds"] / (2 * results[2]["seconds"])
    print(f"this run's ceiling for 2 workers: the class needs {results[1]['cpu_seconds']:.0f} CPU-seconds with 1 "
          f"worker ({results[1]['cpu_seconds'] / results[1]['seconds']:.2f} cores busy on average), so 2 cores can "
          f"grade it at most {ceiling:.2f}x as fast; grading's ratio is {ratio / ceiling:.0%} of that. With 2 "
          f"workers it used {results[2]['cpu_seconds']:.0f} CPU-seconds, both cores {busy:.0%} busy")
    wrong = sum(len(misgraded(r["rows"], expected)) for r in results.values())
    judge_mb = max(r["judge_mb"] for r in results.values())
    ok = ratio >= TARGET and wrong == 0 and judge_mb <= JUDGE_MB
    print(f"throughput ratio 2 workers / 1 worker: {ratio:.2f}x (target >= {TARGET}x); mis-graded {wrong} "
          f"(target 0); judges hold {judge_mb:.0f} MB each (target <= {JUDGE_MB} MB): {'MET' if ok else 'NOT MET'}")
    print("(2 cores shared with everything else on the machine: the ratio is noisy)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

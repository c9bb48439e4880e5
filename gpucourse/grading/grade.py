"""``python -m gpucourse grade SUBMISSIONS…``: grade a class, trusting nothing in a submission.

::

    read every file first ──► parse (bad file → a row saying why) ──► match chapter ──► restore
    checks from the release (+ hidden) ──► run each in its own sandbox, N at a time ──► score
    ──► gradebook rows ──► CSV / JSON / feedback / per-student table ──► exit 0 / 1 / 2

Exit status: 0 every exercise passed; 1 some exercise failed; 2 a usage error or a submission that
could not be graded (unreadable, not a notebook, wrong chapter).
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .engine import names_used, score
from .gradebook import Row, summary_table, write_csv, write_feedback, write_json
from .restore import (
    NotANotebook,
    Release,
    chapter_of,
    load_hidden,
    load_release,
    load_releases,
    parse_notebook,
    restore,
)
from .sandbox import Limits, describe, isolation, run_job

__all__ = ["Options", "Submission", "discover", "grade", "grade_notebook"]

MAX_NOTEBOOK_BYTES = 32 << 20


@dataclass
class Submission:
    student: str
    path: Path
    data: bytes | None = None
    problem: str = ""


@dataclass
class Options:
    cell_timeout: float = 300
    notebook_timeout: float = 900
    limits: Limits = field(default_factory=Limits)
    use_bwrap: bool = True
    hide: list[Path] = field(default_factory=list)


def discover(paths: list[str]) -> list[Submission]:
    """Every ``*.ipynb`` under the given files/folders, read into memory now.

    The student is the first folder under a given folder (``subs/alice/00_….ipynb`` → alice), or
    the file's name without ``.ipynb`` when the submissions are flat.
    """
    subs: list[Submission] = []
    for arg in map(Path, paths):
        files = ([arg] if arg.is_file() else sorted(
            q for q in arg.rglob("*.ipynb") if not any(p.startswith(".") for p in q.relative_to(arg).parts)))
        for f in files:
            rel = f.relative_to(arg) if f != arg else Path(f.name)
            student = rel.parts[0] if len(rel.parts) > 1 else f.stem
            sub = Submission(student, f)
            try:
                if f.stat().st_size > MAX_NOTEBOOK_BYTES:
                    sub.problem = f"unreadable: larger than {MAX_NOTEBOOK_BYTES >> 20} MB"
                else:
                    sub.data = f.read_bytes()
            except OSError as e:
                sub.problem = f"unreadable: {e.strerror or e}"
            subs.append(sub)
    return subs


@dataclass
class Graded:
    sub: Submission
    rows: list[Row]
    status: str                 # graded / unreadable / wrong chapter / no release
    others: list = field(default_factory=list)
    problem: str = ""
    record: dict = field(default_factory=dict)


def _bad(sub: Submission, status: str, why: str, release: Release | None = None,
         hidden: dict | None = None) -> Graded:
    rows = []
    if release is not None:
        for cid, rc in release.checks.items():
            hm = rc.points * len((hidden or {}).get(cid, []))
            rows.append(Row(sub.student, sub.path.name, cid, rc.title, "✗", "✗" if hm else "", 0, rc.points,
                            0, hm, 0.0, why, "", status))
    else:
        rows.append(Row(sub.student, sub.path.name, "-", "(notebook)", "✗", "", 0, 0, 0, 0, 0.0, why, "",
                        status))
    return Graded(sub, rows, status, problem=why)


def choose_release(nb, filename: str, releases: dict[str, Release], expected: str | None
                   ) -> tuple[Release | None, str]:
    """The release to grade against, or (None/release, reason) when the chapter is wrong."""
    content, named = chapter_of(nb, filename)
    want = expected or named
    if content is None and want is None:
        return None, "no release: the notebook names no exercise (NN.k) and its file name no chapter"
    if want and content and content != want:
        rel = releases.get(want)
        source = "expected" if expected else "its file name says"
        return rel, f"wrong chapter: {source} {want}, but its exercises are chapter {content}"
    chapter = content or want
    if chapter not in releases:
        return None, f"no release for chapter {chapter}"
    return releases[chapter], ""


def grade_notebook(sub: Submission, releases: dict[str, Release], *, hidden: dict | None,
                   options: Options, mode: str, expected: str | None = None,
                   work_root: Path | None = None, cwd: Path | None = None,
                   restore_checks: bool = True) -> Graded:
    """Grade one submission (never raises for the submission's sake)."""
    if sub.problem:
        return _bad(sub, "unreadable", sub.problem)
    try:
        nb = parse_notebook(sub.data, sub.path.name)
    except NotANotebook as e:
        return _bad(sub, "unreadable", f"unreadable: {e}")
    if restore_checks:
        release, why = choose_release(nb, sub.path.name, releases, expected)
        if why:
            return _bad(sub, "wrong chapter" if why.startswith("wrong") else "no release", why, release,
                        hidden)
    else:
        release = load_release(sub.path, nb=nb)
    counter = itertools.count()
    run, slots, origin = restore(nb, release, hidden=hidden if restore_checks else None,
                                 nonce=lambda: f"{uuid.uuid4().hex}-{next(counter)}")
    if not slots:
        return _bad(sub, "no checks", "no check cells found (tagged 'check'): nothing to grade")
    work = Path(tempfile.mkdtemp(prefix="sub-", dir=work_root))
    (work / sub.path.name).write_bytes(sub.data)        # the student's own copy, for relative paths
    job = {"notebook": nbformat.writes(run), "names": names_used([s.source for s in slots]),
           "cwd": str(cwd or work), "cell_timeout": options.cell_timeout,
           "notebook_timeout": options.notebook_timeout, "output_limit": options.limits.output_bytes}
    record = run_job(job, work=work, limits=options.limits, mode=mode,
                     wall=options.notebook_timeout + 180, hide=options.hide)
    results, others, problem = score(record, slots, origin)
    rows = []
    for cid in dict.fromkeys(s.id for s in slots):
        vis = next(r for r, s in zip(results, slots) if s.id == cid and s.kind == "visible")
        slot = next(s for s in slots if s.id == cid and s.kind == "visible")
        hid = [r for r, s in zip(results, slots) if s.id == cid and s.kind == "hidden"]
        hidden_ok = all(r.passed for r in hid)
        flag = "missing" if slot.missing else "deleted" if slot.deleted else "edited" if slot.edited else ""
        error = vis.error or next((f"hidden check: {r.error}" for r in hid if not r.passed), "")
        message = vis.message or next((r.message for r in hid if not r.passed), "")
        status = "tampered" if problem.startswith("tampered") else "graded"
        rows.append(Row(sub.student, sub.path.name, cid, vis.title, "✓" if vis.passed else "✗",
                        ("✓" if hidden_ok else "✗") if hid else "", vis.points if vis.passed else 0,
                        vis.points, sum(r.points for r in hid if r.passed), sum(r.points for r in hid),
                        round(vis.seconds + sum(r.seconds for r in hid), 3), error, flag, status, message))
    return Graded(sub, rows, "graded", others, problem, record)


def _print_notebook(g: Graded, out=sys.stdout) -> None:
    print(f"{g.sub.student}: {g.sub.path}", file=out)
    for r in g.rows:
        hidden = f"  hidden {r.hidden}" if r.hidden else ""
        note = {"edited": f"  (check cell {r.exercise} was edited — restored)",
                "deleted": f"  (check cell {r.exercise} was deleted — put back)",
                "missing": f"  (exercise {r.exercise} is missing from the submission)"}.get(r.restored, "")
        detail = f" — {r.error}" if r.error else ""
        print(f"  {r.exercise:<5} {r.visible}{hidden}  {r.title}{detail}{note}", file=out)
    for where, err in g.others:
        print(f"  cell {where}  ✗  (not a check cell) — {err}", file=out)
    if g.problem and not any(g.problem in r.error for r in g.rows):
        print(f"  ✗ {g.problem}", file=out)
    out.flush()


def default_workers() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def grade(paths: list[str], *, release: str = "exercises", hidden_from: str | None = None,
          workers: int | None = None, csv_path: str | None = None, json_path: str | None = None,
          feedback: str | None = None, feedback_format: str = "md", options: Options | None = None,
          chapter: str | None = None, quiet: bool = False) -> int:
    """The ``grade`` command. Returns the exit status."""
    options = options or Options()
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"gpucourse grade: no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    if not Path(release).exists():
        print(f"gpucourse grade: release {release!r} not found (pass --release exercises/)", file=sys.stderr)
        return 2
    releases = load_releases(release)
    if not releases:
        print(f"gpucourse grade: no NN_*.ipynb release notebooks in {release!r}", file=sys.stderr)
        return 2
    expected = chapter or (next(iter(releases)) if Path(release).is_file() else None)
    hidden = None
    if hidden_from is not None:
        if not Path(hidden_from).is_dir():
            print(f"gpucourse grade: --hidden needs the solutions folder, {hidden_from!r} not found",
                  file=sys.stderr)
            return 2
        hidden = load_hidden(hidden_from)
    subs = discover(paths)
    if not subs:
        print("gpucourse grade: no notebooks (*.ipynb) in " + " ".join(paths), file=sys.stderr)
        return 2
    mode = isolation(options.use_bwrap)
    line = describe(mode, options.limits)
    workers = workers or default_workers()
    print(f"grading {len(subs)} notebook(s) with {workers} worker(s); {line}", flush=True)
    options.hide = [*options.hide, *(Path(p).resolve() for p in paths)] + (
        [Path(hidden_from).resolve()] if hidden_from else [])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpucourse-grade-") as root:
        def one(sub):
            try:
                g = grade_notebook(sub, releases, hidden=hidden, options=options, mode=mode,
                                   expected=expected, work_root=Path(root))
            except Exception as e:  # noqa: BLE001 - one odd notebook is a row, never a crash
                g = _bad(sub, "unreadable", f"could not be graded: {type(e).__name__}: {e}")
            if not quiet:
                _print_notebook(g)
            return g
        with ThreadPoolExecutor(max_workers=workers) as pool:
            graded = list(pool.map(one, subs))
    rows = [r for g in graded for r in g.rows]
    print(f"\n{summary_table(rows)}")
    print(f"\n{len(subs)} notebook(s) in {time.monotonic() - started:.1f} s")
    if csv_path:
        write_csv(rows, csv_path)
    if json_path:
        write_json(rows, json_path, isolation=line, notebooks=[
            {"student": g.sub.student, "notebook": str(g.sub.path), "status": g.status, "problem": g.problem,
             "wall_seconds": g.record.get("wall_seconds", 0.0), "phases": g.record.get("phases", {}),
             "processes_killed_after": g.record.get("leftovers_killed", 0)} for g in graded])
    if feedback:
        write_feedback(rows, feedback, fmt=feedback_format)
    if any(g.status != "graded" for g in graded):
        return 2
    ok = all(r.visible == "✓" and r.hidden != "✗" for r in rows)
    return 0 if ok else 1

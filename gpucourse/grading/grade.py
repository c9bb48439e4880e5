"""``python -m gpucourse grade SUBMISSIONS…``: grade a class, trusting nothing in a submission.

::

    read every file first ──► parse (bad file → a row saying why) ──► match chapter ──► restore
    checks from the release (+ a cell per hidden check) ──► the judge draws every check's inputs
    from this run's seed ──► run each notebook in its own sandbox, N at a time: each check cell
    computes the student's values ──► the judge compares them with the course's answers on the
    same inputs ──► gradebook rows ──► CSV / JSON / feedback / per-student table ──► exit 0 / 1 / 2

Where a verdict is decided: in the judge (:mod:`.judge`), a process of the grader's that runs the
course's solutions and never a submission's code. The student's kernel and ranks only compute and
send values as data (:mod:`.wire`); they never see the solutions, the hidden checks or an expected
value (``solutions/`` is hidden from the sandbox).

Exit status: 0 every exercise passed; 1 some exercise failed; 2 a usage error or a submission that
could not be graded (unreadable, not a notebook, wrong chapter).
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .exercises import EXERCISE_HEADING
from .gradebook import Row, earned, summary_table, write_csv, write_feedback, write_json
from .restore import NotANotebook, Release, Slot, chapter_of, load_releases, parse_notebook, restore
from .sandbox import Limits, describe, isolation, run_job

__all__ = ["Judges", "Options", "Submission", "discover", "find_solutions", "grade", "grade_notebook"]

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


_COURSE_NAME = re.compile(r"^\d{2}_")


def student_of(path: Path, given: Path) -> str:
    """Who handed in ``path``, found under the command-line argument ``given``.

    One rule for every way a shell user names a class: a notebook named like a course notebook
    (``00_setup_exercises.ipynb``) belongs to the folder it is in; any other notebook is the student
    (``alice.ipynb``, flat submissions) — unless it sits in a student's folder below ``given``::

        subs/                 subs/alice/00_….ipynb → alice     subs/alice.ipynb → alice
        subs/*  (subs/alice)  subs/alice/00_….ipynb → alice
        subs/alice/00_….ipynb (a file)              → alice      subs/alice.ipynb (a file) → alice

    Example::

        >>> student_of(Path("subs/alice/00_setup_exercises.ipynb"), Path("subs/alice"))
        'alice'
        >>> student_of(Path("subs/bob.ipynb"), Path("subs"))
        'bob'
        >>> student_of(Path("subs/carol/week1/00_setup_exercises.ipynb"), Path("subs"))
        'carol'
    """
    rel = path.relative_to(given) if path != given else Path(path.name)
    if len(rel.parts) > 1:                         # below a folder inside the argument: that folder
        return rel.parts[0]
    if _COURSE_NAME.match(path.name):              # a course notebook: the folder it is in
        folder = given if given.is_dir() else path.parent
        return folder.resolve().name
    return path.stem


def discover(paths: list[str]) -> list[Submission]:
    """Every ``*.ipynb`` under the given files/folders, read into memory now (see :func:`student_of`).

    A student who hands in the same chapter twice gets both graded and a problem naming both files.
    """
    subs: list[Submission] = []
    done: set[Path] = set()
    for arg in map(Path, paths):
        files = ([arg] if arg.is_file() else sorted(
            q for q in arg.rglob("*.ipynb") if not any(p.startswith(".") for p in q.relative_to(arg).parts)))
        for f in files:
            if f.resolve() in done:                 # the same file named twice (subs/ and subs/alice)
                continue
            done.add(f.resolve())
            sub = Submission(student_of(f, arg), f)
            try:
                if f.stat().st_size > MAX_NOTEBOOK_BYTES:
                    sub.problem = f"unreadable: {f.name} is larger than {MAX_NOTEBOOK_BYTES >> 20} MB"
                else:
                    sub.data = f.read_bytes()
            except OSError as e:
                sub.problem = f"unreadable: {f.name}: {e.strerror or e}"
            subs.append(sub)
    seen: dict[tuple[str, str], Path] = {}
    for sub in subs:
        key = (sub.student, sub.path.name[:3] if _COURSE_NAME.match(sub.path.name) else sub.path.name)
        if key in seen:
            sub.problem = sub.problem or (f"duplicate: {sub.student} handed in chapter {key[1][:2]} twice "
                                          f"({seen[key]} and {sub.path}); only the first is graded")
        seen.setdefault(key, sub.path)
    return subs


@dataclass
class Graded:
    sub: Submission
    rows: list[Row]
    status: str                 # graded / unreadable / wrong chapter / no release
    others: list = field(default_factory=list)
    problem: str = ""
    record: dict = field(default_factory=dict)


def _bad(sub: Submission, status: str, why: str, release: Release | None = None) -> Graded:
    """A submission that was not graded: 0 of its chapter's points (when the chapter is known),
    one row per exercise naming the file and why."""
    rows = []
    if release is not None:
        for cid, rc in release.checks.items():
            rows.append(Row(sub.student, sub.path.name, cid, rc.title, "✗", "", 0, rc.points, 0.0,
                            why, "", status))
    else:
        rows.append(Row(sub.student, sub.path.name, "-", sub.path.name, "✗", "", 0, 0, 0.0, why, "", status))
    return Graded(sub, rows, status, problem=why)


def _release_by_name(sub: Submission, releases: dict[str, Release], expected: str | None) -> Release | None:
    """The release a notebook that could not be read was meant for: its file name's chapter, or the
    one chapter being graded."""
    m = _COURSE_NAME.match(sub.path.name)
    return releases.get(sub.path.name[:2]) if m else releases.get(expected or "")


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


class Judges:
    """One judge process per chapter (started on first use), shared by the grading threads.

    Each caches its inputs per slot and seed and the course's answers on them, so a class graded
    with one seed runs each reference once (when the inputs are drawn: a compare only compares).

    One student, one blast radius: a judge that crashes or stalls (over :attr:`compare_timeout`)
    on a submission's values costs that submission the case it was comparing — and its later
    compares, which fail at once instead of stalling the chapter again. A request that finds the
    judge already gone (another submission's doing) is asked again of a fresh judge.
    """

    #: seconds a judge may take over one ``compare`` (its reference is ready by then)
    compare_timeout: float = 120
    #: seconds a judge may take to draw a slot's inputs and run the course's answer on them
    cases_timeout: float = 600

    def __init__(self, solutions: str | os.PathLike | None, seed: int, *, private_network: bool = False):
        self.solutions, self.seed, self.private_network = solutions, seed, private_network
        self._judges: dict[str, object] = {}
        self._cases: dict[str, dict] = {}
        self._ready: dict[object, set] = {}          # judge process → the slots whose reference it holds
        self._crashed: dict[str, str] = {}           # submission → how its values ended a judge
        self._lock = threading.Lock()
        self._chapter_locks: dict[str, threading.Lock] = {}

    def get(self, chapter: str):
        from .harness import JudgeProcess

        with self._lock:
            lock = self._chapter_locks.setdefault(chapter, threading.Lock())
        with lock:
            judge = self._judges.get(chapter)
            if judge is None or judge.proc.poll() is not None:
                folder = self.solutions or find_solutions(chapter)
                if folder is None:
                    raise FileNotFoundError(
                        f"the course's solutions for chapter {chapter} were not found: the grader "
                        "needs them to compute the expected values (pass --solutions solutions/)")
                if judge is not None:                  # ended: let go of its pipes (once no one reads them)
                    with judge.lock:
                        judge.close()
                    self._ready.pop(judge, None)
                judge = JudgeProcess(chapter, folder, local=False, private_network=self.private_network)
                for error in judge.hello.get("errors", []):
                    print(f"warning: the course's solutions did not load cleanly: {error}", file=sys.stderr)
                self._judges[chapter] = judge
            return judge

    def _ask(self, chapter: str, message: dict, timeout: float) -> dict:
        """``message``'s reply from the chapter's judge; one that had already ended (another
        request's doing) is replaced, and asked again, once. A compare goes to a judge that holds
        the slot's reference (drawn there first, with the longer timeout, if it does not)."""
        from .harness import JudgeCrashed, JudgeGone

        for attempt in range(2):
            judge = self.get(chapter)
            try:
                if message["op"] == "compare" and message["slot"] not in self._ready.get(judge, ()):
                    try:
                        self._draw(judge, message["slot"])
                    except JudgeCrashed as e:       # the course's own run: not the values' doing
                        raise RuntimeError(f"the judge failed drawing {message['slot']}: {e}") from None
                return judge.request(message, timeout=timeout)
            except JudgeGone:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _draw(self, judge, slot: str) -> dict:
        reply = judge.request({"op": "cases", "slot": slot, "seed": self.seed}, timeout=self.cases_timeout)
        self._ready.setdefault(judge, set()).add(slot)
        return reply

    def cases(self, chapter: str, slot: str) -> dict:
        if slot not in self._cases:
            from .harness import JudgeGone

            for attempt in range(2):
                try:
                    self._cases[slot] = self._draw(self.get(chapter), slot)
                    break
                except JudgeGone:
                    if attempt:
                        raise
        return self._cases[slot]

    def compare(self, chapter: str, slot: str, values: str, submission: str | None = None) -> dict:
        """The judge's verdict on ``values`` — failed, without a judge, for a ``submission`` whose
        values have crashed or stalled a judge before."""
        from .harness import JudgeCrashed

        if submission is not None and submission in self._crashed:
            how = self._crashed[submission]
            return {"passed": False, "message": f"{slot}: not compared: an earlier check of this notebook "
                                                f"sent values that made the judge {how}"}
        try:
            return self._ask(chapter, {"op": "compare", "slot": slot, "seed": self.seed, "values": values},
                             self.compare_timeout)
        except JudgeCrashed as e:
            if submission is not None:
                self._crashed[submission] = e.how
            print(f"warning: {submission or 'a submission'}, {slot}: {e}", file=sys.stderr)
            return {"passed": False, "message": f"{slot}: your values made the judge {e.how}: not compared"}

    def close(self) -> None:
        for judge in self._judges.values():
            judge.close()


def find_solutions(chapter: str) -> Path | None:
    from .harness import find_solutions as find

    return find(chapter)


def _answer_sources(nb, exercise: str) -> list[str]:
    """The code cells of a submission's exercise section (after its heading, before the next one)."""
    sources, inside = [], False
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            ids = [m["id"] for m in EXERCISE_HEADING.finditer(cell.source)]
            if ids:
                inside = exercise in ids
            continue
        if inside and cell.cell_type == "code" and not cell.source.lstrip().startswith(("# Check", "# Hidden")):
            sources.append(cell.source)
    return sources


def forbidden_uses(sources: list[str], forbid: list[str]) -> list[str]:
    """Which of ``forbid`` (``"gc.zero_memory"``) the sources name: as a name, an attribute, an
    imported name or a string (``getattr(gc, "zero_memory")``). Methods (``gc.Class.method``) are
    not scanned for (their bare name is too common); calling them raises at run time.

    Example::

        >>> forbidden_uses(["f = getattr(gc, 'zero_memory')"], ["gc.zero_memory", "gc.launch"])
        ['gc.zero_memory']
    """
    # a method (gc.Class.method) is left to the runtime gate: its bare name (.scatter) is too common
    wanted = {name.split(".")[-1]: name for name in forbid if name.count(".") == 1}
    found = set()
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.alias):
                names = [node.name.split(".")[-1], node.asname or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            found.update(wanted[n] for n in names if n in wanted)
    return sorted(found)


def grade_notebook(sub: Submission, releases: dict[str, Release], *, judges: Judges, hidden: bool,
                   options: Options, mode: str, expected: str | None = None,
                   work_root: Path | None = None, cwd: Path | None = None) -> Graded:
    """Grade one submission (never raises for the submission's sake)."""
    if sub.problem:
        status = "duplicate" if sub.problem.startswith("duplicate") else "unreadable"
        return _bad(sub, status, sub.problem, _release_by_name(sub, releases, expected))
    try:
        nb = parse_notebook(sub.data, sub.path.name)
    except NotANotebook as e:
        return _bad(sub, "unreadable", f"unreadable: {sub.path.name}: {e}", _release_by_name(sub, releases, expected))
    release, why = choose_release(nb, sub.path.name, releases, expected)
    if why:
        return _bad(sub, "wrong chapter" if why.startswith("wrong") else "no release", why, release)
    try:
        judge = judges.get(release.chapter)
    except (OSError, RuntimeError, TimeoutError) as e:
        return _bad(sub, "not graded", f"not graded: {e}", release)
    slots_of_judge = {s["slot"]: s for s in judge.hello["slots"]}
    hidden_titles = {s["exercise"]: s["title"] for s in slots_of_judge.values()
                     if s["kind"] == "hidden" and s["exercise"] in release.checks} if hidden else {}
    run, slots, origin = restore(nb, release, hidden=hidden_titles)
    if not slots:
        return _bad(sub, "no checks", "no check cells found (tagged 'check'): nothing to grade")
    jobs = {}
    for slot in slots:
        if slot.key in slots_of_judge:
            payload = judges.cases(release.chapter, slot.key)
            jobs[slot.index] = {"slot": slot.key, "payload": json.dumps(payload)}
    work = Path(tempfile.mkdtemp(prefix="sub-", dir=work_root))
    (work / sub.path.name).write_bytes(sub.data)        # the student's own copy, for relative paths
    job = {"notebook": nbformat.writes(run), "slots": jobs, "cwd": str(cwd or work),
           "cell_timeout": options.cell_timeout, "notebook_timeout": options.notebook_timeout,
           "output_limit": options.limits.output_bytes}
    record = run_job(job, work=work, limits=options.limits, mode=mode,
                     wall=options.notebook_timeout + 180, hide=options.hide)
    results = [_judge_slot(slot, record, judges, release.chapter, slots_of_judge, nb,
                           submission=f"{sub.student}: {sub.path}") for slot in slots]
    graded_cells = {s.index for s in slots}
    cells = record["cells"]
    others = [(origin[i] if origin[i] is not None else i, row["error"]) for i, row in enumerate(cells)
              if i not in graded_cells and row.get("error") and i < len(origin)]
    problem = record.get("fatal", "")
    rows = []
    for cid in dict.fromkeys(s.id for s in slots):
        (slot, vis), = [(s, r) for s, r in zip(slots, results) if s.id == cid and s.kind == "visible"]
        hid = [r for s, r in zip(slots, results) if s.id == cid and s.kind == "hidden"]
        hidden_ok = all(r["passed"] for r in hid) if hid else None
        flag = "missing" if slot.missing else "deleted" if slot.deleted else "edited" if slot.edited else ""
        error = vis["error"] or next((r["error"] for r in hid if not r["passed"]), "")
        message = vis["message"] if not vis["passed"] else next((r["message"] for r in hid if not r["passed"]), "")
        rows.append(Row(sub.student, sub.path.name, cid, slot.title, "✓" if vis["passed"] else "✗",
                        "" if hidden_ok is None else "✓" if hidden_ok else "✗",
                        earned(slot.points, vis["passed"], hidden_ok), slot.points,
                        round(vis["seconds"] + sum(r["seconds"] for r in hid), 3), error, flag, "graded",
                        message))
    return Graded(sub, rows, "graded", others, problem, record)


def _judge_slot(slot: Slot, record: dict, judges: Judges, chapter: str, known: dict, nb,
                submission: str | None = None) -> dict:
    """The verdict on one graded cell: the judge's, on the values the cell sent (if it sent any).
    ``submission`` names the notebook to the judges (values that crash a judge fail its later checks)."""
    cells = record["cells"]
    row = cells[slot.index] if 0 <= slot.index < len(cells) else {"status": "not run"}
    out = {"passed": False, "error": "", "message": "", "seconds": row.get("seconds", 0.0)}
    label = f"hidden check of {slot.id}" if slot.kind == "hidden" else slot.id
    if slot.missing:
        out["error"] = f"exercise {slot.id} is missing from the submission"
        return out
    if slot.key not in known:
        out["error"] = f"{label}: the course has no judge for this check (report it to the course)"
        return out
    forbid = known[slot.key].get("forbid", [])
    used = forbidden_uses(_answer_sources(nb, slot.id), forbid) if forbid else []
    if used:
        out["error"] = (f"{slot.id} calls {', '.join(used)}, which the exercise forbids: it asks you to "
                        "write that yourself")
        return out
    values = record.get("values", {}).get(slot.key)
    if values is None:
        if row["status"] == "not run":
            out["error"] = f"{label} did not run: " + (record.get("fatal") or "the notebook stopped before it")
        elif row.get("error"):
            out["error"] = f"{label} could not run: {row['error']}"
            out["message"] = row.get("message", "")
        else:
            out["error"] = f"{label} sent no values (the check cell did not reach gc.check_exercise)"
        return out
    verdict = judges.compare(chapter, slot.key, values, submission)
    out["passed"] = bool(verdict.get("passed"))
    if not out["passed"]:
        message = verdict.get("message") or verdict.get("error") or "failed"
        out["error"] = message.strip().splitlines()[0]
        out["message"] = message
    return out


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


def _answer_folders(solutions) -> list[Path]:
    """Every folder a sandbox must hide because answers are in it: the solutions given, the course's
    own, and the course's git objects (which hold every committed solution)."""
    from .harness import _PACKAGE_DIR

    course = Path(_PACKAGE_DIR).parent
    folders = [course / "solutions", course / ".git"]
    if solutions:
        folders.append(Path(solutions).resolve())
    if os.environ.get("GPUCOURSE_SOLUTIONS"):
        folders.append(Path(os.environ["GPUCOURSE_SOLUTIONS"]).resolve())
    return [f for f in folders if f.exists()]


def default_workers() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def grade(paths: list[str], *, release: str = "exercises", hidden_from: str | None = None,
          workers: int | None = None, csv_path: str | None = None, json_path: str | None = None,
          feedback: str | None = None, feedback_format: str = "md", options: Options | None = None,
          chapter: str | None = None, quiet: bool = False, solutions: str | None = None,
          hidden: bool | None = None, seed: int | None = None, allow_unisolated: bool = False) -> int:
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
    if hidden_from is not None:
        if not Path(hidden_from).is_dir():
            print(f"gpucourse grade: --hidden needs the solutions folder, {hidden_from!r} not found",
                  file=sys.stderr)
            return 2
        solutions = solutions or hidden_from
    hidden = bool(hidden if hidden is not None else hidden_from is not None)
    if solutions is None and os.environ.get("GPUCOURSE_SOLUTIONS"):
        solutions = os.environ["GPUCOURSE_SOLUTIONS"]
    if solutions is not None and not Path(solutions).is_dir():
        print(f"gpucourse grade: solutions folder {solutions!r} not found", file=sys.stderr)
        return 2
    subs = discover(paths)
    if not subs:
        print("gpucourse grade: no notebooks (*.ipynb) in " + " ".join(paths), file=sys.stderr)
        return 2
    mode = isolation(options.use_bwrap)
    if mode != "bwrap" and options.use_bwrap and not allow_unisolated:
        print("gpucourse grade: bubblewrap (bwrap) is not installed or does not work here, and without it "
              "a submission could read the course's solutions. Install it (Debian/Ubuntu: apt-get install "
              "bubblewrap), or pass --no-bwrap to grade trusted notebooks without hiding the answers.",
              file=sys.stderr)
        return 2
    line = describe(mode, options.limits)
    workers = workers or default_workers()
    seed = random.SystemRandom().randrange(1 << 62) if seed is None else int(seed)
    print(f"grading {len(subs)} notebook(s) with {workers} worker(s); {line}", flush=True)
    print(f"check inputs drawn from seed {seed} (the same grades again: --seed {seed})", flush=True)
    judges = Judges(solutions, seed, private_network=mode == "bwrap")     # nothing listens on the host
    options.hide = [*options.hide, *(Path(p).resolve() for p in paths), *_answer_folders(solutions)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpucourse-grade-") as root:
        def one(sub):
            try:
                g = grade_notebook(sub, releases, judges=judges, hidden=hidden, options=options, mode=mode,
                                   expected=expected, work_root=Path(root))
            except Exception as e:  # noqa: BLE001 - one odd notebook is a row, never a crash
                g = _bad(sub, "unreadable", f"could not be graded: {type(e).__name__}: {e}")
            if not quiet:
                _print_notebook(g)
            return g
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                graded = list(pool.map(one, subs))
        finally:
            judges.close()
    rows = [r for g in graded for r in g.rows]
    print(f"\n{summary_table(rows)}")
    print(f"\n{len(subs)} notebook(s) in {time.monotonic() - started:.1f} s")
    if csv_path:
        write_csv(rows, csv_path)
    if json_path:
        write_json(rows, json_path, isolation=line, seed=seed, notebooks=[
            {"student": g.sub.student, "notebook": str(g.sub.path), "status": g.status, "problem": g.problem,
             "wall_seconds": g.record.get("wall_seconds", 0.0), "phases": g.record.get("phases", {}),
             "processes_killed_after": g.record.get("leftovers_killed", 0),
             "other_errors": [f"cell {where}: {error}" for where, error in g.others]} for g in graded])
    if feedback:
        write_feedback(rows, feedback, fmt=feedback_format)
    written = [p for p in (csv_path, json_path, feedback) if p]
    if written:
        print("gradebook written to " + ", ".join(written))
    if any(g.status != "graded" for g in graded):
        return 2
    ok = all(r.points == r.max for r in rows)
    return 0 if ok else 1

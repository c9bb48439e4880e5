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
import errno
import json
import os
import random
import re
import stat
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .exercises import EXERCISE_HEADING
from .graded_build import parse
from .gradebook import (ERROR_LIMIT, NAME_LIMIT, NotAGradebook, Row, Update, cut, earned, printable,
                        stored_student, students_in, summary_table, write_csv, write_feedback, write_json,
                        write_totals)
from .restore import NotANotebook, Release, Slot, chapter_of, load_releases, parse_notebook, restore
from .sandbox import Limits, describe, isolation, run_job
from .torch_ops import OPERATORS

__all__ = ["Judges", "Options", "Submission", "discover", "find_solutions", "grade", "grade_notebook",
           "one_per_chapter"]

MAX_NOTEBOOK_BYTES = 32 << 20
#: what of the judge's ``cases`` reply a kernel receives: its inputs, their seeds, what it may not call
KERNEL_PAYLOAD = ("slot", "cases", "seeds", "forbid")


@dataclass
class Submission:
    student: str
    path: Path
    data: bytes | None = None
    problem: str = ""
    file_id: tuple = ()         # (device, inode) of the file read: the same file named twice is one
    chapter: str | None = None  # the chapter it is taken for (:func:`one_per_chapter`)
    carries: bool = True        # False: another of the student's files carries this chapter's points
    note: str = ""              # how it was matched, said in the student's row


@dataclass
class Options:
    cell_timeout: float = 300
    notebook_timeout: float = 900
    limits: Limits = field(default_factory=Limits)
    use_bwrap: bool = True
    hide: list[Path] = field(default_factory=list)


_COURSE_NAME = re.compile(r"^\d{2}_")

# a submission is opened without following a link (O_NOFOLLOW: the open fails on a symbolic link,
# so one swapped in after the folder was listed is refused too), without blocking on a FIFO
# (O_NONBLOCK), and then checked to be a regular file (fstat)
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
_OPEN_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
_LINK_ERRORS = {errno.ELOOP, errno.EMLINK}        # what O_NOFOLLOW raises on a link (Linux, BSD)
MAX_NESTED_REPORTED = 20                          # refused notebooks listed per student folder
MAX_ENTRIES_WALKED = 10_000                       # entries looked at below one student folder


def student_of(path: Path, given: Path) -> str:
    """Who handed in ``path``, found under the command-line argument ``given``.

    One rule for every way a shell user names a class: a notebook named like a course notebook
    (``00_setup_exercises.ipynb``) belongs to the folder it is in; any other notebook is the student
    (``alice.ipynb``, flat submissions) — unless it sits in a student's folder below ``given``::

        subs/                 subs/alice/00_….ipynb → alice     subs/alice.ipynb → alice
        subs/*  (subs/alice)  subs/alice/00_….ipynb → alice
        subs/alice/00_….ipynb (a file)              → alice      subs/alice.ipynb (a file) → alice

    A notebook deeper than a student's folder (``subs/carol/week1/00_….ipynb``) is carol's: it is
    *refused* in carol's row (:func:`discover`: one student per folder; a folder inside carol's is
    never another student), never graded as ``week1``.

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
        return Path(os.path.abspath(folder)).name
    return path.stem


def _is_link_error(e: OSError) -> bool:
    return e.errno in _LINK_ERRORS


def _read_regular(student: str, path: Path, name: str, dir_fd: int | None) -> Submission:
    """The submission ``path``, read from the regular file ``name`` in the folder open as ``dir_fd``
    (never through a link), or refused with the reason."""
    shown = path.name
    try:
        fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    except OSError as e:
        if _is_link_error(e):
            return Submission(student, path, problem=f"not graded: {shown} is a symbolic link")
        return Submission(student, path, problem=f"unreadable: {shown}: {e.strerror or e}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Submission(student, path, problem=f"not graded: {shown} is not a regular file")
        too_big = f"unreadable: {shown} is larger than {MAX_NOTEBOOK_BYTES >> 20} MB"
        if st.st_size > MAX_NOTEBOOK_BYTES:
            return Submission(student, path, problem=too_big)
        chunks, size = [], 0
        while size <= MAX_NOTEBOOK_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_NOTEBOOK_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_NOTEBOOK_BYTES:                  # it grew while being read
            return Submission(student, path, problem=too_big)
        return Submission(student, path, b"".join(chunks), file_id=(st.st_dev, st.st_ino))
    except OSError as e:
        return Submission(student, path, problem=f"unreadable: {shown}: {e.strerror or e}")
    finally:
        os.close(fd)


def _open_dir(name: str, dir_fd: int | None = None) -> int:
    """A folder opened without following a link: OSError with ELOOP when ``name`` is a link (Linux
    says ENOTDIR for a link opened with O_NOFOLLOW | O_DIRECTORY), ENOTDIR when it is no folder."""
    try:
        return os.open(name, _OPEN_DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            try:
                linked = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
            except OSError:
                linked = False
            if linked:
                raise OSError(errno.ELOOP, f"{name} is a symbolic link") from None
        raise


def _entries(fd: int) -> list[os.DirEntry]:
    """The folder's entries by name, hidden ones (``.ipynb_checkpoints``, ``.git``) left out."""
    with os.scandir(fd) as it:
        return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)


def _is_notebook_name(name: str) -> bool:
    return name.endswith(".ipynb")


def _linked(student: str, path: Path) -> Submission:
    return Submission(student, path, problem=f"not graded: {path.name} is a symbolic link")


def _nested(fd: int, top: str, budget: list[int]) -> list[str]:
    """``top``-relative paths of the notebooks anywhere below the folder open as ``fd`` (links are
    listed, never followed), at most :data:`MAX_NESTED_REPORTED`, looking at a bounded number of
    entries."""
    found, stack = [], [(fd, top)]
    try:
        while stack and len(found) < MAX_NESTED_REPORTED:
            dfd, rel = stack.pop()
            try:
                entries = _entries(dfd)
            except OSError:
                entries = []
            for entry in entries:
                budget[0] -= 1
                if budget[0] < 0 or len(found) >= MAX_NESTED_REPORTED:
                    break
                if _is_notebook_name(entry.name):
                    found.append(f"{rel}/{entry.name}")
                elif entry.is_dir(follow_symlinks=False):
                    try:
                        stack.append((_open_dir(entry.name, dfd), f"{rel}/{entry.name}"))
                    except OSError:
                        pass
            if dfd != fd:
                os.close(dfd)
    finally:
        for dfd, _ in stack:
            if dfd != fd:
                os.close(dfd)
    return sorted(found)


def _student_folder(fd: int, student: str, folder: Path) -> list[Submission]:
    """One student's folder (open as ``fd``): the notebooks at its top, read; a link or a notebook
    in a folder inside it, refused in the student's name."""
    subs, refused, budget = [], [], [MAX_ENTRIES_WALKED]
    for entry in _entries(fd):
        path = folder / entry.name
        if entry.is_symlink():
            if _is_notebook_name(entry.name):
                refused.append(_linked(student, path))
        elif entry.is_dir(follow_symlinks=False):
            try:
                sub_fd = _open_dir(entry.name, fd)
            except OSError as e:
                if _is_link_error(e):                  # became a link after the listing
                    refused.append(_linked(student, path))
                continue
            try:
                inside = _nested(sub_fd, entry.name, budget)
            finally:
                os.close(sub_fd)
            for rel in inside:
                refused.append(Submission(student, folder / rel, problem=(
                    f"not graded: {rel} is in a folder inside {student}'s folder (a student's notebooks "
                    "go at the top of their own folder: one student per folder)")))
        elif _is_notebook_name(entry.name):
            subs.append(_read_regular(student, path, entry.name, fd))
    return subs + refused


def _class_folder(fd: int, folder: Path) -> list[Submission]:
    """A class folder (open as ``fd``): each folder in it is one student's, each other notebook
    in it a student's own (flat: ``alice.ipynb``)."""
    subs = []
    for entry in _entries(fd):
        path = folder / entry.name
        if entry.is_symlink():                          # a student's folder or notebook, or dangling
            student = student_of(path, folder) if _is_notebook_name(entry.name) else entry.name
            subs.append(_linked(student, path))
        elif entry.is_dir(follow_symlinks=False):
            try:
                student_fd = _open_dir(entry.name, fd)
            except OSError as e:
                if _is_link_error(e):
                    subs.append(_linked(entry.name, path))
                else:
                    subs.append(Submission(entry.name, path, problem=f"unreadable: {entry.name}: "
                                                                     f"{e.strerror or e}"))
                continue
            try:
                subs += _student_folder(student_fd, entry.name, path)
            finally:
                os.close(student_fd)
        elif _is_notebook_name(entry.name):
            subs.append(_read_regular(student_of(path, folder), path, entry.name, fd))
    return subs


def _holds_a_course_notebook(fd: int) -> bool:
    return any(_COURSE_NAME.match(e.name) and _is_notebook_name(e.name)
               and not e.is_dir(follow_symlinks=False) for e in _entries(fd))


def _file_argument(arg: Path) -> list[Submission]:
    """A notebook named on the command line: ``subs/alice/00_….ipynb`` is alice's (her folder may
    not be a link either), ``subs/alice.ipynb`` is alice's."""
    student = student_of(arg, arg)
    if _COURSE_NAME.match(arg.name):
        parent = Path(os.path.abspath(arg)).parent
        try:
            fd = _open_dir(str(parent))
        except OSError as e:
            if _is_link_error(e):
                return [Submission(student, arg, problem=f"not graded: {parent.name} is a symbolic link")]
            return [Submission(student, arg, problem=f"unreadable: {arg.name}: {e.strerror or e}")]
        try:
            return [_read_regular(student, arg, arg.name, fd)]
        finally:
            os.close(fd)
    return [_read_regular(student, arg, str(arg), None)]


def _folder_argument(arg: Path, fd: int, among_siblings: bool) -> list[Submission]:
    """A folder named on the command line: one student's (``subs/alice``: one of several folders of
    one class named together, as ``subs/*`` names them, or a folder with a course notebook at its
    top), else a class folder (``subs``)."""
    if among_siblings or _holds_a_course_notebook(fd):
        return _student_folder(fd, Path(os.path.abspath(arg)).name or "student", arg)
    return _class_folder(fd, arg)


def discover(paths: list[str]) -> list[Submission]:
    """Every ``*.ipynb`` under the given files/folders, read into memory now (see :func:`student_of`).

    A class's folder is the students' to fill, and nothing in it is trusted:

    * one student per folder: a folder named on the command line is one student's when it is one of
      several named from the same folder (``grade subs/*``) or holds a course notebook at its top
      (``grade subs/alice``), otherwise the class's (``grade subs``), whose folders are one student
      each. Only the notebooks at the top of a student's folder are graded; one in a folder inside
      it (``subs/aaron/zoe/00_….ipynb``) is refused in that student's row, never graded as ``zoe``;
    * no symbolic link is followed below what the command line names (nor the folder or file it
      names): a linked notebook or student folder is refused ("not graded: … is a symbolic link").
      Files are opened with ``O_NOFOLLOW`` relative to their folder's open descriptor, so a link
      swapped in after the listing is refused too, and must be regular files (not a FIFO or device);
    * the same file named twice for the same student (``grade subs subs/alice``) is read once; a
      file that two students both hand in (a hard link) is each student's own row.

    Which of a student's files is graded for a chapter is decided later, with the release's file
    names at hand (:func:`one_per_chapter`).
    """
    subs: list[Submission] = []
    absolute = [Path(os.path.abspath(p)) for p in paths]
    named: dict[Path, set] = {}                     # folder → what the command line names in it
    for a in absolute:
        named.setdefault(a.parent, set()).add(a.name)
    for arg, full in zip(map(Path, paths), absolute):
        try:
            fd = _open_dir(str(arg))
        except OSError as e:
            if _is_link_error(e):
                subs.append(_linked(student_of(arg, arg) if _is_notebook_name(arg.name) else full.name, arg))
            elif e.errno == errno.ENOTDIR:
                subs += _file_argument(arg)
            else:
                subs.append(Submission(full.name, arg, problem=f"unreadable: {arg.name}: {e.strerror or e}"))
            continue
        try:
            subs += _folder_argument(arg, fd, len(named[full.parent]) > 1)
        finally:
            os.close(fd)
    unique, done = [], set()
    for sub in subs:
        key = (sub.student, sub.file_id or os.path.abspath(sub.path))
        if key in done:                             # the same file named twice (subs/ and subs/alice)
            continue
        done.add(key)
        unique.append(sub)
    return unique


def _chapter_of_file(sub: Submission) -> str | None:
    """The chapter a submitted file is taken for: a course notebook's name says it (``02_….ipynb``,
    ``02_…-Copy1.ipynb``); any other file's exercise ids do (None when it cannot be read)."""
    if _COURSE_NAME.match(sub.path.name):
        return sub.path.name[:2]
    if sub.data is None or sub.problem:
        return None
    try:
        return chapter_of(parse_notebook(sub.data, sub.path.name), sub.path.name)[0]
    except NotANotebook:
        return None


def _refused(sub: Submission) -> bool:
    return sub.problem.startswith("not graded")


def one_per_chapter(subs: list[Submission], releases: dict[str, Release], only: str | None = None
                    ) -> tuple[list[Submission], list[Submission]]:
    """Which of each student's files is graded for a chapter: ``(to grade, left out)``.

    One rule, so that the maximum never counts a chapter twice:

    * a file is taken for the chapter its name says (``02_data_parallel_exercises-Copy1.ipynb`` is
      chapter 02); a file named like no course notebook (``homework.ipynb``) for the chapter of its
      exercise ids, and its row says so;
    * of a student's files of one chapter, the one with the release's exact file name is graded; the
      others are *ignored*: listed in the student's row ("ignored …-Copy1.ipynb"), worth nothing
      and adding nothing to the maximum;
    * only when none has the exact name and several could be the chapter's is the chapter flagged
      *duplicate*: 0 of its points, once, with the files' names (rename the one to grade);
    * with ``only`` (``grade --chapter NN``, or a release of one notebook), files of other chapters
      are left out (returned second); a file whose chapter cannot be told is graded for ``only``.

    A file refused at discovery (a link, a notebook in a folder inside the student's) keeps its
    reason; it carries the chapter's points only when it is the chapter's one file.
    """
    kept, left_out = [], []
    for sub in subs:
        sub.chapter = _chapter_of_file(sub)
        if only is not None:
            if sub.chapter is not None and sub.chapter != only:
                left_out.append(sub)
                continue
            sub.chapter = only
        kept.append(sub)
    groups: dict[tuple[str, str], list[Submission]] = {}
    for sub in kept:
        if sub.chapter is not None:
            groups.setdefault((sub.student, sub.chapter), []).append(sub)
    for (student, chapter), group in groups.items():
        name = releases[chapter].path.name if chapter in releases else None
        if len(group) > 1:
            group.sort(key=_refused)                # stable: a refused file never outranks a readable one
            exact = [s for s in group if s.path.name == name]
            if exact:
                chosen = exact[0]
                for s in group:
                    if s is not chosen:
                        s.carries = False
                        if not _refused(s):
                            s.problem = (f"ignored: {s.path.name} is another copy of chapter {chapter}; "
                                         f"{name} (the release's file name) is the one graded")
            else:
                files = ", ".join(s.path.name for s in group)
                rename = f": rename the one to grade to {name}" if name else ""
                why = (f"duplicate: {student} handed in chapter {chapter} {len(group)} times ({files}) "
                       f"and none is named like the release's notebook{rename}")
                for i, s in enumerate(group):
                    s.carries = i == 0
                    if not _refused(s):
                        s.problem = why
        for s in group:
            if s.carries and not s.problem and not _COURSE_NAME.match(s.path.name) and s.path.stem != student:
                s.note = f"{s.path.name}: chapter {chapter} by its exercise ids"
    return kept, left_out


@dataclass
class Graded:
    sub: Submission
    rows: list[Row]
    status: str                 # graded / unreadable / wrong chapter / no release / ignored / …
    others: list = field(default_factory=list)
    problem: str = ""
    record: dict = field(default_factory=dict)
    span: tuple = (0.0, 0.0)    # seconds after grading began: when a worker took it, when it was done


def _bad(sub: Submission, status: str, why: str, release: Release | None = None) -> Graded:
    """A submission that was not graded: 0 of its chapter's points (when the chapter is known),
    one row per exercise naming the file and why."""
    rows = []
    if release is not None:
        for cid, rc in release.checks.items():
            rows.append(Row(sub.student, sub.path.name, cid, rc.title, "✗", "", 0, rc.points, 0.0,
                            why, "", status))
    else:
        visible = "" if status == "ignored" else "✗"
        rows.append(Row(sub.student, sub.path.name, "-", sub.path.name, visible, "", 0, 0, 0.0, why, "", status))
    return Graded(sub, rows, status, problem=why)


def _release_by_name(sub: Submission, releases: dict[str, Release], expected: str | None) -> Release | None:
    """The release a notebook that could not be read was meant for: its file name's chapter, or the
    one chapter being graded."""
    m = _COURSE_NAME.match(sub.path.name)
    return releases.get(sub.path.name[:2]) if m else releases.get(expected or sub.chapter or "")


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
    """One judge process per chapter (started on first use), shared by the grading threads; all forked
    from one :class:`.harness.JudgeHost`, which imported torch and the course once for them.

    Each caches its inputs per slot and seed and the course's answers on them, so a class graded
    with one seed runs each reference once (when the inputs are drawn: a compare only compares).

    One student, one blast radius: a judge that crashes or stalls (over :attr:`compare_timeout`)
    on a submission's values costs that submission the case it was comparing — and its later
    compares, which fail at once instead of stalling the chapter again. A request that finds the
    judge already gone (another submission's doing) is asked again of a fresh judge.
    """

    #: the host imports what forking ranks needs once for every judge (:func:`.judge._preload`):
    #: these judges run the course's answers, on ranks in most chapters
    warm_host: bool = True
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
        self._builds: dict[tuple, Path] = {}
        self._build_locks: dict[tuple, threading.Lock] = {}
        self._build_root: str | None = None
        self._exercises_of: dict[str, dict] = {}
        self._starting: list[threading.Thread] = []
        self._closing = threading.Event()
        self._host = None

    def start(self, chapters, *, hidden: bool = False) -> None:
        """Start the judges of ``chapters`` now, side by side, in background threads, and let each
        draw its slots' inputs and references (the hidden ones with ``hidden``).

        Each judge imports torch and the course's solutions, then runs the course's answers on the
        drawn inputs — seconds — which the first notebook of its chapter would otherwise wait for,
        one chapter after another, while the other core had nothing to do. A judge that fails to
        start or to draw is left for that first request to meet and report; :meth:`close` waits
        for the starts. The threads stay until then: a sandboxed judge dies with the *thread* that
        started it (``bwrap --die-with-parent`` is the thread's parent-death signal).
        """
        def start_one(chapter):
            try:
                judge = self.get(chapter)
                for slot in judge.hello["slots"]:
                    if hidden or slot["kind"] != "hidden":
                        self.cases(chapter, slot["slot"])
            except Exception:  # noqa: BLE001 - the chapter's first request meets it again and reports it
                pass
            self._closing.wait()

        for chapter in dict.fromkeys(chapters):
            thread = threading.Thread(target=start_one, args=(chapter,), name=f"judge {chapter}", daemon=True)
            thread.start()
            self._starting.append(thread)

    def get(self, chapter: str):
        from .harness import JudgeProcess

        with self._lock:
            lock = self._chapter_locks.setdefault(chapter, threading.Lock())
        with lock:
            judge = self._judges.get(chapter)
            if judge is None or judge.proc.poll() is not None:
                where = self._judge_source(chapter)         # raises FileNotFoundError, saying what is missing
                if judge is not None:                  # ended: let go of its pipes (once no one reads them)
                    with judge.lock:
                        judge.close()
                    self._ready.pop(judge, None)
                judge = JudgeProcess(chapter, where["folder"], local=False, public=where.get("public"),
                                     host=self._judge_host())
                for error in judge.hello.get("errors", []):
                    print(f"warning: {where['warning']}{error}", file=sys.stderr)
                self._judges[chapter] = judge
            return judge

    def _judge_host(self):
        """The host the judges are forked from (started again if it has ended: its judges ended with it)."""
        from .harness import JudgeHost

        with self._lock:
            if self._host is None or not self._host.alive():
                if self._host is not None:
                    self._host.close()
                self._host = JudgeHost(private_network=self.private_network, warm=self.warm_host)
            return self._host

    def _judge_source(self, chapter: str) -> dict:
        """What a judge of ``chapter`` loads: ``{"folder", "warning"}`` (+ ``"public"``, the public
        cases file, for a public judge — see :class:`.selfcheck.PublicJudges`)."""
        folder = self.solutions or find_solutions(chapter)
        if folder is None:
            raise FileNotFoundError(
                f"the course's solutions for chapter {chapter} were not found: the grader "
                "needs them to compute the expected values (pass --solutions solutions/)")
        return {"folder": folder, "warning": "the course's solutions did not load cleanly: "}

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

    def compare(self, chapter: str, slot: str, values: str, submission: str | None = None,
                seconds: float | None = None) -> dict:
        """The judge's verdict on ``values`` — failed, without a judge, for a ``submission`` whose
        values have crashed or stalled a judge before. ``seconds``: the cell's time, as this process
        measured it (a timed hidden check compares it with the course's)."""
        from .harness import JudgeCrashed

        if submission is not None and submission in self._crashed:
            how = self._crashed[submission]
            return {"passed": False, "message": f"{slot}: not compared: an earlier check of this notebook "
                                                f"sent values that made the judge {how}"}
        try:
            return self._ask(chapter, {"op": "compare", "slot": slot, "seed": self.seed, "values": values,
                                       "seconds": seconds}, self.compare_timeout)
        except JudgeCrashed as e:
            if submission is not None:
                self._crashed[submission] = e.how
            print(f"warning: {submission or 'a submission'}, {slot}: {e}", file=sys.stderr)
            return {"passed": False, "message": f"{slot}: your values made the judge {e.how}: not compared"}

    def plan(self, chapter: str, submitted: dict[str, list[str]]) -> dict:
        """The judge's plan of runs for one submission (see :mod:`.graded_build`)."""
        from .harness import JudgeCrashed

        try:
            plan = self._ask(chapter, {"op": "plan", "submitted": submitted}, 300)
        except (JudgeCrashed, RuntimeError):      # the submission's code could not be read: the course's plan
            plan = self._ask(chapter, {"op": "plan", "submitted": None}, 300)
        self._exercises_of.setdefault(chapter, {}).update(plan.get("exercises_of", {}))
        return plan

    def build(self, chapter: str, strip: tuple[str, ...]) -> Path:
        """The graded build without ``strip`` (made once per grading run, by the chapter's judge)."""
        key = (chapter, tuple(sorted(strip)))
        with self._lock:
            lock = self._build_locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._builds:
                if self._build_root is None:
                    self._build_root = tempfile.mkdtemp(prefix="gpucourse-builds-")
                root = Path(self._build_root) / f"{chapter}-{len(self._builds)}"
                root.mkdir()
                reply = self._ask(chapter, {"op": "build", "strip": list(key[1]), "root": str(root),
                                            "exercises_of": self._exercises_of.get(chapter, {})}, 300)
                self._builds[key] = Path(reply["path"])
            return self._builds[key]

    def close(self) -> None:
        self._closing.set()
        for thread in self._starting:             # a judge still starting would outlive the close
            thread.join()
        for judge in self._judges.values():
            judge.close()
        if self._host is not None:
            self._host.close()
        if self._build_root is not None:
            import shutil

            shutil.rmtree(self._build_root, ignore_errors=True)


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
            tree = parse(src)
        except (SyntaxError, ValueError):               # it cannot run either (null bytes: ValueError)
            continue
        except (RecursionError, MemoryError):
            # nested too deep for the grader's parser (60,000 terms of one sum): every word of the
            # source counts, comments and strings too — a cell the scan cannot read hides nothing
            found.update(wanted[w] for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", src) if w in wanted)
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
        status = next((s for s in ("duplicate", "not graded", "ignored") if sub.problem.startswith(s)),
                      "unreadable")
        # a file that does not carry its chapter (a copy) is one "-" row worth 0 of 0
        release = _release_by_name(sub, releases, expected) if sub.carries else None
        return _bad(sub, status, sub.problem, release)
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
            # the kernel gets its cases and nothing else: not the run's seed, not the check's title
            jobs[slot.index] = {"slot": slot.key, "payload": json.dumps(
                {k: payload[k] for k in KERNEL_PAYLOAD if k in payload})}
    def one_run(mine: dict, package: Path | None = None, upto: int | None = None) -> dict:
        notebook = run if upto is None else nbformat.v4.new_notebook(cells=run.cells[:upto + 1],
                                                                     metadata=run.metadata)
        work = Path(tempfile.mkdtemp(prefix="sub-", dir=work_root))
        job = {"notebook": nbformat.writes(notebook), "slots": mine, "cwd": str(cwd or work),
               "cell_timeout": options.cell_timeout, "notebook_timeout": options.notebook_timeout,
               "output_limit": options.limits.output_bytes}
        # the student's own copy, for relative paths (written by the shepherd, inside the sandbox's tmpfs)
        return run_job(job, work=work, limits=options.limits, mode=mode, wall=options.notebook_timeout + 180,
                       hide=options.hide, files={sub.path.name: sub.data}, package=package)

    def judged(slot: Slot, rec: dict, strip: tuple[str, ...] = ()) -> dict:
        out = _judge_slot(slot, rec, judges, release.chapter, slots_of_judge, nb,
                          submission=f"{sub.student}: {sub.path}")
        return _note_disabled(out, strip, slots_of_judge.get(slot.id, {}).get("forbid", []))

    # 0) with bwrap, where every exercise is checked in a run without some helpers (the judge's plan has
    #    no plain run) and one of those runs' builds lacks nothing a cell outside the checks names, the
    #    whole notebook runs once with that build instead of as its student ran it: it counts unless a
    #    stripped helper was reached (ForbiddenCall; then the notebook is graded as in 1) and 2)), and
    #    only the plan's other groups are checked again (2); where the plan is one run, that is all
    record, tried, uncounted = None, None, 0
    first = _first_build(judges, release, nb, slots) if mode == "bwrap" else None
    if first is not None:
        tried = one_run(jobs, judges.build(release.chapter, first[0]))
        if not _reached_a_stripped_helper(tried):
            record = tried
    if record is not None:
        results = {slot.key: judged(slot, record, first[0]) for slot in slots}
        if any(_names_forbidden_call(f"{r['error']} {r['message']}") for r in results.values()):
            record = None                   # a check's own run (a rank) met a stripped helper
    if record is not None:
        extra = _recheck_without_helpers(judges, release, nb, slots, results, jobs, one_run, judged,
                                         plan=first[1], done=first[0])
    else:
        # 1) the notebook as its student ran it: every check (a forbidden helper is behind the kernel's gate)
        record = one_run(jobs)
        results = {slot.key: judged(slot, record) for slot in slots}
        # 2) with bwrap, an exercise that forbids a helper and passed is checked again in a run whose
        #    package does not contain the helper at all, the notebook cut after its last check; that
        #    verdict counts
        extra = _recheck_without_helpers(judges, release, nb, slots, results, jobs, one_run, judged) \
            if mode == "bwrap" else []
        if tried is not None:               # its time counts (what it met does not: it does not count)
            record["wall_seconds"] = round(record.get("wall_seconds", 0.0) + tried.get("wall_seconds", 0.0), 3)
            uncounted = 1
    for rec in extra:
        record["wall_seconds"] = round(record.get("wall_seconds", 0.0) + rec.get("wall_seconds", 0.0), 3)
        for key in ("fatal", "limits_hit"):
            if rec.get(key):
                record.setdefault("limits_hit", []).extend([rec[key]] if key == "fatal" else rec[key])
    record["runs"] = 1 + len(extra) + uncounted
    results = [results[slot.key] for slot in slots]
    graded_cells = {s.index for s in slots}
    cells = record["cells"]
    others = [(origin[i] if origin[i] is not None else i, row["error"]) for i, row in enumerate(cells)
              if i not in graded_cells and row.get("error") and i < len(origin)]
    problem = "; ".join(dict.fromkeys(filter(None, [record.get("fatal", ""), *record.get("limits_hit", [])])))
    rows = []
    for cid in dict.fromkeys(s.id for s in slots):
        (slot, vis), = [(s, r) for s, r in zip(slots, results) if s.id == cid and s.kind == "visible"]
        hid = [r for s, r in zip(slots, results) if s.id == cid and s.kind == "hidden"]
        hidden_ok = all(r["passed"] for r in hid) if hid else None
        flag = "missing" if slot.missing else "deleted" if slot.deleted else "edited" if slot.edited else ""
        error = vis["error"] or next((r["error"] for r in hid if not r["passed"]), "")
        # the exercise is left unsolved (the judge's verdict, not its wording): its inputs do not matter
        unsolved = vis.get("unsolved", False) if not vis["passed"] else \
            next((r.get("unsolved", False) for r in hid if not r["passed"]), False)
        for hit in record.get("limits_hit", []):            # a limit the notebook hit is named in its rows
            if error and hit not in error:
                error = f"{error} ({hit})"
        message = vis["message"] if not vis["passed"] else next((r["message"] for r in hid if not r["passed"]), "")
        rows.append(Row(sub.student, sub.path.name, cid, slot.title, "✓" if vis["passed"] else "✗",
                        "" if hidden_ok is None else "✓" if hidden_ok else "✗",
                        earned(slot.points, vis["passed"], hidden_ok), slot.points,
                        round(vis["seconds"] + sum(r["seconds"] for r in hid), 3), error, flag, "graded",
                        message, unsolved=unsolved))
    return Graded(sub, rows, "graded", others, problem, record)


def _first_build(judges: "Judges", release: Release, nb, slots: list[Slot]) -> tuple[tuple[str, ...], dict] | None:
    """Step 0 of :func:`grade_notebook`: ``(helpers to strip, the judge's plan)`` when the whole
    notebook can run once with one of the plan's graded builds instead of as its student ran it —
    the plan for this submission has no run that strips nothing and holds every exercise of the
    notebook; no exercise needs a helper that build strips (the plan's ``needs``: the helpers each
    check and answer use, through other course code too); and no code cell but the checks names one
    (a cell that reaches one otherwise is found when it runs: ForbiddenCall). ``None``: grade as before,
    an ordinary run and then the stripped ones. Chapters 00, 01, 08 and 10 are one such run."""
    submitted = {cid: _answer_sources(nb, cid) for cid in release.checks}
    plan = judges.plan(release.chapter, submitted)
    runs = plan.get("runs", [])
    if not runs or "needs" not in plan or any(not strip for strip, _ in runs) or \
            not {s.id for s in slots} <= {e for _, members in runs for e in members}:
        return None
    needed = {n for names in plan["needs"].values() for n in names}
    sources = [c.source for c in nb.cells if c.cell_type == "code"
               and not c.source.lstrip().startswith(("# Check", "# Hidden"))]
    strip = next((tuple(strip) for strip, _ in runs if not set(strip) & needed
                  and not forbidden_uses(sources, list(strip))), None)
    return None if strip is None else (strip, plan)


def _reached_a_stripped_helper(record: dict) -> bool:
    """Whether a run met ``ForbiddenCall`` anywhere: in a cell, or as the run's fatal error."""
    texts = [record.get("fatal") or "", *(f"{row.get('error', '')} {row.get('message', '')}"
                                         for row in record.get("cells", []))]
    return any(_names_forbidden_call(t) for t in texts)


def _names_forbidden_call(text: str) -> bool:
    return "ForbiddenCall" in text or "off limits in exercise" in text


def _recheck_without_helpers(judges: "Judges", release: Release, nb, slots: list[Slot], results: dict,
                             jobs: dict, one_run, judged, *, plan: dict | None = None,
                             done: tuple[str, ...] = ()) -> list[dict]:
    """Step 2 of :func:`grade_notebook`: each group of passed exercises that forbid a helper, run
    again with a graded build that lacks the helpers the group forbids (see :mod:`.graded_build`).
    A failed check needs no second run: a package with less in it cannot turn it into a pass that
    counts. ``plan``: the judge's plan, if asked already; ``done``: the helpers of a group whose
    verdicts came from a run without them already (step 0). Returns the extra runs' records;
    ``results`` is updated in place."""
    passed = {cid for cid in release.checks
              if all(results[s.key]["passed"] for s in slots if s.id == cid)}
    if not passed:
        return []
    if plan is None:
        submitted = {cid: _answer_sources(nb, cid) for cid in release.checks}
        plan = judges.plan(release.chapter, submitted)
    forbidding = {e for names in plan.get("exercises_of", {}).values() for e in names}
    records = []
    for strip, members in plan["runs"]:
        todo = [e for e in members if e in passed and e in forbidding]
        if not strip or not todo or tuple(strip) == tuple(done):
            continue
        mine = {i: j for i, j in jobs.items() if j["slot"].split("/")[0] in todo}
        if not mine:
            continue
        rec = one_run(mine, judges.build(release.chapter, tuple(strip)), max(mine))
        for slot in slots:
            if slot.id in todo and slot.index in mine:
                results[slot.key] = judged(slot, rec, tuple(strip))
        records.append(rec)
    return records


def _note_disabled(result: dict, strip, forbid) -> dict:
    """A failed check that ran with PyTorch operators it forbids made no-ops (:mod:`.torch_ops`) says so:
    an answer that called one sees its values unchanged, and would not know why."""
    disabled = [n for n in strip if n in forbid and n in OPERATORS]
    if result["passed"] or not disabled:
        return result
    note = (f"this check ran with a PyTorch in which {' and '.join(disabled)} "
            f"{'does' if len(disabled) == 1 else 'do'} nothing, as the exercise forbids "
            f"{'it' if len(disabled) == 1 else 'them'}: an answer that calls "
            f"{'it' if len(disabled) == 1 else 'one'}, under any name, leaves its arguments unchanged")
    return dict(result, error=f"{result['error']} ({note})" if result["error"] else note,
                message=f"{result['message']}\n\nNote: {note}." if result["message"] else note)


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
    # a hidden check's cell is the grader's own (it runs only the cases), timed by the engine outside
    # the kernel: a timed hidden check compares that time with the course's
    seconds = row.get("seconds") if slot.kind == "hidden" else None
    verdict = judges.compare(chapter, slot.key, values, submission,
                             seconds=seconds if isinstance(seconds, (int, float)) else None)
    out["passed"] = bool(verdict.get("passed"))
    out["unsolved"] = not out["passed"] and verdict.get("not_implemented") is True
    if not out["passed"]:
        message = verdict.get("message") or verdict.get("error") or "failed"
        out["error"] = message.strip().splitlines()[0]
        out["message"] = message
    return out


MAX_OTHER_ERRORS = 20          # errors of cells that are not checks, listed per notebook


def _other_errors(g: Graded) -> list[str]:
    """The errors of the cells that are not checks, each cut, at most :data:`MAX_OTHER_ERRORS`."""
    out = [f"cell {where}: {cut(error, ERROR_LIMIT)}" for where, error in g.others[:MAX_OTHER_ERRORS]]
    if len(g.others) > MAX_OTHER_ERRORS:
        out.append(f"… and {len(g.others) - MAX_OTHER_ERRORS} more cells with errors")
    return out


def _print_notebook(g: Graded, out=None) -> None:
    """What was found in one notebook, for the terminal: every text a student wrote (names, errors)
    shown escaped on one line (:func:`.gradebook.printable`) and cut."""
    out = out or sys.stdout                     # looked up now: a redirected stdout is honoured
    print(f"{printable(g.sub.student, NAME_LIMIT)}: {printable(g.sub.path, 2 * NAME_LIMIT)}", file=out)
    for r in g.rows:
        hidden = f"  hidden {r.hidden}" if r.hidden else ""
        note = {"edited": f"  (check cell {r.exercise} was edited — restored)",
                "deleted": f"  (check cell {r.exercise} was deleted — put back)",
                "missing": f"  (exercise {r.exercise} is missing from the submission)"}.get(r.restored, "")
        detail = f" — {printable(r.error, ERROR_LIMIT)}" if r.error else ""
        title = printable(r.title, NAME_LIMIT)
        print(f"  {r.exercise:<5} {r.visible}{hidden}  {title}{detail}{note}", file=out)
    for where, err in g.others[:MAX_OTHER_ERRORS]:
        print(f"  cell {where}  ✗  (not a check cell) — {printable(err, ERROR_LIMIT)}", file=out)
    if len(g.others) > MAX_OTHER_ERRORS:
        print(f"  … and {len(g.others) - MAX_OTHER_ERRORS} more cells with errors", file=out)
    if g.problem and not any(cut(g.problem, ERROR_LIMIT) in r.error for r in g.rows):
        print(f"  ✗ {printable(g.problem, ERROR_LIMIT)}", file=out)
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


def course_release() -> Path | None:
    """The release of the course this package belongs to, found as the judge finds ``solutions/``:
    ``exercises/`` in the course folder next to the package (``gpucourse/../exercises``), else
    ``exercises/`` in the current folder (a package installed away from its course)."""
    import gpucourse

    for folder in (Path(gpucourse.__file__).resolve().parents[1] / "exercises", Path.cwd() / "exercises"):
        if folder.is_dir() and any(folder.glob("[0-9][0-9]_*.ipynb")):
            return folder
    return None


def _names(names, limit: int = 10) -> str:
    shown = [printable(n, NAME_LIMIT) for n in names[:limit]]
    return ", ".join(shown) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _overwrite_problem(targets: list[tuple[str, str]], students: list[str], update: bool) -> str:
    """Why this run may not write its gradebook files (``targets``: (path, kind)), or "": a file that
    is no gradebook of this grader is never written over; one that holds students not graded in
    this run is merged into with ``update``, never silently replaced."""
    for path, kind in targets:
        try:
            held = students_in(path, kind)
        except NotAGradebook as e:
            return f"{e}; it was left as it is: write the gradebook to another file"
        mine = {stored_student(s, kind) for s in students}
        others = [s for s in held if s not in mine]
        if others and not update:
            return (f"{path} holds the grades of {len(others)} student(s) not graded in this run "
                    f"({_names(others)}); writing it would lose them. Pass --update to merge this run "
                    "into it, student by student (theirs are kept), or write to another file")
    return ""


def _say_update(path: str, done: Update | None) -> None:
    if done is not None:
        parts = [f"{len(done.regraded)} student(s) regraded"
                 + (f" ({_names(done.regraded)})" if done.regraded else "")]
        if done.added:
            parts.append(f"{len(done.added)} added ({_names(done.added)})")
        parts.append(f"{done.kept} kept as they were")
        print(f"updated {printable(path)}: " + "; ".join(parts))


def _course_commit(root: Path) -> str | None:
    """The git commit the course folder ``root`` is at, or None (no git, not a checkout of its own)."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != root.resolve():
        return None
    return lines[1]


def provenance(release: str | Path) -> dict:
    """What a gradebook records of the run that wrote it, besides the seed and the isolation: the
    date (ISO 8601, UTC), the course (its version, its git commit when the course folder is a git
    checkout, the release the checks came from) and the grader (its version, Python's)."""
    import platform
    from datetime import datetime, timezone
    from importlib import metadata

    import gpucourse

    root = Path(gpucourse.__file__).resolve().parents[1]
    course = {"version": gpucourse.__version__}
    commit = _course_commit(root)
    if commit:
        course["commit"] = commit
    course["release"] = str(Path(release).resolve())
    try:
        grader = metadata.version("gpucourse")
    except metadata.PackageNotFoundError:
        grader = gpucourse.__version__
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "course": course,
            "grader": {"version": grader, "python": platform.python_version()}}


def default_workers() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def grade(paths: list[str], *, release: str | None = None, hidden_from: str | None = None,
          workers: int | None = None, csv_path: str | None = None, json_path: str | None = None,
          feedback: str | None = None, feedback_format: str = "md", options: Options | None = None,
          chapter: str | None = None, quiet: bool = False, solutions: str | None = None,
          hidden: bool | None = None, seed: int | None = None, allow_unisolated: bool = False,
          update: bool = False, totals_path: str | None = None) -> int:
    """The ``grade`` command. Returns the exit status.

    ``release``: the folder (or one notebook) the checks come from; by default the course's own
    (:func:`course_release`), wherever the command is run from. A CSV or JSON gradebook already at
    ``csv_path``/``json_path``/``totals_path`` that holds students not in this run is not replaced
    (exit 2) unless ``update``, which merges this run into it student by student.
    """
    options = options or Options()
    missing = [p for p in paths if not os.path.lexists(p)]      # a dangling link is a student's row
    if missing:
        print(f"gpucourse grade: no such file or folder: {', '.join(map(printable, missing))}",
              file=sys.stderr)
        return 2
    if release is None:
        found = course_release()
        if found is None:
            print("gpucourse grade: the course's release (exercises/) was not found next to the gpucourse "
                  "package nor in the current folder: pass --release exercises/", file=sys.stderr)
            return 2
        release = str(found)
    elif not Path(release).exists():
        print(f"gpucourse grade: release {release!r} not found (pass --release exercises/)", file=sys.stderr)
        return 2
    releases = load_releases(release)
    if not releases:
        print(f"gpucourse grade: no NN_*.ipynb release notebooks in {release!r}", file=sys.stderr)
        return 2
    if chapter is not None and chapter not in releases:
        print(f"gpucourse grade: --chapter {printable(chapter)}: the release has no such chapter "
              f"(chapters: {', '.join(releases)})", file=sys.stderr)
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
    # --chapter (or a release of one notebook): that chapter's notebooks only, the others left out
    subs, left_out = one_per_chapter(discover(paths), releases, only=expected)
    if not subs:
        what = f"notebooks of chapter {expected}" if left_out else "notebooks (*.ipynb)"
        print(f"gpucourse grade: no {what} in " + " ".join(map(printable, paths)), file=sys.stderr)
        return 2
    targets = [(p, kind) for p, kind in ((csv_path, "csv"), (json_path, "json"), (totals_path, "totals"))
               if p]
    why = _overwrite_problem(targets, [s.student for s in subs], update)
    if why:
        print(f"gpucourse grade: {why}", file=sys.stderr)
        return 2
    mode = isolation(options.use_bwrap)
    if mode != "bwrap" and options.use_bwrap and not allow_unisolated:
        from . import sandbox

        print(f"gpucourse grade: no sandbox: {sandbox.bwrap_problem or 'bwrap does not work here'}. Without "
              "one a submission could read the course's solutions or, as root, escape. Install bubblewrap "
              "(Debian/Ubuntu: apt-get install bubblewrap) where it can drop privileges, or pass --no-bwrap "
              "to grade trusted notebooks without hiding the answers.", file=sys.stderr)
        return 2
    line = describe(mode, options.limits)
    workers = workers or default_workers()
    seed = random.SystemRandom().randrange(1 << 62) if seed is None else int(seed)
    print(f"release: {Path(release).resolve()} (chapter{'s' if len(releases) > 1 else ''} "
          f"{', '.join(releases)})", flush=True)
    if left_out:
        why = f"--chapter {expected}" if chapter else f"the release is chapter {expected} only"
        names = [f"{s.student}/{s.path.name}" for s in left_out]
        print(f"left out {len(left_out)} notebook(s) of other chapters ({why}): {_names(names, 5)}", flush=True)
    print(f"grading {len(subs)} notebook(s) with {workers} worker(s); {line}", flush=True)
    print(f"check inputs drawn from seed {seed} (the same grades again: --seed {seed})", flush=True)
    judges = Judges(solutions, seed, private_network=mode == "bwrap")     # nothing listens on the host
    options.hide = [*options.hide, *(Path(p).resolve() for p in paths), *_answer_folders(solutions)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpucourse-grade-") as root:
        def one(sub):
            began = time.monotonic() - started
            try:
                g = grade_notebook(sub, releases, judges=judges, hidden=hidden, options=options, mode=mode,
                                   expected=expected, work_root=Path(root))
            except Exception as e:  # noqa: BLE001 - one odd notebook is a row, never a crash
                # worth 0 of its chapter's points, as any submission that could not be graded
                # (without the release: 0 of 0, and the chapter dropped out of the student's total)
                release = _release_by_name(sub, releases, expected) if sub.carries else None
                g = _bad(sub, "unreadable", f"could not be graded: {type(e).__name__}: {e}", release)
            for r in g.rows:
                r.note = cut(sub.note, ERROR_LIMIT)
            g.span = (round(began, 3), round(time.monotonic() - started, 3))
            if not quiet:
                _print_notebook(g)
            return g
        try:                                  # started here, so that close() always ends them
            judges.start((s.chapter for s in subs if s.chapter in releases and not s.problem), hidden=hidden)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                graded = list(pool.map(one, subs))
        finally:
            judges.close()
    rows = [r for g in graded for r in g.rows]
    print(f"\n{summary_table(rows)}")
    print(f"\n{len(subs)} notebook(s) in {time.monotonic() - started:.1f} s")
    if csv_path:
        _say_update(csv_path, write_csv(rows, csv_path, update=update))
    if json_path:
        notebooks = [
            {"student": cut(g.sub.student, NAME_LIMIT), "notebook": cut(g.sub.path, 2 * NAME_LIMIT),
             "status": g.status, "problem": cut(g.problem, ERROR_LIMIT), "note": cut(g.sub.note, ERROR_LIMIT),
             "wall_seconds": g.record.get("wall_seconds", 0.0), "span_seconds": list(g.span),
             "runs": g.record.get("runs", 0),
             "phases": g.record.get("phases", {}),
             "processes_killed_after": g.record.get("leftovers_killed", 0),
             "other_errors": _other_errors(g)} for g in graded]
        _say_update(json_path, write_json(rows, json_path, isolation=line, seed=seed, notebooks=notebooks,
                                          provenance=provenance(release), update=update))
    if totals_path:
        _say_update(totals_path, write_totals(rows, totals_path, update=update))
    if feedback:
        write_feedback(rows, feedback, fmt=feedback_format)
    written = [p for p in (csv_path, json_path, totals_path, feedback) if p]
    if written:
        print("gradebook written to " + ", ".join(written))
    if any(g.status not in ("graded", "ignored") for g in graded):
        return 2
    ok = all(r.points == r.max for r in rows)
    return 0 if ok else 1

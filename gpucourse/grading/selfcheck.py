"""``python -m gpucourse check NOTEBOOK...``: run notebooks in a fresh kernel, one row per exercise.

Learners run it on their own exercises notebook to self-check — from a terminal
(``make check NB=…`` or ``.venv/bin/python -m gpucourse check …``) or from a cell
(``gc.check_this_notebook()``). It is the instructor's grading engine (:mod:`.grade`) on one
notebook: a fresh kernel of *this* Python environment, in the notebook's own folder, a time limit
per cell and per notebook, the course's check cells restored from ``exercises/``, the judge
deciding each check from the values the kernel computed (so the verdict is the one the instructor
will see); with ``bwrap`` installed the kernel runs in the same sandbox as ``grade`` (no
``solutions/``, no network). Every cell runs even after an error, so one unfinished exercise does
not hide the others. Every check becomes a row: ✓, or ✗ with the first line of the judge's reason.
An error in any other cell is reported too.
Exit status: 0 when everything passes, 1 otherwise, 2 when a file is missing.

Where the course's ``solutions/`` are absent (an instructor kept them), the judge is a *public*
one (:mod:`.public`, :class:`PublicJudges`): the same checks, decided on the public cases shipped in
``exercises/public/`` — fixed inputs and the course's values for them — and the report says so.
The instructor's ``grade`` always draws new inputs with the course's solutions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .engine import _current_env_kernel_manager, steady_client_class
from .grade import Judges, Options, Submission, _answer_folders, choose_release, course_release, grade_notebook
from .exercises import check_hash, make_exercise_notebook
from .restore import NotANotebook, load_release, load_releases, parse_notebook
from .sandbox import isolation

__all__ = ["CheckResult", "run_notebook", "check_notebook", "format_results", "main", "check",
           "check_this_notebook"]


@dataclass
class CheckResult:
    """One row of the report: an exercise check, or another cell that raised."""

    label: str        # "04.2", or "cell 7" for a cell that is not a check
    title: str
    passed: bool
    error: str = ""   # first line of the error, "ExcType: message"
    public: str = ""  # the public cases file it was judged on ("": the course's solutions)
    hidden: str = ""  # the hidden checks' verdict with --hidden ("✓" / "✗"), else ""
    visible: bool | None = None   # the visible check alone (with --hidden; else ``passed``)
    seed: int | None = None       # the seed the check's inputs were drawn from (None: the public cases)
    unsolved: bool = False        # failed as "not implemented yet" (the judge's verdict): no seed to replay


class PublicJudges(Judges):
    """The judges of a self-check where ``solutions/`` is absent: per chapter, a public judge
    (``judge --public FILE --solutions RELEASE``) that takes the inputs and the course's values
    from the chapter's public cases file instead of running an answer. Everything else — the
    retries, the compare timeout, plan and build — is :class:`.grade.Judges`'."""

    #: a public judge runs no answer and starts no rank: its host need not import what ranks need
    warm_host = False

    def __init__(self, public: dict[str, tuple[Path, Path]], seed: int, *, private_network: bool = False):
        """``public``: chapter → (its public cases file, the folder of its release notebook)."""
        super().__init__(None, seed, private_network=private_network)
        self.public = public

    def _judge_source(self, chapter: str) -> dict:
        if chapter not in self.public:
            raise FileNotFoundError(
                f"neither the course's solutions nor its public cases for chapter {chapter} were found "
                f"(exercises/public/{chapter}_public_cases.json next to the course's package, the "
                "notebook or its release): nothing to compare with (pass --solutions solutions/)")
        public, release = self.public[chapter]
        return {"folder": release, "public": public, "warning": ""}


def _public_judges(sub: Submission, releases: dict, solutions: str | None, private_network: bool
                   ) -> PublicJudges | None:
    """Public judges for ``sub``'s chapter when the course's solutions are not here (with none, when
    its public cases are not here either: they say so), else ``None``."""
    from .harness import find_public_judge, find_solutions
    from .public import PUBLIC_SEED, load_public

    if solutions is not None:
        return None
    try:
        nb = parse_notebook(sub.data, sub.path.name)
    except NotANotebook:
        return None
    release, why = choose_release(nb, sub.path.name, releases, None)
    if release is None or why or find_solutions(release.chapter) is not None:
        return None
    found = find_public_judge(release.chapter, near=[release.path.parent, sub.path.resolve().parent])
    try:
        seed = load_public(found[0]).seed if found else PUBLIC_SEED
    except (OSError, ValueError) as e:
        print(f"warning: {e}", file=sys.stderr)
        found, seed = None, PUBLIC_SEED
    return PublicJudges({release.chapter: found} if found else {}, seed, private_network=private_network)


def run_notebook(path: str | Path, *, cell_timeout: float = 300, allow_errors: bool = True):
    """Execute a trusted notebook (a lesson, a solution) in a fresh kernel, cwd = its folder.

    This is the course authors' runner (``scripts/execute_notebooks.py``, the tests), not the
    grader: no checks restored, no guard. With ``allow_errors`` every cell runs even after an error
    (errors are stored as outputs); without it the first error raises ``CellExecutionError``.
    Returns the executed notebook (widget state included) and, if execution stopped early (a cell
    timed out, the kernel died), a message saying why.
    """
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    # Start from a blank slate: nbclient replaces only the cells it reaches, so after a timeout or
    # a dead kernel a stale count would make a check that never ran look passed.
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    # The kernel talks over Unix sockets in a private folder, not TCP: TCP ports are picked free,
    # closed and then bound by the kernel, and another process (a test's gloo store, a second
    # kernel) can take one in between. (What CI saw twice, a reply unread for 180 s and more, was
    # pyzmq missing a wake-up: see steady_channels.)
    sockets = tempfile.mkdtemp(prefix="gpucourse-kernel-")
    km = _current_env_kernel_manager()
    km.transport, km.ip = "ipc", os.path.join(sockets, "kernel")
    stack_file = os.path.join(sockets, "stack")

    class Client(steady_client_class()):
        async def async_start_new_kernel(self, **kwargs):
            await super().async_start_new_kernel(**kwargs)
            self.kernel_group = getattr(self.km.provisioner, "pgid", None)

        async def _async_handle_timeout(self, timeout, cell=None):
            # before the kernel goes: where is it stuck? (faulthandler, registered at its start)
            self.stuck_at = _kernel_stack(getattr(self.km.provisioner, "pid", None), stack_file)
            self.shutdown_kernel = "immediate"     # a busy kernel would not answer a shutdown request
            return await super()._async_handle_timeout(timeout, cell)

    client = Client(nb, km=km, timeout=cell_timeout, allow_errors=allow_errors, record_timing=False,
                    resources={"metadata": {"path": str(path.parent.resolve())}},
                    extra_arguments=[_DUMP_STACK_ON_SIGUSR1.format(path=stack_file)])
    client.stuck_at, client.kernel_group = "", None
    fatal = ""
    try:
        # The kernel ends with the run and its connection file goes (nbclient shuts down only a
        # kernel whose manager it made, unless told to) ...
        client.execute(cleanup_kc=True)
    except CellTimeoutError as e:
        fatal = f"a cell ran longer than {cell_timeout:g} s: {str(e).splitlines()[0]}"
        if client.stuck_at:
            fatal += f"\nthe kernel was at (most recent call last):\n{client.stuck_at}"
    except DeadKernelError as e:
        fatal = f"the kernel died: {str(e).splitlines()[0]}"
    finally:
        # ... and so does what its cells started: the kernel led its own process group
        # (jupyter_client starts it in a new session), which outlives it while a member lives
        if client.kernel_group and hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(client.kernel_group, signal.SIGKILL)
        shutil.rmtree(sockets, ignore_errors=True)
    return nb, fatal


#: an ipykernel option: on SIGUSR1 the kernel writes every thread's Python stack to ``path``
#: (no name is left in the learner's namespace)
_DUMP_STACK_ON_SIGUSR1 = ("--IPKernelApp.exec_lines=__import__('faulthandler').register("
                          "__import__('signal').SIGUSR1, file=open({path!r}, 'w'), all_threads=True)")


def _kernel_stack(pid: int | None, stack_file: str, wait: float = 2.0) -> str:
    """The main thread's Python stack of the kernel ``pid`` (SIGUSR1, faulthandler), or ``""``."""
    if not pid:
        return ""
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return ""
    deadline = time.monotonic() + wait
    text = ""
    while time.monotonic() < deadline:
        time.sleep(0.1)
        with contextlib.suppress(OSError):
            text = Path(stack_file).read_text(errors="replace")
        if "Current thread" in text and text.endswith("\n"):
            break
    # faulthandler prints each thread, most recent call first; keep the one running the cell (the
    # signal may land on any thread), oldest frame first
    blocks = [b for b in text.split("\n\n") if "(most recent call first)" in b]
    main = next((b for b in blocks if "interactiveshell.py" in b), blocks[0] if blocks else "")
    frames = [line.strip() for line in main.splitlines()[1:] if line.strip().startswith("File")][::-1]
    cell = [i for i, f in enumerate(frames) if f.endswith(" in run_code")]   # IPython runs the cell
    frames = frames[cell[-1] + 1:] if cell else frames
    return "\n".join(f"  {f}" for f in frames[-12:])


def _find_releases(path: Path, release: str | None, solutions: str | None = None) -> dict:
    """The release the notebook's checks are restored from: ``release``; else, per chapter, the first
    untouched one of: ``exercises/`` (or a folder of release notebooks) next to the notebook, above it
    or in the current folder; the course's own next to the package (:func:`.grade.course_release`) —
    so a notebook in a JupyterHub home or an nbgrader assignment, far from any checkout, is checked
    too; the course's ``solutions/``, stripped as ``make exercises`` strips them.

    *Untouched*: every check cell still has the content hash the release recorded for it, and the
    release is not the notebook being checked. A learner often works in a release notebook itself
    (``exercises/`` of a checkout, a copy in a folder of its own): a check cell they edited or
    deleted there must not become "the course's check"."""
    if release is not None:
        return load_releases(release)
    folders = []
    for folder in (path.resolve().parent, path.resolve().parent.parent, Path.cwd()):
        for candidate in (folder / "exercises", folder):
            if candidate.is_dir() and any(candidate.glob("[0-9][0-9]_*_exercises.ipynb")):
                folders.append(candidate.resolve())
    course = course_release()
    if course is not None:
        folders.append(course.resolve())

    def touched(r) -> bool:
        return r.path.resolve() == path.resolve() or bool(edited_checks(r))

    found: dict = {}
    for folder in dict.fromkeys(folders):
        try:
            releases = load_releases(folder)
        except Exception:  # noqa: BLE001 - an unreadable release: look further
            continue
        for chapter, r in releases.items():
            if chapter not in found or (touched(found[chapter]) and not touched(r)):
                found[chapter] = r
    for chapter, r in list(found.items()):
        if touched(r):
            found[chapter] = _release_from_solutions(chapter, solutions) or r
    return found


def edited_checks(release) -> list[str]:
    """The exercises whose check cell in ``release`` no longer has the content hash recorded for it."""
    return [i for i, c in release.checks.items() if c.hash != check_hash(c.source)]


def _release_from_solutions(chapter: str, solutions: str | None):
    """Chapter ``chapter``'s release as ``make exercises`` writes it, from the course's solutions/."""
    from .harness import find_solutions

    folder = Path(solutions) if solutions else find_solutions(chapter)
    sources = sorted(folder.glob(f"{chapter}_*.ipynb")) if folder and folder.is_dir() else []
    if not sources:
        return None
    try:
        return load_release(sources[0], nb=make_exercise_notebook(nbformat.read(sources[0], as_version=4),
                                                                  name=sources[0].name))
    except Exception:  # noqa: BLE001 - an unreadable solutions notebook: no release from it
        return None


class NoAnswerKey(RuntimeError):
    """``check --hidden`` where the course's ``solutions/`` (and so the hidden checks) is absent."""


def check_notebook(path: str | Path, *, cell_timeout: float = 300, notebook_timeout: float = 1800,
                   release: str | None = None, solutions: str | None = None,
                   seed: int | None = None, hidden: bool = False) -> list[CheckResult]:
    """Run ``path`` and return one :class:`CheckResult` per check cell (and per other failing cell).

    ``hidden``: run each exercise's hidden checks too, as ``grade --hidden`` does (they live in the
    course's ``solutions/``: without it, :class:`NoAnswerKey`)."""
    import random

    path = Path(path)
    sub = Submission(path.stem, path, path.read_bytes())
    releases = _find_releases(path, release, solutions)
    unrestorable = {} if release else {i: r.path for r in releases.values() for i in edited_checks(r)}
    options = Options(cell_timeout=cell_timeout, notebook_timeout=notebook_timeout)
    mode = isolation(True)
    options.hide = _answer_folders(solutions)
    judges = _public_judges(sub, releases, solutions, private_network=mode == "bwrap")
    public = ""
    if hidden and judges is not None:
        judges.close()
        raise NoAnswerKey("--hidden needs the course's solutions/ (the hidden checks live there), and there is "
                          "none here: your instructor keeps it; this check decides on the public cases only")
    if judges is not None and judges.public:
        (public_file, _), = judges.public.values()
        public = str(public_file)
        if seed is not None and seed != judges.seed:
            print(f"(--seed {seed} has no effect here: without the course's solutions only the public cases, "
                  f"seed {judges.seed}, can be checked)", flush=True)
    elif judges is None:
        judges = Judges(solutions, random.SystemRandom().randrange(1 << 62) if seed is None else seed,
                        private_network=mode == "bwrap")
    try:
        with tempfile.TemporaryDirectory(prefix="gpucourse-check-") as root:
            g = grade_notebook(sub, releases, judges=judges, hidden=hidden, options=options, mode=mode,
                               work_root=Path(root))
    finally:
        judges.close()
    results: list[CheckResult] = []
    for r in g.rows:
        if r.exercise == "-":
            title = "no check cells found (tagged 'check')" if g.status == "no checks" else "notebook"
            results.append(CheckResult("-", title, False, r.error if g.status != "no checks"
                                       else "nothing to grade"))
            continue
        if r.exercise in unrestorable:    # only an edited copy of its check cell is here: it cannot count
            results.append(CheckResult(
                r.exercise, r.title, False,
                f"the course's check did not run: its check cell in {unrestorable[r.exercise]} was edited, "
                "and no untouched copy of it is here (the course's exercises/ or solutions/) to restore it "
                "from; undo the edit (copy the cell from the course's release), or pass --release FOLDER"))
            continue
        note = {"edited": " (check cell was edited — restored)",
                "deleted": " (check cell was deleted — put back)"}.get(r.restored, "")
        results.append(CheckResult(r.exercise, r.title + note, r.visible == "✓" and r.hidden != "✗", r.error,
                                   public, r.hidden, r.visible == "✓", None if public else judges.seed,
                                   r.unsolved))
    if public and not release:   # a check the course ships, but the only release here lacks: deleted in it
        from .public import load_public

        with contextlib.suppress(OSError, ValueError):
            shown = {r.label for r in results}
            for slot_id, slot in load_public(public).slots.items():
                if slot_id not in shown:
                    results.append(CheckResult(
                        slot_id, slot.title, False,
                        "the course's check did not run: its check cell was deleted from the only release "
                        "notebook here, and no copy of it is here to put it back from; copy the cell from the "
                        "course's release, or pass --release FOLDER"))
    for where, error in g.others:
        results.append(CheckResult(f"cell {where}", "(not a check cell)", False, error))
    if g.problem and all(r.passed for r in results):
        results.append(CheckResult("-", "notebook", False, g.problem))
    return results


def format_results(name: str, results: list[CheckResult]) -> str:
    """The table printed for one notebook; its last line says what was decided on.

    Example::

        >>> print(format_results("00_setup_exercises.ipynb", [
        ...     CheckResult("00.1", "sum over ranks", True),
        ...     CheckResult("00.2", "mean of ranks", False, "00.2, case 3 of 9 — values differ", seed=7)]))
        00_setup_exercises.ipynb
          00.1  ✓  sum over ranks
          00.2  ✗  mean of ranks — 00.2, case 3 of 9 — values differ
          1 of 2 checks pass — the visible checks on fresh inputs; your instructor's grader also runs hidden checks (check --hidden runs them here)
          (inputs drawn from seed 7: the same inputs again with --seed 7)
        >>> print(format_results("00_setup_exercises.ipynb", [
        ...     CheckResult("00.1", "sum over ranks", True, hidden="✓"),
        ...     CheckResult("00.2", "mean of ranks", False, "hidden check of 00.2, case 3 of 40 — …", hidden="✗",
        ...                 visible=True)]))
        00_setup_exercises.ipynb
          00.1  ✓  hidden ✓  sum over ranks
          00.2  ✓  hidden ✗  mean of ranks — hidden check of 00.2, case 3 of 40 — …
          1 of 2 exercises pass their visible and hidden checks (as grade --hidden decides)
    """
    width = max(len(r.label) for r in results)
    with_hidden = any(r.hidden for r in results)
    lines = [name]
    for r in results:
        visible = "✓" if (r.passed if r.visible is None else r.visible) else "✗"
        hidden = f"  hidden {r.hidden or '·'}" if with_hidden else ""
        detail = f" — {r.error}" if r.error else ""
        lines.append(f"  {r.label:<{width}}  {visible}{hidden}  {r.title}{detail}")
    passed = sum(r.passed for r in results)
    public = next((r.public for r in results if r.public), "")
    if public:
        lines.append(f"  {passed} of {len(results)} checks pass on the public cases — your instructor's grader "
                     "draws new ones and runs hidden checks too")
        lines.append(f"  (no solutions/ here: each check was decided on the fixed inputs and the course's values "
                     f"in {public}, at most {_max_cases(public)} per check)")
    elif with_hidden:
        lines.append(f"  {passed} of {len(results)} exercises pass their visible and hidden checks "
                     "(as grade --hidden decides)")
    else:
        lines.append(f"  {passed} of {len(results)} checks pass — the visible checks on fresh inputs; your "
                     "instructor's grader also runs hidden checks (check --hidden runs them here)")
    # a failure the inputs can matter to (not an exercise left unsolved) names its seed, to replay it
    seed = next((r.seed for r in results if r.seed is not None and not r.passed and not r.unsolved), None)
    if seed is not None:
        lines.append(f"  (inputs drawn from seed {seed}: the same inputs again with --seed {seed})")
    return "\n".join(lines)


def _max_cases(public: str) -> int:
    from .public import MAX_CASES, load_public

    try:
        return load_public(public).max_cases
    except (OSError, ValueError):
        return MAX_CASES


def main(paths: list[str], *, cell_timeout: float = 300, notebook_timeout: float = 1800,
         release: str | None = None, solutions: str | None = None, seed: int | None = None,
         hidden: bool = False) -> int:
    """Check each notebook (folders are searched for ``*.ipynb``); 0 if all pass, 1 if not, 2 when it
    cannot (no such file; ``hidden`` without the course's solutions)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts))
        elif p.exists():
            files.append(p)
        else:
            print(f"{p}: no such file", file=sys.stderr)
            return 2
    if not files:
        print("no notebooks to check", file=sys.stderr)
        return 2
    if isolation(True) != "bwrap":
        print("(no bwrap here: this self-check runs your notebook unsandboxed — the instructor's grader "
              "does not; the verdicts are the same)", flush=True)
    all_ok = True
    summary = []
    for f in files:
        try:
            results = check_notebook(f, cell_timeout=cell_timeout, notebook_timeout=notebook_timeout,
                                     release=release, solutions=solutions, seed=seed, hidden=hidden)
        except NoAnswerKey as e:
            print(f"gpucourse check {f}: {e}", file=sys.stderr)
            return 2
        print(format_results(str(f), results), flush=True)
        ok = all(r.passed for r in results)
        all_ok &= ok
        summary.append((f, ok, sum(r.passed for r in results), len(results)))
    if len(files) > 1:
        print("\nsummary")
        for f, ok, p, n in summary:
            print(f"  {'✓' if ok else '✗'}  {p}/{n}  {f}")
    return 0 if all_ok else 1


class Verdict:
    """What :func:`check` returns: true when every check passed. In a notebook it shows nothing (the
    table printed above says it all: no stray ``False`` under it).

    Example::

        >>> v = Verdict(False)
        >>> bool(v), v == False, v
        (False, True, Verdict(passed=False))
    """

    def __init__(self, passed: bool):
        self.passed = bool(passed)

    def __bool__(self) -> bool:
        return self.passed

    def __eq__(self, other):
        return self.passed == other if isinstance(other, bool) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.passed)

    def __repr__(self) -> str:
        return f"Verdict(passed={self.passed})"

    def _ipython_display_(self) -> None:
        """Displayed as nothing (IPython calls this instead of showing an Out[] line)."""


def _in_a_graded_run() -> bool:
    """Whether this kernel is the grader's (or the judge's): the notebook is being checked already."""
    from .harness import _state

    return _state.get("mode") in ("graded", "judge")


def check(path: str | os.PathLike, *, cell_timeout: float = 300, hidden: bool = False) -> Verdict | None:
    """Check a saved notebook in a fresh kernel, from a notebook cell or a script; print the table.

    Runs ``python -m gpucourse check PATH`` with this interpreter (the course's ``.venv``), so it
    works without an activated environment. Returns True when every check passes. ``hidden=True``:
    the hidden checks too, as the instructor's ``grade --hidden`` (only where ``solutions/`` is).
    """
    if _in_a_graded_run():
        print("(gc.check … is skipped here: this notebook is being checked right now)")
        return None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {str(path)!r}; pass the path of your saved exercises "
                                "notebook, e.g. gc.check('exercises/04_distributed_data_parallel_exercises.ipynb')")
    print(f"checking {path} in a fresh kernel (the saved file: save with Ctrl+S first)…", flush=True)
    proc = subprocess.run([sys.executable, "-m", "gpucourse", "check", "--cell-timeout", str(cell_timeout),
                           *(["--hidden"] if hidden else []), str(path)], capture_output=True, text=True)
    print(proc.stdout.rstrip())
    if proc.returncode not in (0, 1):
        print(proc.stderr.rstrip(), file=sys.stderr)
    return Verdict(proc.returncode == 0)


def _this_notebook() -> Path:
    """The notebook the calling kernel belongs to (JupyterLab / Notebook / VS Code)."""
    ns = {}
    try:
        from IPython import get_ipython

        ns = get_ipython().user_ns if get_ipython() is not None else {}
    except ImportError:
        pass
    if ns.get("__vsc_ipynb_file__"):
        return Path(ns["__vsc_ipynb_file__"])
    session = os.environ.get("JPY_SESSION_NAME")          # set by jupyter_server for every kernel
    if session and session.endswith(".ipynb"):
        p = Path(session)
        if p.is_file():
            return p
        for root in (Path.cwd(), *Path.cwd().parents):
            if (root / session).is_file():
                return root / session
    raise RuntimeError("cannot tell which notebook this kernel belongs to; pass its path: "
                       "gc.check('exercises/NN_…_exercises.ipynb')")


def check_this_notebook(*, cell_timeout: float = 300, hidden: bool = False) -> Verdict | None:
    """Check the notebook this cell belongs to (its saved copy) in a fresh kernel; print the table.

    A cell calling it may stay in the notebook: when the notebook itself is being checked or graded,
    the call only says so (it is not graded as a cell of the notebook)."""
    if _in_a_graded_run():
        return check("", cell_timeout=cell_timeout)
    return check(_this_notebook(), cell_timeout=cell_timeout, hidden=hidden)

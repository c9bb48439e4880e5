"""``python -m gpucourse check NOTEBOOK...``: run notebooks in a fresh kernel, one row per exercise.

Learners run it on their own exercises notebook to self-check; instructors run it on a folder of
collected submissions. Each notebook is executed top to bottom in a new kernel of *this* Python
environment, in the notebook's own folder, with a time limit per cell; every cell runs even after an
error, so one unfinished exercise does not hide the others. Then every check cell (tagged
``check``) becomes a row: ✓, or ✗ with the first line of its error. An error in any other cell is
reported too — a solution cell with a syntax error is a failure even if no check noticed.
Exit status: 0 when everything passes, 1 otherwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .exercises import CHECK_HEADER, CHECK_TAG

__all__ = ["CheckResult", "run_notebook", "check_notebook", "format_results", "main"]


@dataclass
class CheckResult:
    """One row of the report: an exercise check, or another cell that raised."""

    label: str        # "04.2", or "cell 7" for a cell that is not a check
    title: str
    passed: bool
    error: str = ""   # first line of the error, "ExcType: message"


def _current_env_kernel_manager():
    """A kernel manager that starts ipykernel with *this* interpreter (like nbval --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


def run_notebook(path: str | Path, *, cell_timeout: float = 300, allow_errors: bool = True):
    """Execute a notebook in a fresh kernel (cwd = its folder).

    With ``allow_errors`` every cell runs even after an error (errors are stored as outputs).
    Returns the executed notebook and, if execution stopped early (a cell timed out, the kernel
    died), a message saying why.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    # Start from a blank slate: a shipped exercises notebook stores the solution run's check output
    # ("passed ✓", an execution count). nbclient replaces only the cells it reaches, so after a
    # timeout or a dead kernel a stale count would make a check that never ran look passed.
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    client = NotebookClient(nb, km=_current_env_kernel_manager(), timeout=cell_timeout,
                            allow_errors=allow_errors, record_timing=False,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    fatal = ""
    try:
        client.execute()
    except CellTimeoutError as e:
        fatal = f"a cell ran longer than {cell_timeout:g} s: {str(e).splitlines()[0]}"
    except DeadKernelError as e:
        fatal = f"the kernel died: {str(e).splitlines()[0]}"
    return nb, fatal


def _first_error(cell) -> str:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            value = (out.get("evalue") or "").strip().splitlines()
            return f"{out.get('ename')}: {value[0] if value else ''}".rstrip(": ")
    return ""


def check_notebook(path: str | Path, *, cell_timeout: float = 300) -> list[CheckResult]:
    """Run ``path`` and return one :class:`CheckResult` per check cell (and per other failing cell)."""
    nb, fatal = run_notebook(path, cell_timeout=cell_timeout)
    results: list[CheckResult] = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        error = _first_error(cell)
        executed = cell.get("execution_count") is not None or bool(cell.get("outputs"))
        if CHECK_TAG in cell.get("metadata", {}).get("tags", []):
            m = CHECK_HEADER.match(cell.source.splitlines()[0] if cell.source else "")
            label, title = (m["id"], m["title"].strip()) if m else (f"cell {index}", "check")
            if not error and not executed and fatal:
                error = "not run: " + fatal
            results.append(CheckResult(label, title, passed=not error, error=error))
        elif error:
            results.append(CheckResult(f"cell {index}", "(not a check cell)", False, error))
    if not any(r.label[0].isdigit() for r in results):
        results.append(CheckResult("-", "no check cells found (tagged 'check')", False,
                                   "nothing to grade"))
    if fatal and all(r.passed for r in results):
        results.append(CheckResult("-", "notebook", False, fatal))
    return results


def format_results(name: str, results: list[CheckResult]) -> str:
    """The table printed for one notebook.

    Example::

        >>> print(format_results("00_setup_exercises.ipynb", [
        ...     CheckResult("00.1", "sum over ranks", True),
        ...     CheckResult("00.2", "mean of ranks", False, "NotImplementedError: Exercise 00.2")]))
        00_setup_exercises.ipynb
          00.1  ✓  sum over ranks
          00.2  ✗  mean of ranks — NotImplementedError: Exercise 00.2
          1 of 2 checks pass
    """
    width = max(len(r.label) for r in results)
    lines = [name]
    for r in results:
        mark = "✓" if r.passed else "✗"
        detail = f" — {r.error}" if r.error else ""
        lines.append(f"  {r.label:<{width}}  {mark}  {r.title}{detail}")
    passed = sum(r.passed for r in results)
    lines.append(f"  {passed} of {len(results)} checks pass")
    return "\n".join(lines)


def main(paths: list[str], *, cell_timeout: float = 300) -> int:
    """Check each notebook (folders are searched for ``*.ipynb``); 0 if all pass, else 1."""
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
    all_ok = True
    summary = []
    for f in files:
        results = check_notebook(f, cell_timeout=cell_timeout)
        print(format_results(str(f), results), flush=True)
        ok = all(r.passed for r in results)
        all_ok &= ok
        summary.append((f, ok, sum(r.passed for r in results), len(results)))
    if len(files) > 1:
        print("\nsummary")
        for f, ok, p, n in summary:
            print(f"  {'✓' if ok else '✗'}  {p}/{n}  {f}")
    return 0 if all_ok else 1

"""Execute notebooks in place (fresh kernel of this environment, cwd = the notebook's folder).

Course authors run this (``make notebooks``) so that lessons and solutions are stored with fresh
outputs: learners open them with results already visible. Stops at the first error, except in cells
tagged ``raises-exception``.

    python scripts/execute_notebooks.py notebooks/02_data_parallel.ipynb [...]
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient.exceptions import CellExecutionError

from gpucourse.grading.check import run_notebook


def main(paths: list[str]) -> int:
    for path in map(Path, paths):
        start = time.perf_counter()
        try:
            nb, fatal = run_notebook(path, cell_timeout=900, allow_errors=False)
        except CellExecutionError as e:
            print(f"FAILED {path}:\n{e}", file=sys.stderr)
            return 1
        if fatal:
            print(f"FAILED {path}: {fatal}", file=sys.stderr)
            return 1
        nbformat.write(nb, path)
        print(f"executed {path} in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

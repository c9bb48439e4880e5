"""What the ranks printed, shown in the parent: grouped by rank, in rank order, stacks tidied.

Each rank writes its stdout, stderr and (when stopped for hanging) its Python stack to files in the
launch's temporary folder (see :mod:`~gpucourse.runtime.rank_process`); the parent reads them back.
"""

from __future__ import annotations

import os
import sys

__all__ = ["RankFiles", "print_grouped", "tidy_stack"]


class RankFiles:
    """The three files of one rank in ``folder``: ``rank{r}.out``, ``.err`` and ``.stack``."""

    def __init__(self, folder: str, rank: int):
        self.out, self.err, self.stack = (os.path.join(folder, f"rank{rank}.{kind}")
                                          for kind in ("out", "err", "stack"))

    @property
    def paths(self) -> tuple[str, str, str]:
        return self.out, self.err, self.stack

    def sizes(self) -> tuple[int, int]:
        """Bytes written so far to stdout and stderr (to ignore what comes after a decision)."""
        return _size(self.out), _size(self.err)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def read(path: str, limit: int | None = None) -> str:
    """The file's text (its first ``limit`` bytes), or ``""`` when it does not exist."""
    try:
        with open(path, "rb") as f:
            data = f.read() if limit is None else f.read(limit)
    except FileNotFoundError:
        return ""
    return data.decode("utf-8", errors="replace")


def print_grouped(outs: list[str], errs: list[str]) -> None:
    """Each rank's captured stdout (then stderr), lines prefixed ``[rank r]``, in rank order."""
    for rank, text in enumerate(outs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}")
    sys.stdout.flush()
    for rank, text in enumerate(errs):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}", file=sys.stderr)
    sys.stderr.flush()


def tidy_stack(text: str, machinery: str = os.path.join("gpucourse", "runtime", "rank_process.py")) -> str:
    """Keep the user's frames of a faulthandler dump (most recent call first).

    Everything from the rank's own body (``machinery``, by default ``rank_process.py``) down is
    machinery (multiprocessing's bootstrap and, for a forked child, the parent's frames it
    inherited), so it is dropped.
    """
    keep, skipping = [], False
    for line in text.splitlines():
        if line.startswith("Extension modules:"):
            continue
        is_frame = line.lstrip().startswith("File ")
        if is_frame and machinery in line:
            skipping = True
        if not is_frame:
            skipping = False
        if not skipping:
            keep.append(line)
    return "\n".join(keep).strip()

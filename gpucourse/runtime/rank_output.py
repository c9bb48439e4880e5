"""What the ranks printed, shown in the parent: grouped by rank, in rank order, stacks tidied.

Each rank writes its stdout, stderr and (when stopped for hanging) its Python stack to files in the
launch's temporary folder (see :mod:`~gpucourse.runtime.rank_process`); the parent reads them back.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys

__all__ = ["RankFiles", "abort_reason", "blocked_report", "blocked_summary", "hide_check_frames", "position",
           "print_grouped", "rank_died", "signal_name", "tidy_stack"]


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


# --- where blocked ranks are: one line a learner reads ------------------------------------------------

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')
_WRAPPERS = {"wrapper", "_wrapper", "inner", "decorated", "_fn", "fn"}
_POINT_TO_POINT = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


def _frames(stack: str) -> list[tuple[str, int, str]]:
    """``(path, line, function)`` of each frame of a faulthandler dump of the main thread,
    innermost first (the first thread listed is the one that was running: "Current thread")."""
    frames, seen_thread = [], False
    for line in stack.splitlines():
        if line.lstrip().startswith(("Current thread", "Thread ")):
            if seen_thread and frames:
                break
            seen_thread = True
            continue
        m = _FRAME.match(line)
        if m:
            frames.append((m["path"], int(m["line"]), m["func"]))
    return frames


def _is_users(path: str) -> bool:
    """A frame of the learner's code (a ``%%ranks`` cell, a notebook cell), not a library's or the course's."""
    if path.startswith("<ranks ") or path.startswith("<ipython-input"):
        return True
    if path.startswith("<"):
        return False
    norm = path.replace("\\", "/")
    if norm.startswith(("torch/", "numpy/", "IPython/", "ipykernel/")) or "/gpucourse/" in norm \
            or norm.startswith("gpucourse/"):
        return False
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}
    real = os.path.realpath(path)
    return not any(real.startswith(p + os.sep) for p in prefixes)


_check_files: set[str] = set()   # the running check's own code (its cell), besides "<ranks check N>"


@contextlib.contextmanager
def hide_check_frames(*functions):
    """While a check runs its cases: the files these functions were defined in (the check's cell)
    hold the check's code, not the learner's, so a rank blocked in the learner's ``dist.send``
    behind the check's recording wrapper is shown at the learner's line, not at the wrapper's
    ``return real(tensor, ...)``. The forked ranks inherit it, and the parent names the positions."""
    files = {code.co_filename for f in functions
             if (code := getattr(getattr(f, "__func__", f), "__code__", None)) is not None}
    added = files - _check_files
    _check_files.update(added)
    try:
        yield
    finally:
        _check_files.difference_update(added)


def _is_checks(path: str) -> bool:
    """A frame of the running check's own code: what it sends live ranks, or its cell's functions."""
    return path.startswith("<ranks check") or path in _check_files


def _where(path: str, line: int) -> str:
    import linecache

    source = linecache.getline(path, line).strip()
    if path.startswith("<ranks check"):
        place = f"line {line} of the check's code"
    elif path.startswith("<ranks "):
        place = f"line {line} of {path}"
    else:
        place = f"line {line}"
    return place + (f": `{source[:100]}`" if source else "")


def position(stack: str) -> tuple[str | None, str]:
    """``(operation, where)`` of one blocked rank: the ``torch.distributed`` call it waits in (None
    when none shows) and the learner's line that made it (``line 3 of <ranks cell 2>: `dist.send(t, 1)```)."""
    frames = _frames(stack)
    users = [i for i, f in enumerate(frames) if _is_users(f[0])]
    # past the check's own frames (a wrapper recording the learner's calls) to the learner's line
    user = next((i for i in users if not _is_checks(frames[i][0])), users[0] if users else None)
    inside = frames if user is None else frames[:user]
    op = None
    for path, _, func in reversed(inside):         # the call the learner's line made, past wrappers
        if "torch/distributed/" in path.replace("\\", "/") and func not in _WRAPPERS and not func.startswith("<"):
            op = func
            break
    if op is None and inside:
        course = [f for p, _, f in reversed(inside) if "gpucourse/" in p.replace("\\", "/") and f not in _WRAPPERS]
        op = course[0] if course else None
    where = ""
    if user is not None:
        path, line, func = frames[user]
        where = (f"{func}, " if func != "<module>" else "") + _where(path, line)
        if op is None:
            import linecache

            text = linecache.getline(path, line)
            if re.search(r"\.wait\(\s*\)", text):
                op = "wait"
    return op, where


def blocked_summary(stacks: dict[int, str], chosen: list[int]) -> str:
    """Where each blocked rank waits and, when the pattern is a known one, why — one sentence.

    Example::

        >>> s = 'Current thread (most recent call first):\\n  File "torch/distributed/distributed_c10d.py", line 3387 in send\\n'
        >>> blocked_summary({0: s, 1: s}, [0, 1])
        'rank 0 in send, rank 1 in send: both ranks send first, and each send waits for a recv the other rank never reaches'
        >>> busy = ('Current thread (most recent call first):\\n'
        ...         '  File "gpucourse/basics/workloads.py", line 85 in torch_work\\n'
        ...         '  File "gpucourse/basics/parallel.py", line 129 in _process_worker\\n')
        >>> print(blocked_summary({0: busy}, [0, 1]))    # doctest: +NORMALIZE_WHITESPACE
        rank 0 in torch_work: it was not inside a torch.distributed call: it was still running its own
        code (an endless loop, work too slow for the timeout, or a process stuck in a library)
    """
    positions, why = blocked_report(stacks, chosen)
    return positions + (f": {why}" if why else "")


def blocked_report(stacks: dict[int, str], chosen: list[int]) -> tuple[str, str]:
    """``(where each blocked rank waits, why)``; ``why`` is ``""`` when the pattern is not a known one."""
    if not stacks:
        return "", ""
    ops, parts, talking = {}, [], {}
    for r in sorted(stacks):
        op, where = position(stacks[r])
        frames = _frames(stacks[r])
        talking[r] = op == "wait" or any("torch/distributed/" in p.replace("\\", "/") for p, _, _ in frames)
        if not talking[r] and op is not None:
            # no message or collective on its stack: name the course function it runs in, not the
            # outermost one (parallel_map's worker, not the collective it is not)
            op = next((f for p, _, f in frames
                       if "gpucourse/" in p.replace("\\", "/") and f not in _WRAPPERS), op)
        ops[r] = op
        parts.append(f"rank {r} in {op or 'Python code'}" + (f" ({where})" if where else ""))
    if not any(talking.values()):
        one = len(stacks) == 1
        return ", ".join(parts), (
            f"{'it was not' if one else 'none of them was'} inside a torch.distributed call: "
            f"{'it was' if one else 'they were'} still running {'its' if one else 'their'} own code "
            "(an endless loop, work too slow for the timeout, or a process stuck in a library)")
    finished = [r for r in chosen if r not in stacks]
    kinds = {_POINT_TO_POINT.get(op or "", op) for op in ops.values()}
    why = ""
    late = sorted(stacks)
    every = ("both ranks" if len(late) == 2 and not finished else "every rank" if not finished
             else f"ranks {','.join(map(str, late))}")
    if kinds == {"send"}:
        why = (f"{every} send first, and each send waits for a recv the other rank never reaches"
               if len(late) > 1 else "its send waits for a recv that no rank posts")
    elif kinds == {"recv"}:
        why = (f"{every} receive first: each waits for a message no rank has sent"
               if len(late) > 1 else "it waits for a message that no rank sends")
    elif kinds == {"wait"}:
        why = "every blocked rank waits for a request whose peer never posted the matching send or recv"
    elif None not in kinds and not kinds & {"send", "recv", "wait"}:
        names = sorted(kinds)
        if finished:
            left = ", ".join(map(str, finished))
            why = (f"rank{'s' if len(finished) > 1 else ''} {left} finished without calling {names[0]}: "
                   "a collective waits until every rank calls it") if len(names) == 1 else ""
        elif len(names) > 1:
            why = (f"the ranks wait in different collectives ({', '.join(names)}): every rank must "
                   "call the same collectives in the same order")
    return ", ".join(parts), why


# --- why C++ aborted a rank: one clause a learner reads ------------------------------------------------

_WHAT = re.compile(r"^\s*what\(\):\s*(?P<what>.+)$", re.MULTILINE)
_THROWN = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
_ENFORCE = re.compile(r"^\[enforce fail at [^\]]*\]\s*")
_SIZES = re.compile(r"(?P<got>\d+) vs (?P<want>\d+)")
_COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
                "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                "barrier", "all_gather_object", "broadcast_object_list"}


def abort_reason(err: str) -> str:
    """Why C++ aborted a rank (``terminate called ... what(): ...`` on its stderr), in the
    learner's terms, or ``""`` when its stderr says nothing of the kind.

    gloo aborts the receiving rank when a message is larger than the buffer it lands in — a send
    and its recv, or the ranks' tensors in one collective, disagree on the size::

        >>> err = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\\n"
        ...        "  what():  [enforce fail at gloo/transport/tcp/pair.cc:464] op.preamble.length "
        ...        "<= op.nbytes. 96 vs 48. Received data size doesn't match expected size. Is there"
        ...        " a distributed collective mismatch in your code?\\n")
        >>> abort_reason(err)
        'in gloo: it received 96 bytes into a buffer of 48 — a message and the buffer it lands in disagree on size'
    """
    m = _WHAT.search(err)
    if m is None:
        return ""
    what = _ENFORCE.sub("", m["what"].strip())
    thrown = _THROWN.search(err)
    library = "gloo" if "gloo" in m["what"] or (thrown and "gloo" in thrown["type"]) else ""
    op, where = position(err)
    at = f"; it was in {op or 'Python code'}" + (f" ({where})" if where else "") if op or where else ""
    sizes = _SIZES.search(what)
    if "Received data size doesn't match" in what and sizes:
        got, want = sizes["got"], sizes["want"]
        if op in _POINT_TO_POINT or op == "wait":
            why = (f"it received {got} bytes into a recv buffer of {want} — a send and its recv "
                   "disagree on the tensor's size (a chunk index or a buffer's shape)")
        elif op in _COLLECTIVES:
            why = (f"its {op} received {got} bytes into a buffer of {want} — the ranks passed "
                   f"{op} tensors of different sizes (every rank's tensor must have the same shape)")
        else:
            why = (f"it received {got} bytes into a buffer of {want} — a message and the buffer "
                   "it lands in disagree on size")
        return f"in {library or 'C++'}: {why}{at}"
    what = re.sub(r"\s*Is there a distributed collective mismatch in your code\?$", "", what)
    if len(what) > 200:
        what = what[:197] + "..."
    kind = f"{thrown['type']}: " if thrown and not library else ""
    return f"in {library or 'C++'}: {kind}{what}{at}"


def exception_line(tb: str) -> str:
    r"""The ``ExcType: message`` of a formatted traceback's last exception, on one line: the first
    unindented line after the last ``Traceback`` header, with the indented lines that carry on its
    sentence. Not the last line: a CUDA error's message goes on for lines and ends in advice
    ("Compile with `TORCH_USE_CUDA_DSA` ..."), which alone says nothing; and torch writes some
    messages over two lines, the second indented ("but got <class 'list'> instead.").

    Example::

        >>> exception_line('Traceback (most recent call last):\n  File "<ranks cell 1>", line 1, in <module>\n'
        ...                '    dist.all_reduce([1])\nTypeError: Invalid function argument. Expected tensor\n'
        ...                "             but got <class 'list'> instead.\n")
        "TypeError: Invalid function argument. Expected tensor but got <class 'list'> instead."
        >>> exception_line('Traceback (most recent call last):\n  File "x.py", line 3, in f\n'
        ...                'RuntimeError: CUDA error: device-side assert triggered\n'
        ...                'Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n')
        'RuntimeError: CUDA error: device-side assert triggered'
    """
    lines = tb.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    rest = lines[starts[-1] + 1 if starts else 0:]
    for i, line in enumerate(rest):
        if line.strip() and not line[0].isspace():
            carried = []
            for more in rest[i + 1:]:
                if not more.strip() or not more[0].isspace():
                    break
                carried.append(" ".join(more.split()))
            return " ".join([line.rstrip(), *carried])
    return lines[-1] if lines else ""


def signal_name(code: int | None) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it).

    Example::

        >>> signal_name(-6), signal_name(3), signal_name(None)
        ('signal SIGABRT', 'exit code 3', 'an unknown status')
    """
    if code is None:
        return "an unknown status"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def rank_died(rank: int, code: int | None, reason: str = "") -> str:
    """The clause that names a rank that died: with :func:`abort_reason`'s ``reason`` when there is
    one, as launched and live ranks both say it.

    Example::

        >>> rank_died(1, -6, "in gloo: it received 96 bytes into a buffer of 48")
        'rank 1 died (SIGABRT) in gloo: it received 96 bytes into a buffer of 48'
        >>> rank_died(2, -9)
        'rank 2 died with signal SIGKILL'
    """
    if reason:
        return f"rank {rank} died ({signal_name(code).removeprefix('signal ')}) {reason}"
    return f"rank {rank} died with {signal_name(code)}"

"""Every process a rank started, found and stopped — also the ones that tried to get away.

Killing a rank's *process group* (``os.killpg``) misses what ``fn`` started in a new session
(``subprocess.Popen(..., start_new_session=True)``, a daemon that double-forks): those are in
another group, and when their parent dies the kernel hands them to ``init`` — alive after
``launch`` returned. Linux keeps them findable with a **child subreaper**
(``prctl(PR_SET_CHILD_SUBREAPER)``): an orphan is re-parented to its nearest subreaper ancestor
instead of to ``init``. So

1) every rank is a subreaper: while it lives, everything it started stays in its subtree;
2) the launching process is a subreaper while :func:`~gpucourse.launch` runs: orphans of a rank
   that died land with it (they carry ``GPUCOURSE_LAUNCH_ID`` in their environment, inherited from
   the rank, which tells them apart from the kernel's other children);
3) :func:`kill_trees` walks ``/proc`` from the ranks (and those orphans) down and kills every
   process it finds, again and again until none is left — a process forked in between is
   re-parented to a subreaper still in the tree and found by the next walk.

Elsewhere than Linux there is no subreaper and no ``/proc``: only process groups are killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

__all__ = ["become_subreaper", "launcher_subreaper", "descendants", "kill_trees", "kill_my_descendants"]

LAUNCH_ID_VARIABLE = "GPUCOURSE_LAUNCH_ID"
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_lock = threading.Lock()
_users = 0  # launches running in this process that need it to be a subreaper


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:  # pragma: no cover - exotic libc
        return None


def become_subreaper(on: bool = True) -> bool:
    """Make this process a child subreaper (Linux); ``False`` if the platform has none."""
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


@contextlib.contextmanager
def launcher_subreaper():
    """The calling process is a subreaper for the duration (then as it was before)."""
    global _users
    with _lock:
        if _users == 0:
            import ctypes

            prctl, was = _prctl(), ctypes.c_int(0)
            if prctl is not None:
                prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
            launcher_subreaper.was_on = bool(was.value)
            become_subreaper(True)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and not launcher_subreaper.was_on:
                become_subreaper(False)


launcher_subreaper.was_on = False


def _processes() -> dict[int, tuple[int, str]]:
    """``{pid: (parent pid, state letter)}`` of every process visible in ``/proc``."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()   # after "pid (comm) ": state, ppid, ...
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(pids, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """Every live (not zombie) process below ``pids``, children before grandchildren."""
    table = _processes() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, frontier = [], list(pids)
    while frontier:
        nxt = [c for p in frontier for c in children.get(p, ())]
        found += [c for c in nxt if table[c][1] != "Z"]
        frontier = nxt
    return found


def _adopted(launch_id: str, table: dict[int, tuple[int, str]], exclude) -> list[int]:
    """Children of this process that came from a rank of launch ``launch_id`` (orphans it adopted)."""
    me, mine = os.getpid(), []
    marker = f"{LAUNCH_ID_VARIABLE}={launch_id}".encode()
    for pid, (ppid, state) in table.items():
        if ppid != me or pid in exclude or state == "Z":
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    mine.append(pid)
        except OSError:
            continue
    return mine


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_trees(ranks: list[int], launch_id: str | None = None, *, seconds: float = 5.0) -> None:
    """SIGKILL the ranks, everything below them, and the orphans of ``launch_id`` this process adopted.

    Repeats until a walk of ``/proc`` finds nothing alive (or ``seconds`` pass), then reaps the
    adopted ones (this process is their parent now). The ranks themselves are left for their
    ``Process.join``.
    """
    for pid in ranks:   # the group first: works also where there is no /proc
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    adopted: set[int] = set()
    killed: set[int] = set()
    deadline = time.monotonic() + seconds
    while True:
        table = _processes()
        if launch_id is not None:
            adopted.update(_adopted(launch_id, table, set(ranks)))
        tree = descendants(ranks + sorted(adopted), table)
        alive = [p for p in [*ranks, *adopted, *tree] if p in table and table[p][1] != "Z"]
        if not alive or time.monotonic() > deadline:
            break
        for pid in alive:
            _kill(pid, signal.SIGKILL)
        killed.update(alive)
        time.sleep(0.01)
    # a process killed together with its parent is handed to us (the subreaper) as a zombie
    _reap((adopted | killed) - set(ranks), deadline)


def kill_my_descendants(seconds: float = 2.0) -> None:
    """Inside a rank (a subreaper) just before it exits: SIGKILL and reap everything it started."""
    me = os.getpid()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tree = descendants([me])
        if not tree:
            break
        for pid in tree:
            _kill(pid, signal.SIGKILL)
        _reap_any()
        time.sleep(0.005)
    _reap_any()


def _reap(pids, deadline: float) -> None:
    for pid in pids:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.005)


def reap_children() -> list[tuple[int, int]]:
    """``(pid, exit code)`` of every child of this process that has ended, reaped now (without
    waiting); the code is negative for a child a signal ended (``-9``: SIGKILL)."""
    found = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        found.append((pid, os.waitstatus_to_exitcode(status)))
    return found


def _reap_any() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass

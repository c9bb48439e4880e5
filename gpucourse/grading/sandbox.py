"""Isolation: every submission runs in its own copy, session, limits — and in ``bwrap`` when present.

::

    grader ──Popen(start_new_session, rlimits)──► [bwrap: only /usr, /etc, Python and the package, read-
                                                   only; private /tmp + work copy; no network; own pid
                                                   namespace; --die-with-parent]
                                                    └─► shepherd (PR_SET_CHILD_SUBREAPER)
                                                          └─► kernel ─► whatever the notebook starts
           ◄── result JSON on a private pipe ────────────┘

- Limits (``setrlimit`` in the shepherd before it starts the kernel, inherited by the kernel and everything it starts): CPU seconds,
  address space, open file size, no core files; processes (``RLIMIT_NPROC``) when not root.
- The shepherd is a child subreaper: every orphan — also one that called ``setsid`` or
  double-forked — is re-parented to it, and after the notebook it kills its descendants until none
  is left. Every process also carries a per-notebook token in its environment; the grader kills
  any process still carrying it (the shepherd itself may have been killed on the wall-time limit).
- With ``bwrap`` the pid namespace ends with the shepherd: nothing inside survives it.

.. warning::
   Without ``bwrap`` a submission can still read and write wherever the grader's user can (other
   students' *copies* are only ever written to private temporary folders, and every file is read
   before any notebook runs). Install ``bubblewrap`` for filesystem and network isolation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Limits", "descendants", "isolation", "kill_token", "run_job", "shepherd_main"]

PR_SET_CHILD_SUBREAPER = 36
_TOKEN = "GPUCOURSE_GRADE_TOKEN"
_GRADING_DIR = Path(__file__).resolve().parent
#: Imports a grading process never needs. nbformat's jsonschema would compile an IRI grammar (lark,
#: ~0.8 CPU s and 16 MB in every process that reads a notebook) for a string format that no notebook
#: schema uses; blocking it (jsonschema skips the "iri" checker on ImportError) makes every
#: shepherd start ~5x cheaper.
SKIP_IMPORTS = ("rfc3987_syntax",)
# The shepherd imports this folder as a stand-alone package: no torch in the shepherd process.
_BOOT = ("import importlib.util as u, sys; d=sys.argv[1]; "
         f"[sys.modules.setdefault(n, None) for n in {SKIP_IMPORTS!r}]; "
         "s=u.spec_from_file_location('gpucourse_grading', d + '/__init__.py', "
         "submodule_search_locations=[d]); m=u.module_from_spec(s); "
         "sys.modules['gpucourse_grading']=m; s.loader.exec_module(m); "
         "from gpucourse_grading.sandbox import shepherd_main; shepherd_main()")


@dataclass
class Limits:
    cpu_seconds: int = 600           # per process (RLIMIT_CPU)
    memory_bytes: int = 8 << 30      # address space per process (RLIMIT_AS)
    file_bytes: int = 256 << 20      # largest file a notebook may write (RLIMIT_FSIZE)
    processes: int = 512             # extra processes (RLIMIT_NPROC, not enforced for root)
    output_bytes: int = 1 << 20      # output kept per cell (truncated and marked beyond)


_bwrap_ok: bool | None = None


def isolation(use_bwrap: bool = True) -> str:
    """``"bwrap"`` when bubblewrap is installed and works here, else ``"limits"``."""
    global _bwrap_ok
    if not use_bwrap:
        return "limits"
    if _bwrap_ok is None:
        exe = shutil.which("bwrap")
        _bwrap_ok = bool(exe) and subprocess.run(
            [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net",
             "--unshare-pid", "--die-with-parent", "true"], capture_output=True).returncode == 0
    return "bwrap" if _bwrap_ok else "limits"


def describe(mode: str, limits: Limits) -> str:
    """One line saying which isolation is in force."""
    common = (f"CPU {limits.cpu_seconds} s/process, memory {limits.memory_bytes >> 20} MB/process, "
              f"files ≤ {limits.file_bytes >> 20} MB, output ≤ {limits.output_bytes >> 10} KB/cell, "
              "own session, process tree killed after each notebook")
    if mode == "bwrap":
        return ("isolation: bwrap (read-only system, Python and package only — no course files, no "
                f"solutions —, private /tmp and work copy, no network, own pid namespace) + {common}")
    return (f"isolation: limits only ({common}) — install bubblewrap for filesystem and network "
            "isolation")


def _rlimits(limits: dict, running: int) -> None:
    """Set the limits on this process (the shepherd); the kernel and its children inherit them."""
    for what, value in ((resource.RLIMIT_CPU, limits["cpu_seconds"]),
                        (resource.RLIMIT_AS, limits["memory_bytes"]),
                        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                        (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))
    if os.getuid() != 0:            # root is exempt from RLIMIT_NPROC; bwrap's pid namespace remains
        resource.setrlimit(resource.RLIMIT_NPROC, (running + limits["processes"],) * 2)


#: the system folders a kernel needs, read-only; nothing else of the machine is visible
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def visible_paths() -> list[Path]:
    """What a sandboxed kernel sees of the machine besides the system folders: Python, its
    environment, and the ``gpucourse`` package itself — not the course around it (no ``solutions/``,
    no ``.git``), not other users' or courses' files, not the other submissions."""
    package = _GRADING_DIR.parent
    paths = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
             Path(sys.executable).resolve().parent, package}
    return sorted((p for p in paths if p.exists()), key=lambda q: len(q.parts))


def _bwrap_argv(work: Path, hide: list[Path]) -> list[str]:
    argv = [shutil.which("bwrap") or "bwrap"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    shown = visible_paths()
    for path in shown:
        if not any(str(path) == d or str(path).startswith(d + "/") for d in SYSTEM_DIRS if not os.path.islink(d)):
            argv += ["--ro-bind", str(path), str(path)]
    for h in hide:                       # e.g. a solutions folder that lives inside the environment
        h = h.resolve()
        if h.exists() and any(s == h or s in h.parents for s in shown) and not any(
                h == s or h in s.parents for s in shown):
            argv += ["--tmpfs", str(h)]
    argv += ["--bind", str(work), str(work), "--chdir", str(work), "--unshare-net", "--unshare-pid",
             "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session"]
    return argv + ["--"]


def run_job(job: dict, *, work: Path, limits: Limits, mode: str, wall: float,
            hide: list[Path] = ()) -> dict:
    """Run one notebook job in a shepherd (in ``bwrap`` when ``mode == "bwrap"``); return its record.

    ``job`` holds the run notebook and engine options. Never raises for the notebook's sake: a
    killed or crashed shepherd gives a record with ``fatal`` set.
    """
    token = uuid.uuid4().hex
    home = work / ".home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, **{_TOKEN: token, "HOME": str(home), "JUPYTER_RUNTIME_DIR": str(home / "rt"),
                              "IPYTHONDIR": str(home / "ipython"), "MPLCONFIGDIR": str(home / "mpl"),
                              "JUPYTER_PLATFORM_DIRS": "1", "PYTHONDONTWRITEBYTECODE": "1",
                              "MPLBACKEND": "agg"})
    env.pop("JPY_SESSION_NAME", None)
    env.pop("GPUCOURSE_SOLUTIONS", None)          # the kernel never learns where the answers are
    # the kernel imports the very package this grader is (whatever an editable install points at)
    env["PYTHONPATH"] = str(_GRADING_DIR.parent.parent)
    read_fd, write_fd = os.pipe()
    env["GPUCOURSE_RESULT_FD"] = str(write_fd)
    argv = [sys.executable, "-c", _BOOT, str(_GRADING_DIR)]
    if mode == "bwrap":
        argv = _bwrap_argv(work, list(hide)) + argv
        env["TMPDIR"] = "/tmp"            # its own, empty (a TMPDIR from outside does not exist there)
    log = open(work / ".shepherd.log", "wb")
    started = time.monotonic()
    job = dict(job, limits=dataclasses.asdict(limits), spawned=time.time(),
               running=sum(1 for p in os.listdir("/proc") if p.isdigit()))
    # no preexec_fn (unsafe with the grader's worker threads): the shepherd limits itself first
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                            cwd=work, env=env, pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    chunks: list[bytes] = []

    def reader():
        while True:
            data = os.read(read_fd, 1 << 16)
            if not data:
                break
            if sum(map(len, chunks)) < (256 << 20):
                chunks.append(data)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    killed = ""
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout=wall)
    except subprocess.TimeoutExpired:
        killed = f"the notebook ran longer than its budget ({wall:g} s wall time, grader's limit)"
        _kill_group(proc, grace=3.0)
    t.join(timeout=10)
    os.close(read_fd)
    log.close()
    leftovers = kill_token(token)
    try:
        record = json.loads(b"".join(chunks).decode()) if chunks else None
    except ValueError:
        record = None
    if not isinstance(record, dict) or "cells" not in record:
        tail = (work / ".shepherd.log").read_bytes()[-600:].decode(errors="replace").strip().splitlines()
        why = killed or (f"the grading process ended with status {proc.returncode}"
                         + (f": {tail[-1]}" if tail else ""))
        record = {"cells": [], "values": {}, "fatal": why}
    record["leftovers_killed"] = record.get("leftovers_killed", 0) + leftovers
    record["wall_seconds"] = round(time.monotonic() - started, 3)
    return record


def _kill_group(proc, grace: float) -> None:
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _proc_table() -> dict[int, int]:
    """pid → parent pid of every process we can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            table[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return table


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, …)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, pp in table.items():
        children.setdefault(pp, []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_token(token: str) -> int:
    """SIGKILL every process whose environment carries this grading token; return how many."""
    needle = f"{_TOKEN}={token}".encode()
    count = 0
    for _ in range(20):
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
        if not found:
            break
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
                count += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return count


def _kill_descendants() -> int:
    """In the shepherd: kill and reap every descendant (orphans come to us, we are a subreaper)."""
    count = 0
    for _ in range(200):
        pids = descendants(os.getpid())
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                count += 1
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    time.sleep(0.01)
            except ChildProcessError:
                break
    return count


def shepherd_main() -> None:
    """Entry point of the per-notebook shepherd process (reads the job on stdin)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    fd = int(os.environ.pop("GPUCOURSE_RESULT_FD"))
    os.set_inheritable(fd, False)
    job = json.loads(sys.stdin.buffer.read())
    _rlimits(job["limits"], job["running"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    signal.signal(signal.SIGTERM, lambda *a: (_kill_descendants(), os._exit(3)))
    import nbformat

    from . import engine

    nb = nbformat.reads(job["notebook"], as_version=4)
    ready = time.time()
    record = engine.execute(nb, slots=job["slots"], cwd=job["cwd"], cell_timeout=job["cell_timeout"],
                            notebook_timeout=job["notebook_timeout"], output_limit=job["output_limit"],
                            env=dict(os.environ))
    record["leftovers_killed"] = _kill_descendants()
    record.setdefault("phases", {})["shepherd_start"] = round(ready - job["spawned"], 3)
    record["shepherd_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if job.get("want_notebook"):
        record["notebook"] = nbformat.writes(nb)
    data = json.dumps(record).encode()
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)

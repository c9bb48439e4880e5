"""Isolation: every submission runs in its own copy, session, limits — and in ``bwrap`` when present.

::

    grader ──Popen(start_new_session, rlimits)──► [bwrap: only /usr, /etc, Python and the package, read-
       │                                           only, nosuid, nodev; size-limited private /tmp and
       │                                           work copy (tmpfs); no network; own pid namespace;
       │                                           --die-with-parent]
       │                                            └─► shepherd (PR_SET_CHILD_SUBREAPER) drops to an
       │                                                unprivileged user, no capabilities, no way back
       │                                                  └─► kernel ─► whatever the notebook starts
       ├─ every 0.5 s: the memory of the whole tree (a notebook's total, not per process)
       ◄── result JSON on a private pipe ────────────┘

- Limits (``setrlimit`` in the shepherd before it starts the kernel, inherited by the kernel and everything it starts): CPU seconds,
  address space, open file size, open files, no core files; processes (``RLIMIT_NPROC``) when not root.
- The shepherd is a child subreaper: every orphan — also one that called ``setsid`` or
  double-forked — is re-parented to it, and after the notebook it kills its descendants until none
  is left. Every process also carries a per-notebook token in its environment; the grader kills
  any process still carrying it (the shepherd itself may have been killed on the wall-time limit).
- With ``bwrap`` the pid namespace ends with the shepherd: nothing inside survives it.
- **No privileges, whoever starts the grader.** Started by root, ``bwrap`` keeps nearly every
  capability for its child; the shepherd's first act is to drop to the unprivileged user ``nobody``
  (65534): no supplementary groups, an empty capability bounding set, ``no_new_privs`` — so neither the
  kernel nor anything it starts can mount, ``mknod``, ``chroot``, remount the package read-write or
  ``ptrace`` anything outside. Started by another user, ``bwrap`` runs in a user namespace of that user
  with every capability dropped and further user namespaces disabled. :func:`isolation` proves it
  before any notebook runs (a probe reads ``CapEff`` inside); if it cannot, ``grade`` refuses.
- **Totals.** Besides the per-process limits, a notebook's whole process tree may hold at most
  ``total_memory_bytes`` of memory, anonymous or shared (``RssAnon`` + ``RssShmem``; the grader
  measures it every 0.5 s and stops the notebook), and with ``bwrap`` its work copy and ``/tmp`` are
  tmpfs of ``disk_bytes`` each. Hitting a limit is named in the notebook's row. Memory that no
  process's resident set would show is refused outright by the shepherd's seccomp filter:
  ``memfd_create`` and ``memfd_secret`` fail with ENOSYS, SysV ``shmget`` and ``msgget`` with EPERM.

.. warning::
   Without ``bwrap`` a submission can still read and write wherever the grader's user can (other
   students' *copies* are only ever written to private temporary folders, and every file is read
   before any notebook runs). Install ``bubblewrap`` for filesystem and network isolation.
"""

from __future__ import annotations

import base64
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

from .graded_build import OVERLAYS

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
    open_files: int = 4096           # open files per process (RLIMIT_NOFILE; each pipe or socket holds memory)
    output_bytes: int = 1 << 20      # output kept per cell (truncated and marked beyond)
    total_memory_bytes: int = 6 << 30    # the whole process tree of one notebook (resident: anonymous, shared)
    disk_bytes: int = 512 << 20      # with bwrap: the work copy's tmpfs, and /tmp's, each


_bwrap_ok: bool | None = None
#: why bwrap is not used here (empty when it is): what ``grade`` prints when it refuses
bwrap_problem = ""
#: the unprivileged user a root-started sandbox runs its notebook as (``nobody`` on Linux)
SANDBOX_UID = SANDBOX_GID = 65534
_DROP_VARIABLE = "GPUCOURSE_SANDBOX_DROP"


def isolation(use_bwrap: bool = True) -> str:
    """``"bwrap"`` when bubblewrap is installed *and* a probe inside it runs with no capabilities
    as an unprivileged user; else ``"limits"`` (:data:`bwrap_problem` says why)."""
    global _bwrap_ok, bwrap_problem
    if not use_bwrap:
        return "limits"
    if _bwrap_ok is None:
        exe = shutil.which("bwrap")
        if not exe:
            _bwrap_ok, bwrap_problem = False, "bubblewrap (bwrap) is not installed"
        else:
            bwrap_problem = _probe()
            _bwrap_ok = not bwrap_problem
    return "bwrap" if _bwrap_ok else "limits"


def _probe() -> str:
    """Run a shepherd-like process in the sandbox; '' when it ends up unprivileged, else why not."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpucourse-probe-") as work:
        code = (_BOOT.replace("shepherd_main; shepherd_main()", "drop_privileges; drop_privileges()") + "; "
                "st=dict(l.split(':\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\t' in l); "
                "print(st['Uid'].split()[0], int(st['CapEff'], 16), int(st['CapBnd'], 16), st['NoNewPrivs'])")
        argv = _bwrap_argv(Path(work), [], limits=Limits()) + [sys.executable, "-c", code, str(_GRADING_DIR)]
        env = dict(os.environ, **_drop_env())
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap could not start a sandbox ({e})"
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return f"bwrap could not start an unprivileged sandbox here ({tail})"
    try:
        uid, cap_eff, cap_bnd, nnp = r.stdout.split()
    except ValueError:
        return f"the sandbox probe printed {r.stdout!r}"
    if uid == "0" or cap_eff != "0" or nnp != "1" or (os.getuid() == 0 and cap_bnd != "0"):
        return (f"the sandbox could not drop privileges (uid {uid}, CapEff {int(cap_eff):#x}, CapBnd "
                f"{int(cap_bnd):#x}, NoNewPrivs {nnp}): a notebook could escape it")
    return ""


def _drop_env() -> dict:
    """What tells the shepherd to drop to :data:`SANDBOX_UID` (only when the grader is root)."""
    return {_DROP_VARIABLE: f"{SANDBOX_UID}:{SANDBOX_GID}"} if os.getuid() == 0 else {}


PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24


def drop_privileges() -> None:
    """In the sandbox, before anything of the notebook's runs: become ``nobody`` with no capabilities.

    ``no_new_privs`` and the seccomp filter (:func:`_seccomp_filter`) always; the rest only when the
    grader asked for it (root started the sandbox; see :func:`_drop_env`). Order
    matters: groups and gid first (needs CAP_SETGID), then the bounding set (needs CAP_SETPCAP), then
    the uid — which clears the permitted and effective sets — and ``no_new_privs`` so that no
    set-uid file or file capability gives any of it back.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    spec = os.environ.pop(_DROP_VARIABLE, "")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    _seccomp_filter(libc)
    if not spec:
        return
    uid, gid = (int(x) for x in spec.split(":"))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() not in (0, 22):
            raise OSError(ctypes.get_errno(), f"could not drop capability {cap} from the bounding set")
    os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise OSError("still root after setresuid")
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)          # not even a process of the same user may ptrace it

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)())    # the inheritable set too: empty


PR_SET_DUMPABLE = 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
CLONE_NEWUSER = 0x10000000
#: per machine: its AUDIT_ARCH, and the numbers of the system calls the filter looks at
#: (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: include/uapi/asm-generic/unistd.h)
_SYSCALLS = {
    "x86_64": (0xC000003E, {"unshare": 272, "clone": 56, "clone3": 435, "memfd_create": 319,
                            "memfd_secret": 447, "shmget": 29, "msgget": 68}),
    "aarch64": (0xC00000B7, {"unshare": 97, "clone": 220, "clone3": 435, "memfd_create": 279,
                             "memfd_secret": 447, "shmget": 194, "msgget": 186}),
}
#: refused whatever their arguments, with this errno: ``clone3`` (its flags are out of the filter's
#: reach; glibc falls back to ``clone``) and every way to hold memory that no process's resident
#: set shows — a memfd's pages while nobody maps them, a SysV segment or message queue after it is
#: detached — so that a notebook cannot hoard beyond ``total_memory_bytes`` (ENOSYS for the memfds:
#: a library that uses one, asmjit say, takes that as an old kernel and falls back to a file)
_REFUSED = {"clone3": "ENOSYS", "memfd_create": "ENOSYS", "memfd_secret": "ENOSYS", "shmget": "EPERM",
            "msgget": "EPERM"}


def _seccomp_filter(libc) -> None:
    """A seccomp filter for the sandbox (installed after ``no_new_privs``, inherited by everything the
    notebook starts, never lifted): the calls of :data:`_REFUSED` fail; ``unshare``/``clone`` with
    ``CLONE_NEWUSER`` fail with EPERM. A new user namespace is the one way an unprivileged process
    gets capabilities back (over namespaces of its own); a root-started bwrap cannot disable them
    itself without mapping the sandbox to the host's root."""
    import ctypes
    import errno
    import platform

    arch = _SYSCALLS.get(platform.machine())
    if arch is None:
        return                                       # no filter for this machine: documented
    audit, number = arch

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06   # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, JSET, RET
    ALLOW, ERRNO = 0x7FFF0000, 0x00050000
    code = [
        # another ABI (i386's int 0x80 on x86_64, arm32 on aarch64), or x86_64's x32 numbers (bit 30):
        # refused, all of it — a 64-bit Python never uses them, and their numbers are not checked
        (LD, 0, 0, 4), (JEQ, 1, 0, audit), (RET, 0, 0, ERRNO | errno.ENOSYS),
        (LD, 0, 0, 0),                                                # the syscall number
        (JGE, 0, 1, 0x40000000), (RET, 0, 0, ERRNO | errno.ENOSYS),
    ]
    for call, err in _REFUSED.items():                                # refused, whatever the arguments
        code += [(JEQ, 0, 1, number[call]), (RET, 0, 0, ERRNO | getattr(errno, err))]
    code += [
        (JEQ, 1, 0, number["unshare"]), (JEQ, 0, 3, number["clone"]),
        (LD, 0, 0, 16),                                               # args[0], low 32 bits: flags
        (JSET, 0, 1, CLONE_NEWUSER), (RET, 0, 0, ERRNO | errno.EPERM),
        (RET, 0, 0, ALLOW),
    ]
    filters = (Filter * len(code))(*[Filter(*c) for c in code])
    prog = Program(len(code), filters)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "could not install the sandbox's seccomp filter")


def describe(mode: str, limits: Limits) -> str:
    """One line saying which isolation is in force."""
    common = (f"CPU {limits.cpu_seconds} s/process, memory {limits.memory_bytes >> 20} MB/process, "
              f"files ≤ {limits.file_bytes >> 20} MB, {limits.open_files} open files/process, "
              f"output ≤ {limits.output_bytes >> 10} KB/cell, "
              "own session, process tree killed after each notebook")
    common += f", memory {limits.total_memory_bytes >> 20} MB/notebook in all"
    if mode == "bwrap":
        return ("isolation: bwrap (read-only system, Python and package only — no course files, no "
                f"solutions —, private /tmp and work copy of {limits.disk_bytes >> 20} MB each, no network, "
                "own pid namespace, unprivileged user, no capabilities) + " + common)
    root = " — the kernel runs as root here" if os.getuid() == 0 else ""
    return (f"isolation: limits only ({common}){root} — install bubblewrap for filesystem and network "
            "isolation")


def _rlimits(limits: dict, running: int) -> None:
    """Set the limits on this process (the shepherd); the kernel and its children inherit them."""
    for what, value in ((resource.RLIMIT_CPU, limits["cpu_seconds"]),
                        (resource.RLIMIT_AS, limits["memory_bytes"]),
                        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                        (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    files = limits["open_files"] if hard == resource.RLIM_INFINITY else min(limits["open_files"], hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
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


_FEATURES: set[str] | None = None


def bwrap_features() -> set[str]:
    """Which of bwrap's newer options this bwrap has (``--perms`` 0.5, ``--size`` 0.7,
    ``--disable-userns`` 0.8): an older one still sandboxes, without what it lacks."""
    global _FEATURES
    if _FEATURES is None:
        exe = shutil.which("bwrap")
        try:
            text = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30).stdout if exe else ""
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        _FEATURES = {o for o in ("--perms", "--size", "--disable-userns") if o in text}
    return _FEATURES


def _tmpfs(path: str, size: str, mode: str = "1777") -> list[str]:
    """A tmpfs at ``path``: world-writable with the sticky bit (the unprivileged user writes there)
    and of ``size`` bytes, where this bwrap can say so."""
    have = bwrap_features()
    return (["--perms", mode] if "--perms" in have else []) + (["--size", size] if "--size" in have else []) + [
        "--tmpfs", path]


#: the sandbox's own, empty mounts (their mount points exist; what is below them does not)
_FRESH = ("/tmp", "/run", "/dev", "/proc")


def _parent_dirs(path: Path, mounted: list[str], made: set[str]) -> list[str]:
    """``--dir`` for each folder above ``path`` that bwrap would otherwise create root-only (0700):
    the unprivileged user inside must pass through them. Folders at or below a mount already made
    are left alone (they exist there; a read-only one cannot take a new folder)."""
    argv = []
    for parent in reversed(Path(path).parents):
        text = str(parent)
        if text in ("/", *_FRESH) or text in made or any(text == m or text.startswith(m + "/") for m in mounted):
            continue
        # below the sandbox's fresh /tmp the folder is as /tmp is (1777: a process that computes a
        # scratch folder from a TMPDIR below it may make one there); elsewhere only passable
        fresh = any(text.startswith(f + "/") for f in _FRESH)
        argv += (["--perms", "1777" if fresh else "0755"] if "--perms" in bwrap_features() else []) + [
            "--dir", text]
        made.add(text)
    return argv


def _bwrap_argv(work: Path, hide: list[Path], *, limits: Limits | None = None,
                package: Path | None = None) -> list[str]:
    """bwrap's arguments. ``package``: a graded build (:mod:`.graded_build`) to show, read-only, where
    the course's package is — the kernel then cannot reach the original at all."""
    limits = limits or Limits()
    argv = [shutil.which("bwrap") or "bwrap"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    # every mount bwrap makes (binds, tmpfs) is nosuid and nodev; /dev holds only the safe nodes
    size = str(limits.disk_bytes)
    argv += ["--dev", "/dev", "--proc", "/proc", *_tmpfs("/tmp", size), "--tmpfs", "/run"]
    shown = visible_paths()
    # binds of the host's folders: what is below them exists. Not the fresh mounts (_FRESH): a folder
    # below /tmp (a CI clone's venv, the work copy) must be made there, passable by the sandbox's user
    mounted = [d for d in SYSTEM_DIRS if not os.path.islink(d)]
    made: set[str] = set()
    for path in shown:
        if not any(str(path) == d or str(path).startswith(d + "/") for d in SYSTEM_DIRS if not os.path.islink(d)):
            source = package if package is not None and path == _GRADING_DIR.parent else path
            argv += _parent_dirs(path, mounted, made) + ["--ro-bind", str(source), str(path)]
            mounted.append(str(path))
    # a graded build's files that stand for the environment's (a libtorch_cpu.so whose forbidden
    # operators do nothing: .torch_ops), bound over them
    if package is not None and (package.parent / OVERLAYS).is_file():
        for source, target in json.loads((package.parent / OVERLAYS).read_text()):
            argv += ["--ro-bind", source, target]
    for h in hide:                       # e.g. a solutions folder that lives inside the environment
        h = h.resolve()
        if h.exists() and any(s == h or s in h.parents for s in shown) and not any(
                h == s or h in s.parents for s in shown):
            argv += ["--tmpfs", str(h)]
    # the work copy: a tmpfs of its own (what the notebook writes counts against disk_bytes, not the
    # host's disk); the shepherd writes the submission into it
    argv += _parent_dirs(work, mounted, made)
    # /dev (its /dev/shm) and /run read-only: a grader started by an ordinary user owns them inside,
    # and a tmpfs there has no size limit — memory no process shows (a root-started one has them
    # root-owned; the nodes /dev/null, /dev/zero, … still read and write)
    argv += ["--remount-ro", "/dev", "--remount-ro", "/run"]
    argv += [*_tmpfs(str(work), size), "--chdir", str(work),
             "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
             "--new-session"]
    if os.getuid() == 0:
        # root: no user namespace (its root would be the host's root); the shepherd keeps only what it
        # needs to become nobody, then drops that too (drop_privileges)
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                 "--cap-add", "CAP_SETPCAP"]
    else:
        # an ordinary user's bwrap runs in a user namespace anyway; where it can, it forbids more of them
        argv += ["--unshare-user", "--disable-userns"] if "--disable-userns" in bwrap_features() else []
    return argv + ["--"]


def run_job(job: dict, *, work: Path, limits: Limits, mode: str, wall: float,
            hide: list[Path] = (), files: dict[str, bytes] | None = None,
            package: Path | None = None) -> dict:
    """Run one notebook job in a shepherd (in ``bwrap`` when ``mode == "bwrap"``); return its record.

    ``job`` holds the run notebook and engine options; ``files`` (name → bytes) are written into the
    notebook's working folder by the shepherd. Never raises for the notebook's sake: a killed or
    crashed shepherd gives a record with ``fatal`` set.
    """
    token = uuid.uuid4().hex
    home = work / ".home"
    env = dict(os.environ, **{_TOKEN: token, "HOME": str(home), "JUPYTER_RUNTIME_DIR": str(home / "rt"),
                              "IPYTHONDIR": str(home / "ipython"), "MPLCONFIGDIR": str(home / "mpl"),
                              "JUPYTER_PLATFORM_DIRS": "1", "PYTHONDONTWRITEBYTECODE": "1",
                              "MPLBACKEND": "agg"})
    env.pop("JPY_SESSION_NAME", None)
    env.pop("GPUCOURSE_SOLUTIONS", None)          # the kernel never learns where the answers are
    env.pop(_DROP_VARIABLE, None)
    # scratch folders a torch of the grader's process chose (inductor writes its choice into the
    # environment): the kernel picks its own, in its own /tmp
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    # the kernel imports the very package this grader is (whatever an editable install points at)
    env["PYTHONPATH"] = str(_GRADING_DIR.parent.parent)
    read_fd, write_fd = os.pipe()
    env["GPUCOURSE_RESULT_FD"] = str(write_fd)
    argv = [sys.executable, "-c", _BOOT, str(_GRADING_DIR)]
    if mode == "bwrap":
        argv = _bwrap_argv(work, list(hide), limits=limits, package=package) + argv
        env["TMPDIR"] = "/tmp"            # its own, empty (a TMPDIR from outside does not exist there)
        env.update(_drop_env())
    log = open(work / ".shepherd.log", "wb")
    started = time.monotonic()
    job = dict(job, limits=dataclasses.asdict(limits), spawned=time.time(),
               running=sum(1 for p in os.listdir("/proc") if p.isdigit()),
               home=str(home), files={name: base64.b64encode(data).decode() for name, data in (files or {}).items()})
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
    deadline = started + wall
    peak = 0
    while True:
        try:
            proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline:
            killed = f"the notebook ran longer than its budget ({wall:g} s wall time, grader's limit)"
            _kill_group(proc, grace=3.0)
            break
        held = tree_memory(proc.pid)
        peak = max(peak, held)
        if held > limits.total_memory_bytes:
            killed = (f"memory limit: the notebook's processes held {held >> 20} MB together, more than the "
                      f"{limits.total_memory_bytes >> 20} MB a notebook may use; it was stopped there")
            _kill_group(proc, grace=0.5)
            break
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
    record["peak_memory_mb"] = peak >> 20
    if killed.startswith("memory"):
        record.setdefault("limits_hit", []).append(killed)
    return record


def tree_memory(pid: int) -> int:
    """Bytes of memory resident in ``pid``'s descendants that no file on disk backs (what a
    notebook's processes hold together): anonymous pages, and shared memory they map (``RssShmem``:
    ``mmap(-1, n)``'s ``MAP_SHARED`` pages, a tmpfs file mapped). Pages shared after a fork, or mapped
    by several processes, count once per process — an upper bound."""
    total = 0
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/status", "rb") as f:
                for line in f:
                    if line.startswith((b"RssAnon:", b"RssShmem:")):
                        total += int(line.split()[1]) << 10
        except (OSError, ValueError, IndexError):
            continue
    return total


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


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[0] == b"Z"
    except (OSError, ValueError, IndexError):
        return True                                     # gone: nothing left running either


def _kill_descendants(kernel: int | None = None) -> int:
    """In the shepherd: kill and reap every descendant (orphans come to us, we are a subreaper).

    Returns how many processes the notebook left running: each counted once (one that outlives a
    first SIGKILL for a moment — a large process takes time to exit — is killed again, not counted
    again), neither the ``kernel`` itself (its end is the notebook's end) nor a process that had
    already exited and was only waiting to be reaped (a zombie)."""
    left: set[int] = set()
    for _ in range(200):
        pids = descendants(os.getpid())
        if not pids:
            break
        for p in pids:
            alive = p != kernel and p not in left and not _is_zombie(p)
            try:
                os.kill(p, signal.SIGKILL)
                if alive:
                    left.add(p)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    time.sleep(0.01)
            except ChildProcessError:
                break
    return len(left)


def _disk_full(job: dict) -> str:
    """A note when the notebook filled its work folder or /tmp (the tmpfs of ``disk_bytes``), or
    wrote a file as large as it may (``file_bytes``)."""
    size = job["limits"]["disk_bytes"]
    for where, path in (("work folder", job["cwd"]), ("/tmp", "/tmp")):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_blocks * st.f_frsize <= size + (1 << 20) and st.f_bavail * st.f_frsize < (1 << 20):
            return f"disk limit: the notebook filled its {size >> 20} MB {where}"
    return ""


def shepherd_main() -> None:
    """Entry point of the per-notebook shepherd process (reads the job on stdin)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    drop_privileges()                     # first: nothing of the notebook runs with privileges
    fd = int(os.environ.pop("GPUCOURSE_RESULT_FD"))
    os.set_inheritable(fd, False)
    job = json.loads(sys.stdin.buffer.read())
    _rlimits(job["limits"], job["running"])
    os.makedirs(job["home"], exist_ok=True)
    for name, data in job.get("files", {}).items():          # the student's own copy, for relative paths
        with open(os.path.join(job["cwd"], os.path.basename(name)), "wb") as f:
            f.write(base64.b64decode(data))
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
    record["leftovers_killed"] = _kill_descendants(kernel=record.pop("kernel_pid", None))
    hit = _disk_full(job)
    if hit:
        record.setdefault("limits_hit", []).append(hit)
    record.setdefault("phases", {})["shepherd_start"] = round(ready - job["spawned"], 3)
    record["shepherd_maxrss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if job.get("want_notebook"):
        record["notebook"] = nbformat.writes(nb)
    data = json.dumps(record).encode()
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)

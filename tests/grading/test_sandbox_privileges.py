"""A graded kernel has no privileges, whoever starts the grader (issue 37, part 1).

Graders often run as root (a container, a CI job, a course VM). Inside a root-started bwrap the
kernel used to keep nearly every capability: a cell could mount a tmpfs, ``mknod`` the host's disk,
mount it and read ``solutions/`` — or remount the package read-write under every later judge. Here a
submission tries each of those escapes, and more, from a cell of its own; the cell reports what it
saw by raising, so the report comes back in the gradebook's ``other_errors``. Every attempt must fail,
``CapEff`` must read 0, and the blank notebook must score 0.
"""

from __future__ import annotations

import json
import os

import pytest

from _grading_helpers import tiny_submission
from gpucourse.grading import sandbox
from gpucourse.grading.grade import grade

pytestmark = pytest.mark.skipif(sandbox.isolation() != "bwrap",
                                reason="needs bwrap (Debian package bubblewrap) that can drop privileges")

ESCAPES = r'''
import ctypes, errno, json, os, stat, subprocess
import gpucourse
libc = ctypes.CDLL(None, use_errno=True)
package = os.path.dirname(gpucourse.__file__)
report = {}
def attempt(name, fn):
    try:
        out = fn()                            # True: the escape worked; anything else says why not
        report[name] = "ok" if out is True else f"failed: {out}"
    except Exception as e:
        report[name] = f"failed: {type(e).__name__}: {e}"[:120]
def syscall_rc(rc):
    return True if rc == 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def command(*argv):
    r = subprocess.run(argv, capture_output=True, text=True)
    return True if r.returncode == 0 else f"status {r.returncode}: {(r.stdout + r.stderr).strip()[-60:]}"
def call(fn, *args):
    fn(*args)
    return True
os.makedirs("/tmp/m", exist_ok=True)
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
report["uid"] = os.getuid()
report["CapEff"] = int(status["CapEff"], 16)
report["CapBnd"] = int(status["CapBnd"], 16)
report["Seccomp"] = status.get("Seccomp", "?")
attempt("mount_tmpfs", lambda: syscall_rc(libc.mount(b"x", b"/tmp/m", b"tmpfs", 0, None)))
attempt("mount_command", lambda: command("mount", "-t", "tmpfs", "x", "/tmp/m"))
attempt("mknod_disk", lambda: call(os.mknod, "/tmp/sda", stat.S_IFBLK | 0o600, os.makedev(8, 0)))
MS_REMOUNT, MS_BIND = 32, 4096
attempt("remount_package_rw", lambda: syscall_rc(libc.mount(None, package.encode(), None,
                                                            MS_REMOUNT | MS_BIND, None)))
attempt("write_package", lambda: call(lambda: open(os.path.join(package, "planted.py"), "w").write("x = 1")))
attempt("setuid_root", lambda: call(os.setuid, 0))
attempt("chroot", lambda: call(os.chroot, "/tmp"))
PTRACE_ATTACH = 16
attempt("ptrace_parent", lambda: syscall_rc(libc.ptrace(PTRACE_ATTACH, os.getppid(), None, None)))
attempt("ptrace_init", lambda: syscall_rc(libc.ptrace(PTRACE_ATTACH, 1, None, None)))
attempt("new_user_namespace", lambda: syscall_rc(libc.unshare(0x10000000)))
attempt("unshare_command", lambda: command("unshare", "-r", "mount", "-t", "tmpfs", "x", "/tmp/m"))
raise RuntimeError("REPORT" + json.dumps(report, separators=(",", ":")))
'''

ATTEMPTS = ["mount_tmpfs", "mount_command", "mknod_disk", "remount_package_rw", "write_package",
            "setuid_root", "chroot", "ptrace_parent", "ptrace_init", "new_user_namespace", "unshare_command"]


def test_every_escape_fails_and_the_kernel_has_no_capabilities(tiny_release, tmp_path):
    release, solutions = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "mallory", 'raise NotImplementedError("Exercise 99.1")', extra=[ESCAPES],
                    before=True)
    out = tmp_path / "g.json"
    grade([str(subs)], release=str(release), hidden_from=str(solutions), workers=1, json_path=str(out),
          quiet=True)
    data = json.loads(out.read_text())
    (notebook,) = data["notebooks"]
    text = next(e for e in notebook["other_errors"] if "REPORT" in e)
    report = json.loads(text[text.index("REPORT") + len("REPORT"):].split("\n")[0].rstrip("'\")"))
    assert report["CapEff"] == 0, report
    if os.getuid() == 0:
        assert report["uid"] == sandbox.SANDBOX_UID and report["CapBnd"] == 0, report
    succeeded = [name for name in ATTEMPTS if report[name] == "ok"]
    assert not succeeded, f"these escapes worked inside the sandbox: {succeeded} ({report})"
    assert [r["points"] for r in data["rows"]] == [0]
    assert not (solutions.parent / "planted.py").exists()


def _report(text: str) -> dict:
    return json.loads(text[text.index("REPORT") + len("REPORT"):].split("\n")[0].rstrip("'\")"))


def _assert_no_escape(report: dict) -> None:
    assert report["CapEff"] == 0, report
    if os.getuid() == 0:
        assert report["uid"] == sandbox.SANDBOX_UID and report["CapBnd"] == 0, report
    succeeded = [name for name in ATTEMPTS if report[name] == "ok"]
    assert not succeeded, f"these escapes worked inside the sandbox: {succeeded} ({report})"


@pytest.mark.slow
def test_no_escape_in_another_chapter_without_hidden_checks_nor_in_the_self_check(tmp_path):
    """The same escapes from a chapter-00 release notebook graded without --hidden, and from the
    learner's self-check (``check``), which runs in the same sandbox."""
    from pathlib import Path

    import nbformat
    from nbformat.v4 import new_code_cell

    from gpucourse.grading.selfcheck import check_notebook

    root = Path(__file__).resolve().parents[2]
    release = next((root / "exercises").glob("00_*.ipynb"))
    nb = nbformat.read(release, as_version=4)
    nb.cells.insert(2, new_code_cell(ESCAPES))
    (tmp_path / "subs" / "mallory").mkdir(parents=True)
    path = tmp_path / "subs" / "mallory" / release.name
    nbformat.write(nb, path)
    out = tmp_path / "g.json"
    grade([str(tmp_path / "subs")], release=str(root / "exercises"), workers=1, json_path=str(out), quiet=True)
    data = json.loads(out.read_text())
    _assert_no_escape(_report(next(e for e in data["notebooks"][0]["other_errors"] if "REPORT" in e)))
    assert all(r["points"] == 0 for r in data["rows"]), data["rows"]
    results = check_notebook(path, release=str(root / "exercises"))
    _assert_no_escape(_report(next(r.error for r in results if "REPORT" in r.error)))
    assert not any(r.passed for r in results)


@pytest.mark.skipif(os.getuid() != 0, reason="started by another user, bwrap is unprivileged anyway")
def test_the_grader_refuses_a_sandbox_that_keeps_privileges(tiny_release, tmp_path, monkeypatch, capsys):
    """If the probe finds the sandbox privileged (here: root's sandbox without the drop), grade
    refuses and says why rather than grading in a sandbox a notebook could leave."""
    release, solutions = tiny_release
    tiny_submission(tmp_path / "subs", "ann", "return x * x")
    monkeypatch.setattr(sandbox, "_bwrap_ok", None)
    monkeypatch.setattr(sandbox, "_drop_env", lambda: {})
    try:
        status = grade([str(tmp_path / "subs")], release=str(release), hidden_from=str(solutions), workers=1)
        err = capsys.readouterr().err
    finally:
        monkeypatch.setattr(sandbox, "_bwrap_ok", None)
    assert status == 2, err
    assert "could not drop privileges" in err and "CapEff" in err, err


HOARD = '''
import os, time
kids = []
for _ in range(3):                    # three processes, each well under the per-process limit
    pid = os.fork()
    if pid == 0:
        block = bytearray(200 << 20)  # touched: resident
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
time.sleep(30)
'''

MAPPED = '''
import mmap, time
hoard = mmap.mmap(-1, 600 << 20)      # MAP_SHARED: shared memory (RssShmem), not anonymous (RssAnon)
for i in range(0, len(hoard), 4096):
    hoard[i] = 1
time.sleep(30)
'''

FILL = '''
with open("/tmp/fill", "wb") as f:
    for _ in range(64):
        f.write(b"x" * (1 << 20))
'''


def test_a_notebook_is_held_to_its_totals_and_its_row_says_so(tiny_release, tmp_path):
    """Memory is bounded per notebook, not only per process (three 200 MB children against a 400 MB
    total; one process's 600 MB of shared memory mapped), and its /tmp is a tmpfs of disk_bytes (64 MB
    written into 16 MB); each row names the limit."""
    from gpucourse.grading.grade import Options
    from gpucourse.grading.sandbox import Limits

    release, solutions = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "hoarder", "return x * x", extra=[HOARD], before=True)
    tiny_submission(subs, "mapper", "return x * x", extra=[MAPPED], before=True)
    tiny_submission(subs, "filler", "return x * x", extra=[FILL], before=True)
    out = tmp_path / "g.json"
    limits = Limits(total_memory_bytes=400 << 20, disk_bytes=16 << 20)
    grade([str(subs)], release=str(release), hidden_from=str(solutions), workers=2, json_path=str(out),
          quiet=True, options=Options(cell_timeout=120, notebook_timeout=200, limits=limits))
    data = json.loads(out.read_text())
    rows = {r["student"]: r for r in data["rows"]}
    for student in ("hoarder", "mapper"):
        assert rows[student]["points"] == 0 and "memory limit" in rows[student]["error"], rows[student]
    notebook = {n["student"]: n for n in data["notebooks"]}
    assert "memory limit" in notebook["hoarder"]["problem"]
    assert "disk limit" in notebook["filler"]["problem"] or any(
        "No space left" in e for e in notebook["filler"]["other_errors"]), notebook["filler"]


UNSEEN = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
def why(rc):
    return "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
report = {}
try:
    fd = os.memfd_create("hoard")
    os.write(fd, b"x" * (1 << 20))         # a memfd's pages while unmapped are in nobody's RSS
    report["memfd_create"] = "ok"
except OSError as e:
    report["memfd_create"] = errno.errorcode.get(e.errno, str(e.errno))
report["memfd_secret"] = why(libc.syscall(447, 0))          # 447 on x86_64 and aarch64
report["shmget"] = why(libc.shmget(0, ctypes.c_size_t(1 << 20), 0o1600))   # SysV, detached: nobody's
report["msgget"] = why(libc.msgget(0, 0o1600))
import mmap, platform
if platform.machine() == "x86_64":          # i386's getpid through int 0x80: the filter must see it
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))        # mov eax, 20; int 0x80; ret
    got = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
    report["i386_abi"] = "ok" if got > 0 else errno.errorcode.get(-got, str(got))
import resource
report["open_files"] = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
raise RuntimeError("REPORT" + json.dumps(report, separators=(",", ":")))
'''


def test_memory_no_process_shows_cannot_be_held(tiny_release, tmp_path):
    """The notebook's total counts what its processes hold resident; a memfd (its pages unmapped), a
    SysV shared memory segment or message queue hold memory that no process shows. The sandbox's
    seccomp filter refuses all four calls (a red team's cell held 3 GB in memfds under a 2 GB total)."""
    release, solutions = tiny_release
    subs = tmp_path / "subs"
    tiny_submission(subs, "mallory", "return x * x", extra=[UNSEEN], before=True)
    out = tmp_path / "g.json"
    grade([str(subs)], release=str(release), hidden_from=str(solutions), workers=1, json_path=str(out),
          quiet=True)
    data = json.loads(out.read_text())
    report = _report(next(e for e in data["notebooks"][0]["other_errors"] if "REPORT" in e))
    assert report.pop("open_files") <= 4096, report                 # each pipe or socket holds memory too
    assert report.pop("i386_abi", "ENOSYS") == "ENOSYS", report     # nor through another ABI's numbers
    assert report == {"memfd_create": "ENOSYS", "memfd_secret": "ENOSYS", "shmget": "EPERM",
                      "msgget": "EPERM"}, report
    assert [r["points"] for r in data["rows"]] == [r["max"] for r in data["rows"]]    # the rest ran as ever

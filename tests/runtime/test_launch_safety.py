"""launch() is safe to run on a shared machine: loopback-only listeners, nothing left behind (not
even in another session, not after two Ctrl-C), and spawn + cloudpickle when CUDA may be in use.

Only public names are used here (plus monkeypatching torch in a child interpreter to force the
spawn path), so each test also runs against an older launcher and shows what it got wrong.
"""

import ipaddress
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

import gpucourse as gc

from _ctrl_c import interrupt_launch_script
from _processes import listeners_of as _listeners_of, wait_gone

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


# --- 8. listeners on loopback only -----------------------------------------------------------------

def _launch_family_listeners(rank, world_size, url=None):
    """Inside a running launch: the listeners of the launcher and of every rank."""
    if url is not None:
        gc.checked_init_process_group("gloo", url, rank=rank, world_size=world_size, join_timeout=20)
    dist.barrier()                         # every rank has joined: all servers are up
    out = None
    if rank == 0:
        parent = os.getppid()
        ranks = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == parent
                 and _comm(int(p)).startswith("gpucourse-rank")]
        out = (_listeners_of([parent, *ranks]), len(ranks))
    dist.barrier()
    if url is not None:
        dist.destroy_process_group()
    return out


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return None


@linux_only
def test_launch_store_and_gloo_listen_on_loopback_only():
    listeners, n_ranks = gc.launch(_launch_family_listeners, 2, timeout=60)[0]
    assert n_ranks == 2
    assert listeners, "found no listener at all: the test would prove nothing"
    public = [(a, p) for a, p in listeners if not ipaddress.ip_address(a).is_loopback]
    assert public == [], f"listening beyond loopback: {public}"


@linux_only
def test_checked_init_process_group_on_loopback_url_listens_on_loopback_only():
    url = f"tcp://127.0.0.1:{gc.free_port()}"
    listeners, _ = gc.launch(_launch_family_listeners, 2, args=(url,), init_process_group=False,
                             timeout=60)[0]
    port = int(url.rsplit(":", 1)[1])
    assert [a for a, p in listeners if p == port] == ["127.0.0.1"]   # rank 0's store: there, and only there
    public = [(a, p) for a, p in listeners if not ipaddress.ip_address(a).is_loopback]
    assert public == [], f"listening beyond loopback: {public}"


# --- 9. nothing left behind ----------------------------------------------------------------------

def _leave_processes(rank, world_size, folder, how):
    """Start a process that escapes the rank's process group, note its pid, then end as told."""
    if how == "double-fork":   # a daemon: the shell exits at once, its child is orphaned
        out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True,
                             text=True, start_new_session=True, check=True)
        pid = int(out.stdout)
    else:
        pid = subprocess.Popen(["sleep", "60"], start_new_session=True).pid
    (folder / f"{rank}.tmp").write_text(f"{os.getpid()} {pid}")
    os.replace(folder / f"{rank}.tmp", folder / f"{rank}.pid")
    if how == "die" and rank == 1:
        # not before rank 0 has started its escapee too: launch() stops rank 0 as soon as rank 1
        # dies, and on a loaded machine rank 0 could be stopped before it got that far
        deadline = time.monotonic() + 30
        while not (folder / "0.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)   # no chance to clean up after itself
    if how == "hang":
        time.sleep(60)
    return rank


@pytest.mark.parametrize("how", ["return", "double-fork", "die", "hang"])
def test_processes_in_a_new_session_do_not_outlive_launch(tmp_path, how):
    zombies_before = _zombie_children()
    if how == "return" or how == "double-fork":
        assert gc.launch(_leave_processes, 2, args=(tmp_path, how), init_process_group=False,
                         timeout=60) == [0, 1]
    else:
        with pytest.raises(gc.WorkerError if how == "die" else TimeoutError):
            gc.launch(_leave_processes, 2, args=(tmp_path, how), init_process_group=False,
                      timeout=60 if how == "die" else 4)
    pids = [int(p) for f in tmp_path.glob("*.pid") for p in f.read_text().split()]
    assert len(pids) == 4
    assert not wait_gone(pids, 3), f"survived launch(): {wait_gone(pids, 0)}"
    # what this process adopted and killed was also reaped: no zombie left in the kernel
    assert _zombie_children() - zombies_before == set()


def _zombie_children() -> set[int]:
    me = os.getpid()
    found = set()
    for p in os.listdir("/proc"):
        if p.isdigit() and _ppid(int(p)) == me and _state(int(p)) == "Z":
            found.add(int(p))
    return found


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_two_quick_interrupts_still_kill_ranks_that_ignore_sigterm(tmp_path):
    # the second Ctrl-C lands in the SIGTERM grace period of the clean-up the first one began
    out, err, _, survivors = interrupt_launch_script(tmp_path, [0.0, 0.15], ignore_sigterm=True)
    assert survivors == [], f"ranks {survivors} survived two Ctrl-C"
    assert "interrupted" in out, err


def test_a_ctrl_c_as_the_clean_up_begins_still_kills_ranks_that_ignore_sigterm(tmp_path):
    """Python acts on a pending signal when a function starts: a second Ctrl-C that lands as
    stop() begins is raised before stop's own guard. It used to escape the clean-up: the ranks
    (here deaf to SIGTERM) lived on, and the script hung at exit joining them."""
    out, err, took, survivors = interrupt_launch_script(tmp_path, [0.0], ignore_sigterm=True, wait=50, before="""
        real, calls = L.stop, []
        def stop(*a, **k):
            calls.append(1)
            if len(calls) == 1:                        # the second Ctrl-C, at stop's first line
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            return real(*a, **k)
        L.stop = stop
    """)
    assert took < 20, "the script waited at exit for ranks nobody stopped"
    assert "interrupted" in out, err
    assert survivors == [], f"ranks {survivors} outlived the interrupted launch"


# --- 10. spawn + cloudpickle, forced on CPU --------------------------------------------------------

_SPAWN_SCRIPT = """
import os, pathlib, sys, time
import torch, torch.distributed as dist
import gpucourse as gc
if sys.argv[1] != "fork":
    torch.cuda.is_initialized = lambda: True    # as if a lesson had used CUDA: fork is unsafe now
folder = pathlib.Path(sys.argv[2])

class Point:                                    # a class defined in __main__ (a notebook cell)
    def __init__(self, x):
        self.x = x

def summed(rank, world_size, scale):            # a function defined in __main__
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return Point(t.item() * scale), os.getpid()

def make_closure(offset):
    def closure(rank, world_size):
        return rank + offset
    return closure

def failing(rank, world_size):
    if rank == 1:
        raise KeyError("rank one lost its key")
    dist.barrier()

def hanging(rank, world_size):
    (folder / f"{sys.argv[1]}{rank}.pid").write_text(str(os.getpid()))
    time.sleep(60)

out = gc.launch(summed, 2, args=(10,))
print("points", [p.x for p, _ in out], all(isinstance(p, Point) for p, _ in out))
print("pids", *[pid for _, pid in out])
os.environ["GPUCOURSE_SEEN"] = "set-after-the-first-launch"   # after the fork server started
os.chdir(folder)
print("environ", gc.launch(lambda r, w: (os.environ.get("GPUCOURSE_SEEN"), os.getcwd() == str(folder.resolve())),
                           2, init_process_group=False))
print("closure", gc.launch(make_closure(100), 3, init_process_group=False))
print("lambda", gc.launch(lambda r, w: (r, w), 2))
try:
    gc.launch(failing, 2, timeout=60)
except gc.WorkerError as e:
    print("error", e.rank, e.exc_type, str(e).splitlines()[0])
try:
    gc.launch(hanging, 2, init_process_group=False, timeout=20)  # spawn: torch imports first
except TimeoutError as e:
    print("timeout", str(e).split(".")[0])
    print("where", "in hanging" in str(e))
"""


def _run_spawn_script(tmp_path, method):
    script = tmp_path / "notebook_like.py"
    script.write_text(_SPAWN_SCRIPT)   # no `if __name__ == "__main__":`, like a notebook
    env = dict(os.environ, GPUCOURSE_START_METHOD=method)
    out = subprocess.run([sys.executable, str(script), method, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    pids = [int(p) for p in lines.pop("pids").split()]
    pids += [int(f.read_text()) for f in tmp_path.glob(f"{method}*.pid")]
    return lines, pids


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_fork_server_and_spawn_with_cloudpickle_give_the_same_results_errors_and_cleanup_as_fork(
        tmp_path, method):
    forked, fork_pids = _run_spawn_script(tmp_path, "fork")
    spawned, spawn_pids = _run_spawn_script(tmp_path, method)
    assert forked == {
        "points": "[30.0, 30.0] True",
        "environ": "[('set-after-the-first-launch', True), ('set-after-the-first-launch', True)]",
        "closure": "[100, 101, 102]",
        "lambda": "[(0, 2), (1, 2)]",
        "error": "1 KeyError rank 1 raised KeyError: 'rank one lost its key'",
        "timeout": "launch(): rank(s) [0, 1] of 2 did not finish fn within 20 s",
        "where": "True",
    }
    assert spawned == forked
    assert len(spawn_pids) == 4 and not wait_gone(spawn_pids + fork_pids, 3)

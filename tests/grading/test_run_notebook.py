"""The authors' runner (``run_notebook``: ``make notebooks``, the tests) leaves nothing behind.

nbclient shuts down only a kernel whose manager it made itself; ``run_notebook`` passes its own
(Unix sockets), so the kernel used to live on until the calling process exited — ``make notebooks``
kept every lesson's kernel, a test worker dozens — and what a kernel started outlived it.
"""

import os
import time

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_notebook

from gpucourse.grading.selfcheck import run_notebook

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

SLEEPER = "[sys.executable, '-c', 'import time; time.sleep(600)']"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _still_alive(pids, seconds=10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("fails", [False, True], ids=["runs through", "stops at an error"])
def test_no_kernel_or_process_it_started_outlives_run_notebook(tmp_path, fails):
    """The kernel, a process a cell started, the connection file and the socket folder all go.
    (A process that leaves the kernel's session, a daemon, is not followed: nor is it by Jupyter.)"""
    pids = tmp_path / "pids"
    nb = new_notebook(cells=[
        new_code_cell("import json, os, subprocess, sys\n"
                      "from ipykernel import get_connection_file\n"
                      "sockets = os.path.dirname(json.load(open(get_connection_file()))['ip'])\n"
                      f"child = subprocess.Popen({SLEEPER})\n"
                      f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}} '\n"
                      "                                  f'{get_connection_file()} {sockets}')"),
        new_code_cell("raise RuntimeError('a lesson cell failed')" if fails else "x = 1"),
    ])
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    if fails:
        with pytest.raises(CellExecutionError, match="a lesson cell failed"):
            run_notebook(path, cell_timeout=60, allow_errors=False)
    else:
        _, fatal = run_notebook(path, cell_timeout=60, allow_errors=False)
        assert not fatal
    kernel, child, connection, sockets = pids.read_text().split()
    kernel, child = int(kernel), int(child)
    assert kernel != os.getpid()
    assert _still_alive([kernel]) == [], "the kernel outlived run_notebook"
    assert _still_alive([child]) == [], "a process the notebook started outlived run_notebook"
    assert os.path.basename(sockets).startswith("gpucourse-kernel-")
    assert not os.path.exists(connection), "the kernel's connection file was left behind"
    assert not os.path.exists(sockets), "the kernel's socket folder was left behind"


def test_a_judge_leaves_no_log_file_behind():
    """A check cell's judge writes its stderr to a file nobody names: it used to stay in /tmp."""
    from pathlib import Path

    from gpucourse.grading import harness

    solutions = Path(__file__).resolve().parents[2] / "solutions"
    judge = harness.JudgeProcess("00", solutions, local=True)
    try:
        assert not os.path.exists(judge.log.name)
        judge.log.write(b"Traceback (most recent call last):\nValueError: the last line\n")
        judge.log.flush()
        assert judge._tail() == "ValueError: the last line"     # still read, through the open file
        judge.proc.kill()
        judge.proc.wait()
        with pytest.raises(RuntimeError, match="has ended \\(ValueError: the last line\\)"):
            judge.request({"op": "hello"})
    finally:
        judge.close()
    assert judge.log.closed


def test_a_cell_that_runs_too_long_is_reported_with_where_the_kernel_was(tmp_path):
    pids = tmp_path / "pid"
    nb = new_notebook(cells=[new_code_cell(
        "import os, time\n"
        f"open({str(pids)!r}, 'w').write(str(os.getpid()))\n"
        "def waits_for_a_peer_that_never_comes():\n"
        "    time.sleep(600)\n"
        "waits_for_a_peer_that_never_comes()")])
    path = tmp_path / "stuck.ipynb"
    nbformat.write(nb, path)
    started = time.monotonic()
    _, fatal = run_notebook(path, cell_timeout=5, allow_errors=False)
    assert time.monotonic() - started < 60
    assert fatal.startswith("a cell ran longer than 5 s"), fatal
    where = fatal.split("the kernel was at (most recent call last):\n", 1)[1].splitlines()
    assert where[-1].endswith("line 4 in waits_for_a_peer_that_never_comes"), fatal
    assert where[-2].endswith("line 5 in <module>"), fatal
    assert len(where) == 2, "only the cell's own frames, not IPython's"
    assert _still_alive([int(pids.read_text())]) == [], "the stuck kernel outlived run_notebook"


class _MissesWakeUps:
    """A kernel channel whose wait misses the message's wake-up, as pyzmq's asyncio poll can: a
    message that arrives during a wait is seen only when that wait times out."""

    def __init__(self, arrives_after: float | None):
        self.arrives_at = None if arrives_after is None else time.monotonic() + arrives_after
        self.waits = []

    async def get_msg(self, timeout=None):
        import asyncio
        from queue import Empty

        self.waits.append(timeout)
        if timeout is None:
            await asyncio.sleep(3600)             # nothing would wake it
        await asyncio.sleep(timeout)
        if self.arrives_at is not None and time.monotonic() >= self.arrives_at:
            return {"msg_type": "execute_reply"}
        raise Empty


def test_steady_channels_see_a_message_whose_wake_up_was_missed():
    import asyncio
    from queue import Empty
    from types import SimpleNamespace

    from gpucourse.grading.engine import steady_channels

    kc = SimpleNamespace(shell_channel=_MissesWakeUps(0.1), iopub_channel=_MissesWakeUps(None))
    steady_channels(kc, slice_s=0.2)
    started = time.monotonic()
    assert asyncio.run(kc.shell_channel.get_msg(timeout=60))["msg_type"] == "execute_reply"
    assert time.monotonic() - started < 5, "waited for the whole timeout, as before"
    started = time.monotonic()
    with pytest.raises(Empty):                                        # the timeout still holds
        asyncio.run(kc.iopub_channel.get_msg(timeout=0.5))
    assert 0.45 < time.monotonic() - started < 5
    assert max(kc.iopub_channel.waits) <= 0.2
    kc = SimpleNamespace(shell_channel=_MissesWakeUps(0.3), iopub_channel=_MissesWakeUps(None))
    steady_channels(kc, slice_s=0.2)
    assert asyncio.run(kc.shell_channel.get_msg())["msg_type"] == "execute_reply"   # no timeout: still seen

"""Ctrl-C at a script that runs ``gc.launch``: the shared scaffold of the launcher's Ctrl-C tests."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _processes import communicate_or_report, wait_gone

_SCRIPT = """
import os, pathlib, signal, time
import gpucourse as gc
import gpucourse.runtime.launcher as L
{before}
def fn(rank, world_size):
    if {ignore_sigterm}:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)     # a rank that will not stop politely
    tmp = pathlib.Path({folder!r}, f"{{rank}}.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, tmp.with_suffix(".pid"))          # complete when it appears
    time.sleep(60)
try:
    gc.launch(fn, 2, init_process_group=False, timeout=60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def interrupt_launch_script(tmp_path, signals_at: list[float], *, ignore_sigterm: bool = False,
                            before: str = "", wait: float = 30):
    """Run a script that launches two ranks (deaf to SIGTERM if ``ignore_sigterm``), each sleeping
    in ``fn``; once both are there, send the script SIGINT at each of ``signals_at`` (seconds from
    the first). ``before`` is code run before the launch (to patch the launcher).

    Returns (stdout, stderr, seconds from the first signal to the script's end, the ranks still
    alive 5 s after it ended). Fails the test, with how the script stood with signals, if it has not
    ended ``wait`` s after the signal; no rank outlives the test, whatever the outcome."""
    script = tmp_path / "interrupted.py"
    script.write_text(_SCRIPT.format(before=textwrap.dedent(before), folder=str(tmp_path),
                                     ignore_sigterm=ignore_sigterm))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    try:
        if len(pids) < 2:
            proc.kill()
            pytest.fail(f"the ranks did not start fn within 120 s: {proc.communicate()}")
        started = time.monotonic()
        for at in signals_at:
            time.sleep(max(0.0, started + at - time.monotonic()))
            proc.send_signal(signal.SIGINT)
        out, err = communicate_or_report(proc, wait)
        took = time.monotonic() - started
        return out, err, took, wait_gone(pids, 5)      # before the clean-up below kills them
    finally:
        proc.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

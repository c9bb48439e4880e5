"""The test suite tests Ctrl-C even when it was started with SIGINT ignored.

``make test &`` in a script, ``nohup make test`` and CI runners that start their steps in the
background hand SIGINT down *ignored*; every process the tests start inherits that, Python installs
no KeyboardInterrupt handler, and each Ctrl-C test (a launch, live ranks, a kernel) waited out its
timeout and failed: 9 failures and 2 errors in a run of 2026-12-07. ``tests/conftest.py`` hears
SIGINT again in such a run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CTRL_C_TEST = "tests/runtime/test_launch.py::test_keyboard_interrupt_in_parent_kills_children"


def _sigint_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # in the child, before exec: the ignore is inherited


def test_a_run_started_with_sigint_ignored_still_tests_ctrl_c(tmp_path):
    # the premise: a process started this way ignores SIGINT, and so would a test's script
    ignored = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    probe = subprocess.run([sys.executable, "-c", ignored], preexec_fn=_sigint_ignored, capture_output=True,
                           text=True, timeout=60)
    assert probe.stdout.strip() == "True", probe
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "--basetemp",
                          str(tmp_path / "t"), CTRL_C_TEST], cwd=ROOT, preexec_fn=_sigint_ignored,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]

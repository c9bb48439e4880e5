"""Helpers for tests that check no process is left behind."""

import os
import time


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as dead (its /proc state is 'Z' on Linux)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds: float = 5.0) -> list[int]:
    """Wait up to ``seconds`` for every pid to end; return those still alive."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]

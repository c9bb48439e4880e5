"""Helpers for tests that check no process is left behind, and what processes listen on."""

import ipaddress
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


def _decode(hex_addr: str):
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} print the address as 32-bit words in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def listeners_of(pids) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket open in one of ``pids`` (Linux: reads /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:   # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    found.append((str(_decode(addr)), int(port, 16)))
    return found


def parent_of(pid: int):
    """The parent pid of ``pid`` (from /proc), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return None


def children_of(pid: int) -> list[int]:
    """The live (not zombie) children of ``pid``, from /proc."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_of(int(p)) == pid
            and alive(int(p))]


def comm(pid: int) -> str:
    """The process name (what ``ps -o comm`` shows), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _status(path: str) -> dict[str, str]:
    """The fields of a /proc ``status`` file, values stripped."""
    with open(path) as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f.read().splitlines() if ":" in line)}


def signal_report(pid: int) -> str:
    """How ``pid`` stands with signals, from /proc (for a test's failure message): per thread, its
    name and blocked/pending masks; for the process, the shared pending, ignored and caught masks.
    A Ctrl-C that did nothing shows here as SIGINT (bit 2, mask 0x2) blocked, ignored or pending."""
    lines = []
    try:
        fields = _status(f"/proc/{pid}/status")
        lines.append("process " + " ".join(f"{k}={fields[k]}" for k in ("ShdPnd", "SigIgn", "SigCgt")
                                            if k in fields))
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            t = _status(f"/proc/{pid}/task/{tid}/status")
            lines.append(f"  thread {tid} {t.get('Name', '?')}: SigBlk={t.get('SigBlk', '?')} "
                         f"SigPnd={t.get('SigPnd', '?')} State={t.get('State', '?')}")
    except OSError as e:
        lines.append(f"process {pid}: {e}")
    return "\n".join(lines)


def communicate_or_report(proc, timeout: float):
    """``proc.communicate(timeout)``; if it has not ended by then, kill it and fail the test with
    how it stood with signals (see :func:`signal_report`) and what it printed."""
    import subprocess

    import pytest

    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        report = signal_report(proc.pid)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script still ran {timeout:g} s after the signal\n{report}\n"
                    f"stdout: {(out or '')[-1500:]}\nstderr: {(err or '')[-1500:]}")
